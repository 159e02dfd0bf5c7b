"""RoAd, 2D rotary adaptation (Liao, Monz, arXiv 2409.00119), following HF peft 0.21's
``tuners/road/layer.py`` (``_prepare_cols``, ``_apply_road``, ``_get_delta_weight``).

The layer OUTPUT (bias included) is rotated and scaled in pairs: the output features are cut
into groups of ``group_size``; within a group, feature ``j`` is paired with feature
``j + group_size/2``, and each pair ``(y₀, y₁)`` becomes

    (c₀·y₀ − s₀·y₁,  c₁·y₁ + s₁·y₀),   c = α cos θ,  s = α sin θ   (per feature)

    y' = c ⊙ y + s ⊙ rot(y),   rot(y) = (−y₁, y₀) per pair,   W_eff = R W,   b_eff = R b

with ``R`` the ``d_out × d_out`` matrix of those 2 × 2 blocks. Trainable ``road_theta`` and
``road_alpha``, sizes by ``road_variant`` (peft's config field ``variant``):

- ``road_1`` (default): ``(d_out/2,)``: one angle and scale per pair, shared by both features;
- ``road_2``: ``(d_out,)``: one per feature;
- ``road_4``: ``(2·d_out,)``: per group, ``group_size`` values for the cosines then
  ``group_size`` for the sines (``θ`` and ``α`` alike), so ``c`` and ``s`` are independent.

Activation form: the base output rotated elementwise (``einops`` reshape to ``(…, groups, 2,
group_size/2)``): two multiplies and an add over ``(n, d_out)``, no matrix. Weight form: the same
rotation applied to the columns of ``W`` and to ``b``.

Init (``init="identity"``, peft's ``init_weights=True``): ``θ = 0``, ``α = 1`` (``R = I``
exactly). ``init="random"`` (``init_weights=False``): ``θ ~ N(0, 0.5²)``, ``α ~ N(1, 0.5²)``.

Differences from peft: GPT-2 ``Conv1D`` is supported (peft refuses every layer but
``nn.Linear``). ``group_size`` must divide ``d_out`` as in peft; it must also be even (peft
reshapes by ``group_size // 2`` and fails with a shape error on an odd one).
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from lora_func.variants import BaseLayer, Check, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of

ROAD_VARIANTS = ("road_1", "road_2", "road_4")
INITS = ("identity", "random")
_PER_OUTPUT = {"road_1": 0.5, "road_2": 1, "road_4": 2}


def _size(d_out: int, road_variant: str) -> int:
    return int(d_out * _PER_OUTPUT[road_variant])


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    group = info.option("group_size")
    if info.d_out % group:
        raise ValueError(  # error: road-group-size
            f"road: group_size={group} does not divide the layer's d_out={info.d_out}; pass a group_size that divides "
            f"every target's output features (peft's default 64 is too large for small models), e.g. group_size=2"
        )
    size = _size(info.d_out, info.option("road_variant"))
    if info.option("init") == "random":
        # peft's nn.init.normal_ draws: one stream, theta first (bit-equal under one seed)
        theta = torch.empty(size, dtype=torch.float32).normal_(0.0, 0.5, generator=generator)
        alpha = torch.empty(size, dtype=torch.float32).normal_(1.0, 0.5, generator=generator)
    else:
        theta, alpha = torch.zeros(size, dtype=torch.float32), torch.ones(size, dtype=torch.float32)
    return {"road_theta": theta.to(weight.device, dtype), "road_alpha": alpha.to(weight.device, dtype)}, {}


def rotation_columns(params: TensorDict, info: LayerInfo) -> tuple[Tensor, Tensor]:
    """``(c, s)``, each ``(d_out,)``: the diagonal and the pair coefficient of ``R`` per output
    feature (peft's ``_prepare_cols``)."""
    theta, alpha = params["road_theta"], params["road_alpha"]
    half = info.option("group_size") // 2
    variant = info.option("road_variant")
    if variant == "road_4":
        # per group: g cosine values, then g sine values
        theta = rearrange(theta, "(groups two g) -> two (groups g)", two=2, g=2 * half)
        alpha = rearrange(alpha, "(groups two g) -> two (groups g)", two=2, g=2 * half)
        return alpha[0] * theta[0].cos(), alpha[1] * theta[1].sin()
    if variant == "road_1":
        # one value per pair: both halves of a group read it
        theta = rearrange(theta, "(groups h) -> groups h", h=half).repeat_interleave(2, dim=0).reshape(-1)
        alpha = rearrange(alpha, "(groups h) -> groups h", h=half).repeat_interleave(2, dim=0).reshape(-1)
    return alpha * theta.cos(), alpha * theta.sin()


def rotate_pairs(y: Tensor, c: Tensor, s: Tensor, half: int) -> Tensor:
    """``y (..., d_out)`` with each pair ``(j, j + half)`` of every group rotated and scaled:
    ``c ⊙ y + s ⊙ rot(y)``, ``rot`` mapping ``(y₀, y₁)`` to ``(−y₁, y₀)``."""
    grouped = rearrange(y, "... (groups two h) -> ... groups two h", two=2, h=half)
    rotated = torch.stack((-grouped[..., 1, :], grouped[..., 0, :]), dim=-2)
    return y * c + rearrange(rotated, "... groups two h -> ... (groups two h)") * s


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    c, s = rotation_columns(params, info)
    half = info.option("group_size") // 2
    # R W: every column of W (an output vector per input feature) rotated.
    w_eff = rotate_pairs(weight.transpose(-1, -2), c, s, half).transpose(-1, -2)
    return w_eff, None if bias is None else rotate_pairs(bias, c, s, half)


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    c, s = rotation_columns(params, info)
    y = base(x)
    # peft's order: the base output (bias included) cast to the adapter dtype, rotated, cast back.
    return rotate_pairs(y.to(c.dtype), c, s, info.option("group_size") // 2).to(y.dtype)


# features j and j + group_size/2 of a group are rotated together
EVEN = Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 2 and v % 2 == 0, "must be an even number >= 2 (features j and j + group_size/2 of a group are rotated together)")


VARIANT = Variant(
    name="road",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={name: Slot(lambda i: (_size(i.d_out, i.option("road_variant")),), peft=name) for name in ("road_theta", "road_alpha")},
    options={
        # peft's `variant`
        "road_variant": Option("road_1", one_of(*ROAD_VARIANTS), "variant"),
        "group_size": Option(64, EVEN, "group_size"),
        "init": Option("identity", one_of(*INITS), "init_weights", mapped({"identity": True, "random": False})),
    },
    default_alpha=1.0,
    traits=frozenset({"changes_bias"}),
)
# peft: RoadConfig (peft_type ROAD); its config has no `bias` field.
PEFT = PeftFormat(PeftMethod("ROAD", {}), conv1d=False)
