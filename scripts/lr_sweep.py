"""Sweep the learning rate of every variant on the demo task; print a Markdown table.

    python scripts/lr_sweep.py --steps 100 > sweep.md     # about 15 min on 2 CPU cores

The numbers quoted in docs/guide/hyperparameters.md come from this script (r=8, attention
projections, batch 16, AdamW, gradient clipping at 1.0, the shipped tiny model in fp32).
Each cell is the held-out accuracy after training, then the mean loss of the last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

import lora_func as lf
from lora_func.demo.corpus import task_split
from lora_func.demo.model import default_targets, load_model
from lora_func.demo.run import batch_sampler, encode_examples, held_out_accuracy
from lora_func.train import TrainState, fit, make_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="all")
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1,3e-1")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = lf.list_variants() if args.variants == "all" else args.variants.split(",")
    lrs = [float(x) for x in args.lrs.split(",")]
    model, tokenizer = load_model()
    train_examples, held_out_examples = task_split(0)
    train, held_out = encode_examples(tokenizer, train_examples), encode_examples(tokenizer, held_out_examples)
    base = lf.base_params(model)
    calibration = [
        {"input_ids": train.input_ids[i : i + 16], "attention_mask": train.attention_mask[i : i + 16]}
        for i in range(0, len(train.examples), 16)
    ]
    cells: dict[str, dict[float, str]] = {}
    bar = tqdm(total=len(variants) * len(lrs), desc="sweep", unit="run")
    for variant in variants:
        for lr in lrs:
            bar.set_postfix(variant=variant, lr=f"{lr:g}")
            spec = lf.AdapterSpec(variant, targets=default_targets(model), r=args.r)
            calib = calibration if lf.get_variant(variant).calibration is not None else None
            adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0), calibration=calib)
            state = TrainState(adapter, make_optimizer(adapter, lr))
            history = fit(model, state, batch_sampler(train, 16, 0), args.steps, progress=False)
            accuracy, _ = held_out_accuracy(model, adapter, held_out, base=base)
            loss = sum(s.loss for s in history[-10:]) / 10
            cells.setdefault(variant, {})[lr] = f"{accuracy:.0%} / {loss:.2f}"
            tqdm.write(json.dumps({"variant": variant, "lr": lr, "acc": accuracy, "loss": loss}), file=sys.stderr)
            bar.update(1)
    bar.close()
    print("| variant | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |")
    print("|---|" + "---|" * len(lrs))
    for variant, row in cells.items():
        print(f"| {variant} | " + " | ".join(row[lr] for lr in lrs) + " |")


if __name__ == "__main__":
    main()
