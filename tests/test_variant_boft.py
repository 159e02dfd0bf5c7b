"""BOFT beyond tests/test_variants_structured_b.py (peft oracles with one or two butterfly
factors): four factors (the permutation of factor 3 spreads 8 chunks, where ``2**i`` and
``2*i`` part), the block layout's checks, ``boft_block_num``, the dropout's choice of factor, an
adapter in another dtype than the base, and peft's config checks. Written to kill mutants
(tools/mutate.py)."""

from __future__ import annotations

import peft
import pytest
import torch

import lora_func as lf
from lora_func.variants import boft
from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype, init_params


@pytest.mark.parametrize("rows", [3, 20])  # fewer rows than d_out: the input rotated; more: W
def test_four_butterfly_factors_in_another_dtype(rows):
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("boft", 16, 12, adapter_dtype=dtype, rows=rows, boft_block_size=2, boft_n_butterfly_factor=4)


def test_block_num_gives_whole_blocks():
    assert boft.layer_blocks(24, {"boft_block_size": 0, "boft_block_num": 6, "boft_n_butterfly_factor": 2}) == (2, 6, 4)
    assert all(type(v) is int for v in boft.layer_blocks(24, {"boft_block_size": 0, "boft_block_num": 6, "boft_n_butterfly_factor": 2}))
    p, _ = init_params(boft, "boft", 1, 24, 8, boft_block_size=0, boft_block_num=6, boft_n_butterfly_factor=2)
    assert p["boft_R"].shape == (2, 6, 4, 4)


def test_a_butterfly_wider_than_the_layer_is_refused():
    """d_in = 12 = 6 blocks of 2 (both even), but three factors spread 2·2² = 8 features, which
    do not divide 12."""
    with pytest.raises(ValueError, match="boft_n_butterfly_factor=3 do not fit a layer with d_in=12"):
        boft.layer_blocks(12, {"boft_block_size": 2, "boft_block_num": 0, "boft_n_butterfly_factor": 3})
    assert boft.layer_blocks(16, {"boft_block_size": 2, "boft_block_num": 0, "boft_n_butterfly_factor": 4}) == (4, 8, 2)


def test_dropout_draws_every_factor():
    raw = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    kept = boft.orthogonal_blocks({"boft_R": raw})
    torch.manual_seed(0)
    factors = set()
    for _ in range(30):
        dropped = boft.orthogonal_blocks({"boft_R": raw}, dropout=0.5)
        factors |= {f for f in range(3) if not torch.equal(dropped[f], kept[f])}
    assert factors == {0, 1, 2}


def test_peft_config_checks():
    assert_config_checks("boft", peft.BOFTConfig, {
        "boft_block_size": [-1, 2.0, True], "boft_block_num": [-1, 1.5], "boft_n_butterfly_factor": [0, -1, 2.5],
        "boft_dropout": [1.0, -0.1, float("nan"), 2], "init_weights": [0, "x"],
    }, good={"boft_block_size": [0, 4], "boft_block_num": [0, 8], "boft_n_butterfly_factor": [1, 3], "boft_dropout": [0, 0.99]})


def test_dropout_acts_in_training_steps_only():
    """Outside a training op the lazy path equals the merged one (no blocks dropped); in one,
    some draw differs."""
    from tests.one_layer import one_layer, perturbed, run

    model = one_layer("linear", 8, 12, True, torch.float64, 0)
    spec = lf.AdapterSpec("boft", targets=["proj"], dtype=torch.float64, boft_block_size=2, boft_dropout=0.5)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1)), seed=2)
    x, base = torch.randn(3, 8, dtype=torch.float64), lf.base_params(model)
    merged = run(model, lf.merge_overlay(base, adapter), x)
    torch.manual_seed(0)
    for _ in range(3):
        assert torch.allclose(run(model, lf.overlay(base, adapter), x), merged, rtol=1e-12, atol=1e-12)
    training = lf.overlay(base, adapter, training=True)
    assert any(not torch.allclose(run(model, training, x), merged, rtol=1e-6, atol=1e-6) for _ in range(3))
