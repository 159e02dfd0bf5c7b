"""SHiRA beyond tests/test_variants_structured_c.py (peft oracles, base and adapter in one
dtype): an adapter in another dtype than its base (wider, narrower) on both overlays, the init
(dtype, zero or random values, positions sorted row-major as peft's mask gives them),
peft's config checks, and peft's refusal of GPT-2 Conv1D (which peft_problems reports). Written to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import pytest
import torch

import lora_func as lf
from lora_func.io.peft import peft_problems
from lora_func.variants import shira
from tests.models import tiny_model
from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype, init_params


def test_an_adapter_in_another_dtype_than_the_base():
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("shira", 6, 8, adapter_dtype=dtype, r=1, init_weights=False)


def test_init():
    p, b = init_params(shira, "shira", 2, 6, 8, random_seed=3)
    pos = b["shira_indices"]
    assert p["shira_weight"].shape == (28,) and torch.count_nonzero(p["shira_weight"]) == 0 and pos.dtype == torch.int64
    flat = pos[0] * 6 + pos[1]
    assert torch.equal(flat, flat.sort().values) and len(set(flat.tolist())) == 28 and int(pos.max()) < 8
    p, _ = init_params(shira, "shira", 2, 6, 8, init_weights=False)
    assert 0.6 < float(p["shira_weight"].std()) < 1.4


def test_peft_config_checks():
    assert_config_checks("shira", peft.ShiraConfig, {
        "init_weights": [1, None], "random_seed": [-1, 1.5, float("nan"), "3"], "mask_type": [3, None],
    }, good={"random_seed": [None, 0, 5]})


def test_peft_refuses_gpt2_conv1d_and_peft_problems_says_so():
    with pytest.raises((TypeError, ValueError)):
        peft.get_peft_model(tiny_model("gpt2"), peft.ShiraConfig(r=1, target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("shira", targets=["c_attn"], r=1))
    assert "refuses" in peft_problems(adapter)[0]
