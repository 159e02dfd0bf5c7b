"""Tensors shared across layers (``Variant.shared_init``): one leaf each, saved once, stacked
once, gradients summed over the layers that read them, through every path.

The variant is Tied-LoRA (tests/shared_variants.py: one trainable ``A`` for every layer, a ``B``
per layer). The oracle for its gradient is an untied twin: the same adapter built as separate
tensors per layer (each layer its own copy of ``A``, computed here by hand in float64); the tied
gradient must be the sum of the copies' gradients. The contract suite (tests/test_contract.py)
runs over it too, with one ``Row``."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.func import functional_call

import lora_func as lf
from lora_func.adapter import SHARED
from tests import test_contract, test_rank_stack
from tests.models import tiny_model, tokens
from tests.shared_variants import NAME, registered_tied, tied_w_eff  # noqa: F401  (a fixture)
from tests.variant_table import ROWS, Row

ROW = Row(variant=NAME, w_eff=tied_w_eff, step0_nonzero=frozenset({"tied_B"}), spec_kwargs={"r": 4, "alpha": 6.0})
CHECKS = {
    name: check
    for name, check in vars(test_contract).items()
    if name.startswith("test_") and {"row", "kind"} <= set(inspect.signature(check).parameters)
}


@pytest.fixture
def row(registered_tied, monkeypatch):  # noqa: F811
    monkeypatch.setitem(ROWS, NAME, ROW)
    return ROW


def _adapter(kind: str = "llama", seed: int = 0):
    model = tiny_model(kind)
    targets = ["q_proj", "v_proj", "down_proj"] if kind == "llama" else ["c_attn", "c_fc"]
    adapter = lf.init_adapter(model, lf.AdapterSpec(NAME, targets=targets, r=3, alpha=5.0), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 7)
    return model, adapter.with_params({k: (v + 0.3 * torch.randn(v.shape, generator=g)).detach().requires_grad_(True) for k, v in adapter.params.items()})


def test_the_shared_tensor_is_one_leaf_and_counted_once(row):
    _, adapter = _adapter()
    shared = [k for k in adapter.params if k.startswith(SHARED)]
    assert shared == [f"{SHARED}.tied_A"] and adapter.params[shared[0]].shape == (3, 48)
    per_layer = sum(int(t.numel()) for k, t in adapter.params.items() if not k.startswith(SHARED))
    assert adapter.num_parameters() == per_layer + 3 * 48
    assert len(torch.utils._pytree.tree_leaves(adapter)) == len(adapter.params) + len(adapter.buffers)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_gradient_of_a_shared_tensor_is_the_sum_over_the_layers(row, kind):
    """Against an independent float64 oracle: each layer's W_eff written by hand with its own
    copy of A; the tied gradient equals the sum of the copies' gradients, per tensor."""
    model, adapter = _adapter(kind)
    base, ids = lf.base_params(model), tokens(2, 9, seed=3)
    probe = torch.randn(2, 9, 61, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss(params, merged):
        over = (lf.merge_overlay if merged else lf.overlay)(base, adapter.with_params(params))
        return (functional_call(model, over, (ids,)).logits.double() * probe).sum()

    model64 = tiny_model(kind, dtype=torch.float64)
    base64 = lf.base_params(model64)
    a_key = f"{SHARED}.tied_A"
    copies = {layer.target.module: adapter.params[a_key].detach().double().clone().requires_grad_(True) for layer in adapter.layers}
    bs = {layer.target.module: adapter.params[f"{layer.target.module}.tied_B"].detach().double() for layer in adapter.layers}
    over = dict(base64)
    for layer in adapter.layers:
        t = layer.target
        w = base64[t.weight_key] if t.layout == "linear" else base64[t.weight_key].T
        w_eff = w + (5.0 / 3) * bs[t.module] @ copies[t.module][:, : w.shape[1]]
        over[t.weight_key] = w_eff if t.layout == "linear" else w_eff.T
    oracle = (functional_call(model64, over, (ids,)).logits * probe).sum()
    oracle.backward()
    summed = sum(c.grad for c in copies.values())
    assert all(c.grad.abs().max() > 0 for c in copies.values())  # every layer reads A
    for merged in (False, True):
        grads = torch.func.grad(lambda p: loss(p, merged))(adapter.params)  # noqa: B023
        torch.testing.assert_close(grads[a_key].double(), summed, rtol=1e-4, atol=1e-5 * float(summed.abs().max()))
    # the module-call route too
    grads = torch.func.grad(lambda p: (lf.adapted_call(model, adapter.with_params(p), ids, route="module").logits.double() * probe).sum())(adapter.params)
    torch.testing.assert_close(grads[a_key].double(), summed, rtol=1e-4, atol=1e-5 * float(summed.abs().max()))


def test_save_load_stack_vmap_and_per_example_grads(row, tmp_path):
    model, adapter = _adapter()
    ids = tokens(3, 8, seed=5)
    lf.save(adapter, tmp_path / "a.safetensors")
    back = lf.load(tmp_path / "a.safetensors")
    assert back.shared == adapter.shared and sorted(back.params) == sorted(adapter.params)
    assert all(torch.equal(back.params[k], adapter.params[k]) for k in adapter.params)
    # trainable_only: the shared tensor is a param, saved once; it comes back exactly
    lf.save(adapter, tmp_path / "t.safetensors", trainable_only=True)
    assert torch.equal(lf.load(tmp_path / "t.safetensors").params[f"{SHARED}.tied_A"], adapter.params[f"{SHARED}.tied_A"])
    _, other = _adapter(seed=1)
    stacked = lf.stack([adapter, other])
    assert stacked.params[f"{SHARED}.tied_A"].shape == (2, 3, 48)  # stacked once, each member its own
    out = torch.func.vmap(lambda a: lf.adapted_call(model, a, ids).logits)(stacked)
    for k, member in enumerate((adapter, other)):
        torch.testing.assert_close(out[k], lf.adapted_call(model, member, ids).logits, rtol=1e-5, atol=1e-5)
        back = lf.unstack(stacked)[k]
        assert all(torch.equal(back.params[key], member.params[key]) for key in member.params)
    lf.save(stacked, tmp_path / "s.safetensors")
    assert torch.equal(lf.load(tmp_path / "s.safetensors").params[f"{SHARED}.tied_A"], stacked.params[f"{SHARED}.tied_A"])

    def example_loss(a, x):
        return lf.adapted_call(model, a, x).logits.square().mean()

    per_example = lf.per_example_grads(example_loss, adapter, ids)
    for i in range(3):
        alone = torch.func.grad(lambda p: example_loss(adapter.with_params(p), ids[i : i + 1]))(adapter.params)  # noqa: B023
        torch.testing.assert_close(per_example[f"{SHARED}.tied_A"][i], alone[f"{SHARED}.tied_A"], rtol=1e-4, atol=1e-6)


def test_compose_and_combine_keep_each_parts_shared_tensor(row):
    model, a = _adapter()
    _, b = _adapter(seed=1)
    ids = tokens(2, 8, seed=6)
    composed, combined = lf.compose(a, b), lf.combine([a, b], [0.7, -0.4])
    assert {f"0/{SHARED}.tied_A", f"1/{SHARED}.tied_A"} <= set(composed.params)
    base = lf.base_params(model)
    for node in (composed, combined):
        torch.testing.assert_close(
            functional_call(model, lf.overlay(base, node), (ids,)).logits,
            functional_call(model, lf.merge_overlay(base, node), (ids,)).logits,
            rtol=1e-5,
            atol=1e-5,
        )
    # combine is W + Σ w_k ΔW_k: the lazy logits differ from each part's alone
    alone = functional_call(model, lf.merge_overlay(base, a), (ids,)).logits
    assert not torch.allclose(functional_call(model, lf.merge_overlay(base, combined), (ids,)).logits, alone)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_a_rank_padded_stack_pads_the_shared_tensor_and_equals_each_member(row, kind, tmp_path):
    """Members of ranks 1, 2, 4 (alphas 2, 3, 4): the shared A is padded along its rank axis
    like the layers' tensors; outputs, gradients (the padding's exactly zero) and unstack equal
    each member alone, and the stack saves and loads."""
    test_rank_stack.test_rank_padded_stack_equals_each_alone(NAME, kind)
    _, members = test_rank_stack._members(NAME, kind)
    stacked = lf.stack(members)
    assert stacked.params[f"{SHARED}.tied_A"].shape[:2] == (3, 4) and stacked.member_shared == tuple(m.shared for m in members)
    lf.save(stacked, tmp_path / "s.safetensors")
    back = lf.load(tmp_path / "s.safetensors")
    assert back.member_shared == stacked.member_shared
    for again, member in zip(lf.unstack(back), members, strict=True):
        assert again.shared == member.shared
        assert all(torch.equal(again.params[k], member.params[k]) for k in member.params)
    taken = lf.take(stacked, torch.tensor([2, 0]))
    assert taken.member_shared == (members[2].shared, members[0].shared)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_contract_suite_passes_over_a_variant_with_a_shared_tensor(check, kind, row, tmp_path):
    function = CHECKS[check]
    extra = {"tmp_path": tmp_path} if "tmp_path" in inspect.signature(function).parameters else {}
    dtypes = [torch.bfloat16, torch.float16] if "dtype" in inspect.signature(function).parameters else [None]
    for dtype in dtypes:
        function(row=row, kind=kind, **extra, **({} if dtype is None else {"dtype": dtype}))


def test_a_trainable_only_file_rebuilds_a_frozen_shared_tensor_from_its_init(registered_tied, monkeypatch, tmp_path):  # noqa: F811
    """A frozen shared tensor is not stored with trainable_only=True: load re-runs shared_init
    (as peft re-creates VeRA's projections from their seed) and checks it against the digest."""
    from lora_func import variants
    from tests.shared_variants import FROZEN

    monkeypatch.setitem(variants._discover(), FROZEN.name, FROZEN)
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec(FROZEN.name, targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0))
    lf.save(adapter, tmp_path / "t.safetensors", trainable_only=True)
    with pytest.raises(ValueError, match="pass model="):
        lf.load(tmp_path / "t.safetensors")
    back = lf.load(tmp_path / "t.safetensors", model=model)
    assert torch.equal(back.buffers[f"{SHARED}.tied_A"], adapter.buffers[f"{SHARED}.tied_A"])
    drawn_elsewhere = lf.init_adapter(model, adapter.spec, generator=torch.Generator().manual_seed(1))
    lf.save(drawn_elsewhere, tmp_path / "d.safetensors", trainable_only=True)
    with pytest.raises(ValueError, match="the shared buffers"):
        lf.load(tmp_path / "d.safetensors", model=model)


def test_mixed_rows_and_activation_checkpointing_read_the_shared_tensor(row):
    """One adapter per row (both mixed routes) equals each row alone; under non-reentrant
    activation checkpointing (module route) the shared tensor's gradient equals the one without."""
    model, a = _adapter()
    _, b = _adapter(seed=1)
    ids, index = tokens(3, 8, seed=2), torch.tensor([1, 0, 1])
    for call in (lf.mixed_call, lf.mixed_call):
        out = call(model, lf.stack([a, b]), index, ids, use_cache=False).logits
        for i in range(3):
            alone = lf.adapted_call(model, (a, b)[int(index[i])], ids[i : i + 1]).logits[0]
            torch.testing.assert_close(out[i], alone, rtol=1e-5, atol=1e-5 * float(alone.detach().abs().max()))
    grads = []
    for checkpointing in (True, False):
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
        model.train()
        trained = a.detach()
        lf.adapted_call(model, trained, ids, route="module", use_cache=False).logits.square().mean().backward()
        grads.append(trained.params[f"{SHARED}.tied_A"].grad)
    assert grads[1].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6 * float(grads[1].abs().max()))
