"""Runtime checks that turn silent garbage into an error naming the culprit.

A NaN or inf in an adapter tensor (a diverged training step, a bad checkpoint, an fp16
overflow) propagates through every later matmul and shows up, much later, as a NaN loss
with no name attached. :func:`check_finite` finds the offending tensors by name so the
caller can raise at the first place the value appears.

The check reads tensor values, so it is a host synchronisation and cannot run inside
``torch.func.vmap`` (a data-dependent branch); call it in eager code, e.g. once per
training step on the loss and the gradients, or through ``merge_overlay(..., safe=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["MAX_LISTED", "check_finite", "non_finite_keys"]

MAX_LISTED = 8  # offending keys named in one error message


def non_finite_keys(tensors: Mapping[str, Tensor]) -> list[str]:
    """The sorted keys of ``tensors`` whose value holds a NaN or ±inf (any shape, any float
    or complex dtype; integer and bool tensors are always finite)."""
    bad = []
    for key, tensor in tensors.items():
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        # One reduction per tensor, read back once: a bool, not a per-element Python loop.
        finite = torch.isfinite(tensor.detach()).all()
        try:
            ok = bool(finite)
        except RuntimeError as err:
            if "vmap" not in str(err):
                raise
            raise RuntimeError(
                f"check_finite: {key!r} is batched by torch.func.vmap, and reading its values is a "
                f"data-dependent branch vmap cannot run; check the outputs after vmap returns instead"
            ) from None
        if not ok:
            bad.append(key)
    return sorted(bad)


def check_finite(tensors: Mapping[str, Tensor], what: str) -> None:
    """Raise ``FloatingPointError`` if any tensor in ``tensors`` holds a NaN or ±inf.

    Args:
      tensors: named tensors to check (e.g. ``adapter.params``, a dict of gradients, or
        ``{"loss": loss}``); the names appear in the error.
      what: what the tensors are, for the message (``"gradients at step 12"``).

    The message names the offending keys, sorted, each with its count of NaN and inf entries
    (the first ``MAX_LISTED``, then how many more), so a diverged step over hundreds of
    tensors still gives a readable error.
    """
    bad = non_finite_keys(tensors)
    if not bad:
        return
    details = []
    for key in bad[:MAX_LISTED]:
        t = tensors[key].detach()
        n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        details.append(f"{key} ({n_nan} NaN, {n_inf} inf of {t.numel()})")
    more = f" and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
    raise FloatingPointError(
        f"{what}: non-finite values in {bad[:MAX_LISTED]}{more}: {'; '.join(details)}. Lower the learning rate, clip "
        f"gradients, use bf16/fp32 instead of fp16 (or a GradScaler), or check the inputs that produced them"
    )
