"""VeLoRA against peft 0.21 (``LoraConfig(velora_config=VeloraConfig(...))``) on a float64 tiny Llama
in training mode: a peft checkpoint with perturbed trainables loads with load_peft and a training
step gives peft's logits and per-tensor gradients (A's from the compressed activations), for each
``init_type``; those gradients are not LoRA's exact ones; save_peft output loads in peft; the init
draws peft's numbers."""

from __future__ import annotations

import json

import pytest
import torch
from peft.tuners.lora.config import VeloraConfig
from peft.tuners.lora.variants import VeloraLinearVariant

import lora_func as lf
from lora_func.variants import LayerInfo
from tests.lora_family_oracle import ALPHA, R, TARGETS, compare, model64, peft_lora, reloaded_in_peft, rel, saved
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

GROUPS, SCALE = 4, 0.7  # 32 features in 4 groups of 8: a lossy compression


@pytest.fixture(scope="module")
def model():
    return model64()


@pytest.mark.parametrize("init_type", ["batch_average", "random", "batch_average_once"])
def test_a_training_step_gives_peft_s_logits_and_gradients(model, init_type, tmp_path):
    pm = peft_lora(model, velora_config=VeloraConfig(num_groups=GROUPS, scale=SCALE, init_type=init_type), use_rslora=True)
    adapter = saved(pm, tmp_path / "peft", model)
    assert adapter.spec.variant == "velora" and adapter.spec.option("init_type") == init_type
    assert adapter.buffers["model.layers.0.self_attn.q_proj.velora_embed"].shape == (8,)
    pm.train(), model.train()
    try:
        compare(model, pm, adapter, merged=(False,))
        if init_type == "batch_average_once":
            # peft fixed each layer's projection on that first step; lora_func holds it as a buffer
            fixed = {f"{n.removeprefix('base_model.model.')}.velora_embed": m.lora_velora_embed["default"] for n, m in pm.named_modules() if hasattr(m, "lora_velora_embed")}
            assert all(e.any() for e in fixed.values())
            compare(model, pm, adapter.with_buffers(fixed), ids=tokens(2, 9, seed=8), merged=(False,))
        # a lossy compression: A's gradient is not LoRA's exact one (B's is)
        ids = tokens(2, 9, seed=3)
        exact = lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=R, alpha=ALPHA, use_rslora=True, dtype=torch.float64))
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}

        def grads(of):
            out = lf.adapted_call(model, of.with_params(params), ids).logits
            return dict(zip(params, torch.autograd.grad(ce_loss(out, ids), list(params.values())), strict=True))

        ours, lora = grads(adapter), grads(exact)
        key = "model.layers.0.self_attn.q_proj"
        assert rel(ours[f"{key}.lora_B"], lora[f"{key}.lora_B"]) < 1e-12
        assert rel(ours[f"{key}.lora_A"], lora[f"{key}.lora_A"]) > 1e-3
    finally:
        pm.eval(), model.eval()


def test_save_peft_loads_in_peft(model, tmp_path):
    pm = peft_lora(model, velora_config=VeloraConfig(num_groups=GROUPS, scale=SCALE, init_type="random"))
    adapter = saved(pm, tmp_path / "peft", model)
    lf.save_peft(adapter, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["velora_config"] == {"num_groups": GROUPS, "scale": SCALE, "init_type": "random"}
    loaded = reloaded_in_peft(model, tmp_path / "ours")
    ids = tokens(2, 8, seed=5)
    with torch.no_grad():
        assert rel(loaded(ids).logits, pm(ids).logits) <= 1e-12
    layer = loaded.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(layer.lora_velora_embed["default"], adapter.buffers["model.layers.0.self_attn.q_proj.velora_embed"])


@pytest.mark.parametrize("init_type", ["random", "batch_average"])
def test_init_draws_peft_s_numbers(init_type):
    model = tiny_model("llama")
    pm = peft_lora(model, perturbed=False)
    config = pm.peft_config["default"]
    config.velora_config = VeloraConfig(num_groups=GROUPS, init_type=init_type)
    spec = lf.AdapterSpec("velora", targets=TARGETS, r=R, alpha=ALPHA, num_groups=GROUPS, init_type=init_type)
    for name, module in pm.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            weight = model.get_submodule(name.removeprefix("base_model.model.")).weight
            info = LayerInfo(d_in=weight.shape[1], d_out=weight.shape[0], r=R, alpha=ALPHA, has_bias=True, options=spec.options)
            params, buffers = lf.get_variant("velora").init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(9))
            torch.manual_seed(9)
            module.reset_lora_parameters("default", True)
            VeloraLinearVariant.init(module, "default", config)
            assert torch.equal(params["lora_A"], module.lora_A["default"].weight), name
            assert torch.equal(buffers["velora_embed"], module.lora_velora_embed["default"]), name
    assert abs(float(buffers["velora_embed"].norm()) - 1) < 1e-6 if init_type == "random" else not buffers["velora_embed"].any()


def test_per_example_training_gradients_under_vmap_equal_a_loop():
    """The compressed backward under torch.func: vmap(grad) in a training step equals a loop over
    the examples (each example's projection from its own tokens), and differs from LoRA's."""
    model = tiny_model("llama").train()
    spec = lf.AdapterSpec("velora", targets=TARGETS, r=R, alpha=ALPHA, num_groups=GROUPS)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    params = {k: v.detach() + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in adapter.params.items()}
    ids = tokens(3, 8, seed=2)

    def loss(p, x):
        return ce_loss(lf.adapted_call(model, adapter.with_params(p), x[None]).logits, x[None])

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids)
    for i in range(3):
        single = torch.func.grad(loss)(params, ids[i])
        for key, g in single.items():
            torch.testing.assert_close(batched[key][i], g, atol=1e-6, rtol=1e-5)
    model.eval()  # outside training, LoRA's exact gradient
    key = "model.layers.0.self_attn.q_proj.lora_A"
    assert (torch.func.grad(loss)(params, ids[0])[key] - batched[key][0]).abs().max() > 1e-4


@pytest.mark.parametrize("num_groups", [1, 3, 4])
def test_batch_embed_is_peft_s_also_for_a_zero_batch(num_groups):
    """peft's batch average (its own helpers): the mean sub-token normalised in fp32, and all
    ones normalised where the mean is zero (a zero batch), for padded and unpadded groups."""
    from peft.tuners.lora.velora import _normalize_projection, _reshape_to_grouped_subtokens

    from lora_func.variants import velora

    x = torch.randn(2, 3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for batch in (x, torch.zeros_like(x)):
        subtokens = _reshape_to_grouped_subtokens(batch, num_groups)
        want = _normalize_projection(subtokens.reshape(-1, subtokens.shape[-1]).mean(dim=0))
        got = velora.batch_embed(batch, num_groups)
        assert got.dtype == torch.float32 and torch.equal(got, want)
