"""The validated plan of an adapted call (lora_func.plan): the structural checks run once per
adapter structure (the tree walkers are entered at most twice per call), a plan holds across
with_params and is found by structure, not identity; and adapted_call's reuse of the plan's last
application between inference calls: when it reuses, and that every change that could make a
reused application wrong makes the next call build anew (and give what an uncached call gives)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import lora_func as lf
from lora_func import call
from lora_func import plan as plan_module
from tests.models import tiny_model, tokens


def _count_calls(monkeypatch, module, name: str, real) -> list[int]:
    """Replace ``module.name`` by ``real`` counted: the count is ``[n]``."""
    count = [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return count


@pytest.fixture
def builds(monkeypatch):
    """How many applications adapted_call has built."""
    return _count_calls(monkeypatch, call, "application", call.application)


def _setup(kind: str = "llama"):
    model = tiny_model(kind)
    targets = ["q_proj", "v_proj"] if kind == "llama" else ["c_attn"]
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=4), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    adapter = adapter.with_params({k: torch.randn(v.shape, generator=g).requires_grad_(True) for k, v in adapter.params.items()})
    return model, adapter, lf.base_params(model), tokens()


def _oracle(model, base, adapter, ids):
    return functional_call(model, lf.merge_overlay(base, adapter), (ids,)).logits


def test_inference_calls_with_one_base_and_adapter_build_once(builds):
    model, adapter, base, ids = _setup()
    with torch.no_grad():
        outs = [lf.adapted_call(model, adapter, ids, base=base).logits for _ in range(3)]
    assert builds[0] == 1
    for out in outs:
        torch.testing.assert_close(out, _oracle(model, base, adapter, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda model, adapter, base, ids: lf.adapted_call(model, adapter, ids, base=base), id="grad enabled"),
        pytest.param(lambda model, adapter, base, ids: lf.adapted_call(model, adapter, ids), id="no base dict"),
        pytest.param(lambda model, adapter, base, ids: lf.adapted_call(model, adapter, ids, base=base, merged=True), id="merged"),
        pytest.param(lambda model, adapter, base, ids: lf.adapted_call(model, adapter, ids, base=base, check_finite=True), id="check_finite"),
    ],
)
def test_calls_that_read_values_or_record_gradients_never_reuse(builds, call, request):
    model, adapter, base, ids = _setup()
    grad = "grad enabled" in request.node.callspec.id
    for _ in range(2):
        with torch.no_grad():
            lf.adapted_call(model, adapter, ids, base=base)  # a reusable application is there
        before = builds[0]
        with torch.enable_grad() if grad else torch.no_grad():
            call(model, adapter, base, ids)
        assert builds[0] == before + 1


def test_a_grad_call_builds_anew_and_records_the_graph(builds):
    model, adapter, base, ids = _setup()
    with torch.no_grad():
        lf.adapted_call(model, adapter, ids, base=base)
    out = lf.adapted_call(model, adapter, ids, base=base).logits
    assert builds[0] == 2 and out.requires_grad
    out.square().mean().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in adapter.params.values())


def _replace_base_entry(model, adapter, base, ids):
    key = "model.layers.0.self_attn.q_proj.weight"
    base[key] = base[key] * 2.0
    return model, adapter, base


def _new_adapter(model, adapter, base, ids):
    return model, adapter.with_params({k: v * 0.5 for k, v in adapter.params.items()}), base


def _in_place_write(model, adapter, base, ids):
    with torch.no_grad():
        for t in adapter.params.values():
            t.add_(0.3)
    return model, adapter, base


def _train_mode(model, adapter, base, ids):
    model.train()
    return model, adapter, base


@pytest.mark.parametrize("change", [_replace_base_entry, _new_adapter, _in_place_write, _train_mode])
def test_a_change_makes_the_next_call_build_anew_and_follow_it(builds, change):
    model, adapter, base, ids = _setup()
    with torch.no_grad():
        first = lf.adapted_call(model, adapter, ids, base=base).logits
        model, adapter, base = change(model, adapter, base, ids)
        after = lf.adapted_call(model, adapter, ids, base=base).logits
    assert builds[0] == 2
    torch.testing.assert_close(after, _oracle(model, base, adapter, ids), rtol=1e-5, atol=1e-5)
    if change is not _train_mode:  # (dropout is off: train mode gives the same numbers)
        assert (after - first).abs().max() > 1e-3


def test_a_structural_change_of_the_model_is_caught_as_an_uncached_call_would(builds):
    model, adapter, base, ids = _setup()
    with torch.no_grad():
        lf.adapted_call(model, adapter, ids, base=base)
        del model.model.layers[1].self_attn.o_proj.bias  # a parameter the base dict still names
        with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
            lf.adapted_call(model, adapter, ids, base=base)


def test_each_model_keeps_one_reusable_application_and_deleting_the_model_frees_it():
    import gc
    import weakref

    model, adapter, base, ids = _setup()
    other = adapter.with_params({k: v * 0.5 for k, v in adapter.params.items()})
    with torch.no_grad():
        lf.adapted_call(model, adapter, ids, base=base)
        lf.adapted_call(model, other, ids, base=base)
    memo = call._LAST.get(plan_module.plans_for(model)[0])
    assert memo.tensors[0] is next(iter(other.params.values()))
    alive = weakref.ref(model)
    weight = weakref.ref(model.model.layers[0].self_attn.q_proj.weight)
    del model, base
    gc.collect()
    assert alive() is None and weight() is None


# ----------------------------------------------------------------------------- the plan


def _walker_entries(fn) -> int:
    """How many times ``fn()`` enters the adapter-tree walkers (``walk``, ``leaf_adapters``,
    ``leaves``) from outside them: a generator counts once, however often it resumes, and a
    walker's recursion into itself does not count."""
    import sys

    from lora_func import adapter as tree

    walkers = {tree.walk.__code__, tree.leaf_adapters.__code__, tree.leaves.__code__}
    frames: set[int] = set()
    held = []  # the frames seen, kept alive so that no id is reused by a later frame
    count = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in walkers and id(frame) not in frames:
            frames.add(id(frame))
            held.append(frame)
            caller = frame.f_back
            if caller is None or caller.f_code not in walkers:
                count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def test_one_adapted_call_walks_the_adapter_tree_at_most_twice():
    model, adapter, base, ids = _setup()  # LoRA on q_proj and v_proj of 2 layers: 4 targets
    assert len(adapter.layers) == 4
    first = _walker_entries(lambda: lf.adapted_call(model, adapter, ids).logits.sum().backward())
    again = _walker_entries(lambda: lf.adapted_call(model, adapter.with_params(adapter.params), ids, base=base).logits.sum())
    assert first <= 2, first  # one validation (the plan), one application
    assert again == 0, again  # the plan is found by structure: no validation walk


def test_a_plan_is_built_once_per_structure_across_with_params_and_equal_adapters(monkeypatch):
    model, adapter, base, ids = _setup()
    builds = _count_calls(monkeypatch, call, "build_plan", plan_module.build_plan)
    params = adapter.params
    for _ in range(3):  # a training loop: a new adapter (same structure) every step
        adapter = adapter.with_params({k: (v - 0.01 * v.detach()).detach().requires_grad_(True) for k, v in params.items()})
        params = adapter.params
        lf.adapted_call(model, adapter, ids, base=base).logits.sum().backward()
    # Another adapter object of an equal structure (built again from the same spec): found by
    # structure, not by identity.
    twin = lf.init_adapter(model, adapter.spec, generator=torch.Generator().manual_seed(5))
    assert twin.layers == adapter.layers and twin.layers is not adapter.layers
    out = lf.adapted_call(model, twin, ids, base=base).logits
    assert builds[0] == 1
    torch.testing.assert_close(out, _oracle(model, base, twin, ids), rtol=1e-5, atol=1e-5)
    # Another structure (another rank) builds its own plan.
    other = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0))
    lf.adapted_call(model, other, ids, base=base)
    assert builds[0] == 2


def test_a_held_plan_runs_every_runner_and_refuses_another_structure():
    model, adapter, base, ids = _setup()
    plan = lf.make_plan(model, adapter, base=base)
    assert isinstance(plan, lf.Plan) and plan.route == "overlay" and len(plan.targets) == 4
    moved = adapter.with_params({k: v * 1.5 for k, v in adapter.params.items()})
    expected = _oracle(model, base, moved, ids)
    torch.testing.assert_close(lf.adapted_call(model, moved, ids, base=base, plan=plan).logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    for make in (lf.overlay, lf.merge_overlay):
        got = functional_call(model, make(base, moved, plan=plan), (ids,)).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    # A stacked adapter of the same layers has other tensor shapes: the held plan's tensor
    # check still says so (it is not skipped).
    stacked = lf.stack([adapter, moved])
    with pytest.raises(ValueError, match="stacked"):
        lf.overlay(base, stacked, plan=plan)
    other = lf.compose(adapter, moved)
    with pytest.raises(ValueError, match="plan= was built for another"):
        lf.adapted_call(model, other, ids, plan=plan)
    # A module-route plan is not a parameter-dict overlay's.
    module_plan = lf.make_plan(model, adapter, route="module")
    assert module_plan.route == "module"
    with pytest.raises(ValueError, match="plan= was built for another"):
        lf.overlay(base, adapter, plan=module_plan)
    torch.testing.assert_close(lf.adapted_call(model, moved, ids, plan=module_plan).logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_a_cached_plan_follows_a_base_whose_target_changed_kind_or_shape(builds):
    model, adapter, base, ids = _setup()
    lf.adapted_call(model, adapter, ids, base=base)
    key = "model.layers.0.self_attn.q_proj.weight"
    wrong = dict(base)
    wrong[key] = base[key][:, :-1]
    with pytest.raises(ValueError, match="target shapes"):
        lf.adapted_call(model, adapter, ids, base=wrong)
    ints = dict(base)
    ints[key] = base[key].to(torch.int32)
    with pytest.raises(TypeError, match="not floating-point"):
        lf.adapted_call(model, adapter, ids, base=ints, route="overlay")


def test_overlay_finds_its_plan_by_structure_and_follows_the_base(monkeypatch):
    model, adapter, base, ids = _setup()
    builds = _count_calls(monkeypatch, plan_module, "build_plan", plan_module.build_plan)
    monkeypatch.setattr(plan_module, "_OVERLAY_PLANS", [])
    for scale in (1.0, 0.5, 2.0):  # a training loop's with_params: one plan
        moved = adapter.with_params({k: v * scale for k, v in adapter.params.items()})
        got = functional_call(model, lf.overlay(base, moved), (ids,)).logits
        torch.testing.assert_close(got, _oracle(model, base, moved, ids), rtol=1e-4, atol=1e-4 * got.abs().max().item())
    assert builds[0] == 1
    # The found plan still checks the tensors in hand, and a base of another dtype builds anew.
    with pytest.raises(ValueError, match="stacked"):
        lf.overlay(base, lf.stack([adapter, adapter]).with_params(lf.stack([adapter, adapter]).params))
    halved = {k: v.to(torch.float64) if k.endswith("q_proj.weight") else v for k, v in base.items()}
    lf.merge_overlay(halved, adapter)
    assert builds[0] == 2  # the float64 base (an equal-rank stack has the same structure: found, and refused)
    ints = {k: v.to(torch.int32) if k.endswith("q_proj.weight") else v for k, v in base.items()}
    with pytest.raises(TypeError, match="not floating-point"):
        lf.overlay(ints, adapter)
