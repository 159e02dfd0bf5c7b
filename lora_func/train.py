"""Training utilities for adapters: a loss, one step, a loop, and an exact resume.

Built on the public API only. The model is never trained: its tensors reach the forward pass
through :func:`lora_func.adapted_call` (detached), so only the adapter's tensors get gradients.

One step (:func:`train_step`) does, in order:

1. forward under ``torch.autocast`` when ``autocast_dtype`` is set (bf16 or fp16 matmuls),
   the loss in fp32;
2. backward, through a ``torch.amp.GradScaler`` when one is given: fp16 activation gradients
   underflow to zero without one (fp16's smallest normal is 6e-5);
3. ``scaler.unscale_`` *before* clipping, so the clip threshold means the true gradient norm;
4. clipping of the global gradient norm;
5. the optimiser step: with a scaler, a step whose gradients are inf/NaN is skipped and the
   scale lowered (that is the scaler's job, not an error); without one, a non-finite loss or
   gradient raises ``FloatingPointError`` naming the step and the tensors.

Adapters stay fp32 on a bf16/fp16 base (``AdapterSpec``'s default): see docs/guide/precision.md.

Exact resume: :func:`fit` takes ``batch_at(step)``, a pure function of the step number, so
the data order does not depend on how many steps ran before; :func:`save_checkpoint` writes
the adapter (``lora_func.save``, bit-exact), the optimiser state and the scaler state;
:func:`load_checkpoint` rebuilds them, and training continues bit-identically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm import tqdm

import lora_func as lf
from lora_func.adapter import leaf_adapters
from lora_func.checks import check_base, check_finite, check_model, check_path, detached_base, non_finite_keys
from lora_func.io._files import read_safetensors, replace_directory, safetensors_write
from lora_func.io.native import tensors_digest

__all__ = [
    "IGNORE_INDEX",
    "StepStats",
    "TrainState",
    "adapter_loss",
    "causal_lm_loss",
    "fit",
    "load_checkpoint",
    "make_optimizer",
    "save_checkpoint",
    "train_step",
]

IGNORE_INDEX = -100  # label of positions that carry no loss (transformers' convention)
Batch = Mapping[str, Tensor]


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy in fp32.

    Args:
      logits: ``(batch, seq, vocab)``, any float dtype (upcast to fp32 here: a bf16/fp16
        log-softmax over the vocabulary loses the small probabilities).
      labels: ``(batch, seq)`` token ids, ``IGNORE_INDEX`` where no loss is wanted; position
        ``t`` of ``logits`` predicts ``labels[:, t + 1]``.
    """
    shifted = logits[:, :-1].float()
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)


def adapter_loss(model: nn.Module, adapter: Any, batch: Batch, *, base: Mapping[str, Tensor] | None = None) -> Tensor:
    """:func:`causal_lm_loss` of ``model`` with ``adapter`` on ``batch`` (``input_ids``,
    optional ``attention_mask``, ``labels``; labels default to ``input_ids``).

    A pure function of the adapter's tensors, so it also works under ``torch.func``::

        grads = torch.func.grad(lambda p: adapter_loss(model, adapter.with_params(p), batch, base=base))(adapter.params)
    """
    kwargs = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
    # A base built from model.named_parameters() holds the model's requires_grad tensors:
    # backward would fill (and train_step's clipping would read) the model's .grad.
    base = None if base is None else detached_base(base)
    logits = lf.adapted_call(model, adapter, batch["input_ids"], base=base, **kwargs).logits
    return causal_lm_loss(logits, batch.get("labels", batch["input_ids"]))


def make_optimizer(adapter: Any, lr: float, *, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW over the adapter's trainable tensors (in ``adapter.params`` order)."""
    leaf_adapters(adapter)
    return torch.optim.AdamW(list(adapter.params.values()), lr=lr, weight_decay=weight_decay)


@dataclasses.dataclass
class TrainState:
    """What training carries from step to step.

    Attributes:
      adapter: its ``params`` are the leaf tensors the optimiser updates in place.
      optimizer: built over ``adapter.params`` (:func:`make_optimizer`).
      scaler: a ``torch.amp.GradScaler`` for fp16, else ``None``.
      step: the number of completed steps (the next step's index).
    """

    adapter: Any
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None = None
    step: int = 0


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One step's outcome: ``loss`` (fp32, before the step), the global gradient norm before
    clipping, and whether a GradScaler skipped the update (inf/NaN gradients)."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool


def train_step(
    model: nn.Module,
    state: TrainState,
    batch: Batch,
    *,
    base: Mapping[str, Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = 1.0,
) -> StepStats:
    """One optimiser step on ``batch``; advances ``state.step``. See the module docstring for
    the order of operations. Raises ``FloatingPointError`` naming the step (and the adapter
    tensors) on a non-finite loss, or on non-finite gradients without a scaler."""
    check_model(model, "train_step")
    _check_state(state, "train_step")
    if base is not None:
        check_base(base, "train_step")
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0
    ):
        # NaN makes clip_grad_norm_ turn every gradient NaN; <= 0 zeroes them: both silently.
        raise ValueError(  # error: train-max-grad-norm
            f"train_step: max_grad_norm={max_grad_norm!r} must be a number > 0 (math.inf measures without clipping) "
            f"or None; 1.0 is the usual choice"
        )
    adapter, optimizer, scaler, step = state.adapter, state.optimizer, state.scaler, state.step
    params = adapter.params
    _check_optimizer_state(optimizer, params)
    device_type = next(iter(params.values())).device.type
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = adapter_loss(model, adapter, batch, base=base)
    if not torch.isfinite(loss):
        # Name the culprit: a non-finite adapter tensor, else the forward pass itself.
        check_finite(params, f"adapter tensors before step {step}")
        check_finite({"loss": loss}, f"loss at step {step} (the adapter tensors are finite)")
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)  # before clipping: the threshold is on the true gradients
    grads = {key: p.grad for key, p in params.items() if p.grad is not None}
    # The norm before clipping; an infinite threshold measures without clipping.
    with_grads = [p for p in params.values() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(with_grads, math.inf if max_grad_norm is None else max_grad_norm)
    if scaler is None and not torch.isfinite(norm):
        check_finite(grads, f"gradients at step {step}")  # raises before the optimiser moves anything
    if scaler is not None:
        scaler.step(optimizer)  # skipped (and the scale lowered) when the gradients hold inf/NaN
        scaler.update()
    else:
        optimizer.step()
    state.step += 1
    norm_value = norm.item()
    return StepStats(step, loss.item(), norm_value, skipped=not math.isfinite(norm_value))


def fit(
    model: nn.Module,
    state: TrainState,
    batch_at: Callable[[int], Batch],
    steps: int,
    *,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = 1.0,
    max_skipped: int = 20,
    progress: bool = True,
    desc: str = "training",
    on_step: Callable[[StepStats], None] | None = None,
) -> list[StepStats]:
    """Train from ``state.step`` up to ``steps`` (total, not additional) and return each step's
    stats.

    ``batch_at(step)`` gives the batch of a step; make it a pure function of ``step`` (e.g. a
    generator seeded with it) and a resumed run sees the same batches. Shows a tqdm progress
    bar unless ``progress=False``; ``on_step`` is called after every step (live plots).
    ``max_skipped`` consecutive scaler-skipped steps raise: the scale has collapsed and the
    gradients are not finite at any scale.
    """
    check_model(model, "fit")
    _check_state(state, "fit")
    if not callable(batch_at):
        raise TypeError(  # error: fit-batch-at
            f"fit: batch_at must be a function batch_at(step) -> batch (a pure function of the step, for an exact "
            f"resume), got {type(batch_at).__name__}; e.g. fit(model, state, lambda step: batches[step % len(batches)], steps)"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"fit: steps={steps!r} must be an integer >= 0 (the total number of steps, not additional ones)")  # error: fit-steps
    base = lf.base_params(model)
    history: list[StepStats] = []
    skipped_in_a_row = 0
    bar = tqdm(total=steps, initial=state.step, desc=desc, unit="step", disable=not progress, leave=False)
    try:
        while state.step < steps:
            stats = train_step(
                model, state, batch_at(state.step), base=base, autocast_dtype=autocast_dtype, max_grad_norm=max_grad_norm
            )
            history.append(stats)
            skipped_in_a_row = skipped_in_a_row + 1 if stats.skipped else 0
            if skipped_in_a_row >= max_skipped:
                grads = {k: p.grad for k, p in state.adapter.params.items() if p.grad is not None}
                scale = state.scaler.get_scale() if state.scaler is not None else float("nan")
                check_finite(grads, f"gradients at step {stats.step}, the {max_skipped}th skipped step in a row (scale {scale:g})")
            bar.update(1)
            bar.set_postfix(loss=f"{stats.loss:.4f}", refresh=False)
            if on_step is not None:
                on_step(stats)
    finally:
        bar.close()
    return history


# --- checkpoints ----------------------------------------------------------------------------

_ADAPTER_FILE = "adapter.safetensors"
_OPTIMIZER_FILE = "optimizer.safetensors"
_STATE_FILE = "trainer_state.json"
_DIGESTS = "lora_func_checksums"  # metadata of optimizer.safetensors


def save_checkpoint(directory: str | os.PathLike, state: TrainState) -> Path:
    """Write ``state`` to ``directory``: the adapter (:func:`lora_func.save`), the optimiser's
    tensors keyed by adapter tensor name (safetensors) and its hyperparameters, the scaler and
    the step (JSON). Returns the directory.

    The three files are written into a new directory next to ``directory`` that then takes
    its place in one step (as :func:`lora_func.save_peft` does; other entries of an existing
    ``directory`` are kept), so a crash or a kill during the save leaves the previous
    checkpoint or the new one, never one step's adapter with another step's optimiser."""
    check_path(directory, "save_checkpoint", "directory")
    _check_state(state, "save_checkpoint")
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


def load_checkpoint(directory: str | os.PathLike, model: nn.Module) -> TrainState:
    """Rebuild the :class:`TrainState` saved by :func:`save_checkpoint` for ``model``: same
    adapter bits, optimiser class, hyperparameters and moments, scaler and step.

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
    adapter = lf.load(directory / _ADAPTER_FILE, model=model)
    optimizer_class = getattr(torch.optim, meta["optimizer"], None)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)) or optimizer_class is torch.optim.Optimizer:
        raise ValueError(f"checkpoint optimizer {meta['optimizer']!r} is not in torch.optim; rebuild it yourself from {directory}")  # error: train-unknown-optimizer
    order = [name for group in meta["param_groups"] for name in group["params"]]
    unknown = sorted(set(order) - set(adapter.params))
    if unknown:
        raise ValueError(f"{directory}: optimizer state names {unknown} that the adapter does not have")  # error: train-optimizer-names
    index = {name: i for i, name in enumerate(order)}
    per_param = _checked_moments(directory, tensors, adapter.params, index)
    groups = [{**group, "params": [adapter.params[n] for n in group["params"]]} for group in meta["param_groups"]]
    optimizer = optimizer_class(groups)
    state_dict = {"state": per_param, "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]}
    optimizer.load_state_dict(state_dict)
    scaler = None
    if meta["scaler"] is not None:
        scaler = torch.amp.GradScaler(meta["device_type"])
        scaler.load_state_dict(meta["scaler"])
    return TrainState(adapter, optimizer, scaler, meta["step"])


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
        if scalar and value.numel() != 1 or not scalar and tuple(value.shape) != tuple(param.shape):
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


def _check_state(state: Any, where: str) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(  # error: train-not-a-state
            f"{where}: state must be a lora_func.train.TrainState, got {type(state).__name__}; build one with "
            f"TrainState(adapter, make_optimizer(adapter, lr)) or load_checkpoint(directory, model)"
        )
    if not isinstance(state.optimizer, torch.optim.Optimizer):
        # Checked here, not at construction: a TrainState may be built first and given its
        # optimiser after (TrainState(adapter, None); state.optimizer = make_optimizer(...)).
        raise TypeError(  # error: train-state-optimizer
            f"{where}: state.optimizer must be a torch.optim.Optimizer over state.adapter.params, got "
            f"{type(state.optimizer).__name__}; build one with make_optimizer(state.adapter, lr) (a learning-rate "
            f"scheduler wraps the optimiser: pass the optimiser, step the scheduler yourself)"
        )


def _check_optimizer_state(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor]) -> None:
    """Raise before the step, when nothing has moved yet, if a moment does not fit its
    tensor: the optimiser would update the tensors one by one and fail part-way (a
    half-applied step). Shapes and devices only: no values are read."""
    names = {id(p): key for key, p in params.items()}
    problems = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for field_name, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, Tensor) or value.dim() == 0 or field_name == "step":
                    continue
                if value.shape != p.shape or value.device != p.device:
                    problems.append(
                        f"{names.get(id(p), '<a tensor not in the adapter>')}/{field_name}: {tuple(value.shape)} on {value.device}, "
                        f"the tensor is {tuple(p.shape)} on {p.device}"
                    )
    if problems:
        raise ValueError(  # error: train-step-optimizer-state
            f"train_step: the optimizer state does not fit the adapter: {problems[:5]}; nothing was updated. Build the "
            f"optimizer with make_optimizer(adapter, ...) or load it with load_checkpoint"
        )


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
