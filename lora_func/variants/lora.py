"""LoRA (Hu et al. 2021, arXiv 2106.09685), with the rsLoRA scale (arXiv 2312.03732).

Trainable ``lora_A (r, d_in)`` and ``lora_B (d_out, r)``;
``y = x Wᵀ + b + s · (x Aᵀ) Bᵀ``, ``W_eff = W + s·B A``, ``s = alpha/r`` (or
``alpha/sqrt(r)`` with ``use_rslora``). Init as peft: ``A ~ kaiming_uniform(a=√5)``
(or ``N(0, 1/r²)`` with ``init="gaussian"``), ``B = 0``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func._kernels import check_dropout, kaiming_uniform, lora_activation_form, lora_weight_form
from lora_func.variants import LayerInfo, TensorDict, Variant

INITS = ("kaiming", "gaussian")


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, d_in, d_out = info.r, info.d_in, info.d_out
    if info.option("init") == "gaussian":
        lora_a = torch.randn((r, d_in), generator=generator, dtype=torch.float32) / r
    else:
        lora_a = kaiming_uniform((r, d_in), a=math.sqrt(5), generator=generator)
    lora_b = torch.zeros((d_out, r), dtype=torch.float32)
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}
    return params, {}


def check_options(options: Mapping[str, Any]) -> None:
    check_dropout("lora", options)
    if options["init"] not in INITS:
        raise ValueError(f"lora option init={options['init']!r} is not one of {list(INITS)}")  # error: lora-init


VARIANT = Variant(
    name="lora",
    init=init,
    weight_form=lora_weight_form,
    activation_form=lora_activation_form,
    options={"use_rslora": False, "init": "kaiming", "dropout": 0.0},
    default_alpha=8.0,
    rank_axes={"lora_A": 0, "lora_B": 1},
    check_options=check_options,
)
