"""MiSS's init beyond the peft oracles (tests/test_variants_structured_a.py), which start from
perturbed tensors and so cannot see the init: every layout's zero block, ``init="random"``'s
kaiming-uniform draw (``a = √5``, fan-in ``d_out`` of the ``(r, d_out)`` block) and the
requested dtype. Written to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import pytest
import torch

import lora_func as lf
from lora_func.io.peft import peft_problems

from lora_func.variants import miss
from tests.models import tiny_model
from tests.variant_checks import assert_config_checks, assert_kaiming, assert_other_adapter_dtype, init_params, read_options


def test_init_is_peft_s():
    r, d_in, d_out = 4, 24, 64
    p, _ = init_params(miss, "miss", r, d_in, d_out, init="random")
    assert p["miss_block"].shape == (r, d_out)
    assert_kaiming(p["miss_block"], d_out)
    for how, shape in (("miss", (r, d_out)), ("mini", (r, 2)), ("bat", (d_out // r, r, r))):
        p, _ = init_params(miss, "miss", r, d_in, d_out, init=how, mini_r=2)
        assert p["miss_block"].shape == shape and torch.count_nonzero(p["miss_block"]) == 0, how


def mini_w_eff(p, b, w, bias, info):
    """ΔW[o, j] = block[j mod r, o mod mini_r], by loops."""
    out = w.clone()
    block = p["miss_block"]
    for o in range(w.shape[0]):
        for j in range(w.shape[1]):
            out[o, j] += block[j % block.shape[0], o % block.shape[1]]
    return out, bias


def bat_w_eff(p, b, w, bias, info):
    """Each r × r block W[b, c] becomes W[b, c] + W[b, c] M_b + M_b."""
    out = w.clone()
    block = p["miss_block"]
    r = block.shape[-1]
    for i in range(w.shape[0] // r):
        for c in range(w.shape[1] // r):
            tile = w[i * r:(i + 1) * r, c * r:(c + 1) * r]
            out[i * r:(i + 1) * r, c * r:(c + 1) * r] += tile @ block[i] + block[i]
    return out, bias


@pytest.mark.parametrize(("how", "oracle"), [("bat", bat_w_eff), ("mini", mini_w_eff)])
def test_an_adapter_in_another_dtype_than_the_base(how, oracle):
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("miss", 8, 12, adapter_dtype=dtype, w_eff_fn=oracle, r=4, init=how, mini_r=2)


def test_peft_config_checks():
    assert_config_checks("miss", peft.MissConfig, {
        "init_weights": [1, "lora", None], "mini_r": [0, 1.5, True], "miss_dropout": [1.0, -0.1, float("inf"), 3],
    }, good={"init_weights": [True, False, "bat", "mini"], "mini_r": [1, 4], "miss_dropout": [0, 0.99]})
    assert read_options("miss", {"init_weights": False, "mini_r": 3}) == {"init": "random", "mini_r": 3, "dropout": 0.0}


def test_peft_refuses_gpt2_conv1d_and_peft_problems_says_so():
    with pytest.raises(TypeError, match="not supported"):
        peft.get_peft_model(tiny_model("gpt2"), peft.MissConfig(r=2, target_modules=["c_attn"]))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("miss", targets=["c_attn"], r=2))
    assert "refuses" in peft_problems(adapter)[0]
