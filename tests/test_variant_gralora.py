"""GraLoRA's init beyond the peft oracles (tests/test_variants_structured_a.py), which start
from perturbed tensors and so cannot see the init: peft's kaiming-uniform draws (``a = √5``,
fan-in per drawn block) and the requested dtype. Written to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import torch

import lora_func as lf

from lora_func.variants import gralora
from tests.variant_checks import assert_config_checks, assert_kaiming, init_params, layer_info


def test_init_draws_are_peft_s():
    k, r, d_in, d_out, hybrid_r = 2, 8, 64, 48, 3
    p, _ = init_params(gralora, "gralora", r, d_in, d_out, gralora_k=k, hybrid_r=hybrid_r)
    assert p["gralora_A"].shape == (k, d_in // k, r) and p["gralora_B"].shape == (k, r, d_out // k)
    assert_kaiming(p["gralora_A"], d_in // k, "A")  # peft draws each block (r, d_in/k)
    assert_kaiming(p["gralora_A_general"], d_in, "A_general")
    assert torch.count_nonzero(p["gralora_B"]) == 0 and torch.count_nonzero(p["gralora_B_general"]) == 0
    p, _ = init_params(gralora, "gralora", r, d_in, d_out, gralora_k=k, hybrid_r=hybrid_r, init="random")
    assert_kaiming(p["gralora_B"], r, "B")  # (d_out/k, r) blocks
    assert_kaiming(p["gralora_B_general"], hybrid_r, "B_general")


def test_peft_config_checks():
    assert_config_checks("gralora", peft.GraloraConfig, {
        "gralora_k": [0, 1.5, True, "2"], "hybrid_r": [-1, 0.5], "gralora_dropout": [1.0, -0.1, float("nan"), 5], "init_weights": [1, "x"],
    }, good={"gralora_k": [1, 3], "hybrid_r": [0, 2], "gralora_dropout": [0, 0.99]})


def test_one_block_is_plain_lora():
    """``gralora_k=1`` (peft allows it): one block, ``ΔW = t·Bᵀ Aᵀ``, a LoRA of rank r."""
    r, d_in, d_out = 3, 5, 4
    spec = lf.AdapterSpec("gralora", targets=["x"], r=r, gralora_k=1)
    i = layer_info("gralora", r, d_in, d_out, alpha=6.0, **dict(spec.options))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, d_in, r, generator=g, dtype=torch.float64), torch.randn(1, r, d_out, generator=g, dtype=torch.float64)
    dw = gralora.delta_weight({"gralora_A": a, "gralora_B": b}, i)
    assert torch.allclose(dw, 2.0 * b[0].T @ a[0].T, rtol=1e-12, atol=0)
