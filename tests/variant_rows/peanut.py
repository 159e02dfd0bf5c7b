import torch

from tests.variant_table import Row

ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}


def peanut_w_eff(p, b, W, bias, info):
    # variants.md (peanut): h = σ(Wᵀ Aᵀ) through depth encoders and decoders (each decoder's
    # output plus the matching encoder input), ΔW = s·B hᵀ; written as peft's module chain. σ is
    # torch's own function for the act_fn names the suites use (not transformers' ACT2FN).
    options = dict(info.options)
    depth, act = options["depth"], ACTIVATIONS[options["act_fn"]]
    h = act(W.T @ p["peanut_A"].T)
    stack = []
    for i in range(depth):
        stack.append(h)
        h = act(h @ p[f"peanut_encoders_{i}"].T)
    for i in range(depth):
        h = act(h @ p[f"peanut_decoders_{i}"].T) + stack.pop()
    return W + options["scaling"] * (h @ p["peanut_B"].T).T, bias


# depth 2: two encoders and two decoders with their skips; B = 0 at init, so only B gets a
# gradient at step 0 (A, the encoders and decoders reach the output through B).
ROW = Row(variant="peanut", w_eff=peanut_w_eff, step0_nonzero=frozenset({"peanut_B"}), spec_kwargs={"r": 4, "depth": 2, "scaling": 0.7}, perturb_scale=0.3)
