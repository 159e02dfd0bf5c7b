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
import json
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lora_func._model import shared_init
from lora_func.adapter import SHARED, Adapter, SharedTensors
from lora_func.call import adapted, adapted_call
from lora_func.io.peft import load_peft, save_peft
from lora_func.many import Batching, mixed_adapted, mixed_call
from lora_func.spec import AdapterSpec
from lora_func.stacking import take
from lora_func.variants import arrow as arrow_variant
from lora_func.variants import get_variant, poly
from lora_func.variants import xlora as xlora_variant
from lora_func.variants._kernels import lora_scale

__all__ = [
    "arrow", "arrow_experts", "task_adapted", "task_call", "task_members", "load_xlora", "save_xlora", "xlora", "xlora_adapted", "xlora_call",
    "xlora_classifier_keys", "xlora_experts", "xlora_scalings",
]

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


def _lora_library(adapters: Any, what: str, first: Adapter | None, where: str = "arrow()") -> list[Adapter]:
    """``adapters`` checked as a list of plain LoRA adapters of one structure (``first``'s, when given):
    same targets, rank per layer and dtype."""
    if isinstance(adapters, Adapter) or not isinstance(adapters, Sequence) or not adapters:
        raise TypeError(  # error: arrow-library
            f"{where}: {what} must be a non-empty list of LoRA adapters (load_peft of each task checkpoint), got {type(adapters).__name__}"
        )
    library = list(adapters)
    ref = first or library[0]
    for i, a in enumerate(library):
        if not isinstance(a, Adapter) or a.spec.variant != "lora" or a.stack_shape:
            got = f"a {a.spec.variant} adapter" + (f" stacked {a.stack_shape}" if a.stack_shape else "") if isinstance(a, Adapter) else type(a).__name__
            raise TypeError(f"{where}: {what}[{i}] must be a plain LoRA adapter (AdapterSpec('lora', ...)), got {got}")  # error: arrow-not-lora
        mine = [(lay.target.module, lay.info.r, lay.info.d_in, lay.info.d_out) for lay in a.layers]
        want = [(lay.target.module, lay.info.r, lay.info.d_in, lay.info.d_out) for lay in ref.layers]
        if mine != want or a.spec.dtype != ref.spec.dtype:
            diff = sorted({m[0] for m in mine} ^ {w[0] for w in want}) or [m for m, w in zip(mine, want, strict=False) if m != w][:3]
            raise ValueError(  # error: arrow-structure
                f"{where}: {what}[{i}] has other layers, ranks or dtype than the first task expert ({diff or a.spec.dtype}); "
                f"{'Arrow' if where == 'arrow()' else 'X-LoRA'} mixes LoRAs of one rank on the same targets (as peft's create_arrow_model checks for Arrow)"
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
    return _expert_loras(adapter, "arrow_scales")


# ----------------------------------------------------------------------------------- X-LoRA

_SCALINGS_KEY = f"{SHARED}.{xlora_variant.SCALINGS}"


def xlora(
    experts: Sequence[Adapter],
    *,
    hidden_size: int,
    generator: torch.Generator | None = None,
    **config: Any,
) -> Adapter:
    """An X-LoRA adapter over the LoRA adapters ``experts`` (peft's ``XLoraConfig(hidden_size,
    adapters=...)``, ``**config`` its other fields: ``xlora_depth``, ``xlora_size``,
    ``layerwise_scalings``, ``enable_softmax``, ``enable_softmax_topk``, ``softmax_temperature``,
    ``top_k_lora`` (``None``: every expert), ``scaling_pass_value``, ``global_scaling_weight``,
    ``xlora_dropout_p``, ``use_trainable_adapters``): one ``xlora`` adapter whose layers hold the
    experts stacked ``(K, ...)`` with each expert's ``alpha/r`` and LoRA ``dropout`` (the option
    ``expert_dropout``, applied in training as peft applies each expert's ``lora_dropout``), and a
    new classifier drawn from ``generator`` (``nn.Linear``'s init). ``hidden_size``: the model's
    (the classifier's input).

    Run it with :func:`xlora_call` (training, scoring) or :func:`xlora_adapted` (``generate``).
    Its params are the classifier's and the experts'; peft trains the experts only with
    ``use_trainable_adapters=True``: differentiate :func:`xlora_classifier_keys` alone otherwise."""
    library = _lora_library(experts, "experts", None, "xlora()")
    first = library[0]
    if config.get("top_k_lora") is None:
        config["top_k_lora"] = 0
    if "expert_dropout" not in config:  # each expert's own LoRA dropout, as peft applies it in training
        dropouts = tuple(float(a.spec.option("dropout")) for a in library)
        config["expert_dropout"] = dropouts if any(dropouts) else ()
    spec = AdapterSpec(
        "xlora", first.spec.targets, r=first.spec.r, alpha=first.spec.alpha, dtype=first.spec.dtype, layer_types=first.spec.layer_types,
        tied=first.spec.tied, num_experts=len(library), hidden_size=hidden_size, **config,
    )
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    layers = []
    for j, layer in enumerate(first.layers):
        module = layer.target.module
        lora_a = torch.stack([a.params[f"{module}.lora_A"] for a in library])
        lora_b = torch.stack([a.params[f"{module}.lora_B"] for a in library])
        scales = torch.tensor([float(lora_scale(a.layers[j].info)) for a in library], dtype=first.spec.dtype, device=lora_a.device)
        params[f"{module}.lora_A"], params[f"{module}.lora_B"], buffers[f"{module}.xlora_scales"] = lora_a, lora_b, scales
        layers.append(dataclasses.replace(
            layer, info=dataclasses.replace(layer.info, alpha=spec.alpha, options=spec.options),
            param_shapes=(("lora_A", tuple(lora_a.shape)), ("lora_B", tuple(lora_b.shape))), buffer_shapes=(("xlora_scales", tuple(scales.shape)),),
        ))
    infos = {layer.target.module: layer.info for layer in layers}
    device = next(iter(params.values())).device
    shared_params, shared_buffers, shared = shared_init(
        get_variant("xlora"), spec, infos, device=device, generator=torch.Generator().manual_seed(0) if generator is None else generator
    )
    params = _leaves(params, library) | shared_params
    return Adapter(params, buffers | shared_buffers, spec, layers, shared=shared)


def _xlora(adapter: Any, where: str, stacked: bool = False) -> Adapter:
    if not isinstance(adapter, Adapter) or adapter.spec.variant != "xlora" or bool(adapter.stack_shape) != stacked:
        got = f"a {adapter.spec.variant} adapter, stack_shape {adapter.stack_shape}" if isinstance(adapter, Adapter) else type(adapter).__name__
        want = "a stack of xlora adapters (lora_func.stack([...]), with index=)" if stacked else "one xlora adapter (lora_func.routed.xlora, load_xlora)"
        raise TypeError(f"{where}: adapter must be {want}, got {got}")  # error: xlora-not-xlora
    return adapter


def xlora_classifier_keys(adapter: Adapter) -> list[str]:
    """The keys of ``adapter.params`` that are the classifier's (peft's trainables with
    ``use_trainable_adapters=False``)."""
    return sorted(k for k in _xlora(adapter, "xlora_classifier_keys", bool(adapter.stack_shape) if isinstance(adapter, Adapter) else False).params
                  if k.startswith(f"{SHARED}.classifier_"))


def _classify(adapter: Adapter, hidden: Tensor, training: bool) -> Tensor:
    info = adapter.layers[0].info
    return xlora_variant.classify(adapter.shared_tensors()[0], hidden, info, training)


def _last_hidden(model: nn.Module, run: Any, kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
    """``run(kwargs)`` (a call of ``model``) and the last hidden state of every token: what peft reads
    as ``hidden_states[-1]``, taken as the input of the output head (``output_hidden_states=True``
    would make transformers install lasting hooks on the model's layers), all positions kept
    (``logits_to_keep=0`` where the call restricts them, as ``generate`` does)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        out = run({**kwargs, "output_hidden_states": True, "return_dict": True})
        return out.hidden_states[-1], out
    seen: list[Tensor] = []
    handle = head.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    try:
        out = run({**kwargs, "logits_to_keep": 0} if "logits_to_keep" in kwargs else kwargs)
    finally:
        handle.remove()
    return seen[-1], out


def xlora_scalings(model: nn.Module, adapter: Adapter, *args: Any, **kwargs: Any) -> Tensor:
    """peft's scalings pass and classifier: ``model(*args, **kwargs)`` with ``adapter`` as it is
    stored (every scaling ``scaling_pass_value``), without gradients (as peft's), then the
    classifier on its last hidden state: the scalings ``(batch, tokens, L, K)``, differentiable in
    the classifier."""
    adapter = _xlora(adapter, "xlora_scalings")
    with torch.no_grad():
        hidden, _ = _last_hidden(model, lambda k: adapted_call(model, adapter, *args, **k), kwargs)
    return _classify(adapter, hidden, model.training)


def _with_scalings(adapter: Adapter, scalings: Tensor, stacked: bool = False) -> Adapter:
    """``adapter`` with the per-call scalings ``(batch, tokens, L, K)`` (of each member, for a
    ``stacked`` adapter: ``(members, tokens, L, K)``, one member per row) in place of the stored
    ``(L, K)``: an input of this call only, declared at its own shape (the shared buffer's
    description is the call's, so the plan checks it and the layers' stack shape is unchanged)."""
    shared = adapter.shared
    assert shared is not None
    shape = tuple(scalings.shape[1:] if stacked else scalings.shape)
    described = SharedTensors(shared.param_shapes, tuple((n, shape if n == xlora_variant.SCALINGS else s) for n, s in shared.buffer_shapes))
    return Adapter._unchecked(adapter.params, {**adapter.buffers, _SCALINGS_KEY: scalings}, adapter.spec, adapter.layers,
                              adapter.members, described, adapter.member_shared)


def xlora_call(model: nn.Module, adapter: Adapter, *args: Any, index: Tensor | None = None, **kwargs: Any) -> Any:
    """peft's ``XLoraModel`` forward: ``model(*args, **kwargs)`` with the experts mixed per token
    and layer by the scalings the classifier gives on a first pass (:func:`xlora_scalings`), which
    enter the second pass as an input of the call. Differentiable in the classifier and the
    experts; ``torch.func.vmap`` over a stack of X-LoRA adapters and ``per_example_grads`` work.

    ``index (B,)``: one X-LoRA adapter per batch row, ``adapter`` then a stack of them (both
    passes on the mixed route, row ``b`` with member ``index[b]``; ``batching`` as
    :func:`lora_func.mixed_call`'s, ``"layers"`` by default). ``merged=True`` is refused
    (per-token mixtures have no merged weight)."""
    if kwargs.get("merged"):
        adapter = _xlora(adapter, "xlora_call", index is not None)
        raise ValueError(  # error: xlora-merge
            "xlora_call(merged=True): X-LoRA mixes its experts per token, so it has no merged weight (peft cannot merge "
            "X-LoRA either); call it with merged=False (the default), or merge the experts themselves (xlora_experts)"
        )
    kwargs.pop("merged", None)
    if index is None:
        adapter = _xlora(adapter, "xlora_call")
        return adapted_call(model, _with_scalings(adapter, xlora_scalings(model, adapter, *args, **kwargs)), *args, **kwargs)
    adapter = _xlora(adapter, "xlora_call", stacked=True)
    batching = kwargs.pop("batching", "layers")
    with torch.no_grad():
        hidden, _ = _last_hidden(model, lambda k: mixed_call(model, adapter, index, *args, batching=batching, **k), kwargs)
    rows = cast(Adapter, take(adapter, index.to(torch.int64)))
    scalings = torch.func.vmap(lambda member, hidden: _classify(member, hidden, model.training), randomness="different")(rows, hidden)
    rows = _with_scalings(rows, scalings, stacked=True)
    return mixed_call(model, rows, torch.arange(rows.stack_shape[0], device=index.device), *args, batching=batching, **kwargs)


@contextlib.contextmanager
def xlora_adapted(model: nn.Module, adapter: Adapter) -> Iterator[nn.Module]:
    """Within the block every call of ``model`` (``model.generate`` included) is an
    :func:`xlora_call` (peft's ``XLoraModel.generate``). With the KV cache (peft runs without
    one, recomputing both passes over the whole sequence at every step): the scalings pass keeps
    a cache of its own beside the one ``generate`` passes, so each step runs both passes over the
    new tokens only; the tokens are peft's (the model is causal: a token's scalings do not change
    as the sequence grows). Beam search reorders both caches alike."""
    adapter = _xlora(adapter, "xlora_adapted")
    missing = object()
    own = model.__dict__.get("forward", missing)
    inner = model.forward
    caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # generate's cache -> the scalings pass's

    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values")
        first = dict(kwargs)
        if cache is not None:
            mine = caches.get(cache)
            if mine is None:
                if cache.get_seq_length() > 0:
                    raise ValueError(  # error: xlora-cache
                        "xlora_adapted: the call brings a KV cache that already holds tokens the block did not see, so their "
                        "scalings pass has no cache; start generation inside the block (or pass use_cache=False)"
                    )
                first.update(past_key_values=None, use_cache=True)
            else:
                first["past_key_values"] = mine
        with torch.no_grad(), adapted(model, adapter, merged=False):
            hidden, out = _last_hidden(model, lambda k: inner(*args, **k), first)
        if cache is not None and cache not in caches:
            caches[cache] = out.past_key_values
            _reorder_with(cache, out.past_key_values)
        scalings = _classify(adapter, hidden, model.training)
        with adapted(model, _with_scalings(adapter, scalings), merged=False):
            return inner(*args, **kwargs)

    model.__dict__["forward"] = forward
    try:
        yield model
    finally:
        if own is missing:
            model.__dict__.pop("forward", None)
        else:
            model.__dict__["forward"] = own


def _reorder_with(cache: Any, mine: Any) -> None:
    # generate reorders its cache for beam search (cache.reorder_cache(beam_idx)): the scalings
    # pass's cache follows (an instance attribute on generate's own cache object).
    own = getattr(cache, "reorder_cache", None)
    if own is None or not hasattr(mine, "reorder_cache"):
        return

    def reorder_cache(beam_idx: Tensor) -> Any:
        mine.reorder_cache(beam_idx)
        return own(beam_idx)

    cache.reorder_cache = reorder_cache



def _expert_loras(adapter: Adapter, scales: str, dropouts: Sequence[float] = ()) -> list[Adapter]:
    """The ``(K, ...)`` LoRA experts of a routed adapter (arrow, xlora) as ``K`` LoRA adapters,
    expert ``e`` at its own scale ``<module>.<scales>[e]`` (its alpha ``scale · r``) and LoRA
    dropout ``dropouts[e]`` (none when empty)."""
    out = []
    for e in range(int(adapter.spec.option("num_experts"))):
        spec = AdapterSpec("lora", adapter.spec.targets, r=adapter.spec.r, alpha=adapter.spec.alpha, dtype=adapter.spec.dtype,
                           layer_types=adapter.spec.layer_types, tied=adapter.spec.tied, dropout=float(dropouts[e]) if dropouts else 0.0)
        params, layers = {}, []
        for layer in adapter.layers:
            module, info = layer.target.module, layer.info
            scale = float(adapter.buffers[f"{module}.{scales}"][e])
            params[f"{module}.lora_A"] = adapter.params[f"{module}.lora_A"][e]
            params[f"{module}.lora_B"] = adapter.params[f"{module}.lora_B"][e]
            layers.append(dataclasses.replace(
                layer, info=dataclasses.replace(info, alpha=scale * int(info.r), options=spec.options),
                param_shapes=(("lora_A", (int(info.r), info.d_in)), ("lora_B", (info.d_out, int(info.r)))), buffer_shapes=(),
            ))
        out.append(Adapter(params, {}, spec, layers))
    return out


def xlora_experts(adapter: Adapter) -> list[Adapter]:
    """The experts of an ``xlora`` adapter as ``K`` LoRA adapters, each at its own scale and with
    its own LoRA dropout (for ``save_peft``, merging, inspection)."""
    adapter = _xlora(adapter, "xlora_experts")
    return _expert_loras(adapter, "xlora_scales", adapter.spec.option("expert_dropout"))


# X-LoRA in peft's files: adapter_config.json (XLoraConfig; "adapters": expert name -> the LoRA
# checkpoint's path), adapter_model.safetensors (the classifier only, as XLoraModel's
# _get_adapter_state_dict keeps it), the experts as LoRA checkpoints of their own.
_CLASSIFIER = "base_model.internal_xlora_classifier.layers"
_XLORA_FIELDS = (
    "enable_softmax", "enable_softmax_topk", "layerwise_scalings", "xlora_depth", "xlora_size", "xlora_dropout_p",
    "use_trainable_adapters", "softmax_temperature", "top_k_lora", "scaling_pass_value", "global_scaling_weight",
)


def _classifier_index(depth: int, dropout: float) -> list[int]:
    """peft's ``nn.Sequential`` index of each classifier ``Linear`` (ReLU, and Dropout where
    ``xlora_dropout_p > 0``, between them)."""
    stride = 3 if dropout > 0 else 2
    return [i * stride for i in range(depth)]


def load_xlora(directory: str | os.PathLike, model: nn.Module, *, adapters: Mapping[str, str] | Sequence[str] | None = None) -> Adapter:
    """An ``xlora`` adapter from peft's X-LoRA checkpoint ``directory`` (``XLoraModel``'s
    ``save_pretrained``, or :func:`save_xlora`): the config's fields, the classifier from
    ``adapter_model.safetensors``, the experts by ``load_peft`` of each LoRA checkpoint that the
    config's ``adapters`` names (a relative path is read against ``directory``), or of
    ``adapters`` (paths in expert order, or peft's ``from_pretrained(..., adapters=...)``
    mapping), as peft reads them.

    peft 0.21's ``save_pretrained`` leaves out every classifier layer whose ``nn.Sequential``
    index is also an expert's name (its filter for other adapters' keys matches
    ``layers.0.``): such a file is refused, naming the missing tensors (peft reloads them as a
    fresh random init)."""
    directory = Path(directory)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"load_xlora: cannot read {config_path} ({err}); pass the directory of an X-LoRA checkpoint") from err  # error: xlora-config
    if config.get("peft_type") != "XLORA":
        raise ValueError(  # error: xlora-peft-type
            f"load_xlora: {config_path} is a {config.get('peft_type')!r} checkpoint, not peft's X-LoRA (peft_type 'XLORA'); "
            f"read other methods with lora_func.load_peft"
        )
    named = config.get("adapters") or {}
    paths = list(adapters.values()) if isinstance(adapters, Mapping) else list(adapters) if adapters is not None else list(named.values())
    if not paths:
        raise ValueError(f"load_xlora: {config_path} names no experts (its 'adapters' is empty); pass adapters=[paths of the LoRA checkpoints]")  # error: xlora-no-experts
    # (_lora_library in xlora() checks that each is a plain LoRA adapter)
    experts = cast(list[Adapter], [load_peft(p if Path(p).is_absolute() or adapters is not None else directory / p, model) for p in paths])
    options = {k: config[k] for k in _XLORA_FIELDS if k in config}
    adapter = xlora(experts, hidden_size=int(config["hidden_size"]), **options)
    stored = load_file(str(weights_path))
    info = adapter.layers[0].info
    depth, dropout = int(info.option("xlora_depth")), float(info.option("xlora_dropout_p"))
    params = dict(adapter.params)
    missing = []
    for i, index in enumerate(_classifier_index(depth, dropout)):
        for part in ("weight", "bias"):
            key = f"{_CLASSIFIER}.{index}.{part}"
            if key not in stored:
                missing.append(key)
                continue
            want = params[f"{SHARED}.classifier_{i}_{part}"]
            if tuple(stored[key].shape) != tuple(want.shape):
                raise ValueError(  # error: xlora-classifier-shape
                    f"load_xlora: {weights_path} holds {key} of shape {tuple(stored[key].shape)}, but the config (hidden_size, "
                    f"xlora_size, xlora_depth, layerwise_scalings, {len(experts)} experts on {len(adapter.layers)} layers) gives "
                    f"{tuple(want.shape)}; the experts or the config are not the ones the classifier was trained with"
                )
            params[f"{SHARED}.classifier_{i}_{part}"] = stored[key].to(want.device, want.dtype).detach().requires_grad_(True)
    if missing:
        raise ValueError(  # error: xlora-classifier-missing
            f"load_xlora: {weights_path} lacks the classifier tensors {missing}: peft 0.21's save_pretrained drops every key "
            f"holding '.<expert name>.' (its experts are named '0', '1', ...: 'layers.0.' is one), and peft reloads them "
            f"as a fresh random init. Save the classifier with lora_func.routed.save_xlora, or write all of XLoraModel's "
            f"internal_xlora_classifier tensors yourself"
        )
    return adapter.with_params(params)


def save_xlora(adapter: Adapter, directory: str | os.PathLike, *, model: nn.Module | None = None, task_type: str | None = "CAUSAL_LM") -> Path:
    """Write ``adapter`` (one ``xlora`` adapter) as peft's X-LoRA checkpoint, whole: the config
    (``adapters`` naming the subfolders ``0``, ``1``, ... by absolute path, which is where peft's
    ``from_pretrained`` reads the experts), every classifier tensor, and each expert as a LoRA
    checkpoint in its subfolder (``save_peft``). peft loads it with
    ``PeftModel.from_pretrained(base, directory)`` (a base with ``config.use_cache = False``, as
    ``XLoraModel`` requires). Returns the directory."""
    adapter = _xlora(adapter, "save_xlora")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    experts = xlora_experts(adapter)
    for k, expert in enumerate(experts):
        save_peft(expert, directory / str(k), model=model)
    info = adapter.layers[0].info
    depth, dropout = int(info.option("xlora_depth")), float(info.option("xlora_dropout_p"))
    tensors = {}
    for i, index in enumerate(_classifier_index(depth, dropout)):
        for part in ("weight", "bias"):
            tensors[f"{_CLASSIFIER}.{index}.{part}"] = adapter.params[f"{SHARED}.classifier_{i}_{part}"].detach().to("cpu").contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "XLORA", "task_type": task_type, "hidden_size": int(info.option("hidden_size")),
        "adapters": {str(k): str(directory.resolve() / str(k)) for k in range(len(experts))},
        **{k: info.option(k) for k in _XLORA_FIELDS}, "top_k_lora": int(info.option("top_k_lora")) or None,
        "inference_mode": True, "base_model_name_or_path": None, "revision": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return directory
