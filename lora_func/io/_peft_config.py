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

from lora_func.io._peft_keys import CONFIG_NAME, Out, formats, methods
from lora_func.targeting import (
    PARAM_LAYOUTS,
)
from lora_func.variants import (
    PeftFormat,
    Variant,
    get_variant,
    is_finite_number,
)

_MISSING = object()


def _field(config: Mapping[str, Any], name: str) -> Any:
    """The config's value of field ``name`` (a dotted name is a field of a nested object), or
    ``_MISSING``; a parent that is not an object reads as missing (the parent's check names it)."""
    value: Any = config
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _set_field(config: dict[str, Any], name: str, value: Any) -> None:
    *parents, last = name.split(".")
    for part in parents:
        if not isinstance(config.get(part), dict):
            config[part] = {}  # a nested object written over the method's fixed null
        config = config[part]
    config[last] = value


def options_from(variant: Variant, config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``variant``'s options as ``config`` holds them (a missing field: the option's default), and
    the fields whose values the options' checks refuse (``["lora_dropout=1.5"]``)."""
    options, problems = {}, []
    for name, option in variant.options.items():
        raw = _MISSING if option.peft is None else _field(config, option.peft)
        if raw is _MISSING:
            options[name] = option.default
            continue
        value = raw if option.codec is None else option.codec.from_peft(raw)
        if option.problem(value) is not None:
            problems.append(f"{option.peft}={raw!r}")
            continue
        options[name] = option.normalised(value)
    # (options valid one by one but not together are refused by the variant's check when the
    # loader builds the spec, with the variant's own message)
    return options, problems


def config_of(variant: Variant, fmt: PeftFormat, options: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields a checkpoint of ``variant`` with ``options`` writes (the same for every
    layer): the method's fixed fields, the format's own, and each option's under its peft name."""
    config: dict[str, Any] = {**fmt.method.fixed, **fmt.writes}
    for name, option in variant.options.items():
        if option.peft is not None:
            value = options[name]
            _set_field(config, option.peft, value if option.codec is None else option.codec.to_peft(value))
    return config


def _accepts(allowed: Any, value: Any) -> bool:
    """Whether a config value is one a :attr:`PeftFormat.reads` entry marks (a value, a tuple
    of values, or a predicate); ``True`` is not ``1``."""
    if callable(allowed):
        return bool(allowed(value))
    choices = allowed if isinstance(allowed, tuple) else (allowed,)
    return any(type(value) is type(c) and value == c for c in choices)


def _marked(fmt: PeftFormat, config: Mapping[str, Any]) -> bool:
    """Whether every field of ``fmt``'s :attr:`PeftFormat.reads` holds a value it marks (a field
    the config lacks: the method's fixed value)."""
    if fmt.reads is None:
        return False
    for name, allowed in fmt.reads.items():
        value = _field(config, name)
        if not _accepts(allowed, fmt.method.fixed.get(name) if value is _MISSING else value):
            return False
    return True


def reads_as(fmt: PeftFormat, config: Mapping[str, Any], module: str) -> bool:
    """Whether ``config``'s layer ``module`` is stored as ``fmt``'s variant: the config holds the
    values its :attr:`PeftFormat.reads` marks, and the layer is in ``feedforward_modules`` exactly
    when the format says so."""
    if not _marked(fmt, config):
        return False
    feedforward = config.get("feedforward_modules")
    return not any(f.feedforward for f in formats(fmt.method.peft_type).values()) or (
        fmt.feedforward == (feedforward is not None and selects(feedforward, module, dotted=False))
    )


def read_config(directory: Path) -> dict[str, Any]:
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

def _training_only_check(whole: bool) -> Callable[[Any], bool]:
    """A training-only field: none, or a number >= 0 (an integer where ``whole``: a seed)."""
    return lambda v: v is None or (is_finite_number(v) and v >= 0 and (isinstance(v, int) or not whole))


def _one_of_types(types: set[type]) -> Callable[[Any], bool]:
    return lambda value: type(value) in types


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
        "lora_alpha": number,
        "target_modules": selector,
        "feedforward_modules": selector,
        "target_parameters": lambda v: v is None or (isinstance(v, list) and all(isinstance(t, str) for t in v)),
    }
    peft_type = config.get("peft_type")
    method = methods().get(peft_type) if isinstance(peft_type, str) else None
    if method is not None and method.alpha is not None:
        checks[method.alpha] = number
    if method is not None and any(o.peft == "lora_alpha" for v in formats(peft_type) for o in get_variant(v).options.values()):
        del checks["lora_alpha"]  # a variant's own option (Super-Tuning's: null is peft's 2·lora_r), checked below as the spec would
    rank_fields = ("r", "rank_pattern") if method is None else method.rank
    if rank_fields is not None:
        checks[rank_fields[0]] = rank
    if method is not None:
        for field in method.training_only:
            # a number >= 0 (an integer where the method's own value is not a float: a seed)
            checks[field] = _training_only_check(not isinstance(method.fixed.get(field), float))
    # A field that marks a variant (use_dora) holds a value of a type some variant reads.
    marks: dict[str, set[type]] = {}
    for fmt in formats(peft_type).values() if method is not None else ():
        for name, allowed in (fmt.reads or {}).items():
            if not callable(allowed):
                marks.setdefault(name, set()).update(type(v) for v in (allowed if isinstance(allowed, tuple) else (allowed,)))
    checks |= {name: _one_of_types(types) for name, types in marks.items()}
    problems = [f"{name}={config[name]!r}" for name, ok in checks.items() if name in config and not ok(config[name])]
    # The options of the method's variants, each read and checked as the spec would: a field that
    # marks a variant (init_lora_weights) only for the variants the config marks.
    for variant_name, fmt in formats(peft_type).items() if method is not None else ():
        marked = _marked(fmt, config)
        for problem in options_from(get_variant(variant_name), config)[1]:
            if problem not in problems and (marked or problem.split("=")[0] not in marks):
                problems.append(problem)
    # Per-layer patterns where the method has them (a method whose rank has no pattern field may
    # hold a rank_pattern of its own kind, booleans per triplet, that lora_func does not read).
    pattern = rank_fields[1] if rank_fields is not None else None
    for pattern_field, ok in ((pattern, rank), ("alpha_pattern" if pattern else None, number)):
        patterns = config.get(pattern_field) if pattern_field else None
        if pattern_field is None or patterns is None:
            continue
        if not isinstance(patterns, dict):
            problems.append(f"{pattern_field}={patterns!r} (not an object)")
            continue
        # peft matches every key as the regex rf"(.*\.)?({key})$".
        bad = [f"{pattern_field}[{key!r}]={value!r}" for key, value in patterns.items() if not (_is_regex(rf"(.*\.)?({key})$") and ok(value))]
        # a method's own pattern pattern_field (n_frequency_pattern) is named whole, as its other pattern_fields
        problems += bad if pattern_field in ("rank_pattern", "alpha_pattern") or not bad else [f"{pattern_field}={patterns!r}"]
    return problems

def check_config(directory: Path, config: Mapping[str, Any]) -> None:
    problems = _config_problems(config)
    if problems:
        raise ValueError(  # error: peft-config-values
            f"{directory / CONFIG_NAME} has invalid values: {problems[:5]} (ranks are integers >= 1, alphas finite "
            f"numbers, patterns valid regular expressions, flags true/false); re-save the checkpoint or fix the config"
        )

def selects(selector: str | Sequence[str], module: str, *, dotted: bool = True) -> bool:
    """peft's ``target_modules`` matching: a regex matched in full, or names / name suffixes
    (``dotted=False``: peft's ``feedforward_modules`` matching, a plain ``endswith``)."""
    if isinstance(selector, str):
        return re.fullmatch(selector, module) is not None
    return any(module == t or module.endswith(("." if dotted else "") + t) for t in selector)

def pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """peft's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default

def refuse_unsupported(directory: Path, config: Mapping[str, Any]) -> None:
    """Raise for config features that change the math and that lora_func does not have."""
    # modules_to_save: trained copies, read beside the method's layers (_peft_read.saved_copies)
    bad = sorted(name for name in methods()[config["peft_type"]].refused if config.get(name) and name != "modules_to_save")
    # bias: "all" / "<method>_only" train biases, read as bias copies (_peft_read.trained_biases)
    bias = config.get("bias", "none")
    bad += ["bias"] if bias != "none" and not (isinstance(bias, str) and (bias == "all" or bias.endswith("_only"))) else []
    if bad:
        raise ValueError(  # error: peft-unsupported-features
            f"{directory} uses {config.get('peft_type')} features lora_func does not support: {bad}; retrain without "
            f"them, or merge the adapter in peft (merge_and_unload) and use the merged model"
        )

def warn_training_only(directory: Path, config: Mapping[str, Any]) -> None:
    """Say so when a field that only acts in training is dropped (the loaded adapter computes
    what peft computes at inference, but training it would differ)."""
    method = methods()[config["peft_type"]]
    dropped = {k: config[k] for k in method.training_only if isinstance(config.get(k), (int, float)) and config[k] > 0}
    if dropped:
        warnings.warn(
            f"{directory / CONFIG_NAME}: {dropped} not applied: {'; '.join(method.training_only[k] for k in dropped)}. The "
            f"loaded adapter gives peft's outputs at inference; further training runs without it",
            UserWarning,
            stacklevel=3,
        )

def config_rank(config: Mapping[str, Any], module: str, fields: tuple[str, str | None]) -> int:
    """Layer ``module``'s rank as peft reads it: the pattern's value for the module, else the
    rank field's (peft computes the scale from these, not from the tensors)."""
    field, pattern = fields
    return int(pattern_value(config.get(pattern) if pattern else None, module, config.get(field, 8)))


def refuse_rank_mismatch(directory: Path, module: str, got: int, expected: int, fields: tuple[str, str | None]) -> None:
    """The tensors of ``module`` have rank ``got`` where the config says ``expected``."""
    field, pattern = fields
    raise ValueError(  # error: peft-rank-mismatch
        f"{directory} is inconsistent at {module}: its tensors have rank {got}, but the config ({field} / {pattern}) "
        f"says {expected}; re-save the checkpoint"
    )

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

def written_config(
    peft_type: str, shared: Mapping[str, Any], layers: Sequence[Out], model: nn.Module | None, task_type: str | None = None
) -> dict[str, Any]:
    # peft adapts an attention's out_proj as part of the attention (target_modules names that)
    modules = [o.target.module for o in layers if o.target.layout not in (*PARAM_LAYOUTS, "mha_out")]
    all_modules = [n for n, _ in model.named_modules() if n] if model is not None else None
    config: dict[str, Any] = {
        "peft_type": peft_type,
        "task_type": task_type,
        "base_model_name_or_path": (getattr(model, "name_or_path", None) or None) if model is not None else None,
        "inference_mode": True,
        "target_modules": _module_selector(modules, all_modules),
    }
    parameters = sorted(o.target.module for o in layers if o.target.layout in PARAM_LAYOUTS)
    if parameters:
        # peft's target_parameters: the full parameter names select exactly these.
        config["target_parameters"] = parameters
    method = methods()[peft_type]
    if method.fan_in_fan_out and any(o.target.layout == "conv1d" for o in layers):
        # GPT-2 Conv1D: peft needs fan_in_fan_out (it would set it itself, with a warning).
        config["fan_in_fan_out"] = True
    config |= dict(method.fixed) | dict(shared)
    if any(fmt.feedforward for fmt in formats(peft_type).values()):
        ff = [o.target.module for o in layers if o.feedforward]
        selector = _module_selector(ff, modules, dotted=False) if ff else []
        # peft requires feedforward_modules ⊆ target_modules, name by name.
        config["feedforward_modules"] = selector if set(selector) <= set(config["target_modules"]) else sorted(ff)
    pattern = method.rank[1] if method.rank is not None else None
    # an attention's out_proj is written with the attention's rank and alpha (peft derives it)
    own = [o for o in layers if o.target.layout != "mha_out"]
    if method.rank is not None:
        config[method.rank[0]] = r = _most_common([o.r for o in own])
        rank_pattern = {o.target.module: o.r for o in own if o.r != r}
        if pattern:
            config[pattern] = rank_pattern
        elif rank_pattern:
            raise ValueError(  # error: save-peft-one-rank
                f"save_peft: peft's {peft_type} has one rank for all layers, but these layers differ from r={r}: "
                f"{sorted(rank_pattern)[:5]}; save the parts of different ranks separately"
            )
    if method.alpha is not None:
        config[method.alpha] = alpha = _most_common([o.alpha for o in own])
        alpha_pattern = {o.target.module: o.alpha for o in own if o.alpha != alpha}
        if pattern:  # the methods with per-layer ranks have per-layer alphas too
            config["alpha_pattern"] = alpha_pattern
        elif alpha_pattern:
            raise ValueError(  # error: save-peft-one-alpha
                f"save_peft: peft's {peft_type} has one alpha for all layers, but these layers differ from "
                f"{method.alpha}={alpha}: {sorted(alpha_pattern)[:5]}; save the parts of different alphas separately"
            )
    return config
