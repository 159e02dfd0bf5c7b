"""Adapter dropout (peft's ``lora_dropout``) for lora, dora, pissa and eva: it acts on the
low-rank path's input in training steps only, as peft's layers do; peft (same values, same RNG
seed) is the oracle for LoRA and DoRA."""

from __future__ import annotations

import pytest
import torch

import lora_func as lf
from tests.contract_helpers import calibration_batches, perturbed
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss, copy_into_peft
from tests.tolerance import assert_close_to_scale, scale_of

VARIANTS = ("lora", "dora", "pissa", "eva")
P = 0.3


def build(model, variant: str, dropout: float) -> lf.Adapter:
    spec = lf.AdapterSpec(variant, targets=["q_proj", "v_proj"], r=4, alpha=8, dropout=dropout)
    adapter = lf.init_adapter(
        model, spec, generator=torch.Generator().manual_seed(0), calibration=calibration_batches() if variant == "eva" else None
    )
    return perturbed(adapter, 0.3)


def logits(model, adapter, ids, seed=0, **kwargs):
    torch.manual_seed(seed)
    return lf.adapted_call(model, adapter, ids, **kwargs).logits


@pytest.mark.parametrize("route", ["overlay", "module"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_dropout_acts_in_training_steps_only(variant, route):
    model = tiny_model("llama")
    with_dropout = build(model, variant, P)
    without = build(model, variant, 0.0).with_params(with_dropout.params)  # the same tensors, no dropout
    ids = tokens()
    model.eval()
    assert torch.equal(logits(model, with_dropout, ids, route=route), logits(model, without, ids, route=route))
    model.train()  # the tiny model has no dropout of its own
    plain = logits(model, without, ids, route=route)
    dropped = logits(model, with_dropout, ids, route=route)
    assert (dropped - plain).abs().max() > 1e-3, "dropout must change a training step's output"
    assert torch.equal(logits(model, with_dropout, ids, route=route), dropped), "a seeded step is reproducible"
    assert not torch.equal(logits(model, with_dropout, ids, seed=1, route=route), dropped)
    # The merged path has no dropout (as peft's merged layers): W_eff is the same in training.
    torch.testing.assert_close(logits(model, with_dropout, ids, merged=True, route=route), plain, atol=1e-5, rtol=0)


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` in get_peft_model.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_a_training_step_equals_peft_with_the_same_seed(variant):
    import peft

    model = tiny_model("llama").train()
    adapter = build(model, variant, P)
    ids = tokens()
    ours = logits(model, adapter, ids)
    grads = torch.func.grad(lambda p: ce_loss(logits(model, adapter.with_params(p), ids), ids))(adapter.params)
    pm = peft.get_peft_model(
        tiny_model("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=P, use_dora=variant == "dora")
    ).train()
    layers = copy_into_peft(pm, adapter)
    assert sorted(layers) == sorted({k.rsplit(".", 1)[0] for k in adapter.params})
    torch.manual_seed(0)
    theirs = pm(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    ce_loss(theirs, ids).backward()
    for key, module in layers.items():
        torch.testing.assert_close(grads[f"{key}.lora_A"], module.lora_A["default"].weight.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(grads[f"{key}.lora_B"], module.lora_B["default"].weight.grad, atol=1e-5, rtol=1e-4)


def test_vmap_over_a_stack_honours_randomness():
    model = tiny_model("llama").train()
    adapter = build(model, "lora", P)
    stacked = lf.stack([adapter, adapter])
    ids = tokens()

    def run(a):
        return lf.adapted_call(model, a, ids).logits

    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(run)(stacked)
    torch.manual_seed(0)
    different = torch.func.vmap(run, randomness="different")(stacked)
    torch.manual_seed(0)
    same = torch.func.vmap(run, randomness="same")(stacked)
    # The same masks give the same members up to the kernels' round-off (two rows of one batched
    # GEMM need not round alike on every CPU); different masks move the logits by O(1).
    assert (different[0] - different[1]).abs().max() > 1e-2 * scale_of(different[1])
    assert_close_to_scale(same[0], same[1], msg="randomness='same'")
    model.eval()  # no dropout outside training: vmap needs no randomness at all
    torch.func.vmap(run)(stacked)


def test_dropout_must_be_a_probability():
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        lf.AdapterSpec("lora", targets=["q_proj"], dropout=1.0)
