import math

from tests.variant_table import Row


def qalora_w_eff(p, b, W, bias, info):
    # peft's forward: x pooled by group means, times the number of groups, through A then B: the
    # input map is P (d_in/g, d_in) with P[j, i] = (d_in/g)/g where i // g == j.
    g = dict(info.options)["group_size"]
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    groups = W.shape[1] // g
    pool = W.new_zeros(groups, W.shape[1])
    for j in range(groups):
        pool[j, j * g : (j + 1) * g] = groups / g
    return W + s * p["lora_B"] @ p["lora_A"] @ pool, bias


ROWS = (
    Row(variant="qalora", w_eff=qalora_w_eff, step0_nonzero=frozenset({"lora_B"}), spec_kwargs={"r": 4, "alpha": 6.0, "group_size": 4}),
)
