"""Merging two task adapters of the demo model on their deltas.

The shipped demo model knows every single-digit sum in the notation `3 + 4 = 7 .` and has never
seen a question; its corpus also counts (`5 6 7 8 .`). Two LoRA adapters are trained here, each
on one task (about 70 % of its questions; the rest are held out and never trained on):

- task "words":   `what is 3 plus 4 ?` -> `7`   (the demo's task)
- task "count":   `5 6 7 ?`              -> `8`  (the next number, as the corpus counts)

Then `lora_func.merge_adapters` merges them on their deltas (ΔW = s·B·A per layer) with each
method (and TIES with its two weights learned by torch.func.grad on the training questions), and
the table shows each task's held-out accuracy for the base, each adapter alone and each merge.
docs/guide/merging.md quotes the table.

Run: python examples/merge_adapters.py
"""

import random
import warnings

import torch

import lora_func as lf
from lora_func.demo.corpus import TaskExample, task_split
from lora_func.demo.model import default_targets, load_model
from lora_func.demo.run import batch_sampler, encode_examples, held_out_accuracy
from lora_func.train import TrainState, adapter_loss, fit, make_optimizer

torch.manual_seed(0)
torch.set_num_threads(1)  # a tiny model: one thread is fastest, and fair to a busy machine
model, tokenizer = load_model()
base = lf.base_params(model)
train_words, held_words = task_split()


def count_split():
    """Counting runs of 2 to 4 numbers from 0..16: 45 questions, 15 held out."""
    examples = [TaskExample(" ".join(str(n) for n in range(s, s + k)) + " ?", str(s + k), s, k)
                for s in range(16) for k in (2, 3, 4) if s + k <= 18]
    random.Random(0).shuffle(examples)
    return examples[15:], examples[:15]


train_count, held_count = count_split()
tasks = {
    "words": (encode_examples(tokenizer, train_words), encode_examples(tokenizer, held_words)),
    "count": (encode_examples(tokenizer, train_count), encode_examples(tokenizer, held_count)),
}


def trained(task: str, steps: int = 120):
    train, _ = tasks[task]
    spec = lf.AdapterSpec("lora", targets=default_targets(model), r=8)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    state = TrainState(adapter, make_optimizer(adapter, 3e-3))
    fit(model, state, batch_sampler(train, 16, seed=0), steps, progress=False)
    return state.adapter.detach()


adapters = {task: trained(task) for task in tasks}
pair = [adapters["words"], adapters["count"]]
g = torch.Generator().manual_seed(0)
candidates = {
    "base model": None,
    "adapter 'words' alone": adapters["words"],
    "adapter 'count' alone": adapters["count"],
    "linear (1, 1): the sum": lf.merge_adapters(pair, [1.0, 1.0], method="linear"),
    "linear (0.5, 0.5): the mean": lf.merge_adapters(pair, [0.5, 0.5], method="linear"),
    "cat (1, 1), rank 16": lf.merge_adapters(pair, [1.0, 1.0], method="cat"),
    "svd (1, 1), rank 8": lf.merge_adapters(pair, [1.0, 1.0], method="svd", rank=8),
    "ties (1, 1), density 0.5": lf.merge_adapters(pair, [1.0, 1.0], method="ties", density=0.5),
    "dare_ties (1, 1), density 0.5": lf.merge_adapters(pair, [1.0, 1.0], method="dare_ties", density=0.5, generator=g),
    "magnitude_prune (1, 1), density 0.5": lf.merge_adapters(pair, [1.0, 1.0], method="magnitude_prune", density=0.5),
}


# Learned merge weights: the TIES merge is differentiable in its weights (its masks are constant),
# so torch.func.grad tunes them on the training questions of both tasks (held-out ones unseen).
def training_loss(weights):
    merged = lf.merge_adapters(pair, weights, method="ties", density=0.5)
    return sum(adapter_loss(model, merged, train.batch(), base=base) for train, _ in tasks.values())


weights = torch.tensor([1.0, 1.0])
for _ in range(30):
    weights = weights - 0.05 * torch.func.grad(training_loss)(weights)
candidates[f"ties, learned weights ({weights[0]:.2f}, {weights[1]:.2f})"] = lf.merge_adapters(pair, weights, method="ties", density=0.5)

print("| adapter | 'words' held-out (30) | 'count' held-out (15) |")
print("|---|---|---|")
accuracy = {}
for name, adapter in candidates.items():
    accuracy[name] = [held_out_accuracy(model, adapter, held, base=base)[0] for _, held in tasks.values()]
    print(f"| {name} | {accuracy[name][0]:.0%} | {accuracy[name][1]:.0%} |")

# The merge keeps both skills; each adapter alone has mostly one.
merged = accuracy["linear (1, 1): the sum"]
assert min(merged) > max(accuracy["base model"]), accuracy

# Any merge exports to peft as a plain LoRA (per-layer ranks become a rank_pattern). The exact
# TIES merge is full-rank (one factor the identity): save_peft warns and names rank=; a rank-16
# TIES merge is a file of LoRA size.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exact = lf.save_peft(candidates["ties (1, 1), density 0.5"], "merged-peft-exact", model=model)
assert any("rank=k" in str(w.message) for w in caught), [str(w.message) for w in caught]
directory = lf.save_peft(lf.merge_adapters(pair, [1.0, 1.0], method="ties", density=0.5, rank=16), "merged-peft", model=model)
size = {d: (d / "adapter_model.safetensors").stat().st_size for d in (exact, directory)}
inputs = lf.save_peft(adapters["words"], "words-peft", model=model) / "adapter_model.safetensors"
print(f"saved the TIES merge in peft's format: exact {size[exact]:,} bytes, rank 16 {size[directory]:,} bytes "
      f"(each input adapter {inputs.stat().st_size:,} bytes)")
