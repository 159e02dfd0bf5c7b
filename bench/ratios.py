"""Training-step cost of every variant, lazy and merged overlay, next to HF peft.

Prints ``ratio = step time / frozen-base step time`` (medians over interleaved rounds; see
bench/_common.py and docs/benchmarks.md for the exact definitions) with a 95 % confidence
interval of each median, the activation memory each step saves for backward, and for every
variant peft has whether the target (the paired lazy/peft quotient's upper confidence bound at
most 1.02) holds, fails, or is unresolved at this machine's noise. A null row (the
frozen base timed once more as if it were a configuration, true ratio 1) shows the harness's
own resolution in the same run.

    python bench/ratios.py                       # CPU, the documented configuration
    python bench/ratios.py --device cuda --dtype bfloat16 --hidden 2048 --layers 8
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

# The target on the lazy overlay (the training path), for every variant peft has: the upper
# bound of the 95% interval of the median paired quotient (lazy step / peft step, both timed in
# the same round) at most this. No absolute ratio to the frozen base is a target on a CPU: the
# deterministic counts of bench/counts.py are (docs/benchmarks.md).
VS_PEFT_LIMIT = 1.02
NULL = "base, timed again"  # the null configuration: identical to the baseline, true ratio 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_model_args(parser)
    parser.add_argument("--variants", default=",".join(c.ALL_VARIANTS), help="comma-separated rows")
    parser.add_argument("--paths", default="lazy,merged", help="which of our overlays to time")
    parser.add_argument("--no-peft", action="store_true")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clock", default="cpu", choices=("wall", "cpu"), help="cpu: process CPU time (default; robust to other load); wall: elapsed time (always on CUDA)")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args(argv)
    c.setup(args)
    rows = [v for v in args.variants.split(",") if v]
    paths = [p for p in args.paths.split(",") if p]
    s = c.build_setup(args)
    steps: dict[str, c.Step] = {"base": c.base_step(s), NULL: c.base_step(s)}
    excludes: dict[str, list[torch.Tensor]] = {"base": [*s.base.values(), s.embeds], NULL: [*s.base.values(), s.embeds]}
    for row in rows:
        adapter = c.our_adapter(s, row, args.rank)
        for path in paths:
            if path == "merged" and row in c.NO_MERGED_ROWS:
                continue
            steps[f"{row}/{path}"] = c.our_step(s, adapter, merged=path == "merged")
            excludes[f"{row}/{path}"] = [*s.base.values(), s.embeds, *adapter.params.values(), *adapter.buffers.values()]
        if not args.no_peft:
            pm = c.peft_model(s, row, args.rank, adapter=adapter)
            if pm is not None:
                steps[f"{row}/peft"] = c.peft_step(s, pm)
                excludes[f"{row}/peft"] = [*pm.parameters(), *pm.buffers(), s.embeds]
    memory: dict[str, int] = {}
    if not args.no_memory:
        for name, st in steps.items():
            if s.device.type == "cuda":
                memory[name] = c.cuda_peak_bytes(st.step)
            else:
                memory[name] = c.saved_tensor_bytes(st.forward, excludes[name])
    stats, noise = c.interleaved_ratios(
        {n: st.step for n, st in steps.items()}, "base", rounds=args.rounds, warmup=args.warmup, device=s.device, seed=args.seed
    )

    null = stats[NULL]
    print(f"# lora_func step-cost ratios, {datetime.datetime.now().isoformat(timespec='minutes')}")
    print(f"# {c.machine_line(args)}; {args.clock} clock")
    print(
        f"# Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x {args.seq} tokens, "
        f"r={args.rank}; {args.rounds} interleaved rounds; frozen-base step {stats['base'].ms:.1f} ms (median), "
        f"round-to-round noise of the base step (IQR/median) {noise:.1%}"
    )
    print(
        f"# null check: the frozen base timed again as a configuration (true ratio 1.000) measures {null.median:.3f} "
        f"[95% CI {null.lo:.3f}, {null.hi:.3f}]: this run's resolution"
    )
    mem_head = " memory lazy / merged / peft |" if memory else ""
    print()
    print(f"| variant | targets | ours lazy | ours merged | peft |{mem_head} target (lazy vs peft, paired) |")
    print(f"|---|---|---|---|---|{'---|' if memory else ''}---|")

    def cell(name: str) -> str:
        if name not in stats:
            return "—"
        st = stats[name]
        return f"{st.median:.3f} [{st.lo:.3f}, {st.hi:.3f}]"

    failures, unresolved = [], []
    for row in rows:
        text = ""
        if f"{row}/lazy" in stats and f"{row}/peft" in stats:
            # Paired within each round: lazy and peft ran in the same round, a few steps apart,
            # so their quotient cancels most of that round's load.
            paired = [a / b for a, b in zip(stats[f"{row}/lazy"].samples, stats[f"{row}/peft"].samples, strict=True)]
            lo, hi = c.median_ci(paired)
            result = c.verdict(lo, hi, VS_PEFT_LIMIT)
            text = f"lazy/peft {statistics.median(paired):.3f} [{lo:.3f}, {hi:.3f}], upper bound <= {VS_PEFT_LIMIT:.2f}: {result.upper()}"
            if result == "fails":
                failures.append(row)
            elif result == "unresolved":
                unresolved.append(row)
        mem = ""
        if memory:
            base_mem = memory["base"]
            mem_parts = []
            for p in ("lazy", "merged", "peft"):
                key = f"{row}/{p}"
                mem_parts.append("—" if key not in memory else f"{(memory[key] - base_mem) / 2**20:+.1f}")
            mem = f" {' / '.join(mem_parts)} MiB |"
        targets = ",".join(c.ROW_TARGETS[row])
        print(f"| {row} | {targets} | {cell(f'{row}/lazy')} | {cell(f'{row}/merged')} | {cell(f'{row}/peft')} |{mem} {text} |")
    print()
    if memory:
        kind = "peak CUDA memory of a step" if s.device.type == "cuda" else "bytes saved for backward"
        print(f"# memory: {kind}, relative to the frozen base ({c.fmt_bytes(memory['base'])})")
    print("# cells: median of the per-round ratios to the frozen base [95% confidence interval of that median, distribution-free]")
    print(
        "# targets: HOLDS when the whole interval is at or under the limit, FAILS when all of it is above, "
        "UNRESOLVED when it straddles the limit (more --rounds or a quieter machine decide)"
    )
    summary = [f"fail: {', '.join(failures)}"] if failures else []
    summary += [f"unresolved: {', '.join(unresolved)}"] if unresolved else []
    print(f"# targets: {'; '.join(summary) if summary else 'all hold'}")
    return 0


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    raise SystemExit(main())
