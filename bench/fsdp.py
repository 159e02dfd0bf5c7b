"""FSDP2: per-rank memory of LoRA training on a sharded base against a replicated one.

Two configurations, each in its own group of ``--world`` gloo processes on the CPU (fresh
processes, so one cannot inherit the other's peak; with ``--no-peak`` both run in one group, one
after the other: the held bytes are a count and the steps are seeded), on a Llama with random weights and a LoRA
adapter on every linear layer of the decoder (the seven projections):

- ``replicated``: every rank holds the whole base (plain data parallelism, docs/scaling.md);
- ``fsdp2``: ``fully_shard`` per decoder block and on the root (``reshard_after_forward=True``),
  targets sharded, the adapter applied at each target's call.

Per rank it prints:

- the bytes the base holds between steps (a deterministic count: the local storage of every
  parameter and buffer; a sharded parameter counts its shard);
- the peak resident memory of one training step (forward, backward, gradient all-reduce, AdamW
  step) over the resident memory before it: ``VmHWM`` after ``/proc/self/clear_refs``;
- that both configurations train the same adapter (max |difference| after the step).

    python bench/fsdp.py                      # hidden 256, 8 layers, 2 ranks
    python bench/fsdp.py --layers 16 --hidden 512 --world 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

import lora_func as lf

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = ("replicated", "fsdp2")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    heads = max(1, args.hidden // 64)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max(256, args.seq), bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).requires_grad_(False).eval()


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct local storage of the model's parameters and buffers."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        local = getattr(t, "_local_tensor", t)  # a DTensor holds its shard
        if local.numel():
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _worker(rank: int, args: argparse.Namespace, configs: tuple[str, ...], rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.world)
    try:
        for config in configs:
            _measure(rank, args, config, out)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, args: argparse.Namespace, config: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = build_model(args)
    if config == "fsdp2":
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    spec = lf.AdapterSpec("lora", targets=PROJECTIONS, r=args.rank, alpha=2 * args.rank)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(args.seed + 1))
    g = torch.Generator().manual_seed(args.seed + 2)
    adapter = adapter.with_params({k: (v.detach() + 0.01 * torch.randn(v.shape, generator=g)).requires_grad_(True) for k, v in adapter.params.items()})
    optimizer = torch.optim.AdamW(adapter.params.values(), lr=1e-3)
    ids = torch.randint(3, args.vocab, (args.batch * args.world, args.seq), generator=g).chunk(args.world)[rank]

    def step() -> None:
        optimizer.zero_grad()
        logits = lf.adapted_call(model, adapter, ids).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        lf.distributed.all_reduce_mean_grads_(adapter.params)
        optimizer.step()

    step()  # warm-up: lazy initialisation (FSDP2's, the optimiser's state) is not the steady state
    held = held_bytes(model)
    peak = None
    if args.peak:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = c.vm_bytes("VmRSS")
        step()
        peak = c.vm_bytes("VmHWM") - before
    else:
        step()
    params = {k: v.detach() for k, v in adapter.params.items()}
    torch.save({"held": held, "peak": peak, "params": params}, os.path.join(out, f"{config}-rank{rank}.pt"))


def run(args: argparse.Namespace, configs: tuple[str, ...], out: str) -> dict[str, list[dict]]:
    """Each of ``configs`` in one group of processes, one after the other: per config, per rank."""
    rendezvous = os.path.join(out, f"{'-'.join(configs)}-rendezvous")
    # The spawned children import the worker by module name: this file, found on sys.path (also
    # when it runs as __main__ or through runpy under another name).
    import importlib

    worker = importlib.import_module(Path(__file__).stem)._worker
    try:
        mp.start_processes(worker, args=(args, configs, rendezvous, out), nprocs=args.world, start_method="spawn")
    except mp.ProcessExitedException as err:
        # Seen once in CI-like runs: a rank aborted by gloo while connecting ("terminate called
        # without an active exception"), before any measurement. Start the group once more.
        print(f"# {', '.join(configs)}: {err}; starting its processes again")
        mp.start_processes(worker, args=(args, configs, rendezvous + "-again", out), nprocs=args.world, start_method="spawn")
    return {config: [torch.load(os.path.join(out, f"{config}-rank{r}.pt")) for r in range(args.world)] for config in configs}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peak", dest="peak", action="store_false", help="skip the peak resident memory")
    args = parser.parse_args(argv)
    args.peak = args.peak and Path("/proc/self/clear_refs").exists()

    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with tempfile.TemporaryDirectory() as out:
            # (a process starts in seconds: without the peak, one group runs both configurations)
            results = {c: r for config in CONFIGS for c, r in run(args, (config,), out).items()} if args.peak else run(args, CONFIGS, out)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old

    print(f"# FSDP2 vs replicated base: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, "
          f"LoRA r={args.rank} on the 7 projections, {args.world} gloo ranks x {args.batch}x{args.seq} tokens, CPU")
    print("| configuration | rank | base held | held / replicated | step peak over resident |")
    print("|---|---|---|---|---|")
    replicated = results["replicated"]
    for config in CONFIGS:
        for rank, r in enumerate(results[config]):
            peak = mib(r["peak"]) if r["peak"] is not None else "not measured"
            print(f"| {config} | {rank} | {mib(r['held'])} | {r['held'] / replicated[rank]['held']:.3f} | {peak} |")
    diff = max(
        float((a["params"][k] - b["params"][k]).abs().max())
        for a, b in zip(results["fsdp2"], replicated)
        for k in a["params"]
    )
    print(f"# max |adapter difference| after two steps, fsdp2 vs replicated: {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
