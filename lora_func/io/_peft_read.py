"""Reading an HF peft checkpoint: :func:`load_peft` (the weights file, the model checks, each
layer read as the variant whose entry reads it, the adapter assembled on the untouched model).
Generic: it names no variant.
"""

from __future__ import annotations

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
    layer_info,
    layer_infos,
    shared_init,
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
    _check_config,
    _checked_rank,
    _pattern_value,
    _read_config,
    _refuse_unsupported,
    _selects,
    _warn_training_only,
)
from lora_func.io._peft_keys import (
    CONFIG_NAME,
    LEGACY_WEIGHTS_NAME,
    WEIGHTS_NAME,
    _by_module,
    _drop_saved_bases,
    _expert_params,
    _formats,
    _kind_of,
    _methods,
    _resolve_parameters,
    _targeted_parameters,
)
from lora_func.io._prompt_files import PROMPT_PEFT_TYPES, load_prompt_peft
from lora_func.io._validate import refuse_missing_layers, refuse_non_finite
from lora_func.quantized import kind_of_tensor
from lora_func.spec import AdapterSpec
from lora_func.targeting import (
    find_targets,
    kind_of_layout,
    layer_kind,
    tensor_names,
)
from lora_func.variants import (
    LayerInfo,
    PeftFormat,
    get_variant,
    list_variants,
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
    """Whether ``key`` is an integer tensor that a variant stores as integers (``Variant.integer_buffers``)."""
    if tensor.dtype not in (torch.int32, torch.int64):
        return False
    suffixes = {
        fmt.keys[name] for variant in list_variants() if (fmt := get_variant(variant).peft) is not None
        for name in get_variant(variant).integer_buffers if name in fmt.keys
    }
    return any(key.endswith("." + suffix) for suffix in suffixes)

def _check_model(model: nn.Module, directory: Path, modules: Iterable[str]) -> None:
    if hasattr(model, "peft_config"):
        raise TypeError(  # error: peft-wrapped-model
            f"load_peft({directory}) needs the untouched base model, got a peft-wrapped {type(model).__name__}; "
            f"pass model.get_base_model() of a fresh model (lora_func never modifies it)"
        )
    experts = _expert_params(model)
    names = {name for name, _ in model.named_modules()} | set(experts)
    missing = sorted(set(modules) - names)
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
) -> Adapter:
    """An :class:`Adapter` of ``variant_name`` on exactly ``layers``' modules, checked against the model."""
    dtypes = {t.dtype for layer in layers.values() for t in (*layer.params.values(), *layer.buffers.values()) if t.is_floating_point()}
    # a checkpoint may hold only shared tensors (PeftMethod.layers_from_config)
    dtypes = dtypes or {t.dtype for t in (stored_shared or {}).values() if t.is_floating_point()} or {torch.float32}
    dtype = dtypes.pop()
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    experts = _expert_params(model)
    spec = AdapterSpec(
        variant_name,
        targets=sorted(m for m in layers if m not in experts),
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
    try:
        targets = find_targets(model, spec, where="the checkpoint's layers")
    except ValueError as err:
        raise ValueError(f"load_peft({directory}): {err}") from None  # error: peft-layer-refused
    variant = get_variant(variant_name)
    fmt = variant.peft
    assert fmt is not None  # read by its entry
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    out_layers = []
    wrong = []
    unsaved = fmt.unsaved_buffers(dict(spec.options))  # re-created by the variant's init (PeftFormat.saved_buffers)
    infos = {}
    for target in targets:
        layer = layers[target.module]
        rank = spec.r if layer.r is None else layer.r
        layer_alpha = spec.alpha if layer.alpha is None else float(layer.alpha)
        infos[target.module] = layer_info(spec, target, r=rank, alpha=layer_alpha)
    infos = layer_infos(variant, spec, infos)  # ranks a variant derives from every layer (Variant.layer_ranks)
    # Each layer's position among the targets and the adapter's layout, as init_adapter sets them.
    infos = LayerInfo.numbered(infos)
    for target in targets:
        layer = layers[target.module]
        info = infos[target.module]
        rank = info.r
        by_kind = fmt.shapes_by_kind.get(kind_of_layout(target.layout))
        shapes = by_kind(rank, target.d_in, target.d_out) if by_kind is not None else fmt.shapes_for(info)
        expected = {k: (*target.shape[:1], *v) if target.experts is not None else v for k, v in shapes.items()}
        # with layer_shapes the layer's own set of tensors: a missing or extra one is a mismatch
        got = {k: tuple(v.shape) for k, v in (layer.params | layer.buffers).items() if k in expected or fmt.layer_shapes is not None}
        expected = {k: v for k, v in expected.items() if k in got or (k not in fmt.optional and k not in unsaved)}
        if got != expected:
            wrong.append(f"{target.module}: checkpoint has {got}, the model needs {expected}")
            continue
        module = modules[target.owner]
        weight = getattr(module, target.weight_key.rpartition(".")[2])
        # Buffers the config says the checkpoint leaves out are re-created, as peft does (it
        # never reads them from the file: they are not in its state dict then).
        layer_buffers = {k: v for k, v in layer.buffers.items() if k not in unsaved}
        missing = sorted(unsaved & set(shapes))
        if fmt.recompute_buffers or missing:
            # As peft does on load (e.g. a residual from the base, a projection from a seed): the
            # variant's own init on the base.
            recomputed = variant_init(variant, spec, module, target, info, generator=torch.Generator().manual_seed(0))[1]
            layer_buffers = recomputed if fmt.recompute_buffers else layer_buffers | {k: recomputed[k] for k in missing}
        for name, tensor in layer.params.items():
            params[f"{target.module}.{name}"] = tensor.to(weight.device, dtype).contiguous().requires_grad_(True)
        for name, tensor in layer_buffers.items():
            # positions (Variant.integer_buffers) are int64 in lora_func; peft may write int32
            buffers[f"{target.module}.{name}"] = tensor.to(weight.device, None if tensor.is_floating_point() else torch.int64).contiguous()
        out_layers.append(
            adapter_layer(target, info, layer.params, layer_buffers, weight_fingerprint(weight) if variant.records_base else None)
        )
    if wrong:
        raise ValueError(  # error: peft-shapes
            f"{directory} does not fit {type(model).__name__} (tensor shapes): {wrong[:3]}; load it onto the model "
            f"it was trained for"
        )
    if variant.shared_init is None:
        return Adapter(params, buffers, spec, out_layers)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    infos = {layer.target.module: layer.info for layer in out_layers}
    shared_params, shared_buffers, shared = shared_init(variant, spec, infos, device=device, generator=torch.Generator().manual_seed(0))
    _shared_from_checkpoint(directory, fmt, spec, shared_params, stored_shared or {})
    _shared_from_checkpoint(directory, fmt, spec, shared_buffers, stored_shared or {})
    return Adapter(params | shared_params, buffers | shared_buffers, spec, out_layers, shared=shared)


def _shared_from_checkpoint(directory: Path, fmt: PeftFormat, spec: AdapterSpec, built: dict[str, Tensor], stored: Mapping[str, Tensor]) -> None:
    """Replace the shared tensors ``built`` by the variant's ``shared_init`` (keyed
    ``"<shared>.<name>"``) by the checkpoint's, where it holds them; where it does not, the
    built ones stand only if the config says the checkpoint leaves them out (``shared_saved``)."""
    saved = fmt.shared_saved is None or fmt.shared_saved(dict(spec.options))
    for key, tensor in built.items():
        name = key.removeprefix(f"{SHARED}.")
        whole = fmt.shared_keys.get(name)
        if whole is None:
            continue
        if "{}" in whole:  # held row by row (PeftFormat.shared_keys)
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
        built[key] = stored[whole].to(tensor.device, spec.dtype).contiguous().requires_grad_(tensor.requires_grad)

def _is_shared_key(fmt: PeftFormat, key: str) -> bool:
    """Whether ``key`` holds a shared tensor of ``fmt`` (a whole key, or a row of one held row by row)."""
    return any(
        key == whole or ("{}" in whole and re.fullmatch(re.escape(whole).replace(r"\{\}", "[0-9]+"), key) is not None)
        for whole in fmt.shared_keys.values()
    )

def _config_layers(directory: Path, config: Mapping[str, Any], model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """The modules of ``model`` the config's ``target_modules`` select (peft's matching), for a
    method whose checkpoint may hold no tensor of a layer (:attr:`PeftMethod.layers_from_config`)."""
    selector = config.get("target_modules")
    if not selector or config.get("layers_to_transform") is not None or config.get("layers_pattern"):
        raise ValueError(  # error: peft-layers-from-config
            f"{directory}: a {config.get('peft_type')} checkpoint may hold no tensors per layer, so lora_func finds its layers "
            f"from target_modules, and this config has target_modules={selector!r}, layers_to_transform="
            f"{config.get('layers_to_transform')!r}, layers_pattern={config.get('layers_pattern')!r}; lora_func reads a list or "
            f"regex of target_modules without layers_to_transform / layers_pattern: re-save the adapter with such a config"
        )
    return {name: {} for name, module in model.named_modules() if name and _selects(selector, name) and layer_kind(module) in ("linear", "conv1d")}

def _check_complete(directory: Path, module: str, found: Mapping[str, Tensor], needed: Iterable[str], optional: Iterable[str] = ()) -> None:
    if not set(needed) - set(optional) <= set(found) <= set(needed):
        raise ValueError(  # error: peft-incomplete
            f"{directory} is incomplete at {module}: it has {sorted(found)}, the layer needs {sorted(needed)}; re-save the checkpoint"
        )

def _format_for(directory: Path, config: Mapping[str, Any], peft_type: str, module: str) -> tuple[str, dict[str, Any]]:
    """The lora_func variant that reads the checkpoint's layer ``module``, and its spec options."""
    for name, fmt in _formats().items():
        if fmt.method.peft_type == peft_type and (options := fmt.reads(config, module)) is not None:
            return name, options
    unread = _methods()[peft_type].unread
    why = unread(config) if unread is not None else f"no {peft_type} entry reads its config"
    raise ValueError(f"{directory} cannot be read as a lora_func variant at {module}: {why}")  # error: peft-layer-unread

def _layer_from_peft(
    directory: Path, config: Mapping[str, Any], module: str, fmt: PeftFormat, found: Mapping[str, Tensor], kind: tuple[str, tuple[int, ...]]
) -> _Layer:
    """One layer's peft tensors in lora_func shapes, with its rank and alpha checked against the
    config; ``kind``: the layer's kind and stored weight shape in the model."""
    if fmt.convert_in is not None and any(name in fmt.imported.values() for name in found):
        found = fmt.convert_in(dict(found), config)
    if fmt.layer_shapes is None:  # else the layer's own set is checked against the model's sizes in _assemble
        unsaved = fmt.unsaved_buffers(fmt.reads(config, module) or {})
        _check_complete(directory, module, found, fmt.keys_by_kind.get(kind[0], fmt.keys), fmt.optional | unsaved)
    tensors = dict(found)
    if fmt.from_peft is not None:
        tensors = {name: fmt.from_peft(kind[0], name, t, kind[1]) for name, t in tensors.items()}
    for name, (axis, stored_as) in fmt.matrix.items():
        t = tensors[name]
        if t.dim() != 2 or t.shape[axis] != 1:
            raise ValueError(f"{directory} is inconsistent at {module}: {name} has shape {tuple(t.shape)}, but {stored_as}")  # error: peft-vector-shape
        tensors[name] = t.reshape(-1)
    method = fmt.method
    r = alpha = None
    if method.rank_of is not None:
        # peft computes the scale from the config's r / rank_pattern, not from the tensors.
        name, axis = method.rank_of
        axis += 1 if kind[0] == "experts" else 0  # the expert axis comes first
        if fmt.layer_shapes is None:
            # a method without per-layer ranks in peft (rank_pattern=False) ignores the config's pattern
            fields = method.rank_fields if method.rank_pattern else (method.rank_fields[0], None)
            r = _checked_rank(directory, config, module, int(tensors[name].shape[axis]) // method.rank_multiple, fields)
        else:  # the config's, checked by the layer's own shapes in _assemble
            r = int(_pattern_value(config.get("rank_pattern"), module, config.get("r", 8)))
    elif method.rank_in_config:
        # the shapes check in _assemble verifies the tensors
        field_name, pattern = method.rank_fields
        r = int(_pattern_value(config.get(pattern) if method.rank_pattern and pattern else None, module, config.get(field_name, 8)))
    if method.alpha:
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get(method.alpha_key, 8)))
    params = {k: v for k, v in tensors.items() if k not in fmt.buffers}
    return _Layer(params=params, buffers={k: v for k, v in tensors.items() if k in fmt.buffers}, r=r, alpha=alpha)

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
    formats = _formats()
    for module, found in tensors.items():
        name, options = _format_for(directory, config, peft_type, module)
        layer = _layer_from_peft(directory, config, module, formats[name], found, _kind_of(model, module))
        groups.setdefault(name, (options, {}))[1][module] = layer
    method = _methods()[peft_type]
    r = int(config.get(method.rank_fields[0], 8)) if method.rank_of is not None or method.rank_in_config else 8
    alpha = float(config.get(method.alpha_key, 8)) if method.alpha else None
    parts = [
        _assemble(directory, model, name, groups[name][1], r=r, alpha=alpha, options=groups[name][0], stored_shared=stored_shared)
        for name in formats
        if name in groups
    ]
    return parts[0] if len(parts) == 1 else compose(*parts)

def load_peft(directory: str | os.PathLike, model: nn.Module, *, check_finite: bool = True) -> AdapterLike:
    """Read a peft checkpoint directory (``adapter_config.json`` + ``adapter_model.safetensors``,
    or the older ``adapter_model.bin``) as a lora_func adapter on ``model``, the untouched base.

    Each layer is read as the variant whose peft entry reads it (``Variant.peft.reads``: e.g. a
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
    config = _read_config(directory)
    peft_type = config.get("peft_type")
    if peft_type in PROMPT_PEFT_TYPES:  # an input-level adapter (lora_func.prompts)
        prompt = _read_tensors(directory)
        if check_finite:
            refuse_non_finite(prompt, directory, "load_peft(..., check_finite=False)")
        return load_prompt_peft(directory, config, prompt, model)
    methods = _methods()
    if not isinstance(peft_type, str) or peft_type not in methods:
        read_as = "; ".join(
            f"{t} as {', '.join(n for n, f in _formats().items() if f.method.peft_type == t)}" for t in sorted(methods)
        )
        raise ValueError(  # error: peft-unknown-type
            f"{directory} is a peft {peft_type!r} checkpoint; lora_func reads peft_type {sorted(methods)} ({read_as}) and the "
            f"prompt methods' {list(PROMPT_PEFT_TYPES)}"
        )
    _check_config(directory, config)
    _refuse_unsupported(directory, config)
    _warn_training_only(directory, config)
    read = _read_tensors(directory, [s for fmt in _formats().values() if fmt.method.peft_type == peft_type for s in fmt.imported])
    if check_finite:
        refuse_non_finite(read, directory, "load_peft(..., check_finite=False)")
    # Tensors held once for every layer (a shared basis, a bank), under whole keys.
    entries = [fmt for fmt in _formats().values() if fmt.method.peft_type == peft_type]
    stored_shared = {key: read.pop(key) for fmt in entries for key in [*read] if _is_shared_key(fmt, key)}
    # peft's state dict may also hold a copy of them under every layer that reads them.
    copies = {name for fmt in entries for name in fmt.shared_keys}
    read = {key: tensor for key, tensor in read.items() if key.rsplit(".", 1)[-1] not in copies}
    method = methods[peft_type]
    tensors = _by_module(directory, peft_type, _drop_saved_bases(directory, read, model), allow_none=method.layers_from_config)
    if method.layers_from_config:
        tensors = _config_layers(directory, config, model) | tensors
    tensors = _resolve_parameters(directory, config, tensors, model)
    _check_model(model, directory, tensors)
    selector = config.get("target_modules")
    if selector and not any(_selects(selector, name) for name, _ in model.named_modules()):
        # peft refuses such a config ("Target modules ... not found in the base model").
        raise ValueError(  # error: peft-target-modules-unmatched
            f"{directory / CONFIG_NAME}: target_modules={selector!r} matches no module of {type(model).__name__}; load "
            f"it onto the model it was trained for, or fix target_modules"
        )
    adapter = _read(directory, config, peft_type, tensors, model, stored_shared)
    if not method.layers_from_config:  # after the layers it holds passed every check: those errors say more
        parameters = [f"{owner}.{name}" for owner, names in _targeted_parameters(model, config.get("target_parameters") or []).items() for name in names]
        refuse_missing_layers(directory, config, model, list(tensors), parameters)
    return adapter
