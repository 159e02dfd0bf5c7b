"""Mixed-adapter batches inside the target layers: row ``b`` of a batch runs with adapter ``index[b]``.

The route of multi-tenant serving (one frozen base, a different adapter per request): only the
target layers know about the adapters. Each target module's ``forward`` is replaced, for the
duration of a call or a ``with`` block (the module-call route of :mod:`lora_func.core`, through
the same :class:`lora_func._application.Application`, so activation checkpointing recomputes
with the adapters too), by one that computes the frozen layer once for the whole batch and the
variant's adapter path per row with that row's own adapter tensors. Attention, masks, the KV
cache, ``model.generate`` and everything else stay the model's own: any attention
implementation (SDPA, flash, eager), ``use_cache=True``, greedy, sampling and beam search.

Two per-row paths, picked per variant:

- LoRA-form variants (``lora``, ``eva``: activation form ``base(x) + s (x Aᵀ) Bᵀ``): the frozen
  layer on the whole batch, then two batched products with each row's gathered ``A`` and ``B``
  (``bmm``, as S-LoRA/punica's gathered kernels), accumulated into the layer's output.
- every other registered variant (DoRA, PiSSA, DeLoRA, HRA, IA3, AntiPaSTO): the variant's own
  activation form under ``torch.vmap`` over the rows, the base weight unbatched (``vmap`` runs the
  frozen product as one batched matmul). Correct for any form; it pays ``vmap``'s Python cost per
  target call and whatever the form costs per adapter (DoRA's weight norm: one dense
  ``(d_out, d_in)`` product per row and call).

The batch is dim 0 of every target layer's input (true of transformers' decoder layers). Inputs
with ``n = m * len(index)`` rows (``generate`` with ``num_beams=m`` or
``num_return_sequences=m``, which expand each sequence into ``m`` consecutive rows) use
``index.repeat_interleave(m)``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lora_func._application import Application, refuse_checkpointing_in_transform
from lora_func._steps import LayerCall, VariantStep
from lora_func._routing import module_forward
from lora_func._sharded import is_fsdp_model, swapped_on
from lora_func._kernels import lora_activation_form, lora_scale, lowrank_input
from lora_func.variants import LayerInfo
from lora_func.variants._contract import RANK_MASK
from lora_func.adapter import Adapter, AdapterLayer, AdapterLike, Combinator
from lora_func.stacking import _member, _stack_adapters
from lora_func.checks import check_adapter_placement, check_base, check_layouts, check_model, detached_base
from lora_func._model import base_params, check_params
from lora_func.core import _check
from lora_func.quantized import frozen_call, frozen_forwards, kind_of_tensor
from lora_func.targeting import canonical_weight
from lora_func.variants import get_variant, list_variants

__all__ = ["mixed_adapted", "mixed_adapted_call"]

_INDEX_DTYPES = (torch.int64, torch.int32)


def _gathered_path(variant_name: str) -> bool:
    """Whether a variant takes the gathered-``bmm`` path (its activation form is LoRA's)."""
    return get_variant(variant_name).activation_form is lora_activation_form


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


def _checked_index(index: Any, size: int, where: str) -> Tensor:
    if isinstance(index, Sequence) and not isinstance(index, (str, bytes)) and index and all(
        isinstance(i, int) and not isinstance(i, bool) for i in index
    ):
        index = torch.tensor(list(index), dtype=torch.int64)  # a list, tuple or range of positions
    if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype not in _INDEX_DTYPES or index.numel() == 0:
        shown = f"a {index.dtype} tensor of shape {tuple(index.shape)}" if isinstance(index, Tensor) else type(index).__name__
        raise TypeError(  # error: mixed-route-index-type
            f"{where}: index must be a non-empty 1-D int64 or int32 tensor (one adapter position per batch row), got {shown}; "
            f"e.g. torch.tensor([2, 0, 1, 0]) or a list of ints [2, 0, 1, 0]"
        )
    outside = sorted({int(i) for i in index.tolist() if not 0 <= i < size})
    if outside:
        # A negative index would silently pick a member counted from the end.
        raise IndexError(  # error: mixed-route-index-range
            f"{where}: index has values outside [0, {size}) ({size} adapters): {', '.join(map(str, outside[:5]))}; "
            f"negative positions are refused, not counted from the end"
        )
    return index.to(torch.int64)


class _Rows:
    """Which adapter each row of a target layer's input uses: ``index`` for ``len(index)`` rows,
    ``index.repeat_interleave(m)`` for ``m * len(index)`` rows (beams, return sequences)."""

    def __init__(self, index: Tensor) -> None:
        self.index = index
        self._by_rows: dict[tuple[int, torch.device], Tensor] = {}

    def __call__(self, rows: int, device: torch.device, module: str) -> Tensor:
        key = (rows, device)
        found = self._by_rows.get(key)
        if found is None:
            size = self.index.shape[0]
            if rows % size:
                raise ValueError(  # error: mixed-route-batch-rows
                    f"mixed adapters: target {module} got an input with {rows} rows on dim 0, which is not a multiple of "
                    f"len(index)={size}; the batch must be dim 0 of every target's input, one index entry per sequence "
                    f"(generate's num_beams / num_return_sequences expand rows by repeat_interleave, which is handled)"
                )
            found = self.index.to(device).repeat_interleave(rows // size)
            self._by_rows[key] = found
        return found


def _gather(tensors: Mapping[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    return {name: tensor.index_select(0, rows) for name, tensor in tensors.items()}


def _lora_factors(params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], info: LayerInfo) -> tuple[Tensor, Tensor]:
    """Each row's ``s_b A_bᵀ (n, d_in, r)`` and ``B_bᵀ (n, r, d_out)`` from its gathered tensors
    (``A (n, r, d_in)``, ``B (n, d_out, r)``); a rank-padded stack's padding masked out."""
    lora_a, lora_b = params["lora_A"], params["lora_B"]
    if RANK_MASK in buffers:  # rank-padded stack: padded rank entries never reach the output
        mask = buffers[RANK_MASK].to(lora_a.dtype)
        lora_a, lora_b = lora_a * mask[:, :, None], lora_b * mask[:, None, :]
    scale = lora_scale(info, buffers)
    if isinstance(scale, Tensor):
        scale = scale.to(lora_a.dtype).reshape(-1, 1, 1)
    # Contiguous (n, r, d_out): autograd then computes both backward products with their long
    # axis last, as add_low_rank's single-adapter path does.
    return (lora_a * scale).transpose(1, 2), lora_b.transpose(1, 2).contiguous()


def _gathered_lora(a_t: Tensor, b_t: Tensor, info: LayerInfo, x: Tensor, y: Tensor, training: bool) -> Tensor:
    """``y + (x_b s_b A_bᵀ) B_bᵀ`` per row ``b``: ``x (n, ..., d_in)``, ``y (n, ..., d_out)`` the
    frozen layer's output, ``a_t (n, d_in, r)`` and ``b_t (n, r, d_out)`` from :func:`_lora_factors`."""
    n = x.shape[0]
    dropped = lowrank_input(x, types.SimpleNamespace(training=training), info)
    h = torch.bmm(dropped.reshape(n, -1, x.shape[-1]).to(a_t.dtype), a_t)
    flat_y = y.reshape(n, -1, y.shape[-1])
    if flat_y.dtype == h.dtype and not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None:
        # The frozen layer's output is fresh and no backward formula reads it: accumulate in place
        # (as the single-adapter path does), no copy of the (n, L, d_out) activations.
        return flat_y.baddbmm_(h, b_t).view(y.shape)
    return (flat_y + torch.bmm(h, b_t).to(flat_y.dtype)).view(y.shape)


def _target_forward(adapter: Adapter, layer: AdapterLayer, rows: _Rows) -> Any:
    """The replacement ``forward`` of one target module (an Application forward)."""
    target, info, variant, dtype = layer.target, layer.info, adapter.variant, adapter.spec.dtype
    params, buffers = adapter.layer_tensors(layer)
    gathered = _gathered_path(variant.name)
    layout = module_forward(target.layout)
    sources = (*params.values(), *buffers.values())
    # Inference only (no autograd, no transform): each row count's gathered factors, computed once
    # per block (every decoding step reuses them), keyed on the adapter tensors' version counters
    # so an in-place update of an adapter inside the block is seen.
    factors: dict[tuple[int, torch.device], tuple[tuple[int, ...], tuple[Tensor, Tensor]]] = {}

    def lora_factors(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        cacheable = not torch.is_grad_enabled() and torch._C._functorch.peek_interpreter_stack() is None
        versions = tuple(t._version for t in sources) if cacheable else ()
        if cacheable:
            found = factors.get((n, device))
            if found is not None and found[0] == versions:
                return found[1]
        index = rows(n, device, target.module)
        out = _lora_factors(_gather(params, index), _gather(buffers, index), info)
        if cacheable:
            factors[(n, device)] = (versions, out)
        return out

    def forward(module: nn.Module, inner: Any, x: Tensor) -> Tensor:
        kind = kind_of_tensor(module.weight)
        base_call = inner if kind is None else frozen_call(module, kind)
        if gathered:
            a_t, b_t = lora_factors(x.shape[0], x.device)
            return _gathered_lora(a_t, b_t, info, x, base_call(x), module.training)
        index = rows(x.shape[0], x.device, target.module)
        weight = canonical_weight(module.weight, target.layout)
        bias, training = module.bias, module.training

        def one_row(p: dict[str, Tensor], b: dict[str, Tensor], x_row: Tensor) -> Tensor:
            x_op, finish = layout.prepare(x_row, target.d_out)
            step = VariantStep(variant, p, b, info, dtype)
            return finish(step.activation(x_op, LayerCall(weight, bias, base_call, training)))

        # "different": the adapter's dropout (training only) draws an independent mask per row,
        # as one batched call would.
        return torch.vmap(one_row, randomness="different")(_gather(params, index), _gather(buffers, index), x)

    return forward


def _mixed_application(
    model: nn.Module, adapters: Any, index: Any, base: Mapping[str, Tensor] | None, where: str
) -> Application:
    """Every check at the boundary, then the Application that installs the per-row forwards."""
    check_model(model, where)
    stacked = _stacked(adapters, where)
    size = stacked.stack_shape[0]
    index = _checked_index(index, size, where)
    if base is None:
        base = base_params(model)
    else:
        check_base(base, where)
        check_params(model, base)
        base = detached_base(base)
    modules = dict(model.named_modules())
    members = list(adapters) if isinstance(adapters, (list, tuple)) else [_member(stacked, 0)]
    for member in members:
        check_layouts(model, member, where, modules)
        _check(base, member, quantized_ok=True)
        check_adapter_placement(base, member, where)
    tied = sorted(f"{layer.target.weight_key} (also {', '.join(layer.target.tied_keys)})" for layer in stacked.layers if layer.target.tied_keys)
    if tied:
        raise ValueError(  # error: mixed-route-tied
            f"{where} adapts each target at its module's call, but target weight(s) {tied} are also used elsewhere under "
            f"another name, which would see the base weight; leave the tied weight (the embedding / output head) out of "
            f"the targets"
        )
    quantized = sorted(layer.target.module for layer in stacked.layers if kind_of_tensor(base[layer.target.weight_key]) is not None)
    if quantized and not _gathered_path(stacked.spec.variant):
        gathered = sorted(name for name in list_variants() if _gathered_path(name))
        raise ValueError(  # error: mixed-route-quantized
            f"{where}: targets {quantized[:4]} are quantized, and mixed adapters on quantized layers are supported for "
            f"the LoRA-form variants {gathered} only (variant {stacked.spec.variant!r} runs its activation form under "
            f"vmap, which the quantized op does not support); dequantize the base, or use lora_func.adapted per tenant"
        )
    refuse_checkpointing_in_transform(model)
    index = index.to(base[stacked.layers[0].target.weight_key].device) if stacked.layers else index
    rows = _Rows(index)
    forwards = {layer.target.module: _target_forward(stacked, layer, rows) for layer in stacked.layers}
    forwards = {**frozen_forwards(model, exclude=forwards, modules=modules), **forwards}
    trainable = tuple(t for a in members for t in a.params.values()) if isinstance(adapters, (list, tuple)) else tuple(stacked.params.values())
    params = swapped_on(base, modules, is_fsdp_model(modules), where)
    return Application(model, params, forwards, trainable=trainable, modules=modules)


def mixed_adapted_call(
    model: nn.Module,
    adapters: Sequence[Adapter] | AdapterLike,
    index: Tensor,
    *args: Any,
    base: Mapping[str, Tensor] | None = None,
    **kwargs: Any,
) -> Any:
    """``model(*args, **kwargs)`` where batch row ``b`` uses adapter ``index[b]``; the model untouched.

    Args:
      adapters: ``K`` adapters of one variant, targets and options (ranks and alphas may differ):
        a list, or one stacked adapter (:func:`lora_func.stack`, ``stack_shape (K,)``).
      index: ``(B,)`` int64 (or int32) tensor, values in ``[0, K)``, one per row of the batch;
        repeats are fine, unused members get zero gradient.
      args, kwargs: the model's inputs, batched as usual (``input_ids (B, T)``,
        ``attention_mask (B, T)`` with left or right padding, ``labels``).

    Returns the model's output as is (``logits (B, T, V)``; a loss from ``labels`` is the model's
    own batch loss). Works with any attention implementation and ``use_cache=True``, since only
    the target layers change. Differentiable: with a list of adapters whose params require grad,
    ``loss.backward()`` fills each one's ``.grad`` with the gradient of the loss through its own
    rows; under ``torch.func.grad`` over a stack's params (``adapters=stack.with_params(p)``)
    likewise. Activation checkpointing recomputes with the same adapters. ``base``: as in
    :func:`lora_func.adapted_call`. See :func:`mixed_adapted` for generation.
    """
    return _mixed_application(model, adapters, index, base, "mixed_adapted_call")(*args, **kwargs)


@contextlib.contextmanager
def mixed_adapted(
    model: nn.Module, adapters: Sequence[Adapter] | AdapterLike, index: Tensor
) -> Iterator[nn.Module]:
    """Within the ``with`` block, batch row ``b`` of every call of ``model`` uses adapter
    ``index[b]``; on exit (also on error) the model is as it was. For ``model.generate``::

        with torch.no_grad(), lora_func.mixed_adapted(model, [tenant_a, tenant_b], torch.tensor([1, 0, 1])):
            tokens = model.generate(input_ids, attention_mask=mask, max_new_tokens=20)

    ``adapters`` and ``index``: as in :func:`mixed_adapted_call`. Each call's batch must have
    ``len(index)`` rows, or a multiple ``m * len(index)`` laid out as ``repeat_interleave(m)``
    (``num_beams``, ``num_return_sequences``). The base weights are never written (the block
    reparametrizes the model with detached views and swaps the target modules' ``forward``).
    A list of adapters is stacked once, on entering the block (its values then are used); a
    stack passed as such is read in place (an in-place update inside the block is seen).
    Not thread-safe: while the block runs, every caller of ``model`` goes through the mixed
    route with this ``index``; serve concurrent requests by batching them into one block.
    """
    application = _mixed_application(model, adapters, index, None, "mixed_adapted")
    with application.applied():
        yield model
