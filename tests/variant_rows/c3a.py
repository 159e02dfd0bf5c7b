import torch

from tests.variant_table import Row


def c3a_w_eff(p, b, W, bias, info):
    # variants.md (c3a): block (i, j) of ΔW is the circulant of kernel w_ij, ΔW[i·b+s, j·b+t] =
    # w_ij[(t − s) mod b] / d_in, written out entry by entry.
    k = p["c3a_kernel"]
    m, n, blk = k.shape
    d_in = W.shape[1]
    delta = torch.zeros_like(W)
    for i in range(m):
        for j in range(n):
            for s in range(blk):
                for t in range(blk):
                    delta[i * blk + s, j * blk + t] = k[i, j, (t - s) % blk]
    return W + delta / d_in, bias


# r = 8 is the block size (peft's block_size): it divides every target's d_in and d_out.
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

ROWS = (
    # perturbation 3: ΔW is scaled by 1/d_in, so a kernel entry moves the output by ~1/32 of itself.
    Row(variant="c3a", w_eff=c3a_w_eff, step0_nonzero=frozenset({"c3a_kernel"}), spec_kwargs={"r": 8}, perturb_scale=3.0, targets=TARGETS),
)
