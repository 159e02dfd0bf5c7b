"""A new variant is one file plus one test-table row.

The variant that docs/guide/variants.md ("Writing a variant") writes, saved as a module in a
directory the registry scans, is registered by that file alone, and every check of the
contract suite (tests/test_contract.py) passes over it with one ``Row``: identity at init,
merged = lazy = an independent ``W_eff`` formula after a perturbation, both routes, vmap over
stacks, per-example gradients, half-precision bases, save/load, the base untouched."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

import lora_func as lf
import lora_func.variants as variants
from tests import test_contract, test_rank_stack
from tests.variant_table import ROWS, Row

ROOT = Path(__file__).resolve().parents[1]
NAME = "lora_gain"


def _guide_variant_file(heading: str = "## Writing a variant") -> str:
    """The first python block after a heading of the guide: the whole file."""
    section = (ROOT / "docs" / "guide" / "variants.md").read_text().split(heading, 1)[1]
    return re.search(r"^```python\n(.*?)^```", section, re.S | re.M)[1]


def lora_gain_w_eff(p, buffers, W, bias, info):
    """Written here independently of the guide: diag(1 + g) W + (alpha / r) B A, (1 + g) ⊙ b."""
    gain = 1 + p["gain_g"]
    return gain[:, None] * W + info.alpha / info.r * p["gain_B"] @ p["gain_A"], None if bias is None else gain * bias


ROW = Row(variant=NAME, w_eff=lora_gain_w_eff, step0_nonzero=frozenset({"gain_B", "gain_g"}), spec_kwargs={"r": 4, "alpha": 6.0})


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """The guide's file in a directory on the variants package's path, a fresh registry and the
    row in the table; all undone afterwards."""
    (tmp_path / f"{NAME}.py").write_text(_guide_variant_file())
    monkeypatch.setattr(variants, "__path__", [*variants.__path__, str(tmp_path)])
    monkeypatch.setattr(variants, "_REGISTRY", {})
    monkeypatch.setitem(ROWS, NAME, ROW)
    yield
    sys.modules.pop(f"{variants.__name__}.{NAME}", None)


# Every contract check that takes a row and a layer kind (plus tmp_path / a half dtype).
CHECKS = {
    name: check
    for name, check in vars(test_contract).items()
    if name.startswith("test_") and {"row", "kind"} <= set(inspect.signature(check).parameters)
}


def test_the_registry_finds_the_file_and_the_table_has_its_row(registered):
    assert NAME in lf.list_variants()
    assert repr(variants.get_variant(NAME)) == f"Variant('{NAME}')"
    test_contract.test_every_registered_variant_has_a_row()


def test_the_registry_skips_private_modules_and_the_file_is_gone_afterwards():
    assert NAME not in lf.list_variants() and not any(name.startswith("_") for name in lf.list_variants())


def test_every_contract_check_is_run_here():
    """A new check in test_contract.py is picked up by name; only the registry-wide one is
    not per row (it runs in the first test above)."""
    every = {name for name in vars(test_contract) if name.startswith("test_")}
    assert every - set(CHECKS) == {"test_every_registered_variant_has_a_row"} and len(CHECKS) == 13


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_contract_suite_passes_over_the_new_variant(check, kind, registered, tmp_path):
    function = CHECKS[check]
    extra = {"tmp_path": tmp_path} if "tmp_path" in inspect.signature(function).parameters else {}
    dtypes = [torch.bfloat16, torch.float16] if "dtype" in inspect.signature(function).parameters else [None]
    for dtype in dtypes:
        function(row=ROW, kind=kind, **extra, **({} if dtype is None else {"dtype": dtype}))


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_the_new_variant_is_written_and_read_in_its_peft_style_storage(kind, registered, tmp_path):
    """The guide's ``PEFT`` record is all its peft storage needs: ``save_peft`` writes its tensors
    under the schema's keys and its option under its config field, per-layer ranks and alphas as
    peft's patterns; ``load_peft`` reads it back to the same adapter (spec, tensors, outputs), and
    an invalid option value in the file is refused naming the field."""
    import json

    model = test_contract.tiny_model(test_contract.LAYER_KIND_MODEL[kind])
    first = lf.init_adapter(model, lf.AdapterSpec(NAME, targets=test_contract.spec_for(ROW, test_contract.LAYER_KIND_MODEL[kind]).targets, r=4, alpha=6.0, gain_init=0.25), generator=torch.Generator().manual_seed(0))
    adapter = test_contract.perturbed(first, 0.2)
    lf.save_peft(adapter, tmp_path / "ckpt", model=model)
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA_GAIN" and config["gain_init"] == 0.25 and config["r"] == 4 and config["lora_alpha"] == 6.0
    again = lf.load_peft(tmp_path / "ckpt", model)
    # (load_peft names each adapted module: the spec's targets are the full names)
    assert again.spec.options == adapter.spec.options and again.layers == adapter.layers
    assert all(torch.equal(again.params[k], v) for k, v in adapter.params.items())
    ids = test_contract.tokens()
    assert torch.equal(lf.adapted_call(model, again, ids).logits, lf.adapted_call(model, adapter, ids).logits)
    (tmp_path / "ckpt" / "adapter_config.json").write_text(json.dumps({**config, "gain_init": -2.0}))
    with pytest.raises(ValueError, match=r"gain_init=-2\.0"):
        lf.load_peft(tmp_path / "ckpt", model)


def test_the_new_method_costs_one_small_file():
    """The guide's whole method, with its peft storage, is one short file that imports only the
    public contract."""
    text = _guide_variant_file()
    assert len(text.splitlines()) <= 100
    assert {line.split()[1] for line in text.splitlines() if line.startswith(("from ", "import "))} <= {"math", "torch", "lora_func.variants"}


def test_a_wrong_form_fails_the_contract(registered, monkeypatch):
    """Distinguishing power: the same suite over the variant with its gain dropped from the
    activation form (the forms then disagree) fails."""
    import dataclasses

    variant = variants.get_variant(NAME)
    broken = dataclasses.replace(variant, activation_form=lambda p, b, x, base, info: variant.activation_form({**p, "gain_g": 0 * p["gain_g"]}, b, x, base, info))
    monkeypatch.setitem(variants._REGISTRY, NAME, broken)
    with pytest.raises(AssertionError):
        test_contract.test_merged_lazy_and_oracle_agree_after_perturbation(row=ROW, kind="linear")


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_the_guide_variant_reads_info_r_naively_and_is_exact_in_a_rank_padded_stack(kind, registered):
    """The guide's variant computes its scale as ``info.alpha / info.r`` (one adapter's math, no
    rank-mask helper). In a stack of members of ranks 1, 2, 4 with alphas 2, 3, 4 (zero-padded
    to rank 4), every member's outputs and gradients equal the member alone: the contract
    presents each member with its own rank and alpha."""
    assert "info.alpha / info.r" in _guide_variant_file() and "layer_rank" not in _guide_variant_file()
    test_rank_stack.test_rank_padded_stack_equals_each_alone(NAME, kind)


# The guide's second variant: VeRA-like, with a frozen random pair shared by every layer.
SHARED_NAME = "vera_toy"


def vera_toy_w_eff(p, buffers, W, bias, info):
    """Written here independently of the guide: W + diag(b) B[:d_out] diag(d) A[:, :d_in]."""
    a, b = buffers["vera_A"][:, : W.shape[1]], buffers["vera_B"][: W.shape[0]]
    return W + torch.diag(p["vera_b"]) @ b @ torch.diag(p["vera_d"]) @ a, bias


# perturb_scale 1: the toy's effect at 0.1 (b ~ 0.1, d ~ 0.1) is below bf16's rounding of the base output.
SHARED_ROW = Row(variant=SHARED_NAME, w_eff=vera_toy_w_eff, step0_nonzero=frozenset({"vera_b"}), spec_kwargs={"r": 4}, perturb_scale=1.0)


@pytest.fixture
def registered_shared(tmp_path, monkeypatch):
    (tmp_path / f"{SHARED_NAME}.py").write_text(_guide_variant_file("### Tensors shared across layers"))
    monkeypatch.setattr(variants, "__path__", [*variants.__path__, str(tmp_path)])
    monkeypatch.setattr(variants, "_REGISTRY", {})
    monkeypatch.setitem(ROWS, SHARED_NAME, SHARED_ROW)
    yield
    sys.modules.pop(f"{variants.__name__}.{SHARED_NAME}", None)


def test_the_shared_basis_is_one_frozen_leaf_of_the_adapter(registered_shared):
    model, adapter = test_contract.build(SHARED_ROW, "linear")
    assert sorted(k for k in adapter.buffers if k.startswith("<shared>.")) == ["<shared>.vera_A", "<shared>.vera_B"]
    assert not any(k.startswith("<shared>.") for k in adapter.params)
    assert adapter.num_parameters() == sum(4 + layer.info.d_out for layer in adapter.layers)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_contract_suite_passes_over_the_shared_basis_variant(check, kind, registered_shared, tmp_path):
    function = CHECKS[check]
    extra = {"tmp_path": tmp_path} if "tmp_path" in inspect.signature(function).parameters else {}
    dtypes = [torch.bfloat16, torch.float16] if "dtype" in inspect.signature(function).parameters else [None]
    for dtype in dtypes:
        function(row=SHARED_ROW, kind=kind, **extra, **({} if dtype is None else {"dtype": dtype}))

