"""Runtime checks that turn silent garbage into an error naming the culprit.

A NaN or inf in an adapter tensor (a diverged training step, a bad checkpoint, an fp16
overflow) propagates through every later matmul and shows up, much later, as a NaN loss
with no name attached. :func:`check_finite` finds the offending tensors by name so the
caller can raise at the first place the value appears.

The check reads tensor values, so it is a host synchronisation and cannot run inside
``torch.func.vmap`` (a data-dependent branch); call it in eager code, e.g. once per
training step on the loss and the gradients, or through ``merge_overlay(..., check_finite=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_func.adapter import AdapterNode, leaf_adapters
from lora_func.quantized import kind_of_tensor

__all__ = [
    "MAX_LISTED",
    "check_base",
    "check_finite",
    "check_float_targets",
    "check_model",
    "check_path",
    "non_finite_keys",
]

MAX_LISTED = 8  # offending keys named in one error message


def non_finite_keys(tensors: Mapping[str, Tensor]) -> list[str]:
    """The sorted keys of ``tensors`` whose value holds a NaN or ±inf (any shape, any float
    or complex dtype; integer and bool tensors are always finite)."""
    bad = []
    for key, tensor in tensors.items():
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        # One reduction per tensor, read back once: a bool, not a per-element Python loop.
        finite = torch.isfinite(tensor.detach()).all()
        try:
            ok = bool(finite)
        except RuntimeError as err:
            if "vmap" not in str(err):
                raise
            raise RuntimeError(  # error: non-finite-vmap
                f"check_finite: {key!r} is batched by torch.func.vmap, and reading its values is a "
                f"data-dependent branch vmap cannot run; check the outputs after vmap returns instead"
            ) from None
        if not ok:
            bad.append(key)
    return sorted(bad)


def check_finite(tensors: Mapping[str, Tensor], what: str) -> None:
    """Raise ``FloatingPointError`` if any tensor in ``tensors`` holds a NaN or ±inf.

    Args:
      tensors: named tensors to check (e.g. ``adapter.params``, a dict of gradients, or
        ``{"loss": loss}``); the names appear in the error.
      what: what the tensors are, for the message (``"gradients at step 12"``).

    The message names the offending keys, sorted, each with its count of NaN and inf entries
    (the first ``MAX_LISTED``, then how many more), so a diverged step over hundreds of
    tensors still gives a readable error.
    """
    bad = non_finite_keys(tensors)
    if not bad:
        return
    details = []
    for key in bad[:MAX_LISTED]:
        t = tensors[key].detach()
        n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        details.append(f"{key} ({n_nan} NaN, {n_inf} inf of {t.numel()})")
    more = f" and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
    raise FloatingPointError(  # error: non-finite
        f"{what}: non-finite values in {bad[:MAX_LISTED]}{more}: {'; '.join(details)}. Lower the learning rate, clip "
        f"gradients, use bf16/fp32 instead of fp16 (or a GradScaler), or check the inputs that produced them"
    )


# --- argument checks at the public boundary (shared by the calls, io and train) -------


def check_model(model: object, where: str, argument: str = "model") -> None:
    """Raise ``TypeError`` unless ``model`` is an ``nn.Module`` (a state dict, a path or a
    peft config passed as the model would otherwise fail deep inside with an AttributeError)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(  # error: arg-not-a-model
            f"{where}: {argument} must be a torch.nn.Module (the base model), got {type(model).__name__}; pass the "
            f"model itself (for a dict of its tensors use base=lora_func.base_params(model))"
        )


def check_model_and_adapter(model: object, adapter: object, where: str) -> None:
    """Raise ``TypeError`` unless ``where(model, adapter)`` got a module and an adapter node, in
    that order (the usual mistakes: the two swapped, ``adapter.params`` for the adapter)."""
    if not isinstance(model, nn.Module):
        raise TypeError(  # error: call-model-type
            f"{where}(model, adapter): model must be the nn.Module the adapter was built for, got "
            f"{type(model).__name__}; pass the model first and the adapter second"
        )
    if not isinstance(adapter, AdapterNode):
        raise TypeError(  # error: call-adapter-type
            f"{where}(model, adapter): adapter must be an adapter (Adapter, Composed, Combined, ...), got "
            f"{type(adapter).__name__}; build one with lora_func.init_adapter(model, spec)"
        )


def check_base(base: object, where: str) -> None:
    """Raise ``TypeError`` unless ``base`` is a mapping of names to tensors (the shape of
    :func:`lora_func.base_params`); lists of pairs, modules or ``named_parameters()``
    generators are refused with the fix."""
    if not isinstance(base, Mapping):
        raise TypeError(  # error: arg-base-not-mapping
            f"{where}: base must be a dict of name -> tensor, got {type(base).__name__}; build it with "
            f"lora_func.base_params(model)"
        )
    wrong = sorted(str(k) for k, v in base.items() if not isinstance(k, str) or not isinstance(v, Tensor))
    if wrong:
        raise TypeError(  # error: arg-base-values
            f"{where}: base must map names (str) to tensors, but {wrong[:5]} do not; build it with "
            f"lora_func.base_params(model)"
        )


def check_float_targets(base: Mapping[str, Tensor], adapter: object, where: str) -> None:
    """Raise ``TypeError`` when a target weight of ``adapter`` (an adapter, or a list of its
    ``AdapterLayer``) in ``base`` is not a float tensor of no registered quantized kind
    (:mod:`lora_func.quantized`; e.g. a plain int8 copy): merging into it would round the delta
    away, and the lazy path would mix integer and float math."""

    layers = adapter if isinstance(adapter, list) else [layer for leaf in leaf_adapters(cast(Any, adapter)) for layer in leaf.layers]
    bad = sorted(
        {
            f"{layer.target.weight_key} ({base[layer.target.weight_key].dtype})"
            for layer in layers
            if layer.target.weight_key in base
            and not base[layer.target.weight_key].is_floating_point()
            and kind_of_tensor(base[layer.target.weight_key]) is None
        }
    )
    if bad:
        raise TypeError(  # error: target-not-float
            f"{where}: target weights {bad[:5]} are not floating-point (quantized or integer); the adapter's delta "
            f"would be rounded away. Dequantize those layers to float32/bfloat16/float16 first (a model loaded with "
            f"a quantization config: load it without one), or leave them out of the targets"
        )


def check_path(path: object, where: str, argument: str = "path") -> None:
    """Raise ``TypeError`` unless ``path`` is a ``str`` or ``os.PathLike`` (an int, ``None`` or
    an open file would otherwise fail inside ``pathlib`` without naming the argument)."""
    import os

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(  # error: arg-path-type
            f"{where}: {argument} must be a str or os.PathLike (a file or directory path), got {type(path).__name__}; "
            f"pass a string or a pathlib.Path"
        )
