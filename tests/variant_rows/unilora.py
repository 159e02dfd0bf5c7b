from tests.variant_table import Row


def unilora_w_eff(p, b, W, bias, info):
    # variants.md, Uni-LoRA: A = θ[idx_A] ⊙ s_A, B = θ[idx_B] ⊙ s_B, W_eff = W + B A (the suite hands
    # every buffer over as float64, the indices too).
    theta = p["unilora_theta_d"]
    A = theta[b["unilora_indices_A"].long()] * b["unilora_scales_A"]
    B = theta[b["unilora_indices_B"].long()] * b["unilora_scales_B"]
    return W + B @ A, bias


TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

# Not the identity at init (peft's init: θ ~ U(-0.02, 0.02)): measured max |Δlogit| / max |base logit|
# at init 4.4e-5 to 2.2e-4 over seeds 0-2, both layer kinds.
ROW = Row(
    variant="unilora",
    w_eff=unilora_w_eff,
    step0_nonzero=frozenset(),  # no per-layer trainables: θ is shared (its gradient: tests/test_variant_unilora.py)
    spec_kwargs={"r": 2, "theta_d_length": 40},
    identity_rtol=1e-3,
    # θ's entries reach ΔW as products of two (times scales ~0.2): a large perturbation makes the
    # adapter's effect stand clear of bf16 rounding in the half-precision check.
    perturb_scale=2.0,
    targets=TARGETS,
)
