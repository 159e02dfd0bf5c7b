"""Trainable tokens against peft 0.21 (``TrainableTokensConfig``; ``LoraConfig(trainable_token_indices=...)``)
on float64 tiny models: a peft checkpoint of an untied embedding, rows perturbed, loads with
load_peft and gives peft's logits and gradients; save_peft output loads in peft; the init is
peft's (a copy of the rows, or its N(0, 1) draws from the same seed); GPT-2's tied head follows
the embedding with ``tied="both"`` as peft ties it; a LoRA with trainable token indices equals the
composition of ``lora`` and ``trainable_tokens``."""

from __future__ import annotations

import copy
import json
import warnings

import peft
import pytest
import torch

import lora_func as lf
from tests.bank_oracle import rmsnorm_in_input_dtype
from tests.lora_family_oracle import ALPHA, R, TARGETS, compare, model64, perturb, reloaded_in_peft, rel, saved
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

TOKENS = [15, 6, 10, 40]  # unsorted, distinct
# every listed token in both rows, beside others (a row of the table used twice, a token used by none)
IDS = torch.tensor([[15, 6, 3, 10, 40, 22, 6, 9, 30], [40, 15, 6, 11, 12, 10, 7, 8, 3]])


def trainable_tokens(model, *, init_weights: bool = True, **extra):
    config = peft.TrainableTokensConfig(token_indices=TOKENS, init_weights=init_weights, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(copy.deepcopy(model), config).eval()


@pytest.fixture(scope="module")
def model():
    return model64()


def test_peft_checkpoint_gives_peft_logits_and_gradients_and_saves_back(model, tmp_path):
    pm = perturb(trainable_tokens(model, target_modules=["embed_tokens"]))
    adapter = saved(pm, tmp_path / "peft", model)
    assert adapter.spec.variant == "trainable_tokens" and adapter.spec.option("token_indices") == tuple(TOKENS)
    assert adapter.buffers["model.embed_tokens.token_indices"].tolist() == TOKENS
    compare(model, pm, adapter, ids=IDS)
    lf.save_peft(adapter, tmp_path / "ours", model=model)
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["peft_type"] == "TRAINABLE_TOKENS" and config["token_indices"] == TOKENS
    ids = tokens(2, 8, seed=5)
    with torch.no_grad():
        assert rel(reloaded_in_peft(model, tmp_path / "ours")(ids).logits, pm(ids).logits) <= 1e-12


@pytest.mark.parametrize("init_weights", [True, False])
def test_init_is_peft_s(init_weights):
    model = tiny_model("llama")
    torch.manual_seed(9)
    pm = trainable_tokens(model, init_weights=init_weights, target_modules=["embed_tokens"])
    spec = lf.AdapterSpec("trainable_tokens", targets=["embed_tokens"], token_indices=TOKENS, init_weights=init_weights)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(9))
    want = pm.base_model.model.model.embed_tokens.trainable_tokens_delta["default"]
    assert torch.equal(adapter.params["model.embed_tokens.trainable_tokens_delta"], want)
    ids = tokens(2, 8, seed=6)
    if init_weights:
        assert torch.equal(lf.adapted_call(model, adapter, ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match=r"token_indices \[61\] are outside the layer's 61 tokens"):
        lf.init_adapter(model, lf.AdapterSpec("trainable_tokens", targets=["embed_tokens"], token_indices=[3, 61]))
    with pytest.raises(ValueError, match="must be distinct token indices"):
        lf.AdapterSpec("trainable_tokens", targets=["embed_tokens"], token_indices=[3, 3])


def test_a_tied_head_follows_the_embedding_as_peft_ties_it(tmp_path):
    """GPT-2's lm_head is tied to wte: peft puts a tied copy of the adapter on the head; lora_func
    adapts the shared table under both names (tied="both"): peft's logits and gradient (the sum of
    both uses). peft's checkpoint holds the head's copy too, which load_peft does not read yet
    (its tied-module check)."""
    gpt2 = tiny_model("gpt2", dtype=torch.float64)
    pm = perturb(trainable_tokens(gpt2))
    spec = lf.AdapterSpec("trainable_tokens", targets=["wte"], token_indices=TOKENS, tied="both", dtype=torch.float64)
    adapter = lf.init_adapter(gpt2, spec)
    assert adapter.layers[0].target.tied_keys == ("lm_head.weight",)
    delta = pm.base_model.model.transformer.wte.trainable_tokens_delta["default"]
    adapter = adapter.with_params({"transformer.wte.trainable_tokens_delta": delta.detach().clone().requires_grad_(True)})
    ids = IDS
    want = pm(ids).logits
    ce_loss(want, ids).backward()
    for merged in (False, True):
        got = lf.adapted_call(gpt2, adapter, ids, merged=merged).logits
        assert rel(got, want) <= 1e-12
        (grad,) = torch.autograd.grad(ce_loss(got, ids), [adapter.params["transformer.wte.trainable_tokens_delta"]])
        assert rel(grad, delta.grad) <= 1e-9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tied"):
        lf.load_peft(tmp_path, gpt2)


def test_lora_with_trainable_token_indices_is_the_composition(tmp_path):
    """peft's LoraConfig(trainable_token_indices=...) is lora on its targets composed with
    trainable_tokens on the embedding: equal logits and per-tensor gradients (float64). load_peft
    refuses the config itself for now (one LoraConfig read as two variants)."""
    model = rmsnorm_in_input_dtype(tiny_model("llama", dtype=torch.float64))
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, trainable_token_indices=TOKENS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = perturb(peft.get_peft_model(copy.deepcopy(model), config).eval())
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=R, alpha=ALPHA, dtype=torch.float64))
    tt = lf.init_adapter(model, lf.AdapterSpec("trainable_tokens", targets=["embed_tokens"], token_indices=TOKENS, dtype=torch.float64))
    named = dict(pm.named_parameters())
    # peft's name of each tensor: LoRA's factors, and the token rows under the embedding's token_adapter
    where = {k: f"base_model.model.{k}.default.weight" for k in lora.params}
    where["model.embed_tokens.trainable_tokens_delta"] = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"
    lora = lora.with_params({k: named[where[k]].detach().clone().requires_grad_(True) for k in lora.params})
    tt = tt.with_params({k: named[where[k]].detach().clone().requires_grad_(True) for k in tt.params})
    both = lf.compose(lora, tt)
    ids = IDS
    want = pm(ids).logits
    ce_loss(want, ids).backward()
    params = {**lora.params, **tt.params}
    got = lf.adapted_call(model, both, ids).logits
    assert rel(got, want) <= 1e-9
    grads = torch.autograd.grad(ce_loss(got, ids), list(params.values()))
    for key, grad in zip(params, grads, strict=True):
        want_grad = named[where[key]].grad
        assert want_grad.abs().max() > 0 and rel(grad, want_grad) <= 1e-9, key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="trainable_token_indices"):
        lf.load_peft(tmp_path, model)


def test_token_indices_are_distinct_whole_numbers_from_zero():
    lf.AdapterSpec("trainable_tokens", targets=["embed_tokens"], token_indices=[0, 4])
    for bad in ([-1, 2], [True], [1.5], ["3"]):
        with pytest.raises(ValueError, match="token_indices"):
            lf.AdapterSpec("trainable_tokens", targets=["embed_tokens"], token_indices=bad)


def test_an_adapter_in_another_dtype_than_the_base_and_its_init_dtype():
    """float64 and bf16 token rows on a float32 head (nn.Linear), both overlays, against the
    contract row's W_eff; init asked for float64 on a float32 weight gives float64 rows, each init."""
    from lora_func.variants import trainable_tokens
    from tests.variant_checks import assert_other_adapter_dtype, init_params

    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("trainable_tokens", 6, 8, adapter_dtype=dtype, token_indices=[0, 5, 2], init_weights=False)
    for init_weights in (True, False):
        params, buffers = init_params(trainable_tokens, "trainable_tokens", 1, 6, 8, token_indices=[0, 5, 2], init_weights=init_weights)
        assert params["trainable_tokens_delta"].shape == (3, 6) and buffers["token_indices"].tolist() == [0, 5, 2]


def test_an_embedding_s_rows_in_another_dtype_than_the_base():
    """float64 and bf16 token rows on a float32 nn.Embedding, both overlays: the listed rows are
    the adapter's, rounded to float32, the others the base's (an explicit row replacement)."""
    from tests.one_layer import one_layer

    model = one_layer("linear", 4, 3, True, torch.float32, 0)
    ids = torch.tensor([[0, 5, 2, 7, 5]])
    for dtype in (torch.float64, torch.bfloat16):
        spec = lf.AdapterSpec("trainable_tokens", targets=["emb"], token_indices=[5, 0], init_weights=False, dtype=dtype)
        adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1))
        (delta,) = adapter.params.values()
        table = model.emb.weight.detach().clone()
        table[[5, 0]] = delta.float()
        want = model.proj(torch.nn.functional.embedding(ids, table))
        base = lf.base_params(model)
        for make in (lf.overlay, lf.merge_overlay):
            got = torch.func.functional_call(model, make(base, adapter), (ids,))
            assert got.dtype == torch.float32, (dtype, make.__name__)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{dtype} {make.__name__}")
