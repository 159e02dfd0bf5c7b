"""The base-dtype low-rank node (lora_func.variants._kernels._BasePlusProduct / base_plus_product): its
backward formulas (gradcheck in fp64), its bf16 results against an fp64 oracle, torch.func
support, when it applies, and that the targets reading one input keep one copy of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lora_func as lf
from lora_func._layer_ops import LayerCall
from lora_func.variants._kernels import _BasePlusProduct, base_plus_product, half_product_applies
from tests.models import tiny_model

N, D_IN, D_OUT, R = 12, 10, 7, 3


def _layer(dtype: torch.dtype, *, seed: int = 0, weight_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(D_OUT, D_IN, generator=g).to(dtype).requires_grad_(weight_grad)
    bias = torch.randn(D_OUT, generator=g).to(dtype).requires_grad_(weight_grad)
    return LayerCall(weight, bias, lambda x_: F.linear(x_, weight, bias)), weight, bias


def _adapter(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, D_IN, generator=g).requires_grad_(True), torch.randn(D_OUT, R, generator=g).requires_grad_(True)


def test_backward_formulas_pass_gradcheck_for_every_input():
    base, weight, bias = _layer(torch.float64, weight_grad=True)
    x = torch.randn(2, N // 2, D_IN, dtype=torch.float64, requires_grad=True)
    a, b = (t.detach().double().requires_grad_(True) for t in _adapter())

    def f(x, weight, bias, a, b):
        replay = lambda x_: F.linear(x_, weight, bias)  # noqa: E731
        return _BasePlusProduct.apply(x, weight, bias, a, b, replay)[0]

    assert torch.autograd.gradcheck(f, (x, weight, bias, a, b))


def test_bf16_output_and_gradients_match_an_fp64_oracle_to_bf16_precision():
    base, weight, bias = _layer(torch.bfloat16)
    x = torch.randn(2, N // 2, D_IN).bfloat16().requires_grad_(True)
    a, b = _adapter()
    assert half_product_applies(base, x, a)
    y = base_plus_product(base, x, a, b)
    assert y.dtype == torch.bfloat16
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    gx, ga, gb = torch.autograd.grad(y, (x, a, b), g)
    assert ga.dtype == gb.dtype == torch.float32 and gx.dtype == torch.bfloat16

    xd, ad, bd = (t.detach().double().requires_grad_(True) for t in (x, a, b))
    yd = F.linear(xd, weight.double(), bias.double()) + (xd @ ad.T) @ bd.T
    rx, ra, rb = torch.autograd.grad(yd, (xd, ad, bd), g.double())
    # bf16 operands, fp32 accumulation: a few bf16 ulps (2^-8) of each result's scale. An
    # adapter that is ignored, or a scale applied twice, is off by the whole low-rank term.
    for got, want in ((y, yd), (gx, rx), (ga, ra), (gb, rb)):
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()
    low_rank = ((xd @ ad.T) @ bd.T).abs().max()
    assert low_rank > 0.5 * yd.abs().max()  # the check above sees the adapter's term


def test_weight_and_bias_gradients_when_the_base_requires_grad():
    base, weight, bias = _layer(torch.bfloat16, weight_grad=True)
    x = torch.randn(N, D_IN).bfloat16()
    a, b = _adapter()
    y = base_plus_product(base, x, a, b)
    gw, gb = torch.autograd.grad(y.float().square().sum(), (weight, bias))
    wd, bd = weight.detach().double().requires_grad_(True), bias.detach().double().requires_grad_(True)
    yd = F.linear(x.double(), wd, bd) + (x.double() @ a.detach().double().T) @ b.detach().double().T
    rw, rbias = torch.autograd.grad(yd.square().sum(), (wd, bd))
    assert (gw.double() - rw).abs().max() <= 3e-2 * rw.abs().max()
    assert (gb.double() - rbias).abs().max() <= 3e-2 * rbias.abs().max()


def test_func_grad_and_vmap_over_stacked_adapters_match_eager():
    base, _, _ = _layer(torch.bfloat16)
    x = torch.randn(N, D_IN).bfloat16()
    a, b = (t.detach() for t in _adapter())

    def loss(a, b):
        return base_plus_product(base, x, a, b).float().square().sum()

    ga, gb = torch.func.grad(loss, argnums=(0, 1))(a, b)
    ea, eb = torch.autograd.grad(loss(a.requires_grad_(True), b.requires_grad_(True)), (a, b))
    assert torch.equal(ga, ea) and torch.equal(gb, eb)
    a, b = a.detach(), b.detach()
    stacked_a, stacked_b = torch.stack([a, 2 * a]), torch.stack([b, -b])
    out = torch.vmap(lambda a_, b_: base_plus_product(base, x, a_, b_))(stacked_a, stacked_b)
    grads = torch.vmap(torch.func.grad(loss, argnums=(0, 1)))(stacked_a, stacked_b)
    for k in range(2):
        one = base_plus_product(base, x, stacked_a[k], stacked_b[k])
        assert (out[k].float() - one.float()).abs().max() <= 1e-2 * one.float().abs().max()
        want = torch.func.grad(loss, argnums=(0, 1))(stacked_a[k], stacked_b[k])
        for got, ref in zip((grads[0][k], grads[1][k]), want, strict=True):
            assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize(
    ("base_dtype", "adapter_dtype", "applies"),
    [
        (torch.bfloat16, torch.float32, True),
        (torch.bfloat16, torch.float64, True),
        (torch.bfloat16, torch.bfloat16, False),  # nothing wider to protect
        (torch.float16, torch.float32, False),  # fp16 keeps the fp32 path (scales can overflow)
        (torch.float32, torch.float32, False),  # fp32 results unchanged
    ],
)
def test_applies_only_to_a_bf16_base_with_wider_adapters(base_dtype, adapter_dtype, applies):
    base, _, _ = _layer(base_dtype)
    x = torch.randn(N, D_IN).to(base_dtype)
    a = torch.zeros(R, D_IN, dtype=adapter_dtype)
    assert half_product_applies(base, x, a) is applies
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not half_product_applies(base, x, a)
    assert not half_product_applies(lambda x_: x_, x, a)  # a base that does not replay a plain weight


def test_the_targets_reading_one_input_keep_one_copy_of_it():
    """q and v read the same hidden states: over the frozen base, autograd keeps that bf16 tensor
    once per layer (deduplicated by storage) and per target only the (n, r) activations and the
    bf16 copies of the factors; no fp32 copy of an input (twice the bytes, per target)."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", ["q_proj", "v_proj"], r=R), generator=torch.Generator().manual_seed(0))
    adapter = adapter.with_params({k: (v + 0.1).detach().requires_grad_(True) for k, v in adapter.params.items()})
    base = lf.base_params(model)
    embeds = model.get_input_embeddings()(torch.randint(3, 50, (2, 8))).detach().requires_grad_(True)
    skip = {t.untyped_storage().data_ptr() for t in [*base.values(), *adapter.params.values(), embeds]}

    def saved_bytes(params) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.func.functional_call(model, params, (), {"inputs_embeds": embeds})
        out.logits.float().sum().backward()
        return sum(seen.values())

    over = saved_bytes(lf.overlay(base, adapter)) - saved_bytes(base)
    n, hidden, bf16 = 16, model.config.hidden_size, 2
    inputs = model.config.num_hidden_layers * n * hidden * bf16
    per_target = sum(n * R * bf16 + layer.info.d_in * R * bf16 + layer.info.d_out * R * bf16 for layer in adapter.layers)
    assert inputs <= over <= inputs + per_target, (over, inputs, per_target)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.params.values())


@pytest.mark.parametrize("name", ["pissa", "mica"])
def test_lora_derivatives_take_the_node_on_a_bf16_base_and_agree_with_the_adapter_dtype_path(name, monkeypatch):
    """PiSSA (the residual family's form) and MiCA (a frozen B) run their bf16-base step through
    the one node, as LoRA does: once per target, with logits and every adapter gradient within
    bf16 precision of the same step with the node switched off (the fp32 low-rank path), and
    the adapter's term well above that tolerance. The gradients' bound is wider than one node's
    (test above): the bf16 rounding of every activation compounds through the layers above a
    target (LoRA's own gradients differ by up to 3.1 % of their scale here; these, 3.6 %)."""
    import lora_func.variants._kernels as kernels
    import lora_func.variants.pissa as pissa

    model = tiny_model("llama", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    adapter = lf.init_adapter(model, lf.AdapterSpec(name, ["q_proj", "v_proj"], r=R), generator=g)
    adapter = adapter.with_params({k: (v + 0.2 * torch.randn(v.shape, generator=g)).detach().requires_grad_(True) for k, v in adapter.params.items()})
    ids = torch.randint(3, 50, (2, 8), generator=g)
    weights = torch.randn((2, 8, model.config.vocab_size), generator=g)
    calls = []
    apply = _BasePlusProduct.apply
    monkeypatch.setattr(_BasePlusProduct, "apply", lambda *a: calls.append(1) or apply(*a))

    def logits_and_grads():
        logits = lf.adapted_call(model, adapter, ids).logits.float()
        return logits, torch.autograd.grad((logits * weights).sum(), list(adapter.params.values()))

    got, got_grads = logits_and_grads()
    assert len(calls) == 2 * model.config.num_hidden_layers
    for module in (kernels, pissa):
        monkeypatch.setattr(module, "half_product_applies", lambda *a: False)
    want, want_grads = logits_and_grads()
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert (got - want).abs().max() <= 3e-2 * want.abs().max()
    for key, a, b in zip(adapter.params, got_grads, want_grads, strict=True):
        assert (a - b).abs().max() <= 5e-2 * b.abs().max(), key
    with torch.no_grad():
        base_only = model(ids).logits.float()
    assert (want - base_only).abs().max() > 0.2 * want.abs().max()
