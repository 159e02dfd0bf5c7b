"""Export: the full merged state dict of a model with an adapter, for ``save_pretrained``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lora_func.adapter import AdapterLike, leaf_adapters
from lora_func.checks import check_base, check_float_targets
from lora_func._model import base_params, weight_fingerprint
from lora_func.overlay import merge_overlay
from lora_func.quantized import kind_of_tensor

__all__ = ["merged_state_dict"]


def merged_state_dict(
    model_or_base: nn.Module | Mapping[str, Tensor], adapter: AdapterLike, *, check_finite: bool = False, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The merged weights of ``adapter`` on a model, as a full state dict; the base untouched.

    ``model_or_base`` is the model (the result is keyed as ``model.state_dict()``, so
    ``copy.load_state_dict(merged_state_dict(model, adapter))`` then ``copy.save_pretrained(dir)`` exports
    a plain model that needs neither lora_func nor peft) or a dict from
    :func:`lora_func.base_params` (keyed as that dict). Every value is a plain, contiguous
    tensor without autograd history, in the base dtype. Adapted weights (and biases, where
    the variant changes them) are new tensors; the others are the base's own tensors, not
    copies (``load_state_dict`` copies them anyway), so never write into them. Tied names
    (GPT-2 ``lm_head.weight`` / ``transformer.wte.weight`` with ``tied="both"``) get one
    merged tensor. ``adapter`` may be composed or combined; a stacked adapter raises (pick
    one member with ``lora_func.take``). ``check_finite=True`` refuses NaN/inf in the adapter or the
    merged weights, naming them (see :func:`lora_func.merge_overlay`).

    ``dtype``: every floating-point tensor of the result in this dtype. A quantized model
    (:mod:`lora_func.quantized`) needs it: its weights are dequantized to ``dtype``, the
    adapter merged into them, and the result is the state dict of the equivalent dense float
    model (the quantization state entries left out), never a quantized weight with the delta
    rounded away.
    """
    if isinstance(model_or_base, nn.Module):
        base = base_params(model_or_base)
        keys = list(model_or_base.state_dict(keep_vars=True))
        dense = _dequantized(model_or_base, base, dtype)
    elif isinstance(model_or_base, Mapping):
        check_base(model_or_base, "merged_state_dict")
        base = dict(model_or_base)
        keys = list(base)
        quantized = sorted(k for k, v in base.items() if kind_of_tensor(v) is not None)
        if quantized:
            raise TypeError(  # error: merge-quantized-base-dict
                f"merged_state_dict: {quantized[:4]} are quantized weights, which only their layers can dequantize: pass the model "
                f"itself, merged_state_dict(model, adapter, dtype=torch.bfloat16)"
            )
        dense = base
    else:
        raise TypeError(  # error: merge-not-a-model
            f"merged_state_dict() expects a model (nn.Module) or the dict of lora_func.base_params(model), got {type(model_or_base).__name__}"
        )
    check_float_targets(base, adapter, "merged_state_dict")
    _check_fingerprints(base, adapter)
    if dtype is not None:
        cast: dict[int, Tensor] = {}  # one object per object: tied names stay tied
        dense = {k: cast.setdefault(id(v), v.to(dtype) if v.is_floating_point() else v) for k, v in dense.items()}
    with torch.no_grad():
        merged = merge_overlay(dense, adapter, check_finite=check_finite)
    out: dict[str, Tensor] = {}
    plain: dict[int, Tensor] = {}  # one output tensor per input object, so tied names stay tied
    for key in keys:
        if key not in merged:
            continue  # a quantized layer's state (absmax, quant_map ...): the dense model has none
        tensor = merged[key]
        if id(tensor) not in plain:
            # as_subclass: a stand-in or parameter subclass would confuse save_pretrained.
            plain[id(tensor)] = tensor.detach().as_subclass(Tensor).contiguous()
        out[key] = plain[id(tensor)]
    return out


def _check_fingerprints(base: Mapping[str, Tensor], adapter: AdapterLike) -> None:
    """Refuse an adapter derived from other base weights (PiSSA's, OLoRA's residual...): merged
    into this base it would replace its weights by another model's residual."""
    other = sorted(
        layer.target.module
        for leaf in leaf_adapters(adapter)
        for layer in leaf.layers
        if layer.base_fingerprint is not None and layer.target.weight_key in base
        and kind_of_tensor(base[layer.target.weight_key]) is None
        and weight_fingerprint(base[layer.target.weight_key]) != layer.base_fingerprint
    )
    if other:
        raise ValueError(  # error: merge-export-fingerprint
            f"merged_state_dict: the adapter was derived from other base weights than these at {other[:5]} (its "
            f"residual would replace this model's weights by another model's); export it with the model it was built on"
        )


def _dequantized(model: nn.Module, base: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """``base`` with every quantized weight dequantized (``dtype`` required when there is one)."""
    quantized = {
        f"{name}.weight" if name else "weight": (module, kind)
        for name, module in model.named_modules()
        if (kind := kind_of_tensor(getattr(module, "weight", None))) is not None
    }
    if not quantized:
        return base
    if dtype is None:
        raise TypeError(  # error: merge-quantized-dtype
            f"merged_state_dict: {sorted(quantized)[:4]} ({len(quantized)} in all) are quantized: merging into them would round the "
            f"delta away. Name the dense dtype of the export, e.g. merged_state_dict(model, adapter, dtype=torch.bfloat16)"
        )
    with torch.no_grad():
        dense = {key: kind.dequantize(module).to(dtype) for key, (module, kind) in quantized.items()}
    return {k: dense.get(k, v) for k, v in base.items()}
