"""What training carries from step to step: :class:`TrainState` and each step's :class:`StepStats`.

Its own module so that the loop (:mod:`lora_func.train.loop`) and the checkpoint format
(:mod:`lora_func.train.checkpoint`) both build on it without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "Batch", "StepStats", "TrainState", "check_state"]

IGNORE_INDEX = -100  # label of positions that carry no loss (transformers' convention)
Batch = Mapping[str, Tensor]


@dataclasses.dataclass
class TrainState:
    """What training carries from step to step.

    Attributes:
      adapter: its ``params`` are the leaf tensors the optimiser updates in place.
      optimizer: built over ``adapter.params`` (:func:`make_optimizer`).
      scaler: a ``torch.amp.GradScaler`` for fp16, else ``None``.
      step: the number of completed steps (the next step's index).
    """

    adapter: Any
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None = None
    step: int = 0


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One step's outcome: ``loss`` (fp32, before the step), the global gradient norm before
    clipping, and whether a GradScaler skipped the update (inf/NaN gradients)."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool


def check_state(state: Any, where: str) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(  # error: train-not-a-state
            f"{where}: state must be a lora_func.train.TrainState, got {type(state).__name__}; build one with "
            f"TrainState(adapter, make_optimizer(adapter, lr)) or load_checkpoint(directory, model)"
        )
    if not isinstance(state.optimizer, torch.optim.Optimizer):
        # Checked here, not at construction: a TrainState may be built first and given its
        # optimiser after (TrainState(adapter, None); state.optimizer = make_optimizer(...)).
        raise TypeError(  # error: train-state-optimizer
            f"{where}: state.optimizer must be a torch.optim.Optimizer over state.adapter.params, got "
            f"{type(state.optimizer).__name__}; build one with make_optimizer(state.adapter, lr) (a learning-rate "
            f"scheduler wraps the optimiser: pass the optimiser, step the scheduler yourself)"
        )
