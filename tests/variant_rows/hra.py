import torch

from tests.variant_table import Row


def householder_product(U):
    """R = H_0 H_1 ⋯ H_{r-1}, H_i = I - 2 û_i û_iᵀ, built explicitly (d_in × d_in)."""
    d_in, r = U.shape
    R = torch.eye(d_in, dtype=U.dtype)
    for i in range(r):
        u = U[:, i] / torch.sqrt((U[:, i] ** 2).sum())
        R = R @ (torch.eye(d_in, dtype=U.dtype) - 2.0 * torch.outer(u, u))
    return R


def hra_w_eff(p, b, W, bias, info):
    # variants.md §6: W_eff = W R, bias unchanged.
    return W @ householder_product(p["hra_u"]), bias


# Llama/Qwen2: v/o, not q: in the tiny models attention scores are ~0, so q_proj/k_proj of the
# last layer move the logits by < 1e-5 and "each tensor alone changes the output" cannot see them.
# GPT-2: the MLP input projection as well, since c_attn alone moves tiny-GPT-2 logits by ~1e-2,
# too little to separate an adapter from bf16 round-off in the dtype test.
TARGETS = {"llama": ["v_proj", "o_proj"], "qwen2": ["v_proj", "o_proj"], "gpt2": ["c_attn", "c_fc"]}

ROWS = (
    # paired reflections cancel only up to fp32 round-off (x − 2(x·û)û applied twice).
    Row(variant="hra", w_eff=hra_w_eff, step0_nonzero=frozenset({"hra_u"}), spec_kwargs={"r": 4}, identity_atol=1e-5, perturb_scale=0.5, targets=TARGETS),
)
