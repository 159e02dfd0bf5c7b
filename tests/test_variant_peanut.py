"""PEANuT beyond the contract suite, against HF peft 0.21.2 in float64 (peft computes in the
adapter's dtype, so its own forward is the oracle): a peft checkpoint with perturbed trainables
(depths 0 to 3, several activations, a scaling) loads with peft's logits and per-tensor gradients
(lazy and merged, relative 1e-9); ``save_peft`` loads in peft; ``init_adapter`` draws peft's
numbers from the same seed (peft's construction draws included); the activation form builds no
``ΔW``; peft's config checks; peft's refusal of GPT-2 Conv1D."""

from __future__ import annotations

import copy
import re
import warnings

import peft
import pytest
import torch

import lora_func as lf
from lora_func.io.peft import peft_problems
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.one_layer import one_layer, run
from tests.peft_helpers import NoDenseProducts, ce_loss
from tests.variant_checks import assert_config_checks, assert_peft_round_trip

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def lf_key(peft_name: str) -> str:
    """``base_model.model.<m>.peanut_encoders.default.<i>.weight`` -> ``<m>.peanut_encoders_<i>``
    (``peanut_A`` / ``peanut_B``: ``<m>.peanut_A``)."""
    name = peft_name.removeprefix("base_model.model.").removesuffix(".weight")
    return re.sub(r"\.default(?:\.(\d+))?$", lambda m: f"_{m[1]}" if m[1] else "", name)


def peft_logits_and_grads(pm, ids):
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    return want, {lf_key(n): p.grad for n, p in pm.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "options",
    [{}, {"depth": 2, "act_fn": "gelu", "scaling": 0.5}, {"depth": 3, "act_fn": "sigmoid", "r": 5}, {"depth": 1, "act_fn": "silu", "init_weights": False}],
    ids=["depth0", "depth2-gelu", "depth3-sigmoid", "depth1-silu-random"],
)
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path, options):
    config = peft.PeanutConfig(**{"r": 4, "target_modules": TARGETS, **options})
    pm = bank_oracle.peft_model(llama64, config, scale=0.3)
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, llama64)
    assert adapter.spec.option("depth") == options.get("depth", 0) and adapter.spec.option("act_fn") == options.get("act_fn", "relu")
    ids = tokens(2, 9, seed=3)
    want, peft_grads = peft_logits_and_grads(pm, ids)
    assert sorted(peft_grads) == sorted(adapter.params)
    assert (want - llama64(ids).logits).abs().max() > 1e-2
    for merged in (False, True):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        got = lf.adapted_call(llama64, adapter.with_params(params), ids, merged=merged).logits
        assert bank_oracle.rel(got, want) < bank_oracle.RTOL, merged
        grads = torch.autograd.grad(ce_loss(got, ids), list(params.values()))
        for key, g in zip(params, grads, strict=True):
            assert peft_grads[key].abs().max() > 0 and bank_oracle.rel(g, peft_grads[key]) < bank_oracle.RTOL, (key, merged)
    lf.save_peft(adapter, tmp_path / "ours", model=llama64)
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path / "ours", ids), want) < bank_oracle.RTOL


@pytest.mark.parametrize("options", [{"depth": 2}, {"depth": 1, "init_weights": False}], ids=["identity", "random"])
def test_init_adapter_draws_peft_s_numbers_from_the_same_seed(options):
    model = tiny_model("llama")
    torch.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), peft.PeanutConfig(r=3, target_modules=TARGETS, **options))
    init = "random" if options.get("init_weights") is False else "identity"
    adapter = lf.init_adapter(model, lf.AdapterSpec("peanut", TARGETS, r=3, depth=options["depth"], init=init), generator=torch.Generator().manual_seed(4))
    peft_params = {lf_key(n): p for n, p in pm.named_parameters() if p.requires_grad}
    assert sorted(peft_params) == sorted(adapter.params)
    for key, p in peft_params.items():
        assert torch.equal(adapter.params[key], p), key
    assert bool(adapter.params["model.layers.0.mlp.down_proj.peanut_B"].any()) is (init == "random")


@pytest.mark.parametrize("depth", [0, 2])
def test_the_activation_form_builds_no_delta(depth):
    """``ΔW = s·B hᵀ`` has rank r: the activation form takes ``x h`` then ``Bᵀ`` (sizes 11 -> 7, r = 3)."""
    model = one_layer("linear", 11, 7, True, torch.float64, 0)
    adapter = lf.init_adapter(model, lf.AdapterSpec("peanut", ["proj"], r=3, depth=depth, act_fn="tanh", scaling=1.5, dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    adapter = adapter.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    x = torch.randn(5, 11, generator=g, dtype=torch.float64)
    base = lf.base_params(model)
    want = run(model, lf.merge_overlay(base, adapter), x)
    with NoDenseProducts(11, 7):
        got = run(model, lf.overlay(base, adapter), x)
    assert bank_oracle.rel(got, want) < 1e-12


def test_peft_config_checks_and_round_trip():
    assert_config_checks("peanut", peft.PeanutConfig, {
        "depth": [-1, 9, 1.5, None], "act_fn": ["nope", None, 1], "scaling": [float("nan"), "1"], "init_weights": [None, 0],
    }, good={"depth": [0, 8], "act_fn": ["gelu_new", "tanh", "linear"]})
    assert_peft_round_trip("peanut", {"depth": 3, "act_fn": "gelu", "scaling": 0.25, "init": "random"})


def test_peft_refuses_gpt2_conv1d_and_peft_problems_says_so():
    with pytest.raises((TypeError, ValueError, NotImplementedError)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(tiny_model("gpt2"), peft.PeanutConfig(r=2, target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("peanut", targets=["c_attn"], r=2))
    assert "refuses" in peft_problems(adapter)[0]
