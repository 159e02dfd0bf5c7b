"""Fit a method's size options to a model: when an adapter cannot be built because an option
does not suit the target layers' widths (VB-LoRA's ``vector_length=256`` on 128- and 64-wide
layers, RoAd's ``group_size=64`` on a 96-wide output, an odd ``r`` for HRA's paired init), take
the largest value below the asked one that builds.

Which values suit which layers is the variants' own business (their errors say it): this module
only proposes candidates (the divisors of the target widths and the widths themselves, largest
first) and keeps the first one ``init_adapter`` accepts. Built on the public API only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

import lora_func as lf

__all__ = ["SIZE_OPTIONS", "Fitted", "OptionChange", "fit_and_init", "respec"]

# Per variant, the integer options that depend on the target widths, tried in this order before
# ``r`` (which every variant may have to lower: ``r`` at most the narrowest width, C3A's block
# size a divisor of the widths, HRA's paired init an even ``r``).
SIZE_OPTIONS: dict[str, tuple[str, ...]] = {
    "vblora": ("vector_length",),
    "road": ("group_size",),
    "gralora": ("gralora_k",),
    "oft": ("oft_block_size",),
    "boft": ("boft_block_size",),
}


@dataclasses.dataclass(frozen=True)
class OptionChange:
    """``option`` was asked as ``asked`` and used as ``used``, because building with ``asked``
    raised ``reason``."""

    option: str
    asked: int
    used: int
    reason: str

    def describe(self) -> str:
        return f"{self.option}={self.asked} does not fit these layers; using {self.option}={self.used}, the largest value below it that does"


@dataclasses.dataclass(frozen=True)
class Fitted:
    """The adapter, the spec it was built from, and what was changed to build it (empty when the
    asked spec fitted)."""

    adapter: Any
    spec: lf.AdapterSpec
    changes: tuple[OptionChange, ...]


def respec(spec: lf.AdapterSpec, **changes: Any) -> lf.AdapterSpec:
    """``spec`` with ``changes`` (``r=``, ``alpha=`` or variant options) applied."""
    fields: dict[str, Any] = {
        "r": spec.r, "alpha": spec.alpha, "dtype": spec.dtype, "layer_types": spec.layer_types, "tied": spec.tied,
        "target_parameters": spec.target_parameters,
    }
    options = dict(spec.options)
    for name, value in changes.items():
        if name in fields:
            fields[name] = value
        else:
            options[name] = value
    targets = spec.targets if isinstance(spec.targets, str) else list(spec.targets)
    return lf.AdapterSpec(spec.variant, targets, **fields, **options)


def _target_widths(model: nn.Module, spec: lf.AdapterSpec) -> list[tuple[int, int]]:
    """``(d_in, d_out)`` of every target of ``spec``, read from a rank-1 LoRA on the same
    targets (empty when LoRA cannot adapt them)."""
    try:
        probe = lf.init_adapter(model, respec(lf.AdapterSpec("lora", spec.targets, r=1), layer_types=spec.layer_types, tied=spec.tied))
    except (ValueError, TypeError):
        return []
    return [(layer.target.d_in, layer.target.d_out) for layer in probe.layers]


def _candidates(asked: int, widths: Sequence[tuple[int, int]]) -> list[int]:
    """Values below ``asked``, largest first: every divisor of a target width, each width, and
    each layer's ``d_in * d_out`` (the bound of FourierFT's frequency count)."""
    pool: set[int] = set()
    for d_in, d_out in widths:
        pool.update({d_in, d_out, d_in * d_out})
        for width in (d_in, d_out):
            pool.update(k for k in range(1, width + 1) if width % k == 0)
    return sorted((v for v in pool if 1 <= v < asked), reverse=True)


def fit_and_init(model: nn.Module, spec: lf.AdapterSpec, init: Callable[[lf.AdapterSpec], Any]) -> Fitted:
    """``init(spec)``; if it raises ``ValueError``, retry with one size option of the variant
    (:data:`SIZE_OPTIONS`, then ``r``) lowered to each candidate in turn and keep the first that
    builds. Raises the first error when none does."""
    try:
        return Fitted(init(spec), spec, ())
    except ValueError as first:
        widths = _target_widths(model, spec)
        reason = str(first)
        for name in (*SIZE_OPTIONS.get(spec.variant, ()), "r"):
            asked = spec.r if name == "r" else dict(spec.options).get(name)
            if not isinstance(asked, int) or isinstance(asked, bool):
                continue
            for value in _candidates(asked, widths):
                try:
                    candidate = respec(spec, **{name: value})
                    adapter = init(candidate)
                except ValueError:
                    continue
                return Fitted(adapter, candidate, (OptionChange(name, asked, value, reason),))
        raise
