"""The adapter tree: one :class:`Adapter` per variant (the leaves) and the combinators over
them (:class:`Composed`, :class:`Combined`), all frozen nodes of one base, :class:`AdapterNode`.

Every node has ``parts`` (its children: empty for an ``Adapter``) and is a torch pytree (and
an optree one, see :mod:`lora_func._optree`) whose leaves are its tensors. :func:`walk` visits
a tree in application order with each node's key prefix (``"1/0/"``: part 0 of part 1), the
prefix its tensors carry in the root's ``params`` / ``buffers``.

A new combinator is one subclass of :class:`Combinator` (see there for what it defines); the
tree walks, ``with_params``, pytrees, ``stack`` / ``take``, the overlays and ``save`` / ``load``
handle it from that.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lora_func import _optree
from lora_func._steps import ChainStep, LayerStep, SumStep
from lora_func.variants import LayerInfo, TensorDict, Variant
from lora_func.variants._contract import RANK_ALPHA, RANK_MASK
from lora_func.spec import AdapterSpec
from lora_func.targeting import Target
from lora_func.variants import get_variant

__all__ = [
    "NODE_TYPES",
    "Adapter",
    "AdapterLayer",
    "AdapterLike",
    "AdapterNode",
    "Combinator",
    "Combined",
    "Composed",
    "combine",
    "compose",
    "leaf_adapters",
    "leaves",
    "part_prefix",
    "stack",
    "take",
    "target_weight_keys",
    "unstack",
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


def _split(flat: Mapping[str, Tensor], module: str, names: Iterable[tuple[str, tuple[int, ...]]]) -> TensorDict:
    return {name: flat[f"{module}.{name}"] for name, _ in names}


# ----------------------------------------------------------------------------- the tree

# Node tag (the "kind" of a node in a saved file) -> node type; filled by AdapterNode subclasses.
NODE_TYPES: dict[str, type[AdapterNode]] = {}

# Between a part's index and its keys in a combinator's flat params/buffers: "1/<key>".
PART_SEPARATOR = "/"


def part_prefix(prefix: str, index: int) -> str:
    """The key prefix of part ``index`` of the node whose prefix is ``prefix``."""
    return f"{prefix}{index}{PART_SEPARATOR}"


def _prefixed(dicts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    return {prefix + key: value for i, d in enumerate(dicts) for prefix in (part_prefix("", i),) for key, value in d.items()}


def _unprefixed(flat: Mapping[str, Tensor], n: int) -> list[dict[str, Tensor]]:
    out: list[dict[str, Tensor]] = [{} for _ in range(n)]
    for key, value in flat.items():
        index, _, rest = key.partition(PART_SEPARATOR)
        out[int(index)][rest] = value
    return out


def walk(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(key prefix, node)`` for ``node`` and every node below it, pre-order (a node before
    its parts, parts in application order). Needs only ``node.parts``, so it also walks
    io/native's skeletons."""
    yield prefix, node
    for i, part in enumerate(node.parts):
        yield from walk(part, part_prefix(prefix, i))


def leaves(node: Any) -> Iterator[tuple[str, Any]]:
    """``(key prefix, leaf)`` for every leaf (``Adapter``: no parts) of ``node``, in order."""
    return ((prefix, n) for prefix, n in walk(node) if not n.parts)


def _register_pytree(cls: type[AdapterNode]) -> None:
    """One registration path for every node type: torch pytree and optree, from the node's
    ``_tree_flatten`` (children with their keys, and a context) and ``_tree_unflatten``."""

    def flatten(node: AdapterNode) -> tuple[list, Any]:
        keyed, context = node._tree_flatten()
        return [child for _, child in keyed], context

    if cls in pytree.SUPPORTED_NODES:
        return
    # The package's own types keep their public names ("lora_func.Adapter").
    name = f"lora_func.{cls.__name__}" if cls.__module__ == __name__ else f"{cls.__module__}.{cls.__qualname__}"
    pytree.register_pytree_node(
        cls,
        flatten,
        cls._tree_unflatten,
        serialized_type_name=name,
        flatten_with_keys_fn=lambda node: node._tree_flatten(),
    )
    _optree.register(cls, flatten, cls._tree_unflatten)


class AdapterNode:
    """A frozen node of the adapter tree: an :class:`Adapter` (a leaf) or a :class:`Combinator`.

    ``parts``: the children, in application order (``()`` for a leaf). A subclass declared
    with ``tag="..."`` (``class Foo(Combinator, tag="foo")``) is registered: its tag names it
    in saved files (:data:`NODE_TYPES`), and it becomes a torch pytree and optree node.
    Construction validates its arguments; the internal rebuilds (``with_params``, pytree
    unflatten under ``tree_map`` / ``vmap``, whose leaves may be any objects) do not.
    """

    __slots__ = ()
    tag: ClassVar[str]
    # The name of the public function that builds this kind of node, for messages and summaries.
    verb: ClassVar[str]
    parts: tuple[AdapterNode, ...]

    def __init_subclass__(cls, *, tag: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if tag is not None:
            cls.tag = tag
            if "verb" not in cls.__dict__:
                cls.verb = tag
            NODE_TYPES[tag] = cls
            _register_pytree(cls)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(  # error: adapter-immutable
            f"{type(self).__name__} is immutable; use with_params(...) instead of setting {name!r} "
            f"(adapter.with_params(params) returns a new one)"
        )

    def own_params(self) -> dict[str, Tensor]:
        """Trainable tensors the node holds itself, not through its parts (``Combined``: its
        ``weights``), keyed as in ``params``; ``{}`` for an ``Adapter`` (its tensors are its
        layers')."""
        return {}

    def own_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each :meth:`own_params` tensor without stack axes."""
        return {}

    def static(self) -> tuple:
        """The node's hashable non-tensor configuration (pytree context), ``()`` for none."""
        return ()

    # A registered subclass defines ``_tree_flatten(self) -> ([(pytree key, child), ...],
    # context)`` and the classmethod ``_tree_unflatten(children, context) -> node`` (no
    # validation: the children may be any objects).


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

    __slots__ = ("buffers", "layers", "members", "params", "spec")
    parts: ClassVar[tuple[AdapterNode, ...]] = ()
    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    spec: AdapterSpec
    layers: tuple[AdapterLayer, ...]
    members: tuple[tuple[AdapterSpec, tuple[AdapterLayer, ...]], ...] | None

    def __init__(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        spec: AdapterSpec,
        layers: Sequence[AdapterLayer],
        members: Sequence[tuple[AdapterSpec, tuple[AdapterLayer, ...]]] | None = None,
    ) -> None:
        layers = tuple(layers) if isinstance(layers, Iterable) else layers  # type: ignore[assignment]
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
        for arg, flat, keys in (
            ("params", params, [key for layer in layers for key in layer.param_keys()]),
            ("buffers", buffers, [key for layer in layers for key in layer.buffer_keys()]),
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
        for layer in layers:
            for arg, flat, shapes in (("params", params, layer.param_shapes), ("buffers", buffers, layer.buffer_shapes)):
                for name, shape in shapes:
                    key = f"{layer.target.module}.{name}"
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
        self._fill(params, buffers, spec, layers, members)

    def _fill(self, params: Mapping[str, Any], buffers: Mapping[str, Any], spec: AdapterSpec, layers: Sequence[AdapterLayer], members: Any = None) -> None:
        object.__setattr__(self, "params", dict(params))
        object.__setattr__(self, "buffers", dict(buffers))
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "layers", tuple(layers))
        # Only for a rank-padded stack: each member's own (spec, layers), so unstack() gives the
        # originals back (shapes, ranks and alphas).
        object.__setattr__(self, "members", None if members is None else tuple(members))

    @classmethod
    def _unchecked(cls, *fields: Any) -> Adapter:
        """An adapter of ``(params, buffers, spec, layers[, members])`` without the
        constructor's checks: for rebuilds from an adapter's own parts, and for pytree
        unflatten, whose leaves may be anything (``None``, ``object()``)."""
        adapter = object.__new__(cls)
        adapter._fill(*fields)
        return adapter

    @property
    def variant(self) -> Variant:
        return get_variant(self.spec.variant)

    def with_params(self, params: Mapping[str, Tensor]) -> Adapter:
        """A new adapter with these trainable tensors (same keys as ``self.params``)."""
        _check_same_keys("with_params", params, self.params)
        dtype = self.spec.dtype
        if any(not isinstance(v, Tensor) or v.dtype != dtype for v in params.values()):
            _check_params_dtype("Adapter.with_params", params, dtype)
        return Adapter._unchecked(params, self.buffers, self.spec, self.layers, self.members)

    def with_buffers(self, buffers: Mapping[str, Tensor]) -> Adapter:
        _check_same_keys("with_buffers", buffers, self.buffers)
        return Adapter._unchecked(self.params, buffers, self.spec, self.layers, self.members)

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
        )

    def layer_tensors(self, layer: AdapterLayer) -> tuple[TensorDict, TensorDict]:
        """``(params, buffers)`` of one layer, keyed by short names (``"lora_A"``)."""
        module = layer.target.module
        return _split(self.params, module, layer.param_shapes), _split(self.buffers, module, layer.buffer_shapes)

    def num_parameters(self) -> int:
        """Trainable scalars (one stack member's, for a stacked adapter)."""
        return sum(int(torch.Size(shape).numel()) for layer in self.layers for _, shape in layer.param_shapes)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Leading stack dims (``()`` for a single adapter, ``(K,)`` after :func:`stack`)."""
        for layer in self.layers:
            for name, shape in layer.param_shapes + layer.buffer_shapes:
                key = f"{layer.target.module}.{name}"
                tensor = self.params.get(key, self.buffers.get(key))
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

    def _tree_flatten(self) -> tuple[list[tuple[Any, Any]], Any]:
        children = [(pytree.GetAttrKey("params"), self.params), (pytree.GetAttrKey("buffers"), self.buffers)]
        return children, (self.spec, self.layers, self.members)

    @classmethod
    def _tree_unflatten(cls, children: Iterable, context: Any) -> Adapter:
        params, buffers = children
        return cls._unchecked(params, buffers, *context)


class Combinator(AdapterNode):
    """A node that combines its ``parts`` (other nodes) on each layer they adapt.

    A new combinator is one subclass, declared with ``tag="..."`` (its name in saved files),
    that defines:

    - ``__slots__ = ("parts", *tensor_fields, *static_fields)``;
    - ``__init__``: validates its arguments (this is the public constructor), then sets each
      attribute with ``object.__setattr__``;
    - ``layer_step(steps, present) -> LayerStep``: how the steps of its parts that adapt one
      layer (``steps[j]`` is part ``present[j]``'s) combine there (see :mod:`lora_func._steps`);
    - optionally ``tensor_fields`` (names of trainable tensors the node holds itself; they
      appear unprefixed in ``params``, are saved as ``params/<prefix><name>``, stack along the
      stack axis) with ``own_shapes()`` (their shapes without stack axes), ``static_fields``
      (JSON-able, hashable configuration), ``verb`` (the public function that builds it, for
      messages), and ``__repr__``.

    Everything else (``params``, ``buffers``, ``with_params``, ``detach``, ``stack_shape``,
    pytree flatten/unflatten, ``stack`` / ``take`` / ``unstack``, ``save`` / ``load``) is here.
    """

    __slots__ = ()
    tensor_fields: ClassVar[tuple[str, ...]] = ()
    static_fields: ClassVar[tuple[str, ...]] = ()

    # A subclass defines layer_step(self, steps: Sequence[LayerStep], present: Sequence[int]) -> LayerStep.

    @classmethod
    def _make(cls, parts: Sequence[AdapterNode], own: Mapping[str, Any], static: Sequence[Any]) -> Combinator:
        """A node without the constructor's checks (rebuilds, pytree unflatten, load)."""
        node = object.__new__(cls)
        object.__setattr__(node, "parts", tuple(parts))
        for name in cls.tensor_fields:
            object.__setattr__(node, name, own[name])
        for name, value in zip(cls.static_fields, static, strict=True):
            object.__setattr__(node, name, value)
        return node

    def rebuild(self, parts: Sequence[AdapterNode], own: Mapping[str, Any] | None = None) -> Combinator:
        """The same kind of node (same static configuration) over ``parts``, with ``own``
        tensors (default: this node's), unchecked."""
        return self._make(parts, self.own_params() if own is None else own, self.static())

    def own_params(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self.tensor_fields}

    def static(self) -> tuple:
        return tuple(getattr(self, name) for name in self.static_fields)

    @property
    def params(self) -> dict[str, Tensor]:
        prefixed = _prefixed([part.params for part in self.parts])  # type: ignore[attr-defined]
        return {**self.own_params(), **prefixed} if self.tensor_fields else prefixed

    @property
    def buffers(self) -> dict[str, Tensor]:
        return _prefixed([part.buffers for part in self.parts])  # type: ignore[attr-defined]

    def with_params(self, params: Mapping[str, Tensor]) -> Combinator:
        _check_same_keys("with_params", params, self.params)
        own = {name: params[name] for name in self.tensor_fields}
        rest = _unprefixed({k: v for k, v in params.items() if k not in own} if own else params, len(self.parts))
        return self.rebuild([part.with_params(p) for part, p in zip(self.parts, rest, strict=True)], own)  # type: ignore[attr-defined]

    def with_buffers(self, buffers: Mapping[str, Tensor]) -> Combinator:
        _check_same_keys("with_buffers", buffers, self.buffers)
        rest = _unprefixed(buffers, len(self.parts))
        return self.rebuild([part.with_buffers(b) for part, b in zip(self.parts, rest, strict=True)])  # type: ignore[attr-defined]

    def detach(self) -> Combinator:
        own = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in self.own_params().items()}
        return self.rebuild([part.detach() for part in self.parts], own)  # type: ignore[attr-defined]

    def num_parameters(self) -> int:
        own = sum(math.prod(shape) for shape in self.own_shapes().values())
        return own + sum(part.num_parameters() for part in self.parts)  # type: ignore[attr-defined]

    @property
    def stack_shape(self) -> tuple[int, ...]:
        own = self.own_params()
        for name, shape in self.own_shapes().items():
            return tuple(own[name].shape[: own[name].dim() - len(shape)])
        return self.parts[0].stack_shape  # type: ignore[attr-defined]

    def json_fields(self) -> dict[str, Any]:
        """What a saved file records of this node besides its kind and parts: its static
        fields and whether each own tensor requires grad."""
        return {
            **{name: getattr(self, name) for name in self.static_fields},
            **{f"{name}_requires_grad": t.requires_grad for name, t in self.own_params().items()},
        }

    @classmethod
    def from_json(cls, fields: Mapping[str, Any], parts: Sequence[AdapterNode], own: Mapping[str, Tensor]) -> Combinator:
        """The node a saved file describes (:meth:`json_fields`), given its parts and tensors."""
        own = {name: t.requires_grad_(bool(fields[f"{name}_requires_grad"])) for name, t in own.items()}
        return cls._make(parts, own, tuple(fields[name] for name in cls.static_fields))

    def __repr__(self) -> str:
        static = "".join(f", {name}={getattr(self, name)!r}" for name in self.static_fields)
        return f"{type(self).__name__}({', '.join(map(repr, self.parts))}{static})"

    def _tree_flatten(self) -> tuple[list[tuple[Any, Any]], Any]:
        own = [(pytree.GetAttrKey(name), getattr(self, name)) for name in self.tensor_fields]
        return own + [(pytree.SequenceKey(i), part) for i, part in enumerate(self.parts)], (len(self.parts), self.static())

    @classmethod
    def _tree_unflatten(cls, children: Iterable, context: Any) -> Combinator:
        n_parts, static = context
        children = list(children)
        n_own = len(children) - n_parts
        return cls._make(children[n_own:], dict(zip(cls.tensor_fields, children[:n_own], strict=True)), static)


class Composed(Combinator, tag="composed"):
    """Adapters applied in order (see :func:`compose`): on a layer that several parts adapt,
    each part sees the effective weight of the parts before it.

    ``params`` / ``buffers`` are flat dicts keyed ``f"{i}/{key}"`` (``i`` the part index, e.g.
    ``"1/model.layers.0.mlp.up_proj.ia3_l"``), so the training idiom is the same as for one
    adapter: ``grad(lambda p: loss(composed.with_params(p)))(composed.params)``.
    """

    __slots__ = ("parts",)
    verb = "compose"

    def __init__(self, parts: Sequence[AdapterLike]) -> None:
        parts = tuple(parts)
        if not parts:
            raise ValueError("compose() needs at least one adapter")  # error: compose-empty
        adapted: dict[str, int] = {}
        for i, part in enumerate(parts):
            for leaf in leaf_adapters(part):
                if not leaf.variant.replaces_weight:
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
        shapes = {part.stack_shape for part in parts}  # type: ignore[attr-defined]
        if len(shapes) > 1:
            raise ValueError(f"compose(): parts have different stack shapes {sorted(shapes)}; stack each part alike")  # error: compose-stack-shapes
        object.__setattr__(self, "parts", parts)

    def layer_step(self, steps: Sequence[LayerStep], present: Sequence[int]) -> LayerStep:
        """The parts' steps in order, as one flat chain (a composed part's chain is spliced in)."""
        flat = [s for step in steps for s in (step.steps if isinstance(step, ChainStep) else (step,))]
        return flat[0] if len(flat) == 1 else ChainStep(flat)


class Combined(Combinator, tag="combined"):
    """A weighted sum of adapters' deltas on one base (see :func:`combine`).

    ``weights (K,)`` (one per part) is ``params["weights"]``, so it can be trained (learned
    mixing, as in LoraHub) or vmapped over; the parts' tensors are keyed ``f"{i}/{key}"``.
    """

    __slots__ = ("parts", "weights")
    tensor_fields = ("weights",)
    verb = "combine"
    weights: Tensor

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
                weights = torch.as_tensor(weights)
            except (TypeError, ValueError, RuntimeError):
                weights = torch.tensor([])  # not numbers: reported below with the expected form
        if not weights.is_floating_point() or weights.dim() != 1 or weights.shape[0] != len(parts):
            shown = f"shape {tuple(weights.shape)} dtype {weights.dtype}" if weights.numel() or isinstance(given, Tensor) else repr(given)[:80]
            raise ValueError(  # error: combine-weights
                f"combine(): weights must be a 1-D float tensor with one entry per adapter ({len(parts)}), got {shown}"
            )
        shapes = {part.stack_shape for part in parts}  # type: ignore[attr-defined]
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
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "weights", weights)

    def own_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weights": (len(self.parts),)}

    def layer_step(self, steps: Sequence[LayerStep], present: Sequence[int]) -> LayerStep:
        """``W + Σ_k w_k (W_eff_k − W)`` over the parts present on the layer (their weights only)."""
        weights = self.weights if len(present) == len(self.parts) else self.weights[..., list(present)]
        return SumStep(steps, weights)

    def __repr__(self) -> str:
        return f"Combined({', '.join(map(repr, self.parts))}, weights={tuple(self.weights.shape)})"


def compose(*adapters: AdapterLike) -> Composed:
    """One adapter that applies ``adapters[0]``, then ``adapters[1]`` on top, and so on.

    On a layer that several of them adapt, each sees the previous ones' effective weight and
    bias: ``W_eff = f_b(f_a(W, b))`` merged, and ``f_b``'s activation form runs with
    ``f_a``'s as its base layer on the lazy path (the two agree). Order matters (LoRA then
    DoRA renormalises the LoRA update; DoRA then LoRA does not). On different layers the parts
    are independent. Parts may themselves be composed or combined.

    Raises ``ValueError`` when a variant that replaces the base weight (PiSSA: its residual is
    fixed at init) comes after another part on the same layer, since it would silently drop
    the earlier parts' effect there.
    """
    return Composed(adapters)


def combine(adapters: Sequence[AdapterLike], weights: Tensor | Sequence[float]) -> Combined:
    """The weighted sum of the adapters' deltas on one base: ``W + Σ_k w_k (W_eff_k(W) − W)``.

    Always a sum of deltas (of ``W_eff − W``), never of ``A`` and ``B`` separately (averaging
    factors gives ``((A1+A2)/2)((B1+B2)/2)``, which is not the average update). ``weights (K,)``
    may require grad (learned mixing) and may be batched under ``vmap``; a part on a layer
    the others leave alone contributes only there. The lazy path computes each part's
    low-rank path on the same base output.
    """
    return Combined(adapters, weights)


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
        if mine != ref:
            diff = [a.target.module for a, b in zip(first.layers, other.layers, strict=False) if (a.target, _info_key(a.info)) != (b.target, _info_key(b.info))]
            raise ValueError(  # error: stack-other-layers
                f"stack(): adapter {i} adapts other layers than adapter 0 ({diff[:5] or 'a different number of layers'}); "
                f"build the adapters from one model and one AdapterSpec (ranks may differ)"
            )
        if other.stack_shape != first.stack_shape or other.members is not None:
            raise ValueError(f"stack(): adapter {i} is itself stacked (stack_shape {other.stack_shape}); unstack it first")  # error: stack-nested
    if first.members is not None:
        raise ValueError("stack(): adapter 0 is itself a rank-padded stack; unstack it first")  # error: stack-nested-padded
    if all(other.layers == first.layers for other in adapters[1:]):
        return pytree.tree_map(lambda *ts: torch.stack(ts), *adapters)
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
            bad = [lay.target.module for lay in column if any(
                have != want and not _is_rank_axis(variant, name, axis)
                for axis, (have, want) in enumerate(zip(dict(lay.param_shapes + lay.buffer_shapes)[name], shape, strict=True))
            )]
            if bad:
                raise ValueError(  # error: stack-not-rank-axis
                    f"stack(): {variant.name} tensor {name!r} of {bad[0]} differs in shape on an axis that is not a "
                    f"rank axis; these adapters cannot be padded to one stack"
                )
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
    return Adapter._unchecked(
        {k: torch.stack(v) for k, v in params.items()},
        {k: torch.stack(v) for k, v in buffers.items()},
        first.spec,
        layers,
        [(a.spec, a.layers) for a in adapters],
    )


def _is_rank_axis(variant: Variant, name: str, axis: int) -> bool:
    axes = variant.rank_axes.get(name, ())
    return axis == axes if isinstance(axes, int) else axis in axes


def stack(adapters: Sequence[AdapterLike]) -> AdapterLike:
    """One adapter whose tensors have a new leading axis of size ``len(adapters)``.

    ``torch.func.vmap(f)(stack([a, b]))`` runs ``f(a)`` and ``f(b)`` at once. The adapters
    must share variant, targets and options; their ranks (and alphas) may differ: then every
    tensor is zero-padded along the variant's rank axes to the largest rank, and each layer
    gets two buffers, ``rank_mask (K, r_max)`` and ``rank_alpha (K,)``, so each member keeps
    its own scale and its padded entries never reach the output (their gradient is exactly
    zero). :func:`unstack` gives the originals back. Composed/Combined adapters of the same
    structure stack part by part.
    """
    if isinstance(adapters, (AdapterNode, Mapping, str)) or not isinstance(adapters, Iterable):
        raise TypeError(  # error: stack-not-a-list
            f"stack() expects a list of adapters, got {type(adapters).__name__}; e.g. lora_func.stack([adapter_0, adapter_1])"
        )
    adapters = list(adapters)
    if not adapters:
        raise ValueError("stack() needs at least one adapter")  # error: stack-empty
    for adapter in adapters:
        leaf_adapters(adapter)
    kinds = {(type(a), a.static()) for a in adapters}
    if len(kinds) > 1:
        shown = sorted(f"{kind.__name__}{static if static else ''}" for kind, static in kinds)
        raise TypeError(f"stack(): mixed kinds {shown}; stack adapters of one kind")  # error: stack-mixed-kinds
    first = adapters[0]
    if not isinstance(first, Combinator):
        return _as_leaves(_stack_adapters(adapters), adapters)  # type: ignore[arg-type]
    n = {len(a.parts) for a in adapters}
    if len(n) > 1:
        raise ValueError(f"stack(): {type(first).__name__} adapters with different numbers of parts {sorted(n)}")  # error: stack-parts
    parts = [stack([a.parts[i] for a in adapters]) for i in range(len(first.parts))]
    own = {}
    for name in first.tensor_fields:
        values = [a.own_params()[name] for a in adapters]
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
    return Adapter._unchecked(params, stacked.buffers, stacked.spec, stacked.layers, stacked.members)


def unstack(adapter: AdapterLike) -> list[AdapterLike]:
    """The inverse of :func:`stack`: the adapters along the leading axis (a rank-padded stack
    gives each member back at its own rank, without the padding and mask buffers)."""
    leaf_adapters(adapter, "unstack(adapter)")
    if not adapter.stack_shape:  # type: ignore[attr-defined]
        raise ValueError("unstack(): this adapter is not stacked (it has no leading stack axis)")  # error: unstack-not-stacked
    return [_member(adapter, k) for k in range(adapter.stack_shape[0])]  # type: ignore[attr-defined]


def _member(adapter: AdapterLike, index: int | Tensor) -> AdapterLike:
    """The stack position ``index`` of every tensor of the tree: an int gives one member (a
    rank-padded leaf back at its own rank), a 1-D tensor a stack of those members."""
    if isinstance(adapter, Combinator):
        own = {name: t[index] for name, t in adapter.own_params().items()}
        return adapter.rebuild([_member(part, index) for part in adapter.parts], own)
    if adapter.members is None:
        return pytree.tree_map(lambda t: t[index], adapter)
    if isinstance(index, Tensor):
        taken = pytree.tree_map(lambda t: t[index], adapter)
        members = [adapter.members[int(i)] for i in index.reshape(-1).tolist()]
        return Adapter._unchecked(taken.params, taken.buffers, taken.spec, taken.layers, members)
    spec, layers = adapter.members[index]
    params, buffers = {}, {}
    for layer in layers:
        for flat, out, shapes in ((adapter.params, params, layer.param_shapes), (adapter.buffers, buffers, layer.buffer_shapes)):
            for name, shape in shapes:
                key = f"{layer.target.module}.{name}"
                out[key] = flat[key][index][tuple(slice(0, n) for n in shape)]
    return Adapter._unchecked(params, buffers, spec, layers)


def take(adapter: AdapterLike, index: int | Tensor) -> AdapterLike:
    """The stack members at ``index``: an int gives one adapter (as :func:`unstack`), a 1-D
    integer tensor gives a stacked adapter of ``len(index)`` members (e.g. one adapter per
    example of a batch, for a mixed-adapter batch under ``vmap``)."""
    leaf_adapters(adapter, "take(adapter, index)")
    if not adapter.stack_shape:  # type: ignore[attr-defined]
        raise ValueError("take(): this adapter is not stacked; build one with lora_func.stack([...])")  # error: take-not-stacked
    size = adapter.stack_shape[0]  # type: ignore[attr-defined]
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
