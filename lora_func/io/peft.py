"""HF peft's checkpoint format, both directions: ``adapter_config.json`` + ``adapter_model.safetensors``.

Adapters trained with peft load onto the untouched base model (:func:`load_peft`), and
lora_func adapters are written in peft's format (:func:`save_peft`) for peft and the tools
that read it (vLLM, TGI, LoRAX). This is the only module that knows peft's key names; each
row below is one entry of :data:`FORMATS` (:class:`PeftFormat`), the one place that says how
a variant is stored, written and read, and :func:`peft_problems` says whether an adapter fits:

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
import functools
import json
import math
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

from lora_func._kernels import lora_scale
from lora_func.adapter import Adapter, AdapterLayer, AdapterLike, AdapterNode, Composed, compose, leaves, walk
from lora_func.checks import check_model, check_path
from lora_func._model import adapter_layer, base_params, layer_info, variant_init, weight_fingerprint
from lora_func.io._files import replace_directory, safetensors_write
from lora_func.spec import AdapterSpec
from lora_func.quantized import kind_of_tensor
from lora_func.targeting import Target, canonical_weight, find_targets, tensor_names
from lora_func.variants import LayerInfo, get_variant

__all__ = ["load_peft", "peft_problems", "save_peft"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."

# LoRA inits that leave the base untouched: the checkpoint is a plain LoRA on the original base.
PLAIN_LORA_INITS = (True, False, "gaussian", "orthogonal")
# LoraConfig fields lora_func has no equivalent for: any truthy value is refused.
UNSUPPORTED_LORA_FIELDS = (
    "lora_bias", "layer_replication", "target_parameters", "alora_invocation_tokens", "use_qalora", "use_bdlora",
    "arrow_config", "monteclora_config", "kasa_config", "velora_config", "trainable_token_indices", "modules_to_save",
    "megatron_config",
)
# The eva options peft keeps in eva_config.
EVA_FIELDS = ("rho", "tau", "whiten", "adjust_scaling_factors")


# ============================================================ the format: one entry per variant


@dataclass(frozen=True)
class _Method:
    """What a peft method (one ``peft_type``) writes alike for every lora_func variant stored as it.

    Attributes:
      fixed: config fields with one value for every checkpoint of the method.
      rank_of: ``(lora_func tensor name, axis)`` that holds a layer's rank, written as ``r``
        (and ``rank_pattern``) and checked against the config on load; ``None``: no rank.
      rank_pattern: whether the method has per-layer ranks (peft's HRA has one rank).
      alpha: whether the method has ``lora_alpha`` / ``alpha_pattern``.
      feedforward_modules: whether the config lists the feed-forward layers (IA3).
      refused: config fields that change the math in ways lora_func does not have: a
        checkpoint with any of them set (truthy) is refused on load.
    """

    fixed: Mapping[str, Any]
    refused: tuple[str, ...] = ("modules_to_save",)
    rank_of: tuple[str, int] | None = None
    rank_pattern: bool = False
    alpha: bool = False
    feedforward_modules: bool = False


METHODS: dict[str, _Method] = {
    "LORA": _Method({"bias": "none"}, UNSUPPORTED_LORA_FIELDS, rank_of=("lora_A", 0), rank_pattern=True, alpha=True),
    "IA3": _Method({"init_ia3_weights": True}, feedforward_modules=True),
    "HRA": _Method({"bias": "none", "apply_GS": False}, ("modules_to_save", "apply_GS"), rank_of=("hra_u", -1)),
    "DELORA": _Method({"bias": "none", "lambda_pattern": {}, "module_dropout": 0.0}, rank_of=("delora_A", 0), rank_pattern=True),
}


@dataclass(frozen=True)
class _Out:
    """One layer as peft stores it; ``tensors()`` (peft suffix -> tensor in peft's shape) is
    computed only when the checkpoint is written (PiSSA's conversion runs an SVD)."""

    target: Target
    tensors: Callable[[], dict[str, Tensor]]
    r: int | None = None
    alpha: float | None = None
    feedforward: bool = False


@dataclass(frozen=True)
class PeftFormat:
    """How one lora_func variant is stored in peft's format: one entry of :data:`FORMATS`.

    Attributes:
      peft_type: the peft method (a key of :data:`METHODS`).
      keys: lora_func tensor name -> the peft key suffix it is stored under
        (``base_model.model.<module>.<suffix>``).
      shapes: ``(r, d_in, d_out) -> {tensor name: shape}``, lora_func's shapes, checked on load.
      config: the spec's options -> the config fields they set (the same for every layer).
      reads: ``(config, module) -> spec options`` when the checkpoint's layer ``module`` is this
        variant, else ``None`` (peft's ``init_lora_weights`` / ``use_dora`` pick among the LORA
        variants, ``feedforward_modules`` between ia3 and ia3_ff).
      buffers: the keys that are buffers, not trainable.
      old_keys: peft suffixes that older peft versions wrote -> tensor name (read only).
      matrix: tensor name -> ``(axis, what peft stores)``: a vector that peft stores as a
        one-row or one-column matrix, with a size-1 ``axis`` (IA3's ``(d_out, 1)`` / ``(1, d_in)``).
      feedforward: the layers are listed in the method's ``feedforward_modules``.
      conv1d: peft accepts the method on GPT-2 ``Conv1D``.
      export: ``(adapter, layer, base) -> _Out`` where the variant is stored converted (PiSSA);
        ``None``: its tensors as they are.
      load_buffers: ``(module, target, info, spec) -> buffers`` that the checkpoint does not
        hold, recomputed from the base on load (PiSSA's residual); ``None``: the checkpoint's.
    """

    peft_type: str
    keys: Mapping[str, str]
    shapes: Callable[[int, int, int], dict[str, tuple[int, ...]]]
    config: Callable[[Mapping[str, Any]], dict[str, Any]]
    reads: Callable[[Mapping[str, Any], str], dict[str, Any] | None]
    buffers: frozenset[str] = frozenset()
    old_keys: Mapping[str, str] = field(default_factory=dict)
    matrix: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    feedforward: bool = False
    conv1d: bool = True
    export: Callable[[Adapter, AdapterLayer, Mapping[str, Tensor] | None], _Out] | None = None
    load_buffers: Callable[[nn.Module, Target, LayerInfo, AdapterSpec], dict[str, Tensor]] | None = None

    def out(self, adapter: Adapter, layer: AdapterLayer, base: Mapping[str, Tensor] | None) -> _Out:
        """``layer`` of ``adapter`` as peft stores it."""
        if self.export is not None:
            return self.export(adapter, layer, base)
        params, buffers = adapter.layer_tensors(layer)
        found = params | buffers
        method = METHODS[self.peft_type]

        def tensors() -> dict[str, Tensor]:
            out = {}
            for name, suffix in self.keys.items():
                tensor = found[name]
                out[suffix] = tensor.unsqueeze(self.matrix[name][0]) if name in self.matrix else tensor
            return out

        return _Out(
            layer.target,
            tensors,
            r=layer.info.r if method.rank_of is not None else None,
            alpha=layer.info.alpha if method.alpha else None,
            feedforward=self.feedforward,
        )


def _lora_shapes(r: int, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
    return {"lora_A": (r, d_in), "lora_B": (d_out, r)}


def _lora_config(options: Mapping[str, Any], *, use_dora: bool = False, init: str | bool = True) -> dict[str, Any]:
    return {
        "lora_dropout": float(options.get("dropout", 0.0)),
        "use_rslora": bool(options.get("use_rslora", False)),
        "use_dora": use_dora,
        "init_lora_weights": init,
        "eva_config": {k: options[k] for k in EVA_FIELDS} if init == "eva" else None,
    }


def _lora_reads(config: Mapping[str, Any], *, use_dora: bool, inits: Sequence[Any]) -> dict[str, Any] | None:
    """The options shared by the LORA variants, when the config's ``use_dora`` and
    ``init_lora_weights`` are this variant's."""
    if bool(config.get("use_dora", False)) != use_dora or config.get("init_lora_weights", True) not in inits:
        return None
    # dropout is peft's lora_dropout: it acts in training steps only.
    return {"use_rslora": bool(config.get("use_rslora", False)), "dropout": float(config.get("lora_dropout") or 0.0)}


def _plain_lora_reads(config: Mapping[str, Any], module: str) -> dict[str, Any] | None:
    options = _lora_reads(config, use_dora=False, inits=PLAIN_LORA_INITS)
    return None if options is None else options | {"init": "gaussian" if config.get("init_lora_weights") == "gaussian" else "kaiming"}


def _eva_reads(config: Mapping[str, Any], module: str) -> dict[str, Any] | None:
    options = _lora_reads(config, use_dora=False, inits=("eva",))
    eva = config.get("eva_config") or {}
    return None if options is None else options | {k: eva[k] for k in EVA_FIELDS if k in eva}


def _pissa_reads(config: Mapping[str, Any], module: str) -> dict[str, Any] | None:
    """An unconverted peft PiSSA checkpoint (``init_lora_weights="pissa"``): a lora_func pissa
    adapter whose residual is recomputed from the base (the full SVD, as peft does on load)."""
    options = _lora_reads(config, use_dora=False, inits=("pissa",))
    return None if options is None else options | {"niter": 0}


def _is_feedforward(feedforward_modules: str | Sequence[str] | None, module: str) -> bool:
    """peft's ``IA3Model._check_target_module_feedforward`` (note: ``endswith`` without a dot)."""
    if not feedforward_modules:
        return False
    if isinstance(feedforward_modules, str):
        return re.fullmatch(feedforward_modules, module) is not None
    return any(module.endswith(t) for t in feedforward_modules)


def _pissa_residual(module: nn.Module, target: Target, info: LayerInfo, spec: AdapterSpec) -> dict[str, Tensor]:
    """peft recomputes PiSSA's residual from the base when it loads an unconverted PiSSA
    checkpoint (full SVD, deterministic); lora_func's pissa init runs the same operations."""
    _, buffers, _ = variant_init(get_variant("pissa"), spec, module, target, info, generator=torch.Generator().manual_seed(0))
    return buffers


def _pissa_as_lora(adapter: Adapter, layer: AdapterLayer, base: Mapping[str, Tensor] | None) -> _Out:
    """PiSSA as a plain LoRA of rank 2r on the untouched base (peft's conversion):
    ``A' = [A; A0] (2r, d_in)``, ``B' = [B, −B0] (d_out, 2r)``, same scale."""
    t = layer.target
    if base is None:
        raise ValueError(  # error: save-peft-pissa-needs-model
            f"save_peft of a pissa adapter needs model=<the base model>: peft's format stores PiSSA as a LoRA "
            f"relative to the untouched base, and its initial factors are recovered from W − W_res ({t.module})"
        )
    weight = base[t.weight_key]
    if weight_fingerprint(weight) != layer.base_fingerprint:
        raise ValueError(  # error: save-peft-pissa-other-base
            f"save_peft: the pissa adapter on {t.module} was derived from other base weights than this model's "
            f"(fingerprint {layer.base_fingerprint}, model {weight_fingerprint(weight)}); pass the model it was built on"
        )
    params, buffers = adapter.layer_tensors(layer)
    r, s = layer.info.r, lora_scale(layer.info)

    def tensors() -> dict[str, Tensor]:
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
        return {"lora_A.weight": lora_a, "lora_B.weight": lora_b}

    rslora = dict(layer.info.options).get("use_rslora", False)
    # peft's conversion: rank 2r, alpha 2·alpha (alpha·√2 with rsLoRA), so the scale is unchanged.
    alpha = layer.info.alpha * (math.sqrt(2) if rslora else 2)
    return _Out(t, tensors, r=2 * r, alpha=alpha)


_LORA_KEYS = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight"}

# Every lora_func variant that peft can hold; a variant missing here (antipasto) has no peft
# equivalent. The LORA entries are tried in this order when reading (their `reads` exclude
# one another), and a checkpoint with layers of several variants (IA3 with
# feedforward_modules) loads as their composition in this order.
FORMATS: dict[str, PeftFormat] = {
    "lora": PeftFormat("LORA", _LORA_KEYS, _lora_shapes, _lora_config, _plain_lora_reads),
    "dora": PeftFormat(
        "LORA",
        _LORA_KEYS | {"lora_magnitude_vector": "lora_magnitude_vector"},
        lambda r, d_in, d_out: _lora_shapes(r, d_in, d_out) | {"lora_magnitude_vector": (d_out,)},
        functools.partial(_lora_config, use_dora=True),
        lambda config, module: _lora_reads(config, use_dora=True, inits=PLAIN_LORA_INITS),
        old_keys={"lora_magnitude_vector.weight": "lora_magnitude_vector"},
    ),
    "pissa": PeftFormat(
        "LORA",
        _LORA_KEYS,
        _lora_shapes,
        _lora_config,
        _pissa_reads,
        export=_pissa_as_lora,
        load_buffers=_pissa_residual,
    ),
    "eva": PeftFormat("LORA", _LORA_KEYS, _lora_shapes, functools.partial(_lora_config, init="eva"), _eva_reads),
    "ia3": PeftFormat(
        "IA3",
        {"ia3_l": "ia3_l"},
        lambda r, d_in, d_out: {"ia3_l": (d_out,)},
        lambda options: {},
        lambda config, module: None if _is_feedforward(config.get("feedforward_modules"), module) else {},
        matrix={"ia3_l": (1, "a non-feed-forward IA3 layer has (d_out, 1)")},
    ),
    "ia3_ff": PeftFormat(
        "IA3",
        {"ia3_l": "ia3_l"},
        lambda r, d_in, d_out: {"ia3_l": (d_in,)},
        lambda options: {},
        lambda config, module: {} if _is_feedforward(config.get("feedforward_modules"), module) else None,
        matrix={"ia3_l": (0, "a feed-forward IA3 layer has (1, d_in)")},
        feedforward=True,
    ),
    "hra": PeftFormat(
        "HRA",
        {"hra_u": "hra_u"},
        lambda r, d_in, d_out: {"hra_u": (d_in, r)},
        lambda options: {"init_weights": options["init"] == "paired"},
        lambda config, module: {"init": "paired" if config.get("init_weights", True) else "random"},
        conv1d=False,
    ),
    "delora": PeftFormat(
        "DELORA",
        {name: name for name in ("delora_A", "delora_B", "delora_lambda", "delora_w_norm")},
        lambda r, d_in, d_out: {"delora_A": (r, d_in), "delora_B": (d_out, r), "delora_lambda": (1,), "delora_w_norm": (d_in,)},
        lambda options: {"delora_lambda": float(options["lambda0"])},
        lambda config, module: {"lambda0": float(config.get("delora_lambda", 15.0))},
        buffers=frozenset({"delora_w_norm"}),
        conv1d=False,
    ),
}


def _suffixes(peft_type: str) -> dict[str, str]:
    """peft key suffix -> lora_func tensor name, for every variant stored as ``peft_type``."""
    return {
        suffix: name
        for fmt in FORMATS.values()
        if fmt.peft_type == peft_type
        for suffix, name in [*((s, n) for n, s in fmt.keys.items()), *fmt.old_keys.items()]
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
    names = {name for name, _ in model.named_modules()}
    missing = sorted(set(modules) - names)
    if missing:
        raise ValueError(  # error: peft-missing-modules
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
        raise ValueError(  # error: peft-tied-module
            f"{directory} adapts {tied}, whose weight is tied to another name (e.g. GPT-2's lm_head and the token "
            f"embedding): peft adapts only that module's output, lora_func adapts the shared tensor under every name "
            f"(tied='both'), which also changes the embedding; merge the adapter in peft (merge_and_unload) instead"
        )
    try:
        targets = find_targets(model, spec)
    except ValueError as err:
        raise ValueError(f"load_peft({directory}): {err}") from None  # error: peft-layer-refused
    variant, fmt = get_variant(variant_name), FORMATS[variant_name]
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    out_layers = []
    wrong = []
    for target in targets:
        layer = layers[target.module]
        rank = spec.r if layer.r is None else layer.r
        layer_alpha = spec.alpha if layer.alpha is None else float(layer.alpha)
        expected = fmt.shapes(rank, target.d_in, target.d_out)
        got = {k: tuple(v.shape) for k, v in (layer.params | layer.buffers).items() if k in expected}
        if got != expected:
            wrong.append(f"{target.module}: checkpoint has {got}, the model needs {expected}")
            continue
        module = modules[target.module]
        weight = module.weight
        info = layer_info(spec, target, r=rank, alpha=layer_alpha)
        layer_buffers = dict(layer.buffers) if fmt.load_buffers is None else fmt.load_buffers(module, target, info, spec)
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
    bad = sorted(name for name in METHODS[config["peft_type"]].refused if config.get(name))
    bad += ["bias"] if config.get("bias", "none") != "none" else []
    if bad:
        raise ValueError(  # error: peft-unsupported-features
            f"{directory} uses {config.get('peft_type')} features lora_func does not support: {bad}; retrain without "
            f"them, or merge the adapter in peft (merge_and_unload) and use the merged model"
        )


def _check_complete(directory: Path, module: str, found: Mapping[str, Tensor], needed: Iterable[str]) -> None:
    if sorted(found) != sorted(needed):
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
    for name, fmt in FORMATS.items():
        if fmt.peft_type == peft_type and (options := fmt.reads(config, module)) is not None:
            return name, options
    # Only LORA checkpoints can be refused here: every other method has an entry for any config.
    init, use_dora = config.get("init_lora_weights", True), bool(config.get("use_dora", False))
    raise ValueError(  # error: peft-converted-init
        f"{directory} was initialised with init_lora_weights={init!r}{' and use_dora' if use_dora else ''}: peft changed "
        f"its base weights for it, so the checkpoint is relative to a base lora_func does not have; save it in peft with "
        f"save_pretrained(..., path_initial_model_for_weight_conversion=<dir of the initial adapter>) to get a "
        f"plain LoRA on the original base"
    )


def _layer_from_peft(directory: Path, config: Mapping[str, Any], module: str, fmt: PeftFormat, found: Mapping[str, Tensor]) -> _Layer:
    """One layer's peft tensors in lora_func shapes, with its rank and alpha checked against the config."""
    _check_complete(directory, module, found, fmt.keys)
    tensors = dict(found)
    for name, (axis, stored_as) in fmt.matrix.items():
        t = tensors[name]
        if t.dim() != 2 or t.shape[axis] != 1:
            raise ValueError(f"{directory} is inconsistent at {module}: {name} has shape {tuple(t.shape)}, but {stored_as}")  # error: peft-ia3-shape
        tensors[name] = t.reshape(-1)
    method = METHODS[fmt.peft_type]
    r = alpha = None
    if method.rank_of is not None:
        # peft computes the scale from the config's r / rank_pattern, not from the tensors.
        name, axis = method.rank_of
        r = _checked_rank(directory, config, module, int(tensors[name].shape[axis]))
    if method.alpha:
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
    params = {k: v for k, v in tensors.items() if k not in fmt.buffers}
    return _Layer(params=params, buffers={k: v for k, v in tensors.items() if k in fmt.buffers}, r=r, alpha=alpha)


def _read(directory: Path, config: Mapping[str, Any], peft_type: str, tensors: Mapping[str, dict[str, Tensor]], model: nn.Module) -> AdapterLike:
    """The adapter of a ``peft_type`` checkpoint: each layer read as the variant whose entry
    reads it; layers of several variants (IA3 with ``feedforward_modules``) compose."""
    groups: dict[str, tuple[dict[str, Any], dict[str, _Layer]]] = {}
    for module, found in tensors.items():
        name, options = _format_for(directory, config, peft_type, module)
        groups.setdefault(name, (options, {}))[1][module] = _layer_from_peft(directory, config, module, FORMATS[name], found)
    method = METHODS[peft_type]
    r = int(config.get("r", 8)) if method.rank_of is not None else 8
    alpha = float(config.get("lora_alpha", 8)) if method.alpha else None
    parts = [
        _assemble(directory, model, name, groups[name][1], r=r, alpha=alpha, options=groups[name][0]) for name in FORMATS if name in groups
    ]
    return parts[0] if len(parts) == 1 else compose(*parts)


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
    if not isinstance(peft_type, str) or peft_type not in METHODS:
        raise ValueError(  # error: peft-unknown-type
            f"{directory} is a peft {peft_type!r} checkpoint; lora_func reads peft_type {sorted(METHODS)} "
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
    fmt = FORMATS.get(name)
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
        layers.append(fmt.out(adapter, layer, base))
    fmt = FORMATS[name]  # found: an adapter has layers
    shared = fmt.config(dict(adapter.spec.options))
    return _Export(fmt.peft_type, tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in shared.items())), tuple(layers))


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
    method = METHODS[peft_type]
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
            raise ValueError(  # error: save-peft-hra-ranks
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

    What peft cannot hold: antipasto (peft has no such method), a ``Combined`` adapter, a
    stacked adapter, hra/delora on GPT-2 ``Conv1D`` (peft refuses them), a weight adapted under
    its tied names (``tied="both"``), parts that need different peft configs or adapt the same
    layer, hra layers of different ranks. A pissa adapter needs ``model=`` (its conversion
    reads the base weights), which must be the model it was built on. Cheap: nothing is
    computed beyond the base weights' fingerprints for pissa, and nothing is written.
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
    adapter, a stacked adapter, hra/delora on GPT-2 ``Conv1D`` (peft refuses them);
    :func:`peft_problems` says so without trying.

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
    tensors = {
        f"{PREFIX}{o.target.module}.{suffix}": tensor.detach().to("cpu").contiguous()
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
