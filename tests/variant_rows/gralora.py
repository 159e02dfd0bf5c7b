import torch

from tests.variant_table import Row


def gralora_w_eff(p, b, W, bias, info):
    # A k x k grid of rank-s LoRA blocks (s = r / k), plus the hybrid LoRA, times alpha / (r + hybrid_r);
    # built block by block; bias unchanged.
    opts = dict(info.options)
    k, r = opts["gralora_k"], info.r
    s, d_out, d_in = r // k, W.shape[0], W.shape[1]
    dw = torch.zeros_like(W)
    for m in range(k):
        for n in range(k):
            block = (p["gralora_A"][n][:, m * s:(m + 1) * s] @ p["gralora_B"][m][n * s:(n + 1) * s, :]).T
            dw[m * d_out // k:(m + 1) * d_out // k, n * d_in // k:(n + 1) * d_in // k] = block
    if opts["hybrid_r"]:
        dw = dw + p["gralora_B_general"] @ p["gralora_A_general"]
    return W + info.alpha / (r + opts["hybrid_r"]) * dw, bias


ROWS = (
    # B and the hybrid B are zero at init: the step-0 gradient reaches them only.
    Row(
        variant="gralora",
        w_eff=gralora_w_eff,
        step0_nonzero=frozenset({"gralora_B", "gralora_B_general"}),
        spec_kwargs={"r": 4, "alpha": 6.0, "hybrid_r": 2},
        perturb_scale=0.3,
    ),
)
