"""Helpers of the shared-basis variants (VeRA, RandLoRA, VB-LoRA): peft's seed-derived draws,
reproduced draw for draw, and the checks their options share. Not a variant (the leading
``_`` keeps it out of the registry)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from lora_func.variants._contract import LayerInfo


def peft_kaiming(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """peft's ``_kaiming_init`` (``tuners/vera/model.py``, also RandLoRA's and PVeRA's):
    ``U(-√(6 / fan_in), √(6 / fan_in))`` in fp32 from ``generator``, ``fan_in`` as
    ``nn.init._calculate_correct_fan(t, "fan_in")`` (``shape[1]`` times the sizes after it)."""
    out = torch.empty(shape, dtype=torch.float32)
    fan = torch.nn.init._calculate_correct_fan(out, "fan_in")
    bound = math.sqrt(3.0) * math.sqrt(2) / math.sqrt(fan)
    with torch.no_grad():
        return out.uniform_(-bound, bound, generator=generator)


def one_rank(variant: str, infos: Mapping[str, LayerInfo]) -> int:
    """The one rank of every layer: the shared basis has one rank (peft has no ``rank_pattern``
    for these methods)."""
    ranks = sorted({info.r for info in infos.values()})
    if len(ranks) != 1:
        raise ValueError(f"{variant} shares one basis of one rank across its layers, but the layers have ranks {ranks}; use one r")  # error: bank-one-rank
    return ranks[0]


def largest(infos: Mapping[str, LayerInfo]) -> tuple[int, int]:
    """``(largest d_out, largest d_in)`` over the layers, each taken separately: the size of the
    shared basis that every layer slices (peft's ``_find_dim``)."""
    return max(info.d_out for info in infos.values()), max(info.d_in for info in infos.values())


def largest_of(info: LayerInfo) -> tuple[int, int]:
    """:func:`largest` from one layer's info (the adapter's :attr:`LayerInfo.layout`): the size
    of the shared basis, for the tensor schema's shapes."""
    layout = info.layout or ((info.d_in, info.d_out, info.r),)
    return max(d_out for _, d_out, _ in layout), max(d_in for d_in, _, _ in layout)
