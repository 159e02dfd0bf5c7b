import math

from tests.variant_table import Row


def velora_w_eff(p, b, W, bias, info):
    # VeLoRA's forward is LoRA's (only A's gradient in a training step differs: checked against
    # peft in tests/test_variant_velora.py)
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return W + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    Row(variant="velora", w_eff=velora_w_eff, step0_nonzero=frozenset({"lora_B"}), spec_kwargs={"r": 4, "alpha": 6.0, "num_groups": 4}),
)
