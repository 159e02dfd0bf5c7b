"""Reading an HF peft checkpoint: :func:`load_peft` (the weights file, the model checks, each
layer read as the variant whose entry reads it, the adapter assembled on the untouched model).
Generic: it names no variant.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from lora_func._model import (
    adapter_layer,
    grouped_shared,
    layer_info,
    layer_infos,
    shared_init,
    shared_view,
    target_weights,
    variant_init,
    weight_fingerprint,
)
from lora_func.adapter import (
    SHARED,
    Adapter,
    AdapterLike,
    compose,
)
from lora_func.checks import check_model, check_path
from lora_func.io._peft_config import (
    check_config,
    config_rank,
    options_from,
    pattern_value,
    read_config,
    reads_as,
    refuse_rank_mismatch,
    refuse_unsupported,
    selects,
    warn_training_only,
)
from lora_func.io._peft_keys import (
    CONFIG_NAME,
    LEGACY_WEIGHTS_NAME,
    PREFIX,
    WEIGHTS_NAME,
    by_module,
    drop_saved_bases,
    expert_params,
    formats,
    kind_of,
    methods,
    bias_copy_options,
    module_copy,
    resolve_parameters,
    targeted_parameters,
)
from lora_func.io._prompt_files import PROMPT_PEFT_TYPES, load_prompt_peft
from lora_func.io._validate import refuse_missing_layers, refuse_non_finite
from lora_func.quantized import kind_of_tensor
from lora_func.replication import layer_map_of
from lora_func.spec import AdapterSpec
from lora_func.targeting import (
    KINDS,
    biased_modules,
    find_targets,
    layer_kind,
    no_kind,
    peft_target,
    refuse_kinds,
    tensor_names,
)
from lora_func.variants import (
    LayerInfo,
    Variant,
    get_variant,
    list_variants,
    peft_format,
)

__all__ = ["load_peft"]


def _read_tensors(directory: Path, integer_suffixes: Iterable[str] = ()) -> dict[str, Tensor]:
    """The checkpoint's tensors; integer ones only under ``integer_suffixes`` (an entry's
    ``imported`` index tensors) or a variant's integer buffers."""
    allowed = tuple(f".{suffix}" for suffix in integer_suffixes)
    path = directory / WEIGHTS_NAME
    legacy = directory / LEGACY_WEIGHTS_NAME
    loaded: Any = None
    problem = None
    try:
        if path.is_file():
            loaded = load_file(str(path))
        elif legacy.is_file():
            # weights_only: a pickle from the internet must not run code (a hostile one raises
            # UnpicklingError, nothing runs).
            loaded = torch.load(legacy, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
        problem = f"{type(err).__name__}: {err}"
    if problem is None and loaded is not None:
        if not isinstance(loaded, Mapping):
            problem = f"it holds a {type(loaded).__name__}, not a dict of named tensors"
        elif not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()):
            problem = "it holds entries that are not named tensors"
        elif any(not (v.is_floating_point() or _integer_key(k, v) or k.endswith(allowed)) for k, v in loaded.items()):
            # An integer "adapter" would be cast to an integer spec dtype, or truncate the layer.
            wrong = sorted(k for k, v in loaded.items() if not (v.is_floating_point() or _integer_key(k, v) or k.endswith(allowed)))
            problem = f"tensors {wrong[:3]} are not floating-point"
    if problem is not None:
        raise ValueError(f"the weights in {directory} are not readable (truncated or corrupted?): {problem}; re-save the checkpoint")  # error: peft-unreadable-weights
    if loaded is None:
        raise FileNotFoundError(f"no peft checkpoint at {directory}: neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME} is there")  # error: peft-no-weights
    return dict(loaded)


def _integer_key(key: str, tensor: Tensor) -> bool:
    """Whether ``key`` is an integer tensor that a variant stores as integers (its ``integer`` slots)."""
    if tensor.dtype not in (torch.int32, torch.int64):
        return False
    suffixes = {
        suffix
        for name in list_variants()
        if peft_format(name) is not None
        for slot in get_variant(name).layer_slots().values()
        if slot.integer and (suffix := slot.peft_key("")) is not None
    }
    # a shared integer slot's whole keys (positions held once per group: Slot.peft's {group})
    wholes = [
        whole
        for name in list_variants()
        if peft_format(name) is not None
        for slot in get_variant(name).tensors.values()
        if slot.shared and slot.integer and (whole := slot.peft_key("")) is not None
    ]
    return any(key.endswith("." + suffix) for suffix in suffixes) or any(_whole_key_match(whole, key) for whole in wholes)


def _whole_key_match(whole: str, key: str) -> bool:
    """Whether ``key`` is the shared tensor stored under ``whole`` (a row of one held row by row,
    ``{}``; one group's, ``{group}``: Slot.peft)."""
    pattern = re.escape(whole).replace(r"\{\}", "[0-9]+").replace(r"\{group\}", "[^.]+")
    return key == whole or re.fullmatch(pattern, key) is not None

def _check_model(model: nn.Module, directory: Path, modules: Iterable[str]) -> None:
    if hasattr(model, "peft_config"):
        raise TypeError(  # error: peft-wrapped-model
            f"load_peft({directory}) needs the untouched base model, got a peft-wrapped {type(model).__name__}; "
            f"pass model.get_base_model() of a fresh model (lora_func never modifies it)"
        )
    experts = expert_params(model)
    names = {name for name, _ in model.named_modules()} | set(experts)
    missing = sorted(set(modules) - names)
    params = dict(model.named_parameters(remove_duplicate=False))
    other_dims = sorted(f"{m} {tuple(params[m].shape)}" for m in missing if m in params)
    if other_dims:
        raise ValueError(  # error: peft-parameter-dims
            f"{directory} adapts the parameters {other_dims[:5]} of {type(model).__name__} (peft's target_parameters): "
            f"lora_func adapts 3-D expert parameters (num_experts, out, in) there; load the checkpoint in peft "
            f"(merge_and_unload for a merged model)"
        )
    if missing:
        raise ValueError(  # error: peft-missing-modules
            f"{directory} adapts modules that {type(model).__name__} does not have: {missing[:5]} ({len(missing)} in "
            f"all); load it onto the model it was trained for"
        )
    by_name = dict(model.named_modules())
    weights = {m: experts[m] if m in experts else getattr(by_name[m], "weight", None) for m in modules}
    not_float = sorted(
        f"{m}.weight ({w.dtype})"
        for m, w in weights.items()
        if isinstance(w, Tensor) and not w.is_floating_point() and kind_of_tensor(w) is None
    )
    if not_float:
        raise TypeError(  # error: peft-non-float-base
            f"load_peft({directory}): the target weights {not_float[:5]} of {type(model).__name__} are not floating-point "
            f"(quantized or integer): the adapter's delta would be rounded away; dequantize those layers first (load the "
            f"model without a quantization config)"
        )

@dataclass
class _Layer:
    """One layer read from a checkpoint, in lora_func shapes; ``r`` / ``alpha`` ``None`` where
    the variant does not use them (the spec's values are recorded then)."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor] = field(default_factory=dict)
    r: int | None = None
    alpha: float | None = None

def _assemble(
    directory: Path,
    model: nn.Module,
    variant_name: str,
    layers: Mapping[str, _Layer],
    *,
    r: int = 8,
    alpha: float | None = None,
    options: Mapping[str, Any],
    stored_shared: Mapping[str, Tensor] | None = None,
    target_modules: Any = None,
) -> Adapter:
    """An :class:`Adapter` of ``variant_name`` on exactly ``layers``' modules, checked against the
    model; ``target_modules``: the config's, the spec's targets for a variant whose shared tensors
    are shared within groups derived from them (``Variant.groups``)."""
    dtypes = {t.dtype for layer in layers.values() for t in (*layer.params.values(), *layer.buffers.values()) if t.is_floating_point()}
    # a checkpoint may hold only shared tensors (no per-layer tensor in its file)
    dtypes = dtypes or {t.dtype for t in (stored_shared or {}).values() if t.is_floating_point()} or {torch.float32}
    dtype = dtypes.pop()
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    experts = expert_params(model)
    grouping = get_variant(variant_name).groups is not None and isinstance(target_modules, (str, list)) and bool(target_modules)
    spec = AdapterSpec(
        variant_name,
        targets=(target_modules if isinstance(target_modules, str) else sorted(target_modules)) if grouping else sorted(m for m in layers if m not in experts),
        r=r,
        alpha=alpha,
        dtype=dtype,
        target_parameters=sorted(m for m in layers if m in experts),
        **options,
    )
    modules = dict(model.named_modules())
    names_of = tensor_names(model)
    tied = sorted(m for m in layers if m not in experts and len(names_of.get(id(getattr(modules[m], "weight", None)), ())) > 1)
    if tied:
        raise ValueError(  # error: peft-tied-module
            f"{directory} adapts {tied}, whose weight is tied to another name (e.g. GPT-2's lm_head and the token "
            f"embedding): peft adapts only that module's output, lora_func adapts the shared tensor under every name "
            f"(tied='both'), which also changes the embedding; merge the adapter in peft (merge_and_unload) instead"
        )
    # the kinds were checked layer by layer; an attention's projections are two targets, each read
    # from its own tensors
    targets = [t for t in find_targets(model, spec, where="the checkpoint's layers") if t.module in layers]
    variant = get_variant(variant_name)
    if variant.groups is not None and sorted(t.module for t in targets) != sorted(layers):
        raise ValueError(  # error: peft-groups-targets
            f"{directory}: {variant_name} shares tensors within groups of layers that peft derives from target_modules "
            f"({target_modules!r}), but those do not select exactly the checkpoint's layers (it has {sorted(layers)[:4]}...); "
            f"set target_modules in its config to the names or the regex it was trained with"
        )
    options = dict(spec.options)
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    out_layers = []
    wrong = []
    infos = {}
    for target in targets:
        layer = layers[target.module]
        rank = spec.r if layer.r is None else layer.r
        layer_alpha = spec.alpha if layer.alpha is None else float(layer.alpha)
        infos[target.module] = layer_info(spec, target, r=rank, alpha=layer_alpha)
    infos = layer_infos(variant, spec, infos)  # ranks a variant derives from every layer (Variant.layer_ranks)
    # Each layer's position among the targets and the adapter's layout, as init_adapter sets them.
    infos = LayerInfo.numbered(infos)
    # Tensors shared within a group (Variant.groups): peft's file holds a copy under every member
    # layer's key; its load_state_dict leaves the group's last member's (module order) in the tied module.
    groups = variant.layer_groups(spec.targets, infos)
    grouped: dict[str, Tensor] = {}
    grouped_shapes: dict[str, tuple[int, ...] | None] = {}
    for module_name in infos:
        for name, key in groups[module_name].items():
            if variant.tensors[name].peft_key("") is not None:
                continue  # held once per group under its whole key (Slot.peft's {group})
            found = layers[module_name].params.pop(name, None)
            if found is None:
                found = layers[module_name].buffers.pop(name, None)
            grouped_shapes[f"{name}@{key}"] = variant.tensors[name].shape(infos[module_name])
            if found is None:
                raise ValueError(  # error: peft-group-missing
                    f"{directory} is incomplete at {module_name}: it lacks the {name} that the layer shares with its group; re-save the checkpoint"
                )
            grouped[f"{name}@{key}"] = found
    bad = [f"{k}: {tuple(v.shape)} != {grouped_shapes[k]}" for k, v in grouped.items() if tuple(v.shape) != grouped_shapes[k]]
    if bad:
        raise ValueError(  # error: peft-group-shapes
            f"{directory} does not fit {type(model).__name__} (the shapes of tensors shared within groups: {bad[:3]}); "
            f"load it onto the model it was trained for"
        )
    by_module = {target.module: target for target in targets}
    for module_name, layer in layers.items():  # in the file's order: the first bad layer is named
        target, info = by_module[module_name], infos[module_name]
        expected = _expected_shapes(variant, info, target, options)
        got = {k: tuple(v.shape) for k, v in (layer.params | layer.buffers).items()}
        if got == expected:
            continue
        missing, extra = set(expected) - set(got), set(got) - set(expected)
        if (missing and not extra) or extra - set(variant.tensors):
            raise ValueError(  # error: peft-incomplete
                f"{directory} is incomplete at {module_name}: it has {sorted(got)}, the layer needs {sorted(expected)}; re-save the checkpoint"
            )
        found_rank = _tensors_rank(variant, info, target, options, got)
        fields = _rank_fields(variant_name)
        if found_rank is not None and fields is not None and found_rank != info.r:
            refuse_rank_mismatch(directory, module_name, found_rank, int(info.r), fields)
        wrong.append(f"{module_name}: checkpoint has {got}, the model needs {expected}")
    if wrong:
        raise ValueError(  # error: peft-shapes
            f"{directory} does not fit {type(model).__name__} (tensor shapes): {wrong[:3]}; load it onto the model "
            f"it was trained for"
        )
    built: tuple[dict[str, Tensor], dict[str, Tensor], Any] | None = None
    if variant.shared_from_weights:
        # Built from every target's weight before the layers, whose re-created buffers read them;
        # the checkpoint's where it holds them (peft's save_projection).
        built = shared_init(
            variant, spec, infos, device=getattr(modules[targets[0].owner], targets[0].weight_key.rpartition(".")[2]).device,
            generator=torch.Generator().manual_seed(0), weights=target_weights(model, targets, spec),
        )
        _shared_from_checkpoint(directory, variant, spec, built[0], stored_shared or {})
        _shared_from_checkpoint(directory, variant, spec, built[1], stored_shared or {})
    for target in targets:
        layer = layers[target.module]
        info = infos[target.module]
        module = modules[target.owner]
        weight = getattr(module, target.weight_key.rpartition(".")[2])
        layer_buffers = dict(layer.buffers)
        unsaved = {name for name, slot in variant.layer_slots().items() if slot.buffer and not slot.saved(options)}
        if unsaved:
            # Buffers peft's file does not hold are re-created as peft does on load (a residual
            # from the base, positions from a seed): the variant's own init on the base.
            view = shared_view(built[0] | built[1], groups[target.module]) if built is not None else None
            recomputed = variant_init(variant, spec, module, target, info, generator=torch.Generator().manual_seed(0), shared=view)[1]
            layer_buffers |= {k: v for k, v in recomputed.items() if k in unsaved}
        for name, tensor in layer.params.items():
            params[f"{target.module}.{name}"] = tensor.to(weight.device, dtype).contiguous().requires_grad_(True)
        for name, tensor in layer_buffers.items():
            # positions (Variant.integer_buffers) are int64 in lora_func; peft may write int32
            buffers[f"{target.module}.{name}"] = tensor.to(weight.device, None if tensor.is_floating_point() else torch.int64).contiguous()
        out_layers.append(
            adapter_layer(target, info, layer.params, layer_buffers, weight_fingerprint(weight) if variant.records_base else None)
        )
    if variant.shared_init is None and not grouped:
        return Adapter(params, buffers, spec, out_layers)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    infos = {layer.target.module: layer.info for layer in out_layers}
    if built is not None:
        shared_params, shared_buffers, shared = built
    else:
        shared_params, shared_buffers, shared = shared_init(variant, spec, infos, device=device, generator=torch.Generator().manual_seed(0))
        _shared_from_checkpoint(directory, variant, spec, shared_params, stored_shared or {})
        _shared_from_checkpoint(directory, variant, spec, shared_buffers, stored_shared or {})
    if grouped:
        slots = variant.tensors
        grouped = {k: v.to(device, dtype if v.is_floating_point() else torch.int64) for k, v in grouped.items()}
        params, buffers, shared = grouped_shared(
            params | shared_params, buffers | shared_buffers, shared,
            {k: v for k, v in grouped.items() if not slots[k.partition("@")[0]].buffer},
            {k: v for k, v in grouped.items() if slots[k.partition("@")[0]].buffer},
        )
        return Adapter(params, buffers, spec, out_layers, shared=shared)
    return Adapter(params | shared_params, buffers | shared_buffers, spec, out_layers, shared=shared)


def _shared_from_checkpoint(directory: Path, variant: Variant, spec: AdapterSpec, built: dict[str, Tensor], stored: Mapping[str, Tensor]) -> None:
    """Replace the shared tensors ``built`` by the variant's ``shared_init`` (keyed
    ``"<shared>.<name>"``) by the checkpoint's, where it holds them; where it does not, the
    built ones stand only if the config says the checkpoint leaves them out (the slot's
    ``saved_if``)."""
    for key, tensor in built.items():
        name, _, group = key.removeprefix(f"{SHARED}.").partition("@")
        slot = variant.tensors.get(name)
        whole = slot.peft_key("") if slot is not None else None
        if slot is None or whole is None:
            continue
        whole = whole.format(group=group) if "{group}" in whole else whole  # one group's (Slot.peft)
        saved = slot.saved(dict(spec.options))
        if "{}" in whole:  # held row by row (Slot.peft)
            rows = [stored[k] for i in range(len(stored)) if (k := whole.format(i)) in stored]
            stored = {**stored, whole: torch.stack(rows)} if rows else stored
        if whole not in stored:
            if saved:
                raise ValueError(  # error: peft-shared-missing
                    f"{directory} is incomplete: its config says it holds the shared {name} ({whole}), but it does not; "
                    f"re-save the checkpoint, or set save_projection=false in its config if the basis comes from the seed"
                )
            continue
        if tuple(stored[whole].shape) != tuple(tensor.shape):
            raise ValueError(  # error: peft-shared-shape
                f"{directory} does not fit {spec.variant} on these layers: the shared {whole} has shape "
                f"{tuple(stored[whole].shape)}, the adapted layers need {tuple(tensor.shape)}; load it onto the model it was trained for"
            )
        dtype = spec.dtype if tensor.is_floating_point() else torch.int64  # (integer positions stay integers)
        built[key] = stored[whole].to(tensor.device, dtype).contiguous().requires_grad_(tensor.requires_grad)

def _shared_keys(variant: Variant) -> dict[str, str]:
    """Shared tensor name -> the whole key peft stores it under."""
    return {name: key for name, slot in variant.tensors.items() if slot.shared and (key := slot.peft_key("")) is not None}


def _is_shared_key(variant: Variant, key: str) -> bool:
    """Whether ``key`` holds a shared tensor of ``variant`` (a whole key, or a row of one held row by row)."""
    return any(_whole_key_match(whole, key) for whole in _shared_keys(variant).values())


def _expected_shapes(variant: Variant, info: LayerInfo, target: Any, options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The per-layer tensors a checkpoint with ``options`` holds for the layer and their shapes
    (an expert parameter's with the expert axis first)."""
    shapes = {
        name: tuple(shape)
        for name, slot in variant.layer_slots().items()
        if slot.saved(options) and (shape := slot.shape(info)) is not None
    }
    return {k: (*target.shape[:1], *v) if target.experts is not None else v for k, v in shapes.items()}


def _tensors_rank(variant: Variant, info: LayerInfo, target: Any, options: Mapping[str, Any], got: Mapping[str, tuple[int, ...]]) -> int | None:
    """The rank at which the layer's tensor schema gives exactly the shapes ``got``, if one does."""
    for r in range(1, max((size for shape in got.values() for size in shape), default=0) + 1):
        try:
            if _expected_shapes(variant, dataclasses.replace(info, r=r), target, options) == dict(got):
                return r
        except (ValueError, ZeroDivisionError, TypeError):  # a schema that has no layout at this rank
            continue
    return None


def _rank_fields(name: str) -> tuple[str, str | None] | None:
    """The rank fields of the peft method the variant ``name`` is stored as."""
    fmt = peft_format(name)
    return None if fmt is None else fmt.method.rank


def _holds_no_layer_tensors(variant: Variant) -> bool:
    """Whether a checkpoint of ``variant`` may hold no tensor of a layer (every per-layer tensor
    is one peft's file may leave out, as an index buffer saved only on request): its layers are then the
    modules the config's ``target_modules`` selects."""
    slots = variant.layer_slots().values()
    return bool(slots) and all(slot.peft is None or slot.saved_if is not None for slot in slots)

def _config_layers(directory: Path, config: Mapping[str, Any], model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """The modules of ``model`` the config's ``target_modules`` select (peft's matching), for a
    method whose checkpoint may hold no tensor of a layer (:func:`_holds_no_layer_tensors`)."""
    selector = config.get("target_modules")
    if not selector or config.get("layers_to_transform") is not None or config.get("layers_pattern"):
        raise ValueError(  # error: peft-layers-from-config
            f"{directory}: a {config.get('peft_type')} checkpoint may hold no tensors per layer, so lora_func finds its layers "
            f"from target_modules, and this config has target_modules={selector!r}, layers_to_transform="
            f"{config.get('layers_to_transform')!r}, layers_pattern={config.get('layers_pattern')!r}; lora_func reads a list or "
            f"regex of target_modules without layers_to_transform / layers_pattern: re-save the adapter with such a config"
        )
    return {name: {} for name, module in model.named_modules() if name and selects(selector, name) and layer_kind(module) in ("linear", "conv1d")}

def _format_for(directory: Path, config: Mapping[str, Any], peft_type: str, module: str) -> tuple[str, dict[str, Any]]:
    """The lora_func variant that reads the checkpoint's layer ``module``, and its spec options."""
    for name, fmt in formats(peft_type).items():
        if reads_as(fmt, config, module):
            return name, options_from(get_variant(name), config)[0]
    unread = methods()[peft_type].unread
    why = unread(config) if unread is not None else f"no {peft_type} entry reads its config"
    raise ValueError(f"{directory} cannot be read as a lora_func variant at {module}: {why}")  # error: peft-layer-unread

def _layer_from_peft(
    directory: Path, config: Mapping[str, Any], module: str, name: str, options: Mapping[str, Any], found: Mapping[str, Tensor], kind: tuple[str, tuple[int, ...]]
) -> _Layer:
    """One layer's peft tensors in lora_func shapes, as the variant ``name`` with ``options``
    holds them, with its rank and alpha as peft's config gives them (the tensors' shapes are
    checked against them in :func:`_assemble`); ``kind``: the layer's kind and stored weight
    shape in the model."""
    variant, fmt = get_variant(name), peft_format(name)
    assert fmt is not None  # read by its format
    if fmt.convert_in is not None and any(n in fmt.imported.values() for n in found):
        found = fmt.convert_in(dict(found), options)
    tensors = dict(found)
    if fmt.reshape is not None:
        tensors = {n: fmt.reshape(kind[0], n, t, kind[1], False) for n, t in tensors.items()}
    slots = variant.layer_slots()
    for n, t in tensors.items():
        axis = slots[n].matrix if n in slots else None
        if axis is None:
            continue
        if t.dim() != 2 or t.shape[axis] != 1:
            stored = (t.numel(), 1) if axis == 1 else (1, t.numel())
            raise ValueError(  # error: peft-vector-shape
                f"{directory} is inconsistent at {module}: {n} has shape {tuple(t.shape)}, but peft stores it as a {stored} matrix here "
                f"(the config's feedforward_modules decides which); re-save the checkpoint"
            )
        tensors[n] = t.reshape(-1)
    method = fmt.method
    r = config_rank(config, module, method.rank) if method.rank is not None else None
    alpha = float(pattern_value(config.get("alpha_pattern"), module, config.get(method.alpha, 8))) if method.alpha else None
    buffers = {n: t for n, t in tensors.items() if n in slots and slots[n].buffer}
    return _Layer(params={n: t for n, t in tensors.items() if n not in buffers}, buffers=buffers, r=r, alpha=alpha)

def _check_kind(directory: Path, peft_type: str, model: nn.Module, module: str, kind: str | None, variant: Variant) -> None:
    """Refuse a checkpoint's layer whose kind lora_func (or the variant it reads as) does not
    adapt, before its tensors are read: peft wrote it, so the file is not to blame."""
    if kind is None:
        raise ValueError(  # error: peft-layer-no-kind
            f"{directory} adapts {module}, a {no_kind(model.get_submodule(module))}: peft's {peft_type} adapts it there, "
            f"lora_func adapts {', '.join(KINDS.values())} only; load the checkpoint in peft (merge_and_unload for a merged "
            f"model), or retrain without that module"
        )
    try:
        refuse_kinds(variant, [(module, kind)], "the checkpoint's layers")
    except ValueError as err:
        raise ValueError(f"load_peft({directory}): {err}") from None  # error: peft-layer-refused


def _read(
    directory: Path,
    config: Mapping[str, Any],
    peft_type: str,
    tensors: Mapping[str, dict[str, Tensor]],
    model: nn.Module,
    stored_shared: Mapping[str, Tensor],
) -> AdapterLike:
    """The adapter of a ``peft_type`` checkpoint: each layer read as the variant whose entry
    reads it; layers of several variants (a method with ``feedforward_modules``) compose."""
    groups: dict[str, tuple[dict[str, Any], dict[str, _Layer]]] = {}
    modules = dict(model.named_modules())
    for module, found in tensors.items():
        name, options = _format_for(directory, config, peft_type, module)
        kind, shape = kind_of(model, module)
        _check_kind(directory, peft_type, model, module, kind, get_variant(name))
        # (rank and alpha as peft reads them: an attention's out_proj has the attention's)
        layer = _layer_from_peft(directory, config, peft_target(modules, module), name, options, found, (str(kind), shape))
        groups.setdefault(name, (options, {}))[1][module] = layer
    method = methods()[peft_type]
    r = int(config.get(method.rank[0], 8)) if method.rank is not None else 8
    alpha = float(config.get(method.alpha, 8)) if method.alpha is not None else None
    parts = [
        _assemble(
            directory, model, name, groups[name][1], r=r, alpha=alpha, options=groups[name][0], stored_shared=stored_shared,
            target_modules=config.get("target_modules"),
        )
        for name in formats(peft_type)
        if name in groups
    ]
    return parts[0] if len(parts) == 1 else compose(*parts)

def saved_copies(directory: Path, config: Mapping[str, Any], model: nn.Module, read: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """The trained copies of a checkpoint's ``modules_to_save`` (peft's ``ModulesToSaveWrapper``:
    the copy's state dict under the module's own name, ``<module>.weight`` / ``.bias``), popped
    from ``read`` as the tensors of the variant that is a trained copy of its layer
    (``PeftFormat.module_copy``). peft's matching: every module whose name ends with an entry."""
    wanted = config.get("modules_to_save") or []
    if isinstance(wanted, str):
        wanted = [wanted]
    name_of_copy, copy_format, suffixes = module_copy()
    slot_of = {own: slot for slot, own in (copy_format.module_copy or {}).items()}
    kinds = get_variant(name_of_copy).kinds
    modules = dict(model.named_modules())
    names = sorted(name for name in modules if name and any(name.endswith(w) for w in wanted))
    copies: dict[str, dict[str, Tensor]] = {}
    for name in names:
        held = {key.removeprefix(f"{PREFIX}{name}."): key for key in read if key.startswith(f"{PREFIX}{name}.")}
        module = modules[name]
        state = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        own = {k: key for k, key in held.items() if k in state}
        if not own:
            continue  # a module the checkpoint holds no copy of (a target's tensors are its adapter's)
        kind = layer_kind(module)
        if kind not in kinds or set(own) - set(slot_of) or len(own) != len(held):
            raise ValueError(  # error: peft-modules-to-save-kind
                f"{directory}: modules_to_save holds a trained copy of {name} ({type(module).__name__}, tensors "
                f"{sorted(held)}); lora_func holds trained copies of {sorted(kinds)} layers ({sorted(suffixes.values())} only), "
                f"of a module that is not also a target; load the checkpoint in peft (merge_and_unload), or retrain "
                f"without that module in modules_to_save"
            )
        copies[name] = {slot_of[k]: read.pop(key) for k, key in own.items()}
    return copies

def _refuse_replication(directory: Path, config: Mapping[str, Any], model: nn.Module) -> None:
    """A ``layer_replication`` checkpoint loads onto the deeper model peft built for it: a
    :func:`~lora_func.replication.replicated` view of the base with the same layer map."""
    wanted = config.get("layer_replication")
    if not wanted:
        return
    have = layer_map_of(model)
    if have is None or have != [list(pair) for pair in wanted]:
        raise ValueError(  # error: peft-layer-replication
            f"{directory} uses layer_replication={wanted!r}: peft runs it on the model made deeper (the layers repeated "
            f"as the map says, sharing the base weights, each copy with its own {config.get('peft_type')} tensors), and "
            f"{type(model).__name__} is " + ("not that model" if have is None else f"a view with layer_map={have!r}")
            + f"; load it onto lora_func.replication.replicated(model, {wanted!r}), the same deeper model as a view of "
            f"the untouched base (no weight copied)"
        )


def _bias_training(config: Mapping[str, Any]) -> bool:
    """Whether the config trains biases (peft's ``bias="all"`` or ``"<method>_only"``)."""
    bias = config.get("bias", "none")
    return isinstance(bias, str) and (bias == "all" or bias.endswith("_only"))


def trained_biases(directory: Path, config: Mapping[str, Any], model: nn.Module, read: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """The biases a ``bias="all"`` / ``"<method>_only"`` checkpoint trained (peft's
    ``_get_learnable_bias_state_dict``: ``<module>.base_layer.bias`` on the method's targets,
    ``<module>.bias`` elsewhere), popped from ``read`` as ``{module: {"ln_bias": tensor}}``, the
    bias slot of the trained-copy variant with its bias-alone options (``bias_copy_options``). Call after :func:`saved_copies`: a trained
    copy's bias is the copy's."""
    if not _bias_training(config):
        return {}
    modules = dict(model.named_modules())
    name_of_copy, copy_format, _ = module_copy()
    slot = next(slot for slot, own in (copy_format.module_copy or {}).items() if own == "bias")
    kinds = get_variant(name_of_copy).kinds
    found: dict[str, dict[str, Tensor]] = {}
    for name in biased_modules(model):
        for key in (f"{PREFIX}{name}.base_layer.bias", f"{PREFIX}{name}.bias"):
            if key not in read:
                continue
            kind = layer_kind(modules[name])
            if kind not in kinds:
                raise ValueError(  # error: peft-bias-kind
                    f"{directory}: bias={config.get('bias')!r} trained the bias of {name} ({type(modules[name]).__name__}); "
                    f"lora_func trains biases of {sorted(kinds)} layers only; load the checkpoint in peft "
                    f"(merge_and_unload), or retrain with bias='none'"
                )
            found[name] = {slot: read.pop(key)}
    return found


def _drop_wrapper_biases(config: Mapping[str, Any], read: dict[str, Tensor]) -> None:
    """With ``bias="all"`` peft's state dict also holds the ``ModulesToSaveWrapper``'s own views
    of a copied module's bias: ``<module>.modules_to_save.bias`` (the copy's, saved again under
    ``<module>.bias``) and ``<module>.original_module.bias`` (the base's, never used while the copy
    is active): dropped, the copy reads ``<module>.bias``."""
    if config.get("bias") == "all":
        for key in [k for k in read if k.endswith((".modules_to_save.bias", ".original_module.bias"))]:
            del read[key]


def load_peft(directory: str | os.PathLike, model: nn.Module, *, check_finite: bool = True) -> AdapterLike:
    """Read a peft checkpoint directory (``adapter_config.json`` + ``adapter_model.safetensors``,
    or the older ``adapter_model.bin``) as a lora_func adapter on ``model``, the untouched base.

    Each layer is read as the variant whose peft format reads it (``PeftFormat.reads``: e.g. a
    LoraConfig's ``use_dora`` / ``init_lora_weights`` pick among the variants stored as it),
    with its rank and alpha from ``r`` / ``rank_pattern`` and ``lora_alpha`` / ``alpha_pattern``
    as peft computes them; layers of several variants in one checkpoint (``feedforward_modules``)
    load as their composition. Buffers the checkpoint does not hold are recomputed from
    ``model`` as peft does. The adapted layers are exactly the modules that have
    tensors in the file. Everything is checked (modules, shapes, config consistency) before
    anything is returned; the model is only read.

    Two checks go beyond peft's own loader, which accepts both files: a tensor holding a NaN or
    inf raises (naming the keys; ``check_finite=False`` loads it as it is), and so does a
    checkpoint without any tensor of a layer its config targets (peft warns about the missing
    keys and leaves that layer at its initial values; a layer with only some of its tensors is
    refused by both).
    """
    check_path(directory, "load_peft", "directory")
    directory = Path(directory)
    check_model(model, "load_peft")
    config = read_config(directory)
    peft_type = config.get("peft_type")
    if peft_type in PROMPT_PEFT_TYPES:  # an input-level adapter (lora_func.prompts)
        prompt = _read_tensors(directory)
        if check_finite:
            refuse_non_finite(prompt, directory, "load_peft(..., check_finite=False)")
        return load_prompt_peft(directory, config, prompt, model)
    known = methods()
    if not isinstance(peft_type, str) or peft_type not in known:
        read_as = "; ".join(f"{t} as {', '.join(formats(t))}" for t in sorted(known))
        raise ValueError(  # error: peft-unknown-type
            f"{directory} is a peft {peft_type!r} checkpoint; lora_func reads peft_type {sorted(known)} ({read_as}) and the "
            f"prompt methods' {list(PROMPT_PEFT_TYPES)}"
        )
    check_config(directory, config)
    _refuse_replication(directory, config, model)
    refuse_unsupported(directory, config)
    warn_training_only(directory, config)
    read = _read_tensors(directory, [s for fmt in formats(peft_type).values() for s in fmt.imported])
    if check_finite:
        refuse_non_finite(read, directory, "load_peft(..., check_finite=False)")
    # Tensors held once for every layer (a shared basis, a bank), under whole keys.
    stored_as = [get_variant(name) for name in formats(peft_type)]
    stored_shared = {key: read.pop(key) for variant in stored_as for key in [*read] if _is_shared_key(variant, key)}
    # peft's state dict may also hold a copy of them under every layer that reads them.
    copies = {name for variant in stored_as for name in _shared_keys(variant)}
    read = {key: tensor for key, tensor in read.items() if key.rsplit(".", 1)[-1] not in copies}
    _drop_wrapper_biases(config, read)
    saved = saved_copies(directory, config, model, read)  # (popped from read)
    biases = trained_biases(directory, config, model, read)  # (popped from read)
    from_config = any(_holds_no_layer_tensors(variant) for variant in stored_as)
    tensors = by_module(directory, peft_type, drop_saved_bases(directory, read, model), allow_none=from_config)
    if from_config:
        tensors = _config_layers(directory, config, model) | tensors
    tensors = resolve_parameters(directory, config, tensors, model)
    _check_model(model, directory, tensors)
    selector = config.get("target_modules")
    if selector and not any(selects(selector, name) for name, _ in model.named_modules()):
        # peft refuses such a config ("Target modules ... not found in the base model").
        raise ValueError(  # error: peft-target-modules-unmatched
            f"{directory / CONFIG_NAME}: target_modules={selector!r} matches no module of {type(model).__name__}; load "
            f"it onto the model it was trained for, or fix target_modules"
        )
    adapter = _read(directory, config, peft_type, tensors, model, stored_shared)
    parts = [adapter]
    if saved:  # peft's modules_to_save: trained copies composed with the method's layers
        copy_type = module_copy()[1].method.peft_type
        parts.append(_read(directory, {"peft_type": copy_type}, copy_type, saved, model, {}))
    if biases:  # peft's bias training: the trained biases, before the method's layers (they see them as their base's)
        layers = {name: _Layer(params=tensors) for name, tensors in biases.items()}
        name_of_copy = module_copy()[0]
        parts.insert(0, _assemble(directory, model, name_of_copy, layers, alpha=None, options=bias_copy_options()))
    adapter = parts[0] if len(parts) == 1 else compose(*parts)
    if not from_config:  # after the layers it holds passed every check: those errors say more
        parameters = [f"{owner}.{name}" for owner, names in targeted_parameters(model, config.get("target_parameters") or []).items() for name in names]
        refuse_missing_layers(directory, config, model, list(tensors), parameters)
    return adapter
