"""The variant registry: every module in this package that defines ``VARIANT`` (or a tuple
``VARIANTS``) is registered under that variant's name. Adding a variant is adding a file."""

from __future__ import annotations

import importlib
import pkgutil

from lora_func._types import Variant

__all__ = ["get_variant", "list_variants"]

_REGISTRY: dict[str, Variant] = {}


def _discover() -> dict[str, Variant]:
    if not _REGISTRY:
        found: dict[str, Variant] = {}
        for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            module = importlib.import_module(f"{__name__}.{module_info.name}")
            declared = getattr(module, "VARIANTS", ()) + ((module.VARIANT,) if hasattr(module, "VARIANT") else ())
            for variant in declared:
                if variant.name in found:
                    raise RuntimeError(f"variant {variant.name!r} is defined twice (second time in {module.__name__})")
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
        raise ValueError(f"unknown adapter variant {name!r}; known variants: {', '.join(sorted(registry))}")
    return registry[name]
