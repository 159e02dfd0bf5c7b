"""QALoRA against peft 0.21's ``QALoraLinearVariant`` on a float64 tiny Llama. peft applies it on
GPTQ layers only (gptqmodel is not installed here, and a plain ``nn.Linear`` ignores
``use_qalora``), so the oracle installs peft's own variant on peft's LoRA layers (its ``init``
replaces ``lora_A``, its ``forward`` pools): with perturbed trainables, ``save_pretrained``'s
checkpoint loads with load_peft and gives peft's logits and per-tensor gradients, merged and lazy;
save_peft's checkpoint, loaded into such a peft model, gives lora_func's logits; the init draws
peft's numbers in peft's order."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, set_peft_model_state_dict
from peft.tuners.lora.variants import QALoraLinearVariant
from safetensors.torch import load_file

import lora_func as lf
from lora_func.variants import LayerInfo
from tests.lora_family_oracle import ALPHA, R, TARGETS, compare, model64, peft_lora, perturb, rel, saved
from tests.models import tiny_model, tokens

GROUP = 8


def qalora_layers(pm):
    """peft's LoRA layers of ``pm`` with peft's QALoRA variant installed (as GPTQLoraLinear does)."""
    config = pm.peft_config["default"]
    config.use_qalora, config.qalora_group_size = True, GROUP
    layers = {n: m for n, m in pm.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    for module in layers.values():
        QALoraLinearVariant.init(module, "default", config)
        module.lora_variant["default"] = QALoraLinearVariant()
    return layers


@pytest.fixture(scope="module")
def model():
    return model64()


def test_peft_checkpoint_gives_peft_logits_and_gradients_and_saves_back(model, tmp_path):
    pm = peft_lora(model, perturbed=False, use_rslora=True)
    qalora_layers(pm)
    perturb(pm)
    adapter = saved(pm, tmp_path / "peft", model)
    assert adapter.spec.variant == "qalora" and dict(adapter.spec.options) == {"dropout": 0.0, "group_size": GROUP, "use_rslora": True}
    assert adapter.params["model.layers.0.self_attn.v_proj.lora_A"].shape == (R, 32 // GROUP)
    compare(model, pm, adapter)
    lf.save_peft(adapter, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["use_qalora"] is True and config["qalora_group_size"] == GROUP
    # peft's GPTQ path on our checkpoint: its config, its QALoRA layers, our tensors
    fresh = peft_lora(model, perturbed=False, **{k: config[k] for k in ("use_rslora", "lora_dropout")})
    qalora_layers(fresh)
    result = set_peft_model_state_dict(fresh, load_file(str(tmp_path / "ours" / "adapter_model.safetensors")))
    assert not result.unexpected_keys
    ids = tokens(2, 8, seed=5)
    with torch.no_grad():
        assert rel(fresh(ids).logits, pm(ids).logits) <= 1e-12


def test_init_draws_peft_s_numbers():
    model = tiny_model("llama")
    pm = peft_lora(model, perturbed=False)
    spec = lf.AdapterSpec("qalora", targets=TARGETS, r=R, alpha=ALPHA, group_size=GROUP)
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, use_qalora=True, qalora_group_size=GROUP)
    for name, module in pm.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            weight = model.get_submodule(name.removeprefix("base_model.model.")).weight
            info = LayerInfo(d_in=weight.shape[1], d_out=weight.shape[0], r=R, alpha=ALPHA, has_bias=True, options=spec.options)
            params, _ = lf.get_variant("qalora").init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(9))
            torch.manual_seed(9)
            module.reset_lora_parameters("default", True)
            QALoraLinearVariant.init(module, "default", config)
            assert torch.equal(params["lora_A"], module.lora_A["default"].weight), name
            assert not params["lora_B"].any()
    ids = tokens(2, 8, seed=6)
    assert torch.equal(lf.adapted_call(model, lf.init_adapter(model, spec), ids).logits, model(ids).logits)


def test_a_group_size_that_does_not_divide_d_in_is_refused(model):
    with pytest.raises(ValueError, match=r"group_size=5 must divide the layer's d_in=32"):
        lf.init_adapter(model, lf.AdapterSpec("qalora", targets=TARGETS, r=2, group_size=5))


@pytest.mark.parametrize("group_size", [1, 3])
def test_each_group_size_pools_as_a_loop_over_the_groups(group_size):
    """Down to groups of one feature (the smallest group_size accepted; 0 is refused): both
    overlays equal ``x Wᵀ + b + s·(x̄ Aᵀ) Bᵀ``, x̄ each group's mean times the number of groups,
    computed by a Python loop over the groups (float64)."""
    from tests.one_layer import one_layer, perturbed, run

    with pytest.raises(ValueError, match="group_size"):
        lf.AdapterSpec("qalora", targets=["proj"], r=2, group_size=0)
    model = one_layer("linear", 6, 4, True, torch.float64, 0)
    spec = lf.AdapterSpec("qalora", targets=["proj"], r=2, alpha=3.0, group_size=group_size, dtype=torch.float64)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1)), seed=2, scale=0.5)
    a, b = (adapter.params[k] for k in sorted(adapter.params))  # ...lora_A, ...lora_B
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    groups = 6 // group_size
    x_bar = torch.stack([x[:, j * group_size : (j + 1) * group_size].mean(-1) * groups for j in range(groups)], -1)
    want = model(x=x) + 1.5 * (x_bar @ a.T) @ b.T
    base = lf.base_params(model)
    for make in (lf.overlay, lf.merge_overlay):
        torch.testing.assert_close(run(model, make(base, adapter), x), want, rtol=1e-12, atol=1e-12, msg=make.__name__)


def test_init_gives_the_asked_dtype_and_the_pooled_shape():
    from lora_func.variants import qalora
    from tests.variant_checks import init_params

    params, buffers = init_params(qalora, "qalora", 2, 6, 4, group_size=3)
    assert not buffers and {k: tuple(v.shape) for k, v in params.items()} == {"lora_A": (2, 2), "lora_B": (4, 2)}
