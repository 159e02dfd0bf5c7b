from tests.variant_table import Row


def pvera_w_eff(p, b, W, bias, info):
    # variants.md, PVeRA: at inference z = μ, so W_eff = W + Λ_b B Λ_{d,:r} A_{:r} (the layer's slices).
    d_out, d_in = W.shape
    r = b["pvera_B"].shape[1]
    A, B = b["pvera_A"][:r, :d_in], b["pvera_B"][:d_out, :]
    return W + p["pvera_lambda_b"][:, None] * B @ (p["pvera_lambda_d"][:r, None] * A), bias


TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

# λ_b = 0 at init: only λ_b gets a gradient at step 0.
ROW = Row(variant="pvera", w_eff=pvera_w_eff, step0_nonzero=frozenset({"pvera_lambda_b"}), spec_kwargs={"r": 4}, perturb_scale=0.5, targets=TARGETS)
