import torch

from tests.variant_table import Row


def butterfly_perm(n, blocks, half, factor):
    """peft 0.21's block_butterfly_perm, written as a list: within each stretch of n/blocks
    features, the chunks of `half` features reordered even chunks first, then odd ones."""
    if factor == 0:
        return list(range(n))
    size = n // blocks
    chunks = size // half
    order = [c for c in range(0, chunks, 2)] + [c for c in range(1, chunks, 2)]
    within = [c * half + j for c in order for j in range(half)]
    return [start + k for start in range(0, n, size) for k in within]


def boft_w_eff(p, buffers, W, bias, info):
    # variants.md (boft): y = s ⊙ (x M Wᵀ) + b, M = B_{m−1} ⋯ B_0, B_i = P_i blockdiag(R_i) P_iᵀ,
    # each block the Cayley map of its skew part; W_eff = diag(s) W Mᵀ.
    raw = p["boft_R"]
    m, k, b, _ = raw.shape
    n = W.shape[1]
    M = torch.eye(n, dtype=W.dtype)
    for i in range(m):
        perm = butterfly_perm(n, k // 2**i, b // 2, m - 1)
        P = torch.zeros(n, n, dtype=W.dtype)
        for row, col in enumerate(perm):
            P[row, col] = 1.0
        eye = torch.eye(b, dtype=W.dtype)
        blocks = [(eye - 0.5 * (r - r.T)) @ torch.linalg.inv(eye + 0.5 * (r - r.T)) for r in raw[i]]
        M = P @ torch.block_diag(*blocks) @ P.T @ M
    return p["boft_s"][:, None] * (W @ M.T), bias


ROWS = (
    # two butterfly factors of 2×2 blocks (a permutation between them; d_in a multiple of 4,
    # as the one-layer tests' 12), on the default targets
    Row(
        variant="boft",
        w_eff=boft_w_eff,
        step0_nonzero=frozenset({"boft_R", "boft_s"}),
        spec_kwargs={"boft_block_size": 2, "boft_n_butterfly_factor": 2},
        perturb_scale=0.2,
    ),
)
