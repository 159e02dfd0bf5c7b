import torch

from tests.variant_table import Row


def arrow_y(p, b, x, W, bias, info):
    # variants.md (arrow): per token, the top_k experts by |x · prototype|, softmax of their
    # similarities over the temperature, y = x Wᵀ + b + Σ_e c_e s_e (x A_eᵀ) B_eᵀ. No merged weight.
    tokens = x.reshape(-1, x.shape[-1])
    sim = (tokens @ b["arrow_prototypes"].T).abs()
    top = sim.topk(info.option("top_k"), dim=1).indices
    kept = torch.full_like(sim, float("-inf")).scatter(1, top, sim.gather(1, top))
    c = torch.softmax(kept / info.option("router_temperature"), dim=1)
    delta = sum(c[:, e : e + 1] * b["arrow_scales"][e] * (tokens @ p["lora_A"][e].T) @ p["lora_B"][e].T for e in range(sim.shape[1]))
    y = (tokens @ W.T + delta).reshape(*x.shape[:-1], W.shape[0])
    return y if bias is None else y + bias


ROWS = (
    # Three experts, each token routed to its top two (tested against peft in tests/test_routed.py).
    # B = 0 at init: the identity; only B moves at step 0.
    Row(variant="arrow", w_eff=None, y_oracle=arrow_y, step0_nonzero=frozenset({"lora_B"}), spec_kwargs={"r": 2, "alpha": 6.0, "num_experts": 3, "top_k": 2}),
)
