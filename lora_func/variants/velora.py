"""VeLoRA (Miles et al. 2024, arXiv 2405.17991) as peft's ``LoraConfig(velora_config=VeloraConfig(...))``:
LoRA whose backward keeps a compressed copy of the input instead of the input itself.

The forward is LoRA's (``W_eff = W + s·B A``, ``A (r, d_in)``, ``B (d_out, r)``, LoRA's init). In
a training step (``base.training`` and grad enabled, as peft's ``module.training and
torch.is_grad_enabled()``) on the lazy or module-call route (``lora_func.overlay`` with
``training=True``), ``x A ᵀ`` saves for backward only
``c = ⟨x_g, e⟩`` per token and group: ``x (n, d_in)`` zero-padded and split into ``num_groups``
sub-tokens ``x_g`` of ``⌈d_in / num_groups⌉`` features, projected on one unit vector ``e``. ``A``'s
gradient is peft's: ``gᵀ x̃`` with the reconstruction ``x̃ = scale · (c ⊗ e)[:, :d_in]``; the input
gradient is exact (``g A``). ``e``: ``init_type="batch_average"``, the normalised mean sub-token of
the step's (dropped-out) input, recomputed every step; ``"random"``, a normalised ``N(0, 1)`` draw
at init (the ``velora_embed`` buffer); ``"batch_average_once"``, the buffer once it is set (peft
sets it from the first training batch), the step's average while it is zero. peft normalises
``e`` in fp32.

Differences from peft: the forms cannot write state, so ``batch_average_once`` keeps using the
step's average until ``velora_embed`` holds one (``lora_func.variants.velora.batch_embed`` of the
first batch's layer inputs, then ``adapter.with_buffers``); a loaded checkpoint keeps its saved
``e`` (peft recomputes it on the first step after a reload). Under ``vmap`` (per-example
gradients) the "batch" is one example. The merged path differentiates ``W_eff`` exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Option, Slot, TensorDict, lora, one_of, real, whole
from lora_func.variants._kernels import base_plus_low_rank, lora_activation_form, lora_scale, lowrank_input

EMBED = "velora_embed"


def group_dim(d_in: int, num_groups: int) -> int:
    return -(-d_in // num_groups)


def _subtokens(x: Tensor, num_groups: int) -> Tensor:
    """``x (..., d_in)`` zero-padded to ``num_groups`` groups: ``(n, num_groups, group_dim)``."""
    size = group_dim(x.shape[-1], num_groups)
    return F.pad(x, (0, num_groups * size - x.shape[-1])).reshape(-1, num_groups, size)


def batch_embed(x: Tensor, num_groups: int) -> Tensor:
    """peft's ``batch_average`` projection of ``x (..., d_in)``: the mean sub-token, normalised in
    fp32 (all ones, normalised, for a zero mean): ``(group_dim,)`` fp32."""
    mean = _subtokens(x.detach(), num_groups).reshape(-1, group_dim(x.shape[-1], num_groups)).mean(0).float()
    norm = torch.linalg.vector_norm(mean)
    ones = torch.ones_like(mean) / mean.numel() ** 0.5
    return torch.where(norm == 0, ones, mean / torch.where(norm == 0, 1.0, norm))


def compressed_projection(x: Tensor, a: Tensor, embed: Tensor, num_groups: int, scale: float) -> Tensor:
    """``x (..., d_in) @ aᵀ -> (..., r)`` whose backward keeps only ``compressed (n, num_groups)``
    (the projections of the sub-tokens on ``embed``) instead of ``x``: the exact input gradient
    ``g a``, and peft's ``a`` gradient ``gᵀ x̃`` from the reconstruction ``x̃ = scale · (c ⊗
    e)[:, :d_in]``.

    Plain differentiable ops, no ``autograd.Function`` (``torch.compile`` traces them as they are,
    ``vmap`` batches them): ``x @ a.detach()ᵀ`` gives the value and the input gradient (it saves
    ``a``, not ``x``, since ``a.detach()`` needs no gradient); ``a``'s gradient comes through a
    term of value exactly 0, ``z - z.detach()`` with ``z = scale · c (A_g e)ᵀ`` (``A_g (r,
    num_groups, group_dim)``: ``a`` zero-padded into groups), whose backward saves ``c`` alone and
    gives ``∂A_g = (gᵀ scale·c) ⊗ e``, i.e. ``gᵀ x̃`` cropped to ``d_in``."""
    value = x @ a.detach().T
    size = group_dim(x.shape[-1], num_groups)
    compressed = torch.einsum("tgd,d->tg", _subtokens(x.detach(), num_groups), embed.to(x.dtype))  # (n, num_groups)
    a_groups = F.pad(a, (0, num_groups * size - a.shape[-1])).reshape(a.shape[0], num_groups, size)
    z = (compressed * scale) @ torch.einsum("rgd,d->rg", a_groups, embed.to(a.dtype)).T  # (n, r)
    return value + (z - z.detach()).reshape(value.shape)


def _embed(x: Tensor, buffers: TensorDict, info: LayerInfo) -> Tensor:
    num_groups, init_type = info.option("num_groups"), info.option("init_type")
    if init_type == "random":
        return buffers[EMBED]
    step = batch_embed(x, num_groups)
    if init_type == "batch_average":
        return step
    stored = buffers[EMBED]  # batch_average_once: the stored projection once it is set
    # (in the promoted dtype: a set buffer is used at its own precision, as "random" uses it and
    # peft uses its buffer, not rounded to the step's fp32)
    return torch.where(stored.any(), stored, step)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    """LoRA's init, then peft's projection: a normalised ``N(0, 1)`` draw (fp32 normalisation) for
    ``init_type="random"``, zeros (not yet set) otherwise."""
    params, _ = lora.init(weight, bias, info, dtype=dtype, generator=generator)
    size = group_dim(info.d_in, info.option("num_groups"))
    if info.option("init_type") == "random":
        draw = torch.randn(size, generator=generator, dtype=weight.dtype if weight.is_floating_point() else torch.float32)
        embed = draw.float() / torch.linalg.vector_norm(draw.float())
    else:
        embed = torch.zeros(size)
    return params, {EMBED: embed.to(weight.device, dtype)}


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    if not (getattr(base, "training", False) and torch.is_grad_enabled()):
        return lora_activation_form(params, buffers, x, base, info)
    lora_a = params["lora_A"]
    dropped = lowrank_input(x, base, info).to(lora_a.dtype)
    embed = _embed(dropped, buffers, info)
    h = compressed_projection(dropped, lora_a, embed, info.option("num_groups"), info.option("scale"))
    return base_plus_low_rank(base, x, h * lora_scale(info, buffers), params["lora_B"])


VARIANT = lora.derived(
    "velora",
    init,
    activation_form=activation_form,
    tensors=lora.TENSORS | {EMBED: Slot(lambda i: (group_dim(i.d_in, i.option("num_groups")),), buffer=True, peft="lora_velora_embed")},
    options=lora.OPTIONS
    | {
        "num_groups": Option(64, whole(1, why="the sub-tokens each input row is split into"), "velora_config.num_groups"),
        "scale": Option(1.0, real(0, closed="()", why="the reconstruction's scale in backward"), "velora_config.scale"),
        "init_type": Option("batch_average", one_of("batch_average", "batch_average_once", "random"), "velora_config.init_type"),
    },
    # the forward is LoRA's but the gradient is not: the mixed-row fast path and ghost clipping
    # (which read LowRank) would give LoRA's exact gradient
    low_rank=None,
)
PEFT = lora.stored_as_lora(reads=lora.plain_reads(velora_config=bool))
