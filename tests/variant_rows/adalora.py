from tests.variant_table import Row


def adalora_w_eff(p, b, W, bias, info):
    # peft's SVDLinear: W + B (A ⊙ E) · alpha / (ranknum + 1e-5), ranknum = the initial rank r.
    return W + p["lora_B"] @ (p["lora_A"] * p["lora_E"]) * info.alpha / (info.r + 1e-5), bias


ROWS = (
    # E = 0 at init: the adapter is the identity exactly and only E has a gradient at step 0.
    Row(variant="adalora", w_eff=adalora_w_eff, step0_nonzero=frozenset({"lora_E"}), spec_kwargs={"r": 4, "init_r": 4, "alpha": 6.0},
        # ΔW is cubic in the perturbation (B (E ⊙ A)): 0.1 leaves an effect below bf16 rounding of the logits, 0.5 one whose fp32 round-off exceeds the suite's 2e-5.
        perturb_scale=0.3),
)
