import torch

from tests.variant_table import Row


def road_matrix(theta, alpha, group, d_out, variant="road_1"):
    """The d_out × d_out RoAd matrix built pair by pair (variants.md, road): in each group,
    feature j pairs with j + group/2; rows (c_j, −s_j) and (s_{j'}, c_{j'})."""
    R = torch.zeros(d_out, d_out, dtype=theta.dtype)
    half = group // 2
    for g in range(d_out // group):
        for j in range(half):
            lo, hi = g * group + j, g * group + half + j
            if variant == "road_1":
                t = theta[g * half + j]
                a = alpha[g * half + j]
                c_lo = c_hi = a * torch.cos(t)
                s_lo = s_hi = a * torch.sin(t)
            elif variant == "road_2":
                c_lo, s_lo = alpha[lo] * torch.cos(theta[lo]), alpha[lo] * torch.sin(theta[lo])
                c_hi, s_hi = alpha[hi] * torch.cos(theta[hi]), alpha[hi] * torch.sin(theta[hi])
            else:  # road_4: per group, `group` cosine entries then `group` sine entries
                base = 2 * g * group
                c_lo, c_hi = alpha[base + j] * torch.cos(theta[base + j]), alpha[base + half + j] * torch.cos(theta[base + half + j])
                s_lo = alpha[base + group + j] * torch.sin(theta[base + group + j])
                s_hi = alpha[base + group + half + j] * torch.sin(theta[base + group + half + j])
            R[lo, lo], R[lo, hi] = c_lo, -s_lo
            R[hi, hi], R[hi, lo] = c_hi, s_hi
    return R


def road_w_eff(p, buffers, W, bias, info):
    # y' = R (W x + b): W_eff = R W, b_eff = R b.
    R = road_matrix(p["road_theta"], p["road_alpha"], dict(info.options)["group_size"], W.shape[0], dict(info.options)["road_variant"])
    return R @ W, None if bias is None else R @ bias


ROWS = (
    # group_size 2 divides every target's d_out (and the one-layer tests' 10)
    Row(
        variant="road",
        w_eff=road_w_eff,
        step0_nonzero=frozenset({"road_theta", "road_alpha"}),
        spec_kwargs={"group_size": 2},
        perturb_scale=0.3,
    ),
)
