"""Lazy (unmerged) overlay: tensor stand-ins for target weights.

An :class:`AdaptedWeight` has the metadata of the frozen weight it stands in for and holds
the adapter tensors of its layer. Through ``__torch_function__`` it intercepts the ops that
consume a weight (``F.linear`` for nn.Linear, ``torch.addmm``/``torch.matmul`` for GPT-2
Conv1D) and returns ``base(x)`` plus the variant's activation form, so no merged weight is
ever built. Metadata reads (dtype, shape, device) answer from the wrapper; any other op
gets the dense merged weight (correct, just not lazy) or, with ``strict=True``, raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lora_func._routing import found_weights, replace_weights, weight_use
from lora_func.variants import BaseLayer, LayerInfo, TensorDict, Variant
from lora_func.variants._contract import RANK_MASK
from lora_func.targeting import canonical_weight, stored_weight

__all__ = ["AdaptedBias", "AdaptedCalls", "AdaptedWeight", "ChainStep", "LayerCall", "LayerStep", "SumStep", "VariantStep", "merged_weight"]

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
    calling it replays the model's own op with the base weight. ``training``: whether this is a
    training step (the adapter's dropout acts then only).
    """

    __slots__ = ("_call", "bias", "training", "weight")

    # Calling it is exactly ``x @ weight.T + bias`` on a plain weight: the base-dtype low-rank
    # path (lora_func._types.base_plus_product) may compute the input gradient from ``weight``.
    replays_weight = True

    def __init__(self, weight: Tensor, bias: Tensor | None, call: Callable[[Tensor], Tensor], training: bool = False) -> None:
        self.weight = weight
        self.bias = bias
        self._call = call
        self.training = training

    def __call__(self, x: Tensor) -> Tensor:
        return self._call(x)


class LayerStep(Protocol):
    """What the overlays apply to one target layer: a variant, or several combined.

    ``weight(W (d_out, d_in), b (d_out,) | None) -> (W_eff, b_eff)`` takes and returns the
    canonical layout in the base dtype; ``activation(x (..., d_in), base) -> y (..., d_out)``
    must equal ``x @ W_effᵀ + b_eff`` for the ``W``, ``b`` and map of ``base``.
    """

    changes_bias: bool

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]: ...

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor: ...


def _mask_rank_axes(tensors: TensorDict, mask: Tensor, axes: Mapping[str, int | tuple[int, ...]]) -> TensorDict:
    """Multiply every rank axis by the 0/1 ``mask (r_max,)`` of a rank-padded stack member, so
    padded entries never reach the output and get exactly zero gradient."""
    out = dict(tensors)
    for name, tensor in tensors.items():
        for axis in (axes[name],) if isinstance(axes.get(name), int) else axes.get(name, ()):
            shape = [1] * tensor.dim()
            shape[axis] = -1
            out[name] = out[name] * mask.to(tensor.dtype).reshape(shape)
    return out


class VariantStep:
    """One variant's adapter on one layer; the forms run in the adapter ``dtype``."""

    __slots__ = ("buffers", "changes_bias", "dtype", "info", "params", "variant")

    def __init__(self, variant: Variant, params: TensorDict, buffers: TensorDict, info: LayerInfo, dtype: torch.dtype) -> None:
        if RANK_MASK in buffers:
            params = _mask_rank_axes(params, buffers[RANK_MASK], variant.rank_axes)
            buffers = _mask_rank_axes(buffers, buffers[RANK_MASK], variant.rank_axes)
        self.variant, self.params, self.buffers, self.info, self.dtype = variant, params, buffers, info, dtype
        self.changes_bias = variant.changes_bias

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        # Never below the base's precision: a bf16 adapter on an fp32 base would otherwise
        # round the frozen weight itself to bf16 (2.8e-2 off peft's merge, which adds the
        # delta to the fp32 weight). Above it (fp32 adapter, bf16 base) the adapter dtype.
        dtype = torch.promote_types(self.dtype, weight.dtype)
        params = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.params.items()}
        buffers = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.buffers.items()}
        w_eff, b_eff = self.variant.weight_form(
            params, buffers, weight.to(dtype), None if bias is None else bias.to(dtype), self.info
        )
        return w_eff.to(weight.dtype), None if b_eff is None or bias is None else b_eff.to(bias.dtype)

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor:
        return self.variant.activation_form(self.params, self.buffers, x, base, self.info)


class _StepBase:
    """``base`` with ``step`` applied: the base layer that the next step of a chain sees.
    Its ``weight``/``bias`` (the merged effective ones) are only computed if a form reads
    them (DoRA's norm), so a chain of low-rank steps stays lazy."""

    __slots__ = ("_bias", "_inner", "_step", "_weight")

    def __init__(self, step: LayerStep, inner: BaseLayer) -> None:
        self._step, self._inner = step, inner
        self._weight: Tensor | None = None
        self._bias: Tensor | None = None

    @property
    def training(self) -> bool:
        return getattr(self._inner, "training", False)

    def _merge(self) -> None:
        if self._weight is None:
            self._weight, self._bias = self._step.weight(self._inner.weight, self._inner.bias)

    @property
    def weight(self) -> Tensor:
        self._merge()
        return self._weight  # type: ignore[return-value]

    @property
    def bias(self) -> Tensor | None:
        if not self._step.changes_bias:
            return self._inner.bias
        self._merge()
        return self._bias

    def __call__(self, x: Tensor) -> Tensor:
        return self._step.activation(x, self._inner)


class ChainStep:
    """Steps applied in order: each sees the previous ones' effective weight (compose)."""

    __slots__ = ("changes_bias", "steps")

    def __init__(self, steps: Sequence[LayerStep]) -> None:
        self.steps = tuple(steps)
        self.changes_bias = any(step.changes_bias for step in self.steps)

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        for step in self.steps:
            weight, bias = step.weight(weight, bias)
        return weight, bias

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor:
        for step in self.steps[:-1]:
            base = _StepBase(step, base)
        return self.steps[-1].activation(x, base)


class _SharedBase:
    """``base`` that computes ``base(x)`` once per input tensor (the steps of a sum all call it)."""

    __slots__ = ("_base", "_last")

    def __init__(self, base: BaseLayer) -> None:
        self._base = base
        self._last: tuple[Tensor, Tensor] | None = None

    @property
    def training(self) -> bool:
        return getattr(self._base, "training", False)

    @property
    def weight(self) -> Tensor:
        return self._base.weight

    @property
    def bias(self) -> Tensor | None:
        return self._base.bias

    def __call__(self, x: Tensor) -> Tensor:
        if self._last is None or self._last[0] is not x:
            self._last = (x, self._base(x))
        return self._last[1]


class SumStep:
    """A weighted sum of the steps' deltas on one base: ``W + Σ_k w_k (W_eff_k − W)`` (combine).

    ``weights (K,)`` may require grad. Deltas are summed in at least fp32, then cast to the
    base dtype, so a bf16 base does not lose the small deltas to rounding.
    """

    __slots__ = ("changes_bias", "steps", "weights")

    def __init__(self, steps: Sequence[LayerStep], weights: Tensor) -> None:
        self.steps, self.weights = tuple(steps), weights
        self.changes_bias = any(step.changes_bias for step in self.steps)

    def _sum(self, base: Tensor, outs: Sequence[Tensor]) -> Tensor:
        ct = torch.promote_types(base.dtype, torch.float32)
        total = base.to(ct)
        for k, out in enumerate(outs):
            total = total + self.weights[k].to(ct) * (out.to(ct) - base.to(ct))
        return total.to(base.dtype)

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        merged = [step.weight(weight, bias) for step in self.steps]
        w_eff = self._sum(weight, [w for w, _ in merged])
        if bias is None or not self.changes_bias:
            return w_eff, bias
        return w_eff, self._sum(bias, [b for _, b in merged])  # type: ignore[misc]

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor:
        shared = _SharedBase(base)
        y = shared(x)
        return self._sum(y, [step.activation(x, shared) for step in self.steps])


def merged_weight(
    step: LayerStep, weight: Tensor, bias: Tensor | None, layout: str
) -> tuple[Tensor, Tensor | None]:
    """``(W_eff, b_eff)`` in the stored layout and the base dtype."""
    w_eff, b_eff = step.weight(canonical_weight(weight, layout), bias)
    return stored_weight(w_eff, layout), b_eff


class AdaptedWeight(Tensor):
    """Stand-in for one target weight in the lazy overlay (see module docstring)."""

    _weight: Tensor
    _bias: Tensor | None
    _step: LayerStep
    _layout: str
    _strict: bool
    _name: str
    _training: bool

    @staticmethod
    def __new__(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        step: LayerStep,
        *,
        layout: str,
        strict: bool,
        name: str,
        training: bool = False,
    ) -> AdaptedWeight:
        out = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            weight.shape,
            strides=weight.stride(),
            dtype=weight.dtype,
            device=weight.device,
            requires_grad=False,
        )
        out._weight, out._bias, out._step = weight, bias, step
        out._layout, out._strict, out._name, out._training = layout, strict, name, training
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"AdaptedWeight({self._name}, step={type(self._step).__name__}, shape={tuple(self._weight.shape)}, "
            f"dtype={self._weight.dtype})"
        )

    def merged(self) -> Tensor:
        """The dense merged weight, in the stored layout and base dtype."""
        return merged_weight(self._step, self._weight, self._bias, self._layout)[0]

    def _adapted(self, x: Tensor, bias: Tensor | None, call: Callable[[Tensor], Tensor]) -> Tensor:
        base = LayerCall(canonical_weight(self._weight, self._layout), bias, call, self._training)
        return self._step.activation(x, base)

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
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Reaching dispatch means an op bypassed __torch_function__ (a C++ path); computing
        # here would be below autograd and silently drop the adapter's gradients.
        raise RuntimeError(
            f"lazy overlay: {func} reached an adapted weight below autograd; use merge_overlay for this model"
        )


class AdaptedBias(AdaptedWeight):
    """Stand-in for the bias of a target whose variant changes the bias (IA3 scales it).

    Inside its layer's own op, paired with its weight's stand-in, it is the base bias (the
    activation form scales it); in any other op (a layer computing ``x @ W.T + b`` by hand) it is
    the merged ``b_eff``, as its weight there is ``W_eff``, or it raises when strict."""

    _pair: Any

    @staticmethod
    def __new__(cls, bias: Tensor, pair: AdaptedWeight, *, strict: bool, name: str) -> AdaptedBias:  # type: ignore[override]
        out = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, bias.shape, strides=bias.stride(), dtype=bias.dtype, device=bias.device, requires_grad=False
        )
        out._weight, out._bias, out._step, out._pair = bias, None, pair._step, pair
        out._layout, out._strict, out._name = "bias", strict, name
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"AdaptedBias({self._name}, shape={tuple(self._weight.shape)}, dtype={self._weight.dtype})"

    def merged(self) -> Tensor:
        """The merged bias ``b_eff``, in the base dtype."""
        return merged_bias(self._pair)


def merged_bias(pair: Any) -> Tensor:
    """``b_eff`` of the target whose weight is ``pair`` (a stand-in or a mode entry)."""
    return merged_weight(pair._step, pair._weight, pair._bias, pair._layout)[1]  # type: ignore[return-value]


_STANDINS = (AdaptedWeight, AdaptedBias)


def _standin_of(value: Any) -> AdaptedWeight | None:
    return value if type(value) in (AdaptedWeight, AdaptedBias) else None


class _Adapted(Protocol):
    """What the router needs of an adapted weight: a stand-in, or a mode's entry."""

    _weight: Tensor
    _layout: str
    _strict: bool
    _name: str

    def merged(self) -> Tensor: ...

    def _adapted(self, x: Tensor, bias: Tensor | None, call: Callable[[Tensor], Tensor]) -> Tensor: ...


def _route(func: Any, args: tuple, kwargs: dict, find: Callable[[Any], _Adapted | None]) -> Any:
    """``func(*args, **kwargs)`` where ``find`` tells which values are adapted weights: the
    layer's own op on one (:func:`lora_func._routing.weight_use`) takes the low-rank path; any
    other op gets the dense merged weight, or raises when the weight is strict."""
    use = weight_use(func, args, kwargs, find)
    if use is not None:
        w = use.entry
        return w._adapted(use.x, use.bias, lambda x_: use.replay(x_, w._weight))
    found = found_weights(args, kwargs, find)
    if any(a._strict for a in found):
        raise RuntimeError(
            f"lazy overlay (strict): {getattr(func, '__name__', func)} on adapted weight(s) {sorted({a._name for a in found})} "
            f"has no low-rank path; use merge_overlay (merged weights) or overlay(..., strict=False) to fall back "
            f"to the dense merged weight"
        )
    if found:
        args, kwargs = replace_weights(args, kwargs, find, lambda a: a.merged())
    return func(*args, **kwargs)


class _ModeEntry:
    """One target weight of :class:`AdaptedCalls`: the base tensor itself, found by identity."""

    __slots__ = ("_bias", "_layout", "_name", "_step", "_strict", "_training", "_weight")

    def __init__(
        self, weight: Tensor, bias: Tensor | None, step: LayerStep, *, layout: str, strict: bool, name: str, training: bool = False
    ) -> None:
        self._weight, self._bias, self._step = weight, bias, step
        self._layout, self._strict, self._name, self._training = layout, strict, name, training

    merged = AdaptedWeight.merged
    _adapted = AdaptedWeight._adapted


class _BiasEntry:
    """The bias of a target of :class:`AdaptedCalls` whose variant changes it (see AdaptedBias)."""

    __slots__ = ("_layout", "_name", "_pair", "_strict", "_weight")

    def __init__(self, bias: Tensor, pair: _ModeEntry, *, strict: bool, name: str) -> None:
        self._weight, self._pair, self._layout, self._strict, self._name = bias, pair, "bias", strict, name

    def merged(self) -> Tensor:
        return merged_bias(self._pair)


class AdaptedCalls(TorchFunctionMode):
    """The lazy overlay as a torch-function mode, for code that ``torch.compile`` traces.

    Dynamo cannot trace the creation of :class:`AdaptedWeight` stand-ins
    (``Tensor._make_wrapper_subclass``), but it traces torch-function modes. So the model gets
    its own base tensors, and while the mode is active the layer's own op on a target weight
    (found by identity) takes the same low-rank path a stand-in would, and any other op on it
    gets the dense merged weight (or raises when ``strict``): the same semantics as
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
