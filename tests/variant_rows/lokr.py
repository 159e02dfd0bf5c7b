import torch

from tests.variant_table import Row


def _whole(p, which):
    return p[f"lokr_{which}"] if f"lokr_{which}" in p else p[f"lokr_{which}_a"] @ p[f"lokr_{which}_b"]


def lokr_w_eff(p, b, W, bias, info):
    # ΔW = (alpha / r) · W1 ⊗ W2 (each whole or a product of two factors); bias unchanged.
    return W + info.alpha / info.r * torch.kron(_whole(p, "w1"), _whole(p, "w2")), bias


ROWS = (
    # r=2 on the tiny models: W1 whole (zero at init, so it alone gets a step-0 gradient), W2
    # factored as W2a W2b (32 = 4·8, 96 = 8·12: r < max(k, n)/2).
    Row(variant="lokr", w_eff=lokr_w_eff, step0_nonzero=frozenset({"lokr_w1"}), spec_kwargs={"r": 2, "alpha": 3.0}, perturb_scale=0.3),
)
