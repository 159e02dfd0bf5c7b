"""DP-SGD gradients of an adapter: per-example clipping, one noise draw per logical batch.

DP-SGD (Abadi et al. 2016) replaces the batch gradient by

    (sum_b clip_C(g_b) + N(0, (sigma * C)^2 I)) / B,    clip_C(g) = g * min(1, C / ||g||)

where ``g_b`` is example ``b``'s gradient over *all* trainable tensors (one norm per example,
the ``max_grad_norm`` ``C`` bounds each example's influence) and the noise has std
``noise_multiplier * C``. Two small pieces and one combination:

- :func:`clipped_sum`: the per-example gradients (:func:`lora_func.per_example_grads`, one
  batched forward and backward, no hooks), each clipped, summed: a :class:`ClippedSum`.
  ``ClippedSum`` adds (``a + b``), which is gradient accumulation with the privacy semantics
  kept: clip per example in every micro-batch, then noise once per logical batch;
- :func:`noised_mean`: adds the noise to a ``ClippedSum`` and divides by the batch size;
- :func:`private_grads`: the two in one call, a dict like ``adapter.params``.

For the stateful idiom, :func:`set_grads_` writes a gradient dict into the ``.grad`` of the
adapter's leaf tensors before ``optimizer.step()``. The clip factor is Opacus's,
``min(1, C / (||g|| + 1e-6))``. A stack of adapters (an ensemble trained privately, one
mechanism per member) clips each member's per-example gradient separately and draws each
member's noise independently.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lora_func._tree import leaves
from lora_func.adapter import AdapterLike, leaf_adapters
from lora_func.checks import check_finite
from lora_func.many import Randomness, check_chunk_size, per_example_grads
from lora_func.privacy._checks import (
    check_clipping,
    check_expected_batch_size,
    check_generator,
    check_noise,
    check_norm,
)
from lora_func.privacy.batched import BatchedLoss
from lora_func.privacy.ghost import Clipping, batched_pass, ghost_layers, ghost_pass

__all__ = ["ClippedSum", "clipped_sum", "noised_mean", "private_grads", "set_grads_"]

_EPS = 1e-6  # in the clip factor's denominator, as Opacus


def _batch_size(batch: tuple) -> int | None:
    """The common dim-0 size of the tensors in ``batch`` (``None`` when they disagree)."""
    sizes = {t.shape[0] for t in pytree.tree_leaves(batch) if isinstance(t, Tensor) and t.dim() >= 1}
    return sizes.pop() if len(sizes) == 1 else None


@dataclasses.dataclass(frozen=True)
class ClippedSum:
    """The sum of clipped per-example gradients of ``count`` examples, not yet noised.

    ``grads``: a dict like ``adapter.params`` (same keys, shapes, dtypes). ``count``: the
    number of examples summed. ``clipped``: how many of them had a norm above
    ``max_grad_norm``; ``skipped``: how many had a NaN or inf loss or gradient and contributed
    zero (:func:`clipped_sum`); ``loss_sum``: the sum of the other examples' losses
    (statistics of the private data: log them only if you account for them, or treat the run as
    non-private tuning). ``a + b`` sums two (same keys and ``max_grad_norm``).
    """

    grads: dict[str, Tensor]
    count: int
    max_grad_norm: float
    clipped: int = 0
    loss_sum: float = 0.0
    skipped: int = 0

    def __add__(self, other: ClippedSum) -> ClippedSum:
        if not isinstance(other, ClippedSum):
            what = f"a {type(other).__name__}"
        elif other.grads.keys() != self.grads.keys():
            what = f"the sums of two adapters (keys {sorted(self.grads.keys() ^ other.grads.keys())[:3]} differ)"
        elif other.max_grad_norm != self.max_grad_norm:
            what = f"max_grad_norm {self.max_grad_norm} and {other.max_grad_norm}"
        else:
            what = ""
        if what:
            raise ValueError(  # error: privacy-sum-mismatch
                f"ClippedSum: can only add the clipped sums of one adapter under one max_grad_norm (one logical batch), "
                f"got {what}"
            )
        grads = {k: v + other.grads[k] for k, v in self.grads.items()}
        return ClippedSum(grads, self.count + other.count, self.max_grad_norm, self.clipped + other.clipped,
                          self.loss_sum + other.loss_sum, self.skipped + other.skipped)


def _clip_factors(norms: Tensor, losses: Tensor, max_grad_norm: float) -> tuple[Tensor, int, int, float]:
    """Opacus's clip factor ``min(1, C / (norm + 1e-6))`` per example (``norms (B,)`` or ``(B, K)``
    for a stack's members), 0 for an example whose loss or gradient norm is NaN or inf;
    with how many were clipped, how many skipped, and the finite losses' sum."""
    finite_loss = torch.isfinite(losses.detach()).reshape(losses.shape[0], *([1] * (norms.dim() - 1)))
    kept = torch.isfinite(norms) & finite_loss
    factor = torch.where(kept, (max_grad_norm / (norms + _EPS)).clamp(max=1.0), torch.zeros((), dtype=norms.dtype, device=norms.device))
    skipped = int((~kept).sum())
    if skipped:
        warnings.warn(
            f"clipped_sum: {skipped} of {kept.numel()} per-example gradients had a NaN or inf loss or gradient and were "
            f"skipped (clip factor 0: they add nothing, which keeps each example's influence within max_grad_norm); "
            f"ClippedSum.skipped and PrivateStepStats.skipped count them. Check the loss for those inputs",
            RuntimeWarning,
            stacklevel=3,
        )
    losses = losses.detach().float()
    loss_sum = float(torch.where(torch.isfinite(losses), losses, torch.zeros((), device=losses.device)).sum())
    return factor, int(((norms > max_grad_norm) & kept).sum()), skipped, loss_sum


def clipped_sum(
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    *batch: Any,
    max_grad_norm: float,
    randomness: Randomness = "error",
    chunk_size: int | None = None,
    clipping: Clipping = "auto",
) -> ClippedSum:
    """The per-example gradients of ``loss_fn(adapter, *example)``, each clipped to total L2
    norm ``<= max_grad_norm`` over all of ``adapter.params``, summed.

    ``loss_fn``, ``batch``, ``randomness`` and ``chunk_size`` are
    :func:`lora_func.per_example_grads`'s: ``loss_fn`` sees one example as a batch of one
    (``input_ids (1, T)``) and returns its 0-d loss; every tensor of ``batch`` has the batch
    ``B`` on dim 0. A batch of zero examples (``(0, T)`` tensors, an empty Poisson draw) gives
    zero gradients and ``count=0``. For a stacked adapter (``stack_shape (K,)``) ``loss_fn``
    returns the sum of the members' losses and each member's gradient is clipped on its own.

    ``loss_fn`` may instead be a :func:`lora_func.privacy.batched_loss` (one loss per example,
    ``(B,)``, from one batched call): the same result without running the model under ``vmap``
    where one batched call can give it exactly (:mod:`lora_func.privacy.batched`).

    An example whose loss or gradient holds a NaN or inf is skipped: its clip factor is 0, so
    it adds nothing (the sum of the others is unchanged) and a ``RuntimeWarning`` says how many
    (``ClippedSum.skipped``; which ones is not said: that would be a statement about a private
    example outside the mechanism). Zero is within every example's bound ``max_grad_norm``, so
    the guarantee holds as for any other example; one NaN no longer makes every coordinate of
    the sum NaN. docs/guide/privacy.md says why this and not an error.

    ``clipping``: how the per-example norms are found; every choice gives the same result.
    ``"per_example"``: per-example gradients of every tensor (:func:`lora_func.per_example_grads`);
    ``"ghost"``: ghost norms and book-keeping (:mod:`lora_func.privacy.ghost`) for the LoRA-form
    layers, per-example gradients for the other tensors, in one forward and backward;
    ``"auto"`` (default): as ``"ghost"``, each layer's norm from its ``(B, T, T)`` Gram products
    or its materialised per-example gradient, whichever is smaller (with ``chunk_size``:
    ``"per_example"``). docs/guide/privacy.md says which tensors get ghost norms.
    """
    norm = check_norm(max_grad_norm)
    clipping = check_clipping(clipping)
    check_chunk_size(chunk_size, "clipped_sum")
    leaf_adapters(adapter)
    _check_finite_adapter(adapter)
    size = _batch_size(batch)
    params = adapter.params
    if size == 0:
        zeros = {k: torch.zeros_like(v, memory_format=torch.contiguous_format).detach() for k, v in params.items()}
        return ClippedSum(zeros, 0, norm, 0)
    recorded = None
    if isinstance(loss_fn, BatchedLoss):
        if size is not None and _batched_ready(adapter, clipping, chunk_size, randomness):
            recorded = batched_pass(loss_fn.fn, adapter, batch, size, ghost_layers(adapter), clipping=clipping)
        loss_fn = loss_fn.one_example  # the vmap paths: one example as a batch of one
    layers = ghost_layers(adapter) if clipping != "per_example" and (chunk_size is None or clipping == "ghost") else {}
    if recorded is None and layers and size:
        recorded = ghost_pass(loss_fn, adapter, batch, size, layers, clipping=clipping, randomness=randomness)
    if recorded is not None:
        norms = recorded.squares.sqrt()
        factor, clipped, skipped, loss_sum = _clip_factors(norms, recorded.losses, norm)
        return ClippedSum(recorded.clipped_sums(factor), norms.shape[0], norm, clipped, loss_sum, skipped)

    def with_loss(adapter: AdapterLike, *example: Any) -> tuple[Tensor, Tensor]:
        loss = loss_fn(adapter, *example)
        return loss, loss.detach() if isinstance(loss, Tensor) else loss

    grads, losses = per_example_grads(with_loss, adapter, *batch, has_aux=True, randomness=randomness, chunk_size=chunk_size)
    lead = 1 + len(adapter.stack_shape)  # (B, *stack_shape): one norm per example (and member)
    squares = [g.flatten(lead).float().pow(2).sum(-1) for g in grads.values()]
    norms = torch.stack(squares).sum(0).sqrt()
    factor, clipped, skipped, loss_sum = _clip_factors(norms, losses, norm)
    if skipped:  # a skipped example's gradient may hold NaN, and 0 · NaN is NaN
        grads = {key: torch.where(factor.reshape(*factor.shape, *([1] * (g.dim() - lead))) == 0, torch.zeros((), dtype=g.dtype, device=g.device), g)
                 for key, g in grads.items()}
    # Fused clip and sum: one contraction over the batch, no clipped copy of the gradients.
    sums = {
        key: torch.einsum("b,b...->...", factor.to(g.dtype), g) if lead == 1
        else (g * factor.reshape(*factor.shape, *([1] * (g.dim() - lead))).to(g.dtype)).sum(0)  # a stack: per member
        for key, g in grads.items()
    }
    return ClippedSum(sums, norms.shape[0], norm, clipped, loss_sum, skipped)


def _check_finite_adapter(adapter: AdapterLike) -> None:
    """A NaN/inf in the adapter itself (not in one example's loss) raises, naming the tensors: it
    would make every example's gradient non-finite, and skipping them all would train on noise
    alone. One host synchronisation for the whole adapter; skipped under a torch.func transform."""
    tensors = {k: t for k, t in {**adapter.params, **adapter.buffers}.items() if t.is_floating_point()}
    if not tensors or any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors.values()):
        return
    if not bool(torch.stack([torch.isfinite(t.detach()).all().to(next(iter(tensors.values())).device) for t in tensors.values()]).all()):
        check_finite(tensors, "private gradients: the adapter's own tensors (before any example)")


def _batched_ready(adapter: AdapterLike, clipping: Clipping, chunk_size: int | None, randomness: Randomness) -> bool:
    """Whether a batched loss may try the pass without ``vmap``: every adapter tensor is some
    layer's (not a combination's own weights, not a stack), no layer has dropout (its form run
    again would draw another mask), and the call asks for no ``vmap`` feature (``chunk_size``,
    ``randomness="same"``, ``clipping="per_example"``)."""
    if clipping == "per_example" or chunk_size is not None or randomness == "same" or adapter.stack_shape:
        return False
    parts = list(leaves(adapter))
    own = {prefix + key for prefix, leaf in parts for key in leaf.params}
    dropout = any(dict(layer.info.options).get("dropout", 0.0) for _, leaf in parts for layer in leaf.layers)
    return own == set(adapter.params) and not dropout


def noised_mean(
    total: ClippedSum,
    *,
    noise_multiplier: float,
    generator: torch.Generator | None = None,
    expected_batch_size: float | None = None,
) -> dict[str, Tensor]:
    """``(total + N(0, (noise_multiplier * max_grad_norm)^2)) / B``: the DP-SGD gradient.

    ``B`` is ``expected_batch_size`` when given (with Poisson sampling: ``sample_rate *
    dataset size``, :attr:`PoissonBatchSampler.expected_batch_size`; the sampled size depends
    on the data) and ``total.count`` otherwise. The noise is drawn from ``generator`` (a
    ``torch.Generator``; ``None``: the global RNG) one tensor per key in ``total.grads``'s
    order, in fp32 (fp64 for fp64 gradients) on the generator's device, then moved to each
    gradient's device and dtype: the same generator state gives the same noise on any device.
    ``torch.Generator`` is not a cryptographically secure RNG (docs/guide/privacy.md).
    """
    if not isinstance(total, ClippedSum):
        raise TypeError(f"noised_mean: total must be a ClippedSum (from clipped_sum), got {type(total).__name__}")  # error: privacy-not-clipped
    sigma = check_noise(noise_multiplier)
    check_generator(generator, "noised_mean")
    denominator = check_expected_batch_size(expected_batch_size)
    if denominator is None and total.count == 0:
        raise ValueError(  # error: privacy-empty-batch
            "noised_mean: the batch has no examples and no expected_batch_size was given to divide by; with Poisson "
            "sampling pass expected_batch_size=sample_rate * dataset size (an empty draw is then a noise-only step)"
        )
    if denominator is None:
        denominator = float(total.count)
    device = generator.device if generator is not None else None
    out = {}
    for key, summed in total.grads.items():
        draw_dtype = torch.float64 if summed.dtype == torch.float64 else torch.float32
        if sigma == 0:
            out[key] = summed / denominator
            continue
        noise = torch.randn(summed.shape, generator=generator, dtype=draw_dtype, device=device if device is not None else summed.device)
        noise = noise.to(summed.device) * (sigma * total.max_grad_norm)
        out[key] = ((summed.to(draw_dtype) + noise) / denominator).to(summed.dtype)
    return out


def private_grads(
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    *batch: Any,
    max_grad_norm: float,
    noise_multiplier: float,
    generator: torch.Generator | None = None,
    expected_batch_size: float | None = None,
    randomness: Randomness = "error",
    chunk_size: int | None = None,
    clipping: Clipping = "auto",
) -> dict[str, Tensor]:
    """The DP-SGD gradient of ``loss_fn`` at ``adapter`` on ``batch``: a dict like ``adapter.params``.

    Per-example gradients (:func:`lora_func.per_example_grads`), each clipped to total L2
    norm ``<= max_grad_norm`` over all of the adapter's trainable tensors, summed, plus
    Gaussian noise ``N(0, (noise_multiplier * max_grad_norm)^2)`` from ``generator``, divided
    by the batch size (``expected_batch_size`` when given). ``clipped_sum`` then
    ``noised_mean``; see them for the arguments (``clipping``: how the per-example norms are
    found, ghost clipping for LoRA-form layers by default; every choice gives the same
    result). Any adapter: every variant, compositions, combinations, stacks (one private
    mechanism per member), on any base ``adapted_call`` runs (quantized included). Checks
    every argument before any work.
    """
    norm = check_norm(max_grad_norm)
    check_noise(noise_multiplier)
    check_generator(generator, "private_grads")
    check_expected_batch_size(expected_batch_size)
    check_clipping(clipping)
    total = clipped_sum(loss_fn, adapter, *batch, max_grad_norm=norm, randomness=randomness, chunk_size=chunk_size, clipping=clipping)
    return noised_mean(total, noise_multiplier=noise_multiplier, generator=generator, expected_batch_size=expected_batch_size)


def set_grads_(adapter: AdapterLike, grads: Mapping[str, Tensor]) -> None:
    """Write ``grads`` into ``.grad`` of the adapter's leaf tensors (replacing what is there),
    for the stateful idiom: ``set_grads_(adapter, private_grads(...)); optimizer.step()``."""
    params = adapter.params
    if set(grads) != set(params):
        missing, unknown = sorted(set(params) - set(grads)), sorted(set(grads) - set(params))
        raise KeyError(  # error: privacy-grads-keys
            f"set_grads_: grads must have exactly the adapter's keys; missing {missing[:5]}, unknown {unknown[:5]}; "
            f"pass the dict private_grads or noised_mean returned for this adapter"
        )
    for key, param in params.items():
        if not param.is_leaf:
            raise ValueError(  # error: privacy-grads-not-leaf
                f"set_grads_: adapter tensor {key!r} is not a leaf tensor, so an optimiser cannot own it; use the adapter "
                f"whose params the optimiser was built on (lora_func.train.make_optimizer(adapter, lr))"
            )
        param.grad = grads[key].detach().to(param.dtype).clone()
