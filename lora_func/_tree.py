"""The adapter tree's node base: fields declared once, the interface every node implements
(:class:`AdapterNode`), the walk over a tree, and the pytree registration.

Each node type declares its fields once, as class attributes (equinox-style):
:func:`tensor_dict` (a dict of tensors: an ``Adapter``'s ``params`` and ``buffers``),
:func:`own_tensor` (a trainable tensor a combinator holds itself, e.g. ``Combined.weights``)
and :func:`static_field` (hashable configuration). The metaclass turns them into slots; the
pytree children and context, the unchecked rebuilds (:meth:`AdapterNode._build`), the saved
file's fields and the own-tensor shapes all come from these declarations. The node types
themselves are in :mod:`lora_func.adapter`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch.utils._pytree as pytree
from torch import Tensor

from lora_func import _optree

__all__ = [
    "NODE_TYPES",
    "AdapterNode",
    "Field",
    "leaves",
    "own_tensor",
    "part_prefix",
    "parts_field",
    "prefixed",
    "static_field",
    "tensor_dict",
    "unprefixed",
    "walk",
]

# Node tag (the "kind" of a node in a saved file) -> node type; filled by AdapterNode subclasses.
NODE_TYPES: dict[str, type[AdapterNode]] = {}

# Between a part's index and its keys in a combinator's flat params/buffers: "1/<key>".
PART_SEPARATOR = "/"


def part_prefix(prefix: str, index: int) -> str:
    """The key prefix of part ``index`` of the node whose prefix is ``prefix``."""
    return f"{prefix}{index}{PART_SEPARATOR}"


def prefixed(dicts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    return {prefix + key: value for i, d in enumerate(dicts) for prefix in (part_prefix("", i),) for key, value in d.items()}


def unprefixed(flat: Mapping[str, Tensor], n: int) -> list[dict[str, Tensor]]:
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
    name = f"lora_func.{cls.__name__}" if cls.__module__ == "lora_func.adapter" else f"{cls.__module__}.{cls.__qualname__}"
    pytree.register_pytree_node(
        cls,
        flatten,
        cls._tree_unflatten,
        serialized_type_name=name,
        flatten_with_keys_fn=lambda node: node._tree_flatten(),
    )
    _optree.register(cls, flatten, cls._tree_unflatten)


# The field kinds that are pytree children (in declaration order, before the parts).
CHILD_KINDS = ("tensors", "tensor")


@dataclasses.dataclass(frozen=True)
class Field:
    """One declared field of a node type (see :func:`tensor_dict`, :func:`own_tensor`,
    :func:`static_field`); the class attribute is replaced by a slot of the same name."""

    kind: str  # "tensors" (a dict of tensors), "tensor" (an own trainable tensor), "static" or "parts"
    shape: Callable[[Any], tuple[int, ...]] | None = None
    default: Any = None


def tensor_dict() -> Any:
    """A field holding a dict of tensors (a pytree child): an ``Adapter``'s ``params``, ``buffers``."""
    return Field("tensors")


def own_tensor(*, shape: Callable[[Any], tuple[int, ...]]) -> Any:
    """A trainable tensor a combinator holds itself (a pytree child, in ``params`` under its
    name, saved as ``params/<prefix><name>``, stacked along the stack axis); ``shape(node)`` is
    its shape without stack axes, from the node's ``parts`` only (a saved file's skeleton has
    no tensors)."""
    return Field("tensor", shape)


def parts_field() -> Any:
    """The field holding a combinator's children (pytree children after its tensors)."""
    return Field("parts")


def static_field(default: Any = None) -> Any:
    """A hashable, non-tensor field (pytree context; a combinator's is saved as JSON)."""
    return Field("static", default=default)


class _NodeMeta(abc.ABCMeta):
    """Turns the fields a node class declares (class attributes made by :func:`tensor_dict`,
    :func:`own_tensor`, :func:`static_field`) into slots, and records them, inherited ones
    first, in ``cls.fields``."""

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> _NodeMeta:
        declared = {key: value for key, value in namespace.items() if isinstance(value, Field)}
        for key in declared:
            del namespace[key]
        namespace["__slots__"] = tuple(namespace.get("__slots__", ())) + tuple(declared)
        inherited: dict[str, Field] = {}
        for base in reversed(bases):
            inherited |= getattr(base, "fields", {})
        namespace["fields"] = inherited | declared
        return super().__new__(mcs, name, bases, namespace, **kwargs)


class AdapterNode(metaclass=_NodeMeta):
    """A frozen node of the adapter tree: an :class:`Adapter` (a leaf) or a :class:`Combinator`.

    ``parts``: the children, in application order (``()`` for a leaf). A subclass declared
    with ``tag="..."`` (``class Foo(Combinator, tag="foo")``) is registered: its tag names it
    in saved files (:data:`NODE_TYPES`), and it becomes a torch pytree and optree node whose
    children are its tensor fields, then its parts, and whose context is its static fields.
    Construction validates its arguments; the internal rebuilds (:meth:`_build`: ``with_params``,
    pytree unflatten under ``tree_map`` / ``vmap``, whose leaves may be any objects) do not.
    """

    __slots__ = ()
    tag: ClassVar[str]
    # The name of the public function that builds this kind of node, for messages and summaries.
    verb: ClassVar[str]
    # Every declared field by name, inherited first (filled by the metaclass).
    fields: ClassVar[dict[str, Field]]

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

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # copy, deepcopy, pickle and torch.save rebuild a node from its fields (their default
        # restores slots by setattr, which a frozen node refuses); cached slots are left out
        return (_rebuilt_node, (type(self), {name: getattr(self, name) for name in self.fields}))

    @classmethod
    def _build(cls, **values: Any) -> Any:
        """A node of these field values (``parts`` included where the type has them), without
        the constructor's checks; a static field left out takes its default."""
        node = object.__new__(cls)
        for name, field in cls.fields.items():
            object.__setattr__(node, name, values[name] if name in values or field.kind != "static" else field.default)
        return node

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        """The names of the trainable tensors the node type holds itself (:func:`own_tensor`)."""
        return tuple(name for name, field in cls.fields.items() if field.kind == "tensor")

    @classmethod
    def static_fields(cls) -> tuple[str, ...]:
        return tuple(name for name, field in cls.fields.items() if field.kind == "static")

    @classmethod
    def own_shapes_of(cls, node: Any) -> dict[str, tuple[int, ...]]:
        """The shape of each own tensor without stack axes for a node of this type with
        ``node.parts`` (a node, or a saved file's skeleton)."""
        return {name: field.shape(node) for name, field in cls.fields.items() if field.shape is not None}

    def own_params(self) -> dict[str, Tensor]:
        """Trainable tensors the node holds itself, not through its parts (``Combined``: its
        ``weights``), keyed as in ``params``; ``{}`` for an ``Adapter`` (its tensors are its
        layers')."""
        return {name: getattr(self, name) for name in self.tensor_fields()}

    def own_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each :meth:`own_params` tensor without stack axes."""
        return self.own_shapes_of(self)

    def static(self) -> tuple:
        """The node's hashable non-tensor configuration (pytree context), ``()`` for none."""
        return tuple(getattr(self, name) for name in self.static_fields())

    def _tree_flatten(self) -> tuple[list[tuple[Any, Any]], Any]:
        """``([(pytree key, child), ...], context)``: the tensor fields, then the parts."""
        children = [(pytree.GetAttrKey(name), getattr(self, name)) for name, f in self.fields.items() if f.kind in CHILD_KINDS]
        parts: list[tuple[Any, Any]] = [(pytree.SequenceKey(i), part) for i, part in enumerate(self.parts)]
        return children + parts, (len(self.parts), self.static())

    @classmethod
    def _tree_unflatten(cls, children: Iterable, context: Any) -> AdapterNode:
        n_parts, static = context
        children = list(children)
        n_own = len(children) - n_parts
        values = dict(zip((n for n, f in cls.fields.items() if f.kind in CHILD_KINDS), children[:n_own], strict=True))
        values |= dict(zip(cls.static_fields(), static, strict=True))
        if "parts" in cls.fields:
            values["parts"] = tuple(children[n_own:])
        return cls._build(**values)

    # ---------------------------------------------------------------- what every node implements

    @property
    @abc.abstractmethod
    def parts(self) -> tuple[AdapterNode, ...]:
        """The children, in application order (``()`` for a leaf)."""

    @property
    @abc.abstractmethod
    def params(self) -> dict[str, Tensor]:
        """Every trainable tensor of the tree, flat: ``"<module>.<name>"`` in a leaf, prefixed
        ``"<part index>/"`` through a combinator."""

    @property
    @abc.abstractmethod
    def buffers(self) -> dict[str, Tensor]:
        """Every frozen tensor of the tree, flat, keyed as :attr:`params`."""

    @property
    @abc.abstractmethod
    def stack_shape(self) -> tuple[int, ...]:
        """Leading stack dims (``()`` for a single adapter, ``(K,)`` after ``stack``)."""

    @abc.abstractmethod
    def with_params(self, params: Mapping[str, Tensor]) -> AdapterNode:
        """A new node with these trainable tensors (the keys of :attr:`params`)."""

    @abc.abstractmethod
    def with_buffers(self, buffers: Mapping[str, Tensor]) -> AdapterNode:
        """A new node with these frozen tensors (the keys of :attr:`buffers`)."""

    @abc.abstractmethod
    def detach(self) -> AdapterNode:
        """The same values as new leaf tensors in new storage (params requiring grad)."""

    @abc.abstractmethod
    def num_parameters(self) -> int:
        """Trainable scalars (one stack member's, for a stacked adapter)."""


def _rebuilt_node(cls: type[AdapterNode], values: dict[str, Any]) -> AdapterNode:
    """The node of :meth:`AdapterNode.__reduce__` (module level, so pickle finds it)."""
    return cls._build(**values)
