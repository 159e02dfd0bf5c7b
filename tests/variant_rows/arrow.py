from tests.variant_table import Row


def arrow_w_eff(p, b, W, bias, info):
    # variants.md (arrow): one expert routes every token with coefficient 1: W + s·B A, s its scale.
    return W + b["arrow_scales"][0] * p["lora_B"][0] @ p["lora_A"][0], bias


ROWS = (
    # One expert: the only configuration with a merged weight (several experts route per token,
    # tested against peft in tests/test_routed.py). B = 0 at init: the identity; only B moves at step 0.
    Row(variant="arrow", w_eff=arrow_w_eff, step0_nonzero=frozenset({"lora_B"}), spec_kwargs={"r": 2, "alpha": 6.0, "num_experts": 1, "top_k": 1}),
)
