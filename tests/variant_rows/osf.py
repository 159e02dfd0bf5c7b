import torch

from tests.variant_table import Row


def osf_w_eff(p, buffers, W, bias, info):
    # variants.md (osf): W_eff = W + U diag(S) V − U0 diag(S0) V0 (the frozen copies of the SVD's
    # trained part; tests/test_variant_osf.py checks them against an independent SVD).
    trained = p["osf_U"] @ torch.diag(p["osf_S"]) @ p["osf_V"]
    initial = buffers["osf_U0"] @ torch.diag(buffers["osf_S0"]) @ buffers["osf_V0"]
    return W + trained - initial, bias


# q_proj 32x32 (square: the projections use U0, V0), v_proj 16x32 (V_high stored), up_proj 48x32
# (U_high stored); GPT-2 c_attn 96x32 and c_fc 128x32. effective_rank 3/8 of each layer's smaller
# side (12 of 32, 6 of 16; 3 of the one-layer suites' 10).
TARGETS = {"llama": ["q_proj", "v_proj", "up_proj"], "qwen2": ["q_proj", "v_proj", "up_proj"], "gpt2": ["c_attn", "c_fc"]}
ROW = Row(
    variant="osf",
    w_eff=osf_w_eff,
    step0_nonzero=frozenset({"osf_U", "osf_S", "osf_V"}),
    spec_kwargs={"effective_rank": 0.375},
    perturb_scale=0.1,
    targets=TARGETS,
)
