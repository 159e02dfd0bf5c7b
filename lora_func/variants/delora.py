"""DeLoRA (Bini, Girrbach, Akata, ICLR 2025, arXiv 2503.18225), following HF peft's
``tuners/delora/layer.py`` exactly.

Trainable ``delora_A (r, d_in)``, ``delora_B (d_out, r)``, ``delora_lambda (1,)``; frozen
buffer ``delora_w_norm (d_in,)``, the column norms ``‖W[:, j]‖₂`` of the base weight at init.
With ``a_i = max(‖A[i, :]‖, 1e-4)``, ``b_i = max(‖B[:, i]‖, 1e-4)`` (norms not detached):

    W_eff = W + (lambda / r) · B diag(1 / (a_i b_i)) A diag(w_norm),   bias unchanged
    y     = x Wᵀ + b + (((x ⊙ w_norm) Aᵀ) ⊙ (lambda / r) / (a b)) Bᵀ

Init as peft: ``A ~ kaiming_uniform(a=√5)``, ``B = 0``, ``lambda = lambda0`` (15).
The per-rank scale (≈ 1e4 at init because of the clamp) and everything it multiplies are
computed in at least fp32, so a half-precision adapter dtype cannot overflow.
Unlike peft, GPT-2 ``Conv1D`` layers are supported (same math on the canonical view).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import (
    base_plus_low_rank,
    base_plus_product,
    half_product_applies,
    kaiming_uniform,
    promoted,
)
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, layer_rank, real

NORM_CLAMP = 1e-4  # peft's clamp on the per-rank norms of A and B


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The adapter dtype, raised to at least fp32 (fp64 stays fp64)."""
    return promoted(dtype, torch.float32)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, d_in, d_out = info.r, info.d_in, info.d_out
    delora_a = kaiming_uniform((r, d_in), a=math.sqrt(5), generator=generator)
    delora_b = torch.zeros((d_out, r), dtype=torch.float32)
    delora_lambda = torch.full((1,), float(info.option("lambda0")), dtype=torch.float32)
    w_norm = torch.linalg.vector_norm(weight.to(torch.float32), dim=0)  # (d_in,), fp32
    device = weight.device
    params = {
        "delora_A": delora_a.to(device, dtype),
        "delora_B": delora_b.to(device, dtype),
        "delora_lambda": delora_lambda.to(device, dtype),
    }
    return params, {"delora_w_norm": w_norm.to(device, dtype)}


def _rank_scale(params: TensorDict, r: int | Tensor) -> Tensor:
    """``(lambda / r) / (a_i b_i)``, shape ``(r,)``, in at least fp32."""
    ct = _compute_dtype(params["delora_A"].dtype)
    a_norm = torch.linalg.vector_norm(params["delora_A"].to(ct), dim=1).clamp(min=NORM_CLAMP)
    b_norm = torch.linalg.vector_norm(params["delora_B"].to(ct), dim=0).clamp(min=NORM_CLAMP)
    return (params["delora_lambda"].to(ct) / r) / (a_norm * b_norm)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    a, b = params["delora_A"], params["delora_B"]
    ct = _compute_dtype(a.dtype)
    scale = _rank_scale(params, layer_rank(info, buffers))
    delta = (b.to(ct) * scale) @ (a.to(ct) * buffers["delora_w_norm"].to(ct))
    return weight + delta.to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a, b = params["delora_A"], params["delora_B"]
    ct = _compute_dtype(a.dtype)
    # peft computes (x ⊙ w_norm) Aᵀ; x (A diag(w_norm))ᵀ is the same product with the column
    # scaling moved onto the (r, d_in) factor: no pass over (and no saved copy of) the inputs.
    # It runs in the adapter dtype; from the per-rank scale on (≈1e4 at init) in >= fp32.
    a_scaled = a * buffers["delora_w_norm"]
    rank_scale = _rank_scale(params, layer_rank(info, buffers))
    if half_product_applies(base, x, a_scaled.to(ct)):
        # bf16 base: the per-rank scale folded into the (d_out, r) factor, in >= fp32, and the
        # products on bf16 operands (base_plus_product; docs/dtype.md).
        return base_plus_product(base, x, a_scaled.to(ct), b.to(ct) * rank_scale)
    h = x.to(a.dtype) @ a_scaled.T
    h = h.to(ct) * rank_scale
    return base_plus_low_rank(base, x, h, b.to(ct))


VARIANT = Variant(
    name="delora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # the column norms travel as peft's delora_w_norm buffer
    tensors={
        "delora_A": Slot(lambda i: (i.r, i.d_in), rank_axes=(0,), peft="delora_A"),
        "delora_B": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,), peft="delora_B"),
        "delora_lambda": Slot(lambda i: (1,), peft="delora_lambda"),
        "delora_w_norm": Slot(lambda i: (i.d_in,), buffer=True, peft="delora_w_norm"),
    },
    options={"lambda0": Option(15.0, real(), "delora_lambda")},
    default_alpha=8.0,
)
# peft: DeloraConfig; peft refuses DeLoRA on GPT-2 Conv1D.
PEFT = PeftFormat(
    PeftMethod(
        "DELORA",
        {"bias": "none", "lambda_pattern": {}, "module_dropout": 0.0},
        rank=("r", "rank_pattern"),
        training_only={"module_dropout": "lora_func's DeLoRA has no module dropout"},
    ),
    conv1d=False,
)
