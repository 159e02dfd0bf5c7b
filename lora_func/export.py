"""Export: the full merged state dict of a model with an adapter, for ``save_pretrained``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lora_func.adapter import AdapterLike
from lora_func.checks import check_base, check_float_targets
from lora_func.core import base_params, merge_overlay

__all__ = ["merge"]


def merge(model_or_base: nn.Module | Mapping[str, Tensor], adapter: AdapterLike, *, safe: bool = False) -> dict[str, Tensor]:
    """The merged weights of ``adapter`` on a model, as a full state dict; the base untouched.

    ``model_or_base`` is the model (the result is keyed as ``model.state_dict()``, so
    ``copy.load_state_dict(merge(model, adapter))`` then ``copy.save_pretrained(dir)`` exports
    a plain model that needs neither lora_func nor peft) or a dict from
    :func:`lora_func.base_params` (keyed as that dict). Every value is a plain, contiguous
    tensor without autograd history, in the base dtype. Adapted weights (and biases, where
    the variant changes them) are new tensors; the others are the base's own tensors, not
    copies (``load_state_dict`` copies them anyway), so never write into them. Tied names
    (GPT-2 ``lm_head.weight`` / ``transformer.wte.weight`` with ``tied="both"``) get one
    merged tensor. ``adapter`` may be composed or combined; a stacked adapter raises (pick
    one member with ``lora_func.take``). ``safe=True`` refuses NaN/inf in the adapter or the
    merged weights, naming them (see :func:`lora_func.merge_overlay`).
    """
    if isinstance(model_or_base, nn.Module):
        base = base_params(model_or_base)
        keys = list(model_or_base.state_dict(keep_vars=True))
    elif isinstance(model_or_base, Mapping):
        check_base(model_or_base, "merge")
        base = dict(model_or_base)
        keys = list(base)
    else:
        raise TypeError(
            f"merge() expects a model (nn.Module) or the dict of lora_func.base_params(model), got {type(model_or_base).__name__}"
        )
    check_float_targets(base, adapter, "merge")
    with torch.no_grad():
        merged = merge_overlay(base, adapter, safe=safe)
    out: dict[str, Tensor] = {}
    plain: dict[int, Tensor] = {}  # one output tensor per input object, so tied names stay tied
    for key in keys:
        tensor = merged[key]
        if id(tensor) not in plain:
            # as_subclass: a stand-in or parameter subclass would confuse save_pretrained.
            plain[id(tensor)] = tensor.detach().as_subclass(Tensor).contiguous()
        out[key] = plain[id(tensor)]
    return out
