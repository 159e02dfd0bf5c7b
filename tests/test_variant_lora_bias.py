"""lora_bias against peft 0.21 (``LoraConfig(lora_bias=True)``) on a float64 tiny Llama: a peft
checkpoint with perturbed trainables loads with load_peft and gives peft's logits and per-tensor
gradients (lora_B's bias included), merged and lazy; save_peft output loads in peft; the init draws
peft's numbers from the same seed; a target without a bias is refused before any work."""

from __future__ import annotations

import json

import pytest
import torch

import lora_func as lf
from lora_func.variants import LayerInfo
from tests.lora_family_oracle import ALPHA, R, TARGETS, compare, model64, peft_lora, reloaded_in_peft, rel, saved
from tests.models import tiny_model, tokens


@pytest.fixture(scope="module")
def model():
    return model64()


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    pm = peft_lora(model, lora_bias=True, use_rslora=True)
    directory = tmp_path_factory.mktemp("lora_bias") / "peft"
    return pm, directory, saved(pm, directory, model)


def test_peft_checkpoint_gives_peft_logits_and_gradients(model, trained, tmp_path):
    pm, directory, adapter = trained
    assert adapter.spec.variant == "lora_bias" and dict(adapter.spec.options) == {"dropout": 0.0, "use_rslora": True}
    compare(model, pm, adapter)
    # peft allows lora_bias with init_lora_weights True or False: both read as lora_bias
    config = json.loads((directory / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"init_lora_weights": False}))
    (tmp_path / "adapter_model.safetensors").write_bytes((directory / "adapter_model.safetensors").read_bytes())
    assert lf.load_peft(tmp_path, model).spec.variant == "lora_bias"


def test_save_peft_loads_in_peft(model, trained, tmp_path):
    pm, _, adapter = trained
    lf.save_peft(adapter, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["lora_bias"] is True and config["use_rslora"] is True
    ids = tokens(2, 8, seed=5)
    with torch.no_grad():
        assert rel(reloaded_in_peft(model, tmp_path)(ids).logits, pm(ids).logits) <= 1e-12


def test_init_draws_peft_s_numbers():
    """Per layer, peft's init (``reset_lora_parameters``: A kaiming from the global RNG, B and its
    bias zero) equals the variant's init from a generator seeded alike; the model at init is the base."""
    model = tiny_model("llama")
    pm = peft_lora(model, lora_bias=True, perturbed=False)
    variant, spec = lf.get_variant("lora_bias"), lf.AdapterSpec("lora_bias", targets=TARGETS, r=R, alpha=ALPHA)
    for name, module in pm.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            weight = model.get_submodule(name.removeprefix("base_model.model.")).weight
            info = LayerInfo(d_in=weight.shape[1], d_out=weight.shape[0], r=R, alpha=ALPHA, has_bias=True, options=spec.options)
            params, _ = variant.init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(9))
            torch.manual_seed(9)
            module.reset_lora_parameters("default", True)
            assert torch.equal(params["lora_A"], module.lora_A["default"].weight), name
            assert torch.equal(params["lora_B"], module.lora_B["default"].weight) and not params["lora_B"].any()
            assert torch.equal(params["lora_bias"], module.lora_B["default"].bias) and not params["lora_bias"].any()
    adapter = lf.init_adapter(model, spec)
    ids = tokens(2, 8, seed=6)
    assert torch.equal(lf.adapted_call(model, adapter, ids).logits, model(ids).logits)


def test_a_target_without_a_bias_is_refused(model, tmp_path):
    with pytest.raises(ValueError, match=r"down_proj.*have no bias"):
        lf.init_adapter(model, lf.AdapterSpec("lora_bias", targets=["down_proj"], r=2))
    pm = peft_lora(model, targets=["down_proj"], lora_bias=True)
    with pytest.raises(ValueError, match=r"down_proj.*have no bias"):
        saved(pm, tmp_path, model)
