"""The shared contract table: one Row per registered variant, one file per row in
``tests/variant_rows/``. ``test_contract.py`` runs every check over every row x layer kind."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from torch import Tensor

from lora_func.variants import LayerInfo

# (params, buffers, W (d_out, d_in) float64, b (d_out,) float64 | None, info) -> (W_eff, b_eff)
Oracle = Callable[[dict[str, Tensor], dict[str, Tensor], Tensor, "Tensor | None", LayerInfo], "tuple[Tensor, Tensor | None]"]


@dataclasses.dataclass(frozen=True)
class Row:
    """How the contract suite exercises one variant.

    Attributes:
      variant: the registered name.
      w_eff: the explicit ``W_eff, b_eff`` formula from variants.md, written independently of
        the package (tensors arrive as float64; short names as in the adapter).
      step0_nonzero: short names of trainable tensors whose step-0 gradient is non-zero in every
        layer; every other trainable tensor's gradient must be exactly zero.
      spec_kwargs: extra ``AdapterSpec`` arguments (r, alpha, options).
      identity_rtol: max |logit difference| to the base at init, relative to max |base logit|
        (0.0 = bit-exact).
      perturb_scale: std of the random perturbation added to every trainable tensor.
      targets: per tiny-model kind, the targets to use (default tests/models.DEFAULT_TARGETS).
      calibration: whether ``init_adapter`` needs calibration batches.
      tol: atol for merged == lazy == oracle comparisons in fp32.
      training_only: short names of trainable tensors that act in training steps only
        (MonteCLoRA's sampler priors): the eval-mode checks that every tensor moves the output and
        gets a per-example gradient leave them out; the variant's own tests check them in training.
      step0_by_kind: ``step0_nonzero`` on the target kinds where the init differs (peft's
        embedding inits draw ``B`` and zero ``A``).
      y_oracle: for a variant without a merged weight (the ``no_merged_weight`` trait: its update
        depends on the call's inputs), the explicit layer output ``(params, buffers, x (..., d_in),
        W, b, info) -> y (..., d_out)`` in float64 that the suite checks the lazy paths against;
        ``w_eff`` is then unused (``None`` allowed).
    """

    variant: str
    w_eff: Oracle
    step0_nonzero: frozenset[str]
    spec_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    identity_rtol: float = 0.0
    perturb_scale: float = 0.1
    targets: dict[str, list[str]] | None = None
    calibration: bool = False
    tol: float = 2e-5
    training_only: frozenset[str] = frozenset()
    step0_by_kind: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    y_oracle: Callable[..., Tensor] | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        """The contract suite's paths that apply (tests/contract_helpers.PATHS): the lazy ones
        only for a variant without a merged weight."""
        from lora_func.variants import get_variant
        from tests.contract_helpers import PATHS

        return PATHS if get_variant(self.variant).merges else tuple(p for p in PATHS if not p.endswith("merged"))

    def step0(self, kind: str) -> frozenset[str]:
        """The trainable tensors with a non-zero step-0 gradient on a target of ``kind``."""
        return self.step0_by_kind.get(kind, self.step0_nonzero)


def _collect() -> dict[str, Row]:
    from tests import variant_rows

    rows: dict[str, Row] = {}
    for info in sorted(pkgutil.iter_modules(variant_rows.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"tests.variant_rows.{info.name}")
        for row in getattr(module, "ROWS", ()) + ((module.ROW,) if hasattr(module, "ROW") else ()):
            assert row.variant not in rows, f"two rows for {row.variant}"
            rows[row.variant] = row
    return rows


ROWS: dict[str, Row] = _collect()
