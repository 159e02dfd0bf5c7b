"""Lily beyond the contract suite: peft checkpoints (perturbed A's, B's and routers, tied in
groups and stride blocks) load with peft's logits and per-tensor gradients in float64, a shared
tensor's gradient summed over the layers that read it; ``save_peft`` loads in peft;
``init_adapter`` draws peft's numbers from peft's seed; the groups as peft ties them (names,
shapes, a regex); the mean over the call's tokens, per example under vmap; no merged weight."""

from __future__ import annotations

import copy
import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file
from torch.func import grad, vmap

import lora_func as lf
from lora_func.adapter import SHARED
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj", "down_proj"]
# Llama (2 layers): q 32x32, v 16x32, down 32x48: three groups of two layers; stride 2 ties each
# group's A's, num_B 3 mixes three B's.
CONFIG = {"r": 4, "num_B": 3, "stride_A": 2, "scaling": 0.7}


def _peft_config(**overrides):
    return peft.LilyConfig(target_modules=TARGETS, **{**CONFIG, **overrides})


def _lf_key(peft_name: str, groups: dict[str, dict[str, str]]) -> str:
    """peft's (deduplicated) parameter name -> ours: a tied A / B is listed under its group's
    (block's) first layer."""
    module, _, tensor = peft_name.removeprefix("base_model.model.").removesuffix(".default.weight").rpartition(".")
    if tensor == "lily_router":
        return f"{module}.lily_router"
    return f"{SHARED}.{tensor}@{groups[module][tensor]}"


def _check(model, pm, directory, ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(directory)
    adapter = lf.load_peft(directory, model)
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    groups = adapter.layer_groups()
    peft_grads = {_lf_key(n, groups): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    assert sorted(peft_grads) == sorted(adapter.params), "peft and lora_func train different tensors"
    assert (want - model(ids).logits).abs().max() > 1e-2
    params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
    got = lf.adapted_call(model, adapter.with_params(params), ids).logits
    assert bank_oracle.rel(got, want) < bank_oracle.RTOL
    grads = torch.autograd.grad(ce_loss(got, ids), list(params.values()))
    for key, g in zip(params, grads, strict=True):
        assert peft_grads[key].abs().max() > 0, key
        assert bank_oracle.rel(g.reshape(peft_grads[key].shape), peft_grads[key]) < bank_oracle.RTOL, key
    return adapter


def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(tmp_path):
    model = bank_oracle.model64("llama")
    pm = bank_oracle.peft_model(model, _peft_config())
    adapter = _check(model, pm, tmp_path, tokens(2, 9, seed=3))
    # peft ties: 3 groups (one B each), stride 2 over 2 layers: one A per group; 6 routers.
    shared = dict(adapter.shared.param_shapes)
    assert shared == {
        "lily_A@0_0": (4, 32), "lily_A@1_0": (4, 32), "lily_A@2_0": (4, 48),
        "lily_B@0": (3, 4, 32), "lily_B@1": (3, 4, 16), "lily_B@2": (3, 4, 32),
    }
    assert sum(1 for k in adapter.params if k.endswith("lily_router")) == 6
    assert {k: adapter.spec.option(k) for k in ("num_B", "stride_A", "scaling")} == {"num_B": 3, "stride_A": 2, "scaling": 0.7}


def test_stride_one_and_a_regex_group_by_shape_only(tmp_path):
    """stride_A=1: every layer its own A; a regex target_modules: one group per weight shape
    (q_proj and o_proj, both 32x32, share one B)."""
    model = bank_oracle.model64("llama")
    pm = bank_oracle.peft_model(model, peft.LilyConfig(target_modules=r".*\.(q_proj|o_proj|v_proj)", r=4, num_B=2, stride_A=1))
    adapter = _check(model, pm, tmp_path, tokens(2, 9, seed=3))
    shared = dict(adapter.shared.param_shapes)
    assert sorted(n for n in shared if n.startswith("lily_B")) == ["lily_B@0", "lily_B@1"]  # 32x32 (q, o), 16x32 (v)
    assert sum(1 for n in shared if n.startswith("lily_A")) == 6
    groups = adapter.layer_groups()
    assert groups["model.layers.1.self_attn.o_proj"]["lily_B"] == groups["model.layers.0.self_attn.q_proj"]["lily_B"]


def test_save_peft_loads_in_peft_and_back(tmp_path):
    model = bank_oracle.model64("llama")
    spec = lf.AdapterSpec("lily", targets=TARGETS, dtype=torch.float64, **CONFIG)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2)
    adapter = adapter.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    lf.save_peft(adapter, tmp_path, model=model)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LILY" and {k: config[k] for k in CONFIG} == CONFIG
    assert "bias" not in config  # LilyConfig has no bias field (peft warns of an unknown key)
    stored = load_file(tmp_path / "adapter_model.safetensors")
    # every layer holds its A, B (peft's (num_B·r, d_out)) and router, as peft writes them
    assert stored["base_model.model.model.layers.1.self_attn.v_proj.lily_B.weight"].shape == (12, 16)
    assert torch.equal(stored["base_model.model.model.layers.1.self_attn.v_proj.lily_A.weight"], stored["base_model.model.model.layers.0.self_attn.v_proj.lily_A.weight"])
    ids = tokens(2, 9, seed=4)
    want = lf.adapted_call(model, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(model, tmp_path, ids), want) < bank_oracle.RTOL
    back = lf.load_peft(tmp_path, model)
    assert sorted(back.params) == sorted(adapter.params)
    assert all(torch.equal(back.params[k], adapter.params[k]) for k in adapter.params)


def test_save_peft_refuses_conv1d(tmp_path):
    model = tiny_model("gpt2")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lily", targets=["c_attn"], r=2), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="Conv1D"):
        lf.save_peft(adapter, tmp_path, model=model)


@pytest.mark.parametrize("init_weights", [True, False])
def test_init_draws_peft_s_numbers_from_peft_s_seed(init_weights):
    model = tiny_model("llama")
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), _peft_config(init_weights=init_weights))
    spec = lf.AdapterSpec("lily", targets=TARGETS, **CONFIG, init="zero" if init_weights else "random")
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5))
    groups = adapter.layer_groups()
    theirs = {_lf_key(n, groups): p.detach() for n, p in pm.named_parameters() if p.requires_grad}
    assert sorted(theirs) == sorted(adapter.params)
    for key, value in theirs.items():
        ours = adapter.params[key]
        assert torch.equal(ours.reshape(value.shape), value), key
    assert bool(adapter.params[f"{SHARED}.lily_B@0"].abs().max() > 0) is not init_weights


def test_the_mixing_is_over_the_call_s_tokens_and_per_example_under_vmap():
    """A batched call mixes the B's by the softmax averaged over every token of the batch, so an
    example's output depends on the others (peft's math); under vmap each example's mean is over
    its own tokens: per-example gradients equal a loop of single-example calls."""
    model = tiny_model("llama")
    spec = lf.AdapterSpec("lily", targets=TARGETS, **CONFIG, init="random")
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1))
    ids = tokens(3, 8, seed=2)
    batched = lf.adapted_call(model, adapter, ids).logits
    alone = torch.cat([lf.adapted_call(model, adapter, ids[i : i + 1]).logits for i in range(3)])
    assert (batched - alone).abs().max() > 1e-4, "the batch's other examples move the mixing"

    def loss(params, x):
        return ce_loss(lf.adapted_call(model, adapter.with_params(params), x[None]).logits, x[None])

    per_example = vmap(grad(loss), in_dims=(None, 0))(adapter.params, ids)
    for i in range(3):
        single = grad(loss)(adapter.params, ids[i])
        for key, g in single.items():
            torch.testing.assert_close(per_example[key][i], g, atol=1e-6, rtol=1e-5, msg=key)
    with torch.no_grad():
        outs = vmap(lambda x: lf.adapted_call(model, adapter, x[None]).logits[0])(ids)
    torch.testing.assert_close(outs, alone, atol=1e-5, rtol=0)


def test_no_merged_weight_lazy_by_default_and_merges_refused():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lily", targets=TARGETS, **CONFIG, init="random"), generator=torch.Generator().manual_seed(1))
    ids = tokens(2, 8, seed=2)
    want = lf.adapted_call(model, adapter, ids).logits
    assert (want - model(ids).logits).abs().max() > 1e-3
    with torch.no_grad(), lf.adapted(model, adapter):  # the default: the lazy route for Lily
        torch.testing.assert_close(model(ids).logits, want, atol=1e-6, rtol=0)
    for call in (
        lambda: lf.adapted_call(model, adapter, ids, merged=True),
        lambda: lf.merge_overlay(lf.base_params(model), adapter),
        lambda: lf.to_lora(adapter, rank=2, base=lf.base_params(model)),
    ):
        with pytest.raises(ValueError, match="lily has no merged weight"):
            call()


def test_a_regex_adapter_saves_its_regex_so_peft_ties_as_lora_func_does(tmp_path):
    """targets=<regex>: one group per shape (q_proj and o_proj share one B); save_peft writes the
    regex as target_modules, so peft's reload ties the same layers, and load_peft gives them back."""
    model = bank_oracle.model64("llama")
    spec = lf.AdapterSpec("lily", targets=r".*\.(q_proj|o_proj)", r=2, num_B=2, dtype=torch.float64, init="random")
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    assert sorted(n for n, _ in adapter.shared.param_shapes if n.startswith("lily_B")) == ["lily_B@0"]
    lf.save_peft(adapter, tmp_path, model=model)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == r".*\.(q_proj|o_proj)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path)
    leaders = {id(m.lily_B["default"]) for n, m in pm.named_modules() if type(m).__name__ == "Linear" and hasattr(m, "lily_B")}
    assert len(leaders) == 1, "peft ties one B over the group"
    back = lf.load_peft(tmp_path, model)
    assert back.layer_groups() == adapter.layer_groups()
    assert all(torch.equal(back.params[k], adapter.params[k]) for k in adapter.params)


def test_names_of_one_shape_are_separate_groups(tmp_path):
    """target_modules=["q_proj", "o_proj"] (both 32x32): peft ties a B per name, not per shape."""
    model = bank_oracle.model64("llama")
    pm = bank_oracle.peft_model(model, peft.LilyConfig(target_modules=["q_proj", "o_proj"], r=4, num_B=2, stride_A=2))
    adapter = _check(model, pm, tmp_path, tokens(2, 9, seed=3))
    assert sorted(n for n, _ in adapter.shared.param_shapes) == ["lily_A@0_0", "lily_A@1_0", "lily_B@0", "lily_B@1"]
    groups = adapter.layer_groups()
    assert groups["model.layers.0.self_attn.q_proj"] == groups["model.layers.1.self_attn.q_proj"] != groups["model.layers.0.self_attn.o_proj"]


def test_one_b_and_the_random_init_round_trip_through_peft_s_config(tmp_path):
    """num_B=1 is allowed (as in peft: one B, the router's softmax is 1); init="random" is peft's
    init_weights=False in the written config and reads back as "random"."""
    model = tiny_model("llama")
    spec = lf.AdapterSpec("lily", targets=["q_proj"], r=2, num_B=1, init="random")
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    assert adapter.params[f"{SHARED}.lily_B@0"].shape == (1, 2, 32)
    lf.save_peft(adapter, tmp_path, model=model)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["init_weights"] is False and config["num_B"] == 1
    assert lf.load_peft(tmp_path, model).spec.option("init") == "random"


def test_differing_copies_of_a_tied_tensor_load_as_peft_loads_them(tmp_path):
    """A file whose copies of a tied B differ (edited by hand): peft's load_state_dict leaves the
    group's last layer's copy in the tied module, and load_peft takes that one too."""
    from safetensors.torch import save_file

    model = bank_oracle.model64("llama")
    pm = bank_oracle.peft_model(model, _peft_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    stored = load_file(path)
    first = "base_model.model.model.layers.0.self_attn.q_proj.lily_B.weight"
    save_file(stored | {first: stored[first] + 1.0}, str(path))
    ids = tokens(2, 9, seed=3)
    adapter = lf.load_peft(tmp_path, model)
    last = stored["base_model.model.model.layers.1.self_attn.q_proj.lily_B.weight"]
    assert torch.equal(adapter.params[f"{SHARED}.lily_B@0"].reshape(last.shape), last)
    assert bank_oracle.rel(lf.adapted_call(model, adapter, ids).logits, bank_oracle.peft_reload_logits(model, tmp_path, ids)) < bank_oracle.RTOL


def test_layer_tensors_derives_the_groups_once_per_adapter_linear_in_the_layers(monkeypatch):
    """``layer_tensors`` of every layer (the mixed route's, merging's, the optimisers' walk) derives
    the groups once per adapter: the layer infos ``Variant.layer_groups`` reads grow as the layers
    (it used to run for every layer: 144 and 576 reads for 12 and 24 layers), and each layer
    sees exactly :func:`group_view`'s tensors (the same objects) of its group."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_func.variants._contract import Variant, group_view

    reads: list[int] = []
    original = Variant.layer_groups
    monkeypatch.setattr(Variant, "layer_groups", lambda self, targets, infos: reads.append(len(infos)) or original(self, targets, infos))
    counts = {}
    for layers in (4, 8):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=layers,
                                             num_attention_heads=2, num_key_value_heads=1))
        adapter = lf.init_adapter(model, lf.AdapterSpec("lily", targets=TARGETS, **CONFIG), generator=torch.Generator().manual_seed(1))
        reads.clear()
        seen = [adapter.layer_tensors(layer) for layer in adapter.layers]
        counts[layers] = (len(reads), sum(reads))
        shared_params, shared_buffers = adapter.shared_tensors()
        groups = original(adapter.variant, adapter.spec.targets, {layer.target.module: layer.info for layer in adapter.layers})
        assert len({tuple(sorted(g.items())) for g in groups.values()}) > 2, "several groups (a view that ignored them would pass)"
        for layer, (params, buffers) in zip(adapter.layers, seen, strict=True):
            module = layer.target.module
            own = {name: adapter.params[f"{module}.{name}"] for name, _ in layer.param_shapes}
            want = group_view(shared_params, groups[module]) | own
            assert sorted(params) == sorted(want) and all(params[k] is want[k] for k in want), module
            want_buffers = group_view(shared_buffers, groups[module]) | {name: adapter.buffers[f"{module}.{name}"] for name, _ in layer.buffer_shapes}
            assert sorted(buffers) == sorted(want_buffers) and all(buffers[k] is want_buffers[k] for k in want_buffers), module
    # 3 targets per decoder layer: 12 and 24 adapted layers, one derivation each
    assert counts == {4: (1, 12), 8: (1, 24)}, counts
