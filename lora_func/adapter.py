"""The adapter tree: one :class:`Adapter` per variant (the leaves) and the combinators over
them (:class:`Composed`, :class:`Combined`), all frozen nodes of one base, :class:`AdapterNode`.

Every node has ``parts`` (its children: empty for an ``Adapter``) and is a torch pytree (and
an optree one, see :mod:`lora_func._optree`) whose leaves are its tensors. :func:`walk` visits
a tree in application order with each node's key prefix (``"1/0/"``: part 0 of part 1), the
prefix its tensors carry in the root's ``params`` / ``buffers``.

Each node type declares its fields once, as class attributes (equinox-style:
``weights: Tensor = own_tensor(shape=...)``); :mod:`lora_func._tree` turns the declarations into
slots, pytree children and context, rebuilds and saved fields, and :class:`AdapterNode` there
declares the interface every node implements.

A new combinator is one subclass of :class:`Combinator` (see there for what it defines); the
tree walks, ``with_params``, pytrees, ``stack`` / ``take`` (:mod:`lora_func.stacking`), the
overlays and ``save`` / ``load`` handle it from that.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from lora_func._layer_ops import ChainOp, LayerOp, SumOp
from lora_func._tree import (
    NODE_TYPES,
    AdapterNode,
    leaves,
    own_tensor,
    part_prefix,
    parts_field,
    prefixed,
    static_field,
    tensor_dict,
    unprefixed,
    walk,
)
from lora_func.spec import AdapterSpec
from lora_func.targeting import Target
from lora_func.variants import LayerInfo, TensorDict, Variant, get_variant
from lora_func.variants._contract import GROUP, group_view

__all__ = [
    "NODE_TYPES",
    "SHARED",
    "Adapter",
    "AdapterLayer",
    "AdapterLike",
    "AdapterNode",
    "Combinator",
    "Combined",
    "Composed",
    "SharedTensors",
    "combine",
    "compose",
    "leaf_adapters",
    "leaves",
    "own_tensor",
    "part_prefix",
    "static_field",
    "target_weight_keys",
    "tensor_dict",
    "walk",
]


@dataclasses.dataclass(frozen=True)
class AdapterLayer:
    """Static description of the adapter on one target (pytree context, no tensors).

    Attributes:
      target: the layer it adapts (names, layout, sizes).
      info: the variant's per-layer static info (rank, alpha, options).
      param_shapes / buffer_shapes: ``(short name, shape)`` of each tensor; the adapter's
        flat keys are ``f"{target.module}.{short name}"``.
      base_fingerprint: for variants that record their base (``Variant.records_base``), a
        digest of the base weight the adapter was derived from; else ``None``.
    """

    target: Target
    info: LayerInfo
    param_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    buffer_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    base_fingerprint: str | None = None

    def param_keys(self) -> list[str]:
        return [f"{self.target.module}.{name}" for name, _ in self.param_shapes]

    def buffer_keys(self) -> list[str]:
        return [f"{self.target.module}.{name}" for name, _ in self.buffer_shapes]


# The module name under which an adapter's shared tensors are keyed ("<shared>.basis_A"): no
# module of a model has it, so the keys cannot collide with a layer's.
SHARED = "<shared>"


@dataclasses.dataclass(frozen=True)
class SharedTensors:
    """Static description of the tensors an adapter holds once and every layer reads
    (``Variant.shared_init``: a basis, a bank), keyed ``"<shared>.<name>"`` in ``params`` /
    ``buffers``."""

    param_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    buffer_shapes: tuple[tuple[str, tuple[int, ...]], ...]

    def param_keys(self) -> list[str]:
        return [f"{SHARED}.{name}" for name, _ in self.param_shapes]

    def buffer_keys(self) -> list[str]:
        return [f"{SHARED}.{name}" for name, _ in self.buffer_shapes]


def _split(flat: Mapping[str, Tensor], module: str, names: Iterable[tuple[str, tuple[int, ...]]]) -> TensorDict:
    return {name: flat[f"{module}.{name}"] for name, _ in names}


AdapterLike = AdapterNode


def leaf_adapters(adapter: AdapterLike, where: str = "") -> list[Adapter]:
    """Every :class:`Adapter` inside ``adapter``, in application order; ``where`` names the
    public call and argument in the error for anything else (``"unstack(adapter)"``)."""
    if not isinstance(adapter, AdapterNode):
        raise TypeError(  # error: not-an-adapter
            f"{where + ': ' if where else ''}expected an Adapter, Composed or Combined, got {type(adapter).__name__}; "
            f"build one with lora_func.init_adapter(model, spec)"
        )
    return [leaf for _, leaf in leaves(adapter)]


def target_weight_keys(adapter: AdapterLike) -> set[str]:
    """The model weight keys that some leaf of ``adapter`` adapts."""
    return {layer.target.weight_key for leaf in leaf_adapters(adapter) for layer in leaf.layers}


def _check_params_dtype(where: str, params: Mapping[str, Any], dtype: torch.dtype) -> None:
    """Trainable tensors are in the adapter dtype (``spec.dtype``), always: the dtype the adapter
    reports, the one its file records and the one both paths compute in. A tensor in another
    dtype would run (the merged path promotes it, the low-rank path fails deep in a GEMM on
    mixed operands) and then save a file whose metadata contradicts it."""
    wrong = sorted(k for k, v in params.items() if not isinstance(v, Tensor) or not (v.is_floating_point() or v.is_complex()))
    if wrong:
        got = params[wrong[0]]
        shown = f"a {got.dtype} tensor" if isinstance(got, Tensor) else type(got).__name__
        # An integer tensor would be silently truncated or promoted by the low-rank path.
        raise TypeError(  # error: adapter-params-dtype
            f"{where}: {wrong[:5]} must be floating-point tensors, got {shown}; pass tensors of "
            f"the adapter dtype ({dtype})"
        )
    other = sorted(k for k, v in params.items() if v.dtype != dtype)
    if other:
        got_dtypes = sorted({str(params[k].dtype) for k in other})
        raise TypeError(  # error: adapter-params-spec-dtype
            f"{where}: {other[:5]}{' ...' if len(other) > 5 else ''} are {', '.join(got_dtypes)} tensors, but the "
            f"adapter dtype is {dtype} (adapter.spec.dtype), which every trainable tensor must have; cast them "
            f"(v.to({dtype})), or build the adapter in the other dtype with AdapterSpec(..., dtype=...)"
        )


def _check_same_keys(where: str, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or unexpected:
        raise KeyError(f"Adapter.{where}: missing keys {missing}, unexpected keys {unexpected}")  # error: adapter-keys


class Adapter(AdapterNode, tag="adapter"):
    """An adapter: trainable ``params`` and frozen ``buffers`` (flat dicts of tensors keyed
    ``"<module name>.<tensor name>"``, e.g. ``"model.layers.0.self_attn.q_proj.lora_A"``),
    the :class:`AdapterSpec` it was built from, and one static :class:`AdapterLayer` per
    target.

    Immutable: ``with_params`` returns a new adapter. It is a torch pytree (tensors are the
    leaves), so ``torch.func.vmap(f)(stacked_adapter)`` and ``tree_map`` work on it. The
    training idiom::

        grads = torch.func.grad(lambda p: loss(adapter.with_params(p)))(adapter.params)

    ``params`` are leaf tensors with ``requires_grad=True``, so a ``torch.optim`` optimiser
    over ``adapter.params.values()`` works too.

    The constructor checks that the keys of ``params`` / ``buffers`` are those of ``layers``
    and that every tensor has its layer's shape after one common stack shape; build adapters
    with :func:`lora_func.init_adapter` and derive them with :meth:`with_params`.
    """

    parts: ClassVar[tuple[AdapterNode, ...]] = ()  # a leaf
    # layer_groups() and each layer's view of the shared tensors, computed on first use: they
    # depend on spec, layers and shared alone, and layer_tensors reads them for every layer
    # (recomputing them there made a pass over the layers quadratic in their number). Not
    # fields: never pytree leaves or context, never saved.
    __slots__ = ("_groups_memo", "_views_memo")
    params: dict[str, Tensor] = tensor_dict()
    buffers: dict[str, Tensor] = tensor_dict()
    spec: AdapterSpec = static_field()
    layers: tuple[AdapterLayer, ...] = static_field()
    # Only for a rank-padded stack: each member's own (spec, layers), so unstack() gives the
    # originals back (shapes, ranks and alphas).
    members: tuple[tuple[AdapterSpec, tuple[AdapterLayer, ...]], ...] | None = static_field()
    # The tensors every layer reads (Variant.shared_init), or None.
    shared: SharedTensors | None = static_field()
    # Only for a rank-padded stack with shared tensors: each member's own shared shapes.
    member_shared: tuple[SharedTensors | None, ...] | None = static_field()

    def __init__(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        spec: AdapterSpec,
        layers: Sequence[AdapterLayer],
        members: Sequence[tuple[AdapterSpec, tuple[AdapterLayer, ...]]] | None = None,
        shared: SharedTensors | None = None,
    ) -> None:
        layers = tuple(layers) if isinstance(layers, Iterable) else layers
        wrong = [f"spec is a {type(spec).__name__}, not an AdapterSpec"] if not isinstance(spec, AdapterSpec) else []
        if not isinstance(layers, tuple) or not all(isinstance(layer, AdapterLayer) for layer in layers):
            held = sorted({type(layer).__name__ for layer in layers}) if isinstance(layers, tuple) else type(layers).__name__
            wrong.append(f"layers must be a sequence of AdapterLayer, got {held}")
        for arg, flat in (("params", params), ("buffers", buffers)):
            if not isinstance(flat, Mapping):
                wrong.append(f"{arg} is a {type(flat).__name__}, not a dict of tensors")
            else:
                wrong += [f"{arg}[{key!r}] is a {type(value).__name__}, not a tensor" for key, value in flat.items() if not isinstance(value, Tensor)][:3]
        if wrong:
            raise TypeError(  # error: adapter-init-types
                f"Adapter(params, buffers, spec, layers): {'; '.join(wrong)}; build adapters with "
                f"lora_func.init_adapter(model, spec), and new values with adapter.with_params(params)"
            )
        if shared is not None and not isinstance(shared, SharedTensors):
            raise TypeError(f"Adapter(...): shared must be a SharedTensors or None, got {type(shared).__name__}")  # error: adapter-init-shared
        # (module, param shapes, buffer shapes) of each layer, and of the shared tensors.
        groups = [(layer.target.module, layer.param_shapes, layer.buffer_shapes) for layer in layers]
        groups += [(SHARED, shared.param_shapes, shared.buffer_shapes)] if shared is not None else []
        for arg, flat, keys in (
            ("params", params, [f"{module}.{name}" for module, shapes, _ in groups for name, _ in shapes]),
            ("buffers", buffers, [f"{module}.{name}" for module, _, shapes in groups for name, _ in shapes]),
        ):
            missing, unexpected = sorted(set(keys) - set(flat)), sorted(set(flat) - set(keys))
            if missing or unexpected:
                raise KeyError(  # error: adapter-init-keys
                    f"Adapter(params, buffers, spec, layers): {arg} is missing keys {missing[:5]} and has unexpected "
                    f"keys {unexpected[:5]}; its keys are f'{{module}}.{{name}}' of each layer's {arg[:-1]}_shapes "
                    f"(adapter.with_params(params) keeps an adapter's keys)"
                )
        _check_params_dtype("Adapter(params, buffers, spec, layers)", params, spec.dtype)
        stacks: dict[tuple[int, ...], str] = {}
        for module, param_shapes, buffer_shapes in groups:
            for arg, flat, shapes in (("params", params, param_shapes), ("buffers", buffers, buffer_shapes)):
                for name, shape in shapes:
                    key = f"{module}.{name}"
                    got = tuple(flat[key].shape)
                    if got[len(got) - len(shape) :] != tuple(shape) or len(got) < len(shape):
                        raise ValueError(  # error: adapter-init-shape
                            f"Adapter(params, buffers, spec, layers): {arg}[{key!r}] has shape {got}, but its layer "
                            f"says {tuple(shape)} (after any leading stack axes); pass tensors of the layer's shapes"
                        )
                    stacks.setdefault(got[: len(got) - len(shape)], key)
        if len(stacks) > 1:
            raise ValueError(  # error: adapter-init-stack-shapes
                f"Adapter(params, buffers, spec, layers): the tensors have different leading stack shapes "
                f"{dict(sorted(stacks.items()))} (shape: first key with it); every tensor needs the same stack axes "
                f"(build stacks with lora_func.stack)"
            )
        built = self._unchecked(params, buffers, spec, layers, members, shared)
        for name in self.fields:
            object.__setattr__(self, name, getattr(built, name))

    @classmethod
    def _unchecked(cls, *fields: Any) -> Adapter:
        """An adapter of ``(params, buffers, spec, layers[, members[, shared[, member_shared]]])``
        (the declared fields, in order) without the constructor's checks: for rebuilds from an
        adapter's own parts."""
        values = dict(zip(cls.fields, fields))
        values |= {"params": dict(values["params"]), "buffers": dict(values["buffers"]), "layers": tuple(values["layers"])}
        for name in ("members", "member_shared"):
            values[name] = None if values.get(name) is None else tuple(values[name])
        return cls._build(**values)

    @property
    def variant(self) -> Variant:
        return get_variant(self.spec.variant)

    def with_params(self, params: Mapping[str, Tensor]) -> Adapter:
        """A new adapter with these trainable tensors (same keys as ``self.params``)."""
        _check_same_keys("with_params", params, self.params)
        dtype = self.spec.dtype
        if any(not isinstance(v, Tensor) or v.dtype != dtype for v in params.values()):
            _check_params_dtype("Adapter.with_params", params, dtype)
        return Adapter._unchecked(params, self.buffers, self.spec, self.layers, self.members, self.shared, self.member_shared)

    def with_buffers(self, buffers: Mapping[str, Tensor]) -> Adapter:
        _check_same_keys("with_buffers", buffers, self.buffers)
        return Adapter._unchecked(self.params, buffers, self.spec, self.layers, self.members, self.shared, self.member_shared)

    def detach(self) -> Adapter:
        """The same values as new leaf tensors in new storage: params with ``requires_grad=True``
        (ready for a ``torch.optim`` optimiser), buffers without. An optimiser step (or any
        in-place write) on the copy leaves ``self`` unchanged."""
        return Adapter._unchecked(
            {k: v.detach().clone().requires_grad_(True) for k, v in self.params.items()},
            {k: v.detach().clone() for k, v in self.buffers.items()},
            self.spec,
            self.layers,
            self.members,
            self.shared,
            self.member_shared,
        )

    def layer_tensors(self, layer: AdapterLayer) -> tuple[TensorDict, TensorDict]:
        """``(params, buffers)`` of one layer as its forms see them, keyed by short names
        (``"lora_A"``): the layer's own tensors and the adapter's shared ones."""
        module = layer.target.module
        own_params, own_buffers = _split(self.params, module, layer.param_shapes), _split(self.buffers, module, layer.buffer_shapes)
        if self.shared is None:
            return own_params, own_buffers
        views = self._shared_views()
        if module not in views:  # a layer of another adapter of this structure
            shared_params, shared_buffers = self.shared_tensors()
            groups = self._layer_groups().get(module, {})
            return group_view(shared_params, groups) | own_params, group_view(shared_buffers, groups) | own_buffers
        param_keys, buffer_keys = views[module]
        return {n: self.params[k] for n, k in param_keys} | own_params, {n: self.buffers[k] for n, k in buffer_keys} | own_buffers

    def layer_groups(self) -> dict[str, dict[str, str]]:
        """Module name -> {grouped shared tensor name: the layer's group key}
        (``Variant.groups``); empty for a variant without grouped shared tensors."""
        return {module: dict(groups) for module, groups in self._layer_groups().items()}

    def _layer_groups(self) -> dict[str, dict[str, str]]:
        # layer_groups() computed once per adapter (read only: the callers here do not change it)
        memo = getattr(self, "_groups_memo", None)
        if memo is None:
            variant = self.variant
            memo = {} if variant.groups is None else variant.layer_groups(self.spec.targets, {layer.target.module: layer.info for layer in self.layers})
            object.__setattr__(self, "_groups_memo", memo)
        return memo

    def _shared_views(self) -> dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]]:
        """Module name -> the ``(short name, flat key)`` pairs of the shared params and buffers
        its forms see (:func:`group_view`'s choice: the ungrouped ones, and its own group's copy of
        each grouped one), for every layer at once: linear in the layers and shared tensors."""
        memo = getattr(self, "_views_memo", None)
        if memo is None:
            assert self.shared is not None
            groups = self._layer_groups()

            kinds = []  # (its names, its ungrouped pairs): params, then buffers
            for shapes in (self.shared.param_shapes, self.shared.buffer_shapes):
                kinds.append(({name for name, _ in shapes}, tuple((name, f"{SHARED}.{name}") for name, _ in shapes if GROUP not in name)))

            def pairs(names: set[str], plain: tuple[tuple[str, str], ...], layer_groups: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
                return plain + tuple((slot, f"{SHARED}.{slot}{GROUP}{key}") for slot, key in layer_groups.items() if f"{slot}{GROUP}{key}" in names)

            memo = {}
            for layer in self.layers:
                g = groups.get(layer.target.module, {})
                memo[layer.target.module] = (pairs(*kinds[0], g), pairs(*kinds[1], g))
            object.__setattr__(self, "_views_memo", memo)
        return memo

    def shared_tensors(self) -> tuple[TensorDict, TensorDict]:
        """``(params, buffers)`` the adapter holds once for every layer (``Variant.shared_init``),
        keyed by short names; empty for a variant without shared tensors."""
        if self.shared is None:
            return {}, {}
        return _split(self.params, SHARED, self.shared.param_shapes), _split(self.buffers, SHARED, self.shared.buffer_shapes)

    def num_parameters(self) -> int:
        """Trainable scalars (one stack member's, for a stacked adapter): the layers' and the shared ones."""
        shared = self.shared.param_shapes if self.shared is not None else ()
        shapes = [shape for layer in self.layers for _, shape in layer.param_shapes] + [shape for _, shape in shared]
        return sum(int(torch.Size(shape).numel()) for shape in shapes)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Leading stack dims (``()`` for a single adapter, ``(K,)`` after :func:`stack`)."""
        for layer in self.layers:
            for name, shape in layer.param_shapes + layer.buffer_shapes:
                key = f"{layer.target.module}.{name}"
                tensor = self.params[key] if key in self.params else self.buffers[key]
                return tuple(tensor.shape[: tensor.dim() - len(shape)])
        return ()

    def __repr__(self) -> str:
        stacked = f", stack_shape={self.stack_shape}" if self.stack_shape else ""
        if self.members is not None:
            stacked += f", rank-padded ranks={sorted({layer.info.r for _, ls in self.members for layer in ls})}"
        return (
            f"Adapter(variant={self.spec.variant!r}, layers={len(self.layers)}, "
            f"params={self.num_parameters()}{stacked})"
        )


class Combinator(AdapterNode):
    """A node that combines its ``parts`` (other nodes) on each layer they adapt.

    A new combinator is one subclass, declared with ``tag="..."`` (its name in saved files),
    that declares its fields and defines:

    - fields, each in one place: ``name: Tensor = own_tensor(shape=lambda node: ...)`` for a
      trainable tensor it holds itself (unprefixed in ``params``, saved as
      ``params/<prefix><name>``, stacked along the stack axis), ``name: T = static_field()``
      for JSON-able, hashable configuration (``parts`` is declared here);
    - ``__init__``: validates its arguments (this is the public constructor), then calls
      ``self._init(parts, **fields)``;
    - ``layer_op(ops, present) -> LayerOp``: how the layer ops of its parts that adapt one
      layer (``ops[j]`` is part ``present[j]``'s) combine there (see :mod:`lora_func._layer_ops`;
      a subclass that defines it under its old name ``layer_step`` still works until 0.2, with
      a ``DeprecationWarning``);
    - optionally ``verb`` (the public function that builds it, for messages) and ``__repr__``.

    Everything else (``params``, ``buffers``, ``with_params``, ``detach``, ``stack_shape``,
    pytree flatten/unflatten, ``stack`` / ``take`` / ``unstack``, ``save`` / ``load``) is here.
    """

    parts: tuple[AdapterNode, ...] = parts_field()

    def _init(self, parts: Sequence[AdapterNode], **values: Any) -> None:
        """Set the fields (for a validating ``__init__``, after its checks)."""
        built = self._build(parts=tuple(parts), **values)
        for name in self.fields:
            object.__setattr__(self, name, getattr(built, name))

    @abc.abstractmethod
    def layer_op(self, ops: Sequence[LayerOp], present: Sequence[int]) -> LayerOp:
        """How the layer ops of the parts that adapt one layer combine there."""

    def rebuild(self, parts: Sequence[AdapterNode], own: Mapping[str, Any] | None = None) -> Combinator:
        """The same kind of node (same static configuration) over ``parts``, with ``own``
        tensors (default: this node's), unchecked."""
        own = self.own_params() if own is None else own
        return self._build(parts=tuple(parts), **own, **dict(zip(self.static_fields(), self.static(), strict=True)))

    @property
    def params(self) -> dict[str, Tensor]:
        flat = prefixed([part.params for part in self.parts])
        return {**self.own_params(), **flat} if self.tensor_fields() else flat

    @property
    def buffers(self) -> dict[str, Tensor]:
        return prefixed([part.buffers for part in self.parts])

    def with_params(self, params: Mapping[str, Tensor]) -> Combinator:
        _check_same_keys("with_params", params, self.params)
        own = {name: params[name] for name in self.tensor_fields()}
        rest = unprefixed({k: v for k, v in params.items() if k not in own} if own else params, len(self.parts))
        return self.rebuild([part.with_params(p) for part, p in zip(self.parts, rest, strict=True)], own)

    def with_buffers(self, buffers: Mapping[str, Tensor]) -> Combinator:
        _check_same_keys("with_buffers", buffers, self.buffers)
        rest = unprefixed(buffers, len(self.parts))
        return self.rebuild([part.with_buffers(b) for part, b in zip(self.parts, rest, strict=True)])

    def detach(self) -> Combinator:
        own = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in self.own_params().items()}
        return self.rebuild([part.detach() for part in self.parts], own)

    def num_parameters(self) -> int:
        own = sum(math.prod(shape) for shape in self.own_shapes().values())
        return own + sum(part.num_parameters() for part in self.parts)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        own = self.own_params()
        for name, shape in self.own_shapes().items():
            return tuple(own[name].shape[: own[name].dim() - len(shape)])
        return self.parts[0].stack_shape

    def json_fields(self) -> dict[str, Any]:
        """What a saved file records of this node besides its kind and parts: its static
        fields and whether each own tensor requires grad."""
        return {
            **dict(zip(self.static_fields(), self.static(), strict=True)),
            **{f"{name}_requires_grad": t.requires_grad for name, t in self.own_params().items()},
        }

    @classmethod
    def json_field_names(cls) -> tuple[str, ...]:
        """The keys :meth:`json_fields` writes (a saved file without one is damaged)."""
        return (*cls.static_fields(), *(f"{name}_requires_grad" for name in cls.tensor_fields()))

    @classmethod
    def from_json(cls, fields: Mapping[str, Any], parts: Sequence[AdapterNode], own: Mapping[str, Tensor]) -> Combinator:
        """The node a saved file describes (:meth:`json_fields`), given its parts and tensors."""
        own = {name: t.requires_grad_(bool(fields[f"{name}_requires_grad"])) for name, t in own.items()}
        return cls._build(parts=tuple(parts), **own, **{name: fields[name] for name in cls.static_fields()})

    def __repr__(self) -> str:
        static = "".join(f", {name}={getattr(self, name)!r}" for name in self.static_fields())
        return f"{type(self).__name__}({', '.join(map(repr, self.parts))}{static})"


class Composed(Combinator, tag="composed"):
    """Adapters applied in order (see :func:`compose`): on a layer that several parts adapt,
    each part sees the effective weight of the parts before it.

    ``params`` / ``buffers`` are flat dicts keyed ``f"{i}/{key}"`` (``i`` the part index, e.g.
    ``"1/model.layers.0.mlp.up_proj.ia3_l"``), so the training idiom is the same as for one
    adapter: ``grad(lambda p: loss(composed.with_params(p)))(composed.params)``.
    """

    verb = "compose"

    def __init__(self, parts: Sequence[AdapterLike]) -> None:
        parts = tuple(parts)
        if not parts:
            raise ValueError("compose() needs at least one adapter")  # error: compose-empty
        adapted: dict[str, int] = {}
        for i, part in enumerate(parts):
            for leaf in leaf_adapters(part):
                if not isinstance(leaf, Adapter) or not leaf.variant.replaces_weight:  # (a prompt adapts no weight)
                    continue
                earlier = sorted(k for k in (layer.target.weight_key for layer in leaf.layers) if k in adapted)
                if earlier:
                    raise ValueError(  # error: compose-replacing-part-later
                        f"compose(): part {i} ({leaf.spec.variant}) replaces the base weight of {earlier[:5]}, which "
                        f"part {adapted[earlier[0]]} already adapts: its residual was computed from the untouched "
                        f"base, so the earlier part would be dropped there. Put part {i} first on these layers."
                    )
            for key in target_weight_keys(part):
                adapted.setdefault(key, i)
        shapes = {part.stack_shape for part in parts}
        if len(shapes) > 1:
            raise ValueError(f"compose(): parts have different stack shapes {sorted(shapes)}; stack each part alike")  # error: compose-stack-shapes
        self._init(parts)

    def layer_op(self, ops: Sequence[LayerOp], present: Sequence[int]) -> LayerOp:
        """The parts' layer ops in order, as one flat chain (a composed part's chain is spliced in)."""
        flat = [o for op in ops for o in (op.ops if isinstance(op, ChainOp) else (op,))]
        return flat[0] if len(flat) == 1 else ChainOp(flat)


class Combined(Combinator, tag="combined"):
    """A weighted sum of adapters' deltas on one base (see :func:`combine`).

    ``weights (K,)`` (one per part) is ``params["weights"]``, so it can be trained (learned
    mixing, as in LoraHub) or vmapped over; the parts' tensors are keyed ``f"{i}/{key}"``.
    """

    verb = "combine"
    weights: Tensor = own_tensor(shape=lambda node: (len(node.parts),))

    def __init__(self, parts: Sequence[AdapterLike], weights: Tensor | Sequence[float]) -> None:
        if isinstance(parts, (AdapterNode, Mapping, str)) or not isinstance(parts, Iterable):
            raise TypeError(  # error: combine-not-a-list
                f"combine(adapters, weights): adapters must be a list of adapters, got {type(parts).__name__}; "
                f"pass a list, one weight per adapter: combine([adapter], [w]) or combine([a, b], [w_a, w_b])"
            )
        parts = tuple(parts)
        if not parts:
            raise ValueError("combine() needs at least one adapter")  # error: combine-empty
        for i, part in enumerate(parts):
            leaf_adapters(part, f"combine(adapters, weights): adapters[{i}]")
        given = weights
        if not isinstance(weights, Tensor):
            try:
                # a list holding tensors (learned weights that require grad) is stacked: graph kept
                is_list = isinstance(weights, Sequence) and any(isinstance(w, Tensor) for w in weights)
                weights = torch.stack([torch.as_tensor(w) for w in weights]) if is_list else torch.as_tensor(weights)
            except (TypeError, ValueError, RuntimeError):
                weights = torch.tensor([])  # not numbers: reported below with the expected form
        if not weights.is_floating_point() or weights.dim() != 1 or weights.shape[0] != len(parts):
            shown = f"shape {tuple(weights.shape)} dtype {weights.dtype}" if weights.numel() or isinstance(given, Tensor) else repr(given)[:80]
            raise ValueError(  # error: combine-weights
                f"combine(): weights must be a 1-D float tensor with one entry per adapter ({len(parts)}), got {shown}"
            )
        shapes = {part.stack_shape for part in parts}
        if len(shapes) > 1:
            raise ValueError(f"combine(): parts have different stack shapes {sorted(shapes)}; stack each part alike")  # error: combine-stack-shapes
        (stack_shape,) = shapes
        if stack_shape:
            # Combined.stack_shape is read from the weights: 1-D weights over stacked parts would
            # make an object whose parts are stacked and whose weights are not.
            raise ValueError(  # error: combine-stacked-parts
                f"combine(): the parts are stacked (stack_shape {stack_shape}) but weights has shape {tuple(weights.shape)}; "
                f"combine the unstacked adapters, then stack the combinations (lora_func.stack([combine(...), ...]))"
            )
        if not torch._C._functorch.is_functorch_wrapped_tensor(weights) and not bool(torch.isfinite(weights.detach()).all()):
            raise ValueError(  # error: combine-weights-finite
                f"combine(): weights {weights.detach().tolist()} hold a NaN or inf, which would make every adapted "
                f"output NaN; pass finite weights"
            )
        self._init(parts, weights=weights)

    def layer_op(self, ops: Sequence[LayerOp], present: Sequence[int]) -> LayerOp:
        """``W + Σ_k w_k (W_eff_k − W)`` over the parts present on the layer (their weights only)."""
        weights = self.weights if len(present) == len(self.parts) else self.weights[..., list(present)]
        return SumOp(ops, weights)

    def __repr__(self) -> str:
        return f"Combined({', '.join(map(repr, self.parts))}, weights={tuple(self.weights.shape)})"


def compose(*adapters: AdapterLike | Sequence[AdapterLike]) -> Composed:
    """One adapter that applies ``adapters[0]``, then ``adapters[1]`` on top, and so on.

    ``compose(a, b)`` or ``compose([a, b])`` (as :func:`combine` and :func:`lora_func.stack`).
    On a layer that several of them adapt, each sees the previous ones' effective weight and
    bias: ``W_eff = f_b(f_a(W, b))`` merged, and ``f_b``'s activation form runs with
    ``f_a``'s as its base layer on the lazy path (the two agree). Order matters (LoRA then
    DoRA renormalises the LoRA update; DoRA then LoRA does not). On different layers the parts
    are independent. Parts may themselves be composed or combined.

    Raises ``ValueError`` when a variant that replaces the base weight (PiSSA: its residual is
    fixed at init) comes after another part on the same layer, since it would silently drop
    the earlier parts' effect there.
    """
    listed = len(adapters) == 1 and isinstance(adapters[0], (list, tuple))
    return Composed(cast("Sequence[AdapterLike]", adapters[0] if listed else adapters))  # Composed checks each part


def combine(*adapters: Any, weights: Tensor | Sequence[float] | None = None) -> Combined:
    """The weighted sum of the adapters' deltas on one base: ``W + Σ_k w_k (W_eff_k(W) − W)``.

    ``combine([a, b], [w_a, w_b])`` or ``combine(a, b, weights=[w_a, w_b])`` (as :func:`compose`).
    Always a sum of deltas (of ``W_eff − W``), never of ``A`` and ``B`` separately (averaging
    factors gives ``((A1+A2)/2)((B1+B2)/2)``, which is not the average update). ``weights (K,)``
    may require grad (learned mixing) and may be batched under ``vmap``; a part on a layer
    the others leave alone contributes only there. The lazy path computes each part's
    low-rank path on the same base output.
    """
    parts: Any
    if len(adapters) == 2 and weights is None and not isinstance(adapters[1], AdapterNode):
        parts, weights = adapters  # combine(adapters, weights), or a bad first argument Combined refuses
    elif len(adapters) == 1 and isinstance(adapters[0], (list, tuple)):
        parts = adapters[0]  # combine([a, b], weights=...)
    else:
        parts = adapters  # combine(a, b, weights=...)
    if weights is None:
        raise TypeError(  # error: combine-no-weights
            "combine() needs weights, one per adapter: combine([a, b], [w_a, w_b]) or combine(a, b, weights=[w_a, w_b])"
        )
    return Combined(parts, weights)


