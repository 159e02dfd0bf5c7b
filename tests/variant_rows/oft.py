import torch

from tests.variant_table import Row


def oft_blocks(vec, b, terms=5, neumann=True):
    """Orthogonal blocks from their strict upper triangles, written out with explicit loops
    (variants.md, oft): Q = U − Uᵀ, then peft 0.21's series I + 2Q + ⋯ + 2Q^{m−1} + Q^m
    (m = max(terms − 1, 3)) or the exact Cayley map (I − Q)(I + Q)⁻¹."""
    out = []
    for row in vec:
        q = torch.zeros(b, b, dtype=vec.dtype)
        n = 0
        for i in range(b):
            for j in range(i + 1, b):
                q[i, j], q[j, i] = row[n], -row[n]
                n += 1
        eye = torch.eye(b, dtype=vec.dtype)
        if not neumann:
            out.append((eye - q) @ torch.linalg.inv(eye + q))
            continue
        if terms <= 2:
            out.append(eye + 2 * q if terms == 2 else eye)
            continue
        m = max(terms - 1, 3)
        out.append(eye + sum(2 * torch.linalg.matrix_power(q, k) for k in range(1, m)) + torch.linalg.matrix_power(q, m))
    return out


def oft_w_eff(p, buffers, W, bias, info):
    # variants.md (oft): y = base(x R), R block diagonal, so W_eff = W Rᵀ; bias unchanged.
    # COFT: each block's skew matrix scaled onto the ball of radius eps/√k (fp32 radius) outside it.
    options = dict(info.options)
    vec = p["oft_R"]
    b = next(s for s in range(1, 64) if s * (s - 1) // 2 == vec.shape[1])
    if options["coft"]:
        radius = float(torch.tensor(options["eps"], dtype=torch.float32) / torch.tensor(float(vec.shape[0])).sqrt())
        norms = (2 * (vec**2).sum(dim=1, keepdim=True)).sqrt()  # ‖U − Uᵀ‖_F = √2 ‖u‖
        vec = torch.where(norms <= radius, vec, radius * vec / norms)
    blocks = oft_blocks(vec, b, options["num_cayley_neumann_terms"], options["use_cayley_neumann"])
    R = torch.block_diag(*(blocks * (W.shape[1] // b) if len(blocks) == 1 else blocks))
    return W @ R.T, bias


ROWS = (
    # block size 8 (peft's default 32 is the whole width of these tiny layers): 4 blocks on the
    # default targets (Llama q/v with bias, GPT-2 c_attn)
    Row(
        variant="oft",
        w_eff=oft_w_eff,
        step0_nonzero=frozenset({"oft_R"}),
        spec_kwargs={"oft_block_size": 8},
        perturb_scale=0.2,
    ),
)
