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

- :func:`arrow`: an Arrow router (``AdapterSpec("arrow", ...)``, per-token routing over a library of
  task LoRAs by their top singular directions) built from LoRA adapters, with GenKnowSub
  (``general=``) as peft's ``create_arrow_model``; :func:`arrow_experts` gives the experts back as
  LoRA adapters (for ``save_peft``, merging, inspection).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lora_func.adapter import SHARED, Adapter
from lora_func.many import Batching, mixed_adapted, mixed_call
from lora_func.spec import AdapterSpec
from lora_func.variants import arrow as arrow_variant
from lora_func.variants import poly
from lora_func.variants._kernels import lora_scale

__all__ = ["arrow", "arrow_experts", "task_adapted", "task_call", "task_members"]

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


# ----------------------------------------------------------------------------------- Arrow


def _lora_library(adapters: Any, what: str, first: Adapter | None) -> list[Adapter]:
    """``adapters`` checked as a list of plain LoRA adapters of one structure (``first``'s, when given):
    same targets, rank per layer and dtype."""
    if isinstance(adapters, Adapter) or not isinstance(adapters, Sequence) or not adapters:
        raise TypeError(  # error: arrow-library
            f"arrow(): {what} must be a non-empty list of LoRA adapters (load_peft of each task checkpoint), got {type(adapters).__name__}"
        )
    library = list(adapters)
    ref = first or library[0]
    for i, a in enumerate(library):
        if not isinstance(a, Adapter) or a.spec.variant != "lora" or a.stack_shape:
            got = f"a {a.spec.variant} adapter" + (f" stacked {a.stack_shape}" if a.stack_shape else "") if isinstance(a, Adapter) else type(a).__name__
            raise TypeError(f"arrow(): {what}[{i}] must be a plain LoRA adapter (AdapterSpec('lora', ...)), got {got}")  # error: arrow-not-lora
        mine = [(lay.target.module, lay.info.r, lay.info.d_in, lay.info.d_out) for lay in a.layers]
        want = [(lay.target.module, lay.info.r, lay.info.d_in, lay.info.d_out) for lay in ref.layers]
        if mine != want or a.spec.dtype != ref.spec.dtype:
            diff = sorted({m[0] for m in mine} ^ {w[0] for w in want}) or [m for m, w in zip(mine, want, strict=False) if m != w][:3]
            raise ValueError(  # error: arrow-structure
                f"arrow(): {what}[{i}] has other layers, ranks or dtype than the first task expert ({diff or a.spec.dtype}); "
                f"Arrow routes between LoRAs of one rank on the same targets (as peft's create_arrow_model checks)"
            )
    return library


def _leaves(params: dict[str, Tensor], sources: Sequence[Adapter]) -> dict[str, Tensor]:
    # As stack(): plain leaf sources give new leaves (torch.optim refuses non-leaves); a graph is kept otherwise.
    if all(t.is_leaf and not torch._C._functorch.is_functorch_wrapped_tensor(t) for a in sources for t in a.params.values()):
        return {k: v.detach().requires_grad_(True) for k, v in params.items()}
    return params


def arrow(
    experts: Sequence[Adapter],
    *,
    top_k: int = 3,
    router_temperature: float = 1.0,
    rng_seed: int = 0,
    general: Sequence[Adapter] | None = None,
) -> Adapter:
    """An Arrow router over the task LoRAs ``experts`` (peft's ``create_arrow_model`` with
    ``ArrowConfig(top_k, router_temperature, rng_seed, use_gks=general is not None)``): one
    ``arrow`` adapter whose layers hold the experts stacked ``(E, ...)``, each expert's
    ``alpha/r``, and its prototype (the top right singular vector of ``B_e A_e``, peft's seeded
    power iteration), computed here once.

    ``general``: general-knowledge LoRAs of the same structure for GenKnowSub: their mean ``A`` and
    mean ``B`` are subtracted from every task expert's ``A`` and ``B`` before the prototypes. The
    experts' tensors are not modified (peft subtracts in place)."""
    library = _lora_library(experts, "experts", None)
    first = library[0]
    knowledge = None if general is None else _lora_library(general, "general", first)
    spec = AdapterSpec(
        "arrow", first.spec.targets, r=first.spec.r, alpha=first.spec.alpha, dtype=first.spec.dtype, layer_types=first.spec.layer_types,
        tied=first.spec.tied, num_experts=len(library), top_k=top_k, router_temperature=router_temperature, rng_seed=rng_seed,
    )
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    layers = []
    for j, layer in enumerate(first.layers):
        module, info = layer.target.module, layer.info
        lora_a = torch.stack([a.params[f"{module}.lora_A"] for a in library])
        lora_b = torch.stack([a.params[f"{module}.lora_B"] for a in library])
        if knowledge is not None:  # GenKnowSub: factor by factor, as peft's gen_know_sub
            lora_a = lora_a - torch.stack([g.params[f"{module}.lora_A"] for g in knowledge]).mean(0)
            lora_b = lora_b - torch.stack([g.params[f"{module}.lora_B"] for g in knowledge]).mean(0)
        scales = torch.tensor([float(lora_scale(a.layers[j].info)) for a in library], dtype=first.spec.dtype, device=lora_a.device)
        params[f"{module}.lora_A"], params[f"{module}.lora_B"] = lora_a, lora_b
        buffers[f"{module}.arrow_scales"] = scales
        buffers[f"{module}.arrow_prototypes"] = arrow_variant.prototypes(lora_a, lora_b, rng_seed)
        shapes = {"lora_A": tuple(lora_a.shape), "lora_B": tuple(lora_b.shape), "arrow_scales": tuple(scales.shape), "arrow_prototypes": (len(library), info.d_in)}
        layers.append(dataclasses.replace(
            layer, info=dataclasses.replace(info, alpha=spec.alpha, options=spec.options),
            param_shapes=(("lora_A", shapes["lora_A"]), ("lora_B", shapes["lora_B"])),
            buffer_shapes=(("arrow_scales", shapes["arrow_scales"]), ("arrow_prototypes", shapes["arrow_prototypes"])),
        ))
    return Adapter(_leaves(params, [*library, *(knowledge or [])]), buffers, spec, layers)


def arrow_experts(adapter: Adapter) -> list[Adapter]:
    """The task experts of an ``arrow`` adapter as ``E`` LoRA adapters (after GenKnowSub, if it was
    applied), each at its own scale: for ``save_peft`` (peft's ``create_arrow_model`` with
    ``use_gks=False`` then routes between them as this adapter does), merging, inspection."""
    if not isinstance(adapter, Adapter) or adapter.spec.variant != "arrow" or adapter.stack_shape:
        got = f"{adapter.spec.variant} stack_shape {adapter.stack_shape}" if isinstance(adapter, Adapter) else type(adapter).__name__
        raise TypeError(f"arrow_experts: adapter must be one arrow adapter (lora_func.routed.arrow), got {got}")  # error: arrow-not-arrow
    spec = AdapterSpec("lora", adapter.spec.targets, r=adapter.spec.r, alpha=adapter.spec.alpha, dtype=adapter.spec.dtype,
                       layer_types=adapter.spec.layer_types, tied=adapter.spec.tied)
    out = []
    for e in range(int(adapter.spec.option("num_experts"))):
        params, layers = {}, []
        for layer in adapter.layers:
            module, info = layer.target.module, layer.info
            scale = float(adapter.buffers[f"{module}.arrow_scales"][e])
            params[f"{module}.lora_A"] = adapter.params[f"{module}.lora_A"][e]
            params[f"{module}.lora_B"] = adapter.params[f"{module}.lora_B"][e]
            layers.append(dataclasses.replace(
                layer, info=dataclasses.replace(info, alpha=scale * int(info.r), options=spec.options),
                param_shapes=(("lora_A", (int(info.r), info.d_in)), ("lora_B", (info.d_out, int(info.r)))), buffer_shapes=(),
            ))
        out.append(Adapter(params, {}, spec, layers))
    return out
