"""LoRA's inference path (``lora_activation_form`` under ``torch.no_grad``: one ``addmm`` with
the scale on the product, no gradient layouts): the same outputs as the weight form (merged
``W_eff``, an independent formula), as the training path, on both routes and layer kinds; and
it leaves dropout to training steps only."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import lora_func as lf
from tests.models import DEFAULT_TARGETS, tiny_model, tokens


def _perturbed(model, kind: str, dtype: torch.dtype, **options) -> lf.Adapter:
    spec = lf.AdapterSpec("lora", targets=DEFAULT_TARGETS[kind], r=4, alpha=12.0, dtype=dtype, **options)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(7)
    return adapter.with_params({k: torch.randn(v.shape, generator=g, dtype=dtype).requires_grad_(True) for k, v in adapter.params.items()})


@pytest.mark.parametrize("route", ["overlay", "module"])
@pytest.mark.parametrize("rslora", [False, True], ids=["alpha/r", "rslora"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_no_grad_output_equals_the_merged_weight_in_fp64(kind, rslora, route):
    model = tiny_model(kind, dtype=torch.float64)
    adapter = _perturbed(model, kind, torch.float64, use_rslora=rslora)
    ids = tokens()
    base = lf.base_params(model)
    with torch.no_grad():
        oracle = functional_call(model, lf.merge_overlay(base, adapter), (ids,)).logits
        got = lf.adapted_call(model, adapter, ids, route=route).logits
        plain = model(ids).logits
    assert (oracle - plain).abs().max() > 1e-2  # the adapter moves the output
    torch.testing.assert_close(got, oracle, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("route", ["overlay", "module"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_no_grad_output_equals_the_training_path_in_fp32(kind, route):
    model = tiny_model(kind)
    adapter = _perturbed(model, kind, torch.float32)
    ids = tokens()
    with torch.no_grad():
        inference = lf.adapted_call(model, adapter, ids, route=route).logits
    training = lf.adapted_call(model, adapter, ids, route=route).logits
    assert training.requires_grad
    torch.testing.assert_close(inference, training.detach(), rtol=1e-5, atol=1e-5)


def test_dropout_still_acts_in_a_no_grad_training_step():
    model = tiny_model("llama").train()
    adapter = _perturbed(model, "llama", torch.float32, dropout=0.5)
    ids = tokens()
    with torch.no_grad():
        torch.manual_seed(3)
        dropped = lf.adapted_call(model, adapter, ids).logits
        model.eval()
        kept = lf.adapted_call(model, adapter, ids).logits
        model.train()
    torch.manual_seed(3)
    with_grad = lf.adapted_call(model, adapter, ids).logits.detach()
    assert (dropped - kept).abs().max() > 1e-3
    torch.testing.assert_close(dropped, with_grad, rtol=1e-5, atol=1e-5)
