"""The variant contract: what one variant file provides, and what the core hands it.

A variant is a handful of pure functions of explicit tensors. It never sees an
``nn.Module``: the core hands it the frozen base weight in the canonical ``(d_out, d_in)``
layout (transposed views for GPT-2 ``Conv1D``), a :class:`LayerInfo` of static facts, and,
in the activation form, a :class:`BaseLayer` that replays the model's own op, so one
implementation serves both layer kinds and both application routes.

A variant that HF peft also has says how it is stored in peft's checkpoint format with
``Variant(peft=PeftFormat(...))``: its peft method (:class:`PeftMethod`), the key suffix of
each tensor, the shapes checked on load, the config fields it writes and reads, and any
conversion. ``lora_func.io.peft`` is a generic reader/writer driven by these entries; peft
shapes adapter tensors in feature terms on GPT-2 ``Conv1D`` too, so an entry holds for both
layer kinds.

The public names are re-exported by :mod:`lora_func.variants`; the low-rank kernels that the
built-in variants share (LoRA's forms, the dropout input, the base-dtype product) live in
``lora_func._kernels``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

import torch
from torch import Tensor

__all__ = [
    "RANK_ALPHA",
    "RANK_MASK",
    "ActivationFn",
    "BaseLayer",
    "InitFn",
    "LayerInfo",
    "LowRank",
    "PeftFormat",
    "PeftLayer",
    "PeftMethod",
    "TensorDict",
    "Variant",
    "WeightFn",
    "is_finite_number",
    "layer_alpha",
    "layer_rank",
    "padded_member",
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
      r: the adapter rank for this layer (variants without a rank ignore it). A form called
        on a member of a rank-padded stack gets the member's own (a 0-d tensor, see
        :func:`padded_member`): ``info.alpha / info.r`` is right there too.
      alpha: the scaling hyperparameter (``s = alpha / r`` for LoRA); a member's own in a
        rank-padded stack, as ``r``.
      has_bias: whether the base layer has a bias.
      options: the variant's resolved options, as sorted ``(name, value)`` pairs.
      kernel: a conv target's kernel size (``"conv"`` kind: the stored weight is ``(d_out,
        d_in // prod(kernel), *kernel)``, the canonical view its ``(d_out, d_in)`` flattening);
        ``()`` on every other kind.
      position: the layer's index among the adapter's targets, in the model's module order
        (``named_modules``, peft's target order): which slice of a shared tensor a layer reads,
        or a per-layer seed (TinyLoRA's ``projection_seed + position``).
      layout: ``(d_in, d_out, r)`` of every target of the adapter, in that order (the same tuple
        object in every layer's info): where a layer sits in a concatenation of all the layers'
        tensors (UniLoRA's one index assignment over every layer). ``()`` for a layer built
        alone (tests, one-layer tools): then the layer is the adapter's only one.
        ``position`` and ``layout`` are set by whoever builds an adapter's infos
        (:meth:`numbered`), are derived from the saved layers' order and never saved.
    """

    d_in: int
    d_out: int
    r: int
    alpha: float
    has_bias: bool
    options: tuple[tuple[str, Any], ...] = ()
    kernel: tuple[int, ...] = ()
    position: int = 0
    layout: tuple[tuple[int, int, int], ...] = ()

    @property
    def count(self) -> int:
        """The number of the adapter's targets (1 for a layer built alone)."""
        return max(1, len(self.layout))

    @staticmethod
    def numbered(infos: Mapping[str, LayerInfo]) -> dict[str, LayerInfo]:
        """``infos`` (module name -> info, in the model's module order) with each one's
        :attr:`position` and the shared :attr:`layout` set."""
        layout = tuple((info.d_in, info.d_out, int(info.r)) for info in infos.values())
        return {m: dataclasses.replace(info, position=i, layout=layout) for i, (m, info) in enumerate(infos.items())}

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

    @property
    def weight(self) -> Tensor: ...

    @property
    def bias(self) -> Tensor | None: ...

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


def is_finite_number(value: Any) -> bool:
    """A JSON number that is finite (json reads ``NaN`` and ``1e999``), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------- HF peft's checkpoint format


@dataclasses.dataclass(frozen=True)
class PeftMethod:
    """One peft method (one ``peft_type``): what every checkpoint of it writes alike, whichever
    lora_func variant it holds. Variants stored as the same method share one ``PeftMethod``.

    Attributes:
      peft_type: peft's name of the method (``"LORA"``, ``"IA3"``, ...).
      fixed: config fields with one value for every checkpoint of the method.
      refused: config fields that change the math in ways lora_func does not have: a
        checkpoint with any of them set (truthy) is refused on load.
      rank_of: ``(tensor name, axis)`` that holds a layer's rank, written as ``r`` (and
        ``rank_pattern``) and checked against the config on load; ``None``: no rank.
      rank_multiple: the ``rank_of`` axis holds this many times the rank (PVeRA's ``λ_d``: 2r).
      rank_pattern: whether the method has per-layer ranks (``rank_pattern``), and alphas
        (``alpha_pattern``) where it has ``alpha``.
      alpha: whether the method has ``lora_alpha`` / ``alpha_pattern``.
      alpha_key: the config field that holds alpha (``"lora_alpha"``; LyCORIS methods and
        GraLoRA call it ``"alpha"``); ``alpha_pattern`` keeps its name.
      feedforward_modules: whether the config lists feed-forward layers (``feedforward_modules``).
      checks: config field -> whether a value is valid (type, finite, range), for the fields
        the method's entries read; a checkpoint with an invalid value is refused on load.
      training_only: config field -> what lora_func does not apply when it is set (a number
        > 0): loaded with a warning, as it acts in training only.
      unread: ``config -> why`` no variant of the method reads a layer of this config (e.g. an
        init that changed peft's base weights); the loader raises with it.
      rank_in_config: the layer's ``r`` is the config's ``r`` (written from it, read as it),
        though no tensor axis has that size (SHiRA: ``r·(d_in + d_out)`` values); the shapes
        check on load verifies the tensors.
      rank_fields: the config fields that hold ``r`` and, with :attr:`rank_pattern`, the
        per-layer pattern (peft's ``get_pattern_key`` matching), where a method names them
        otherwise (FourierFT: ``n_frequency`` and ``n_frequency_pattern``).
        A pattern field ``None``: no per-layer integer ranks to check tensors against (AdaLoRA's
        ``rank_pattern`` holds booleans per triplet, which its own entry reads).
      fan_in_fan_out: the method's config has peft's ``fan_in_fan_out`` (written ``true`` for
        GPT-2 ``Conv1D`` layers).
      layers_from_config: a checkpoint may hold no tensor of a layer (UniLoRA without
        ``save_indices``: one shared vector, every layer's buffers re-created): the adapted
        layers are then the model's modules that the config's ``target_modules`` select
        (peft's matching), not only those with tensors in the file.
    """

    peft_type: str
    fixed: Mapping[str, Any]
    refused: tuple[str, ...] = ("modules_to_save",)
    rank_of: tuple[str, int] | None = None
    rank_multiple: int = 1
    rank_pattern: bool = False
    alpha: bool = False
    feedforward_modules: bool = False
    checks: Mapping[str, Callable[[Any], bool]] = dataclasses.field(default_factory=dict)
    alpha_key: str = "lora_alpha"
    training_only: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unread: Callable[[Mapping[str, Any]], str] | None = None
    rank_in_config: bool = False
    rank_fields: tuple[str, str | None] = ("r", "rank_pattern")
    fan_in_fan_out: bool = True
    layers_from_config: bool = False


@dataclasses.dataclass(frozen=True)
class PeftLayer:
    """One layer as peft stores it, when a variant stores it converted (:attr:`PeftFormat.export`).

    Attributes:
      tensors: ``() -> {tensor name: tensor}`` in lora_func shapes, named as in
        :attr:`PeftFormat.keys`; called only when the checkpoint is written (a conversion
        may run an SVD, which ``peft_problems`` must not).
      r: the rank written for the layer (``None`` where the method has none).
      alpha: the alpha written for the layer (``None`` where the method has none).
    """

    tensors: Callable[[], TensorDict]
    r: int | None = None
    alpha: float | None = None


@dataclasses.dataclass(frozen=True)
class PeftFormat:
    """How one variant is stored in peft's format: ``Variant(peft=...)``.

    Attributes:
      method: the peft method it is stored as.
      keys: tensor name -> the peft key suffix it is stored under
        (``base_model.model.<module>.<suffix>``).
      shapes: ``(r, d_in, d_out) -> {tensor name: shape}``, lora_func's shapes, checked on load.
      config: the spec's options -> the config fields they set (the same for every layer).
      reads: ``(config, module) -> spec options`` when the checkpoint's layer ``module`` is this
        variant, else ``None``. The entries of one method must exclude one another.
      buffers: the tensors that are buffers, not trainable.
      old_keys: peft suffixes that older peft versions wrote -> tensor name (read only).
      matrix: tensor name -> ``(axis, what peft stores)``: a vector that peft stores as a
        one-row or one-column matrix, with a size-1 ``axis``.
      feedforward: the layers are listed in the method's ``feedforward_modules``.
      conv1d: peft accepts the method on GPT-2 ``Conv1D``.
      checks: config field -> validity, as :attr:`PeftMethod.checks`, for fields only this
        variant reads.
      export: ``(params, buffers, weight (d_out, d_in) | None, info) -> PeftLayer`` where the
        variant is stored converted; ``weight`` is the model's base weight in the canonical
        layout (``None`` without ``model=``). ``None``: its tensors as they are.
      export_needs_base: why the conversion needs ``model=`` (a phrase for the error), or
        ``None`` if it does not. With :attr:`Variant.records_base`, the base must also be the
        one the adapter was built on (checked by fingerprint).
      recompute_buffers: the checkpoint holds no buffers: on load they are the variant's
        ``init`` on the base (PiSSA's residual, as peft recomputes it; positions that peft
        derives from a seed in the config).
      layer_shapes: ``LayerInfo -> {tensor name: shape}`` for a variant whose tensors depend on
        its options or differ from layer to layer (OFT's block size; LoKr's Kronecker factors
        are full or factored by the layer's sizes and rank; GraLoRA's hybrid part exists only
        with ``hybrid_r``), called with the options the entry's ``reads`` gave: a layer then
        holds exactly these tensors, a subset of ``keys``, and they replace :attr:`shapes` on
        load (see :meth:`shapes_for`). The layer's rank is then the config's (``r`` /
        ``rank_pattern``), checked by these shapes (:attr:`PeftMethod.rank_of` only says that
        the method has one). ``None``: :attr:`shapes`.
      shared_keys: a tensor of :attr:`Variant.shared_init` -> its whole key in the checkpoint
        (``"base_model.vera_A"``): held once, not per layer. A key with ``{}`` holds the
        tensor row by row, ``{}`` the row's index (TinyLoRA's ``(groups, u)`` vectors as
        ``base_model.tinylora_v.0``, ``.1``, ...).
      shared_saved: ``options -> whether the checkpoint holds the shared tensors`` (peft's
        ``save_projection``); ``None``: always. Where it does not, ``save_peft`` leaves them out
        and ``load_peft`` re-creates them with the variant's ``shared_init`` (a basis drawn
        from a seed in the options, as peft re-creates it from ``projection_prng_key``).
      info_shapes: ``LayerInfo -> {tensor name: shape}`` for a variant whose shapes depend on
        its options (VB-LoRA's ``vector_length``); checked on load instead of ``shapes``.
      imported: peft suffix -> name, for tensors a checkpoint may hold in place of ``keys``
        (VB-LoRA's top-k indices and weights; integer tensors allowed). ``export`` may store a
        layer under these names; on load ``convert_in`` turns them into ``keys``' tensors.
      convert_in: ``(the layer's tensors by name, config) -> {name in keys: tensor}``, applied
        on load to a layer that holds ``imported`` tensors.
      keys_by_kind: target kind -> tensor name -> peft key suffix, where peft names a kind's
        tensors otherwise (LoRA on ``nn.Embedding``: ``lora_embedding_A``); the other kinds use
        :attr:`keys`.
      to_peft / from_peft: ``(kind, name, tensor, stored weight shape) -> tensor``: a tensor
        in peft's shape for a target of that kind and back (LoRA's conv tensors carry the
        kernel's axes, its expert tensors are peft's ``(r·E, d_in)`` / ``(d_out, r·E)``);
        ``None``: the same shapes for every kind.
      optional: tensor names a layer may lack (a norm without a bias).
      shapes_by_kind: target kind -> ``(r, d_in, d_out) -> {tensor name: shape}`` where a kind's
        tensors have other shapes than :attr:`shapes` (a norm's ``(d,)`` weight).
      saved_buffers: ``options -> the buffers a checkpoint holds`` (peft's ``save_projection``,
        ``save_indices``); ``save_peft`` leaves the others out and ``load_peft`` re-creates
        those the checkpoint lacks with the variant's ``init`` on the base (a layer's
        projection drawn from a seed and its position). ``None``: every buffer in :attr:`keys`.
    """

    method: PeftMethod
    keys: Mapping[str, str]
    shapes: Callable[[int, int, int], dict[str, tuple[int, ...]]]
    config: Callable[[Mapping[str, Any]], dict[str, Any]]
    reads: Callable[[Mapping[str, Any], str], dict[str, Any] | None]
    buffers: frozenset[str] = frozenset()
    old_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    matrix: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    feedforward: bool = False
    conv1d: bool = True
    checks: Mapping[str, Callable[[Any], bool]] = dataclasses.field(default_factory=dict)
    export: Callable[[TensorDict, TensorDict, Tensor | None, LayerInfo], PeftLayer] | None = None
    export_needs_base: str | None = None
    recompute_buffers: bool = False
    shared_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    shared_saved: Callable[[Mapping[str, Any]], bool] | None = None
    info_shapes: Callable[[LayerInfo], dict[str, tuple[int, ...]]] | None = None
    imported: Mapping[str, str] = dataclasses.field(default_factory=dict)
    convert_in: Callable[[TensorDict, Mapping[str, Any]], TensorDict] | None = None
    layer_shapes: Callable[[LayerInfo], dict[str, tuple[int, ...]]] | None = None
    keys_by_kind: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    to_peft: Callable[[str, str, Tensor, tuple[int, ...]], Tensor] | None = None
    from_peft: Callable[[str, str, Tensor, tuple[int, ...]], Tensor] | None = None
    optional: frozenset[str] = frozenset()
    shapes_by_kind: Mapping[str, Callable[[int, int, int], dict[str, tuple[int, ...]]]] = dataclasses.field(default_factory=dict)
    saved_buffers: Callable[[Mapping[str, Any]], frozenset[str]] | None = None

    def unsaved_buffers(self, options: Mapping[str, Any]) -> frozenset[str]:
        """The buffers a checkpoint with ``options`` leaves out (:attr:`saved_buffers`)."""
        return frozenset() if self.saved_buffers is None else self.buffers - self.saved_buffers(options)

    def shapes_for(self, info: LayerInfo) -> dict[str, tuple[int, ...]]:
        """One layer's lora_func shapes, checked on load: :attr:`layer_shapes` or :attr:`info_shapes` where set, else
        :attr:`shapes` of ``(info.r, info.d_in, info.d_out)``."""
        if self.layer_shapes is not None:
            return self.layer_shapes(info)
        if self.info_shapes is not None:
            return self.info_shapes(info)
        return self.shapes(info.r, info.d_in, info.d_out)


@dataclasses.dataclass(frozen=True)
class LowRank:
    """A declaration that a variant's activation form is a scaled low-rank product on the base:
    ``y = base(x) + scale · (dropout(x) Aᵀ) Bᵀ`` with ``A = params[a] (r, d_in)``, ``B =
    params[b] (d_out, r)`` and ``dropout`` the variant's ``dropout`` option (training steps
    only; none without the option). Code that applies many adapters of the variant at once (the
    mixed route: a different adapter per row) then batches the product itself (``bmm`` over the
    members' stacked factors) instead of running the form per row under ``vmap``.

    Attributes:
      a: the short name of ``A``.
      b: the short name of ``B``.
      scale: ``(info, buffers) -> s``: a float, or, given a rank-padded stack's raw buffers
        (with a leading member axis), one value per member (see :func:`layer_rank`).
    """

    a: str
    b: str
    scale: Callable[[LayerInfo, TensorDict | None], float | Tensor]


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
        to stack adapters of different ranks, and the forms then see each member through
        :func:`padded_member`: these axes masked, ``info.r`` / ``info.alpha`` the member's own.
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
      calibrate_on: what ``calibrate``'s ``layer_inputs`` yields per calibration batch:
        ``"inputs"`` (the default: the target layers' input rows, as above) or ``"gradients"``
        (``{module name: ∂loss/∂W (d_out, d_in)}``, the gradient of the model's own loss on the
        batch, ``labels`` the batch's or its ``input_ids``, in the weight's dtype: LoRA-GA), one
        pass over the batches.
      shared_init: tensors the adapter holds once and every layer reads (a random basis, a
        bank, a seed-derived projection: VeRA, VB-LoRA, Tied-LoRA). ``(infos, *, dtype,
        device, generator) -> (params, buffers)``, called once before the layers' ``init``
        with ``infos`` (module name -> ``LayerInfo``) of every target, in module order (each
        with its :attr:`LayerInfo.position` and the adapter's :attr:`LayerInfo.layout`); random draws from the
        given CPU ``generator``, outputs in ``dtype`` on ``device``. Each is one leaf of the
        adapter (keyed ``"<shared>.<name>"``), saved and stacked once; the forms of every layer
        see them in their ``params`` / ``buffers`` under their names (which must differ from
        the layers'), and a shared param's gradient is the sum over the layers that read it.
        Name the rank axes of shared tensors in ``rank_axes`` too: a stack of adapters of
        different ranks pads and masks them as the layers' tensors.
      peft: how the variant is stored in HF peft's checkpoint format (a
        :class:`~lora_func.variants.PeftFormat`); ``None``: peft has no equivalent, and
        ``save_peft`` refuses it.
      low_rank: a :class:`LowRank` when ``activation_form`` is exactly that scaled low-rank
        product (tests/test_mixed_route.py checks it): the mixed route batches it; ``None``: the
        mixed route runs ``activation_form`` per row.
      padded_axes: axes sized by ``r`` but not of size ``r`` (SHiRA's ``r·(d_in + d_out)``
        values and positions): :func:`lora_func.stack` zero-pads them to the largest member as
        it pads rank axes, but :func:`padded_member` leaves them alone; the forms mask them
        themselves from the member's own ``info.r`` (a 0-d tensor in a rank-padded stack).
      integer_buffers: buffers that hold integer positions (int64: SHiRA's mask indices,
        FourierFT's frequencies), never cast to the adapter dtype, saved and loaded as integers.
      kinds: the target kinds it adapts (``lora_func.targeting.KINDS``: ``"linear"``,
        ``"conv1d"``, ``"embedding"``, ``"conv"``, ``"norm"``, ``"experts"``); a spec naming a
        target of another kind is refused, naming the variant, the kind and these. Every kind's
        weight arrives in its canonical view (``(d_out, d_in)``; ``(d,)`` for a norm; an expert
        parameter's forms run once per expert, its tensors carry a leading expert axis); the
        activation form is only called on ``"linear"`` and ``"conv1d"`` layers (the other
        kinds apply through the merged weight, unless ``kind_forms`` has one).
      kind_forms: activation forms for kinds whose layer op is not a matmul of ``x``, where
        computing without the merged weight is cheaper: ``{"embedding": form}`` with ``form(params,
        buffers, ids (...), base, info) -> (..., d_out)``, ``base(ids)`` the layer's lookup and
        ``base.replay(ids, table)`` the same lookup (padding index and options) in another
        ``(num_embeddings, k)`` table. Must equal the lookup in ``W_effᵀ``.
      layer_ranks: ``(r, infos) -> {module name: r}``: each layer's rank derived from the spec's
        ``r`` and every target's ``LayerInfo`` (module name -> info), where the variant's options
        spread one budget over the layers (WaveFT's ``proportional_parameters``: in proportion to
        ``d_in·d_out``). ``init_adapter`` and ``load_peft`` apply it before the layers' ``init``;
        ``None``: the spec's ``r`` (or a checkpoint's rank pattern) on every layer.
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
    calibrate_on: str = "inputs"
    shared_init: Callable[..., tuple[TensorDict, TensorDict]] | None = None
    peft: PeftFormat | None = None
    low_rank: LowRank | None = None
    padded_axes: Mapping[str, int | tuple[int, ...]] = dataclasses.field(default_factory=dict)
    integer_buffers: frozenset[str] = frozenset()
    kinds: frozenset[str] = frozenset({"linear", "conv1d"})
    kind_forms: Mapping[str, ActivationFn] = dataclasses.field(default_factory=dict)
    layer_ranks: Callable[[int, Mapping[str, LayerInfo]], Mapping[str, int]] | None = None

    def __repr__(self) -> str:
        # The functions' reprs would fill a screen; the name identifies the variant.
        return f"Variant({self.name!r})"


def layer_rank(info: LayerInfo, buffers: TensorDict | None = None) -> int | Tensor:
    """The layer's rank: ``info.r``, or, given the raw buffers of a rank-padded stack (which
    hold :data:`RANK_MASK`), the member's own rank (a 0-d tensor, the sum of its rank mask).

    A variant's forms never need it: they see a padded member through :func:`padded_member`,
    whose ``info.r`` already is the member's own. It serves code that handles a stack's raw
    buffers (the shared LoRA kernels, the mixed route)."""
    if buffers is not None and RANK_MASK in buffers:
        return buffers[RANK_MASK].sum(-1)
    return info.r


def layer_alpha(info: LayerInfo, buffers: TensorDict | None = None) -> float | Tensor:
    """The layer's ``alpha``: ``info.alpha``, or the member's own given a rank-padded stack's
    raw buffers (see :func:`layer_rank`)."""
    if buffers is not None and RANK_ALPHA in buffers:
        return buffers[RANK_ALPHA]
    return info.alpha


def _mask_rank_axes(tensors: TensorDict, mask: Tensor, axes: Mapping[str, int | tuple[int, ...]]) -> TensorDict:
    """Multiply every rank axis by the 0/1 ``mask (r_max,)`` of a rank-padded stack member, so
    padded entries never reach the output and get exactly zero gradient."""
    out = dict(tensors)
    for name, tensor in tensors.items():
        declared = axes.get(name, ())
        for axis in (declared,) if isinstance(declared, int) else declared:
            shape = [1] * tensor.dim()
            shape[axis] = -1
            out[name] = out[name] * mask.to(tensor.dtype).reshape(shape)
    return out


def padded_member(
    params: TensorDict, buffers: TensorDict, info: LayerInfo, rank_axes: Mapping[str, int | tuple[int, ...]]
) -> tuple[TensorDict, TensorDict, LayerInfo]:
    """What a variant's forms see of one member of a rank-padded stack (adapters of different
    ranks, zero-padded to the largest by :func:`lora_func.stack`), so that a variant writes its
    math for one adapter and cannot get a stack wrong:

    - ``params`` / ``buffers`` with every rank axis (``Variant.rank_axes``) multiplied by the
      member's 0/1 rank mask: the padded entries are exact zeros there and get exactly zero
      gradient; the stack's own :data:`RANK_MASK` / :data:`RANK_ALPHA` buffers left out;
    - ``info`` whose ``r`` and ``alpha`` are the member's own, as 0-d tensors in the adapter
      dtype (at least fp32; under ``vmap`` one per member), so ``info.alpha / info.r`` is the
      member's scale. Tensor shapes keep the padded rank (a form reads sizes from its tensors).

    Outside a rank-padded stack (no :data:`RANK_MASK` in ``buffers``) the arguments unchanged.
    """
    if RANK_MASK not in buffers:
        return params, buffers, info
    mask, alpha = buffers[RANK_MASK], buffers[RANK_ALPHA]
    own = {k: v for k, v in buffers.items() if k not in (RANK_MASK, RANK_ALPHA)}
    # r and alpha are per-member tensors here (declared int / float for one adapter).
    member = dataclasses.replace(info, r=cast(Any, mask.sum(-1)), alpha=cast(Any, alpha))
    return _mask_rank_axes(params, mask, rank_axes), _mask_rank_axes(own, mask, rank_axes), member
