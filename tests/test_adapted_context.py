"""lora_func.adapted(): a temporary reparametrization for stateful APIs (generate), always undone."""

from __future__ import annotations

import pytest
import torch

import lora_func as lf
from tests.contract_helpers import assert_unchanged, perturbed, snapshot
from tests.models import tiny_model, tokens


@pytest.fixture(params=["llama", "gpt2"])
def model_and_adapter(request):
    model = tiny_model(request.param)
    targets = ["c_attn"] if request.param == "gpt2" else ["q_proj", "v_proj"]
    a = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=2), generator=torch.Generator().manual_seed(0)), 0.3)
    b = perturbed(lf.init_adapter(model, lf.AdapterSpec("ia3", targets=targets), generator=torch.Generator().manual_seed(1)), 0.3)
    return model, lf.compose(a, b)


@pytest.mark.parametrize("merged", [True, False])
def test_inside_the_block_the_model_is_adapted_and_restored_after(model_and_adapter, merged):
    model, adapter = model_and_adapter
    ids = tokens(2, 9, seed=1)
    snap = snapshot(model)
    plain = model(ids).logits.detach()
    want = lf.adapted_call(model, adapter, ids).logits.detach()
    with torch.no_grad(), lf.adapted(model, adapter, merged=merged):
        got = model(ids).logits
    # merged (inside the block) against lazy (adapted_call): fp32 round-off of two different
    # orders of summation, up to ~1e-5 on GPT-2's logits depending on the CPU's kernels; the
    # adapter's effect is 1000x larger.
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    assert (got - plain).abs().max() > 1e-2
    assert_unchanged(model, snap)
    torch.testing.assert_close(model(ids).logits.detach(), plain, atol=0, rtol=0)


def test_generate_inside_equals_a_greedy_loop_over_adapted_call(model_and_adapter):
    model, adapter = model_and_adapter
    prompt = tokens(1, 4, seed=2)
    with torch.no_grad(), lf.adapted(model, adapter):
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            nxt = lf.adapted_call(model, adapter, seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(generated, seq)


def test_restored_when_the_block_raises(model_and_adapter):
    model, adapter = model_and_adapter
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"), lf.adapted(model, adapter):
        raise RuntimeError("boom")
    assert_unchanged(model, snap)
