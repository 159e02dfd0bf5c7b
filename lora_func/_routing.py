"""Which op consumes a target weight, and in which layout: the one table every interception reads.

lora_func meets a target layer in four places, and all four ask this module:

- the lazy stand-ins (:class:`lora_func._lazy.AdaptedWeight`) and the compile-time mode
  (:class:`lora_func._lazy.AdaptedCalls`) see torch calls and ask :func:`weight_use` whether the
  call is the layer's own op on an adapted weight;
- the calibration recorder (:class:`lora_func.calibration.RecordingWeight`) asks the same
  question to find a layer's input;
- the module-call route (:mod:`lora_func.call`, and the per-row route of :mod:`lora_func.many`)
  sees the module's call itself and asks :func:`module_forward` for the layer's input, its base
  map and its merged map.

A layer's own op, per layout: ``F.linear(x, W, b)`` for ``nn.Linear`` (``W`` stored
``(d_out, d_in)``), ``torch.addmm(b, x, W)`` with ``beta == alpha == 1`` or
``torch.matmul(x, W)`` for transformers' GPT-2 ``Conv1D`` (``W`` stored ``(d_in, d_out)``), and
``F.embedding(ids, W, ...)`` for ``nn.Embedding`` (``W`` stored ``(num_embeddings, dim)``; ``x``
is then the ids, and ``replay(ids, T)`` looks them up in another table ``T``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["LayoutForward", "WeightStandIn", "WeightUse", "module_forward", "module_replay", "replace_weights", "weight_use"]


class WeightStandIn(Tensor):
    """Base of the wrapper tensors that stand in for a target weight (the lazy overlay's, the
    calibration recorder's): each intercepts the weight's uses in ``__torch_function__``, holds
    the real weight as ``_weight``, and declares here, once, what an op that reaches torch's
    dispatch below autograd does (:meth:`below_autograd`)."""

    _weight: Tensor

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:  # type: ignore[override]  # torch's stub is a plain function
        return cls.below_autograd(func, args, kwargs or {})

    @classmethod
    def below_autograd(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op that bypassed ``__torch_function__`` (a C++ path): by default computed on the
        real weights; a subclass for which that would be wrong (it drops gradients) refuses."""
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._weight, (args, kwargs))
        return func(*args, **kwargs)


class Entry(Protocol):
    """What the table needs of an adapted weight: the layout of the layer it belongs to."""

    _layout: str
    _weight: Tensor


class WeightUse(NamedTuple):
    """The layer's own op on an adapted weight, taken apart.

    ``entry`` is the adapted weight found; ``x`` the layer input as the op sees it (``(..., d_in)``
    for ``F.linear``, ``(n, d_in)`` for ``addmm``); ``bias`` the bias the op adds (or ``None``);
    ``replay(x, W)`` the same op, same bias and options, with another input and stored weight.
    """

    entry: Any
    x: Tensor
    bias: Tensor | None
    replay: Callable[[Tensor, Tensor], Tensor]


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict, **defaults: Any) -> dict[str, Any]:
    bound = dict(defaults)
    bound.update(zip(names, args, strict=False))
    extra = args[len(names) :]
    for name, value in zip(tuple(defaults), extra, strict=False):
        bound[name] = value
    bound.update(kwargs)
    return bound


def weight_use(func: Any, args: tuple, kwargs: dict, find: Callable[[Any], Entry | None]) -> WeightUse | None:
    """The layer's own op on an adapted weight, or ``None`` when ``func`` is any other call.

    ``find(value)`` returns the adapted weight that ``value`` is (a stand-in, a mode's entry, a
    recorder), or ``None``. An op whose input or bias is itself adapted is not a layer's op.
    """
    if func is F.linear:
        bound = _bind(("input", "weight", "bias"), args, kwargs, bias=None)
        x, w = bound["input"], find(bound["weight"])
        b = _own_bias(bound["bias"], w, find)
        if w is not None and w._layout == "linear" and find(x) is None and b is not _NOT_OWN:
            return WeightUse(w, x, b, lambda x_, w_: F.linear(x_, w_, b))
    elif func is torch.addmm:
        bound = _bind(("input", "mat1", "mat2"), args, kwargs, beta=1, alpha=1)
        x, w = bound["mat1"], find(bound["mat2"])
        b = _own_bias(bound["input"], w, find)
        if w is not None and w._layout == "conv1d" and bound["beta"] == 1 and bound["alpha"] == 1 and find(x) is None and b is not _NOT_OWN:
            return WeightUse(w, x, b, lambda x_, w_: torch.addmm(b, x_, w_))
    elif func is F.embedding:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        bound = _bind(names, args, kwargs, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False)
        x, w = bound["input"], find(bound["weight"])
        # max_norm renormalises the table in place: that lookup gets the merged table instead.
        if w is not None and w._layout == "embedding" and find(x) is None and bound["max_norm"] is None:
            options = {name: bound[name] for name in names[2:]}
            return WeightUse(w, x, None, lambda x_, w_: F.embedding(x_, w_, **options))
    elif func in (torch.matmul, Tensor.matmul, Tensor.__matmul__):
        bound = _bind(("input", "other"), args, kwargs)
        x, w = bound["input"], find(bound["other"])
        if w is not None and w._layout == "conv1d" and find(x) is None:
            return WeightUse(w, x, None, lambda x_, w_: torch.matmul(x_, w_))
    return None


_NOT_OWN = object()


def _own_bias(value: Any, weight: Any, find: Callable[[Any], Entry | None]) -> Any:
    """The bias a layer's op adds: a plain tensor (or ``None``) as it is; the adapted stand-in
    of ``weight``'s own bias as the base bias it stands for; anything else adapted: ``_NOT_OWN``."""
    entry = find(value)
    if entry is None:
        return value
    return entry._weight if getattr(entry, "_pair", None) is weight and weight is not None else _NOT_OWN


def found_weights(args: tuple, kwargs: dict, find: Callable[[Any], Entry | None]) -> list[Any]:
    """Every adapted weight among a call's arguments."""
    return [a for a in map(find, pytree.tree_leaves((args, kwargs))) if a is not None]


def replace_weights(args: tuple, kwargs: dict, find: Callable[[Any], Any], replace: Callable[[Any], Tensor]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every adapted weight ``w`` replaced by ``replace(w)``."""
    return pytree.tree_map(lambda v: v if find(v) is None else replace(find(v)), (args, kwargs))


class LayoutForward(NamedTuple):
    """How the module-call route runs one plain layer of a layout.

    ``prepare(x) -> (x_op, finish)``: the input as the layer's op sees it, and how to shape the
    op's output back (``Conv1D`` flattens to ``(n, d_in)`` and views the result back);
    ``merged(x_op, W, b)``: the op with a given stored weight and bias.
    """

    prepare: Callable[[Tensor, int], tuple[Tensor, Callable[[Tensor], Tensor]]]
    merged: Callable[[Tensor, Tensor, Tensor | None], Tensor]


def _linear_prepare(x: Tensor, d_out: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    return x, lambda y: y


def _conv1d_prepare(x: Tensor, d_out: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    # Exactly transformers' Conv1D.forward, so both routes run the same kernels on the same shapes.
    size_out = (*x.size()[:-1], d_out)
    return x.view(-1, x.size(-1)), lambda y: y.view(size_out)


def _conv1d_merged(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.addmm(bias, x, weight) if bias is not None else torch.matmul(x, weight)


_LAYOUTS = {
    "linear": LayoutForward(_linear_prepare, lambda x, w, b: F.linear(x, w, b)),
    "conv1d": LayoutForward(_conv1d_prepare, _conv1d_merged),
    # x: the ids; the merged map is a lookup in the merged table (a frozen table's gradient
    # options do not matter for its values).
    "embedding": LayoutForward(_linear_prepare, lambda ids, w, b: F.embedding(ids, w)),
}


def module_replay(module: Any) -> Callable[[Tensor, Tensor], Tensor] | None:
    """An ``nn.Embedding``'s lookup with its options in another table (``LayerCall.replay``), or
    ``None`` for another layer."""
    if not isinstance(module, torch.nn.Embedding):
        return None
    options = (module.padding_idx, module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse)
    return lambda ids, table: F.embedding(ids, table, *options)


def module_forward(layout: str) -> LayoutForward:
    """The module-call route's forward of a plain layer with stored ``layout``."""
    return _LAYOUTS[layout]

