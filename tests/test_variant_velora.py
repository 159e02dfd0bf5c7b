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


def test_the_random_projection_is_drawn_in_the_weight_s_dtype():
    """peft draws ``init_type="random"``'s projection with ``randn(dtype=<the weight's dtype>)``
    after LoRA's factors (see test_init_draws_peft_s_numbers on float32), then normalises it in
    float32: on float64 and bf16 weights, draws of that dtype (not float32 draws cast)."""
    from lora_func.variants import lora, velora
    from tests.variant_checks import layer_info

    for dtype in (torch.float64, torch.bfloat16):
        weight = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
        info = layer_info("velora", 2, 6, 4, num_groups=2, init_type="random")
        _, buffers = velora.init(weight, None, info, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        g = torch.Generator().manual_seed(9)
        lora.init(weight, None, info, dtype=torch.float64, generator=g)
        draw = torch.randn(3, generator=g, dtype=dtype).float()
        assert buffers["velora_embed"].dtype == torch.float64 and torch.equal(buffers["velora_embed"], (draw / draw.norm()).double()), dtype


def _one_layer_velora(dtype, init_type="batch_average", base_dtype=torch.float64):
    from tests.one_layer import one_layer, perturbed

    model = one_layer("linear", 6, 4, True, base_dtype, 0).train()
    spec = lf.AdapterSpec("velora", ["proj"], r=2, num_groups=2, init_type=init_type, dtype=dtype)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1)), seed=2, scale=0.5)
    return model, adapter


def test_the_input_gradient_is_exact_also_with_a_frozen_adapter():
    """A training step that differentiates the input only (the adapter's tensors frozen): the
    input gradient is the exact ``(W + s B A)ᵀ g``, as the merged weight's."""
    model, adapter = _one_layer_velora(torch.float64)
    frozen = adapter.with_params({k: v.detach() for k, v in adapter.params.items()})
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    (lazy,) = torch.autograd.grad(lf.adapted_call(model, frozen, x=x).square().sum(), x)
    (merged,) = torch.autograd.grad(lf.adapted_call(model, frozen, x=x, merged=True).square().sum(), x)
    (plain,) = torch.autograd.grad(model(x=x).square().sum(), x)
    torch.testing.assert_close(lazy, merged, rtol=1e-12, atol=1e-12)
    assert (lazy - plain).abs().max() > 1e-3


def test_a_bf16_adapter_s_step_is_its_float32_values_step():
    """A bf16 adapter on a float32 layer in a training step: the compressed backward runs (in
    bf16) and A's gradient is the float32 adapter's (same values) to bf16's round-off."""
    grads = []
    for dtype in (torch.bfloat16, torch.float32):
        model, adapter = _one_layer_velora(torch.bfloat16, base_dtype=torch.float32)
        if dtype == torch.float32:
            adapter = lf.init_adapter(model, lf.AdapterSpec("velora", ["proj"], r=2, num_groups=2)).with_params({k: v.detach().float().requires_grad_(True) for k, v in adapter.params.items()})
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
        out = lf.adapted_call(model, adapter, x=x)
        grads.append(torch.autograd.grad(out.square().sum(), adapter.params["proj.lora_A"])[0])
    assert grads[0].dtype == torch.bfloat16
    assert (grads[0].float() - grads[1]).abs().max() < 3e-2 * grads[1].abs().max()


def test_a_set_projection_is_used_at_its_own_precision():
    """``batch_average_once`` with its buffer set uses it as ``random`` uses its buffer (and peft
    its buffer): a float64 projection not rounded to float32 (same gradients, bit for bit)."""
    e = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    e = e / e.norm()
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for init_type in ("batch_average_once", "random"):
        model, adapter = _one_layer_velora(torch.float64, init_type)
        adapter = adapter.with_buffers({"proj.velora_embed": e})
        out = lf.adapted_call(model, adapter, x=x)
        grads.append(torch.autograd.grad(out.square().sum(), adapter.params["proj.lora_A"])[0])
    assert torch.equal(grads[0], grads[1])
    model.eval()  # (the compressed backward ran: outside training, LoRA's exact gradient)
    exact = torch.autograd.grad(lf.adapted_call(model, adapter, x=x).square().sum(), adapter.params["proj.lora_A"])[0]
    assert (exact - grads[1]).abs().max() > 1e-3


def test_outside_a_training_step_the_gradient_is_lora_s_and_overlay_takes_training_true():
    """The compressed backward needs a training step: in eval mode, and on lf.overlay's parameter
    route without ``training=True`` (a parameter dict sees no module's training flag), A's
    gradient is LoRA's exact one (the merged weight's); ``lf.overlay(..., training=True)`` gives
    the training step's compressed gradient. One group per row is accepted (0 not)."""
    from tests.one_layer import run

    with pytest.raises(ValueError, match="num_groups"):
        lf.AdapterSpec("velora", ["proj"], num_groups=0)
    model, adapter = _one_layer_velora(torch.float64)
    adapter = lf.init_adapter(model, lf.AdapterSpec("velora", ["proj"], r=2, num_groups=1, dtype=torch.float64)).with_params(adapter.params)
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    key = "proj.lora_A"

    def grad(out):
        return torch.autograd.grad(out.square().sum(), adapter.params[key])[0]

    base = lf.base_params(model)
    trained = grad(lf.adapted_call(model, adapter, x=x))
    overlay_route = grad(run(model, lf.overlay(base, adapter), x))
    torch.testing.assert_close(grad(run(model, lf.overlay(base, adapter, training=True), x)), trained, rtol=1e-12, atol=1e-12)
    model.eval()
    exact = grad(lf.adapted_call(model, adapter, x=x, merged=True))
    torch.testing.assert_close(grad(lf.adapted_call(model, adapter, x=x)), exact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(overlay_route, exact, rtol=1e-12, atol=1e-12)
    assert (trained - exact).abs().max() > 1e-3


def test_a_compiled_training_step_gives_the_eager_compressed_gradient():
    """``torch.compile`` (fullgraph; dynamo is where it failed) of a training step with VeLoRA
    alone and in a one-part composition: the forwards and A's compressed gradients equal eager's
    (no ``autograd.Function`` for dynamo to instantiate: it raised a DeprecationWarning, an error
    under ``-W error``), and A's gradient is not LoRA's exact one."""
    model, adapter = _one_layer_velora(torch.float64)
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    params, key = adapter.params, "proj.lora_A"

    def step(p):
        changed = adapter.with_params(p)
        return lf.adapted_call(model, changed, x=x) + lf.adapted_call(model, lf.compose([changed]), x=x).square()

    eager = step(params)
    compiled = torch.compile(step, fullgraph=True, backend="eager")(params)
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-12)
    want, got = (torch.autograd.grad(out.sum(), params[key])[0] for out in (eager, compiled))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    model.eval()
    assert (torch.autograd.grad(step(params).sum(), params[key])[0] - want).abs().max() > 1e-3
