import torch

from tests.variant_table import Row


def lily_y(p, b, x, W, bias, info):
    # variants.md (lily): no W_eff; the layer's output from its input: h = x Aᵀ, the B's mixed by the
    # router's softmax averaged over every token of the call, y = x Wᵀ + b + scaling · h (Σ_e p_e B_e).
    h = x @ p["lily_A"].T
    probs = torch.softmax(h @ p["lily_router"].T, dim=-1)
    mix = probs.reshape(-1, probs.shape[-1]).mean(0)
    y = x @ W.T + h @ (mix[:, None, None] * p["lily_B"]).sum(0) * info.option("scaling")
    return y if bias is None else y + bias


# B = 0 at init: no router (the only per-layer tensor) gets a step-0 gradient. stride_A=2 ties the
# two layers' A of each target name; three B's mixed.
ROW = Row(variant="lily", w_eff=None, y_oracle=lily_y, step0_nonzero=frozenset(), spec_kwargs={"r": 4, "num_B": 3, "stride_A": 2, "scaling": 0.7}, perturb_scale=0.5)
