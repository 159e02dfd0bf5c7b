"""Stacking adapters along a leading axis, for ``torch.func.vmap``: :func:`stack`,
:func:`unstack` and :func:`take` over the adapter tree (:mod:`lora_func.adapter`).

Adapters of one structure stack tensor by tensor. Leaf adapters of different ranks are
zero-padded along their variant's rank axes to the largest rank, and each layer gets a rank
mask and the member's own alpha (:data:`~lora_func.variants.RANK_MASK`,
:data:`~lora_func.variants.RANK_ALPHA`), so each member keeps its own scale; the member's own
``(spec, layers)`` are kept so that :func:`unstack` gives it back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lora_func.adapter import (
    SHARED,
    Adapter,
    AdapterLike,
    AdapterNode,
    Combinator,
    SharedTensors,
    leaf_adapters,
)
from lora_func.spec import AdapterSpec
from lora_func.targeting import stored_shape
from lora_func.variants import LayerInfo, Variant
from lora_func.variants._contract import RANK_ALPHA, RANK_MASK

__all__ = ["stack", "take", "unstack"]


def _info_key(info: LayerInfo) -> tuple:
    return (info.d_in, info.d_out, info.has_bias, info.options)


def _spec_key(spec: AdapterSpec) -> tuple:
    return (spec.variant, spec.targets, spec.dtype, spec.layer_types, spec.tied, spec.options)


def _pad_to(tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    pads: list[int] = []
    for have, want in reversed(list(zip(tensor.shape, shape, strict=True))):
        pads += [0, want - have]
    return torch.nn.functional.pad(tensor, pads) if any(pads) else tensor


def _stack_adapters(adapters: list[Adapter]) -> Adapter:
    first = adapters[0]
    for i, other in enumerate(adapters[1:], start=1):
        if _spec_key(other.spec) != _spec_key(first.spec):
            raise ValueError(  # error: stack-mismatch
                f"stack(): adapter {i} has spec {other.spec} but adapter 0 has {first.spec}; only adapters of one "
                f"variant, targets, dtype and options stack (ranks and alpha may differ)"
            )
        mine = [(layer.target, _info_key(layer.info), [n for n, _ in layer.param_shapes], [n for n, _ in layer.buffer_shapes]) for layer in other.layers]
        ref = [(layer.target, _info_key(layer.info), [n for n, _ in layer.param_shapes], [n for n, _ in layer.buffer_shapes]) for layer in first.layers]
        if mine != ref and [m[:2] for m in mine] == [m[:2] for m in ref]:
            module, have, want = next((b[0].module, b[2] + b[3], a[2] + a[3]) for a, b in zip(ref, mine, strict=True) if a != b)
            raise ValueError(  # error: stack-tensor-sets
                f"stack(): the {first.spec.variant} adapter {i} has tensors {have} on {module}, adapter 0 has {want}: "
                f"this variant's tensors depend on the rank (or the options), so these ranks cannot be zero-padded into "
                f"one stack; stack adapters of ranks that give the same tensors (docs/variants.md)"
            )
        if mine != ref:
            diff = [
                a.target.module if a.target.module != b.target.module or stored_shape(a.target) == stored_shape(b.target)
                else f"{a.target.module} of shape {stored_shape(b.target)} here, {stored_shape(a.target)} in adapter 0"
                for a, b in zip(first.layers, other.layers, strict=False)
                if (a.target, _info_key(a.info)) != (b.target, _info_key(b.info))
            ]
            raise ValueError(  # error: stack-other-layers
                f"stack(): adapter {i} adapts other layers than adapter 0 ({diff[:5] or 'a different number of layers'}); "
                f"build the adapters from one model and one AdapterSpec (ranks may differ)"
            )
        if other.stack_shape != first.stack_shape or other.members is not None:
            raise ValueError(f"stack(): adapter {i} is itself stacked (stack_shape {other.stack_shape}); unstack it first")  # error: stack-nested
    if first.members is not None:
        raise ValueError("stack(): adapter 0 is itself a rank-padded stack; unstack it first")  # error: stack-nested-padded
    devices = [sorted({str(t.device) for t in (*a.params.values(), *a.buffers.values())}) for a in adapters]
    if any(d != devices[0] for d in devices[1:]):
        i = next(i for i, d in enumerate(devices) if d != devices[0])
        raise ValueError(  # error: stack-devices
            f"stack(): adapter {i}'s tensors are on {devices[i]}, adapter 0's on {devices[0]}; a stack is one tensor per "
            f"key: move them to one device first (adapter.with_params({{k: v.to(device) ...}}), or lora_func.load(path, "
            f"model=model) onto the model's)"
        )
    if all(other.layers == first.layers and other.shared == first.shared for other in adapters[1:]):
        same_params = {k: torch.stack([a.params[k] for a in adapters]) for k in first.params}
        same_buffers = {k: _stack_buffer(k, [a.buffers[k] for a in adapters]) for k in first.buffers}
        return Adapter._unchecked(same_params, same_buffers, first.spec, first.layers, None, first.shared, None)
    # Rank-padded: zero-pad every tensor to the largest shape (only rank axes differ) and give
    # each layer a rank mask and the member's alpha, so each keeps its own scale.
    variant = first.variant
    # The mask and alpha make each member's scale alpha/r: in the adapter dtype, but at least
    # fp32 (a bf16 alpha such as 0.1 would be rounded, a bf16 rank above 256 inexact).
    scale_dtype = torch.promote_types(first.spec.dtype, torch.float32)
    params: dict[str, list[Tensor]] = {k: [] for k in first.params}
    buffers: dict[str, list[Tensor]] = {k: [] for k in first.buffers}
    layers = []
    for j, layer in enumerate(first.layers):
        column = [a.layers[j] for a in adapters]
        r_max = max(lay.info.r for lay in column)
        p_shapes = tuple((n, tuple(max(s) for s in zip(*(dict(lay.param_shapes)[n] for lay in column), strict=True))) for n, _ in layer.param_shapes)
        b_shapes = tuple((n, tuple(max(s) for s in zip(*(dict(lay.buffer_shapes)[n] for lay in column), strict=True))) for n, _ in layer.buffer_shapes)
        for name, shape in p_shapes + b_shapes:
            offset = 1 if layer.target.experts is not None else 0  # the expert axis comes first
            _check_rank_axes(variant, name, shape, [(lay.target.module, dict(lay.param_shapes + lay.buffer_shapes)[name]) for lay in column], offset)
        module = layer.target.module
        for a, lay in zip(adapters, column, strict=True):
            for name, shape in p_shapes:
                params[f"{module}.{name}"].append(_pad_to(a.params[f"{module}.{name}"], shape))
            for name, shape in b_shapes:
                buffers[f"{module}.{name}"].append(_pad_to(a.buffers[f"{module}.{name}"], shape))
            device = a.params[f"{module}.{p_shapes[0][0]}"].device if p_shapes else None
            mask = (torch.arange(r_max, device=device) < lay.info.r).to(scale_dtype)
            buffers.setdefault(f"{module}.{RANK_MASK}", []).append(mask)
            buffers.setdefault(f"{module}.{RANK_ALPHA}", []).append(torch.tensor(float(lay.info.alpha), dtype=scale_dtype, device=device))
        layers.append(
            dataclasses.replace(
                layer,
                info=dataclasses.replace(layer.info, r=r_max),
                param_shapes=p_shapes,
                buffer_shapes=b_shapes + ((RANK_MASK, (r_max,)), (RANK_ALPHA, ())),
            )
        )
    # The padded layers' layout holds r_max, as a reload of the stack numbers them (LayerInfo.numbered).
    numbered = LayerInfo.numbered({str(j): layer.info for j, layer in enumerate(layers)}).values()
    layers = [dataclasses.replace(layer, info=info) for layer, info in zip(layers, numbered, strict=True)]
    shared = None
    if first.shared is not None:
        # Shared tensors pad along their rank axes as the layers' do; each member's own shapes
        # are kept for unstack (the layers' rank masks mask them in the forms).
        shared = _pad_shared(variant, adapters, params, buffers)
    return Adapter._unchecked(
        {k: torch.stack(v) for k, v in params.items()},
        {k: torch.stack(v) for k, v in buffers.items()},
        first.spec,
        layers,
        [(a.spec, a.layers) for a in adapters],
        shared,
        None if shared is None else [a.shared for a in adapters],
    )


def _stack_buffer(key: str, tensors: Sequence[Tensor]) -> Tensor:
    """The members' buffer ``key`` stacked; a buffer that every member holds equal (a basis drawn
    from one seed: VeRA's ``vera_A``; a layer's buffers derived from the base or a seed: TinyLoRA's
    SVD factors and projections, UniLoRA's indices) as an ``expand`` of the first, one copy for
    all members (buffers are never written, so the stride-0 view is safe)."""
    first = tensors[0]
    if all(
        t is first or (t.shape == first.shape and t.dtype == first.dtype and t.device == first.device and torch.equal(t, first))
        for t in tensors[1:]
    ):
        return first.unsqueeze(0).expand(len(tensors), *first.shape)
    return torch.stack(list(tensors))


def _pad_shared(
    variant: Variant, adapters: Sequence[Adapter], params: dict[str, list[Tensor]], buffers: dict[str, list[Tensor]]
) -> SharedTensors:
    """Zero-pad every member's shared tensors to the largest shape (rank axes only) into
    ``params`` / ``buffers``; the padded shapes."""
    column = [cast(SharedTensors, a.shared) for a in adapters]  # one spec, so the same names
    out = []
    for kind, flat in (("param_shapes", params), ("buffer_shapes", buffers)):
        padded = []
        for name, _ in getattr(column[0], kind):
            have = [dict(getattr(s, kind))[name] for s in column]
            shape = tuple(max(sizes) for sizes in zip(*have, strict=True))
            _check_rank_axes(variant, name, shape, [(f"the shared {name}", one) for one in have])
            flat[f"{SHARED}.{name}"] = [
                _pad_to((a.params if kind == "param_shapes" else a.buffers)[f"{SHARED}.{name}"], shape) for a in adapters
            ]
            padded.append((name, shape))
        out.append(tuple(padded))
    return SharedTensors(param_shapes=out[0], buffer_shapes=out[1])


def _check_rank_axes(
    variant: Variant, name: str, padded: tuple[int, ...], shapes: Sequence[tuple[str, tuple[int, ...]]], offset: int = 0
) -> None:
    """Raise unless each ``(where, shape)`` of tensor ``name`` differs from ``padded`` on rank axes
    only; ``offset``: leading axes before the variant's own (an expert parameter's expert axis)."""
    bad = [where for where, shape in shapes if any(
        have != want and not _is_rank_axis(variant, name, axis - offset) for axis, (have, want) in enumerate(zip(shape, padded, strict=True))
    )]
    if bad:
        raise ValueError(  # error: stack-not-rank-axis
            f"stack(): {variant.name} tensor {name!r} of {bad[0]} differs in shape on an axis that is not a "
            f"rank axis; these adapters cannot be padded to one stack"
        )


def _is_rank_axis(variant: Variant, name: str, axis: int) -> bool:
    """A rank axis, or an axis sized by the rank that the variant masks itself (``padded_axes``)."""
    name = name.partition("@")[0]  # a grouped shared tensor's slot (Variant.groups)
    for axes in (variant.rank_axes.get(name, ()), variant.padded_axes.get(name, ())):
        if axis == axes if isinstance(axes, int) else axis in axes:
            return True
    return False


def stack(*adapters: AdapterLike | Sequence[AdapterLike]) -> AdapterLike:
    """One adapter whose tensors have a new leading axis of size ``len(adapters)``.

    ``stack([a, b])`` or ``stack(a, b)`` (as :func:`lora_func.compose`); one adapter alone is
    refused (a one-member stack is ``stack([a])``).

    ``torch.func.vmap(f)(stack([a, b]))`` runs ``f(a)`` and ``f(b)`` at once. The adapters
    must share variant, targets and options; their ranks (and alphas) may differ: then every
    tensor is zero-padded along the variant's rank axes to the largest rank, and each layer
    gets two buffers, ``rank_mask (K, r_max)`` and ``rank_alpha (K,)``, so each member keeps
    its own scale and its padded entries never reach the output (their gradient is exactly
    zero). :func:`unstack` gives the originals back. Composed/Combined adapters of the same
    structure stack part by part.
    """
    given: Any = adapters[0] if len(adapters) == 1 else adapters
    if isinstance(given, (AdapterNode, Mapping, str)) or not isinstance(given, Iterable):
        raise TypeError(  # error: stack-not-a-list
            f"stack() expects a list of adapters, got {type(given).__name__}; e.g. lora_func.stack([adapter_0, adapter_1]) "
            f"or lora_func.stack(adapter_0, adapter_1)"
        )
    members: list[AdapterLike] = list(given)
    if not members:
        raise ValueError("stack() needs at least one adapter")  # error: stack-empty
    for adapter in members:
        leaf_adapters(adapter)
    kinds = {(type(a), a.static() if isinstance(a, Combinator) else ()) for a in members}
    if len(kinds) > 1:
        shown = sorted(f"{kind.__name__}{static if static else ''}" for kind, static in kinds)
        raise TypeError(f"stack(): mixed kinds {shown}; stack adapters of one kind")  # error: stack-mixed-kinds
    first = members[0]
    if not isinstance(first, (Adapter, Combinator)):  # another leaf type (a prompt) stacks itself
        return type(first).stack_members(members)  # type: ignore[attr-defined]  # a leaf type outside the tree (a prompt) defines it
    if not isinstance(first, Combinator):
        leaves = cast("list[Adapter]", members)  # one kind: all Adapters
        return _as_leaves(_stack_adapters(leaves), leaves)
    n = {len(a.parts) for a in members}
    if len(n) > 1:
        raise ValueError(f"stack(): {type(first).__name__} adapters with different numbers of parts {sorted(n)}")  # error: stack-parts
    parts = [stack([a.parts[i] for a in members]) for i in range(len(first.parts))]
    own = {}
    for name in first.tensor_fields():
        values = [a.own_params()[name] for a in members]
        stacked = torch.stack(values)
        if all(_plain_leaf(v) for v in values):
            stacked = stacked.detach().requires_grad_(any(v.requires_grad for v in values))
        own[name] = stacked
    return first.rebuild(parts, own)


def _plain_leaf(tensor: Tensor) -> bool:
    """A tensor without autograd history, outside any torch.func transform."""
    return tensor.is_leaf and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def _as_leaves(stacked: Adapter, sources: Sequence[Adapter]) -> Adapter:
    """``stacked`` with its params as new leaves (``requires_grad=True``) when every source
    param is a plain leaf: ``torch.stack`` gives non-leaf tensors, which ``torch.optim``
    refuses. Stacking inside ``torch.func.grad`` or through an autograd graph keeps the
    history, so gradients still reach the members there."""
    if not all(_plain_leaf(t) for a in sources for t in a.params.values()):
        return stacked
    params = {k: v.detach().requires_grad_(True) for k, v in stacked.params.items()}
    return Adapter._unchecked(
        params, stacked.buffers, stacked.spec, stacked.layers, stacked.members, stacked.shared, stacked.member_shared
    )


def unstack(adapter: AdapterLike) -> list[AdapterLike]:
    """The inverse of :func:`stack`: the adapters along the leading axis (a rank-padded stack
    gives each member back at its own rank, without the padding and mask buffers)."""
    leaf_adapters(adapter, "unstack(adapter)")
    if not adapter.stack_shape:
        raise ValueError("unstack(): this adapter is not stacked (it has no leading stack axis)")  # error: unstack-not-stacked
    return [_member(adapter, k) for k in range(adapter.stack_shape[0])]


def _member(adapter: AdapterLike, index: int | Tensor) -> AdapterLike:
    """The stack position ``index`` of every tensor of the tree: an int gives one member (a
    rank-padded leaf back at its own rank), a 1-D tensor a stack of those members."""
    if isinstance(adapter, Combinator):
        own = {name: t[index] for name, t in adapter.own_params().items()}
        return adapter.rebuild([_member(part, index) for part in adapter.parts], own)
    if not isinstance(adapter, Adapter) or adapter.members is None:  # (another leaf type: a prompt)
        return pytree.tree_map(lambda t: t[index], adapter)
    if isinstance(index, Tensor):
        taken = pytree.tree_map(lambda t: t[index], adapter)
        positions = [int(i) for i in index.reshape(-1).tolist()]
        members = [adapter.members[i] for i in positions]
        member_shared = None if adapter.member_shared is None else [adapter.member_shared[i] for i in positions]
        return Adapter._unchecked(taken.params, taken.buffers, taken.spec, taken.layers, members, taken.shared, member_shared)
    spec, layers = adapter.members[index]
    shared = None if adapter.member_shared is None else adapter.member_shared[index]
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    groups = [(layer.target.module, layer.param_shapes, layer.buffer_shapes) for layer in layers]
    groups += [(SHARED, shared.param_shapes, shared.buffer_shapes)] if shared is not None else []
    for module, param_shapes, buffer_shapes in groups:
        for flat, out, shapes in ((adapter.params, params, param_shapes), (adapter.buffers, buffers, buffer_shapes)):
            for name, shape in shapes:
                key = f"{module}.{name}"
                out[key] = flat[key][index][tuple(slice(0, n) for n in shape)]
    return Adapter._unchecked(params, buffers, spec, layers, None, shared)


def take(adapter: AdapterLike, index: int | Tensor) -> AdapterLike:
    """The stack members at ``index``: an int gives one adapter (as :func:`unstack`), a 1-D
    integer tensor gives a stacked adapter of ``len(index)`` members (e.g. one adapter per
    example of a batch, for a mixed-adapter batch under ``vmap``)."""
    leaf_adapters(adapter, "take(adapter, index)")
    if not adapter.stack_shape:
        raise ValueError("take(): this adapter is not stacked; build one with lora_func.stack([...])")  # error: take-not-stacked
    size = adapter.stack_shape[0]
    if isinstance(index, int) and not isinstance(index, bool):
        if not 0 <= index < size:
            raise IndexError(f"take(): index {index} is outside [0, {size}) (the stack has {size} adapters); pass 0 <= index < {size}")  # error: take-index-range
        return _member(adapter, index)
    # A bool would index as a new axis, a bool tensor as a mask, a float tensor not at all.
    if not isinstance(index, Tensor) or index.dtype not in (torch.int64, torch.int32) or index.dim() != 1:
        shown = f"a {index.dtype} tensor of shape {tuple(index.shape)}" if isinstance(index, Tensor) else repr(index)
        raise TypeError(  # error: take-index-type
            f"take(): index must be an int or a 1-D int64/int32 tensor of stack positions, got {shown}; "
            f"e.g. take(stack, 0) or take(stack, torch.tensor([0, 1, 0]))"
        )
    outside = _outside(index, size)
    if outside:
        raise IndexError(  # error: take-index-values
            f"take(): index has values {outside} outside [0, {size}) (the stack has {size} adapters); negative "
            f"positions are refused rather than counted from the end"
        )
    return _member(adapter, index)


def _outside(index: Tensor, size: int) -> list[int]:
    """The values of ``index`` outside ``[0, size)`` (at most 5); none can be read under vmap."""
    if torch._C._functorch.is_functorch_wrapped_tensor(index):
        return []
    bad = index[(index < 0) | (index >= size)]
    return bad.unique()[:5].tolist()
