"""BD-LoRA against peft 0.21 (``LoraConfig(use_bdlora=BdLoraConfig(...))``) on a float64 tiny Llama:
a peft checkpoint with A (or B) block-diagonal on every target, trainables perturbed, loads with
load_peft and gives peft's logits and per-tensor gradients, merged and lazy; save_peft output loads
in peft; the init draws peft's numbers in peft's order; the layouts lora_func does not read or stack
are refused naming why."""

from __future__ import annotations

import json

import pytest
import torch
from peft.tuners.lora.config import BdLoraConfig
from peft.tuners.lora.variants import BdLoraLinearVariant

import lora_func as lf
from lora_func.variants import LayerInfo
from tests.lora_family_oracle import ALPHA, R, TARGETS, compare, model64, peft_lora, reloaded_in_peft, rel, saved
from tests.models import tiny_model, tokens

SIDES = {"a": {"target_modules_bd_a": TARGETS}, "b": {"target_modules_bd_b": TARGETS}}


@pytest.fixture(scope="module")
def model():
    return model64()


@pytest.mark.parametrize("side", ["a", "b"])
def test_peft_checkpoint_gives_peft_logits_and_gradients_and_saves_back(model, side, tmp_path):
    pm = peft_lora(model, use_bdlora=BdLoraConfig(nblocks=2, **SIDES[side]), use_rslora=side == "b")
    adapter = saved(pm, tmp_path / "peft", model)
    assert adapter.spec.variant == "bdlora" and adapter.spec.option("side") == side and adapter.spec.option("nblocks") == 2
    shapes = {k.rsplit(".", 1)[-1]: tuple(v.shape) for k, v in adapter.params.items() if ".0.self_attn.v_proj." in k}
    assert shapes == ({"lora_A": (R, 16), "lora_B": (16, R)} if side == "a" else {"lora_A": (R, 32), "lora_B": (16, R // 2)})
    compare(model, pm, adapter)
    lf.save_peft(adapter, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["use_bdlora"] == {**{f"target_modules_bd_{s}": [""] if s == side else None for s in "ab"}, "nblocks": 2, "match_strict": True}
    ids = tokens(2, 8, seed=5)
    with torch.no_grad():
        assert rel(reloaded_in_peft(model, tmp_path / "ours")(ids).logits, pm(ids).logits) <= 1e-12


@pytest.mark.parametrize("side", ["a", "b"])
def test_init_draws_peft_s_numbers(side):
    """Per layer, peft's draws from the global RNG in its order (LoRA's A, then the block-diagonal
    one on side a) equal the variant's init from a generator seeded alike."""
    model = tiny_model("llama")
    pm = peft_lora(model, use_bdlora=BdLoraConfig(nblocks=2, **SIDES[side]), perturbed=False)
    spec = lf.AdapterSpec("bdlora", targets=TARGETS, r=R, alpha=ALPHA, side=side, nblocks=2)
    config = pm.peft_config["default"]
    for name, module in pm.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            weight = model.get_submodule(name.removeprefix("base_model.model.")).weight
            info = LayerInfo(d_in=weight.shape[1], d_out=weight.shape[0], r=R, alpha=ALPHA, has_bias=True, options=spec.options)
            params, _ = lf.get_variant("bdlora").init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(9))
            # peft's layer as update_layer builds it before the variant's init: LoRA's plain factors
            module.lora_A["default"] = torch.nn.Linear(weight.shape[1], R, bias=False)
            module.lora_B["default"] = torch.nn.Linear(R, weight.shape[0], bias=False)
            torch.manual_seed(9)
            module.reset_lora_parameters("default", True)
            BdLoraLinearVariant.init(module, "default", config, target_name=name)
            assert torch.equal(params["lora_A"], module.lora_A["default"].weight), name
            assert torch.equal(params["lora_B"], module.lora_B["default"].weight) and not params["lora_B"].any()
    ids = tokens(2, 8, seed=6)
    assert torch.equal(lf.adapted_call(model, lf.init_adapter(model, spec), ids).logits, model(ids).logits)


def test_what_is_not_read_or_stacked_is_refused(model, tmp_path):
    # peft's serving layout, A on q and B on v by module name: one factor per adapter here.
    mixed = peft_lora(model, use_bdlora=BdLoraConfig(target_modules_bd_a=["q_proj"], target_modules_bd_b=["v_proj"], nblocks=2))
    with pytest.raises(ValueError, match=r"makes A block-diagonal on some targets and B.*compose two"):
        saved(mixed, tmp_path / "mixed", model)
    both = peft_lora(model, use_bdlora=BdLoraConfig(target_modules_bd_a=TARGETS, nblocks=2), lora_bias=True)
    with pytest.raises(ValueError, match=r"combines \['lora_bias', 'use_bdlora'\]"):
        saved(both, tmp_path / "both", model)
    with pytest.raises(ValueError, match=r"nblocks=3 must divide r=4"):
        lf.init_adapter(model, lf.AdapterSpec("bdlora", targets=TARGETS, r=4, nblocks=3))
    # the block-diagonal factor's own side: down_proj's d_in = 48 (side a), v_proj's d_out = 16 (side b)
    with pytest.raises(ValueError, match=r"factor's d_in=48"):
        lf.init_adapter(model, lf.AdapterSpec("bdlora", targets=["down_proj"], r=32, nblocks=32, side="a"))
    with pytest.raises(ValueError, match=r"factor's d_out=16"):
        lf.init_adapter(model, lf.AdapterSpec("bdlora", targets=["v_proj"], r=32, nblocks=32, side="b"))
    small, large = (lf.init_adapter(model, lf.AdapterSpec("bdlora", targets=TARGETS, r=r, nblocks=2)) for r in (2, 4))
    with pytest.raises(ValueError, match="not a rank axis; these adapters cannot be padded"):
        lf.stack([small, large])
    # the usual serving layout: two adapters, one per block-diagonal factor, composed
    q = lf.init_adapter(model, lf.AdapterSpec("bdlora", targets=["q_proj"], r=R, nblocks=2, side="a"))
    v = lf.init_adapter(model, lf.AdapterSpec("bdlora", targets=["v_proj"], r=R, nblocks=2, side="b"))
    assert len(lf.compose(q, v).parts) == 2


@pytest.mark.parametrize("side", ["a", "b"])
def test_init_gives_the_asked_dtype_and_the_stored_shapes(side):
    """A float64 adapter asked for on a float32 weight comes back float64 (the contract's init
    dtype), each factor in its stored shape (the block-diagonal one as its nblocks blocks)."""
    from lora_func.variants import bdlora
    from tests.variant_checks import init_params

    params, buffers = init_params(bdlora, "bdlora", 4, 6, 8, side=side, nblocks=2)
    assert not buffers
    assert {k: tuple(v.shape) for k, v in params.items()} == ({"lora_A": (4, 3), "lora_B": (8, 4)} if side == "a" else {"lora_A": (4, 6), "lora_B": (8, 2)})
