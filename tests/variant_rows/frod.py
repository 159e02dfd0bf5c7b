import torch

from tests.variant_table import Row


def frod_w_eff(p, b, W, bias, info):
    # variants.md (frod): W_eff = U (S + diag λ) Vᵀ replacing W, S the (d_in, d_in) matrix with the
    # trained values at the category's positions (a Python loop; a repeated position sums; the positions arrive as float64).
    lam = p["frod_lambda_l"]
    s = torch.zeros(lam.shape[0], lam.shape[0], dtype=lam.dtype)
    for k, (i, j) in enumerate(b["frod_s_indices"].T.tolist()):
        s[int(i), int(j)] += p["frod_lambda_s_values"][k]
    return b["frod_U"] @ (s + torch.diag(lam)) @ b["frod_V"].T, bias


# W_eff = W at init up to the round-off of solving U, λ against V (not bit-exact); λ and S's
# values both get a step-0 gradient. sparse_rate 0.1: a few positions on the tiny layers.
ROW = Row(
    variant="frod",
    w_eff=frod_w_eff,
    step0_nonzero=frozenset({"frod_lambda_l", "frod_lambda_s_values"}),
    spec_kwargs={"sparse_rate": 0.1},
    identity_rtol=1e-5,
)
