"""adapted_call's reuse of a validated application between inference calls: when it reuses,
and that every change that could make a reused application wrong makes the next call build
anew (and give what an uncached call gives)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import lora_func as lf
from lora_func import core
from tests.models import tiny_model, tokens


@pytest.fixture
def builds(monkeypatch):
    """How many applications adapted_call has built."""
    count = [0]
    real = core._application

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "_application", counting)
    return count


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
        pytest.param(lambda model, adapter, base, ids: lf.adapted_call(model, adapter, ids, base=base, safe=True), id="safe"),
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
    assert core._REUSABLE[model].key[1] == id(other)
    alive = weakref.ref(model)
    weight = weakref.ref(model.model.layers[0].self_attn.q_proj.weight)
    del model, base
    gc.collect()
    assert alive() is None and weight() is None
