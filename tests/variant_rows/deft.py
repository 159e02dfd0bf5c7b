import torch

from tests.variant_table import Row


def deft_w_eff(p, b, W, bias, info):
    # variants.md (deft): W_eff = (I − P_proj) W + s·Q R with P_proj = Q rightᵀ as a (d_out, d_out)
    # matrix; relu: Q = P, right = relu(P); qr: Q = right = the orthonormal factor of P.
    options = dict(info.options)
    P = p["deft_P"]
    Q = P if options["decomposition_method"] == "relu" else torch.linalg.qr(P)[0]
    right = torch.relu(P) if options["decomposition_method"] == "relu" else Q
    w_eff = (torch.eye(W.shape[0], dtype=W.dtype) - Q @ right.T) @ W
    if not options["para"]:
        alpha = options["injection_alpha"]
        s = 1.0 if alpha is None else alpha / min(info.r, W.shape[0])
        w_eff = w_eff + s * Q @ p["deft_R"]
    return w_eff, bias


# The identity init: P gets a gradient through relu(P)ᵀ W, R through Q.
ROW = Row(variant="deft", w_eff=deft_w_eff, step0_nonzero=frozenset({"deft_P", "deft_R"}), spec_kwargs={"r": 4})
