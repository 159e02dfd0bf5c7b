"""Multi-tenant serving: one frozen base, a different adapter for every request of a batch, in
`model.generate` (greedy and sampled, KV cache on, SDPA attention, left padding).

`lora_func.mixed_adapted(model, adapters, index)` swaps only the target layers' forwards for
the block: row b of every call uses adapter index[b], everything else (attention, masks, the
KV cache, beam search) is the model's own. Each request's tokens are exactly what it gets when
served alone with its tenant's adapter.

Run: python examples/serving.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf

torch.manual_seed(0)
config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)
model = LlamaForCausalLM(config).eval()  # SDPA attention, the default
print(f"attention: {model.config._attn_implementation}")

# Four tenants' adapters (random stand-ins for trained ones: B = 0 at init is the identity).
spec = lf.AdapterSpec("lora", targets=["q_proj", "k_proj", "v_proj", "o_proj"], r=4)
tenants = []
for seed in range(4):
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(100 + seed)
    tenants.append(adapter.with_params({k: 0.5 * torch.randn(v.shape, generator=g) for k, v in adapter.params.items()}))

# Six requests, left-padded into one batch; request i is tenant index[i]'s.
prompts = [[5, 9, 14], [7, 3, 22, 40, 11], [8, 8, 30, 12], [19, 4, 27, 33, 50], [6, 44], [21, 13, 37, 9, 17]]
index = torch.tensor([2, 0, 3, 1, 0, 2])
width = max(map(len, prompts))
ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
mask = (ids != 0).long()
greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}

with torch.no_grad(), lf.mixed_adapted(model, tenants, index):
    batched = model.generate(ids, attention_mask=mask, **greedy)
for i, k in enumerate(index.tolist()):
    with torch.no_grad(), lf.adapted(model, tenants[k]):
        alone = model.generate(ids[i : i + 1], attention_mask=mask[i : i + 1], **greedy)
    assert torch.equal(batched[i], alone[0]), i
    print(f"request {i} (tenant {k}): {batched[i, width:].tolist()}  == served alone")

# Sampling: fixed seed; beams and num_return_sequences expand each request's rows, and the
# index follows (each request's copies keep its tenant).
torch.manual_seed(7)
with torch.no_grad(), lf.mixed_adapted(model, tenants, index):
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=2, pad_token_id=0)
print(f"sampled, 2 per request: {tuple(sampled.shape)}")
with torch.no_grad(), lf.mixed_adapted(model, tenants, index):
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3, pad_token_id=0)
print(f"beam search (3 beams): {tuple(beams.shape)}")
assert all(p.grad is None for p in model.parameters()) and not any("forward" in vars(m) for m in model.modules())
print("model untouched after the blocks")
