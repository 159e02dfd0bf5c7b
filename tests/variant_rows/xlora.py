from tests.variant_table import Row


def xlora_w_eff(p, b, W, bias, info):
    # variants.md (xlora): a plain call is peft's scalings pass: every scaling scaling_pass_value (0.5
    # here), no top-k, g = global_scaling_weight (1.5): W + g · Σ_k 0.5 · s_k · B_k A_k.
    delta = sum(0.5 * b["xlora_scales"][k] * p["lora_B"][k] @ p["lora_A"][k] for k in range(p["lora_A"].shape[0]))
    return W + 1.5 * delta, bias


ROWS = (
    # The adapter as stored (constant scalings: the only configuration with a merged weight; the
    # routed call with per-token scalings is tested against peft in tests/test_routed_xlora.py).
    # B = 0 at init: the identity; only B moves at step 0. The classifier acts in the routed call
    # only (xlora_call): the plain call's checks leave it out.
    Row(variant="xlora", w_eff=xlora_w_eff, step0_nonzero=frozenset({"lora_B"}),
        spec_kwargs={"r": 2, "alpha": 6.0, "num_experts": 2, "hidden_size": 4, "scaling_pass_value": 0.5, "global_scaling_weight": 1.5},
        training_only=frozenset({"classifier_0_weight", "classifier_0_bias"})),
)
