"""peft's bias training (``bias="all"`` / ``bias="lora_only"``) against HF peft 0.21, float64.

In lora_func a trained bias is an ``ln_tuning`` part with ``weight=False`` (``ln_bias``, the
layer's weight stays the base's), composed before the method's part: pure (overlaid for the call,
never assigned), stackable, saved by ``save_peft`` as peft's config ``bias`` and bias keys
(``<module>.base_layer.bias`` on a LoRA target, ``<module>.bias`` elsewhere). Each case relative
1e-9: ``load_peft`` of peft's perturbed checkpoint gives peft's logits and every tensor's gradient
(the biases' included); ``save_peft`` of an adapter built with ``init_adapter`` loads in peft with
lora_func's logits; K stacked members under ``vmap`` equal a loop; per-example gradients equal a loop.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch.func import grad, vmap

import lora_func as lf
from lora_func.targeting import biased_modules
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

# bias, modules_to_save: "all" beside a trained copy of the final norm (whose bias is the copy's)
CASES = {"all": ["ln_f"], "lora_only": None}


def _gpt2():
    return tiny_model("gpt2", dtype=torch.float64)


def _close(got, want, what, rtol=1e-9):
    got, want = got.detach(), want.detach()
    scale = want.abs().max().clamp_min(1e-30)
    assert (got - want).abs().max() <= rtol * scale, f"{what}: off by {float((got - want).abs().max() / scale):.2e} relative"


def _perturbed(adapter, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return adapter.with_params({k: v.detach() + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    bias = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LoraConfig(r=2, lora_alpha=6, target_modules=["c_attn"], bias=bias, modules_to_save=CASES[bias])
        peft_model = get_peft_model(_gpt2(), config).eval()
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, p in sorted(peft_model.named_parameters()):
                if p.requires_grad:
                    p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        path = tmp_path_factory.mktemp(f"bias_{bias}")
        peft_model.save_pretrained(path)
    model = _gpt2()
    return bias, peft_model, model, lf.load_peft(path, model), tokens(2, 8)


def test_load_peft_gives_peft_s_logits_and_every_gradient(case, tmp_path):
    bias, peft_model, model, adapter, ids = case
    parts = {leaf.spec.variant: leaf for leaf in lf.adapter.leaf_adapters(adapter)}
    trained = sorted(layer.target.module for leaf in lf.adapter.leaf_adapters(adapter) if dict(leaf.spec.options).get("weight") is False for layer in leaf.layers)
    # peft's own choice of trained biases is the oracle
    want_biases = sorted(
        n.removeprefix("base_model.model.").removesuffix(".bias").removesuffix(".base_layer")
        for n, p in peft_model.named_parameters()
        if p.requires_grad and n.endswith(".bias") and "modules_to_save" not in n and "original_module" not in n
    )
    assert trained == want_biases and len(trained) == (12 if bias == "all" else 2)
    assert "lora" in parts
    want = peft_model(ids).logits
    assert (want - model(ids).logits).abs().max() > 1e-2
    for route in ("overlay", "module"):
        for merged in (False, True):
            _close(lf.adapted_call(model, adapter, ids, route=route, merged=merged).logits, want, f"{route} merged={merged}")
    # the biases matter: without them the logits are another
    without = lf.compose(*[p for p in adapter.parts if dict(p.spec.options).get("weight") is not False])
    assert (lf.adapted_call(model, without, ids).logits - want).abs().max() > 1e-3

    peft_model.zero_grad()
    ce_loss(peft_model(ids).logits, ids).backward()
    # (bias="all" also marks the wrapper's unused original_module.bias trainable: it gets no gradient)
    grads = {n.replace(".modules_to_save.default", "").replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    got = grad(lambda params: ce_loss(lf.adapted_call(model, adapter.with_params(params), ids).logits, ids))(dict(adapter.params))
    lf.save_peft(adapter.with_params(got), tmp_path, model=model)
    as_peft = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(as_peft) == sorted(grads)
    assert sum(k.endswith("bias") for k in grads) == len(trained) + (1 if bias == "all" else 0)
    for key, g in grads.items():
        assert g.abs().max() > 0, key
        _close(as_peft[key], g, key)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["bias"] == bias
    assert torch.equal(model.transformer.h[0].attn.c_attn.bias, _gpt2().transformer.h[0].attn.c_attn.bias)


def _built(model, bias):
    """LoRA on c_attn with trained biases built by init_adapter: every bias ("all") or the
    LoRA layers' ("lora_only"), perturbed."""
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["c_attn"], r=2, alpha=6, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    targets = biased_modules(model) if bias == "all" else ["c_attn"]
    biases = lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=targets, dtype=torch.float64, weight=False))
    assert all(k.endswith("ln_bias") for k in biases.params)
    return _perturbed(lf.compose(biases, lora), 3)


@pytest.mark.parametrize("bias", sorted(CASES))
def test_save_peft_of_init_adapter_biases_loads_in_peft(bias, tmp_path):
    model, ids = _gpt2(), tokens(2, 8)
    adapter = _built(model, bias)
    want = lf.adapted_call(model, adapter, ids).logits
    lf.save_peft(adapter, tmp_path, model=model)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["bias"] == bias
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(_gpt2(), tmp_path).eval()
    _close(loaded(ids).logits, want, "peft on save_peft")
    again = lf.load_peft(tmp_path, _gpt2())
    assert sorted(again.params) == sorted(adapter.params)
    assert all(torch.equal(again.params[k], t) for k, t in adapter.params.items())


def test_trained_biases_stack_under_vmap_and_give_per_example_gradients():
    model, ids = _gpt2(), tokens(2, 8)
    base = _built(model, "all")
    members = [_perturbed(base, seed) for seed in (11, 12, 13)]
    got = vmap(lambda a: lf.adapted_call(model, a, ids).logits)(lf.stack(members))
    for k, member in enumerate(members):
        _close(got[k], lf.adapted_call(model, member, ids).logits, f"member {k}")
    assert (got[0] - got[1]).abs().max() > 1e-3

    def example_loss(params, x):
        return ce_loss(lf.adapted_call(model, base.with_params(params), x[None]).logits, x[None])

    per_example = vmap(grad(example_loss), in_dims=(None, 0))(dict(base.params), ids)
    bias_key = next(k for k in per_example if k.endswith("h.1.mlp.c_fc.ln_bias"))
    for i in range(2):
        single = grad(example_loss)(dict(base.params), ids[i])
        for key, tensor in single.items():
            _close(per_example[key][i], tensor, f"example {i} {key}")
    assert (per_example[bias_key][0] - per_example[bias_key][1]).abs().max() > 0


def test_biases_peft_cannot_train_are_refused(tmp_path):
    model = _gpt2()
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["c_attn"], r=2))
    some = lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=["ln_1"], weight=False))
    with pytest.raises(ValueError, match=r"trains the biases of \['transformer.h.0.ln_1', 'transformer.h.1.ln_1'\].*bias='all'"):
        lf.save_peft(lf.compose(some, lora), tmp_path / "a", model=model)
    with pytest.raises(ValueError, match=r"trains only biases"):
        lf.save_peft(some, tmp_path / "b", model=model)
    assert lf.io.peft_problems(lf.compose(some, lora), model=model)
    llama = tiny_model("llama", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weight=False: this layer has no bias"):
        lf.init_adapter(llama, lf.AdapterSpec("ln_tuning", targets=["embed_tokens"], weight=False))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_trained_biases_never_share_the_base_storage():
    """A trained bias in the base's own dtype is a copy: an in-place optimiser step on it leaves
    the model's bias as it was (``bias.to(dtype)`` alone would return the base's tensor)."""
    model = _gpt2()
    adapter = lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=["c_fc"], weight=False, dtype=torch.float64))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for key, tensor in adapter.params.items():
        bias = model.get_submodule(key.removesuffix(".ln_bias")).bias
        assert torch.equal(tensor, bias) and tensor.untyped_storage().data_ptr() != bias.untyped_storage().data_ptr(), key
        with torch.no_grad():
            tensor.add_(1.0)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_trained_bias_in_another_dtype_keeps_the_layer_s_dtype(dtype):
    """A trained bias (``weight=False``) wider or narrower than its float32 layer: both overlays
    give float32 outputs (the next layer's input dtype), equal to ``x Wᵀ + b`` in float64."""
    from tests.variant_checks import assert_other_adapter_dtype

    assert_other_adapter_dtype("ln_tuning", 6, 5, adapter_dtype=dtype, weight=False, w_eff_fn=lambda p, b, w, bias, info: (w, p["ln_bias"]))
