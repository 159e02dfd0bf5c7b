"""Quickstart: a LoRA adapter on a tiny GPT-2, trained with torch.func.grad, the model untouched.

Run: python examples/quickstart.py
"""

import torch
from torch.func import functional_call, grad, vmap
from transformers import GPT2Config, GPT2LMHeadModel

import lora_func as lf

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=1)).eval()
model.config._attn_implementation = "eager"  # vmap(grad) with attention masks wants eager attention
ids = torch.randint(0, 64, (4, 16))

spec = lf.AdapterSpec("lora", targets=["c_attn"], r=4, alpha=8)  # GPT-2 Conv1D, handled transparently
adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
base = lf.base_params(model)  # detached views of the model's tensors, no copies


def loss(params, ids):
    logits = functional_call(model, lf.overlay(base, adapter.with_params(params)), (ids,)).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


params = {k: v.detach() for k, v in adapter.params.items()}
print(f"trainable parameters: {adapter.num_parameters():,}; loss before: {loss(params, ids):.4f}")
for step in range(20):
    grads = grad(loss)(params, ids)
    params = {k: params[k] - 0.5 * grads[k] for k in params}
adapter = adapter.with_params(params)
print(f"loss after 20 steps: {loss(params, ids):.4f}")

# The merged and the lazy (unmerged) paths agree.
merged = functional_call(model, lf.merge_overlay(base, adapter), (ids,)).logits
lazy = functional_call(model, lf.overlay(base, adapter), (ids,)).logits
print(f"max |merged - lazy| = {(merged - lazy).abs().max():.2e}")

# Per-example gradients: vmap over the batch.
per_example = vmap(grad(loss), in_dims=(None, 0))(params, ids[:, None])
print("per-example grad shape:", tuple(per_example["transformer.h.0.attn.c_attn.lora_B"].shape))
