"""How a variant is stored in HF peft's checkpoint format: records that a variant file defines
beside its :class:`~lora_func.variants.Variant` (``PEFT = PeftFormat(...)``), read by the
generic reader and writer of :mod:`lora_func.io`.

What is declared elsewhere: each tensor's peft key, shape, and whether the file holds it are in
the variant's tensor schema (:class:`~lora_func.variants.Slot`); each option's config field and
its encoding in the option schema (:class:`~lora_func.variants.Option`). A record here holds
what is left: the peft method (one per ``peft_type``, shared by the variants stored as it),
which config marks a variant of it, and the conversions of variants stored in another form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from lora_func.variants._contract import LayerInfo, TensorDict

__all__ = ["PeftFormat", "PeftLayer", "PeftMethod"]


@dataclasses.dataclass(frozen=True)
class PeftMethod:
    """One peft method (one ``peft_type``): what every checkpoint of it writes alike, whichever
    lora_func variant it holds. Variants stored as the same method share one ``PeftMethod``.

    Attributes:
      peft_type: peft's name of the method (``"LORA"``, ``"IA3"``, ...).
      fixed: config fields with one value for every checkpoint of the method, written as they
        are; also what a checkpoint that lacks one of them holds (peft's defaults).
      refused: config fields that change the math in ways lora_func does not have: a checkpoint
        with any of them set (truthy) is refused on load.
      rank: ``(field, pattern field)`` that hold a layer's rank (``("r", "rank_pattern")``;
        AdaLoRA's ``("init_r", None)``: no per-layer ranks), written from each layer's ``r`` and
        read as peft reads them; the tensors' shapes (the tensor schema) check them on load.
        ``None``: the method has no rank.
      alpha: the field of the scale numerator (``"lora_alpha"``; LyCORIS and GraLoRA: ``"alpha"``),
        with ``alpha_pattern`` where the method has per-layer ranks; ``None``: no alpha.
      training_only: config field -> what lora_func does not apply when it is set (a number
        > 0): loaded with a warning, as it acts in training only.
      unread: ``config -> why`` no variant of the method reads a checkpoint of this config (e.g.
        an init that changed peft's base weights); the loader raises with it.
      fan_in_fan_out: the method's config has peft's ``fan_in_fan_out`` (written ``true`` for
        GPT-2 ``Conv1D`` layers).
    """

    peft_type: str
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"bias": "none"})
    refused: tuple[str, ...] = ("modules_to_save",)
    rank: tuple[str, str | None] | None = None
    alpha: str | None = None
    training_only: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unread: Callable[[Mapping[str, Any]], str] | None = None
    fan_in_fan_out: bool = True


@dataclasses.dataclass(frozen=True)
class PeftLayer:
    """One layer as peft stores it, when a variant stores it converted (:attr:`PeftFormat.export`).

    Attributes:
      tensors: ``() -> {name: tensor}`` in lora_func shapes, named as the tensor schema or
        :attr:`PeftFormat.imported` name them; called only when the checkpoint is written (a
        conversion may run an SVD, which ``peft_problems`` must not).
      r: the rank written for the layer (``None`` where the method has none).
      alpha: the alpha written for the layer (``None`` where the method has none).
    """

    tensors: Callable[[], TensorDict]
    r: int | None = None
    alpha: float | None = None


@dataclasses.dataclass(frozen=True)
class PeftFormat:
    """How one variant is stored in peft's format: the ``PEFT`` of its file.

    Attributes:
      method: the peft method it is stored as.
      reads: the config values that mark a checkpoint's layer as this variant: field -> a value,
        a tuple of values, or a predicate (``{"use_dora": True}``); a field the config lacks has
        the method's :attr:`PeftMethod.fixed` value. The entries of one method must exclude one
        another. ``None``: no checkpoint reads as this variant (it is only written, converted).
      writes: config fields this variant writes beside its options' (``{"use_dora": True}``).
      feedforward: the layers are listed in the method's ``feedforward_modules``, and a layer
        reads as this variant exactly when it is listed there (IA3's feed-forward form).
      conv1d: peft accepts the method on GPT-2 ``Conv1D``.
      export: ``(params, buffers, weight (d_out, d_in) | None, info) -> PeftLayer`` where the
        variant is stored converted (PiSSA as a plain LoRA on the untouched base); ``weight`` is
        the model's base weight in the canonical layout (``None`` without ``model=``).
      export_needs_base: why the conversion needs ``model=`` (a phrase for the error), or
        ``None``. With the ``records_base`` trait the base must also be the one the adapter was
        built on (checked by fingerprint).
      imported: peft key suffix -> name, for tensors a checkpoint may hold besides or in place of
        the tensor schema's (an older suffix; VB-LoRA's top-k indices and weights, integers
        allowed; a LyCORIS layer's CP core).
      convert_in: ``(a layer's tensors by name, options) -> tensors as the schema names them``,
        applied on load to a layer that holds an ``imported`` name.
      reshape: ``(kind, name, tensor, stored weight shape, to_peft) -> tensor``: a tensor in
        peft's shape on a target of that kind (``to_peft=True``) and back (LoRA's conv tensors
        carry the kernel's axes; a tensor it does not recognise comes back unchanged, and the
        shape check names it). ``None``: the same shapes for every kind.
      module_copy: this variant is a trained copy of its layer, so it is also peft's
        ``modules_to_save`` form beside another method: slot name -> the module's own tensor name
        (``{"ln_weight": "weight", "ln_bias": "bias"}``), the keys peft stores a copy under
        (``<module>.weight``, in the stored layout of ``reshape``). At most one variant has it.
        Where the weight's slot is saved only with an option (``Slot.saved_if``), the copy
        with that option false is the layer's bias alone: peft's bias training beside a method
        (``bias="all"`` / ``"<method>_only"``), stored as the config's ``bias`` and
        ``<module>.bias`` (``<module>.base_layer.bias`` on a target).
    """

    method: PeftMethod
    reads: Mapping[str, Any] | None = dataclasses.field(default_factory=dict)
    writes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    feedforward: bool = False
    conv1d: bool = True
    export: Callable[[TensorDict, TensorDict, Tensor | None, LayerInfo], PeftLayer] | None = None
    export_needs_base: str | None = None
    imported: Mapping[str, str] = dataclasses.field(default_factory=dict)
    convert_in: Callable[[TensorDict, Mapping[str, Any]], TensorDict] | None = None
    reshape: Callable[[str, str, Tensor, tuple[int, ...], bool], Tensor] | None = None
    module_copy: Mapping[str, str] | None = None
