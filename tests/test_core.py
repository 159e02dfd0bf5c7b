"""Core runtime behaviour beyond the per-variant contract: acceptance on Llama/Qwen2/GPT-2,
tied weights, base_params, training idioms, golden parameter names, LoRA specifics."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch.func import functional_call, grad, vmap

import lora_func as lf
from lora_func._lazy import AdaptedWeight
from tests.contract_helpers import assert_unchanged, perturbed, snapshot
from tests.models import tiny_model, tokens
from tests.tolerance import assert_close_to_scale

GOLDEN = Path(__file__).parent / "golden"


def _ce(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize(("kind", "targets"), [("llama", ["q_proj", "v_proj"]), ("qwen2", ["q_proj", "v_proj"]), ("gpt2", ["c_attn"])])
def test_acceptance_overlays_grad_vmap_on_tiny_models(kind, targets):
    model = tiny_model(kind)
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=4)), 0.1)
    base, ids = lf.base_params(model), tokens(batch=3)
    merged = functional_call(model, lf.merge_overlay(base, adapter), (ids,)).logits
    lazy = functional_call(model, lf.overlay(base, adapter), (ids,)).logits
    torch.testing.assert_close(lazy, merged, atol=1e-5, rtol=0)
    assert (lazy - model(ids).logits).abs().max() > 1e-3

    def loss(params, x):
        return _ce(functional_call(model, lf.overlay(base, adapter.with_params(params)), (x,)).logits, x)

    g = grad(loss)(adapter.params, ids)
    assert all(v.abs().max() > 0 for v in g.values())
    per_example = vmap(grad(loss), in_dims=(None, 0))(adapter.params, ids[:, None])
    mean = {k: v.mean(0) for k, v in per_example.items()}
    for k in g:
        torch.testing.assert_close(mean[k], g[k], atol=1e-6, rtol=1e-4)  # mean of per-example == batch grad
    stacked = lf.stack([adapter, perturbed(adapter, 0.1, seed=9)])
    outs = vmap(lambda a: functional_call(model, lf.overlay(base, a), (ids,)).logits)(stacked)
    torch.testing.assert_close(outs[0], lazy, atol=1e-5, rtol=0)


def test_base_params_shares_storage_and_ties():
    gpt2 = tiny_model("gpt2")
    base = lf.base_params(gpt2)
    assert base["lm_head.weight"] is base["transformer.wte.weight"]
    names = {n for n, _ in gpt2.named_parameters(remove_duplicate=False)} | {n for n, _ in gpt2.named_buffers()}
    assert set(base) == names
    for name, p in gpt2.named_parameters():
        assert base[name].data_ptr() == p.data_ptr() and not base[name].requires_grad


def test_tied_both_adapts_the_shared_tensor_everywhere():
    gpt2 = tiny_model("gpt2")
    snap = snapshot(gpt2)
    adapter = perturbed(lf.init_adapter(gpt2, lf.AdapterSpec("lora", targets=["lm_head"], tied="both", r=2)), 0.1)
    (layer,) = adapter.layers
    assert layer.target.tied_keys == ("transformer.wte.weight",)
    base, ids = lf.base_params(gpt2), tokens()
    merged = lf.merge_overlay(base, adapter)
    assert merged["lm_head.weight"] is merged["transformer.wte.weight"]
    scale = 8.0 / 2  # peft's default alpha over r
    w_eff = base["lm_head.weight"] + scale * adapter.params["lm_head.lora_B"] @ adapter.params["lm_head.lora_A"]
    torch.testing.assert_close(merged["lm_head.weight"], w_eff)
    # the embedding lookup sees the adapted weight too (lazy falls back to the merged tensor)
    lazy_out = functional_call(gpt2, lf.overlay(base, adapter), (ids,)).logits
    merged_out = functional_call(gpt2, merged, (ids,)).logits
    torch.testing.assert_close(lazy_out, merged_out, atol=1e-5, rtol=0)
    manual = dict(base)
    manual["lm_head.weight"] = manual["transformer.wte.weight"] = w_eff
    assert_close_to_scale(functional_call(gpt2, manual, (ids,)).logits, merged_out, msg="logits")
    assert_unchanged(gpt2, snap)


def test_standin_answers_metadata_and_falls_back_to_merged_weight():
    model = tiny_model("llama")
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2)), 0.1)
    base = lf.base_params(model)
    key = "model.layers.0.self_attn.q_proj.weight"
    standin = lf.overlay(base, adapter)[key]
    assert isinstance(standin, AdaptedWeight)
    assert standin.shape == base[key].shape and standin.dtype == base[key].dtype and standin.device == base[key].device
    assert standin.dim() == 2 and standin.size(0) == 32 and not standin.requires_grad
    merged = lf.merge_overlay(base, adapter)[key]
    torch.testing.assert_close(standin.T, merged.T)  # any other op: the dense merged weight
    torch.testing.assert_close(standin * 2, merged * 2)
    assert "AdaptedWeight(model.layers.0.self_attn.q_proj.weight" in repr(standin)
    lazy_only = lf.overlay(base, adapter, lazy_only=True)[key]
    with pytest.raises(RuntimeError, match="lazy_only=True"):
        lazy_only * 2


def test_training_with_torch_func_grad_reduces_loss():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=8.0))
    base, ids = lf.base_params(model), tokens(batch=4, length=12)
    ids = (ids[:, :1] + torch.arange(12)) % ids.max()  # a learnable pattern: successor tokens

    def loss(params):
        return _ce(functional_call(model, lf.overlay(base, adapter.with_params(params)), (ids,)).logits, ids)

    params = {k: v.detach() for k, v in adapter.params.items()}
    first = loss(params)
    for _ in range(30):
        params = {k: v - 2.0 * g for (k, v), g in zip(params.items(), grad(loss)(params).values(), strict=True)}
    assert loss(params) < first - 0.05


def test_training_with_a_torch_optimiser_reduces_loss_and_only_touches_the_adapter():
    model = tiny_model("gpt2")
    snap = snapshot(model)
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["c_attn", "c_proj"], r=4))
    ids = tokens(batch=4, length=12)
    optimizer = torch.optim.AdamW(adapter.params.values(), lr=2e-2)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = _ce(lf.adapted_call(model, adapter, ids).logits, ids)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05
    assert_unchanged(model, snap)


def test_rslora_scale_and_lora_init_statistics():
    model = tiny_model("llama")
    key = "model.layers.0.self_attn.q_proj"
    for use_rslora, scale in ((False, 6.0 / 4), (True, 6.0 / math.sqrt(4))):
        adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=4, alpha=6.0, use_rslora=use_rslora)), 0.2)
        base = lf.base_params(model)
        merged = lf.merge_overlay(base, adapter)[f"{key}.weight"]
        expected = base[f"{key}.weight"] + scale * adapter.params[f"{key}.lora_B"] @ adapter.params[f"{key}.lora_A"]
        assert_close_to_scale(merged, expected, msg=f"rslora={use_rslora}")
    big = torch.nn.Linear(512, 256)
    holder = torch.nn.Sequential()
    holder.add_module("proj", big)
    a = lf.init_adapter(holder, lf.AdapterSpec("lora", targets=["proj"], r=64), generator=torch.Generator().manual_seed(0))
    lora_a = a.params["proj.lora_A"]
    # kaiming_uniform(a=sqrt(5)) on fan_in=512: U(-1/sqrt(512), 1/sqrt(512))
    assert lora_a.abs().max() <= 1 / math.sqrt(512) and lora_a.abs().max() > 0.95 / math.sqrt(512)
    assert torch.count_nonzero(a.params["proj.lora_B"]) == 0
    g = lf.init_adapter(holder, lf.AdapterSpec("lora", targets=["proj"], r=64, init="gaussian"), generator=torch.Generator().manual_seed(0))
    assert abs(g.params["proj.lora_A"].std().item() - 1 / 64) < 0.05 / 64


def test_generator_reproducibility():
    model = tiny_model("llama")
    spec = lf.AdapterSpec("lora", targets=["q_proj"], r=2)
    a = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5))
    b = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5))
    c = lf.init_adapter(model, spec)
    d = lf.init_adapter(model, spec)
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k])
    assert not torch.equal(c.params["model.layers.0.self_attn.q_proj.lora_A"], d.params["model.layers.0.self_attn.q_proj.lora_A"])
    torch.manual_seed(3)
    e = lf.init_adapter(model, spec)
    torch.manual_seed(3)
    f = lf.init_adapter(model, spec)
    assert all(torch.equal(e.params[k], f.params[k]) for k in e.params)


def test_spec_is_frozen_and_round_trips_through_json():
    spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=16, dtype=torch.bfloat16, use_rslora=True)
    assert lf.AdapterSpec.from_json(spec.to_json()) == spec
    assert hash(spec) == hash(lf.AdapterSpec.from_json(spec.to_json()))
    assert spec.option("use_rslora") is True and spec.alpha == 16.0
    with pytest.raises(dataclasses_frozen_error()):
        spec.r = 3  # type: ignore[misc]
    assert lf.AdapterSpec("lora", targets=["q_proj"]).alpha == 8.0  # peft's default lora_alpha


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_adapter_is_a_pytree():
    import torch.utils._pytree as pytree

    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    leaves, spec = pytree.tree_flatten(adapter)
    assert len(leaves) == len(adapter.params) + len(adapter.buffers)
    rebuilt = pytree.tree_unflatten([leaf * 2 for leaf in leaves], spec)
    assert isinstance(rebuilt, lf.Adapter) and rebuilt.spec == adapter.spec
    for k in adapter.params:
        assert torch.equal(rebuilt.params[k], adapter.params[k] * 2)


@pytest.mark.parametrize(("kind", "targets"), [("llama", ["q_proj", "v_proj"]), ("gpt2", ["c_attn"])])
def test_golden_parameter_names_and_shapes(kind, targets):
    """Pins the adapter's tensor names and shapes (the public checkpoint layout)."""
    model = tiny_model(kind)
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=4))
    got = {
        "params": {k: list(v.shape) for k, v in adapter.params.items()},
        "buffers": {k: list(v.shape) for k, v in adapter.buffers.items()},
        "layouts": {layer.target.module: layer.target.layout for layer in adapter.layers},
    }
    path = GOLDEN / f"lora_{kind}.json"
    if os.environ.get("LORA_FUNC_UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())
