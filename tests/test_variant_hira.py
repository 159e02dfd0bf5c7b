"""HiRA beyond tests/test_variants_structured_b.py (peft oracles, base and adapter in one
dtype): an adapter in another dtype than its base (wider, narrower) on both overlays, and
peft's config checks. Written to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import torch

from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype


def test_an_adapter_in_another_dtype_than_the_base():
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("hira", 6, 8, adapter_dtype=dtype, r=2)


def test_peft_config_checks():
    assert_config_checks("hira", peft.HiraConfig, {
        "hira_dropout": [1.0, -0.1, float("nan"), 2], "init_weights": [1, "kaiming", None],
    }, good={"hira_dropout": [None, 0, 0.99], "init_weights": [True, False, "gaussian"]})
