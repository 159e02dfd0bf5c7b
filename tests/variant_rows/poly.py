import torch

from tests.variant_table import Row


def poly_w_eff(p, b, W, bias, info):
    # variants.md (poly): task t's skill weights w = σ(z_t) / Σ_skills σ(z_t) per split q; A_t, B_t the
    # split blocks of the mixed skills; W_eff = W + (A_t B_t)ᵀ / r. Written with loops, no einsum.
    opts = dict(info.options)
    n, skills = opts["n_splits"], opts["n_skills"]
    z = torch.sigmoid(p["poly_router"][int(b["poly_task"])].reshape(n, skills))
    w = z / (z.sum(-1, keepdim=True) + 1e-12)
    a_blocks = [sum(w[q, s] * p["poly_lora_A"][q, s] for s in range(skills)) for q in range(n)]
    b_blocks = [sum(w[q, s] * p["poly_lora_B"][q, s] for s in range(skills)) for q in range(n)]
    a, b_ = torch.cat(a_blocks, 0), torch.cat(b_blocks, 1)
    return W + (a @ b_).T / info.r, bias


ROWS = (
    # B = 0 at init: the identity exactly; only B has a step-0 gradient (A's and the router's pass
    # through B). Two splits (MHR) and three tasks, so a split or task mix-up shows.
    Row(
        variant="poly",
        w_eff=poly_w_eff,
        step0_nonzero=frozenset({"poly_lora_B"}),
        spec_kwargs={"r": 2, "n_tasks": 3, "n_skills": 3, "n_splits": 2},
        perturb_scale=0.3,
    ),
)
