import math

from tests.variant_table import Row


def alora_w_eff(p, b, W, bias, info):
    # Until invoked, aLoRA acts on every token: LoRA (the gating from the invocation on is checked
    # against peft in tests/test_variant_alora.py)
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return W + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    Row(variant="alora", w_eff=alora_w_eff, step0_nonzero=frozenset({"lora_B"}), spec_kwargs={"r": 4, "alpha": 6.0, "invocation_tokens": [5, 9]}),
)
