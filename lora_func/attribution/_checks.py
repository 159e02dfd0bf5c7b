"""Argument checks of :mod:`lora_func.attribution`, at the public boundary (before any work)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["batch_size", "check_callable", "check_chunk_size", "check_generator", "check_proj_dim"]


def check_callable(loss_fn: Any, where: str) -> None:
    if not callable(loss_fn):
        raise TypeError(  # error: attribution-loss-fn
            f"{where}: loss_fn must be a function loss_fn(adapter, *example) -> 0-d loss (the per_example_grads "
            f"convention), got {type(loss_fn).__name__}; the adapter is the second argument: {where}(loss_fn, adapter, ...)"
        )


def check_proj_dim(proj_dim: Any, where: str) -> int | None:
    if proj_dim is None:
        return None
    if not isinstance(proj_dim, int) or isinstance(proj_dim, bool) or proj_dim < 1:
        raise ValueError(  # error: attribution-proj-dim
            f"{where}: proj_dim must be None (the raw gradients) or an integer >= 1 (the projected dimension, e.g. "
            f"8192 as LESS, 2048 as TRAK), got {proj_dim!r}"
        )
    return proj_dim


def check_chunk_size(chunk_size: Any, where: str) -> int | None:
    if chunk_size is None:
        return None
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(  # error: attribution-chunk-size
            f"{where}: chunk_size must be None (every example of a batch at once) or an integer >= 1 (that many "
            f"examples at a time), got {chunk_size!r}"
        )
    return chunk_size


def check_generator(generator: Any, where: str) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(  # error: attribution-generator
            f"{where}: generator must be a torch.Generator or None (the global RNG), got {type(generator).__name__}; "
            f"pass torch.Generator().manual_seed(seed) for reproducible projections"
        )


def batch_size(batch: tuple, where: str) -> int:
    """The common dim-0 size of the tensors in ``batch`` (every tensor is one example per row)."""
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, Tensor)]
    sizes = sorted({t.shape[0] for t in leaves if t.dim() >= 1})
    if len(sizes) != 1 or any(t.dim() == 0 for t in leaves):
        raise ValueError(  # error: attribution-batch
            f"{where}: every tensor of the batch must hold one example per row on dim 0, all with the same number of "
            f"rows; got dim-0 sizes {sizes}{' and 0-d tensors' if any(t.dim() == 0 for t in leaves) else ''}; pass "
            f"shared tensors through loss_fn's closure"
        )
    return sizes[0]
