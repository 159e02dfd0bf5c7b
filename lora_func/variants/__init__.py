"""The variant contract and the variant registry.

A variant is one module in this package that defines ``VARIANT`` (or a tuple ``VARIANTS``), a
:class:`Variant` of pure functions and declarations, and, where HF peft has the method, ``PEFT``:
its :class:`PeftFormat` (a mapping from variant name to format for a module of several). The
registry collects both under the variant's name. Adding a variant is adding a file (plus one
row in the contract-test table, ``tests/variant_rows/``); modules whose name starts with ``_``
are not variants. What a variant author writes against:

- :class:`Variant`: the record a variant file defines (``init``, ``weight_form``,
  ``activation_form``, the tensor and option schemas, a few traits; its docstring gives every
  signature and shape);
- :class:`Slot`: one tensor of the tensor schema (shape from the layer, rank axes, buffer or
  trainable, shared or per layer, peft key);
- :class:`Option`, :class:`Check` and the checks :data:`FLAG`, :data:`SEED`, :data:`DROPOUT`,
  :func:`whole`, :func:`real`, :func:`one_of`: the option schema, validated once for specs and
  peft configs alike;
- :class:`LowRank`: the declaration that answers "is this adapter LoRA-shaped" for merging, the
  mixed-row fast path and ghost clipping; :class:`Calibration` for a data-driven init;
- :class:`LayerInfo`: the static facts about one layer (``d_in``, ``d_out``, ``r``,
  ``alpha``, ``has_bias``, options) every function receives;
- :class:`BaseLayer`: the frozen base layer the activation form calls (``weight (d_out,
  d_in)``, ``bias``, ``base(x)`` with the model's own op);
- :data:`TensorDict`, :class:`InitFn`, :data:`WeightFn`, :data:`ActivationFn`: the types of
  the tensors and functions;
- :func:`group_view`: the shared tensors as one layer of a group sees them
  (``Variant.groups``); :func:`refuse_merge`: the ``weight_form`` of a variant without a merged
  weight (the ``no_merged_weight`` trait);
- :func:`padded_member`: what the forms see of one member of a rank-padded stack (adapters of
  different ranks): its rank axes masked, ``info.r`` / ``info.alpha`` its own, so a variant
  writes its math for one adapter; :func:`layer_rank`, :func:`layer_alpha` read a member's
  rank and alpha from a stack's raw buffers;
- :class:`PeftFormat`, :class:`PeftMethod`, :class:`PeftLayer`, :class:`Codec`, :func:`mapped`:
  how the variant is stored in HF peft's checkpoint format, beside the variant.

docs/guide/variants.md ("Writing a variant") walks through one.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping

from lora_func.variants._contract import (
    TRAITS,
    ActivationFn,
    BaseLayer,
    Calibration,
    InitFn,
    LayerInfo,
    LowRank,
    Slot,
    TensorDict,
    Variant,
    WeightFn,
    group_view,
    layer_alpha,
    layer_rank,
    padded_member,
    refuse_merge,
)
from lora_func.variants._options import (
    DROPOUT,
    FLAG,
    SEED,
    Check,
    Codec,
    Option,
    is_finite_number,
    mapped,
    one_of,
    real,
    resolve_options,
    whole,
)
from lora_func.variants._peft import PeftFormat, PeftLayer, PeftMethod

__all__ = [
    "DROPOUT",
    "FLAG",
    "SEED",
    "TRAITS",
    "ActivationFn",
    "BaseLayer",
    "Calibration",
    "Check",
    "Codec",
    "InitFn",
    "LayerInfo",
    "LowRank",
    "Option",
    "PeftFormat",
    "PeftLayer",
    "PeftMethod",
    "Slot",
    "TensorDict",
    "Variant",
    "WeightFn",
    "get_variant",
    "group_view",
    "is_finite_number",
    "layer_alpha",
    "layer_rank",
    "list_variants",
    "mapped",
    "one_of",
    "padded_member",
    "peft_format",
    "real",
    "refuse_merge",
    "resolve_options",
    "whole",
]

_REGISTRY: dict[str, Variant] = {}
_PEFT: dict[str, PeftFormat] = {}


def _discover() -> dict[str, Variant]:
    if not _REGISTRY:
        found: dict[str, Variant] = {}
        formats: dict[str, PeftFormat] = {}
        for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if module_info.name.startswith("_"):
                continue  # the contract itself, helpers: not variants
            module = importlib.import_module(f"{__name__}.{module_info.name}")
            declared = getattr(module, "VARIANTS", ()) + ((module.VARIANT,) if hasattr(module, "VARIANT") else ())
            peft = getattr(module, "PEFT", None)
            for variant in declared:
                if variant.name in found:
                    raise RuntimeError(f"variant {variant.name!r} is defined twice (second time in {module.__name__})")  # error: variant-duplicate
                found[variant.name] = variant
                fmt = peft.get(variant.name) if isinstance(peft, Mapping) else peft
                if fmt is not None:
                    formats[variant.name] = fmt
        _REGISTRY.update(found)
        _PEFT.clear()
        _PEFT.update(formats)
    return _REGISTRY


def list_variants() -> list[str]:
    """The registered variant names, sorted."""
    return sorted(_discover())


def get_variant(name: str) -> Variant:
    """The :class:`Variant` registered as ``name``; a ``ValueError`` lists the known names."""
    registry = _discover()
    if name not in registry:
        raise ValueError(f"unknown adapter variant {name!r}; known variants: {', '.join(sorted(registry))}")  # error: variant-unknown
    return registry[name]


def peft_format(name: str) -> PeftFormat | None:
    """How the variant ``name`` is stored in HF peft's format (its file's ``PEFT``), or ``None``
    where peft has no such method."""
    get_variant(name)
    return _PEFT.get(name)
