"""DoRA beyond the contract suite: init, the detached norm and unscaled bias against a float64
autograd oracle on one layer, HF peft (LoraConfig(use_dora=True)) on Llama, Qwen2 and GPT-2
Conv1D, and exact identity on a bf16 base."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import lora_func as lf
from lora_func._layer_ops import LayerCall
from lora_func.variants import LayerInfo
from lora_func.variants.dora import VARIANT
from lora_func.targeting import canonical_weight
from tests.models import tiny_model, tokens
from tests.test_peft_oracle_lora import ALPHA, PEFT_TARGETS, R, assert_matches_peft, make_peft, perturb_peft


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_init_magnitude_is_the_row_norm_and_lora_factors_as_lora(kind):
    model = tiny_model(kind, seed=3)
    adapter = lf.init_adapter(model, lf.AdapterSpec("dora", targets=PEFT_TARGETS[kind], r=R), generator=torch.Generator().manual_seed(0))
    modules = dict(model.named_modules())
    for layer in adapter.layers:
        t = layer.target
        w = canonical_weight(modules[t.module].weight.detach(), t.layout).double()
        m = adapter.params[f"{t.module}.lora_magnitude_vector"]
        assert m.shape == (t.d_out,) and m.dtype == torch.float32
        torch.testing.assert_close(m.double(), w.norm(dim=1), atol=1e-7, rtol=1e-6, msg=t.module)
        a, b = adapter.params[f"{t.module}.lora_A"], adapter.params[f"{t.module}.lora_B"]
        assert a.shape == (R, t.d_in) and b.shape == (t.d_out, R)
        assert torch.count_nonzero(b) == 0
        bound = 1 / math.sqrt(t.d_in)  # kaiming_uniform(a=√5): U(-1/√fan_in, 1/√fan_in)
        assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound and a.std() > 0.4 * bound


@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora-scale", "rslora-scale"])
def test_one_layer_forms_and_gradients_equal_a_float64_oracle(use_rslora):
    """Both forms vs y = x (diag(m / n.detach()) (W + s B A))ᵀ + b in float64, values and the
    gradients of A, B and m. The oracle's norm is detached, its bias unscaled; not detaching
    changes every gradient, scaling the bias changes the output."""
    d_in, d_out, r, alpha = 7, 5, 3, 4.0
    s = alpha / (math.sqrt(r) if use_rslora else r)
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g)
    x = torch.randn(2, 4, d_in, generator=g)
    params = {
        "lora_A": torch.randn(r, d_in, generator=g),
        "lora_B": torch.randn(d_out, r, generator=g),
        "lora_magnitude_vector": torch.rand(d_out, generator=g) + 0.5,
    }
    info = LayerInfo(d_in=d_in, d_out=d_out, r=r, alpha=alpha, has_bias=True, options=(("use_rslora", use_rslora),))
    upstream = torch.randn(2, 4, d_out, generator=g)

    def oracle(p):
        v = w.double() + s * p["lora_B"] @ p["lora_A"]
        k = p["lora_magnitude_vector"] / v.norm(dim=1).detach()
        return F.linear(x.double(), k[:, None] * v, bias.double())

    def lazy(p):
        base = LayerCall(w, bias, lambda x_: F.linear(x_, w, bias))
        return VARIANT.activation_form(p, {}, x, base, info)

    def merged(p):
        w_eff, b_eff = VARIANT.weight_form(p, {}, w, bias, info)
        return F.linear(x, w_eff, b_eff)

    p64 = {k: v.double().requires_grad_(True) for k, v in params.items()}
    expected = oracle(p64)
    expected_grads = torch.autograd.grad((expected * upstream.double()).sum(), list(p64.values()))
    for name, form in (("lazy", lazy), ("merged", merged)):
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        out = form(p)
        torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=1e-5, msg=name)
        got = torch.autograd.grad((out * upstream).sum(), list(p.values()))
        for key, gg, ge in zip(p, got, expected_grads, strict=True):
            assert ge.abs().max() > 1e-3, key
            torch.testing.assert_close(gg.double(), ge, atol=1e-5, rtol=1e-5, msg=f"{name} {key}")


@pytest.mark.parametrize(
    ("kind", "use_rslora"),
    [("llama", False), ("qwen2", False), ("gpt2", False), ("llama", True)],
    ids=["llama", "qwen2", "gpt2-conv1d", "llama-rslora"],
)
def test_matches_peft_use_dora_after_perturbation(kind, use_rslora):
    """peft supports DoRA on GPT-2's Conv1D (lora.Linear with fan_in_fan_out=True), so all
    three models are compared; A, B and the magnitude are all perturbed."""
    peft_model, lf_model = make_peft(kind, use_dora=True, use_rslora=use_rslora)
    spec = lf.AdapterSpec("dora", targets=PEFT_TARGETS[kind], r=R, alpha=ALPHA, use_rslora=use_rslora)
    adapter = lf.init_adapter(lf_model, spec, generator=torch.Generator().manual_seed(0))
    peft_tensors = dict(peft_model.named_parameters())
    for layer in adapter.layers:  # same magnitude init as peft
        module = layer.target.module
        theirs = peft_tensors[f"base_model.model.{module}.lora_magnitude_vector.default.weight"]
        torch.testing.assert_close(adapter.params[f"{module}.lora_magnitude_vector"], theirs, atol=1e-7, rtol=1e-6)
    perturb_peft(peft_model, scale=0.05)
    assert_matches_peft(peft_model, lf_model, adapter)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_exact_identity_at_init_on_a_half_precision_base(dtype):
    """m and n come from the same fp32 computation, so k = 1 exactly: both overlays give the
    base logits bit for bit (peft, computing m in bf16, is only close to ~4e-2)."""
    model = tiny_model("gpt2", dtype=dtype)
    adapter = lf.init_adapter(model, lf.AdapterSpec("dora", targets=["c_attn", "c_fc"], r=R))
    ids = tokens()
    reference = model(ids).logits
    for merged in (False, True):
        assert torch.equal(lf.adapted_call(model, adapter, ids, merged=merged).logits, reference), merged
