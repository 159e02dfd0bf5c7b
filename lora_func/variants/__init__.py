"""The variant contract and the variant registry.

A variant is one module in this package that defines ``VARIANT`` (or a tuple ``VARIANTS``), a
:class:`Variant` of pure functions; it is registered under that variant's name. Adding a
variant is adding a file (plus one row in the contract-test table, ``tests/variant_rows/``);
modules whose name starts with ``_`` are not variants. What a variant author writes against:

- :class:`Variant`: the record a variant file defines (``init``, ``weight_form``,
  ``activation_form``, options and flags; its docstring gives every signature and shape);
- :class:`LayerInfo`: the static facts about one layer (``d_in``, ``d_out``, ``r``,
  ``alpha``, ``has_bias``, options) every function receives;
- :class:`BaseLayer`: the frozen base layer the activation form calls (``weight (d_out,
  d_in)``, ``bias``, ``base(x)`` with the model's own op);
- :data:`TensorDict`, :class:`InitFn`, :data:`WeightFn`, :data:`ActivationFn`: the types of
  the tensors and functions;
- :func:`padded_member`: what the forms see of one member of a rank-padded stack (adapters of
  different ranks): its rank axes masked, ``info.r`` / ``info.alpha`` its own, so a variant
  writes its math for one adapter; :func:`layer_rank`, :func:`layer_alpha` read a member's
  rank and alpha from a stack's raw buffers;
- :class:`PeftFormat`, :class:`PeftMethod`, :class:`PeftLayer`: how the variant is stored in
  HF peft's checkpoint format (``Variant(peft=...)``), for a variant that peft also has.

docs/guide/variants.md ("Writing a variant") walks through one.
"""

from __future__ import annotations

import importlib
import pkgutil

from lora_func.variants._contract import (
    ActivationFn,
    BaseLayer,
    InitFn,
    LayerInfo,
    PeftFormat,
    PeftLayer,
    PeftMethod,
    TensorDict,
    Variant,
    WeightFn,
    is_finite_number,
    layer_alpha,
    layer_rank,
    padded_member,
)

__all__ = [
    "ActivationFn",
    "BaseLayer",
    "InitFn",
    "LayerInfo",
    "PeftFormat",
    "PeftLayer",
    "PeftMethod",
    "TensorDict",
    "Variant",
    "WeightFn",
    "get_variant",
    "is_finite_number",
    "layer_alpha",
    "layer_rank",
    "list_variants",
    "padded_member",
]

_REGISTRY: dict[str, Variant] = {}


def _discover() -> dict[str, Variant]:
    if not _REGISTRY:
        found: dict[str, Variant] = {}
        for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if module_info.name.startswith("_"):
                continue  # the contract itself, helpers: not variants
            module = importlib.import_module(f"{__name__}.{module_info.name}")
            declared = getattr(module, "VARIANTS", ()) + ((module.VARIANT,) if hasattr(module, "VARIANT") else ())
            for variant in declared:
                if variant.name in found:
                    raise RuntimeError(f"variant {variant.name!r} is defined twice (second time in {module.__name__})")  # error: variant-duplicate
                found[variant.name] = variant
        _REGISTRY.update(found)
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
