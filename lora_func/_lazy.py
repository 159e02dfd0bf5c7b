"""Lazy (unmerged) overlay: tensor stand-ins for target weights.

An :class:`AdaptedWeight` has the metadata of the frozen weight it stands in for and holds
the adapter tensors of its layer. Through ``__torch_function__`` it intercepts the ops that
consume a weight (``F.linear`` for nn.Linear, ``torch.addmm``/``torch.matmul`` for GPT-2
Conv1D) and returns ``base(x)`` plus the variant's activation form, so no merged weight is
ever built. Metadata reads (dtype, shape, device) answer from the wrapper; any other op
gets the dense merged weight (correct, just not lazy) or, with ``strict=True``, raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

from lora_func._types import LayerInfo, TensorDict, Variant
from lora_func.targeting import canonical_weight, stored_weight

__all__ = ["AdaptedWeight", "LayerCall", "merged_weight"]

_METADATA_FUNCS = {
    Tensor.dtype.__get__,  # type: ignore[attr-defined]
    Tensor.shape.__get__,  # type: ignore[attr-defined]
    Tensor.device.__get__,  # type: ignore[attr-defined]
    Tensor.ndim.__get__,  # type: ignore[attr-defined]
    Tensor.layout.__get__,  # type: ignore[attr-defined]
    Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
    Tensor.grad.__get__,  # type: ignore[attr-defined]
    Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.stride,
    Tensor.is_floating_point,
    Tensor.is_complex,
    Tensor.element_size,
    Tensor.get_device,
}


class LayerCall:
    """The frozen base layer as a variant's activation form sees it (a ``BaseLayer``).

    ``weight`` is the canonical ``(d_out, d_in)`` view, ``bias`` the bias the model passed;
    calling it replays the model's own op with the base weight.
    """

    __slots__ = ("_call", "bias", "weight")

    def __init__(self, weight: Tensor, bias: Tensor | None, call: Callable[[Tensor], Tensor]) -> None:
        self.weight = weight
        self.bias = bias
        self._call = call

    def __call__(self, x: Tensor) -> Tensor:
        return self._call(x)


def merged_weight(
    variant: Variant,
    params: TensorDict,
    buffers: TensorDict,
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    layout: str,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """``(W_eff, b_eff)`` in the stored layout and the base dtype, computed in ``dtype``."""
    w_eff, b_eff = variant.weight_form(
        params,
        buffers,
        canonical_weight(weight, layout).to(dtype),
        None if bias is None else bias.to(dtype),
        info,
    )
    return stored_weight(w_eff, layout).to(weight.dtype), None if b_eff is None else b_eff.to(bias.dtype)  # type: ignore[union-attr]


class AdaptedWeight(Tensor):
    """Stand-in for one target weight in the lazy overlay (see module docstring)."""

    _weight: Tensor
    _bias: Tensor | None
    _variant: Variant
    _params: TensorDict
    _buffers: TensorDict
    _info: LayerInfo
    _layout: str
    _dtype: torch.dtype
    _strict: bool
    _name: str

    @staticmethod
    def __new__(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        variant: Variant,
        params: TensorDict,
        buffers: TensorDict,
        info: LayerInfo,
        *,
        layout: str,
        dtype: torch.dtype,
        strict: bool,
        name: str,
    ) -> AdaptedWeight:
        out = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            weight.shape,
            strides=weight.stride(),
            dtype=weight.dtype,
            device=weight.device,
            requires_grad=False,
        )
        out._weight, out._bias, out._variant = weight, bias, variant
        out._params, out._buffers, out._info = params, buffers, info
        out._layout, out._dtype, out._strict, out._name = layout, dtype, strict, name
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"AdaptedWeight({self._name}, variant={self._variant.name!r}, shape={tuple(self._weight.shape)}, "
            f"dtype={self._weight.dtype})"
        )

    def merged(self) -> Tensor:
        """The dense merged weight, in the stored layout and base dtype."""
        return merged_weight(
            self._variant, self._params, self._buffers, self._weight, self._bias, self._info, self._layout, self._dtype
        )[0]

    def _adapted(self, x: Tensor, bias: Tensor | None, call: Callable[[Tensor], Tensor]) -> Tensor:
        base = LayerCall(canonical_weight(self._weight, self._layout), bias, call)
        return self._variant.activation_form(self._params, self._buffers, x, base, self._info)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_FUNCS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is F.linear:
            bound = _bind(("input", "weight", "bias"), args, kwargs, bias=None)
            x, w, b = bound["input"], bound["weight"], bound["bias"]
            if type(w) is cls and not _has_standin((x, b)):
                return w._adapted(x, b, lambda x_: F.linear(x_, w._weight, b))
        elif func is torch.addmm:
            bound = _bind(("input", "mat1", "mat2"), args, kwargs, beta=1, alpha=1)
            b, x, w = bound["input"], bound["mat1"], bound["mat2"]
            if type(w) is cls and w._layout == "conv1d" and bound["beta"] == 1 and bound["alpha"] == 1 and not _has_standin((x, b)):
                return w._adapted(x, b, lambda x_: torch.addmm(b, x_, w._weight))
        elif func in (torch.matmul, Tensor.matmul, Tensor.__matmul__):
            bound = _bind(("input", "other"), args, kwargs)
            x, w = bound["input"], bound["other"]
            if type(w) is cls and w._layout == "conv1d" and not _has_standin((x,)):
                return w._adapted(x, None, lambda x_: torch.matmul(x_, w._weight))
        standins = sorted({t._name for t in pytree.tree_leaves((args, kwargs)) if type(t) is cls})
        if any(t._strict for t in pytree.tree_leaves((args, kwargs)) if type(t) is cls):
            raise RuntimeError(
                f"lazy overlay (strict): {getattr(func, '__name__', func)} on adapted weight(s) {standins} has no "
                f"low-rank path; use merge_overlay (merged weights) or overlay(..., strict=False) to fall back "
                f"to the dense merged weight"
            )
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.merged(), (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Reaching dispatch means an op bypassed __torch_function__ (a C++ path); computing
        # here would be below autograd and silently drop the adapter's gradients.
        raise RuntimeError(
            f"lazy overlay: {func} reached an adapted weight below autograd; use merge_overlay for this model"
        )


def _has_standin(values: tuple) -> bool:
    return any(type(v) is AdaptedWeight for v in values)


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict, **defaults: Any) -> dict[str, Any]:
    bound = dict(defaults)
    bound.update(zip(names, args, strict=False))
    extra = args[len(names) :]
    for name, value in zip(tuple(defaults), extra, strict=False):
        bound[name] = value
    bound.update(kwargs)
    return bound
