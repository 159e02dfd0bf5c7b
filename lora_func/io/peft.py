"""HF peft's checkpoint format, both directions: ``adapter_config.json`` + ``adapter_model.safetensors``.

Adapters trained with peft load onto the untouched base model (:func:`load_peft`), and
lora_func adapters are written in peft's format (:func:`save_peft`) for peft and the tools
that read it (vLLM, TGI, LoRAX); :func:`peft_problems` says whether an adapter fits.

This module is a generic reader/writer: how each variant is stored (its peft method, key
names, shapes, config fields, how a checkpoint's layer reads as it, any conversion) is the
variant's own ``Variant(peft=PeftFormat(...))`` entry, in its file (see
:mod:`lora_func.variants`); docs/io.md has the table. A variant without an entry has no peft
equivalent.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lora_func._model import (
    adapter_layer,
    base_params,
    layer_info,
    variant_init,
    weight_fingerprint,
)
from lora_func.adapter import (
    Adapter,
    AdapterLayer,
    AdapterLike,
    AdapterNode,
    Composed,
    compose,
    leaves,
    walk,
)
from lora_func.checks import check_model, check_path
from lora_func.io._files import replace_directory, safetensors_write
from lora_func.quantized import kind_of_tensor
from lora_func.spec import AdapterSpec
from lora_func.targeting import EXPERT_LAYOUTS, Target, canonical_weight, find_targets, kind_of_layout, layer_kind, stored_shape, tensor_names
from lora_func.variants import (
    PeftFormat,
    PeftMethod,
    get_variant,
    is_finite_number,
    list_variants,
)

__all__ = ["load_peft", "peft_problems", "save_peft"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."

# ============================================================ the variants' entries


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
    for name, suffix in fmt.keys_by_kind.get(kind, fmt.keys).items():
        if name not in found and name in fmt.optional:
            continue
        tensor = found[name]
        if fmt.to_peft is not None:
            tensor = fmt.to_peft(kind, name, tensor, stored_shape(target))
        out[suffix] = tensor.unsqueeze(fmt.matrix[name][0]) if name in fmt.matrix else tensor
    return out


def _out(fmt: PeftFormat, adapter: Adapter, layer: AdapterLayer, base: Mapping[str, Tensor] | None) -> _Out:
    """``layer`` of ``adapter`` as peft stores it, after checking that a conversion has the base it needs."""
    params, buffers = adapter.layer_tensors(layer)
    t, name = layer.target, adapter.spec.variant
    if fmt.export is None:
        method = fmt.method
        return _Out(
            t,
            lambda: _stored(fmt, params | buffers, t),
            r=layer.info.r if method.rank_of is not None else None,
            alpha=layer.info.alpha if method.alpha else None,
            feedforward=fmt.feedforward,
        )
    weight = None
    if fmt.export_needs_base is not None:
        if base is None:
            raise ValueError(  # error: save-peft-needs-model
                f"save_peft of a {name} adapter needs model=<the base model>: {fmt.export_needs_base} ({t.module})"
            )
        weight = base[t.weight_key]
        if layer.base_fingerprint is not None and weight_fingerprint(weight) != layer.base_fingerprint:
            raise ValueError(  # error: save-peft-other-base
                f"save_peft: the {name} adapter on {t.module} was derived from other base weights than this model's "
                f"(fingerprint {layer.base_fingerprint}, model {weight_fingerprint(weight)}); pass the model it was built on"
            )
        weight = canonical_weight(weight, t.layout)
    converted = fmt.export(params, buffers, weight, layer.info)
    return _Out(t, lambda: _stored(fmt, converted.tensors(), t), r=converted.r, alpha=converted.alpha, feedforward=fmt.feedforward)


def _suffixes(peft_type: str) -> dict[str, str]:
    """peft key suffix -> lora_func tensor name, for every variant stored as ``peft_type``."""
    return {
        suffix: name
        for fmt in _formats().values()
        if fmt.method.peft_type == peft_type
        for keys in (fmt.keys, *fmt.keys_by_kind.values())
        for suffix, name in [*((s, n) for n, s in keys.items()), *fmt.old_keys.items()]
    }


# ===================================================================================== load


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(  # error: peft-no-config
            f"no peft checkpoint at {directory}: {CONFIG_NAME} is missing; pass the directory that peft's "
            f"save_pretrained (or lora_func.save_peft) wrote"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: hostile deep nesting
        config = err
    if not isinstance(config, dict):
        problem = config if isinstance(config, Exception) else f"a JSON {type(config).__name__}"
        raise ValueError(f"{path} is not a peft config (a JSON object): {problem}; re-save the checkpoint")  # error: peft-bad-config
    return config


def _read_tensors(directory: Path) -> dict[str, Tensor]:
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
        elif any(not v.is_floating_point() for v in loaded.values()):
            # An integer "adapter" would be cast to an integer spec dtype, or truncate the layer.
            problem = f"tensors {sorted(k for k, v in loaded.items() if not v.is_floating_point())[:3]} are not floating-point"
    if problem is not None:
        raise ValueError(f"the weights in {directory} are not readable (truncated or corrupted?): {problem}; re-save the checkpoint")  # error: peft-unreadable-weights
    if loaded is None:
        raise FileNotFoundError(f"no peft checkpoint at {directory}: neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME} is there")  # error: peft-no-weights
    return dict(loaded)


def _is_regex(pattern: Any) -> bool:
    try:
        re.compile(pattern)
    except (re.error, TypeError, RecursionError, OverflowError):
        return False
    return True


def _config_problems(config: Mapping[str, Any]) -> list[str]:
    """Values of the config fields lora_func reads that have the wrong type or are not finite
    (json reads ``NaN`` and ``1e999``): each would fail deep inside, or make every output NaN."""

    number = is_finite_number

    def rank(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    def selector(value: Any) -> bool:
        return value is None or (isinstance(value, str) and _is_regex(value)) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )

    checks: dict[str, Callable[[Any], bool]] = {
        "r": rank,
        "lora_alpha": number,
        "target_modules": selector,
        "feedforward_modules": selector,
        "target_parameters": lambda v: v is None or (isinstance(v, list) and all(isinstance(t, str) for t in v)),
    }
    # The fields the variants' entries read (every entry's checks, whatever the peft_type, as a
    # field means one thing in peft).
    for fmt in _formats().values():
        checks |= {**fmt.method.checks, **fmt.checks}
    problems = [f"{name}={config[name]!r}" for name, ok in checks.items() if name in config and not ok(config[name])]
    for name, ok in (("rank_pattern", rank), ("alpha_pattern", number)):
        patterns = config.get(name)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            problems.append(f"{name}={patterns!r} (not an object)")
            continue
        # peft matches every key as the regex rf"(.*\.)?({key})$".
        problems += [f"{name}[{key!r}]={value!r}" for key, value in patterns.items() if not (_is_regex(rf"(.*\.)?({key})$") and ok(value))]
    return problems


def _check_config(directory: Path, config: Mapping[str, Any]) -> None:
    problems = _config_problems(config)
    if problems:
        raise ValueError(  # error: peft-config-values
            f"{directory / CONFIG_NAME} has invalid values: {problems[:5]} (ranks are integers >= 1, alphas finite "
            f"numbers, patterns valid regular expressions, flags true/false); re-save the checkpoint or fix the config"
        )


def _selects(selector: str | Sequence[str], module: str) -> bool:
    """peft's ``target_modules`` matching: a regex matched in full, or names / name suffixes."""
    if isinstance(selector, str):
        return re.fullmatch(selector, module) is not None
    return any(module == t or module.endswith("." + t) for t in selector)


def _by_module(directory: Path, peft_type: str, tensors: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """``{module name: {lora_func short name: tensor}}`` from peft's flat keys."""
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
    if unknown or not out:
        raise ValueError(  # error: peft-unmapped-tensors
            f"{directory} has tensors lora_func cannot map for peft_type {peft_type}: {sorted(unknown)[:5]} "
            f"({len(unknown)} of {len(tensors)}); lora_func reads {sorted(set(suffixes))} under '{PREFIX}' (bias, "
            f"modules_to_save and embedding layers are not supported)"
        )
    return out


def _pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """peft's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


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
) -> Adapter:
    """An :class:`Adapter` of ``variant_name`` on exactly ``layers``' modules, checked against the model."""
    dtypes = {t.dtype for layer in layers.values() for t in (*layer.params.values(), *layer.buffers.values())}
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
    for target in targets:
        layer = layers[target.module]
        rank = spec.r if layer.r is None else layer.r
        layer_alpha = spec.alpha if layer.alpha is None else float(layer.alpha)
        shapes = fmt.shapes_by_kind.get(kind_of_layout(target.layout), fmt.shapes)(rank, target.d_in, target.d_out)
        expected = {k: (*target.shape[:1], *v) if target.experts is not None else v for k, v in shapes.items()}
        got = {k: tuple(v.shape) for k, v in (layer.params | layer.buffers).items() if k in expected}
        expected = {k: v for k, v in expected.items() if k in got or k not in fmt.optional}
        if got != expected:
            wrong.append(f"{target.module}: checkpoint has {got}, the model needs {expected}")
            continue
        module = modules[target.owner]
        weight = getattr(module, target.weight_key.rpartition(".")[2])
        info = layer_info(spec, target, r=rank, alpha=layer_alpha)
        layer_buffers = dict(layer.buffers)
        if fmt.recompute_buffers:
            # As peft does on load (e.g. a residual from the base): the variant's own init on the base.
            layer_buffers = variant_init(variant, spec, module, target, info, generator=torch.Generator().manual_seed(0))[1]
        for name, tensor in layer.params.items():
            params[f"{target.module}.{name}"] = tensor.to(weight.device, dtype).contiguous().requires_grad_(True)
        for name, tensor in layer_buffers.items():
            buffers[f"{target.module}.{name}"] = tensor.to(weight.device).contiguous()
        out_layers.append(
            adapter_layer(target, info, layer.params, layer_buffers, weight_fingerprint(weight) if variant.records_base else None)
        )
    if wrong:
        raise ValueError(  # error: peft-shapes
            f"{directory} does not fit {type(model).__name__} (tensor shapes): {wrong[:3]}; load it onto the model "
            f"it was trained for"
        )
    return Adapter(params, buffers, spec, out_layers)


def _warn_training_only(directory: Path, config: Mapping[str, Any]) -> None:
    """Say so when a field that only acts in training is dropped (the loaded adapter computes
    what peft computes at inference, but training it would differ)."""
    method = _methods()[config["peft_type"]]
    dropped = {k: config[k] for k in method.training_only if isinstance(config.get(k), (int, float)) and config[k] > 0}
    if dropped:
        warnings.warn(
            f"{directory / CONFIG_NAME}: {dropped} not applied: {'; '.join(method.training_only[k] for k in dropped)}. The "
            f"loaded adapter gives peft's outputs at inference; further training runs without it",
            UserWarning,
            stacklevel=3,
        )


def _refuse_unsupported(directory: Path, config: Mapping[str, Any]) -> None:
    """Raise for config features that change the math and that lora_func does not have."""
    bad = sorted(name for name in _methods()[config["peft_type"]].refused if config.get(name))
    bad += ["bias"] if config.get("bias", "none") != "none" else []
    if bad:
        raise ValueError(  # error: peft-unsupported-features
            f"{directory} uses {config.get('peft_type')} features lora_func does not support: {bad}; retrain without "
            f"them, or merge the adapter in peft (merge_and_unload) and use the merged model"
        )


def _check_complete(directory: Path, module: str, found: Mapping[str, Tensor], needed: Iterable[str], optional: Iterable[str] = ()) -> None:
    if not set(needed) - set(optional) <= set(found) <= set(needed):
        raise ValueError(  # error: peft-incomplete
            f"{directory} is incomplete at {module}: it has {sorted(found)}, the layer needs {sorted(needed)}; re-save the checkpoint"
        )


def _checked_rank(directory: Path, config: Mapping[str, Any], module: str, got: int) -> int:
    """``got`` (the tensors' rank), after checking that peft's config gives the same: peft
    computes the scale from the config's ``r`` / ``rank_pattern``, not from the tensors."""
    expected = _pattern_value(config.get("rank_pattern"), module, config.get("r", 8))
    if expected != got:
        raise ValueError(  # error: peft-rank-mismatch
            f"{directory} is inconsistent at {module}: its tensors have rank {got}, but the config (r / rank_pattern) "
            f"says {expected}; re-save the checkpoint"
        )
    return got


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
    _check_complete(directory, module, found, fmt.keys_by_kind.get(kind[0], fmt.keys), fmt.optional)
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
        r = _checked_rank(directory, config, module, int(tensors[name].shape[axis]))
    if method.alpha:
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
    params = {k: v for k, v in tensors.items() if k not in fmt.buffers}
    return _Layer(params=params, buffers={k: v for k, v in tensors.items() if k in fmt.buffers}, r=r, alpha=alpha)


def _read(directory: Path, config: Mapping[str, Any], peft_type: str, tensors: Mapping[str, dict[str, Tensor]], model: nn.Module) -> AdapterLike:
    """The adapter of a ``peft_type`` checkpoint: each layer read as the variant whose entry
    reads it; layers of several variants (a method with ``feedforward_modules``) compose."""
    groups: dict[str, tuple[dict[str, Any], dict[str, _Layer]]] = {}
    formats = _formats()
    for module, found in tensors.items():
        name, options = _format_for(directory, config, peft_type, module)
        layer = _layer_from_peft(directory, config, module, formats[name], found, _kind_of(model, module))
        groups.setdefault(name, (options, {}))[1][module] = layer
    method = _methods()[peft_type]
    r = int(config.get("r", 8)) if method.rank_of is not None else 8
    alpha = float(config.get("lora_alpha", 8)) if method.alpha else None
    parts = [
        _assemble(directory, model, name, groups[name][1], r=r, alpha=alpha, options=groups[name][0]) for name in formats if name in groups
    ]
    return parts[0] if len(parts) == 1 else compose(*parts)


def load_peft(directory: str | os.PathLike, model: nn.Module) -> AdapterLike:
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
    """
    check_path(directory, "load_peft", "directory")
    directory = Path(directory)
    check_model(model, "load_peft")
    config = _read_config(directory)
    peft_type = config.get("peft_type")
    methods = _methods()
    if not isinstance(peft_type, str) or peft_type not in methods:
        read_as = "; ".join(
            f"{t} as {', '.join(n for n, f in _formats().items() if f.method.peft_type == t)}" for t in sorted(methods)
        )
        raise ValueError(  # error: peft-unknown-type
            f"{directory} is a peft {peft_type!r} checkpoint; lora_func reads peft_type {sorted(methods)} ({read_as})"
        )
    _check_config(directory, config)
    _refuse_unsupported(directory, config)
    _warn_training_only(directory, config)
    tensors = _by_module(directory, peft_type, _drop_saved_bases(directory, _read_tensors(directory), model))
    tensors = _resolve_parameters(directory, config, tensors, model)
    _check_model(model, directory, tensors)
    selector = config.get("target_modules")
    if selector and not any(_selects(selector, name) for name, _ in model.named_modules()):
        # peft refuses such a config ("Target modules ... not found in the base model").
        raise ValueError(  # error: peft-target-modules-unmatched
            f"{directory / CONFIG_NAME}: target_modules={selector!r} matches no module of {type(model).__name__}; load "
            f"it onto the model it was trained for, or fix target_modules"
        )
    return _read(directory, config, peft_type, tensors, model)


# ===================================================================================== save


@dataclass(frozen=True)
class _Export:
    """What one lora_func adapter becomes in peft: a peft_type, the config fields that must be
    the same for every layer of one checkpoint, and its layers."""

    peft_type: str
    shared: tuple[tuple[str, Any], ...]
    layers: tuple[_Out, ...]


def _export_leaf(adapter: Adapter, base: Mapping[str, Tensor] | None) -> _Export:
    """``adapter`` as peft stores it, after every check that peft can hold it (no tensor is
    computed yet: see :class:`_Out`)."""
    name = adapter.spec.variant
    if adapter.stack_shape or adapter.members is not None:
        raise ValueError(  # error: save-peft-stacked
            f"save_peft: this {name} adapter is stacked (stack_shape {adapter.stack_shape}); a peft checkpoint holds one "
            f"adapter: save each of lora_func.unstack(adapter)"
        )
    fmt = get_variant(name).peft
    layers = []
    for layer in adapter.layers:
        if layer.target.tied_keys:
            raise ValueError(  # error: save-peft-tied
                f"save_peft: {layer.target.module} is adapted under its tied names {list(layer.target.tied_keys)} too "
                f"(tied='both'), but peft would adapt only the {layer.target.module} module's output, not the embedding "
                f"lookup: a different model. Export the merged model with lora_func.merged_state_dict, or save with lora_func.save"
            )
        if fmt is None:
            raise ValueError(  # error: save-peft-no-equivalent
                f"save_peft: {name} has no peft equivalent (peft has no such method); save it with lora_func.save, or "
                f"export the merged model with lora_func.merged_state_dict"
            )
        if layer.target.layout == "conv1d" and not fmt.conv1d:
            raise ValueError(  # error: save-peft-conv1d
                f"save_peft: peft refuses {name} on GPT-2 Conv1D layers ({layer.target.module}), so no peft tool could "
                f"load this checkpoint; save it with lora_func.save instead"
            )
        layers.append(_out(fmt, adapter, layer, base))
    assert fmt is not None  # an adapter has layers
    shared = fmt.config(dict(adapter.spec.options))
    return _Export(fmt.method.peft_type, tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in shared.items())), tuple(layers))


def _leaves(adapter: AdapterLike) -> list[Adapter]:
    """The leaf adapters of ``adapter`` in order. peft applies its adapters in order, as
    :class:`Composed` does, and has no form for any other combinator."""

    if not isinstance(adapter, AdapterNode):
        raise TypeError(f"save_peft expects an Adapter or Composed, got {type(adapter).__name__}")  # error: save-peft-not-adapter
    for _, node in walk(adapter):
        if node.parts and not isinstance(node, Composed):
            raise TypeError(  # error: save-peft-combined
                f"save_peft: a {type(node).__name__} adapter (built by {node.verb}()) has no peft checkpoint form "
                f"(peft applies adapters only in order, as compose does); save it with lora_func.save, or export the "
                f"merged model with lora_func.merged_state_dict"
            )
    return [leaf for _, leaf in leaves(adapter)]


def _most_common(values: Sequence[Any]) -> Any:
    return collections.Counter(values).most_common(1)[0][0]


def _module_selector(selected: Sequence[str], candidates: Sequence[str] | None, *, dotted: bool = True) -> list[str]:
    """Names for peft's ``target_modules``-style list that select exactly ``selected``.

    The short names (``["q_proj", "v_proj"]``), as people write them, when they select
    exactly ``selected`` among ``candidates`` (peft's list matching: equal, or ending in
    ``"." + name``; ``dotted=False`` is peft's ``feedforward_modules`` matching, a plain
    ``endswith``); otherwise the full module names.
    """
    short = sorted({m.rsplit(".", 1)[-1] for m in selected})

    def matches(module: str) -> bool:
        return any(module == s or module.endswith(("." if dotted else "") + s) for s in short)

    if candidates is not None and {m for m in candidates if matches(m)} == set(selected):
        return short
    return sorted(selected)


def _peft_config(
    peft_type: str, shared: Mapping[str, Any], layers: Sequence[_Out], model: nn.Module | None, task_type: str | None = None
) -> dict[str, Any]:
    modules = [o.target.module for o in layers if o.target.layout not in EXPERT_LAYOUTS]
    all_modules = [n for n, _ in model.named_modules() if n] if model is not None else None
    config: dict[str, Any] = {
        "peft_type": peft_type,
        "task_type": task_type,
        "base_model_name_or_path": (getattr(model, "name_or_path", None) or None) if model is not None else None,
        "inference_mode": True,
        "target_modules": _module_selector(modules, all_modules),
    }
    parameters = sorted(o.target.module for o in layers if o.target.layout in EXPERT_LAYOUTS)
    if parameters:
        # peft's target_parameters: the full parameter names select exactly these.
        config["target_parameters"] = parameters
    method = _methods()[peft_type]
    if method.fan_in_fan_out and any(o.target.layout == "conv1d" for o in layers):
        # GPT-2 Conv1D: peft needs fan_in_fan_out (it would set it itself, with a warning).
        config["fan_in_fan_out"] = True
    config |= dict(method.fixed) | dict(shared)
    if method.feedforward_modules:
        ff = [o.target.module for o in layers if o.feedforward]
        selector = _module_selector(ff, modules, dotted=False) if ff else []
        # peft requires feedforward_modules ⊆ target_modules, name by name.
        config["feedforward_modules"] = selector if set(selector) <= set(config["target_modules"]) else sorted(ff)
    if method.rank_of is not None:
        config["r"] = r = _most_common([o.r for o in layers])
        rank_pattern = {o.target.module: o.r for o in layers if o.r != r}
        if method.rank_pattern:
            config["rank_pattern"] = rank_pattern
        elif rank_pattern:
            raise ValueError(  # error: save-peft-one-rank
                f"save_peft: peft's {peft_type} has one rank for all layers, but these layers differ from r={r}: "
                f"{sorted(rank_pattern)[:5]}; save the parts of different ranks separately"
            )
    if method.alpha:
        config["lora_alpha"] = alpha = _most_common([o.alpha for o in layers])
        config["alpha_pattern"] = {o.target.module: o.alpha for o in layers if o.alpha != alpha}
    return config


def _base_of(leaves: Sequence[Adapter], model: nn.Module | None) -> dict[str, Tensor] | None:
    """The model's parameters (``None`` without a model), after checking that it has every target."""
    base = base_params(model) if model is not None else None
    if base is not None:
        missing = sorted({layer.target.weight_key for leaf in leaves for layer in leaf.layers} - set(base))
        if missing:
            raise ValueError(f"save_peft: the adapter's targets {missing[:5]} are not in {type(model).__name__}; pass the model it was built on")  # error: save-peft-wrong-model
    return base


def _one_checkpoint(exports: Sequence[_Export], model: nn.Module | None, task_type: str | None) -> tuple[dict[str, Any], list[_Out]]:
    """The config and the layers of the one checkpoint that holds every part, after checking
    that the parts fit in one: one peft method and one set of options, each layer once."""
    kinds = sorted({(e.peft_type, e.shared) for e in exports})
    if len(kinds) > 1:
        raise ValueError(  # error: save-peft-mixed-methods
            f"save_peft: the parts of this composed adapter need different peft configs ({[k[0] for k in kinds]}: "
            f"{[{name: json.loads(value) for name, value in k[1]} for k in kinds]}); one peft checkpoint has one method and one set of options: save each "
            f"part with save_peft to its own directory"
        )
    layers = [o for e in exports for o in e.layers]
    counts = collections.Counter(o.target.module for o in layers)
    twice = sorted(m for m, n in counts.items() if n > 1)
    if twice:
        raise ValueError(  # error: save-peft-same-layers
            f"save_peft: several parts adapt the same layers {twice[:5]}; a peft checkpoint has one adapter per "
            f"layer: save the parts separately, or export the merged model with lora_func.merged_state_dict"
        )
    peft_type, shared = kinds[0][0], {k: json.loads(v) for k, v in kinds[0][1]}
    return _peft_config(peft_type, shared, layers, model, task_type), layers


def peft_problems(adapter: AdapterLike, *, model: nn.Module | None = None) -> list[str]:
    """Why :func:`save_peft` would refuse to write ``adapter`` (with this ``model=``): the
    message it would raise for each part that peft's format cannot hold, or for the parts
    together; an empty list when it can write the checkpoint.

    What peft cannot hold: a variant without a peft entry (peft has no such method), a
    ``Combined`` adapter, a stacked adapter, a variant on GPT-2 ``Conv1D`` where peft refuses
    it, a weight adapted under its tied names (``tied="both"``), parts that need different peft
    configs or adapt the same layer, layers of different ranks where the method has one rank.
    A variant stored converted from its base (``export_needs_base``) needs ``model=``,
    which must be the model it was built on. Cheap: nothing is computed beyond the base
    weights' fingerprints, and nothing is written.
    """
    if not isinstance(adapter, AdapterNode):
        raise TypeError(f"peft_problems expects an adapter (Adapter, Composed, Combined, ...), got {type(adapter).__name__}")  # error: peft-problems-not-adapter
    if model is not None:
        check_model(model, "peft_problems")
    try:
        leaves = _leaves(adapter)
        base = _base_of(leaves, model)
    except (TypeError, ValueError) as err:  # a Combined adapter; a model without the targets
        return [str(err)]
    problems, exports = [], []
    for leaf in leaves:
        try:
            exports.append(_export_leaf(leaf, base))
        except ValueError as err:
            problems.append(str(err))
    if not problems:
        try:
            _one_checkpoint(exports, model, None)
        except ValueError as err:
            problems.append(str(err))
    return problems


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def save_peft(
    adapter: AdapterLike, directory: str | os.PathLike, *, model: nn.Module | None = None, task_type: str | None = None
) -> Path:
    """Write ``adapter`` as a peft checkpoint: ``directory/adapter_config.json`` and
    ``directory/adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained(base,
    directory)``. Returns the directory.

    Every variant with a peft entry (its file's ``Variant(peft=...)``; docs/io.md has the
    table), per-layer ranks and alphas as ``rank_pattern`` / ``alpha_pattern``, a conversion
    where the entry has one (one that reads the base weights needs ``model=``). A ``Composed`` of adapters that map to one peft method on
    different layers is one checkpoint.
    ``model`` (the base) is optional otherwise; with it the config uses short module names
    (``["q_proj", "v_proj"]``) when they select exactly the adapted layers, and records the
    model's ``name_or_path``. ``task_type`` (e.g. ``"CAUSAL_LM"``) is written as peft's
    ``task_type``: it picks peft's wrapper class, not the adapter's math, so ``load_peft``
    does not keep it (pass it again when you save).

    Raises before writing anything for what peft cannot express (see :func:`peft_problems`,
    which says so without trying).

    The checkpoint is replaced as a whole: both files are written into a new directory next to
    ``directory``, which then takes its place in one atomic step (Linux ``renameat2``), so an
    interrupted save leaves the complete old checkpoint or the complete new one, never a mix,
    and at every moment ``directory`` holds one complete checkpoint. Other entries of
    ``directory`` (a README, tokenizer files) are kept (as hard links, or copies where links
    are refused). Elsewhere, or where the file system refuses the exchange, the two files are
    renamed into place one after the other (each file whole; the pair best effort). See
    docs/io.md.
    """
    leaves = _leaves(adapter)
    check_path(directory, "save_peft", "directory")
    if task_type is not None and not isinstance(task_type, str):
        raise TypeError(f"save_peft: task_type must be a peft task name such as 'CAUSAL_LM' or None, got {task_type!r}")  # error: save-peft-task-type
    if model is not None:
        check_model(model, "save_peft")
    base = _base_of(leaves, model)
    config, layers = _one_checkpoint([_export_leaf(leaf, base) for leaf in leaves], model, task_type)
    stored_under = _parameter_key([o.target for o in layers])
    tensors = {
        f"{PREFIX}{stored_under[o.target.module]}.{suffix}": tensor.detach().to("cpu").contiguous()
        for o in layers
        for suffix, tensor in o.tensors().items()
    }
    directory = Path(directory)
    # The real directory (a symlink to a checkpoint directory is kept, its target replaced).
    target = Path(os.path.realpath(directory))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(  # error: save-peft-not-a-directory
            f"save_peft: {directory} exists and is not a directory; pass a directory path (a peft checkpoint is "
            f"a directory holding {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    replace_directory(
        target,
        {
            WEIGHTS_NAME: lambda path: safetensors_write(path, lambda: save_file(tensors, str(path), metadata={"format": "pt"})),
            CONFIG_NAME: lambda path: _write_text(path, text),
        },
    )
    return directory
