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
            rows = t == TASK_IDS
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
    # beams (peft's Poly cannot: its task_ids do not follow generate's expansion): each row's beams on its task
    with torch.no_grad():
        with routed.task_adapted(model, adapter, TASK_IDS):
            beams = model.generate(input_ids=ids, max_new_tokens=4, num_beams=2, do_sample=False)
        for b, t in enumerate(TASK_IDS.tolist()):
            with lf.adapted(model, poly.for_task(adapter, t)):
                alone = model.generate(input_ids=ids[b : b + 1], max_new_tokens=4, num_beams=2, do_sample=False)
            assert torch.equal(beams[b : b + 1], alone), b


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
    # DP-SGD with per-row tasks: unclipped and noise-free, private_grads is the mean of these
    private = lf.private_grads(loss_fn, adapter, ids, tasks, max_grad_norm=1e9, noise_multiplier=0.0)
    for key in got:
        assert rel(private[key], got[key].mean(0)) < RTOL, key
    for b in range(3):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        loss = loss_fn(adapter.with_params(params), ids[b : b + 1], tasks[b : b + 1])
        want = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        for key in params:
            assert rel(got[key][b], want[key]) < RTOL, (b, key)


def test_training_mode_draws_peft_relaxed_bernoulli_mixture_one_per_row(model, loaded):
    """peft draws one mixture per batch row (one ``torch.rand((rows, n_splits, n_skills))`` per
    layer): the same seed gives the same draws, so a multi-row training step equals peft's, on the
    plain route (one task for every row) and per-row tasks (``task_call``, both batchings)."""
    pm, adapter = loaded
    ids = tokens(4, 9, seed=3)
    train_model = copy.deepcopy(model).train()
    pm.train()
    try:
        torch.manual_seed(11)
        want_one = pm(input_ids=ids, task_ids=torch.full((4,), 2)).logits
        torch.manual_seed(11)
        want_rows = pm(input_ids=ids, task_ids=TASK_IDS).logits
        torch.manual_seed(11)
        got_one = lf.adapted_call(train_model, poly.for_task(adapter, 2), ids).logits
        got_rows = {}
        for batching in ("layers", "vmap"):
            torch.manual_seed(11)
            kwargs = {"randomness": "different"} if batching == "vmap" else {}
            got_rows[batching] = routed.task_call(train_model, adapter, ids, task_ids=TASK_IDS, batching=batching, use_cache=False, **kwargs).logits
        torch.manual_seed(12)
        other = lf.adapted_call(train_model, poly.for_task(adapter, 2), ids).logits
        with torch.no_grad():
            evaluated = lf.adapted_call(model, poly.for_task(adapter, 2), ids).logits
    finally:
        pm.eval()
    assert rel(got_one, want_one) < RTOL
    assert rel(got_rows["layers"], want_rows) < RTOL
    assert rel(got_rows["vmap"], want_rows) < RTOL  # each example alone: vmap's "different" draws are the same rows of one draw
    assert torch.equal(got_one, want_one), "one task on every row: peft's ops and draws, bit for bit"
    assert (other - want_one).abs().max() > 1e-6, "the mixture is sampled in training"
    assert (got_one - evaluated).abs().max() > 1e-6
    same = lf.adapted_call(train_model, poly.for_task(adapter, 2), ids[:1].expand(4, -1)).logits  # four copies of one row
    assert (same[1:] - same[:1]).abs().amax((1, 2)).min() > 1e-6, "each row draws its own mixture"


# ----------------------------------------------------------------------------------- Arrow

ARROW_TARGETS = ["q_proj", "v_proj", "down_proj"]
ALPHAS = [4.0, 6.0, 3.0, 5.0, 2.0]  # three task experts, two general ones; every scale its own
ARROW = {"top_k": 2, "router_temperature": 0.7, "rng_seed": 5}


@pytest.fixture(scope="module")
def library(model, tmp_path_factory):
    """Paths of five perturbed peft LoRA checkpoints (three task experts, two general)."""
    directory = tmp_path_factory.mktemp("arrow")
    paths = []
    for i, alpha in enumerate(ALPHAS):
        pm = peft_model(model, peft.LoraConfig(r=2, lora_alpha=alpha, target_modules=ARROW_TARGETS, lora_dropout=0.0), seed=10 + i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm.save_pretrained(directory / f"lora{i}")
        paths.append(str(directory / f"lora{i}"))
    return paths


def _peft_arrow(model, tasks, general=None, **config):
    from peft.tuners.lora.arrow import create_arrow_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arrow_config = peft.ArrowConfig(use_gks=general is not None, **{**ARROW, **config})
        return create_arrow_model(copy.deepcopy(model), tasks, arrow_config, general_adapter_paths=general).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["arrow", "genknowsub"])
def arrowed(request, model, library):
    """(peft's Arrow model, lora_func's arrow adapter from load_peft of the same checkpoints)."""
    tasks, general = library[:3], (library[3:] if request.param else None)
    pm = _peft_arrow(model, tasks, general)
    adapter = lf.routed.arrow([lf.load_peft(p, model) for p in tasks], general=None if general is None else [lf.load_peft(p, model) for p in general], **ARROW)
    return pm, adapter


def _arrow_peft_grads(pm) -> dict[str, list]:
    """peft's gradients of the task experts' factors, as the arrow adapter keys them (per expert)."""
    grads: dict[str, dict[int, torch.Tensor]] = {}
    for name, p in pm.named_parameters():
        if ".task_" in name and p.grad is not None:
            module, rest = name.removeprefix("base_model.model.").split(".lora_")
            which, task = rest.split(".")[0], int(rest.split(".")[1].removeprefix("task_"))
            grads.setdefault(f"{module}.lora_{which}", {})[task] = p.grad
    return {k: [v[e] for e in sorted(v)] for k, v in grads.items()}


def test_arrow_logits_loss_and_expert_gradients_equal_peft(model, arrowed):
    pm, adapter = arrowed
    for name, p in pm.named_parameters():  # peft trains only the router adapter: ask it for the experts' gradients
        if ".lora_A.task_" in name or ".lora_B.task_" in name:
            p.requires_grad_(True)
    ids = tokens(3, 9, seed=3)
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    want_loss = ce_loss(want, ids)
    want_loss.backward()  # (peft's first forward applies GenKnowSub and builds the prototypes)
    peft_grads = _arrow_peft_grads(pm)
    assert sorted(peft_grads) == sorted(adapter.params) and all(len(v) == 3 for v in peft_grads.values())
    assert (want - model(ids).logits).abs().max() > 1e-2
    params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
    got = lf.adapted_call(model, adapter.with_params(params), ids).logits
    loss = ce_loss(got, ids)
    assert rel(got, want) < RTOL and rel(loss, want_loss) < RTOL
    for key, grad in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
        for e in range(3):
            assert peft_grads[key][e].abs().max() > 0, (key, e)
            assert rel(grad[e], peft_grads[key][e]) < RTOL, (key, e)


def test_arrow_routes_per_token_and_genknowsub_changes_it(model, library, arrowed):
    _, adapter = arrowed
    ids = tokens(2, 9, seed=3)
    coeffs = []
    layer = adapter.layers[0]
    x = torch.randn(40, layer.info.d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    coeffs = lf.variants.arrow.coefficients(x, adapter.buffers[f"{layer.target.module}.arrow_prototypes"], layer.info)
    assert torch.equal((coeffs > 0).sum(1), torch.full((40,), 2)), "top_k=2 experts per token"
    assert len({tuple(row.nonzero().flatten().tolist()) for row in coeffs}) > 1, "tokens are routed to different experts"
    plain = lf.routed.arrow([lf.load_peft(p, model) for p in library[:3]], **ARROW)
    with_gks = lf.routed.arrow([lf.load_peft(p, model) for p in library[:3]], general=[lf.load_peft(p, model) for p in library[3:]], **ARROW)
    with torch.no_grad():
        assert (lf.adapted_call(model, plain, ids).logits - lf.adapted_call(model, with_gks, ids).logits).abs().max() > 1e-3


def test_arrow_greedy_generate_token_equal_to_peft_and_merged_refused(model, arrowed):
    pm, adapter = arrowed
    ids = tokens(2, 6, seed=4)
    with torch.no_grad():
        want = pm.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        with lf.adapted(model, adapter, merged=False):
            got = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="no merged weight"):
        lf.adapted_call(model, adapter, ids, merged=True)


def test_arrow_experts_save_peft_and_peft_routes_them_alike(model, arrowed, tmp_path):
    pm, adapter = arrowed
    experts = lf.routed.arrow_experts(adapter)
    for e, expert in enumerate(experts):
        lf.save_peft(expert, tmp_path / f"expert{e}", model=model)
    saved = _peft_arrow(model, [str(tmp_path / f"expert{e}") for e in range(3)])  # GenKnowSub already in the experts
    ids = tokens(3, 9, seed=3)
    with torch.no_grad():
        assert rel(saved(input_ids=ids).logits, pm(input_ids=ids).logits) < RTOL
        assert rel(lf.adapted_call(model, lf.routed.arrow(experts, **ARROW), ids).logits, lf.adapted_call(model, adapter, ids).logits) < RTOL
    lf.save(adapter, tmp_path / "arrow.safetensors")
    again = lf.load(tmp_path / "arrow.safetensors", model=model)
    assert all(torch.equal(again.params[k], v) for k, v in adapter.params.items())
    assert all(torch.equal(again.buffers[k], v) for k, v in adapter.buffers.items())


def test_arrow_per_row_routers_vmap_and_per_example_grads(model, library):
    tasks = [lf.load_peft(p, model) for p in library]
    routers = [lf.routed.arrow(tasks[:3], **ARROW), lf.routed.arrow(tasks[2:], **ARROW)]
    ids = tokens(3, 9, seed=3)
    index = torch.tensor([1, 0, 1])
    with torch.no_grad():
        alone = [lf.adapted_call(model, r, ids).logits for r in routers]
        mixed = lf.mixed_call(model, routers, index, ids, batching="layers").logits
        vmapped = torch.func.vmap(lambda a: lf.adapted_call(model, a, ids).logits)(lf.stack(routers))
    for b, k in enumerate(index.tolist()):
        assert rel(mixed[b], alone[k][b]) < RTOL
    for k in range(2):
        assert rel(vmapped[k], alone[k]) < RTOL
    assert (alone[0] - alone[1]).abs().max() > 1e-3

    def loss_fn(a, x):
        return ce_loss(lf.adapted_call(model, a, x).logits, x)

    got = lf.per_example_grads(loss_fn, routers[0], ids)
    for b in range(3):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in routers[0].params.items()}
        want = torch.autograd.grad(loss_fn(routers[0].with_params(params), ids[b : b + 1]), list(params.values()))
        for key, grad in zip(params, want, strict=True):
            assert rel(got[key][b], grad) < RTOL, (b, key)


def test_arrow_on_gpt2_conv1d_equals_peft(tmp_path):
    gpt2 = model64("gpt2")
    paths = []
    for i, alpha in enumerate(ALPHAS[:3]):
        pm = peft_model(gpt2, peft.LoraConfig(r=2, lora_alpha=alpha, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_dropout=0.0), seed=20 + i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm.save_pretrained(tmp_path / f"lora{i}")
        paths.append(str(tmp_path / f"lora{i}"))
    pm = _peft_arrow(gpt2, paths)
    for name, p in pm.named_parameters():
        if ".lora_A.task_" in name or ".lora_B.task_" in name:
            p.requires_grad_(True)
    adapter = lf.routed.arrow([lf.load_peft(p, gpt2) for p in paths], **ARROW)
    ids = tokens(2, 9, seed=3)
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    peft_grads = _arrow_peft_grads(pm)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
    got = lf.adapted_call(gpt2, adapter.with_params(params), ids).logits
    assert rel(got, want) < RTOL and (want - gpt2(ids).logits).abs().max() > 1e-2
    for key, grad in zip(params, torch.autograd.grad(ce_loss(got, ids), list(params.values())), strict=True):
        for e in range(3):
            assert peft_grads[key][e].abs().max() > 0 and rel(grad[e], peft_grads[key][e]) < RTOL, (key, e)
