"""The demo's per-method defaults: the learning rate, rank and options each registered method
trains with in ``lora-func demo``, the dashboard (examples/dashboard.py) and the sweep's
tables in docs/guide/hyperparameters.md. This is the one table they all read.

The values were chosen by ``scripts/lr_sweep.py`` on the demo task and on the worked-sums task
(``lora_func.demo.corpus``), three seeds each: the rule and the numbers behind every row are in
docs/guide/hyperparameters.md. They are demo-level choices for the shipped 1.2 M-parameter model
(120 steps, batch 16, AdamW, clipping at 1.0): the library's own defaults (``AdapterSpec``,
peft's values) are not changed by them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["DEFAULTS", "DEMO_R", "FALLBACK", "MethodDefaults", "method_defaults"]

# The rank the demo gives a method whose row names none (LoRA's r = 8 on the attention projections).
DEMO_R = 8


@dataclasses.dataclass(frozen=True)
class MethodDefaults:
    """One method's demo defaults.

    Attributes:
      lr: AdamW's learning rate.
      r: the rank (or what the method calls ``r``: FourierFT's number of frequencies, C3A's block
        size); ``None``: ``DEMO_R``.
      alpha: the scale numerator; ``None``: the variant's own default (peft's).
      options: variant options (``AdapterSpec(**options)``), e.g. FourierFT's ``scaling``.
      note: what the sweep found, in a few words (the docs' table shows it).
    """

    lr: float
    r: int | None = None
    alpha: float | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def rank(self) -> int:
        """The rank this row trains with: ``r``, or ``DEMO_R`` when the row names none."""
        return DEMO_R if self.r is None else self.r


def _row(lr: float, note: str = "", *, r: int | None = None, alpha: float | None = None, **options: Any) -> MethodDefaults:
    return MethodDefaults(lr=lr, r=r, alpha=alpha, options=options, note=note)


# One row per registered method (tests/test_demo.py checks that every one of
# lora_func.list_variants() has a row).
DEFAULTS: Mapping[str, MethodDefaults] = MappingProxyType({
    "adalora": _row(0.01),
    "adamss": _row(0.01),
    "antipasto": _row(0.03),
    "boft": _row(0.03),
    "c3a": _row(0.3),
    "corda": _row(0.0003),
    "delora": _row(0.003),
    "dora": _row(0.003),
    "eva": _row(0.003),
    "fourierft": _row(0.03, init_weights=True, r=1000),
    "gralora": _row(0.003),
    "hira": _row(0.03),
    "hra": _row(0.01),
    "ia3": _row(0.1),
    "ia3_ff": _row(0.1),
    "kasa": _row(0.01),
    "ln_tuning": _row(0.003),
    "loftq": _row(0.003),
    "loha": _row(0.01),
    "lokr": _row(0.01),
    "lora": _row(0.003, alpha=16.0),
    "lora_ga": _row(0.003),
    "mica": _row(0.01),
    "miss": _row(0.003),
    "oft": _row(0.003),
    "olora": _row(0.003),
    "pissa": _row(0.001),
    "pvera": _row(0.1),
    "randlora": _row(0.003, randlora_alpha=64.0),
    "road": _row(0.1),
    "shira": _row(0.003),
    "tinylora": _row(0.01),
    "unilora": _row(0.03, theta_d_length=4096),
    "vblora": _row(0.01),
    "vera": _row(0.1),
    "waveft": _row(0.001, r=1000),
})

# A method registered after this table was written (a user's own variant): LoRA-like settings.
FALLBACK = MethodDefaults(lr=1e-2, note="no sweep: a method registered outside lora_func")


def method_defaults(variant: str) -> MethodDefaults:
    """``variant``'s row of :data:`DEFAULTS`, or :data:`FALLBACK` for a method it lacks."""
    return DEFAULTS.get(variant, FALLBACK)
