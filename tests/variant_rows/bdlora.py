import math

import torch

from tests.variant_table import Row


def _block_diag(blocks, k):
    # peft's weight_as_blockdiagonal_matrix: k blocks of p/k rows stacked -> their block diagonal
    return torch.block_diag(*torch.chunk(blocks, k, dim=0))


def bdlora_w_eff(p, b, W, bias, info):
    opts = dict(info.options)
    s = info.alpha / (math.sqrt(info.r) if opts["use_rslora"] else info.r)
    a = _block_diag(p["lora_A"], opts["nblocks"]) if opts["side"] == "a" else p["lora_A"]
    bb = _block_diag(p["lora_B"], opts["nblocks"]) if opts["side"] == "b" else p["lora_B"]
    return W + s * bb @ a, bias


ROWS = (
    # A block-diagonal (2 blocks); the other side is tests/test_variant_bdlora.py's.
    Row(variant="bdlora", w_eff=bdlora_w_eff, step0_nonzero=frozenset({"lora_B"}), spec_kwargs={"r": 4, "alpha": 6.0, "nblocks": 2}),
)
