"""Data-parallel training of a LoRA adapter on torch.distributed; the base model stays frozen.

Run on CPU with two processes (gloo):   torchrun --nproc_per_node=2 examples/ddp_train.py
or in one process (a world of one):     python examples/ddp_train.py
On GPUs the same script uses NCCL and one GPU per rank (LOCAL_RANK).

Every rank holds the frozen base and a full copy of the adapter. Each rank computes the
gradient on its shard of the batch; lora_func.distributed.all_reduce_mean averages the gradients, so
every rank takes the same step and the adapters stay identical. Rank 0 saves the adapter.
"""

import os
import tempfile

import torch
import torch.distributed as dist
from torch.func import functional_call, grad
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf

under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
backend = "nccl" if torch.cuda.is_available() else "gloo"
rendezvous = None
if under_torchrun:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)  # torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE
else:
    # One process: a world of one, through a file rendezvous (no port needed).
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

try:
    # The same frozen base on every rank (same seed; or load the same checkpoint).
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         bos_token_id=0, eos_token_id=1)).to(device).eval()
    base = lf.base_params(model)

    spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=8)
    # Every rank starts from rank 0's init, whatever its own generator gave.
    adapter = lf.distributed.broadcast_adapter(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(rank)))

    # A fixed global batch; rank r takes an equal shard (the loss is a mean over examples,
    # so the mean of the shard gradients is the full-batch gradient).
    global_batch = 8
    assert global_batch % world == 0, "the global batch must split into equal shards"
    data = torch.randint(2, 64, (global_batch, 16), generator=torch.Generator().manual_seed(1)).to(device)
    ids = data.chunk(world)[rank]

    def loss(params, ids):
        logits = functional_call(model, lf.overlay(base, adapter.with_params(params)), (ids,)).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    params = {k: v.detach() for k, v in adapter.params.items()}
    for step in range(20):
        grads = lf.distributed.all_reduce_mean(grad(loss)(params, ids))  # one all_reduce for the whole adapter
        params = {k: params[k] - 0.5 * grads[k] for k in params}
        if step in (0, 19):
            full = lf.distributed.all_reduce_mean({"loss": loss(params, ids).detach().reshape(1)})["loss"]
            if rank == 0:
                print(f"[world {world}, {backend}] after step {step + 1:2d}: mean loss over ranks {full.item():.4f}")
    adapter = adapter.with_params(params)

    # All ranks hold the same adapter; rank 0 saves it.
    if rank == 0:
        path = os.path.join(tempfile.mkdtemp(), "ddp_adapter.safetensors")
        lf.save(adapter, path)
        again = lf.load(path, model=model)
        same = torch.equal(lf.adapted_call(model, again, ids).logits, lf.adapted_call(model, adapter, ids).logits)
        print(f"saved {adapter.num_parameters():,} adapter parameters to {path}; reloads identically: {same}")
    dist.barrier()
finally:
    dist.destroy_process_group()
    if rendezvous is not None and os.path.exists(rendezvous):
        os.unlink(rendezvous)
