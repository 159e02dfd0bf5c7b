"""AntiPaSTO (Clark, arXiv 2601.07473; authors' code wassname/AntiPaSTO): a steerable SVD adapter.

The top-``r`` singular triplets of the frozen weight, ``W = U diag(S) Vᵀ + W_res`` (``U (d_out, r)``,
``S (r,)``, ``V (d_in, r)``, computed once in fp32), are frozen buffers. Trainable: additive
singular-value deltas ``delta_s (r,)`` and a rotation of the input basis ``V`` (optionally also of
``U``) by the Cayley transform of the skew part of ``P (r, r)`` (``P_u (r, r)`` for ``U``), with the
authors' tanh soft clamp. A steering coefficient ``alpha`` scales both::

    A   = a_lim · tanh((P − Pᵀ) / a_lim),   a_lim = 2·tan(max_rotation_angle / 2)
    R   = (I − alpha·A/2)⁻¹ (I + alpha·A/2)            (R(−alpha) = R(alpha)⁻¹ = R(alpha)ᵀ)
    W_eff = W_res + (U R_u) diag(S + alpha·delta_s) (V R)ᵀ,   W_res = W − U diag(S) Vᵀ

``alpha`` is a runtime input: the frozen per-layer buffer ``steer`` (shape ``()``, the option
``steer``, default 1.0), so ``torch.func.vmap`` over ``alpha`` works through
``adapter.with_buffers(with_steering(adapter.buffers, alpha))``.

Both forms are written as the base plus a rank-``r`` correction in the singular basis,
``W_eff = W + U M Vᵀ`` with the ``(r, r)`` matrix ``M = R_u diag(S + alpha·delta_s) Rᵀ − diag(S)``
(this is the formula above with ``W_res`` expanded), so the activation form is
``y = base(x) + ((x V) Mᵀ) Uᵀ``: LoRA's cost, no ``(d_out, d_in)`` residual stored or multiplied,
and ``alpha = 0`` (or ``delta_s = 0, P = 0``) gives ``M = 0`` exactly, i.e. the base model bit for
bit. ``W_res`` is never materialised; ``records_base=True`` makes ``load`` refuse a base whose
weights differ from the one ``U, S, V`` were computed from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank
from lora_func.variants import FLAG, BaseLayer, LayerInfo, Option, Slot, TensorDict, Variant, real

__all__ = ["VARIANT", "rotation", "trunc_normal", "with_steering"]

# The authors' init: delta_s ~ trunc_normal(mean=4e-4, std=4e-4), P = X − Xᵀ with
# X ~ trunc_normal(std=3e-3); truncation at torch's default absolute bounds [-2, 2].
DELTA_S_MEAN = 4e-4
DELTA_S_STD = 4e-4
P_STD = 3e-3
TRUNC_BOUNDS = (-2.0, 2.0)


def trunc_normal(
    shape: tuple[int, ...], *, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0, generator: torch.Generator
) -> Tensor:
    """``N(mean, std²)`` truncated to ``[a, b]`` (absolute bounds, as ``nn.init.trunc_normal_``), fp32, CPU.

    Inverse-CDF sampling in float64 from one ``torch.rand`` draw per element of ``generator``,
    so a seed gives the same tensor on every torch version (``trunc_normal_``'s algorithm has
    changed between releases).
    """
    lo = 0.5 * (1.0 + math.erf((a - mean) / (std * math.sqrt(2.0))))
    hi = 0.5 * (1.0 + math.erf((b - mean) / (std * math.sqrt(2.0))))
    u = lo + (hi - lo) * torch.rand(shape, generator=generator, dtype=torch.float64)
    x = mean + std * math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)
    return x.clamp(a, b).to(torch.float32)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # SVDs and Cayley solves in fp32 at least (fp64 adapters stay fp64).
    return torch.promote_types(dtype, torch.float32)


def rotation(p: Tensor, steer: Tensor, max_rotation_angle: float) -> Tensor:
    """The Cayley rotation ``R = (I − steer·A/2)⁻¹ (I + steer·A/2)``, ``A`` the clamped skew part of ``p``.

    Computed in fp32 (or fp64 for an fp64 ``p``); returns that dtype. ``max_rotation_angle`` is a
    static option: below π, ``A = a_lim·tanh((p − pᵀ)/a_lim)`` with ``a_lim = 2·tan(angle/2)``;
    at π or above (e.g. ``math.inf``) no clamp. The clamp bounds the rotation angle by
    ``max_rotation_angle`` only for ``r = 2`` and ``|steer| <= 1``; in general the angles are
    bounded by ``2·atan(|steer|·(r−1)·tan(angle/2))`` (see docs/variants/antipasto.md).
    """
    ct = _compute_dtype(p.dtype)
    p = p.to(ct)
    skew = p - p.transpose(-1, -2)
    if max_rotation_angle < math.pi:
        a_lim = 2.0 * math.tan(max_rotation_angle / 2.0)
        skew = a_lim * torch.tanh(skew / a_lim)
    half = steer.to(ct) * skew / 2.0
    eye = torch.eye(p.shape[-1], dtype=ct, device=p.device)
    # I − X is invertible for every real skew X (eigenvalues 1 ± iλ), so the solve never fails.
    return torch.linalg.solve(eye - half, eye + half)


def _core(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> Tensor:
    """``M = R_u diag(S + steer·delta_s) Rᵀ − diag(S)`` (r, r) in the compute dtype, so ``W_eff = W + U M Vᵀ``."""
    angle = info.option("max_rotation_angle")
    steer, s = buffers["steer"], buffers["S"]
    ct = _compute_dtype(s.dtype)
    s = s.to(ct)
    s_new = s + steer.to(ct) * params["delta_s"].to(ct)
    # (diag(s_new) Rᵀ): scale the rows of Rᵀ.
    core = s_new[:, None] * rotation(params["P"], steer, angle).transpose(-1, -2)
    if info.option("rotate_u"):
        core = rotation(params["P_u"], steer, angle) @ core
    return core - torch.diag_embed(s)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    """Top-``r`` SVD of ``weight`` (fp32) and the authors' random init.

    Runs once, outside any transform, so it may inspect values: it raises if ``r`` exceeds the
    numerical rank of ``weight`` (the extra singular vectors would span an arbitrary null-space
    basis), and it fixes the sign of each singular pair (largest-magnitude entry of each ``U``
    column positive) so the adapter does not depend on the SVD backend's sign convention.
    """
    if info.alpha != VARIANT.default_alpha:
        raise ValueError(  # error: antipasto-alpha
            f"antipasto does not use AdapterSpec.alpha (LoRA's scale numerator; got alpha={info.alpha}); "
            f"leave it unset. The steering coefficient is the option steer=... (default 1.0), or at run "
            f"time adapter.with_buffers(with_steering(adapter.buffers, alpha))"
        )
    r = info.r
    ct = _compute_dtype(dtype)
    u_full, s_full, vh_full = torch.linalg.svd(weight.detach().to(ct), full_matrices=False)
    tol = s_full[0] * max(weight.shape) * torch.finfo(ct).eps
    rank = int((s_full > tol).sum())
    if r > rank:
        raise ValueError(  # error: antipasto-rank
            f"antipasto r={r} exceeds the numerical rank {rank} of this weight {tuple(weight.shape)} "
            f"(singular values at or below {float(tol):.3g} count as zero); lower r to at most {rank}"
        )
    u, s, v = u_full[:, :r], s_full[:r], vh_full[:r].transpose(0, 1)
    pivot = u.abs().argmax(dim=0, keepdim=True)
    sign = torch.where(torch.gather(u, 0, pivot) < 0, -1.0, 1.0).to(ct)
    u, v = u * sign, v * sign

    def skew_init() -> Tensor:
        x = trunc_normal((r, r), std=P_STD, a=TRUNC_BOUNDS[0], b=TRUNC_BOUNDS[1], generator=generator)
        return x - x.T

    delta_s = trunc_normal((r,), mean=DELTA_S_MEAN, std=DELTA_S_STD, a=TRUNC_BOUNDS[0], b=TRUNC_BOUNDS[1], generator=generator)
    params = {"delta_s": delta_s, "P": skew_init()}
    if info.option("rotate_u"):
        params["P_u"] = skew_init()
    device = weight.device
    params = {k: t.to(device, dtype) for k, t in params.items()}
    buffers = {
        "U": u.to(device, dtype).contiguous(),
        "S": s.to(device, dtype).contiguous(),
        "V": v.to(device, dtype).contiguous(),
        "steer": torch.tensor(float(info.option("steer")), dtype=dtype, device=device),
    }
    return params, buffers


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    u, v = buffers["U"], buffers["V"]
    delta = (u @ _core(params, buffers, info).to(u.dtype)) @ v.transpose(-1, -2)
    return weight + delta.to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # x W_resᵀ + b = base(x) − ((x V) ⊙ S) Uᵀ, so
    # y = ((x V_rot) ⊙ (S + alpha·delta_s)) U_rotᵀ + x W_resᵀ + b = base(x) + ((x V) Mᵀ) Uᵀ.
    u, v = buffers["U"], buffers["V"]
    core = _core(params, buffers, info).to(u.dtype)
    return base_plus_low_rank(base, x, (x.to(v.dtype) @ v) @ core.transpose(-1, -2), u)


def with_steering(adapter_buffers: Mapping[str, Tensor], alpha: Tensor | float) -> dict[str, Tensor]:
    """``adapter_buffers`` with every antipasto ``steer`` buffer set to ``alpha`` (a new dict).

    For ``adapter.with_buffers(with_steering(adapter.buffers, alpha))``; ``alpha`` may be a
    batched scalar under ``torch.func.vmap``::

        f = lambda a: logits(adapter.with_buffers(with_steering(adapter.buffers, a)))
        torch.func.vmap(f)(torch.tensor([-1.0, 0.0, 1.0]))
    """
    # A Python number becomes a tensor in each buffer's own dtype directly (going through a
    # float32 tensor first would round 0.7 to 0.699999988 in an fp64 adapter).
    def steer(value: Tensor) -> Tensor:
        if isinstance(alpha, Tensor):
            return alpha.to(dtype=value.dtype, device=value.device).expand(value.shape)
        return torch.as_tensor(alpha, dtype=value.dtype, device=value.device).expand(value.shape)

    return {key: (steer(value) if key.rsplit(".", 1)[-1] == "steer" else value) for key, value in adapter_buffers.items()}


VARIANT = Variant(
    name="antipasto",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # P and P_u carry the rank on both axes: zero-padding both is exact, since the Cayley
    # transform of a block-diagonal skew matrix is block-diagonal with an identity block.
    tensors={
        "delta_s": Slot(lambda i: (i.r,), rank_axes=(0,)),
        "P": Slot(lambda i: (i.r, i.r), rank_axes=(0, 1)),
        "P_u": Slot(lambda i: (i.r, i.r) if i.option("rotate_u") else None, rank_axes=(0, 1)),
        "U": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,), buffer=True),
        "S": Slot(lambda i: (i.r,), rank_axes=(0,), buffer=True),
        "V": Slot(lambda i: (i.d_in, i.r), rank_axes=(1,), buffer=True),
        "steer": Slot(lambda i: (), buffer=True),
    },
    options={
        "max_rotation_angle": Option(math.pi / 3, real(0, closed="()", finite=False, why="radians; >= pi, e.g. math.inf, disables the clamp")),
        "rotate_u": Option(False, FLAG),
        "steer": Option(1.0, real()),
    },
    default_alpha=1.0,
    traits=frozenset({"records_base", "rank_within_layer"}),
)
