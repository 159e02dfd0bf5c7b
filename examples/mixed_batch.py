"""Mixed-adapter batches: every example of one batch runs with its own adapter, for serving
AND training (peft's `adapter_names` is inference-only).

A stack of 4 "tenant" adapters; a batch of 6 requests, each naming its tenant. One call,
one batched forward; then one training step on that mixed batch, in which each tenant's
adapter gets the gradient of its own examples only.

Run: python examples/mixed_batch.py
"""

import torch
from torch.func import grad
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf
from lora_func.batching import mixed_call

torch.manual_seed(0)
config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False)
model = LlamaForCausalLM(config).eval()
model.set_attn_implementation("eager")  # mixed_call runs the model under vmap: eager attention

spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4)
tenants = []
for seed in range(4):
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed))
    # Stand-ins for trained adapters (B = 0 at init would make them all the identity).
    g = torch.Generator().manual_seed(100 + seed)
    tenants.append(adapter.with_params({k: 0.2 * torch.randn(v.shape, generator=g) for k, v in adapter.params.items()}))
stacked = lf.stack(tenants)  # every tensor gets a leading axis of 4
base = lf.base_params(model)

# Six requests, left-padded to one length; request i is served by tenant index[i].
ids = torch.randint(3, 61, (6, 10))
mask = torch.ones_like(ids)
mask[0, :4] = 0
mask[3, :2] = 0
index = torch.tensor([2, 0, 2, 1, 0, 2])  # tenant 3 has no request in this batch

with torch.no_grad():
    logits = mixed_call(model, stacked, index, ids, attention_mask=mask, base=base).logits
    # The same as serving each request alone with its tenant's adapter.
    alone = torch.cat([lf.adapted_call(model, tenants[int(k)], ids[i : i + 1], attention_mask=mask[i : i + 1]).logits
                       for i, k in enumerate(index)])
print(f"mixed batch logits {tuple(logits.shape)}; max |mixed - one by one| = {(logits - alone).abs().max():.1e}")


# Training on the mixed batch: the loss of each request flows to its own tenant only.
def loss(params):
    out = mixed_call(model, stacked.with_params(params), index, ids, attention_mask=mask, base=base)
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # no loss on padding
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten())


params = {k: v.detach() for k, v in stacked.params.items()}
grads = grad(loss)(params)
norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
print("gradient norm per tenant:", [f"{n:.3f}" for n in norms.tolist()], "(tenant 3 had no request: 0)")
before = loss(params)
params = {k: v - 0.5 * grads[k] for k, v in params.items()}
print(f"one SGD step on the mixed batch: loss {before:.4f} -> {loss(params):.4f}")
