"""compose() and combine(): merged == lazy == the independent float64 oracle, for every ordered
pair of registered variants on one layer (nn.Linear with bias and GPT-2 Conv1D with bias)."""

from __future__ import annotations


import pytest
import torch
from torch.func import functional_call

import lora_func as lf
from lora_func.targeting import canonical_weight, stored_weight
from tests.contract_helpers import calibration_batches, perturbed
from tests.models import LAYER_KIND_MODEL, tiny_model, tokens
from tests.variant_table import ROWS

# One biased target per layer kind, so bias handling (IA3 scales it, DoRA must not) composes.
LAYER = {"linear": "model.layers.1.self_attn.q_proj", "conv1d": "transformer.h.1.attn.c_attn"}
# Every variant composed on top of, and under, one partner of each kind of form: an additive
# low-rank update (lora), a per-output scale that also scales the bias (ia3), an orthogonal
# rotation (oft), a norm of the weight it sees (dora), a buffer fixed from the base it was built
# on (delora), a residual that replaces the weight (pissa), a basis shared by every layer (vera),
# a Hadamard product (loha), a trained bias (beft). All ordered pairs of 52 variants (2,704 per
# layer kind) repeated these cases at about four times the cost.
PARTNERS = ("beft", "delora", "dora", "ia3", "lora", "loha", "oft", "pissa", "vera")
PAIRS = sorted({(a, b) for a in ROWS for b in PARTNERS} | {(b, a) for a in ROWS for b in PARTNERS})
# On GPT-2's Conv1D the chain is the same code on the canonical (d_out, d_in) view; what the
# layout can change is bias handling and a norm of the stored weight, so there every variant meets
# the partners that touch those (a scaled bias, a trained bias, a weight norm, the plain update).
CONV1D_PARTNERS = ("beft", "dora", "ia3", "lora")
PAIR_CASES = [
    pytest.param(kind, a, b, id=f"{kind}-{a}-then-{b}")
    for kind in sorted(LAYER)
    for a, b in PAIRS
    if kind != "conv1d" or a in CONV1D_PARTNERS or b in CONV1D_PARTNERS
]
# DeLoRA's column norms of W are a buffer fixed at init from the base it was built on (as in
# peft), so on top of another part its delta is the one it has on the base; the row's oracle
# recomputes the norms from the W it gets, so the chain oracle feeds it the original base.
DELTA_FROM_INIT_BASE = {"delora"}


@pytest.fixture(scope="module", params=sorted(LAYER))
def setting(request):
    kind = request.param
    model = tiny_model(LAYER_KIND_MODEL[kind])
    return kind, model, lf.base_params(model), tokens(2, 12, seed=5)


# The pair test needs every variant's perturbed adapter (and its output alone) ~2·len(ROWS) times
# per layer kind; they are built once per model and reused: nothing here writes into an adapter's
# tensors (compose, combine, with_params and the overlays make new dicts), and the key holds the
# model, so a rebuilt module fixture gets its own.
_ADAPTERS: dict[tuple, tuple[torch.nn.Module, lf.Adapter]] = {}
_ALONE: dict[int, tuple[lf.Adapter, torch.Tensor]] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_adapters():
    yield
    _ADAPTERS.clear()
    _ALONE.clear()


def _adapter(model, variant: str, layers: list[str], seed: int) -> lf.Adapter:
    key = (id(model), variant, tuple(layers), seed)
    if key not in _ADAPTERS or _ADAPTERS[key][0] is not model:
        row = ROWS[variant]
        spec = lf.AdapterSpec(variant, targets=layers, **row.spec_kwargs)
        adapter = lf.init_adapter(
            model, spec, generator=torch.Generator().manual_seed(seed), calibration=calibration_batches() if row.calibration else None
        )
        _ADAPTERS[key] = (model, perturbed(adapter, row.perturb_scale, seed=seed + 1))
    return _ADAPTERS[key][1]


def _merged_alone(model, base, adapter: lf.Adapter, ids) -> torch.Tensor:
    """The logits of ``adapter`` alone, merged; cached per cached adapter."""
    key = id(adapter)
    if key not in _ALONE or _ALONE[key][0] is not adapter:
        _ALONE[key] = (adapter, _logits(model, lf.merge_overlay(base, adapter), ids))
    return _ALONE[key][1]


def _chain_oracle(base, parts: list[lf.Adapter]) -> dict[str, torch.Tensor]:
    """Each part's explicit W_eff formula (tests/variant_rows) applied to the previous result, float64."""
    out = dict(base)
    for part in parts:
        row = ROWS[part.spec.variant]
        for layer in part.layers:
            t = layer.target
            p, b = part.layer_tensors(layer)
            p64, b64 = ({k: v.detach().double() for k, v in d.items()} for d in (p, b))
            w = canonical_weight(out[t.weight_key], t.layout).double()
            bias = out[t.bias_key].double() if t.bias_key else None
            if part.spec.variant in DELTA_FROM_INIT_BASE:
                w0 = canonical_weight(base[t.weight_key], t.layout).double()
                w_eff, b_eff = w + (row.w_eff(p64, b64, w0, bias, layer.info)[0] - w0), bias
            else:
                w_eff, b_eff = row.w_eff(p64, b64, w, bias, layer.info)
            out[t.weight_key] = stored_weight(w_eff, t.layout).to(base[t.weight_key].dtype)
            if t.bias_key is not None and b_eff is not None:
                out[t.bias_key] = b_eff.to(base[t.bias_key].dtype)
    return out


def _logits(model, params, ids):
    return functional_call(model, params, (ids,)).logits


class _OracleBase:
    """A layer op given by a function (a part without a merged weight, by its row's y_oracle), as a
    part on top of it sees it: no weight to read (reading it is what a merge would need)."""

    training = False

    def __init__(self, call, bias):
        self._call, self.bias = call, bias

    @property
    def weight(self):
        raise AssertionError("a part on top of a variant without a merged weight read its weight")

    def __call__(self, x):
        return self._call(x)


def _lazy_chain_logits(model, base, parts: list[lf.Adapter], ids, *, detach: bool = True) -> torch.Tensor:
    """Two parts on one layer, one of them without a merged weight (Lily), in float64 from the rows:
    under it, the first part's W_eff feeds the row's ``y_oracle``; on top of it, the second part's
    activation form runs on the ``y_oracle`` as its base layer. ``detach=False``: differentiable
    in the parts' params."""
    (layer,) = parts[0].layers
    t = layer.target
    tensors = [tuple({k: (v.detach() if detach else v).double() for k, v in d.items()} for d in part.layer_tensors(part.layers[0])) for part in parts]
    first, second = (part.spec.variant for part in parts)
    if not lf.get_variant(second).merges:  # [X, lily]: X's W_eff, then the y-oracle on it
        params = _chain_oracle(base, [parts[0]]) if detach else base
        if not detach:  # X's W_eff from the live params
            w, bias = ROWS[first].w_eff(*tensors[0], canonical_weight(base[t.weight_key], t.layout).double(), base[t.bias_key].double() if t.bias_key else None, parts[0].layers[0].info)
        else:
            w, bias = canonical_weight(params[t.weight_key], t.layout).double(), params[t.bias_key].double() if t.bias_key else None

        def layer_out(x):
            return ROWS[second].y_oracle(*tensors[1], x, w, bias, parts[1].layers[0].info)
    else:  # [lily, X]: X's own activation form on top of the y-oracle's layer
        w = canonical_weight(base[t.weight_key], t.layout).double()
        bias = base[t.bias_key].double() if t.bias_key else None
        under = _OracleBase(lambda x: ROWS[first].y_oracle(*tensors[0], x, w, bias, parts[0].layers[0].info), bias)

        def layer_out(x):
            return lf.get_variant(second).activation_form(*tensors[1], x, under, parts[1].layers[0].info)

    handle = dict(model.named_modules())[t.module].register_forward_hook(lambda m, i, o: layer_out(i[0].double()).to(o.dtype))
    try:
        return _logits(model, base, ids)
    finally:
        handle.remove()


@pytest.mark.parametrize(("setting", "first", "second"), PAIR_CASES, indirect=["setting"])
def test_compose_pair_on_one_layer_merged_lazy_oracle(setting, first, second):
    kind, model, base, ids = setting
    a = _adapter(model, first, [LAYER[kind]], seed=10)
    b = _adapter(model, second, [LAYER[kind]], seed=20)
    if lf.get_variant(second).replaces_weight:  # pissa, olora, corda, ln_tuning: a residual replaces W
        with pytest.raises(ValueError, match=rf"part 1 \({second}\) replaces the base weight of .*Put part 1 first"):
            lf.compose(a, b)
        return
    if not all(lf.get_variant(v).merges for v in (first, second)):  # no merged weight (Lily): the lazy path
        _check_pair_without_merged_weight(model, base, a, b, ids)
        return
    both = lf.compose(a, b)
    oracle = _logits(model, _chain_oracle(base, [a, b]), ids)
    merged = _logits(model, lf.merge_overlay(base, both), ids)
    lazy = _logits(model, lf.overlay(base, both), ids)
    scale = oracle.abs().max()
    tol = 4e-5 * float(scale)
    torch.testing.assert_close(merged, oracle, atol=tol, rtol=0)
    torch.testing.assert_close(lazy, oracle, atol=tol, rtol=0)
    # The second part is really applied on top of the first (not instead of it, not ignored);
    # trainable tokens replace whole rows: a second part on the same rows replaces the first's.
    if first == second == "trainable_tokens":
        torch.testing.assert_close(_merged_alone(model, base, b, ids), oracle, atol=tol, rtol=0)
        return
    for alone in (a, b):
        assert (_merged_alone(model, base, alone, ids) - oracle).abs().max() > 100 * tol


def _check_pair_without_merged_weight(model, base, a, b, ids):
    """A pair with a part that has no merged weight: the merged path refuses; a part on top that
    reads the weight under it (DoRA's norm) refuses; otherwise the lazy path equals the float64
    chain of the rows (the y-oracle), and differs from each part alone."""
    both = lf.compose(a, b)
    with pytest.raises(ValueError, match="has no merged weight"):
        lf.merge_overlay(base, both)
    try:
        lazy = _logits(model, lf.overlay(base, both), ids)
    except ValueError as err:
        assert "has no merged weight" in str(err) and lf.get_variant(b.spec.variant).merges
        with pytest.raises(AssertionError, match="read its weight"):
            _lazy_chain_logits(model, base, [a, b], ids)
        return
    oracle = _lazy_chain_logits(model, base, [a, b], ids)
    tol = 4e-5 * float(oracle.abs().max())
    torch.testing.assert_close(lazy, oracle, atol=tol, rtol=0)
    for alone in (a, b):
        assert (_logits(model, lf.overlay(base, alone), ids) - oracle).abs().max() > 100 * tol


@pytest.mark.parametrize("variant", sorted(ROWS))
def test_compose_gradients_lazy_equal_merged(setting, variant):
    kind, model, base, ids = setting
    # A variant that replaces the base weight (pissa, olora, corda, ln_tuning) goes first; the others after pissa.
    replaces = lf.get_variant(variant).replaces_weight
    first = "lora" if replaces else "pissa"
    parts = [_adapter(model, first, [LAYER[kind]], seed=1), _adapter(model, variant, [LAYER[kind]], seed=2)]
    if replaces:
        parts.reverse()
    both = lf.compose(*parts)

    def loss(params, merged):
        over = (lf.merge_overlay if merged else lf.overlay)(base, both.with_params(params))
        return _logits(model, over, ids).square().mean()

    lazy = torch.func.grad(loss)(both.params, False)
    if not lf.get_variant(variant).merges:  # no merged weight (Lily): against the float64 chain of the rows
        with pytest.raises(ValueError, match="has no merged weight"):
            torch.func.grad(loss)(both.params, True)

        def oracle_loss(params):
            return _lazy_chain_logits(model, base, list(both.with_params(params).parts), ids, detach=False).square().mean()

        merged = torch.func.grad(oracle_loss)(both.params)
    else:
        merged = torch.func.grad(loss)(both.params, True)
    assert sorted(lazy) == sorted(both.params) and all(k.split("/")[0] in "01" for k in lazy)
    for key in lazy:
        assert lazy[key].abs().max() > 0 or key.rsplit(".", 1)[-1] in ROWS[variant].training_only, f"{key} gets no gradient"
        torch.testing.assert_close(lazy[key], merged[key], atol=1e-5 * float(merged[key].detach().abs().max()) + 1e-7, rtol=1e-4)


def test_compose_on_different_layers_is_both_applied(setting):
    kind, model, base, ids = setting
    other = {"linear": "model.layers.0.mlp.down_proj", "conv1d": "transformer.h.0.mlp.c_proj"}[kind]
    a = _adapter(model, "dora", [LAYER[kind]], seed=1)
    b = _adapter(model, "ia3_ff", [other], seed=2)
    both = lf.compose(a, b)
    oracle = _logits(model, _chain_oracle(base, [a, b]), ids)
    for over in (lf.merge_overlay, lf.overlay):
        torch.testing.assert_close(_logits(model, over(base, both), ids), oracle, atol=4e-5 * float(oracle.abs().max()), rtol=0)
    # Different layers: the order does not matter.
    torch.testing.assert_close(_logits(model, lf.overlay(base, lf.compose(b, a)), ids), oracle, atol=4e-5 * float(oracle.abs().max()), rtol=0)


def _sum_oracle(base, parts, weights):
    out = dict(base)
    deltas: dict[str, torch.Tensor] = {}
    for part, w in zip(parts, weights.tolist(), strict=True):
        single = _chain_oracle(base, [part])
        for key, value in single.items():
            if value is not base[key]:
                deltas[key] = deltas.get(key, 0) + w * (value.double() - base[key].double())
    for key, delta in deltas.items():
        out[key] = (base[key].double() + delta).to(base[key].dtype)
    return out


def test_combine_every_variant_weighted_sum_of_deltas(setting):
    kind, model, base, ids = setting
    # (the variants without a merged weight: test_combine_with_a_part_without_a_merged_weight)
    parts = [_adapter(model, v, [LAYER[kind]], seed=30 + i) for i, v in enumerate(sorted(ROWS)) if lf.get_variant(v).merges]
    weights = torch.linspace(-0.7, 1.3, len(parts))
    mix = lf.combine(parts, weights)
    oracle = _logits(model, _sum_oracle(base, parts, weights), ids)
    tol = 4e-5 * float(oracle.abs().max())
    torch.testing.assert_close(_logits(model, lf.merge_overlay(base, mix), ids), oracle, atol=tol, rtol=0)
    torch.testing.assert_close(_logits(model, lf.overlay(base, mix), ids), oracle, atol=tol, rtol=0)

    # Gradients w.r.t. the mixing weights (learned mixing) agree between the two paths and are
    # the directional derivatives along each part's delta.
    def loss(params, merged):
        over = (lf.merge_overlay if merged else lf.overlay)(base, mix.with_params(params))
        return _logits(model, over, ids).square().mean()

    g_lazy = torch.func.grad(loss)(mix.params, False)
    g_merged = torch.func.grad(loss)(mix.params, True)
    assert g_lazy["weights"].abs().min() > 0
    # fp32 over every variant at once (29 parts): relative to the gradient's scale (the largest
    # entry over all tensors: a 1-element tensor's own scale is its round-off), as the logits above
    scale = max(float(g.detach().abs().max()) for g in g_merged.values())
    for key in g_lazy:
        torch.testing.assert_close(g_lazy[key], g_merged[key], atol=4e-5 * scale, rtol=0, msg=key)


@pytest.mark.parametrize("variant", [v for v in sorted(ROWS) if not lf.get_variant(v).merges])
def test_combine_with_a_part_without_a_merged_weight(setting, variant):
    """combine(lora, lily) (or arrow): the merged path refuses; the lazy one is the base plus the
    weighted sum of each part's change of the layer's output, from the rows' float64 oracles."""
    kind, model, base, ids = setting
    parts = [_adapter(model, "lora", [LAYER[kind]], seed=40), _adapter(model, variant, [LAYER[kind]], seed=41)]
    weights = torch.tensor([0.6, -1.3])
    mix = lf.combine(parts, weights)
    with pytest.raises(ValueError, match="has no merged weight"):
        lf.merge_overlay(base, mix)
    t = parts[0].layers[0].target
    w = canonical_weight(base[t.weight_key], t.layout).double()
    bias = base[t.bias_key].double() if t.bias_key else None
    (p0, b0), (p1, b1) = ({k: v.detach().double() for k, v in d.items()} for d in parts[0].layer_tensors(parts[0].layers[0])), (
        {k: v.detach().double() for k, v in d.items()} for d in parts[1].layer_tensors(parts[1].layers[0])
    )
    w_lora = ROWS["lora"].w_eff(p0, b0, w, bias, parts[0].layers[0].info)[0]

    def layer_out(x):
        plain = x @ w.T + (0 if bias is None else bias)
        other = ROWS[variant].y_oracle(p1, b1, x, w, bias, parts[1].layers[0].info)
        return plain + 0.6 * (x @ (w_lora - w).T) - 1.3 * (other - plain)

    handle = dict(model.named_modules())[t.module].register_forward_hook(lambda m, i, o: layer_out(i[0].double()).to(o.dtype))
    try:
        oracle = _logits(model, base, ids)
    finally:
        handle.remove()
    tol = 4e-5 * float(oracle.abs().max())
    torch.testing.assert_close(_logits(model, lf.overlay(base, mix), ids), oracle, atol=tol, rtol=0)
    for alone in parts:
        assert (_logits(model, lf.overlay(base, alone), ids) - oracle).abs().max() > 100 * tol


def test_combine_is_not_a_sum_of_factors(setting):
    # Averaging A and B separately gives ((A1+A2)/2)((B1+B2)/2), not the average update.
    kind, model, base, ids = setting
    a, b = (_adapter(model, "lora", [LAYER[kind]], seed=s) for s in (1, 2))
    mean = lf.combine([a, b], torch.tensor([0.5, 0.5]))
    naive = a.with_params({k: (a.params[k] + b.params[k]) / 2 for k in a.params})
    oracle = _logits(model, _sum_oracle(base, [a, b], torch.tensor([0.5, 0.5])), ids)
    got = _logits(model, lf.overlay(base, mean), ids)
    torch.testing.assert_close(got, oracle, atol=4e-5 * float(oracle.abs().max()), rtol=0)
    assert (_logits(model, lf.overlay(base, naive), ids) - oracle).abs().max() > 1e-3


def test_combined_and_composed_stack_and_vmap_like_a_loop(setting):
    kind, model, base, ids = setting
    members = [
        lf.compose(_adapter(model, "lora", [LAYER[kind]], seed=s), _adapter(model, "ia3", [LAYER[kind]], seed=s + 1))
        for s in (1, 5, 9)
    ]
    stacked = lf.stack(members)
    got = torch.func.vmap(lambda ad: _logits(model, lf.overlay(base, ad), ids))(stacked)
    for k, member in enumerate(members):
        torch.testing.assert_close(got[k], _logits(model, lf.overlay(base, member), ids), atol=1e-5, rtol=1e-5)
    mixes = [lf.combine([m.parts[0], m.parts[1]], torch.tensor([0.3 * k, 1.0])) for k, m in enumerate(members)]
    got = torch.func.vmap(lambda ad: _logits(model, lf.merge_overlay(base, ad), ids))(lf.stack(mixes))
    for k, mix in enumerate(mixes):
        torch.testing.assert_close(got[k], _logits(model, lf.merge_overlay(base, mix), ids), atol=1e-5, rtol=1e-5)
    back = lf.unstack(lf.stack(mixes))
    assert all(torch.equal(x.weights, y.weights) for x, y in zip(back, mixes, strict=True))


def test_compose_and_combine_bad_input(setting):
    kind, model, base, _ = setting
    a = _adapter(model, "lora", [LAYER[kind]], seed=1)
    with pytest.raises(ValueError, match="at least one adapter"):
        lf.compose()
    with pytest.raises(TypeError, match="expected an Adapter, Composed or Combined, got dict"):
        lf.compose(a, a.params)
    with pytest.raises(ValueError, match=r"one entry per adapter \(2\), got shape \(3,\)"):
        lf.combine([a, a], torch.ones(3))
    with pytest.raises(ValueError, match="different stack shapes"):
        lf.compose(a, lf.stack([a, a]))
    composed = lf.compose(a, a)
    with pytest.raises(KeyError, match=r"missing keys \['0/"):
        composed.with_params({k: v for k, v in composed.params.items() if not k.startswith("0/")})
