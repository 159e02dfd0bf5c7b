"""RandLoRA beyond the contract suite: the bases are peft's draw for draw (dense bf16 kaiming,
sparse, very sparse); peft checkpoints (perturbed λ and γ, with and without ``save_projection``,
Llama and GPT-2 Conv1D) load with peft's logits and per-tensor gradients in float64; ``save_peft``
loads in peft; ``init_adapter`` trains; a random init draws peft's values; peft's config checks
and a round trip of every option through its config."""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file

import lora_func as lf
from lora_func.adapter import SHARED
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.variant_checks import assert_config_checks, assert_peft_round_trip

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Specified to not:UserWarning"),  # every save_projection=False config
]

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


@pytest.mark.parametrize("basis", [{}, {"sparse": True}, {"very_sparse": True}])
def test_the_bases_and_the_init_are_peft_s_draw_for_draw(basis):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(tiny_model("llama"), peft.RandLoraConfig(r=4, target_modules=TARGETS["llama"], projection_prng_key=7, **basis))
    adapter = lf.init_adapter(tiny_model("llama"), lf.AdapterSpec("randlora", targets=TARGETS["llama"], r=4, projection_prng_key=7, **basis))
    # m = min(32, 48) = 32 = 8 bases of rank 4; D = 48
    assert adapter.buffers[f"{SHARED}.randlora_A"].shape == (4, 1, 32) and adapter.buffers[f"{SHARED}.randlora_B"].shape == (48, 8, 4)
    for name in ("randlora_A", "randlora_B"):
        assert torch.equal(adapter.buffers[f"{SHARED}.{name}"], getattr(pm.base_model, name)["default"].float()), name
    for name, p in pm.named_parameters():
        if p.requires_grad:
            assert torch.equal(adapter.params[bank_oracle.lf_key(name)], p), name


@pytest.mark.parametrize(("kind", "options"), [("llama", {}), ("llama", {"save_projection": False, "sparse": True}), ("gpt2", {"very_sparse": True})])
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(tmp_path, kind, options):
    model = bank_oracle.model64(kind)
    pm = bank_oracle.peft_model(model, peft.RandLoraConfig(r=4, target_modules=TARGETS[kind], randlora_alpha=20, projection_prng_key=2, **options))
    adapter, _ = bank_oracle.check_against_peft(model, pm, tmp_path)
    assert ("base_model.randlora_A" in load_file(tmp_path / "adapter_model.safetensors")) is options.get("save_projection", True)
    assert torch.equal(adapter.buffers[f"{SHARED}.randlora_B"], pm.base_model.randlora_B["default"])
    assert adapter.spec.option("randlora_alpha") == 20.0


@pytest.mark.parametrize("save_projection", [True, False])
def test_save_peft_loads_in_peft(tmp_path, save_projection):
    model = bank_oracle.model64("llama")
    spec = lf.AdapterSpec("randlora", targets=TARGETS["llama"], r=4, dtype=torch.float64, randlora_alpha=8.0, save_projection=save_projection)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2)
    adapter = adapter.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    lf.save_peft(adapter, tmp_path, model=model)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "RANDLORA" and config["randlora_alpha"] == 8.0 and config["save_projection"] is save_projection
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert ("base_model.randlora_A" in stored) is save_projection and not any(k.startswith("base_model.model.") and k.endswith(".randlora_A") for k in stored)
    ids = tokens(2, 9, seed=4)
    want = lf.adapted_call(model, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(model, tmp_path, ids), want) < bank_oracle.RTOL


def test_init_adapter_trains():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("randlora", targets=TARGETS["llama"], r=4, randlora_alpha=8.0), generator=torch.Generator().manual_seed(0))
    losses = bank_oracle.adam_losses(model, adapter, lr=0.02)
    assert losses[-1] < 0.8 * losses[0], losses


def test_a_random_init_is_peft_s_init_weights_false_draw_for_draw():
    # peft's init_weights=False keeps λ ~ N(0, 1) (global generator, layer by layer) and
    # γ = 1 / max(d_in, d_out); the bases come from projection_prng_key either way
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = tiny_model("llama")
        torch.manual_seed(11)
        pm = peft.get_peft_model(base, peft.RandLoraConfig(r=4, target_modules=TARGETS["llama"], projection_prng_key=7, init_weights=False))
    spec = lf.AdapterSpec("randlora", targets=TARGETS["llama"], r=4, projection_prng_key=7, init="random")
    adapter = lf.init_adapter(tiny_model("llama"), spec, generator=torch.Generator().manual_seed(11))
    compared = 0
    for name, p in pm.named_parameters():
        if p.requires_grad:
            assert torch.equal(adapter.params[bank_oracle.lf_key(name)], p.detach()), name
            compared += 1
    assert compared == 2 * 2 * len(TARGETS["llama"])


def test_peft_config_checks_and_round_trip():
    assert_config_checks("randlora", peft.RandLoraConfig, {
        "projection_prng_key": [-1, 2**63, 1.5, True], "save_projection": [1], "sparse": [0], "very_sparse": ["yes"],
        "randlora_alpha": [float("nan"), float("inf"), "8"], "randlora_dropout": [-0.1, 1.0, float("nan")], "init_weights": [1],
    }, good={"projection_prng_key": [0, 2**63 - 1], "randlora_dropout": [None, 0.0, 0.99], "randlora_alpha": [0.5, 640]})
    assert_peft_round_trip("randlora", {
        "projection_prng_key": 5, "save_projection": False, "sparse": True, "very_sparse": True,
        "randlora_alpha": 20.0, "dropout": 0.3, "init": "random",
    })
