"""DP-SGD on a LoRA adapter: per-example gradients with vmap(grad), per-example clipping, noise.

Each step: the gradient of every example's loss (`per_example_grads`, one batched
forward/backward, no hooks), each clipped to L2 norm <= C over all adapter tensors, summed,
plus Gaussian noise N(0, (sigma*C)^2), divided by the batch size (Abadi et al. 2016). Only the
adapter is trained, so only its (small) per-example gradients are ever materialised.
Privacy accounting (epsilon for given sigma, sampling rate and steps) is not part of
lora_func: use e.g. Opacus's RDP accountant on the same numbers.

Run: python examples/dp_sgd.py
"""

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf
from lora_func.many import per_example_grads

torch.manual_seed(0)
config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                     initializer_range=0.2)  # 0.02 leaves a 32-wide random model near-uniform
model = LlamaForCausalLM(config).eval()
# Per-example attention masks under vmap need eager attention (SDPA branches on the mask).
model.set_attn_implementation("eager")
adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=8),
                          generator=torch.Generator().manual_seed(0))
base = lf.base_params(model)

# A learnable toy task: each sequence counts up by one (mod 61), left-padded to length 12.
starts = torch.randint(3, 40, (32, 1))
ids = (starts + torch.arange(12)) % 61
mask = torch.ones_like(ids)
mask[::3, :4] = 0


def loss_fn(adapter, ids, mask):
    """Mean next-token loss of a batch (here: a batch of one example, ids (1, T))."""
    logits = lf.adapted_call(model, adapter, ids, attention_mask=mask, base=base).logits
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())


def dp_step(adapter, ids, mask, *, max_norm, noise_multiplier, lr, generator):
    grads = per_example_grads(loss_fn, adapter, ids, mask)  # each (B, *param shape)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)  # (B,)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)  # clip each example to norm <= max_norm
    batch = ids.shape[0]
    new = {}
    for key, g in grads.items():
        clipped_sum = torch.einsum("b,b...->...", scale, g)
        noise = noise_multiplier * max_norm * torch.randn(clipped_sum.shape, generator=generator)
        new[key] = adapter.params[key].detach() - lr * (clipped_sum + noise) / batch
    return adapter.with_params(new), float((norms > max_norm).float().mean())


def full_loss(adapter):
    with torch.no_grad():
        return float(loss_fn(adapter, ids, mask))


generator = torch.Generator().manual_seed(1)
print(f"loss before: {full_loss(adapter):.4f}")
for step in range(30):
    batch = torch.randperm(32, generator=generator)[:8]  # sampled batch of 8
    adapter, clipped = dp_step(adapter, ids[batch], mask[batch], max_norm=0.5, noise_multiplier=0.5, lr=2.0,
                               generator=generator)
    if step % 10 == 0:
        print(f"step {step:2d}: {clipped:.0%} of the examples clipped, loss {full_loss(adapter):.4f}")
print(f"loss after 30 DP-SGD steps: {full_loss(adapter):.4f}")
