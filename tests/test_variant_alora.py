"""aLoRA against peft 0.21 (``LoraConfig(alora_invocation_tokens=[...], task_type="CAUSAL_LM")``) on a
float64 tiny Llama: peft's checkpoint with perturbed trainables loads with load_peft; with the offsets
peft computes (the invocation at different places per row, absent in one), a batch through the mixed
route (one invoked member per row) and each row alone give peft's logits, and the batch peft's
per-tensor gradients; greedy generation with the KV cache gives peft's tokens; save_peft output loads
in peft; an adapter not yet invoked is LoRA."""

from __future__ import annotations

import json

import pytest
import torch

import lora_func as lf
from lora_func.variants import alora
from tests.lora_family_oracle import ALPHA, R, TARGETS, lf_name, model64, peft_lora, reloaded_in_peft, rel, saved
from tests.peft_helpers import ce_loss

INVOCATION = [5, 9, 13]
# row 0: invoked at 3 (and a partial match before), row 1: twice (the last counts), row 2: never
IDS = torch.tensor(
    [
        [4, 5, 9, 5, 9, 13, 20, 21, 22, 23],
        [5, 9, 13, 30, 31, 32, 5, 9, 13, 40],
        [5, 9, 14, 13, 50, 51, 52, 53, 54, 55],
    ]
)


@pytest.fixture(scope="module")
def model():
    return model64()


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    pm = peft_lora(model, alora_invocation_tokens=INVOCATION, task_type="CAUSAL_LM", use_rslora=True)
    return pm, saved(pm, tmp_path_factory.mktemp("alora") / "peft", model)


def test_offsets_are_peft_s():
    from peft.tuners.lora.variants import calculate_alora_offsets

    class Config:
        alora_invocation_tokens = INVOCATION

    want = [0 if o is None else o for o in calculate_alora_offsets({"default": Config()}, "default", IDS)]
    assert alora.offsets(IDS, INVOCATION).tolist() == want == [7, 4, 0]
    assert alora.offsets(IDS[:, :2], INVOCATION).tolist() == [0, 0, 0]


def test_invoked_rows_give_peft_s_logits_and_gradients(model, trained):
    pm, adapter = trained
    assert adapter.spec.variant == "alora" and adapter.spec.option("invocation_tokens") == tuple(INVOCATION)
    pm.zero_grad()
    want = pm(input_ids=IDS).logits
    ce_loss(want, IDS).backward()
    expected = {lf_name(n): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
    members = [alora.invoked(adapter.with_params(params), o) for o in alora.offsets(IDS, INVOCATION)]
    got = lf.mixed_call(model, members, torch.arange(len(members)), IDS, batching="layers").logits
    assert rel(got, want) < 1e-9
    assert torch.equal(want[2], model(IDS[2:]).logits[0]), "a row without the invocation is the base"
    assert (want[0, 3:] - model(IDS[:1]).logits[0, 3:]).abs().max() > 1e-2 and torch.allclose(want[0, :3], model(IDS[:1]).logits[0, :3])
    grads = torch.autograd.grad(ce_loss(got, IDS), list(params.values()))
    assert sorted(expected) == sorted(params)
    for key, grad in zip(params, grads, strict=True):
        assert expected[key].abs().max() > 0 and rel(grad, expected[key]) < 1e-9, key
    for row, member in enumerate(members):  # each row alone, through adapted_call
        assert rel(lf.adapted_call(model, member, IDS[row : row + 1]).logits[0], want[row]) < 1e-9


def test_greedy_generation_with_the_cache_equals_peft_s(model, trained):
    pm, adapter = trained
    prompt = IDS[:2, :8]  # row 0 invoked at 3, row 1 at 0
    with torch.no_grad():
        want = pm.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
        members = [alora.invoked(adapter, o) for o in alora.offsets(prompt, INVOCATION)]
        with lf.mixed_adapted(model, members, torch.arange(2)):
            got = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_save_peft_loads_in_peft_and_uninvoked_is_lora(model, trained, tmp_path):
    pm, adapter = trained
    lf.save_peft(adapter, tmp_path, task_type="CAUSAL_LM")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["alora_invocation_tokens"] == INVOCATION
    with torch.no_grad():
        assert rel(reloaded_in_peft(model, tmp_path)(input_ids=IDS).logits, pm(input_ids=IDS).logits) <= 1e-12
    assert int(adapter.buffers["<shared>.alora_offset"]) == alora.EVERY_TOKEN
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=R, alpha=ALPHA, use_rslora=True, dtype=torch.float64))
    lora = lora.with_params({k: v.detach() for k, v in adapter.params.items()})
    for merged in (False, True):
        assert rel(lf.adapted_call(model, adapter, IDS, merged=merged).logits, lf.adapted_call(model, lora, IDS).logits) < 1e-12
    off = alora.invoked(adapter, 0)
    assert torch.equal(lf.adapted_call(model, off, IDS).logits, model(IDS).logits)
    assert torch.equal(lf.adapted_call(model, off, IDS, merged=True).logits, model(IDS).logits)


@pytest.mark.parametrize(
    "invocation",
    [[9], [13], [5, 9, 13, 20, 21, 22, 23, 24, 25, 26, 27], [4, 5, 9, 5, 9, 13, 20, 21, 22, 23]],
    ids=["one-token", "one-token-twice", "longer-than-the-input", "the-whole-first-row"],
)
def test_offsets_are_peft_s_at_the_edges(invocation):
    """One-token invocations, one longer than the input (never found), one as long as the input
    (found at 0 in row 0: the whole row adapted)."""
    from peft.tuners.lora.variants import calculate_alora_offsets

    class Config:
        alora_invocation_tokens = invocation

    want = [0 if o is None else o for o in calculate_alora_offsets({"default": Config()}, "default", IDS)]
    assert alora.offsets(IDS, invocation).tolist() == want
    assert any(want) == (len(invocation) <= IDS.shape[1])


def test_no_invocation_tokens_adapt_every_token_of_a_long_input():
    """Without invocation tokens (and uninvoked, the adapter's default) every token is adapted,
    however long the input: the lazy path equals the merged LoRA on 300 tokens."""
    from tests.one_layer import one_layer, perturbed, run

    assert (alora.offsets(IDS, []) >= IDS.shape[1]).all()
    model = one_layer("linear", 4, 3, True, torch.float64, 0)
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("alora", ["proj"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(1)), seed=2, scale=0.5)
    x = torch.randn(1, 300, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    base = lf.base_params(model)
    lazy, merged = (run(model, make(base, adapter), x) for make in (lf.overlay, lf.merge_overlay))
    assert (merged - model(x=x)).abs().min() > 0
    torch.testing.assert_close(lazy, merged, rtol=1e-12, atol=1e-12)


def test_one_token_rows_under_vmap_are_the_batched_rows():
    """``vmap`` over the tokens hands each layer a 1-D input (one token): adapted as one token,
    the same as the batched call."""
    from tests.one_layer import one_layer, perturbed, run

    model = one_layer("linear", 4, 3, True, torch.float64, 0)
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("alora", ["proj"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(1)), seed=2, scale=0.5)
    params = lf.overlay(lf.base_params(model), adapter)
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = run(model, params, x)
    assert (want - model(x=x)).abs().min() > 0
    torch.testing.assert_close(torch.func.vmap(lambda row: run(model, params, row))(x), want, rtol=1e-12, atol=1e-12)


def test_invocation_tokens_are_whole_numbers_from_zero():
    lf.AdapterSpec("alora", targets=["q_proj"], invocation_tokens=[0, 7])
    for bad in ([-1], [True], [2.0], ["5"]):
        with pytest.raises(ValueError, match="invocation_tokens"):
            lf.AdapterSpec("alora", targets=["q_proj"], invocation_tokens=bad)


def test_a_one_token_step_invoked_at_its_last_token_is_adapted_on_both_paths():
    """Offset 1 (the invocation ends the input: a decoding step of one token): the merged and the
    lazy path both adapt it; offset 0 adapts neither."""
    from tests.one_layer import one_layer, perturbed, run

    model = one_layer("linear", 4, 3, True, torch.float64, 0)
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("alora", ["proj"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(1)), seed=2, scale=0.5)
    x = torch.randn(1, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    base = lf.base_params(model)
    for offset in (1, 0):
        member = alora.invoked(adapter, offset)
        lazy, merged = (run(model, make(base, member), x) for make in (lf.overlay, lf.merge_overlay))
        torch.testing.assert_close(lazy, merged, rtol=1e-12, atol=1e-12)
        assert torch.equal(lazy, model(x=x)) == (offset == 0)
