"""The Adapter container: plain tensors plus static layout, registered as a torch pytree."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lora_func._types import LayerInfo, TensorDict, Variant
from lora_func.spec import AdapterSpec
from lora_func.targeting import Target
from lora_func.variants import get_variant

__all__ = ["Adapter", "AdapterLayer", "stack", "take", "unstack"]


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


class Adapter:
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
    """

    __slots__ = ("buffers", "layers", "params", "spec")
    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    spec: AdapterSpec
    layers: tuple[AdapterLayer, ...]

    def __init__(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        spec: AdapterSpec,
        layers: Sequence[AdapterLayer],
    ) -> None:
        object.__setattr__(self, "params", dict(params))
        object.__setattr__(self, "buffers", dict(buffers))
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "layers", tuple(layers))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Adapter is immutable; use adapter.with_params(...) instead of setting {name!r}")

    @property
    def variant(self) -> Variant:
        return get_variant(self.spec.variant)

    def with_params(self, params: Mapping[str, Tensor]) -> Adapter:
        """A new adapter with these trainable tensors (same keys as ``self.params``)."""
        _check_same_keys("with_params", params, self.params)
        return Adapter(params, self.buffers, self.spec, self.layers)

    def with_buffers(self, buffers: Mapping[str, Tensor]) -> Adapter:
        _check_same_keys("with_buffers", buffers, self.buffers)
        return Adapter(self.params, buffers, self.spec, self.layers)

    def detach(self) -> Adapter:
        """The same values as new leaf tensors: params with ``requires_grad=True`` (ready for a
        ``torch.optim`` optimiser, e.g. after :func:`stack`), buffers without."""
        return Adapter(
            {k: v.detach().requires_grad_(True) for k, v in self.params.items()},
            {k: v.detach() for k, v in self.buffers.items()},
            self.spec,
            self.layers,
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
        return (
            f"Adapter(variant={self.spec.variant!r}, layers={len(self.layers)}, "
            f"params={self.num_parameters()}{stacked})"
        )


def _check_same_keys(where: str, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or unexpected:
        raise KeyError(f"Adapter.{where}: missing keys {missing}, unexpected keys {unexpected}")


def _flatten(adapter: Adapter) -> tuple[list, tuple]:
    return [adapter.params, adapter.buffers], (adapter.spec, adapter.layers)


def _unflatten(children: Iterable, context: tuple) -> Adapter:
    params, buffers = children
    return Adapter(params, buffers, *context)


def _flatten_with_keys(adapter: Adapter) -> tuple[list, tuple]:
    children, context = _flatten(adapter)
    return [(pytree.GetAttrKey("params"), children[0]), (pytree.GetAttrKey("buffers"), children[1])], context


pytree.register_pytree_node(
    Adapter,
    _flatten,
    _unflatten,
    serialized_type_name="lora_func.Adapter",
    flatten_with_keys_fn=_flatten_with_keys,
)


def stack(adapters: Sequence[Adapter]) -> Adapter:
    """One adapter whose tensors have a new leading axis of size ``len(adapters)``.

    ``torch.func.vmap(f)(stack([a, b]))`` runs ``f(a)`` and ``f(b)`` at once. All adapters
    must share spec and layers (same variant, targets and ranks).
    """
    adapters = list(adapters)
    if not adapters:
        raise ValueError("stack() needs at least one adapter")
    first = adapters[0]
    for i, other in enumerate(adapters[1:], start=1):
        if other.spec != first.spec or other.layers != first.layers:
            diff = [
                a.target.module
                for a, b in zip(first.layers, other.layers, strict=False)
                if a != b
            ] or ["spec or number of layers"]
            raise ValueError(
                f"stack(): adapter {i} differs from adapter 0 in {diff[:5]}; only adapters with the same "
                f"spec and per-layer ranks stack (build them from one AdapterSpec)"
            )
    return pytree.tree_map(lambda *ts: torch.stack(ts), *adapters)


def unstack(adapter: Adapter) -> list[Adapter]:
    """The inverse of :func:`stack`: a list of the adapters along the leading axis."""
    if not adapter.stack_shape:
        raise ValueError("unstack(): this adapter is not stacked (it has no leading stack axis)")
    return [take(adapter, i) for i in range(adapter.stack_shape[0])]


def take(adapter: Adapter, index: int | Tensor) -> Adapter:
    """The stack members at ``index``: an int gives one adapter, a 1-D integer tensor gives a
    stacked adapter of ``len(index)`` members (e.g. one adapter per example of a batch)."""
    if not adapter.stack_shape:
        raise ValueError("take(): this adapter is not stacked; build one with lora_func.stack([...])")
    return pytree.tree_map(lambda t: t[index], adapter)
