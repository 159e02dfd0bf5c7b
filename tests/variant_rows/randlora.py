import math

import torch

from tests.variant_table import Row


def randlora_w_eff(p, b, W, bias, info):
    # variants.md, RandLoRA: ΔW = s Σ_k U_B[:, k] U_A[k, :], U_A's rows in (rank, basis) order and
    # U_B's columns in (basis, rank) order; transposed when d_in > d_out. Term by term here.
    d_out, d_in = W.shape
    lam, gamma, A, B = p["randlora_lambda"], p["randlora_gamma"], b["randlora_A"], b["randlora_B"]
    r, n = lam.shape
    d, big = min(d_in, d_out), max(d_in, d_out)
    delta = torch.zeros(big, d, dtype=W.dtype)
    for k in range(r * n):
        i_a, j_a = divmod(k, n)
        j_b, i_b = divmod(k, r)
        delta += torch.outer(B[:big, j_b, i_b], lam[i_a, j_a] * A[i_a, 0, :d] * gamma[j_a])
    s = info.option("randlora_alpha") / r
    assert n == math.ceil(d / r)
    return W + s * (delta if d_in <= d_out else delta.T), bias


# q 32x32, v 16x32 (d_out < d_in: the transposed case), down 32x48 on Llama/Qwen2; c_attn 96x32 and
# c_fc 128x32 (d_in < d_out) on GPT-2.
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

# λ = 0 at init: only λ gets a gradient at step 0 (γ's is λ-weighted).
ROW = Row(
    variant="randlora",
    w_eff=randlora_w_eff,
    step0_nonzero=frozenset({"randlora_lambda"}),
    spec_kwargs={"r": 4, "randlora_alpha": 2.0},
    perturb_scale=0.5,
    targets=TARGETS,
)
