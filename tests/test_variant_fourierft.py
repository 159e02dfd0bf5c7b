"""FourierFT beyond tests/test_variants_structured_c.py (peft oracles, base and adapter in one
dtype): an adapter in another dtype than its base (wider, narrower) on both overlays, the init's
dtype, and peft's config checks. Written to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import torch

from lora_func.variants import fourierft
from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype, init_params


def test_an_adapter_in_another_dtype_than_the_base():
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("fourierft", 6, 8, adapter_dtype=dtype, r=10, scaling=3.0)


def test_init_in_the_requested_dtype_with_integer_positions():
    p, b = init_params(fourierft, "fourierft", 12, 6, 8)
    assert p["fourierft_spectrum"].shape == (12,) and b["fourierft_indices"].dtype == torch.int64
    p, _ = init_params(fourierft, "fourierft", 12, 6, 8, init_weights=True)
    assert torch.count_nonzero(p["fourierft_spectrum"]) == 0


def test_peft_config_checks():
    assert_config_checks("fourierft", peft.FourierFTConfig, {
        "n_frequency": [0, 2.0, True], "n_frequency_pattern": [{"q": 0}, {"q": 1.5}, [1]], "scaling": [float("nan"), "1"],
        "random_loc_seed": [-1, None, 1.0], "init_weights": [1, None],
    }, good={"n_frequency": [1], "n_frequency_pattern": [{}, {"q": 1}], "random_loc_seed": [0]})
