"""Batched losses: DP-SGD's per-example norms from one ordinary batched call, without ``vmap``.

``private_grads(loss_fn, ...)`` runs ``loss_fn`` on one example at a time under ``vmap``, which
works for any loss but batches the model's forward through ``vmap``'s rules. A loss that already
returns one value per example from one batched call, ``loss_fn(adapter, *batch) -> (B,)``, says
so with :func:`batched_loss`; ``private_grads``, ``clipped_sum`` and ``private_step_`` then
run it as an ordinary batched forward and one backward (:func:`lora_func.privacy.ghost.batched_pass`):
ghost norms and book-keeping for the LoRA-form layers, and for every other adapted layer its
per-example gradients from its own form, fed the layer's recorded input and output gradient
(``vmap`` over that one layer only). Where that cannot be exact they run the ``vmap`` path with
each example as a batch of one (the loss then returns shape ``(1,)``): docs/guide/privacy.md
lists when.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor

from lora_func.privacy.ghost import check_batched_losses

__all__ = ["BatchedLoss", "batched_loss"]


@dataclasses.dataclass(frozen=True)
class BatchedLoss:
    """A loss of a whole batch, one value per example: ``fn(adapter, *batch) -> (B,)``.

    Made by :func:`batched_loss`. Calling it calls ``fn`` and checks the shape;
    :meth:`one_example` is the same loss for the ``vmap`` path (one example as a batch of one,
    a 0-d result).
    """

    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        if not callable(self.fn) or isinstance(self.fn, BatchedLoss):
            what = "already a BatchedLoss" if isinstance(self.fn, BatchedLoss) else f"a {type(self.fn).__name__}"
            raise TypeError(  # error: privacy-batched-loss-fn
                f"batched_loss: loss_fn must be a function loss_fn(adapter, *batch) -> (B,) per-example losses, got {what}"
            )

    def __call__(self, adapter: Any, *batch: Any) -> Tensor:
        sizes = {t.shape[0] for t in pytree.tree_leaves(batch) if isinstance(t, Tensor) and t.dim() >= 1}
        out = self.fn(adapter, *batch)
        return check_batched_losses(out, sizes.pop()) if len(sizes) == 1 else out

    def one_example(self, adapter: Any, *example: Any) -> Tensor:
        """The loss of one example, given as a batch of one: 0-d (``fn``'s ``(1,)`` result, checked)."""
        return check_batched_losses(self.fn(adapter, *example), 1)[0]


def batched_loss(loss_fn: Callable[..., Any]) -> BatchedLoss:
    """Mark ``loss_fn(adapter, *batch) -> Tensor (B,)`` as a batched per-example loss.

    ``loss_fn`` takes the adapter and the whole batch (every tensor with the batch ``B`` on dim
    0) and returns each example's loss, shape ``(B,)``, from one batched call: example ``b``'s
    loss must depend on row ``b`` of the batch only (a transformers model with an attention
    mask qualifies; batch statistics, in-batch negatives or a loss averaged over the batch do
    not). Every adapted layer must keep the batch on dim 0 of its input. Pass the result
    wherever ``lora_func.privacy`` takes a ``loss_fn`` (``private_grads``, ``clipped_sum``,
    ``private_step_``): the result is the same, without running the model under ``vmap``. A
    loss of another shape raises ``ValueError`` naming it.
    """
    return BatchedLoss(loss_fn)
