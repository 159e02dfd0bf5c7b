"""OLoRA (Büyükakyüz 2024, arXiv 2406.01775): LoRA initialised on the QR factors of the base
weight, on top of the frozen residual, as peft's ``init_lora_weights="olora"``.

``Q, R = qr(W)`` (fp32, ``W (d_out, d_in)``); trainable ``lora_A = R[:r] (r, d_in)`` and
``lora_B = Q[:, :r] (d_out, r)``; frozen buffer ``W_res = W − s·B A``; ``W_eff = W_res + s·B A``
(= ``W`` at init up to round-off), bias unchanged, ``s = alpha/r`` (``alpha/√r`` with
``use_rslora``). peft writes ``W_res`` into the base weight; lora_func keeps the base untouched
and holds ``W_res`` in the adapter, exactly as :mod:`lora_func.variants.pissa` does, whose forms
and peft conversion it shares: ``save_peft`` writes the plain rank-``2r`` LoRA
``s·[B, −B0][A; A0]`` on the untouched base (peft's ``path_initial_model_for_weight_conversion``
output), and an unconverted peft OLoRA checkpoint loads with its residual recomputed from the base
as peft recomputes it.

peft runs the QR on the stored weight without transposing GPT-2 ``Conv1D`` weights, so its OLoRA
on ``Conv1D`` factors the ``(d_in, d_out)`` matrix; lora_func factors ``W (d_out, d_in)`` on both
layer kinds (its ``Conv1D`` adapters are the math above, not peft's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lora_func.variants import LayerInfo, TensorDict
from lora_func.variants._kernels import lora_scale
from lora_func.variants.pissa import residual_variant, stored_converted


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, s = info.r, lora_scale(info)
    w = weight.to(torch.promote_types(weight.dtype, torch.float32))
    q, upper = torch.linalg.qr(w)
    lora_a, lora_b = upper[:r].contiguous(), q[:, :r].contiguous()
    w_res = w - s * lora_b @ lora_a  # peft's operations, so the residual matches its base bit for bit
    res_dtype = torch.promote_types(weight.dtype, dtype)
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}
    return params, {"W_res": w_res.to(weight.device, res_dtype).contiguous()}


VARIANT = residual_variant("olora", init)
PEFT = stored_converted("OLoRA", init="olora")
