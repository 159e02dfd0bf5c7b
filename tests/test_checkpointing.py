"""Activation checkpointing: the recompute in backward must see the adapter again.

Every variant x layer kind x path (lazy, merged) x route (overlay, module-call), each under one
checkpointing flavour (HF's, reentrant and not; ``torch.utils.checkpoint`` around user blocks,
reentrant and not) rotated so that each variant and layer kind meets all four: loss and per-tensor adapter gradients equal the same model without checkpointing, a
recompute really happened in backward, and the model is left as it was. The oracle is the
run without checkpointing (whose own correctness the contract suite checks against W_eff).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import lora_func as lf
import lora_func._application as application
from lora_func.train import TrainState, fit, make_optimizer
from tests.contract_helpers import assert_unchanged, calibration_batches, perturbed, snapshot, spec_for
from tests.models import LAYER_KIND_MODEL, tiny_model, tokens
from tests.tolerance import FP32_REL, assert_close_to_scale
from tests.variant_table import ROWS

FLAVOURS = ("hf", "hf-reentrant", "user", "user-reentrant")
KINDS = ("linear", "conv1d")


class UserCheckpoint(nn.Module):
    """A user's own wrapper: ``torch.utils.checkpoint`` around one decoder block."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant, self.enabled = inner, reentrant, True

    def forward(self, *args, **kwargs):
        if not (self.enabled and self.training):
            return self.inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(functools.partial(self.inner, **kwargs), *args, use_reentrant=self.reentrant)


def _blocks(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def checkpointed_model(kind: str, flavour: str, seed: int = 0) -> nn.Module:
    """A tiny model in training mode with ``flavour`` of checkpointing, switched off for now."""
    model = tiny_model(LAYER_KIND_MODEL[kind], seed=seed)
    if flavour.startswith("user"):
        blocks = _blocks(model)
        for i, block in enumerate(blocks):
            blocks[i] = UserCheckpoint(block, reentrant=flavour.endswith("reentrant"))
        if flavour.endswith("reentrant"):
            model.enable_input_require_grads()  # a reentrant block needs an input that requires grad
    model.train()
    set_checkpointing(model, flavour, False)
    return model


def set_checkpointing(model: nn.Module, flavour: str, on: bool) -> None:
    if flavour.startswith("user"):
        for block in _blocks(model):
            block.enabled = on
    elif on:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": flavour == "hf-reentrant"})
    else:
        model.activation_checkpointing_disable()


def build_adapter(model: nn.Module, row, kind: str, seed: int = 0) -> lf.Adapter:
    model.eval()  # calibration refuses a model in training mode
    adapter = lf.init_adapter(
        model,
        spec_for(row, LAYER_KIND_MODEL[kind]),
        generator=torch.Generator().manual_seed(seed + 100),
        calibration=calibration_batches() if row.calibration else None,
    )
    model.train()
    return perturbed(adapter, row.perturb_scale)


def fresh(adapter: lf.Adapter) -> lf.Adapter:
    return adapter.with_params({k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()})


def loss_and_grads(model, adapter, ids, **call):
    a = fresh(adapter)
    loss = lf.adapted_call(model, a, ids, labels=ids, use_cache=False, **call).loss
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in a.params.items()}


@pytest.fixture
def recomputes(monkeypatch):
    """Counts the calls of re-applied checkpoint functions made during backward (recomputes)."""
    seen: list[bool] = []
    rebound = application._rebound

    def spy(function, reentrant, args):
        wrapped = rebound(function, reentrant, args)
        if wrapped is function:
            return function

        def counted(*a, **k):
            seen.append(torch._C._current_graph_task_id() != -1)
            return wrapped(*a, **k)

        return counted

    monkeypatch.setattr(application, "_rebound", spy)
    return seen


def assert_clean(model: nn.Module) -> None:
    leftovers = sorted(name for name, m in model.named_modules() if "forward" in m.__dict__)
    assert not leftovers, f"module-call forwards left on {leftovers}"
    assert not application.active_applications()


# The big grid below reuses one model per (kind, flavour) and one adapter per (variant, kind,
# flavour) across its paths and routes (building them was a third of its time). A test takes the
# model out of the cache, starts from the state checkpointed_model() gives (training mode,
# checkpointing off) and puts it back only once every check passed (the model left as it was
# found): a failing test never hands a model it may have changed to the next one. Adapters are
# never written to (loss_and_grads runs on fresh copies of their tensors).
_MODELS: dict[tuple[str, str], nn.Module] = {}
_ADAPTERS: dict[tuple[str, str, str], lf.Adapter] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_models():
    yield
    _MODELS.clear()
    _ADAPTERS.clear()


def _take_model(kind: str, flavour: str) -> nn.Module:
    model = _MODELS.pop((kind, flavour), None) or checkpointed_model(kind, flavour)
    set_checkpointing(model, flavour, False)
    return model.train()


def _grid_cases():
    """Every variant x kind x path x route, each with one checkpointing flavour, rotated so that
    every (variant, kind) meets all four flavours and every (path, route, flavour) meets about a
    quarter of the variants. The full product (four times as many cases) re-ran the same variant
    forms under each flavour: what a flavour changes (when the recompute runs, reentrant or not,
    HF's hook or the user's wrapper) acts on the application route and the path, which every
    flavour still meets on every one of them."""
    paths = [(merged, route) for merged in (False, True) for route in ("overlay", "module")]
    for i, variant in enumerate(sorted(ROWS)):
        for k, kind in enumerate(KINDS):
            for j, (merged, route) in enumerate(paths):
                flavour = FLAVOURS[(i + j + k) % len(FLAVOURS)]
                yield pytest.param(variant, kind, merged, route, flavour, id=f"{variant}-{kind}-{'merged' if merged else 'lazy'}-{route}-{flavour}")


@pytest.mark.parametrize(("variant", "kind", "merged", "route", "flavour"), list(_grid_cases()))
def test_gradients_with_checkpointing_equal_the_run_without(variant, kind, merged, route, flavour, recomputes):
    row = ROWS[variant]
    model = _take_model(kind, flavour)
    if (variant, kind, flavour) not in _ADAPTERS:
        _ADAPTERS[variant, kind, flavour] = build_adapter(model, row, kind)
    adapter = _ADAPTERS[variant, kind, flavour]
    snap = snapshot(model)
    ids = tokens(2, 8, seed=5)
    # One seed for both runs: a variant that samples in training steps (PVeRA) draws the same noise
    # (checkpointing replays the RNG state in the recompute).
    torch.manual_seed(0)
    if merged and not lf.get_variant(variant).merges:  # no merged weight (Lily): refused, the model untouched
        with pytest.raises(ValueError, match="has no merged weight"):
            loss_and_grads(model, adapter, ids, merged=merged, route=route)
        assert_unchanged(model, snap)
        return
    want_loss, want = loss_and_grads(model, adapter, ids, merged=merged, route=route)
    assert not recomputes
    set_checkpointing(model, flavour, True)
    torch.manual_seed(0)
    got_loss, got = loss_and_grads(model, adapter, ids, merged=merged, route=route)
    assert any(recomputes), "no block was recomputed in backward: checkpointing did not run"
    assert_close_to_scale(got_loss, want_loss, msg="loss")
    assert sorted(got) == sorted(want)
    for name in want:
        if name.rsplit(".", 1)[-1] in row.training_only:
            continue  # acts in training steps only (Row.training_only): unused here
        assert got[name] is not None, f"{name}: no gradient with checkpointing"
        assert_close_to_scale(got[name], want[name], msg=name)
    assert any(g.abs().max() > 0 for g in got.values() if g is not None)
    assert_unchanged(model, snap)
    assert_clean(model)
    _MODELS[kind, flavour] = model


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("merged", [False, True], ids=["lazy", "merged"])
def test_an_adapter_missing_at_recompute_is_caught(flavour, merged, monkeypatch):
    # The bug this issue fixes, put back: the recompute runs without the adapter. The check
    # above must fail on it, loudly (CheckpointError) or by a gradient that differs or is missing.
    model = checkpointed_model("linear", flavour)
    adapter = build_adapter(model, ROWS["dora"], "linear")
    ids = tokens(2, 8, seed=5)
    _, want = loss_and_grads(model, adapter, ids, merged=merged)
    monkeypatch.setattr(application, "_rebound", lambda function, reentrant, args: function)
    set_checkpointing(model, flavour, True)
    try:
        _, got = loss_and_grads(model, adapter, ids, merged=merged)
    except (torch.utils.checkpoint.CheckpointError, RuntimeError):
        return
    assert any(got[k] is None or not torch.allclose(got[k], want[k], atol=1e-6, rtol=0) for k in want)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("merged", [False, True], ids=["lazy", "merged"])
def test_torch_func_grad_with_checkpointing_raises_a_clear_error(flavour, merged):
    model = checkpointed_model("linear", flavour)
    adapter = build_adapter(model, ROWS["lora"], "linear")
    snap = snapshot(model)
    set_checkpointing(model, flavour, True)
    ids = tokens(2, 8, seed=5)

    def loss(params):
        return lf.adapted_call(model, adapter.with_params(params), ids, labels=ids, use_cache=False, merged=merged).loss

    with pytest.raises(RuntimeError, match=r"inside a torch.func transform.*loss.backward\(\).*gradient_checkpointing_disable"):
        torch.func.grad(loss)(adapter.params)
    assert_unchanged(model, snap)
    assert_clean(model)
    # and without checkpointing the same idiom gives the gradients of the backward idiom
    set_checkpointing(model, flavour, False)
    if flavour != "user":
        model.disable_input_require_grads()  # HF's hook calls requires_grad_, which torch.func refuses
    got = torch.func.grad(loss)(adapter.params)
    _, want = loss_and_grads(model, adapter, ids, merged=merged)
    for name in want:
        assert_close_to_scale(got[name], want[name], msg=name)


def test_a_reentrant_block_whose_inputs_need_no_grad_is_refused():
    # Without an input that requires grad, reentrant checkpointing returns an output with no
    # graph: the adapter inside would silently train nothing.
    model = tiny_model("llama")
    blocks = _blocks(model)
    for i, block in enumerate(blocks):
        blocks[i] = UserCheckpoint(block, reentrant=True)
    model.train()
    adapter = build_adapter(model, ROWS["lora"], "linear")
    ids = tokens(2, 8, seed=5)
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*no gradient.*enable_input_require_grads"):
        lf.adapted_call(model, adapter, ids, labels=ids, use_cache=False)
    assert_clean(model)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("flavour", ["hf", "hf-reentrant"])
def test_train_step_and_fit_with_checkpointing_train_as_without(flavour, autocast):
    row = ROWS["lora"]
    runs = []
    for on in (False, True):
        model = checkpointed_model("linear", flavour)
        adapter = fresh(build_adapter(model, row, "linear"))
        set_checkpointing(model, flavour, on)
        state = TrainState(adapter, make_optimizer(adapter, lr=1e-2))
        g = torch.Generator().manual_seed(0)
        batches = [{"input_ids": torch.randint(3, 61, (2, 8), generator=g)} for _ in range(3)]
        history = fit(
            model, state, lambda step: {**batches[step], "labels": batches[step]["input_ids"]}, 3, progress=False, autocast_dtype=autocast
        )
        runs.append(([s.loss for s in history], {k: v.detach() for k, v in adapter.params.items()}))
    (loss0, params0), (loss1, params1) = runs
    assert loss0 == pytest.approx(loss1, rel=FP32_REL)
    for name in params0:
        assert_close_to_scale(params1[name], params0[name], msg=name)
    assert any(not torch.equal(params0[k], build_adapter(checkpointed_model("linear", flavour), row, "linear").params[k]) for k in params0)


def test_backward_after_an_adapted_block_recomputes_with_the_adapter():
    model = checkpointed_model("linear", "hf")
    adapter = build_adapter(model, ROWS["lora"], "linear")
    ids = tokens(2, 8, seed=5)
    _, want = loss_and_grads(model, adapter, ids)
    set_checkpointing(model, "hf", True)
    a = fresh(adapter)
    with lf.adapted(model, a, merged=False):
        loss = model(ids, labels=ids, use_cache=False).loss
    assert_clean(model)
    loss.backward()  # the recompute happens here, after the block has restored the model
    for name in want:
        assert_close_to_scale(a.params[name].grad, want[name], msg=name)
