"""Many adapters per batch: a different adapter per row, an ensemble, per-example gradients.

Two batchings, one feature (``batching=`` of :func:`mixed_call` and :func:`ensemble_call`):

- **In the target layers** (``batching="layers"``, the default's choice, and :func:`mixed_adapted`):
  each target module's ``forward`` is replaced, for the duration of a call
  or a ``with`` block (the module-call route, through the same
  :class:`lora_func._application.Application`, so activation checkpointing recomputes with the
  adapters too), by one that computes the frozen layer once for the whole batch and the adapter
  path per row with that row's own adapter tensors. Attention, masks, the KV cache,
  ``model.generate`` and everything else stay the model's own: any attention implementation
  (SDPA, flash, eager), ``use_cache=True``, quantized bases. An ensemble repeats the batch's rows
  once per member. Two per-row paths: a variant that declares its activation form a scaled
  low-rank product on the model's own layer (``Variant.low_rank``: ``lora``, the LoRA inits,
  ``mica``) takes two batched products with
  each row's gathered ``A`` and ``B`` (``bmm``, as S-LoRA/punica's gathered kernels; an ensemble's
  member-major blocks of rows read the stacked factors as they are, no gather); every other
  variant runs its own activation form under ``torch.vmap`` over the rows, the base weight
  unbatched.
- **``torch.func.vmap`` over the whole model** (``batching="vmap"``, :func:`per_example_grads`):
  pure functions of the adapter tensors, so they compose
  with ``torch.func.grad`` and with each other, and each example runs as a batch of one (a
  per-example loss). Attention must be ``"eager"`` (SDPA and flash attention have no ``vmap``
  batching rule, and with a mask they branch on its values; checked up front), and dropout in
  train mode needs ``randomness="different"`` or ``"same"``.

The batch is dim 0 of every target layer's input (true of transformers' decoder layers), one
row per index entry: any other row count raises (an index one entry short would run rows with
other rows' adapters). Inputs with ``n = m * len(index)`` rows use ``index.repeat_interleave(m)``
only where that is asked for: ``rows_per_index=m``, or the calls ``model.generate`` makes
(``num_beams=m``, ``num_return_sequences=m``) inside a :func:`mixed_adapted` block. See
docs/functional.md.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from lora_func._application import Application, refuse_checkpointing_in_transform
from lora_func.variants._kernels import lowrank_input
from lora_func._model import base_params
from lora_func._routing import module_forward
from lora_func._sharded import swapped_on
from lora_func._layer_ops import LayerCall, VariantOp
from lora_func.adapter import Adapter, AdapterLayer, AdapterLike, Combinator, leaf_adapters
from lora_func.stacking import _member, _stack_adapters, take
from lora_func.call import _call_plan, adapted_call
from lora_func.checks import check_base, check_model
from lora_func.plan import adapter_tensors, checked_index, detached_base
from lora_func.prompts._apply import contains_prompt, mixed_prompt_application
from lora_func.quantized import frozen_call, frozen_forwards, kind_of_tensor
from lora_func.targeting import MERGED_ONLY, canonical_weight
from lora_func._vmapped import check_attention as _check_attention
from lora_func._vmapped import drop_example_dim as _drop_example_dim
from lora_func._vmapped import outputs_as_tensors as _outputs_as_tensors
from lora_func._vmapped import split_examples as _split_examples
from lora_func._vmapped import vmapped as _vmapped
from lora_func.variants import LayerInfo, Variant, get_variant, list_variants
from lora_func.variants._contract import RANK_MASK, LowRank

__all__ = ["ensemble_call", "mixed_adapted", "mixed_call", "per_example_grads"]

Randomness = Literal["error", "different", "same"]


# ----------------------------------------------------------------------------- in the target layers


def _low_rank(variant: Variant | str) -> LowRank | None:
    """The variant's low-rank declaration, when it takes the batched-``bmm`` path: its product
    added to the model's own layer (not to a residual that replaces the weight)."""
    found = get_variant(variant) if isinstance(variant, str) else variant
    return None if found.replaces_weight else found.low_rank


def _stacked(adapters: Any, where: str) -> Adapter:
    """``adapters`` (a list of adapters, or one stacked adapter) as one stack ``(K, ...)``; a
    list is stacked with its autograd history kept, so gradients reach every list member."""
    if isinstance(adapters, Combinator) or (
        isinstance(adapters, (list, tuple)) and any(isinstance(a, Combinator) for a in adapters)
    ):
        raise TypeError(  # error: mixed-route-composite
            f"{where}: adapters must be plain adapters of one variant (any of {list_variants()}), got a "
            f"{type(adapters).__name__ if not isinstance(adapters, (list, tuple)) else 'list with Composed/Combined'}; "
            f"compose/combine are not supported per row: merge each tenant into one adapter, or serve them with "
            f"lora_func.adapted one at a time"
        )
    if isinstance(adapters, (list, tuple)):
        if not adapters or not all(isinstance(a, Adapter) for a in adapters):
            shown = "an empty list" if not adapters else f"a list holding {sorted({type(a).__name__ for a in adapters})}"
            raise TypeError(f"{where}: adapters must be a non-empty list of lora_func.Adapter (one per tenant), got {shown}")  # error: mixed-route-list
        # Not lora_func.stack: it returns new leaves (for optimisers), which would cut the
        # gradient off the listed adapters.
        return _stack_adapters(list(adapters))
    if not isinstance(adapters, Adapter):
        raise TypeError(  # error: mixed-route-adapters-type
            f"{where}: adapters must be a list of lora_func.Adapter or one stacked adapter (lora_func.stack([...])), "
            f"got {type(adapters).__name__}"
        )
    if len(adapters.stack_shape) != 1:
        raise ValueError(  # error: mixed-route-not-stacked
            f"{where}: a single adapter must be stacked along one leading axis (stack_shape (K,)), got stack_shape "
            f"{adapters.stack_shape}; pass a list of adapters or lora_func.stack([adapter_0, adapter_1, ...])"
        )
    return adapters


class _Rows:
    """Which adapter each row of a target layer's input uses: ``index`` for ``len(index)`` rows,
    ``index.repeat_interleave(m)`` for ``m * len(index)`` rows (beams, return sequences), where
    ``m`` is ``rows_per_index``, or any ``m`` while ``expanding`` (inside ``model.generate`` in a
    :func:`mixed_adapted` block, which expands each sequence itself)."""

    def __init__(self, index: Tensor, rows_per_index: int = 1) -> None:
        self.index = index
        self.rows_per_index = rows_per_index
        self.expanding = False
        self._by_rows: dict[tuple[int, torch.device], Tensor] = {}
        # Consecutive members (an ensemble: index = arange(start, start + m), each over a block of
        # rows): (start, m), so the LoRA path multiplies each block by its member's factors as
        # they are stacked, with no per-row gather (a copy per row, pure overhead there).
        values = index.tolist()
        self.span = (values[0], len(values)) if values == list(range(values[0], values[0] + len(values))) else None

    def __call__(self, rows: int, device: torch.device, module: str) -> Tensor:
        size = self.index.shape[0]
        per = rows // size if self.expanding and rows % size == 0 else self.rows_per_index
        check_rows(rows, size, per, f"mixed adapters: target {module}")
        key = (rows, device)
        found = self._by_rows.get(key)
        if found is None:
            found = self.index.to(device).repeat_interleave(per)
            self._by_rows[key] = found
        return found


def check_rows(rows: int, size: int, rows_per_index: int, where: str, *, expandable: bool = True) -> None:
    """Raise unless a batch of ``rows`` rows is ``rows_per_index`` rows per index entry (one by
    default): an index of another length would silently run rows with other rows' adapters.
    ``expandable``: the caller takes ``rows_per_index`` (say so in the fix)."""
    if rows != size * rows_per_index:
        expanded = f" x rows_per_index={rows_per_index} = {size * rows_per_index}" if rows_per_index != 1 else ""
        fix = (
            "For rows expanded from each sequence (beam search, num_return_sequences: index.repeat_interleave(m)) pass "
            "rows_per_index=m, or call model.generate inside lora_func.mixed_adapted, which expands the index itself"
            if expandable else "mixed_call runs each example alone: pass one index entry per example"
        )
        raise ValueError(  # error: mixed-route-batch-rows
            f"{where}: the batch has {rows} rows on dim 0, but len(index)={size}{expanded}: index needs one entry per "
            f"row of the batch. {fix}"
        )


def check_rows_per_index(rows_per_index: object, where: str) -> int:
    if isinstance(rows_per_index, bool) or not isinstance(rows_per_index, int) or rows_per_index < 1:
        raise ValueError(  # error: mixed-route-rows-per-index
            f"{where}: rows_per_index={rows_per_index!r} must be an integer >= 1: how many consecutive rows of the batch "
            f"each index entry covers (1, the default: one row per entry; m for m beams or return sequences per entry)"
        )
    return rows_per_index


def check_chunk_size(chunk_size: object, where: str) -> int | None:
    """``chunk_size`` after checking it is ``None`` or an integer >= 1 (0 or a fraction would
    otherwise be rounded to some other number of members, or examples, per chunk)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(  # error: many-chunk-size
            f"{where}: chunk_size={chunk_size!r} must be None (all at once) or an integer >= 1: how many members or "
            f"examples run at a time"
        )
    return chunk_size


def _input_rows(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The batch size of a model call's main input (the first positional tensor, or ``input_ids``
    / ``inputs_embeds``), or ``None`` where there is none to read."""
    first = args[0] if args else next((kwargs[k] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None), None)
    return first.shape[0] if isinstance(first, Tensor) and first.dim() >= 1 else None


def _gather(tensors: Mapping[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    # A tensor every member shares (stacked as an expand: a seed-derived basis) stays one copy.
    return {
        name: tensor[0].expand(rows.shape[0], *tensor.shape[1:]) if tensor.dim() and tensor.stride(0) == 0 else tensor.index_select(0, rows)
        for name, tensor in tensors.items()
    }


def _lora_factors(
    form: LowRank, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], info: LayerInfo
) -> tuple[Tensor, Tensor]:
    """Each row's ``s_b A_bᵀ (n, d_in, r)`` and ``B_bᵀ (n, r, d_out)`` from its gathered tensors
    (``A (n, r, d_in)``, ``B (n, d_out, r)``, named by ``form``); a rank-padded stack's padding
    masked out."""
    tensors = {**buffers, **params}  # a factor the variant freezes is a buffer (MiCA's B)
    lora_a, lora_b = tensors[form.a], tensors[form.b]
    if RANK_MASK in buffers:  # rank-padded stack: padded rank entries never reach the output
        mask = buffers[RANK_MASK].to(lora_a.dtype)
        lora_a, lora_b = lora_a * mask[:, :, None], lora_b * mask[:, None, :]
    scale = form.scale(info, dict(buffers))
    if isinstance(scale, Tensor):
        scale = scale.to(lora_a.dtype).reshape(-1, 1, 1)
    # Contiguous (n, r, d_out): autograd then computes both backward products with their long
    # axis last, as add_low_rank's single-adapter path does.
    return (lora_a * scale).transpose(1, 2), lora_b.transpose(1, 2).contiguous()


def _gathered_lora(
    a_t: Tensor, b_t: Tensor, info: LayerInfo, x: Tensor, base: Callable[[Tensor], Tensor], training: bool
) -> Tensor:
    """``base(x) + (x_b s_b A_bᵀ) B_bᵀ`` per block ``b`` of rows: ``x (rows, ..., d_in)``,
    ``base`` the frozen layer's op, ``a_t (n, d_in, r)`` and ``b_t (n, r, d_out)`` from
    :func:`_lora_factors`, ``n`` dividing ``rows`` (one factor per row, or per block of rows).

    The rows are laid out member-major, so ``x.view(n, -1, d_in)`` is free and the frozen layer
    runs on that view: its output ``(n, L, d_out)`` is then a fresh tensor, not a view, and the
    low-rank product is accumulated into it in place (``baddbmm_``) with no copy of the
    activations (in place into a view of the output would make autograd copy the whole
    gradient in backward, ``CopySlices``)."""
    n = a_t.shape[0]
    x3 = x.reshape(n, -1, x.shape[-1])
    dropped = lowrank_input(x3, types.SimpleNamespace(training=training), info)
    h = torch.bmm(dropped.to(a_t.dtype), a_t)
    y = base(x3)
    out_shape = (*x.shape[:-1], y.shape[-1])
    if y.dtype == h.dtype and not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None:
        # The frozen layer's output is fresh and no backward formula reads it: accumulate in place
        # (as the single-adapter path does), no copy of the (n, L, d_out) activations.
        return y.baddbmm_(h, b_t).view(out_shape)
    return (y + torch.bmm(h, b_t).to(y.dtype)).view(out_shape)


def _target_forward(adapter: Adapter, layer: AdapterLayer, rows: _Rows) -> Any:
    """The replacement ``forward`` of one target module (an Application forward)."""
    target, info, variant, dtype = layer.target, layer.info, adapter.variant, adapter.spec.dtype
    params, buffers = adapter.layer_tensors(layer)
    form = _low_rank(variant)
    layout = module_forward(target.layout)
    sources = (*params.values(), *buffers.values())
    # Inference only (no autograd, no transform): each row count's gathered factors, computed once
    # per block (every decoding step reuses them), keyed on the adapter tensors' version counters
    # so an in-place update of an adapter inside the block is seen.
    factors: dict[tuple[int, torch.device], tuple[tuple[int, ...], tuple[Tensor, Tensor]]] = {}

    def lora_factors(form: LowRank, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        index = rows(n, device, target.module)  # checks the row count, on every call (before the cache)
        cacheable = not torch.is_grad_enabled() and torch._C._functorch.peek_interpreter_stack() is None
        versions = tuple(t._version for t in sources) if cacheable else ()
        if cacheable:
            found = factors.get((n, device))
            if found is not None and found[0] == versions:
                return found[1]
        if rows.span is not None:
            start, members = rows.span
            out = _lora_factors(
                form, {k: v.narrow(0, start, members) for k, v in params.items()}, {k: v.narrow(0, start, members) for k, v in buffers.items()}, info
            )
        else:
            out = _lora_factors(form, _gather(params, index), _gather(buffers, index), info)
        if cacheable:
            factors[(n, device)] = (versions, out)
        return out

    def forward(module: Any, inner: Any, x: Tensor) -> Tensor:
        kind = kind_of_tensor(module.weight)
        base_call = inner if kind is None else frozen_call(module, kind)
        if form is not None:
            a_t, b_t = lora_factors(form, x.shape[0], x.device)
            return _gathered_lora(a_t, b_t, info, x, base_call, module.training)
        index = rows(x.shape[0], x.device, target.module)
        weight = canonical_weight(module.weight, target.layout)
        bias, training = module.bias, module.training

        def one_row(p: dict[str, Tensor], b: dict[str, Tensor], x_row: Tensor) -> Tensor:
            x_op, finish = layout.prepare(x_row, target.d_out)
            op = VariantOp(variant, p, b, info, dtype)
            return finish(op.activation(x_op, LayerCall(weight, bias, base_call, training)))

        # "different": the adapter's dropout (training only) draws an independent mask per row,
        # as one batched call would.
        return torch.vmap(one_row, randomness="different")(_gather(params, index), _gather(buffers, index), x)

    return forward


def _mixed_application(
    model: nn.Module, adapters: Any, index: Any, base: Mapping[str, Tensor] | None, where: str, rows_per_index: int = 1,
    rows: int | None = None,
) -> tuple[Application, _Rows | None]:
    """Every check at the boundary, then the Application that installs the per-row forwards and
    the rows' index (``None`` for prompts, which index their rows themselves). ``rows``: the
    call's batch size where known (checked here, before any work)."""
    check_model(model, where)
    if contains_prompt(adapters) or (isinstance(adapters, (list, tuple)) and any(contains_prompt(a) for a in adapters)):
        rows_per_index = check_rows_per_index(rows_per_index, where)
        application = mixed_prompt_application(model, adapters, index, base, where, checked_index)  # checks index
        if rows is not None:
            check_rows(rows, len(index), rows_per_index, where)
        return application, None
    stacked = _stacked(adapters, where)
    size = stacked.stack_shape[0]
    index = checked_index(index, size, where)
    rows_per_index = check_rows_per_index(rows_per_index, where)
    if rows is not None:
        check_rows(rows, index.shape[0], rows_per_index, where)
    given = base is not None
    if base is None:
        base = base_params(model)
    else:
        check_base(base, where)
    members = list(adapters) if isinstance(adapters, (list, tuple)) else [_member(stacked, 0)]
    # One plan per member structure (members of one stack or list usually share it: built once).
    plan = None
    for member in members:
        plan = _call_plan(model, base, given, member, "module", where, None)
    assert plan is not None
    modules = plan.modules(model)
    if given:
        base = detached_base(base)
    quantized = sorted(layer.target.module for layer in stacked.layers if kind_of_tensor(base[layer.target.weight_key]) is not None)
    if quantized and _low_rank(stacked.spec.variant) is None:
        gathered = sorted(name for name in list_variants() if _low_rank(name) is not None)
        raise ValueError(  # error: mixed-route-quantized
            f"{where}: targets {quantized[:4]} are quantized, and mixed adapters on quantized layers are supported for "
            f"the LoRA-form variants {gathered} only (variant {stacked.spec.variant!r} runs its activation form under "
            f"vmap, which the quantized op does not support); dequantize the base, or use lora_func.adapted per tenant"
        )
    merged_only = sorted(f"{layer.target.module} ({layer.target.layout})" for layer in stacked.layers if layer.target.layout in MERGED_ONLY)
    if merged_only:
        raise ValueError(  # error: mixed-route-kind
            f"{where}: targets {merged_only[:4]} are embeddings, convolutions, norms or expert parameters, which the "
            f"layers batching does not adapt per row, so one batch cannot hold rows of different adapters there; use "
            f"lora_func.adapted_call per adapter, or leave those layers out of the targets"
        )
    refuse_checkpointing_in_transform(model)
    index = index.to(base[stacked.layers[0].target.weight_key].device) if stacked.layers else index
    row_index = _Rows(index, rows_per_index)
    forwards = {layer.target.module: _target_forward(stacked, layer, row_index) for layer in stacked.layers}
    forwards = {**frozen_forwards(model, exclude=forwards, modules=modules), **forwards}
    trainable = tuple(t for a in members for t in adapter_tensors(a)[0].values()) if isinstance(adapters, (list, tuple)) else tuple(stacked.params.values())
    params = swapped_on(base, modules, plan.fsdp, where)
    return Application(model, params, forwards, trainable=trainable, modules=modules), row_index


def _mixed_layers(model: nn.Module, adapters: Any, index: Any, base: Any, rows_per_index: int, args: Any, kwargs: Any) -> Any:
    """:func:`mixed_call` inside the target layers (``batching="layers"``)."""
    application, _ = _mixed_application(model, adapters, index, base, "mixed_call", rows_per_index, _input_rows(args, kwargs))
    return application(*args, **kwargs)


@contextlib.contextmanager
def mixed_adapted(
    model: nn.Module, adapters: Sequence[Adapter] | AdapterLike, index: Tensor, *, rows_per_index: int = 1
) -> Iterator[nn.Module]:
    """Within the ``with`` block, batch row ``b`` of every call of ``model`` uses adapter
    ``index[b]``; on exit (also on error) the model is as it was. For ``model.generate``::

        with torch.no_grad(), lora_func.mixed_adapted(model, [tenant_a, tenant_b], torch.tensor([1, 0, 1])):
            tokens = model.generate(input_ids, attention_mask=mask, max_new_tokens=20)

    ``adapters``, ``index`` and ``rows_per_index``: as in :func:`mixed_call`: each call's
    batch must have ``rows_per_index * len(index)`` rows (``len(index)`` by default), except the
    calls ``model.generate`` makes, which may have any multiple ``m * len(index)``, laid out as
    ``repeat_interleave(m)`` (``num_beams``, ``num_return_sequences``: generate expands each
    sequence itself). For that the block also sets ``model.generate`` (an instance attribute, removed
    on exit) to the model's own ``generate`` marked as expanding. The base weights are never written (the block
    reparametrizes the model with detached views and swaps the target modules' ``forward``).
    A list of adapters is stacked once, on entering the block (its values then are used); a
    stack passed as such is read in place (an in-place update inside the block is seen).
    Not thread-safe: while the block runs, every caller of ``model`` goes through the per-row
    layers with this ``index``; serve concurrent requests by batching them into one block.
    """
    application, rows = _mixed_application(model, adapters, index, None, "mixed_adapted", rows_per_index)
    with application.applied(), (_expanding_generate(model, rows) if rows is not None else contextlib.nullcontext()):
        yield model


@contextlib.contextmanager
def _expanding_generate(model: nn.Module, rows: _Rows) -> Iterator[None]:
    """For the block, ``model.generate`` (when the model has one) runs with ``rows`` expanding:
    the calls it makes may have any multiple of ``len(index)`` rows (its beams and return
    sequences). An instance attribute, as the target modules' ``forward``; the previous one (if
    any) is put back on exit."""
    generate = getattr(model, "generate", None)
    if not callable(generate):
        yield
        return
    missing = object()
    own = model.__dict__.get("generate", missing)

    @functools.wraps(generate)
    def expanding(*args: Any, **kwargs: Any) -> Any:
        before = rows.expanding
        rows.expanding = True
        try:
            return generate(*args, **kwargs)
        finally:
            rows.expanding = before

    model.__dict__["generate"] = expanding
    try:
        yield
    finally:
        if own is missing:
            model.__dict__.pop("generate", None)
        else:
            model.__dict__["generate"] = own


# ----------------------------------------------------------------------------- vmap over the model


def _check_arguments(where: str, model: Any, adapters: Any, base: Any) -> None:
    check_model(model, where)
    leaf_adapters(adapters)
    if base is not None:
        check_base(base, where)


def _stack_size(adapters: Any, where: str) -> int:
    shape = adapters.stack_shape
    if len(shape) != 1:
        raise ValueError(  # error: batch-not-stacked
            f"{where} needs adapters stacked along one leading axis (stack_shape (K,)), got stack_shape {shape}; "
            f"build them with lora_func.stack([adapter_0, adapter_1, ...])"
        )
    return shape[0]


Batching = Literal["auto", "layers", "vmap"]
BATCHINGS: tuple[str, ...] = ("auto", "layers", "vmap")


def _in_layers(model: nn.Module, adapters: Any, batching: Any, merged: bool, randomness: str, kwargs: Mapping[str, Any], where: str) -> bool:
    """Whether a call of :func:`mixed_call` / :func:`ensemble_call` runs inside the target layers
    or under ``vmap`` over the whole model. ``"auto"`` takes the layers but for what only ``vmap``
    gives: merged weights per member, composed/combined stacks, a loss the model computes from
    ``labels`` (one per member or example), and ``randomness`` other than ``"different"`` in train
    mode (the in-layer batching draws every row's dropout independently)."""
    if batching not in BATCHINGS:
        raise ValueError(  # error: many-batching-unknown
            f"{where}: batching={batching!r} is not one of {list(BATCHINGS)}; batching='layers' applies each member inside "
            f"the target layers (any attention, KV cache, quantized bases), batching='vmap' runs the whole model under "
            f"torch.func.vmap (eager attention), 'auto' (default) the layers unless only vmap can do the call"
        )
    if batching == "layers" and merged:
        raise ValueError(  # error: many-layers-merged
            f"{where}: merged=True with batching='layers': inside the target layers each row runs its adapter's activation "
            f"form; merged weights per row need batching='vmap' (or leave merged=False)"
        )
    if batching != "auto":
        return batching == "layers"
    return not merged and not isinstance(adapters, Combinator) and "labels" not in kwargs and (not model.training or randomness == "different")


def _reshaped_rows(out: Any, members: int, rows: int) -> Any:
    """Every output tensor with ``members * rows`` rows on dim 0 as ``(members, rows, ...)``."""
    return pytree.tree_map_only(
        Tensor, lambda t: t.reshape(members, rows, *t.shape[1:]) if t.dim() >= 1 and t.shape[0] == members * rows else t, out
    )


def mixed_call(
    model: nn.Module,
    adapters: Sequence[Adapter] | AdapterLike,
    index: Tensor,
    *args: Any,
    merged: bool = False,
    base: Mapping[str, Tensor] | None = None,
    lazy_only: bool = False,
    randomness: Randomness = "error",
    batching: Batching = "auto",
    rows_per_index: int = 1,
    **kwargs: Any,
) -> Any:
    """``model(*args, **kwargs)`` where batch row ``b`` uses adapter ``index[b]``; the model untouched.

    Args:
      adapters: ``K`` adapters of one variant, targets and options (ranks and alphas may differ):
        a list, or one stacked adapter (:func:`lora_func.stack`, ``stack_shape (K,)``).
      index: ``(B,)`` int64 (or int32) tensor, values in ``[0, K)``, one per row of the batch;
        repeats are fine, unused members get zero gradient.
      args, kwargs: the model's inputs, the batch on dim 0 (``input_ids (B, T)``,
        ``attention_mask (B, T)`` with left or right padding, ``labels (B, T)``); other
        arguments (non-tensors, ``position_ids (1, T)``) are shared by every row.
      batching: ``"layers"`` applies each row's adapter inside the target layers (the model is
        called once on the batch; any attention implementation, ``use_cache=True``, quantized
        bases, activation checkpointing; a loss from ``labels`` is the model's own batch loss);
        ``"vmap"`` runs the model under ``torch.func.vmap``, each row as a batch of one with its
        own attention-mask row, exactly as in a per-example loop (eager attention, checked; a
        loss from ``labels`` per row, ``(B,)``; outputs must be tensors: pass
        ``use_cache=False``). ``"auto"`` (default): the layers, but vmap for what only it gives:
        ``merged=True``, composed/combined stacks, ``labels``, and in train mode ``randomness``
        other than ``"different"``.
      rows_per_index: (layers) how many consecutive rows of the batch each index entry covers:
        the batch must have exactly ``rows_per_index * len(index)`` rows (``m`` for sequences
        each expanded into ``m`` rows, as beam search does: ``index.repeat_interleave(m)``). The
        default, 1, refuses a batch of any other size than ``len(index)`` (``ValueError``, before
        the model runs): an index one entry short would otherwise run rows with other rows'
        adapters. :func:`mixed_adapted` expands it for ``model.generate`` by itself.

    Returns the model's output batched on dim 0, e.g. ``logits (B, T, V)``.

    Pure and differentiable: ``torch.func.grad(lambda p: loss(mixed_call(model,
    adapters.with_params(p), index, ids)))(adapters.params)`` gives each stack member the gradient
    of the rows that used it (zero for members no row used); with a list of adapters whose params
    require grad, ``loss.backward()`` fills each one's ``.grad``. A model with dropout in train
    mode needs ``randomness="different"`` (an independent mask per row, both batchings).
    ``merged=True`` builds every row's merged weights (``B`` dense copies per target): keep the
    default. ``base``: as in :func:`lora_func.adapted_call`. See :func:`mixed_adapted` for
    generation.
    """
    where = "mixed_call"
    check_model(model, where)
    if _in_layers(model, adapters, batching, merged, randomness, kwargs, where):
        return _mixed_layers(model, adapters, index, base, rows_per_index, args, kwargs)
    if check_rows_per_index(rows_per_index, where) != 1:
        raise ValueError(  # error: many-vmap-rows-per-index
            f"{where}: rows_per_index={rows_per_index} needs batching='layers': under vmap every row is one example of "
            f"its own index entry; repeat the index (index.repeat_interleave(m)) instead"
        )
    stacked: AdapterLike = _stacked(adapters, where) if isinstance(adapters, (list, tuple)) else cast(AdapterLike, adapters)
    _check_arguments(where, model, stacked, base)
    size = _stack_size(stacked, where)
    index = checked_index(index, size, where)
    batch_size = index.shape[0]
    rows = _input_rows(args, kwargs)
    if rows is not None:
        check_rows(rows, batch_size, 1, where, expandable=False)
    examples, rebuild = _split_examples(args, kwargs, batch_size)
    if not examples:
        raise ValueError(  # error: mixed-batch-size
            f"mixed_call: no tensor argument has the batch size len(index)={batch_size} on dim 0; index needs one "
            f"entry per example of the batch"
        )
    # A base from named_parameters() would give the model .grad in a training step.
    base = None if base is None else detached_base(base)
    _check_attention(model, where)
    per_example = take(stacked, index)

    def one(adapter: AdapterLike, *example: Tensor) -> Any:
        example_args, example_kwargs = rebuild(example)
        out = adapted_call(model, adapter, *example_args, merged=merged, base=base, lazy_only=lazy_only, **example_kwargs)
        return _drop_example_dim(_outputs_as_tensors(out, where))

    return _vmapped(one, where, randomness=randomness)(per_example, *examples)


def ensemble_call(
    model: nn.Module,
    adapters: AdapterLike,
    *args: Any,
    merged: bool = False,
    base: Mapping[str, Tensor] | None = None,
    lazy_only: bool = False,
    randomness: Randomness = "error",
    chunk_size: int | None = None,
    batching: Batching = "auto",
    **kwargs: Any,
) -> Any:
    """``model(*args, **kwargs)`` through each of the ``K`` stacked ``adapters``, in one call.

    The inputs are shared (not split); every output gets a leading ``K`` axis, e.g. ``logits
    (K, B, T, V)``. Composes with ``grad`` and ``loss.backward()``: train ``K`` adapters at once
    on one frozen base. ``batching="layers"``: the batch's rows are repeated once per member
    (``K * B`` rows) and each member is applied inside the target layers (as
    :func:`mixed_call`), so any attention implementation (SDPA, flash), the KV cache (returned as
    the model returns it, for ``K * B`` rows) and quantized bases work. ``batching="vmap"`` runs
    the model under ``torch.func.vmap`` over the members (eager attention, checked; pass
    ``use_cache=False``). ``"auto"`` (default) takes the layers, but vmap for ``merged=True``,
    composed/combined stacks, ``labels`` (a loss per member, ``(K,)``) and, in train mode,
    ``randomness`` other than ``"different"``. ``chunk_size`` runs the members that many at a
    time, bounding the activations' memory. The lazy path shares the frozen weights across
    members and holds no merged weight.
    """
    where = "ensemble_call"
    _check_arguments(where, model, adapters, base)
    size = _stack_size(adapters, where)
    check_chunk_size(chunk_size, where)
    if _in_layers(model, adapters, batching, merged, randomness, kwargs, where):
        leaves, spec = pytree.tree_flatten((args, dict(kwargs)))
        rows = next((leaf.shape[0] for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() >= 1), None)
        if rows is not None:
            step = size if chunk_size is None else chunk_size
            outs = []
            for start in range(0, size, step):
                members = min(step, size - start)
                index = torch.arange(start, start + members)  # each over a block of `rows` rows
                repeated = [
                    leaf.repeat(members, *([1] * (leaf.dim() - 1))) if isinstance(leaf, Tensor) and leaf.dim() >= 1 and leaf.shape[0] == rows else leaf
                    for leaf in leaves
                ]
                call_args, call_kwargs = pytree.tree_unflatten(repeated, spec)
                out = _mixed_layers(model, adapters, index, base, rows, call_args, call_kwargs)
                outs.append(_reshaped_rows(out, members, rows))
            if len(outs) == 1:
                return outs[0]
            return pytree.tree_map(lambda *parts: torch.cat(parts) if isinstance(parts[0], Tensor) else parts[0], *outs)
    base = None if base is None else detached_base(base)
    _check_attention(model, where)

    def one(adapter: AdapterLike) -> Any:
        out = adapted_call(model, adapter, *args, merged=merged, base=base, lazy_only=lazy_only, **kwargs)
        return _outputs_as_tensors(out, where)

    return _vmapped(one, where, randomness=randomness, chunk_size=chunk_size)(adapters)


def per_example_grads(
    loss_fn: Callable[..., Any],
    adapter: Any,
    *batch: Any,
    has_aux: bool = False,
    randomness: Randomness = "error",
    chunk_size: int | None = None,
) -> Any:
    """The gradient of ``loss_fn(adapter, *example)`` for every example of ``batch``.

    Equal to ``torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, ...))`` (tested), at the
    cost of one batched backward: each example gets its own copy of ``adapter.params`` (an
    ``expand``, no copy), the forward runs under ``vmap`` over (copy, example) pairs, and one
    reverse pass (``torch.autograd.grad`` of the summed losses) gives each copy the gradient
    of its own example's loss. That reverse pass runs in the ordinary autograd engine, which
    accumulates in place and keeps fused backward kernels, where ``grad`` under ``vmap``
    decomposes some of them (docs/benchmarks.md, the functional section, has the comparison).

    Args:
      loss_fn: ``loss_fn(adapter, *example) -> loss`` (0-d), or ``(loss, aux)`` with
        ``has_aux=True``. It sees each example as a batch of one: tensors keep a dim 0 of
        size 1 (``input_ids (1, T)``), so a function written for a batch works unchanged.
      adapter: one adapter (not stacked); the gradients are w.r.t. ``adapter.params``.
      batch: the examples; every tensor in it is split along dim 0 (all with the same size
        ``B``), every other value is passed whole.
      chunk_size: run that many examples at a time in the forward (see ``torch.func.vmap``);
        the backward still holds every example's activations, as a batched backward does.

    Returns a dict like ``adapter.params`` whose tensors have a leading ``(B,)`` axis (and the
    per-example aux, batched, with ``has_aux=True``), detached. Transformers models need eager
    attention (SDPA with an attention mask fails under ``vmap``; the error says so), and
    dropout in train mode needs ``randomness="different"``.
    """
    where = "per_example_grads"
    check_chunk_size(chunk_size, where)
    if not callable(loss_fn):
        raise TypeError(  # error: per-example-not-callable
            f"per_example_grads: loss_fn must be a function loss_fn(adapter, *example) -> 0-d loss, got "
            f"{type(loss_fn).__name__}; the adapter is the second argument: per_example_grads(loss_fn, adapter, *batch)"
        )
    leaf_adapters(adapter)
    sizes = sorted({t.shape[0] for t in pytree.tree_leaves(batch) if isinstance(t, Tensor) and t.dim() >= 1})
    scalars = [t for t in pytree.tree_leaves(batch) if isinstance(t, Tensor) and t.dim() == 0]
    if len(sizes) != 1 or scalars:
        raise ValueError(  # error: per-example-batch
            f"per_example_grads: every tensor in batch must have the batch on dim 0, all of one size B; got dim-0 "
            f"sizes {sizes}{' and 0-d tensors' if scalars else ''}; pass shared tensors through loss_fn's closure"
        )
    batch_size = sizes[0]
    examples, rebuild = _split_examples(batch, {}, batch_size)
    # One leaf per parameter with a leading (B,) axis: example b reads slice b only, so the
    # gradient of the summed losses w.r.t. slice b is example b's gradient.
    copies = {
        key: value.detach().unsqueeze(0).expand(batch_size, *value.shape).requires_grad_(True)
        for key, value in adapter.params.items()
    }

    def loss(params: dict[str, Tensor], *example: Tensor) -> Any:
        example_batch, _ = rebuild(example)
        return loss_fn(adapter.with_params(params), *example_batch)

    with torch.enable_grad():
        out = _vmapped(loss, where, randomness=randomness, chunk_size=chunk_size)(copies, *examples)
        losses, aux = out if has_aux else (out, None)
        if not isinstance(losses, Tensor) or tuple(losses.shape) != (batch_size,):
            raise ValueError(  # error: per-example-loss
                f"per_example_grads: loss_fn must return one scalar loss per example (a 0-d tensor{', aux' if has_aux else ''}), "
                f"got {type(losses).__name__} of per-example shape {tuple(losses.shape[1:]) if isinstance(losses, Tensor) else '?'}"
            )
        grads = torch.autograd.grad(losses.sum(), list(copies.values()), allow_unused=True)
    out_grads = {key: torch.zeros_like(copies[key]) if g is None else g for key, g in zip(copies, grads, strict=True)}
    if not has_aux:
        return out_grads
    return out_grads, pytree.tree_map_only(Tensor, Tensor.detach, aux)
