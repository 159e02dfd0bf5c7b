import torch

from tests.variant_table import Row


def adamss_w_eff(p, b, W, bias, info):
    # variants.md (adamss): ΔW'[S_k] = B_k A_k V per subspace k (rows S_k of W' = [W | b]), each
    # B_k, A_k at its own rank ρ_k; W_eff = W + ΔW'[:, :d_in], b_eff = b + ΔW'[:, d_in].
    V = b["adamss_newB"]
    delta = torch.zeros(W.shape[0], V.shape[1], dtype=W.dtype)
    ranks, rows, sub = ([int(v) for v in b[n].tolist()] for n in ("subspace_ranks", "scatter_index", "subspace"))  # float64 here
    for t, (row, k) in enumerate(zip(rows, sub, strict=True)):
        delta[row] = p["adamss_B"][t, : ranks[k]] @ p["adamss_A"][k, : ranks[k]] @ V
    if bias is None:
        return W + delta, None
    return W + delta[:, : W.shape[1]], bias + delta[:, W.shape[1]]


# B = 0 at init: the identity exactly, and only B has a gradient at step 0. r=8 SVD directions,
# 3 subspaces of rank up to 2 (a subspace of one row has rank 1: the padding is masked).
ROWS = (Row(variant="adamss", w_eff=adamss_w_eff, step0_nonzero=frozenset({"adamss_B"}), spec_kwargs={"r": 8, "num_subspaces": 3, "subspace_rank": 2}),)
