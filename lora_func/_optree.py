"""optree registration of the adapter types, when optree is importable.

torchopt (the functional optimiser library for torch.func) walks its arguments with optree, not
with torch's pytree, so without this an ``Adapter`` is one opaque leaf to it. The flatten and
unflatten functions are the ones adapter.py registered with torch's pytree (read back from its
registry), so the two libraries see the same leaves in the same order.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as torch_pytree

from lora_func.adapter import Adapter, Combined, Composed

__all__ = ["OPTREE_NAMESPACE", "registered"]

OPTREE_NAMESPACE = "lora_func"

try:
    import optree
except ImportError:  # optree is optional: nothing to register
    optree = None  # type: ignore[assignment]


def _register(cls: type, namespace: Any) -> None:
    node = torch_pytree.SUPPORTED_NODES[cls]

    def flatten(obj: Any, _flatten: Any = node.flatten_fn) -> tuple[list, Any]:
        children, context = _flatten(obj)
        return list(children), context

    def unflatten(context: Any, children: Any, _unflatten: Any = node.unflatten_fn) -> Any:
        return _unflatten(list(children), context)

    optree.register_pytree_node(cls, flatten, unflatten, namespace=namespace)


def registered() -> bool:
    """Whether the adapter types are optree pytree nodes (optree is installed)."""
    return optree is not None


if optree is not None:
    for _cls in (Adapter, Composed, Combined):
        # The "lora_func" namespace is optree's documented way. torchopt calls optree without a
        # namespace (the global registry), so the types go there too: lora_func owns them, so
        # no other library registers them differently.
        _register(_cls, OPTREE_NAMESPACE)
        _global = getattr(optree.registry, "__GLOBAL_NAMESPACE", None)
        if _global is not None:
            _register(_cls, _global)
