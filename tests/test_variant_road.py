"""RoAd beyond tests/test_variants_structured_b.py (peft oracles in float64, adapter and base
in one dtype): each ``road_variant`` with groups of 4 (two pairs per group, where a swapped
pair axis shows) as an adapter in another dtype than its base (a wider one, a narrower one),
against the contract row's ``R``; peft's config checks. Written to kill mutants
(tools/mutate.py)."""

from __future__ import annotations

import peft
import pytest
import torch

from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype


@pytest.mark.parametrize("road_variant", ["road_1", "road_2", "road_4"])
def test_each_variant_in_another_dtype(road_variant):
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("road", 6, 8, adapter_dtype=dtype, road_variant=road_variant, group_size=4)


def test_peft_config_checks():
    assert_config_checks("road", peft.RoadConfig, {
        "variant": ["road_3", None], "group_size": [0, 3, 4.0, True, -2], "init_weights": [1, "x"],
    }, good={"variant": ["road_1", "road_2", "road_4"], "group_size": [2, 8]})
