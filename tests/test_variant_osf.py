"""OSF beyond the contract suite, against HF peft 0.21 in float64: the SVD split is peft's bit for
bit (trained and frozen parts, the stored ``U_high`` / ``V_high``), the random init is peft's draw
for draw; a peft checkpoint with perturbed ``U``, ``S``, ``V`` loads with peft's logits and its
projected gradients (merged and lazy) on square, wide and tall layers for each form of
``effective_rank``; ``save_peft`` loads in peft; the gradients stay off the frozen subspace; the
refusals (a layer with nothing frozen or nothing trained, ``rank_pattern``, ``Conv1D``)."""

from __future__ import annotations

import copy
import json
import warnings

import peft
import pytest
import torch

import lora_func as lf
from tests import bank_oracle, methods_oracle
from tests.contract_helpers import loss_fn, perturbed
from tests.models import tiny_model, tokens
from tests.variant_checks import assert_config_checks, assert_peft_round_trip, init_params, layer_info

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj", "up_proj"]  # 32x32 (square), 16x32 (V_high), 48x32 (U_high)
KEY = methods_oracle.nested_key(r"osf_svd_params\.default\.(U|S|V)_low$", r"osf_\1")
BUFFERS = {"_osf_U_low_init": "osf_U0", "_osf_S_low_init": "osf_S0", "_osf_V_low_init": "osf_V0", "_osf_U_high": "osf_U_high", "_osf_V_high": "osf_V_high"}


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def _peft_buffers(pm) -> dict[str, torch.Tensor]:
    out = {}
    for name, module in pm.named_modules():
        for attr, ours in BUFFERS.items():
            if "default" in getattr(module, attr, {}):
                out[f"{name.removeprefix('base_model.model.')}.{ours}"] = getattr(module, attr)["default"]
    return out


@pytest.mark.parametrize("effective_rank", [None, 12, 0.25], ids=["half", "12", "quarter"])
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_projected_gradients(llama64, tmp_path, effective_rank):
    pm = bank_oracle.peft_model(llama64, peft.OSFConfig(target_modules=TARGETS, effective_rank=effective_rank), scale=0.1)
    adapter, _ = methods_oracle.check_against_peft(llama64, pm, tmp_path / "peft", KEY)
    assert adapter.spec.option("effective_rank") == effective_rank
    assert sorted(_peft_buffers(pm)) == sorted(adapter.buffers)  # U_high on up_proj, V_high on v_proj only
    assert all(torch.equal(adapter.buffers[k], t) for k, t in _peft_buffers(pm).items())
    ids = tokens(2, 9, seed=3)
    want = lf.adapted_call(llama64, adapter, ids).logits
    lf.save_peft(adapter, tmp_path / "ours", model=llama64)
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path / "ours", ids), want) < bank_oracle.RTOL


@pytest.mark.parametrize("init_weights", [True, False])
def test_the_init_is_peft_s(llama64, init_weights):
    torch.manual_seed(0)  # peft's randn_like from the global RNG; ours from a generator of the same seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(llama64), peft.OSFConfig(target_modules=TARGETS, init_weights=init_weights))
    generator = torch.Generator().manual_seed(0)
    adapter = lf.init_adapter(llama64, lf.AdapterSpec("osf", targets=TARGETS, dtype=torch.float64, init="svd" if init_weights else "random"), generator=generator)
    want = methods_oracle.peft_params(pm, KEY)
    assert sorted(want) == sorted(adapter.params)
    assert all(torch.equal(adapter.params[k], p) for k, p in want.items())
    assert all(torch.equal(adapter.buffers[k], t) for k, t in _peft_buffers(pm).items())
    # and the split is the SVD of W: W = U_high S_high V_high + U0 S0 V0 (an independent float64 SVD's singular values)
    for layer in adapter.layers:
        w = llama64.get_submodule(layer.target.module).weight
        s = torch.linalg.svdvals(w)
        torch.testing.assert_close(adapter.buffers[f"{layer.target.module}.osf_S0"], s[layer.info.r :], atol=1e-6, rtol=1e-6)


def test_the_gradients_stay_off_the_frozen_subspace(llama64):
    adapter = perturbed(lf.init_adapter(llama64, lf.AdapterSpec("osf", targets=TARGETS, dtype=torch.float64, effective_rank=10)), 0.1)
    ids = tokens(2, 9, seed=3)
    base = lf.base_params(llama64)
    for merged in (False, True):
        grads = torch.func.grad(loss_fn(llama64, base, adapter, ids, merged=merged))(adapter.params)
        for layer in adapter.layers:
            m, k = layer.target.module, layer.info.r
            w = llama64.get_submodule(m).weight.float()
            u, _, vh = torch.linalg.svd(w, full_matrices=True)
            u_high, v_high = u[:, :k].double(), vh[:k].double()
            gu, gv = grads[f"{m}.osf_U"], grads[f"{m}.osf_V"]
            assert gu.abs().max() > 1e-6 and gv.abs().max() > 1e-6
            assert (u_high.T @ gu).abs().max() < 1e-6 * gu.abs().max(), m
            assert (gv @ v_high.T).abs().max() < 1e-6 * gv.abs().max(), m


def test_refusals(llama64, tmp_path):
    with pytest.raises(ValueError, match=r"effective_rank=20 freezes 16 of the 16 directions of model.layers.0.self_attn.v_proj"):
        lf.init_adapter(llama64, lf.AdapterSpec("osf", targets=["v_proj"], effective_rank=20))
    with pytest.raises(ValueError, match="effective_rank=0 must be None"):
        lf.AdapterSpec("osf", targets=["v_proj"], effective_rank=0)
    pm = bank_oracle.peft_model(llama64, peft.OSFConfig(target_modules=["q_proj"]), scale=0.1)
    pm.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"rank_pattern": {"q_proj": 4}}))
    with pytest.raises(ValueError, match=r"features lora_func does not support: \['rank_pattern'\]"):
        lf.load_peft(tmp_path, llama64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skipped = peft.get_peft_model(tiny_model("gpt2"), peft.OSFConfig(target_modules=["c_attn"]))
    assert not any(p.requires_grad for p in skipped.parameters())  # peft silently skips Conv1D
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("osf", targets=["c_attn"]))
    with pytest.raises(ValueError, match="peft refuses osf on GPT-2 Conv1D"):
        lf.save_peft(adapter, tmp_path / "x")


def test_peft_config_checks_and_round_trip():
    assert_config_checks(
        "osf", peft.OSFConfig, {"effective_rank": [0, -1, 1.5, 0.0, True, "4"], "init_weights": [0]},
        good={"effective_rank": [None, 1, 64, 1.0, 0.01]},
    )
    assert_peft_round_trip("osf", {"effective_rank": 0.5, "init": "random"})


@pytest.mark.parametrize(("left", "complement"), [(True, True), (True, False), (False, True), (False, False)])
def test_the_traced_projection_is_the_eager_one(left, complement):
    """Under torch.compile the projection is plain ops (dynamo does not trace the autograd node):
    the same value bit for bit and the same gradient, for each side and kind."""
    from lora_func.variants.osf import _projected_ops, _ProjectedGradient

    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    basis, _ = torch.linalg.qr(torch.randn(6 if left else 4, 3, generator=g, dtype=torch.float64))
    basis = basis if left else basis.T.contiguous()
    upstream = torch.randn(6, 4, generator=g, dtype=torch.float64)
    eager = _ProjectedGradient.apply(t, basis, left, complement)
    traced = _projected_ops(t, basis, left, complement)
    assert torch.equal(eager, t) and torch.equal(traced, t)
    want = torch.autograd.grad((eager * upstream).sum(), t)[0]
    got = torch.autograd.grad((traced * upstream).sum(), t)[0]
    torch.testing.assert_close(got, want, atol=1e-14, rtol=0)
    projector = basis @ basis.T if left else basis.T @ basis
    expected = upstream - (projector @ upstream if left else upstream @ projector) if complement else (projector @ upstream if left else upstream @ projector)
    torch.testing.assert_close(want, expected, atol=1e-14, rtol=0)


@pytest.mark.parametrize("shape", [(5, 5), (4, 6), (6, 4)])
def test_init_gives_the_asked_dtype_and_the_high_factor_of_the_tall_or_wide_side(shape):
    from lora_func.variants import osf

    d_out, d_in = shape
    for init in ("svd", "random"):
        params, buffers = init_params(osf, "osf", 2, d_in, d_out, init=init)
        assert {k: tuple(v.shape) for k, v in params.items()} == {"osf_U": (d_out, min(shape) - 2), "osf_S": (min(shape) - 2,), "osf_V": (min(shape) - 2, d_in)}
        assert ("osf_U_high" in buffers, "osf_V_high" in buffers) == (d_out > d_in, d_out < d_in)


def test_a_bf16_base_s_factors_are_peft_s_rounded_to_bf16():
    """peft's decompose_weight_matrix: the float32 SVD of a bf16 weight, each factor rounded to
    bf16; asked for float32 factors, init holds exactly those bf16 values (frozen and trained)."""
    from peft.tuners.osf.utils import decompose_weight_matrix

    from lora_func.variants import osf

    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(3)).bfloat16()
    info = layer_info("osf", 2, 4, 6)
    params, buffers = osf.init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    want = decompose_weight_matrix(weight, 2)
    for ours, theirs in (("U0", "U_low"), ("S0", "S_low"), ("V0", "V_low"), ("U_high", "U_high")):
        assert torch.equal(buffers[f"osf_{ours}"], want[theirs].detach().float()), ours
    for name in ("U", "S", "V"):
        assert torch.equal(params[f"osf_{name}"], buffers[f"osf_{name}0"]), name


def test_an_in_place_step_on_the_trained_factors_leaves_the_frozen_copies():
    """The trained U, S, V start as copies of the frozen U0, S0, V0, not views of them: an
    optimizer's in-place step moves the trained ones only."""
    from tests.one_layer import one_layer

    adapter = lf.init_adapter(one_layer("linear", 6, 4, True, torch.float32, 0), lf.AdapterSpec("osf", ["proj"], effective_rank=2))
    frozen = {k: v.clone() for k, v in adapter.buffers.items()}
    with torch.no_grad():
        for p in adapter.params.values():
            p.add_(1.0)
    assert all(torch.equal(adapter.buffers[k], v) for k, v in frozen.items())


def test_a_fraction_that_freezes_no_direction_is_refused():
    from tests.one_layer import one_layer

    # int(4 · 0.2) = 0 frozen directions on a 4x6 layer
    with pytest.raises(ValueError, match=r"effective_rank=0\.2 freezes 0 of the 4 directions"):
        lf.init_adapter(one_layer("linear", 6, 4, True, torch.float32, 0), lf.AdapterSpec("osf", ["proj"], effective_rank=0.2))
