"""PVeRA beyond the contract suite: the basis is peft's draw for draw; peft checkpoints (perturbed,
with and without ``save_projection``, Llama and GPT-2 Conv1D) load with peft's logits and
per-tensor gradients in float64, in eval mode and, under one global seed, in training mode (the
Gaussian sample); ``save_peft`` loads in peft; ``init_adapter`` trains. Stacks of different ranks:
tests/test_bank_rank_stack.py."""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch

import lora_func as lf
from lora_func.adapter import SHARED
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss
from tests.variant_checks import assert_config_checks, assert_peft_round_trip

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Specified to not:UserWarning"),
]

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


def test_the_basis_and_the_init_are_peft_s_draw_for_draw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(tiny_model("llama"), peft.PveraConfig(r=4, target_modules=TARGETS["llama"], projection_prng_key=5, d_initial=0.2))
    adapter = lf.init_adapter(tiny_model("llama"), lf.AdapterSpec("pvera", targets=TARGETS["llama"], r=4, projection_prng_key=5, d_initial=0.2))
    assert adapter.buffers[f"{SHARED}.pvera_A"].shape == (8, 48) and adapter.buffers[f"{SHARED}.pvera_B"].shape == (32, 4)
    for name in ("pvera_A", "pvera_B"):
        assert torch.equal(adapter.buffers[f"{SHARED}.{name}"], getattr(pm.base_model, name)["default"]), name
    for name, p in pm.named_parameters():
        if p.requires_grad:
            assert torch.equal(adapter.params[bank_oracle.lf_key(name)], p), name


@pytest.mark.parametrize(("kind", "save_projection"), [("llama", True), ("llama", False), ("gpt2", True)])
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(tmp_path, kind, save_projection):
    model = bank_oracle.model64(kind)
    pm = bank_oracle.peft_model(model, peft.PveraConfig(r=4, target_modules=TARGETS[kind], projection_prng_key=2, save_projection=save_projection))
    adapter, _ = bank_oracle.check_against_peft(model, pm, tmp_path)
    # Training mode: z = μ + ε σ, ε from the global RNG, drawn layer by layer in the same order.
    ids = tokens(2, 9, seed=3)
    pm.train()
    torch.manual_seed(11)
    want = pm(input_ids=ids).logits
    torch.manual_seed(11)
    got = lf.adapted_call(copy.deepcopy(model).train(), adapter, ids).logits
    assert bank_oracle.rel(got, want) < bank_oracle.RTOL
    assert bank_oracle.rel(lf.adapted_call(model, adapter, ids).logits, want) > 1e-2, "the sample should move the output"


def test_save_peft_loads_in_peft(tmp_path):
    model = bank_oracle.model64("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("pvera", targets=TARGETS["llama"], r=4, dtype=torch.float64, save_projection=False))
    g = torch.Generator().manual_seed(2)
    adapter = adapter.with_params({k: v.detach() + torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    lf.save_peft(adapter, tmp_path, model=model)
    ids = tokens(2, 9, seed=4)
    want = lf.adapted_call(model, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(model, tmp_path, ids), want) < bank_oracle.RTOL


def test_init_adapter_trains():
    model = tiny_model("llama").train()
    adapter = lf.init_adapter(model, lf.AdapterSpec("pvera", targets=TARGETS["llama"], r=8), generator=torch.Generator().manual_seed(0))
    ids = tokens(4, 12, seed=5)
    params = dict(adapter.params)
    opt = torch.optim.Adam(params.values(), lr=0.05)
    losses = []
    torch.manual_seed(0)
    for _ in range(30):
        loss = ce_loss(lf.adapted_call(model, adapter.with_params(params), ids).logits, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    final = float(ce_loss(lf.adapted_call(model, adapter.with_params(params), ids).logits, ids).detach())
    assert final < 0.85 * losses[0], (losses, final)  # training steps are noisy (the sample)


def test_peft_config_checks_and_round_trip():
    assert_config_checks("pvera", peft.PveraConfig, {
        "projection_prng_key": [-1, 2**63, 1.5, True], "save_projection": [1], "pvera_dropout": [-0.1, 1.0, float("nan")],
        "d_initial": [float("nan"), "0.1"], "init_weights": [0], "sample_at_inference": [1], "generator_seed": [1.5, True],
    }, good={"projection_prng_key": [0, 2**63 - 1], "pvera_dropout": [None, 0.0, 0.99], "generator_seed": [None]})
    assert_peft_round_trip("pvera", {
        "projection_prng_key": 5, "save_projection": False, "dropout": 0.3, "d_initial": 0.5, "init": "random", "sample_at_inference": True,
    })
