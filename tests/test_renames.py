"""Issue 36's renames: the new names work, and until 0.2 every old name and keyword still works,
warns (``DeprecationWarning`` naming the new spelling) and gives the same result bit for bit.

(The old module-level names, ``lora_func.check_params`` and ``lora_func.overlay_calls``, are in
tests/test_public_api.py with the earlier renames; a ``Combinator`` defining ``layer_step`` is in
tests/test_adapter_tree.py.)
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lora_func as lf
from tests.models import tiny_model, tokens


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2)
    adapters = []
    for seed in range(2):
        a = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed))
        adapters.append(a.with_params({k: torch.randn(v.shape, generator=g) * 0.3 for k, v in a.params.items()}))
    return model, adapters, tokens(2, 6, seed=1)


def _same(old, new) -> None:
    if hasattr(old, "logits"):  # a model output (a dict too): the logits
        old, new = old.logits, new.logits
    if isinstance(old, dict):
        assert old.keys() == new.keys()
        for k in new:
            _same(old[k], new[k])
        return
    torch.testing.assert_close(old, new, rtol=0, atol=0)


def _old_warns(where: str, old: str, new: str, call):
    with pytest.warns(DeprecationWarning, match=rf"{where}\({old}=\.\.\.\) is deprecated.*{where}\({new}=\.\.\.\)"):
        return call()


def _new_is_silent(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return call()


KEYWORDS = [
    # (function, old keyword, new keyword, value, call(kwargs) given the setup)
    ("adapted_call", "strict", "lazy_only", True, lambda m, a, ids, kw: lf.adapted_call(m, a[0], ids, **kw)),
    ("adapted_call", "safe", "check_finite", True, lambda m, a, ids, kw: lf.adapted_call(m, a[0], ids, merged=True, **kw)),
    ("overlay", "strict", "lazy_only", True, lambda m, a, ids, kw: torch.func.functional_call(m, lf.overlay(lf.base_params(m), a[0], **kw), (ids,))),
    ("overlay", "safe", "check_finite", True, lambda m, a, ids, kw: torch.func.functional_call(m, lf.overlay(lf.base_params(m), a[0], **kw), (ids,))),
    ("merge_overlay", "safe", "check_finite", True, lambda m, a, ids, kw: lf.merge_overlay(lf.base_params(m), a[0], **kw)),
    ("merged_state_dict", "safe", "check_finite", True, lambda m, a, ids, kw: lf.merged_state_dict(m, a[0], **kw)),
    ("mixed_call", "strict", "lazy_only", True, lambda m, a, ids, kw: lf.mixed_call(m, lf.stack(a), torch.tensor([1, 0]), ids, **kw)),
    ("ensemble_call", "strict", "lazy_only", True, lambda m, a, ids, kw: lf.ensemble_call(m, lf.stack(a), ids, **kw)),
]


@pytest.mark.parametrize(("where", "old", "new", "value", "call"), KEYWORDS, ids=[f"{k[0]}-{k[1]}" for k in KEYWORDS])
def test_an_old_keyword_warns_and_gives_the_new_keywords_result(setup, where, old, new, value, call):
    model, adapters, ids = setup
    with torch.no_grad():
        got_new = _new_is_silent(lambda: call(model, adapters, ids, {new: value}))
        got_old = _old_warns(where, old, new, lambda: call(model, adapters, ids, {old: value}))
    _same(got_old, got_new)


@pytest.mark.parametrize(("old", "new"), [("strict", "lazy_only"), ("safe", "check_finite")])
def test_the_old_keywords_of_overlay_mode_and_adapted_warn_and_act_alike(setup, old, new):
    model, adapters, ids = setup
    base = lf.base_params(model)
    with torch.no_grad():
        with lf.overlay_mode(base, adapters[0], **{new: True}):
            want = torch.func.functional_call(model, base, (ids,)).logits
        with _old_warns("overlay_mode", old, new, lambda: lf.overlay_mode(base, adapters[0], **{old: True})):
            got = torch.func.functional_call(model, base, (ids,)).logits
        _same(got, want)
        if old == "strict":
            with lf.adapted(model, adapters[0], merged=False, lazy_only=True):
                want = model(ids).logits
            with _old_warns("adapted", old, new, lambda: lf.adapted(model, adapters[0], merged=False, strict=True)):
                got = model(ids).logits
            _same(got, want)


def test_lazy_only_refuses_where_strict_refused():
    """The behaviour the keyword names: an op without a low-rank path on an adapted weight (GPT-2's
    tied embedding) raises with lazy_only=True under both spellings."""
    model = tiny_model("gpt2")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["lm_head"], r=2, tied="both"), generator=torch.Generator().manual_seed(0))
    base = lf.base_params(model)
    ids = tokens(1, 4, seed=2)
    for keyword in ({"lazy_only": True}, {"strict": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            params = lf.overlay(base, adapter, **keyword)
        with pytest.raises(RuntimeError, match="has no low-rank path"):
            torch.func.functional_call(model, params, (ids,))


def test_plan_steps_warns_and_is_plan_ops(setup):
    model, adapters, _ = setup
    plan = lf.make_plan(model, adapters[0])
    ops = plan.ops(adapters[0])
    with pytest.warns(DeprecationWarning, match=r"Plan\.steps is deprecated.*Plan\.ops"):
        steps = plan.steps(adapters[0])
    assert list(steps) == list(ops) and len(ops) == 4
    assert all(type(steps[k]) is type(ops[k]) for k in ops)


def test_several_adapters_as_a_list_or_as_separate_arguments_give_the_same_adapter(setup):
    model, adapters, ids = setup
    a, b = adapters
    w = torch.tensor([0.7, -0.2])
    pairs = {
        "compose": (lf.compose(a, b), lf.compose([a, b])),
        "combine": (lf.combine([a, b], w), lf.combine(a, b, weights=w)),
        "combine weights=": (lf.combine([a, b], w), lf.combine([a, b], weights=w)),
        "stack": (lf.stack([a, b]), lf.stack(a, b)),
    }
    with torch.no_grad():
        for name, (one, other) in pairs.items():
            assert type(one) is type(other), name
            _same(one.params, other.params)
            if name != "stack":
                _same(lf.adapted_call(model, one, ids), lf.adapted_call(model, other, ids))
    with pytest.raises(TypeError, match="stack\\(\\) expects a list of adapters"):
        lf.stack(a)
    with pytest.raises(TypeError, match="combine\\(\\) needs weights"):
        lf.combine(a, b)
