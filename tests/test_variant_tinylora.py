"""TinyLoRA beyond the contract suite: the SVD factors, the per-position projections and the
weight-tying groups are peft's draw for draw; peft checkpoints (perturbed, with and without
``save_projection``, Llama and GPT-2 Conv1D) load with peft's logits and per-tensor gradients in
float64; ``save_peft`` loads in peft; ``init_adapter`` trains; and a stack of 128 members trains in
one ``ensemble_call`` step holding one copy of the frozen factors and projections (128 members: each
init runs six SVDs)."""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_func as lf
from lora_func.adapter import SHARED
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

pytestmark = [
    pytest.mark.filterwarnings("ignore:Specified to not:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}
V = f"{SHARED}.tinylora_v"


def _config(kind: str = "llama", **kwargs) -> peft.TinyLoraConfig:
    return peft.TinyLoraConfig(**({"r": 2, "u": 3, "weight_tying": 0.5, "projection_seed": 7, "target_modules": TARGETS[kind]} | kwargs))


def _spec(kind: str = "llama", **kwargs) -> lf.AdapterSpec:
    return lf.AdapterSpec("tinylora", targets=TARGETS[kind], **({"r": 2, "u": 3, "weight_tying": 0.5, "projection_seed": 7} | kwargs))


def _peft_v(pm) -> torch.nn.ParameterDict:
    return pm.base_model.tinylora_v["default"]


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


@pytest.mark.parametrize("weight_tying", [0.0, 0.5, 0.8, 1.0])
def test_the_factors_projections_and_groups_are_peft_s(weight_tying):
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(tiny_model("llama"), _config(weight_tying=weight_tying))
    adapter = lf.init_adapter(model, _spec(weight_tying=weight_tying))
    assert [layer.info.position for layer in adapter.layers] == list(range(6))
    buffers = dict(pm.named_buffers())
    for key, tensor in adapter.buffers.items():  # A, B (SVD), P (seed + position): bit-equal
        assert torch.equal(buffers[f"base_model.model.{key}.default"], tensor), key
    # The same groups: peft's v_key per layer, and as many vectors as peft has.
    assert adapter.params[V].shape == (len(_peft_v(pm)), 3)
    want = [int(m._tinylora_v_key["default"]) for _, m in pm.named_modules() if isinstance(m, peft.tuners.tinylora.layer.TinyLoraLayer)]
    from lora_func.variants.tinylora import groups

    assert [groups(layer.info)[1] for layer in adapter.layers] == want
    assert len(set(want)) == {0.0: 6, 0.5: 3, 0.8: 1, 1.0: 1}[weight_tying]


@pytest.mark.parametrize(("kind", "save_projection"), [("llama", True), ("llama", False), ("gpt2", True)])
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path, kind, save_projection):
    model = llama64 if kind == "llama" else bank_oracle.model64("gpt2")
    pm = bank_oracle.peft_model(model, _config(kind, save_projection=save_projection))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(tmp_path)
        adapter = lf.load_peft(tmp_path, model)
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert any(k.endswith("tinylora_P") for k in stored) is save_projection
    ids = tokens(2, 9, seed=3)
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    want_grad = torch.stack([_peft_v(pm)[str(g)].grad for g in range(len(_peft_v(pm)))])
    assert (want - model(ids).logits).abs().max() > 1e-2 and want_grad.abs().min() > 0
    for merged in (False, True):
        v = adapter.params[V].detach().clone().requires_grad_(True)
        got = lf.adapted_call(model, adapter.with_params({V: v}), ids, merged=merged).logits
        (g,) = torch.autograd.grad(ce_loss(got, ids), [v])
        assert bank_oracle.rel(got, want) < bank_oracle.RTOL and bank_oracle.rel(g, want_grad) < bank_oracle.RTOL, merged
    # Re-drawn from the seed and the layer's position when the file leaves them out, as peft does.
    buffers = dict(pm.named_buffers())
    assert all(torch.equal(t, buffers[f"base_model.model.{k}.default"]) for k, t in adapter.buffers.items())


@pytest.mark.parametrize("save_projection", [True, False])
def test_save_peft_loads_in_peft(llama64, tmp_path, save_projection):
    spec = _spec(dtype=torch.float64, save_projection=save_projection, init="uniform", u=4, weight_tying=0.3)
    adapter = lf.init_adapter(llama64, spec, generator=torch.Generator().manual_seed(1))
    adapter = adapter.with_params({V: adapter.params[V].detach() + torch.randn(adapter.params[V].shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)})
    lf.save_peft(adapter, tmp_path, model=llama64)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "TINYLORA" and config["r"] == 2 and config["u"] == 4 and config["projection_seed"] == 7
    assert config["weight_tying"] == 0.3 and config["init_weights"] == "uniform" and config["save_projection"] is save_projection
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert sorted(k for k in stored if "tinylora_v" in k) == [f"base_model.tinylora_v.{g}" for g in range(4)]  # round(6 · 0.7)
    assert any(k.endswith("tinylora_P") for k in stored) is save_projection
    ids = tokens(2, 9, seed=4)
    want = lf.adapted_call(llama64, adapter, ids).logits
    assert (want - llama64(ids).logits).abs().max() > 1e-2
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path, ids), want) < bank_oracle.RTOL
    back = lf.load_peft(tmp_path, llama64)
    assert back.spec.options == adapter.spec.options
    assert all(torch.equal(back.params[k], adapter.params[k]) for k in adapter.params)
    assert all(torch.equal(back.buffers[k], adapter.buffers[k]) for k in adapter.buffers)


def test_a_checkpoint_with_a_missing_or_extra_group_is_refused(llama64, tmp_path):
    pm = bank_oracle.peft_model(llama64, _config())
    pm.save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if k != "base_model.tinylora_v.2"}, path)
    with pytest.raises(ValueError, match=r"the shared base_model.tinylora_v.\{\} has shape \(2, 3\), the adapted layers need \(3, 3\)"):
        lf.load_peft(tmp_path, llama64)
    save_file(tensors | {"base_model.tinylora_v.3": tensors["base_model.tinylora_v.0"].clone()}, path)
    with pytest.raises(ValueError, match=r"has shape \(4, 3\), the adapted layers need \(3, 3\)"):
        lf.load_peft(tmp_path, llama64)


def test_init_adapter_trains():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, _spec(u=8, weight_tying=0.0), generator=torch.Generator().manual_seed(0))
    losses = bank_oracle.adam_losses(model, adapter, lr=0.3)  # 48 numbers in all: a large step
    # measured 4.80 -> 3.98 (0.83); with v unused the loss would not move
    assert losses[-1] < 0.9 * losses[0], losses



def test_a_stack_of_128_members_holds_one_copy_of_the_frozen_tensors_and_trains_in_one_ensemble_step():
    model = tiny_model("llama")
    members = [lf.init_adapter(model, _spec(init="uniform"), generator=torch.Generator().manual_seed(i)) for i in range(128)]
    stacked = lf.stack(members)
    one = members[0]
    frozen = sum(t.numel() * t.element_size() for t in one.buffers.values())
    vectors = sum(t.numel() * t.element_size() for t in one.params.values())
    # per layer A (2, d_in), B (d_out, 2), P (3, 2, 2); one (3 groups, u = 3) leaf of vectors
    assert frozen == 4 * 2 * (2 * (32 + 32) + 2 * (32 + 16) + 2 * (48 + 32) + 3 * 4 * 3) and vectors == 4 * 3 * 3
    assert bank_oracle.storage_bytes(stacked) == frozen + 128 * vectors  # not 128 * (frozen + vectors)
    ids = tokens(2, 9, seed=1)
    params = {V: stacked.params[V].detach().clone().requires_grad_(True)}

    def losses(p):
        out = lf.ensemble_call(model, stacked.with_params(p), ids).logits
        return torch.stack([ce_loss(o, ids) for o in out])

    before = losses(params)
    before.sum().backward()
    assert params[V].grad is not None and params[V].grad.shape == (128, 3, 3)
    with torch.no_grad():
        after = losses({V: params[V] - 0.5 * params[V].grad})
    assert bool((after < before).all()), int((after < before).sum())


def test_positions_come_from_the_layers_order_on_load_and_are_never_saved(tmp_path):
    from safetensors import safe_open

    model = tiny_model("llama")
    adapter = lf.init_adapter(model, _spec(save_projection=False))
    path = lf.save(adapter, tmp_path / "a.safetensors", trainable_only=True)  # P rebuilt from seed + position
    with safe_open(str(path), "pt") as f:
        saved = json.loads(f.metadata()["tree"])["layers"]
    assert sorted(saved[0]["info"]) == ["alpha", "d_in", "d_out", "has_bias", "options", "r"]  # as before the fields existed
    back = lf.load(path, model)
    assert [layer.info for layer in back.layers] == [layer.info for layer in adapter.layers]
    assert [layer.info.position for layer in back.layers] == list(range(6)) and back.layers[0].info.count == 6
    assert all(torch.equal(back.buffers[k], adapter.buffers[k]) for k in adapter.buffers)
