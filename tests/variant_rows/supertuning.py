import torch

from tests.variant_table import Row


def supertuning_w_eff(p, b, W, bias, info):
    # variants.md (supertuning): ΔW.flat[idx_k] += v_k (a Python loop; the oracle gets the
    # positions as float64), plus s·B A with
    # s = lora_alpha / lora_r when lora_r is set.
    options = dict(info.options)
    delta = torch.zeros(W.numel(), dtype=W.dtype)
    for k, flat in enumerate(b["supertuning_indices"].tolist()):
        delta[int(flat)] += p["supertuning_values"][k]
    w_eff = W + delta.reshape(W.shape)
    if options["lora_r"] is not None:
        alpha = 2 * options["lora_r"] if options["lora_alpha"] is None else options["lora_alpha"]
        w_eff = w_eff + alpha / options["lora_r"] * p["supertuning_lora_B"] @ p["supertuning_lora_A"]
    return w_eff, bias


# Supra (the sparse support plus a LoRA) on 10 % of each weight's entries; B = 0 at init, so A
# gets no gradient at step 0.
ROW = Row(
    variant="supertuning",
    w_eff=supertuning_w_eff,
    step0_nonzero=frozenset({"supertuning_values", "supertuning_lora_B"}),
    spec_kwargs={"sparsity": 0.9, "lora_r": 2, "lora_alpha": 3.0},
)
