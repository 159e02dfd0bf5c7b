"""Layer ops: what the overlays apply to one target layer.

A :class:`LayerOp` is one variant's adapter on one layer (:class:`VariantOp`) or several
combined: applied in order (:class:`ChainOp`, from ``compose``) or as a weighted sum of
deltas (:class:`SumOp`, from ``combine``). Each op has a weight form (``W -> W_eff``, used
by the merged path: :func:`merged_weight`) and an activation form (``x -> y`` given the base
layer, used by the lazy stand-ins of :mod:`lora_func._lazy`, the module-call route and the
mixed route). An adapter tree node says how its parts' ops combine
(``AdapterNode.layer_op``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from lora_func.targeting import EXPERT_LAYOUTS, canonical_weight, stored_weight
from lora_func.variants import BaseLayer, LayerInfo, TensorDict, Variant
from lora_func.variants._contract import RANK_ALPHA, RANK_MASK, padded_member, refuse_merge
from lora_func.variants._kernels import promoted

__all__ = ["ActivationTap", "ChainOp", "ExpertsOp", "LayerCall", "LayerOp", "Recorder", "SumOp", "TapInput", "TapOutputGrad", "VariantOp", "activation_tap", "has_kind_form", "merged_weight", "variant_op"]

# ------------------------------------------------------------------ the activation tap
# lora_func.privacy's ghost clipping needs each adapted layer's input and output gradient, and
# to know when an adapter tensor reaches the model another way (a merged weight). A tap,
# installed for one call in one thread by activation_tap, sees every VariantOp's activation
# (step, x, base, y) and returns the y to use (an identity that records), and every weight form
# (step). Both routes (stand-ins and module calls) and every merge reach a variant through
# VariantOp.activation or VariantOp.weight, so these are the two places. TapInput /
# TapOutputGrad are the recording identity both recording taps put a layer's output through.
_tap_state = threading.local()
_tap_users = 0  # taps installed in any thread: a plain int, so that compiled code guards on 0


class ActivationTap(Protocol):
    """What :func:`activation_tap` installs."""

    def activation(self, step: VariantOp, x: Tensor, base: BaseLayer, y: Tensor) -> Tensor:
        """The ``y`` to use for ``step``'s activation ``y = form(x, base)``."""
        ...

    def weight(self, step: VariantOp) -> None:
        """``step``'s weight form is running (its tensors reach the model through a merged weight)."""
        ...


@contextlib.contextmanager
def activation_tap(tap: ActivationTap) -> Iterator[None]:
    """Show ``tap`` every variant activation and weight form in this thread for the block
    (taken off in ``finally``)."""
    global _tap_users
    previous = getattr(_tap_state, "tap", None)
    _tap_state.tap = tap
    _tap_users += 1
    try:
        yield
    finally:
        _tap_users -= 1
        _tap_state.tap = previous


class Recorder(Protocol):
    """What :class:`TapInput` / :class:`TapOutputGrad` report to (an activation tap that records
    per-example layer inputs and output gradients: ghost clipping, EK-FAC's covariances)."""

    def record_input(self, name: str, x: Tensor) -> int:
        """Keep layer ``name``'s input ``x`` (batch first, detached); returns its index."""
        ...

    def output_grad(self, name: str, index: int, grad: Tensor) -> None:
        """Layer ``name``'s output gradient (batch first) for its input number ``index``."""
        ...


def _batch_first(t: Tensor, dim: int | None, size: int) -> Tensor:
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


class TapInput(torch.autograd.Function):
    """``TapInput.apply(x, y, anchor, recorder, name)``: ``y`` unchanged. Its ``vmap`` rule sees
    the batched tensors themselves: it hands ``recorder`` the layer input ``x`` (batch first)
    and puts ``y`` through :class:`TapOutputGrad`, whose backward hands it the per-example output
    gradient. Outside ``vmap`` nothing is recorded (the caller checks)."""

    @staticmethod
    def forward(x: Tensor, y: Tensor, anchor: Tensor | None, recorder: Recorder, name: str) -> Tensor:
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None, None]:
        return None, grad, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, y: Tensor, anchor: Tensor | None, recorder: Recorder, name: str) -> tuple[Tensor, int]:
        index = recorder.record_input(name, _batch_first(x, in_dims[0], info.batch_size).detach())
        # y keeps its layout (where vmap put the batch): moving it would make later views copy.
        dim = in_dims[1]
        if dim is None:
            y, dim = y.expand(info.batch_size, *y.shape), 0
        return TapOutputGrad.apply(y, anchor, recorder, name, index, dim), dim


class TapOutputGrad(torch.autograd.Function):
    """``TapOutputGrad.apply(y, anchor, recorder, name, index, dim)``: identity on ``y`` (batch
    on dim ``dim``) whose backward hands ``recorder`` the output gradient, batch first. A 0-d
    ``anchor`` that requires grad (or ``None``) makes the one backward, asked for the anchor's
    gradient, reach every tapped layer even where nothing before it needs a gradient."""

    @staticmethod
    def forward(y: Tensor, anchor: Tensor | None, recorder: Recorder, name: str, index: int, dim: int) -> Tensor:
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.recorder, ctx.name, ctx.index, ctx.dim = inputs[2:]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:
        with torch.no_grad():
            ctx.recorder.output_grad(ctx.name, ctx.index, grad.detach().movedim(ctx.dim, 0))
        return grad, None, None, None, None, None


class LayerCall:
    """The frozen base layer as a variant's activation form sees it (a ``BaseLayer``).

    ``weight`` is the canonical ``(d_out, d_in)`` view, ``bias`` the bias the model passed;
    calling it replays the model's own op with the base weight. ``training``: whether this is a
    training step (the adapter's dropout acts then only).
    """

    __slots__ = ("_call", "bias", "replay", "training", "weight")

    # Calling it is exactly ``x @ weight.T + bias`` on a plain weight: the base-dtype low-rank
    # path (lora_func.variants._kernels.base_plus_product) may compute the input gradient from ``weight``.
    replays_weight = True

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        call: Callable[[Tensor], Tensor],
        training: bool = False,
        replay: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self._call = call
        self.training = training
        # The layer's op with another stored table (an embedding's lookup: Variant.kind_forms).
        self.replay = replay

    def __call__(self, x: Tensor) -> Tensor:
        return self._call(x)


class LayerOp(Protocol):
    """What the overlays apply to one target layer: a variant, or several combined.

    ``weight(W (d_out, d_in), b (d_out,) | None) -> (W_eff, b_eff)`` takes and returns the
    canonical layout in the base dtype; ``activation(x (..., d_in), base) -> y (..., d_out)``
    must equal ``x @ W_effᵀ + b_eff`` for the ``W``, ``b`` and map of ``base``.
    """

    changes_bias: bool

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]: ...

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor: ...


class VariantOp:
    """One variant's adapter on one layer; the forms run in the adapter ``dtype``."""

    __slots__ = ("buffers", "changes_bias", "dtype", "form", "info", "params", "variant")

    def __init__(
        self, variant: Variant, params: TensorDict, buffers: TensorDict, info: LayerInfo, dtype: torch.dtype, kind: str = "linear"
    ) -> None:
        # A member of a rank-padded stack is presented as one adapter (the contract's view).
        params, buffers, info = padded_member(params, buffers, info, variant.rank_axes)
        self.variant, self.params, self.buffers, self.info, self.dtype = variant, params, buffers, info, dtype
        self.changes_bias = variant.changes_bias
        # The activation form of the target's kind (an embedding's gather: Variant.kind_forms).
        self.form = variant.kind_forms.get(kind) or variant.activation_form

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if not self.variant.merges:
            refuse_merge(self.variant.name)
        tap = getattr(_tap_state, "tap", None) if _tap_users else None
        if tap is not None:
            tap.weight(self)
        # Never below the base's precision: a bf16 adapter on an fp32 base would otherwise
        # round the frozen weight itself to bf16 (2.8e-2 off peft's merge, which adds the
        # delta to the fp32 weight). Above it (fp32 adapter, bf16 base) the adapter dtype.
        dtype = promoted(self.dtype, weight.dtype)
        params = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.params.items()}
        buffers = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.buffers.items()}
        w_eff, b_eff = self.variant.weight_form(
            params, buffers, weight.to(dtype), None if bias is None else bias.to(dtype), self.info
        )
        return w_eff.to(weight.dtype), None if b_eff is None or bias is None else b_eff.to(bias.dtype)

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor:
        y = self.form(self.params, self.buffers, x, base, self.info)
        tap = getattr(_tap_state, "tap", None) if _tap_users else None
        return y if tap is None else tap.activation(self, x, base, y)


class _OpBase:
    """``base`` with ``op`` applied: the base layer that the next op of a chain sees.
    Its ``weight``/``bias`` (the merged effective ones) are only computed if a form reads
    them (DoRA's norm), so a chain of low-rank ops stays lazy."""

    __slots__ = ("_bias", "_inner", "_op", "_weight")

    def __init__(self, op: LayerOp, inner: BaseLayer) -> None:
        self._op, self._inner = op, inner
        self._weight: Tensor | None = None
        self._bias: Tensor | None = None

    @property
    def training(self) -> bool:
        return getattr(self._inner, "training", False)

    def _merge(self) -> None:
        if self._weight is None:
            self._weight, self._bias = self._op.weight(self._inner.weight, self._inner.bias)

    @property
    def weight(self) -> Tensor:
        self._merge()
        return cast(Tensor, self._weight)  # set by _merge

    @property
    def bias(self) -> Tensor | None:
        if not self._op.changes_bias:
            return self._inner.bias
        self._merge()
        return self._bias

    def __call__(self, x: Tensor) -> Tensor:
        return self._op.activation(x, self._inner)


class ChainOp:
    """Steps applied in order: each sees the previous ones' effective weight (compose)."""

    __slots__ = ("changes_bias", "ops")

    def __init__(self, ops: Sequence[LayerOp]) -> None:
        self.ops = tuple(ops)
        self.changes_bias = any(op.changes_bias for op in self.ops)

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        for op in self.ops:
            weight, bias = op.weight(weight, bias)
        return weight, bias

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor:
        for op in self.ops[:-1]:
            base = _OpBase(op, base)
        return self.ops[-1].activation(x, base)


class _SharedBase:
    """``base`` that computes ``base(x)`` once per input tensor (the ops of a sum all call it)."""

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


class SumOp:
    """A weighted sum of the ops' deltas on one base: ``W + Σ_k w_k (W_eff_k − W)`` (combine).

    ``weights (K,)`` may require grad. Deltas are summed in at least fp32, then cast to the
    base dtype, so a bf16 base does not lose the small deltas to rounding.
    """

    __slots__ = ("changes_bias", "ops", "weights")

    def __init__(self, ops: Sequence[LayerOp], weights: Tensor) -> None:
        self.ops, self.weights = tuple(ops), weights
        self.changes_bias = any(op.changes_bias for op in self.ops)

    def _sum(self, base: Tensor, outs: Sequence[Tensor]) -> Tensor:
        ct = promoted(base.dtype, torch.float32)
        total = base.to(ct)
        for k, out in enumerate(outs):
            total = total + self.weights[k].to(ct) * (out.to(ct) - base.to(ct))
        return total.to(base.dtype)

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        merged = [op.weight(weight, bias) for op in self.ops]
        w_eff = self._sum(weight, [w for w, _ in merged])
        if bias is None or not self.changes_bias:
            return w_eff, bias
        return w_eff, self._sum(bias, [cast(Tensor, b) for _, b in merged])  # each op keeps a bias it was given

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor:
        shared = _SharedBase(base)
        y = shared(x)
        return self._sum(y, [op.activation(x, shared) for op in self.ops])


class ExpertsOp:
    """One variant's adapter on a 3-D expert parameter: its forms run per expert.

    ``params`` / ``buffers`` are the layer's own tensors, each with a leading expert axis ``E``;
    ``shared_params`` / ``shared_buffers`` (the adapter's shared tensors, a rank-padded stack's
    mask and alphas) have none and every expert reads them. ``weight(W (E, d_out, d_in), None)``
    maps the variant's weight form over the experts (``torch.func.vmap``), so a member of a
    rank-padded stack is presented per expert exactly as on a matrix (:class:`VariantOp`).
    Applied through the merged weight (the experts' op is a per-expert loop or a grouped matmul,
    not one layer call).
    """

    __slots__ = ("buffers", "dtype", "info", "params", "shared_buffers", "shared_params", "variant")
    changes_bias = False

    def __init__(
        self,
        variant: Variant,
        params: TensorDict,
        buffers: TensorDict,
        shared_params: TensorDict,
        shared_buffers: TensorDict,
        info: LayerInfo,
        dtype: torch.dtype,
    ) -> None:
        self.variant, self.params, self.buffers, self.info, self.dtype = variant, params, buffers, info, dtype
        self.shared_params, self.shared_buffers = shared_params, shared_buffers

    def weight(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        shared_params, shared_buffers, variant, info, dtype = self.shared_params, self.shared_buffers, self.variant, self.info, self.dtype

        def one(params: TensorDict, buffers: TensorDict, w: Tensor) -> Tensor:
            op = VariantOp(variant, shared_params | params, shared_buffers | buffers, info, dtype)
            return op.weight(w, None)[0]

        return torch.func.vmap(one)(self.params, self.buffers, weight), bias

    def activation(self, x: Tensor, base: BaseLayer) -> Tensor:
        # Per expert x (E, n, d_in) -> (E, n, d_out) through the merged weights (the overlays
        # never call it: they apply an expert parameter by its merged weight).
        return x @ self.weight(base.weight, None)[0].transpose(-1, -2)


def variant_op(
    variant: Variant,
    own: tuple[TensorDict, TensorDict],
    shared: tuple[TensorDict, TensorDict],
    info: LayerInfo,
    dtype: torch.dtype,
    *,
    layout: str = "linear",
) -> LayerOp:
    """One variant's layer op on one layer (stored ``layout``) from the layer's ``own`` ``(params,
    buffers)`` and the adapter's ``shared`` ones: a :class:`VariantOp`, or on an expert
    parameter an :class:`ExpertsOp` (a rank-padded stack's mask and alphas have no expert
    axis: every expert reads them, as the shared tensors)."""
    (params, buffers), (shared_params, shared_buffers) = own, shared
    if layout not in EXPERT_LAYOUTS:
        return VariantOp(variant, shared_params | params, shared_buffers | buffers, info, dtype, kind=layout)
    per_expert = {n: t for n, t in buffers.items() if n not in (RANK_MASK, RANK_ALPHA)}
    every = shared_buffers | {n: t for n, t in buffers.items() if n not in per_expert}
    return ExpertsOp(variant, params, per_expert, shared_params, every, info, dtype)


def has_kind_form(op: LayerOp, kind: str) -> bool:
    """Whether ``op`` computes on a target of ``kind`` without its merged weight: every variant
    in it has an activation form for the kind (``Variant.kind_forms``)."""
    if isinstance(op, VariantOp):
        return op.variant.kind_forms.get(kind) is not None
    if isinstance(op, (ChainOp, SumOp)):
        return all(has_kind_form(part, kind) for part in op.ops)
    return False


def merged_weight(
    op: LayerOp, weight: Tensor, bias: Tensor | None, layout: str
) -> tuple[Tensor, Tensor | None]:
    """``(W_eff, b_eff)`` in the stored layout and the base dtype."""
    w_eff, b_eff = op.weight(canonical_weight(weight, layout), bias)
    return stored_weight(w_eff, layout, weight.shape), b_eff
