"""Helpers the position-based variants share (SHiRA, FourierFT): values at fixed positions of a
``(d_out, d_in)`` matrix, drawn as peft draws them, and the dense-delta activation form.

Not variants (the leading ``_`` keeps the registry out). Positions are int64 ``(2, n)``
buffers (row, column), so they stack, vmap and compile as tensors; values are ``(n,)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants._contract import BaseLayer, LayerInfo, Slot, TensorDict
from lora_func.variants._options import FLAG, SEED, Option, real

__all__ = ["linear_plus_dense", "own_values", "peft_randperm_positions", "scatter_dense", "spectrum_init", "spectrum_options", "spectrum_tensors"]


def spectrum_tensors(prefix: str) -> dict[str, Slot]:
    """``<prefix>_spectrum (n,)`` trainable values and ``<prefix>_indices (2, n)`` their fixed
    positions, ``n = r`` (peft's ``n_frequency``): a rank-padded stack pads both, each member
    masks its own. peft's file holds the values only: the positions come from the seed."""
    return {
        f"{prefix}_spectrum": Slot(lambda i: (i.r,), padded_axes=(0,), peft=f"{prefix}_spectrum"),
        f"{prefix}_indices": Slot(lambda i: (2, i.r), padded_axes=(1,), buffer=True, integer=True),
    }


def spectrum_options(scaling: float, init_weights: bool) -> dict[str, Option]:
    """FourierFT's and WaveFT's options (peft's names and defaults): the scale, the positions'
    seed, and whether the values start at zero."""
    return {
        "scaling": Option(scaling, real(), "scaling"),
        "random_loc_seed": Option(777, SEED, "random_loc_seed"),
        "init_weights": Option(init_weights, FLAG, "init_weights"),
    }


def spectrum_init(
    prefix: str, what: str, info: LayerInfo, *, std: float, dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> tuple[TensorDict, TensorDict]:
    """``n = r`` values at positions peft draws from ``random_loc_seed``: zeros (``init_weights``)
    or ``N(0, std²)`` from the generator; ``what`` names the values in the refusal."""
    n = info.r
    if n > info.d_in * info.d_out:
        raise ValueError(  # error: spectrum-too-many
            f"{prefix}: r={n} {what} (peft's n_frequency) exceed the layer's {info.d_out}×{info.d_in} = "
            f"{info.d_in * info.d_out} entries; lower r to at most {info.d_in * info.d_out}"
        )
    positions = peft_randperm_positions(info.d_out, info.d_in, n, info.option("random_loc_seed"))
    values = torch.zeros(n) if info.option("init_weights") else std * torch.randn(n, generator=generator)
    return {f"{prefix}_spectrum": values.to(device, dtype)}, {f"{prefix}_indices": positions.to(device)}


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
