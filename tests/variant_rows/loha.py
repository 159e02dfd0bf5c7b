import torch

from tests.variant_table import Row


def loha_w_eff(p, b, W, bias, info):
    # ΔW = (alpha / r) · (W1a W1b) ⊙ (W2a W2b), built densely; bias unchanged.
    dw = torch.mul(p["hada_w1_a"] @ p["hada_w1_b"], p["hada_w2_a"] @ p["hada_w2_b"])
    return W + info.alpha / info.r * dw, bias


ROWS = (
    # W2b = 0 at init: the step-0 gradient reaches W2b only.
    Row(variant="loha", w_eff=loha_w_eff, step0_nonzero=frozenset({"hada_w2_b"}), spec_kwargs={"r": 4, "alpha": 6.0}, perturb_scale=0.3),
)
