"""peft's storage of the conv kinds, shared by the variant files: which conv layers a peft method
adapts (a ``PeftFormat.export`` that refuses the others, so ``save_peft`` and ``peft_problems``
say so before anything is written) and a per-channel vector stored as peft's conv layers hold it
(``(1, n, 1, …)``, one size-1 axis per kernel axis).

A variant adapts ``nn.Conv1d/2d/3d`` (the ``"conv"`` kind) and grouped convs (``"grouped_conv"``)
through their canonical ``(out, in·prod(kernel))`` view, whatever peft covers; these say where
peft's format ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor

from lora_func.variants._contract import LayerInfo, TensorDict
from lora_func.variants._peft import PeftLayer

__all__ = ["CONV_KINDS", "chained", "channel_vector", "low_rank_kernels", "peft_conv_layers"]

CONV_KINDS = ("conv", "grouped_conv")
_NAMES = {1: "nn.Conv1d", 2: "nn.Conv2d", 3: "nn.Conv3d"}


def peft_conv_layers(
    method: str, dims: tuple[int, ...], *, square: bool = False, export: Callable[..., PeftLayer] | None = None
) -> Callable[[TensorDict, TensorDict, Tensor | None, LayerInfo], PeftLayer]:
    """A ``PeftFormat.export`` for a method that peft adapts on conv layers of ``dims`` kernel
    axes only (``(2,)``: ``nn.Conv2d``), with ``square`` kernels only where peft reads a kernel as
    ``k[0]·k[0]`` (its OFT and HRA): a layer of another conv is refused naming it. Every other
    layer is written by ``export`` (the variant's own conversion), or as it is (its trainable
    tensors: a variant without saved buffers)."""

    def written(params: TensorDict, buffers: TensorDict, weight: Tensor | None, info: LayerInfo) -> PeftLayer:
        if info.kind in CONV_KINDS and (len(info.kernel) not in dims or (square and len(set(info.kernel)) > 1)):
            kinds = " / ".join(_NAMES[d] for d in dims) + (" with square kernels" if square else "")
            raise ValueError(  # error: save-peft-conv-kind
                f"save_peft: peft's {method} adapts {kinds} only, not a {_NAMES.get(len(info.kernel), 'conv')} with kernel "
                f"{info.kernel}, so no peft tool could load this checkpoint; save the adapter with lora_func.save instead"
            )
        if export is not None:
            return export(params, buffers, weight, info)
        return PeftLayer(lambda: dict(params), r=info.r, alpha=info.alpha)

    return written


def channel_vector(*names: str, axis: int | None) -> Callable[[str, str, Tensor, tuple[int, ...], bool], Tensor | None]:
    """The part of a ``PeftFormat.reshape`` for per-channel vectors ``names`` on a conv: lora_func
    holds them as peft's Linear layers do (``axis=None``: a vector ``(n,)``; else a matrix with a
    size-1 ``axis``, ``(n, 1)`` or ``(1, n)``, the slot's ``matrix``), peft's conv layers as
    ``(1, n, 1, …)``. Returns ``None`` for a tensor it does not handle (another name, another
    kind), so reshapes chain; a tensor of another shape comes back unchanged (the loader's shape
    check names it)."""

    def reshape(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...], to_peft: bool) -> Tensor | None:
        if kind not in CONV_KINDS or name not in names:
            return None
        spatial = len(shape) - 2
        if to_peft:
            return tensor.reshape(1, -1, *[1] * spatial)
        if tensor.dim() == 2 + spatial and tensor.shape[0] == 1 and math.prod(tensor.shape[2:]) == 1:
            return tensor.reshape(-1) if axis is None else tensor.reshape(-1, 1) if axis == 1 else tensor.reshape(1, -1)
        return tensor

    return reshape


def low_rank_kernels(a: str, b: str) -> Callable[[str, str, Tensor, tuple[int, ...], bool], Tensor | None]:
    """The part of a ``PeftFormat.reshape`` for a low-rank pair on a conv, stored as peft's conv
    LoRA stores ``lora_A`` / ``lora_B``: ``a (r, in·K) <-> (r, in, *kernel)`` (a conv with the base
    kernel) and ``b (out, r) <-> (out, r, 1, …)`` (a 1x1 conv); ``None`` for another tensor."""

    def reshape(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...], to_peft: bool) -> Tensor | None:
        if kind not in CONV_KINDS or name not in (a, b):
            return None
        spatial = len(shape) - 2
        if to_peft:
            return tensor.reshape(tensor.shape[0], *shape[1:]) if name == a else tensor.reshape(*tensor.shape, *[1] * spatial)
        fits = tuple(tensor.shape[1:]) == tuple(shape[1:]) if name == a else tensor.dim() == 2 + spatial and math.prod(tensor.shape[2:]) == 1
        return tensor.flatten(1) if fits else tensor

    return reshape


def chained(*parts: Callable[[str, str, Tensor, tuple[int, ...], bool], Tensor | None]) -> Any:
    """One ``PeftFormat.reshape`` from parts that each handle some tensors (``None`` for the
    others): the first part's answer, or the tensor unchanged."""

    def reshape(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...], to_peft: bool) -> Tensor:
        for part in parts:
            out = part(kind, name, tensor, shape, to_peft)
            if out is not None:
                return out
        return tensor

    return reshape
