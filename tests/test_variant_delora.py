"""DeLoRA beyond the contract suite: init (kaiming A, zero B, lambda0, the column-norm buffer in
both layouts), both forms and the gradients of A, B and lambda against a float64 autograd oracle
with the 1e-4 clamp active and the norms not detached, the fp32 scale (no fp16 overflow), and HF
peft (DeloraConfig) on tiny Llama and Qwen2, at init (the huge step-0 B gradient) and after a
random perturbation. peft refuses GPT-2 Conv1D; lora_func supports it (contract suite)."""

from __future__ import annotations

import math

import pytest
import torch
from peft import DeloraConfig, get_peft_model
from torch.func import grad

import lora_func as lf
from lora_func.variants import LayerInfo
from lora_func.targeting import canonical_weight
from lora_func.variants.delora import VARIANT
from tests.contract_helpers import loss_fn
from tests.models import tiny_model, tokens
from tests import peft_helpers
from tests.peft_helpers import NoWeightBase, ce_loss

R = 4
PEFT_TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"]}





# --------------------------------------------------------------------------------------------- init


@pytest.mark.parametrize(("kind", "targets"), [("llama", ["v_proj", "down_proj"]), ("gpt2", ["c_attn", "c_fc"])])
@pytest.mark.parametrize("lambda0", [None, 2.5])
def test_init(kind, targets, lambda0):
    model = tiny_model(kind, seed=3)
    options = {} if lambda0 is None else {"lambda0": lambda0}
    spec = lf.AdapterSpec("delora", targets=targets, r=R, **options)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    modules = dict(model.named_modules())
    assert len(adapter.layers) == 4
    for layer in adapter.layers:
        t = layer.target
        w = canonical_weight(modules[t.module].weight.detach(), t.layout).double()
        p = {n: adapter.params[f"{t.module}.{n}"] for n in ("delora_A", "delora_B", "delora_lambda")}
        assert p["delora_A"].shape == (R, t.d_in) and p["delora_B"].shape == (t.d_out, R)
        assert p["delora_lambda"].shape == (1,)
        assert all(v.dtype == torch.float32 for v in p.values())
        assert torch.count_nonzero(p["delora_B"]) == 0
        bound = 1 / math.sqrt(t.d_in)  # kaiming_uniform(a=√5) on (r, d_in)
        a = p["delora_A"]
        assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound and a.std() > 0.4 * bound
        assert p["delora_lambda"].tolist() == [15.0 if lambda0 is None else lambda0]
        # the buffer: per INPUT column of the canonical (d_out, d_in) weight (rows of a Conv1D's storage)
        (buffer_name,) = [n for n, _ in layer.buffer_shapes]
        w_norm = adapter.buffers[f"{t.module}.{buffer_name}"]
        assert buffer_name == "delora_w_norm" and w_norm.shape == (t.d_in,) and w_norm.dtype == torch.float32
        torch.testing.assert_close(w_norm.double(), w.norm(dim=0), atol=1e-7, rtol=1e-6, msg=t.module)


def peft_key_to_lf(name: str) -> str:
    return peft_helpers.peft_key_to_lf(name, ('delora_A', 'delora_B', 'delora_lambda', 'delora_w_norm'))


def test_lambda0_is_validated():
    with pytest.raises(ValueError, match="lambda0"):
        lf.AdapterSpec("delora", targets=["q_proj"], lambda0=float("nan"))
    with pytest.raises(TypeError, match="lambda0"):
        lf.AdapterSpec("delora", targets=["q_proj"], lambda0="15")


# ----------------------------------------------------------------------------- one-layer oracle


def test_one_layer_forms_and_gradients_equal_a_float64_oracle():
    """Both forms vs y = x (W + (λ/r) B diag(1/(a b)) A diag(w_norm))ᵀ + b in float64, values and
    the gradients of A, B and λ. One row of A and one column of B are below the 1e-4 clamp, so a
    missing clamp, a detached norm or a wrong λ/r changes some value or gradient."""
    d_in, d_out, r = 7, 5, 3
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g)
    x = torch.randn(2, 4, d_in, generator=g)
    a, b = torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g)
    a[1] *= 1e-5 / a[1].norm()  # ‖A[1]‖ = 1e-5 < 1e-4: clamped
    b[:, 2] *= 3e-5 / b[:, 2].norm()  # ‖B[:, 2]‖ = 3e-5: clamped
    params = {"delora_A": a, "delora_B": b, "delora_lambda": torch.tensor([2.7])}
    buffers = {"delora_w_norm": w.norm(dim=0)}
    info = LayerInfo(d_in=d_in, d_out=d_out, r=r, alpha=8.0, has_bias=True, options=(("lambda0", 15.0),))
    upstream = torch.randn(2, 4, d_out, generator=g)

    def oracle(p):
        an = p["delora_A"].norm(dim=1).clamp(min=1e-4)
        bn = p["delora_B"].norm(dim=0).clamp(min=1e-4)
        w_eff = w.double() + p["delora_lambda"] / r * p["delora_B"] @ torch.diag(1 / (an * bn)) @ p["delora_A"] @ torch.diag(
            w.double().norm(dim=0)
        )
        return x.double() @ w_eff.T + bias.double()

    def lazy(p):
        return VARIANT.activation_form(p, buffers, x, NoWeightBase(w, bias), info)

    def merged(p):
        w_eff, b_eff = VARIANT.weight_form(p, buffers, w, bias, info)
        return x @ w_eff.T + b_eff

    p64 = {k: v.double().requires_grad_(True) for k, v in params.items()}
    (oracle(p64) * upstream.double()).sum().backward()
    expected = oracle({k: v.double() for k, v in params.items()})
    for name, form in (("lazy", lazy), ("merged", merged)):
        p32 = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        out = form(p32)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=name)
        (out * upstream).sum().backward()
        for k, v in p32.items():
            assert p64[k].grad.abs().max() > 0, k
            torch.testing.assert_close(v.grad.double(), p64[k].grad, atol=1e-4, rtol=1e-4, msg=f"{name} grad {k}")


def test_a_bf16_adapter_merges_with_its_norms_and_scale_in_fp32():
    """bf16 adapter tensors on an fp32 layer: the merged weight is the float64 W_eff of those
    exact bf16 values to fp32 round-off (1e-5), since the norms, the per-rank scale and the
    product run in fp32. A norm or scale left in bf16 is ~4e-3 off; a product of mixed dtypes
    raises."""
    d_in, d_out, r = 7, 5, 3
    g = torch.Generator().manual_seed(1)
    w = torch.randn(d_out, d_in, generator=g)
    params = {
        "delora_A": torch.randn(r, d_in, generator=g).bfloat16(),
        "delora_B": torch.randn(d_out, r, generator=g).bfloat16(),
        "delora_lambda": torch.tensor([2.7]).bfloat16(),
    }
    buffers = {"delora_w_norm": w.norm(dim=0).bfloat16()}
    info = LayerInfo(d_in=d_in, d_out=d_out, r=r, alpha=8.0, has_bias=False, options=(("lambda0", 15.0),))
    a, b, lam, wn = (t.double() for t in (params["delora_A"], params["delora_B"], params["delora_lambda"], buffers["delora_w_norm"]))
    delta = lam / r * b @ torch.diag(1 / (a.norm(dim=1) * b.norm(dim=0))) @ a @ torch.diag(wn)
    w_eff, _ = VARIANT.weight_form(params, buffers, w, None, info)
    assert w_eff.dtype == torch.float32
    assert (w_eff.double() - (w.double() + delta)).abs().max() <= 1e-5 * delta.abs().max()


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.float16])
def test_scale_is_computed_in_fp32_on_fp16(adapter_dtype):
    """r=1: the per-rank scale at init is λ/(‖A‖·1e-4) ≈ 2.6e5 > 65504 (fp16 max). Computed in fp16
    it is inf and inf · 0 (B = 0) is NaN; computed in fp32 the adapter is the identity."""
    model = tiny_model("llama", dtype=torch.float16)
    spec = lf.AdapterSpec("delora", targets=["v_proj", "down_proj"], r=1, dtype=adapter_dtype)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    key = "model.layers.0.self_attn.v_proj"
    an = adapter.params[f"{key}.delora_A"].float().norm()
    assert 15.0 / (an * 1e-4) > torch.finfo(torch.float16).max
    ids = tokens()
    reference = model(ids).logits
    for merged in (False, True):
        out = lf.adapted_call(model, adapter, ids, merged=merged).logits
        assert torch.isfinite(out).all(), merged
        assert torch.equal(out, reference), merged
    if adapter_dtype == torch.float32:
        grads = grad(loss_fn(model, lf.base_params(model), adapter, ids))(adapter.params)
        assert all(torch.isfinite(v).all() for v in grads.values())
        assert grads[f"{key}.delora_B"].abs().max() > 0


def test_activation_form_never_reads_the_dense_weight():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(5, 7, generator=g), torch.randn(3, 7, generator=g)
    info = LayerInfo(d_in=7, d_out=5, r=2, alpha=8.0, has_bias=False, options=(("lambda0", 15.0),))
    params, buffers = VARIANT.init(w, None, info, dtype=torch.float32, generator=g)
    params["delora_B"] = torch.randn(5, 2, generator=g)
    y = VARIANT.activation_form(params, buffers, x, NoWeightBase(w, None), info)
    w_eff, _ = VARIANT.weight_form(params, buffers, w, None, info)
    torch.testing.assert_close(y, x @ w_eff.T, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------- peft


def make_peft(kind: str, seed: int = 0):
    lf_model = tiny_model(kind, seed=seed)
    peft_base = tiny_model(kind, seed=seed)
    cfg = DeloraConfig(r=R, target_modules=PEFT_TARGETS[kind])
    # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: that exact
    # FutureWarning is expected; pytest.warns re-raises any other warning.
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        peft_model = get_peft_model(peft_base, cfg)
    return peft_model.eval(), lf_model


def compare_with_peft(peft_model, lf_model, adapter, *, grad_rel: float | None = None, modes=(False, True)):
    """peft's trainable tensors into ``adapter``; logits (lazy, merged) and every gradient per tensor
    (atol 1e-5, or ``grad_rel`` times the tensor's largest peft gradient)."""
    params = {peft_key_to_lf(n): p.detach().clone().requires_grad_(True) for n, p in peft_model.named_parameters() if p.requires_grad}
    assert sorted(params) == sorted(adapter.params), "peft and lora_func adapt different tensors"
    adapter = adapter.with_params(params)
    ids = tokens(batch=2, length=10, seed=4)
    peft_model.zero_grad()
    peft_out = peft_model(input_ids=ids).logits
    ce_loss(peft_out, ids).backward()
    peft_grads = {peft_key_to_lf(n): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    base = lf.base_params(lf_model)
    for merged in modes:
        out = lf.adapted_call(lf_model, adapter, ids, merged=merged).logits
        torch.testing.assert_close(out, peft_out.detach(), atol=1e-5, rtol=0, msg=f"logits merged={merged}")
        grads = grad(loss_fn(lf_model, base, adapter, ids, merged=merged))(adapter.params)
        for key, g in grads.items():
            atol = 1e-5 if grad_rel is None else grad_rel * float(peft_grads[key].abs().max())
            torch.testing.assert_close(g, peft_grads[key], atol=atol, rtol=0, msg=f"grad {key} merged={merged}")
    return peft_out, peft_grads


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_matches_peft(kind):
    peft_model, lf_model = make_peft(kind)
    adapter = lf.init_adapter(lf_model, lf.AdapterSpec("delora", targets=PEFT_TARGETS[kind], r=R), generator=torch.Generator().manual_seed(0))
    # Same init rule: lambda = 15, B = 0, and the frozen column norms equal peft's buffer.
    peft_buffers = {peft_key_to_lf(n): b for n, b in peft_model.named_buffers() if ".delora_w_norm." in n}
    assert sorted(peft_buffers) == sorted(adapter.buffers)
    for key, value in peft_buffers.items():
        torch.testing.assert_close(adapter.buffers[key], value, atol=1e-6, rtol=1e-6, msg=key)
    for name, p in peft_model.named_parameters():
        if p.requires_grad and not name.split(".")[-2] == "delora_A":
            torch.testing.assert_close(adapter.params[peft_key_to_lf(name)], p.detach(), atol=0, rtol=0, msg=name)

    # Step 0 (peft's own init, B = 0): only B gets a gradient, and it is large (the clamp makes the
    # per-rank factor ~1e4: max |grad| ~1e4 here); lora_func equals peft relative to that size:
    # measured max |Δgrad| <= 5.2e-7 · max |grad| per tensor (fp32 summation order). The
    # zero gradients of A and lambda are compared with atol 0.
    _, step0 = compare_with_peft(peft_model, lf_model, adapter, grad_rel=2e-6, modes=(False,))
    for key, g in step0.items():
        if key.endswith("delora_B"):
            assert g.abs().max() > 0, key
        else:
            assert torch.count_nonzero(g) == 0, key
    assert max(g.abs().max() for k, g in step0.items() if k.endswith("delora_B")) > 10.0

    # After a random perturbation of every trainable peft tensor (B no longer zero, λ ≠ 15).
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(peft_model.named_parameters()):
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    reference = lf_model(tokens(batch=2, length=10, seed=4)).logits
    out, grads = compare_with_peft(peft_model, lf_model, adapter)
    assert (out - reference).abs().max() > 1e-2, "the perturbed adapter should change the output"
    assert all(g.abs().max() > 0 for g in grads.values())


def test_peft_refuses_conv1d_which_lora_func_supports():
    """Keeps docs/variants/delora.md honest: peft 0.21 raises on GPT-2 Conv1D."""
    with pytest.raises(TypeError, match="only `torch.nn.Linear`"):
        get_peft_model(tiny_model("gpt2"), DeloraConfig(r=R, target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("delora", targets=["c_attn"], r=R))
    assert {layer.target.layout for layer in adapter.layers} == {"conv1d"}
