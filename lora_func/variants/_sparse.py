"""Helpers the position-based variants share (SHiRA, FourierFT): values at fixed positions of a
``(d_out, d_in)`` matrix, drawn as peft draws them, and the dense-delta activation form.

Not variants (the leading ``_`` keeps the registry out). Positions are int64 ``(2, n)``
buffers (row, column), so they stack, vmap and compile as tensors; values are ``(n,)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants._contract import BaseLayer

__all__ = ["linear_plus_dense", "own_values", "peft_randperm_positions", "scatter_dense"]


def peft_randperm_positions(d_out: int, d_in: int, n: int, seed: int | None) -> Tensor:
    """The first ``n`` entries of ``torch.randperm(d_out·d_in)`` from a fresh CPU generator
    seeded with ``seed`` (``None``: the generator's default seed, as ``torch.Generator()``
    gives), as ``(2, n)`` int64 (row, column) of the row-major flat index: exactly the positions
    peft's FourierFT and SHiRA's random mask draw."""
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    flat = torch.randperm(d_out * d_in, generator=generator)[:n]
    return torch.stack([flat // d_in, flat % d_in])


def own_values(values: Tensor, size: int | Tensor) -> Tensor:
    """``values (n,)`` with the entries past ``size`` zeroed when ``size`` is a tensor: a member
    of a stack of different sizes (``Variant.padded_axes``), whose padding sits at position
    ``(0, 0)``; masked, it adds nothing and gets exactly zero gradient. An int ``size`` (one
    adapter) returns ``values`` itself."""
    if not isinstance(size, Tensor):
        return values
    own = torch.arange(values.shape[-1], device=values.device) < size
    return values * own.to(values.dtype)


def scatter_dense(values: Tensor, positions: Tensor, shape: tuple[int, int]) -> Tensor:
    """``D (shape)`` with ``D[row_k, col_k] += values[k]`` and zeros elsewhere (repeated positions
    sum, as peft's coalesced sparse tensor does). A ``scatter_add`` on the flat matrix: it has a
    ``vmap`` rule (stacked members with their own positions) and traces under ``torch.compile``."""
    flat = positions[0] * shape[1] + positions[1]
    out = values.new_zeros(shape[0] * shape[1])
    return out.scatter_add(0, flat, values).reshape(shape)


def linear_plus_dense(base: BaseLayer, x: Tensor, delta: Tensor) -> Tensor:
    """``x (W + Δ)ᵀ + b`` with one product on the merged weight, as peft's SHiRA forward: ``Δ``
    rounded to the base weight's dtype and added to ``W`` (one weight-sized write), then the
    layer's own product. Cheaper than ``base(x) + x Δᵀ`` (a second product, its output, and an
    input-gradient sum in backward) whenever ``Δ`` is dense anyway."""
    weight = base.weight
    return F.linear(x, weight + delta.to(weight.dtype), base.bias)
