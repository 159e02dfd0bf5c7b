"""The training checkpoint format: :func:`save_checkpoint` / :func:`load_checkpoint`.

A checkpoint is a directory: the adapter (``lora_func.save``, bit-exact), the optimiser's
tensors keyed by adapter tensor name (safetensors, with checksums) and its hyperparameters, the
scaler and the step (``trainer_state.json``), written atomically and checked on load, so that
training continues bit-identically.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

import lora_func as lf
from lora_func.checks import check_model, check_path, non_finite_keys
from lora_func.io._files import read_safetensors, replace_directory, safetensors_write
from lora_func.io.native import tensors_digest
from lora_func.privacy.step import DPSGD
from lora_func.train.state import TrainState, check_state

__all__ = ["load_checkpoint", "save_checkpoint"]


_ADAPTER_FILE = "adapter.safetensors"
_OPTIMIZER_FILE = "optimizer.safetensors"
_STATE_FILE = "trainer_state.json"
_DIGESTS = "lora_func_checksums"  # metadata of optimizer.safetensors


def save_checkpoint(directory: str | os.PathLike, state: TrainState, *, privacy: DPSGD | None = None) -> Path:
    """Write ``state`` to ``directory``: the adapter (:func:`lora_func.save`), the optimiser's
    tensors keyed by adapter tensor name (safetensors) and its hyperparameters, the scaler and
    the step (JSON). Returns the directory.

    ``privacy``: the run's :class:`lora_func.privacy.DPSGD`; its mechanism and its noise
    generator's state are saved too, so that :func:`load_checkpoint` with ``privacy=`` continues
    the noise draws where they were (a resumed run draws what an uninterrupted one would). The
    accountant's step count is ``state.step``.

    The three files are written into a new directory next to ``directory`` that then takes
    its place in one step (as :func:`lora_func.save_peft` does; other entries of an existing
    ``directory`` are kept), so a crash or a kill during the save leaves the previous
    checkpoint or the new one, never one step's adapter with another step's optimiser."""
    check_path(directory, "save_checkpoint", "directory")
    check_state(state, "save_checkpoint")
    private = None if privacy is None else _privacy_meta(privacy)
    directory = Path(directory)
    target = Path(os.path.realpath(directory))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(  # error: train-checkpoint-not-a-directory
            f"save_checkpoint: {directory} exists and is not a directory; pass a directory path (a training "
            f"checkpoint is a directory holding {_ADAPTER_FILE}, {_OPTIMIZER_FILE} and {_STATE_FILE})"
        )
    names = _param_names(state)
    saved = state.optimizer.state_dict()
    tensors = {
        f"{names[index]}/{field}": value.detach().to("cpu").contiguous()
        for index, fields in saved["state"].items()
        for field, value in fields.items()
    }
    groups = [{k: v for k, v in group.items() if k != "params"} | {"params": [names[i] for i in group["params"]]} for group in saved["param_groups"]]
    meta = {
        "step": state.step,
        "optimizer": type(state.optimizer).__name__,
        "param_groups": groups,
        "scaler": None if state.scaler is None else state.scaler.state_dict(),
        "device_type": next(iter(state.adapter.params.values())).device.type,
    }
    if private is not None:
        meta["privacy"] = private
    text = json.dumps(meta, indent=1)
    # Checked on load: safetensors has no checksum, and a flipped bit in a moment (or in the
    # learning rate in trainer_state.json) would otherwise train on silently.
    # One metadata entry: safetensors writes several in a random order (different bytes per save).
    checksums = {"tensors_sha256": tensors_digest(tensors), "trainer_state_sha256": hashlib.sha256(text.encode()).hexdigest()}

    def write_optimizer(path: Path) -> None:
        # The adapter file is written first (same directory): binding its digest here makes
        # one step's adapter next to another step's moments (a hand-copied file) detectable.
        digest = {_DIGESTS: json.dumps(checksums | {"adapter_digest": _adapter_digest(path.parent / _ADAPTER_FILE)}, sort_keys=True)}
        safetensors_write(path, lambda: save_file(tensors, str(path), metadata=digest))

    replace_directory(
        target,
        {
            _ADAPTER_FILE: lambda path: lf.save(state.adapter, path),
            _OPTIMIZER_FILE: write_optimizer,
            _STATE_FILE: lambda path: path.write_text(text),
        },
    )
    return directory


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, *, privacy: DPSGD | None = None) -> TrainState:
    """Rebuild the :class:`TrainState` saved by :func:`save_checkpoint` for ``model``: same
    adapter bits, optimiser class, hyperparameters and moments, scaler and step.

    A checkpoint of a private run needs ``privacy``: a :class:`lora_func.privacy.DPSGD` with
    the saved mechanism (``max_grad_norm``, ``noise_multiplier``, ``expected_batch_size``) and a
    generator on the saved device, whose state is then set to the saved one (the only change
    made to it, after every check passed). A checkpoint of a non-private run refuses
    ``privacy`` (its noise state is unknown).

    Everything is checked before anything is built: the files' checksums (a flipped bit in
    the moments or the state raises), the structure of ``trainer_state.json``, and every
    optimiser moment against its adapter tensor (name, shape, dtype, finite values), so a
    damaged checkpoint raises here, naming the file, instead of in a later half-applied step.
    """
    check_path(directory, "load_checkpoint", "directory")
    directory = Path(directory)
    check_model(model, "load_checkpoint")
    missing = [name for name in (_ADAPTER_FILE, _OPTIMIZER_FILE, _STATE_FILE) if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} is not a lora_func training checkpoint: {missing} missing; write one with save_checkpoint")  # error: train-not-a-checkpoint
    text, meta = _read_state(directory / _STATE_FILE)
    tensors, file_meta = _read_optimizer_file(directory / _OPTIMIZER_FILE)
    _check_digests(directory, text, tensors, file_meta)
    noise_state = _check_privacy(directory, meta.get("privacy"), privacy)
    adapter: Any = lf.load(directory / _ADAPTER_FILE, model=model)
    optimizer_class: Any = getattr(torch.optim, meta["optimizer"], None)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)) or optimizer_class is torch.optim.Optimizer:
        raise ValueError(f"checkpoint optimizer {meta['optimizer']!r} is not in torch.optim; rebuild it yourself from {directory}")  # error: train-unknown-optimizer
    order = [name for group in meta["param_groups"] for name in group["params"]]
    unknown = sorted(set(order) - set(adapter.params))
    if unknown:
        raise ValueError(f"{directory}: optimizer state names {unknown} that the adapter does not have")  # error: train-optimizer-names
    index = {name: i for i, name in enumerate(order)}
    per_param = _checked_moments(directory, tensors, adapter.params, index)
    groups = [{**group, "params": [adapter.params[n] for n in group["params"]]} for group in meta["param_groups"]]
    optimizer = cast(Any, optimizer_class)(groups)  # a torch.optim class that takes (params, **defaults)
    state_dict = {"state": per_param, "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]}
    optimizer.load_state_dict(state_dict)
    scaler = None
    if meta["scaler"] is not None:
        scaler = torch.amp.GradScaler(meta["device_type"])
        scaler.load_state_dict(meta["scaler"])
    if privacy is not None and privacy.generator is not None and noise_state is not None:
        privacy.generator.set_state(noise_state)
    return TrainState(adapter, optimizer, scaler, meta["step"])


def _privacy_meta(privacy: DPSGD) -> dict[str, Any]:
    if not isinstance(privacy, DPSGD) or privacy.generator is None:
        raise ValueError(  # error: train-checkpoint-privacy-generator
            f"save_checkpoint: privacy must be the run's lora_func.privacy.DPSGD with its own noise generator, got "
            f"{type(privacy).__name__ if not isinstance(privacy, DPSGD) else 'a DPSGD drawing from the global RNG (generator=None)'}; "
            f"a resumable private run needs DPSGD(..., generator=torch.Generator().manual_seed(seed))"
        )
    return {
        "max_grad_norm": privacy.max_grad_norm,
        "noise_multiplier": privacy.noise_multiplier,
        "expected_batch_size": privacy.expected_batch_size,
        "generator_device": privacy.generator.device.type,
        "generator_state": base64.b64encode(privacy.generator.get_state().numpy().tobytes()).decode("ascii"),
    }


def _check_privacy(directory: Path, saved: Any, privacy: DPSGD | None) -> Tensor | None:
    """The saved noise generator state, after checking that ``privacy`` fits the checkpoint."""
    if saved is None and privacy is None:
        return None
    if saved is None or privacy is None:
        raise ValueError(  # error: train-checkpoint-privacy
            f"load_checkpoint: {directory} was saved by a {'private' if saved is not None else 'non-private'} run, and "
            + ("no privacy= was given: pass the run's DPSGD (same max_grad_norm, noise_multiplier, expected_batch_size; a "
               "generator) so that its noise continues where it stopped, and train on with privacy=" if saved is not None else
               "privacy= was given, but the checkpoint holds no noise state to continue; load it without privacy= and start "
               "the private run from it (its accounting starts at step 0)")
        )
    if not isinstance(privacy, DPSGD) or privacy.generator is None:
        raise ValueError(  # error: train-checkpoint-privacy-load-generator
            f"load_checkpoint: privacy must be a lora_func.privacy.DPSGD with a generator (the saved noise state is set "
            f"into it), got {type(privacy).__name__ if not isinstance(privacy, DPSGD) else 'generator=None'}"
        )
    wanted = {key: saved[key] for key in ("max_grad_norm", "noise_multiplier", "expected_batch_size")}
    given = {key: getattr(privacy, key) for key in wanted}
    if wanted != given or privacy.generator.device.type != saved["generator_device"]:
        raise ValueError(  # error: train-checkpoint-privacy-mismatch
            f"load_checkpoint: {directory} was saved with {wanted} and a {saved['generator_device']} generator, but privacy "
            f"has {given} and a {privacy.generator.device.type} generator; resume with the saved mechanism (a different one "
            f"changes the accounting: start a new run for it)"
        )
    return torch.frombuffer(bytearray(base64.b64decode(saved["generator_state"])), dtype=torch.uint8)


def _adapter_digest(path: Path) -> str | None:
    """The checksum that lora_func.save stored in an adapter file (``None`` if unreadable:
    lora_func.load then says why)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("digest")
    except (SafetensorError, OSError, ValueError):
        return None


def _is_device_type(name: str) -> bool:
    try:
        return torch.device(name).index is None
    except (RuntimeError, ValueError):
        return False


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _state_problems(meta: Any) -> list[str]:
    """What is wrong with the structure of a parsed ``trainer_state.json`` (empty when fine)."""
    if not isinstance(meta, dict):
        return [f"a JSON {type(meta).__name__}, not an object"]
    problems = [f"no {key!r}" for key in ("step", "optimizer", "param_groups", "scaler", "device_type") if key not in meta]
    if problems:
        return problems
    if isinstance(meta["step"], bool) or not isinstance(meta["step"], int) or meta["step"] < 0:
        problems.append(f"step={meta['step']!r} is not an integer >= 0")
    if not isinstance(meta["optimizer"], str):
        problems.append(f"optimizer={meta['optimizer']!r} is not a class name")
    if not isinstance(meta["device_type"], str) or not _is_device_type(meta["device_type"]):
        problems.append(f"device_type={meta['device_type']!r} is not a device type")
    groups = meta["param_groups"]
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        problems.append("param_groups is not a non-empty list of objects")
    else:
        names = [n for g in groups for n in (g.get("params") if isinstance(g.get("params"), list) else [None])]
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            problems.append("param_groups[*].params are not distinct tensor names")
        for i, group in enumerate(groups):
            if not _finite_number(group.get("lr")) or group["lr"] < 0:
                problems.append(f"param_groups[{i}].lr={group.get('lr')!r} is not a finite number >= 0")
            # The hyperparameters torch.optim validates only in a constructor, not in load_state_dict.
            betas = group.get("betas", [0.0, 0.0])
            if not (isinstance(betas, list) and len(betas) == 2 and all(_finite_number(b) and 0 <= b < 1 for b in betas)):
                problems.append(f"param_groups[{i}].betas={betas!r} are not two numbers in [0, 1)")
            for key, low in (("eps", 0.0), ("weight_decay", 0.0), ("momentum", 0.0), ("dampening", 0.0)):
                if key in group and not (_finite_number(group[key]) and group[key] >= low and (key != "eps" or group[key] > 0)):
                    problems.append(f"param_groups[{i}].{key}={group[key]!r} is out of range")
            for key, value in group.items():
                numbers = value if isinstance(value, list) and key != "params" else [value]
                if key != "params" and any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
                    problems.append(f"param_groups[{i}].{key}={value!r} is not finite")
    scaler = meta["scaler"]
    if scaler is not None and (not isinstance(scaler, dict) or not all(_finite_number(v) for v in scaler.values())):
        problems.append(f"scaler={scaler!r} is not an object of finite numbers")
    if "privacy" in meta:
        problems += _privacy_problems(meta["privacy"])
    return problems


def _privacy_problems(private: Any) -> list[str]:
    """What is wrong with the ``privacy`` entry of a parsed ``trainer_state.json``."""
    keys = ("max_grad_norm", "noise_multiplier", "expected_batch_size", "generator_device", "generator_state")
    if not isinstance(private, dict) or set(private) != set(keys):
        return [f"privacy is not an object with exactly the fields {list(keys)}"]
    problems = [f"privacy.{key}={private[key]!r} is not a finite number >= 0" for key in ("max_grad_norm", "noise_multiplier")
                if not (_finite_number(private[key]) and private[key] >= 0)]
    if private["expected_batch_size"] is not None and not (_finite_number(private["expected_batch_size"]) and private["expected_batch_size"] > 0):
        problems.append(f"privacy.expected_batch_size={private['expected_batch_size']!r} is not None or a number > 0")
    if not isinstance(private["generator_device"], str) or not _is_device_type(private["generator_device"]):
        problems.append(f"privacy.generator_device={private['generator_device']!r} is not a device type")
    try:
        base64.b64decode(private["generator_state"], validate=True)
    except (TypeError, binascii.Error):
        problems.append("privacy.generator_state is not base64")
    return problems


def _read_state(path: Path) -> tuple[str, dict]:
    """The text of ``trainer_state.json`` and its parsed, structurally checked content."""
    try:
        text = path.read_text()
        meta = json.loads(text)
        problems = _state_problems(meta)
    except (OSError, ValueError, RecursionError) as err:
        text, problems = "", [f"{type(err).__name__}: {err}"]
    if problems:
        raise ValueError(  # error: train-bad-state
            f"{path} is not a valid lora_func trainer state (truncated, damaged or edited): {problems[:5]}; resume "
            f"from another checkpoint, or save one again with save_checkpoint"
        )
    return text, meta


def _read_optimizer_file(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    try:
        return read_safetensors(path)
    except ValueError as err:
        raise ValueError(f"{err}; resume from another checkpoint, or save one again with save_checkpoint") from None  # error: train-unreadable-optimizer


def _check_digests(directory: Path, text: str, tensors: Mapping[str, Tensor], file_meta: Mapping[str, str]) -> None:
    """The checksums save_checkpoint wrote (checkpoints written before them have none)."""
    if _DIGESTS not in file_meta:
        return
    try:
        saved = json.loads(file_meta[_DIGESTS])
        saved = saved if isinstance(saved, dict) else {}
    except (ValueError, RecursionError):
        saved = {}
    bad = [name for name, ok in (
        (_ADAPTER_FILE, "adapter_digest" not in saved or saved["adapter_digest"] == _adapter_digest(directory / _ADAPTER_FILE)),
        (_OPTIMIZER_FILE, saved.get("tensors_sha256") == tensors_digest(tensors)),
        (_STATE_FILE, saved.get("trainer_state_sha256") == hashlib.sha256(text.encode()).hexdigest()),
    ) if not ok]
    if bad:
        raise ValueError(  # error: train-corrupted
            f"{directory} is corrupted: {bad} do not match the checksums saved with the checkpoint (damaged on disk or "
            f"in transfer, edited by hand, or copied in from another checkpoint); resume from another checkpoint"
        )


def _checked_moments(
    directory: Path, tensors: Mapping[str, Tensor], params: Mapping[str, Tensor], index: Mapping[str, int]
) -> dict[int, dict[str, Tensor]]:
    """The optimiser state by parameter index, after checking every moment against its
    adapter tensor: a known name, one set of fields for every tensor, the tensor's shape
    (0-d or one element for ``step``), a float dtype and finite values."""
    per_param: dict[int, dict[str, Tensor]] = {}
    problems = []
    for key, value in sorted(tensors.items()):
        name, _, field_name = key.rpartition("/")
        if name not in index:
            problems.append(f"{key}: no parameter {name!r} in the optimizer's groups")
            continue
        param = params[name]
        scalar = field_name == "step"
        if (scalar and value.numel() != 1) or (not scalar and tuple(value.shape) != tuple(param.shape)):
            problems.append(f"{key}: shape {tuple(value.shape)}, the adapter tensor has {tuple(param.shape)}")
        elif not value.is_floating_point():
            problems.append(f"{key}: dtype {value.dtype}, not floating-point")
        per_param.setdefault(index[name], {})[field_name] = value.to(param.device)
    fields = {tuple(sorted(state)) for state in per_param.values()}
    if len(fields) > 1:
        problems.append(f"the tensors have different sets of moments {sorted(fields)}")
    flat = {f"{name}/{field_name}": value for name, i in index.items() for field_name, value in per_param.get(i, {}).items()}
    problems += [f"{key}: NaN or inf" for key in non_finite_keys(flat)]
    problems += [f"{key}: negative" for key, value in flat.items() if key.endswith("/step") and bool((value < 0).any())]
    if problems:
        raise ValueError(  # error: train-bad-moments
            f"{directory}/{_OPTIMIZER_FILE} holds optimizer moments that do not fit the adapter: {problems[:5]}"
            f"{f' and {len(problems) - 5} more' if len(problems) > 5 else ''}; resume from another checkpoint"
        )
    return per_param


def _param_names(state: TrainState) -> list[str]:
    """Adapter tensor names in the optimiser's parameter order."""
    by_id = {id(p): key for key, p in state.adapter.params.items()}
    names = []
    for group in state.optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError("the optimizer holds a tensor that is not in state.adapter.params; build it with make_optimizer(adapter, ...)")  # error: train-foreign-param
            names.append(by_id[id(p)])
    return names
