import math

from tests.variant_table import Row


def lora_ga_w_eff(p, b, W, bias, info):
    # LoRA-GA replaces the base weight by its frozen residual, as PiSSA (factors and residual are
    # checked against peft's preprocess_loraga in tests/test_init_lora_ga.py).
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return b["W_res"] + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    Row(variant="lora_ga", w_eff=lora_ga_w_eff, step0_nonzero=frozenset({"lora_A", "lora_B"}), spec_kwargs={"r": 4, "alpha": 6.0},
        identity_rtol=4e-6, calibration=True),
)
