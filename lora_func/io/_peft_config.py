"""HF peft's ``adapter_config.json``, both ways: reading and checking a config (the fields
lora_func reads, their types and ranges, what it refuses or does not apply), peft's
``target_modules`` / ``rank_pattern`` / ``alpha_pattern`` matching, and the config written for a
checkpoint (module selectors, ``target_parameters``, ranks and alphas). Generic: it names no
variant.
"""

from __future__ import annotations

import collections
import json
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from lora_func.io._peft_keys import CONFIG_NAME, _formats, _methods, _Out
from lora_func.targeting import (
    EXPERT_LAYOUTS,
)
from lora_func.variants import (
    is_finite_number,
)


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
    # The fields the entries of the checkpoint's method read (a field can mean different things
    # in different methods: init_weights is a bool in HRAConfig, a bool or a name in C3AConfig).
    for fmt in _formats().values():
        if fmt.method.peft_type == config.get("peft_type"):
            checks |= {fmt.method.alpha_key: number, **fmt.method.checks, **fmt.checks}
    problems = [f"{name}={config[name]!r}" for name, ok in checks.items() if name in config and not ok(config[name])]
    for name, ok in (("rank_pattern", rank), ("alpha_pattern", number)):
        patterns = config.get(name)
        if patterns is None or name in checks:  # the method's own check reads it (a pattern of booleans per triplet)
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

def _pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """peft's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default

def _refuse_unsupported(directory: Path, config: Mapping[str, Any]) -> None:
    """Raise for config features that change the math and that lora_func does not have."""
    bad = sorted(name for name in _methods()[config["peft_type"]].refused if config.get(name))
    bad += ["bias"] if config.get("bias", "none") != "none" else []
    if bad:
        raise ValueError(  # error: peft-unsupported-features
            f"{directory} uses {config.get('peft_type')} features lora_func does not support: {bad}; retrain without "
            f"them, or merge the adapter in peft (merge_and_unload) and use the merged model"
        )

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

def _checked_rank(
    directory: Path, config: Mapping[str, Any], module: str, got: int, fields: tuple[str, str | None] = ("r", "rank_pattern")
) -> int:
    """``got`` (the tensors' rank), after checking that peft's config gives the same: peft
    computes the scale from the config's ``r`` / ``rank_pattern`` (the method's ``rank_fields``),
    not from the tensors."""
    field, pattern = fields
    expected = _pattern_value(config.get(pattern) if pattern else None, module, config.get(field, 8))
    if expected != got:
        raise ValueError(  # error: peft-rank-mismatch
            f"{directory} is inconsistent at {module}: its tensors have rank {got}, but the config ({field} / {pattern}) "
            f"says {expected}; re-save the checkpoint"
        )
    return got

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
    if method.rank_of is not None or method.rank_in_config:
        field_name, pattern = method.rank_fields
        config[field_name] = r = _most_common([o.r for o in layers])
        rank_pattern = {o.target.module: o.r for o in layers if o.r != r}
        if method.rank_pattern and pattern:
            config[pattern] = rank_pattern
        elif rank_pattern:
            raise ValueError(  # error: save-peft-one-rank
                f"save_peft: peft's {peft_type} has one rank for all layers, but these layers differ from r={r}: "
                f"{sorted(rank_pattern)[:5]}; save the parts of different ranks separately"
            )
    if method.alpha:
        config[method.alpha_key] = alpha = _most_common([o.alpha for o in layers])
        alpha_pattern = {o.target.module: o.alpha for o in layers if o.alpha != alpha}
        if method.rank_pattern:  # the methods with per-layer ranks have per-layer alphas too
            config["alpha_pattern"] = alpha_pattern
        elif alpha_pattern:
            raise ValueError(  # error: save-peft-one-alpha
                f"save_peft: peft's {peft_type} has one alpha for all layers, but these layers differ from "
                f"{method.alpha_key}={alpha}: {sorted(alpha_pattern)[:5]}; save the parts of different alphas separately"
            )
    return config
