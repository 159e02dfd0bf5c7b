"""HF peft's checkpoint format, both directions: ``adapter_config.json`` + ``adapter_model.safetensors``.

Adapters trained with peft load onto the untouched base model (:func:`load_peft`), and
lora_func adapters are written in peft's format (:func:`save_peft`) for peft and the tools
that read it (vLLM, TGI, LoRAX). This is the only module that knows peft's key names:

============  ===========  =====================================================================
lora_func     peft_type    tensors (``base_model.model.<module>.<name>``)
============  ===========  =====================================================================
lora, eva     LORA         ``lora_A.weight (r, d_in)``, ``lora_B.weight (d_out, r)``
dora          LORA         the same plus ``lora_magnitude_vector (d_out,)``, ``use_dora=true``
pissa         LORA         converted to a plain LoRA of rank ``2r`` on the untouched base
ia3, ia3_ff   IA3          ``ia3_l (d_out, 1)``, or ``(1, d_in)`` for ``feedforward_modules``
hra           HRA          ``hra_u (d_in, r)``
delora        DELORA       ``delora_A``, ``delora_B``, ``delora_lambda (1,)``, ``delora_w_norm (d_in,)``
============  ===========  =====================================================================

peft shapes adapter tensors in feature terms on GPT-2 ``Conv1D`` too (``fan_in_fan_out`` only
changes how peft merges), so the tensors are the same on both layer kinds.

PiSSA: peft overwrites the base weight with the residual ``W_res = W − s·B0 A0``, so a PiSSA
checkpoint as peft saves it by default is relative to a base nobody else has. ``save_peft``
therefore writes what peft's ``save_pretrained(path_initial_model_for_weight_conversion=...)``
writes: the plain LoRA ``ΔW = s·(B A − B0 A0) = s·[B, −B0][A; A0]`` of rank ``2r`` (same
scale) relative to the untouched base. lora_func does not keep ``A0, B0``: it recovers them
from ``s·B0 A0 = W − W_res`` by an SVD (rank ``r`` exactly, up to fp32 round-off), which
needs the base weights (``model=``) and works for any PiSSA adapter, including a randomized-SVD
one or one loaded from a file. A peft PiSSA checkpoint saved without the conversion
(``init_lora_weights="pissa"``) loads as a lora_func ``pissa`` adapter whose residual is
recomputed from the base exactly as peft does on load.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lora_func._types import LayerInfo, lora_scale
from lora_func.adapter import Adapter, AdapterLayer, AdapterLike, Combined, Composed, compose
from lora_func.checks import check_model, check_path
from lora_func._model import base_params, weight_fingerprint
from lora_func.io._files import replace_directory, safetensors_write
from lora_func.spec import AdapterSpec
from lora_func.quantized import kind_of_tensor
from lora_func.targeting import Target, canonical_weight, find_targets, tensor_names
from lora_func.variants import get_variant

__all__ = ["load_peft", "save_peft"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."

# peft tensor suffix -> lora_func short name, per peft_type.
SUFFIXES: dict[str, dict[str, str]] = {
    "LORA": {
        "lora_A.weight": "lora_A",
        "lora_B.weight": "lora_B",
        "lora_magnitude_vector": "lora_magnitude_vector",
        "lora_magnitude_vector.weight": "lora_magnitude_vector",  # older peft
    },
    "IA3": {"ia3_l": "ia3_l"},
    "HRA": {"hra_u": "hra_u"},
    "DELORA": {"delora_A": "delora_A", "delora_B": "delora_B", "delora_lambda": "delora_lambda", "delora_w_norm": "delora_w_norm"},
}
# LoRA inits that leave the base untouched: the checkpoint is a plain LoRA on the original base.
PLAIN_LORA_INITS = (True, False, "gaussian", "orthogonal")
# LoraConfig fields lora_func has no equivalent for: any truthy value is refused.
UNSUPPORTED_LORA_FIELDS = (
    "lora_bias", "layer_replication", "target_parameters", "alora_invocation_tokens", "use_qalora", "use_bdlora",
    "arrow_config", "monteclora_config", "kasa_config", "velora_config", "trainable_token_indices", "modules_to_save",
    "megatron_config",
)


# ===================================================================================== load


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"no peft checkpoint at {directory}: {CONFIG_NAME} is missing; pass the directory that peft's "
            f"save_pretrained (or lora_func.save_peft) wrote"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: hostile deep nesting
        config = err
    if not isinstance(config, dict):
        problem = config if isinstance(config, Exception) else f"a JSON {type(config).__name__}"
        raise ValueError(f"{path} is not a peft config (a JSON object): {problem}; re-save the checkpoint")
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
        raise ValueError(f"the weights in {directory} are not readable (truncated or corrupted?): {problem}; re-save the checkpoint")
    if loaded is None:
        raise FileNotFoundError(f"no peft checkpoint at {directory}: neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME} is there")
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

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def rank(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    def selector(value: Any) -> bool:
        return value is None or (isinstance(value, str) and _is_regex(value)) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )

    checks = {
        "r": rank,
        "lora_alpha": number,
        "delora_lambda": number,
        "lora_dropout": lambda v: v is None or (number(v) and 0 <= v < 1),
        "use_rslora": lambda v: isinstance(v, bool),
        "use_dora": lambda v: isinstance(v, bool),
        "init_weights": lambda v: isinstance(v, bool),
        "init_lora_weights": lambda v: isinstance(v, (bool, str)),
        "target_modules": selector,
        "feedforward_modules": selector,
        "eva_config": lambda v: v is None or (isinstance(v, dict) and all(number(v[k]) for k in ("rho", "tau") if k in v)),
    }
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
        raise ValueError(
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
    suffixes = SUFFIXES[peft_type]
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
        raise ValueError(
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
        raise TypeError(
            f"load_peft({directory}) needs the untouched base model, got a peft-wrapped {type(model).__name__}; "
            f"pass model.get_base_model() of a fresh model (lora_func never modifies it)"
        )
    names = {name for name, _ in model.named_modules()}
    missing = sorted(set(modules) - names)
    if missing:
        raise ValueError(
            f"{directory} adapts modules that {type(model).__name__} does not have: {missing[:5]} ({len(missing)} in "
            f"all); load it onto the model it was trained for"
        )
    by_name = dict(model.named_modules())
    weights = {m: getattr(by_name[m], "weight", None) for m in modules}
    not_float = sorted(
        f"{m}.weight ({w.dtype})"
        for m, w in weights.items()
        if isinstance(w, Tensor) and not w.is_floating_point() and kind_of_tensor(w) is None
    )
    if not_float:
        raise TypeError(
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


def _expected_shapes(variant: str, r: int, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
    lora = {"lora_A": (r, d_in), "lora_B": (d_out, r)}
    return {
        "lora": lora,
        "eva": lora,
        "pissa": lora,
        "dora": lora | {"lora_magnitude_vector": (d_out,)},
        "ia3": {"ia3_l": (d_out,)},
        "ia3_ff": {"ia3_l": (d_in,)},
        "hra": {"hra_u": (d_in, r)},
        "delora": {"delora_A": (r, d_in), "delora_B": (d_out, r), "delora_lambda": (1,), "delora_w_norm": (d_in,)},
    }[variant]


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
    spec = AdapterSpec(variant_name, targets=sorted(layers), r=r, alpha=alpha, dtype=dtype, **options)
    modules = dict(model.named_modules())
    names_of = tensor_names(model)
    tied = sorted(m for m in layers if len(names_of.get(id(getattr(modules[m], "weight", None)), ())) > 1)
    if tied:
        raise ValueError(
            f"{directory} adapts {tied}, whose weight is tied to another name (e.g. GPT-2's lm_head and the token "
            f"embedding): peft adapts only that module's output, lora_func adapts the shared tensor under every name "
            f"(tied='both'), which also changes the embedding; merge the adapter in peft (merge_and_unload) instead"
        )
    try:
        targets = find_targets(model, spec)
    except ValueError as err:
        raise ValueError(f"load_peft({directory}): {err}") from None
    variant = get_variant(variant_name)
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    out_layers = []
    wrong = []
    for target in targets:
        layer = layers[target.module]
        rank = spec.r if layer.r is None else layer.r
        layer_alpha = spec.alpha if layer.alpha is None else float(layer.alpha)
        expected = _expected_shapes(variant_name, rank, target.d_in, target.d_out)
        got = {k: tuple(v.shape) for k, v in (layer.params | layer.buffers).items() if k in expected}
        if got != expected:
            wrong.append(f"{target.module}: checkpoint has {got}, the model needs {expected}")
            continue
        weight = modules[target.module].weight
        info = LayerInfo(
            d_in=target.d_in, d_out=target.d_out, r=rank, alpha=layer_alpha, has_bias=target.bias_key is not None, options=spec.options
        )
        layer_buffers = dict(layer.buffers)
        if variant_name == "pissa":
            layer_buffers = _pissa_residual(weight, target, info, dtype)
        for name, tensor in layer.params.items():
            params[f"{target.module}.{name}"] = tensor.to(weight.device, dtype).contiguous().requires_grad_(True)
        for name, tensor in layer_buffers.items():
            buffers[f"{target.module}.{name}"] = tensor.to(weight.device).contiguous()
        out_layers.append(
            AdapterLayer(
                target=target,
                info=info,
                param_shapes=tuple((n, tuple(t.shape)) for n, t in layer.params.items()),
                buffer_shapes=tuple((n, tuple(t.shape)) for n, t in layer_buffers.items()),
                base_fingerprint=weight_fingerprint(weight) if variant.records_base else None,
            )
        )
    if wrong:
        raise ValueError(
            f"{directory} does not fit {type(model).__name__} (tensor shapes): {wrong[:3]}; load it onto the model "
            f"it was trained for"
        )
    return Adapter(params, buffers, spec, out_layers)


def _pissa_residual(weight: Tensor, target: Target, info: LayerInfo, dtype: torch.dtype) -> dict[str, Tensor]:
    """peft recomputes PiSSA's residual from the base when it loads an unconverted PiSSA
    checkpoint (full SVD, deterministic); lora_func's pissa init runs the same operations."""
    with torch.no_grad():
        _, buffers = get_variant("pissa").init(
            canonical_weight(weight.detach(), target.layout), None, info, dtype=dtype, generator=torch.Generator().manual_seed(0)
        )
    return buffers


def _warn_training_only(directory: Path, config: Mapping[str, Any]) -> None:
    """Say so when a field that only acts in training is dropped (the loaded adapter computes
    what peft computes at inference, but training it would differ)."""
    dropped = {k: config[k] for k in ("module_dropout",) if isinstance(config.get(k), (int, float)) and config[k] > 0}
    if dropped:
        warnings.warn(
            f"{directory / CONFIG_NAME}: {dropped} not applied: lora_func's DeLoRA has no module dropout. The loaded "
            f"adapter gives peft's outputs at inference; further training runs without it",
            UserWarning,
            stacklevel=3,
        )


def _refuse_unsupported(directory: Path, config: Mapping[str, Any]) -> None:
    """Raise for config features that change the math and that lora_func does not have."""
    fields = UNSUPPORTED_LORA_FIELDS if config.get("peft_type") == "LORA" else ("modules_to_save",)
    bad = sorted(name for name in fields if config.get(name))
    bad += ["bias"] if config.get("bias", "none") != "none" else []
    bad += ["apply_GS"] if config.get("peft_type") == "HRA" and config.get("apply_GS") else []
    if bad:
        raise ValueError(
            f"{directory} uses {config.get('peft_type')} features lora_func does not support: {bad}; retrain without "
            f"them, or merge the adapter in peft (merge_and_unload) and use the merged model"
        )


def _check_complete(directory: Path, module: str, found: Mapping[str, Tensor], needed: Iterable[str]) -> None:
    if sorted(found) != sorted(needed):
        raise ValueError(
            f"{directory} is incomplete at {module}: it has {sorted(found)}, the layer needs {sorted(needed)}; re-save the checkpoint"
        )


def _checked_rank(directory: Path, config: Mapping[str, Any], module: str, got: int) -> int:
    """``got`` (the tensors' rank), after checking that peft's config gives the same: peft
    computes the scale from the config's ``r`` / ``rank_pattern``, not from the tensors."""
    expected = _pattern_value(config.get("rank_pattern"), module, config.get("r", 8))
    if expected != got:
        raise ValueError(
            f"{directory} is inconsistent at {module}: its tensors have rank {got}, but the config (r / rank_pattern) "
            f"says {expected}; re-save the checkpoint"
        )
    return got


def _read_lora(directory: Path, config: Mapping[str, Any], tensors: Mapping[str, dict[str, Tensor]], model: nn.Module) -> Adapter:
    init = config.get("init_lora_weights", True)
    use_dora = bool(config.get("use_dora", False))
    rslora = bool(config.get("use_rslora", False))
    dropout = float(config.get("lora_dropout") or 0.0)
    if use_dora and init in PLAIN_LORA_INITS:
        variant, options = "dora", {"use_rslora": rslora}
    elif init == "pissa" and not use_dora:
        variant, options = "pissa", {"use_rslora": rslora, "niter": 0}
    elif init == "eva" and not use_dora:
        eva = config.get("eva_config") or {}
        keep = ("rho", "tau", "whiten", "adjust_scaling_factors")
        variant, options = "eva", {"use_rslora": rslora} | {k: eva[k] for k in keep if k in eva}
    elif init in PLAIN_LORA_INITS and not use_dora:
        variant, options = "lora", {"use_rslora": rslora, "init": "gaussian" if init == "gaussian" else "kaiming"}
    else:
        raise ValueError(
            f"{directory} was initialised with init_lora_weights={init!r}{' and use_dora' if use_dora else ''}: peft changed "
            f"its base weights for it, so the checkpoint is relative to a base lora_func does not have; save it in peft with "
            f"save_pretrained(..., path_initial_model_for_weight_conversion=<dir of the initial adapter>) to get a "
            f"plain LoRA on the original base"
        )
    options["dropout"] = dropout  # peft's lora_dropout: acts in training steps only
    layers = {}
    for module, found in tensors.items():
        _check_complete(directory, module, found, ["lora_A", "lora_B"] + (["lora_magnitude_vector"] if use_dora else []))
        r = _checked_rank(directory, config, module, int(found["lora_A"].shape[0]))
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
        layers[module] = _Layer(params=dict(found), r=r, alpha=alpha)
    return _assemble(directory, model, variant, layers, r=int(config.get("r", 8)), alpha=float(config.get("lora_alpha", 8)), options=options)


def _is_feedforward(feedforward_modules: str | Sequence[str] | None, module: str) -> bool:
    """peft's ``IA3Model._check_target_module_feedforward`` (note: ``endswith`` without a dot)."""
    if not feedforward_modules:
        return False
    if isinstance(feedforward_modules, str):
        return re.fullmatch(feedforward_modules, module) is not None
    return any(module.endswith(t) for t in feedforward_modules)


def _read_ia3(directory: Path, config: Mapping[str, Any], tensors: Mapping[str, dict[str, Tensor]], model: nn.Module) -> AdapterLike:
    out_layers, ff_layers = {}, {}
    for module, found in tensors.items():
        g = found["ia3_l"]
        ff = _is_feedforward(config.get("feedforward_modules"), module)
        # peft stores (d_out, 1) or, for feed-forward modules, (1, d_in).
        if g.dim() != 2 or g.shape[0 if ff else 1] != 1:
            raise ValueError(
                f"{directory} is inconsistent at {module}: ia3_l has shape {tuple(g.shape)}, but a "
                f"{'feed-forward' if ff else 'non-feed-forward'} IA3 layer has {'(1, d_in)' if ff else '(d_out, 1)'}"
            )
        (ff_layers if ff else out_layers)[module] = _Layer(params={"ia3_l": g.reshape(-1)})
    parts = [
        _assemble(directory, model, variant, layers, options={})
        for variant, layers in (("ia3", out_layers), ("ia3_ff", ff_layers))
        if layers
    ]
    return parts[0] if len(parts) == 1 else compose(*parts)


def _read_hra(directory: Path, config: Mapping[str, Any], tensors: Mapping[str, dict[str, Tensor]], model: nn.Module) -> Adapter:
    layers = {}
    for module, found in tensors.items():
        u = found["hra_u"]
        layers[module] = _Layer(params={"hra_u": u}, r=_checked_rank(directory, config, module, int(u.shape[-1])))
    options = {"init": "paired" if config.get("init_weights", True) else "random"}
    return _assemble(directory, model, "hra", layers, r=int(config.get("r", 8)), options=options)


def _read_delora(directory: Path, config: Mapping[str, Any], tensors: Mapping[str, dict[str, Tensor]], model: nn.Module) -> Adapter:
    layers = {}
    for module, found in tensors.items():
        _check_complete(directory, module, found, ["delora_A", "delora_B", "delora_lambda", "delora_w_norm"])
        r = _checked_rank(directory, config, module, int(found["delora_A"].shape[0]))
        params = {k: found[k] for k in ("delora_A", "delora_B", "delora_lambda")}
        layers[module] = _Layer(params=params, buffers={"delora_w_norm": found["delora_w_norm"]}, r=r)
    options = {"lambda0": float(config.get("delora_lambda", 15.0))}
    return _assemble(directory, model, "delora", layers, r=int(config.get("r", 8)), options=options)


READERS = {"LORA": _read_lora, "IA3": _read_ia3, "HRA": _read_hra, "DELORA": _read_delora}


def load_peft(directory: str | os.PathLike, model: nn.Module) -> AdapterLike:
    """Read a peft checkpoint directory (``adapter_config.json`` + ``adapter_model.safetensors``,
    or the older ``adapter_model.bin``) as a lora_func adapter on ``model``, the untouched base.

    ``peft_type`` LORA gives ``lora`` (or ``dora`` with ``use_dora``, ``eva`` for
    ``init_lora_weights="eva"``, ``pissa`` for an unconverted PiSSA checkpoint, whose residual
    is recomputed from ``model``), with per-layer ranks and alphas from ``rank_pattern`` /
    ``alpha_pattern`` and ``use_rslora``; IA3 gives ``ia3`` (or ``ia3_ff`` for
    ``feedforward_modules``; a checkpoint with both is ``compose(ia3, ia3_ff)``); HRA gives
    ``hra``; DELORA gives ``delora``. The adapted layers are exactly the modules that have
    tensors in the file. Everything is checked (modules, shapes, config consistency) before
    anything is returned; the model is only read.
    """
    check_path(directory, "load_peft", "directory")
    directory = Path(directory)
    check_model(model, "load_peft")
    config = _read_config(directory)
    peft_type = config.get("peft_type")
    if not isinstance(peft_type, str) or peft_type not in READERS:
        raise ValueError(
            f"{directory} is a peft {peft_type!r} checkpoint; lora_func reads peft_type {sorted(READERS)} "
            f"(LoRA with rsLoRA/DoRA/PiSSA/EVA, IA3, HRA, DeLoRA)"
        )
    _check_config(directory, config)
    _refuse_unsupported(directory, config)
    _warn_training_only(directory, config)
    tensors = _by_module(directory, peft_type, _read_tensors(directory))
    _check_model(model, directory, tensors)
    selector = config.get("target_modules")
    if selector and not any(_selects(selector, name) for name, _ in model.named_modules()):
        # peft refuses such a config ("Target modules ... not found in the base model").
        raise ValueError(
            f"{directory / CONFIG_NAME}: target_modules={selector!r} matches no module of {type(model).__name__}; load "
            f"it onto the model it was trained for, or fix target_modules"
        )
    return READERS[peft_type](directory, config, tensors, model)


# ===================================================================================== save


@dataclass(frozen=True)
class _Out:
    """One layer as peft stores it."""

    target: Target
    tensors: dict[str, Tensor]  # peft suffix -> tensor in peft's shape
    r: int | None = None
    alpha: float | None = None
    feedforward: bool = False


@dataclass(frozen=True)
class _Export:
    """What one lora_func adapter becomes in peft: a peft_type, the config fields that must be
    the same for every layer of one checkpoint, and its layers."""

    peft_type: str
    shared: tuple[tuple[str, Any], ...]
    layers: tuple[_Out, ...]


def _lora_out(adapter: Adapter, layer: AdapterLayer, params: Mapping[str, Tensor], r: int, alpha: float) -> _Out:
    tensors = {"lora_A.weight": params["lora_A"], "lora_B.weight": params["lora_B"]}
    if "lora_magnitude_vector" in params:
        tensors["lora_magnitude_vector"] = params["lora_magnitude_vector"]
    return _Out(layer.target, tensors, r=r, alpha=alpha)


def _pissa_as_lora(adapter: Adapter, layer: AdapterLayer, base: Mapping[str, Tensor] | None) -> _Out:
    """PiSSA as a plain LoRA of rank 2r on the untouched base (peft's conversion):
    ``A' = [A; A0] (2r, d_in)``, ``B' = [B, −B0] (d_out, 2r)``, same scale."""
    t = layer.target
    if base is None:
        raise ValueError(
            f"save_peft of a pissa adapter needs model=<the base model>: peft's format stores PiSSA as a LoRA "
            f"relative to the untouched base, and its initial factors are recovered from W − W_res ({t.module})"
        )
    weight = base[t.weight_key]
    if weight_fingerprint(weight) != layer.base_fingerprint:
        raise ValueError(
            f"save_peft: the pissa adapter on {t.module} was derived from other base weights than this model's "
            f"(fingerprint {layer.base_fingerprint}, model {weight_fingerprint(weight)}); pass the model it was built on"
        )
    params, buffers = adapter.layer_tensors(layer)
    r, s = layer.info.r, lora_scale(layer.info)
    w_res = buffers["W_res"]
    compute = torch.promote_types(w_res.dtype, torch.float32)
    # s·B0 A0 = W − W_res; its top-r SVD gives factors with exactly that product up to round-off.
    initial = canonical_weight(weight, t.layout).to(compute) - w_res.to(compute)
    u, sv, vh = torch.linalg.svd(initial, full_matrices=False)
    root = torch.sqrt(sv[:r] / s)
    a0, b0 = root[:, None] * vh[:r], u[:, :r] * root[None, :]
    dtype = params["lora_A"].dtype
    lora_a = torch.cat([params["lora_A"], a0.to(dtype)], dim=0)
    lora_b = torch.cat([params["lora_B"], -b0.to(dtype)], dim=1)
    rslora = dict(layer.info.options).get("use_rslora", False)
    # peft's conversion: rank 2r, alpha 2·alpha (alpha·√2 with rsLoRA), so the scale is unchanged.
    alpha = layer.info.alpha * (math.sqrt(2) if rslora else 2)
    return _Out(t, {"lora_A.weight": lora_a, "lora_B.weight": lora_b}, r=2 * r, alpha=alpha)


def _export_leaf(adapter: Adapter, base: Mapping[str, Tensor] | None) -> _Export:
    name = adapter.spec.variant
    if adapter.stack_shape or adapter.members is not None:
        raise ValueError(
            f"save_peft: this {name} adapter is stacked (stack_shape {adapter.stack_shape}); a peft checkpoint holds one "
            f"adapter: save each of lora_func.unstack(adapter)"
        )
    layers = []
    for layer in adapter.layers:
        params, buffers = adapter.layer_tensors(layer)
        info = layer.info
        if layer.target.tied_keys:
            raise ValueError(
                f"save_peft: {layer.target.module} is adapted under its tied names {list(layer.target.tied_keys)} too "
                f"(tied='both'), but peft would adapt only the {layer.target.module} module's output, not the embedding "
                f"lookup: a different model. Export the merged model with lora_func.merge, or save with lora_func.save"
            )
        if layer.target.layout == "conv1d" and name in ("hra", "delora"):
            raise ValueError(
                f"save_peft: peft refuses {name} on GPT-2 Conv1D layers ({layer.target.module}), so no peft tool could "
                f"load this checkpoint; save it with lora_func.save instead"
            )
        if name in ("lora", "eva", "dora"):
            layers.append(_lora_out(adapter, layer, params, info.r, info.alpha))
        elif name == "pissa":
            layers.append(_pissa_as_lora(adapter, layer, base))
        elif name in ("ia3", "ia3_ff"):
            g = params["ia3_l"]
            shaped = g.reshape(1, -1) if name == "ia3_ff" else g.reshape(-1, 1)
            layers.append(_Out(layer.target, {"ia3_l": shaped}, feedforward=name == "ia3_ff"))
        elif name == "hra":
            layers.append(_Out(layer.target, {"hra_u": params["hra_u"]}, r=info.r))
        elif name == "delora":
            tensors = {k: params[k] for k in ("delora_A", "delora_B", "delora_lambda")} | {"delora_w_norm": buffers["delora_w_norm"]}
            layers.append(_Out(layer.target, tensors, r=info.r))
        else:
            raise ValueError(
                f"save_peft: {name} has no peft equivalent (peft has no such method); save it with lora_func.save, or "
                f"export the merged model with lora_func.merge"
            )
    options = dict(adapter.spec.options)
    if name in ("lora", "eva", "dora", "pissa"):
        shared: dict[str, Any] = {
            "lora_dropout": float(options.get("dropout", 0.0)),
            "use_rslora": bool(options.get("use_rslora", False)),
            "use_dora": name == "dora",
            "init_lora_weights": "eva" if name == "eva" else True,
            "eva_config": (
                {k: options[k] for k in ("rho", "tau", "whiten", "adjust_scaling_factors")} if name == "eva" else None
            ),
        }
        peft_type = "LORA"
    elif name in ("ia3", "ia3_ff"):
        peft_type, shared = "IA3", {}
    elif name == "hra":
        peft_type, shared = "HRA", {"init_weights": options["init"] == "paired"}
    else:
        peft_type, shared = "DELORA", {"delora_lambda": float(options["lambda0"])}
    return _Export(peft_type, tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in shared.items())), tuple(layers))


def _leaves(adapter: AdapterLike) -> list[Adapter]:
    """The leaf adapters of ``adapter`` in order. peft applies its adapters in order, as
    :class:`Composed` does, and has no form for any other combinator."""
    from lora_func.adapter import AdapterNode, leaves, walk

    if not isinstance(adapter, AdapterNode):
        raise TypeError(f"save_peft expects an Adapter or Composed, got {type(adapter).__name__}")
    for _, node in walk(adapter):
        if node.parts and not isinstance(node, Composed):
            raise TypeError(
                f"save_peft: a {type(node).__name__} adapter (built by {node.verb}()) has no peft checkpoint form "
                f"(peft applies adapters only in order, as compose does); save it with lora_func.save, or export the "
                f"merged model with lora_func.merge"
            )
    return [leaf for _, leaf in leaves(adapter)]


def _most_common(values: Sequence[Any]) -> Any:
    return collections.Counter(values).most_common(1)[0][0]


def _module_selector(selected: Sequence[str], candidates: Sequence[str] | None, *, dotted: bool = True) -> list[str]:
    """Names for peft's ``target_modules``-style list that select exactly ``selected``.

    The short names (``["q_proj", "v_proj"]``), as people write them, when they select
    exactly ``selected`` among ``candidates`` (peft's list matching: equal, or ending in
    ``"." + name``; ``dotted=False`` is IA3's ``feedforward_modules`` matching, a plain
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
    modules = [o.target.module for o in layers]
    all_modules = [n for n, _ in model.named_modules() if n] if model is not None else None
    config: dict[str, Any] = {
        "peft_type": peft_type,
        "task_type": task_type,
        "base_model_name_or_path": (getattr(model, "name_or_path", None) or None) if model is not None else None,
        "inference_mode": True,
        "target_modules": _module_selector(modules, all_modules),
    }
    if any(o.target.layout == "conv1d" for o in layers):
        # GPT-2 Conv1D: peft needs fan_in_fan_out (it would set it itself, with a warning).
        config["fan_in_fan_out"] = True
    if peft_type == "IA3":
        ff = [o.target.module for o in layers if o.feedforward]
        selector = _module_selector(ff, modules, dotted=False) if ff else []
        # peft requires feedforward_modules ⊆ target_modules, name by name.
        config["feedforward_modules"] = selector if set(selector) <= set(config["target_modules"]) else sorted(ff)
        config["init_ia3_weights"] = True
        return config
    r = _most_common([o.r for o in layers])
    config |= dict(shared) | {"r": r, "bias": "none"}
    rank_pattern = {o.target.module: o.r for o in layers if o.r != r}
    if peft_type == "HRA":
        if rank_pattern:
            raise ValueError(
                f"save_peft: peft's HRA has one rank for all layers, but these layers differ from r={r}: "
                f"{sorted(rank_pattern)[:5]}; save the parts of different ranks separately"
            )
        return config | {"apply_GS": False}
    if peft_type == "DELORA":
        return config | {"rank_pattern": rank_pattern, "lambda_pattern": {}, "module_dropout": 0.0}
    alpha = _most_common([o.alpha for o in layers])
    alpha_pattern = {o.target.module: o.alpha for o in layers if o.alpha != alpha}
    return config | {"lora_alpha": alpha, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def save_peft(
    adapter: AdapterLike, directory: str | os.PathLike, *, model: nn.Module | None = None, task_type: str | None = None
) -> Path:
    """Write ``adapter`` as a peft checkpoint: ``directory/adapter_config.json`` and
    ``directory/adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained(base,
    directory)``. Returns the directory.

    lora/eva (per-layer ranks and alphas as ``rank_pattern`` / ``alpha_pattern``), dora, pissa
    (converted to a plain LoRA of rank ``2r`` on the untouched base; needs ``model=``), ia3 /
    ia3_ff (``feedforward_modules``), hra and delora. A ``Composed`` of adapters that map to one
    peft method on different layers (e.g. ``compose(ia3, ia3_ff)``) is one checkpoint.
    ``model`` (the base) is optional otherwise; with it the config uses short module names
    (``["q_proj", "v_proj"]``) when they select exactly the adapted layers, and records the
    model's ``name_or_path``. ``task_type`` (e.g. ``"CAUSAL_LM"``) is written as peft's
    ``task_type``: it picks peft's wrapper class, not the adapter's math, so ``load_peft``
    does not keep it (pass it again when you save).

    Raises before writing anything for what peft cannot express: antipasto, a ``Combined``
    adapter, a stacked adapter, hra/delora on GPT-2 ``Conv1D`` (peft refuses them).

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
        raise TypeError(f"save_peft: task_type must be a peft task name such as 'CAUSAL_LM' or None, got {task_type!r}")
    if model is not None:
        check_model(model, "save_peft")
    base = base_params(model) if model is not None else None
    if base is not None:
        missing = sorted({layer.target.weight_key for leaf in leaves for layer in leaf.layers} - set(base))
        if missing:
            raise ValueError(f"save_peft: the adapter's targets {missing[:5]} are not in {type(model).__name__}; pass the model it was built on")
    exports = [_export_leaf(leaf, base) for leaf in leaves]
    kinds = sorted({(e.peft_type, e.shared) for e in exports})
    if len(kinds) > 1:
        raise ValueError(
            f"save_peft: the parts of this composed adapter need different peft configs ({[k[0] for k in kinds]}: "
            f"{[{name: json.loads(value) for name, value in k[1]} for k in kinds]}); one peft checkpoint has one method and one set of options: save each "
            f"part with save_peft to its own directory"
        )
    layers = [o for e in exports for o in e.layers]
    counts = collections.Counter(o.target.module for o in layers)
    twice = sorted(m for m, n in counts.items() if n > 1)
    if twice:
        raise ValueError(
            f"save_peft: several parts adapt the same layers {twice[:5]}; a peft checkpoint has one adapter per "
            f"layer: save the parts separately, or export the merged model with lora_func.merge"
        )
    peft_type, shared = kinds[0][0], {k: json.loads(v) for k, v in kinds[0][1]}
    config = _peft_config(peft_type, shared, layers, model, task_type)
    tensors = {
        f"{PREFIX}{o.target.module}.{suffix}": tensor.detach().to("cpu").contiguous()
        for o in layers
        for suffix, tensor in o.tensors.items()
    }
    directory = Path(directory)
    # The real directory (a symlink to a checkpoint directory is kept, its target replaced).
    target = Path(os.path.realpath(directory))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(
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
