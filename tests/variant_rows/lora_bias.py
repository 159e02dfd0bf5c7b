import math

from tests.variant_table import Row


def lora_bias_w_eff(p, b, W, bias, info):
    # peft's merge: W + s·B A and bias + s·lora_B.bias
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return W + s * p["lora_B"] @ p["lora_A"], bias + s * p["lora_bias"]


ROWS = (
    Row(
        variant="lora_bias",
        w_eff=lora_bias_w_eff,
        # B = 0 and b_B = 0 at init: both get the output's gradient; A's passes through B.
        step0_nonzero=frozenset({"lora_B", "lora_bias"}),
        spec_kwargs={"r": 4, "alpha": 6.0},
    ),
)
