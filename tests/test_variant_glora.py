"""GLoRA beyond the contract suite, against HF peft 0.21 in float64: a peft checkpoint with
perturbed paths loads with peft's logits and per-tensor gradients (merged and lazy), for every
form of every path, on biased layers and a bias-free one (A and B only); ``save_peft`` writes
peft's keys (the ``none`` paths' zero buffers included) and loads in peft; the inits are peft's
draw for draw; peft refuses GPT-2 ``Conv1D`` and so does ``save_peft``."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file

import lora_func as lf
from tests import bank_oracle, methods_oracle
from tests.models import tiny_model, tokens
from tests.variant_checks import assert_config_checks, assert_peft_round_trip, init_params

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

# q_proj, v_proj biased (C, D, E present), up_proj bias-free (A, B only); 32x32, 16x32, 48x32
TARGETS = ["q_proj", "v_proj", "up_proj"]
KEY = methods_oracle.nested_key(r"glora_([A-E])\.default\.(\w+)$", r"glora_\1_\2")
FORMS = [("lora", "lora", "constant"), ("vector", "vector", "vector"), ("constant", "none", "none"), ("none", "lora", "vector")]


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def _config(forms, **kwargs) -> peft.GloraConfig:
    a_b, c, d_e = forms
    return peft.GloraConfig(r=3, target_modules=TARGETS, config_A_B=a_b, config_C=c, config_D_E=d_e, **kwargs)


@pytest.mark.parametrize("forms", FORMS, ids=["-".join(f) for f in FORMS])
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients_and_saves_as_peft(llama64, tmp_path, forms):
    pm = bank_oracle.peft_model(llama64, _config(forms), scale=0.3)
    adapter, _ = methods_oracle.check_against_peft(llama64, pm, tmp_path / "peft", KEY)
    assert dict(adapter.spec.options) == {"config_A_B": forms[0], "config_C": forms[1], "config_D_E": forms[2], "init": "zero"}
    ids = tokens(2, 9, seed=3)
    want = lf.adapted_call(llama64, adapter, ids).logits
    lf.save_peft(adapter, tmp_path / "ours", model=llama64)
    theirs, ours = load_file(tmp_path / "peft" / "adapter_model.safetensors"), load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours) and all(torch.count_nonzero(ours[k]) == 0 for k in ours if k.endswith(".zeros"))
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path / "ours", ids), want) < bank_oracle.RTOL


@pytest.mark.parametrize("init_weights", [True, False])
@pytest.mark.parametrize("forms", [("lora", "lora", "vector"), ("vector", "vector", "constant")], ids=["lora", "vector"])
def test_the_init_is_peft_s_draw_for_draw(init_weights, forms):
    """Every Xu (and, with init_weights=False, every Xd, vector and constant) from peft's global
    RNG in peft's order: kaiming fan-ins r / d_in / 1 (a column) / n (a 1-D vector), N(0, 0.02²)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(tiny_model("llama"), _config(forms, init_weights=init_weights))
    model = tiny_model("llama")  # the global RNG as peft found it
    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    a_b, c, d_e = forms
    spec = lf.AdapterSpec("glora", targets=TARGETS, r=3, config_A_B=a_b, config_C=c, config_D_E=d_e, init="zero" if init_weights else "random")
    adapter = lf.init_adapter(model, spec, generator=generator)
    want = methods_oracle.peft_params(pm, KEY)
    assert sorted(want) == sorted(adapter.params)
    for key, p in want.items():
        assert torch.equal(adapter.params[key], p), key
    assert any(torch.count_nonzero(p) == 0 for p in want.values()) == init_weights


def test_peft_refuses_conv1d_and_so_does_save_peft(tmp_path):
    with pytest.raises(ValueError, match="GLoRA does not support this layer type"):
        peft.get_peft_model(tiny_model("gpt2"), peft.GloraConfig(target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("glora", targets=["c_attn"], r=2))
    with pytest.raises(ValueError, match="peft refuses glora on GPT-2 Conv1D"):
        lf.save_peft(adapter, tmp_path / "x")


def test_peft_config_checks_and_round_trip():
    assert_config_checks(
        "glora",
        peft.GloraConfig,
        {"config_A_B": ["full", None, 1], "config_C": ["constant"], "config_D_E": ["lora"], "init_weights": [0], "r": [0, 1.5]},
        good={"config_A_B": ["none", "vector", "constant"], "config_C": ["none", "vector"], "config_D_E": ["none", "vector"]},
    )
    assert_peft_round_trip("glora", {"config_A_B": "vector", "config_C": "none", "config_D_E": "vector", "init": "random"})


@pytest.mark.parametrize("forms", FORMS, ids=["-".join(f) for f in FORMS])
def test_init_gives_the_asked_dtype_for_each_form(forms):
    from lora_func.variants import glora

    a_b, c, d_e = forms
    for init in ("zero", "random"):
        params, _ = init_params(glora, "glora", 3, 6, 5, init=init, config_A_B=a_b, config_C=c, config_D_E=d_e)
        assert all(k.startswith("glora_A") or k.startswith("glora_B") for k in params)  # layer_info: no bias, so no C, D, E


@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_an_fp32_adapter_on_an_fp64_biased_layer_computes_w_c_in_fp64(layout):
    """The bias path's ``W C`` mixes the base's and the adapter's dtypes (found by
    test_properties): lazy and merged agree with the explicit formula in float64."""
    from tests.one_layer import one_layer, perturbed, run

    model = one_layer(layout, 5, 4, True, torch.float64, 0)
    spec = lf.AdapterSpec("glora", targets=["proj"], r=2, dtype=torch.float32)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0)), 3)
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    base = lf.base_params(model)
    p = {k.rsplit(".", 1)[-1]: v.detach().double() for k, v in adapter.params.items()}
    w = model.proj.weight.detach() if layout == "linear" else model.proj.weight.detach().T
    b = model.proj.bias.detach()
    w_eff = w + w * (p["glora_A_Xd"] @ p["glora_A_Xu"]) + p["glora_B_Xd"] @ p["glora_B_Xu"]
    b_eff = b + b * p["glora_D_X"] + p["glora_E_X"] + (w @ (p["glora_C_Xd"] @ p["glora_C_Xu"])).squeeze(-1)
    want = x @ w_eff.T + b_eff
    assert (want - run(model, base, x)).abs().max() > 1e-2
    for make in (lf.overlay, lf.merge_overlay):
        got = run(model, make(base, adapter), x)
        assert got.dtype == torch.float64 and (got - want).abs().max() < 1e-5 * want.abs().max()


def test_bias_paths_only_on_a_bf16_layer():
    """``config_A_B="none"`` (no weight update: only the bias paths) with an fp32 adapter on a bf16
    layer: lazy and merged agree with the explicit formula to bf16's round-off."""
    from tests.one_layer import one_layer, perturbed, run

    model = one_layer("linear", 5, 4, True, torch.bfloat16, 0)
    spec = lf.AdapterSpec("glora", targets=["proj"], r=2, config_A_B="none", config_C="vector", config_D_E="vector", dtype=torch.float32)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0)), 3, scale=0.5)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).bfloat16()
    p = {k.rsplit(".", 1)[-1]: v.detach().double() for k, v in adapter.params.items()}
    w, b = model.proj.weight.detach().double(), model.proj.bias.detach().double()
    want = x.double() @ w.T + b + b * p["glora_D_X"] + p["glora_E_X"] + (w @ p["glora_C_X"]).squeeze(-1)
    base = lf.base_params(model)
    assert (want - run(model, base, x).double()).abs().max() > 0.1
    for make in (lf.overlay, lf.merge_overlay):
        got = run(model, make(base, adapter), x)
        assert got.dtype == torch.bfloat16 and (got.double() - want).abs().max() < 2e-2 * want.abs().max(), make.__name__
