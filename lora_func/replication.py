"""replicated: peft's ``layer_replication`` as a view of the base, the base never changed.

peft's ``replicate_layers`` rebuilds a model deeper in place: its layer list repeated as a
``layer_map`` says (``[[0, 4], [2, 5]]`` runs layers ``0 1 2 3 2 3 4``), the repeated layers sharing
the base weights, each copy with its own adapter. :func:`replicated` builds the same deeper model
as a new module tree beside the base: the modules on the path to the layer list are shallow
copies, the first occurrence of a layer is the base's own module, every later one a copy whose
parameters are new tensors on the same storage (no weight is copied, and each copy has names of its
own, so an adapter adapts each copy by itself); a layer run at another position than its own is
such a copy too (its ``layer_idx``, the KV cache slot, is its new position, as peft sets it). Its config is a copy with peft's
``num_hidden_layers``. The base model, its modules and its config are never assigned.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

__all__ = ["layer_map_of", "replicated"]

# the view's layer map, read by load_peft / save_peft (peft's config field layer_replication)
_LAYER_MAP = "_lora_func_layer_map"


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose own child, parameter and buffer tables are new dicts (so setting
    a child on the copy leaves ``module`` as it was); the children themselves are shared."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    return out


def _copy_on_same_storage(layer: nn.Module) -> nn.Module:
    """A structural copy of ``layer`` whose parameters and buffers are new tensor objects viewing
    the base's storage (peft's ``clone_module(share_weights=True)``, but under names of its own)."""
    memo: dict[int, object] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = b.detach()
    return copy.deepcopy(layer, memo)


def _layer_path(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``[(module, child name), ...]`` from ``model`` down to its layer list, found as peft finds it
    (``model(.model)*.layers``, ``.bert.encoder.layer``, ``.h``)."""
    path: list[tuple[nn.Module, str]] = []
    node = model
    while isinstance(inner := getattr(node, "model", None), nn.Module):
        path.append((node, "model"))
        node = inner
    if isinstance(bert := getattr(node, "bert", None), nn.Module):
        path.append((node, "bert"))
        node = bert
    for names in (("layers",), ("encoder", "layer"), ("h",)):
        parent, found = node, True
        steps = []
        for name in names:
            child = getattr(parent, name, None)
            if not isinstance(child, nn.Module):
                found = False
                break
            steps.append((parent, name))
            parent = child
        if found and isinstance(parent, nn.ModuleList):
            return path + steps
    raise ValueError(  # error: replicated-no-layers
        f"replicated: {type(model).__name__} has no layer list where peft's layer_replication looks for one "
        f"(model(.model)*.layers, .bert.encoder.layer, .h); peft refuses such a model too"
    )


def replicated(model: nn.Module, layer_map: Sequence[Sequence[int]]) -> nn.Module:
    """``model`` deeper, as peft's ``layer_replication=layer_map`` builds it, as a new module tree
    that shares every weight with ``model`` (no weight copied, ``model`` never changed).

    ``layer_map``: ``[[start, end), ...]`` ranges of the base's layer indices, run in order
    (``[[0, 2], [1, 2]]`` on 2 layers runs ``0 1 1``: 3 layers). Use the result as the base of an
    adapter: ``init_adapter``, ``load_peft`` of a peft checkpoint with that ``layer_replication``
    (``load_peft(dir, replicated(model, config["layer_replication"]))``), ``adapted_call``; and
    ``save_peft(..., model=view)`` writes the option back. Each repeated layer has names of its own
    (``model.layers.2`` is the second run of layer 1), so each gets its own adapter.
    """
    if isinstance(layer_map, (str, bytes)) or not isinstance(layer_map, Sequence) or not layer_map:
        raise TypeError(f"replicated: layer_map must be a list of [start, end) pairs, got {layer_map!r}; e.g. [[0, 2], [1, 2]]")  # error: replicated-layer-map
    path = _layer_path(model)
    parent, name = path[-1]
    layers = getattr(parent, name)
    pairs = [tuple(pair) for pair in layer_map]
    bad = [p for p in pairs if len(p) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in p) or not 0 <= p[0] < p[1] <= len(layers)]
    if bad:
        raise ValueError(  # error: replicated-layer-range
            f"replicated: layer_map ranges {bad} are not [start, end) ranges of the {len(layers)} layers of "
            f"{type(model).__name__}; e.g. [[0, {len(layers)}], [{len(layers) - 1}, {len(layers)}]]"
        )
    new_layers: list[nn.Module] = []
    for start, end in pairs:
        for i in range(start, end):
            # the base's own module where it keeps its place, else a copy on the same storage
            layer = layers[i] if i == len(new_layers) else _copy_on_same_storage(layers[i])
            if layer is not layers[i]:
                # transformers' layer_idx (the KV cache slot): the position in the deeper model, as peft sets it
                for sub in layer.modules():
                    if hasattr(sub, "layer_idx"):
                        sub.layer_idx = len(new_layers)
            new_layers.append(layer)
    # the path's modules copied shallowly, top down, each copy holding the next
    copies = [_shallow(module) for module, _ in path]
    for copied, (_, child), below in zip(copies, path, [*copies[1:], None], strict=True):
        copied._modules[child] = below if below is not None else nn.ModuleList(new_layers)
    view = copies[0]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        config = copy.copy(config)
        config.num_hidden_layers = len(new_layers)
        for module in copies:
            if "config" in module.__dict__:
                module.__dict__["config"] = config
    view.__dict__[_LAYER_MAP] = [list(p) for p in pairs]
    return view


def layer_map_of(model: nn.Module) -> list[list[int]] | None:
    """The ``layer_map`` of a :func:`replicated` view, ``None`` for any other model."""
    found = model.__dict__.get(_LAYER_MAP)
    return None if found is None else [list(p) for p in found]
