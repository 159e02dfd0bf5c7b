import math

from tests.variant_table import Row


def loftq_w_eff(p, b, W, bias, info):
    # LoftQ replaces the base weight by its quantization W_res (checked against peft's loftq_init,
    # bit for bit, in tests/test_init_loftq.py); the factors correct part of the quantization error.
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return b["W_res"] + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    Row(
        variant="loftq",
        w_eff=loftq_w_eff,
        step0_nonzero=frozenset({"lora_A", "lora_B"}),
        spec_kwargs={"r": 4, "alpha": 4.0},
        # LoftQ starts from the NF4 base plus a rank-4 correction, not the float base: the logits
        # move by the remaining quantization error (measured 0.32 of max |logit| on Llama, 0.19 on GPT-2,
        # seed 0); a bound, not a check.
        identity_rtol=0.6,
    ),
)
