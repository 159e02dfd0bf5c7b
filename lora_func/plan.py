"""The validated plan of an adapted call: every structural check once, then thin runners.

A :class:`Plan` is built from a model (or a base dict), an adapter's *structure* (its tree of
nodes, each leaf's spec and layers, each combinator's static configuration) and the route. The
build runs every structural check of the adapter against the model, in one walk of the adapter
tree, and keeps per target what applying needs (:class:`TargetPlan`: names, layout, tied names,
quantized / sharded flags) and how to build each target's op from the adapter's tensors. It
reads no tensor values, so ``adapter.with_params(...)`` (a training loop's new adapter each
step) runs under the same plan: hold one with :func:`lora_func.make_plan`, or let the library find it in
its per-model cache (:func:`cached_plan`), keyed by structure, held weakly by the model.

Applying is then a thin loop: :meth:`Plan.check_tensors` (shapes, devices and dtypes of the
adapter's tensors: what ``with_params`` may change) and :meth:`Plan.ops` (one layer op per target,
no walk of the tree). The runners are :mod:`lora_func.overlay` (``overlay``, ``merge_overlay``,
``overlay_mode``), :mod:`lora_func.call` (``adapted_call``, ``adapted``, the module route) and
:mod:`lora_func.many` (many adapters per batch).
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import Tensor, nn

from lora_func._model import base_params, check_base_params
from lora_func._sharded import is_fsdp_model, is_sharded
from lora_func._layer_ops import LayerOp, variant_op
from lora_func.adapter import SHARED, Adapter, AdapterLike, AdapterNode, walk
from lora_func.checks import check_base, check_float_targets
from lora_func.quantized import kind_of_tensor, logical_shape
from lora_func.targeting import MERGED_ONLY, Target, close_names, module_kind, stored_shape
from lora_func.variants import LayerInfo, Variant, get_variant
from lora_func.variants._contract import group_view

__all__ = [
    "ROUTES",
    "Plan",
    "Route",
    "TargetPlan",
    "adapter_tensors",
    "cached_plan",
    "check_plan_fits",
    "checked_index",
    "detached_base",
    "build_plan",
    "normalised_base",
    "overlay_plan",
    "refuse_tied",
]

Route = Literal["auto", "overlay", "module"]
ROUTES: tuple[str, ...] = get_args(Route)
# Where a plan applies an adapter: "auto" is resolved when the plan is built.
ResolvedRoute = Literal["overlay", "module"]
_INDEX_DTYPES = (torch.int64, torch.int32)  # what tensor indexing accepts as indices (uint8 would be a mask)


def adapter_tensors(adapter: AdapterLike) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(params, buffers)`` of any adapter-tree node, flat (as ``node.params``, ``node.buffers``)."""
    node: Any = adapter  # every node has them; AdapterNode does not declare them (yet)
    return node.params, node.buffers


# ----------------------------------------------------------------------------- the base dict


def detached_base(base: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``base`` with every tensor that requires grad detached (no copy), one object per
    object (tied names stay tied). A dict built from ``model.named_parameters()`` holds the
    model's own ``requires_grad=True`` tensors: ``backward()`` would fill their ``.grad``
    (full fine-tuning cost, and a changed model)."""
    seen: dict[int, Tensor] = {}
    out = {}
    for key, tensor in base.items():
        if id(tensor) not in seen:
            seen[id(tensor)] = tensor.detach() if tensor.requires_grad else tensor
        out[key] = seen[id(tensor)]
    return out


def normalised_base(model: nn.Module, base: Mapping[str, Tensor] | None, where: str, *, known: Plan | None = None) -> dict[str, Tensor]:
    """The base dict every runner works on: ``base_params(model)`` when ``base`` is ``None``;
    else ``base`` checked (a mapping of names to tensors, exactly the model's names) and with
    every tensor that requires grad detached. ``known``: a plan whose build checked a dict with
    these same names against the model (the names check is skipped)."""
    if base is None:
        return base_params(model)
    check_base(base, where)
    if known is None or base.keys() != known.base_keys:
        check_base_params(model, base)
    return detached_base(base)


def checked_index(index: Any, size: int, where: str) -> Tensor:
    """``index`` as an int64 tensor after checking it picks one of ``size`` stack members per
    batch row: a non-empty 1-D int64/int32 tensor (or a list of ints), values in ``[0, size)``
    (a negative value would silently pick a member counted from the end)."""
    if isinstance(index, Sequence) and not isinstance(index, (str, bytes)) and index and all(
        isinstance(i, int) and not isinstance(i, bool) for i in index
    ):
        index = torch.tensor(list(index), dtype=torch.int64)  # a list, tuple or range of positions
    if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype not in _INDEX_DTYPES or index.numel() == 0:
        shown = f"a {index.dtype} tensor of shape {tuple(index.shape)}" if isinstance(index, Tensor) else type(index).__name__
        raise TypeError(  # error: mixed-route-index-type
            f"{where}: index must be a 1-D int64 or int32 tensor, not empty (one adapter position per batch row), got "
            f"{shown}; e.g. torch.tensor([2, 0, 1, 0]) or a list of ints [2, 0, 1, 0]"
        )
    outside = sorted({int(i) for i in index.tolist() if not 0 <= i < size})
    if outside:
        raise IndexError(  # error: mixed-route-index-range
            f"{where}: index has values outside [0, {size}) ({size} adapters): index {', '.join(map(str, outside[:5]))}; "
            f"negative positions are refused, not counted from the end"
        )
    return index.to(torch.int64)


# ----------------------------------------------------------------------------- the plan


class TargetPlan(NamedTuple):
    """One target as a plan applies it.

    Attributes:
      target: names (module, weight, bias, tied), layout and sizes.
      quantized: the base weight is of a registered quantized kind (only the module route
        applies to it).
      sharded: the base weight is an FSDP2 ``DTensor``.
    """

    target: Target
    quantized: bool
    sharded: bool


class _Leaf(NamedTuple):
    """How to build one leaf adapter's layer ops: per layer ``(weight key, info, ((short name, flat
    key), ...) of params, the same of buffers, the target's stored layout)``; ``shared``:
    the leaf holds tensors every layer reads (``Variant.shared_init``)."""

    variant: Variant
    dtype: torch.dtype
    layers: tuple[tuple[str, LayerInfo, tuple[tuple[str, str], ...], tuple[tuple[str, str], ...], str], ...]
    shared: bool = False
    # Per layer (as ``layers``), its group key of each grouped shared tensor (Variant.groups).
    groups: tuple[tuple[tuple[str, str], ...], ...] = ()


class _Node(NamedTuple):
    """How a combinator's parts' layer ops combine: its parts' programs, and per weight key (in
    application order) the indices of the parts that adapt it."""

    parts: tuple[_Leaf | _Node, ...]
    present: tuple[tuple[str, tuple[int, ...]], ...]


def _ops(program: _Leaf | _Node, node: Any) -> dict[str, LayerOp]:
    if isinstance(program, _Leaf):
        params, buffers = node.params, node.buffers
        # Tensors every layer reads (one leaf each, so their gradient sums over the layers).
        shared_params, shared_buffers = node.shared_tensors() if program.shared else ({}, {})
        if program.groups:  # shared within groups of layers: each layer sees its group's
            return {
                key: variant_op(
                    program.variant, ({n: params[k] for n, k in p_keys}, {n: buffers[k] for n, k in b_keys}),
                    (group_view(shared_params, dict(groups)), group_view(shared_buffers, dict(groups))), info, program.dtype, layout=layout,
                )
                for (key, info, p_keys, b_keys, layout), groups in zip(program.layers, program.groups, strict=True)
            }
        return {
            key: variant_op(
                program.variant, ({n: params[k] for n, k in p_keys}, {n: buffers[k] for n, k in b_keys}), (shared_params, shared_buffers),
                info, program.dtype, layout=layout,
            )
            for key, info, p_keys, b_keys, layout in program.layers
        }
    per_part = [_ops(sub, part) for sub, part in zip(program.parts, node.parts, strict=True)]
    return {key: node.layer_op([per_part[k][key] for k in present], present) for key, present in program.present}


@dataclasses.dataclass(frozen=True)
class _TensorCheck:
    """One adapter tensor as the plan expects it: flat key, shape without stack axes, the device
    of its target weight, whether it is trainable, and what to say when it is stacked."""

    key: str
    shape: tuple[int, ...]
    device: torch.device | None
    param: bool
    own: tuple[str, str] | None = None
    dtype: torch.dtype | None = None  # a leaf's trainable tensors: the adapter dtype (spec.dtype)  # (node tag, tensor name) of a combinator's own tensor


class Plan:
    """A validated plan: see the module docstring. Build one with :func:`lora_func.make_plan`.

    Attributes:
      route: ``"overlay"`` (the parameter dict) or ``"module"`` (at each target module's call).
      targets: weight key -> :class:`TargetPlan`, in application order.
      base_keys: the names of the base dict it was checked against.
      fsdp: the model has a ``fully_shard``-ed module.
    """

    __slots__ = ("__weakref__", "_checks", "_modules", "_program", "_tree", "_weights", "base_keys", "fsdp", "route", "structure", "targets")

    route: ResolvedRoute
    targets: dict[str, TargetPlan]
    base_keys: frozenset[str]
    fsdp: bool
    structure: tuple
    last: Any

    def __init__(
        self,
        route: ResolvedRoute,
        targets: dict[str, TargetPlan],
        program: _Leaf | _Node,
        checks: tuple[_TensorCheck, ...],
        base_keys: frozenset[str],
        structure: tuple,
        fsdp: bool = False,
        modules: dict[str, nn.Module] | None = None,
        tree: list[Any] | None = None,
    ) -> None:
        self.route, self.targets, self._program, self._checks = route, targets, program, checks
        self.base_keys, self.structure, self.fsdp, self._modules, self._tree = base_keys, structure, fsdp, modules, tree
        self._weights: tuple[tuple[str, type, torch.Size, torch.dtype, torch.device], ...] = ()

    def _record_weights(self, base: Mapping[str, Tensor]) -> Plan:
        self._weights = tuple((key, type(w), w.shape, w.dtype, w.device) for key in self.targets for w in (base[key],))
        return self

    def __repr__(self) -> str:
        return f"Plan(route={self.route!r}, targets={len(self.targets)})"

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """``dict(model.named_modules())`` of ``model``, which it was built for (the plan keeps the
        submodules only: what the model's weak cache holds must not keep the model alive)."""
        return {"": model, **(self._modules or {})}

    def ops(self, adapter: AdapterLike) -> dict[str, LayerOp]:
        """Per target weight key, the layer op that applies ``adapter`` there (an adapter of the
        plan's structure: checked by :meth:`check_tensors`)."""
        return _ops(self._program, adapter)

    def check_tensors(self, adapter: AdapterLike, where: str) -> None:
        """Raise unless every tensor of ``adapter`` has its unstacked shape, sits on its target
        weight's device and (for params) is floating-point: what ``with_params`` may change.
        Shapes and devices only, so it runs under ``torch.func`` transforms too."""
        params, buffers = adapter_tensors(adapter)
        for check in self._checks:
            tensor = (params if check.param else buffers)[check.key]
            if tensor.shape != check.shape or (check.device is not None and tensor.device != check.device) or (
                check.dtype is not None and tensor.dtype != check.dtype
            ):
                _raise_tensor_problem(self._checks, params, buffers, where)

    def matches(self, structure: tuple, base: Mapping[str, Tensor]) -> bool:
        """Whether this plan applies to an adapter of ``structure`` (:func:`structure_key`) on
        ``base``: the same base names, and every target weight of the tensor type (plain,
        quantized kind, sharded), shape, dtype and device it was built for."""
        if structure != self.structure or base.keys() != self.base_keys:
            return False
        for key, kind, shape, dtype, device in self._weights:
            w = base[key]
            if type(w) is not kind or w.shape != shape or w.dtype != dtype or w.device != device:
                return False
        return True

    def model_unchanged(self, model: nn.Module) -> bool:
        """Whether ``model`` has the modules (objects, classes, numbers of tensors) it was built on."""
        tree = self._tree
        return tree is not None and _same_tree(module_tree(model), tree)


def _raise_tensor_problem(checks: Sequence[_TensorCheck], params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], where: str) -> None:
    """The errors of :meth:`Plan.check_tensors`, in the order the checks were always made:
    a combinator's own tensors, every tensor's shape, then devices, then dtypes."""
    for check in checks:
        got = tuple((params if check.param else buffers)[check.key].shape)
        if check.own is not None and got != check.shape:
            hint = "it is stacked: call it under torch.func.vmap" if len(got) > len(check.shape) else f"keep {check.own[1]} at shape {check.shape}"
            tag, name = check.own
            raise ValueError(f"{tag} adapter {name} have shape {got}, expected {check.shape}; {hint}")  # error: combine-weights-shape
    for check in checks:
        got = tuple((params if check.param else buffers)[check.key].shape)
        if got != check.shape:
            hint = (
                "this adapter is stacked: call it under torch.func.vmap, or pick one with take()/unstack()"
                if got[len(got) - len(check.shape) :] == check.shape
                else "was it built with another spec?"
            )
            raise ValueError(f"adapter tensor {check.key} has shape {got}, expected {check.shape}; {hint}")  # error: overlay-tensor-shape
    misplaced, not_float = [], []
    for check in checks:
        tensor = (params if check.param else buffers)[check.key]
        if check.device is not None and tensor.device != check.device:
            misplaced.append(f"{check.key} on {tensor.device} (its target weight is on {check.device})")
        elif check.dtype is not None and tensor.dtype != check.dtype:
            # An adapter dict edited in place: computing in another dtype than the adapter
            # reports (and saves) is refused on every path, merged or lazy.
            not_float.append(f"{check.key} ({tensor.dtype}, the adapter dtype is {check.dtype})")
    if misplaced:
        raise ValueError(  # error: adapter-placement-device
            f"{where}: adapter tensors {sorted(misplaced)[:5]} are not on their target weight's device; move them "
            f"(adapter.with_params({{k: v.to(device) ...}}).with_buffers(...)), or load the adapter with "
            f"lora_func.load(path, model=model), which places every tensor on its layer's device"
        )
    if not_float:
        raise TypeError(  # error: adapter-placement-dtype
            f"{where}: adapter params {sorted(not_float)[:5]} are not in the adapter dtype (adapter.spec.dtype); the "
            f"low-rank path would truncate, promote or refuse them. Derive new values with adapter.with_params(params) "
            f"(tensors of the adapter dtype), or rebuild the adapter (init_adapter / load)"
        )


def check_plan_fits(plan: Any, adapter: AdapterLike, base: Mapping[str, Tensor], where: str, *, model: nn.Module | None = None) -> None:
    """Raise unless ``plan`` (passed as ``plan=``) was built for ``adapter``'s structure on
    ``base`` (and ``model``, when given; a parameter-dict overlay needs an overlay plan)."""
    fits = (
        isinstance(plan, Plan)
        and isinstance(adapter, AdapterNode)
        and plan.matches(structure_key(adapter), base)
        and (plan.model_unchanged(model) if model is not None else plan.route == "overlay")
    )
    if not fits:
        raise ValueError(  # error: plan-mismatch
            f"{where}: plan= was built for another adapter structure, base dict or model ({plan!r}); build it with "
            f"lora_func.make_plan(model, adapter) for this model and an adapter of this structure (with_params keeps it)"
        )


# ----------------------------------------------------------------------------- structure


def structure_key(adapter: AdapterLike) -> tuple:
    """What a plan depends on in an adapter: the node types, each leaf's spec and layers, each
    combinator's static configuration; no tensors (``with_params`` keeps it). A leaf's registered
    variant object is part of it: a variant registered again under its name gets a new plan."""
    node: Any = adapter
    if not node.parts:
        return (Adapter, node.spec, node.layers, node.members, node.shared, node.member_shared, get_variant(node.spec.variant))
    return (type(node), node.static(), tuple(structure_key(part) for part in node.parts))


def module_tree(model: nn.Module) -> list[Any]:
    """Every submodule of ``model`` with its class and its numbers of parameters and buffers:
    the structure a plan was validated against (a walk, but no names built). The model itself is
    left out: what keeps this list must not keep the model alive."""
    out: list[Any] = [type(model), len(model._parameters), len(model._buffers)]
    stack = [child for child in model._modules.values() if child is not None]
    while stack:
        module = stack.pop()
        out += (module, type(module), len(module._parameters), len(module._buffers))
        stack.extend(child for child in module._modules.values() if child is not None)
    return out


def _same_tree(a: list[Any], b: list[Any]) -> bool:
    return (len(a) == len(b) and all(map(operator.is_, a, b))) or a == b


# ----------------------------------------------------------------------------- the build


def refuse_tied(targets: Mapping[str, TargetPlan], where: str) -> None:
    """Raise when a target weight is also used under another name (``tied="both"``): a route that
    adapts a target at its module's call would leave the other name with the base weight."""
    tied = sorted(f"{key} (also {', '.join(t.target.tied_keys)})" for key, t in targets.items() if t.target.tied_keys)
    if tied:
        raise ValueError(  # error: route-module-tied
            f"{where} adapts each target at its module's call, but target weight(s) {tied} are also used elsewhere "
            f"under another name, which would see the base weight; use route='overlay' (adapted_call, adapted) for "
            f"tied targets, or leave the tied weight (the embedding / output head) out of the targets"
        )


def _check_layouts(modules: Mapping[str, nn.Module], targets: Sequence[Target], where: str) -> None:
    wrong = []
    for t in targets:
        module = modules.get(t.owner)
        if module is not None and module_kind(modules, t) != t.layout:
            wrong.append(f"{t.module}: adapter built for a {t.layout} layer, the model's is {module_kind(modules, t) or type(module).__name__}")
    if wrong:
        raise ValueError(  # error: adapter-layout
            f"{where}: {sorted(wrong)[:5]}; the stored weight layouts differ (Linear (out, in) vs Conv1D (in, out)), so "
            f"the outputs would be silently wrong. Build the adapter on this model (init_adapter or load_peft)"
        )


def _resolve_route(route: Any, fsdp: bool, quantized: bool) -> ResolvedRoute:
    if route not in ROUTES:
        raise ValueError(  # error: route-unknown
            f"route={route!r} is not one of {list(ROUTES)}; route='auto' picks the overlay for plain layers and the "
            f"module-call route for quantized ones and for models sharded by FSDP2"
        )
    if fsdp and route == "overlay":
        raise ValueError(  # error: fsdp-overlay-route
            "route='overlay' on a model sharded by FSDP2 (fully_shard): FSDP2 installs its gathered weights at each "
            "module's call over anything a parameter dict put there, so the adapter would be silently ignored; use "
            "route='auto' or route='module' (the adapter is applied at each target's call, after FSDP2's all-gather)"
        )
    if fsdp:
        return "module"
    if route == "auto":
        return "module" if quantized else "overlay"
    return "module" if route == "module" else "overlay"


def build_plan(
    base: Mapping[str, Tensor],
    adapter: AdapterLike,
    *,
    model: nn.Module | None = None,
    modules: dict[str, nn.Module] | None = None,
    route: Route = "overlay",
    where: str = "overlay",
) -> Plan:
    """Check ``adapter``'s structure against ``base`` (and ``model``'s modules, when given) and
    return the :class:`Plan` that applies it; raises, naming the culprit, before any work.

    Args:
      base: the base dict (``lora_func.base_params(model)``): names, shapes, devices, kinds.
      adapter: an adapter of the structure to plan for (its tensors' shapes are checked too).
      model: the model, for a call that runs it (layouts of the target modules, FSDP2, the
        module route); ``None`` for a parameter-dict overlay.
      route: ``"auto"`` picks the overlay for plain layers, the module route for quantized
        targets and on a model sharded by FSDP2; a parameter-dict overlay (no model) refuses
        quantized and sharded targets.
    """
    if not isinstance(adapter, AdapterNode):
        raise TypeError(  # error: overlay-not-adapter
            f"expected an Adapter, Composed or Combined, got {type(adapter).__name__}; build one with "
            f"lora_func.init_adapter(model, spec) (or lora_func.load)"
        )
    modules = dict(model.named_modules()) if model is not None and modules is None else modules
    # The one walk of the adapter tree: collect each leaf's layers and each node's own tensors.
    own_checks: list[_TensorCheck] = []
    leaf_layers: list[tuple[str, Adapter]] = []
    for prefix, node in walk(adapter):
        own_checks += [_TensorCheck(prefix + name, tuple(shape), None, True, own=(node.tag, name)) for name, shape in node.own_shapes().items()]
        if not node.parts:
            leaf_layers.append((prefix, node))
    targets_in_order = {layer.target.weight_key: layer.target for _, leaf in leaf_layers for layer in leaf.layers}
    if modules is not None:
        _check_layouts(modules, list(targets_in_order.values()), where)
    fsdp = modules is not None and is_fsdp_model(modules)
    missing = sorted(set(targets_in_order) - set(base))
    quantized = sorted(key for key in targets_in_order if key in base and kind_of_tensor(base[key]) is not None)
    resolved = _resolve_route(route, fsdp, bool(quantized) and not missing)
    if missing:
        raise KeyError(  # error: overlay-missing-targets
            f"adapter targets {missing} are not tensors of this model (built for another model?); "
            f"close names: {close_names(missing, base) or 'none'}"
        )
    wrong = []
    for key, t in targets_in_order.items():
        stored = stored_shape(t)
        if logical_shape(base[key]) != stored:
            wrong.append(f"{key}: adapter built for {stored}, model has {logical_shape(base[key])}")
    if wrong:
        raise ValueError(f"adapter does not fit this model's target shapes: {sorted(wrong)}")  # error: overlay-target-shape
    checks = list(own_checks)
    for prefix, leaf in leaf_layers:
        for layer in leaf.layers:
            device = base[layer.target.weight_key].device
            module = layer.target.module
            checks += [_TensorCheck(f"{prefix}{module}.{name}", tuple(shape), device, True, dtype=leaf.spec.dtype) for name, shape in layer.param_shapes]
            checks += [_TensorCheck(f"{prefix}{module}.{name}", tuple(shape), device, False) for name, shape in layer.buffer_shapes]
        for param, shapes in ((True, leaf.shared.param_shapes), (False, leaf.shared.buffer_shapes)) if leaf.shared is not None else ():
            checks += [_TensorCheck(f"{prefix}{SHARED}.{n}", tuple(s), None, param, dtype=leaf.spec.dtype if param else None) for n, s in shapes]
    plan_checks = tuple(checks)
    params, buffers = adapter_tensors(adapter)
    for check in plan_checks:  # the adapter in hand (later ones: Plan.check_tensors)
        tensor = (params if check.param else buffers)[check.key]
        if tensor.shape != check.shape or (check.device is not None and tensor.device != check.device):
            _raise_tensor_problem(plan_checks, params, buffers, where)
        if check.dtype is not None and tensor.dtype != check.dtype:
            _raise_tensor_problem(plan_checks, params, buffers, where)
    sharded = sorted(key for key in targets_in_order if is_sharded(base[key]))
    special = sorted(key for key in {*quantized, *sharded} if targets_in_order[key].layout in MERGED_ONLY)
    if special:
        raise ValueError(  # error: kind-quantized-or-sharded
            f"{where}: target(s) {special[:4]} are {', '.join(sorted({targets_in_order[k].layout for k in special}))} weights that "
            f"are quantized or sharded by FSDP2; lora_func applies these kinds through their merged weight, which needs a "
            f"plain tensor: leave them out of the targets, or dequantize / unshard those layers"
        )
    if resolved == "overlay":
        if quantized:
            raise ValueError(  # error: quantized-overlay
                f"target(s) {quantized} hold quantized weights, which a parameter dict cannot replace (the layer runs "
                f"its own op on them): use lora_func.adapted_call or lora_func.adapted (they adapt quantized targets at "
                f"the module's call, route='module'), or lora_func.merged_state_dict(..., dtype=...) for a dense export"
            )
        if sharded:
            raise ValueError(  # error: fsdp-parameter-dict
                f"target(s) {sharded[:4]}{' ...' if len(sharded) > 4 else ''} are sharded by FSDP2 (DTensor), which a "
                f"parameter dict cannot replace (FSDP2 installs its gathered weight at the module's call): use "
                f"lora_func.adapted_call or lora_func.adapted, which adapt them at the module's call (route='module')"
            )
        check_float_targets(base, [layer for _, leaf in leaf_layers for layer in leaf.layers], where)
    targets = {key: TargetPlan(t, key in quantized, key in sharded) for key, t in targets_in_order.items()}
    if resolved == "module":
        refuse_tied(targets, where)
    plan = Plan(
        resolved,
        targets,
        _program(adapter, ""),
        plan_checks,
        frozenset(base),
        structure_key(adapter),
        fsdp=fsdp,
        modules=None if modules is None else {name: module for name, module in modules.items() if name},
        tree=None if model is None else module_tree(model),
    )
    return plan._record_weights(base)


def _program(node: Any, prefix: str) -> _Leaf | _Node:
    """How to build ``node``'s layer ops from its tensors (a recursion over the parts, as the ops are)."""
    if not node.parts:
        return _Leaf(
            node.variant,
            node.spec.dtype,
            tuple(
                (
                    layer.target.weight_key,
                    layer.info,
                    tuple((name, f"{layer.target.module}.{name}") for name, _ in layer.param_shapes),
                    tuple((name, f"{layer.target.module}.{name}") for name, _ in layer.buffer_shapes),
                    layer.target.layout,
                )
                for layer in node.layers
            ),
            node.shared is not None,
            tuple(tuple(sorted(groups.get(layer.target.module, {}).items())) for layer in node.layers) if (groups := node.layer_groups()) else (),
        )
    parts = tuple(_program(part, prefix) for part in node.parts)
    keys: dict[str, list[int]] = {}
    for k, sub in enumerate(parts):
        for key in _program_keys(sub):
            keys.setdefault(key, []).append(k)
    return _Node(parts, tuple((key, tuple(present)) for key, present in keys.items()))


def _program_keys(program: _Leaf | _Node) -> list[str]:
    if isinstance(program, _Leaf):
        return [key for key, *_ in program.layers]
    return [key for key, _ in program.present]


# ----------------------------------------------------------------------------- the cache


def plans_for(model: nn.Module) -> list[Plan]:
    """The plans built for ``model`` (by :func:`cached_plan`), the latest first."""
    entry = _PLANS.get(model)
    return [plan for _, plan in reversed(entry)] if entry is not None else []


# model -> the plans built for it, with the route each was asked for, the latest last; held
# weakly by the model (deleting the model frees them). Documented in the README.
_PLANS: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, Plan]]] = weakref.WeakKeyDictionary()
_PLANS_PER_MODEL = 8


def cached_plan(
    model: nn.Module, base: Mapping[str, Tensor], adapter: AdapterLike, *, route: Route, build: Callable[[], Plan]
) -> Plan:
    """The plan of ``adapter`` on ``model`` with ``base``: the one built before for the same
    structure, route, base names and target kinds when the model's modules are unchanged, else
    ``build()``'s (then kept). Under ``torch.compile`` tracing it always builds (dynamo traces
    the build once per graph)."""
    if torch.compiler.is_compiling() or not isinstance(adapter, AdapterNode):
        return build()
    structure = structure_key(adapter)
    entry = _PLANS.get(model)
    if entry is not None:
        # A few plans per model, compared by equality, whose element-wise identity check makes
        # a training loop's adapters (one layers tuple shared by every with_params) cheap to match.
        for route_, plan in reversed(entry):
            if route_ == route and plan.matches(structure, base) and plan.model_unchanged(model):
                return plan
    plan = build()
    if entry is None:
        entry = _PLANS[model] = []
    entry.append((route, plan))
    del entry[:-_PLANS_PER_MODEL]
    return plan


# The latest parameter-dict plans (overlay, merge_overlay, overlay_mode: no model), found by
# structure and base as cached_plan finds a model's; they hold no tensors. Documented in the README.
_OVERLAY_PLANS: list[Plan] = []
_OVERLAY_PLANS_MAX = 8


def overlay_plan(base: Mapping[str, Tensor], adapter: AdapterLike, where: str) -> tuple[Plan, bool]:
    """The parameter-dict plan of ``adapter`` on ``base`` and whether it was built now (else it
    was found: the caller checks the adapter's tensors with :meth:`Plan.check_tensors`)."""
    if torch.compiler.is_compiling() or not isinstance(adapter, AdapterNode):
        return build_plan(base, adapter, route="overlay", where=where), True
    structure = structure_key(adapter)
    for plan in reversed(_OVERLAY_PLANS):
        if plan.matches(structure, base):
            return plan, False
    plan = build_plan(base, adapter, route="overlay", where=where)
    _OVERLAY_PLANS.append(plan)
    del _OVERLAY_PLANS[:-_OVERLAY_PLANS_MAX]
    return plan, True
