"""LN tuning (Zhao et al. 2023, arXiv 2312.11420), following HF peft's ``tuners/ln_tuning``.

peft's LN tuning trains a copy of each targeted layer: meant for norm layers (``LayerNorm``,
Llama's ``RMSNorm``: weight ``(d,)``, bias ``(d,)``), it takes any layer (peft warns), and on a
``nn.Linear`` / GPT-2 ``Conv1D`` it is full fine-tuning of that layer. Trainable ``ln_weight``
(canonical view: ``(d,)`` on a norm, ``(d_out, d_in)`` on a matrix) and ``ln_bias`` (where the
layer has a bias), copies of the base's values, so the adapted model starts as the base:

    W_eff = ln_weight,   b_eff = ln_bias

``r`` and ``alpha`` are not used. peft stores them as ``ln_tuning_layers.weight`` /
``ln_tuning_layers.bias`` (``peft_type`` ``LN_TUNING``); a norm without a bias has only the
weight.

A trained copy of a layer is also what peft's ``modules_to_save`` holds beside another method
(``PeftFormat.module_copy``): composed with that method's adapter, it loads and saves as
``<module>.weight`` / ``.bias`` (an ``nn.Embedding``'s copy too: its ``(V, d)`` table, the
canonical ``(d, V)`` view here, looked up in the merged table; a conv's: its kernel).

``weight=False`` trains the bias alone (``ln_bias``; the weight stays the base's, no
``ln_weight``): peft's bias training beside another method (``bias="all"`` /
``bias="lora_only"``), loaded and saved as the method's config ``bias`` and the biases under
``<module>.bias`` (``<module>.base_layer.bias`` on the method's own targets). Composed *before*
the method's part on the same layer (``compose(biases, lora)``: the method sees the trained bias
as its base's). A layer without a bias is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants._kernels import promoted
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant

def _bias_only(info: LayerInfo) -> bool:
    """The copy trains the bias alone (``weight=False``: peft's bias training)."""
    return not dict(info.options).get("weight", True)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    # Copies: the trained tensors must never share storage with the frozen base.
    if _bias_only(info):
        if bias is None:
            raise ValueError(  # error: ln-tuning-bias-none
                "ln_tuning weight=False: this layer has no bias to train (peft's bias training trains existing biases "
                "only); target the layers that have one (lora_func.targeting.biased_modules(model))"
            )
        return {"ln_bias": bias.to(dtype, copy=True)}, {}
    params = {"ln_weight": weight.to(dtype, copy=True)}
    if bias is not None:
        params["ln_bias"] = bias.to(dtype, copy=True)
    return params, {}


def weight_form(params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo) -> tuple[Tensor, Tensor | None]:
    return params.get("ln_weight", weight), params.get("ln_bias", bias)


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # The trained copy replaces the layer: its own weight and bias, in the adapter dtype, the
    # output cast back to the layer's. weight=False: the layer's own product in its dtype, the
    # trained bias added in the wider dtype (as peft's bias, a parameter of the layer's dtype)
    if "ln_weight" not in params:
        b = params["ln_bias"]
        y = F.linear(x, base.weight.to(x.dtype))
        return (y.to(promoted(y.dtype, b.dtype)) + b).to(y.dtype)
    weight = params["ln_weight"]
    return F.linear(x.to(weight.dtype), weight, params.get("ln_bias", None if base.bias is None else base.bias.to(weight.dtype))).to(x.dtype)


def _stored_layout(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...], to_peft: bool) -> Tensor:
    """peft's copy of a GPT-2 Conv1D holds its weight ``(d_in, d_out)``, of an ``nn.Embedding`` its
    ``(V, d)`` table: the transpose of the canonical view, both ways; of a conv its kernel
    ``(out, in/groups, *k)``, the canonical ``(out, in/groups·K)`` view unflattened."""
    if name != "ln_weight":
        return tensor
    if kind in ("conv1d", "embedding"):
        return tensor.T
    if kind in ("conv", "grouped_conv"):
        return tensor.reshape(shape) if to_peft else tensor.flatten(1)
    return tensor


VARIANT = Variant(
    name="ln_tuning",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        # a norm's weight is (d,); a matrix layer's its canonical view
        "ln_weight": Slot(lambda i: None if _bias_only(i) else (i.d_out,) if i.kind == "norm" else (i.d_out, i.d_in), peft="ln_tuning_layers.weight", saved_if="weight"),
        "ln_bias": Slot(lambda i: (i.d_out,) if i.has_bias else None, peft="ln_tuning_layers.bias"),
    },
    # whether the copy trains the layer's weight (False: its bias alone, peft's bias training)
    options={"weight": Option(True, None, None)},
    default_alpha=1.0,
    # (an nn.Embedding's copy: peft's modules_to_save of embed_tokens when tokens are added)
    kind_forms={"linear": None, "conv1d": None, "norm": None, "embedding": None, "conv": None, "grouped_conv": None},
    traits=frozenset({"changes_bias", "replaces_weight"}),
)
# A trained copy of its layer: also peft's modules_to_save beside another method's layers
PEFT = PeftFormat(
    PeftMethod("LN_TUNING", {}, fan_in_fan_out=False), reshape=_stored_layout, module_copy={"ln_weight": "weight", "ln_bias": "bias"}
)
