"""Data-parallel adapter training on ``torch.distributed``: three small functions, no engine.

Every rank holds the frozen base model and a full copy of the adapter (the adapter is tiny,
so it is replicated, never sharded). Each rank computes gradients on its own shard of the
batch; the gradients are averaged over the process group with one ``all_reduce`` per
(dtype, device) bucket; every rank then takes the same optimiser step, so the adapters stay
identical. The process group is the user's: ``torch.distributed.init_process_group("gloo")``
on CPU, ``"nccl"`` on GPU, launched by ``torchrun``. See docs/scaling.md.

- :func:`broadcast_adapter` -- every rank starts from ``src``'s adapter (call once, after
  ``init_adapter``).
- :func:`all_reduce_mean` -- the ``torch.func.grad`` idiom: a dict of gradients in, a new
  dict of averaged gradients out (the input is not modified).
- :func:`all_reduce_mean_grads_` -- the ``torch.optim`` idiom: averages ``.grad`` of the
  adapter's leaf tensors in place, between ``backward()`` and ``optimizer.step()``.

Averaging is exact data parallelism only if the loss is a mean over the batch and every
rank's shard has the same size (then the mean of the shard gradients is the full-batch
gradient). All ranks must call these functions with the same keys, shapes and dtypes, in
the same order of calls, as with any collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lora_func.adapter import Adapter

__all__ = ["all_reduce_mean", "all_reduce_mean_grads_", "broadcast_adapter"]


def _require_initialized(where: str) -> None:
    if not dist.is_available():
        raise RuntimeError(f"{where}: this torch build has no torch.distributed support")  # error: dist-unavailable
    if not dist.is_initialized():
        raise RuntimeError(  # error: dist-not-initialised
            f"{where}: torch.distributed is not initialised; call "
            f"torch.distributed.init_process_group('gloo' on CPU or 'nccl' on GPU) first "
            f"(torchrun sets the environment it reads)"
        )


def _buckets(tensors: Mapping[str, Tensor]) -> dict[tuple[torch.dtype, torch.device], list[str]]:
    """Keys grouped by (dtype, device), in sorted key order (the same on every rank)."""
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for key in sorted(tensors):
        t = tensors[key]
        groups.setdefault((t.dtype, t.device), []).append(key)
    return groups


def _flat(tensors: Mapping[str, Tensor], keys: list[str]) -> Tensor:
    # torch.cat always allocates: the flat buffer never aliases an input.
    return torch.cat([tensors[k].detach().reshape(-1) for k in keys])


def _unflat(flat: Tensor, tensors: Mapping[str, Tensor], keys: list[str], out: dict[str, Tensor]) -> None:
    offset = 0
    for key in keys:
        n = tensors[key].numel()
        out[key] = flat[offset : offset + n].view(tensors[key].shape)
        offset += n


def all_reduce_mean(grads: Mapping[str, Tensor], group: Any = None) -> dict[str, Tensor]:
    """The mean of ``grads`` over the ranks of ``group`` (default: the world).

    Args:
      grads: ``{key: Tensor}``, e.g. ``torch.func.grad(loss)(adapter.params)``; any shapes,
        dtypes and devices (one ``all_reduce`` per (dtype, device) bucket, on a single
        concatenated buffer, so a whole adapter costs one collective). Every rank must pass
        the same keys with the same shapes and dtypes.
      group: a ``torch.distributed`` process group, or ``None`` for the default one.

    Returns:
      A new dict with the same keys (in the input's order), shapes, dtypes and devices,
      holding ``sum over ranks / world size``. The returned tensors are new (views into one
      fresh buffer per bucket) and carry no autograd history; ``grads`` is not modified.

    Raises:
      RuntimeError: ``torch.distributed`` is not initialised.
    """
    _require_initialized("all_reduce_mean")
    world = dist.get_world_size(group)
    reduced: dict[str, Tensor] = {}
    for keys in _buckets(grads).values():
        flat = _flat(grads, keys)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)
        _unflat(flat, grads, keys, reduced)
    return {key: reduced[key] for key in grads}


def all_reduce_mean_grads_(params: Mapping[str, Tensor] | Iterable[Tensor], group: Any = None) -> None:
    """In place: replace each parameter's ``.grad`` by its mean over the ranks of ``group``.

    For the ``torch.optim`` idiom, between ``loss.backward()`` and ``optimizer.step()``::

        loss(adapter.params).backward()
        all_reduce_mean_grads_(adapter.params)
        optimizer.step()

    Args:
      params: ``adapter.params`` (a dict) or an iterable of the optimiser's leaf tensors.
        Only their ``.grad`` tensors are written (the parameter values are not). Every
        tensor must have a ``.grad`` on every rank (a missing one raises ``ValueError``
        before any communication, so the ranks cannot silently disagree).
      group: a process group, or ``None`` for the default one.
    """
    _require_initialized("all_reduce_mean_grads_")
    named = dict(params) if isinstance(params, Mapping) else {str(i): p for i, p in enumerate(params)}
    missing = sorted(k for k, p in named.items() if p.grad is None)
    if missing:
        raise ValueError(  # error: dist-no-grad
            f"all_reduce_mean_grads_: {missing[:5]}{' ...' if len(missing) > 5 else ''} have no .grad; "
            f"call loss.backward() first (every parameter must get a gradient on every rank)"
        )
    averaged = all_reduce_mean({k: p.grad for k, p in named.items()}, group=group)  # type: ignore[misc]
    with torch.no_grad():
        for key, p in named.items():
            p.grad.copy_(averaged[key])  # type: ignore[union-attr]


def _signature(adapter: Adapter) -> list[tuple[str, str, tuple[int, ...], str]]:
    return [
        (kind, key, tuple(t.shape), str(t.dtype))
        for kind, flat in (("param", adapter.params), ("buffer", adapter.buffers))
        for key, t in sorted(flat.items())
    ]


def broadcast_adapter(adapter: Adapter, src: int = 0, group: Any = None) -> Adapter:
    """Rank ``src``'s adapter values on every rank (call once after ``init_adapter``).

    Every rank passes an adapter of the same structure (same spec, keys, shapes, dtypes);
    the values of non-``src`` ranks are ignored. A structural mismatch raises ``ValueError``
    on every rank (one ``all_gather_object`` of the key/shape/dtype list, then one
    ``broadcast`` per (dtype, device) bucket of params and buffers).

    Args:
      adapter: this rank's adapter.
      src: the global rank whose values everyone takes.
      group: a process group, or ``None`` for the default one.

    Returns:
      A new :class:`Adapter` (same spec and layers) whose params are fresh leaf tensors with
      ``requires_grad=True`` (ready for an optimiser) and whose buffers are fresh tensors,
      on the same devices as the input's. The input adapter is not modified.
    """
    _require_initialized("broadcast_adapter")
    if not isinstance(adapter, Adapter):
        raise TypeError(f"broadcast_adapter expects an Adapter, got {type(adapter).__name__}")  # error: dist-not-adapter
    signatures: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, _signature(adapter), group=group)
    reference = signatures[0]
    differing = [i for i, sig in enumerate(signatures) if sig != reference]
    if differing:
        other = signatures[differing[0]]
        first = next(
            ((a, b) for a, b in zip(reference, other, strict=False) if a != b),
            (f"{len(reference)} tensors", f"{len(other)} tensors"),
        )
        raise ValueError(  # error: dist-structure
            f"broadcast_adapter: the adapter of rank(s) {differing} differs in structure from rank 0's "
            f"(first difference: {first[0]} vs {first[1]}); build every rank's adapter from the same "
            f"AdapterSpec and model"
        )
    keyed = {f"p:{k}": v for k, v in adapter.params.items()} | {f"b:{k}": v for k, v in adapter.buffers.items()}
    out: dict[str, Tensor] = {}
    for keys in _buckets(keyed).values():
        flat = _flat(keyed, keys)
        dist.broadcast(flat, src=src, group=group)
        _unflat(flat, keyed, keys, out)
    params = {k: out[f"p:{k}"].clone().requires_grad_(True) for k in adapter.params}
    buffers = {k: out[f"b:{k}"].clone() for k in adapter.buffers}
    return Adapter(params, buffers, adapter.spec, adapter.layers, shared=adapter.shared)
