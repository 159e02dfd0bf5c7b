"""Rank-padded stacks of the shared-basis variants whose structure depends on r: RandLoRA (⌈d/r⌉
bases, and U_A's rows paired with U_B's columns by a flat index that depends on r) and PVeRA (λ_d
and pvera_A split in halves at r). tests/test_rank_stack.py runs them with every ranked variant
(outputs, per-tensor gradients and SGD steps under vmap equal to each member alone, in eval mode);
here the parts it cannot reach: PVeRA's log σ² half, which acts only in a sampled forward (the
noise fixed to 1, so that a stacked member and the member alone draw the same), and the members'
own bases (each r draws its own basis from the seed)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import lora_func as lf
from lora_func.adapter import SHARED
from tests.models import tiny_model, tokens

F64 = torch.float64


def _members(model, variant, ranks, **options):
    members = []
    for i, r in enumerate(ranks):
        adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=["q_proj", "down_proj"], r=r, dtype=F64, **options), generator=torch.Generator().manual_seed(i))
        g = torch.Generator().manual_seed(10 + i)
        members.append(adapter.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=F64) for k, v in adapter.params.items()}))
    return members


def _loss(model, base, ids):
    def loss(params, adapter):
        out = functional_call(model, lf.overlay(base, adapter.with_params(params)), (ids,)).logits
        return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))

    return loss


def _assert_stack_equals_each_alone(model, members):
    base, ids = lf.base_params(model), tokens(2, 8, seed=4)
    loss = _loss(model, base, ids)
    stacked = lf.stack(members)
    assert stacked.members is not None  # rank-padded
    grads, values = torch.func.vmap(lambda a: torch.func.grad_and_value(loss)(a.params, a))(stacked)
    for k, (member, back) in enumerate(zip(members, lf.unstack(stacked.with_params(grads)), strict=True)):
        g_alone, v_alone = torch.func.grad_and_value(loss)(member.params, member)
        assert abs(values[k] - v_alone) <= 1e-12 * abs(v_alone), k
        for key, want in g_alone.items():
            assert want.abs().max() > 0 and (back.params[key] - want).abs().max() <= 1e-10 * want.abs().max(), (k, key)


def test_pvera_stack_keeps_each_member_s_log_variance_half(monkeypatch):
    model = tiny_model("llama", dtype=F64)
    members = _members(model, "pvera", (2, 4, 3), init="random", sample_at_inference=True)
    monkeypatch.setattr(torch, "randn_like", torch.ones_like)  # ε = 1: z = μ + exp(log σ² / 2)
    _assert_stack_equals_each_alone(model, members)


@pytest.mark.parametrize("options", [{}, {"sparse": True}], ids=["kaiming", "sparse"])
def test_randlora_stack_keeps_each_member_s_bases_and_pairing(options):
    model = tiny_model("llama", dtype=F64)
    members = _members(model, "randlora", (3, 8, 5), init="random", **options)  # 32/3: 11 bases, the last one partly used
    bases = [m.buffers[f"{SHARED}.randlora_B"] for m in members]
    assert [tuple(b.shape) for b in bases] == [(48, 11, 3), (48, 4, 8), (48, 7, 5)]  # each r its own draw
    _assert_stack_equals_each_alone(model, members)
