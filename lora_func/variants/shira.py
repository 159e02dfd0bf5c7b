"""SHiRA, Sparse High Rank Adapters (Bhardwaj et al., NeurIPS 2024, arXiv 2406.13175), following
HF peft's ``tuners/shira/layer.py`` and ``tuners/shira/mask_functions.py``.

Trainable ``shira_weight (n,)`` at fixed positions ``shira_indices (2, n)`` (int64 row,
column; a buffer) of the ``(d_out, d_in)`` weight, ``n = r·(d_in + d_out)`` (as many values as
a rank-``r`` LoRA; the update is not of rank ``r``, it is sparse and high rank):

    ΔW[rows_k, cols_k] = w_k,   W_eff = W + ΔW,   bias unchanged

Positions (``mask_type="random"``, peft's default): the first ``n`` entries of
``torch.randperm(d_out·d_in)`` from a CPU generator seeded with ``random_seed`` (``None``:
``torch.Generator()``'s default seed, as peft), sorted row-major as peft's ``torch.where``
over the mask gives them. ``mask_type="custom"``: positions are yours: build with
``"random"`` and replace them with ``adapter.with_buffers``, or load a peft checkpoint (it
stores the positions, whatever mask made them). Init (``init_weights=True``): zeros, the
identity; ``False``: standard normal (peft's test init).

The weight form builds the dense ``ΔW`` by a ``scatter_add`` (repeated positions sum, as peft's
coalesced sparse tensor). The activation form is peft's forward: the values added into a copy of
``W`` at their positions (``index_put``, in the base dtype), then one product; no dense ``ΔW``
in the adapter dtype and no second product (a dequantized weight on a quantized base). peft's ``scaling`` (1.0, not in its
config; ``set_scale`` at inference only) is not offered. peft refuses GPT-2 ``Conv1D``;
lora_func adapts it (``ΔW`` in the canonical ``(d_out, d_in)`` layout).

A stack of adapters of different ``r`` zero-pads the values and positions to the largest
(``Variant.padded_axes``); each member masks the values past its own ``r·(d_in + d_out)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants import FLAG, BaseLayer, Check, Codec, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, is_finite_number, one_of
from lora_func.variants._sparse import own_values, peft_randperm_positions, scatter_dense

MASK_TYPES = ("random", "custom")


def size(info: LayerInfo) -> int:
    """``n = r·(d_in + d_out)``, the layer's number of trainable values."""
    return info.r * (info.d_in + info.d_out)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    n = size(info)
    if n > info.d_in * info.d_out:
        raise ValueError(  # error: shira-too-many
            f"shira: r={info.r} asks for r·(d_in + d_out) = {n} values, more than the layer's {info.d_out}×{info.d_in} = "
            f"{info.d_in * info.d_out} weights (d_in={info.d_in}, d_out={info.d_out}); lower r to at most "
            f"{info.d_in * info.d_out // (info.d_in + info.d_out)}"
        )
    if info.option("mask_type") == "custom":
        raise ValueError(  # error: shira-custom-mask
            "shira: mask_type='custom' positions are yours to give: build the adapter with mask_type='random' and "
            "replace each layer's '<module>.shira_indices' (2, r·(d_in + d_out)) int64 rows and columns with "
            "adapter.with_buffers(...), or load a peft checkpoint, which stores them"
        )
    positions = peft_randperm_positions(info.d_out, info.d_in, n, info.option("random_seed"))
    # peft: torch.where over the 0/1 mask, i.e. the positions sorted row-major.
    order = torch.argsort(positions[0] * info.d_in + positions[1])
    positions = positions[:, order]
    values = torch.zeros(n) if info.option("init_weights") else torch.randn(n, generator=generator)
    return {"shira_weight": values.to(weight.device, dtype)}, {"shira_indices": positions.to(weight.device)}


def delta(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> Tensor:
    """``ΔW (d_out, d_in)`` in the adapter dtype."""
    # In a stack of different r, info.r is the member's own (a tensor): its padding is masked.
    values = own_values(params["shira_weight"], info.r * (info.d_in + info.d_out))
    return scatter_dense(values, buffers["shira_indices"], (info.d_out, info.d_in))


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + delta(params, buffers, info).to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # peft's forward: the values added into (a copy of) W at their positions, then one product.
    # One weight-sized write in the base dtype; no dense ΔW in the adapter dtype.
    weight = base.weight
    values = own_values(params["shira_weight"], info.r * (info.d_in + info.d_out))
    rows, cols = buffers["shira_indices"]
    return F.linear(x, weight.index_put((rows, cols), values.to(weight.dtype), accumulate=True), base.bias)


def _size(info: LayerInfo) -> int:
    return info.r * (info.d_in + info.d_out)


VARIANT = Variant(
    name="shira",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # r in the config (no tensor has r as a size); the positions are in the checkpoint (peft
    # writes '<module>.shira_indices', int32, and reads them back whatever the mask).
    tensors={
        "shira_weight": Slot(lambda i: (_size(i),), padded_axes=(0,), peft="shira_weight"),
        "shira_indices": Slot(lambda i: (2, _size(i)), padded_axes=(1,), buffer=True, integer=True, peft="shira_indices"),
    },
    options={
        # peft's config holds any other mask's name; lora_func reads it as "custom"
        "mask_type": Option("random", one_of(*MASK_TYPES), "mask_type", Codec(lambda v: v, lambda v: "custom" if isinstance(v, str) and v != "random" else v)),
        "random_seed": Option(
            None,
            Check(lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0), "must be None or an integer >= 0 (a torch.Generator seed)"),
            "random_seed",
            # peft may write a whole float
            Codec(lambda v: v, lambda v: int(v) if is_finite_number(v) and int(v) == v else v),
        ),
        "init_weights": Option(True, FLAG, "init_weights"),
    },
    default_alpha=1.0,  # not used: SHiRA has no scale
)
# peft: ShiraConfig (no bias field: peft warns on unknown fields).
PEFT = PeftFormat(PeftMethod("SHIRA", {}, rank=("r", None)), conv1d=False)
