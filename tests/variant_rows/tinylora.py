from tests.variant_table import Row


def tinylora_w_eff(p, b, W, bias, info):
    # variants.md, TinyLoRA: W_eff = W + B (Σ_i v_i P_i) A with the vector of the layer's group:
    # G = max(1, round(L (1 - weight_tying))) groups of max(1, L // G) consecutive layers.
    count = max(1, len(info.layout))
    groups = max(1, round(count * (1 - info.option("weight_tying"))))
    v = p["tinylora_v"][min(info.position // max(1, count // groups), groups - 1)]
    R = sum(v[i] * b["tinylora_P"][i] for i in range(v.shape[0]))
    delta = b["tinylora_B"] @ R @ b["tinylora_A"]
    # on an embedding A, B factor the stored (V, d) table (peft's): the (d, V) view's delta is its transpose
    return W + (delta.T if info.kind == "embedding" else delta), bias


# Layers of different shapes (q 32x32, v 16x32, down 32x48 on Llama; c_attn 96x32, c_fc 128x32 on GPT-2);
# weight_tying 0.5 puts 6 Llama layers into 3 groups of 2 (4 GPT-2 layers into 2 of 2).
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

# v = 0 at init: ΔW = 0.
ROW = Row(
    variant="tinylora",
    w_eff=tinylora_w_eff,
    step0_nonzero=frozenset(),  # no per-layer trainables: v is shared (its gradient: tests/test_variant_tinylora.py)
    spec_kwargs={"r": 2, "u": 3, "weight_tying": 0.5},
    # v ~ 1.5: the embedding's change is well above a bf16 base's own round-off (measured 0.07 of logits ~3)
    perturb_scale=1.5,
    targets=TARGETS,
)
