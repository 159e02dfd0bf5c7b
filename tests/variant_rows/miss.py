from tests.variant_table import Row


def miss_w_eff(p, b, W, bias, info):
    # ΔW[o, j] = block[j mod r, o]: the (r, d_out) block tiled along the input; bias unchanged.
    block = p["miss_block"]
    out = W.clone()
    for j in range(W.shape[1]):
        out[:, j] += block[j % block.shape[0]]
    return out, bias


ROWS = (
    # r=3 does not divide 32: the last tile is partial. The zero block gets the whole step-0 gradient.
    Row(variant="miss", w_eff=miss_w_eff, step0_nonzero=frozenset({"miss_block"}), spec_kwargs={"r": 3}, perturb_scale=0.1),
)
