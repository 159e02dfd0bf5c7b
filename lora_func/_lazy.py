"""Lazy (unmerged) overlay: tensor stand-ins for target weights.

An :class:`AdaptedWeight` has the metadata of the frozen weight it stands in for and holds
the adapter tensors of its layer. Through ``__torch_function__`` it intercepts the ops that
consume a weight (``F.linear`` for nn.Linear, ``torch.addmm``/``torch.matmul`` for GPT-2
Conv1D) and returns ``base(x)`` plus the variant's activation form, so no merged weight is
ever built. Metadata reads (dtype, shape, device) answer from the wrapper; any other op
gets the dense merged weight (correct, just not lazy) or, with ``lazy_only=True``, raises.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lora_func._routing import WeightStandIn, found_weights, replace_weights, weight_use
from lora_func._layer_ops import LayerCall, LayerOp, has_kind_form, merged_weight
from lora_func.targeting import canonical_weight

__all__ = ["AdaptedBias", "AdaptedCalls", "AdaptedWeight"]

# The getters of the tensor properties (torch's stubs type the properties as their values).
_METADATA_FUNCS = {
    *(
        inspect.getattr_static(Tensor, name).__get__
        for name in ("dtype", "shape", "device", "ndim", "layout", "requires_grad", "is_leaf", "grad", "is_cuda")
    ),
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.stride,
    Tensor.is_floating_point,
    Tensor.is_complex,
    Tensor.element_size,
    Tensor.get_device,
}


class AdaptedWeight(WeightStandIn):
    """Stand-in for one target weight in the lazy overlay (see module docstring)."""

    _weight: Tensor
    _bias: Tensor | None
    _op: LayerOp
    _layout: str
    _lazy_only: bool
    _name: str
    _training: bool

    @staticmethod
    def __new__(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        op: LayerOp,
        *,
        layout: str,
        lazy_only: bool,
        name: str,
        training: bool = False,
    ) -> AdaptedWeight:
        out = Tensor._make_wrapper_subclass(
            cls,
            weight.shape,
            strides=weight.stride(),
            dtype=weight.dtype,
            device=weight.device,
            requires_grad=False,
        )
        out._weight, out._bias, out._op = weight, bias, op
        out._layout, out._lazy_only, out._name, out._training = layout, lazy_only, name, training
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's stub: no keyword
        return (
            f"AdaptedWeight({self._name}, op={type(self._op).__name__}, shape={tuple(self._weight.shape)}, "
            f"dtype={self._weight.dtype})"
        )

    def merged(self) -> Tensor:
        """The dense merged weight, in the stored layout and base dtype."""
        return merged_weight(self._op, self._weight, self._bias, self._layout)[0]

    def _adapted(
        self, x: Tensor, bias: Tensor | None, call: Callable[[Tensor], Tensor], replay: Callable[[Tensor, Tensor], Tensor] | None = None
    ) -> Tensor:
        base = LayerCall(canonical_weight(self._weight, self._layout), bias, call, self._training, replay)
        return self._op.activation(x, base)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.linear and not kwargs and 2 <= len(args) <= 3:
            # nn.Linear's own call, F.linear(x, W, b) with W a stand-in and x, b plain: what
            # weight_use would find, without binding the arguments (once per target and call).
            w, x = args[1], args[0]
            bias = args[2] if len(args) == 3 else None
            if type(w) is AdaptedWeight and w._layout == "linear" and type(x) not in _STANDINS and type(bias) not in _STANDINS:
                weight = w._weight
                return w._adapted(x, bias, lambda x_: F.linear(x_, weight, bias))
        kwargs = kwargs or {}
        if func in _METADATA_FUNCS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _route(func, args, kwargs, _standin_of)

    @classmethod
    def below_autograd(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        # Reaching dispatch means an op bypassed __torch_function__ (a C++ path); computing
        # here would be below autograd and silently drop the adapter's gradients.
        raise RuntimeError(  # error: lazy-below-autograd
            f"lazy overlay: {func} reached an adapted weight below autograd; use merge_overlay for this model"
        )


class AdaptedBias(AdaptedWeight):
    """Stand-in for the bias of a target whose variant changes the bias (IA3 scales it).

    Inside its layer's own op, paired with its weight's stand-in, it is the base bias (the
    activation form scales it); in any other op (a layer computing ``x @ W.T + b`` by hand) it is
    the merged ``b_eff``, as its weight there is ``W_eff``, or it raises when lazy_only."""

    _pair: Any

    @staticmethod
    def __new__(cls, bias: Tensor, pair: AdaptedWeight, *, lazy_only: bool, name: str) -> AdaptedBias:
        out = Tensor._make_wrapper_subclass(
            cls, bias.shape, strides=bias.stride(), dtype=bias.dtype, device=bias.device, requires_grad=False
        )
        out._weight, out._bias, out._op, out._pair = bias, None, pair._op, pair
        out._layout, out._lazy_only, out._name = "bias", lazy_only, name
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's stub: no keyword
        return f"AdaptedBias({self._name}, shape={tuple(self._weight.shape)}, dtype={self._weight.dtype})"

    def merged(self) -> Tensor:
        """The merged bias ``b_eff``, in the base dtype."""
        return merged_bias(self._pair)


def merged_bias(pair: Any) -> Tensor:
    """``b_eff`` of the target whose weight is ``pair`` (a stand-in or a mode entry)."""
    return cast(Tensor, merged_weight(pair._op, pair._weight, pair._bias, pair._layout)[1])  # the pair has a bias


_STANDINS = (AdaptedWeight, AdaptedBias)


def _standin_of(value: Any) -> AdaptedWeight | None:
    return value if type(value) in (AdaptedWeight, AdaptedBias) else None


class _Adapted(Protocol):
    """What the router needs of an adapted weight: a stand-in, or a mode's entry."""

    _weight: Tensor
    _layout: str
    _lazy_only: bool
    _name: str

    def merged(self) -> Tensor: ...

    def _adapted(
        self, x: Tensor, bias: Tensor | None, call: Callable[[Tensor], Tensor], replay: Callable[[Tensor, Tensor], Tensor] | None = None
    ) -> Tensor: ...


def _route(func: Any, args: tuple, kwargs: dict, find: Callable[[Any], Any]) -> Any:
    """``func(*args, **kwargs)`` where ``find`` tells which values are adapted weights: the
    layer's own op on one (:func:`lora_func._routing.weight_use`) takes the low-rank path (on an
    embedding, where the op has a form for it: ``Variant.kind_forms``); any other op gets the
    dense merged weight, or raises when the weight is lazy_only."""
    use = weight_use(func, args, kwargs, find)
    if use is not None and (use.entry._layout in ("linear", "conv1d") or has_kind_form(use.entry._op, use.entry._layout)):
        w = use.entry
        return w._adapted(use.x, use.bias, lambda x_: use.replay(x_, w._weight), use.replay)
    found = found_weights(args, kwargs, find)
    if any(a._lazy_only for a in found):
        raise RuntimeError(  # error: lazy-only
            f"lazy overlay (lazy_only=True): {getattr(func, '__name__', func)} on adapted weight(s) {sorted({a._name for a in found})} "
            f"has no low-rank path; use merge_overlay (merged weights) or overlay(..., lazy_only=False) to fall back "
            f"to the dense merged weight"
        )
    if found:
        args, kwargs = replace_weights(args, kwargs, find, lambda a: a.merged())
    return func(*args, **kwargs)


class _ModeEntry:
    """One target weight of :class:`AdaptedCalls`: the base tensor itself, found by identity."""

    __slots__ = ("_bias", "_layout", "_lazy_only", "_name", "_op", "_training", "_weight")

    def __init__(
        self, weight: Tensor, bias: Tensor | None, op: LayerOp, *, layout: str, lazy_only: bool, name: str, training: bool = False
    ) -> None:
        self._weight, self._bias, self._op = weight, bias, op
        self._layout, self._lazy_only, self._name, self._training = layout, lazy_only, name, training

    merged = AdaptedWeight.merged
    _adapted = AdaptedWeight._adapted


class _BiasEntry:
    """The bias of a target of :class:`AdaptedCalls` whose variant changes it (see AdaptedBias)."""

    __slots__ = ("_layout", "_lazy_only", "_name", "_pair", "_weight")

    def __init__(self, bias: Tensor, pair: _ModeEntry, *, lazy_only: bool, name: str) -> None:
        self._weight, self._pair, self._layout, self._lazy_only, self._name = bias, pair, "bias", lazy_only, name

    def merged(self) -> Tensor:
        return merged_bias(self._pair)


class AdaptedCalls(TorchFunctionMode):
    """The lazy overlay as a torch-function mode, for code that ``torch.compile`` traces.

    Dynamo cannot trace the creation of :class:`AdaptedWeight` stand-ins
    (``Tensor._make_wrapper_subclass``), but it traces torch-function modes. So the model gets
    its own base tensors, and while the mode is active the layer's own op on a target weight
    (found by identity) takes the same low-rank path a stand-in would, and any other op on it
    gets the dense merged weight (or raises when ``lazy_only``): the same semantics as
    :func:`lora_func.overlay`. Checking every op's arguments costs Python time per op, which
    only the trace pays; eager code uses the stand-ins.
    """

    def __init__(self, entries: Sequence[_ModeEntry | _BiasEntry]) -> None:
        super().__init__()
        self._entries = tuple(entries)

    def _find(self, value: Any) -> _ModeEntry | _BiasEntry | None:
        if isinstance(value, Tensor):
            for entry in self._entries:
                if value is entry._weight:
                    return entry
        return None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_FUNCS:
            return func(*args, **kwargs)
        return _route(func, args, kwargs, self._find)
