"""MiSS's init beyond the peft oracles (tests/test_variants_structured_a.py), which start from
perturbed tensors and so cannot see the init: every layout's zero block, ``init="random"``'s
kaiming-uniform draw (``a = √5``, fan-in ``d_out`` of the ``(r, d_out)`` block) and the
requested dtype. Written to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import torch

from lora_func.variants import miss
from tests.variant_checks import assert_kaiming, init_params


def test_init_is_peft_s():
    r, d_in, d_out = 4, 24, 64
    p, _ = init_params(miss, "miss", r, d_in, d_out, init="random")
    assert p["miss_block"].shape == (r, d_out)
    assert_kaiming(p["miss_block"], d_out)
    for how, shape in (("miss", (r, d_out)), ("mini", (r, 2)), ("bat", (d_out // r, r, r))):
        p, _ = init_params(miss, "miss", r, d_in, d_out, init=how, mini_r=2)
        assert p["miss_block"].shape == shape and torch.count_nonzero(p["miss_block"]) == 0, how
