"""GraLoRA, granular low-rank adaptation (Jung et al., arXiv 2505.20355), following HF peft's
``tuners/gralora/layer.py``.

The weight is cut into a ``k × k`` grid (``k = gralora_k``); block ``(m, n)`` (output block
``m``, input block ``n``) gets its own LoRA of rank ``s = r / k``. peft stores the ``k²`` block
factors in two tensors: ``gralora_A (k, d_in/k, r)`` holds, for input block ``n``, the ``k``
down-projections side by side (``r = (m, s)``, output block ``m`` major), and
``gralora_B (k, r, d_out/k)`` holds, for output block ``m``, the up-projections of the ``k``
input blocks (``r = (n, s)``). With ``t = alpha / (r + hybrid_r)``:

    ΔW[m, n] = t · B[m][n·s:(n+1)·s]ᵀ A[n][:, m·s:(m+1)·s]ᵀ       (d_out/k × d_in/k)

so ΔW has rank up to ``k·r`` from LoRA's parameter count. ``hybrid_r > 0`` adds a plain LoRA
``t · gralora_B_general (d_out, hybrid_r) @ gralora_A_general (hybrid_r, d_in)``.

Activation form, as peft's: ``h = x_n A_n`` per input block (``(..., k, r)``), regrouped so that
output block ``m`` reads the ``m``-th ``s``-chunk of every input block, then ``B_m``: LoRA's
cost, never the ``(d_out, d_in)`` update. The weight form builds the ``k × k`` blocks in one
``einsum``.

Init (peft's): ``init="default"``: every block's A kaiming-uniform (``a = √5``, fan-in
``d_in/k``), B zero (the hybrid part too), so ``ΔW = 0``; ``init="random"`` (peft's
``init_weights=False``): B kaiming-uniform too. ``dropout`` is peft's ``gralora_dropout`` on
the input in training steps, drawn separately for the block and the hybrid paths, as peft.

A rank-padded stack (members of ranks ``k·s₁ < k·s₂ ...``) zero-pads the ``r`` axes at their
end, which cuts across the ``(m, s)`` groups: the forms regroup a member's own entries (read
from its rank, a tensor there) into ``k`` groups of the padded ``s``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from lora_func.variants._kernels import kaiming_uniform, lowrank_input
from lora_func.variants._options import dropout_option
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, whole

INITS = ("default", "random")
HYBRID = ("gralora_A_general", "gralora_B_general")


def _check_layer(r: int, d_in: int, d_out: int, k: int) -> None:
    if r % k:
        raise ValueError(  # error: gralora-rank
            f"gralora: r={r} is not a multiple of gralora_k={k} (each of the k×k blocks has rank r/k); use r="
            f"{' or r='.join(str(v) for v in sorted({max(k, r - r % k), r + k - r % k}))}, or another gralora_k"
        )
    if d_in % k or d_out % k:
        raise ValueError(  # error: gralora-sizes
            f"gralora: the layer's sizes d_in={d_in}, d_out={d_out} are not both multiples of gralora_k={k} (the "
            f"weight is cut into a k×k grid); pick a gralora_k that divides both, or leave this layer out"
        )


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
    k, hybrid_r, rand = info.option("gralora_k"), info.option("hybrid_r"), info.option("init") == "random"
    _check_layer(r, d_in, d_out, k)
    a5 = math.sqrt(5)

    def up(shape: tuple[int, int]) -> Tensor:
        return kaiming_uniform(shape, a=a5, generator=generator) if rand else torch.zeros(shape)

    # peft draws the k blocks as (r, d_in/k) / (d_out/k, r) matrices and stores them transposed.
    blocks_a = [kaiming_uniform((r, d_in // k), a=a5, generator=generator) for _ in range(k)]
    blocks_b = [up((d_out // k, r)) for _ in range(k)]
    params = {
        "gralora_A": torch.stack(blocks_a).transpose(1, 2),
        "gralora_B": torch.stack(blocks_b).transpose(1, 2),
    }
    if hybrid_r:
        params |= {
            "gralora_A_general": kaiming_uniform((hybrid_r, d_in), a=a5, generator=generator),
            "gralora_B_general": up((d_out, hybrid_r)),
        }
    return {name: t.contiguous().to(weight.device, dtype) for name, t in params.items()}, {}


def _regroup(t: Tensor, axis: int, k: int, r: Tensor) -> Tensor:
    """A rank-padded member's ``r`` axis (its own ``r = k·s₁`` entries first, zeros after) as
    ``k`` groups of the padded ``s = r_pad / k``: entry ``(g, j)`` is the member's ``g·s₁ + j``
    where ``j < s₁``, else zero."""
    moved = t.movedim(axis, -1)
    r_pad = moved.shape[-1]
    s_own = r / k
    group = torch.arange(k, device=t.device, dtype=r.dtype)[:, None]
    within = torch.arange(r_pad // k, device=t.device, dtype=r.dtype)[None, :]
    valid = (within < s_own).expand(k, -1).reshape(-1)
    index = (group * s_own + within).clamp(max=r_pad - 1).reshape(-1).long()
    picked = torch.gather(moved, -1, index.expand(*moved.shape[:-1], r_pad)) * valid.to(t.dtype)
    return picked.movedim(-1, axis)


def blocks(params: TensorDict, info: LayerInfo) -> tuple[Tensor, Tensor]:
    """``gralora_A``, ``gralora_B`` in peft's layout, regrouped for a rank-padded member."""
    a, b = params["gralora_A"], params["gralora_B"]
    if isinstance(info.r, Tensor):  # a member of a rank-padded stack (padded_member)
        k = info.option("gralora_k")
        a, b = _regroup(a, -1, k, info.r), _regroup(b, -2, k, info.r)
    return a, b


def scale(info: LayerInfo) -> float | Tensor:
    """``alpha / (r + hybrid_r)``."""
    return info.alpha / (info.r + info.option("hybrid_r"))


def delta_weight(params: TensorDict, info: LayerInfo) -> Tensor:
    """``ΔW (d_out, d_in)``: the ``k × k`` blocks, plus the hybrid LoRA, times the scale."""
    k = info.option("gralora_k")
    a, b = blocks(params, info)
    a4 = rearrange(a, "n i (m s) -> n i m s", m=k)
    b4 = rearrange(b, "m (n s) o -> m n s o", n=k)
    dw = rearrange(torch.einsum("nims,mnso->moni", a4, b4), "m o n i -> (m o) (n i)")
    if "gralora_A_general" in params:
        dw = dw + params["gralora_B_general"] @ params["gralora_A_general"]
    return dw * scale(info)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + delta_weight(params, info).to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    k = info.option("gralora_k")
    a, b = blocks(params, info)
    t = scale(info)
    y = base(x)
    xd = lowrank_input(x, base, info).to(a.dtype)
    h = torch.einsum("...ni,nir->...nr", rearrange(xd, "... (n i) -> ... n i", n=k), a)
    # Output block m reads the m-th s-chunk of every input block's r features. The scale rides
    # on these (..., k, r) activations (not on the (..., d_out) outputs, nor on a scaled copy of
    # B that backward would have to keep).
    h = rearrange(h * t, "... n (m s) -> ... m (n s)", m=k)
    delta = rearrange(torch.einsum("...mr,mro->...mo", h, b), "... m o -> ... (m o)")
    if "gralora_A_general" in params:
        xh = lowrank_input(x, base, info).to(a.dtype)  # peft draws the hybrid path's dropout anew
        hybrid_h = (xh @ params["gralora_A_general"].transpose(-1, -2)) * t
        delta = delta + hybrid_h @ params["gralora_B_general"].transpose(-1, -2)
    return y + delta.to(y.dtype)


def peft_shapes(r: int, d_in: int, d_out: int, options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The layer's tensors and their shapes (the hybrid part only with ``hybrid_r``)."""
    k, hybrid_r = options["gralora_k"], options["hybrid_r"]
    shapes: dict[str, tuple[int, ...]] = {"gralora_A": (k, d_in // k, r), "gralora_B": (k, r, d_out // k)}
    if hybrid_r:
        shapes |= {"gralora_A_general": (hybrid_r, d_in), "gralora_B_general": (d_out, hybrid_r)}
    return shapes


def _slot(name: str, **declared: Any) -> Slot:
    return Slot(lambda i: peft_shapes(i.r, i.d_in, i.d_out, dict(i.options)).get(name), **declared)


VARIANT = Variant(
    name="gralora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "gralora_A": _slot("gralora_A", rank_axes=(2,), peft="gralora_A"),
        "gralora_B": _slot("gralora_B", rank_axes=(1,), peft="gralora_B"),
        "gralora_A_general": _slot("gralora_A_general", peft="gralora_A_general.weight"),
        "gralora_B_general": _slot("gralora_B_general", peft="gralora_B_general.weight"),
    },
    options={
        "gralora_k": Option(2, whole(1), "gralora_k"),
        "hybrid_r": Option(0, whole(0), "hybrid_r"),
        "dropout": dropout_option("gralora_dropout"),
        "init": Option("default", one_of(*INITS), "init_weights", mapped({"default": True, "random": False})),
    },
    default_alpha=16.0,  # peft's default scale: alpha / r = 64 / 32
)
# peft: GraloraConfig; one alpha for all layers (no alpha_pattern).
PEFT = PeftFormat(PeftMethod("GRALORA", rank=("r", None), alpha="alpha"))
