"""BEFT, bias-efficient fine-tuning (arXiv 2509.15974, BitFit-style), following HF peft 0.21's
``tuners/beft/layer.py`` (``Linear``).

Trainable ``beft_bias (d_out,)``, added to the layer's output, also where the layer has no
bias of its own:

    y = base(x) + β,   W_eff = W,   b_eff = b + β

Init (``init="zero"``, peft's ``init_weights=True``): ``β = 0``. ``init="random"``
(``init_weights=False``): ``β ~ N(0, 1)`` from the generator (peft draws from the global RNG).
``r`` and ``alpha`` are not used.

A layer without a bias has no merged weight that holds ``β`` (a bias cannot be folded into
``W``): its weight form refuses, as peft's ``merge`` does there; the lazy path (the activation
form) adds ``β`` to the output as peft's forward does. peft stores ``β`` as ``(1, d_out)``.

Differences from peft: ``init="random"`` draws from the given generator; GPT-2 ``Conv1D`` is
supported (peft's BEFT takes ``nn.Linear`` only, so ``save_peft`` refuses it there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of

INITS = ("zero", "random")


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    if info.option("init") == "random":
        beta = torch.randn((info.d_out,), generator=generator, dtype=torch.float32)
    else:
        beta = torch.zeros((info.d_out,), dtype=torch.float32)
    return {"beft_bias": beta.to(weight.device, dtype)}, {}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    if bias is None:
        raise ValueError(  # error: beft-merged-no-bias
            "beft: this layer has no bias, so no merged weight holds the trained beft_bias (peft's merge refuses it too); "
            "use the lazy path (adapted_call(..., merged=False), lf.overlay) or target layers that have a bias"
        )
    return weight, bias + params["beft_bias"]


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    y = base(x)
    # peft: the base output plus the bias in their promoted dtype, cast back to the output's (a
    # float32 bias on a float64 layer is added in float64, not after rounding the output to float32).
    return (y + params["beft_bias"]).to(y.dtype)


VARIANT = Variant(
    name="beft",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={"beft_bias": Slot(lambda i: (i.d_out,), peft="beft_bias", matrix=0)},
    options={"init": Option("zero", one_of(*INITS), "init_weights", mapped({"zero": True, "random": False}))},
    default_alpha=1.0,
    traits=frozenset({"changes_bias"}),
)
# peft: BeftConfig, no rank, alpha, `bias` or fan_in_fan_out field; nn.Linear only.
PEFT = PeftFormat(PeftMethod("BEFT", {}, fan_in_fan_out=False), conv1d=False)
