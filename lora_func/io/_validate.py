"""What a file must hold before an adapter is built from it, beyond its format: finite values,
and (peft's format) every layer its config targets.

Both checks read only what the loaders already have (the file's tensors, the config, the model's
module names), and each is one function the loaders call: :func:`refuse_non_finite` for
:func:`lora_func.load` and :func:`lora_func.load_peft`, :func:`refuse_missing_layers` for
:func:`lora_func.load_peft`. peft itself loads both kinds of file: NaN/inf values as they are,
and a checkpoint without some targeted layer's tensors with a warning ("Found missing adapter
keys"), leaving that layer at its initial values (an identity for OFT, BOFT, ...). lora_func
refuses both, naming the keys or layers: the outputs would otherwise be NaN, or silently the
base model's, with no hint where from.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lora_func.checks import MAX_LISTED, non_finite_keys
from lora_func.targeting import layer_kind

__all__ = ["config_targets", "refuse_missing_layers", "refuse_non_finite", "warn_full_rank_merge"]


def refuse_non_finite(tensors: Mapping[str, Tensor], source: object, where: str) -> None:
    """Raise ``ValueError`` naming every key of ``tensors`` (a file's, as read) that holds a NaN
    or ±inf, with its counts. ``source``: the file or directory; ``where``: the call and the
    keyword that opts out (``"load_peft(..., check_finite=False)"``)."""
    bad = non_finite_keys(tensors)
    if not bad:
        return
    counts = []
    for key in bad[:MAX_LISTED]:
        t = tensors[key].detach()
        counts.append(f"{key} ({int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} inf of {t.numel()})")
    more = f" and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
    raise ValueError(  # error: load-non-finite
        f"{source} holds non-finite values in {bad[:MAX_LISTED]}{more}: {'; '.join(counts)}. Every output of the adapter "
        f"would be NaN or inf (a diverged run, or a damaged file); re-save it from a finite adapter, or pass "
        f"{where} to load it as it is"
    )


def _excluded(config: Mapping[str, Any], module: str) -> bool:
    """peft's ``exclude_modules``: a regex matched in full, or names / name suffixes."""
    excluded = config.get("exclude_modules")
    if not excluded:
        return False
    if isinstance(excluded, str):
        return re.fullmatch(excluded, module) is not None
    return any(module == name or module.endswith("." + name) for name in excluded)


def _layer_index(config: Mapping[str, Any], module: str) -> int | None:
    """The decoder-layer index peft reads from ``module``'s name for ``layers_to_transform``."""
    patterns = config.get("layers_pattern")
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
            if match is not None:
                break
    return int(match["idx"]) if match is not None else None


def _targets_module(config: Mapping[str, Any], module: str) -> bool:
    """peft's ``check_target_module_exists`` for a config read from ``adapter_config.json``."""
    if _excluded(config, module):
        return False
    selector = config.get("target_modules")
    if not selector:
        return False
    if isinstance(selector, str):
        return re.fullmatch(selector, module) is not None
    if module in selector:
        return True
    if not any(module.endswith("." + name) for name in selector):
        return False
    indexes = config.get("layers_to_transform")
    if indexes is None or (isinstance(indexes, list) and not indexes):
        return True
    index = _layer_index(config, module)
    if index is None:
        return False
    return index == indexes if isinstance(indexes, int) else index in indexes


def config_targets(config: Mapping[str, Any], model: nn.Module, parameters: Iterable[str] = ()) -> list[str]:
    """The layers of ``model`` a peft config adapts: modules of a kind lora_func adapts
    (:func:`lora_func.targeting.layer_kind`: peft refuses the others when it builds the model)
    that ``target_modules`` selects by peft's rules (``exclude_modules``, ``layers_to_transform``,
    ``layers_pattern``), and ``parameters``, the ``target_parameters`` names it selects, as
    :func:`lora_func.load_peft` keys them (``<module>.<parameter>``). Sorted."""
    modules = [name for name, module in model.named_modules() if name and layer_kind(module) is not None and _targets_module(config, name)]
    return sorted({*modules, *parameters})


def refuse_missing_layers(directory: object, config: Mapping[str, Any], model: nn.Module, found: Sequence[str], parameters: Iterable[str] = ()) -> None:
    """Raise ``ValueError`` when the config targets layers of ``model`` (:func:`config_targets`)
    for which the checkpoint holds no tensor at all (``found``: the layers it holds tensors
    for). A layer with some of its tensors is refused by the reader itself (``peft-incomplete``)."""
    missing = sorted(set(config_targets(config, model, parameters)) - set(found))
    if missing:
        raise ValueError(  # error: peft-layer-missing
            f"{directory} is incomplete: its config targets {missing[:MAX_LISTED]}{' ...' if len(missing) > MAX_LISTED else ''} "
            f"({len(missing)} layer(s)) of {type(model).__name__}, but it holds no tensor for them (deleted keys, or a partial "
            f"copy); peft would load it with a warning and leave those layers at their initial values. Re-save the "
            f"checkpoint, or drop those layers from target_modules in its adapter_config.json"
        )


def warn_full_rank_merge(leaves: Sequence[Any]) -> None:
    """Warn (``UserWarning``) when ``save_peft`` is about to write LoRA layers in the form of
    ``merge_adapters``' exact merge (``rank=None``): rank ``min(d_out, d_in)`` with one factor the
    identity, ``(d_out + d_in)·min(d_out, d_in)`` numbers per layer, more than the dense delta
    and far more than LoRA inputs of small rank. ``leaves``: the adapters (leaf ``Adapter``)
    being saved."""
    full, numbers, dense = [], 0, 0
    for leaf in leaves:
        form = leaf.variant.low_rank  # a plain LoRA's product (its LowRank declaration): what a merge returns
        if form is None or leaf.variant.replaces_weight:
            continue
        for layer in leaf.layers:
            info = layer.info
            if info.r != min(info.d_in, info.d_out):
                continue
            params, _ = leaf.layer_tensors(layer)
            a, b = params.get(form.a), params.get(form.b)
            if a is None or b is None or a.dim() != 2 or b.dim() != 2:
                continue
            identity = (a.shape[0] == a.shape[1] and torch.equal(a.detach(), torch.eye(a.shape[0], dtype=a.dtype, device=a.device))) or (
                b.shape[0] == b.shape[1] and torch.equal(b.detach(), torch.eye(b.shape[0], dtype=b.dtype, device=b.device))
            )
            if identity:
                full.append(layer.target.module)
                numbers += a.numel() + b.numel()
                dense += info.d_in * info.d_out
    if full:
        warnings.warn(
            f"save_peft: {len(full)} layer(s) ({full[:3]}{' ...' if len(full) > 3 else ''}) hold an exact merge as a full-rank "
            f"LoRA (rank min(d_out, d_in), one factor the identity): {numbers:,} numbers, {numbers / dense:.1f}x the dense "
            f"weights they update, and usually far more than the adapters merged. For a small file, merge with "
            f"merge_adapters(..., rank=k) or convert with lora_func.to_lora(adapter, rank=k) (it reports the error per layer)",
            UserWarning,
            stacklevel=3,
        )
