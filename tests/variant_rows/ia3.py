from tests.variant_table import Row


def ia3_w_eff(p, b, W, bias, info):
    # variants.md §4: y = (x Wᵀ + b) ⊙ g, so W_eff = diag(g) W and b_eff = g ⊙ b.
    g = p["ia3_l"]
    return g[:, None] * W, None if bias is None else g * bias


def ia3_ff_w_eff(p, b, W, bias, info):
    # variants.md §4: y = (x ⊙ g) Wᵀ + b, so W_eff = W diag(g), bias unchanged.
    return W * p["ia3_l"][None, :], bias


ROWS = (
    # q/v (Llama, no bias) and c_attn/c_fc (GPT-2 Conv1D, with bias: b_eff = g ⊙ b).
    # GPT-2 adds c_fc and perturbations are larger (g = 1 ± 0.5): c_attn alone at g = 1 ± 0.1 moves
    # tiny-GPT-2 logits by ~2e-3, no more than bf16 round-off in the dtype test.
    Row(
        variant="ia3",
        w_eff=ia3_w_eff,
        step0_nonzero=frozenset({"ia3_l"}),
        perturb_scale=0.5,
        targets={"llama": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"], "gpt2": ["c_attn", "c_fc"]},
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
