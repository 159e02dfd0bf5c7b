"""HiRA, Hadamard high-rank adaptation (Huang et al., ICLR 2025, openreview TwJrTz9cRS),
following HF peft 0.21's ``tuners/hira/layer.py`` (``Linear``).

Trainable ``hira_A (r, d_in)``, ``hira_B (d_out, r)``. The update is the frozen weight times a
rank-``r`` matrix, elementwise, so it can have full rank:

    ΔW = W ⊙ (B A),   W_eff = W ⊙ (1 + B A),   bias unchanged,   y = base(x) + x (W ⊙ B A)ᵀ

No ``alpha`` scale (peft has none). Both forms build ``W ⊙ B A`` (``d_out × d_in``): the
activation form without it would need ``r`` passes through ``W`` (``Σ_k b_k ⊙ (W (a_k ⊙ x))``),
``r`` times the base layer's cost, so the merged weight is the cheaper form at every rank
above 1. The activation form adds ``x (W ⊙ B A)ᵀ`` to the base output (peft's order; the
``dropout`` option, peft's ``hira_dropout``, acts on that ``x`` in training steps); the weight
form returns ``W + W ⊙ B A``.

Init (``init="kaiming"``, peft's ``init_weights=True``): ``A ~ kaiming_uniform(a=√5)``,
``B = 0`` (no change at init). ``init="gaussian"``: ``A ~ N(0, 1/r²)``, ``B = 0``.
``init="random"`` (``init_weights=False``): ``A, B ~ N(0, 1)`` (not the identity at init).

Conv layers (``nn.Conv1d/2d/3d``, peft's HiRA conv layers) through the merged kernel in the
``(out, in·K)`` view: peft's ``B·A`` kernel is ``B A`` there (``hira_A`` stored ``(r, in, *k)``,
``hira_B`` ``(out, r, 1, …)``); grouped convs are refused, as peft refuses them.

Differences from peft: none in the math. GPT-2 ``Conv1D`` is supported as in peft. On a conv
layer the ``dropout`` option does not act (the layer runs its merged kernel).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._conv import chained, low_rank_kernels
from lora_func.variants._kernels import kaiming_uniform, lowrank_input
from lora_func.variants._options import dropout_option
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of

INITS = ("kaiming", "gaussian", "random")


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
    how = info.option("init")
    if how == "random":
        a = torch.randn((r, d_in), generator=generator, dtype=torch.float32)
        b = torch.randn((d_out, r), generator=generator, dtype=torch.float32)
    else:
        if how == "gaussian":
            a = torch.randn((r, d_in), generator=generator, dtype=torch.float32) / r
        else:
            a = kaiming_uniform((r, d_in), a=math.sqrt(5), generator=generator)
        b = torch.zeros((d_out, r), dtype=torch.float32)
    return {"hira_A": a.to(weight.device, dtype), "hira_B": b.to(weight.device, dtype)}, {}


def hadamard_delta(params: TensorDict, weight: Tensor) -> Tensor:
    """``W ⊙ (B A)`` ``(d_out, d_in)``, in the wider of the base and adapter dtypes."""
    a, b = params["hira_A"], params["hira_B"]
    # Type promotion computes a half-precision W times the fp32 product in fp32, without a
    # separate upcast copy of W (peft's order).
    return weight * (b @ a)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + hadamard_delta(params, weight).to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    delta = hadamard_delta(params, base.weight)
    y = base(x)
    update = lowrank_input(x, base, info).to(delta.dtype) @ delta.transpose(-1, -2)
    # y + update in the wider dtype by promotion (no upcast copy of y), cast back: peft's order.
    return (y + update).to(y.dtype)


VARIANT = Variant(
    name="hira",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "hira_A": Slot(lambda i: (i.r, i.d_in), rank_axes=(0,), peft="hira_A"),
        "hira_B": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,), peft="hira_B"),
    },
    options={
        "init": Option("kaiming", one_of(*INITS), "init_weights", mapped({"kaiming": True, "gaussian": "gaussian", "random": False})),
        "dropout": dropout_option("hira_dropout"),
    },
    default_alpha=1.0,
    kind_forms={"linear": None, "conv1d": None, "conv": None},
)
# peft: HiraConfig, no alpha and no `bias` field. peft 0.21's HiRA builds every layer with the
# config's r whatever its rank_pattern says: one rank per checkpoint.
PEFT = PeftFormat(PeftMethod("HIRA", {}, rank=("r", None)), reshape=chained(low_rank_kernels("hira_A", "hira_B")))
