import torch

from tests.variant_table import Row


def delora_w_eff(p, b, W, bias, info):
    # variants.md §3: W + (lambda/r) · B diag(1/(a_i b_i)) A diag(w_norm), a_i/b_i clamped at 1e-4.
    # w_norm is recomputed from W here (not read from the buffer), so a wrong buffer fails.
    A, B, lam = p["delora_A"], p["delora_B"], p["delora_lambda"]
    r = A.shape[0]
    a = torch.clamp(torch.sqrt((A * A).sum(dim=1)), min=1e-4)
    bn = torch.clamp(torch.sqrt((B * B).sum(dim=0)), min=1e-4)
    w_norm = torch.sqrt((W * W).sum(dim=0))
    return W + (lam / r) * B @ torch.diag(1.0 / (a * bn)) @ A @ torch.diag(w_norm), bias


# Llama/Qwen2: q/v (with bias) and down_proj (no bias, d_in > d_out), as in the peft oracle
# test; GPT-2: c_attn and the MLP input projection c_fc.
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

ROWS = (
    Row(
        variant="delora",
        w_eff=delora_w_eff,
        step0_nonzero=frozenset({"delora_B"}),
        spec_kwargs={"r": 4},
        targets=TARGETS,
    ),
)
