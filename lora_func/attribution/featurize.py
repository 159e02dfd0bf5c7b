"""Attribution features: each example's gradient over the adapter's trainable tensors, as a row.

:func:`features` is :func:`lora_func.per_example_grads` (exact per-example gradients, one
batched backward) flattened in ``adapter.params`` order, optionally preconditioned (LESS's Adam
direction, :mod:`lora_func.attribution.precondition`) and randomly projected to ``proj_dim``
columns (:mod:`lora_func.attribution._projection`: block by block, never the whole matrix).
:func:`write_features` streams the rows of a whole dataset (any iterable of batches, e.g. a
``DataLoader``) into a ``.npy`` file read back as a memory map, for datasets larger than
memory; :func:`lora_func.attribution.scores` reads such arrays block by block.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lora_func.adapter import AdapterLike, leaf_adapters
from lora_func.attribution._checks import batch_size, check_callable, check_chunk_size, check_generator, check_proj_dim
from lora_func.attribution._projection import Projection
from lora_func.attribution.precondition import Preconditioner, resolve
from lora_func.checks import check_path
from lora_func.many import Randomness, per_example_grads

__all__ = ["feature_dim", "features", "write_features"]


def feature_dim(adapter: AdapterLike) -> int:
    """``D``: the trainable values of one adapter (one stack member), the width of raw features."""
    stack = math.prod(adapter.stack_shape)
    return sum(t.numel() for t in adapter.params.values()) // stack


class _Featurizer:
    """One validated configuration of :func:`features`: what each batch goes through."""

    def __init__(self, loss_fn: Callable[..., Any], adapter: AdapterLike, proj_dim: Any, generator: Any, chunk_size: Any,
                 preconditioner: Any, randomness: Randomness, where: str) -> None:
        check_callable(loss_fn, where)
        leaf_adapters(adapter, f"{where}(loss_fn, adapter, ...)")
        proj_dim = check_proj_dim(proj_dim, where)
        check_generator(generator, where)
        self.chunk_size = check_chunk_size(chunk_size, where)
        self.precondition: Preconditioner | None = resolve(preconditioner, adapter, where)
        self.loss_fn, self.adapter, self.randomness, self.where = loss_fn, adapter, randomness, where
        self.stack = tuple(adapter.stack_shape)
        if len(self.stack) > 1:
            raise ValueError(  # error: attribution-stack-shape
                f"{where}: the adapter is stacked along {len(self.stack)} axes {self.stack}; features take one adapter "
                f"or one stack (K,) (an ensemble: one block of features per member)"
            )
        self.dim = feature_dim(adapter)
        self.proj_dim, self.generator = proj_dim, generator
        self.projection: Projection | None = None

    def start(self) -> _Featurizer:
        """Draw the projection (after every check: a refused call leaves the generator as it was)."""
        if self.proj_dim is not None:
            device = self.generator.device if self.generator is not None else torch.device("cpu")
            # One draw from the caller's generator; the blocks come from (seed, block index).
            seed = int(torch.randint(0, 2**62, (), generator=self.generator, device=device))
            self.projection = Projection(seed, self.dim, self.proj_dim)
        return self

    @property
    def out_dim(self) -> int:
        return self.dim if self.proj_dim is None else self.proj_dim

    def rows(self, batch: tuple) -> Tensor:
        """The features of ``batch``: ``(B, out_dim)``, or ``(K, B, out_dim)`` for a stack."""
        size = batch_size(batch, self.where)
        step = size if self.chunk_size is None else self.chunk_size
        leaves, spec = pytree.tree_flatten(batch)
        split = [isinstance(leaf, Tensor) and leaf.dim() >= 1 for leaf in leaves]
        parts = []
        for start in range(0, size, step):
            chunk = pytree.tree_unflatten([leaf[start : start + step] if s else leaf for leaf, s in zip(leaves, split, strict=True)], spec)
            parts.append(self._chunk(chunk))
        return torch.cat(parts, dim=-2)

    def _chunk(self, chunk: Any) -> Tensor:
        grads = per_example_grads(self.loss_fn, self.adapter, *chunk, randomness=self.randomness)
        if self.precondition is not None:
            grads = self.precondition(grads)
        n, members = next(iter(grads.values())).shape[0], math.prod(self.stack)
        dtype = torch.promote_types(torch.float32, next(iter(grads.values())).dtype)
        for g in grads.values():
            dtype = torch.promote_types(dtype, g.dtype)
        # (B, *stack, *shape) -> (B * K, numel): one row per example and member.
        pieces = [grads[key].to(dtype).reshape(n * members, -1) for key in self.adapter.params]
        flat = torch.cat(pieces, dim=1) if self.projection is None else self.projection.apply(pieces)
        flat = flat.view(n, *self.stack, flat.shape[-1])
        return flat.movedim(0, -2).contiguous() if self.stack else flat


def features(
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    *batch: Any,
    proj_dim: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    preconditioner: Any = None,
    randomness: Randomness = "error",
) -> Tensor:
    """Each example's gradient of ``loss_fn(adapter, *example)`` as a row: ``(B, D)``.

    Row ``b`` is example ``b``'s gradient over every trainable tensor of ``adapter``, flattened
    row-major and concatenated in ``adapter.params`` order (``D`` = the number of trainable
    values, :func:`feature_dim`), exactly :func:`lora_func.per_example_grads` (one batched
    backward; any variant, composition or combination, quantized bases: whatever
    ``per_example_grads`` runs).

    Args:
      loss_fn: ``loss_fn(adapter, *example) -> 0-d loss``, seeing one example as a batch of one
        (``input_ids (1, T)``), as for ``per_example_grads``. For a stack (below) the sum of the
        members' losses.
      adapter: one adapter, or a stack ``(K,)`` (an ensemble, TRAK's checkpoints, LDS subset
        models): then ``(K, B, D)``, one block per member, projected by the same matrix.
      batch: the examples, every tensor with the batch ``B`` on dim 0.
      proj_dim: ``None``: the raw gradients. An int ``k``: projected by a random ``(D, k)``
        matrix of ``±1/√k`` entries (norms and inner products kept in expectation, within the
        Johnson-Lindenstrauss bounds), generated block by block and never held whole.
      generator: where the projection comes from (one draw; ``None``: the global RNG). The same
        seed gives the same matrix, bit for bit, whatever the batch, ``chunk_size`` or device.
      chunk_size: run that many examples at a time (their activations, gradients and
        projection), bounding memory; ``None``: the whole batch at once.
      preconditioner: applied to the per-example gradients before flattening: a function
        ``{key: (B, *shape)} -> same``, or the Adam/AdamW optimiser that trained the adapter, or a
        dict ``{key: {"exp_avg": m, "exp_avg_sq": v}}`` (LESS's Adam direction,
        :func:`lora_func.attribution.adam_preconditioner`).
      randomness: as for ``per_example_grads`` (dropout in train mode).

    Returns a detached tensor in the gradients' dtype (at least float32), on their device.
    Every argument is checked before any work.
    """
    featurizer = _Featurizer(loss_fn, adapter, proj_dim, generator, chunk_size, preconditioner, randomness, "features")
    batch_size(batch, "features")
    featurizer.start()
    with torch.no_grad():
        return featurizer.rows(batch)


def _npy_header(shape: tuple[int, ...], descr: str) -> bytes:
    """A ``.npy`` version 1.0 header of exactly :data:`_HEADER_BYTES` bytes (padded with spaces):
    written first with a zero row count and rewritten in place with the final one."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    body = text.ljust(_HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


_HEADER_BYTES = 192


def _batch_args(batch: Any) -> tuple:
    # A DataLoader yields a tuple/list of tensors (argument tuples) or one object (a dict, a tensor).
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def write_features(
    path: str | os.PathLike,
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    batches: Iterable[Any],
    *,
    proj_dim: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    preconditioner: Any = None,
    randomness: Randomness = "error",
) -> np.memmap:
    """:func:`features` of every batch of ``batches``, streamed into the ``.npy`` file ``path``;
    returns it as a read-only memory map ``(N, D)`` (``(K, N, D)`` for a stack ``(K,)``: the
    file holds ``(N, K, D)``, the map is its transposed view), N the examples of all batches.

    ``batches``: any iterable (a ``DataLoader``); a tuple or list is a batch's arguments
    (``loss_fn(adapter, *batch)``), anything else one argument (a dict of tensors). One
    projection for the whole dataset (one draw from ``generator``). Memory: one batch's features
    (or ``chunk_size`` examples' work) at a time. Float32 on disk (float64 features stay
    float64). Written beside ``path`` as the batches come and renamed into place at the end
    (``np.load(path, mmap_mode="r")`` reads it): a failure midway leaves no file behind.
    """
    check_path(path, "write_features")
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"write_features: path {str(target)!r} is a directory; pass a file name such as features.npy")  # error: attribution-path-dir
    featurizer = _Featurizer(loss_fn, adapter, proj_dim, generator, chunk_size, preconditioner, randomness, "write_features").start()
    members = featurizer.stack
    width = featurizer.out_dim
    descr: str | None = None
    count = 0
    # Written beside the target and renamed at the end: a failure midway leaves no file behind
    # and an existing file as it was.
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as handle:
            handle.write(_npy_header((0, *members, width), "<f4"))
            for batch in batches:
                args = _batch_args(batch)
                with torch.no_grad():
                    rows = featurizer.rows(args)
                rows = rows.movedim(-2, 0) if members else rows  # (B, *stack, width): example-major on disk
                if descr is None:  # the first batch's precision for the whole file
                    descr = "<f8" if rows.dtype == torch.float64 else "<f4"
                array = rows.detach().to("cpu", torch.float64 if descr == "<f8" else torch.float32).contiguous().numpy()
                handle.write(array.tobytes())
                count += array.shape[0]
            if count == 0:
                raise ValueError("write_features: batches gave no examples; pass a non-empty DataLoader or list of batches")  # error: attribution-no-examples
            handle.seek(0)
            handle.write(_npy_header((count, *members, width), descr or "<f4"))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    mapped = np.load(target, mmap_mode="r")
    return mapped.transpose(1, 0, 2) if members else mapped
