"""HRA, Householder Reflection Adaptation (Yuan, Liu, Xu, arXiv 2405.17484), following HF
peft's ``tuners/hra/layer.py`` (``apply_GS=False``).

Trainable ``hra_u (d_in, r)``, one column per reflection. With ``û_i = u_i / ‖u_i‖`` and
``H_i = I − 2 û_i û_iᵀ``:

    R = H_0 H_1 ⋯ H_{r−1}   (d_in × d_in, never built here)
    W_eff = W R,   bias unchanged,   y = x Rᵀ Wᵀ + b

Activation form: the reflections act on ``x`` from the LAST column to the FIRST
(``x ← x − 2 (x·û_i) û_iᵀ`` for ``i = r−1 … 0``), then the base layer. Weight form: the
reflections act on the rows of ``W`` from the FIRST column to the LAST. Both apply the ``r``
reflections at once through the compact WY form ``R = I − Û T Ûᵀ`` (``T`` upper triangular,
``r × r``, :func:`reflection_wy`), so neither builds a ``d_in × d_in`` matrix nor loops over
the reflections.

Init (``init="paired"``, default, peft's ``init_weights=True``): ``half ~
kaiming_uniform((d_in, r/2), a=√5)``, ``U = repeat_interleave(half, 2, dim=1)``, so each
reflection is undone by the next and ``R = I``. An odd ``r`` cannot be paired: peft only
warns and silently starts from a non-identity adapter; lora_func raises ``ValueError``
unless ``init="random"`` (peft's ``init_weights=False``: every column kaiming-uniform) is
asked for explicitly.

A column whose norm is below ``1e-30`` is treated as the zero vector (its reflection is the
identity) instead of dividing by ~0 (peft gives inf/NaN there); above it the math is peft's.
Gram-Schmidt (peft ``apply_GS=True``) is not offered.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import (
    promoted,
    base_plus_low_rank,
    base_plus_product,
    half_product_applies,
    kaiming_uniform,
)
from lora_func.variants._conv import peft_conv_layers
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of

INITS = ("paired", "random")
_MIN_NORM = 1e-30


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, d_in = info.r, info.d_in
    if info.option("init") == "random":
        u = kaiming_uniform((d_in, r), a=math.sqrt(5), generator=generator)
    else:
        if r % 2:
            even = f"r={r + 1}" + (f" or r={r - 1}" if r > 1 else "")
            raise ValueError(  # error: hra-odd-rank
                f"hra: r={r} is odd, but the default init='paired' needs an even r (pairs of identical "
                f"reflections make the adapter exactly the identity at init). Use {even}, or pass "
                f"init='random' to start from random reflections (not the identity at init; peft's "
                f"behaviour for odd r)."
            )
        half = kaiming_uniform((d_in, r // 2), a=math.sqrt(5), generator=generator)
        u = torch.repeat_interleave(half, 2, dim=1)
    return {"hra_u": u.to(weight.device, dtype)}, {}


def unit_columns(u: Tensor) -> Tensor:
    """``u / ‖u‖`` per column, the norm taken in at least fp32; result in ``u``'s dtype."""
    ct = promoted(u.dtype, torch.float32)
    uc = u.to(ct)
    norm = torch.linalg.vector_norm(uc, dim=0, keepdim=True).clamp(min=_MIN_NORM)
    return (uc / norm).to(u.dtype)


def reflection_wy(u_hat: Tensor) -> Tensor:
    """``T (r, r)``, upper triangular, with ``H_0 H_1 ⋯ H_{r−1} = I − Û T Ûᵀ``.

    The compact WY form of a product of Householder reflections (Schreiber and Van Loan 1989;
    LAPACK's ``larft``) in Puglisi's closed form ``T⁻¹ = I/2 + striu(ÛᵀÛ)`` for unit columns
    (``τ = 2``); a zero column contributes nothing. It lets both forms apply all ``r``
    reflections with two rank-``r`` products instead of ``r`` sequential rank-1 updates, each
    a pass over (and, for backward, a saved copy of) the whole input.
    """
    # The r x r solve runs in at least fp32 (as every solve in lora_func); returned in u_hat's dtype.
    ct = promoted(u_hat.dtype, torch.float32)
    uc = u_hat.to(ct)
    eye = torch.eye(u_hat.shape[-1], dtype=ct, device=u_hat.device)
    t_inv = 0.5 * eye + torch.triu(uc.transpose(-1, -2) @ uc, diagonal=1)
    return torch.linalg.solve_triangular(t_inv, eye, upper=True).to(u_hat.dtype)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    u_hat = unit_columns(params["hra_u"]).to(weight.dtype)
    # W R = W − (W Û) T Ûᵀ
    return weight - ((weight @ u_hat) @ reflection_wy(u_hat)) @ u_hat.transpose(-1, -2), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    u_hat = unit_columns(params["hra_u"])
    # base(x Rᵀ) with x Rᵀ = x − (x Û) Tᵀ Ûᵀ (all r reflections of x at once) is
    # base(x) − ((x Û) Tᵀ) (W Û)ᵀ: the same reflections, pushed through the frozen weight. So the
    # layer is LoRA-shaped (two rank-r products plus W Û, an (d_out, r) product) and never
    # builds the reflected (n, d_in) input, a full copy of x and a pass over it each way.
    # The low-rank path runs in the adapter dtype, as every variant's.
    # Ûᵀ (r, d_in) contiguous: x Û then runs as x (Ûᵀ)ᵀ, the layout BLAS is fastest with for
    # an (n, r) result, and autograd computes ∂Ûᵀ = ∂hᵀ x with its long axis last.
    ut = u_hat.transpose(-1, -2).contiguous()
    # The sign goes on the (d_out, r) factor, not on the (n, r) activations.
    minus_weight_u = -(base.weight.to(ut.dtype) @ ut.transpose(-1, -2))
    if half_product_applies(base, x, ut):
        # bf16 base: x Û Tᵀ = x (T Ûᵀ)ᵀ, one (r, d_in) factor, and the products on bf16 operands
        # (base_plus_product; docs/dtype.md).
        return base_plus_product(base, x, reflection_wy(u_hat) @ ut, minus_weight_u)
    h = (x.to(ut.dtype) @ ut.transpose(-1, -2)) @ reflection_wy(u_hat).transpose(-1, -2)
    return base_plus_low_rank(base, x, h, minus_weight_u)


VARIANT = Variant(
    name="hra",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={"hra_u": Slot(lambda i: (i.d_in, i.r), rank_axes=(1,), peft="hra_u")},
    options={"init": Option("paired", one_of(*INITS), "init_weights", mapped({"paired": True, "random": False}))},
    default_alpha=8.0,
    kind_forms={"linear": None, "conv1d": None, "conv": None},
)
# peft: HRAConfig(apply_GS=False), one rank for all layers; peft refuses HRA on GPT-2 Conv1D and
# adapts nn.Conv2d with square kernels (it reads a kernel as k[0]·k[0]).
PEFT = PeftFormat(
    PeftMethod("HRA", {"bias": "none", "apply_GS": False}, ("modules_to_save", "apply_GS"), rank=("r", None)),
    conv1d=False,
    export=peft_conv_layers("HRA", (2,), square=True),
)
