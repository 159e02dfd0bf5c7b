"""Prompts (:mod:`lora_func.prompts`) on disk, both formats: lora_func's own safetensors file and
HF peft's prompt-learning checkpoints (``prompt_embeddings`` and friends, or adaption prompt's
per-module tensors). Generic: each method's peft record (its file's ``PEFT``) says what it stores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from lora_func._tree import AdapterNode
from lora_func.io._files import replace_directory, safetensors_write, write_file
from lora_func.prompts._apply import split_prompt
from lora_func.prompts._contract import Geometry
from lora_func.prompts._methods import BY_PEFT_TYPE, get_method
from lora_func.prompts._node import Prompt
from lora_func.prompts.build import embedding_weight, geometry_of
from lora_func.prompts.spec import PromptSpec

__all__ = ["PROMPT_PEFT_TYPES", "is_prompt_file", "load_prompt_file", "load_prompt_peft", "prompt_peft_problems", "save_prompt_file", "save_prompt_peft"]

PROMPT_PEFT_TYPES = tuple(sorted(BY_PEFT_TYPE))
_PREFIX = "base_model.model."  # peft's key prefix of a module's tensor
_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _alone(adapter: AdapterNode, where: str) -> Prompt:
    prompt, weights = split_prompt(adapter, where)
    if weights is not None or prompt.stack_shape:
        raise ValueError(  # error: prompt-save-composed
            f"{where}: a file holds one unstacked prompt; this adapter is "
            f"{'a prompt composed with weight-level adapters' if weights is not None else f'a stack of prompts {prompt.stack_shape}'}: "
            f"save each part (lora_func.unstack a stack) to its own file, and compose them again after loading"
        )
    return prompt


# ----------------------------------------------------------------------------- peft


def prompt_peft_problems(adapter: AdapterNode) -> list[str]:
    """Why :func:`save_prompt_peft` would refuse ``adapter`` (empty: it would write it)."""
    try:
        _alone(adapter, "save_peft")
    except ValueError as err:
        return [str(err)]
    return []


def save_prompt_peft(adapter: AdapterNode, directory: str | os.PathLike, *, model: nn.Module | None, task_type: str | None) -> Path:
    """A prompt as peft's checkpoint (``PeftModel.from_pretrained`` loads it; peft applies a
    prompt-learning checkpoint only for a causal-LM ``task_type``: ``"CAUSAL_LM"`` by default)."""
    prompt = _alone(adapter, "save_peft")
    method, spec = prompt.method, prompt.spec
    options = dict(spec.options)
    stored = method.peft.to_peft(prompt.params, prompt.buffers, spec.num_virtual_tokens, options, prompt.geometry)
    tensors = {(_PREFIX + key if "." in key else key): t.detach().to("cpu").contiguous() for key, t in stored.items()}
    name = getattr(getattr(model, "config", None), "name_or_path", None) if model is not None else None
    config = {
        "peft_type": method.peft.peft_type,
        "task_type": task_type or "CAUSAL_LM",
        "inference_mode": True,
        "base_model_name_or_path": name or None,
        "revision": None,
        **method.peft.config(spec.num_virtual_tokens, options, prompt.geometry),
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    directory = Path(directory)
    replace_directory(
        Path(os.path.realpath(directory)),
        {
            _WEIGHTS: lambda path: safetensors_write(path, lambda: save_file(tensors, str(path), metadata={"format": "pt"})),
            _CONFIG: lambda path: path.write_text(text),
        },
    )
    return directory


def load_prompt_peft(directory: Path, config: Mapping[str, Any], tensors: Mapping[str, Tensor], model: nn.Module) -> Prompt:
    """The prompt a peft prompt-learning (or adaption prompt) checkpoint holds, on ``model``."""
    method = BY_PEFT_TYPE[config["peft_type"]]
    found = {key.removeprefix(_PREFIX): t for key, t in tensors.items()}
    try:
        n, options = method.peft.read_config(config, geometry_of(model, method, {**method.options, **_options(method, config)}, "load_peft"))
        dtype = next(iter(found.values())).dtype if found else torch.float32
        spec = PromptSpec(method.name, None if method.count is not None else n, dtype=dtype, **options)
        geometry = geometry_of(model, method, dict(spec.options), "load_peft")
        params, buffers = method.peft.from_peft(found, spec.num_virtual_tokens, dict(spec.options), geometry)
        extra = sorted(set(found) - set(_stored_keys(method, spec, geometry)))
        problem = f"unexpected tensors {extra[:5]}" if extra else None
        prompt = Prompt({k: v.detach().clone().requires_grad_(True) for k, v in params.items()}, {k: v.detach().clone() for k, v in buffers.items()}, spec, geometry)
    except (KeyError, ValueError, TypeError) as err:
        prompt, problem = None, f"{type(err).__name__}: {err}"
    if problem is not None or prompt is None:
        raise ValueError(  # error: load-peft-prompt-mismatch
            f"load_peft: the {config.get('peft_type')} checkpoint in {directory} does not fit {type(model).__name__}: {problem}; "
            f"load it onto the model it was trained on"
        )
    device = embedding_weight(model).device
    return Prompt._unchecked({k: v.detach().to(device).requires_grad_(True) for k, v in prompt.params.items()},
                             {k: v.to(device) for k, v in prompt.buffers.items()}, prompt.spec, prompt.geometry,
                             prompt.param_shapes, prompt.buffer_shapes)


def _options(method: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """The options the geometry depends on (adaption prompt's ``adapter_layers``)."""
    return {"adapter_layers": int(config["adapter_layers"])} if "adapter_layers" in method.options and "adapter_layers" in config else {}


def _stored_keys(method: Any, spec: PromptSpec, geometry: Geometry) -> list[str]:
    """The keys ``to_peft`` writes for this spec (shapes only: zero tensors)."""
    params, buffers = (
        {name: torch.zeros(shape, dtype=spec.dtype) for name, shape in shapes} for shapes in method.shapes(spec.num_virtual_tokens, dict(spec.options), geometry)
    )
    return list(method.peft.to_peft(params, buffers, spec.num_virtual_tokens, dict(spec.options), geometry))


# ----------------------------------------------------------------------------- lora_func's own file


def is_prompt_file(metadata: Mapping[str, str]) -> bool:
    return "prompt" in metadata


def _digest(metadata: Mapping[str, str], tensors: Mapping[str, Tensor]) -> str:
    h = hashlib.sha256()
    for key in ("format", "format_version", "prompt"):
        h.update(f"{key}={metadata.get(key)}\n".encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_prompt_file(adapter: AdapterNode, path: Path, metadata: Mapping[str, str]) -> Path:
    """A prompt in lora_func's format: ``params/<key>``, ``buffers/<key>``, metadata ``prompt``
    (its spec and geometry) and a digest over both, checked on load."""
    prompt = _alone(adapter, "save")
    tensors = {f"params/{k}": v.detach().to("cpu").contiguous() for k, v in prompt.params.items()}
    tensors |= {f"buffers/{k}": v.detach().to("cpu").contiguous() for k, v in prompt.buffers.items()}
    meta = {**metadata, "prompt": json.dumps({"spec": json.loads(prompt.spec.to_json()), "geometry": dataclasses.asdict(prompt.geometry)}, sort_keys=True)}
    meta["digest"] = _digest(meta, tensors)
    write_file(path, lambda tmp: safetensors_write(path, lambda: save_file(tensors, str(tmp), metadata=meta)))
    return path


def load_prompt_file(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str], model: nn.Module | None) -> Prompt:
    """The prompt a lora_func prompt file holds (checked: digest, tensors, and with ``model`` its
    geometry); params as leaf tensors requiring grad, on the model's embedding device."""
    problem = None
    prompt = None
    try:
        data = json.loads(metadata["prompt"])
        spec = PromptSpec.from_json(json.dumps(data["spec"]))
        geometry = Geometry(**cast(dict[str, Any], {k: tuple(v) if isinstance(v, list) else v for k, v in data["geometry"].items()}))
        if _digest(metadata, tensors) != metadata.get("digest"):
            problem = "its tensors or metadata do not match the checksum saved with them (damaged, or edited by hand)"
        else:
            params = {k.removeprefix("params/"): v.requires_grad_(True) for k, v in tensors.items() if k.startswith("params/")}
            buffers = {k.removeprefix("buffers/"): v for k, v in tensors.items() if k.startswith("buffers/")}
            prompt = Prompt(params, buffers, spec, geometry)
    except (KeyError, TypeError, ValueError) as err:
        problem = f"{type(err).__name__}: {err}"
    if problem is None and prompt is not None and model is not None:
        method = get_method(prompt.spec.method)
        try:
            expected = geometry_of(model, method, dict(prompt.spec.options), "load")
        except ValueError as err:
            expected, problem = None, str(err)
        if expected is not None and expected != prompt.geometry:
            problem = f"the prompt was built for {prompt.geometry}, the model is {expected}"
    if problem is not None or prompt is None:
        raise ValueError(f"load({path}): not a loadable prompt: {problem}; save the prompt again, and load it onto its model")  # error: load-prompt-file
    if model is None:
        return prompt
    device = embedding_weight(model).device
    return prompt._rebuilt({k: v.detach().to(device).requires_grad_(True) for k, v in prompt.params.items()}, {k: v.to(device) for k, v in prompt.buffers.items()})
