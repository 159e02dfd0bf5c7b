"""DoRA (Liu et al. 2024, arXiv 2402.09353): weight-decomposed LoRA.

Trainable ``lora_A (r, d_in)``, ``lora_B (d_out, r)`` (LoRA init: ``A ~ kaiming_uniform(a=√5)``,
``B = 0``; on an embedding peft's ``A = 0``, ``B ~ N(0, 1)``) and ``lora_magnitude_vector (d_out,)`` (peft's name; the paper's ``m``),
initialised to the row norms ``‖W[i, :]‖₂``.

``V = W + s·B A``; ``n = ‖W + s·(B A).detach()‖_row``, then detached (paper §4.3, as peft
and NVlabs); ``k = m / n``; ``W_eff = diag(k) V``, ``b_eff = b`` (the bias is not rescaled).
Activation form: ``y = k ⊙ t + (1 − k) ⊙ b`` with ``t = base(x) + s·(x Aᵀ) Bᵀ = x Vᵀ + b``.
Norms are computed in fp32 (at least), from the same operations at init and in both forms,
so ``k = 1`` exactly at init and the adapter is exactly the identity on any base dtype.

Conv layers (``nn.Conv1d/2d/3d``, peft's DoRA conv layers) through the merged kernel in the
``(out, in·K)`` view (peft's norm over every axis but the output channels is the row norm there),
the magnitude stored ``(1, out, 1, …)`` as peft does; an ``nn.Embedding`` as peft's DoRA embedding,
a gather (:func:`embedding_form`). Grouped convs are not adapted: peft's DoRA adds a dense
``(out, in, *kernel)`` update there, which the grouped layer cannot hold.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Slot, TensorDict, lora
from lora_func.variants._conv import chained, channel_vector, low_rank_kernels
from lora_func.variants._kernels import add_low_rank, kaiming_uniform, lora_scale, lowrank_input, promoted

MAGNITUDE = "lora_magnitude_vector"


def _row_norm(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float | Tensor) -> Tensor:
    """``‖W + s·(B A).detach()‖`` over ``d_in`` for each output, detached, in fp32 at least."""
    dtype = promoted(lora_a.dtype, torch.float32)
    delta = (lora_b.detach().to(dtype) @ lora_a.detach().to(dtype)) * scale
    return torch.linalg.norm(weight.to(dtype) + delta, dim=1).detach()


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
    if info.kind == "embedding":
        # peft's embedding init (an nn.Embedding's own): A = 0, B ~ N(0, 1)
        lora_a = torch.zeros((r, d_in), dtype=dtype, device=weight.device)
        lora_b = torch.randn((d_out, r), generator=generator, dtype=torch.float32).to(weight.device, dtype)
    else:
        lora_a = kaiming_uniform((r, d_in), a=math.sqrt(5), generator=generator).to(weight.device, dtype)
        lora_b = torch.zeros((d_out, r), dtype=dtype, device=weight.device)
    # The same function the forms call, so that m / n is exactly 1 at init.
    magnitude = _row_norm(weight, lora_a, lora_b, lora_scale(info))
    return {"lora_A": lora_a, "lora_B": lora_b, MAGNITUDE: magnitude.to(dtype)}, {}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    s = lora_scale(info, buffers)
    lora_a, lora_b, magnitude = params["lora_A"], params["lora_B"], params[MAGNITUDE]
    norm = _row_norm(weight, lora_a, lora_b, s)
    k = (magnitude / norm).to(weight.dtype)
    return k[:, None] * (weight + s * (lora_b @ lora_a)), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    s = lora_scale(info, buffers)
    lora_a, lora_b, magnitude = params["lora_A"], params["lora_B"], params[MAGNITUDE]
    y = base(x)
    # The dense W is needed every step for the norm (DoRA's inherent cost).
    norm = _row_norm(base.weight, lora_a, lora_b, s)
    k = (magnitude / norm).to(lora_a.dtype)
    dropped = lowrank_input(x, base, info)
    if dropped is not x:
        # peft's DoRA with dropout in training: y = base(x) + (k − 1)·W x_d + k·s·B A x_d, the
        # magnitude rescaling applied to the dropped input's base product (bias excluded).
        w_xd = base(dropped).to(lora_a.dtype)
        if base.bias is not None:
            w_xd = w_xd - base.bias.to(lora_a.dtype)
        lowrank = ((dropped.to(lora_a.dtype) @ lora_a.T) * s) @ lora_b.T
        return (y.to(lora_a.dtype) + (k - 1) * w_xd + k * lowrank).to(y.dtype)
    # t = x Vᵀ + b = base(x) + s·(x Aᵀ) Bᵀ; y_eff = k ⊙ (t − b) + b = k ⊙ t + (1 − k) ⊙ b: the
    # bias is not rescaled. Two passes over the outputs (addmm, addcmul) instead of peft's six;
    # at init (B = 0, k = 1) every step is exact, so the adapter is exactly the identity.
    t = add_low_rank(y.to(lora_a.dtype), (x.to(lora_a.dtype) @ lora_a.T) * s, lora_b)
    if base.bias is None:
        return (t * k).to(y.dtype)
    return torch.addcmul((1 - k) * base.bias.to(t.dtype), t, k).to(y.dtype)


def embedding_form(params: TensorDict, buffers: TensorDict, ids: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """DoRA on an ``nn.Embedding`` (peft's ``DoraEmbeddingLayer``): ``ids (...) -> k ⊙ (base(ids) +
    s·A[:, ids]ᵀ Bᵀ) (..., d)``, ``k = m / ‖W + s·(B A).detach()‖_row`` detached, the rows of ``A``
    looked up with the layer's own lookup (its padding index keeps that column's gradient zero, as
    peft's), no dropout (peft applies none to embeddings)."""
    s = lora_scale(info, buffers)
    lora_a, lora_b, magnitude = params["lora_A"], params["lora_B"], params[MAGNITUDE]
    norm = _row_norm(base.weight, lora_a, lora_b, s)
    k = (magnitude / norm).to(lora_a.dtype)
    y = base(ids)
    replay = cast(Any, base).replay  # an embedding's BaseLayer has one
    h = replay(ids, lora_a.transpose(0, 1)) * s
    return (add_low_rank(y.to(lora_a.dtype), h, lora_b) * k).to(y.dtype)


# peft: LoraConfig(use_dora=True), plus lora_magnitude_vector (d_out,) (".weight" in older peft).
VARIANT = lora.derived(
    "dora",
    init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors=lora.TENSORS | {MAGNITUDE: Slot(lambda i: (i.d_out,), peft=MAGNITUDE)},
    low_rank=None,
    kind_forms={"linear": None, "conv1d": None, "conv": None, "embedding": embedding_form},
)
PEFT = dataclasses.replace(
    lora.stored_as_lora(
        reads={"use_dora": True, "init_lora_weights": lora.PLAIN_INITS, "kasa_config": lambda v: not v},
        writes={"use_dora": True},
        imported={f"{MAGNITUDE}.weight": MAGNITUDE},
    ),
    # LoRA's conv tensors; the magnitude (1, out, 1, ...) on a conv
    reshape=chained(channel_vector(MAGNITUDE, axis=None), low_rank_kernels("lora_A", "lora_B")),
)
