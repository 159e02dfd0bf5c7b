"""Ensembles: K LoRA adapters trained and evaluated in one batched call, on one frozen base.

`stack` gives the K adapters a leading axis; `ensemble_call` runs the model once on the batch
repeated K times, each member applied inside the target layers to its own block of rows (any
attention implementation: this model keeps transformers' default, SDPA; `batching="vmap"` would
run it under `torch.func.vmap` over the members instead, with eager attention). The frozen
weights are shared by all members (no merged weight is built, so memory grows with K only
through the small adapters and the activations), and `torch.func.grad` through it trains all K
members in one step, each on its own loss. The members' disagreement is a cheap uncertainty
estimate.

Run: python examples/ensemble.py
"""

import torch
import torch.nn.functional as F
from torch.func import grad
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf
from lora_func.many import ensemble_call

torch.manual_seed(0)
config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                     initializer_range=0.2)  # 0.02 leaves a 32-wide random model near-uniform
model = LlamaForCausalLM(config).eval()
assert model.config._attn_implementation == "sdpa"  # ensemble_call's default route needs no eager attention
base = lf.base_params(model)

K = 4
spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=8)
members = [lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(k)) for k in range(K)]
stacked = lf.stack(members)  # every tensor gets a leading axis of K

ids = (torch.randint(3, 40, (16, 1)) + torch.arange(10)) % 61  # sequences that count up by one


def member_losses(params):
    """(K,) next-token losses, one per member, from one batched forward."""
    logits = ensemble_call(model, stacked.with_params(params), ids, base=base).logits  # (K, B, T, V)
    targets = ids[:, 1:].expand(K, -1, -1)
    return F.cross_entropy(logits[:, :, :-1].flatten(0, 2), targets.flatten(), reduction="none").view(K, -1).mean(1)


params = {k: v.detach() for k, v in stacked.params.items()}
print("member losses before:", [f"{x:.3f}" for x in member_losses(params).tolist()])
for step in range(15):
    # The members are independent, so the gradient of the sum is each member's own gradient.
    grads = grad(lambda p: member_losses(p).sum())(params)
    params = {k: v - 0.3 * grads[k] for k, v in params.items()}
print("member losses after: ", [f"{x:.3f}" for x in member_losses(params).tolist()])

with torch.no_grad():
    probs = ensemble_call(model, stacked.with_params(params), ids[:2], base=base).logits.softmax(-1)  # (K, 2, T, V)
mean = probs.mean(0)
disagreement = (probs - mean).abs().sum(-1).mean(0)  # per token: how much the members differ
print(f"ensemble prediction {tuple(mean.shape)}; mean member disagreement {disagreement.mean():.3f}")
# Each member alone gives the same logits as its slice of the ensemble call.
first = lf.unstack(stacked.with_params(params))[0]
with torch.no_grad():
    alone = lf.adapted_call(model, first, ids[:2], base=base).logits.softmax(-1)
print(f"max |member 0 alone - member 0 in the ensemble| = {(alone - probs[0]).abs().max():.1e}")
