"""What privacy costs: a DP-SGD step against the non-private step, and against Opacus.

One tiny Llama (hidden 256, 4 layers, 64 tokens, LoRA r=8 on q_proj/v_proj by default), CPU,
batch sizes 8 to 64, in one run; for each batch size:

- non-private step (the reference): the batched loss, one backward to the adapter's tensors;
- ``lora_func.private_grads``: per-example norms, clipped sum, noise (the whole DP-SGD
  gradient), ``clipping="auto"`` (the default), given a batched loss
  (``lora_func.privacy.batched_loss``: one loss per example from one batched call, no
  ``vmap``), and again given the loss of one example at a time (the model under ``vmap``);
  ``--forced`` adds the vmap path with each of the two ways ``auto`` chooses between per layer
  forced: ``"ghost"`` (Gram norms and book-keeping for every LoRA layer) and ``"per_example"``
  (per-example gradients of every tensor); ``--seq``/``--rank`` move the choice (short
  sequences and large ranks: Gram products);
- Opacus (when installed): ``GradSampleModule`` on a peft model with the same weights, in its
  hooks mode and its functorch mode, then the same clipping and noise on ``grad_sample``
  (what Opacus's ``DPOptimizer`` does), against peft's own non-private backward.

Time: interleaved rounds, median per-round ratio (bench/_common.py), this process's CPU time on
one thread by default. Memory: peak bytes allocated on the CPU during one call (torch profiler
memory events), as a ratio to the non-private step's.

Run: python bench/privacy.py [--batches 8 16 32 64] [--rounds 5] [--clock cpu|wall] [--forced] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c
from functional import build, peak_allocated, perturbed, token_loss

import lora_func as lf
from lora_func.privacy import batched_loss

TARGETS = ["q_proj", "v_proj"]
PRIVATE = "lora_func private_grads, batched_loss (clip + noise)"
C, SIGMA = 1.0, 1.0


def token_losses(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each example's mean next-token cross-entropy on its real tokens, shape (B,) (token_loss is their mean)."""
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return per_token.sum(1) / (labels != -100).sum(1)


def opacus_clip_and_noise(gsm: torch.nn.Module, batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    """DP-SGD on Opacus's per-sample gradients, as its ``DPOptimizer`` computes it."""
    params = [p for p in gsm.parameters() if p.requires_grad]
    norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in params]).norm(dim=0)
    factor = (C / (norms + 1e-6)).clamp(max=1.0)
    return [(torch.einsum("b,b...->...", factor, p.grad_sample) + SIGMA * C * torch.randn(p.shape, generator=generator)) / batch for p in params]


def section(model, adapter, ids, mask, r, alpha, rounds, clock, forced=False):
    batch = ids.shape[0]
    base = lf.base_params(model)

    def loss(a, ids_, mask_):
        return token_loss(lf.adapted_call(model, a, ids_, attention_mask=mask_, base=base).logits, ids_, mask_)

    leaves = {k: v.detach().requires_grad_(True) for k, v in adapter.params.items()}
    live = adapter.with_params(leaves)
    noise = torch.Generator().manual_seed(0)

    def non_private():
        return torch.autograd.grad(loss(live, ids, mask), list(leaves.values()))

    def example_losses(a, ids_, mask_):  # one loss per example from one batched call
        return token_losses(lf.adapted_call(model, a, ids_, attention_mask=mask_, base=base).logits, ids_, mask_)

    batched = batched_loss(example_losses)

    def private(clipping="auto", fn=batched):
        return lf.private_grads(fn, live, ids, mask, max_grad_norm=C, noise_multiplier=SIGMA, generator=noise, clipping=clipping)

    reference = "lora_func non-private step (batched backward)"
    methods = {reference: non_private, PRIVATE: private}
    references = {PRIVATE: reference}
    # The same with a loss of one example at a time (the model under vmap); with --forced also
    # each of the two ways clipping="auto" chooses between per layer.
    for clipping in ("auto", "ghost", "per_example") if forced else ("auto",):
        name = f"lora_func private_grads, vmap, clipping={clipping!r}"
        methods[name] = functools.partial(private, clipping, loss)
        references[name] = reference
    try:
        peft = c.peft_named_adapters(model, [adapter], r, alpha, TARGETS)
    except ImportError:
        peft = None
        print("peft not installed: no peft or Opacus rows")
    if peft is not None:
        peft_params = [p for p in peft.parameters() if p.requires_grad]

        def peft_step():
            return torch.autograd.grad(token_loss(peft(ids, attention_mask=mask).logits, ids, mask), peft_params)

        methods["peft non-private step"] = peft_step
        try:
            import opacus
            from opacus import GradSampleModule
        except ImportError:
            print("opacus not installed: no Opacus rows")
        else:
            for mode, functorch in (("hooks", False), ("functorch", True)):
                # Hooks record in train mode only; the tiny model has no dropout.
                gsm = GradSampleModule(c.peft_named_adapters(model, [adapter], r, alpha, TARGETS).train(), loss_reduction="mean",
                                       force_functorch=functorch)

                def opacus_step(gsm=gsm):
                    gsm.zero_grad(set_to_none=True)
                    token_loss(gsm(ids, attention_mask=mask).logits, ids, mask).backward()
                    return opacus_clip_and_noise(gsm, batch, noise)

                name = f"opacus {opacus.__version__} GradSampleModule {mode} (peft) + clip + noise"
                methods[name] = opacus_step
                references[name] = "peft non-private step"
                methods[f"{name} "] = opacus_step  # the same call against our private step (a second row)
                references[f"{name} "] = PRIVATE
    peaks = {name: peak_allocated(fn) for name, fn in methods.items() if not name.endswith(" ")}
    times = c.timed_rounds({k: v for k, v in methods.items() if not k.endswith(" ")}, rounds, clock)
    for name in methods:
        if name.endswith(" "):
            times[name] = times[name.rstrip()]
    c.print_paired_table(f"Batch {batch} x {ids.shape[1]} tokens: time (target: private_grads <= 1.3x the non-private step)", times, references)
    print("\n| method | peak allocated | ratio | vs |\n|---|---|---|---|")
    for name in methods:
        ref = references.get(name)
        peak = peaks[name.rstrip()]
        ratio = f"{peak / peaks[ref.rstrip()]:.2f}" if ref else ""
        print(f"| {name} | {c.fmt_bytes(peak)} | {ratio} | {ref or ''} |")
    out = {"time": c.paired_ratio(times, PRIVATE, reference), "memory": peaks[PRIVATE] / peaks[reference]}
    for mode in ("hooks", "functorch"):  # Opacus against the private step (> 1: the private step is ahead)
        name = next((n for n in methods if f"GradSampleModule {mode}" in n), None)
        if name is not None:
            out[f"opacus {mode} time"] = c.paired_ratio(times, name, PRIVATE)
            out[f"opacus {mode} memory"] = peaks[name] / peaks[PRIVATE]
    vmap_name = next(n for n in methods if "vmap, clipping='auto'" in n)
    out["vmap time"] = c.paired_ratio(times, vmap_name, reference)
    spreads = {"time": (PRIVATE, reference), "vmap time": (vmap_name, reference)}
    spreads |= {k: (n, PRIVATE) for k, n in (("opacus hooks time", next((n for n in methods if "hooks" in n), None)),
                                              ("opacus functorch time", next((n for n in methods if "functorch" in n), None))) if n}
    print("\nper-round ratios (min, quartiles, max): " + "; ".join(
        f"{key} " + " ".join(f"{q:.3f}" for q in _quantiles([a / b for a, b in zip(times[n], times[ref], strict=True)]))
        for key, (n, ref) in spreads.items()))
    return out


def _quantiles(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [ordered[round(q * (len(ordered) - 1))] for q in (0, 0.25, 0.5, 0.75, 1)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_interleaved_args(parser, rounds=5)
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 8 16 32 64; --quick: 2 4)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--forced", action="store_true", help="also time clipping='ghost' and 'per_example' (vmap path)")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.seq, args.rounds = 32, 1, 64, 8, 1
    args.batches = args.batches or ([2, 4] if args.quick else [8, 16, 32, 64])
    torch.set_num_threads(args.threads)
    clock = c.CLOCKS[args.clock]
    model = build(args.hidden, args.layers, args.vocab)
    r, alpha = args.rank, 2 * args.rank
    spec = lf.AdapterSpec("lora", targets=TARGETS, r=r, alpha=alpha)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0)), 0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), clock {args.clock}; Llama hidden {args.hidden}, {args.layers} layers, "
          f"LoRA r={r} on {TARGETS} ({adapter.num_parameters():,} trainable), max_grad_norm {C}, noise_multiplier {SIGMA}")
    results = {}
    for batch in args.batches:
        ids, mask = c.left_padded_batch(batch, args.seq, args.vocab)
        results[batch] = section(model, adapter, ids, mask, r, alpha, args.rounds, clock, args.forced)
    print(f"\nsummary (private_grads / non-private step; opacus: its time over private_grads's): {json.dumps({b: {k: round(v, 3) for k, v in x.items()} for b, x in results.items()})}")
    return results


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    main()
