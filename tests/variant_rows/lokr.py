import torch

from tests.variant_table import Row


def _whole(p, which):
    return p[f"lokr_{which}"] if f"lokr_{which}" in p else p[f"lokr_{which}_a"] @ p[f"lokr_{which}_b"]


def lokr_w_eff(p, b, W, bias, info):
    # ΔW = (alpha / r) · W1 ⊗ W2 (each whole or a product of two factors); bias unchanged.
    w1, w2 = _whole(p, "w1"), _whole(p, "w2")
    if info.kernel and "lokr_w2" in p:
        # a conv's whole W2 as peft holds it, (k, n, *kernel), and peft's make_kron: torch.kron with
        # W1 (l, m, 1, 1) on a 2-D kernel, with the 2-D W1 on a Conv1d's 3-D W2; then the kernel's reshape
        w2 = w2.reshape(w2.shape[0], -1, *info.kernel)
        w1 = w1[:, :, None, None] if w2.dim() == 4 else w1
        return W + info.alpha / info.r * torch.kron(w1, w2).reshape(W.shape), bias
    return W + info.alpha / info.r * torch.kron(w1, w2), bias


ROWS = (
    # r=2 on the tiny models: W1 whole (zero at init, so it alone gets a step-0 gradient), W2
    # factored as W2a W2b (32 = 4·8, 96 = 8·12: r < max(k, n)/2).
    Row(variant="lokr", w_eff=lokr_w_eff, step0_nonzero=frozenset({"lokr_w1"}), spec_kwargs={"r": 2, "alpha": 3.0}, perturb_scale=0.3),
)
