from tests.variant_table import Row


def vera_w_eff(p, b, W, bias, info):
    # variants.md, VeRA: W_eff = W + Λ_b B Λ_d A with the layer's top-left slices of the shared basis.
    d_out, d_in = W.shape
    A, B = b["vera_A"][:, :d_in], b["vera_B"][:d_out, :]
    return W + p["vera_lambda_b"][:, None] * B @ (p["vera_lambda_d"][:, None] * A), bias


# Layers of different shapes (q_proj 32x32, v_proj 16x32, down_proj 32x48 on Llama; c_attn 96x32
# and c_fc 128x32 on GPT-2) so that every layer reads a different slice of the shared basis.
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

# λ_b = 0 at init: only λ_b gets a gradient at step 0 (λ_d's is λ_b-weighted).
ROW = Row(variant="vera", w_eff=vera_w_eff, step0_nonzero=frozenset({"vera_lambda_b"}), spec_kwargs={"r": 4}, perturb_scale=0.5, targets=TARGETS)
