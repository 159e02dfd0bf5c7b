"""VB-LoRA beyond the contract suite: peft checkpoints (perturbed logits and bank, Llama and GPT-2
Conv1D) load with peft's logits and per-tensor gradients in float64, the bank's gradient summed
over the layers; ``save_peft`` loads in peft; ``init_adapter`` trains; the sizes are checked;
peft's index types, config checks and a round trip of every option."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from safetensors.torch import load_file

import lora_func as lf
from lora_func.adapter import SHARED
from lora_func.variants.vblora import _index_dtype
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.variant_checks import assert_config_checks, assert_peft_round_trip

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}
SIZES = {"num_vectors": 12, "vector_length": 8, "topk": 3}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(tmp_path, kind):
    model = bank_oracle.model64(kind)
    pm = bank_oracle.peft_model(model, peft.VBLoRAConfig(r=4, target_modules=TARGETS[kind], **SIZES))
    adapter, _ = bank_oracle.check_against_peft(model, pm, tmp_path)
    assert adapter.params[f"{SHARED}.vblora_vector_bank"].shape == (12, 8)
    assert {k: adapter.spec.option(k) for k in SIZES} == SIZES


def test_save_peft_loads_in_peft(tmp_path):
    model = bank_oracle.model64("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("vblora", targets=TARGETS["llama"], r=4, dtype=torch.float64, **SIZES), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2)
    adapter = adapter.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    lf.save_peft(adapter, tmp_path, model=model)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "VBLORA" and config["save_only_topk_weights"] is False
    assert {k: config[k] for k in SIZES} == SIZES
    assert load_file(tmp_path / "adapter_model.safetensors")["base_model.vblora_vector_bank"].shape == (12, 8)
    ids = tokens(2, 9, seed=4)
    want = lf.adapted_call(model, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(model, tmp_path, ids), want) < bank_oracle.RTOL
    back = lf.load_peft(tmp_path, model)
    assert all(torch.equal(back.params[k], adapter.params[k]) for k in adapter.params)


def test_top_k_checkpoints_load_and_save_both_ways(tmp_path):
    """peft's save_only_topk_weights: integer top-k indices and k-1 weights per logits tensor. Read
    back as peft does (log of the weights at the indices): peft's logits and gradients; written
    the same way, peft loads it to the same logits."""
    model = bank_oracle.model64("llama")
    pm = bank_oracle.peft_model(model, peft.VBLoRAConfig(r=4, target_modules=TARGETS["llama"], save_only_topk_weights=True, **SIZES))
    adapter, _ = bank_oracle.check_against_peft(model, pm, tmp_path / "peft")
    stored = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert stored["base_model.model.model.layers.0.self_attn.q_proj.vblora_logits_A_topk_indices"].dtype == torch.uint8
    assert adapter.spec.option("save_only_topk_weights") is True
    logits = adapter.params["model.layers.0.self_attn.q_proj.vblora_logits_A"]
    assert bool(torch.isfinite(logits).all()) and int((logits > -1e300).sum(-1).max()) == SIZES["topk"]
    lf.save_peft(adapter, tmp_path / "ours", model=model)
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(stored)
    for key, tensor in stored.items():
        assert ours[key].dtype == tensor.dtype and torch.allclose(ours[key].double(), tensor.double(), rtol=1e-12, atol=0), key
    # peft reads a top-k checkpoint only in fp32 (its -inf matrix is fp32, scattered with the
    # weights' dtype): the reload in peft runs on an fp32 model.
    model32 = tiny_model("llama")
    spec = lf.AdapterSpec("vblora", targets=TARGETS["llama"], r=4, save_only_topk_weights=True, **SIZES)
    adapter32 = lf.init_adapter(model32, spec, generator=torch.Generator().manual_seed(3))
    lf.save_peft(adapter32, tmp_path / "ours32", model=model32)
    ids = tokens(2, 9, seed=4)
    want = lf.adapted_call(model32, adapter32, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(model32, tmp_path / "ours32", ids), want) < 1e-6
    assert bank_oracle.rel(lf.adapted_call(model32, lf.load_peft(tmp_path / "ours32", model32), ids).logits, want) < 1e-6


def test_init_adapter_trains():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("vblora", targets=TARGETS["llama"], r=4, **SIZES), generator=torch.Generator().manual_seed(0))
    losses = bank_oracle.adam_losses(model, adapter, lr=0.05)
    assert losses[-1] < 0.8 * losses[0], losses


def test_vector_length_must_divide_every_layer():
    with pytest.raises(ValueError, match=r"vector_length=12 must divide d_in and d_out of every layer.*v_proj \(16x32\)"):
        lf.init_adapter(tiny_model("llama"), lf.AdapterSpec("vblora", targets=["v_proj"], r=2, num_vectors=4, vector_length=12))
    # down_proj is 32 x 48: 12 divides d_in only.
    with pytest.raises(ValueError, match=r"vector_length=12 .*down_proj \(32x48\)"):
        lf.init_adapter(tiny_model("llama"), lf.AdapterSpec("vblora", targets=["down_proj"], r=2, num_vectors=4, vector_length=12))
    with pytest.raises(ValueError, match=r"topk=5 exceeds num_vectors=4"):
        lf.AdapterSpec("vblora", targets=["v_proj"], num_vectors=4, topk=5)


def test_init_draws_peft_s_distributions():
    """bank ~ U(-bound, bound), logits ~ N(0, std²) (peft's init, from the generator)."""
    spec = lf.AdapterSpec("vblora", targets=TARGETS["llama"], r=4, num_vectors=64, vector_length=8, init_vector_bank_bound=0.5, init_logits_std=0.3)
    adapter = lf.init_adapter(tiny_model("llama"), spec, generator=torch.Generator().manual_seed(0))
    bank = adapter.params[f"{SHARED}.vblora_vector_bank"].detach()
    assert bank.abs().max() <= 0.5 and bank.abs().max() > 0.45 and abs(float(bank.std()) - 0.5 / 3**0.5) < 0.03
    for name in ("vblora_logits_A", "vblora_logits_B"):
        logits = torch.cat([adapter.params[f"{layer.target.module}.{name}"].detach().flatten() for layer in adapter.layers])
        assert abs(float(logits.std()) - 0.3) < 0.01 and abs(float(logits.mean())) < 0.01, name


def test_top_k_indices_are_stored_in_peft_s_integer_type():
    # peft's VBLoRAModel._get_adapter_state_dict: uint8 under 2**8 vectors, int16 under 2**15,
    # int32 under 2**31, else int64 (each edge on both sides)
    edges = {255: torch.uint8, 256: torch.int16, 2**15 - 1: torch.int16, 2**15: torch.int32, 2**31 - 1: torch.int32, 2**31: torch.int64}
    assert {count: _index_dtype(count) for count in edges} == edges


def test_peft_config_checks_and_round_trip():
    assert_config_checks("vblora", peft.VBLoRAConfig, {
        "num_vectors": [0, -1, 2.0, True], "vector_length": [0, 1.5], "topk": [0, False], "vblora_dropout": [-0.1, 1.0],
        "init_vector_bank_bound": [float("nan"), "0.02"], "init_logits_std": [float("inf")], "save_only_topk_weights": [1],
    }, good={"num_vectors": [1, 4096], "topk": [1], "vblora_dropout": [None, 0.0, 0.5]})
    assert_peft_round_trip("vblora", {
        "num_vectors": 64, "vector_length": 8, "topk": 3, "init_vector_bank_bound": 0.5, "init_logits_std": 0.3,
        "save_only_topk_weights": True, "dropout": 0.2,
    })
