"""Where the time goes besides the adapter math.

Five sections (``--sections`` picks some):

- ``adapted_call``: the per-call overhead of ``adapted_call`` with a reused base dict on a
  1-token input, 32 layers x 7 targets (a Llama all-linear adapter), against peft's forward
  overhead on the same weights, interleaved in one run (target: at most peft's).

- ``calls``: per-call cost of building the overlays (``overlay``, ``merge_overlay``) and of
  ``functional_call`` itself, on a tiny input so that Python overhead dominates, and how it
  grows with the number of model layers (the overlay copies the base dict and validates
  every adapted layer on every call).
- ``targets``: the LoRA training-step ratio as the number of targeted modules grows
  (q,v -> q,k,v,o -> every Linear of the blocks).
- ``rank``: the LoRA training-step ratio as the rank grows.
- ``inference``: forward-only (``torch.no_grad``) time of the lazy and the merged overlay
  against the frozen base as the tokens per call grow: where merged is faster.

    python bench/overhead.py
    python bench/overhead.py --sections inference --device cuda --dtype bfloat16 --hidden 2048 --layers 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

import lora_func as lf

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _per_call_us(fn, *, reps: int, rounds: int = 9) -> float:
    """Wall-clock microseconds per call, best of ``rounds``: Python overhead is a floor that
    other processes on the machine can only add to. (Not process CPU time: on 2 threads that
    also counts OpenMP's spinning second thread, which made differences of two such
    measurements swing by milliseconds.)"""
    for _ in range(max(3, reps // 10)):
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return 1e6 * min(samples)


def _call_costs(model: torch.nn.Module, base: dict, adapter: object, ids: torch.Tensor) -> tuple[float, ...]:
    """Wall-clock microseconds per call: overlay(), merge_overlay(), the direct model call,
    functional_call with the base dict, functional_call with a prebuilt lazy overlay."""
    prebuilt = lf.overlay(base, adapter)
    with torch.no_grad():
        return (
            _per_call_us(lambda: lf.overlay(base, adapter), reps=200),
            _per_call_us(lambda: lf.merge_overlay(base, adapter), reps=50),
            _per_call_us(lambda: model(ids), reps=20),
            _per_call_us(lambda: torch.func.functional_call(model, base, (ids,), tie_weights=True, strict=False), reps=20),
            _per_call_us(lambda: torch.func.functional_call(model, prebuilt, (ids,), tie_weights=True, strict=False), reps=20),
        )


def section_calls(args: argparse.Namespace) -> None:
    print("## per-call overhead (wall-clock microseconds per call, best of 9; batch 1 x 1 token, eager attention, no_grad)")
    print()
    print(
        "| model layers | targets (q,v) | overlay() | merge_overlay() | functional_call vs direct call | "
        "lazy stand-ins (per target call) | model(...) direct |"
    )
    print("|---|---|---|---|---|---|---|")
    for layers in (4, 16, 64):
        s = c.build_setup(args, layers=layers)
        # Eager attention: CPU SDPA costs milliseconds on a 1-token input and would hide the rest.
        s.model.config._attn_implementation = "eager"
        ids = torch.tensor([[5]], device=s.device)
        adapter = c.our_adapter(s, "lora", args.rank)
        model, base = s.model, s.base
        n_targets = len(adapter.layers)
        ov, mo, direct, fb, fo = _call_costs(model, base, adapter, ids)
        # The stand-ins' cost is what a LoRA forward with B = 0 adds beyond the base call, minus
        # the two small matmuls; it is dominated by __torch_function__ dispatch in Python.
        per_target = (fo - fb) / n_targets
        print(f"| {layers} | {n_targets} | {ov:.0f} | {mo:.0f} | {fb - direct:+.0f} | {per_target:+.0f} | {direct:.0f} |")
    print()


def _ratio_table(args: argparse.Namespace, title: str, configs: list[tuple[str, tuple[str, ...], int]]) -> None:
    s = c.build_setup(args)
    steps = {"base": c.base_step(s).step}
    for label, targets, rank in configs:
        adapter = c.our_adapter(s, "lora", rank, targets=targets)
        steps[label] = c.our_step(s, adapter, merged=False).step
    stats, noise = c.interleaved_ratios(steps, "base", rounds=args.rounds, warmup=1, device=s.device, seed=args.seed)
    print(f"## {title} (LoRA, lazy overlay; training-step ratio, median of {args.rounds} rounds; base noise {noise:.1%})")
    print()
    print("| config | ratio [95% CI of the median] | extra per targeted module (ms) |")
    print("|---|---|---|")
    base_ms = stats["base"].ms
    for label, targets, _rank in configs:
        st = stats[label]
        per = (st.median - 1.0) * base_ms / (len(targets) * args.layers)
        print(f"| {label} | {st.median:.3f} [{st.lo:.3f}, {st.hi:.3f}] | {per:.2f} |")
    print()


def section_targets(args: argparse.Namespace) -> None:
    configs = [
        ("q,v", ("q_proj", "v_proj"), args.rank),
        ("q,k,v,o", ("q_proj", "k_proj", "v_proj", "o_proj"), args.rank),
        ("all 7 linears", ALL_LINEAR, args.rank),
    ]
    _ratio_table(args, "cost vs targeted modules", configs)


def section_rank(args: argparse.Namespace) -> None:
    configs = [(f"r={r}", ("q_proj", "v_proj"), r) for r in (4, 8, 16, 32, 64)]
    _ratio_table(args, "cost vs rank (targets q,v)", configs)


def section_inference(args: argparse.Namespace) -> None:
    rows = ("lora", "dora", "hra", "ia3_kv_down")
    paths = ("lazy", "merged", "merged once")
    sizes = ((1, 1), (1, 16), (1, 128), (8, 128), (32, 128))
    cells: dict[tuple[str, str], list[str]] = {(r, p): [] for r in rows for p in paths}
    model = None  # one model for every size (only the inputs change), built once
    for batch, seq in sizes:
        sub = argparse.Namespace(**{**vars(args), "batch": batch, "seq": seq})
        s = c.build_setup(sub, model=model)
        model, base, embeds = s.model, s.base, s.embeds.detach()
        steps = {"base": lambda model=model, embeds=embeds: model(inputs_embeds=embeds)}
        for row in rows:
            adapter = c.our_adapter(s, row, args.rank).detach()
            with torch.no_grad():
                once = lf.merge_overlay(base, adapter)  # merged weights built once, reused every call
            for path in paths:
                if path == "merged once":
                    make = lambda base, adapter, once=once: once
                else:
                    make = lf.merge_overlay if path == "merged" else lf.overlay

                def fwd(make=make, adapter=adapter, model=model, base=base, embeds=embeds):
                    params = make(base, adapter)
                    return torch.func.functional_call(model, params, (), {"inputs_embeds": embeds}, tie_weights=True, strict=False)

                steps[f"{row}/{path}"] = fwd
        reps = max(1, min(50, 4096 // (batch * seq)))

        def batched(fn, reps=reps):
            def run():
                for _ in range(reps):
                    fn()

            return run

        with torch.no_grad():
            stats, _noise = c.interleaved_ratios(
                {k: batched(v) for k, v in steps.items()}, "base", rounds=args.rounds, warmup=1, device=s.device, seed=args.seed
            )
        for row in rows:
            for path in paths:
                cells[(row, path)].append(f"{stats[f'{row}/{path}'].median:.2f}")
    print("## inference: forward-only time / frozen-base forward (no_grad), by tokens per call")
    print()
    print("| variant | overlay | " + " | ".join(f"{b * q} tokens" for b, q in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for row in rows:
        for path in paths:
            print(f"| {row} | {path} | " + " | ".join(cells[(row, path)]) + " |")
    print()
    print("# lazy: overlay() every call; merged: merge_overlay() every call; merged once: merge_overlay()")
    print("# computed once and the dict reused (what lora_func.adapted(model, adapter) does for generate)")
    print()


def adapted_call_overhead(args: argparse.Namespace, *, layers: int = 32, rounds: int | None = None, reps: int = 5) -> dict[str, object]:
    """Per-call overhead of ``adapted_call(model, adapter, ids, base=base)`` (LoRA on all 7 linears
    of every block, a reused base dict, a 1-token input, no_grad) and of peft's forward on the same
    weights, each minus the direct model call, interleaved: every round times the three in a
    fresh random order (``reps`` calls each, wall clock). Returns the medians (microseconds), the
    per-round ``ours - peft`` differences and their 95% interval (``_common.median_ci``)."""
    import random
    import statistics

    rounds = rounds or args.rounds
    s = c.build_setup(argparse.Namespace(**{**vars(args), "batch": 1, "seq": 1}), layers=layers)
    s.model.config._attn_implementation = "eager"  # CPU SDPA costs milliseconds on 1 token
    adapter = c.our_adapter(s, "lora", args.rank, targets=ALL_LINEAR).detach()
    pm = c.peft_model(s, "lora", args.rank, targets=ALL_LINEAR)
    pm.config._attn_implementation = "eager"  # type: ignore[union-attr]
    model, base, ids = s.model, s.base, torch.tensor([[5]], device=s.device)
    calls = {
        "direct": lambda: model(ids),
        "ours": lambda: lf.adapted_call(model, adapter, ids, base=base),
        "peft": lambda: pm(ids),  # type: ignore[misc]
    }
    rng = random.Random(args.seed)
    times: dict[str, list[float]] = {k: [] for k in calls}
    with torch.no_grad():
        for fn in calls.values():
            for _ in range(3):
                fn()
        for _ in range(rounds):
            order = list(calls)
            rng.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                for _ in range(reps):
                    calls[name]()
                times[name].append(1e6 * (time.perf_counter() - t0) / reps)
    ours = [o - d for o, d in zip(times["ours"], times["direct"], strict=True)]
    peft = [p - d for p, d in zip(times["peft"], times["direct"], strict=True)]
    diff = [o - p for o, p in zip(ours, peft, strict=True)]
    lo, hi = c.median_ci(diff)
    return {
        "targets": len(adapter.layers), "direct": statistics.median(times["direct"]),
        "ours": statistics.median(ours), "peft": statistics.median(peft), "diff": statistics.median(diff), "lo": lo, "hi": hi,
    }


def section_adapted_call(args: argparse.Namespace) -> None:
    r = adapted_call_overhead(args, layers=args.overhead_layers)
    print(f"## adapted_call per-call overhead vs peft ({args.overhead_layers} layers x 7 targets = {r['targets']} targets, 1 token, reused base, no_grad; wall clock, {args.rounds} interleaved rounds)")
    print()
    print("| direct model call (us) | adapted_call overhead (us) | peft forward overhead (us) | ours - peft [95% CI] (us) |")
    print("|---|---|---|---|")
    print(f"| {r['direct']:.0f} | {r['ours']:+.0f} | {r['peft']:+.0f} | {r['diff']:+.0f} [{r['lo']:+.0f}, {r['hi']:+.0f}] |")
    verdict = c.verdict(r["lo"], r["hi"], 0.0)  # type: ignore[arg-type]
    print(f"# target: adapted_call overhead <= peft's forward overhead: {verdict.upper()}")
    print()


SECTIONS = {"adapted_call": section_adapted_call, "calls": section_calls, "targets": section_targets, "rank": section_rank, "inference": section_inference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_model_args(parser)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--overhead-layers", type=int, default=32, help="model layers of the adapted_call section")
    parser.add_argument("--clock", default="cpu", choices=("wall", "cpu"), help="for the ratio sections (calls: always wall)")
    args = parser.parse_args(argv)
    c.setup(args)
    print(f"# lora_func overheads; {c.machine_line(args)}; {args.clock} clock")
    print(f"# Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x {args.seq}, r={args.rank}")
    print()
    for name in args.sections.split(","):
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    raise SystemExit(main())
