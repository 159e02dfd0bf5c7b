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

__all__ = ["DEFAULTS", "DEMO_R", "DEMO_TASK_TOKENS", "FALLBACK", "NOT_TRAINED", "MethodDefaults", "method_defaults"]

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
      note: what the sweep found, or what the demo gives the method, in a few words (the docs'
        table shows it).
      targets: the modules this method trains (``AdapterSpec(targets=)``); ``None``: the demo's
        (the attention projections, or ``--targets``). A method that adapts something else names
        it here: trainable tokens the embedding table.
      tied: ``AdapterSpec(tied=)`` for ``targets`` (the shipped model ties its embedding and its
        output head); ``None``: the spec's default.
    """

    lr: float
    r: int | None = None
    alpha: float | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    note: str = ""
    targets: tuple[str, ...] | None = None
    tied: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def rank(self) -> int:
        """The rank this row trains with: ``r``, or ``DEMO_R`` when the row names none."""
        return DEMO_R if self.r is None else self.r


def _row(
    lr: float, note: str = "", *, r: int | None = None, alpha: float | None = None, targets: tuple[str, ...] | None = None,
    tied: str | None = None, **options: Any,
) -> MethodDefaults:
    return MethodDefaults(lr=lr, r=r, alpha=alpha, options=options, note=note, targets=targets, tied=tied)


# The token ids of every word of the demo's two tasks (lora_func.demo.corpus: the questions, the
# answers and the closing full stop; no special token) in the shipped tokenizer: what trainable
# tokens re-trains there (tests/test_demo.py recomputes them from the tokenizer).
DEMO_TASK_TOKENS = (4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 73, 90, 101)


# One row per registered method the demo trains (tests/test_demo.py checks that every one of
# lora_func.list_variants() has a row here or in NOT_TRAINED, never both).
DEFAULTS: Mapping[str, MethodDefaults] = MappingProxyType({
    "adalora": _row(0.01),
    "adamss": _row(0.01),
    "alora": _row(0.003, "no invocation sequence in the demo's prompts: it acts on every token, so it trains as LoRA (the same runs)", alpha=16.0),
    "antipasto": _row(0.03),
    "bdlora": _row(0.01),
    "beft": _row(0.1, "no merged weight on the bias-free layers: the demo generates its samples on the lazy path"),
    "boft": _row(0.03),
    "c3a": _row(0.3),
    "corda": _row(0.0003),
    "deft": _row(0.003),
    "delora": _row(0.003),
    "dora": _row(0.003),
    "eva": _row(0.003),
    "fourierft": _row(0.03, init_weights=True, r=1000),
    "frod": _row(0.03),
    "glora": _row(0.003),
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
    "monteclora": _row(0.01, "the demo trains the model in eval mode, where MonteCLoRA draws no samples: LoRA with its own init here"),
    "oft": _row(0.003),
    "olora": _row(0.003),
    "osf": _row(0.01),
    "peanut": _row(0.003),
    "pissa": _row(0.001),
    "poly": _row(0.01, "one task (n_tasks=1): the router mixes the 4 skills for the demo's only task"),
    "psoft": _row(0.03),
    "pvera": _row(0.1),
    "qalora": _row(0.01),
    "randlora": _row(0.003, randlora_alpha=64.0),
    "road": _row(0.1),
    "shira": _row(0.003),
    "supertuning": _row(0.03),
    "tinylora": _row(0.01),
    "trainable_tokens": _row(0.01, "the demo gives it token_indices: the words of its two tasks (DEMO_TASK_TOKENS), on the tied embedding",
                             targets=("embed_tokens",), tied="both", token_indices=DEMO_TASK_TOKENS),
    "unilora": _row(0.03, theta_d_length=4096),
    "vblora": _row(0.01),
    "velora": _row(0.003, "the demo trains the model in eval mode, where VeLoRA's compressed activations are off: it trains as LoRA (the same runs)", alpha=16.0),
    "vera": _row(0.1),
    "waveft": _row(0.001, r=1000),
})

# The registered methods the demo does not train, each with its reason: `lora-func demo` and the
# dashboard report them in their results table with it (status "skipped"), the guide lists them
# (docs/guide/hyperparameters.md, "### Not trained by the demo"), and no sweep record is expected.
NOT_TRAINED: Mapping[str, str] = MappingProxyType({
    "arrow": "training-free: Arrow routes among LoRAs already trained on other tasks (build it with "
             "lora_func.routed.arrow from them, docs/routed.md); it is not trained from scratch",
    "lora_bias": "needs target layers with a bias (the trained lora_bias is added to it); the demo's "
                 "model has no bias in any layer",
    "xlora": "a mixture of LoRA experts trained before (build it with lora_func.routed.xlora from them, "
             "docs/routed.md) whose classifier trains through the two-pass lora_func.routed.xlora_call, "
             "not the demo's single adapted call",
    "lily": "not swept yet: added after the demo's learning-rate sweep (issue 43), so the demo has no "
            "chosen learning rate for it",
})

# A method registered after this table was written (a user's own variant): LoRA-like settings.
FALLBACK = MethodDefaults(lr=1e-2, note="no sweep: a method registered outside lora_func")


def method_defaults(variant: str) -> MethodDefaults:
    """``variant``'s row of :data:`DEFAULTS`, or :data:`FALLBACK` for a method it lacks."""
    return DEFAULTS.get(variant, FALLBACK)
