import math

from tests.variant_table import Row


def lora_w_eff(p, b, W, bias, info):
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return W + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    Row(
        variant="lora", w_eff=lora_w_eff, step0_nonzero=frozenset({"lora_B"}), spec_kwargs={"r": 4, "alpha": 6.0},
        step0_by_kind={"embedding": frozenset({"lora_A"})},  # peft's embedding init: A = 0, B random
    ),
)
