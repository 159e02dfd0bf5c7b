"""DP-SGD gradients (lora_func.privacy): clipping, noise, accumulation, the two training idioms.

The oracle is an explicit Python loop: each example's gradient by ``torch.func.grad`` on a
batch of one, its total norm over every adapter tensor, the clip factor, the mean. The clip
bound sits between the examples' norms, so some are clipped and some are not (checked), and
the adapters are perturbed so that every tensor has a gradient (LoRA's B starts at zero).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import lora_func as lf
from lora_func.privacy import (
    ClippedSum,
    clipped_sum,
    noised_mean,
    private_grads,
    set_grads_,
)
from lora_func.train import causal_lm_loss
from tests.models import tiny_model, tokens

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

B = 6


def _lm_loss(model, adapter, ids):
    return causal_lm_loss(lf.adapted_call(model, adapter, ids).logits, ids)


def _perturbed(adapter, seed=3, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return adapter.with_params({k: (v + scale * torch.randn(v.shape, generator=g)).detach().requires_grad_(True)
                                for k, v in adapter.params.items()})


def _adapter(model, variant, targets, seed=0, **kwargs):
    spec = lf.AdapterSpec(variant, targets=targets, r=2, **kwargs)
    return _perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed)))


def _loop(loss_fn, adapter, ids, max_grad_norm, *, lead=()):
    """Per-example gradients one by one, clipped (one norm over all tensors; per member for a
    stack) and averaged; also the norms."""
    params = {k: v.detach() for k, v in adapter.params.items()}
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    norms = []
    for b in range(ids.shape[0]):
        g = torch.func.grad(lambda p, b=b: loss_fn(adapter.with_params(p), ids[b : b + 1]))(params)
        norm = torch.stack([v.flatten(len(lead)).pow(2).sum(-1) for v in g.values()]).sum(0).sqrt()  # lead == stack shape
        factor = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for k in total:
            total[k] += g[k] * factor.reshape(*lead, *([1] * (g[k].dim() - len(lead))))
        norms.append(norm)
    return {k: v / ids.shape[0] for k, v in total.items()}, torch.stack(norms)


def _between(norms):
    """A clip bound halfway between the two middle norms: half the examples are clipped, and
    no norm sits on the bound."""
    middle = norms.flatten().sort().values[norms.numel() // 2 - 1 : norms.numel() // 2 + 1]
    return float(middle.mean())


def _assert_rel(got, want, rtol, idle=frozenset()):
    """``idle``: short names that act in training steps only (Row.training_only): zero on both sides."""
    assert got.keys() == want.keys()
    for k in want:
        scale = want[k].norm()
        if k.rsplit(".", 1)[-1] in idle:
            assert not want[k].any() and not got[k].any(), k
            continue
        assert scale > 0, k
        err = (got[k] - want[k]).norm() / scale
        assert err < rtol, f"{k}: relative error {err:.2e}"


def _assert_equals_the_clipped_loop(loss_fn, adapter, ids, *, lead=(), idle=frozenset()):
    """private_grads without noise against the loop, at a bound that clips some examples."""
    _, norms = _loop(loss_fn, adapter, ids, 1.0, lead=lead)
    c = _between(norms)
    want, _ = _loop(loss_fn, adapter, ids, c, lead=lead)
    got = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.0)
    _assert_rel(got, want, 1e-5, idle)
    return got, c


def _quantized_llama():
    from tests.quantized_models import quantized_llama

    model = quantized_llama("bnb-nf4")
    model.set_attn_implementation("eager")  # vmap of the model: from_pretrained chose SDPA
    return model


CASES = {
    "lora-llama": (lambda: tiny_model("llama"), "lora", ["q_proj", "v_proj"]),
    "dora-gpt2-conv1d": (lambda: tiny_model("gpt2"), "dora", ["c_attn"]),
    "lora-llama-nf4": (_quantized_llama, "lora", ["q_proj", "v_proj"]),
    "dora-llama-nf4": (_quantized_llama, "dora", ["q_proj", "v_proj"]),
}


@functools.cache
def _case(name):
    make, variant, targets = CASES[name]
    model = make()
    adapter = _adapter(model, variant, targets)
    ids = tokens(B, 8, seed=2)
    loss_fn = functools.partial(_lm_loss, model)
    _, norms = _loop(loss_fn, adapter, ids, 1.0)
    max_grad_norm = _between(norms)
    want, _ = _loop(loss_fn, adapter, ids, max_grad_norm)
    return model, adapter, ids, loss_fn, max_grad_norm, want, norms


@pytest.mark.parametrize("name", sorted(CASES))
def test_without_noise_equals_a_loop_of_clipped_per_example_grads(name):
    model, adapter, ids, loss_fn, max_grad_norm, want, norms = _case(name)
    if "nf4" in name:
        assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Params4bit"
    got = private_grads(loss_fn, adapter, ids, max_grad_norm=max_grad_norm, noise_multiplier=0.0)
    assert 0 < int((norms > max_grad_norm).sum()) < B  # the bound clips some examples, not all
    _assert_rel(got, want, 1e-5)
    unclipped, _ = _loop(loss_fn, adapter, ids, 1e9)
    assert all((got[k] - unclipped[k]).norm() > 1e-3 * unclipped[k].norm() for k in got)  # clipping did something
    total = clipped_sum(loss_fn, adapter, ids, max_grad_norm=max_grad_norm)
    assert total.count == B and total.clipped == int((norms > max_grad_norm).sum())


def test_compositions_clip_over_all_parts():
    model = tiny_model("llama")
    both = lf.compose(_adapter(model, "lora", ["q_proj", "v_proj"]), _adapter(model, "ia3", ["v_proj", "k_proj"], seed=1))
    _assert_equals_the_clipped_loop(functools.partial(_lm_loss, model), both, tokens(4, 8, seed=2))


def test_a_stack_is_one_private_mechanism_per_member():
    model = tiny_model("llama")
    members = [_adapter(model, "lora", ["q_proj", "v_proj"], seed=s) for s in (0, 1)]
    stacked = _perturbed(lf.stack(members), seed=5)

    def ensemble_loss(adapters, ids):  # the members' losses summed: each member's gradient is its own
        logits = lf.ensemble_call(model, adapters, ids, use_cache=False).logits
        return sum(causal_lm_loss(logits[k], ids) for k in range(logits.shape[0]))

    ids = tokens(4, 8, seed=2)
    got, c = _assert_equals_the_clipped_loop(ensemble_loss, stacked, ids, lead=(2,))
    # Independent noise per member: the two members' draws differ.
    noisy = private_grads(ensemble_loss, stacked, ids, max_grad_norm=c, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    key = next(iter(noisy))
    deviation = noisy[key] - got[key]
    assert not torch.allclose(deviation[0], deviation[1])


def test_noise_has_std_sigma_c_over_b_and_the_generator_reproduces_it():
    _, adapter, ids, loss_fn, c, clean, _ = _case("lora-llama")
    sigma = 0.7
    total = clipped_sum(loss_fn, adapter, ids, max_grad_norm=c)
    deviations = []
    for seed in range(32):
        noisy = noised_mean(total, noise_multiplier=sigma, generator=torch.Generator().manual_seed(seed))
        deviations.append(torch.cat([(noisy[k] - clean[k]).flatten() for k in clean]))
    deviations = torch.stack(deviations).double()
    assert deviations.numel() > 10_000
    expected = sigma * c / B
    assert abs(float(deviations.std()) / expected - 1) < 0.05
    assert abs(float(deviations.mean())) < 0.05 * expected
    # private_grads draws the same noise from the same generator state, and another seed differs.
    again = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=sigma, generator=torch.Generator().manual_seed(0))
    _assert_rel(again, noised_mean(total, noise_multiplier=sigma, generator=torch.Generator().manual_seed(0)), 1e-6)
    other = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=sigma, generator=torch.Generator().manual_seed(1))
    assert all(not torch.allclose(other[k], again[k]) for k in again)


def test_expected_batch_size_divides_and_an_empty_batch_is_a_noise_only_step():
    _, adapter, ids, loss_fn, c, clean, _ = _case("lora-llama")
    got = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.0, expected_batch_size=12.0)
    _assert_rel(got, {k: v * B / 12 for k, v in clean.items()}, 1e-5)
    empty = ids[:0]
    noise_only = private_grads(loss_fn, adapter, empty, max_grad_norm=c, noise_multiplier=0.5, expected_batch_size=4.0,
                               generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    for k, v in adapter.params.items():
        torch.testing.assert_close(noise_only[k], torch.randn(v.shape, generator=g) * 0.5 * c / 4.0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        private_grads(loss_fn, adapter, empty, max_grad_norm=c, noise_multiplier=0.5)


def test_accumulation_over_micro_batches_equals_one_logical_batch_with_the_same_noise():
    _, adapter, ids, loss_fn, c, _, _ = _case("lora-llama")
    whole = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.8, generator=torch.Generator().manual_seed(4))
    parts = [clipped_sum(loss_fn, adapter, ids[i : i + 2], max_grad_norm=c) for i in range(0, B, 2)]
    total = parts[0] + parts[1] + parts[2]
    assert total.count == B
    accumulated = noised_mean(total, noise_multiplier=0.8, generator=torch.Generator().manual_seed(4))
    _assert_rel(accumulated, whole, 1e-6)
    # Noising each micro-batch instead (three draws) is not the same mechanism: it differs.
    per_micro = [noised_mean(p, noise_multiplier=0.8, generator=torch.Generator().manual_seed(4)) for p in parts]
    wrong = {k: sum(m[k] * 2 for m in per_micro) / B for k in whole}
    assert any((wrong[k] - whole[k]).norm() > 0.1 * whole[k].norm() for k in whole)
    with pytest.raises(ValueError, match="max_grad_norm"):
        parts[0] + clipped_sum(loss_fn, adapter, ids[:2], max_grad_norm=2 * c)


def test_the_stateful_idiom_sets_grad_and_the_optimizer_step_equals_the_functional_update():
    model, adapter, ids, loss_fn, c, _, _ = _case("lora-llama")
    grads = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.5, generator=torch.Generator().manual_seed(0))
    live = adapter.detach()
    optimizer = torch.optim.SGD(live.params.values(), lr=0.1)
    set_grads_(live, grads)
    optimizer.step()
    for k, v in adapter.params.items():
        torch.testing.assert_close(live.params[k].detach(), v.detach().add(grads[k], alpha=-0.1), rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(KeyError, match="missing"):
        set_grads_(live, dict(list(grads.items())[1:]))


def _flat(grads):
    return torch.cat([v.flatten() for v in grads.values()])


def test_bf16_autocast_stays_within_bf16_error_of_the_fp32_result():
    # bf16 rounding alone moves a per-example loop by 2-6 % per tensor here, so the check is on
    # the whole gradient: closer to the fp32 clipped mean than the unclipped mean is.
    _, adapter, ids, loss_fn, c, fp32, _ = _case("lora-llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.0)
    assert all(v.dtype == torch.float32 for v in got.values())  # fp32 adapter, fp32 gradients
    unclipped, _ = _loop(loss_fn, adapter, ids, 1e9)
    error = float((_flat(got) - _flat(fp32)).norm() / _flat(fp32).norm())
    assert 1e-3 < error < 5e-2  # autocast acted, within bf16 error
    assert float((_flat(unclipped) - _flat(fp32)).norm() / _flat(fp32).norm()) > 4 * error


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_grad_norm": 0.0}, "max_grad_norm must be a real number in"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm"),
        ({"max_grad_norm": torch.tensor(1.0)}, "max_grad_norm"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be a real number in"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"expected_batch_size": 0}, "expected_batch_size"),
        ({"generator": 0}, "generator must be a torch.Generator"),
    ],
)
def test_bad_arguments_are_named_before_any_work(kwargs, match):
    calls = []
    adapter = _adapter(tiny_model("llama"), "lora", ["q_proj"])
    arguments = {"max_grad_norm": 1.0, "noise_multiplier": 1.0} | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        private_grads(lambda a, x: calls.append(1), adapter, torch.zeros(2, 3), **arguments)
    assert not calls


def test_noised_mean_refuses_anything_but_a_clipped_sum():
    with pytest.raises(TypeError, match="ClippedSum"):
        noised_mean({"a": torch.zeros(2)}, noise_multiplier=1.0)
    assert isinstance(ClippedSum({"a": torch.zeros(1)}, 1, 1.0) + ClippedSum({"a": torch.ones(1)}, 2, 1.0), ClippedSum)


# ------------------------------------------------------------------------- the stateful step


def test_private_step_over_micro_batches_equals_sgd_on_private_grads_of_the_logical_batch():
    from lora_func.privacy import DPSGD, private_step_

    _, adapter, ids, loss_fn, c, _, norms = _case("lora-llama")
    whole = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.8, generator=torch.Generator().manual_seed(4))
    live = adapter.detach()
    optimizer = torch.optim.SGD(live.params.values(), lr=0.5)
    dp = DPSGD(max_grad_norm=c, noise_multiplier=0.8, generator=torch.Generator().manual_seed(4))
    stats = private_step_(optimizer, live, loss_fn, [ids[:2], (ids[2:5],), (ids[5:],)], dp)
    moved = {k: live.params[k].detach() - v.detach() for k, v in adapter.params.items()}
    _assert_rel(moved, {k: -0.5 * g for k, g in whole.items()}, 1e-5)
    assert all(p.grad is None for p in live.params.values())  # cleared after the step
    losses = torch.stack([loss_fn(adapter, ids[b : b + 1]) for b in range(B)]).detach()
    assert stats.count == B and stats.clipped == int((norms > c).sum())
    assert math.isclose(stats.loss, float(losses.mean()), rel_tol=1e-5)


def test_private_step_under_bf16_autocast_is_private_grads_under_autocast():
    from lora_func.privacy import DPSGD, private_step_

    model, adapter, ids, loss_fn, c, _, _ = _case("lora-llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.5, expected_batch_size=6.0,
                             generator=torch.Generator().manual_seed(0))
    fp32 = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.5, expected_batch_size=6.0,
                         generator=torch.Generator().manual_seed(0))
    live = adapter.detach()
    optimizer = torch.optim.SGD(live.params.values(), lr=1.0)
    dp = DPSGD(max_grad_norm=c, noise_multiplier=0.5, expected_batch_size=6.0, generator=torch.Generator().manual_seed(0))
    stats = private_step_(optimizer, live, loss_fn, [ids], dp, autocast_dtype=torch.bfloat16)
    moved = {k: v.detach() - live.params[k].detach() for k, v in adapter.params.items()}
    _assert_rel(moved, want, 1e-5)
    assert (_flat(moved) - _flat(fp32)).norm() > 1e-3 * _flat(fp32).norm()  # the forward did run in bf16
    assert stats.count == B and math.isfinite(stats.loss)
    assert all(v.dtype == torch.float32 for v in live.params.values())
    assert all(p.grad is None for p in model.parameters())
    # An empty Poisson draw is a noise-only step: the adapter still moves, the loss is nan.
    adamw = torch.optim.AdamW(live.params.values(), lr=1e-2)
    before = {k: v.detach().clone() for k, v in live.params.items()}
    stats = private_step_(adamw, live, loss_fn, [ids[:0]], dp)
    assert stats.count == 0 and math.isnan(stats.loss)
    assert all(not torch.equal(v.detach(), before[k]) for k, v in live.params.items())


def test_private_step_refuses_a_foreign_optimizer_and_a_nan_before_moving():
    from lora_func.privacy import DPSGD, private_step_

    _, adapter, ids, loss_fn, c, _, _ = _case("lora-llama")
    dp = DPSGD(max_grad_norm=c, noise_multiplier=0.5)
    live = adapter.detach()
    with pytest.raises(ValueError, match="must own every adapter tensor"):
        private_step_(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), live, loss_fn, [ids], dp)
    key = next(iter(live.params))
    with torch.no_grad():
        live.params[key][0, 0] = math.nan
    optimizer = torch.optim.SGD(live.params.values(), lr=0.1)
    snapshot = {k: v.detach().clone() for k, v in live.params.items()}
    with pytest.raises(FloatingPointError, match="private gradients"):
        private_step_(optimizer, live, loss_fn, [ids], dp)
    torch.testing.assert_close(dict(live.params), snapshot, rtol=0, atol=0, equal_nan=True)  # nothing moved
    with pytest.raises(ValueError, match="max_grad_norm"):
        DPSGD(max_grad_norm=-1.0, noise_multiplier=1.0)


# --------------------------------------------------------------------------- every variant


def _first_row_per_variant():
    from tests.variant_table import ROWS

    rows = {}
    for row in ROWS.values():
        rows.setdefault(row.variant, row)
    return rows


@pytest.mark.parametrize("variant", sorted(_first_row_per_variant()))
def test_every_variant_without_noise_equals_the_loop(variant):
    from tests.contract_helpers import build, perturbed

    assert set(_first_row_per_variant()) == set(lf.list_variants())  # a new variant gets a row here
    row = _first_row_per_variant()[variant]
    kind = "conv1d" if variant in ("hra", "delora") else "linear"  # the two peft refuses on Conv1D: ours are checked
    model, adapter = build(row, kind)
    adapter = perturbed(adapter, max(row.perturb_scale, 0.1))
    _assert_equals_the_clipped_loop(functools.partial(_lm_loss, model), adapter, tokens(3, 8, seed=2), idle=row.training_only)


def test_a_train_state_and_a_dict_batch_work_as_lora_func_train_would_call_it():
    """What lora_func.train's private mode does: adapter_loss on a batch dict, TrainState's optimiser."""
    from lora_func.privacy import DPSGD, private_step_
    from lora_func.train import TrainState, adapter_loss, make_optimizer

    model, adapter, ids, _, c, _, _ = _case("lora-llama")
    live = adapter.detach()
    state = TrainState(live, make_optimizer(live, 1e-2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def loss_fn(a, b):
        return adapter_loss(model, a, b)

    dp = DPSGD(max_grad_norm=c, noise_multiplier=0.0)
    want = private_grads(loss_fn, state.adapter, batch, max_grad_norm=c, noise_multiplier=0.0)
    oracle, _ = _loop(lambda a, i: adapter_loss(model, a, {k: v[int(i)][None] for k, v in batch.items()}), state.adapter, torch.arange(B)[:, None], c)
    _assert_rel(want, oracle, 1e-5)  # each row of the dict is one example, its own mask
    stats = private_step_(state.optimizer, state.adapter, loss_fn, [batch], dp)
    assert stats.count == B and all(p.grad is None for p in model.parameters())
