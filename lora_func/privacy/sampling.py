"""Poisson sampling of batches: what the DP-SGD accounting assumes.

The privacy accountant (:mod:`lora_func.privacy.accounting`) analyses the *sampled* Gaussian
mechanism: at every step each example of the dataset is in the batch independently with
probability ``q`` (the ``sample_rate``), so batch sizes vary (binomial, mean ``q * N``, possibly
zero). Shuffling and cutting into fixed-size batches is a different mechanism, whose guarantee
the RDP accountant does not give; use this sampler.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from lora_func.privacy._checks import (
    check_generator,
    check_num_examples,
    check_rate,
    check_steps,
)

__all__ = ["PoissonBatchSampler", "poisson_batch_indices"]


class PoissonBatchSampler(Sampler[list[int]]):
    """``steps`` batches of indices into a dataset of ``num_examples``, each example in each
    batch independently with probability ``sample_rate`` (sorted indices; a batch may be empty).

    Deterministic given ``generator`` (a ``torch.Generator``; ``None`` draws from the global
    RNG): iterating twice continues the generator, it does not replay. Index tensors with each
    batch (``ids[torch.tensor(batch, dtype=torch.long)]`` gives ``(0, T)`` for an empty batch,
    which :func:`lora_func.privacy.private_grads` accepts: the step is then noise only, as the
    accounting assumes), or use it as a ``DataLoader``'s ``batch_sampler`` with a ``collate_fn``
    that turns an empty list into empty tensors: ``default_collate([])`` raises, and skipping
    the empty step would not be the mechanism the accountant analyses. ``expected_batch_size`` is ``sample_rate * num_examples``: divide the
    noisy gradient sum by it (``private_grads(..., expected_batch_size=)``), not by the sampled
    size, whose value depends on the data.
    """

    def __init__(self, num_examples: int, sample_rate: float, steps: int, *, generator: torch.Generator | None = None) -> None:
        check_num_examples(num_examples, "PoissonBatchSampler")
        check_generator(generator, "PoissonBatchSampler")
        self.num_examples = num_examples
        self.sample_rate = check_rate(sample_rate)
        self.steps = check_steps(steps)
        self.generator = generator

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.num_examples

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        device = self.generator.device if self.generator is not None else "cpu"
        for _ in range(self.steps):
            drawn = torch.rand(self.num_examples, generator=self.generator, device=device) < self.sample_rate
            yield drawn.nonzero().flatten().tolist()

    def __repr__(self) -> str:
        return f"PoissonBatchSampler(num_examples={self.num_examples}, sample_rate={self.sample_rate}, steps={self.steps})"


def poisson_batch_indices(num_examples: int, sample_rate: float, *, seed: int, step: int) -> torch.Tensor:
    """Step ``step``'s Poisson batch as a sorted ``int64`` index tensor (possibly empty): each of
    ``num_examples`` examples in with probability ``sample_rate``, drawn from a generator seeded
    by ``(seed, step)`` alone. A pure function of the step, so a ``batch_at(step)`` built on it
    (``lora_func.train.fit``) sees the same batches after a resume; the draws of different
    steps are independent, as the accounting assumes."""
    check_num_examples(num_examples, "poisson_batch_indices")
    rate = check_rate(sample_rate)
    generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + check_steps(step))
    return (torch.rand(num_examples, generator=generator) < rate).nonzero().flatten()
