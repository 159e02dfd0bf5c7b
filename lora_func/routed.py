"""Routed LoRA: adapters whose layers mix LoRA experts by a routing input (peft's Poly / MHR
``task_ids``), as a composition of what exists: the variant's forms read the route from a shared
buffer, and one route per batch row is the mixed route over the adapter's route members.

- :func:`task_members`: a Poly / MHR adapter (``AdapterSpec("poly", ...)``) as a stack of its
  ``n_tasks`` task members, member ``t`` routed for task ``t``. The members share the adapter's
  tensors (stride-0 views, no copies), so a gradient through them reaches the adapter's params.
- :func:`task_call`: peft's ``model(input_ids, task_ids=task_ids)``: ``mixed_call`` over the task
  members with ``index = task_ids`` (one task per batch row), the batch through the target layers
  once (the model's own batch loss from ``labels``).
- :func:`task_adapted`: the same around ``model.generate`` (``with task_adapted(model, adapter,
  task_ids): model.generate(...)``), the beams of a row on its task.

One task for a whole call is the plain route: ``adapted_call(model, poly.for_task(adapter, t), ...)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lora_func.adapter import SHARED, Adapter
from lora_func.many import Batching, mixed_adapted, mixed_call
from lora_func.variants import poly

__all__ = ["task_adapted", "task_call", "task_members"]

_TASK_KEY = f"{SHARED}.{poly.TASK}"


def _poly(adapter: Any, where: str) -> Adapter:
    if not isinstance(adapter, Adapter) or adapter.spec.variant != "poly":
        got = adapter.spec.variant if isinstance(adapter, Adapter) else type(adapter).__name__
        raise TypeError(  # error: routed-not-poly
            f"{where}: adapter must be a poly adapter (AdapterSpec('poly', ...), or load_peft of a PolyConfig checkpoint), got {got}"
        )
    if adapter.stack_shape:
        raise ValueError(  # error: routed-stacked
            f"{where}: adapter is stacked (stack_shape {adapter.stack_shape}); pass one poly adapter (take(adapter, k)), its tasks become the members"
        )
    return adapter


def task_members(adapter: Adapter) -> Adapter:
    """``adapter``'s ``n_tasks`` task members as one stack ``(n_tasks,)``: member ``t`` is
    ``poly.for_task(adapter, t)``. Its params are views of ``adapter``'s (no copies; gradients
    flow back to them), for :func:`lora_func.mixed_call` / :func:`lora_func.mixed_adapted` with
    ``index = task_ids``."""
    adapter = _poly(adapter, "task_members")
    tasks = int(adapter.spec.option("n_tasks"))
    task = adapter.buffers[_TASK_KEY]
    params = {k: v.unsqueeze(0).expand(tasks, *v.shape) for k, v in adapter.params.items()}
    buffers = {k: v.unsqueeze(0).expand(tasks, *v.shape) for k, v in adapter.buffers.items()}
    buffers[_TASK_KEY] = torch.arange(tasks, dtype=torch.int64, device=task.device)
    return Adapter._unchecked(params, buffers, adapter.spec, adapter.layers, None, adapter.shared, None)


def _check_task_ids(task_ids: Any, tasks: int, where: str) -> Tensor:
    if not isinstance(task_ids, Tensor) or task_ids.dtype not in (torch.int64, torch.int32) or task_ids.dim() != 1:
        raise ValueError(  # error: routed-task-ids
            f"{where}: task_ids must be a 1-D int64/int32 tensor, one task per batch row, got {repr(task_ids)[:200]}"
        )
    if not torch._C._functorch.is_functorch_wrapped_tensor(task_ids) and bool(((task_ids < 0) | (task_ids >= tasks)).any()):
        raise ValueError(  # error: routed-task-range
            f"{where}: task_ids {sorted(set(task_ids.tolist()))} must be in [0, n_tasks={tasks}) (the adapter's n_tasks option)"
        )
    return task_ids.to(torch.int64)


def task_call(model: nn.Module, adapter: Adapter, *args: Any, task_ids: Tensor, batching: Batching = "layers", **kwargs: Any) -> Any:
    """``model(*args, **kwargs)`` with batch row ``b`` routed for task ``task_ids[b]`` (peft's
    ``PolyModel.forward(..., task_ids=task_ids)``): :func:`lora_func.mixed_call` over
    :func:`task_members`. ``task_ids (B,)`` int64; ``batching`` as ``mixed_call``'s (default
    ``"layers"``: one batched call, a ``labels`` loss the model's own batch loss, as peft's)."""
    adapter = _poly(adapter, "task_call")
    ids = _check_task_ids(task_ids, int(adapter.spec.option("n_tasks")), "task_call")
    return mixed_call(model, task_members(adapter), ids, *args, batching=batching, **kwargs)


@contextlib.contextmanager
def task_adapted(model: nn.Module, adapter: Adapter, task_ids: Tensor) -> Iterator[nn.Module]:
    """Within the block, batch row ``b`` of every call of ``model`` (``model.generate`` included,
    with its beams) is routed for task ``task_ids[b]``: :func:`lora_func.mixed_adapted` over
    :func:`task_members` (peft's ``generate(..., task_ids=task_ids)``)."""
    adapter = _poly(adapter, "task_adapted")
    ids = _check_task_ids(task_ids, int(adapter.spec.option("n_tasks")), "task_adapted")
    with mixed_adapted(model, task_members(adapter), ids) as inner:
        yield inner
