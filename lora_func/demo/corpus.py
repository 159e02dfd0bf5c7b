"""The demo's text: a pretraining corpus and a fine-tuning task, both generated here (nothing
is downloaded).

The corpus describes a tiny world in short sentences (people, animals, things, places),
counts, and states every single-digit sum as ``3 + 4 = 7 .``. A model pretrained on it knows
all 100 sums, but only in that notation.

The fine-tuning task asks the same sums in words: ``what is 3 plus 4 ?`` -> ``7``. The base
model has never seen the question form and answers with a word from its stories (0 %
correct). An adapter trained on 70 of the 100 pairs learns the *format*; the 30 held-out
pairs then come out right only if the adapter reuses the sums the model learnt in
pretraining, which is the point of fine-tuning a pretrained model instead of training from
scratch.

A second task of another shape checks that a learning rate chosen on the first is not a
coincidence of it (scripts/lr_sweep.py runs both): *worked sums*, ``what is 2 plus 3 plus 4 ?``
-> ``2 + 3 = 5 , 5 + 4 = 9``. The prompt is longer, the answer is 13 tokens instead of one, and
it is right only if the adapter copies the operands into the pretraining notation and chains
two sums the base knows (``a + b`` is kept at most 9, so both sums are single-digit ones).
"""

from __future__ import annotations

import dataclasses
import random

__all__ = [
    "TaskExample",
    "WorkedSum",
    "pretraining_corpus",
    "task_examples",
    "task_split",
    "vocabulary",
    "worked_sum_examples",
    "worked_sum_split",
]

NAMES = ["alice", "bob", "carol", "dave", "eve", "frank", "grace", "heidi", "ivan", "judy", "kim", "leo", "mia", "nina", "omar", "rosa"]
ANIMALS = ["cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen", "bat", "duck", "frog", "goat"]
COLOURS = ["red", "blue", "green", "black", "white", "brown", "yellow", "grey"]
THINGS = ["ball", "book", "apple", "cup", "hat", "kite", "box", "lamp", "key", "coin"]
PLACES = ["park", "river", "forest", "market", "school", "garden", "hill", "beach"]
VERBS = ["sees", "likes", "finds", "wants", "draws", "feeds"]
NUMBERS = [str(n) for n in range(20)]  # 0..18 are the sums; 19 ends the counts

# One sentence pattern per line; {name2} differs from {name}.
TEMPLATES = [
    "{name} has a {colour} {thing} .",
    "the {animal} runs to the {place} .",
    "{name} and {name2} go to the {place} .",
    "{name} {verb} the {colour} {animal} .",
    "in the {place} , {name} {verb} a {thing} .",
    "what does {name} see ? {name} sees a {animal} .",
    "the {thing} is {colour} and the {animal} is {colour2} .",
    "{name} has a {thing} plus a {thing2} .",
    "{name} gives the {thing} to {name2} .",
    "where is the {animal} ? it is in the {place} .",
]


@dataclasses.dataclass(frozen=True)
class TaskExample:
    """One question of the fine-tuning task: ``prompt`` is answered by ``answer``."""

    prompt: str
    answer: str
    a: int
    b: int


def _sentence(rng: random.Random) -> str:
    name, name2 = rng.sample(NAMES, 2)
    thing, thing2 = rng.sample(THINGS, 2)
    colour, colour2 = rng.sample(COLOURS, 2)
    return rng.choice(TEMPLATES).format(
        name=name, name2=name2, animal=rng.choice(ANIMALS), colour=colour, colour2=colour2,
        thing=thing, thing2=thing2, place=rng.choice(PLACES), verb=rng.choice(VERBS),
    )


def _sum_line(rng: random.Random) -> str:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a} + {b} = {a + b} ."


def _count_line(rng: random.Random) -> str:
    start = rng.randrange(0, 15)
    return " ".join(NUMBERS[start : start + rng.randrange(3, 6)]) + " ."


def pretraining_corpus(n_lines: int, seed: int = 0) -> list[str]:
    """``n_lines`` lines: about 60 % world sentences, 30 % sums, 10 % counts (deterministic in
    ``seed``)."""
    rng = random.Random(seed)
    makers = [_sentence] * 6 + [_sum_line] * 3 + [_count_line]
    return [rng.choice(makers)(rng) for _ in range(n_lines)]


def task_examples() -> list[TaskExample]:
    """All 100 questions ``what is a plus b ?`` for single digits ``a, b``, in a fixed order."""
    return [TaskExample(f"what is {a} plus {b} ?", str(a + b), a, b) for a in range(10) for b in range(10)]


def task_split(seed: int = 0, n_held_out: int = 30) -> tuple[list[TaskExample], list[TaskExample]]:
    """``(train, held_out)``: a fixed random partition of the 100 questions. No pair of the
    held-out set is seen during fine-tuning."""
    examples = task_examples()
    random.Random(seed).shuffle(examples)
    return examples[n_held_out:], examples[:n_held_out]


@dataclasses.dataclass(frozen=True)
class WorkedSum:
    """One question of the second task: ``prompt`` is answered by ``answer``, the two sums of
    ``terms`` written out in the pretraining notation."""

    prompt: str
    answer: str
    terms: tuple[int, int, int]


def worked_sum_examples() -> list[WorkedSum]:
    """All 550 questions ``what is a plus b plus c ?`` with single digits and ``a + b <= 9``,
    answered ``a + b = s , s + c = t``, in a fixed order."""
    return [
        WorkedSum(f"what is {a} plus {b} plus {c} ?", f"{a} + {b} = {a + b} , {a + b} + {c} = {a + b + c}", (a, b, c))
        for a in range(10) for b in range(10 - a) for c in range(10)
    ]


def worked_sum_split(seed: int = 0, n_held_out: int = 100) -> tuple[list[WorkedSum], list[WorkedSum]]:
    """``(train, held_out)``: a fixed random partition of the 550 worked-sum questions (450
    and 100 by default); no held-out triple is trained on."""
    examples = worked_sum_examples()
    random.Random(seed).shuffle(examples)
    return examples[n_held_out:], examples[:n_held_out]


def vocabulary() -> list[str]:
    """Every word the corpus and the task use, sorted (the word-level tokenizer's vocabulary)."""
    words = set(NAMES + ANIMALS + COLOURS + THINGS + PLACES + VERBS + NUMBERS)
    for template in TEMPLATES:
        words.update(w for w in template.split() if not w.startswith("{"))
    words.update(["+", "=", ".", "?", "what", "is", "plus"])
    return sorted(words)
