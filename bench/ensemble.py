"""K adapters trained at once on one frozen base against K separate runs.

One training step (forward, next-token loss, ``loss.backward()`` into every adapter's leaves) of
``K = 8`` LoRA adapters (r=8 on q_proj/v_proj) of a 4-layer Llama (SDPA attention, GQA):

- **ensemble**: ``lora_func.ensemble_call(model, stack, ids)`` on the default route (the batch's
  rows repeated once per member, each member applied inside the target layers), the members'
  losses (one batched cross-entropy, ``_member_losses``) summed;
- **separate**: ``K`` steps of ``lora_func.adapted_call(model, adapter_k, ids)``, one per adapter
  (what K independent runs cost per step).

Two sizes: hidden 64 with batch 4 x 32 tokens (overhead-bound) and hidden 256 with batch 8 x 128
tokens (FLOP-bound on a CPU). Issue 36's targets: ensemble / separate at most 0.5 at the small
size and at most 1.0 at the larger. Timings are interleaved rounds, each ratio the median over
rounds of the per-round ratio; default clock: this process's CPU time on one thread.

Run: python bench/ensemble.py [--rounds 7] [--clock cpu|wall] [--threads 1] [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

import lora_func as lf

TARGETS = ["q_proj", "v_proj"]
K = 8
SIZES = {"small": (64, 4, 32), "larger": (256, 8, 128)}  # hidden, batch, tokens
TARGET_RATIO = {"small": 0.5, "larger": 1.0}


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[..., :-1, :].flatten(0, -2), ids[..., 1:].flatten())


def _member_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``(K,)``: each member's next-token loss from ``logits (K, B, T, V)``, in one cross-entropy.
    (Not ``sum(_loss(logits[k], ids) for k in range(K))``: each ``logits[k]``'s backward fills a
    zero gradient of the whole ``(K, B, T, V)`` logits, K times: 0.33 s of a 2.1 s step at the
    larger size.)"""
    members = logits.shape[0]
    targets = ids[..., 1:].expand(members, *ids.shape[:-1], ids.shape[-1] - 1)
    flat = F.cross_entropy(logits[..., :-1, :].flatten(0, -2), targets.flatten(), reduction="none")
    return flat.view(members, -1).mean(1)


def measure(
    hidden: int, batch: int, tokens: int, *, rounds: int, clock, device: torch.device, chunk_size: int | None = None
) -> tuple[float, float, float]:
    """(ensemble step, separate steps, their median paired ratio); seconds are medians."""
    import statistics

    model = c.gqa_llama(hidden, 4, 2048, attention="sdpa", seed=0).to(device)
    spec = lf.AdapterSpec("lora", targets=TARGETS, r=8, alpha=16)
    adapters = []
    for k in range(K):
        a = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(k))
        g = torch.Generator().manual_seed(100 + k)
        adapters.append(a.with_params({n: (0.02 * torch.randn(v.shape, generator=g)).to(device).requires_grad_() for n, v in a.params.items()}))
    stacked = lf.stack([a.detach() for a in adapters])
    base = lf.base_params(model)
    ids = torch.randint(3, 2048, (batch, tokens), generator=torch.Generator().manual_seed(7)).to(device)

    def ensemble() -> None:
        logits = lf.ensemble_call(model, stacked, ids, base=base, use_cache=False, chunk_size=chunk_size).logits  # (K, B, T, V)
        _member_losses(logits, ids).sum().backward()
        for t in stacked.params.values():
            t.grad = None

    def separate() -> None:
        for a in adapters:
            _loss(lf.adapted_call(model, a, ids, base=base, use_cache=False).logits, ids).backward()
            for t in a.params.values():
                t.grad = None

    times = c.timed_rounds({"ensemble": ensemble, "separate": separate}, rounds, clock)
    return statistics.median(times["ensemble"]), statistics.median(times["separate"]), c.paired_ratio(times, "ensemble", "separate")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.add_interleaved_args(parser, rounds=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="small,larger", help=f"comma-separated, of {sorted(SIZES)} or hidden:batch:tokens")
    parser.add_argument("--chunk-size", type=int, default=None, help="ensemble_call's chunk_size (members per model call)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = c.CLOCKS["wall" if device.type == "cuda" else args.clock]
    rounds = 1 if args.quick else args.rounds
    print(f"# K={K} LoRA adapters (r=8, q/v) trained at once vs {K} separate steps; {args.rounds} rounds, {args.clock} clock, {args.threads} thread(s), {device}")
    print("| size | ensemble step (ms) | 8 separate steps (ms) | ratio | target |")
    print("|---|---|---|---|---|")
    out = {}
    for name in args.sizes.split(","):
        hidden, batch, tokens = SIZES[name] if name in SIZES else tuple(int(x) for x in name.split(":"))
        if args.quick:
            hidden, batch, tokens = 32, 2, 8
        ens, sep, ratio = measure(hidden, batch, tokens, rounds=rounds, clock=clock, device=device, chunk_size=args.chunk_size)
        target = TARGET_RATIO.get(name)
        shown = f"<= {target} ({'holds' if ratio <= target else 'fails'})" if target is not None else "-"
        print(f"| {name} (hidden {hidden}, {batch}x{tokens}) | {1e3 * ens:.1f} | {1e3 * sep:.1f} | {ratio:.2f} | {shown} |")
        out[name] = ratio
    return out


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    main()
