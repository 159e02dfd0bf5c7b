"""Super-Tuning beyond the contract suite, against HF peft 0.21.2 in float64 (peft moves its
float32 values and LoRA to the model's dtype and computes there, so its own forward is the
oracle): peft checkpoints with perturbed trainables (Supra with and without an explicit
``lora_alpha``, ``select_top=False``, ``save_precomputed_indices=False``, Super) load with peft's
logits and per-tensor gradients (lazy and merged, relative 1e-9); ``save_peft`` loads in peft;
the positions and the draws of ``init_adapter`` are peft's; dropout equals peft's under one seed;
peft's config checks; peft's refusal of GPT-2 Conv1D.

A Super checkpoint (peft's ``r=None``) holds ``"lora_alpha": null``: the generic config check in
``lora_func/io/_peft_config.py`` leaves ``lora_alpha`` to Super-Tuning's own option check (null
allowed: peft's ``2·lora_r``), so it loads as peft wrote it, and so does ``save_peft``'s.
"""

from __future__ import annotations

import copy
import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file

import lora_func as lf
from lora_func.io._peft_config import _config_problems
from lora_func.io.peft import peft_problems
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss
from tests.variant_checks import assert_peft_round_trip, read_options

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*save_precomputed_indices.*:UserWarning"),
]

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def _assert_peft_s_logits_and_gradients(model, pm, adapter) -> None:
    """``adapter``'s logits and per-tensor gradients are ``pm``'s (lazy and merged)."""
    ids = tokens(2, 9, seed=3)
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    peft_grads = {bank_oracle.lf_key(n): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    assert sorted(peft_grads) == sorted(adapter.params) and (want - model(ids).logits).abs().max() > 1e-2
    for merged in (False, True):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        got = lf.adapted_call(model, adapter.with_params(params), ids, merged=merged).logits
        assert bank_oracle.rel(got, want) < bank_oracle.RTOL, merged
        for key, g in zip(params, torch.autograd.grad(ce_loss(got, ids), list(params.values())), strict=True):
            assert peft_grads[key].abs().max() > 0 and bank_oracle.rel(g, peft_grads[key]) < bank_oracle.RTOL, (key, merged)


def _config(**kwargs) -> peft.SupertuningConfig:
    return peft.SupertuningConfig(**{"target_modules": TARGETS, "sparsity": 0.9, **kwargs})


@pytest.mark.parametrize(
    "options",
    [{"r": 2, "lora_alpha": 3.0}, {"r": 3}, {"r": 2, "select_top": False, "save_precomputed_indices": False}],
    ids=["supra", "supra-default-alpha", "bottom-unsaved-indices"],
)
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path, options):
    pm = bank_oracle.peft_model(llama64, _config(**options), scale=0.3)
    adapter, _ = bank_oracle.check_against_peft(llama64, pm, tmp_path)
    assert adapter.spec.option("lora_r") == options["r"] and adapter.spec.option("lora_alpha") == options.get("lora_alpha", 2 * options["r"])
    stored = load_file(tmp_path / "adapter_model.safetensors")
    key = "model.layers.0.mlp.down_proj.supertuning_indices"
    assert (f"base_model.model.{key}" in stored) is options.get("save_precomputed_indices", True)
    # saved or recomputed from the base weight's magnitudes on load: peft's positions
    assert torch.equal(adapter.buffers[key], pm.base_model.model.model.layers[0].mlp.down_proj.supertuning_indices["default"].long())
    lf.save_peft(adapter, tmp_path / "ours", model=llama64)
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        ours = lf.adapted_call(llama64, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path / "ours", ids), ours) < bank_oracle.RTOL


def test_a_super_checkpoint_loads_with_its_null_lora_alpha(llama64, tmp_path):
    pm = bank_oracle.peft_model(llama64, _config(), scale=0.3)
    pm.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] is None and config["lora_alpha"] is None
    adapter = lf.load_peft(tmp_path, llama64)
    _assert_peft_s_logits_and_gradients(llama64, pm, adapter)
    assert adapter.spec.option("lora_r") is None and sorted({k.rsplit(".", 1)[1] for k in adapter.params}) == ["supertuning_values"]
    lf.save_peft(adapter, tmp_path / "ours", model=llama64)
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        ours = lf.adapted_call(llama64, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path / "ours", ids), ours) < bank_oracle.RTOL
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["lora_alpha"] is None  # peft's null, written back
    reloaded = lf.load_peft(tmp_path / "ours", llama64)
    assert all(torch.equal(reloaded.params[k], v) for k, v in adapter.params.items())


@pytest.mark.parametrize("options", [{"r": 2}, {"r": 3, "init_weights": False, "select_top": False}, {"init_weights": False}], ids=["supra", "random-bottom", "super-random"])
def test_init_adapter_draws_peft_s_positions_and_numbers(options):
    model = tiny_model("llama")
    torch.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), _config(**options))
    spec_options = {"lora_r": options.get("r"), "select_top": options.get("select_top", True), "init": "random" if options.get("init_weights") is False else "identity"}
    adapter = lf.init_adapter(model, lf.AdapterSpec("supertuning", TARGETS, sparsity=0.9, **spec_options), generator=torch.Generator().manual_seed(4))
    peft_params = {bank_oracle.lf_key(n): p for n, p in pm.named_parameters() if p.requires_grad}
    assert sorted(peft_params) == sorted(adapter.params)
    for key, p in peft_params.items():
        assert torch.equal(adapter.params[key], p), key
    for name, module in pm.named_modules():
        if hasattr(module, "supertuning_indices") and "default" in module.supertuning_indices:
            key = f"{name.removeprefix('base_model.model.')}.supertuning_indices"
            assert torch.equal(adapter.buffers[key], module.supertuning_indices["default"].long()), key


def test_dropout_in_a_training_step_equals_peft_s(llama64, tmp_path):
    """lora_dropout drops the LoRA's input only, from the global RNG in module order."""
    pm = bank_oracle.peft_model(llama64, _config(r=2, lora_dropout=0.4), scale=0.3)
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, llama64)
    ids = tokens(2, 9, seed=3)
    model, got = bank_oracle.dropout_step_against_peft(llama64, pm, adapter, ids)
    torch.manual_seed(1)
    assert (lf.adapted_call(model, adapter, ids).logits - got).abs().max() > 1e-4, "the dropout mask must come from the RNG"


def test_peft_config_checks_and_round_trip():
    fields = {"sparsity", "select_top", "r", "lora_alpha", "lora_dropout", "init_weights", "save_precomputed_indices"}
    defaults = {k: v for k, v in _config().to_dict().items() if k in fields}
    config = {"peft_type": "SUPERTUNING", **defaults}
    assert config["lora_alpha"] is None and _config_problems(config) == []  # null: peft's 2·lora_r (module docstring)
    del config["lora_alpha"]
    assert _config_problems(config) == [] and read_options("supertuning", config) == {**dict(lf.AdapterSpec("supertuning", ["x"]).options), "sparsity": 0.9}
    bad = {
        "sparsity": [1.0, -0.1, float("nan"), "0.5"], "select_top": [None, 1], "r": [0, 1.5, "2", True], "lora_alpha": ["x", float("inf")],
        "lora_dropout": [1.0, -0.5], "init_weights": [None], "save_precomputed_indices": [0],
    }
    for name, values in bad.items():
        for value in values:
            problems = _config_problems({**config, "r": 2, name: value})
            assert [p for p in problems if p.startswith(f"{name}=")], (name, value, problems)
    for good in ({"r": 2, "lora_alpha": 5}, {"sparsity": 0.0}, {"r": 1, "lora_alpha": -1.5}):
        assert _config_problems({**config, **good}) == [], good
    assert_peft_round_trip("supertuning", {"sparsity": 0.5, "select_top": False, "lora_r": 3, "lora_alpha": 7.0, "dropout": 0.2, "init": "random", "save_precomputed_indices": False})


def test_peft_refuses_gpt2_conv1d_and_peft_problems_says_so():
    with pytest.raises((TypeError, ValueError)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(tiny_model("gpt2"), peft.SupertuningConfig(target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("supertuning", targets=["c_attn"], sparsity=0.9))
    assert "refuses" in peft_problems(adapter)[0]


def test_the_positions_are_the_largest_or_smallest_magnitudes():
    """An independent count: the top (bottom) n |W| entries, n = int(d_out·d_in·(1 − sparsity))
    (peft's rounding: 0.99 of 32·32 leaves 10, not 11)."""
    model = tiny_model("llama")
    weight = model.model.layers[0].self_attn.q_proj.weight.detach()
    for select_top in (True, False):
        adapter = lf.init_adapter(model, lf.AdapterSpec("supertuning", ["q_proj"], select_top=select_top))
        flat = adapter.buffers["model.layers.0.self_attn.q_proj.supertuning_indices"]
        assert flat.dtype == torch.int64 and flat.shape == (10,) and len(set(flat.tolist())) == 10
        chosen = weight.abs().flatten()[flat]
        rest = weight.abs().flatten()[[i for i in range(weight.numel()) if i not in set(flat.tolist())]]
        assert (chosen.min() >= rest.max()) if select_top else (chosen.max() <= rest.min())


def test_a_spec_without_lora_alpha_scales_its_lora_as_peft_s_two_lora_r():
    """``lora_alpha=None`` (the option's default; peft's config fills in ``2·lora_r``) scales the
    LoRA by 2: the same outputs as ``lora_alpha = 2·lora_r``, not as ``lora_alpha = lora_r``."""
    from tests.one_layer import one_layer, run

    model = one_layer("linear", 6, 5, True, torch.float64, 0)
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    base = lf.base_params(model)
    outs = {}
    for alpha in (None, 6.0, 3.0):
        spec = lf.AdapterSpec("supertuning", ["proj"], sparsity=0.5, lora_r=3, lora_alpha=alpha, init="random", dtype=torch.float64)
        adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1))
        outs[alpha] = run(model, lf.overlay(base, adapter), x)
    torch.testing.assert_close(outs[None], outs[6.0], rtol=1e-14, atol=1e-14)
    assert (outs[None] - outs[3.0]).abs().max() > 1e-3


@pytest.mark.parametrize("lora_r", [None, 2])
def test_init_gives_the_asked_dtype(lora_r):
    from lora_func.variants import supertuning
    from tests.variant_checks import init_params

    params, buffers = init_params(supertuning, "supertuning", 2, 6, 5, sparsity=0.5, lora_r=lora_r, init="random")
    assert sorted(params) == (["supertuning_lora_A", "supertuning_lora_B"] if lora_r else []) + ["supertuning_values"]
    assert buffers["supertuning_indices"].dtype == torch.int64
