"""A private fine-tune of the demo model (DP-SGD at epsilon ~8, delta 1e-5) next to the
non-private one: the numbers in docs/guide/privacy.md.

The task is `lora-func demo`'s: 70 training questions `what is a plus b ?`, exact-match accuracy
on 30 held-out ones. The private run samples every batch by Poisson sampling (each of the 70
examples in with probability `--sample-rate`), clips every example's gradient to
`--max-grad-norm`, adds the noise that gives each epsilon of `--epsilons` at delta = `--delta` after
`--steps` steps (lora_func.privacy.noise_for_epsilon), and divides by the expected batch size.
The non-private run is the same loop with no clipping and no noise (same sampler, optimiser,
learning rate and steps), and `lora_func.train.fit` as the demo runs it (batch 16 with
replacement, clipping the batch norm at 1.0).

Caveat printed with the numbers: the hyper-parameters were chosen on this synthetic task; on
real private data, choosing them by looking at results on that data spends privacy too
(docs/guide/privacy.md).

Run: PYTHONPATH=. python scripts/private_demo.py [--variants lora ia3] [--epsilons 8 64 1000] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import lora_func as lf
from lora_func.demo.corpus import task_split
from lora_func.demo.model import default_targets, load_model
from lora_func.demo.run import (
    DEFAULT_LR,
    batch_sampler,
    encode_examples,
    held_out_accuracy,
)
from lora_func.privacy import (
    DPSGD,
    PoissonBatchSampler,
    epsilon,
    noise_for_epsilon,
    private_step_,
)
from lora_func.train import TrainState, adapter_loss, fit, make_optimizer


def run(model, train, held_out, variant, *, lr, steps, seed, sample_rate, dp, r):
    """Train one adapter with private_step_ (dp=None: no clipping, no noise); held-out accuracy."""
    base = lf.base_params(model)
    spec = lf.AdapterSpec(variant, targets=default_targets(model), r=r)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed))
    optimizer = make_optimizer(adapter, lr)
    if dp is None:  # the same loop without privacy: a huge clip bound, no noise
        dp = DPSGD(max_grad_norm=1e9, noise_multiplier=0.0, expected_batch_size=sample_rate * len(train.examples))

    def loss_fn(a, ids, mask, labels):
        return adapter_loss(model, a, {"input_ids": ids, "attention_mask": mask, "labels": labels}, base=base)

    sampler = PoissonBatchSampler(len(train.examples), sample_rate, steps, generator=torch.Generator().manual_seed(1000 + seed))
    start = time.perf_counter()
    clipped = counted = 0
    for indices in sampler:
        index = torch.tensor(indices, dtype=torch.long)
        stats = private_step_(optimizer, adapter, loss_fn, [(train.input_ids[index], train.attention_mask[index], train.labels[index])], dp)
        clipped, counted = clipped + stats.clipped, counted + stats.count
    seconds = time.perf_counter() - start
    accuracy, _ = held_out_accuracy(model, adapter, held_out, base=base)
    return accuracy, 1e3 * seconds / steps, clipped / max(1, counted)


def run_demo_fit(model, train, held_out, variant, *, lr, steps, seed, r):
    """The demo's own non-private training (lora_func.train.fit, batch 16, clip 1.0)."""
    base = lf.base_params(model)
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=default_targets(model), r=r), generator=torch.Generator().manual_seed(seed))
    state = TrainState(adapter, make_optimizer(adapter, lr))
    fit(model, state, batch_sampler(train, 16, seed), steps, progress=False)
    return held_out_accuracy(model, adapter, held_out, base=base)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["lora", "ia3"])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sample-rate", type=float, default=0.25)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[8.0, 64.0, 1000.0])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr-scale", type=float, default=1.0, help="multiplies the demo's learning rate of each variant")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, tokenizer = load_model()
    train_examples, held_out_examples = task_split()
    train, held_out = encode_examples(tokenizer, train_examples), encode_examples(tokenizer, held_out_examples)
    n = len(train.examples)
    expected = args.sample_rate * n
    sigmas = {eps: noise_for_epsilon(epsilon=eps, sample_rate=args.sample_rate, steps=args.steps, delta=args.delta) for eps in args.epsilons}
    print(f"{n} training examples, Poisson sample rate {args.sample_rate} (expected batch {expected:g}), {args.steps} steps, "
          f"max_grad_norm {args.max_grad_norm}, delta {args.delta:g}; noise multiplier per epsilon: "
          + ", ".join(f"{eps:g}: {sigma:.3f}" for eps, sigma in sigmas.items()))
    rows = []
    for variant in args.variants:
        lr = DEFAULT_LR[variant] * args.lr_scale
        row = {"variant": variant, "lr": lr, "private": {}}
        for eps, sigma in sigmas.items():
            assert epsilon(noise_multiplier=sigma, sample_rate=args.sample_rate, steps=args.steps, delta=args.delta) <= eps
            results = [run(model, train, held_out, variant, lr=lr, steps=args.steps, seed=seed, sample_rate=args.sample_rate, r=args.r,
                           dp=DPSGD(max_grad_norm=args.max_grad_norm, noise_multiplier=sigma, expected_batch_size=expected,
                                    generator=torch.Generator().manual_seed(seed)))
                       for seed in args.seeds]
            row["private"][eps] = {"sigma": sigma, "acc": [r[0] for r in results], "ms_per_step": statistics.mean(r[1] for r in results),
                                   "clipped": statistics.mean(r[2] for r in results)}
        plain = [run(model, train, held_out, variant, lr=lr, steps=args.steps, seed=seed, sample_rate=args.sample_rate, dp=None, r=args.r)
                 for seed in args.seeds]
        row["no privacy"] = {"acc": [r[0] for r in plain], "ms_per_step": statistics.mean(r[1] for r in plain)}
        row["demo fit"] = [run_demo_fit(model, train, held_out, variant, lr=lr, steps=args.steps, seed=s, r=args.r) for s in args.seeds]
        rows.append(row)
        print(json.dumps(row))

    def cell(accs):
        return f"{statistics.mean(accs):.0%} ({', '.join(f'{a:.0%}' for a in accs)})"

    print()
    print("| variant | lr | " + " | ".join(f"private, ε = {eps:g} (σ = {s:.2f})" for eps, s in sigmas.items())
          + " | same loop, no clipping or noise | demo's `fit` (non-private) | ms/step private / non-private |")
    print("|---|---|" + "---|" * (len(sigmas) + 3))
    for row in rows:
        first = row["private"][args.epsilons[0]]
        print(f"| {row['variant']} | {row['lr']:g} | " + " | ".join(cell(row["private"][eps]["acc"]) for eps in sigmas)
              + f" | {cell(row['no privacy']['acc'])} | {cell(row['demo fit'])} | {first['ms_per_step']:.0f} / {row['no privacy']['ms_per_step']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
