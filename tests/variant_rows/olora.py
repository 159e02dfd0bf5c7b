import math

from tests.variant_table import Row


def olora_w_eff(p, b, W, bias, info):
    # OLoRA replaces the base weight by its frozen residual, as PiSSA (the residual and the QR
    # factors are checked against peft in tests/test_inits.py).
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return b["W_res"] + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    # QR round-off (W_res + s·B A vs W): an O(1) error in the split (scale, rank, residual) moves the
    # logits by O(1); bound as PiSSA's.
    Row(variant="olora", w_eff=olora_w_eff, step0_nonzero=frozenset({"lora_A", "lora_B"}), spec_kwargs={"r": 4, "alpha": 6.0}, identity_rtol=4e-6),
)
