"""Non-finite values raise with the tensor's name instead of silently producing garbage:
``lora_func.checks.check_finite`` and ``merge_overlay`` / ``overlay`` with ``check_finite=True``."""

from __future__ import annotations

import math

import pytest
import torch

from lora_func.checks import check_finite, non_finite_keys


def test_finite_tensors_of_every_kind_pass():
    check_finite(
        {
            "fp32": torch.randn(3, 4),
            "bf16": torch.randn(5).bfloat16(),
            "fp16": torch.full((2,), 65504.0, dtype=torch.float16),  # the largest finite fp16
            "fp64-scalar": torch.tensor(1e308, dtype=torch.float64),
            "empty": torch.empty(0, 3),
            "int": torch.tensor([2**31 - 1]),
            "bool": torch.tensor([True]),
            "complex": torch.tensor([1 + 2j]),
        },
        "anything",
    )
    assert non_finite_keys({}) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_each_non_finite_value_is_found_in_every_float_dtype(dtype, bad):
    t = torch.zeros(3, 5, dtype=dtype)
    t[2, 4] = bad
    with pytest.raises(FloatingPointError, match=r"step 7: non-finite values in \['w'\]"):
        check_finite({"ok": torch.ones(2, dtype=dtype), "w": t}, "step 7")


def test_the_message_lists_every_offending_key_sorted_with_counts():
    tensors = {
        "z.lora_B": torch.tensor([math.nan, 1.0, math.nan]),
        "a.lora_A": torch.tensor([[math.inf, -math.inf], [0.0, math.nan]]),
        "m.fine": torch.ones(4),
    }
    before = {k: v.clone() for k, v in tensors.items()}
    with pytest.raises(FloatingPointError) as err:
        check_finite(tensors, "gradients")
    message = str(err.value)
    assert "['a.lora_A', 'z.lora_B']" in message and "m.fine" not in message
    assert "a.lora_A (1 NaN, 2 inf of 4)" in message and "z.lora_B (2 NaN, 0 inf of 3)" in message
    assert "clip" in message  # says how to fix it
    assert all(torch.allclose(tensors[k], before[k], rtol=0, atol=0, equal_nan=True) for k in tensors), "inputs changed"
    assert non_finite_keys(tensors) == ["a.lora_A", "z.lora_B"]


def test_works_inside_grad_and_refuses_clearly_inside_vmap():
    def loss(x):
        check_finite({"x": x}, "inside grad")
        return (x**2).sum()

    assert torch.equal(torch.func.grad(loss)(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.raises(FloatingPointError, match=r"inside grad: non-finite values in \['x'\]"):
        torch.func.grad(loss)(torch.tensor([1.0, math.nan]))
    with pytest.raises(RuntimeError, match="'x' is batched by torch.func.vmap"):
        torch.func.vmap(loss)(torch.ones(2, 3))


def test_a_tensor_that_requires_grad_is_checked_without_autograd_history():
    w = torch.tensor([1.0, math.inf], requires_grad=True)
    with pytest.raises(FloatingPointError, match=r"\['w'\]"):
        check_finite({"w": w * 2}, "forward")


def test_the_message_names_at_most_eight_keys_and_counts_the_rest():
    tensors = {f"layer{i:02d}.lora_B": torch.tensor([math.nan]) for i in range(20)}
    with pytest.raises(FloatingPointError) as err:
        check_finite(tensors, "gradients at step 4")
    message = str(err.value)
    assert "layer07.lora_B (1 NaN, 0 inf of 1)" in message and "layer08" not in message
    assert "and 12 more" in message and len(message) < 1000


def _lora_on(model_kind: str, dtype: torch.dtype = torch.float32):
    import lora_func as lf
    from tests.models import tiny_model

    model = tiny_model(model_kind, dtype=dtype)
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0))
    return model, adapter


def test_check_finite_merging_names_the_non_finite_adapter_tensor_and_leaves_the_model_alone():
    import lora_func as lf
    from tests.contract_helpers import assert_unchanged, snapshot
    from tests.models import tokens

    model, adapter = _lora_on("llama")
    snap = snapshot(model)
    key = "model.layers.1.self_attn.v_proj.lora_B"
    params = dict(adapter.params)
    params[key] = params[key].detach().clone()
    params[key][3, 1] = math.nan
    bad = adapter.with_params(params)
    base = lf.base_params(model)
    calls = {
        "merge_overlay": lambda **check: lf.merge_overlay(base, bad, **check),
        "overlay": lambda **check: lf.overlay(base, bad, **check),
        "overlay_mode": lambda **check: lf.overlay_mode(base, bad, **check),
        "merge": lambda **check: lf.merged_state_dict(model, bad, **check),
        "adapted_call merged": lambda **check: lf.adapted_call(model, bad, tokens(), merged=True, **check),
        "adapted_call lazy": lambda **check: lf.adapted_call(model, bad, tokens(), **check),
    }
    # Without check_finite=True (the default) nothing is checked: the NaN silently reaches the outputs,
    # which is what the option is for.
    for name, call in calls.items():
        call()
    assert torch.isnan(lf.adapted_call(model, bad, tokens(), merged=True).logits).any()
    for name, call in calls.items():
        with pytest.raises(FloatingPointError, match=rf"adapter tensors: non-finite values in \['{key}'\]: {key} \(1 NaN"):
            call(check_finite=True)
            pytest.fail(f"{name}(check_finite=True) did not raise")
    assert_unchanged(model, snap)
    lf.merge_overlay(base, adapter, check_finite=True)  # a finite adapter passes


def test_check_finite_merging_catches_a_merge_that_overflows_a_half_precision_base():
    import lora_func as lf

    model, adapter = _lora_on("llama", torch.float16)
    base = lf.base_params(model)
    key = "model.layers.0.self_attn.q_proj"
    params = {k: v.detach().clone() for k, v in adapter.params.items()}
    params[f"{key}.lora_A"].fill_(300.0)  # finite fp32 adapter tensors ...
    params[f"{key}.lora_B"].fill_(300.0)  # ... whose product overflows fp16 (> 65504)
    big = adapter.with_params(params)
    with pytest.raises(FloatingPointError, match=rf"merged weights: non-finite values in \['{key}.weight'\]"):
        lf.merge_overlay(base, big, check_finite=True)
    assert torch.isinf(lf.merge_overlay(base, big)[f"{key}.weight"]).any()  # unsafe: silently inf
