"""Mixed-adapter batches: every example of one batch runs with its own adapter, for serving
AND training (peft's `adapter_names` is inference-only).

Four "tenant" adapters; a batch of 6 requests, each naming its tenant. One call, one batched
forward (`lora_func.mixed_call`: the per-row adapters live inside the target layers,
so attention stays SDPA); then one training step on that mixed batch, in which each tenant's
adapter gets the gradient of its own examples only. Last, the same batch through the older
`mixed_call` (the whole model under vmap: eager attention, one loss per example).

Run: python examples/mixed_batch.py
"""

import torch
from torch.func import grad
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf

torch.manual_seed(0)
config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()  # SDPA attention (the default)

spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4)
tenants = []
for seed in range(4):
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed))
    # Stand-ins for trained adapters (B = 0 at init would make them all the identity), as
    # leaf tensors that require grad: backward fills each tenant's .grad.
    g = torch.Generator().manual_seed(100 + seed)
    tenants.append(adapter.with_params({k: (0.2 * torch.randn(v.shape, generator=g)).requires_grad_() for k, v in adapter.params.items()}))

# Six requests, left-padded to one length; request i is served by tenant index[i].
ids = torch.randint(3, 61, (6, 10))
mask = torch.ones_like(ids)
mask[0, :4] = 0
mask[3, :2] = 0
index = torch.tensor([2, 0, 2, 1, 0, 2])  # tenant 3 has no request in this batch

with torch.no_grad():
    logits = lf.mixed_call(model, tenants, index, ids, attention_mask=mask, batching="layers").logits
    # The same as serving each request alone with its tenant's adapter.
    alone = torch.cat([lf.adapted_call(model, tenants[int(k)], ids[i : i + 1], attention_mask=mask[i : i + 1]).logits
                       for i, k in enumerate(index)])
print(f"mixed batch logits {tuple(logits.shape)}; max |mixed - one by one| = {(logits - alone).abs().max():.1e}")


# Training on the mixed batch: the loss of each request flows to its own tenant only.
def loss_of(logits: torch.Tensor) -> torch.Tensor:
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # no loss on padding
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())


loss = loss_of(lf.mixed_call(model, tenants, index, ids, attention_mask=mask, batching="layers").logits)
loss.backward()
norms = [torch.stack([t.grad.norm() for t in tenant.params.values()]).norm().item() for tenant in tenants]
print("gradient norm per tenant:", [f"{n:.3f}" for n in norms], "(tenant 3 had no request: 0)")
with torch.no_grad():
    for tenant in tenants:
        for t in tenant.params.values():
            t -= 0.5 * t.grad
    after = loss_of(lf.mixed_call(model, tenants, index, ids, attention_mask=mask, batching="layers").logits)
print(f"one SGD step on the mixed batch: loss {loss:.4f} -> {after:.4f}")

# The functional form: torch.func.grad over a stack's params (the same gradients).
stacked = lf.stack(tenants)
params = {k: v.detach() for k, v in stacked.params.items()}
grads = grad(lambda p: loss_of(lf.mixed_call(model, stacked.with_params(p), index, ids, attention_mask=mask, batching="layers").logits))(params)
print("grad over the stack, per member:", [f"{n:.3f}" for n in torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0).tolist()])

# mixed_call: the whole model under vmap, each example a batch of one, so a loss comes back per
# example; it needs eager attention and use_cache=False.
model.set_attn_implementation("eager")
labels = ids.masked_fill(mask == 0, -100)
losses = lf.mixed_call(model, stacked, index, ids, attention_mask=mask, labels=labels, use_cache=False).loss
print(f"mixed_call per-example losses: {[round(v, 3) for v in losses.tolist()]}")
