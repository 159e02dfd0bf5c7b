"""LoRA's optimiser methods (lora_func.optimizers) against peft 0.21's ``peft.optimizers``: ten
steps of LoRA+, LoRA-FA and the Riemannian preconditioner on a float64 tiny Llama (RMSNorm in the
input dtype on both sides) from the same perturbed adapter on the same batches give peft's tensors;
the pure transforms on a rank-padded stack equal each member stepped alone; the factor pairs come
from the variants' declarations (compositions, DoRA's magnitude, HRA)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.optimizers import create_lorafa_optimizer, create_loraplus_optimizer, create_riemannian_optimizer
from torch.func import grad

import lora_func as lf
from lora_func import optimizers as lo
from tests import peft_helpers
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

F64 = torch.float64
TARGETS = ["q_proj", "v_proj", "down_proj"]  # v_proj 32->16, down_proj 48->32: d_in != d_out
STEPS = 10
BATCHES = [tokens(2, 8, seed=s) for s in range(STEPS)]


def _rmsnorm_in_input_dtype(model: torch.nn.Module) -> None:
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.forward = types.MethodType(forward, m)


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", dtype=F64)
    _rmsnorm_in_input_dtype(m)
    return m


def _peft_and_adapter(model, *, variant="lora", r=4, alpha=6.0, **config):
    """A peft model (a copy of ``model``) with perturbed trainables, and a lora_func adapter
    holding the same values as fresh leaf tensors."""
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0, use_dora=variant == "dora", **config)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        pm = get_peft_model(copy.deepcopy(model), cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    names = ("lora_A", "lora_B", "lora_magnitude_vector")
    values = {peft_helpers.peft_key_to_lf(n, names): p.detach().clone().requires_grad_(True) for n, p in pm.named_parameters() if p.requires_grad}
    spec = lf.AdapterSpec(variant, targets=TARGETS, r=r, alpha=alpha, dtype=F64, use_rslora=config.get("use_rslora", False))
    adapter = lf.init_adapter(model, spec).with_params(values)
    return pm, adapter


def _train_peft(pm, optimizer):
    for ids in BATCHES:
        optimizer.zero_grad()
        ce_loss(pm(ids).logits, ids).backward()
        optimizer.step()
    names = ("lora_A", "lora_B", "lora_magnitude_vector")
    return {peft_helpers.peft_key_to_lf(n, names): p.detach() for n, p in pm.named_parameters() if "lora_" in n}


def _train_lf(model, adapter, optimizer):
    base = lf.base_params(model)
    for ids in BATCHES:
        optimizer.zero_grad()
        ce_loss(lf.adapted_call(model, adapter, ids, base=base).logits, ids).backward()
        optimizer.step()
    return {k: v.detach() for k, v in adapter.params.items()}


def _assert_same_steps(got, want, start, rel=1e-9, frozen=()):
    """Per tensor, relative to how far peft moved it (a lost step or a wrong group is off by a
    large part of the movement)."""
    assert sorted(got) == sorted(want)
    for k in want:
        moved = (want[k] - start[k]).abs().max().item()
        if k in frozen:
            assert moved == 0 and torch.equal(got[k], start[k]), k
            continue
        assert moved > 1e-3, f"{k} did not move"
        diff = (got[k] - want[k]).abs().max().item()
        assert diff <= rel * moved, f"{k}: {diff:.3g} vs movement {moved:.3g}"


def test_loraplus_equals_peft(model):
    pm, adapter = _peft_and_adapter(model)
    start = {k: v.detach().clone() for k, v in adapter.params.items()}
    kwargs = {"lr": 1e-2, "loraplus_lr_ratio": 8.0, "loraplus_weight_decay": 0.1}
    want = _train_peft(pm, create_loraplus_optimizer(pm, torch.optim.AdamW, **kwargs))
    optimizer = lo.loraplus_optimizer(adapter, torch.optim.AdamW, **kwargs)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2, 1e-6, 8e-2, 8e-2]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.1, 0.0]
    assert all(k.endswith("lora_B") for k in optimizer.param_groups[2]["names"]) and len(optimizer.param_groups[2]["names"]) == 6
    _assert_same_steps(_train_lf(model, adapter, optimizer), want, start)


def test_lorafa_equals_peft_with_rslora_scale(model):
    # float64 tensors: peft's bf16 autocast of the projection does not apply (fp64 is never autocast).
    pm, adapter = _peft_and_adapter(model, use_rslora=True)
    start = {k: v.detach().clone() for k, v in adapter.params.items()}
    want = _train_peft(pm, create_lorafa_optimizer(pm, r=4, lora_alpha=6.0, lr=1e-2, weight_decay=0.1))
    got = _train_lf(model, adapter, lo.lorafa_optimizer(adapter, lr=1e-2, weight_decay=0.1))
    _assert_same_steps(got, want, start, frozen={k for k in start if k.endswith("lora_A")})


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_riemannian_equals_peft_and_leaves_doras_magnitude_alone(model, optimizer_cls):
    pm, adapter = _peft_and_adapter(model, variant="dora")
    start = {k: v.detach().clone() for k, v in adapter.params.items()}
    kwargs = {"lr": 1e-2, "reg": 0.05, "weight_decay": 0.01}
    want = _train_peft(pm, create_riemannian_optimizer(pm, optimizer_cls, **kwargs))
    optimizer = lo.riemannian_optimizer(adapter, optimizer_cls, **kwargs)
    _assert_same_steps(_train_lf(model, adapter, optimizer), want, start)
    with pytest.raises(ValueError, match="closure"):
        optimizer.step(lambda: None)


def _stack_of_two_ranks(model):
    members = []
    for seed, r in ((0, 2), (1, 4)):
        a = lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=r, alpha=3.0 * r, dtype=F64), generator=torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(10 + seed)
        members.append(a.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=F64) for k, v in a.params.items()}))
    return members


@pytest.mark.parametrize("method", ["riemannian", "lorafa"])
def test_pure_transforms_on_a_rank_padded_stack_equal_each_member_alone(model, method):
    """Pure SGD steps with the transform on a stack of two adapters of ranks 2 and 4 with scales
    3 and 1.25 (a member given the other's rank or scale is off by O(1)), against each member
    stepped alone with the same transform."""
    members = _stack_of_two_ranks(model)
    members[1] = lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=4, alpha=5.0, dtype=F64)).with_params(members[1].params)
    base, lr = lf.base_params(model), 1e-2
    transform = {"riemannian": lambda a, g: lo.riemannian_precondition(a, g, reg=0.05), "lorafa": lo.lorafa_project}[method]

    def loss(adapter, ids):
        return ce_loss(lf.adapted_call(model, adapter, ids, base=base).logits, ids)

    def sgd(adapter, batches):
        for ids in batches:
            grads = grad(lambda p: loss(adapter.with_params(p), ids))(adapter.params)
            grads = transform(adapter, grads)
            adapter = adapter.with_params({k: v - lr * grads[k] for k, v in adapter.params.items()})
        return adapter

    stacked = lf.stack(members)
    batches = BATCHES[:3]
    for ids in batches:  # the stack: the loss summed over members, so each member's gradient is its own
        grads = grad(lambda p: sum(loss(m, ids) for m in lf.unstack(stacked.with_params(p))))(stacked.params)
        grads = transform(stacked, grads)
        stacked = stacked.with_params({k: v - lr * grads[k] for k, v in stacked.params.items()})
    for got, member in zip(lf.unstack(stacked), members, strict=True):
        want = sgd(member, batches)
        for k, v in want.params.items():
            moved = (v - member.params[k]).abs().max().item()
            if method == "lorafa" and k.endswith("lora_A"):
                assert moved == 0
            else:
                assert moved > 1e-5, k
            assert (got.params[k] - v).abs().max().item() <= 1e-9 * max(moved, 1e-3), k


def test_torch_optimiser_uses_the_pure_transform(model):
    """riemannian_optimizer(SGD) steps as p - lr · riemannian_precondition(grads)."""
    _, adapter = _peft_and_adapter(model)
    pure = adapter.detach()
    base = lf.base_params(model)
    optimizer = lo.riemannian_optimizer(adapter, torch.optim.SGD, lr=0.1)
    for ids in BATCHES[:2]:
        optimizer.zero_grad()
        ce_loss(lf.adapted_call(model, adapter, ids, base=base).logits, ids).backward()
        optimizer.step()
        grads = grad(lambda p: ce_loss(lf.adapted_call(model, pure.with_params(p), ids, base=base).logits, ids))(pure.params)
        grads = lo.riemannian_precondition(pure, grads)
        pure = pure.with_params({k: v - 0.1 * grads[k] for k, v in pure.params.items()})
    for k, v in pure.params.items():
        torch.testing.assert_close(adapter.params[k].detach(), v, rtol=1e-12, atol=1e-12)


def test_loraplus_scale_is_sgd_with_per_group_learning_rates(model):
    _, adapter = _peft_and_adapter(model, variant="dora")
    start = adapter.detach()
    optimizer = lo.loraplus_optimizer(adapter, torch.optim.SGD, lr=0.1, loraplus_lr_ratio=4.0)
    base = lf.base_params(model)
    pure = start
    for ids in BATCHES[:2]:
        optimizer.zero_grad()
        ce_loss(lf.adapted_call(model, adapter, ids, base=base).logits, ids).backward()
        optimizer.step()
        grads = grad(lambda p: ce_loss(lf.adapted_call(model, pure.with_params(p), ids, base=base).logits, ids))(pure.params)
        updates = lo.loraplus_scale(pure, {k: -0.1 * g for k, g in grads.items()}, loraplus_lr_ratio=4.0)
        pure = pure.with_params({k: v + updates[k] for k, v in pure.params.items()})
    for k, v in pure.params.items():
        torch.testing.assert_close(adapter.params[k].detach(), v, rtol=1e-12, atol=1e-12)


def test_roles_and_pairs_come_from_the_declarations(model):
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    dora = lf.init_adapter(model, lf.AdapterSpec("dora", targets=["v_proj"], r=2))
    hra = lf.init_adapter(model, lf.AdapterSpec("hra", targets=["q_proj"], r=2))
    tree = lf.compose(lora, lf.combine([dora, hra], [0.5, 0.5]))
    pairs = lo.factor_pairs(tree)
    assert [(p.a.split(".")[-1], p.b.split(".")[-1]) for p in pairs] == [("lora_A", "lora_B")] * 4
    assert [p.a.split("/")[0] for p in pairs] == ["0", "0", "1", "1"] and pairs[2].a.startswith("1/0/")
    assert {p.scale for p in pairs} == {4.0}
    roles = lo.loraplus_roles(tree)
    assert sorted(roles) == sorted(tree.params)
    by_suffix = {k.rsplit(".", 1)[-1]: v for k, v in roles.items()}
    assert by_suffix == {"lora_A": "A", "lora_B": "B", "lora_magnitude_vector": "B", "hra_u": "A", "1/weights": "A"}
    with pytest.raises(ValueError, match="no \\(A, B\\) factor pair"):
        lo.lorafa_optimizer(hra, lr=1e-3)
    with pytest.raises(KeyError, match="does not have"):
        lo.riemannian_precondition(lora, {"x.lora_A": torch.zeros(1)})
    with pytest.raises(ValueError, match="loraplus_lr_ratio"):
        lo.loraplus_optimizer(lora, torch.optim.SGD, lr=1e-3, loraplus_lr_ratio=0)
