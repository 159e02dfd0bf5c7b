"""The training loop: a loss, one step, a loop (the package's docstring says what a step does).

Built on the public API only: the model's tensors reach the forward pass through
:func:`lora_func.adapted_call` (detached), so only the adapter's tensors get gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

import lora_func as lf
from lora_func.adapter import leaf_adapters
from lora_func.checks import check_base, check_finite, check_model
from lora_func.plan import detached_base
from lora_func.privacy.batched import batched_loss
from lora_func.privacy.step import DPSGD, private_step_
from lora_func.train.state import (
    IGNORE_INDEX,
    Batch,
    StepStats,
    TrainState,
    check_state,
)

__all__ = ["adapter_loss", "causal_lm_loss", "fit", "make_optimizer", "train_step"]


class _DefaultNorm(float):
    """``max_grad_norm``'s default (1.0), told apart from a value passed by hand: a private
    step refuses the latter (it clips per example instead)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "1.0"


DEFAULT_MAX_GRAD_NORM = _DefaultNorm(1.0)


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy in fp32.

    Args:
      logits: ``(batch, seq, vocab)``, any float dtype (upcast to fp32 here: a bf16/fp16
        log-softmax over the vocabulary loses the small probabilities).
      labels: ``(batch, seq)`` token ids, ``IGNORE_INDEX`` where no loss is wanted; position
        ``t`` of ``logits`` predicts ``labels[:, t + 1]``.
    """
    shifted = logits[:, :-1].float()
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)


def _causal_lm_losses(logits: Tensor, labels: Tensor) -> Tensor:
    """:func:`causal_lm_loss` of each example (row) of the batch: ``(batch,)``, each row's mean
    over its own labelled tokens (what :func:`causal_lm_loss` gives on that row alone)."""
    shifted, target = logits[:, :-1].float(), labels[:, 1:]
    per_token = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    return per_token.view(target.shape).sum(1) / (target != IGNORE_INDEX).sum(1)


def adapter_loss(model: nn.Module, adapter: Any, batch: Batch, *, base: Mapping[str, Tensor] | None = None) -> Tensor:
    """:func:`causal_lm_loss` of ``model`` with ``adapter`` on ``batch`` (``input_ids``,
    optional ``attention_mask``, ``labels``; labels default to ``input_ids``).

    A pure function of the adapter's tensors, so it also works under ``torch.func``::

        grads = torch.func.grad(lambda p: adapter_loss(model, adapter.with_params(p), batch, base=base))(adapter.params)
    """
    kwargs: dict[str, Any] = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
    # A base built from model.named_parameters() holds the model's requires_grad tensors:
    # backward would fill (and train_step's clipping would read) the model's .grad.
    base = None if base is None else detached_base(base)
    logits = lf.adapted_call(model, adapter, batch["input_ids"], base=base, **kwargs).logits
    return causal_lm_loss(logits, batch.get("labels", batch["input_ids"]))


def make_optimizer(adapter: Any, lr: float, *, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW over the adapter's trainable tensors (in ``adapter.params`` order)."""
    leaf_adapters(adapter)
    return torch.optim.AdamW(list(adapter.params.values()), lr=lr, weight_decay=weight_decay)


def train_step(
    model: nn.Module,
    state: TrainState,
    batch: Batch,
    *,
    base: Mapping[str, Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM,
    privacy: DPSGD | None = None,
    micro_batch_size: int | None = None,
) -> StepStats:
    """One optimiser step on ``batch``; advances ``state.step``. See the module docstring for
    the order of operations. Raises ``FloatingPointError`` naming the step (and the adapter
    tensors) on a non-finite loss, or on non-finite gradients without a scaler.

    ``privacy`` (a :class:`lora_func.privacy.DPSGD`): a DP-SGD step instead
    (:func:`lora_func.privacy.private_step_`): every example (row of ``batch``) clipped to
    ``privacy.max_grad_norm``, one noise draw for the whole batch, in micro-batches of
    ``micro_batch_size`` rows (``None``: one) that change memory, not the result. fp32 or
    ``autocast_dtype=torch.bfloat16``; no GradScaler and no ``max_grad_norm`` with it (the
    clipping is per example). ``StepStats.grad_norm`` is then the noisy gradient's norm.
    """
    check_model(model, "train_step")
    check_state(state, "train_step")
    if base is not None:
        check_base(base, "train_step")
    if privacy is not None or micro_batch_size is not None:
        return _private_step(model, state, batch, base, autocast_dtype, max_grad_norm, privacy, micro_batch_size)
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0
    ):
        # NaN makes clip_grad_norm_ turn every gradient NaN; <= 0 zeroes them: both silently.
        raise ValueError(  # error: train-max-grad-norm
            f"train_step: max_grad_norm={max_grad_norm!r} must be a number > 0 (math.inf measures without clipping) "
            f"or None; 1.0 is the usual choice"
        )
    adapter, optimizer, scaler, step = state.adapter, state.optimizer, state.scaler, state.step
    params = adapter.params
    _check_optimizer_state(optimizer, params)
    device_type = next(iter(params.values())).device.type
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = adapter_loss(model, adapter, batch, base=base)
    if not torch.isfinite(loss):
        # Name the culprit: a non-finite adapter tensor, else the forward pass itself.
        check_finite(params, f"adapter tensors before step {step}")
        check_finite({"loss": loss}, f"loss at step {step} (the adapter tensors are finite)")
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)  # before clipping: the threshold is on the true gradients
    grads = {key: p.grad for key, p in params.items() if p.grad is not None}
    # The norm before clipping; an infinite threshold measures without clipping.
    with_grads = [p for p in params.values() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(with_grads, math.inf if max_grad_norm is None else max_grad_norm)
    if scaler is None and not torch.isfinite(norm):
        check_finite(grads, f"gradients at step {step}")  # raises before the optimiser moves anything
    if scaler is not None:
        scaler.step(optimizer)  # skipped (and the scale lowered) when the gradients hold inf/NaN
        scaler.update()
    else:
        optimizer.step()
    state.step += 1
    norm_value = norm.item()
    return StepStats(step, loss.item(), norm_value, skipped=not math.isfinite(norm_value))


def fit(
    model: nn.Module,
    state: TrainState,
    batch_at: Callable[[int], Batch],
    steps: int,
    *,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM,
    privacy: DPSGD | None = None,
    micro_batch_size: int | None = None,
    max_skipped: int = 20,
    progress: bool = True,
    desc: str = "training",
    on_step: Callable[[StepStats], None] | None = None,
) -> list[StepStats]:
    """Train from ``state.step`` up to ``steps`` (total, not additional) and return each step's
    stats.

    ``batch_at(step)`` gives the batch of a step; make it a pure function of ``step`` (e.g. a
    generator seeded with it) and a resumed run sees the same batches. Shows a tqdm progress
    bar unless ``progress=False``; ``on_step`` is called after every step (live plots).
    ``max_skipped`` consecutive scaler-skipped steps raise: the scale has collapsed and the
    gradients are not finite at any scale. ``privacy``, ``micro_batch_size``: private steps
    (:func:`train_step`); a resumed private run restores ``privacy.generator`` with
    :func:`load_checkpoint` (``privacy=``), and ``state.step`` is the accountant's step count.
    """
    check_model(model, "fit")
    check_state(state, "fit")
    if not callable(batch_at):
        raise TypeError(  # error: fit-batch-at
            f"fit: batch_at must be a function batch_at(step) -> batch (a pure function of the step, for an exact "
            f"resume), got {type(batch_at).__name__}; e.g. fit(model, state, lambda step: batches[step % len(batches)], steps)"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"fit: steps={steps!r} must be an integer >= 0 (the total number of steps, not additional ones)")  # error: fit-steps
    base = lf.base_params(model)
    history: list[StepStats] = []
    skipped_in_a_row = 0
    bar = tqdm(total=steps, initial=state.step, desc=desc, unit="step", disable=not progress, leave=False)
    try:
        while state.step < steps:
            stats = train_step(
                model, state, batch_at(state.step), base=base, autocast_dtype=autocast_dtype, max_grad_norm=max_grad_norm,
                privacy=privacy, micro_batch_size=micro_batch_size,
            )
            history.append(stats)
            skipped_in_a_row = skipped_in_a_row + 1 if stats.skipped else 0
            if skipped_in_a_row >= max_skipped:
                grads = {k: p.grad for k, p in state.adapter.params.items() if p.grad is not None}
                scale = state.scaler.get_scale() if state.scaler is not None else float("nan")
                check_finite(grads, f"gradients at step {stats.step}, the {max_skipped}th skipped step in a row (scale {scale:g})")
            bar.update(1)
            bar.set_postfix(loss=f"{stats.loss:.4f}", refresh=False)
            if on_step is not None:
                on_step(stats)
    finally:
        bar.close()
    return history


def _private_step(
    model: nn.Module,
    state: TrainState,
    batch: Batch,
    base: Mapping[str, Tensor] | None,
    autocast_dtype: torch.dtype | None,
    max_grad_norm: float | None,
    privacy: DPSGD | None,
    micro_batch_size: int | None,
) -> StepStats:
    """:func:`train_step`'s private mode (its docstring)."""
    if privacy is None:
        raise ValueError(  # error: train-micro-batch-needs-privacy
            f"train_step: micro_batch_size={micro_batch_size!r} accumulates the clipped per-example gradients of a private "
            f"step; pass privacy=lora_func.privacy.DPSGD(...) with it (a non-private step takes the whole batch)"
        )
    if not isinstance(privacy, DPSGD):
        raise TypeError(  # error: train-privacy-type
            f"train_step: privacy must be a lora_func.privacy.DPSGD, got {type(privacy).__name__}; "
            f"DPSGD(max_grad_norm=1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))"
        )
    conflicts = [name for name, on in (("a GradScaler (state.scaler)", state.scaler is not None),
                                       (f"max_grad_norm={max_grad_norm!r}", max_grad_norm is not DEFAULT_MAX_GRAD_NORM)) if on]
    if conflicts:
        raise ValueError(  # error: train-privacy-conflict
            f"train_step: privacy= clips every example to privacy.max_grad_norm and draws the noise on unscaled gradients, "
            f"so {' and '.join(conflicts)} cannot go with it; drop {'them' if len(conflicts) > 1 else 'it'} (bf16 autocast "
            f"needs no scaler; set the clip bound in DPSGD)"
        )
    rows = _batch_rows(batch)
    if micro_batch_size is None:
        micro_batch_size = max(rows, 1)
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(  # error: train-micro-batch-size
            f"train_step: micro_batch_size={micro_batch_size!r} must be an integer >= 1 (rows of the batch per forward "
            f"and backward) or None (the whole batch at once)"
        )
    _check_optimizer_state(state.optimizer, state.adapter.params)
    base = None if base is None else detached_base(base)

    def example_losses(adapter: Any, part: Batch) -> Tensor:
        # adapter_loss of each row, from one batched call (no vmap where the adapter allows).
        kwargs: dict[str, Any] = {"attention_mask": part["attention_mask"]} if "attention_mask" in part else {}
        logits = lf.adapted_call(model, adapter, part["input_ids"], base=base, **kwargs).logits
        return _causal_lm_losses(logits, part.get("labels", part["input_ids"]))

    loss_fn = batched_loss(example_losses)

    parts = [({k: v[i : i + micro_batch_size] for k, v in batch.items()},) for i in range(0, max(rows, 1), micro_batch_size)]
    stats = private_step_(state.optimizer, state.adapter, loss_fn, parts, privacy, autocast_dtype=autocast_dtype,
                          randomness="different")
    step = state.step
    state.step += 1
    return StepStats(step, stats.loss, stats.grad_norm, skipped=False)


def _batch_rows(batch: Batch) -> int:
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, Tensor) and v.dim() >= 1} if isinstance(batch, Mapping) else set()
    if len(sizes) != 1 or "input_ids" not in batch:
        raise ValueError(  # error: train-private-batch
            f"train_step: a private step needs a batch dict with input_ids whose tensors all have the examples on dim 0 "
            f"(one size), got {sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__} with dim-0 sizes "
            f"{sorted(sizes)}"
        )
    return sizes.pop()


def _check_optimizer_state(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor]) -> None:
    """Raise before the step, when nothing has moved yet, if a moment does not fit its
    tensor: the optimiser would update the tensors one by one and fail part-way (a
    half-applied step). Shapes and devices only: no values are read."""
    names = {id(p): key for key, p in params.items()}
    problems = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for field_name, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, Tensor) or value.dim() == 0 or field_name == "step":
                    continue
                if value.shape != p.shape or value.device != p.device:
                    problems.append(
                        f"{names.get(id(p), '<a tensor not in the adapter>')}/{field_name}: {tuple(value.shape)} on {value.device}, "
                        f"the tensor is {tuple(p.shape)} on {p.device}"
                    )
    if problems:
        raise ValueError(  # error: train-step-optimizer-state
            f"train_step: the optimizer state does not fit the adapter: {problems[:5]}; nothing was updated. Build the "
            f"optimizer with make_optimizer(adapter, ...) or load it with load_checkpoint"
        )
