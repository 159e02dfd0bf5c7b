"""The variant contract: what one variant file provides, and what the core hands it.

A variant is a handful of pure functions of explicit tensors. It never sees an
``nn.Module``: the core hands it the frozen base weight in the canonical ``(d_out, d_in)``
layout (transposed views for GPT-2 ``Conv1D``), a :class:`LayerInfo` of static facts, and,
in the activation form, a :class:`BaseLayer` that replays the model's own op, so one
implementation serves both layer kinds and both application routes.

The public names are re-exported by :mod:`lora_func.variants`; the low-rank kernels that the
built-in variants share (LoRA's forms, the dropout input, the base-dtype product) live in
``lora_func._kernels``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "ActivationFn",
    "BaseLayer",
    "InitFn",
    "LayerInfo",
    "RANK_ALPHA",
    "RANK_MASK",
    "TensorDict",
    "Variant",
    "WeightFn",
    "layer_alpha",
    "layer_rank",
]

TensorDict = dict[str, Tensor]
"""A variant's tensors of one layer by short name (``{"lora_A": (r, d_in), ...}``)."""

# Buffers that stack() adds to every layer of a rank-padded stack (adapters of different
# ranks): a 0/1 mask over the padded rank axis and each member's own alpha, so a member keeps
# its own scale (alpha / r) under vmap, where r can only be a tensor. Forms read them through
# layer_rank / layer_alpha, never by name.
RANK_MASK = "rank_mask"
RANK_ALPHA = "rank_alpha"


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """Static (hashable, non-tensor) facts about one adapted layer.

    Attributes:
      d_in: input features of the layer.
      d_out: output features of the layer.
      r: the adapter rank for this layer (variants without a rank ignore it). Inside a
        rank-padded stack it is the padded rank: forms read the member's own with
        :func:`layer_rank`.
      alpha: the scaling hyperparameter (``s = alpha / r`` for LoRA); read it with
        :func:`layer_alpha`.
      has_bias: whether the base layer has a bias.
      options: the variant's resolved options, as sorted ``(name, value)`` pairs.
    """

    d_in: int
    d_out: int
    r: int
    alpha: float
    has_bias: bool
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str) -> Any:
        """The resolved value of the variant option ``name``."""
        for key, value in self.options:
            if key == name:
                return value
        raise KeyError(f"LayerInfo has no option {name!r}; options are {sorted(k for k, _ in self.options)}")  # error: layerinfo-option


class BaseLayer(Protocol):
    """The frozen base layer as the activation form sees it.

    Attributes:
      weight: ``(d_out, d_in)`` canonical view of the frozen weight, base dtype.
      bias: ``(d_out,)`` or ``None``.
      training: whether the call is a training step (the adapter's dropout acts then only);
        a base layer without the attribute counts as not training.
    Calling it maps ``x (..., d_in) -> (..., d_out)`` with exactly the model's own op
    (``F.linear`` for nn.Linear, ``addmm``/``matmul`` for GPT-2 Conv1D), bias included.
    """

    weight: Tensor
    bias: Tensor | None

    def __call__(self, x: Tensor) -> Tensor: ...


class InitFn(Protocol):
    """A variant's ``init`` for one layer: ``(weight (d_out, d_in), bias (d_out,) | None, info,
    *, dtype, generator, calibration) -> (params, buffers)``. See :class:`Variant`."""

    def __call__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        info: LayerInfo,
        *,
        dtype: torch.dtype,
        generator: torch.Generator,
        calibration: Any = None,
    ) -> tuple[TensorDict, TensorDict]: ...


WeightFn = Callable[[TensorDict, TensorDict, Tensor, "Tensor | None", LayerInfo], "tuple[Tensor, Tensor | None]"]
"""``(params, buffers, W (d_out, d_in), b (d_out,) | None, info) -> (W_eff, b_eff)``."""
ActivationFn = Callable[[TensorDict, TensorDict, Tensor, BaseLayer, LayerInfo], Tensor]
"""``(params, buffers, x (..., d_in), base, info) -> y (..., d_out)``."""


@dataclasses.dataclass(frozen=True, repr=False)
class Variant:
    """One adapter variant, as pure functions: what a variant file defines as ``VARIANT``.

    Every function is a pure function of explicit tensors: no global RNG (draws come from
    the ``generator``), no ``.item()`` or other value-dependent Python branching, no in-place
    writes to its inputs, so that ``torch.func`` transforms and ``torch.compile`` see through it.

    Attributes:
      name: registry name (``AdapterSpec(variant=name)``).
      init: ``(weight (d_out, d_in), bias (d_out,) | None, info, *, dtype, generator,
        calibration) -> (params, buffers)`` for one layer: the trainable tensors and the fixed
        ones, by short name. ``weight`` is in the base dtype; random draws use the given CPU
        ``generator``; outputs are in ``dtype`` on the weight's device.
      weight_form: ``(params, buffers, W (d_out, d_in), b (d_out,) | None, info) ->
        (W_eff, b_eff)``. ``W`` and ``b`` arrive in the adapter dtype; the core casts the
        result back to the base dtype.
      activation_form: ``(params, buffers, x (..., d_in), base, info) -> y (..., d_out)``,
        ``y`` in the dtype of ``base(x)``; must equal ``x @ W_eff.T + b_eff`` (the contract
        tests check it), computed without building ``W_eff`` where the math allows.
      options: accepted options and their defaults (the type of the default is enforced).
      default_alpha: ``alpha`` when the spec leaves it ``None``.
      uses_rank: whether ``r`` means anything (IA3 does not use it).
      changes_bias: whether ``b_eff`` can differ from ``b``.
      rank_axes: for each trainable/buffer tensor that has a rank axis, which axis (or axes:
        a ``(r, r)`` rotation generator has two). :func:`lora_func.stack` zero-pads these axes
        to stack adapters of different ranks, and the core multiplies them by the rank mask.
        Forms that use ``r`` must read it with :func:`layer_rank` (and ``alpha`` with
        :func:`layer_alpha`), which are tensors inside a rank-padded stack.
      check_options: optional ``options -> None`` that raises ``ValueError`` on bad values.
      records_base: the adapter depends on the exact base weights it was built from (PiSSA
        and AntiPaSTO residuals): the core stores a fingerprint of each target's base
        weight, and ``load(..., model=)`` refuses a model whose weights differ.
      replaces_weight: the weight form discards ``W`` (PiSSA's ``W_res + s·BA``, ``W_res`` fixed
        at init), so :func:`lora_func.compose` refuses it after another part on the same layer.
      calibrate: data-driven variants only (EVA). ``(layer_inputs, infos, *, generator) ->
        {module name: (LayerInfo, payload)}``. ``layer_inputs`` is an iterator that yields,
        per calibration batch, ``{module name: rows (n, d_in)}``: the target layers' inputs
        with padding (``attention_mask == 0``) and ``labels == -100`` token rows removed;
        ``infos`` maps module name to the spec's ``LayerInfo``. The returned ``LayerInfo``
        may change ``r`` and ``alpha`` per layer; a module left out gets no adapter;
        ``payload`` reaches that layer's ``init`` as ``calibration``.
    """

    name: str
    init: InitFn
    weight_form: WeightFn
    activation_form: ActivationFn
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    default_alpha: float = 8.0
    uses_rank: bool = True
    changes_bias: bool = False
    rank_axes: Mapping[str, int | tuple[int, ...]] = dataclasses.field(default_factory=dict)
    check_options: Callable[[Mapping[str, Any]], None] | None = None
    records_base: bool = False
    replaces_weight: bool = False
    calibrate: Callable[..., dict[str, tuple[LayerInfo, Any]]] | None = None

    def __repr__(self) -> str:
        # The functions' reprs would fill a screen; the name identifies the variant.
        return f"Variant({self.name!r})"


def layer_rank(info: LayerInfo, buffers: TensorDict | None = None) -> int | Tensor:
    """The layer's rank: ``info.r``, or inside a rank-padded stack the member's own rank (a
    0-d tensor in the adapter dtype (at least fp32), the sum of its rank mask)."""
    if buffers is not None and RANK_MASK in buffers:
        return buffers[RANK_MASK].sum(-1)
    return info.r


def layer_alpha(info: LayerInfo, buffers: TensorDict | None = None) -> float | Tensor:
    """The layer's ``alpha``: ``info.alpha``, or the member's own inside a rank-padded stack."""
    if buffers is not None and RANK_ALPHA in buffers:
        return buffers[RANK_ALPHA]
    return info.alpha
