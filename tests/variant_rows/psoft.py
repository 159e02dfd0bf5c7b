import torch

from tests.variant_table import Row


def psoft_rotation(p, r, options):
    """R (r, r) written out from the triangle (variants.md, psoft): Q[i, j] = -Q[j, i] = u_n in
    row-major order, R = (I + Q)(I − Q)⁻¹, rows scaled by b, columns by a."""
    vec = p["psoft_R"]
    if options["psoft_orth"]:
        q = torch.zeros(r, r, dtype=vec.dtype)
        n = 0
        for i in range(r):
            for j in range(i + 1, r):
                q[i, j], q[j, i] = vec[n], -vec[n]
                n += 1
        eye = torch.eye(r, dtype=vec.dtype)
        R = (eye + q) @ torch.linalg.inv(eye - q)
    else:
        R = vec
    if "psoft_vector_b" in p:
        R = torch.diag(p["psoft_vector_b"]) @ R
    if "psoft_vector_a" in p:
        R = R @ torch.diag(p["psoft_vector_a"])
    return R


def psoft_w_eff(p, buffers, W, bias, info):
    # variants.md (psoft): W_eff = W + (alpha / r) · B (R − I) A, A and B the frozen SVD factors.
    r = buffers["psoft_A"].shape[0]
    R = psoft_rotation(p, r, dict(info.options))
    return W + info.alpha / info.r * buffers["psoft_B"] @ (R - torch.eye(r, dtype=W.dtype)) @ buffers["psoft_A"], bias


# R = I at init: the skew triangle and both magnitude vectors get a gradient at step 0.
ROW = Row(
    variant="psoft",
    w_eff=psoft_w_eff,
    step0_nonzero=frozenset({"psoft_R", "psoft_vector_a", "psoft_vector_b"}),
    spec_kwargs={"r": 4, "alpha": 6.0},
    perturb_scale=0.2,
)
