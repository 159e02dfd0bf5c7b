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

Conv layers (``nn.Conv1d/2d/3d``, peft's IA3 ``Conv2d`` / ``Conv3d``), through the merged kernel:
``ia3`` scales the output channels (``W_eff = diag(g) W`` in the ``(out, in·K)`` view, ``b_eff =
g ⊙ b``), also of a grouped conv; ``ia3_ff`` scales the input channels, ``ia3_l (c_in,)``, each
over its ``K = prod(kernel)`` columns (groups = 1: peft's grouped form needs the group count,
which a layer's info does not carry). peft stores the vector as ``(1, n, 1, …)`` there and
refuses ``nn.Conv1d``, so ``save_peft`` does too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._conv import chained, channel_vector, peft_conv_layers
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


def _in_features(info: LayerInfo) -> int:
    """The input features ``ia3_ff`` scales: ``d_in``, a conv's input channels (``d_in / K``)."""
    return info.d_in // math.prod(info.kernel)


def _init_in(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    return {"ia3_l": torch.ones((_in_features(info),), dtype=dtype, device=weight.device)}, {}


def _weight_out(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    g = params["ia3_l"]
    return weight * g[:, None], None if bias is None else bias * g


def _weight_in(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    # a conv's input channel c holds columns c·K .. c·K + K − 1 of the (out, in·K) view
    return weight * params["ia3_l"].repeat_interleave(math.prod(info.kernel))[None, :], bias


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
    kind_forms={"linear": None, "conv1d": None, "conv": None, "grouped_conv": None},
)

IA3_FF = Variant(
    name="ia3_ff",
    init=_init_in,
    weight_form=_weight_in,
    activation_form=_activation_in,
    tensors={"ia3_l": Slot(lambda i: (_in_features(i),), peft="ia3_l", matrix=0)},
    default_alpha=1.0,
    kind_forms={"linear": None, "conv1d": None, "conv": None},
)

VARIANTS = (IA3, IA3_FF)
# peft's IA3 adapts nn.Conv2d / nn.Conv3d (not nn.Conv1d), with ia3_l (1, n, 1, ...)
_CONVS = peft_conv_layers("IA3", (2, 3))
PEFT = {
    "ia3": PeftFormat(PEFT_METHOD, export=_CONVS, reshape=chained(channel_vector("ia3_l", axis=1))),
    "ia3_ff": PeftFormat(PEFT_METHOD, feedforward=True, export=_CONVS, reshape=chained(channel_vector("ia3_l", axis=0))),
}
