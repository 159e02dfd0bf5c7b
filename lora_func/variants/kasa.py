"""KaSA (knowledge-aware singular-value adaptation, Wang et al. 2024, arXiv 2412.06071) as peft's
``LoraConfig(kasa_config=KasaConfig(beta, gamma))``: LoRA in SVD form on top of the base weight with
its ``r`` smallest singular components dropped.

``U, S, Vh = svd(W)`` in fp32 (as peft, whatever the base dtype), ``k = min(d_in, d_out)``; frozen
buffer ``W_res = U[:, :k−r] diag(S[:k−r]) Vh[:k−r]`` (the rank-``k−r`` truncation, in the base
dtype); trainable ``lora_A (r, d_in)`` (kaiming-uniform, as LoRA), ``lora_B (d_out, r)`` (zeros)
and ``lora_diag (r,)`` (``N(0, 1)``: the learnable singular values ``ΔΣ``); ``W_eff = W_res + s·B
diag(ΔΣ) A``, ``s = alpha/r`` (``alpha/√r`` with ``use_rslora``), bias unchanged. ``r < k``.
At init ``W_eff = W_res``, not ``W``: KaSA starts from the truncated base.

The paper trains with two regularisers, ``beta·‖ΔΣ‖² + gamma·(‖BᵀB − I‖_F + ‖A Aᵀ − I‖_F)`` per
layer (peft's ``LoraModel._get_kasa_loss``): :func:`lora_func.kasa_penalty` is that sum as a pure
function of the adapter, with ``beta`` and ``gamma`` from the spec's options.

peft overwrites the base weight with the truncation; lora_func keeps the base untouched and
``W_res`` in the adapter (as for PiSSA). peft's checkpoint holds ``A``, ``B`` and ``ΔΣ`` only and
peft truncates the base again on load, so ``save_peft`` writes the adapter as it is and
``load_peft`` recomputes ``W_res`` from the base. peft has KaSA on ``nn.Linear`` only (it refuses
``fan_in_fan_out`` layers); lora_func's forms serve GPT-2 ``Conv1D`` too (the truncation of
``W (d_out, d_in)``), which ``save_peft`` refuses.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Option, Slot, TensorDict, lora, real
from lora_func.variants._kernels import base_plus_low_rank, kaiming_uniform, lora_scale, lowrank_input
from lora_func.variants.pissa import RESIDUAL, RESIDUAL_TRAITS


def truncated_base(weight: Tensor, r: int) -> Tensor:
    """peft's ``_truncate_base_weight``: ``W (d_out, d_in)`` without its ``r`` smallest singular
    components, the SVD and product in fp32, returned in ``W``'s dtype."""
    k = min(weight.shape)
    u, s, vh = torch.linalg.svd(weight.detach().to(torch.float32), full_matrices=False)
    return ((u[:, : k - r] * s[: k - r]) @ vh[: k - r]).to(weight.dtype)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, k = info.r, min(info.d_in, info.d_out)
    if isinstance(r, int) and r >= k:
        raise ValueError(  # error: kasa-rank
            f"kasa: r={r} must be smaller than min(d_in, d_out) = {k}: the base keeps its k - r largest singular "
            f"components and the adapter learns in the r dropped ones; lower r"
        )
    # peft's draws in its order: A as LoRA's, then the singular values.
    lora_a = kaiming_uniform((r, info.d_in), a=math.sqrt(5), generator=generator)
    lora_diag = torch.randn((r,), generator=generator, dtype=torch.float32)
    w_res = truncated_base(weight, r)
    res_dtype = torch.promote_types(weight.dtype, dtype)
    params = {
        "lora_A": lora_a.to(weight.device, dtype),
        "lora_B": torch.zeros((info.d_out, r), dtype=dtype, device=weight.device),
        "lora_diag": lora_diag.to(weight.device, dtype),
    }
    return params, {"W_res": w_res.to(weight.device, res_dtype).contiguous()}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    # ``weight`` is unused beyond its dtype: KaSA replaces the base by its truncation.
    w_res = buffers["W_res"].to(weight.dtype)
    return w_res + lora_scale(info, buffers) * ((params["lora_B"] * params["lora_diag"]) @ params["lora_A"]), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # peft's order: h = (dropout(x) Aᵀ) ⊙ ΔΣ, then s·h Bᵀ on the truncated base's output.
    w_res = buffers["W_res"].to(base.weight.dtype)
    lora_a = params["lora_A"]
    h = ((lowrank_input(x, base, info).to(lora_a.dtype) @ lora_a.T) * params["lora_diag"]) * lora_scale(info, buffers)
    return base_plus_low_rank(lambda x_: F.linear(x_, w_res, base.bias), x, h, params["lora_B"])


VARIANT = lora.derived(
    "kasa",
    init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors=lora.TENSORS | RESIDUAL | {"lora_diag": Slot(lambda i: (i.r,), rank_axes=(0,), peft="lora_diag")},
    # peft's KasaConfig: the weights of the singular-value and orthogonality penalties (kasa_penalty)
    options=lora.OPTIONS
    | {
        "beta": Option(1e-4, real(0, why="the weight of the singular-value penalty in kasa_penalty"), "kasa_config.beta"),
        "gamma": Option(1e-3, real(0, why="the weight of the orthogonality penalty in kasa_penalty"), "kasa_config.gamma"),
    },
    low_rank=None,
    traits=RESIDUAL_TRAITS,
)
# peft truncates the base again on load, and so does load_peft (W_res is not in the file).
PEFT = lora.stored_as_lora(reads={"use_dora": False, "init_lora_weights": lora.PLAIN_INITS, "kasa_config": bool}, conv1d=False)
