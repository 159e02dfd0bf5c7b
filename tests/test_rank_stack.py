"""Rank sweeps: stack() of adapters of different ranks (zero-padded, rank mask, own scale) under
vmap equals each adapter alone: outputs, gradients and SGD steps, for every variant with a rank."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import lora_func as lf
from lora_func.variants._contract import RANK_ALPHA, RANK_MASK
from tests.contract_helpers import build, perturbed
from tests.models import tokens
from tests.variant_table import ROWS

# HRA's paired init needs an even r; antipasto's r=6 row default stays below the weight rank.
RANKS = {"hra": (2, 4, 6), "antipasto": (1, 3, 6), "eva": (2, 4), "lokr": (1, 2, 3), "gralora": (2, 4, 6)}  # lokr: r=4 makes the 32x32 W2 whole; gralora: r a multiple of gralora_k=2
RANKS["psoft"] = (2, 3, 4)  # r=1: an empty skew triangle (R is the magnitude vectors alone)
# Variants without rank axes (RandLoRA, PVeRA: their structure depends on r) refuse rank-padded
# stacks; their refusal is tested with them.
RANKED = sorted(v for v in ROWS if lf.get_variant(v).rank_axes)


def _members(variant: str, kind: str):
    row = ROWS[variant]
    members = []
    model = None
    for i, r in enumerate(RANKS.get(variant, (1, 2, 4))):
        # Each member keeps its own alpha too (alpha / r differs per member).
        overrides = {"r": r} if variant == "antipasto" else {"r": r, "alpha": 2.0 + i}
        model, adapter = build(row, kind, seed=0, **overrides)
        members.append(perturbed(adapter, row.perturb_scale, seed=11 + i))
    return model, members


def _loss(model, base, ids, merged):
    def loss(adapter):
        over = (lf.merge_overlay if merged else lf.overlay)(base, adapter)
        out = functional_call(model, over, (ids,)).logits
        return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))

    return loss


def _value_and_grad(loss):
    def f(adapter):
        return torch.func.grad_and_value(lambda p: loss(adapter.with_params(p)))(adapter.params)

    return f


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("variant", RANKED)
def test_rank_padded_stack_equals_each_alone(variant, kind):
    model, members = _members(variant, kind)
    base, ids = lf.base_params(model), tokens(2, 10, seed=4)
    stacked = lf.stack(members)
    assert stacked.members is not None
    ranks = RANKS.get(variant, (1, 2, 4))
    for layer in stacked.layers:
        mask = stacked.buffers[f"{layer.target.module}.{RANK_MASK}"]
        assert mask.shape[-1] == max(m.layers[0].info.r for m in members) or variant == "eva"
        assert mask.sum(-1).tolist() == [float(m.layers[stacked.layers.index(layer)].info.r) for m in members]
        alphas = stacked.buffers[f"{layer.target.module}.{RANK_ALPHA}"].tolist()
        assert alphas == [m.layers[stacked.layers.index(layer)].info.alpha for m in members]
    # unstack gives the originals back, bit for bit, with their own spec and layers.
    for back, member in zip(lf.unstack(stacked), members, strict=True):
        assert back.spec == member.spec and back.layers == member.layers and back.members is None
        for flat in ("params", "buffers"):
            got, want = getattr(back, flat), getattr(member, flat)
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[k], want[k]) for k in want)
    for merged in (False, True)[: 1 + lf.get_variant(variant).merges]:  # (no merged weight: the lazy path only)
        loss = _loss(model, base, ids, merged)
        grads, values = torch.func.vmap(_value_and_grad(loss))(stacked)
        for k, member in enumerate(members):
            g_alone, v_alone = _value_and_grad(loss)(member)
            torch.testing.assert_close(values[k], v_alone, atol=2e-6, rtol=2e-6)
            trimmed = lf.unstack(stacked.with_params(grads))[k]
            # Round-off is relative to the member's gradient scale, not to each tensor's own: a
            # scalar like DeLoRA's lambda gradient can be a sum that cancels to 1 % of its terms
            # (measured: the stacked value was the closer one to float64 there).
            scale = max(float(g.detach().abs().max()) for g in g_alone.values())
            for key, g in g_alone.items():
                torch.testing.assert_close(trimmed.params[key], g, atol=1e-5 * scale + 1e-8, rtol=1e-4)
            # Padded entries get exactly zero gradient, so they stay zero under any optimiser.
            for key, g in grads.items():
                padding = g[k].detach().clone()
                padding[tuple(slice(0, n) for n in trimmed.params[key].shape)] = 0
                assert torch.count_nonzero(padding) == 0, f"{key}: gradient in the padding of member {k}"
    assert len(ranks) == len(members)


@pytest.mark.parametrize("variant", ["lora", "hra", "antipasto", "delora"])
def test_rank_mask_hides_the_padding(variant):
    """Garbage in the padded entries must not reach the output (the mask is applied)."""
    model, members = _members(variant, "linear")
    base, ids = lf.base_params(model), tokens(2, 10, seed=4)
    stacked = lf.stack(members)
    g = torch.Generator().manual_seed(0)
    noisy = {}
    for key, value in stacked.params.items():
        noise = torch.randn(value.shape, generator=g)
        for k, member in enumerate(members):  # keep member k's own entries, poison the padding
            own = member.params[key]
            noise[k][tuple(slice(0, n) for n in own.shape)] = 0
        noisy[key] = value.detach() + noise
    assert any(not torch.equal(noisy[k], stacked.params[k]) for k in noisy)
    loss = _loss(model, base, ids, merged=False)
    clean = torch.func.vmap(loss)(stacked)
    dirty = torch.func.vmap(loss)(stacked.with_params(noisy))
    torch.testing.assert_close(dirty, clean, atol=1e-6, rtol=1e-6)


def test_rank_sweep_sgd_steps_match_training_each_alone():
    model, members = _members("lora", "linear")
    base, ids = lf.base_params(model), tokens(2, 10, seed=4)
    loss = _loss(model, base, ids, merged=False)
    stacked = lf.stack(members)
    step = torch.func.vmap(_value_and_grad(loss))
    for _ in range(3):
        grads, _ = step(stacked)
        stacked = stacked.with_params({k: v - 0.5 * grads[k] for k, v in stacked.params.items()})
    for k, member in enumerate(members):
        for _ in range(3):
            grads, _ = _value_and_grad(loss)(member)
            member = member.with_params({key: v - 0.5 * grads[key] for key, v in member.params.items()})
        back = lf.unstack(stacked)[k]
        for key in member.params:
            torch.testing.assert_close(back.params[key], member.params[key], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(member.params[key], members[k].params[key])


def test_take_keeps_members_of_a_rank_padded_stack():
    model, members = _members("lora", "linear")
    stacked = lf.stack(members)
    picked = lf.take(stacked, torch.tensor([2, 0, 2]))
    assert picked.stack_shape == (3,)
    back = lf.unstack(picked)
    assert [b.spec.r for b in back] == [members[2].spec.r, members[0].spec.r, members[2].spec.r]
    assert torch.equal(back[1].params[sorted(members[0].params)[0]], members[0].params[sorted(members[0].params)[0]])
