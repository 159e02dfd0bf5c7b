"""Ghost clipping with book-keeping (lora_func.privacy.ghost): the same clipped sums as the
explicit loop of per-example gradients, for every clipping= choice, and which tensors get them.

The oracle is tests/test_privacy.py's loop (torch.func.grad per example, clipped, averaged),
at a bound between the examples' norms. A spy on the ghost layers records which path each
layer took (Gram norms and book-keeping, or its per-example gradients built in the backward),
so a test cannot pass by silently falling back to the per-example path.
"""

from __future__ import annotations

import functools

import pytest
import torch

import lora_func as lf
from lora_func import _layer_ops
from lora_func.privacy import clipped_sum, ghost, private_grads
from lora_func.train import causal_lm_loss
from tests.models import tiny_model, tokens
from tests.test_privacy import _adapter, _assert_rel, _between, _case, _lm_loss, _loop

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture
def paths(monkeypatch):
    """Per ghost layer of each call: True for Gram norms + book-keeping, False for per-example gradients."""
    seen: list[bool] = []
    finish = ghost._Layer.finish

    def spy(self, batch_size):
        seen.append(self.gram)
        return finish(self, batch_size)

    monkeypatch.setattr(ghost._Layer, "finish", spy)
    return seen


def _equals_the_loop(loss_fn, adapter, ids, clipping):
    _, norms = _loop(loss_fn, adapter, ids, 1.0)
    c = _between(norms)
    want, _ = _loop(loss_fn, adapter, ids, c)
    got = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.0, clipping=clipping)
    _assert_rel(got, want, 1e-5)
    assert 0 < int((norms > c).sum()) < ids.shape[0]


@pytest.mark.parametrize("clipping", ["ghost", "per_example"])
@pytest.mark.parametrize("name", ["lora-llama", "lora-llama-nf4", "dora-gpt2-conv1d", "dora-llama-nf4"])
def test_each_clipping_equals_the_loop_on_a_float_and_an_nf4_base(name, clipping, paths):
    _, adapter, ids, loss_fn, c, want, norms = _case(name)
    total = clipped_sum(loss_fn, adapter, ids, max_grad_norm=c, clipping=clipping)
    _assert_rel({k: v / ids.shape[0] for k, v in total.grads.items()}, want, 1e-5)
    assert total.clipped == int((norms > c).sum()) and total.count == ids.shape[0]
    # LoRA's four layers take Gram norms when asked; DoRA's norm term keeps every tensor per example.
    assert paths == ([True] * 4 if clipping == "ghost" and name.startswith("lora") else [])


def test_auto_picks_per_layer_what_holds_less_and_both_equal_the_loop(paths):
    model = tiny_model("llama")  # hidden 32, r=2: Gram products hold less below about 6 tokens
    adapter = _adapter(model, "lora", ["q_proj", "v_proj"])
    loss_fn = functools.partial(_lm_loss, model)
    _equals_the_loop(loss_fn, adapter, tokens(4, 3, seed=2), "auto")
    assert paths == [True] * 4
    paths.clear()
    _equals_the_loop(loss_fn, adapter, tokens(4, 12, seed=2), "auto")
    assert paths == [False] * 4
    paths.clear()
    _equals_the_loop(loss_fn, adapter, tokens(4, 12, seed=2), "ghost")  # Gram products at 12 tokens too
    assert paths == [True] * 4


def test_pissa_gets_ghost_norms_and_equals_the_loop(paths):
    model = tiny_model("llama")
    _equals_the_loop(functools.partial(_lm_loss, model), _adapter(model, "pissa", ["q_proj", "v_proj"]), tokens(4, 8, seed=2), "ghost")
    assert paths == [True] * 4


@pytest.mark.parametrize("clipping", ["ghost", "auto"])
def test_a_layer_called_twice_in_one_forward_sums_both_calls(clipping, paths):
    # Two adapted calls in one loss: each LoRA layer's gradient sums over both (their rows side by side).
    model = tiny_model("llama")
    adapter = _adapter(model, "lora", ["q_proj", "v_proj"])

    def twice(a, ids):
        return _lm_loss(model, a, ids) + 0.5 * _lm_loss(model, a, ids.flip(1))

    _equals_the_loop(twice, adapter, tokens(4, 8, seed=2), clipping)
    assert paths == [clipping == "ghost"] * 4


def test_other_tensors_fall_back_per_tensor_in_the_same_pass(paths):
    # A combination: its LoRA layers get ghost norms; its own weights stay per example.
    model = tiny_model("llama")
    both = lf.combine([_adapter(model, "lora", ["q_proj", "v_proj"]), _adapter(model, "lora", ["v_proj"], seed=1)], weights=[0.7, 0.4])
    _equals_the_loop(functools.partial(_lm_loss, model), both, tokens(4, 8, seed=2), "ghost")
    assert paths == [True] * 6 and "weights" in both.params
    # A composition with IA3: LoRA's tensors ghost, IA3's per example.
    paths.clear()
    composed = lf.compose(_adapter(model, "lora", ["q_proj", "v_proj"]), _adapter(model, "ia3", ["v_proj", "k_proj"], seed=1))
    _equals_the_loop(functools.partial(_lm_loss, model), composed, tokens(4, 8, seed=2), "ghost")
    assert paths == [True] * 4


def test_tensors_that_reach_the_model_merged_take_the_per_example_path(paths):
    model = tiny_model("llama")
    adapter = _adapter(model, "lora", ["q_proj", "v_proj"])

    def merged(a, ids):
        return causal_lm_loss(lf.adapted_call(model, a, ids, merged=True).logits, ids)

    _equals_the_loop(merged, adapter, tokens(4, 8, seed=2), "ghost")
    assert paths == []  # the tap never saw the layers: the whole call went per example


def test_which_layers_get_ghost_norms():
    model = tiny_model("llama")
    assert len(ghost.ghost_layers(_adapter(model, "lora", ["q_proj", "v_proj"], use_rslora=True))) == 4
    assert len(ghost.ghost_layers(_adapter(model, "pissa", ["q_proj"]))) == 2  # a frozen residual + LoRA's product
    assert ghost.ghost_layers(_adapter(model, "lora", ["q_proj"], dropout=0.1)) == {}
    assert ghost.ghost_layers(_adapter(model, "dora", ["q_proj"])) == {}
    assert ghost.ghost_layers(lf.stack([_adapter(model, "lora", ["q_proj"], seed=s) for s in (0, 1)])) == {}


def test_the_tap_is_gone_after_a_call_and_after_one_that_raises():
    model = tiny_model("llama")
    adapter = _adapter(model, "lora", ["q_proj"])
    ids = tokens(3, 6, seed=2)
    clipped_sum(functools.partial(_lm_loss, model), adapter, ids, max_grad_norm=1.0, clipping="ghost")
    assert _layer_ops._tap_users == 0 and getattr(_layer_ops._tap_state, "tap", None) is None

    def boom(a, ids):
        lf.adapted_call(model, a, ids)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        clipped_sum(boom, adapter, ids, max_grad_norm=1.0, clipping="ghost")
    assert _layer_ops._tap_users == 0 and getattr(_layer_ops._tap_state, "tap", None) is None
    # An adapted call outside private_grads runs no tap.
    calls = []
    original = ghost._Layer.record
    try:
        ghost._Layer.record = lambda *a: calls.append(a) or original(*a)
        lf.adapted_call(model, adapter, ids).logits.sum().backward()
    finally:
        ghost._Layer.record = original
    assert not calls


def test_bf16_autocast_ghost_equals_per_example_within_bf16_error():
    _, adapter, ids, loss_fn, c, fp32, _ = _case("lora-llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ghosted = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.0, clipping="ghost")
        per_example = private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.0, clipping="per_example")
    flat = [torch.cat([g[k].flatten() for k in fp32]) for g in (ghosted, per_example, fp32)]
    assert all(v.dtype == torch.float32 for v in ghosted.values())
    assert float((flat[0] - flat[2]).norm() / flat[2].norm()) < 5e-2
    assert float((flat[0] - flat[1]).norm() / flat[2].norm()) < 5e-2
