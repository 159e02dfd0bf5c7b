"""C3A beyond tests/test_variants_structured_c.py (peft oracles, base and adapter in one
dtype): an adapter in another dtype than its base (wider, narrower) on both overlays, and
peft's config checks. Written to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import torch

from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype


def test_an_adapter_in_another_dtype_than_the_base():
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("c3a", 6, 8, adapter_dtype=dtype, r=2, init="gaussian")


def test_peft_config_checks():
    assert_config_checks("c3a", peft.C3AConfig, {
        "block_size": [0, 2.0, True], "block_size_pattern": [{"q": 0}, [2]], "init_weights": ["ones", 1, "zeros"],
    }, good={"block_size": [1, 64], "block_size_pattern": [{}, {"q": 4}], "init_weights": [True, False, "gaussian", "xavier_uniform", "kaiming_uniform"]},
       peft_defaults={"init": "xavier_uniform"})  # C3AConfig's default init_weights; lora_func's default is zeros (the identity)
