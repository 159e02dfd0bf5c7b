"""LoRA with a trainable bias on ``lora_B``: peft's ``LoraConfig(lora_bias=True)``.

Trainable ``lora_A (r, d_in)``, ``lora_B (d_out, r)`` and ``lora_bias (d_out,)`` (peft's
``lora_B.bias``); ``y = x Wᵀ + b + s·((x Aᵀ) Bᵀ + b_B)``, so ``W_eff = W + s·B A`` and
``b_eff = b + s·b_B`` (peft's merge: ``bias += lora_B.bias · scaling``), ``s = alpha/r`` (or
``alpha/√r`` with ``use_rslora``). Init as peft's ``init_lora_weights=True``: ``A ~
kaiming_uniform(a=√5)``, ``B = 0``, ``b_B = 0``. peft's use case: a LoRA extracted from a full
fine-tune whose biases changed too.

Its own variant, not an option of ``lora``: the bias makes the update affine, so it is not the
scaled low-rank product that ``lora`` declares (``LowRank``: the mixed-row fast path, ``cat``
merging and ghost clipping would drop the bias), and it changes the layer's bias. A target
without a bias is refused (before any init, by ``init_adapter`` and ``load_peft`` alike): the
merged path has no bias entry to put ``s·b_B`` in; peft warns there and cannot merge it either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Slot, TensorDict, lora
from lora_func.variants._kernels import base_plus_low_rank, lora_scale, lowrank_input

BIAS = "lora_bias"


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    """LoRA's init (the same draws) and a zero bias ``(d_out,)``."""
    params, buffers = lora.init(weight, bias, info, dtype=dtype, generator=generator)
    return params | {BIAS: torch.zeros(info.d_out, dtype=dtype, device=weight.device)}, buffers


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    s = lora_scale(info, buffers)
    w_eff = weight + s * (params["lora_B"] @ params["lora_A"])
    return w_eff, None if bias is None else bias + s * params[BIAS]


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """``base(x) + s·((x Aᵀ) Bᵀ + b_B)`` in one product: the bias is one more column of ``B``
    whose activation is the constant ``s`` (``h' = [s·x Aᵀ, s]``, ``B' = [B, b_B]``), so no
    extra pass over the ``(..., d_out)`` outputs."""
    lora_a, s = params["lora_A"], lora_scale(info, buffers)
    h = (lowrank_input(x, base, info).to(lora_a.dtype) @ lora_a.T) * s
    ones = torch.ones((*h.shape[:-1], 1), dtype=h.dtype, device=h.device) * s
    b_aug = torch.cat([params["lora_B"], params[BIAS][:, None]], dim=1)
    return base_plus_low_rank(base, x, torch.cat([h, ones], dim=-1), b_aug)


def _biased_targets_only(r: int, infos: Mapping[str, LayerInfo]) -> dict[str, int]:
    """Every target's rank unchanged, after refusing targets without a bias: this hook sees every
    target before any init, in ``init_adapter`` and ``load_peft`` alike."""
    missing = sorted(module for module, info in infos.items() if not info.has_bias)
    if missing:
        raise ValueError(  # error: lora-bias-no-bias
            f"lora_bias: the target(s) {missing[:4]}{' ...' if len(missing) > 4 else ''} have no bias, so the merged "
            f"weights could not hold s·lora_bias (peft cannot merge it there either); target layers with a bias, or use 'lora'"
        )
    return {module: info.r for module, info in infos.items()}


VARIANT = lora.derived(
    "lora_bias",
    init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors=lora.TENSORS | {BIAS: Slot(lambda i: (i.d_out,), peft="lora_B.bias")},
    # affine, not LoRA's scaled product: no LowRank declaration
    low_rank=None,
    layer_ranks=_biased_targets_only,
    traits=frozenset({"changes_bias"}),
)
# peft allows lora_bias with init_lora_weights True or False only, and not with DoRA.
PEFT = lora.stored_as_lora(reads=lora.plain_reads(lora_bias=True, init_lora_weights=(True, False)), writes={"lora_bias": True})
