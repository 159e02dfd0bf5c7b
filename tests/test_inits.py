"""peft's LoRA inits (``init_lora_weights``) in lora_func, against peft 0.21 on tiny Llama (fp32: peft
refuses OLoRA on float64 bases): the adapter equals peft's (random inits: the same draws from a
generator seeded as peft's global RNG), and the effective model at init equals peft's (for OLoRA:
peft's modified base plus its adapter, against lora_func's untouched base plus residual and
adapter), relative 1e-6; OLoRA's converted checkpoint loads in peft onto an untouched base, and
peft's unconverted one loads with load_peft."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import lora_func as lf
from lora_func.variants import LayerInfo, get_variant
from tests import peft_helpers
from tests.models import tiny_model, tokens

TARGETS = ["q_proj", "v_proj", "down_proj"]  # v_proj 32->16, down_proj 48->32: d_in != d_out
R, ALPHA = 4, 6.0


def _peft(model, init, **extra):
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=init, **extra)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        return get_peft_model(copy.deepcopy(model), config).eval()


def _peft_layers(pm) -> dict:
    return {n.removeprefix("base_model.model."): m for n, m in pm.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("init", ["gaussian", "orthogonal"])
def test_random_inits_draw_as_peft(model, init):
    pm = _peft(model, init)
    for name, layer in _peft_layers(pm).items():
        weight = layer.base_layer.weight
        torch.manual_seed(11)
        if init == "gaussian":
            layer.reset_lora_parameters("default", "gaussian")
        else:
            layer.orthogonal_init("default")
        info = LayerInfo(d_in=weight.shape[1], d_out=weight.shape[0], r=R, alpha=ALPHA, has_bias=False,
                         options=(("dropout", 0.0), ("init", init), ("use_rslora", False)))
        params, _ = get_variant("lora").init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(11))
        assert torch.equal(params["lora_A"], layer.lora_A["default"].weight), name  # r = 4: x/r == x·(1/r) exactly
        assert torch.equal(params["lora_B"], layer.lora_B["default"].weight), name
    # The effective model at init: the base (B A = 0; for orthogonal up to round-off) on both sides.
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=R, alpha=ALPHA, init=init), generator=torch.Generator().manual_seed(0))
    if init == "orthogonal":
        assert all(v.abs().max() > 1e-3 for v in adapter.params.values())  # both factors non-zero
    ids = tokens(2, 8, seed=3)
    want = pm(ids).logits
    assert _rel(lf.adapted_call(model, adapter, ids).logits, want) <= 1e-6


def test_orthogonal_reads_back_from_peft(model, tmp_path):
    pm = _peft(model, "orthogonal")
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, model)
    assert dict(adapter.spec.options)["init"] == "orthogonal"
    for name, layer in _peft_layers(pm).items():
        assert torch.equal(adapter.params[f"{name}.lora_A"], layer.lora_A["default"].weight)


@pytest.fixture(scope="module")
def olora(model):
    pm = _peft(model, "olora")
    adapter = lf.init_adapter(model, lf.AdapterSpec("olora", targets=TARGETS, r=R, alpha=ALPHA))
    return pm, adapter


def test_olora_adapter_and_residual_equal_peft(model, olora):
    pm, adapter = olora
    for name, layer in _peft_layers(pm).items():
        # The same QR of W (d_out, d_in): equal factors (QR's sign convention is the same op on both sides).
        assert _rel(adapter.params[f"{name}.lora_A"], layer.lora_A["default"].weight) <= 1e-6, name
        assert _rel(adapter.params[f"{name}.lora_B"], layer.lora_B["default"].weight) <= 1e-6, name
        # peft's modified base weight is lora_func's residual buffer; lora_func's base is untouched.
        assert _rel(adapter.buffers[f"{name}.W_res"], layer.base_layer.weight) <= 1e-6, name
    first = next(iter(_peft_layers(pm)))
    assert not torch.equal(_peft_layers(pm)[first].base_layer.weight, model.get_submodule(first).weight)  # peft changed its base
    ids = tokens(2, 8, seed=4)
    want = pm(ids).logits
    assert _rel(lf.adapted_call(model, adapter, ids).logits, want) <= 1e-6  # peft's path: W_res x + s·(x Aᵀ) Bᵀ
    # merged: W_res + s·B A rounded once more in fp32 (measured 1.2e-6).
    assert _rel(lf.adapted_call(model, adapter, ids, merged=True).logits, want) <= 5e-6


def test_olora_checkpoints_both_ways(model, olora, tmp_path):
    pm, adapter = olora
    g = torch.Generator().manual_seed(2)
    trained = adapter.with_params({k: v.detach() + 0.05 * torch.randn(v.shape, generator=g) for k, v in adapter.params.items()})
    ids = tokens(2, 8, seed=5)
    want = lf.adapted_call(model, trained, ids).logits
    # save_peft: a plain rank-2r LoRA that peft loads onto an untouched base.
    lf.save_peft(trained, tmp_path / "converted", model=model)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        loaded = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "converted").eval()
    assert loaded.peft_config["default"].r == 2 * R
    assert _rel(loaded(ids).logits, want) <= 1e-5  # the SVD that recovers the initial factors: fp32 round-off
    # peft's own OLoRA checkpoint (unconverted, init_lora_weights="olora"): load_peft recomputes the
    # residual from the untouched base, as peft does on load.
    pm.save_pretrained(tmp_path / "peft")
    back = lf.load_peft(tmp_path / "peft", model)
    assert back.spec.variant == "olora"
    assert _rel(lf.adapted_call(model, back, ids).logits, pm(ids).logits) <= 1e-6


def test_peft_key_names_are_lora_keys():
    assert peft_helpers.peft_key_to_lf("base_model.model.x.lora_A.default.weight", ("lora_A",)) == "x.lora_A"


@pytest.mark.parametrize("method", ["ipm", "kpm"])
def test_corda_equals_peft_preprocess_corda(model, method, tmp_path, monkeypatch):
    import dataclasses
    import sys
    import types

    from peft.tuners.lora.config import CordaConfig

    # peft's corda.py imports `dataclass` from the attrs package (not a dependency here) for one plain record.
    monkeypatch.setitem(sys.modules, "attr", types.SimpleNamespace(dataclass=dataclasses.dataclass))
    from peft.tuners.lora.corda import preprocess_corda

    batches = [tokens(1, 12, seed=20 + i) for i in range(3)]  # peft hooks batches of one sequence
    peft_base = copy.deepcopy(model)
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights="corda", corda_config=CordaConfig(corda_method=method))
    preprocess_corda(peft_base, config, run_model=lambda: [peft_base(ids) for ids in batches])
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        pm = get_peft_model(peft_base, config).eval()
    spec = lf.AdapterSpec("corda", targets=TARGETS, r=R, alpha=ALPHA, corda_method=method)
    adapter = lf.init_adapter(model, spec, calibration=[{"input_ids": ids} for ids in batches])
    for name, layer in _peft_layers(pm).items():
        # The same SVD of W C' on both sides: equal factors (its sign convention is the same op).
        assert _rel(adapter.params[f"{name}.lora_A"], layer.lora_A["default"].weight) <= 1e-6, name
        assert _rel(adapter.params[f"{name}.lora_B"], layer.lora_B["default"].weight) <= 1e-6, name
        assert _rel(adapter.buffers[f"{name}.W_res"], layer.base_layer.weight) <= 1e-6, name
    ids = tokens(2, 8, seed=6)
    assert _rel(lf.adapted_call(model, adapter, ids).logits, pm(ids).logits) <= 1e-6
    # The converted checkpoint on the untouched base.
    trained = adapter.with_params({k: v.detach() * 1.1 for k, v in adapter.params.items()})
    lf.save_peft(trained, tmp_path, model=model)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        loaded = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path).eval()
    assert _rel(loaded(ids).logits, lf.adapted_call(model, trained, ids).logits) <= 1e-5


def test_mica_equals_peft_and_its_checkpoints_load_both_ways(model, tmp_path):
    pm = _peft(model, "mica")
    adapter = lf.init_adapter(model, lf.AdapterSpec("mica", targets=TARGETS, r=R, alpha=ALPHA))
    assert sorted(adapter.params) == sorted(k for k in adapter.params if k.endswith("lora_A"))  # B is a buffer
    for name, layer in _peft_layers(pm).items():
        assert not layer.lora_B["default"].weight.requires_grad  # peft freezes it too
        assert _rel(adapter.buffers[f"{name}.lora_B"], layer.lora_B["default"].weight) <= 1e-6, name
        assert not adapter.params[f"{name}.lora_A"].any() and not layer.lora_A["default"].weight.any()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in _peft_layers(pm).values():
            layer.lora_A["default"].weight.add_(0.3 * torch.randn(layer.lora_A["default"].weight.shape, generator=g))
    ids = tokens(2, 8, seed=7)
    pm.save_pretrained(tmp_path / "peft")
    back = lf.load_peft(tmp_path / "peft", model)
    assert back.spec.variant == "mica" and sorted(back.buffers) == sorted(adapter.buffers)
    assert _rel(lf.adapted_call(model, back, ids).logits, pm(ids).logits) <= 1e-6
    lf.save_peft(back, tmp_path / "ours")
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        again = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "ours").eval()
    assert _rel(again(ids).logits, pm(ids).logits) <= 1e-6


def test_mica_on_a_wider_bf16_layer_equals_peft():
    """MiCA on a bf16 ``nn.Linear`` with ``d_out > d_in`` (the last ``r`` columns of the reduced
    SVD's ``U``, not of the full one's) against peft's own init (``autocast_adapter_dtype=False``:
    its adapter stays in the base's bf16): the frozen ``lora_B`` bit for bit (the SVD in fp32, then
    bf16), ``lora_A`` zeros, every tensor in the adapter dtype; a float64 adapter on a float32
    layer holds its tensors in float64."""
    from tests.one_layer import one_layer

    model = one_layer("linear", 6, 10, True, torch.bfloat16, seed=0)
    config = LoraConfig(r=3, lora_alpha=ALPHA, target_modules=["proj"], init_lora_weights="mica")
    pm = get_peft_model(copy.deepcopy(model), config, autocast_adapter_dtype=False)
    want = pm.base_model.model.proj.lora_B["default"].weight
    adapter = lf.init_adapter(model, lf.AdapterSpec("mica", targets=["proj"], r=3, alpha=ALPHA, dtype=torch.bfloat16))
    got, lora_a = adapter.buffers["proj.lora_B"], adapter.params["proj.lora_A"]
    assert want.dtype == got.dtype == lora_a.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not lora_a.any() and lora_a.shape == (3, 6)
    wide = lf.init_adapter(one_layer("linear", 6, 10, True, torch.float32, seed=0), lf.AdapterSpec("mica", targets=["proj"], r=3, dtype=torch.float64))
    assert wide.buffers["proj.lora_B"].dtype == wide.params["proj.lora_A"].dtype == torch.float64
