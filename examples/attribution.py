"""Which training questions made the model answer this? Training-data attribution on the demo task.

The demo model (lora_func/demo: a tiny pretrained Llama that knows ``3 + 4 = 7 .``) learns to
answer ``what is 3 plus 4 ?`` from 70 training questions; 30 are held out. This script:

1. fine-tunes a LoRA on the 70 questions and computes the attribution features of every training
   question and every held-out answer (exact per-example gradients, projected);
2. prints, for a few held-out answers, the training questions that support them most, by TracIn,
   LESS, TRAK (one model, and averaged over an ensemble of adapters trained on random halves, one
   stacked adapter) and EK-FAC influence;
3. judges the four methods by the linear datamodeling score (LDS): M adapters trained on random
   halves of the training set, K at a time as one stacked adapter (``ensemble_call``: the subset
   models are one batched training run), and the rank correlation between each method's
   prediction of a held-out answer's log-probability and what the subset models give;
4. with ``--select``, LESS-style data selection (docs/attribution.md): from a pool of training
   questions and as many unrelated sentences, pick a budget of examples by their LESS score
   against a few target questions, and compare the held-out accuracy of an adapter trained on
   them with one trained on a random pick of the same size.

Run: python examples/attribution.py           # small settings (a smoke run: 4 subset models), about 15 s on one core
     python examples/attribution.py --full    # the numbers in docs/attribution.md
     python examples/attribution.py --select --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import lora_func as lf
from lora_func import attribution as at
from lora_func.demo.corpus import TaskExample, pretraining_corpus, task_split
from lora_func.demo.model import load_model
from lora_func.demo.run import correct_answers, cpu_threads, encode_examples
from lora_func.train import IGNORE_INDEX

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the demo's default


def example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed next-token cross-entropy over its labelled tokens: ``(..., B)``."""
    per_token = F.cross_entropy(logits[..., :-1, :].flatten(0, -2), labels[..., 1:].flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return per_token.view(labels[..., 1:].shape).sum(-1)


def make_loss(model):
    """The per-example loss of the features: the answer's negative log-likelihood."""

    def loss_fn(adapter, ids, mask, labels):
        return example_losses(lf.adapted_call(model, adapter, ids, attention_mask=mask).logits, labels).sum()

    return loss_fn


def train_lora(model, data, *, steps: int, seed: int, r: int = 8, lr: float = 3e-3, rows: torch.Tensor | None = None):
    """A LoRA trained on ``data`` (or its ``rows``) with AdamW, batches of 16; returns (adapter, optimizer)."""
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=r), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(adapter.params.values(), lr=lr)
    pool = torch.arange(data.input_ids.shape[0]) if rows is None else rows
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = pool[torch.randint(0, len(pool), (16,), generator=g)]
        optimizer.zero_grad()
        logits = lf.adapted_call(model, adapter, data.input_ids[index], attention_mask=data.attention_mask[index]).logits
        (example_losses(logits, data.labels[index]).mean()).backward()
        optimizer.step()
    return adapter, optimizer


def train_subset_models(model, data, subsets: torch.Tensor, *, steps: int, seed: int, r: int = 8, lr: float = 3e-3):
    """``K`` LoRAs, member ``k`` trained on the rows where ``subsets[k]`` is True, as one stack:
    every step runs the same batch through all members (``ensemble_call``) and weights each
    member's per-example losses by its subset."""
    members = [lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=r), generator=torch.Generator().manual_seed(seed + k)) for k in range(len(subsets))]
    stacked = lf.stack(members)
    optimizer = torch.optim.AdamW(stacked.params.values(), lr=lr)
    weights = subsets.float()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, data.input_ids.shape[0], (32,), generator=g)
        optimizer.zero_grad()
        logits = lf.ensemble_call(model, stacked, data.input_ids[index], attention_mask=data.attention_mask[index]).logits  # (K, 32, T, V)
        losses = example_losses(logits, data.labels[index].expand(len(subsets), -1, -1))  # (K, 32)
        w = weights[:, index]
        (losses * w).sum(1).div(w.sum(1).clamp(min=1)).sum().backward()
        optimizer.step()
    return stacked


def held_out_metrics(model, adapter, data) -> tuple[float, float]:
    """(exact-match accuracy, mean negative log-likelihood of the answers) on ``data``."""
    with torch.no_grad():
        logits = lf.adapted_call(model, adapter, data.input_ids, attention_mask=data.attention_mask).logits
    return float(correct_answers(logits, data).float().mean()), float(example_losses(logits, data.labels).mean())


def attribution_scores(model, adapter, train, held_out, *, proj_dim: int, seed: int, ensemble=None) -> dict[str, torch.Tensor]:
    """TracIn, LESS, TRAK and EK-FAC influence of every training question on every held-out
    answer; with ``ensemble`` (a stack of adapters) also TRAK averaged over its members."""
    loss_fn = make_loss(model)
    batch = (train.input_ids, train.attention_mask, train.labels)
    test = (held_out.input_ids, held_out.attention_mask, held_out.labels)
    raw_train, raw_test = at.features(loss_fn, adapter, *batch), at.features(loss_fn, adapter, *test)
    projected = {name: at.features(loss_fn, adapter, *rows, proj_dim=proj_dim, generator=torch.Generator().manual_seed(seed)) for name, rows in (("train", batch), ("test", test))}
    damping = 0.1 * float(projected["train"].square().sum(1).mean())
    curvature = at.ekfac(loss_fn, adapter, [batch], token_mask=lambda ids, mask, labels: mask)
    out = {
        "tracin": at.scores(raw_train, raw_test),
        "less": at.scores(raw_train, raw_test, method="less"),
        "trak": at.scores(projected["train"], projected["test"], method="trak", damping=damping),
        "ekfac": at.influence(curvature, raw_train, raw_test, damping=None),
    }
    if ensemble is not None:
        def stack_loss(stacked, ids, mask, labels):  # the sum of the members' losses: each member's gradient is its own
            logits = lf.ensemble_call(model, stacked, ids, attention_mask=mask).logits
            return example_losses(logits, labels.expand(logits.shape[0], -1, -1)).sum()

        members = {name: at.features(stack_loss, ensemble, *rows, proj_dim=proj_dim, generator=torch.Generator().manual_seed(seed)) for name, rows in (("train", batch), ("test", test))}
        damping = 0.1 * float(members["train"].square().sum(-1).mean())
        out[f"trak x{members['train'].shape[0]}"] = at.scores(members["train"], members["test"], method="trak", damping=damping)
    return out


def show_top(scores: dict[str, torch.Tensor], train, held_out, count: int) -> None:
    for j in range(count):
        question = held_out.examples[j]
        print(f"\n{question.prompt} {question.answer}: the training questions that support it most")
        for method, s in scores.items():
            top = s[j].topk(3).indices.tolist()
            print(f"  {method:>8}: " + " | ".join(f"{train.examples[i].prompt} {train.examples[i].answer}" for i in top))


def answer_log_probs(model, stacked, data) -> torch.Tensor:
    """``(K, n)``: each member's log-probability of each answer (minus its loss)."""
    with torch.no_grad():
        logits = lf.ensemble_call(model, stacked, data.input_ids, attention_mask=data.attention_mask).logits
    return -example_losses(logits, data.labels.expand(logits.shape[0], -1, -1))


def lds_of_methods(model, scores, train, held_out, *, subsets_per_stack: int, stacks: int, steps: int, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    n = train.input_ids.shape[0]
    subsets, margins = [], []
    for s in range(stacks):
        masks = torch.stack([torch.randperm(n, generator=g) < n // 2 for _ in range(subsets_per_stack)])  # random halves
        stacked = train_subset_models(model, train, masks, steps=steps, seed=seed + 1000 * (s + 1))
        subsets.append(masks)
        margins.append(answer_log_probs(model, stacked, held_out))
    subsets_all, margins_all = torch.cat(subsets), torch.cat(margins)
    return {method: float(at.lds(s, subsets_all, margins_all).nanmean()) for method, s in scores.items()}


# ----------------------------------------------------------------------------- LESS-style selection


def selection_pool(tokenizer, train_examples: list[TaskExample], seed: int):
    """The pool: the training questions and as many unrelated corpus sentences (a sentence's
    last word before the full stop is its "answer")."""
    sentences = [line.rsplit(" ", 2) for line in pretraining_corpus(len(train_examples), seed=seed + 7)]
    unrelated = [TaskExample(" ".join(words[:-2]) if len(words) > 2 else words[0], words[-2] if len(words) > 2 else words[-1], -1, -1) for words in sentences]
    return encode_examples(tokenizer, train_examples + unrelated)


def less_selection(model, tokenizer, train_examples, held_out, *, seed: int, budget: int, warmup_steps: int, steps: int, proj_dim: int, targets: int):
    """LESS (Xia et al. 2024) on the pool: a warm-up LoRA on 5 % of it; Adam-preconditioned
    features of the pool, plain features of ``targets`` clean questions (not held out); each
    pool example scored by its mean cosine to the targets; the top ``budget`` against as many
    picked at random, each trained from scratch and scored on the held-out questions."""
    target_examples, rest = train_examples[:targets], train_examples[targets:]
    pool = selection_pool(tokenizer, rest, seed)
    n = pool.input_ids.shape[0]
    g = torch.Generator().manual_seed(seed)
    warm_rows = torch.randperm(n, generator=g)[: max(1, n // 20)]
    warm, optimizer = train_lora(model, pool, steps=warmup_steps, seed=seed, rows=warm_rows)
    loss_fn = make_loss(model)
    target = encode_examples(tokenizer, target_examples)
    pool_features = at.features(loss_fn, warm, pool.input_ids, pool.attention_mask, pool.labels, proj_dim=proj_dim,
                                generator=torch.Generator().manual_seed(seed), preconditioner=optimizer)
    target_features = at.features(loss_fn, warm, target.input_ids, target.attention_mask, target.labels, proj_dim=proj_dim,
                                  generator=torch.Generator().manual_seed(seed))
    score = at.scores(pool_features, target_features, method="less").mean(0)
    chosen = score.topk(budget).indices
    random_pick = torch.randperm(n, generator=g)[:budget]
    out = {}
    for name, rows in (("less", chosen), ("random", random_pick)):
        adapter, _ = train_lora(model, pool, steps=steps, seed=seed, rows=rows)
        out[name], out[f"{name}_loss"] = held_out_metrics(model, adapter, held_out)
        out[f"{name}_questions"] = int((rows < len(rest)).sum())  # task questions picked (the rest: sentences)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the settings of docs/attribution.md (several minutes)")
    parser.add_argument("--select", action="store_true", help="run the LESS data-selection comparison instead")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the selection comparison")
    parser.add_argument("--steps", type=int, default=120, help="training steps of each selection's adapter")
    parser.add_argument("--targets", type=int, default=16, help="target questions LESS matches (taken from the training split, not held out)")
    args = parser.parse_args(argv)
    # The tiny model's products are too small to split over threads (docs/benchmarks.md, "Kernel choices").
    with cpu_threads(1):
        return run(args)


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model, tokenizer = load_model()
    train_examples, held_out_examples = task_split()
    train, held_out = encode_examples(tokenizer, train_examples), encode_examples(tokenizer, held_out_examples)
    if args.select:
        budget = len(train_examples) // 2
        rows = {}
        for seed in args.seeds:
            start = time.perf_counter()
            rows[seed] = less_selection(model, tokenizer, list(train_examples), held_out, seed=seed, budget=budget, warmup_steps=40,
                                        steps=args.steps, proj_dim=2048, targets=args.targets)
            row = rows[seed]
            print(f"seed {seed}: held-out accuracy LESS {row['less']:.0%}, random {row['random']:.0%}; answer loss LESS {row['less_loss']:.3f}, "
                  f"random {row['random_loss']:.3f}; task questions among the {budget} picked: LESS {row['less_questions']}, random "
                  f"{row['random_questions']} ({time.perf_counter() - start:.0f} s)")
        mean = {k: sum(r[k] for r in rows.values()) / len(rows) for k in ("less", "random", "less_loss", "random_loss")}
        print(f"mean over seeds {args.seeds}: accuracy LESS {mean['less']:.1%}, random {mean['random']:.1%}; answer loss LESS "
              f"{mean['less_loss']:.3f}, random {mean['random_loss']:.3f}")
        return rows
    steps, stacks, per_stack = (120, 4, 8) if args.full else (30, 1, 4)
    start = time.perf_counter()
    adapter, _ = train_lora(model, train, steps=steps, seed=0)
    print(f"LoRA r=8 on {TARGETS}, {steps} steps on the 70 training questions: held-out accuracy {held_out_metrics(model, adapter, held_out)[0]:.0%}")
    # TRAK's ensemble: models trained on other random halves than the LDS's subset models, one stack.
    n = train.input_ids.shape[0]
    g = torch.Generator().manual_seed(99)
    halves = torch.stack([torch.randperm(n, generator=g) < n // 2 for _ in range(per_stack)])
    ensemble = train_subset_models(model, train, halves, steps=steps, seed=99)
    scores = attribution_scores(model, adapter, train, held_out, proj_dim=512, seed=0, ensemble=ensemble)
    show_top(scores, train, held_out, 3 if args.full else 2)
    lds = lds_of_methods(model, scores, train, held_out, subsets_per_stack=per_stack, stacks=stacks, steps=steps, seed=0)
    print(f"\nLDS over {stacks * per_stack} subset models (random halves, {steps} steps each, {per_stack} per stacked adapter), "
          "mean over the 30 held-out answers:")
    for method, value in lds.items():
        print(f"  {method:>8}: {value:+.3f}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return lds


if __name__ == "__main__":
    main()
