"""PSOFT beyond the contract suite, against HF peft 0.21: the frozen SVD factors are peft's bit for
bit (full and low-rank SVD, both ``ab_svd_init``), the random init is peft's draw for draw; a
peft checkpoint with perturbed trainables loads with peft's logits and per-tensor gradients in
float64 (merged and lazy) for the exact Cayley map, the Cayley–Neumann series with its norm bound,
and a free ``R`` without magnitude vectors; ``save_peft`` writes peft's keys and loads in peft; a
free ``R`` stacks across ranks; peft refuses ``Conv1D`` and so does ``save_peft``.

peft's PSOFT refuses a float64 base (its init), so its float64 oracle is the peft model built on
the float32 copy of the base, perturbed, and cast to float64 as a whole (``.double()``: base,
trainables and the cached factors); lora_func loads its checkpoint on the float64 base, computing
the factors in fp32 from the same weights, as peft does."""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file

import lora_func as lf
from tests import bank_oracle, methods_oracle
from tests.contract_helpers import perturbed
from tests.models import tiny_model, tokens
from tests.variant_checks import assert_config_checks, assert_peft_round_trip, init_params

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj", "up_proj"]  # 32x32 (biased), 16x32, 48x32
KEY = methods_oracle.nested_key(r"psoft_R\.default\.(weight|vector_a|vector_b)$", lambda m: "psoft_R" if m[1] == "weight" else f"psoft_{m[1]}")
CONFIGS = {
    "cayley": {},
    "neumann-eps": {"use_cayley_neumann": True, "num_cayley_neumann_terms": 4, "cayley_neumann_eps": 0.5},
    "free-pissa": {"psoft_orth": False, "psoft_mag_a": False, "psoft_mag_b": False, "ab_svd_init": "pissa_init"},
    "lowrank": {"psoft_svd": "lowrank", "psoft_svd_lowrank_niter": 2, "random_seed": 3, "psoft_mag_a": False},
}


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def _peft(model, **config):
    """peft's PSOFT on a float32 copy of ``model``, trainables perturbed, then cast to float64."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model).float(), peft.PsoftConfig(r=4, psoft_alpha=6, target_modules=TARGETS, **config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(0.4 * torch.randn(p.shape, generator=g))
    return pm.double().eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path, name):
    pm = _peft(llama64, **CONFIGS[name])
    if name == "neumann-eps":  # the bound acts on every layer (the perturbation's ‖Q‖ is above 0.5)
        assert all(torch.linalg.norm(m.psoft_R["default"]._skew_symmetric()) > 0.5 for m in pm.modules() if hasattr(m, "psoft_R"))
    adapter, _ = methods_oracle.check_against_peft(llama64, pm, tmp_path, KEY)
    assert adapter.spec.alpha == 6.0 and adapter.spec.r == 4
    for module in pm.modules():
        if hasattr(module, "_psoft_A_cache"):  # the recomputed frozen factors: peft's values
            key = next(layer.target.module for layer in adapter.layers if pm.get_submodule(f"base_model.model.{layer.target.module}") is module)
            assert torch.equal(adapter.buffers[f"{key}.psoft_A"], module._psoft_A_cache["default"])
            assert torch.equal(adapter.buffers[f"{key}.psoft_B"], module._psoft_B_cache["default"])


@pytest.mark.parametrize("init_weights", [True, False])
@pytest.mark.parametrize("orth", [True, False])
def test_init_and_save_peft_are_peft_s(tmp_path, init_weights, orth):
    """float32: the factors and the trainables of init_adapter are peft's (the global RNG as peft
    found it, in a generator); save_peft writes peft's keys and shapes and loads in peft."""
    config = {"r": 4, "psoft_alpha": 6, "target_modules": TARGETS, "psoft_orth": orth, "init_weights": init_weights}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(tiny_model("llama"), peft.PsoftConfig(**config))
        pm.save_pretrained(tmp_path / "peft")
    model = tiny_model("llama")
    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    spec = lf.AdapterSpec("psoft", targets=TARGETS, r=4, alpha=6.0, psoft_orth=orth, init="identity" if init_weights else "random")
    adapter = lf.init_adapter(model, spec, generator=generator)
    want = methods_oracle.peft_params(pm, KEY)
    assert sorted(want) == sorted(adapter.params)
    assert all(torch.equal(adapter.params[k], p) for k, p in want.items())
    adapter = perturbed(adapter, 0.3)
    lf.save_peft(adapter, tmp_path / "ours", model=model)
    theirs, ours = load_file(tmp_path / "peft" / "adapter_model.safetensors"), load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    ids = tokens(2, 9, seed=3)
    want_logits = lf.adapted_call(model, adapter, ids).logits
    got = bank_oracle.peft_reload_logits(model, tmp_path / "ours", ids)
    assert bank_oracle.rel(got, want_logits) < 1e-5 and (want_logits - model(ids).logits).abs().max() > 1e-2


def test_a_free_rotation_stacks_across_ranks_with_zero_gradient_in_the_padding():
    model = tiny_model("llama")
    members = [
        perturbed(lf.init_adapter(model, lf.AdapterSpec("psoft", targets=["v_proj"], r=r, psoft_orth=False), generator=torch.Generator().manual_seed(r)), 0.3, seed=r)
        for r in (2, 4)
    ]
    stacked = lf.stack(members)
    ids = tokens(2, 9, seed=3)
    base = lf.base_params(model)

    def loss(adapter):
        out = torch.func.functional_call(model, lf.overlay(base, adapter), (ids,)).logits
        return out.square().mean()

    grads = torch.func.vmap(lambda a: torch.func.grad(lambda p: loss(a.with_params(p)))(a.params))(stacked)
    key = "model.layers.0.self_attn.v_proj.psoft_R"
    alone = torch.func.grad(lambda p: loss(members[0].with_params(p)))(members[0].params)[key]
    torch.testing.assert_close(grads[key][0, :2, :2], alone, atol=1e-6, rtol=1e-5)
    assert torch.count_nonzero(grads[key][0, 2:]) == 0 and torch.count_nonzero(grads[key][0, :, 2:]) == 0
    values = torch.func.vmap(loss)(stacked)
    torch.testing.assert_close(values, torch.stack([loss(m) for m in members]), atol=1e-6, rtol=1e-6)


def test_peft_refuses_conv1d_and_so_does_save_peft(tmp_path):
    with pytest.raises(ValueError, match=r"Only torch\.nn\.Linear is supported"):
        peft.get_peft_model(tiny_model("gpt2"), peft.PsoftConfig(r=2, target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("psoft", targets=["c_attn"], r=2))
    with pytest.raises(ValueError, match="peft refuses psoft on GPT-2 Conv1D"):
        lf.save_peft(adapter, tmp_path / "x")


def test_peft_config_checks_and_round_trip():
    assert_config_checks(
        "psoft",
        peft.PsoftConfig,
        {
            "ab_svd_init": ["svd", None], "psoft_svd": ["randomized"], "psoft_svd_lowrank_niter": [-1, 2.5], "random_seed": [-1, 1.5],
            "psoft_orth": [1], "psoft_mag_a": ["yes"], "psoft_mag_b": [0], "use_cayley_neumann": [None], "num_cayley_neumann_terms": [0, 2.0],
            "cayley_neumann_eps": [0.0, 1.0, float("nan"), -0.5], "psoft_dropout": [1.0, -0.1], "init_weights": [0], "r": [0], "psoft_alpha": [float("inf")],
        },
        good={"cayley_neumann_eps": [None, 0.9, 1e-3], "psoft_dropout": [None, 0.5], "num_cayley_neumann_terms": [1, 9], "psoft_svd_lowrank_niter": [0]},
    )
    assert_peft_round_trip(
        "psoft",
        {
            "ab_svd_init": "pissa_init", "psoft_svd": "lowrank", "psoft_svd_lowrank_niter": 3, "random_seed": 7, "psoft_orth": False,
            "psoft_mag_b": False, "psoft_mag_a": False, "use_cayley_neumann": True, "num_cayley_neumann_terms": 3,
            "cayley_neumann_eps": 0.4, "dropout": 0.1, "init": "random",
        },
    )


@pytest.mark.parametrize("orth", [True, False])
def test_init_gives_the_asked_dtype(orth):
    from lora_func.variants import psoft

    for init in ("identity", "random"):
        params, buffers = init_params(psoft, "psoft", 3, 6, 5, init=init, psoft_orth=orth)
        assert params["psoft_R"].shape == ((3,) if orth else (3, 3)) and sorted(buffers) == ["psoft_A", "psoft_B"]


def test_an_orthogonal_stack_with_a_rank_one_member_equals_each_member_alone():
    """Ranks 1 and 4 (the rank-1 member's skew triangle is empty: R is its magnitude vectors):
    the padded member reads no entry of the stacked triangle, and each member's loss and R
    gradient under vmap are its own."""
    model = tiny_model("llama")
    members = [
        perturbed(lf.init_adapter(model, lf.AdapterSpec("psoft", targets=["v_proj"], r=r), generator=torch.Generator().manual_seed(r)), 0.3, seed=r)
        for r in (1, 4)
    ]
    stacked = lf.stack(members)
    ids = tokens(2, 9, seed=3)
    base = lf.base_params(model)

    def loss(adapter):
        return torch.func.functional_call(model, lf.overlay(base, adapter), (ids,)).logits.square().mean()

    values = torch.func.vmap(loss)(stacked)
    torch.testing.assert_close(values, torch.stack([loss(m) for m in members]), atol=1e-6, rtol=1e-6)
    grads = torch.func.vmap(lambda a: torch.func.grad(lambda p: loss(a.with_params(p)))(a.params))(stacked)
    key = "model.layers.0.self_attn.v_proj.psoft_vector_b"
    alone = torch.func.grad(lambda p: loss(members[0].with_params(p)))(members[0].params)[key]
    torch.testing.assert_close(grads[key][0, :1], alone, atol=1e-6, rtol=1e-5)


def test_the_cayley_neumann_projection_is_peft_s_at_tiny_norms():
    """``cayley_neumann_eps``: Q scaled to ``eps / (‖Q‖ + 1e-12)`` where ``‖Q‖ > eps`` (the 1e-12
    matters at tiny norms), left alone at ``‖Q‖ = eps`` exactly; R against peft's OrthLayer in float64."""
    from peft.tuners.psoft.layer import OrthLayer

    from lora_func.variants import psoft
    from tests.variant_checks import layer_info

    g = torch.Generator().manual_seed(0)
    vec = torch.randn(3, dtype=torch.float64, generator=g) * 1e-10
    vectors = {f"psoft_vector_{s}": 1 + 0.1 * torch.randn(3, dtype=torch.float64, generator=g) for s in "ba"}
    norm = float(torch.linalg.norm(psoft._skew(vec, 3, layer_info("psoft", 3, 6, 5))))
    for eps in (norm / 3, norm):
        info = layer_info("psoft", 3, 6, 5, use_cayley_neumann=True, cayley_neumann_eps=eps)
        got = psoft.rotation({"psoft_R": vec, **vectors}, 3, info)
        layer = OrthLayer(3, use_cayley_neumann=True, cayley_neumann_eps=eps).double()
        with torch.no_grad():
            layer.weight.copy_(vec)
            layer.vector_b.copy_(vectors["psoft_vector_b"])
            layer.vector_a.copy_(vectors["psoft_vector_a"])
        torch.testing.assert_close(got, layer.get_matrix().detach(), rtol=1e-14, atol=0)
