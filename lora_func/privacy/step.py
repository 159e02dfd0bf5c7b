"""One DP-SGD optimiser step on a logical batch, for the stateful (``torch.optim``) idiom.

:class:`DPSGD` is a run's mechanism (the clip bound, the noise multiplier, the divisor and the
noise generator), validated once at construction. :func:`private_step_` takes one step with
it: for each micro-batch of the logical batch, under ``torch.autocast`` when asked, the
clipped per-example gradient sum (:func:`lora_func.privacy.clipped_sum`); then the noise,
drawn once; then ``.grad`` of the adapter's tensors and ``optimizer.step()``. Micro-batches
bound memory (each one's per-example gradients and activations) without changing the result:
the step equals one call on the whole logical batch with the same generator state.

The functional idiom needs no step function: ``grads = private_grads(...)`` (or
``noised_mean(sum of clipped_sum(...))`` over micro-batches) and any update rule (torchopt, a
hand-written SGD).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lora_func.adapter import AdapterLike
from lora_func.checks import check_finite
from lora_func.privacy._checks import (
    check_expected_batch_size,
    check_generator,
    check_noise,
    check_norm,
)
from lora_func.privacy.ghost import Clipping
from lora_func.privacy.grads import ClippedSum, clipped_sum, noised_mean, set_grads_
from lora_func.many import Randomness

__all__ = ["DPSGD", "PrivateStepStats", "private_step_"]


@dataclasses.dataclass(frozen=True)
class DPSGD:
    """The DP-SGD mechanism of a training run.

    ``max_grad_norm`` (C) bounds each example's gradient norm over all adapter tensors;
    ``noise_multiplier`` (sigma) sets the noise std ``sigma * C``; ``expected_batch_size``
    divides the noisy sum (``sample_rate * dataset size`` with Poisson sampling; ``None``: the
    logical batch's size); ``generator`` draws the noise (``None``: the global RNG). The
    accountant needs ``noise_multiplier`` and the sample rate: :func:`lora_func.privacy.epsilon`.
    """

    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: float | None = None
    generator: torch.Generator | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_grad_norm", check_norm(self.max_grad_norm))
        object.__setattr__(self, "noise_multiplier", check_noise(self.noise_multiplier))
        object.__setattr__(self, "expected_batch_size", check_expected_batch_size(self.expected_batch_size))
        check_generator(self.generator, "DPSGD")


@dataclasses.dataclass(frozen=True)
class PrivateStepStats:
    """One private step: ``count`` examples in the logical batch, ``clipped`` of them clipped,
    ``loss`` the mean loss of those not skipped (``nan`` when there are none), ``skipped`` the
    examples whose loss or gradient was NaN or inf and which contributed zero
    (:func:`lora_func.privacy.clipped_sum`): statistics of the private data.
    ``grad_norm``: the norm of the noisy gradient the optimiser got (released by the mechanism,
    so logging it costs no privacy)."""

    count: int
    clipped: int
    loss: float
    grad_norm: float = math.nan
    skipped: int = 0


def _micro_batches(micro_batches: Any) -> list[tuple]:
    batches = [m if isinstance(m, tuple) else (m,) for m in micro_batches] if isinstance(micro_batches, Iterable) else None
    if not batches or isinstance(micro_batches, (torch.Tensor, dict)):
        raise TypeError(  # error: privacy-micro-batches
            f"private_step_: micro_batches must be a non-empty list of micro-batches, each a tuple of loss_fn's "
            f"arguments after the adapter (or one tensor), got {type(micro_batches).__name__}; one logical batch "
            f"without accumulation is [(ids, mask)]"
        )
    return batches


def _check_optimizer_owns(optimizer: torch.optim.Optimizer, adapter: AdapterLike) -> None:
    owned = {id(p) for group in getattr(optimizer, "param_groups", []) for p in group["params"]}
    foreign = sorted(k for k, p in adapter.params.items() if id(p) not in owned)
    if not isinstance(optimizer, torch.optim.Optimizer) or foreign:
        raise ValueError(  # error: privacy-optimizer-params
            f"private_step_: the optimiser must own every adapter tensor (the step writes their .grad), but it does not "
            f"hold {foreign[:5] if foreign else type(optimizer).__name__}; build it on this adapter: "
            f"torch.optim.AdamW(adapter.params.values()) or lora_func.train.make_optimizer(adapter, lr)"
        )


def private_step_(
    optimizer: torch.optim.Optimizer,
    adapter: AdapterLike,
    loss_fn: Callable[..., Any],
    micro_batches: Iterable[Any],
    dp: DPSGD,
    *,
    autocast_dtype: torch.dtype | None = None,
    randomness: Randomness = "error",
    chunk_size: int | None = None,
    clipping: Clipping = "auto",
) -> PrivateStepStats:
    """One DP-SGD step of ``optimizer`` on the logical batch made of ``micro_batches``.

    ``loss_fn(adapter, *example)`` as for :func:`lora_func.privacy.private_grads`; each
    micro-batch is a tuple of its arguments after the adapter (every tensor with the batch on
    dim 0; ``(0, T)`` tensors for an empty Poisson draw) or one tensor. Every example is
    clipped to ``dp.max_grad_norm``, the noise is drawn once for the logical batch, the result
    is written to ``.grad`` (replacing it) and ``optimizer.step()`` runs; ``.grad`` is then
    cleared. ``autocast_dtype`` (``torch.bfloat16``) runs the forward passes under
    ``torch.autocast`` on the adapter's device; the gradients stay in the adapter's dtype.
    A non-finite gradient raises ``FloatingPointError`` naming the tensors before the optimiser
    moves anything. No gradient scaler: clip per example on unscaled gradients (bf16 or fp32).
    ``clipping``, ``randomness``, ``chunk_size``: :func:`lora_func.privacy.clipped_sum`'s.
    """
    if not isinstance(dp, DPSGD):
        raise TypeError(f"private_step_: dp must be a lora_func.privacy.DPSGD, got {type(dp).__name__}; DPSGD(max_grad_norm=1.0, noise_multiplier=1.0)")  # error: privacy-step-dp
    if autocast_dtype not in (None, torch.bfloat16):
        raise ValueError(  # error: privacy-autocast-dtype
            f"private_step_: autocast_dtype={autocast_dtype!r} is not supported; use torch.bfloat16 or None (fp32). "
            f"fp16 gradients need a loss scaler, and one scale for the batch cannot keep every example's gradient "
            f"representable before it is clipped"
        )
    _check_optimizer_owns(optimizer, adapter)
    batches = _micro_batches(micro_batches)
    device_type = next(iter(adapter.params.values())).device.type
    total: ClippedSum | None = None
    with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        for batch in batches:
            part = clipped_sum(loss_fn, adapter, *batch, max_grad_norm=dp.max_grad_norm, randomness=randomness,
                               chunk_size=chunk_size, clipping=clipping)
            total = part if total is None else total + part
    assert total is not None
    grads = noised_mean(total, noise_multiplier=dp.noise_multiplier, generator=dp.generator, expected_batch_size=dp.expected_batch_size)
    check_finite(grads, "private gradients")
    set_grads_(adapter, grads)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    norm = float(torch.stack([g.detach().float().pow(2).sum() for g in grads.values()]).sum().sqrt())
    summed = total.count - total.skipped
    return PrivateStepStats(total.count, total.clipped, total.loss_sum / summed if summed else math.nan, norm, total.skipped)
