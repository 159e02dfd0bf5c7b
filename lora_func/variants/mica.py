"""MiCA (minor component adaptation, arXiv 2604.01694) as peft's ``init_lora_weights="mica"``:
LoRA whose ``B`` is fixed to the left singular vectors of the ``r`` *smallest* singular values of
the base weight and whose ``A`` starts at zero and is the only trainable tensor.

``U, S, Vh = svd(W)`` (fp32); frozen buffer ``lora_B = U[:, -r:] (d_out, r)``; trainable
``lora_A = 0 (r, d_in)``; ``W_eff = W + s·B A`` (exactly ``W`` at init), ``s = alpha/r``
(``alpha/√r`` with ``use_rslora``). The update lives in the span of the weight's minor output
directions, the ones pretraining used least. peft freezes ``lora_B`` (``MiCALinearVariant``) and
stores it in the checkpoint like a trainable ``lora_B``; lora_func holds it as a buffer, so no
optimiser, gradient or stack member carries it as a parameter. ``r <= min(d_in, d_out)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func._kernels import base_plus_low_rank, check_dropout, lora_scale, lowrank_input
from lora_func.variants import BaseLayer, LayerInfo, PeftFormat, TensorDict, Variant
from lora_func.variants.lora import PEFT_KEYS, PEFT_METHOD, peft_config, peft_reads, peft_shapes


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r = info.r
    if isinstance(r, int) and r > min(info.d_in, info.d_out):
        raise ValueError(  # error: mica-rank
            f"mica: r={r} is larger than min(d_in, d_out) = {min(info.d_in, info.d_out)}: B takes r of the weight's "
            f"left singular vectors; lower r"
        )
    u, _, _ = torch.linalg.svd(weight.to(torch.promote_types(weight.dtype, torch.float32)), full_matrices=False)
    lora_b = u[:, -r:].contiguous()
    lora_a = torch.zeros((r, info.d_in), dtype=torch.float32)
    return {"lora_A": lora_a.to(weight.device, dtype)}, {"lora_B": lora_b.to(weight.device, dtype)}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + lora_scale(info) * (buffers["lora_B"] @ params["lora_A"]), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    lora_a = params["lora_A"]
    h = (lowrank_input(x, base, info).to(lora_a.dtype) @ lora_a.T) * lora_scale(info)
    return base_plus_low_rank(base, x, h, buffers["lora_B"])


def check_options(options: Mapping[str, Any]) -> None:
    check_dropout("mica", options)


def _peft_reads(config: Mapping[str, Any], module: str) -> dict[str, Any] | None:
    return peft_reads(config, use_dora=False, inits=("mica",))


VARIANT = Variant(
    name="mica",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    options={"use_rslora": False, "dropout": 0.0},
    default_alpha=8.0,
    rank_axes={"lora_A": 0, "lora_B": 1},
    check_options=check_options,
    peft=PeftFormat(
        PEFT_METHOD,
        PEFT_KEYS,
        peft_shapes,
        lambda options: peft_config(options, init="mica"),
        _peft_reads,
        buffers=frozenset({"lora_B"}),
    ),
)
