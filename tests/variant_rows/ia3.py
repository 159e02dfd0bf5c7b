from tests.variant_table import Row


def ia3_w_eff(p, b, W, bias, info):
    # variants.md §4: y = (x Wᵀ + b) ⊙ g, so W_eff = diag(g) W and b_eff = g ⊙ b.
    g = p["ia3_l"]
    return g[:, None] * W, None if bias is None else g * bias


def ia3_ff_w_eff(p, b, W, bias, info):
    # variants.md §4: y = (x ⊙ g) Wᵀ + b, so W_eff = W diag(g), bias unchanged.
    return W * p["ia3_l"][None, :], bias


ROWS = (
    # v_proj (with bias: b_eff = g ⊙ b) and up_proj (no bias) on Llama/Qwen2; c_attn and c_fc
    # (GPT-2 Conv1D, with bias). Not q/k: tiny-model attention scores are ~0, so scaling q/k of the
    # last layer moves the logits by < 1e-5. Perturbations are larger (g = 1 ± 0.5): on GPT-2,
    # c_attn alone at g = 1 ± 0.1 moves the logits by ~2e-3, no more than bf16 round-off.
    Row(
        variant="ia3",
        w_eff=ia3_w_eff,
        step0_nonzero=frozenset({"ia3_l"}),
        perturb_scale=0.5,
        targets={"llama": ["v_proj", "up_proj"], "qwen2": ["v_proj", "up_proj"], "gpt2": ["c_attn", "c_fc"]},
    ),
    # input scaling belongs on layers whose input is an MLP/attention intermediate.
    Row(
        variant="ia3_ff",
        w_eff=ia3_ff_w_eff,
        step0_nonzero=frozenset({"ia3_l"}),
        perturb_scale=0.5,
        targets={"llama": ["down_proj", "o_proj"], "qwen2": ["down_proj", "o_proj"], "gpt2": ["mlp.c_proj", "attn.c_proj"]},
    ),
)
