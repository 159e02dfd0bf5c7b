import torch

from tests.variant_table import Row


def ia3_w_eff(p, b, W, bias, info):
    # variants.md §4: y = (x Wᵀ + b) ⊙ g, so W_eff = diag(g) W and b_eff = g ⊙ b.
    g = p["ia3_l"]
    return g[:, None] * W, None if bias is None else g * bias


def ia3_ff_w_eff(p, b, W, bias, info):
    # variants.md §4: y = (x ⊙ g) Wᵀ + b, so W_eff = W diag(g), bias unchanged. On a conv kernel
    # (out, c_in, *k) the gate scales input channel c, columns c·K .. c·K + K − 1 of the view.
    g = p["ia3_l"]
    per_column = torch.stack([g] * (W.shape[1] // g.shape[0]), dim=1).reshape(-1)
    return W * per_column[None, :], bias


ROWS = (
    # q_proj, v_proj (with bias: b_eff = g ⊙ b) and up_proj (no bias) on Llama/Qwen2; c_attn
    # and c_fc (GPT-2 Conv1D, with bias). Perturbations are larger (g = 1 ± 0.5), so that each
    # gate moves the output well above bf16 round-off.
    Row(
        variant="ia3",
        w_eff=ia3_w_eff,
        step0_nonzero=frozenset({"ia3_l"}),
        perturb_scale=0.5,
        targets={"llama": ["q_proj", "v_proj", "up_proj"], "qwen2": ["q_proj", "v_proj", "up_proj"], "gpt2": ["c_attn", "c_fc"]},
    ),
    # input scaling usually goes on layers whose input is an MLP/attention intermediate
    # (down_proj, o_proj / c_proj); q_proj too on Llama/Qwen2 (a biased layer whose output feeds
    # the attention scores; the bias must stay unscaled).
    Row(
        variant="ia3_ff",
        w_eff=ia3_ff_w_eff,
        step0_nonzero=frozenset({"ia3_l"}),
        perturb_scale=0.5,
        targets={"llama": ["q_proj", "o_proj", "down_proj"], "qwen2": ["q_proj", "o_proj", "down_proj"], "gpt2": ["mlp.c_proj", "attn.c_proj"]},
    ),
)
