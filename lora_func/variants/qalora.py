"""QALoRA (quantization-aware LoRA, Xu et al. 2023, arXiv 2309.14717) as peft's
``LoraConfig(use_qalora=True, qalora_group_size=g)``: LoRA on the input pooled over groups of
``g`` consecutive features, the groups of a group-wise quantized weight.

Trainable ``lora_A (r, d_in/g)`` and ``lora_B (d_out, r)``; ``x̄ = mean over each group of x ·
(d_in/g)`` (peft's scale: the number of groups, not ``g``); ``y = x Wᵀ + b + s·(x̄ Aᵀ) Bᵀ``, so
``W_eff = W + s·(d_in/g)/g · B (A ⊗ 1_gᵀ)`` (each column of ``A`` repeated ``g`` times), bias
unchanged, ``s = alpha/r`` (``alpha/√r`` with ``use_rslora``); dropout (training steps) on ``x``
before the pooling. ``g`` divides ``d_in``. Init as peft's, its draws in its order: LoRA's ``A
(r, d_in)`` drawn, then replaced by a new ``nn.Linear(d_in/g, r)``'s kaiming-uniform (``a=√5``)
``A``; ``B = 0``.

peft applies it on GPTQ layers only (a plain ``nn.Linear`` ignores ``use_qalora``, and peft cannot
merge it); lora_func applies it on any base (float, bitsandbytes, torchao; ``nn.Linear`` and
GPT-2 ``Conv1D``) and merges it (the delta above is an ordinary matrix). A peft checkpoint saved
from a float model with ``use_qalora=True`` holds a plain LoRA (peft ignored the flag there): its
``lora_A (r, d_in)`` is refused by the shape check; set ``use_qalora`` false in its config.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Option, Slot, TensorDict, lora, whole
from lora_func.variants._kernels import base_plus_low_rank, kaiming_uniform, lora_scale, lowrank_input


def pooled(x: Tensor, group_size: int) -> Tensor:
    """``x (..., d_in)`` averaged over groups of ``group_size`` consecutive features and scaled by
    the number of groups, as peft: ``(..., d_in / group_size)``."""
    groups = x.shape[-1] // group_size
    return x.unflatten(-1, (groups, group_size)).mean(-1) * groups


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    g = info.option("group_size")
    if info.d_in % g:
        raise ValueError(  # error: qalora-group-size
            f"qalora: group_size={g} must divide the layer's d_in={info.d_in} (the input is pooled over groups of "
            f"group_size features); pick a divisor, e.g. the base's quantization group size"
        )
    kaiming_uniform((info.r, info.d_in), a=math.sqrt(5), generator=generator)  # peft's LoRA A, then replaced
    lora_a = kaiming_uniform((info.r, info.d_in // g), a=math.sqrt(5), generator=generator)
    lora_b = torch.zeros((info.d_out, info.r))
    return {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}, {}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    g = info.option("group_size")
    groups = info.d_in // g
    expanded = params["lora_A"].repeat_interleave(g, dim=-1) * (groups / g)
    return weight + lora_scale(info, buffers) * (params["lora_B"] @ expanded), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    lora_a = params["lora_A"]
    x_bar = pooled(lowrank_input(x, base, info).to(lora_a.dtype), info.option("group_size"))
    h = (x_bar @ lora_a.T) * lora_scale(info, buffers)
    return base_plus_low_rank(base, x, h, params["lora_B"])


VARIANT = lora.derived(
    "qalora",
    init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "lora_A": Slot(lambda i: (i.r, i.d_in // i.option("group_size")), rank_axes=(0,), peft="lora_A.weight"),
        "lora_B": lora.TENSORS["lora_B"],
    },
    options={
        "group_size": Option(16, whole(1, why="the input features pooled into one (the quantization group size)"), "qalora_group_size"),
        **lora.OPTIONS,
    },
    low_rank=None,  # the pooled input is not LoRA's product on x
)
PEFT = lora.stored_as_lora(reads=lora.plain_reads(use_qalora=True), writes={"use_qalora": True})
