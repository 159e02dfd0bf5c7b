"""The count in docs/io.md: of peft's configurations for lora_func's methods (each variant with a
peft entry x each layer kind of tests/models.LAYER_KIND_MODEL), how many load exactly, how many
lora_func refuses, and how many peft itself has not.

Each cell, on the tiny model of that kind in float64 (the expert model in float32):

- lora_func adapts the kind: its adapter (the contract row's spec, perturbed) is written by
  ``save_peft``; peft loads it (``PeftModel.from_pretrained``) and gives lora_func's outputs
  (relative 1e-9; 2e-5 in float32), and ``load_peft`` reads it back exactly: **exact**. Where
  ``save_peft`` refuses, the first words of its reason are recorded (peft refuses the method on
  that kind: GPT-2 ``Conv1D``, a conv of a shape it does not take).
- lora_func does not adapt the kind: the variant's peft config (as ``save_peft`` writes it on
  Linear layers) retargeted at the kind's modules; peft builds it (``get_peft_model``): **refused**
  by lora_func (``variant-kind-unsupported``), or peft raises: **peft has none**.

Run ``python -m tests.peft_coverage`` from the repository root to print the table;
tests/test_peft_coverage.py checks docs/io.md's against it.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

import lora_func as lf
from tests.models import DEFAULT_TARGETS, LAYER_KIND_MODEL, MODEL_SPEC, tiny_model
from tests.variant_table import ROWS

KINDS = sorted(LAYER_KIND_MODEL)


def _inputs(model_kind: str) -> torch.Tensor:
    from tests.models import tokens

    return tokens()


def _in_input_dtype(model):
    """transformers' RMSNorm computes in float32: in the input dtype here, on both sides."""
    import types

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(forward, m)
    return model


def _build(row, kind: str, dtype: torch.dtype):
    """(model, adapter) of the contract row on the kind's tiny model, both in ``dtype``."""
    from tests.contract_helpers import calibration_batches, spec_for

    model_kind = LAYER_KIND_MODEL[kind]
    model = _in_input_dtype(tiny_model(model_kind, dtype=dtype))
    spec = spec_for(row, model_kind, dtype=dtype)
    calibration = calibration_batches() if row.calibration else None
    return model, lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(100), calibration=calibration)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _perturbed(adapter):
    g = torch.Generator().manual_seed(7)
    return adapter.with_params({k: v.detach() + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})


def _quiet():
    manager = warnings.catch_warnings()
    manager.__enter__()
    warnings.simplefilter("ignore")
    return manager


class _BlockDiag:
    """peft's CUDA ``FastBlockDiag`` on the CPU (BOFT with several butterfly factors)."""

    @staticmethod
    def apply(blocks):
        return torch.stack([torch.block_diag(*factor) for factor in blocks])


class _Float64Torch:
    """``torch`` with ``float32`` meaning ``float64``. peft's DEFT layer casts to float32 whatever
    the model's dtype (``_project``, ``forward``): unmodified it differs from lora_func's float64
    by float32 round-off (2e-7 on Linear, 6e-8 on Conv1D); with this proxy as its module's
    ``torch`` (nothing else changed, as tests/test_variant_deft.py's oracle) it agrees exactly."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


def cell(variant: str, kind: str, tmp: Path) -> str:
    """``"exact"``, ``"differs"``, ``"refused: <reason>"``, ``"peft has none"`` or ``"error: ..."``."""
    import peft.tuners.boft.layer as boft_layer
    import peft.tuners.deft.layer as deft_layer
    import pytest

    with pytest.MonkeyPatch.context() as mend:
        mend.setattr(boft_layer, "_FBD_CUDA", object())  # peft with its CUDA extension, emulated
        mend.setattr(boft_layer, "FastBlockDiag", _BlockDiag)
        mend.setattr(deft_layer, "torch", _Float64Torch())  # DEFT's float32 casts in the probe's float64
        try:
            return _cell(variant, kind, tmp)
        except Exception as err:  # recorded, not hidden: the table shows it
            return f"error: {type(err).__name__}: {str(err)[:80]}"


def _cell(variant: str, kind: str, tmp: Path) -> str:
    from peft import PeftConfig, PeftModel, get_peft_model

    row = ROWS[variant]
    # (peft initialises MiCA in float32 only; the expert model runs its fp32 kernels)
    dtype = torch.float32 if kind == "experts" or variant == "mica" else torch.float64
    model_kind = LAYER_KIND_MODEL[kind]
    quiet = _quiet()
    try:
        if kind in lf.get_variant(variant).kinds:
            model, adapter = _build(row, kind, dtype)
            adapter = _perturbed(adapter)
            problems = lf.io.peft_problems(adapter, model=model)
            if problems:
                return "save_peft refuses: " + problems[0].split(";")[0].removeprefix("save_peft: ")[:90]
            # (peft's causal-LM wrapper is the one that hands a routed method its task_ids)
            lf.save_peft(adapter, tmp / "ours", model=model, task_type="CAUSAL_LM" if variant == "poly" else None)
            ids = _inputs(model_kind)
            peft_model = PeftModel.from_pretrained(_in_input_dtype(tiny_model(model_kind, dtype=dtype)), tmp / "ours").eval()
            if variant == "poly":  # a routed method: one task per batch row, peft's task_ids
                from lora_func.routed import task_call

                tasks = torch.arange(ids.shape[0]) % int(adapter.spec.option("n_tasks"))
                want = _logits(task_call(model, adapter, ids, task_ids=tasks, use_cache=False))
                got = _logits(peft_model(input_ids=ids, task_ids=tasks))
                return "exact" if (got - want).abs().max() <= (2e-5 if dtype == torch.float32 else 1e-9) * want.abs().max() else "differs"
            want = _logits(lf.adapted_call(model, adapter, ids))
            got = _logits(peft_model(ids))
            rtol = 2e-5 if dtype == torch.float32 else 1e-9
            # (a variant stored converted reads back as the plain method: compared on outputs)
            again = lf.load_peft(tmp / "ours", model)
            back = _logits(lf.adapted_call(model, again, ids))
            off = max(float((got - want).abs().max() / want.abs().max()), float((back - want).abs().max() / want.abs().max()))
            return "exact" if off <= rtol else f"differs ({off:.0e})"
        if lf.variants.peft_format(variant).export_needs_base is not None:
            return "n/a (stored converted)"  # its config is the plain method's: no probe of its own
        # the variant's config on Linear layers, retargeted at this kind's modules
        linear_model, linear = _build(row, "linear", dtype)
        lf.save_peft(_perturbed(linear), tmp / "linear", model=linear_model)
        config = json.loads((tmp / "linear" / "adapter_config.json").read_text())
        targets = DEFAULT_TARGETS[model_kind]
        config["target_modules"] = targets
        config.pop("rank_pattern", None), config.pop("alpha_pattern", None)
        if "feedforward_modules" in config:
            config["feedforward_modules"] = [] if not targets else targets[:1]
        if MODEL_SPEC.get(model_kind, {}).get("target_parameters"):
            config["target_parameters"] = MODEL_SPEC[model_kind]["target_parameters"]
        (tmp / "linear" / "adapter_config.json").write_text(json.dumps(config))
        try:
            get_peft_model(tiny_model(model_kind, dtype=dtype), PeftConfig.from_pretrained(tmp / "linear"))
        except Exception:  # peft's own refusal, whatever its type
            return "peft has none"
        return "refused: variant-kind-unsupported"
    finally:
        quiet.__exit__(None, None, None)


def table() -> dict[tuple[str, str], str]:
    variants = [v for v in sorted(ROWS) if lf.variants.peft_format(v) is not None and lf.variants.peft_format(v).reads is not None]
    out = {}
    for variant in variants:
        for kind in KINDS:
            with tempfile.TemporaryDirectory() as tmp:
                out[variant, kind] = cell(variant, kind, Path(tmp))
    return out


# a cell's label in docs/io.md
LABELS = {
    "exact": "exact",
    "differs": "≈",  # with the measured relative difference
    "save_peft refuses": "peft ✗",  # peft refuses the method on that layer (save_peft says so)
    "peft has none": "·",
    "refused": "refused",  # peft builds it, lora_func refuses (variant-kind-unsupported)
    "n/a": "n/a",  # stored converted: its config is the plain method's
    "error": "error",
}


def label(cell_text: str) -> str:
    head = cell_text.split(" (")[0].split(":")[0]
    if head == "differs":
        return f"≈ {cell_text.split('(')[1].rstrip(')')}"
    if head == "error" and "CUDA" in cell_text:
        return "error (peft needs CUDA)"
    return LABELS[head]


def _category(label_text: str) -> str:
    if label_text.startswith("≈"):
        return "≈" if float(label_text.split()[1]) <= 2e-7 else "differs"
    if label_text.startswith("error"):
        return "cuda" if "CUDA" in label_text else "error"
    return label_text


def count_line(labels: list[str]) -> str:
    """The sentence above the table: the cells counted by category (a difference above peft's
    float32 round-off is counted apart, and so is an error that is not peft's CUDA requirement)."""
    counts = Counter(_category(c) for c in labels)
    names = {"exact": "exact", "≈": "within 2e-7 (≈)", "differs": "differing where the docs say why (≈ above 1e-6)",
             "refused": "refused by lora_func", "cuda": "not run on the CPU (peft needs CUDA)",
             "error": "where peft fails on our file or model (error)", "peft ✗": "refused by peft itself (peft ✗)",
             "·": "not in peft (·)", "n/a": "n/a"}
    return f"{len(labels)} cells: " + ", ".join(f"{counts[k]} {names[k]}" for k in names if counts[k]) + "."


def markdown(cells: dict[tuple[str, str], str]) -> str:
    lines = [count_line([label(c) for c in cells.values()]), ""]
    variants = sorted({v for v, _ in cells})
    lines.append("| variant | " + " | ".join(KINDS) + " |")
    lines.append("|---|" + "---|" * len(KINDS))
    for v in variants:
        lines.append(f"| `{v}` | " + " | ".join(label(cells[v, k]) for k in KINDS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(table()))
