"""HF peft's checkpoint format: how peft names and shapes one layer's tensors.

The file names, the key prefix, the variants' entries (``Variant(peft=PeftFormat(...))``) by
name and by peft method, a layer's tensors in peft's suffixes and shapes (per target kind:
``PeftFormat.keys_by_kind``, ``to_peft`` / ``from_peft``) and back, peft's nesting of
``target_parameters`` layers (``<module>.base_layer...``), and the base weights peft saves
beside an adapted embedding. Generic: it names no variant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lora_func.targeting import (
    EXPERT_LAYOUTS,
    Target,
    kind_of_layout,
    layer_kind,
    stored_shape,
)
from lora_func.variants import (
    PeftFormat,
    PeftMethod,
    get_variant,
    list_variants,
)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."


def _formats() -> dict[str, PeftFormat]:
    """Every registered variant that peft can hold -> its entry, by name. The entries of one
    method are tried in this order when reading (their ``reads`` exclude one another), and a
    checkpoint with layers of several variants loads as their composition in this order."""
    return {name: fmt for name in list_variants() if (fmt := get_variant(name).peft) is not None}

def _methods() -> dict[str, PeftMethod]:
    """peft_type -> its method, from the entries (variants of one method share it)."""
    methods: dict[str, PeftMethod] = {}
    for fmt in _formats().values():
        methods.setdefault(fmt.method.peft_type, fmt.method)
    return methods

@dataclass(frozen=True)
class _Out:
    """One layer as peft stores it; ``tensors()`` (peft suffix -> tensor in peft's shape) is
    computed only when the checkpoint is written (a conversion may run an SVD)."""

    target: Target
    tensors: Callable[[], dict[str, Tensor]]
    r: int | None = None
    alpha: float | None = None
    feedforward: bool = False

def _stored(fmt: PeftFormat, found: Mapping[str, Tensor], target: Target) -> dict[str, Tensor]:
    """A layer's tensors (lora_func names) as peft stores them (peft suffixes and shapes) on ``target``."""
    kind = kind_of_layout(target.layout)
    out = {}
    # A conversion may store a layer under the entry's other names (a top-k form, say), besides
    # or instead of its keys (a LyCORIS CP layer's cores).
    names = [(n, s) for s, n in fmt.imported.items() if n in found]
    names += [(n, s) for n, s in fmt.keys_by_kind.get(kind, fmt.keys).items() if n not in dict(names)]
    for name, suffix in names:
        if name not in found:
            continue  # a tensor this layer does not have (PeftFormat.optional, layer_shapes)
        tensor = found[name]
        if fmt.to_peft is not None:
            tensor = fmt.to_peft(kind, name, tensor, stored_shape(target))
        out[suffix] = tensor.unsqueeze(fmt.matrix[name][0]) if name in fmt.matrix else tensor
    return out

def _suffixes(peft_type: str) -> dict[str, str]:
    """peft key suffix -> lora_func tensor name, for every variant stored as ``peft_type``."""
    return {
        suffix: name
        for fmt in _formats().values()
        if fmt.method.peft_type == peft_type
        for keys in (fmt.keys, *fmt.keys_by_kind.values())
        for suffix, name in [*((s, n) for n, s in keys.items()), *fmt.old_keys.items(), *fmt.imported.items()]
    }

def _by_module(directory: Path, peft_type: str, tensors: Mapping[str, Tensor], *, allow_none: bool = False) -> dict[str, dict[str, Tensor]]:
    """``{module name: {lora_func short name: tensor}}`` from peft's flat keys; ``allow_none``:
    a checkpoint may hold no layer's tensors (:attr:`PeftMethod.layers_from_config`)."""
    suffixes = _suffixes(peft_type)
    out: dict[str, dict[str, Tensor]] = {}
    unknown = []
    for key, tensor in tensors.items():
        rest = key.removeprefix(PREFIX)
        match = next((s for s in sorted(suffixes, key=len, reverse=True) if rest.endswith("." + s)), None)
        if not key.startswith(PREFIX) or match is None:
            unknown.append(key)
            continue
        out.setdefault(rest[: -len(match) - 1], {})[suffixes[match]] = tensor
    if unknown or not (out or allow_none):
        raise ValueError(  # error: peft-unmapped-tensors
            f"{directory} has tensors lora_func cannot map for peft_type {peft_type}: {sorted(unknown)[:5]} "
            f"({len(unknown)} of {len(tensors)}); lora_func reads {sorted(set(suffixes))} under '{PREFIX}' (bias, "
            f"modules_to_save and embedding layers are not supported)"
        )
    return out

def _expert_params(model: nn.Module) -> dict[str, Tensor]:
    """The model's 3-D parameters (MoE experts) by name: what ``target_parameters`` can name."""
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if p.dim() == 3}

def _targeted_parameters(model: nn.Module, selector: Sequence[str]) -> dict[str, list[str]]:
    """owner module -> the names of its parameters peft's ``target_parameters`` selects, in the
    module's order (peft wraps them in this order: the first one innermost)."""
    out: dict[str, list[str]] = {}
    for owner, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            key = f"{owner}.{pname}"
            if any(key == t or key.endswith("." + t) for t in selector):
                out.setdefault(owner, []).append(pname)
    return out

def _resolve_parameters(directory: Path, config: Mapping[str, Any], tensors: dict[str, dict[str, Tensor]], model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """peft's keys of ``target_parameters`` layers under their parameters' names. peft wraps each
    targeted parameter of a module in its own ``ParamWrapper``, nested in the module's parameter
    order: with n of them, the i-th one's tensors are under ``<module>`` + ``.base_layer`` × (n-1-i)."""
    selector = config.get("target_parameters") or []
    if not selector:
        return tensors
    targeted = _targeted_parameters(model, selector)
    out: dict[str, dict[str, Tensor]] = {}
    for module, found in tensors.items():
        owner, depth = module, 0
        while owner.endswith(".base_layer"):
            owner, depth = owner.removesuffix(".base_layer"), depth + 1
        names = targeted.get(owner)
        if names is None:
            out[module] = found
            continue
        if depth >= len(names):
            raise ValueError(  # error: peft-parameter-nesting
                f"{directory} has tensors under {module}, nested {depth} deep, but target_parameters={list(selector)} selects "
                f"{len(names)} parameter(s) of {owner} ({names}); re-save the checkpoint"
            )
        out[f"{owner}.{names[len(names) - 1 - depth]}"] = found
    return out

def _parameter_key(layers: Sequence[Target]) -> dict[str, str]:
    """Target module -> the module path peft stores its tensors under: an expert parameter's
    owner with ``.base_layer`` once for every targeted parameter of that owner after it
    (:func:`_resolve_parameters` reads it back)."""
    by_owner: dict[str, list[str]] = {}
    for t in layers:
        if t.layout in EXPERT_LAYOUTS:
            by_owner.setdefault(t.owner, []).append(t.module)
    out = {t.module: t.module for t in layers}
    for owner, params in by_owner.items():
        for i, name in enumerate(params):
            out[name] = owner + ".base_layer" * (len(params) - 1 - i)
    return out

def _drop_saved_bases(directory: Path, tensors: Mapping[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """The tensors without the base weights peft saves beside an adapted embedding
    (``save_embedding_layers``: ``<module>.base_layer.weight``), after checking that each equals
    the model's: lora_func never changes the base, so a checkpoint that changed it (a resized
    vocabulary, trained embeddings) must be refused."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out, changed = {}, []
    for key, tensor in tensors.items():
        name = key.removeprefix(PREFIX)
        if key.startswith(PREFIX) and name.endswith(".base_layer.weight"):
            own = params.get(name.replace(".base_layer.weight", ".weight"))
            if own is not None:
                if own.shape != tensor.shape or not torch.equal(own.detach().to(tensor.dtype), tensor):
                    changed.append(name.replace(".base_layer.weight", ".weight"))
                continue
        out[key] = tensor
    if changed:
        raise ValueError(  # error: peft-base-changed
            f"{directory} holds base weights that differ from the model's: {sorted(changed)[:4]} (peft saved the base layer "
            f"of an adapted embedding: a resized vocabulary or trained embeddings); lora_func never changes the base: copy "
            f"those weights into the model first, then load_peft"
        )
    return out

def _kind_of(model: nn.Module, module: str) -> tuple[str, tuple[int, ...]]:
    """``(kind, stored weight shape)`` of a checkpoint's layer ``module`` in ``model``."""
    experts = _expert_params(model)
    if module in experts:
        return "experts", tuple(experts[module].shape)
    found = model.get_submodule(module)
    weight = getattr(found, "weight", None)
    return layer_kind(found) or "linear", tuple(weight.shape) if isinstance(weight, Tensor) else ()
