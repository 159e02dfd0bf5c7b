"""The variant contract: what one variant file provides, and what the core hands it.

A variant is a handful of pure functions of explicit tensors plus declarations. It never sees
an ``nn.Module``: the core hands it the frozen base weight in the canonical ``(d_out, d_in)``
layout (transposed views for GPT-2 ``Conv1D``), a :class:`LayerInfo` of static facts, and, in
the activation form, a :class:`BaseLayer` that replays the model's own op, so one
implementation serves both layer kinds and both application routes.

What the generic machinery needs to know about a variant is declared, never asked by name:
each option as an :class:`~lora_func.variants.Option` (default, allowed values, peft field),
each tensor as a :class:`Slot` (shape from the layer, rank axes, buffer or trainable, shared
or per layer, peft key), a :class:`LowRank` where its activation form is a scaled low-rank
product on the base, and a few :data:`TRAITS`. How a variant is stored in HF peft's format is
a record beside it (:class:`~lora_func.variants.PeftFormat`, the ``PEFT`` of its file).

The public names are re-exported by :mod:`lora_func.variants`; the low-rank kernels that the
built-in variants share live in ``lora_func.variants._kernels``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lora_func.variants._options import Option

__all__ = [
    "RANK_ALPHA",
    "RANK_MASK",
    "TRAITS",
    "ActivationFn",
    "BaseLayer",
    "Calibration",
    "InitFn",
    "LayerInfo",
    "LowRank",
    "Slot",
    "TensorDict",
    "Variant",
    "WeightFn",
    "group_view",
    "layer_alpha",
    "refuse_merge",
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
      kind: the target's kind (``"linear"``, ``"conv1d"``, ``"embedding"``, ``"conv"``,
        ``"norm"``, ``"experts"``), derived from the target, never saved.
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
    kind: str = "linear"

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


# ----------------------------------------------------------------------- the tensor schema


@dataclasses.dataclass(frozen=True)
class Slot:
    """One adapter tensor of a variant: what every layer holds under its name (or, ``shared``,
    what the adapter holds once for every layer).

    Attributes:
      shape: ``LayerInfo -> shape`` of the tensor on one layer (a shared tensor's from the
        adapter's :attr:`LayerInfo.layout`, the same in every layer's info), or ``None`` where the
        layer does not hold it (a norm without a bias; LoKr's factored or whole factors, by the
        layer's sizes). An expert parameter adds a leading expert axis.
      rank_axes: axes of size ``r``: :func:`lora_func.stack` zero-pads them to stack adapters of
        different ranks, and the forms then see each member through :func:`padded_member` (these
        axes masked, ``info.r`` / ``info.alpha`` the member's own).
      padded_axes: axes sized by ``r`` but not of size ``r`` (SHiRA's ``r·(d_in + d_out)`` values):
        a stack zero-pads them as rank axes, but :func:`padded_member` leaves them alone; the forms
        mask them from the member's own ``info.r``.
      buffer: fixed (a buffer), not trainable.
      integer: holds integer positions (int64), never cast to the adapter dtype, saved and loaded
        as integers.
      shared: held once by the adapter (keyed ``"<shared>.<name>"``) and read by every layer,
        built by :attr:`Variant.shared_init`; its gradient is the sum over the layers. A shared
        slot that :attr:`Variant.groups` names is held once per *group* of layers instead (keyed
        ``"<shared>.<name>@<group key>"``), built by the ``init`` of the group's first layer and
        read by the group's layers only (see :attr:`Variant.groups`).
      peft: the key suffix peft stores it under (``"lora_A.weight"``: key
        ``base_model.model.<module>.<suffix>``), a mapping from target kind to suffix with
        ``""`` for the other kinds (LoRA on ``nn.Embedding``: ``lora_embedding_A``), or for a
        shared tensor the whole key (``"base_model.vera_A"``; with ``{}``, row by row:
        ``base_model.tinylora_v.{}``; a grouped one with ``{group}``, once per group under its
        group key: ``base_model.frod_V.{group}``); ``None``: peft's file does not hold it, and ``load_peft``
        re-creates it with the variant's ``init`` on the base, as peft does (a residual, positions
        drawn from a seed).
      saved_if: an option whose value says whether peft's file holds it (``save_projection``);
        ``save_peft`` leaves it out when false and ``load_peft`` re-creates it.
      matrix: peft stores this vector as a matrix with a size-1 axis here (IA3's ``(d_out, 1)``).
    """

    shape: Callable[[LayerInfo], tuple[int, ...] | None]
    rank_axes: tuple[int, ...] = ()
    padded_axes: tuple[int, ...] = ()
    buffer: bool = False
    integer: bool = False
    shared: bool = False
    peft: str | Mapping[str, str] | None = None
    saved_if: str | None = None
    matrix: int | None = None

    def peft_key(self, kind: str) -> str | None:
        """The suffix peft stores the tensor under on a target of ``kind``."""
        if isinstance(self.peft, Mapping):
            return self.peft.get(kind, self.peft.get(""))
        return self.peft

    def saved(self, options: Mapping[str, Any]) -> bool:
        """Whether peft's file holds the tensor, for a checkpoint with ``options``."""
        return self.peft is not None and (self.saved_if is None or bool(options[self.saved_if]))


@dataclasses.dataclass(frozen=True)
class LowRank:
    """A declaration that a variant's activation form is a scaled low-rank product on the base:
    ``y = base(x) + scale · (dropout(x) Aᵀ) Bᵀ`` with ``A (r, d_in)``, ``B (d_out, r)`` (each a
    param, or a buffer where the variant freezes it) and ``dropout`` the variant's ``dropout``
    option (training steps only). ``base`` is the model's layer, or with the
    ``replaces_weight`` trait the variant's own residual (PiSSA's ``W_res``): code that needs the
    delta on the model's weight (merging, the mixed-row fast path) asks for both.

    What reads it: the mixed route batches the product itself (``bmm`` over the members' gathered
    factors), ghost clipping computes the per-example gradient norms of ``A`` and ``B`` from the
    layer's input and output gradient, and merging treats the delta ``s·B A`` as a plain LoRA.

    Attributes:
      a: the short name of ``A``.
      b: the short name of ``B``.
      scale: ``(info, buffers) -> s``: a float, or, given a rank-padded stack's raw buffers
        (with a leading member axis), one value per member (see :func:`layer_rank`).
    """

    a: str
    b: str
    scale: Callable[[LayerInfo, TensorDict | None], float | Tensor]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A data-driven init: ``fit(layer_inputs, infos, *, generator) -> {module name: (LayerInfo,
    payload)}`` is called once before the layers' ``init``, with ``on`` saying what
    ``layer_inputs`` yields per calibration batch:

    - ``"inputs"``: ``{module name: rows (n, d_in)}``, the target layers' inputs with padding
      (``attention_mask == 0``) and ``labels == -100`` token rows removed (EVA, CorDA);
    - ``"gradients"``: ``{module name: ∂loss/∂W (d_out, d_in)}``, the gradient of the model's own
      loss on the batch, ``labels`` the batch's or its ``input_ids``, in the weight's dtype
      (LoRA-GA), one pass over the batches.

    ``infos`` maps module name to the spec's ``LayerInfo``. The returned ``LayerInfo`` may change
    ``r`` and ``alpha`` per layer; a module left out gets no adapter; ``payload`` reaches that
    layer's ``init`` as ``calibration``."""

    fit: Callable[..., dict[str, tuple[LayerInfo, Any]]]
    on: str = "inputs"


# What Variant.traits may hold.
TRAITS = frozenset({"changes_bias", "records_base", "replaces_weight", "rank_within_layer", "no_merged_weight", "shared_from_weights"})

# Separates a grouped shared tensor's slot name from its group key ("lily_B@0"): Variant.groups.
GROUP = "@"


def refuse_merge(name: str) -> Any:
    """Raise the refusal of a merged weight for the variant ``name`` (``"no_merged_weight"``
    trait): what every merged route, ``to_lora`` and merging meet, and the ``weight_form`` such a
    variant declares."""
    raise ValueError(  # error: no-merged-weight
        f"{name} has no merged weight (its update depends on each call's inputs, not only on its tensors), so no merged "
        f"route, merge or to_lora can apply it; apply it by its activation form: merged=False (adapted_call, adapted, "
        f"many_call) or lora_func.overlay"
    )


def group_view(shared: TensorDict, groups: Mapping[str, str]) -> TensorDict:
    """The shared tensors as one layer's forms see them: each grouped ``"<name>@<key>"`` of the
    layer's own group (``groups``: slot name -> the layer's group key, :attr:`Variant.groups`)
    under ``<name>``, the other groups' left out, the ungrouped ones unchanged."""
    out = {}
    for name, tensor in shared.items():
        slot, grouped, key = name.partition(GROUP)
        if not grouped:
            out[name] = tensor
        elif groups.get(slot) == key:
            out[slot] = tensor
    return out


@dataclasses.dataclass(frozen=True, repr=False)
class Variant:
    """One adapter variant: pure functions and declarations, what a variant file defines as
    ``VARIANT``.

    Every function is a pure function of explicit tensors: no global RNG (draws come from
    the ``generator``), no ``.item()`` or other value-dependent Python branching, no in-place
    writes to its inputs, so that ``torch.func`` transforms and ``torch.compile`` see through it.

    Attributes:
      name: registry name (``AdapterSpec(variant=name)``).
      init: ``(weight (d_out, d_in), bias (d_out,) | None, info, *, dtype, generator,
        calibration) -> (params, buffers)`` for one layer: the trainable tensors and the fixed
        ones, by short name, as :attr:`tensors` declares them (the contract tests check it).
        ``weight`` is in the base dtype; random draws use the given CPU ``generator``; outputs
        are in ``dtype`` on the weight's device (integer slots in int64).
      weight_form: ``(params, buffers, W (d_out, d_in), b (d_out,) | None, info) ->
        (W_eff, b_eff)``. ``W`` and ``b`` arrive in the adapter dtype; the core casts the
        result back to the base dtype.
      activation_form: ``(params, buffers, x (..., d_in), base, info) -> y (..., d_out)``,
        ``y`` in the dtype of ``base(x)``; must equal ``x @ W_eff.T + b_eff`` (the contract
        tests check it), computed without building ``W_eff`` where the math allows.
      tensors: the tensor schema, name -> :class:`Slot`, per-layer and shared tensors alike.
      options: the option schema, name -> :class:`~lora_func.variants.Option`: defaults, the
        values each allows (checked once, for specs and peft configs alike), peft's field.
      check: ``options -> None`` that raises ``ValueError`` where options are valid one by one
        but not together (OFT's block size and count: exactly one set).
      default_alpha: ``alpha`` when the spec leaves it ``None``.
      low_rank: a :class:`LowRank` when ``activation_form`` is exactly that scaled low-rank
        product (tests/test_mixed_route.py checks it); ``None`` otherwise.
      kind_forms: the target kinds it adapts (``lora_func.targeting.KINDS``: ``"linear"``,
        ``"conv1d"``, ``"embedding"``, ``"conv"``, ``"norm"``, ``"experts"``) -> an activation
        form for a kind whose layer op is not a matmul of ``x`` (``None``: the merged weight
        there; ``activation_form`` on ``"linear"`` / ``"conv1d"``). A spec naming a target of
        another kind is refused, naming the variant, the kind and these. An embedding's form:
        ``form(params, buffers, ids (...), base, info) -> (..., d_out)``, ``base(ids)`` the
        layer's lookup and ``base.replay(ids, table)`` the same lookup in another
        ``(num_embeddings, k)`` table; must equal the lookup in ``W_effᵀ``. An expert
        parameter's forms run once per expert, its tensors carry a leading expert axis.
      shared_init: ``(infos, *, dtype, device, generator) -> (params, buffers)`` of the
        ``shared`` slots (a random basis, a bank), called once before the layers' ``init`` with
        ``infos`` (module name -> ``LayerInfo``) of every target in module order; random draws
        from the given CPU ``generator``, outputs in ``dtype`` on ``device``. The forms of every
        layer see them in their ``params`` / ``buffers`` under their names. With the
        ``shared_from_weights`` trait it also gets ``weights`` (module name -> the target's base
        weight ``(d_out, d_in)``, every target, module order) and may return grouped tensors
        (``"<name>@<group key>"``, :attr:`groups`); each layer's ``init`` then gets ``shared=``,
        the layer's view of them (:func:`group_view`).
      calibration: a :class:`Calibration` for a data-driven init (EVA, CorDA, LoRA-GA).
      layer_ranks: ``(r, infos) -> {module name: r}``: each layer's rank derived from the spec's
        ``r`` and every target's ``LayerInfo``, where the options spread one budget over the
        layers (WaveFT's ``proportional_parameters``). ``None``: the spec's ``r`` (or a
        checkpoint's rank pattern) on every layer.
      traits: facts the core acts on, from :data:`TRAITS`: ``"changes_bias"`` (``b_eff`` can
        differ from ``b``); ``"records_base"`` (the adapter depends on the exact base weights it
        was built from, PiSSA's residual: a fingerprint of each target's base weight is stored,
        and a model with other weights is refused); ``"replaces_weight"`` (the forms discard
        ``W``: :func:`lora_func.compose` refuses it after another part on the same layer, and a
        quantized base is refused); ``"rank_within_layer"`` (``r <= min(d_in, d_out)`` of every
        target: the init takes ``r`` directions of the weight, checked before any init);
        ``"shared_from_weights"`` (``shared_init`` reads the targets' base weights and each
        layer's ``init`` its group's shared tensors: FRoD's basis of all the layers of one
        category, which each layer's own factor is solved against).
    """

    name: str
    init: InitFn
    weight_form: WeightFn
    activation_form: ActivationFn
    tensors: Mapping[str, Slot]
    options: Mapping[str, Option] = dataclasses.field(default_factory=dict)
    check: Callable[[Mapping[str, Any]], None] | None = None
    default_alpha: float = 8.0
    low_rank: LowRank | None = None
    kind_forms: Mapping[str, ActivationFn | None] = dataclasses.field(default_factory=lambda: {"linear": None, "conv1d": None})
    shared_init: Callable[..., tuple[TensorDict, TensorDict]] | None = None
    calibration: Calibration | None = None
    layer_ranks: Callable[[int, Mapping[str, LayerInfo]], Mapping[str, int]] | None = None
    traits: frozenset[str] = frozenset()
    groups: Callable[[str | tuple[str, ...], Mapping[str, LayerInfo]], Mapping[str, Mapping[str, str]]] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.traits) - TRAITS)
        if unknown:
            raise ValueError(f"Variant {self.name!r}: unknown traits {unknown}; traits are {sorted(TRAITS)}")  # error: variant-traits

    def __repr__(self) -> str:
        # The functions' reprs would fill a screen; the name identifies the variant.
        return f"Variant({self.name!r})"

    # Views of the declarations, read by the generic machinery.
    @functools.cached_property
    def rank_axes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> its rank axes, for the tensors that have any."""
        return {name: slot.rank_axes for name, slot in self.tensors.items() if slot.rank_axes}

    @functools.cached_property
    def padded_axes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> its padded (rank-sized, self-masked) axes, for the tensors that have any."""
        return {name: slot.padded_axes for name, slot in self.tensors.items() if slot.padded_axes}

    @functools.cached_property
    def integer_buffers(self) -> frozenset[str]:
        """The tensors that hold integer positions."""
        return frozenset(name for name, slot in self.tensors.items() if slot.integer)

    @functools.cached_property
    def kinds(self) -> frozenset[str]:
        """The target kinds it adapts (:attr:`kind_forms`' keys)."""
        return frozenset(self.kind_forms)

    @property
    def changes_bias(self) -> bool:
        return "changes_bias" in self.traits

    @property
    def records_base(self) -> bool:
        return "records_base" in self.traits

    @property
    def replaces_weight(self) -> bool:
        return "replaces_weight" in self.traits

    @property
    def shared_from_weights(self) -> bool:
        """Whether ``shared_init`` reads the targets' weights and ``init`` its tensors (the trait)."""
        return "shared_from_weights" in self.traits

    @property
    def merges(self) -> bool:
        """Whether the variant has a merged weight (no ``no_merged_weight`` trait)."""
        return "no_merged_weight" not in self.traits

    def layer_groups(self, targets: str | tuple[str, ...], infos: Mapping[str, LayerInfo]) -> dict[str, dict[str, str]]:
        """Module name -> {grouped shared slot name: the layer's group key} (:attr:`groups`);
        empty mappings for a variant without grouped slots."""
        if self.groups is None:
            return {module: {} for module in infos}
        found = self.groups(targets, infos)
        named = {name for groups in found.values() for name in groups}
        bad = sorted(named - {name for name, slot in self.tensors.items() if slot.shared})
        if bad:
            raise ValueError(  # error: variant-groups-slot
                f"Variant {self.name!r}: its groups name {bad}, which are not shared slots of its tensor schema; declare "
                f"them Slot(..., shared=True) (a tensor held once per group)"
            )
        return {module: dict(found.get(module, {})) for module in infos}

    @property
    def default_options(self) -> dict[str, Any]:
        """Option name -> its default."""
        return {name: option.default for name, option in self.options.items()}

    def layer_slots(self) -> dict[str, Slot]:
        """The per-layer tensors' slots (not ``shared``)."""
        return {name: slot for name, slot in self.tensors.items() if not slot.shared}

    def shapes(self, info: LayerInfo) -> dict[str, tuple[int, ...]]:
        """The per-layer tensors a layer holds and their shapes (a slot whose shape is ``None``
        there is left out)."""
        return {name: tuple(shape) for name, slot in self.layer_slots().items() if (shape := slot.shape(info)) is not None}


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
