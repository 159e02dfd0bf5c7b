"""What one training step costs beyond the frozen base, in deterministic counts.

For every variant, on the lazy and the merged overlay, next to HF peft and the frozen base,
on an fp32 and a bf16 base (adapters fp32): three counts over one step (forward, loss,
backward to the adapter tensors and the input embeddings; bench/_common.py), each minus the
frozen base's:

- saved: bytes of the distinct storages autograd keeps for backward (deduplicated by storage,
  so a tensor saved by several ops counts once; weights, adapter tensors and embeddings excluded);
- written: bytes of every tensor an op writes, forward and backward (the outputs of every aten
  op, in-place ones included, views excluded), seen through a ``TorchDispatchMode``;
- ops: the aten ops that ran (views excluded).

They are the same on any machine (no timings), so targets on them resolve on a noisy CPU.
Memory traffic (written) and launches (ops) are what a bandwidth-bound or launch-bound GPU step
pays for; saved bytes are its activation memory.

The limit of a low-rank adapter on q,v (what no implementation can avoid over the frozen
base): keeping one base-dtype copy of each distinct target input (the frozen base keeps none:
a frozen layer's backward needs its weight, not its input) and the ``(n, r)`` activations of
each target (counted in fp32), and writing one base-dtype pass over the input gradient per
target. Targets (bf16 base): LoRA lazy saved <= 1.2x and written <= 2x that limit, written <=
the merged path's, ops <= peft's; every other row peft has (all but AntiPaSTO) lazy <= peft on
all three counts. The exit status is 1 when a target fails.

    python bench/counts.py                      # hidden 256, 4 layers, 8 x 128 tokens, r = 8
    python bench/counts.py --dtypes bfloat16 --variants lora,dora
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

# Lazy-path limits on a bf16 base, in units of the unavoidable part (module docstring).
LORA_SAVED_LIMIT = 1.2
LORA_WRITTEN_LIMIT = 2.0
# Rows held to "at most peft's" on every count (the list; ia3 in its three recipes).
VS_PEFT_ROWS = ("lora", "dora", "delora", "hra", "ia3", "ia3_ff", "ia3_kv_down")
# Issue 30, structured family (b): each at most peft's on every count too.
VS_PEFT_ROWS += ("oft", "boft", "road", "hira")
# Issue 30 (structured family): LoHa, LoKr, GraLoRA and MiSS lazy at most peft's on every count.
VS_PEFT_ROWS += c.STRUCTURED_A
# Issue 30: WaveFT lazy at most peft's on every count.
VS_PEFT_ROWS += ("waveft",)
# Issue 30 (part c): C3A's lazy FFT form at most peft's too.
VS_PEFT_ROWS += ("c3a",)
# Issue 46: every other row peft has (PiSSA, EVA, and the methods added for it), the same target;
# checked after the rows above, whose verdict lines keep their order.
LATER_VS_PEFT_ROWS = ("pissa", "eva", *c.SAVED_PEFT_ROWS, *c.LORA_INIT_ROWS)
# Issue 43: BEFT, GLoRA and PSOFT lazy at most peft's on every count; OSF too but for its ops on a
# bf16 base (docs/benchmarks.md: two casts per target of its fp32 factors, where peft's are bf16).
VS_PEFT_ROWS += ("beft", "glora", "psoft")
# Issue 43 (methods b): DEFT, PEANuT and Super-Tuning lazy at most peft's on every count too.
VS_PEFT_ROWS += c.METHODS_B
# Issue 43: BD-LoRA and VeLoRA (in eval mode, as the benchmark's model) at most peft's.
VS_PEFT_ROWS += ("bdlora", "velora")
TARGET_DTYPE = "bfloat16"


def _is_view(func: Any) -> bool:
    """An aten op whose outputs alias an input without writing it (view, alias, detach)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops that run and the bytes their tensor outputs hold."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.written = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _is_view(func):
            self.ops += 1
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.written += t.numel() * t.element_size()
        return out


def count_step(step: c.Step, exclude: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    """``(saved bytes, written bytes, ops)`` of one step (``step.step()`` twice: a first call
    warms up lazily built state, so the counted one is what every training step costs)."""
    step.step()
    saved = c.saved_tensor_bytes(step.forward, exclude)
    counter = OpCounter()
    with counter:
        step.step()
    return saved, counter.written, counter.ops


def limit_bytes(s: c.Setup, targets: Sequence[str], rank: int) -> tuple[int, int]:
    """``(saved, written)`` that no low-rank adapter on ``targets`` can avoid (module docstring):
    one base-dtype copy of each distinct target input plus ``(n, r)`` fp32 activations per
    target; one base-dtype pass over the input gradient per target."""
    n = s.embeds.shape[0] * s.embeds.shape[1]
    item = torch.empty((), dtype=s.dtype).element_size()
    # q, k and v read the same input; so do gate and up.
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
    inputs: dict[tuple[str, str], int] = {}
    written = layers = 0
    for name, module in s.model.named_modules():
        block, _, leaf = name.rpartition(".")
        if leaf in targets and isinstance(module, torch.nn.Linear):
            inputs[(block, shared.get(leaf, leaf))] = module.in_features
            written += n * module.in_features * item
            layers += 1
    saved = sum(n * d * item for d in inputs.values()) + layers * n * rank * 4
    return saved, written


def measure(args: argparse.Namespace, dtype: str, rows: Sequence[str]) -> dict[str, Any]:
    """``{"base": counts, "limit": {row: (saved, written)}, row/path: counts}`` for one dtype."""
    sub = argparse.Namespace(**{**vars(args), "dtype": dtype})
    s = c.build_setup(sub)
    out: dict[str, Any] = {"limit": {}}
    base = c.base_step(s)
    out["base"] = count_step(base, [*s.base.values(), s.embeds])
    for row in rows:
        adapter = c.our_adapter(s, row, args.rank)
        own = [*s.base.values(), s.embeds, *adapter.params.values(), *adapter.buffers.values()]
        out["limit"][row] = limit_bytes(s, c.ROW_TARGETS[row], args.rank)
        for path in ("lazy",) if row in c.NO_MERGED_ROWS else ("lazy", "merged"):
            out[f"{row}/{path}"] = count_step(c.our_step(s, adapter, merged=path == "merged"), own)
        if args.peft:
            pm = c.peft_model(s, row, args.rank, adapter=adapter)
            if pm is not None:
                out[f"{row}/peft"] = count_step(c.peft_step(s, pm), [*pm.parameters(), *pm.buffers(), s.embeds])
    return out


def check_targets(counts: dict[str, Any], rows: Sequence[str]) -> list[tuple[str, float, float, bool]]:
    """``[(what, value, limit, holds)]`` for the targets of the rows present (bf16 counts)."""
    base = counts["base"]
    over = {k: tuple(v - b for v, b in zip(val, base, strict=True)) for k, val in counts.items() if k not in ("base", "limit")}
    results = []
    if "lora" in rows:
        saved_lim, written_lim = counts["limit"]["lora"]
        saved, written, _ops = over["lora/lazy"]
        results.append(("lora lazy saved / limit", saved / saved_lim, LORA_SAVED_LIMIT, saved <= LORA_SAVED_LIMIT * saved_lim))
        results.append(("lora lazy written / limit", written / written_lim, LORA_WRITTEN_LIMIT, written <= LORA_WRITTEN_LIMIT * written_lim))
        merged_written = over["lora/merged"][1]
        results.append(("lora lazy written / merged written", written / merged_written, 1.0, written <= merged_written))
    for targeted in (VS_PEFT_ROWS, LATER_VS_PEFT_ROWS):
        for row in rows:
            if row not in targeted or f"{row}/peft" not in over:
                continue
            lazy, peft = over[f"{row}/lazy"], over[f"{row}/peft"]
            for i, what in enumerate(("saved", "written", "ops")):
                ratio = lazy[i] / peft[i] if peft[i] else float("inf") if lazy[i] > 0 else 0.0
                results.append((f"{row} lazy {what} / peft", ratio, 1.0, lazy[i] <= peft[i]))
    return results


def _mib(n: float) -> str:
    return f"{n / 2**20:+.2f}"


def print_table(dtype: str, counts: dict[str, Any], rows: Sequence[str]) -> None:
    base = counts["base"]
    print(f"## {dtype} base: over the frozen base (saved MiB / written MiB / ops)")
    print()
    print(f"frozen base step: saved {base[0] / 2**20:.2f} MiB, written {base[1] / 2**20:.2f} MiB, {base[2]} ops")
    print()
    print("| variant | limit saved / written | lazy | merged | peft |")
    print("|---|---|---|---|---|")
    for row in rows:
        cells = []
        for path in ("lazy", "merged", "peft"):
            val = counts.get(f"{row}/{path}")
            cells.append("—" if val is None else f"{_mib(val[0] - base[0])} / {_mib(val[1] - base[1])} / {val[2] - base[2]:+d}")
        lim_s, lim_w = counts["limit"][row]
        print(f"| {row} | {lim_s / 2**20:.2f} / {lim_w / 2**20:.2f} | " + " | ".join(cells) + " |")
    print()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_model_args(parser)
    parser.add_argument("--variants", default=",".join(c.ALL_VARIANTS), help="comma-separated rows")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="base dtypes, comma-separated")
    parser.add_argument("--no-peft", dest="peft", action="store_false", help="leave out the peft rows (and the targets against them)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    c.setup(args)
    rows = [v for v in args.variants.split(",") if v]
    print(f"# lora_func step counts; torch {torch.__version__}; adapters fp32")
    print(f"# Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.batch} x {args.seq} tokens, r={args.rank}")
    print()
    failed = False
    for dtype in args.dtypes.split(","):
        counts = measure(args, dtype, rows)
        print_table(dtype, counts, rows)
        if dtype == TARGET_DTYPE:
            for what, value, limit, holds in check_targets(counts, rows):
                failed |= not holds
                print(f"# target: {what} = {value:.2f} <= {limit:.2f}: {'HOLDS' if holds else 'FAILS'}")
            print()
    return 1 if failed else 0


COUNTS: Callable[..., Any] = measure

if __name__ == "__main__":
    raise SystemExit(main())
