"""Routed LoRA against HF peft in float64 (issue 47): Poly and MHR (``PolyConfig``).

A perturbed peft checkpoint is loaded with ``load_peft``: logits, the loss and every trainable
tensor's gradient equal peft's (relative 1e-9) with ``task_ids`` one per row, as peft takes them
(``task_call``); greedy ``generate`` is token-equal (``task_adapted``); ``save_peft`` loads in
peft; per-row tasks equal each task alone; a stack of task members under ``vmap`` equals a loop;
``per_example_grads`` with per-row tasks equals a per-example loop; a training-mode step draws
peft's relaxed Bernoulli mixture."""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch

import lora_func as lf
from lora_func import routed
from lora_func.variants import poly
from tests.bank_oracle import model64, peft_model, rel
from tests.models import tokens
from tests.peft_helpers import ce_loss

RTOL = 1e-9
TARGETS = ["q_proj", "v_proj", "down_proj"]  # d_in != d_out on v_proj and down_proj
TASK_IDS = torch.tensor([2, 0, 1, 2])


@pytest.fixture(scope="module")
def model():
    return model64()


def _config(n_splits: int) -> peft.PolyConfig:
    # CAUSAL_LM: peft's causal-LM wrapper is the one that hands task_ids to the Poly layers.
    return peft.PolyConfig(task_type="CAUSAL_LM", r=2, target_modules=TARGETS, n_tasks=3, n_skills=3, n_splits=n_splits)


@pytest.fixture(scope="module", params=[1, 2], ids=["poly", "mhr"])
def loaded(request, model, tmp_path_factory):
    """(peft model, the adapter load_peft reads from its perturbed checkpoint)."""
    pm = peft_model(model, _config(request.param))
    directory = tmp_path_factory.mktemp("poly")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(directory)
    return pm, lf.load_peft(directory, model)


def _peft_key(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".default", "").replace(".module_logits", "")


def test_load_peft_logits_loss_and_every_gradient_equal_peft(model, loaded):
    pm, adapter = loaded
    ids = tokens(4, 9, seed=3)
    pm.zero_grad()
    want = pm(input_ids=ids, task_ids=TASK_IDS).logits
    want_loss = ce_loss(want, ids)
    want_loss.backward()
    peft_grads = {_peft_key(n): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    assert sorted(peft_grads) == sorted(adapter.params)
    assert (want - model(ids).logits).abs().max() > 1e-2, "the perturbed adapter should change the output"
    for batching in ("layers", "vmap"):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        got = routed.task_call(model, adapter.with_params(params), ids, task_ids=TASK_IDS, batching=batching, use_cache=False).logits
        loss = ce_loss(got, ids)
        assert rel(got, want) < RTOL and rel(loss, want_loss) < RTOL, batching
        grads = torch.autograd.grad(loss, list(params.values()))
        for key, grad in zip(params, grads, strict=True):
            assert peft_grads[key].abs().max() > 0, key
            assert rel(grad, peft_grads[key]) < RTOL, (batching, key)


def test_each_task_alone_on_the_plain_route_merged_and_lazy(model, loaded):
    pm, adapter = loaded
    ids = tokens(4, 9, seed=3)
    with torch.no_grad():
        want = pm(input_ids=ids, task_ids=TASK_IDS).logits
        for t in range(3):
            rows = TASK_IDS == t
            for merged in (False, True):
                got = lf.adapted_call(model, poly.for_task(adapter, t), ids[rows], merged=merged).logits
                assert rel(got, want[rows]) < RTOL, (t, merged)
        # the tasks differ: a task mix-up would show
        a0 = lf.adapted_call(model, poly.for_task(adapter, 0), ids).logits
        a1 = lf.adapted_call(model, poly.for_task(adapter, 1), ids).logits
        assert (a0 - a1).abs().max() > 1e-3


def test_greedy_generate_token_equal_to_peft(model, loaded):
    pm, adapter = loaded
    ids = tokens(4, 6, seed=4)
    with torch.no_grad():
        want = pm.generate(input_ids=ids, task_ids=TASK_IDS, max_new_tokens=6, do_sample=False)
        with routed.task_adapted(model, adapter, TASK_IDS):
            got = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        base = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert not torch.equal(base, want), "the adapter should change the greedy tokens"


def test_save_peft_loads_in_peft_and_native_save_round_trips(model, tmp_path):
    spec = lf.AdapterSpec("poly", TARGETS, r=2, dtype=torch.float64, n_tasks=3, n_skills=2, n_splits=2, init_weights=False)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    adapter = adapter.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    lf.save_peft(adapter, tmp_path / "peft", model=model, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "peft").eval()
    ids = tokens(4, 9, seed=3)
    with torch.no_grad():
        assert rel(routed.task_call(model, adapter, ids, task_ids=TASK_IDS).logits, pm(input_ids=ids, task_ids=TASK_IDS).logits) < RTOL
    again = lf.load_peft(tmp_path / "peft", model)
    assert all(torch.equal(again.params[k], v) for k, v in adapter.params.items())
    routed_for_2 = poly.for_task(adapter, 2)
    lf.save(routed_for_2, tmp_path / "native.safetensors")
    native = lf.load(tmp_path / "native.safetensors", model=model)
    assert all(torch.equal(native.params[k], v) for k, v in adapter.params.items())
    assert int(native.buffers["<shared>.poly_task"]) == 2


def test_per_row_tasks_equal_each_alone_and_a_vmapped_stack_equals_a_loop(model, loaded):
    _, adapter = loaded
    ids = tokens(4, 9, seed=3)
    members = routed.task_members(adapter)
    assert members.stack_shape == (3,)
    assert all(members.params[k].stride(0) == 0 for k in members.params), "task members share the adapter's tensors"
    with torch.no_grad():
        alone = [lf.adapted_call(model, poly.for_task(adapter, t), ids).logits for t in range(3)]
        mixed = routed.task_call(model, adapter, ids, task_ids=TASK_IDS).logits
        for b, t in enumerate(TASK_IDS.tolist()):
            assert rel(mixed[b], alone[t][b]) < RTOL
        vmapped = torch.func.vmap(lambda a: lf.adapted_call(model, a, ids).logits)(members)
    for t in range(3):
        assert rel(vmapped[t], alone[t]) < RTOL


def test_per_example_grads_with_per_row_tasks_equal_a_loop(model, loaded):
    _, adapter = loaded
    ids = tokens(3, 7, seed=6)
    tasks = torch.tensor([1, 2, 0])

    def loss_fn(a, x, t):  # x (1, T), t (1,): each example as a batch of one
        return ce_loss(lf.adapted_call(model, poly.for_task(a, t[0]), x).logits, x)

    got = lf.per_example_grads(loss_fn, adapter, ids, tasks)
    for b in range(3):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        loss = loss_fn(adapter.with_params(params), ids[b : b + 1], tasks[b : b + 1])
        want = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        for key in params:
            assert rel(got[key][b], want[key]) < RTOL, (b, key)


def test_training_mode_draws_peft_relaxed_bernoulli_mixture(model, loaded):
    pm, adapter = loaded
    ids = tokens(1, 9, seed=3)  # one row: peft draws one mixture per row, lora_func one per call
    train_model = copy.deepcopy(model).train()
    pm.train()
    try:
        torch.manual_seed(11)
        want = pm(input_ids=ids, task_ids=torch.tensor([2])).logits
        torch.manual_seed(11)
        got = lf.adapted_call(train_model, poly.for_task(adapter, 2), ids).logits
        torch.manual_seed(12)
        other = lf.adapted_call(train_model, poly.for_task(adapter, 2), ids).logits
    finally:
        pm.eval()
    assert rel(got, want) < RTOL
    assert (other - want).abs().max() > 1e-6, "the mixture is sampled in training"
