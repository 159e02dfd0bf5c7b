"""optree registration of the adapter tree's node types, when optree is importable.

torchopt (the functional optimiser library for torch.func) walks its arguments with optree, not
with torch's pytree, so without this an ``Adapter`` is one opaque leaf to it. Every node type
(:class:`lora_func.adapter.AdapterNode` subclass) registers itself here with the same flatten and
unflatten functions it gives torch's pytree, so the two libraries see the same leaves in the
same order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["OPTREE_NAMESPACE", "register", "registered"]

OPTREE_NAMESPACE = "lora_func"

optree: Any
try:
    optree = importlib.import_module("optree")
except ImportError:  # optree is optional: nothing to register
    optree = None


def registered() -> bool:
    """Whether the adapter types are optree pytree nodes (optree is installed)."""
    return optree is not None


def register(cls: type, flatten: Callable[[Any], tuple[list, Any]], unflatten: Callable[[list, Any], Any]) -> None:
    """Register ``cls`` with optree (nothing without optree). ``flatten(node) -> (children,
    context)`` and ``unflatten(children, context) -> node`` are torch pytree's argument order."""
    if optree is None:
        return

    def optree_flatten(obj: Any) -> tuple[list, Any]:
        children, context = flatten(obj)
        return list(children), context

    def optree_unflatten(context: Any, children: Any) -> Any:
        return unflatten(list(children), context)

    # The "lora_func" namespace is optree's documented way. torchopt calls optree without a
    # namespace (the global registry), so the types go there too: lora_func owns them, so no
    # other library registers them differently.
    namespaces = [OPTREE_NAMESPACE]
    global_namespace = getattr(optree.registry, "__GLOBAL_NAMESPACE", None)
    if global_namespace is not None:
        namespaces.append(global_namespace)
    for namespace in namespaces:
        optree.register_pytree_node(cls, optree_flatten, optree_unflatten, namespace=namespace)
