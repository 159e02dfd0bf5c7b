"""WaveFT against HF peft 0.21 in float64 (issue 30), beyond the contract suite.

A peft WaveFT adapter with perturbed trainables, saved by peft, loads with ``load_peft`` and gives
peft's logits and per-tensor gradients (lazy and merged, 1e-9 relative: peft computes WaveFT in
the spectrum's dtype, float64 here, so nothing of peft's is patched); ``save_peft`` output loads
in peft with the same logits; the positions peft derives from its seed are peft's exactly; every
wavelet family's update equals peft's on odd and even layer sizes; the default init trains.
"""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
from peft.tuners.waveft.constants import WAVELET_REDUCTIONS
from peft.tuners.waveft.wavelet import Wavelet
from peft.tuners.waveft.waverec2d import waverec2d
from torch import nn
from torch.func import grad

import lora_func as lf
from lora_func.variants._wavelet import _REC_LO, FAMILIES, idwt2, reduction
from tests.contract_helpers import loss_fn
from tests.models import tiny_model, tokens
from tests.test_variants_structured_c import (
    _rmsnorm_in_input_dtype,
    check_against_peft,
    check_reloads_in_peft,
    check_trains,
    perturb,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj", "down_proj"]  # 32 -> 32 (biased), 32 -> 16, 48 -> 32


@pytest.fixture(scope="module")
def llama64():
    return _rmsnorm_in_input_dtype(tiny_model("llama", seed=1, dtype=torch.float64))


@pytest.fixture(scope="module")
def gpt2_64():
    return tiny_model("gpt2", seed=1, dtype=torch.float64)


def _peft_indices(pm) -> dict[str, torch.Tensor]:
    return {
        name.removeprefix("base_model.model."): module.waveft_indices["default"]
        for name, module in pm.named_modules()
        if hasattr(module, "waveft_indices") and "default" in module.waveft_indices
    }


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("llama", {"wavelet_family": "sym3", "n_frequency_pattern": {"model.layers.1.self_attn.v_proj": 40}}),
        ("llama", {"wavelet_family": "db1", "use_idwt": False}),
        ("llama", {"wavelet_family": "coif1", "proportional_parameters": True}),
        ("gpt2", {"wavelet_family": "db2"}),
    ],
    ids=["sym3-pattern", "no-idwt", "coif1-proportional", "gpt2-conv1d-db2"],
)
def test_peft_checkpoint_loads_with_peft_logits_gradients_and_reloads(llama64, gpt2_64, tmp_path, kind, fields):
    """n_frequency / n_frequency_pattern are lora_func's r / rank pattern, both ways;
    proportional_parameters gives peft's per-layer n on load and is saved as the pattern."""
    model = llama64 if kind == "llama" else gpt2_64
    targets = TARGETS if kind == "llama" else ["c_attn", "c_fc"]
    config = peft.WaveFTConfig(n_frequency=24, scaling=3.0, random_loc_seed=5, target_modules=targets, fan_in_fan_out=kind == "gpt2", **fields)
    pm = peft.get_peft_model(copy.deepcopy(model), config).eval()
    perturb(pm, "waveft_spectrum")
    pm.save_pretrained(tmp_path / "peft")
    adapter, ids, want = check_against_peft(model, pm, tmp_path / "peft", "waveft_spectrum", "waveft_spectrum")
    options = {k: v for k, v in fields.items() if k != "n_frequency_pattern"}
    assert adapter.spec.options == lf.AdapterSpec("waveft", targets, scaling=3.0, random_loc_seed=5, **options).options
    peft_sizes = {m: int(t.shape[1]) for m, t in _peft_indices(pm).items()}
    assert {layer.target.module: layer.info.r for layer in adapter.layers} == peft_sizes
    if "n_frequency_pattern" in fields or fields.get("proportional_parameters"):
        assert len(set(peft_sizes.values())) > 1
    # init_adapter draws peft's positions (and, with proportional_parameters, peft's sizes)
    ours = lf.init_adapter(model, lf.AdapterSpec("waveft", targets, r=24, random_loc_seed=5, dtype=torch.float64, **options))
    for module, indices in _peft_indices(pm).items():
        assert torch.equal(adapter.buffers[f"{module}.waveft_indices"], indices), module
        if module not in fields.get("n_frequency_pattern", {}):
            assert torch.equal(ours.buffers[f"{module}.waveft_indices"], indices), module
    reloaded = check_reloads_in_peft(model, adapter, ids, want, tmp_path)
    assert reloaded.peft_config["default"].proportional_parameters is False
    assert {m: int(t.shape[1]) for m, t in _peft_indices(reloaded).items()} == peft_sizes


def test_every_family_and_odd_sizes_give_peft_delta_weight():
    """The merged update of every family on odd and even sizes (the padding rounded up to even,
    the centred offset, the crop of the extra row) equals peft's ``get_delta_weight``; the filters
    are peft's own values; peft's config lists families it has no filters for, refused here."""
    assert set(FAMILIES) == set(WAVELET_REDUCTIONS) & set(_REC_LO) and len(FAMILIES) == 23
    coefficients = torch.randn(24, 36, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    quadrants = (coefficients[:12, :18], (coefficients[:12, 18:], coefficients[12:, :18], coefficients[12:, 18:]))
    for family in FAMILIES:
        assert _REC_LO[family] == tuple(Wavelet(family).rec_lo), family
        assert reduction(family) == WAVELET_REDUCTIONS[family][0], family
        assert torch.equal(idwt2(coefficients, family), waverec2d(quadrants, family)), family  # (24 − L + 2, 36 − L + 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(15, 21), nn.Linear(21, 8)).double()
    base = lf.base_params(model)
    g = torch.Generator().manual_seed(1)
    for family in FAMILIES:
        config = peft.WaveFTConfig(n_frequency=50, scaling=2.0, wavelet_family=family, target_modules=["0", "1"], random_loc_seed=9)
        pm = peft.get_peft_model(copy.deepcopy(model), config)
        adapter = lf.init_adapter(model, lf.AdapterSpec("waveft", ["0", "1"], r=50, scaling=2.0, wavelet_family=family, random_loc_seed=9, dtype=torch.float64))
        adapter = adapter.with_params({k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
        merged = lf.merge_overlay(base, adapter)
        for name in ("0", "1"):
            layer = pm.base_model.model.get_submodule(name)
            with torch.no_grad():
                layer.waveft_spectrum["default"].copy_(adapter.params[f"{name}.waveft_spectrum"])
            want = layer.get_delta_weight("default")
            got = merged[f"{name}.weight"] - base[f"{name}.weight"]
            assert want.shape == got.shape and (got - want).abs().max() <= 1e-12 * want.abs().max(), (family, name)


def test_init_trains_and_random_init_is_peft_scale():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("waveft", ["v_proj"], r=256, init_weights=False), generator=torch.Generator().manual_seed(0))
    spectrum = adapter.params["model.layers.0.self_attn.v_proj.waveft_spectrum"]
    assert spectrum.shape == (256,) and 0.008 < spectrum.std() < 0.012  # peft: 0.01 · randn
    spec = lf.AdapterSpec("waveft", TARGETS, r=64)
    assert (spec.option("scaling"), spec.option("wavelet_family"), spec.option("random_loc_seed")) == (25.0, "db1", 777)
    check_trains(spec, lr=0.01)  # init_weights=True (peft's default): zeros, the identity


def test_stack_of_different_sizes_equals_each_alone():
    """Stacks of different r: padded, each member masked (padding gets exactly zero gradient)."""
    model = tiny_model("gpt2")
    ids = tokens()
    adapters = []
    for i, r in enumerate((8, 20)):
        a = lf.init_adapter(model, lf.AdapterSpec("waveft", ["c_attn"], r=r, wavelet_family="db2", scaling=1.0))
        g = torch.Generator().manual_seed(7 + i)
        adapters.append(a.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in a.params.items()}))
    stacked = lf.stack(adapters)
    base = lf.base_params(model)
    batched = torch.func.vmap(lambda a: lf.adapted_call(model, a, ids).logits)(stacked)
    for i, a in enumerate(adapters):
        alone = lf.adapted_call(model, a, ids).logits
        torch.testing.assert_close(batched[i], alone, atol=1e-5, rtol=1e-5)
        assert (alone - model(ids).logits).abs().max() > 1e-2
    grads = torch.func.vmap(lambda a: grad(loss_fn(model, base, a, ids))(a.params))(stacked)
    for key, g in grads.items():
        assert g.shape[-1] == 20 and torch.count_nonzero(g[0, ..., 8:]) == 0 and g[0, ..., :8].abs().max() > 0, key


def test_refusals(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"r=513 coefficients.*16×32 = 512.*at most 512"):
        lf.init_adapter(model, lf.AdapterSpec("waveft", ["v_proj"], r=513))
    assert lf.init_adapter(model, lf.AdapterSpec("waveft", ["v_proj"], r=512)).buffers["model.layers.0.self_attn.v_proj.waveft_indices"].shape == (2, 512)
    with pytest.raises(ValueError, match="random_loc_seed=-3"):
        lf.AdapterSpec("waveft", ["v_proj"], random_loc_seed=-3)
    for family in ("coif5", "db11", "haar"):
        with pytest.raises(ValueError, match=f"wavelet_family='{family}' is not one of"):
            lf.AdapterSpec("waveft", ["v_proj"], wavelet_family=family)
    adapter = lf.init_adapter(model, lf.AdapterSpec("waveft", ["v_proj"], r=1, random_loc_seed=0, wavelet_family="sym2"))
    lf.save_peft(adapter, tmp_path, model=model)
    assert lf.load_peft(tmp_path, model).spec.options == adapter.spec.options
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    # a config without the option fields reads peft's dataclass defaults, as peft does
    fields = ("scaling", "wavelet_family", "use_idwt", "random_loc_seed", "init_weights", "proportional_parameters")
    (tmp_path / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in fields}))
    assert lf.load_peft(tmp_path, model).spec.options == lf.AdapterSpec("waveft", ["v_proj"]).options
    bad = [("wavelet_family", "coif5"), ("use_idwt", 1), ("proportional_parameters", "yes"), ("random_loc_seed", -1), ("n_frequency", 0)]
    bad.append(("n_frequency_pattern", {"model.layers.0.self_attn.v_proj": 0}))
    for field, value in bad:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=f"{field}="):
            lf.load_peft(tmp_path, model)


def test_proportional_parameters_spreads_the_budget_and_survives_save_load(tmp_path):
    """peft's rule by hand: budget 24 · 6 layers over q (32·32), v (16·32), down (32·48), twice."""
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("waveft", TARGETS, r=24, proportional_parameters=True))
    sizes = {layer.target.module: layer.info.r for layer in adapter.layers}
    assert sizes == {f"model.layers.{i}.{m}": n for i in (0, 1) for m, n in (("self_attn.q_proj", 24), ("self_attn.v_proj", 12), ("mlp.down_proj", 36))}
    # a budget of 1 per layer: v's share 0.5 rounds (half to even) to 0, raised to 1; down's 1.5 to 2
    small = lf.init_adapter(model, lf.AdapterSpec("waveft", TARGETS, r=1, proportional_parameters=True))
    assert [layer.info.r for layer in small.layers][:3] == [1, 1, 2]
    for trainable_only in (False, True):
        again = lf.load(lf.save(adapter, tmp_path / f"native{trainable_only}", trainable_only=trainable_only), model=model)
        assert {layer.target.module: layer.info.r for layer in again.layers} == sizes
        assert all(torch.equal(again.buffers[k], v) for k, v in adapter.buffers.items())
