import math

from tests.variant_table import Row


def dora_w_eff(p, b, W, bias, info):
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    V = W + s * p["lora_B"] @ p["lora_A"]
    norm = V.norm(dim=1, keepdim=True)  # per output row, over d_in (detached only for gradients)
    return p["lora_magnitude_vector"][:, None] / norm * V, bias  # bias not rescaled


ROWS = (
    Row(
        variant="dora",
        w_eff=dora_w_eff,
        step0_nonzero=frozenset({"lora_B", "lora_magnitude_vector"}),
        step0_by_kind={"embedding": frozenset({"lora_A", "lora_magnitude_vector"})},  # peft's embedding init: A = 0, B random
        spec_kwargs={"r": 4, "alpha": 6.0},
        identity_rtol=0.0,  # m / n == 1 exactly at init: same norm computation at init and in the forms
    ),
)
