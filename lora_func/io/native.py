"""lora_func's own format: one safetensors file, exact reload.

Tensors are stored as ``params/<key>`` and ``buffers/<key>`` in the adapter dtype;
the metadata holds the spec and each layer's static info as JSON, so a reload needs no
calibration data and no recomputation (PiSSA-style residuals are buffers and come back
bit-exact).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lora_func._types import LayerInfo
from lora_func.adapter import Adapter, AdapterLayer
from lora_func.core import base_params, weight_fingerprint
from lora_func.spec import AdapterSpec
from lora_func.targeting import Target

__all__ = ["load", "save"]

FORMAT = "lora_func"
FORMAT_VERSION = "1"


def _layer_to_json(layer: AdapterLayer) -> dict:
    return {
        "target": layer.target.to_dict(),
        "info": {
            "d_in": layer.info.d_in,
            "d_out": layer.info.d_out,
            "r": layer.info.r,
            "alpha": layer.info.alpha,
            "has_bias": layer.info.has_bias,
            "options": [list(kv) for kv in layer.info.options],
        },
        "param_shapes": [[n, list(s)] for n, s in layer.param_shapes],
        "buffer_shapes": [[n, list(s)] for n, s in layer.buffer_shapes],
        "base_fingerprint": layer.base_fingerprint,
    }


def _layer_from_json(data: dict) -> AdapterLayer:
    info = data["info"]
    return AdapterLayer(
        target=Target.from_dict(data["target"]),
        info=LayerInfo(**(info | {"options": tuple((k, v) for k, v in info["options"])})),
        param_shapes=tuple((n, tuple(s)) for n, s in data["param_shapes"]),
        buffer_shapes=tuple((n, tuple(s)) for n, s in data["buffer_shapes"]),
        base_fingerprint=data["base_fingerprint"],
    )


def save(adapter: Adapter, path: str | os.PathLike) -> Path:
    """Write ``adapter`` to ``path`` (a ``.safetensors`` file), atomically.

    The file is written next to ``path`` under a temporary name and renamed into place, so
    ``path`` is never half-written. Returns the path.
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"save() expects an Adapter, got {type(adapter).__name__}")
    path = Path(path)
    tensors: dict[str, Tensor] = {}
    for prefix, flat in (("params", adapter.params), ("buffers", adapter.buffers)):
        for key, tensor in flat.items():
            tensors[f"{prefix}/{key}"] = tensor.detach().to("cpu").contiguous()
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "spec": adapter.spec.to_json(),
        "layers": json.dumps([_layer_to_json(layer) for layer in adapter.layers]),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted?): {err}") from None
    return tensors, metadata


def load(path: str | os.PathLike, model: nn.Module | None = None) -> Adapter:
    """Read an adapter written by :func:`save`.

    With ``model``, checks that every target exists in it with the saved shape and layout
    (raising before anything is returned) and moves the tensors to each target weight's
    device. Params come back as leaf tensors with ``requires_grad=True``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no adapter file at {path}")
    tensors, metadata = _read(path)
    if metadata.get("format") != FORMAT:
        hint = " (a peft checkpoint? use lora_func.load_peft)" if "adapter_model" in path.name else ""
        raise ValueError(f"{path} is not a lora_func adapter file: its metadata has no format={FORMAT!r}{hint}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {metadata.get('format_version')!r}; this lora_func reads {FORMAT_VERSION!r}")
    spec = AdapterSpec.from_json(metadata["spec"])
    layers = [_layer_from_json(d) for d in json.loads(metadata["layers"])]
    expected = {f"params/{k}" for layer in layers for k in layer.param_keys()} | {
        f"buffers/{k}" for layer in layers for k in layer.buffer_keys()
    }
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{path} is inconsistent: missing tensors {missing}, unexpected tensors {unexpected}")
    devices: dict[str, torch.device] = {}
    if model is not None:
        base = base_params(model)
        problems = []
        for layer in layers:
            t = layer.target
            stored = (t.d_out, t.d_in) if t.layout == "linear" else (t.d_in, t.d_out)
            if t.weight_key not in base:
                problems.append(f"{t.weight_key}: not in the model")
            elif tuple(base[t.weight_key].shape) != stored:
                problems.append(f"{t.weight_key}: adapter built for {stored}, model has {tuple(base[t.weight_key].shape)}")
            elif layer.base_fingerprint is not None and weight_fingerprint(base[t.weight_key]) != layer.base_fingerprint:
                problems.append(
                    f"{t.weight_key}: the adapter was derived from different base weights "
                    f"(fingerprint {layer.base_fingerprint}, model {weight_fingerprint(base[t.weight_key])})"
                )
            else:
                devices[t.module] = base[t.weight_key].device
        if problems:
            raise ValueError(f"{path} does not fit {type(model).__name__}: {sorted(problems)}")
    params, buffers = {}, {}
    for layer in layers:
        device = devices.get(layer.target.module, torch.device("cpu"))
        for key in layer.param_keys():
            params[key] = tensors[f"params/{key}"].to(device).requires_grad_(True)
        for key in layer.buffer_keys():
            buffers[key] = tensors[f"buffers/{key}"].to(device)
    return Adapter(params, buffers, spec, layers)
