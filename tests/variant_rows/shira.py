import torch

from tests.variant_table import Row


def shira_w_eff(p, b, W, bias, info):
    # variants.md (shira): ΔW[rows_k, cols_k] = w_k at the fixed positions, W_eff = W + ΔW.
    rows, cols = b["shira_indices"].long()
    delta = torch.zeros_like(W)
    for k in range(rows.numel()):
        delta[rows[k], cols[k]] += p["shira_weight"][k]
    return W + delta, bias


# q/v (biased) and down_proj (d_in 48 > d_out 32) on Llama/Qwen2; c_attn and c_fc on GPT-2 (peft
# refuses Conv1D; lora_func adapts it). r=2: 2·(d_in + d_out) values per layer.
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

ROWS = (Row(variant="shira", w_eff=shira_w_eff, step0_nonzero=frozenset({"shira_weight"}), spec_kwargs={"r": 2}, targets=TARGETS),)
