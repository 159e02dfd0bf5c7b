"""Differentially private fine-tuning of adapters (DP-SGD): gradients, accounting, sampling.

- :mod:`lora_func.privacy.grads`: :func:`private_grads` (per-example gradients clipped to
  ``max_grad_norm``, summed, Gaussian noise, divided by the batch size), and its two pieces
  :func:`clipped_sum` / :func:`noised_mean` for gradient accumulation (clip per example, noise
  once per logical batch); :func:`set_grads_` for a ``torch.optim`` optimiser.
- :mod:`lora_func.privacy.batched`: :func:`batched_loss`, a loss that returns one value per
  example from one batched call, run without ``vmap``.
- :mod:`lora_func.privacy.ghost`: ghost clipping with book-keeping, the per-example norms and
  clipped sums of LoRA-form layers from their inputs and output gradients (``clipping=``).
- :mod:`lora_func.privacy.accounting`: :func:`epsilon`, :func:`noise_for_epsilon` and
  :class:`Accountant` (the RDP accountant of the sampled Gaussian mechanism, equal to
  Opacus's; no dependency); :func:`prv_epsilon` and :func:`prv_epsilon_of_history`, the tighter
  PRV accountant (:mod:`lora_func.privacy.prv`, equal to Opacus's ``PRVAccountant``).
- :mod:`lora_func.privacy.sampling`: :class:`PoissonBatchSampler`, the batches the
  accounting assumes.
- :mod:`lora_func.privacy.step`: :class:`DPSGD` (a run's mechanism, validated once) and
  :func:`private_step_`, one ``torch.optim`` step on a logical batch given as micro-batches,
  under bf16 autocast when asked: what ``lora_func.train``'s private mode
  (``train_step(..., privacy=DPSGD(...))``) runs.

What is private, what is not, and how to choose ``max_grad_norm``, ``noise_multiplier`` and
the batch size: docs/guide/privacy.md.
"""

from lora_func.privacy.accounting import (
    DEFAULT_ORDERS,
    Accountant,
    epsilon,
    noise_for_epsilon,
    rdp,
)
from lora_func.privacy.batched import BatchedLoss, batched_loss
from lora_func.privacy.grads import (
    ClippedSum,
    clipped_sum,
    noised_mean,
    private_grads,
    set_grads_,
)
from lora_func.privacy.prv import prv_epsilon, prv_epsilon_of_history
from lora_func.privacy.sampling import PoissonBatchSampler, poisson_batch_indices
from lora_func.privacy.step import DPSGD, PrivateStepStats, private_step_

__all__ = [
    "DEFAULT_ORDERS",
    "DPSGD",
    "Accountant",
    "BatchedLoss",
    "ClippedSum",
    "PoissonBatchSampler",
    "PrivateStepStats",
    "batched_loss",
    "clipped_sum",
    "epsilon",
    "noise_for_epsilon",
    "noised_mean",
    "poisson_batch_indices",
    "private_grads",
    "private_step_",
    "prv_epsilon",
    "prv_epsilon_of_history",
    "rdp",
    "set_grads_",
]
