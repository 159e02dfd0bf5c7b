"""(IA)³ (Liu et al., NeurIPS 2022, arXiv 2205.05638), following HF peft's
``tuners/ia3/layer.py``. Two registered variants:

``ia3`` (peft ``is_feedforward=False``): trainable ``ia3_l (d_out,)``, init ones, scales the
layer OUTPUT, bias included:

    y = (x Wᵀ + b) ⊙ g,   W_eff = diag(g) W,   b_eff = g ⊙ b

``ia3_ff`` (peft ``is_feedforward=True``, e.g. the MLP down projection): trainable
``ia3_l (d_in,)``, init ones, scales the layer INPUT, bias unchanged:

    y = (x ⊙ g) Wᵀ + b,   W_eff = W diag(g),   b_eff = b

Neither activation form builds ``W_eff``. peft stores ``ia3_l`` as ``(d_out, 1)`` /
``(1, d_in)``; lora_func stores the vector. ``r`` and ``alpha`` are not used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import promoted
from lora_func.variants import BaseLayer, LayerInfo, PeftFormat, PeftMethod, Slot, TensorDict, Variant


def _init_out(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    return {"ia3_l": torch.ones((info.d_out,), dtype=dtype, device=weight.device)}, {}


def _init_in(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    return {"ia3_l": torch.ones((info.d_in,), dtype=dtype, device=weight.device)}, {}


def _weight_out(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    g = params["ia3_l"]
    return weight * g[:, None], None if bias is None else bias * g


def _weight_in(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight * params["ia3_l"][None, :], bias


def _activation_out(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # peft: base output (bias included) times the vector in the adapter dtype, cast back.
    y = base(x)
    g = params["ia3_l"]
    # A wider adapter dtype: type promotion computes in it without an (n, d_out) upcast copy of
    # y (the same values), and the product saves y itself for ∂g, not an upcast copy.
    return ((y if _promotes_to(y, g) else y.to(g.dtype)) * g).to(y.dtype)


def _activation_in(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # peft: the input times the vector in the adapter dtype, cast back to the input dtype,
    # then the base layer (whose bias is untouched).
    g = params["ia3_l"]
    return base(((x if _promotes_to(x, g) else x.to(g.dtype)) * g).to(x.dtype))


def _promotes_to(t: Tensor, g: Tensor) -> bool:
    """Whether ``t * g`` computes in ``g``'s dtype: exactly ``t.to(g.dtype) * g``, without the copy."""
    return promoted(t.dtype, g.dtype) == g.dtype


# peft: IA3Config; ia3 layers store ia3_l as (d_out, 1), ia3_ff layers (the config's
# feedforward_modules) as (1, d_in). A checkpoint with both loads as compose(ia3, ia3_ff).
PEFT_METHOD = PeftMethod("IA3", {"init_ia3_weights": True})

IA3 = Variant(
    name="ia3",
    init=_init_out,
    weight_form=_weight_out,
    activation_form=_activation_out,
    tensors={"ia3_l": Slot(lambda i: (i.d_out,), peft="ia3_l", matrix=1)},
    default_alpha=1.0,
    traits=frozenset({"changes_bias"}),
)

IA3_FF = Variant(
    name="ia3_ff",
    init=_init_in,
    weight_form=_weight_in,
    activation_form=_activation_in,
    tensors={"ia3_l": Slot(lambda i: (i.d_in,), peft="ia3_l", matrix=0)},
    default_alpha=1.0,
)

VARIANTS = (IA3, IA3_FF)
PEFT = {"ia3": PeftFormat(PEFT_METHOD), "ia3_ff": PeftFormat(PEFT_METHOD, feedforward=True)}
