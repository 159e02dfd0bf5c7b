"""A rank sweep in one run: LoRA adapters of ranks 1, 2, 4 and 8 trained side by side.

`stack` zero-pads adapters of different ranks to the largest one and records a rank mask
and each member's own scale (alpha / r), so under `torch.func.vmap` every member computes
exactly what it computes alone: the padded entries never reach the output and get exactly
zero gradient. `unstack` gives each member back at its own rank.

Run: python examples/rank_sweep.py
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
model.set_attn_implementation("eager")  # the model runs under vmap: eager attention
base = lf.base_params(model)

ranks = [1, 2, 4, 8]
members = [
    lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=r, alpha=2 * r),
                    generator=torch.Generator().manual_seed(0))
    for r in ranks
]
sweep = lf.stack(members)  # lora_A (4, 8, d_in), lora_B (4, d_out, 8), plus rank masks
ids = (torch.randint(3, 40, (16, 1)) + torch.arange(10)) % 61  # sequences that count up by one


def losses(params):
    """(len(ranks),) next-token losses, one per rank, from one batched forward."""
    logits = ensemble_call(model, sweep.with_params(params), ids, base=base).logits
    targets = ids[:, 1:].expand(len(ranks), -1, -1)
    return F.cross_entropy(logits[:, :, :-1].flatten(0, 2), targets.flatten(), reduction="none").view(len(ranks), -1).mean(1)


params = {k: v.detach() for k, v in sweep.params.items()}
for step in range(20):
    params = {k: v - 0.3 * g for (k, v), g in zip(params.items(), grad(lambda p: losses(p).sum())(params).values())}
final = losses(params)

trained = lf.unstack(sweep.with_params(params))  # each at its own rank again
for r, adapter, loss in zip(ranks, trained, final.tolist()):
    shape = tuple(adapter.params["model.layers.0.self_attn.q_proj.lora_A"].shape)
    print(f"r={r}: {adapter.num_parameters():5d} parameters, lora_A {shape}, loss after 20 steps {loss:.3f}")

# The padded entries of the rank-1 member stayed exactly zero through training.
padded = params["model.layers.0.self_attn.q_proj.lora_A"][0, 1:]
print("rank-1 member's padding still zero:", bool((padded == 0).all()))
