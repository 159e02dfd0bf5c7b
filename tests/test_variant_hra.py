"""HRA beyond the contract suite: the paired init (R = I exactly in exact arithmetic), the odd-r
error and the explicit ``init="random"`` option, both forms and the gradient of U against a
float64 oracle that builds R = H_0 H_1 ⋯ H_{r-1} explicitly, the reflection order (x Rᵀ, not
x R), the step-0 pattern per layer (every column, pairs equal and opposite), zero columns, and
HF peft (HRAConfig) on tiny Llama and Qwen2. peft refuses GPT-2 Conv1D; lora_func supports it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from peft import HRAConfig, get_peft_model
from torch.func import grad

import lora_func as lf
from lora_func.variants import LayerInfo
from lora_func.variants.hra import VARIANT
from tests.contract_helpers import loss_fn
from tests.models import tiny_model, tokens
from tests import peft_helpers
from tests.peft_helpers import LinearBase, NoDenseProducts, ce_loss

PEFT_TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"]}




def peft_key_to_lf(name: str) -> str:
    return peft_helpers.peft_key_to_lf(name, ('hra_u',))


def householder_product(u: torch.Tensor) -> torch.Tensor:
    """R = H_0 H_1 ⋯ H_{r-1}, H_i = I − 2 û_i û_iᵀ, as an explicit d_in × d_in matrix."""
    d_in, r = u.shape
    eye = torch.eye(d_in, dtype=u.dtype)
    R = eye
    for i in range(r):
        v = u[:, i] / u[:, i].norm()
        R = R @ (eye - 2 * torch.outer(v, v))
    return R


def info_for(d_in: int, d_out: int, r: int, init: str = "paired") -> LayerInfo:
    return LayerInfo(d_in=d_in, d_out=d_out, r=r, alpha=8.0, has_bias=True, options=(("init", init),))



# --------------------------------------------------------------------------------------------- init


@pytest.mark.parametrize(("kind", "targets"), [("llama", ["v_proj", "down_proj"]), ("gpt2", ["c_attn", "c_fc"])])
def test_paired_init(kind, targets):
    r = 6
    model = tiny_model(kind, seed=2)
    adapter = lf.init_adapter(model, lf.AdapterSpec("hra", targets=targets, r=r), generator=torch.Generator().manual_seed(0))
    assert len(adapter.layers) == 4
    for layer in adapter.layers:
        t = layer.target
        u = adapter.params[f"{t.module}.hra_u"]
        assert u.shape == (t.d_in, r) and u.dtype == torch.float32
        assert torch.equal(u[:, 0::2], u[:, 1::2]), "adjacent columns must be identical"
        half = u[:, 0::2]
        bound = 1 / math.sqrt(r // 2)  # kaiming_uniform(a=√5) on the (d_in, r/2) half
        assert half.abs().max() <= bound and half.abs().max() > 0.8 * bound and half.std() > 0.4 * bound
        assert torch.linalg.matrix_rank(half) == r // 2, "the pairs must differ from each other"
        R = householder_product(u.double())
        torch.testing.assert_close(R, torch.eye(t.d_in, dtype=torch.float64), atol=1e-12, rtol=0)


def test_odd_r_raises_naming_r_and_the_fix():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"r=3 is odd.*r=4 or r=2.*init='random'"):
        lf.init_adapter(model, lf.AdapterSpec("hra", targets=["v_proj"], r=3))
    with pytest.raises(ValueError, match=r"r=1 is odd.*Use r=2, or"):
        lf.init_adapter(model, lf.AdapterSpec("hra", targets=["v_proj"], r=1))
    with pytest.raises(ValueError, match="init='pairs' is not one of"):
        lf.AdapterSpec("hra", targets=["v_proj"], init="pairs")


@pytest.mark.parametrize("r", [3, 4])
def test_random_init_option(r):
    """init='random' (peft's init_weights=False): every column kaiming-uniform, any r, not the identity."""
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("hra", targets=["v_proj"], r=r, init="random"), generator=torch.Generator().manual_seed(0))
    for layer in adapter.layers:
        u = adapter.params[f"{layer.target.module}.hra_u"]
        assert u.shape == (32, r) and u.abs().max() <= 1 / math.sqrt(r)
        assert torch.linalg.matrix_rank(u) == r
    ids = tokens()
    assert (lf.adapted_call(model, adapter, ids).logits - model(ids).logits).abs().max() > 1e-3


# ----------------------------------------------------------------------------- one-layer oracle


@pytest.mark.parametrize("r", [1, 2, 5])
def test_one_layer_forms_and_gradient_equal_the_explicit_product(r):
    """Both forms vs y = x Rᵀ Wᵀ + b with R = H_0 ⋯ H_{r-1} built explicitly in float64, values and
    dL/dU, with random (unpaired) columns; the activation form builds no dense matrix (it may
    read W: it maps the reflections through W Û, a (d_out, r) product)."""
    d_in, d_out = 7, 6
    gen = torch.Generator().manual_seed(r)
    w, bias = torch.randn(d_out, d_in, generator=gen), torch.randn(d_out, generator=gen)
    x = torch.randn(2, 4, d_in, generator=gen)
    u0 = torch.randn(d_in, r, generator=gen)
    upstream = torch.randn(2, 4, d_out, generator=gen)
    info = info_for(d_in, d_out, r)

    def oracle(u):
        return x.double() @ householder_product(u).T @ w.double().T + bias.double()

    u64 = u0.double().requires_grad_(True)
    (oracle(u64) * upstream.double()).sum().backward()
    expected = oracle(u0.double())

    def merged(p):
        w_eff, b_eff = VARIANT.weight_form(p, {}, w, bias, info)
        assert b_eff is bias
        return x @ w_eff.T + b_eff

    def lazy(p):
        with NoDenseProducts(d_in, d_out):
            return VARIANT.activation_form(p, {}, x, LinearBase(w, bias), info)

    for name, form in (("lazy", lazy), ("merged", merged)):
        u32 = u0.clone().requires_grad_(True)
        out = form({"hra_u": u32})
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=name)
        (out * upstream).sum().backward()
        torch.testing.assert_close(u32.grad.double(), u64.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_reflection_order_x_R_transpose_not_x_R():
    """At the paired init R is symmetric, so x R and x Rᵀ agree and no identity test can see the
    order. After a non-symmetric perturbation they differ; the activation form must give
    x Rᵀ Wᵀ + b, which a loop over the columns in the FORWARD order does not."""
    d_in, d_out, r = 8, 6, 4
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(d_out, d_in, generator=gen), torch.randn(d_out, generator=gen)
    x = torch.randn(3, d_in, generator=gen)
    info = info_for(d_in, d_out, r)
    params, _ = VARIANT.init(w, bias, info, dtype=torch.float32, generator=gen)
    R0 = householder_product(params["hra_u"].double())
    torch.testing.assert_close(R0, R0.T, atol=1e-12, rtol=0)  # why the init hides the bug

    u = params["hra_u"] + 0.3 * torch.randn(d_in, r, generator=gen)
    R = householder_product(u.double())
    right = x.double() @ R.T @ w.double().T + bias.double()
    wrong = x.double() @ R @ w.double().T + bias.double()
    assert (right - wrong).abs().max() > 0.1, "the perturbation must make R non-symmetric"

    def forward_order_loop(x_):  # the bug: H_0 applied to x first
        u_hat = u / u.norm(dim=0)
        for i in range(r):
            x_ = x_ - 2 * (x_ @ u_hat[:, i])[:, None] * u_hat[:, i]
        return x_ @ w.T + bias

    torch.testing.assert_close(forward_order_loop(x).double(), wrong, atol=1e-5, rtol=0)
    out = VARIANT.activation_form({"hra_u": u}, {}, x, LinearBase(w, bias), info)
    torch.testing.assert_close(out.double(), right, atol=1e-5, rtol=0)
    w_eff, _ = VARIANT.weight_form({"hra_u": u}, {}, w, bias, info)
    torch.testing.assert_close(w_eff.double(), w.double() @ R, atol=1e-5, rtol=0)


def test_zero_column_is_the_identity_reflection_with_zero_gradient():
    """Deliberate difference from peft (which divides by ‖u‖ = 0 and gives NaN): a zero column,
    as zero-padding to a larger rank would create, reflects nothing and gets a zero gradient."""
    d_in, d_out = 6, 4
    gen = torch.Generator().manual_seed(0)
    w, bias, x = torch.randn(d_out, d_in, generator=gen), torch.randn(d_out, generator=gen), torch.randn(3, d_in, generator=gen)
    u = torch.randn(d_in, 2, generator=gen)
    padded = torch.cat([u, torch.zeros(d_in, 2)], dim=1)
    base = LinearBase(w, bias)

    def loss(p, info):
        return VARIANT.activation_form(p, {}, x, base, info).square().sum()

    out2 = VARIANT.activation_form({"hra_u": u}, {}, x, base, info_for(d_in, d_out, 2))
    out4 = VARIANT.activation_form({"hra_u": padded}, {}, x, base, info_for(d_in, d_out, 4))
    # fp32 round-off of two reflection products of different rank (outputs ~10: 2e-6 seen)
    torch.testing.assert_close(out4, out2, atol=1e-6, rtol=1e-6)
    w_eff, _ = VARIANT.weight_form({"hra_u": padded}, {}, w, bias, info_for(d_in, d_out, 4))
    torch.testing.assert_close(w_eff, VARIANT.weight_form({"hra_u": u}, {}, w, bias, info_for(d_in, d_out, 2))[0], atol=1e-6, rtol=0)
    g = grad(loss)({"hra_u": padded}, info_for(d_in, d_out, 4))["hra_u"]
    assert torch.isfinite(g).all() and torch.count_nonzero(g[:, 2:]) == 0 and g[:, :2].abs().max() > 0


# --------------------------------------------------------------------------------------------- step 0


@pytest.mark.parametrize(("kind", "targets"), [("llama", ["v_proj", "o_proj", "down_proj"]), ("gpt2", ["c_attn", "c_fc"])])
def test_step0_every_column_gets_a_gradient_pairs_equal_and_opposite(kind, targets):
    model = tiny_model(kind)
    adapter = lf.init_adapter(model, lf.AdapterSpec("hra", targets=targets, r=4), generator=torch.Generator().manual_seed(0))
    ids = tokens()
    base = lf.base_params(model)
    for merged in (False, True):
        grads = grad(loss_fn(model, base, adapter, ids, merged=merged))(adapter.params)
        for layer in adapter.layers:
            key = f"{layer.target.module}.hra_u"
            g = grads[key]
            col = g.abs().amax(dim=0)
            assert (col > 1e-3 * col.max()).all(), f"{key}: a column gets (almost) no gradient: {col}"
            torch.testing.assert_close(g[:, 0::2], -g[:, 1::2], atol=1e-4 * col.max().item(), rtol=0, msg=f"{key} merged={merged}")


# --------------------------------------------------------------------------------------------- peft


def make_peft(kind: str, r: int, init_weights: bool, seed: int = 0):
    lf_model = tiny_model(kind, seed=seed)
    peft_base = tiny_model(kind, seed=seed)
    cfg = HRAConfig(r=r, target_modules=PEFT_TARGETS[kind], init_weights=init_weights)
    # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: that exact
    # FutureWarning is expected; pytest.warns re-raises any other warning.
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        peft_model = get_peft_model(peft_base, cfg)
    return peft_model.eval(), lf_model


@pytest.mark.parametrize(("r", "init"), [(4, "paired"), (3, "random")])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_matches_peft_after_perturbation(kind, r, init):
    peft_model, lf_model = make_peft(kind, r, init_weights=init == "paired")
    adapter = lf.init_adapter(lf_model, lf.AdapterSpec("hra", targets=PEFT_TARGETS[kind], r=r, init=init))
    peft_params = {peft_key_to_lf(n): p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert sorted(peft_params) == sorted(adapter.params), "peft and lora_func adapt different layers"
    for key, p in peft_params.items():
        assert p.shape == adapter.params[key].shape, key
        if init == "paired":  # peft's init has the same structure
            assert torch.equal(p[:, 0::2], p[:, 1::2]), key
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(peft_model.named_parameters()):
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    adapter = adapter.with_params({k: p.detach().clone() for k, p in peft_params.items()})

    ids = tokens(batch=2, length=10, seed=4)
    peft_model.zero_grad()
    peft_out = peft_model(input_ids=ids).logits
    ce_loss(peft_out, ids).backward()
    assert (peft_out - lf_model(ids).logits).abs().max() > 1e-2, "the perturbed adapter should change the output"
    base = lf.base_params(lf_model)
    for merged in (False, True):
        out = lf.adapted_call(lf_model, adapter, ids, merged=merged).logits
        torch.testing.assert_close(out, peft_out.detach(), atol=1e-5, rtol=0, msg=f"logits merged={merged}")
        grads = grad(loss_fn(lf_model, base, adapter, ids, merged=merged))(adapter.params)
        for key, g in grads.items():
            assert peft_params[key].grad.abs().max() > 0, key
            torch.testing.assert_close(g, peft_params[key].grad, atol=1e-5, rtol=0, msg=f"grad {key} merged={merged}")


def test_peft_only_warns_on_odd_r_and_refuses_conv1d():
    """Keeps docs/variants/hra.md honest about the two deliberate differences."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(tiny_model("llama"), HRAConfig(r=3, target_modules=["v_proj"]))
    assert any("r is odd" in str(w.message) for w in caught)
    with pytest.raises(TypeError, match="is not supported"):
        get_peft_model(tiny_model("gpt2"), HRAConfig(r=4, target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("hra", targets=["c_attn"], r=4))
    assert {layer.target.layout for layer in adapter.layers} == {"conv1d"}
