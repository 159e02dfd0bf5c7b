import math

import torch

from tests.variant_table import Row


def kasa_w_eff(p, b, W, bias, info):
    # KaSA replaces the base by its rank-(k - r) truncation W_res (checked against peft's truncated
    # base in tests/test_variant_kasa.py); the update is s·B diag(ΔΣ) A.
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return b["W_res"] + s * (p["lora_B"] @ torch.diag(p["lora_diag"])) @ p["lora_A"], bias


ROWS = (
    Row(
        variant="kasa",
        w_eff=kasa_w_eff,
        # B = 0 at init: only B's gradient is non-zero (A's and ΔΣ's pass through B).
        step0_nonzero=frozenset({"lora_B"}),
        spec_kwargs={"r": 4, "alpha": 6.0},
        # KaSA starts from the truncated base, not the base: the logits move by the r = 4 dropped
        # singular components of each target (measured 0.61 of max |logit| on Llama, 0.35 on GPT-2, seed 0); a bound,
        # not a check: the exact start is checked against peft in tests/test_variant_kasa.py.
        identity_rtol=1.0,
    ),
)
