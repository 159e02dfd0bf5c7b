"""HF peft's checkpoint format: how peft names and shapes one layer's tensors.

The file names, the key prefix, the variants' peft formats (each variant file's ``PEFT``) by
name and by peft method, a layer's tensors in peft's suffixes and shapes (per target kind: the
tensor schema's keys, ``PeftFormat.reshape``) and back, peft's nesting of
``target_parameters`` layers (``<module>.base_layer...``), and the base weights peft saves
beside an adapted embedding. Generic: it names no variant.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_func.targeting import (
    PARAM_LAYOUTS,
    Target,
    is_mha_out_proj,
    kind_of_layout,
    layer_kind,
    stored_shape,
)
from lora_func.variants import (
    PeftFormat,
    PeftMethod,
    Variant,
    get_variant,
    list_variants,
    peft_format,
)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."


def formats(peft_type: str | None = None) -> dict[str, PeftFormat]:
    """Every registered variant that peft can hold -> its format, by name (those stored as
    ``peft_type`` only, where given). The formats of one method are tried in this order when
    reading (their ``reads`` exclude one another), and a checkpoint with layers of several
    variants loads as their composition in this order."""
    return {
        name: fmt
        for name in list_variants()
        if (fmt := peft_format(name)) is not None and peft_type in (None, fmt.method.peft_type)
    }

def methods() -> dict[str, PeftMethod]:
    """peft_type -> its method, from the formats (variants of one method share it)."""
    found: dict[str, PeftMethod] = {}
    for fmt in formats().values():
        found.setdefault(fmt.method.peft_type, fmt.method)
    return found

def saved_names(variant: Variant, options: Mapping[str, object]) -> set[str]:
    """The per-layer tensors a checkpoint with ``options`` holds (the tensor schema's saved slots)."""
    return {name for name, slot in variant.layer_slots().items() if slot.saved(options)}

@dataclass(frozen=True)
class Out:
    """One layer as peft stores it; ``tensors()`` (peft suffix -> tensor in peft's shape) is
    computed only when the checkpoint is written (a conversion may run an SVD)."""

    target: Target
    tensors: Callable[[], dict[str, Tensor]]
    r: int | None = None
    alpha: float | None = None
    feedforward: bool = False

def stored(variant: Variant, fmt: PeftFormat, found: Mapping[str, Tensor], target: Target) -> dict[str, Tensor]:
    """A layer's tensors (lora_func names) as peft stores them (peft suffixes and shapes) on
    ``target``: a tensor of the schema under its slot's key, another one (a conversion's: a
    top-k form) under its :attr:`PeftFormat.imported` suffix."""
    kind = kind_of_layout(target.layout)
    slots = variant.layer_slots()
    imported = {name: suffix for suffix, name in fmt.imported.items()}
    out = {}
    for name, tensor in found.items():
        slot = slots.get(name)
        suffix = slot.peft_key(kind) if slot is not None else imported.get(name)
        if suffix is None:
            continue  # a tensor peft's file does not hold (re-created on load)
        if slot is not None and slot.matrix is not None:
            tensor = tensor.unsqueeze(slot.matrix)  # as peft's Linear layers hold it; a reshape maps it on from there
        out[suffix] = fmt.reshape(kind, name, tensor, stored_shape(target), True) if fmt.reshape is not None else tensor
    return out

def suffixes(peft_type: str) -> dict[str, str]:
    """peft key suffix -> lora_func tensor name, for every variant stored as ``peft_type``."""
    out: dict[str, str] = {}
    for name, fmt in formats(peft_type).items():
        for tensor, slot in get_variant(name).layer_slots().items():
            keys = slot.peft.values() if isinstance(slot.peft, Mapping) else [slot.peft]
            out |= {key: tensor for key in keys if key is not None}
        out |= dict(fmt.imported)
    return out

def by_module(directory: Path, peft_type: str, tensors: Mapping[str, Tensor], *, allow_none: bool = False) -> dict[str, dict[str, Tensor]]:
    """``{module name: {lora_func short name: tensor}}`` from peft's flat keys; ``allow_none``:
    a checkpoint may hold no layer's tensors (every per-layer tensor of the method is optional in its files)."""
    by_suffix = suffixes(peft_type)
    out: dict[str, dict[str, Tensor]] = {}
    unknown = []
    for key, tensor in tensors.items():
        rest = key.removeprefix(PREFIX)
        match = next((s for s in sorted(by_suffix, key=len, reverse=True) if rest.endswith("." + s)), None)
        if not key.startswith(PREFIX) or match is None:
            unknown.append(key)
            continue
        out.setdefault(unwrapped(rest[: -len(match) - 1]), {})[by_suffix[match]] = tensor
    if unknown or not (out or allow_none):
        raise ValueError(  # error: peft-unmapped-tensors
            f"{directory} has tensors lora_func cannot map for peft_type {peft_type}: {sorted(unknown)[:5]} "
            f"({len(unknown)} of {len(tensors)}); lora_func reads {sorted(set(by_suffix))} under '{PREFIX}' "
            f"(peft's bias training reads only with the config's bias='all' or '<method>_only')"
        )
    return out

def bias_copy_options() -> dict[str, bool]:
    """The options of the trained-copy variant (``PeftFormat.module_copy``) that make its copy the
    layer's bias alone: its weight slot's ``saved_if`` option, false (peft's bias training)."""
    name, fmt, _ = module_copy()
    slots = get_variant(name).tensors
    weight = next(slot for slot, own in (fmt.module_copy or {}).items() if own == "weight")
    flag = slots[weight].saved_if
    assert flag is not None  # the trained-copy variant declares how it holds the bias alone
    return {flag: False}

def module_copy() -> tuple[str, PeftFormat, dict[str, str]]:
    """The variant stored as peft's ``modules_to_save`` (its ``PeftFormat.module_copy``), its
    format, and peft's suffix of each of its tensors -> the module's own tensor name."""
    found = [(name, fmt) for name in list_variants() if (fmt := peft_format(name)) is not None and fmt.module_copy]
    assert len(found) == 1, found  # the registry declares one trained-copy variant
    name, fmt = found[0]
    slots = get_variant(name).tensors
    return name, fmt, {str(slots[slot].peft_key("")): own for slot, own in (fmt.module_copy or {}).items()}


def unwrapped(module: str) -> str:
    """A module path in a peft checkpoint as the model names it: peft moves the children of a
    module it wraps under ``<module>.base_layer`` (the out_proj of an adapted
    ``nn.MultiheadAttention`` is ``attn.base_layer.out_proj``); a trailing ``.base_layer`` (nested
    ``target_parameters`` wrappers) is left to :func:`resolve_parameters`."""
    return re.sub(r"\.base_layer(?=\.)", "", module)


def expert_params(model: nn.Module) -> dict[str, Tensor]:
    """The model's 2-D and 3-D parameters (MoE experts) by name: what ``target_parameters`` can
    name (peft's ``ParamWrapper``)."""
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if p.dim() in (2, 3)}

def targeted_parameters(model: nn.Module, selector: Sequence[str]) -> dict[str, list[str]]:
    """owner module -> the names of its parameters peft's ``target_parameters`` selects, in the
    module's order (peft wraps them in this order: the first one innermost)."""
    out: dict[str, list[str]] = {}
    for owner, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            key = f"{owner}.{pname}"
            if any(key == t or key.endswith("." + t) for t in selector):
                out.setdefault(owner, []).append(pname)
    return out

def resolve_parameters(directory: Path, config: Mapping[str, Any], tensors: dict[str, dict[str, Tensor]], model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """peft's keys of ``target_parameters`` layers under their parameters' names. peft wraps each
    targeted parameter of a module in its own ``ParamWrapper``, nested in the module's parameter
    order: with n of them, the i-th one's tensors are under ``<module>`` + ``.base_layer`` × (n-1-i)."""
    selector = config.get("target_parameters") or []
    if not selector:
        return tensors
    targeted = targeted_parameters(model, selector)
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

def parameter_key(layers: Sequence[Target]) -> dict[str, str]:
    """Target module -> the module path peft stores its tensors under: a targeted parameter's
    owner with ``.base_layer`` once for every targeted parameter of that owner after it
    (:func:`resolve_parameters` reads it back); an ``nn.MultiheadAttention``'s out_proj under the
    attention's ``base_layer`` (:func:`unwrapped` reads it back)."""
    by_owner: dict[str, list[str]] = {}
    for t in layers:
        if t.layout in PARAM_LAYOUTS:
            by_owner.setdefault(t.owner, []).append(t.module)
    out = {t.module: t.module for t in layers}
    for t in layers:
        if t.layout == "mha_out":
            attention, _, child = t.module.rpartition(".")
            out[t.module] = f"{attention}.base_layer.{child}"
    for owner, params in by_owner.items():
        for i, name in enumerate(params):
            out[name] = owner + ".base_layer" * (len(params) - 1 - i)
    return out

def drop_saved_bases(directory: Path, tensors: Mapping[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
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

def kind_of(model: nn.Module, module: str) -> tuple[str | None, tuple[int, ...]]:
    """``(kind, stored weight shape)`` of a checkpoint's layer ``module`` in ``model``; the kind
    ``None`` for a module of no kind lora_func adapts."""
    experts = expert_params(model)
    if module in experts:
        return ("experts" if experts[module].dim() == 3 else "parameter"), tuple(experts[module].shape)
    if is_mha_out_proj(dict(model.named_modules()), module):
        return "mha", tuple(cast(Tensor, model.get_submodule(module).weight).shape)
    found = model.get_submodule(module)
    weight = getattr(found, "weight", None)
    return layer_kind(found), tuple(weight.shape) if isinstance(weight, Tensor) else ()
