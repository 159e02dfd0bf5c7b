"""merge_adapters and to_lora (issue 32): every method on the deltas, against HF peft's
add_weighted_adapter in float64, DARE's statistics, gradients and vmap, and to_lora's reported
errors against the measured ones."""

from __future__ import annotations

import copy
import types

import peft  # the oracle: a pinned test dependency, imported directly so its absence fails
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf

# transformers deprecations reached through peft
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj", "down_proj"]  # down_proj: d_in 32 > d_out 16
# (rank, alpha, seed); weights exactly representable in fp32 (peft casts them to fp32)
ADAPTERS = {"task1": (2, 4.0, 1), "task2": (3, 5.0, 2), "task3": (4, 3.0, 3)}
WEIGHTS = [0.5, 0.75, -0.25]


def _rmsnorm_in_input_dtype(module: torch.nn.Module) -> None:
    """transformers' Llama RMSNorm computes in fp32; in float64 oracle tests it must compute in
    the input dtype on both sides."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in module.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.forward = types.MethodType(forward, m)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    _rmsnorm_in_input_dtype(model)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A float64 Llama, a peft model (a copy) holding three trained LoRA adapters of different
    ranks and alphas, and the same three loaded into lora_func with load_peft."""
    model = tiny_llama()
    pm = None
    for name, (r, alpha, _) in ADAPTERS.items():
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS)
        if pm is None:
            pm = peft.get_peft_model(copy.deepcopy(model), config, adapter_name=name)
        else:
            pm.add_adapter(name, config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    directory = tmp_path_factory.mktemp("peft")
    pm.save_pretrained(directory)
    adapters = [lf.load_peft(directory / name, model) for name in ADAPTERS]
    ids = torch.randint(2, 48, (2, 7), generator=torch.Generator().manual_seed(3))
    return types.SimpleNamespace(model=model, peft=pm, adapters=adapters, ids=ids, base=lf.base_params(model))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().max() / want.abs().max()).detach())


def lf_deltas(setup, adapter) -> dict[str, torch.Tensor]:
    """Per target module ΔW = W_eff − W, measured through merge_overlay."""
    merged = lf.merge_overlay(setup.base, adapter)
    return {k.removesuffix(".weight"): merged[k] - setup.base[k] for k in setup.base if merged[k] is not setup.base[k]}


def peft_merge(setup, name, combination_type, **kwargs):
    pm = setup.peft
    if name not in pm.peft_config:
        pm.add_weighted_adapter(list(ADAPTERS), WEIGHTS, name, combination_type=combination_type, **kwargs)
    layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules() if hasattr(m, "lora_A") and name in m.lora_A}
    deltas = {n: m.get_delta_weight(name) for n, m in layers.items()}
    pm.set_adapter(name)
    with torch.no_grad():
        logits = pm(setup.ids).logits
    return deltas, logits


def check_against_peft(setup, merged, name, combination_type, **kwargs):
    want, want_logits = peft_merge(setup, name, combination_type, **kwargs)
    got = lf_deltas(setup, merged)
    assert set(got) == set(want) and len(want) == 6
    for module in want:
        assert want[module].abs().max() > 1e-3, module  # the oracle is not trivially zero
        assert rel(got[module], want[module]) < 1e-8, (module, rel(got[module], want[module]))
    with torch.no_grad():
        logits = lf.adapted_call(setup.model, merged, setup.ids).logits
    base_logits = setup.model(setup.ids).logits
    assert rel(want_logits - base_logits, want_logits - base_logits) == 0  # finite
    assert (want_logits - base_logits).abs().max() > 1e-4  # the merge changes the output
    assert rel(logits, want_logits) < 1e-8


def full_rank(setup) -> int:
    return 16  # min(d_out, d_in) of every target


def test_cat_equals_peft_cat(setup):
    merged = lf.merge_adapters(setup.adapters, torch.tensor(WEIGHTS, dtype=torch.float64), method="cat")
    # a LoRA of rank Σ r_k with each member's scale folded in
    assert {layer.info.r for layer in merged.layers} == {9}
    check_against_peft(setup, merged, "m_cat", "cat")


def test_svd_equals_peft_svd(setup):
    merged = lf.merge_adapters(setup.adapters, WEIGHTS, method="svd", rank=3, base=setup.base)
    assert {layer.info.r for layer in merged.layers} == {3}
    check_against_peft(setup, merged, "m_svd", "svd", svd_rank=3)


@pytest.mark.parametrize("majority_sign", ["total", "frequency"])
def test_ties_equals_peft_ties_svd_at_full_rank(setup, majority_sign):
    merged = lf.merge_adapters(setup.adapters, WEIGHTS, method="ties", density=0.4, majority_sign=majority_sign, base=setup.base)
    check_against_peft(setup, merged, f"m_ties_{majority_sign}", "ties_svd", svd_rank=full_rank(setup), density=0.4,
                       majority_sign_method=majority_sign)


def test_magnitude_prune_equals_peft_at_full_rank(setup):
    merged = lf.merge_adapters(setup.adapters, WEIGHTS, method="magnitude_prune", density=0.3, base=setup.base)
    check_against_peft(setup, merged, "m_mag", "magnitude_prune_svd", svd_rank=full_rank(setup), density=0.3)


def test_linear_is_the_sum_of_deltas(setup):
    # the exact cat form (plain LoRAs) and the delta path (full-rank form) both give Σ w_k ΔW_k
    deltas = [lf_deltas(setup, a) for a in setup.adapters]
    cat_form = lf.merge_adapters(setup.adapters, WEIGHTS, method="linear")
    full_form = lf.merge_adapters(setup.adapters, WEIGHTS, method="magnitude_prune", density=1.0, base=setup.base)
    assert {layer.info.r for layer in cat_form.layers} == {9} and {layer.info.r for layer in full_form.layers} == {16}
    for merged in (cat_form, full_form):
        got = lf_deltas(setup, merged)
        assert len(got) == 6
        for module in got:
            want = sum(w * d[module] for w, d in zip(WEIGHTS, deltas))
            assert rel(got[module], want) < 1e-12


# ------------------------------------------------------------------ DARE


def test_dare_keeps_density_within_3_sigma_and_rescales_exactly(setup):
    density = 0.3
    (adapter,) = setup.adapters[:1]
    want = lf_deltas(setup, adapter)
    merged = lf.merge_adapters([adapter], [1.0], method="dare_linear", density=density, base=setup.base,
                               generator=torch.Generator().manual_seed(0))
    got = lf_deltas(setup, merged)
    kept = n = 0
    for module, delta in want.items():
        mask = got[module] != 0
        kept, n = kept + int(mask.sum()), n + mask.numel()
        # every kept entry is ΔW / density, every other one exactly 0
        torch.testing.assert_close(got[module][mask], delta[mask] / density, rtol=1e-14, atol=0)
    sigma = (n * density * (1 - density)) ** 0.5
    assert abs(kept - n * density) < 3 * sigma, (kept, n * density, sigma)
    again = lf.merge_adapters([adapter], [1.0], method="dare_linear", density=density, base=setup.base,
                              generator=torch.Generator().manual_seed(0))
    other = lf.merge_adapters([adapter], [1.0], method="dare_linear", density=density, base=setup.base,
                              generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(again.params[k], merged.params[k]) for k in merged.params)
    assert not all(torch.equal(other.params[k], merged.params[k]) for k in merged.params)


def test_dare_ties_at_density_one_is_ties(setup):
    dare = lf.merge_adapters(setup.adapters, WEIGHTS, method="dare_ties", density=1.0, base=setup.base)
    ties = lf.merge_adapters(setup.adapters, WEIGHTS, method="ties", density=1.0, base=setup.base)
    linear = lf_deltas(setup, lf.merge_adapters(setup.adapters, WEIGHTS, method="linear"))
    got, want = lf_deltas(setup, dare), lf_deltas(setup, ties)
    for module in want:
        assert rel(got[module], want[module]) < 1e-14
        assert rel(want[module], linear[module]) > 1e-3  # the disjoint mean is not the sum


# ------------------------------------------------------------------ gradients and vmap


def _probe(setup):
    g = torch.Generator().manual_seed(11)
    return {m: torch.randn(d.shape, generator=g, dtype=torch.float64) for m, d in lf_deltas(setup, setup.adapters[0]).items()}


@pytest.mark.parametrize("method", ["linear", "cat", "svd", "ties", "dare_linear", "dare_ties", "magnitude_prune"])
def test_gradients_reach_the_weights_through_every_method(setup, method):
    adapters = [a.detach() for a in setup.adapters]
    probe = _probe(setup)
    kwargs = {"density": 0.5} if method in ("ties", "dare_linear", "dare_ties", "magnitude_prune") else {}

    def f(w):
        merged = lf.merge_adapters(adapters, w, method=method, rank=4 if method == "svd" else None, base=setup.base,
                                   generator=torch.Generator().manual_seed(0), **kwargs)
        deltas = lf_deltas(setup, merged)
        return sum((deltas[m] * probe[m]).sum() for m in probe)

    w = torch.tensor(WEIGHTS, dtype=torch.float64)
    grad = torch.func.grad(f)(w)
    assert grad.shape == (3,) and torch.isfinite(grad).all() and (grad.abs() > 1e-6).all(), grad


def test_grad_through_ties_equals_finite_difference(setup):
    adapters = [a.detach() for a in setup.adapters]

    def loss(w):
        merged = lf.merge_adapters(adapters, w, method="ties", density=0.4, base=setup.base)
        return lf.adapted_call(setup.model, merged, setup.ids).logits.logsumexp(-1).mean()

    w = torch.tensor(WEIGHTS, dtype=torch.float64)
    grad = torch.func.grad(loss)(w)
    eps = 1e-6
    fd = torch.stack([(loss(w + eps * e) - loss(w - eps * e)) / (2 * eps) for e in torch.eye(3, dtype=torch.float64)])
    assert grad.abs().min() > 1e-4
    torch.testing.assert_close(grad, fd.detach(), rtol=1e-6, atol=0)


def test_vmap_over_weights_and_a_density_sweep(setup):
    adapters = [a.detach() for a in setup.adapters]
    ws = torch.tensor([WEIGHTS, [1.0, -0.5, 0.25], [0.1, 0.2, 0.7]], dtype=torch.float64)
    densities = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)

    def merged_params(w, d, method):
        return lf.merge_adapters(adapters, w, method=method, density=d, base=setup.base).params

    for method in ("ties", "magnitude_prune"):
        over_w = torch.func.vmap(lambda w, m=method: merged_params(w, 0.4, m))(ws)
        over_d = torch.func.vmap(lambda d, m=method: merged_params(ws[0], d, m))(densities)
        for i in range(3):
            one_w, one_d = merged_params(ws[i], 0.4, method), merged_params(ws[0], float(densities[i]), method)
            for key in one_w:
                torch.testing.assert_close(over_w[key][i], one_w[key], rtol=1e-13, atol=0)
                torch.testing.assert_close(over_d[key][i], one_d[key], rtol=1e-13, atol=0)
        assert not all(torch.equal(v[0], v[2]) for v in over_d.values())  # the sweep changes the merge
    # DARE: one draw shared by every density of the sweep (randomness="same")
    dare = torch.func.vmap(lambda d: lf.merge_adapters(adapters, ws[0], method="dare_ties", density=d, base=setup.base,
                                                       generator=torch.Generator().manual_seed(5)).params,
                           randomness="same")(densities)
    for i in range(3):
        one = lf.merge_adapters(adapters, ws[0], method="dare_ties", density=float(densities[i]), base=setup.base,
                                generator=torch.Generator().manual_seed(5)).params
        for key in one:
            torch.testing.assert_close(dare[key][i], one[key], rtol=1e-13, atol=0)


# ------------------------------------------------------------------ to_lora and export


def _trained(model, variant, targets, seed, **spec):
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=targets, r=4, dtype=torch.float64, **spec),
                              generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 100)
    return adapter.with_params({k: v + 0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})


@pytest.mark.parametrize("kind", ["dora", "ia3", "hra", "composition", "merge"])
def test_to_lora_reports_the_error_it_makes(setup, kind):
    model = setup.model
    if kind == "composition":
        adapter = lf.compose(_trained(model, "lora", ["q_proj", "v_proj"], 1), _trained(model, "ia3", ["v_proj", "down_proj"], 2))
    elif kind == "merge":
        adapter = lf.merge_adapters(setup.adapters, WEIGHTS, method="ties", density=0.5, base=setup.base)
    else:
        adapter = _trained(model, kind, ["q_proj", "down_proj"], 3)
    want = lf_deltas(setup, adapter)
    lora, errors = lf.to_lora(adapter, rank=2, base=setup.base)
    assert lora.variant.name == "lora" and {layer.info.r for layer in lora.layers} == {2}
    got = lf_deltas(setup, lora)
    assert set(errors) == set(want) == set(got)
    for module in want:
        measured = float((torch.linalg.matrix_norm(want[module] - got[module]) / torch.linalg.matrix_norm(want[module])).detach())
        assert measured > 1e-3  # rank 2 loses something: the check can fail
        assert abs(errors[module] - measured) <= 1e-9 * measured, (module, errors[module], measured)
    exact, exact_errors = lf.to_lora(adapter, rank=16, base=setup.base)
    assert max(exact_errors.values()) < 1e-12
    for module, delta in lf_deltas(setup, exact).items():
        assert rel(delta, want[module]) < 1e-12


def test_to_lora_energy_picks_the_smallest_rank_per_layer(setup):
    adapter = _trained(setup.model, "dora", ["q_proj", "down_proj"], 4)
    lora, errors = lf.to_lora(adapter, energy=0.9, base=setup.base)
    want = lf_deltas(setup, adapter)
    for layer in lora.layers:
        s = torch.linalg.svdvals(want[layer.target.module].detach())
        captured = (s**2).cumsum(0) / (s**2).sum()
        r = layer.info.r
        assert captured[r - 1] >= 0.9 and (r == 1 or captured[r - 2] < 0.9)
        assert errors[layer.target.module] == pytest.approx(float((1 - captured[r - 1]) ** 0.5), rel=1e-9)


@pytest.mark.parametrize("how", ["svd", "ties", "cat-ranks-differ"])
def test_a_merge_saves_with_save_peft_and_peft_reloads_it(setup, tmp_path, how):
    if how == "svd":
        merged = lf.merge_adapters(setup.adapters, WEIGHTS, method="svd", rank=3, base=setup.base)
    elif how == "ties":  # exact: rank min(d_out, d_in) per layer, an identity factor
        merged = lf.merge_adapters(setup.adapters, WEIGHTS, method="ties", density=0.5, base=setup.base)
    else:  # q_proj rank 8, v_proj and down_proj rank 4: peft's rank_pattern
        a = _trained(setup.model, "lora", ["q_proj", "down_proj"], 5, use_rslora=True)
        b = _trained(setup.model, "lora", ["q_proj", "v_proj"], 6, alpha=3.0)
        merged = lf.merge_adapters([a, b], [0.5, -1.5], method="cat")
        assert len({layer.info.r for layer in merged.layers}) == 2
    if how == "ties":  # the exact merge saves, with a warning that names rank=
        with pytest.warns(UserWarning, match=r"full-rank LoRA .* merge_adapters\(\.\.\., rank=k\)"):
            directory = lf.save_peft(merged.detach(), tmp_path / how, model=setup.model)
    else:
        directory = lf.save_peft(merged.detach(), tmp_path / how, model=setup.model)
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(setup.model), directory).eval()
    with torch.no_grad():
        want = lf.adapted_call(setup.model, merged, setup.ids).logits
        got = reloaded(setup.ids).logits
        base_logits = setup.model(setup.ids).logits
    assert (want - base_logits).abs().max() > 1e-4
    assert rel(got, want) < 1e-10


# ------------------------------------------------------------------ any variant, Conv1D, rsLoRA


def test_mixed_variants_on_gpt2_conv1d_equal_peft_merge_functions_on_the_deltas():
    """LoRA (rsLoRA), DoRA and HRA on GPT-2's Conv1D c_attn (stored (d_in, d_out)), one LoRA also
    on mlp.c_fc: each method equals peft's merge_utils function applied to the measured deltas."""
    from peft.utils import merge_utils

    from tests.models import tiny_model

    model = tiny_model("gpt2", dtype=torch.float64)
    base = lf.base_params(model)
    adapters = [_trained(model, "lora", ["c_attn", "mlp.c_fc"], 1, use_rslora=True),
                _trained(model, "dora", ["c_attn"], 2), _trained(model, "hra", ["c_attn"], 3)]
    weights = [0.5, 0.75, -0.25]
    measured = []
    for adapter in adapters:
        merged = lf.merge_overlay(base, adapter)
        measured.append({k: merged[k] - base[k] for k in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight",
                                                          "transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_fc.weight")})
    w = torch.tensor(weights, dtype=torch.float64)
    oracles = {
        "linear": lambda ts: merge_utils.task_arithmetic(ts, w),
        "ties": lambda ts: merge_utils.ties(ts, w, 0.3, "total"),
        "magnitude_prune": lambda ts: merge_utils.magnitude_prune(ts, w, 0.3),
    }
    for method, oracle in oracles.items():
        merged = lf.merge_adapters(adapters, weights, method=method, density=None if method == "linear" else 0.3, base=base)
        got = lf.merge_overlay(base, merged)
        for key in measured[0]:
            want = oracle([m[key].detach() for m in measured])
            assert want.abs().max() > 1e-3
            assert rel(got[key] - base[key], want) < 1e-10, (method, key)


def test_cat_folds_each_members_scale_rslora_included(setup):
    model = setup.model
    a = _trained(model, "lora", ["q_proj", "down_proj"], 5, use_rslora=True)
    b = _trained(model, "lora", ["q_proj", "v_proj"], 6, alpha=3.0)
    merged = lf.merge_adapters([a, b], [0.5, -1.5], method="cat")
    # q_proj carries both (rank 8), down_proj and v_proj one each (rank 4)
    assert sorted((layer.target.module.rsplit(".", 2)[-1], layer.info.r) for layer in merged.layers if ".0." in layer.target.module) == [
        ("down_proj", 4), ("q_proj", 8), ("v_proj", 4)]
    got, want = lf_deltas(setup, merged), lf_deltas(setup, lf.combine([a, b], torch.tensor([0.5, -1.5], dtype=torch.float64)))
    assert set(got) == set(want) and len(got) == 6
    for module in want:
        assert rel(got[module], want[module]) < 1e-12


def test_vmap_over_a_stack_of_adapters_merges_each_member(setup):
    """The error for a stacked adapter says to vmap the merge over the stack: it works, ranks padded."""
    a, b, c = (x.detach() for x in setup.adapters)
    stacked = lf.stack([a, c])  # ranks 2 and 4: padded to 4 with a rank mask
    for method, kwargs in (("cat", {}), ("ties", {"density": 0.4, "base": setup.base})):
        over = torch.func.vmap(lambda member, m=method, kw=kwargs: lf.merge_adapters([member, b], [0.5, 0.75], method=m, **kw).params)(stacked)
        for i, member in enumerate((a, c)):
            one = lf.merge_adapters([member, b], [0.5, 0.75], method=method, **kwargs)
            got = lf_deltas(setup, one.with_params({k: v[i] for k, v in over.items()}) if method != "cat" else one)
            want = lf_deltas(setup, one)
            if method == "cat":  # padded ranks: compare ΔW = B A of the vmapped factors
                got = {k.removesuffix(".lora_A"): over[f"{k.removesuffix('.lora_A')}.lora_B"][i] @ over[k][i]
                       for k in over if k.endswith(".lora_A")}
            for module in want:
                assert rel(got[module], want[module]) < 1e-12, (method, i, module)


def test_a_bf16_base_gives_deltas_in_fp32():
    from tests.models import tiny_model

    model = tiny_model("llama", dtype=torch.bfloat16)
    base = lf.base_params(model)
    adapters = []
    for seed in (0, 1):
        adapter = lf.init_adapter(model, lf.AdapterSpec("dora", targets=["q_proj"], r=2), generator=torch.Generator().manual_seed(seed))
        adapters.append(adapter.with_params({k: v + 0.01 * torch.randn_like(v) for k, v in adapter.params.items()}))
    merged = lf.merge_adapters(adapters, [1.0, 1.0], method="linear", base=base)
    assert {v.dtype for v in merged.params.values()} == {torch.float32}
    fp32 = {k: v.float() for k, v in base.items()}
    for layer in merged.layers:
        key, module = layer.target.weight_key, layer.target.module
        want = sum(lf.merge_overlay(fp32, x)[key] - fp32[key] for x in adapters)
        got = merged.params[f"{module}.lora_B"] @ merged.params[f"{module}.lora_A"]
        assert rel(got, want) < 1e-6  # W_eff rounded to bf16 before the subtraction: ~1e-2 off


def test_the_building_blocks_compose_into_ties(setup):
    """A new method is a few lines of the public blocks: TIES written by hand on the measured
    deltas equals merge_adapters(method='ties'); DARE's drop keeps exactly where noise < density."""
    from lora_func.merging import disjoint_mean, drop, elect_sign, trim

    deltas = [lf_deltas(setup, a) for a in setup.adapters]
    merged = lf_deltas(setup, lf.merge_adapters(setup.adapters, WEIGHTS, method="ties", density=0.4, base=setup.base))
    w = torch.tensor(WEIGHTS, dtype=torch.float64)[:, None, None]
    for module in merged:
        stacked = torch.stack([d[module] for d in deltas])
        trimmed = torch.stack([t * trim(t, 0.4) for t in stacked])
        assert int(trim(stacked[0], 0.4).sum()) == int(0.4 * stacked[0].numel())
        assert rel(disjoint_mean(w * trimmed, elect_sign(trimmed)), merged[module]) < 1e-12
    noise = torch.rand(stacked[0].shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    dropped = drop(stacked[0], 0.25, noise)
    assert torch.equal(dropped != 0, (noise < 0.25) & (stacked[0] != 0))
    torch.testing.assert_close(dropped[noise < 0.25], stacked[0][noise < 0.25] * 4, rtol=1e-15, atol=0)
