"""``lora-func``: command-line entry point.

``lora-func demo`` fine-tunes adapters on a small pretrained Llama that ships with the
package (or any local Hugging Face causal-LM directory, ``--model DIR``), offline, on a task
the base model fails: answering ``what is 3 plus 4 ?`` when it only ever saw ``3 + 4 = 7``.
Per variant it prints the trainable parameters, the held-out accuracy before and after, the
final loss, the time per step and generated samples; it saves each adapter (peft format where
peft has the variant), reloads it and checks the outputs; it writes a loss plot and a results
table to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import lora_func as lf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _variants(text: str) -> list[str]:
    return lf.list_variants() if text == "all" else [v.strip() for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    from lora_func.demo.run import DEFAULT_VARIANTS, DemoConfig, run_demo

    parser = argparse.ArgumentParser(prog="lora-func", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="fine-tune adapters on a small pretrained model and report",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated names, or 'all'")
    demo.add_argument("--r", type=int, default=None, help="adapter rank for every variant; unset: each variant's own (8 for most; lora_func/demo/defaults.py)")
    demo.add_argument("--steps", type=int, default=DemoConfig.steps, help="training steps per variant")
    demo.add_argument("--lr", type=float, default=None, help="learning rate for every variant; unset: each variant's own (lora_func/demo/defaults.py)")
    demo.add_argument("--batch-size", type=int, default=DemoConfig.batch_size)
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the base model's dtype (adapters stay float32)")
    demo.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps ...")
    demo.add_argument("--model", default=None, help="a local Hugging Face causal-LM directory (default: the shipped tiny Llama)")
    demo.add_argument("--targets", default=None, help="comma-separated module names (default: the attention projections)")
    demo.add_argument("--out", type=Path, default=Path("lora-func-demo"), help="where the plot, the tables and the adapters go")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--threads", type=int, default=None,
        help="torch CPU threads for training (default: 1 for the shipped tiny model, whose matmuls are too small to "
        "split, torch's default for --model)",
    )
    demo.add_argument(
        "--gradient-checkpointing", action="store_true",
        help="recompute each decoder layer in backward instead of keeping its activations (less memory, more time)",
    )
    demo.add_argument(
        "--quantize", choices=("nf4", "int8"), default=None,
        help="load the base quantized with bitsandbytes (QLoRA; needs bitsandbytes installed): nf4 4-bit or LLM.int8",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    variants = _variants(args.variants)
    unknown = sorted(set(variants) - set(lf.list_variants()))
    if unknown or not variants:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(lf.list_variants())}, or 'all'")
    if args.r is not None and args.r < 1:
        parser.error(f"--r must be a whole number >= 1, got {args.r}")
    if args.quantize and "pissa" in variants:
        parser.error("pissa replaces the base weight by a dense residual, which a quantized base cannot hold; leave it out with --quantize")
    config = DemoConfig(
        variants=variants, r=args.r, steps=args.steps, lr=args.lr, batch_size=args.batch_size, dtype=DTYPES[args.dtype],
        device=args.device, model_dir=args.model, targets=args.targets.split(",") if args.targets else None,
        out=args.out, seed=args.seed, progress=not args.no_progress, threads=args.threads,
        gradient_checkpointing=args.gradient_checkpointing, quantize=args.quantize,
    )
    try:
        rows = run_demo(config)
    except FloatingPointError as err:  # a diverged run (the printed lines above name its step and tensors); the rest is written
        print(f"lora-func demo: {err}\nTry a lower --lr (or --dtype float32).", file=sys.stderr)
        return 1
    trained = [r for r in rows if r["status"] == "trained"]
    not_learnt = [r["variant"] for r in trained if r["acc_after"] <= r["acc_before"]]
    if not_learnt:
        print(f"note: held-out accuracy did not improve for {not_learnt}; try more --steps or another --lr", file=sys.stderr)
    for row in rows:
        if row["status"] == "skipped":  # the method cannot start here (an option no value fits, a missing optional package)
            print(f"note: {row['variant']} skipped: {row['reason']}", file=sys.stderr)
    failed = [r for r in rows if r["status"] == "failed"]
    for row in failed:
        print(f"lora-func demo: {row['variant']} failed: {row['reason']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
