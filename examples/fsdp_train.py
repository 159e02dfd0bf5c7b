"""Train a LoRA adapter on a base sharded by FSDP2, target weights included.

Run on CPU with two processes (gloo):   torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py
or in one process (a world of one):     python examples/fsdp_train.py
On GPUs the same script uses NCCL, one GPU per rank (LOCAL_RANK) and bf16 compute.

FSDP2 (`fully_shard`) keeps 1/world of every base weight on each rank and all-gathers a block's
weights just before its forward. lora_func applies the adapter at each target's call, after that
all-gather, so the targets stay sharded. The adapter itself is small and replicated: every rank
holds all of it, averages its gradients with lora_func.distributed.all_reduce_mean_grads_, and takes the same
optimiser step. Rank 0 saves the adapter; the file loads on an unsharded model.
"""

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf

under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
backend = "nccl" if torch.cuda.is_available() else "gloo"
if under_torchrun:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)  # torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE
else:
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")  # a world of one, no port needed
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

try:
    torch.manual_seed(0)  # the same base on every rank (or load the same checkpoint)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config).to(device)
    model.requires_grad_(False)  # the base is frozen: only the adapter trains
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})  # optional; lora_func re-applies the adapter in recomputes
    model.train()

    # torchtune's layout: one FSDP2 unit per decoder block, the root holds embeddings and head.
    # On GPUs, compute in bf16 (the adapter stays fp32); on the CPU keep fp32.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if backend == "nccl" else MixedPrecisionPolicy()
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    # init_adapter on the sharded model: whole weights are gathered one target at a time where
    # a variant needs them (DoRA's norms here); every rank runs it, then takes rank 0's values.
    spec = lf.AdapterSpec("dora", targets="all-linear", r=8, alpha=16)
    adapter = lf.distributed.broadcast_adapter(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(rank)))
    optimizer = torch.optim.AdamW(adapter.params.values(), lr=3e-3)

    # A fixed global batch; rank r takes an equal shard, the loss is a mean over examples.
    batch = torch.randint(2, 64, (4 * world, 32), generator=torch.Generator().manual_seed(1)).to(device)
    ids = batch.chunk(world)[rank]

    for step in range(5):
        optimizer.zero_grad()
        logits = lf.adapted_call(model, adapter, ids).logits  # the default route adapts at each target's call
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        lf.distributed.all_reduce_mean_grads_(adapter.params)  # every rank takes the same step
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        if rank == 0:
            print(f"step {step}: loss {global_loss.item() / world:.4f}")

    if rank == 0:
        path = os.path.join(tempfile.mkdtemp(), "adapter.safetensors")
        lf.save(adapter, path)
        print(f"saved {len(adapter.params)} adapter tensors to {path}")
finally:
    dist.destroy_process_group()
