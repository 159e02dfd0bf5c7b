from tests.variant_table import Row


def _path(p, name):
    if f"glora_{name}_Xd" in p:
        return p[f"glora_{name}_Xd"] @ p[f"glora_{name}_Xu"]
    return p.get(f"glora_{name}_X", 0.0)


def glora_w_eff(p, buffers, W, bias, info):
    # variants.md (glora): W_eff = W + W ⊙ A + B, b_eff = b + b ⊙ D + E + W C; a missing path is 0.
    A, B, C, D, E = (_path(p, n) for n in "ABCDE")
    w_eff = W + W * A + B
    if bias is None:
        return w_eff, None
    wc = (W @ C).squeeze(-1) if isinstance(C, type(W)) else 0.0
    return w_eff, bias + bias * D + E + wc


# Biased targets (C, D, E present on every layer: the suite's step-0 pattern is per tensor name);
# a bias-free layer (A and B alone) is checked against peft in tests/test_variant_glora.py.
# Every path low-rank where it can be, D and E per output feature: step 0 moves the Xd of A, B,
# C (their Xu multiply a zero Xd) and the vectors D, E.
ROWS = (
    Row(
        variant="glora",
        w_eff=glora_w_eff,
        step0_nonzero=frozenset({"glora_A_Xd", "glora_B_Xd", "glora_C_Xd", "glora_D_X", "glora_E_X"}),
        spec_kwargs={"r": 3, "config_D_E": "vector"},
        perturb_scale=0.2,
        targets={"llama": ["q_proj", "v_proj", "o_proj"], "qwen2": ["q_proj", "v_proj"], "gpt2": ["c_attn", "c_fc"]},
    ),
)
