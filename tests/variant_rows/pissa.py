import math

from tests.variant_table import Row


def pissa_w_eff(p, b, W, bias, info):
    # PiSSA replaces the base weight by its frozen residual: W itself does not enter W_eff
    # (W_res is checked against an independent float64 SVD in tests/test_variant_pissa.py).
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return b["W_res"] + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    Row(
        variant="pissa",
        w_eff=pissa_w_eff,
        step0_nonzero=frozenset({"lora_A", "lora_B"}),
        spec_kwargs={"r": 4, "alpha": 6.0},
        # SVD round-off (W_res + s·B A vs W, and x W_resᵀ + s (x Aᵀ) Bᵀ vs x Wᵀ): measured
        # max |Δlogit| / max |base logit| <= 8e-7 over seeds 0-4, both layer kinds, both
        # overlays (~3e-6 absolute, logits up to ~4); ~5x headroom. A wrong split (scale, rank,
        # residual) moves the logits by O(1).
        identity_rtol=4e-6,
    ),
)
