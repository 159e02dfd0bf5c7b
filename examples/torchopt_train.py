"""A fully functional training loop with torchopt: a pure ``step(params, opt_state, batch)``,
then the same step under ``torch.func.vmap`` for a stack of adapters, each member with its own
optimiser state (an ensemble trained in one call).

    pip install torchopt        # (the test extra pins it)
    python examples/torchopt_train.py

lora_func registers ``Adapter`` / ``Composed`` / ``Combined`` with optree (torchopt's pytree
library), so torchopt takes an adapter itself as well as ``adapter.params``.
"""

import warnings

import torch
import torchopt
from torch.func import grad_and_value, vmap
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf
from lora_func.train import causal_lm_loss

torch.manual_seed(0)
model = LlamaForCausalLM(
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                bos_token_id=0, eos_token_id=1, attn_implementation="eager")
).eval()
base = lf.base_params(model)
spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4)
adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
optimizer = torchopt.adam(lr=3e-2)
# Under vmap, torchopt's Adam uses addcmul_, which torch 2.13 batches with a (correct) slow
# loop and a warning per call; the step is tiny here.
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented the batching rule")


def loss_fn(params, ids):
    logits = lf.adapted_call(model, adapter.with_params(params), ids, base=base).logits
    return causal_lm_loss(logits, ids)


def step(params, opt_state, ids):
    """Pure: new params and optimiser state out, nothing updated in place."""
    grads, loss = grad_and_value(loss_fn)(params, ids)
    updates, opt_state = optimizer.update(grads, opt_state, params=params, inplace=False)
    return torchopt.apply_updates(params, updates, inplace=False), opt_state, loss


def batch_at(i):
    # A few fixed sequences to memorise (i picks one of 2 batches), so the loss visibly falls.
    return torch.randint(2, 64, (4, 8), generator=torch.Generator().manual_seed(i % 2))


# 1. One adapter: torchopt state over the Adapter's params (an Adapter itself works too for
#    variants without frozen buffers: torchopt sees every tensor of the pytree).
params = {k: v.detach() for k, v in adapter.params.items()}
opt_state = optimizer.init(params)
for i in range(8):
    params, opt_state, loss = step(params, opt_state, batch_at(i))
    if i % 2 == 1:
        print(f"step {i:2d}: loss {loss.item():.3f}")
trained = adapter.with_params(params)

# 2. An ensemble of 3 adapters (different inits), trained in one vmapped step. Each member has
#    its own Adam moments and step count: init is vmapped too, so every state leaf has the K axis.
members = [lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(s)) for s in range(3)]
stacked = {k: v.detach() for k, v in lf.stack(members).params.items()}
states = vmap(optimizer.init)(stacked)
ensemble_step = vmap(step, in_dims=(0, 0, None))  # the same batch for every member
for i in range(3):
    stacked, states, losses = ensemble_step(stacked, states, batch_at(i))
print("ensemble losses after 3 steps:", [round(x, 3) for x in losses.tolist()])
