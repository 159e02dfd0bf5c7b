"""(IA)³ beyond the contract suite: init and rank independence, both forms and the gradient of g
against a float64 oracle on one layer (ia3 scales the bias, ia3_ff does not), activation forms
that never read the dense weight, the merged bias, and HF peft (IA3Config with
feedforward_modules) on tiny Llama, Qwen2 and GPT-2: peft's single mixed adapter is an ``ia3``
adapter on the non-feed-forward targets plus an ``ia3_ff`` adapter on the feed-forward ones."""

from __future__ import annotations


import pytest
import torch
from peft import IA3Config, get_peft_model
from torch.func import functional_call, grad

import lora_func as lf
from lora_func.variants import LayerInfo
from lora_func.variants.ia3 import IA3, IA3_FF
from tests.models import tiny_model, tokens
from tests import peft_helpers
from tests.peft_helpers import NoWeightBase, ce_loss

# peft's default IA3 targets (variants.md §4); the feed-forward ones scale the input.
PEFT_TARGETS = {
    "llama": (["k_proj", "v_proj"], ["down_proj"]),
    "qwen2": (["k_proj", "v_proj"], ["down_proj"]),  # Qwen2's k/v carry a bias: b_eff = g ⊙ b
    "gpt2": (["c_attn"], ["mlp.c_proj"]),
}





@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("variant", ["ia3", "ia3_ff"])
def test_init_is_ones_and_rank_is_unused(kind, variant):
    model = tiny_model(kind)
    targets = ["v_proj", "down_proj"] if kind == "llama" else ["c_attn", "c_fc"]
    # r far above every layer size: IA3 has no rank, so this must not be refused.
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=targets, r=1000), generator=torch.Generator().manual_seed(0))
    assert len(adapter.layers) == 4
    for layer in adapter.layers:
        t = layer.target
        g = adapter.params[f"{t.module}.ia3_l"]
        assert g.shape == ((t.d_out,) if variant == "ia3" else (t.d_in,)) and g.dtype == torch.float32
        assert torch.equal(g, torch.ones_like(g))
    assert adapter.buffers == {}


@pytest.mark.parametrize("variant", ["ia3", "ia3_ff"])
def test_one_layer_forms_and_gradient_equal_a_float64_oracle(variant):
    """ia3: y = (x Wᵀ + b) ⊙ g (bias scaled); ia3_ff: y = (x ⊙ g) Wᵀ + b (bias not). A variant
    that skips the bias (ia3) or scales it (ia3_ff) changes the output; both forms and dL/dg
    are checked, the activation form without reading W."""
    d_in, d_out = 7, 5
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(d_out, d_in, generator=gen), torch.randn(d_out, generator=gen)
    x = torch.randn(2, 4, d_in, generator=gen)
    g0 = torch.rand(d_out if variant == "ia3" else d_in, generator=gen) + 0.5
    upstream = torch.randn(2, 4, d_out, generator=gen)
    var = IA3 if variant == "ia3" else IA3_FF
    info = LayerInfo(d_in=d_in, d_out=d_out, r=8, alpha=1.0, has_bias=True)

    def oracle(g):
        x64, w64, b64 = x.double(), w.double(), bias.double()
        return (x64 @ w64.T + b64) * g if variant == "ia3" else (x64 * g) @ w64.T + b64

    g64 = g0.double().requires_grad_(True)
    (oracle(g64) * upstream.double()).sum().backward()
    expected = oracle(g0.double())

    def merged(p):
        w_eff, b_eff = var.weight_form(p, {}, w, bias, info)
        return x @ w_eff.T + b_eff

    for name, form in (("lazy", lambda p: var.activation_form(p, {}, x, NoWeightBase(w, bias), info)), ("merged", merged)):
        g32 = g0.clone().requires_grad_(True)
        out = form({"ia3_l": g32})
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=name)
        (out * upstream).sum().backward()
        torch.testing.assert_close(g32.grad.double(), g64.grad, atol=1e-5, rtol=1e-5, msg=name)
    # the bias really is (not) scaled: g ≠ 1 changes b_eff exactly as the math says
    _, b_eff = var.weight_form({"ia3_l": g0}, {}, w, bias, info)
    torch.testing.assert_close(b_eff, bias * g0 if variant == "ia3" else bias, atol=0, rtol=0)


def peft_key_to_lf(name: str) -> str:
    return peft_helpers.peft_key_to_lf(name, ('ia3_l',))


def test_merged_overlay_replaces_the_bias_only_for_ia3():
    model = tiny_model("gpt2")
    base = lf.base_params(model)
    for variant, scales_bias in (("ia3", True), ("ia3_ff", False)):
        adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=["c_attn"]))
        adapter = adapter.with_params({k: v.detach() * 1.5 for k, v in adapter.params.items()})
        merged = lf.merge_overlay(base, adapter)
        for layer in adapter.layers:
            key = layer.target.bias_key
            if scales_bias:
                torch.testing.assert_close(merged[key], 1.5 * base[key], atol=0, rtol=0)
            else:
                assert merged[key] is base[key]


# --------------------------------------------------------------------------------------------- peft


def make_peft(kind: str, seed: int = 0):
    out_targets, ff_targets = PEFT_TARGETS[kind]
    lf_model = tiny_model(kind, seed=seed)
    peft_base = tiny_model(kind, seed=seed)
    # GPT-2 targets are Conv1D: fan_in_fan_out=True explicitly (peft would set it with a warning).
    cfg = IA3Config(target_modules=out_targets + ff_targets, feedforward_modules=ff_targets, fan_in_fan_out=kind == "gpt2")
    # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: that exact
    # FutureWarning is expected; pytest.warns re-raises any other warning.
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        peft_model = get_peft_model(peft_base, cfg)
    return peft_model.eval(), lf_model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_matches_peft_after_perturbation(kind):
    out_targets, ff_targets = PEFT_TARGETS[kind]
    peft_model, lf_model = make_peft(kind)
    a_out = lf.init_adapter(lf_model, lf.AdapterSpec("ia3", targets=out_targets))
    a_ff = lf.init_adapter(lf_model, lf.AdapterSpec("ia3_ff", targets=ff_targets))
    assert {layer.target.layout for layer in a_out.layers + a_ff.layers} == {"conv1d" if kind == "gpt2" else "linear"}

    peft_params = {peft_key_to_lf(n): p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert sorted(peft_params) == sorted([*a_out.params, *a_ff.params]), "peft and lora_func adapt different layers"
    for key, p in peft_params.items():  # same init (ones); peft stores (d_out, 1) or (1, d_in)
        ours = a_out.params.get(key, a_ff.params.get(key))
        assert p.shape == ((ours.numel(), 1) if key in a_out.params else (1, ours.numel())), key
        assert torch.equal(p.detach().reshape(-1), ours)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(peft_model.named_parameters()):
            if p.requires_grad:
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
    flat = {k: p.detach().reshape(-1).clone() for k, p in peft_params.items()}
    params = ({k: flat[k] for k in a_out.params}, {k: flat[k] for k in a_ff.params})

    ids = tokens(batch=2, length=10, seed=4)
    peft_model.zero_grad()
    peft_out = peft_model(input_ids=ids).logits
    ce_loss(peft_out, ids).backward()
    peft_grads = {k: p.grad.reshape(-1) for k, p in peft_params.items()}
    base = lf.base_params(lf_model)
    assert (peft_out - lf_model(ids).logits).abs().max() > 1e-2, "the perturbed adapter should change the output"

    for make in (lf.overlay, lf.merge_overlay):

        def loss(p, make=make):
            over = make(make(base, a_out.with_params(p[0])), a_ff.with_params(p[1]))
            out = functional_call(lf_model, over, (ids,)).logits
            return ce_loss(out, ids), out

        grads, out = grad(loss, has_aux=True)(params)
        torch.testing.assert_close(out, peft_out.detach(), atol=1e-5, rtol=0, msg=make.__name__)
        for part in grads:
            for key, g in part.items():
                assert peft_grads[key].abs().max() > 0, key
                torch.testing.assert_close(g, peft_grads[key], atol=1e-5, rtol=0, msg=f"{make.__name__} grad {key}")


@pytest.mark.parametrize(("base_dtype", "adapter_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float64, torch.float32)])
def test_the_product_runs_in_the_adapter_dtype_as_peft_orders_it(base_dtype, adapter_dtype):
    """peft multiplies in the adapter dtype and casts back: (y.to(g) * g).to(y) for ia3, the same on
    the input for ia3_ff. A wider adapter gets it by type promotion (no upcast copy); a narrower
    one must round the activation first. Bit for bit, both directions."""
    d_in, d_out = 6, 5
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(d_out, d_in, generator=gen).to(base_dtype), torch.randn(d_out, generator=gen).to(base_dtype)
    x = torch.randn(3, d_in, generator=gen).to(base_dtype)
    info = LayerInfo(d_in=d_in, d_out=d_out, r=1, alpha=1.0, has_bias=True, options=())
    base = NoWeightBase(w, bias)
    g_out = (1 + 0.3 * torch.randn(d_out, generator=gen)).to(adapter_dtype)
    g_in = (1 + 0.3 * torch.randn(d_in, generator=gen)).to(adapter_dtype)
    out = IA3.activation_form({"ia3_l": g_out}, {}, x, base, info)
    y = base(x)
    assert out.dtype == base_dtype and torch.equal(out, (y.to(adapter_dtype) * g_out).to(base_dtype))
    out_ff = IA3_FF.activation_form({"ia3_l": g_in}, {}, x, base, info)
    assert out_ff.dtype == base_dtype and torch.equal(out_ff, base((x.to(adapter_dtype) * g_in).to(base_dtype)))
