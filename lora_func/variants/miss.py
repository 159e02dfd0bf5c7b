"""MiSS, matrix shard sharing (Kang and Yin, arXiv 2409.15371, formerly "Bone"), following HF
peft's ``tuners/miss/layer.py``.

One trainable block, shared over the whole weight:

- ``init="miss"`` (peft's default, ``init_weights=True``): ``miss_block (r, d_out)``;
  ``ΔW[o, j] = block[j mod r, o]``: the block tiled along the input (a last partial tile
  where ``r`` does not divide ``d_in``). Activation form, as peft: the input summed over its
  ``r``-wide chunks, ``(..., r)``, times the block: ``d_in + r·d_out`` work per row, no
  ``(d_out, d_in)`` matrix.
- ``init="mini"``: ``miss_block (r, mini_r)``, tiled along the output too (``d_out / mini_r``
  copies): fewer parameters, the same forms.
- ``init="bat"``: ``miss_block (d_out/r, r, r)``; the weight's ``r × r`` blocks
  ``W[b, c]`` become ``W[b, c] + W[b, c] M_b + M_b`` (block-affine: the update reads ``W``). The
  activation form builds that update from the frozen weight (the merged weight, as peft's
  forward does); ``r`` must divide both sizes.
- ``init="random"`` (peft's ``init_weights=False``): the ``miss`` layout, kaiming-uniform
  (``a = √5``) instead of zero.

Every init but ``random`` is zero, the identity. No scale (peft's has none). ``dropout`` is
peft's ``miss_dropout`` on the input of the summed path, in training steps; peft's ``bat``
path has none, nor has this one. A rank-padded stack of the ``miss``/``mini`` layouts keeps
each member's own tiling period ``r`` (read from its rank, a tensor there); ``bat`` blocks
cannot be padded (``stack`` refuses them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from lora_func.variants._kernels import kaiming_uniform, lowrank_input
from lora_func.variants._options import dropout_option
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, whole

INITS = ("miss", "mini", "bat", "random")


def block_shape(r: int, d_in: int, d_out: int, options: Mapping[str, Any]) -> tuple[int, ...]:
    """``miss_block``'s shape for the layout ``options["init"]``."""
    how = options["init"]
    if how == "bat":
        return (d_out // r, r, r)
    if how == "mini":
        return (r, options["mini_r"])
    return (r, d_out)


def _check_layer(r: int, d_in: int, d_out: int, options: Mapping[str, Any]) -> None:
    # r <= min(d_in, d_out) is init_adapter's own check (init-rank-too-big); peft asks r <= d_in.
    how, mini_r = options["init"], options["mini_r"]
    if how == "bat" and (d_in % r or d_out % r):
        raise ValueError(  # error: miss-bat-sizes
            f"miss: init='bat' cuts the weight into r×r blocks, but r={r} does not divide d_in={d_in} and d_out={d_out}; "
            f"pick an r that divides both, or init='miss'"
        )
    if how == "mini" and d_out % mini_r:
        raise ValueError(  # error: miss-mini-r
            f"miss: init='mini' tiles a (r, mini_r) block along the output, but mini_r={mini_r} does not divide "
            f"d_out={d_out}; pick a mini_r that divides d_out"
        )


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    options = dict(info.options)
    _check_layer(info.r, info.d_in, info.d_out, options)
    shape = block_shape(info.r, info.d_in, info.d_out, options)
    random = options["init"] == "random"
    block = kaiming_uniform(shape, a=math.sqrt(5), generator=generator) if random else torch.zeros(shape)
    return {"miss_block": block.to(weight.device, dtype)}, {}


def _tiled(params: TensorDict, info: LayerInfo) -> Tensor:
    """The ``(r, d_out)`` block of the ``miss``/``mini`` layouts (``mini``: tiled along ``d_out``)."""
    block = params["miss_block"]
    if info.option("init") == "mini":
        block = block.repeat(1, info.d_out // block.shape[-1])
    return block


def _chunk_selector(d_in: int, r_pad: int, r: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``S (d_in, r_pad)``, ``S[j, c] = (j mod r == c)``: the chunk sum of a member of own rank
    ``r`` (a tensor) as a product, for a rank-padded stack."""
    j = torch.arange(d_in, device=device, dtype=r.dtype)
    return (torch.remainder(j, r)[:, None] == torch.arange(r_pad, device=device, dtype=r.dtype)[None, :]).to(dtype)


def _bat_delta(block: Tensor, weight: Tensor) -> Tensor:
    """``ΔW`` of the ``bat`` layout: each ``r × r`` block ``W[b, c] M_b + M_b``."""
    r = block.shape[-1]
    w = rearrange(weight, "(b r1) (c r2) -> b c r1 r2", r1=r, r2=r)
    delta = w @ block[:, None] + block[:, None]
    return rearrange(delta, "b c r1 r2 -> (b r1) (c r2)")


def delta_weight(params: TensorDict, weight: Tensor, info: LayerInfo) -> Tensor:
    """``ΔW (d_out, d_in)``; ``weight`` (the base, adapter dtype) is read by ``bat`` only."""
    if info.option("init") == "bat":
        return _bat_delta(params["miss_block"], weight)
    block = _tiled(params, info)
    r = info.r
    if isinstance(r, Tensor):  # a rank-padded member: its own period
        selector = _chunk_selector(info.d_in, block.shape[0], r, block.dtype, block.device)
        return (selector @ block).transpose(-1, -2)
    index = torch.arange(info.d_in, device=block.device) % block.shape[0]
    return block[index].transpose(-1, -2)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + delta_weight(params, weight, info).to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    y = base(x)
    block = params["miss_block"]
    if info.option("init") == "bat":
        # The update reads W: built once per call from the frozen weight (peft's forward merges too).
        delta = _bat_delta(block, base.weight.to(block.dtype))
        return y + (x.to(block.dtype) @ delta.transpose(-1, -2)).to(y.dtype)
    tiled = _tiled(params, info)
    xd = lowrank_input(x, base, info).to(tiled.dtype)
    r_pad = tiled.shape[0]
    if isinstance(info.r, Tensor):  # a rank-padded member: chunks of its own r
        summed = xd @ _chunk_selector(info.d_in, r_pad, info.r, tiled.dtype, tiled.device)
    else:
        # The input's r-wide chunks summed (zero-padded to a whole number of chunks, as peft).
        padded = F.pad(xd, (0, (-info.d_in) % r_pad)) if info.d_in % r_pad else xd
        summed = rearrange(padded, "... (c r) -> ... c r", r=r_pad).sum(-2)
    return y + (summed @ tiled).to(y.dtype)


VARIANT = Variant(
    name="miss",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={"miss_block": Slot(lambda i: block_shape(i.r, i.d_in, i.d_out, dict(i.options)), rank_axes=(0,), peft="miss_block")},
    options={
        "init": Option("miss", one_of(*INITS), "init_weights", mapped({"miss": True, "random": False, "bat": "bat", "mini": "mini"})),
        "mini_r": Option(1, whole(1), "mini_r"),
        "dropout": dropout_option("miss_dropout"),
    },
    default_alpha=8.0,  # unused: MiSS has no scale
)
# peft: MissConfig; its MiSS takes nn.Linear only.
PEFT = PeftFormat(PeftMethod("MISS", rank=("r", None)), conv1d=False)
