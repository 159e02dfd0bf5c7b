"""BEFT beyond the contract suite, against HF peft 0.21 in float64: a peft checkpoint with
perturbed biases loads with peft's logits and per-tensor gradients (merged and lazy) on biased
layers and, lazily, on bias-free ones, where the merged form refuses as peft's merge does;
``save_peft`` loads in peft; ``init="random"`` is peft's ``init_weights=False`` draw for draw; peft
refuses GPT-2 ``Conv1D`` and so does ``save_peft``."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch

import lora_func as lf
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss
from tests.variant_checks import assert_config_checks, assert_peft_round_trip, init_params

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

BIASED = ["q_proj", "v_proj"]  # attention_bias=True on the tiny Llama
BIAS_FREE = ["up_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path):
    pm = bank_oracle.peft_model(llama64, peft.BeftConfig(target_modules=BIASED))
    adapter, _ = bank_oracle.check_against_peft(llama64, pm, tmp_path)
    ids = tokens(2, 9, seed=3)
    want = lf.adapted_call(llama64, adapter, ids).logits
    lf.save_peft(adapter, tmp_path / "ours", model=llama64)
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path / "ours", ids), want) < bank_oracle.RTOL


def test_bias_free_layers_lazily_as_peft_and_their_merged_form_refuses(llama64, tmp_path):
    pm = bank_oracle.peft_model(llama64, peft.BeftConfig(target_modules=BIAS_FREE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, llama64)
    ids = tokens(2, 9, seed=3)
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
    got = lf.adapted_call(llama64, adapter.with_params(params), ids).logits
    assert bank_oracle.rel(got, want) < bank_oracle.RTOL and (want - llama64(ids).logits).abs().max() > 1e-2
    grads = dict(zip(params, torch.autograd.grad(ce_loss(got, ids), list(params.values())), strict=True))
    for name, p in pm.named_parameters():
        if p.requires_grad:
            assert bank_oracle.rel(grads[bank_oracle.lf_key(name)], p.grad) < bank_oracle.RTOL, name
    with pytest.raises(ValueError, match="this layer has no bias"):
        lf.adapted_call(llama64, adapter, ids, merged=True)
    with pytest.raises(ValueError, match="Base layer has no bias"):
        pm.merge_adapter()


def test_random_init_is_peft_s_draw_for_draw():
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("llama")
        torch.manual_seed(5)
        pm = peft.get_peft_model(tiny_model("llama"), peft.BeftConfig(target_modules=BIASED, init_weights=False))
    torch.manual_seed(5)
    tiny_model("llama")  # the same draws before the adapter's as peft's
    state = torch.get_rng_state()
    generator = torch.Generator()
    generator.set_state(state)
    adapter = lf.init_adapter(model, lf.AdapterSpec("beft", targets=BIASED, init="random"), generator=generator)
    want = {bank_oracle.lf_key(n): p for n, p in pm.named_parameters() if p.requires_grad}
    assert sorted(want) == sorted(adapter.params)
    for key, value in adapter.params.items():
        assert torch.equal(value, want[key].reshape(-1)), key
    zero = lf.init_adapter(model, lf.AdapterSpec("beft", targets=BIASED))
    assert all(torch.count_nonzero(v) == 0 for v in zero.params.values())


def test_peft_refuses_conv1d_and_so_does_save_peft(tmp_path):
    with pytest.raises(TypeError, match=r"only `torch\.nn\.Linear` is supported"):
        peft.get_peft_model(tiny_model("gpt2"), peft.BeftConfig(target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("beft", targets=["c_attn"]))
    with pytest.raises(ValueError, match="peft refuses beft on GPT-2 Conv1D"):
        lf.save_peft(adapter, tmp_path / "x")


def test_peft_config_checks_and_round_trip():
    assert_config_checks("beft", peft.BeftConfig, {"init_weights": [0, "yes", None]})
    assert_peft_round_trip("beft", {"init": "random"})


def test_init_gives_the_asked_dtype_for_each_init():
    from lora_func.variants import beft

    for init in ("zero", "random"):
        params, buffers = init_params(beft, "beft", 2, 6, 5, init=init)
        assert params["beft_bias"].shape == (5,) and not buffers
        assert (torch.count_nonzero(params["beft_bias"]) > 0) == (init == "random")


@pytest.mark.parametrize("bias", [True, False])
def test_a_float32_bias_on_a_float64_layer_is_added_in_float64(bias):
    """peft's ``(result + beft_bias).to(result.dtype)``: the sum in the promoted dtype, so a
    float32 beft_bias on a float64 layer is added to the unrounded float64 output,
    on the lazy path and (with a bias) the merged one."""
    from tests.one_layer import one_layer, run

    model = one_layer("linear", 5, 4, bias, torch.float64, 0)
    adapter = lf.init_adapter(model, lf.AdapterSpec("beft", ["proj"], dtype=torch.float32, init="random"), generator=torch.Generator().manual_seed(1))
    (beta,) = adapter.params.values()
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x=x) + beta.double()
        base = lf.base_params(model)
        for make in (lf.overlay, lf.merge_overlay) if bias else (lf.overlay,):
            got = run(model, make(base, adapter), x)
            assert got.dtype == torch.float64, make.__name__
            # (the merged form sums b + β first: the same up to float64 round-off; β rounded in
            # float32 after the sum would be off by ~1e-8)
            torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14, msg=make.__name__)
