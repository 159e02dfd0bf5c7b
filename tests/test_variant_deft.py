"""DEFT beyond the contract suite, against HF peft 0.21.2 in float64.

peft computes DEFT's projection and update in float32 whatever the model's dtype (``_project``,
``forward``, ``_merge_factor`` cast to ``torch.float32``), so on a float64 model its outputs are
float32-accurate only. The oracle is peft's own code run in the input dtype: its layer module's
``torch`` is swapped for a proxy whose ``float32`` is ``float64`` (:func:`peft_in_float64`),
nothing else changed; peft's forward is then differentiated by autograd as it is. Checked: a peft
checkpoint with perturbed trainables (each decomposition, PaRa, an alpha, r capped at d_out, GPT-2
Conv1D) loads with peft's logits and per-tensor gradients (lazy and merged, relative 1e-9);
``save_peft`` loads in peft; ``init_adapter`` draws peft's P from the same seed; dropout in a
training step equals peft's under one global RNG seed; the activation form builds no ``W_eff``.
"""

from __future__ import annotations

import copy
import json
import warnings

import peft
import peft.tuners.deft.layer as peft_deft
import pytest
import torch

import lora_func as lf
from tests import bank_oracle
from tests.models import tokens
from tests.one_layer import one_layer, run
from tests.peft_helpers import NoDenseProducts
from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype, assert_peft_round_trip, saved_bytes

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


class _Float64Torch:
    """``torch`` with ``float32`` meaning ``float64``: peft's DEFT layer code, unchanged, in float64."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


@pytest.fixture
def peft_in_float64(monkeypatch):
    monkeypatch.setattr(peft_deft, "torch", _Float64Torch())


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def _config(kind: str, **kwargs) -> peft.DeftConfig:
    return peft.DeftConfig(**{"r": 4, "target_modules": TARGETS[kind], **kwargs})


CASES = [
    pytest.param("llama", {}, id="relu"),
    # r = 20 > v_proj's d_out = 16: peft caps that layer's rank (and its scale alpha / 16)
    pytest.param("llama", {"decomposition_method": "qr", "alpha": 6, "r": 20}, id="qr-alpha-capped"),
    pytest.param("llama", {"para": True}, id="para"),
    pytest.param("llama", {"para": True, "decomposition_method": "qr"}, id="para-qr"),
    pytest.param("gpt2", {"alpha": 3}, id="gpt2-conv1d"),
]


@pytest.mark.parametrize(("kind", "options"), CASES)
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path, kind, options, peft_in_float64):
    model = llama64 if kind == "llama" else bank_oracle.model64("gpt2")
    pm = bank_oracle.peft_model(model, _config(kind, fan_in_fan_out=kind == "gpt2", **options), scale=0.3)
    adapter, _ = bank_oracle.check_against_peft(model, pm, tmp_path)
    assert adapter.spec.option("para") is options.get("para", False)
    assert adapter.spec.option("injection_alpha") == options.get("alpha")
    if options.get("r") == 20:
        assert adapter.params["model.layers.0.self_attn.v_proj.deft_P"].shape == (16, 16)
        assert adapter.params["model.layers.0.self_attn.q_proj.deft_P"].shape == (32, 20)
    # save_peft writes what peft reads back to the same logits
    lf.save_peft(adapter, tmp_path / "ours", model=model)
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        ours = lf.adapted_call(model, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(model, tmp_path / "ours", ids), ours) < bank_oracle.RTOL


def test_peft_s_own_float32_forward_is_within_float32_round_off(llama64, tmp_path):
    """Without the float64 oracle, peft's forward on the float64 model differs from lora_func's
    only by float32 round-off: the one difference the oracle removes."""
    pm = bank_oracle.peft_model(llama64, _config("llama", decomposition_method="qr"), scale=0.3)
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, llama64)
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        err = bank_oracle.rel(lf.adapted_call(llama64, adapter, ids).logits, pm(input_ids=ids).logits)
    assert 1e-12 < err < 1e-5, err


@pytest.mark.parametrize("options", [{}, {"init_weights": False, "init_scale": 3.0}, {"r": 20, "alpha": 5}, {"para": True}], ids=["identity", "random", "capped", "para"])
def test_init_adapter_draws_peft_s_numbers_from_the_same_seed(llama64, options, peft_in_float64):
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(llama64), _config("llama", **options))
    names = {"init_weights": "init", "alpha": "injection_alpha"}
    spec_options = {names.get(k, k): ({True: "identity", False: "random"}[v] if k == "init_weights" else v) for k, v in options.items() if k != "r"}
    spec = lf.AdapterSpec("deft", TARGETS["llama"], r=options.get("r", 4), dtype=torch.float64, **spec_options)
    adapter = lf.init_adapter(llama64, spec, generator=torch.Generator().manual_seed(7))
    peft_params = {bank_oracle.lf_key(n): p for n, p in pm.named_parameters() if "deft_" in n}
    assert sorted(peft_params) == sorted(adapter.params)
    for key, p in peft_params.items():
        if key.endswith("deft_R") and options.get("init_weights", True):
            # peft computes R = rightᵀ W / s and stores it in its float32 parameter before the model's
            # dtype reaches it: float32 round-off of lora_func's float64 R
            assert bank_oracle.rel(adapter.params[key], p) < 1e-7, key
        else:
            assert torch.equal(adapter.params[key], p), key
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        base, ours = llama64(ids).logits, lf.adapted_call(llama64, adapter, ids).logits
    if options.get("para"):
        assert (ours - base).abs().max() > 1e-3  # PaRa removes a subspace from the start
    elif options.get("init_weights", True):
        assert (ours - base).abs().max() < 1e-12 * base.abs().max()
    else:
        assert (ours - base).abs().max() > 1e-3


@pytest.mark.parametrize("para", [False, True])
def test_dropout_in_a_training_step_equals_peft_s(llama64, tmp_path, peft_in_float64, para):
    """deft_dropout drops the injection's input only (the removal sees the whole input), from the
    global RNG in module order: one seed, peft's logits and gradients. PaRa has no injection: no
    draw, the training step is the eval step."""
    pm = bank_oracle.peft_model(llama64, _config("llama", deft_dropout=0.4, para=para), scale=0.3)
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, llama64)
    assert adapter.spec.option("dropout") == 0.4
    ids = tokens(2, 9, seed=3)
    model, got = bank_oracle.dropout_step_against_peft(llama64, pm, adapter, ids)
    torch.manual_seed(1)
    other = lf.adapted_call(model, adapter, ids).logits
    with torch.no_grad():
        evaluated = lf.adapted_call(llama64, adapter, ids).logits
    if para:
        assert torch.equal(other, got) and bank_oracle.rel(evaluated, got) < 1e-14
    else:
        assert (other - got).abs().max() > 1e-4, "the dropout mask must come from the RNG"
        assert not torch.equal(evaluated, got)  # eval: no dropout


@pytest.mark.parametrize("method", ["relu", "qr"])
@pytest.mark.parametrize("para", [False, True])
def test_the_activation_form_builds_no_dense_matrix(method, para):
    """The removal and the injection run as one rank-r path: no (d_out, d_in) W_eff, no (d_out,
    d_out) projector (sizes 11 -> 7, r = 3)."""
    model = one_layer("linear", 11, 7, True, torch.float64, 0)
    spec = lf.AdapterSpec("deft", ["proj"], r=3, decomposition_method=method, para=para, injection_alpha=2.0, dtype=torch.float64)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    adapter = adapter.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    x = torch.randn(5, 11, generator=g, dtype=torch.float64)
    base = lf.base_params(model)
    want = run(model, lf.merge_overlay(base, adapter), x)
    with NoDenseProducts(11, 7):
        got = run(model, lf.overlay(base, adapter), x)
    assert bank_oracle.rel(got, want) < 1e-12


@pytest.mark.parametrize("method", ["relu", "qr"])
@pytest.mark.parametrize("ranks", [(2, 5), (3, 20)], ids=["2-5", "3-20-capped"])
def test_a_stack_of_different_ranks_equals_each_member_alone(method, ranks):
    """``P`` and ``R`` are ``min(r, d_out)`` wide (``padded_axes``): a stack pads them and each
    member masks its padding, capped rank included (r = 20 on a 9-wide layer: its own scale
    alpha / 9). QR of a zero-padded ``P`` has orthonormal columns for the padding too, which the
    member masks (else its projection removes more than its own directions). Outputs and
    gradients, lazy and merged; the padding's gradient is exactly zero."""
    model = one_layer("linear", 12, 9, True, torch.float64, 0)
    members = []
    for i, r in enumerate(ranks):
        spec = lf.AdapterSpec("deft", ["proj"], r=r, decomposition_method=method, injection_alpha=3.0, dtype=torch.float64)
        adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(i))
        g = torch.Generator().manual_seed(10 + i)
        members.append(adapter.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()}))
    stacked = lf.stack(members)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    probe = torch.randn(4, 9, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    base = lf.base_params(model)
    for make in (lf.overlay, lf.merge_overlay):

        def loss(params, adapter, make=make):
            return (run(model, make(base, adapter.with_params(params)), x) * probe).sum()

        batched = torch.vmap(lambda a: torch.func.grad_and_value(loss)(a.params, a))(stacked)
        for i, member in enumerate(members):
            grads, value = torch.func.grad_and_value(loss)(member.params, member)
            assert abs(float((batched[1][i] - value).detach())) < 1e-12 * abs(float(value.detach())), (make.__name__, i)
            for key, g in grads.items():
                padded = batched[0][key][i]
                own = padded[tuple(slice(0, n) for n in g.shape)]
                assert bank_oracle.rel(own, g) < 1e-12, (make.__name__, i, key)
                assert torch.count_nonzero(padded) == torch.count_nonzero(own), (make.__name__, i, key)  # zero on the padding


def test_peft_config_checks_and_round_trip():
    assert_config_checks("deft", peft.DeftConfig, {
        "decomposition_method": ["svd", None, 1], "para": [1, None], "alpha": [0, float("nan"), "2"],
        "init_weights": [None, "yes"], "init_scale": [-1.0, float("inf")], "deft_dropout": [1.0, -0.1],
    }, good={"alpha": [None, 1, 0.5, -2]})
    assert_peft_round_trip("deft", {"decomposition_method": "qr", "para": True, "injection_alpha": 6.0, "init": "random", "init_scale": 0.5, "dropout": 0.1})


def test_save_peft_writes_peft_s_config(tmp_path):
    model = bank_oracle.model64("gpt2")
    adapter = lf.init_adapter(model, lf.AdapterSpec("deft", TARGETS["gpt2"], r=3, decomposition_method="qr", injection_alpha=4, dropout=0.1))
    lf.save_peft(adapter, tmp_path, model=model)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "DEFT" and config["r"] == 3 and config["alpha"] == 4.0 and config["decomposition_method"] == "qr"
    assert config["fan_in_fan_out"] is True and config["deft_dropout"] == 0.1 and config["para"] is False and config["init_weights"] is True


@pytest.mark.parametrize("method", ["relu", "qr"])
def test_an_adapter_in_another_dtype_than_the_base(method):
    """float64 and bf16 adapters on a float32 base, both overlays; a bf16 adapter's projection
    (a QR has no bf16 kernel) runs in float32."""
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("deft", 6, 8, adapter_dtype=dtype, r=3, decomposition_method=method, injection_alpha=2.0, init="random")


def test_a_bf16_base_keeps_no_float32_copy_of_the_input():
    """Without dropout the rank-r path is LoRA's bf16 kernel (base_plus_product): autograd keeps
    the bf16 input, not a float32 copy of it (which alone would be n·d_in·4 bytes); with dropout in
    a training step the two paths run in float32 and the step works on the bf16 base."""
    model = one_layer("linear", 64, 48, True, torch.bfloat16, 0)
    adapter = lf.init_adapter(model, lf.AdapterSpec("deft", ["proj"], r=4, dropout=0.3), generator=torch.Generator().manual_seed(1))
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    base = lf.base_params(model)
    saved = saved_bytes(lambda: run(model, lf.overlay(base, adapter), x).float().sum().backward())
    assert saved < 1024 * 64 * 4, saved
    model.train()
    torch.manual_seed(0)
    out = lf.adapted_call(model, adapter, x=x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.manual_seed(1)
    assert not torch.equal(lf.adapted_call(model, adapter, x=x), out)


@pytest.mark.parametrize("method", ["relu", "qr"])
def test_a_bf16_adapter_s_dropout_step_is_its_float32_values_step(method):
    """A training step with dropout on a bf16 adapter (float32 base) runs the injection in float32:
    it equals the same values held in a float32 adapter under the same RNG seed (R is cast to the
    projection's dtype before it meets the dropped input)."""
    model = one_layer("linear", 6, 8, True, torch.float32, 0)
    spec = dict(targets=["proj"], r=3, decomposition_method=method, injection_alpha=2.0, init="random", dropout=0.3)
    narrow = lf.init_adapter(model, lf.AdapterSpec("deft", dtype=torch.bfloat16, **spec), generator=torch.Generator().manual_seed(1))
    wide = lf.init_adapter(model, lf.AdapterSpec("deft", dtype=torch.float32, **spec), generator=torch.Generator().manual_seed(1))
    wide = wide.with_params({k: v.float() for k, v in narrow.params.items()})
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    model.train()
    outs = []
    for adapter in (narrow, wide):
        torch.manual_seed(3)
        outs.append(lf.adapted_call(model, adapter, x=x))
    torch.manual_seed(4)
    other = lf.adapted_call(model, wide, x=x)
    model.eval()
    assert outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    assert not torch.equal(other, outs[1])  # the step dropped something


@pytest.mark.parametrize("method", ["relu", "qr"])
def test_a_stack_member_ignores_values_in_its_padding(method):
    """A stacked adapter whose padding holds values (written there by hand or by an update that
    is not masked): each member's output is still its own slice's, the padding of P (columns past
    its rank) and of R (rows past it) never read."""
    model = one_layer("linear", 12, 9, True, torch.float64, 0)
    spec = {"decomposition_method": method, "injection_alpha": 3.0, "dtype": torch.float64}
    members = [lf.init_adapter(model, lf.AdapterSpec("deft", ["proj"], r=r, **spec), generator=torch.Generator().manual_seed(r)) for r in (2, 5)]
    stacked = lf.stack(members)
    g = torch.Generator().manual_seed(7)
    noisy = stacked.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in stacked.params.items()})
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    base = lf.base_params(model)
    outs = torch.vmap(lambda a: run(model, lf.overlay(base, a), x))(noisy)
    for i, member in enumerate(members):
        own = member.with_params({k: noisy.params[k][i][tuple(slice(0, n) for n in v.shape)] for k, v in member.params.items()})
        torch.testing.assert_close(outs[i], run(model, lf.overlay(base, own), x), rtol=1e-12, atol=1e-12)
