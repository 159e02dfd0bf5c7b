import math

from tests.variant_table import Row


def mica_w_eff(p, b, W, bias, info):
    # lora_B is a frozen buffer (the minor left singular vectors, checked against peft in
    # tests/test_inits.py); only lora_A trains.
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return W + s * b["lora_B"] @ p["lora_A"], bias


ROWS = (
    Row(variant="mica", w_eff=mica_w_eff, step0_nonzero=frozenset({"lora_A"}), spec_kwargs={"r": 4, "alpha": 6.0}),
)
