"""RoAd beyond tests/test_variants_structured_b.py (peft oracles in float64, adapter and base
in one dtype): each ``road_variant`` with groups of 4 (two pairs per group, where a swapped
pair axis shows) as an adapter in another dtype than its base (a wider one, a narrower one),
against the contract row's ``R``; peft's config checks; peft's seeded random init. Written to
kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import pytest
import torch

import lora_func as lf
from tests.one_layer import one_layer
from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype


@pytest.mark.parametrize("road_variant", ["road_1", "road_2", "road_4"])
def test_each_variant_in_another_dtype(road_variant):
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("road", 6, 8, adapter_dtype=dtype, road_variant=road_variant, group_size=4)


def test_peft_config_checks():
    assert_config_checks("road", peft.RoadConfig, {
        "variant": ["road_3", None], "group_size": [0, 3, 4.0, True, -2], "init_weights": [1, "x"],
    }, good={"variant": ["road_1", "road_2", "road_4"], "group_size": [2, 8]})


@pytest.mark.parametrize("road_variant", ["road_1", "road_2", "road_4"])
@pytest.mark.parametrize("d_out", [8, 12, 32])
def test_a_seeded_random_init_draws_peft_values_bit_for_bit(road_variant, d_out):
    # peft's init_weights=False: theta ~ N(0, 0.5²), then alpha ~ N(1, 0.5²), from one stream;
    # sizes under 16 and over take different paths of torch's normal_ (both covered)
    base = one_layer("linear", 6, d_out, True, torch.float32, 0)
    torch.manual_seed(7)  # peft's init draws from the global generator
    pm = peft.get_peft_model(base, peft.RoadConfig(target_modules=["proj"], group_size=4, variant=road_variant, init_weights=False))
    want = {n.split(".")[-2]: p.detach() for n, p in pm.named_parameters() if "road_" in n}
    model = one_layer("linear", 6, d_out, True, torch.float32, 0)
    spec = lf.AdapterSpec("road", targets=["proj"], group_size=4, road_variant=road_variant, init="random")
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(7))
    assert sorted(want) == ["road_alpha", "road_theta"]
    for name, value in want.items():
        assert torch.equal(adapter.params[f"proj.{name}"], value), name
