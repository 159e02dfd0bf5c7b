"""antipasto beyond the shared contract: the authors' formulas written out here (float64, explicit
inverse, independent of the package), Cayley properties, the tanh clamp, runtime steering under
vmap, exact base at alpha = 0, init, rank and option errors, half precision, reload on another base."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import lora_func as lf
from lora_func._layer_ops import LayerCall
from lora_func.variants import LayerInfo
from lora_func.variants import antipasto
from tests.contract_helpers import logits, loss_fn, perturbed
from tests.models import DEFAULT_TARGETS, LAYER_KIND_MODEL, tiny_model, tokens

KINDS = ("linear", "conv1d")


# ----------------------------------------------------------------------------- oracle (authors)
def cayley64(p, alpha, max_angle):
    """R = (I − αA/2)⁻¹ (I + αA/2), A = a_lim·tanh((P − Pᵀ)/a_lim), a_lim = 2 tan(max/2); float64."""
    p = p.double()
    a = p - p.T
    if max_angle < math.pi:
        limit = 2 * math.tan(max_angle / 2)
        a = limit * torch.tanh(a / limit)
    eye = torch.eye(p.shape[0], dtype=torch.float64)
    return torch.linalg.inv(eye - alpha * a / 2) @ (eye + alpha * a / 2)


def w_eff64(params, buffers, W, alpha, *, max_angle, rotate_u):
    """W_res + (U R_u) diag(S + α·δs) (V R)ᵀ with W_res = W − U diag(S) Vᵀ (authors' forward)."""
    U, S, V = (buffers[k].double() for k in ("U", "S", "V"))
    W = W.double()
    w_res = W - U @ torch.diag(S) @ V.T
    v_rot = V @ cayley64(params["P"], alpha, max_angle)
    u_rot = U @ cayley64(params["P_u"], alpha, max_angle) if rotate_u else U
    return w_res + u_rot @ torch.diag(S + alpha * params["delta_s"].double()) @ v_rot.T


def info_for(d_out, d_in, r, *, bias=True, angle=math.pi / 3, rotate_u=False, steer=1.0):
    options = {"max_rotation_angle": angle, "rotate_u": rotate_u, "steer": steer}
    return LayerInfo(d_in=d_in, d_out=d_out, r=r, alpha=1.0, has_bias=bias, options=tuple(sorted(options.items())))


def layer(d_out=12, d_in=10, r=4, seed=0, **opts):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g)
    b = torch.randn(d_out, generator=g)
    info = info_for(d_out, d_in, r, **opts)
    params, buffers = antipasto.init(W, b, info, dtype=torch.float32, generator=torch.Generator().manual_seed(seed + 1))
    return W, b, info, params, buffers


def bump(params, scale, seed=5):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in params.items()}


def build(kind, seed=0, dtype=torch.float32, adapter_dtype=torch.float32, **opts):
    model_kind = LAYER_KIND_MODEL[kind]
    model = tiny_model(model_kind, seed=seed, dtype=dtype)
    spec = lf.AdapterSpec("antipasto", targets=DEFAULT_TARGETS[model_kind], r=4, dtype=adapter_dtype, **opts)
    return model, lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed + 100))


def steered(adapter, alpha):
    return adapter.with_buffers(antipasto.with_steering(adapter.buffers, alpha))


# ----------------------------------------------------------------------------- init
def test_buffers_are_the_top_r_singular_triplets():
    W, _, _, params, buffers = layer(d_out=12, d_in=10, r=4)
    u64, s64, vh64 = torch.linalg.svd(W.double(), full_matrices=False)
    U, S, V = buffers["U"], buffers["S"], buffers["V"]
    assert U.shape == (12, 4) and S.shape == (4,) and V.shape == (10, 4) and buffers["steer"].shape == ()
    assert all(t.dtype == torch.float32 for t in (*params.values(), *buffers.values()))
    torch.testing.assert_close(S.double(), s64[:4], atol=1e-5, rtol=0)
    # Sign-invariant: the rank-r truncation and the residual, against a float64 SVD.
    top = u64[:, :4] @ torch.diag(s64[:4]) @ vh64[:4]
    torch.testing.assert_close((U @ torch.diag(S) @ V.T).double(), top, atol=2e-5, rtol=0)
    torch.testing.assert_close(U.T @ U, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(V.T @ V, torch.eye(4), atol=1e-5, rtol=0)
    # Deterministic sign convention: the largest-|.| entry of each U column is positive.
    assert (U.gather(0, U.abs().argmax(0, keepdim=True)) > 0).all()
    assert buffers["steer"] == 1.0
    assert sorted(params) == ["P", "delta_s"]
    assert params["delta_s"].shape == (4,) and params["P"].shape == (4, 4)
    assert torch.equal(params["P"], -params["P"].T), "authors init P = X - Xᵀ (skew)"
    assert params["P"].abs().max() > 0 and params["delta_s"].abs().min() > 0
    _, _, _, params_u, buffers_u = layer(rotate_u=True, steer=-0.5)
    assert sorted(params_u) == ["P", "P_u", "delta_s"] and buffers_u["steer"] == -0.5
    assert torch.equal(params_u["P"], params["P"]) and torch.equal(params_u["delta_s"], params["delta_s"])
    assert not torch.equal(params_u["P_u"], params_u["P"])


def test_init_distribution_and_determinism():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(128, 128, generator=g)
    info = info_for(128, 128, 128, bias=False)
    p1, b1 = antipasto.init(W, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    p2, b2 = antipasto.init(W, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    p3, _ = antipasto.init(W, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    assert all(torch.equal(p1[k], p2[k]) for k in p1) and all(torch.equal(b1[k], b2[k]) for k in b1)
    assert not torch.equal(p1["P"], p3["P"]) and not torch.equal(p1["delta_s"], p3["delta_s"])
    ds = p1["delta_s"].double()
    assert abs(ds.mean() - 4e-4) < 4 * 4e-4 / math.sqrt(128) and 0.8 < ds.std() / 4e-4 < 1.2
    off = p1["P"].double()[~torch.eye(128, dtype=torch.bool)]
    assert abs(off.mean()) < 1e-4 and 0.96 < off.std() / (3e-3 * math.sqrt(2)) < 1.04
    # The sampler itself, where the truncation bites: N(0.3, 1) on [-0.5, 1].
    x = antipasto.trunc_normal((200_000,), mean=0.3, std=1.0, a=-0.5, b=1.0, generator=torch.Generator().manual_seed(3))
    assert x.dtype == torch.float32 and x.min() >= -0.5 and x.max() <= 1.0
    phi = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    alpha_, beta_ = -0.8, 0.7
    mean = 0.3 + (phi(alpha_) - phi(beta_)) / (cdf(beta_) - cdf(alpha_))
    assert abs(x.double().mean() - mean) < 3e-3


# ----------------------------------------------------------------------------- formulas
@pytest.mark.parametrize("rotate_u", [False, True])
@pytest.mark.parametrize("angle", [math.pi / 3, 2.0, math.inf])
def test_weight_and_activation_forms_match_the_authors_formula(rotate_u, angle):
    W, b, info, params, buffers = layer(rotate_u=rotate_u, angle=angle)
    params = bump(params, 1.0)  # clamp well into its non-linear range, non-symmetric
    x = torch.randn(3, 5, 10, generator=torch.Generator().manual_seed(9))
    for alpha in (-1.3, -1.0, 0.5, 1.0, 2.0):
        bufs = {**buffers, "steer": torch.tensor(alpha)}
        expected = w_eff64(params, bufs, W, alpha, max_angle=angle, rotate_u=rotate_u)
        w_eff, b_eff = antipasto.weight_form(params, bufs, W, b, info)
        assert b_eff is b
        torch.testing.assert_close(w_eff.double(), expected, atol=1e-5, rtol=0, msg=f"alpha={alpha}")
        y_ref = x.double() @ expected.T + b.double()
        # nn.Linear and GPT-2 Conv1D (addmm on the stored (d_in, d_out) weight) base ops.
        linear = LayerCall(W, b, lambda x_: F.linear(x_, W, b))
        conv = LayerCall(W, b, lambda x_: torch.addmm(b, x_.reshape(-1, 10), W.T.contiguous()).reshape(*x_.shape[:-1], 12))
        for base in (linear, conv):
            y = antipasto.activation_form(params, bufs, x, base, info)
            torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=0, msg=f"alpha={alpha}")


def test_cayley_rotation_properties():
    g = torch.Generator().manual_seed(4)
    p = torch.randn(5, 5, generator=g)
    for angle in (math.pi / 3, 2.0, math.inf):
        for alpha in (-1.0, 0.4, 1.0, 2.5):
            R = antipasto.rotation(p, torch.tensor(alpha), angle)
            assert R.dtype == torch.float32
            torch.testing.assert_close(R.double(), cayley64(p, alpha, angle), atol=1e-6, rtol=0)
            torch.testing.assert_close(R @ R.T, torch.eye(5), atol=1e-6, rtol=0)
            assert abs(torch.linalg.det(R.double()) - 1) < 1e-5, "a rotation, not a reflection"
            R_minus = antipasto.rotation(p, torch.tensor(-alpha), angle)
            torch.testing.assert_close(R_minus @ R, torch.eye(5), atol=1e-6, rtol=0)  # R(−α) = R(α)⁻¹
            torch.testing.assert_close(R_minus, R.T, atol=1e-6, rtol=0)
            assert not torch.allclose(R, torch.eye(5), atol=1e-2)
    assert torch.equal(antipasto.rotation(p, torch.tensor(0.0), math.pi / 3), torch.eye(5))
    # The solve runs in fp32 for half-precision parameters (torch has no half solve on CPU).
    for half in (torch.bfloat16, torch.float16):
        R = antipasto.rotation(p.to(half), torch.tensor(1.0, dtype=half), math.pi / 3)
        assert R.dtype == torch.float32
        torch.testing.assert_close(R @ R.T, torch.eye(5), atol=1e-6, rtol=0)


def rotation_angles(R):
    return torch.linalg.eigvals(R.double()).angle().abs()


def test_tanh_clamp_bounds_the_angle_for_2x2_but_not_larger_blocks():
    angle = math.pi / 3
    for scale in (0.1, 10.0, 1e4):
        for alpha in (-1.0, 1.0):
            R = antipasto.rotation(torch.tensor([[0.0, scale], [0.0, 0.0]]), torch.tensor(alpha), angle)
            assert rotation_angles(R).max() <= angle + 1e-6
    # Saturated: the angle reaches the bound; without the clamp it would approach pi.
    saturated = antipasto.rotation(torch.tensor([[0.0, 1e4], [0.0, 0.0]]), torch.tensor(1.0), angle)
    assert rotation_angles(saturated).max() > angle - 1e-4
    free = antipasto.rotation(torch.tensor([[0.0, 1e4], [0.0, 0.0]]), torch.tensor(1.0), math.inf)
    assert rotation_angles(free).max() > 3.0
    # r = 4: every element is clamped, yet the rotation angle exceeds max_rotation_angle (the
    # documented caveat); it stays below 2·atan(|α|(r−1)·tan(max/2)).
    big = 1e4 * torch.triu(torch.ones(4, 4), 1) * torch.tensor([[1, 1, -1, 1]] * 4)
    R4 = antipasto.rotation(big, torch.tensor(1.0), angle)
    worst = rotation_angles(R4).max()
    assert worst > angle + 0.1
    assert worst <= 2 * math.atan(3 * math.tan(angle / 2)) + 1e-6
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        R = antipasto.rotation(100 * torch.randn(4, 4, generator=g), torch.tensor(1.0), angle)
        assert rotation_angles(R).max() <= 2 * math.atan(3 * math.tan(angle / 2)) + 1e-6


# ----------------------------------------------------------------------------- model level
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_alpha_zero_and_zero_params_give_the_base_exactly(kind, dtype):
    model, adapter = build(kind, dtype=dtype, rotate_u=True)
    adapter = perturbed(adapter, 1.0)
    base, ids = lf.base_params(model), tokens()
    reference = model(ids).logits
    zeroed = adapter.with_params({k: torch.zeros_like(v) for k, v in adapter.params.items()})
    for make in (lf.overlay, lf.merge_overlay):
        assert not torch.equal(logits(model, make(base, adapter), ids), reference)
        assert torch.equal(logits(model, make(base, steered(adapter, 0.0)), ids), reference)
        assert torch.equal(logits(model, make(base, zeroed), ids), reference)


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_over_alpha_equals_three_calls(kind):
    model, init = build(kind, rotate_u=True)
    adapter = perturbed(init, 1.0)
    base, ids = lf.base_params(model), tokens()
    alphas = torch.tensor([-1.0, 0.0, 1.0])
    for make in (lf.overlay, lf.merge_overlay):
        batched = vmap(lambda a: logits(model, make(base, steered(adapter, a)), ids))(alphas)  # noqa: B023
        singles = [logits(model, make(base, steered(adapter, float(a))), ids) for a in alphas]
        for i in range(3):
            torch.testing.assert_close(batched[i], singles[i], atol=1e-5, rtol=0)
        assert (batched[0] - batched[2]).abs().max() > 1e-2, "+alpha and -alpha must steer differently"
        # alpha = 0 is the base exactly outside vmap (test above); under vmap the base matmuls
        # are batched and round differently: measured 1.5e-6 = 3.7e-7 · max |logit| (~4).
        reference = model(ids).logits.detach()
        torch.testing.assert_close(batched[1], reference, atol=2e-6 * float(reference.abs().max()), rtol=0)
    # Near the init (first order), ±alpha move the output in opposite directions around the base.
    near = vmap(lambda a: logits(model, lf.overlay(base, steered(init, a)), ids))(alphas)
    d_plus, d_minus = (near[2] - near[1]).flatten(), (near[0] - near[1]).flatten()
    assert F.cosine_similarity(d_plus, d_minus, dim=0) < -0.95

    # A contrastive (±alpha) objective: grad of the vmapped sum == sum of the separate grads.
    def loss(params, a):
        return loss_fn(model, base, steered(adapter, a), ids)(params)

    batched_grad = grad(lambda p: vmap(loss, in_dims=(None, 0))(p, alphas).sum())(adapter.params)
    for key in adapter.params:
        expected = sum(grad(loss)(adapter.params, float(a))[key] for a in alphas)
        torch.testing.assert_close(batched_grad[key], expected, atol=1e-6, rtol=1e-4, msg=key)
        assert batched_grad[key].abs().max() > 0, key


def test_with_steering_is_pure_and_only_touches_steer():
    model, adapter = build("linear")
    before = dict(adapter.buffers)
    out = antipasto.with_steering(adapter.buffers, torch.tensor(-2.0))
    assert adapter.buffers == before and out is not adapter.buffers
    for key, value in out.items():
        if key.endswith(".steer"):
            assert value.dtype == torch.float32 and value.shape == () and value == -2.0
            assert before[key] == 1.0
        else:
            assert value is before[key]
    stacked = lf.stack([adapter, adapter])
    out = antipasto.with_steering(stacked.buffers, 0.5)
    assert all(v.shape == (2,) and (v == 0.5).all() for k, v in out.items() if k.endswith(".steer"))


def test_default_options_step0_gradients_and_training_runs():
    model, adapter = build("linear")
    assert sorted({n for layer in adapter.layers for n, _ in layer.param_shapes}) == ["P", "delta_s"]
    g = grad(loss_fn(model, lf.base_params(model), adapter, tokens()))(adapter.params)
    assert all(v.abs().max() > 0 for v in g.values())


# ----------------------------------------------------------------------------- errors
def test_rank_deficient_weight_raises_with_r_and_rank():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(8, 2, generator=g) @ torch.randn(2, 6, generator=g)
    with pytest.raises(ValueError, match=r"r=3 exceeds the numerical rank 2 "):
        antipasto.init(W, None, info_for(8, 6, 3), dtype=torch.float32, generator=g)
    antipasto.init(W, None, info_for(8, 6, 2), dtype=torch.float32, generator=g)  # r = rank is fine
    with pytest.raises(ValueError, match=r"numerical rank 0"):
        antipasto.init(torch.zeros(8, 6), None, info_for(8, 6, 1), dtype=torch.float32, generator=g)


def _rank_one_model():
    model = tiny_model("llama")
    with torch.no_grad():
        w = model.model.layers[1].self_attn.q_proj.weight
        w.copy_(torch.outer(w[:, 0], w[0]))
    return model


def test_rank_deficient_model_layer_raises():
    spec = lf.AdapterSpec("antipasto", targets=DEFAULT_TARGETS["llama"], r=4)
    with pytest.raises(ValueError, match=r"r=4 exceeds the numerical rank 1 "):
        lf.init_adapter(_rank_one_model(), spec, generator=torch.Generator().manual_seed(0))


def test_rank_error_names_the_layer():
    spec = lf.AdapterSpec("antipasto", targets=DEFAULT_TARGETS["llama"], r=4)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj"):
        lf.init_adapter(_rank_one_model(), spec, generator=torch.Generator().manual_seed(0))


def test_spec_alpha_is_refused_and_options_are_validated():
    model = tiny_model("llama")
    targets = DEFAULT_TARGETS["llama"]
    with pytest.raises(ValueError, match="does not use AdapterSpec.alpha.*steer"):
        lf.init_adapter(model, lf.AdapterSpec("antipasto", targets=targets, r=2, alpha=-1.0))
    assert lf.AdapterSpec("antipasto", targets=targets).alpha == 1.0
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="max_rotation_angle"):
            lf.AdapterSpec("antipasto", targets=targets, max_rotation_angle=bad)
    with pytest.raises(ValueError, match="steer"):
        lf.AdapterSpec("antipasto", targets=targets, steer=math.inf)
    with pytest.raises(TypeError, match="rotate_u"):
        lf.AdapterSpec("antipasto", targets=targets, rotate_u="yes")
    with pytest.raises(TypeError, match="unknown option"):
        lf.AdapterSpec("antipasto", targets=targets, rotate_v=False)


# ----------------------------------------------------------------------------- dtype, reload
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_adapter_dtype_on_half_base(half):
    model, adapter = build("linear", dtype=half, adapter_dtype=half, rotate_u=True)
    assert all(v.dtype == half for v in (*adapter.params.values(), *adapter.buffers.values()))
    adapter = perturbed(adapter, 1.0)
    base, ids = lf.base_params(model), tokens()
    outs = [logits(model, make(base, adapter), ids) for make in (lf.overlay, lf.merge_overlay)]
    for out in outs:
        assert out.dtype == half and torch.isfinite(out).all()
    # lazy vs merged differ by half-precision round-off only: measured 0.018 (bf16) / 0.0024
    # (fp16) of the adapter's effect (max |Δlogit| to the base, ~5.3).
    effect = (outs[0].float() - model(ids).logits.float()).abs().max()
    assert (outs[0].float() - outs[1].float()).abs().max() < 0.05 * effect
    g = grad(loss_fn(model, base, adapter, ids))(adapter.params)
    assert all(v.dtype == half and torch.isfinite(v).all() and v.abs().max() > 0 for v in g.values())
    assert torch.equal(logits(model, lf.overlay(base, steered(adapter, 0.0)), ids), model(ids).logits)


def test_load_onto_a_different_base_raises(tmp_path):
    model, adapter = build("linear")
    path = lf.save(perturbed(adapter, 1.0), tmp_path / "a.safetensors")
    lf.load(path, model=tiny_model("llama", seed=0))
    with pytest.raises(ValueError, match="fingerprint"):
        lf.load(path, model=tiny_model("llama", seed=1))
