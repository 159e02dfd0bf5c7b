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


# Llama/Qwen2: q/v (with bias) and down_proj (no bias, d_in > d_out), as in the peft oracle
# test; GPT-2: c_attn and the MLP input projection c_fc.
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

ROWS = (
    # paired reflections cancel only up to fp32 round-off (x − 2(x·û)û applied twice): measured
    # max |Δlogit| / max |base logit| <= 9.5e-7 over seeds 0-4, both layer kinds and overlays
    # (~4e-6 absolute); an unpaired reflection moves the logits by O(1).
    Row(variant="hra", w_eff=hra_w_eff, step0_nonzero=frozenset({"hra_u"}), spec_kwargs={"r": 4}, identity_rtol=4e-6, perturb_scale=0.5, targets=TARGETS),
)
