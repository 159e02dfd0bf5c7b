"""Uni-LoRA beyond the contract suite: the index assignment over every layer and its scales are
peft's; peft checkpoints (perturbed, with and without ``save_indices``, Llama and GPT-2 Conv1D)
load with peft's logits and gradient in float64; ``save_peft`` loads in peft; ``init_adapter``
trains; and a stack of 256 members trains in one ``ensemble_call`` step holding one copy of the
indices and scales."""

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
from tests.peft_helpers import ce_loss

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}
THETA = f"{SHARED}.unilora_theta_d"


def _config(kind: str = "llama", **kwargs) -> peft.UniLoraConfig:
    return peft.UniLoraConfig(**({"r": 2, "theta_d_length": 50, "proj_seed": 7, "target_modules": TARGETS[kind]} | kwargs))


def _spec(kind: str = "llama", **kwargs) -> lf.AdapterSpec:
    return lf.AdapterSpec("unilora", targets=TARGETS[kind], **({"r": 2, "theta_d_length": 50, "proj_seed": 7} | kwargs))


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


# 50 < N = 2 · 2 · (64 + 48 + 80) = 768 (with a remainder), and 1000 > N (every index once at most)
@pytest.mark.parametrize(("length", "seed"), [(50, 7), (1000, 3)])
def test_the_indices_and_scales_are_peft_s(length, seed):
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(tiny_model("llama"), _config(theta_d_length=length, proj_seed=seed))
    adapter = lf.init_adapter(model, _spec(theta_d_length=length, proj_seed=seed))
    buffers = dict(pm.named_buffers())
    assert len(adapter.buffers) == 4 * 6
    for key, tensor in adapter.buffers.items():
        assert torch.equal(buffers[f"base_model.model.{key}.default"], tensor), key
    used = torch.cat([t.flatten() for k, t in adapter.buffers.items() if "indices" in k])
    counts = torch.bincount(used, minlength=length)
    assert used.numel() == 768 and counts.max() - counts.min() <= 1  # balanced


@pytest.mark.parametrize(("kind", "save_indices"), [("llama", False), ("llama", True), ("gpt2", False)])
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path, kind, save_indices):
    model = llama64 if kind == "llama" else bank_oracle.model64("gpt2")
    pm = bank_oracle.peft_model(model, _config(kind, save_indices=save_indices)).double()  # θ is created fp32
    if save_indices:  # saved indices other than the seed's: peft reads them from the file, so must lora_func
        for m in pm.modules():
            if isinstance(m, peft.tuners.unilora.layer.UniLoraLayer):
                m.unilora_indices_A["default"] = m.unilora_indices_A["default"].roll(1, dims=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(tmp_path)
        adapter = lf.load_peft(tmp_path, model)
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert (len(stored) > 1) is save_indices  # without save_indices: θ alone, the layers from target_modules
    assert sorted(layer.target.module for layer in adapter.layers) == sorted(
        n.removeprefix("base_model.model.") for n, m in pm.named_modules() if isinstance(m, peft.tuners.unilora.layer.UniLoraLayer)
    )
    ids = tokens(2, 9, seed=3)
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    want_grad = pm.base_model.unilora_theta_d["default"].grad
    assert (want - model(ids).logits).abs().max() > 1e-2 and want_grad.abs().max() > 0
    for merged in (False, True):
        theta = adapter.params[THETA].detach().clone().requires_grad_(True)
        got = lf.adapted_call(model, adapter.with_params({THETA: theta}), ids, merged=merged).logits
        (g,) = torch.autograd.grad(ce_loss(got, ids), [theta])
        assert bank_oracle.rel(got, want) < bank_oracle.RTOL and bank_oracle.rel(g, want_grad) < bank_oracle.RTOL, merged


@pytest.mark.parametrize("save_indices", [False, True])
def test_save_peft_loads_in_peft(llama64, tmp_path, save_indices):
    spec = _spec(dtype=torch.float64, save_indices=save_indices, init="normal", theta_d_length=64)
    adapter = lf.init_adapter(llama64, spec, generator=torch.Generator().manual_seed(1))
    lf.save_peft(adapter, tmp_path, model=llama64)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "UNILORA" and config["r"] == 2 and config["theta_d_length"] == 64 and config["proj_seed"] == 7
    assert config["init_weights"] is False and config["save_indices"] is save_indices
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert len(stored) == (1 + 4 * 6 if save_indices else 1)
    ids = tokens(2, 9, seed=4)
    want = lf.adapted_call(llama64, adapter, ids).logits
    assert (want - llama64(ids).logits).abs().max() > 1e-2
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path, ids), want) < bank_oracle.RTOL
    back = lf.load_peft(tmp_path, llama64)
    assert back.spec.options == adapter.spec.options
    assert all(torch.equal(back.params[k], adapter.params[k]) for k in adapter.params)
    assert all(torch.equal(back.buffers[k], adapter.buffers[k]) for k in adapter.buffers)


def test_a_checkpoint_without_layer_tensors_needs_plain_target_modules(llama64, tmp_path):
    lf.save_peft(lf.init_adapter(llama64, _spec(dtype=torch.float64)), tmp_path)
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"layers_to_transform": [0]}))
    with pytest.raises(ValueError, match=r"finds its layers from target_modules.*layers_to_transform=\[0\]"):
        lf.load_peft(tmp_path, llama64)


def test_init_adapter_trains():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, _spec(r=4, theta_d_length=256), generator=torch.Generator().manual_seed(0))
    losses = bank_oracle.adam_losses(model, adapter, lr=0.05)
    assert losses[-1] < 0.8 * losses[0], losses



def test_a_stack_of_256_members_holds_one_copy_of_the_indices_and_trains_in_one_ensemble_step():
    model = tiny_model("llama")
    members = [lf.init_adapter(model, _spec(), generator=torch.Generator().manual_seed(i)) for i in range(256)]
    stacked = lf.stack(members)
    one = members[0]
    frozen = sum(t.numel() * t.element_size() for t in one.buffers.values())
    vectors = sum(t.numel() * t.element_size() for t in one.params.values())
    assert frozen == 768 * (8 + 4) and vectors == 4 * 50  # int64 indices and fp32 scales; θ (50,)
    assert bank_oracle.storage_bytes(stacked) == frozen + 256 * vectors  # not 256 * (frozen + vectors)
    ids = tokens(2, 9, seed=1)
    params = {THETA: stacked.params[THETA].detach().clone().requires_grad_(True)}

    def losses(p):
        out = lf.ensemble_call(model, stacked.with_params(p), ids).logits
        return torch.stack([ce_loss(o, ids) for o in out])

    before = losses(params)
    before.sum().backward()
    assert params[THETA].grad is not None and params[THETA].grad.shape == (256, 50)
    with torch.no_grad():
        after = losses({THETA: params[THETA] - 1.0 * params[THETA].grad})
    assert bool((after < before).all()), int((after < before).sum())
