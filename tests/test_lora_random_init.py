"""LoRA's ``init="random"``: peft's ``init_lora_weights=False`` (both factors drawn as their layers'
constructors draw them, so the adapter changes the model from step 0), on a Llama's Linear
layers, its embedding, and a conv LM's Conv1d / Conv2d: from one seed, peft's tensors exactly;
the option round-trips through peft's file."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, PeftConfig, get_peft_model
from safetensors.torch import load_file

import lora_func as lf
from tests.models import DEFAULT_TARGETS, tiny_model


@pytest.mark.parametrize("model_kind", ["llama", "llama_embedding", "convlm"])
def test_random_init_draws_peft_s_init_lora_weights_false(model_kind, tmp_path):
    targets = DEFAULT_TARGETS[model_kind] + (["q_proj"] if model_kind == "llama_embedding" else [])
    peft_base = tiny_model(model_kind)
    torch.manual_seed(5)  # after the base's own seeded build: the adapters' draws alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(peft_base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    model = tiny_model(model_kind)
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=4, alpha=8, init="random"), generator=torch.Generator().manual_seed(5))
    lf.save_peft(adapter, tmp_path, model=model)
    assert PeftConfig.from_pretrained(tmp_path).init_lora_weights is False
    ours = load_file(str(tmp_path / "adapter_model.safetensors"))
    theirs = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert sorted(ours) == sorted(theirs) and len(ours) >= 4
    for key, tensor in theirs.items():
        assert "lora_B" not in key and "lora_embedding_B" not in key or tensor.abs().min() > 0, key  # B drawn, not 0
        assert torch.equal(ours[key], tensor), key
    again = lf.load_peft(tmp_path, model)
    assert again.spec.option("init") == "random"
    ids = torch.randint(0, 32, (2, 6))
    base = model(ids)
    out = lf.adapted_call(model, adapter, ids)
    assert ((out.logits if hasattr(out, "logits") else out) - (base.logits if hasattr(base, "logits") else base)).abs().max() > 1e-4  # not the identity


def test_adalora_random_init_draws_peft_s_init_lora_weights_false(tmp_path):
    """AdaLoRA's ``init="random"``: peft's ``init_lora_weights=False`` keeps its ``update_layer``'s
    ``N(0, 1)`` draws of ``A``, ``E``, ``B`` (and draws a ``ranknum`` it overwrites)."""
    from peft import AdaLoraConfig

    config = AdaLoraConfig(init_r=4, target_r=2, total_step=10, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_base = tiny_model("llama")
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(peft_base, config)
    model = tiny_model("llama")
    spec = lf.AdapterSpec("adalora", targets=["q_proj", "v_proj"], r=4, alpha=8, init_r=4, target_r=2, total_step=10, init="random")
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5))
    lf.save_peft(adapter, tmp_path, model=model)
    assert PeftConfig.from_pretrained(tmp_path).init_lora_weights is False
    ours = load_file(str(tmp_path / "adapter_model.safetensors"))
    theirs = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if "lora_" in k and k.replace(".default", "") in ours}
    assert sorted(theirs) == sorted(k for k in ours if "lora_" in k) and len(theirs) == 12
    for key, tensor in theirs.items():
        assert tensor.abs().min() > 0 and torch.equal(ours[key], tensor), key
    assert lf.load_peft(tmp_path, model).spec.option("init") == "random"
