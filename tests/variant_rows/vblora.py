import torch

from tests.variant_table import Row


def _mix(logits, bank, k):
    # variants.md, VB-LoRA: each sub-vector is Σ_{j in topk} softmax(top logits)_j bank_j, written
    # here as a dense (…, N) weight vector (zero outside the top k) times the bank.
    top, idx = logits.topk(k, dim=-1)
    weights = torch.zeros_like(logits).scatter(-1, idx, torch.softmax(top, dim=-1))
    return weights @ bank


def vblora_w_eff(p, b, W, bias, info):
    k, bank = info.option("topk"), p["vblora_vector_bank"]
    la, lb = p["vblora_logits_A"], p["vblora_logits_B"]
    r = la.shape[0]
    A = _mix(la, bank, k).reshape(r, -1)  # (r, d_in/L, L) -> (r, d_in)
    B = torch.cat([_mix(lb[t], bank, k).T for t in range(lb.shape[0])], dim=0)  # block t: (L, r)
    return W + B @ A, bias


# vector_length 2 divides every size: q 32x32, v 16x32, down 32x48 (Llama/Qwen2), c_attn 96x32 and
# c_fc 128x32 (GPT-2), and the 10x12 layer of the one-layer tests.
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}

# Not the identity at init (peft's init: ΔW = B A from a random bank and logits): measured
# max |Δlogit| / max |base logit| at init 5.7e-4 to 1.3e-3 over seeds 0-2, both layer kinds.
ROW = Row(
    variant="vblora",
    w_eff=vblora_w_eff,
    step0_nonzero=frozenset({"vblora_logits_A", "vblora_logits_B"}),
    spec_kwargs={"r": 4, "num_vectors": 12, "vector_length": 2, "topk": 3},
    identity_rtol=5e-3,
    perturb_scale=0.5,
    targets=TARGETS,
)
