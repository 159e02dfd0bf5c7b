"""DP-SGD on a LoRA adapter with lora_func.privacy: Poisson batches, per-example clipping, noise,
accounting.

The privacy unit is one training example (a sequence): the adapter's updates are
(epsilon, delta)-differentially private with respect to adding or removing one. Before
training, the noise multiplier that spends the budget (epsilon = 8 at delta = 1e-5) over the
planned steps is computed by the RDP accountant; every step then samples a Poisson batch
(each example in with probability q), clips every example's gradient to `max_grad_norm` over
all adapter tensors, adds Gaussian noise once and divides by the expected batch size.
Both idioms are shown: the functional one (`private_grads`, then any update rule) and the
stateful one (`private_step_` with a torch optimiser, accumulating micro-batches).
docs/guide/privacy.md says what is private and how to choose the numbers.

Run: python examples/dp_sgd.py
"""

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf
from lora_func.privacy import DPSGD, private_step_

torch.manual_seed(0)
config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                     initializer_range=0.2)  # 0.02 leaves a 32-wide random model near-uniform
model = LlamaForCausalLM(config).eval()
# Per-example gradients run the model under vmap: per-example attention masks need eager attention.
model.set_attn_implementation("eager")
adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=8),
                          generator=torch.Generator().manual_seed(0))
base = lf.base_params(model)

# The private dataset: 128 sequences that count up by one (mod 61), some left-padded.
N = 128
starts = torch.randint(3, 40, (N, 1))
ids = (starts + torch.arange(12)) % 61
mask = torch.ones_like(ids)
mask[::3, :4] = 0


def loss_fn(adapter, ids, mask):
    """Mean next-token loss of a batch; private_grads calls it on one example at a time, (1, T)."""
    logits = lf.adapted_call(model, adapter, ids, attention_mask=mask, base=base).logits
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())


def full_loss(adapter):
    with torch.no_grad():
        return float(loss_fn(adapter, ids, mask))


# Plan the run, then get the noise that spends exactly the budget (the accountant assumes
# Poisson sampling at rate q for `steps` steps).
q, steps, delta, max_grad_norm = 12 / N, 40, 1e-5, 1.0
sigma = lf.noise_for_epsilon(epsilon=8.0, sample_rate=q, steps=steps, delta=delta)
print(f"noise multiplier {sigma:.3f} for epsilon 8 at delta {delta:g}: {steps} steps at sample rate {q:.3f}")
sampler = lf.PoissonBatchSampler(N, q, steps, generator=torch.Generator().manual_seed(1))
noise = torch.Generator().manual_seed(2)  # the noise has its own generator

# 1. Functional: private_grads, then a hand-written SGD update (or torchopt).
print(f"loss before: {full_loss(adapter):.4f}")
params = {k: v.detach() for k, v in adapter.params.items()}
for step, batch in enumerate(sampler):
    if step == steps // 2:
        break
    index = torch.tensor(batch, dtype=torch.long)
    grads = lf.private_grads(loss_fn, adapter.with_params(params), ids[index], mask[index], max_grad_norm=max_grad_norm,
                             noise_multiplier=sigma, generator=noise, expected_batch_size=q * N)
    params = {k: p - 0.5 * grads[k] for k, p in params.items()}
adapter = adapter.with_params(params).detach()
print(f"after {steps // 2} private SGD steps: loss {full_loss(adapter):.4f}")

# 2. Stateful: a torch optimiser; each logical batch in micro-batches of at most 8 examples
# (clipped per example, noised once: the same as one call on the whole batch).
optimizer = torch.optim.AdamW(adapter.params.values(), lr=3e-3)
dp = DPSGD(max_grad_norm=max_grad_norm, noise_multiplier=sigma, expected_batch_size=q * N, generator=noise)
for step, batch in enumerate(sampler, start=steps // 2):
    if step == steps:
        break
    index = torch.tensor(batch, dtype=torch.long)
    micro = [(ids[index[i : i + 8]], mask[index[i : i + 8]]) for i in range(0, max(len(index), 1), 8)]
    stats = private_step_(optimizer, adapter, loss_fn, micro, dp)
    if step % 10 == 0:
        print(f"step {step}: {stats.count} examples, {stats.clipped} clipped, loss {full_loss(adapter):.4f}")
print(f"loss after {steps} DP-SGD steps: {full_loss(adapter):.4f}")
print(f"privacy spent: epsilon {lf.epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta):.3f} at delta {delta:g}")
assert all(p.grad is None for p in model.parameters())  # the base model was never touched
