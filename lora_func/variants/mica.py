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

from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Slot, TensorDict, lora
from lora_func.variants._kernels import lora_activation_form, lora_scale


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
    u, _, _ = torch.linalg.svd(weight.to(torch.promote_types(weight.dtype, torch.float32)), full_matrices=False)
    lora_b = u[:, -r:].contiguous()
    lora_a = torch.zeros((r, info.d_in), dtype=torch.float32)
    return {"lora_A": lora_a.to(weight.device, dtype)}, {"lora_B": lora_b.to(weight.device, dtype)}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + lora_scale(info) * (buffers["lora_B"] @ params["lora_A"]), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # LoRA's form with the frozen B: on a half-precision base its one product node, which
    # computes no gradient for a factor that needs none.
    return lora_activation_form({"lora_A": params["lora_A"], "lora_B": buffers["lora_B"]}, {}, x, base, info)


VARIANT = lora.derived(
    "mica",
    init,
    weight_form=weight_form,
    activation_form=activation_form,
    # B takes r of the weight's left singular vectors, frozen: a buffer, stored as peft's lora_B.
    tensors=lora.TENSORS | {"lora_B": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,), buffer=True, peft="lora_B.weight")},
    traits=frozenset({"rank_within_layer"}),
)
PEFT = lora.stored_as_lora(reads={"use_dora": False, "init_lora_weights": "mica"}, writes={"init_lora_weights": "mica"})
