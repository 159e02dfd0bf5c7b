"""DEFT, Decompositional Efficient Fine-Tuning (and PaRa, its pure subspace removal), following
HF peft 0.21.2's ``tuners/deft/layer.py`` (``DeftLinear``).

Trainable ``deft_P (d_out, r)``, a projection direction, and ``deft_R (r, d_in)``, an injection
(``r`` capped at ``d_out``, as peft). With ``Q`` and ``right`` from ``P`` by
``decomposition_method`` (``"relu"``: ``Q = P``, ``right = relu(P)``, a non-orthogonal
projection; ``"qr"``: ``Q = right`` the orthonormal factor of ``P``), ``P_proj = Q rightᵀ``:

    W_eff = (I − P_proj) W + s·Q R = W + Q (s·R − rightᵀ W),   bias unchanged

``s = injection_alpha / r`` (peft's ``alpha``; ``None``: 1). ``para=True`` (PaRa) drops the
injection: ``W_eff = W − Q rightᵀ W``, ``P`` the only tensor. Both forms work on the
``(r, d_in)`` factor ``M = rightᵀ W``: the activation form is the rank-``r`` product
``base(x) + (x (s·R − M)ᵀ) Qᵀ`` (the ``dropout`` option, peft's ``deft_dropout``, acts on the
injection's input only, as peft), so no ``(d_out, d_out)`` projector and no ``W_eff`` is built.
The projection and ``M`` are computed in at least float32 (peft: float32 always).

Init as peft (``init="identity"``, peft's ``init_weights=True``): ``P ~ N(0, 0.02²)`` from the
generator in peft's order (one draw per layer, module order), ``R = rightᵀ W / s``, so the
adapter is the identity at init (exactly, for ``s = 1``). ``init="random"`` (``False``):
``R ~ N(0, (0.02·init_scale)²)``. PaRa is never the identity at init.

A stack of adapters of different ranks pads ``P``'s columns and ``R``'s rows
(``Variant.padded_axes``: their size is ``min(r, d_out)``, not ``r``) and each member masks them
by its own rank; with ``"qr"`` the orthonormal factor's padded columns are masked too (QR of a
zero-padded ``P`` keeps the member's own columns and adds orthonormal ones for the padding).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, Check, FLAG, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, is_finite_number, mapped, one_of, real
from lora_func.variants._kernels import base_plus_low_rank, base_plus_product, lowrank_input, promoted
from lora_func.variants._options import dropout_option

METHODS = ("relu", "qr")
INITS = ("identity", "random")


def rank(info: LayerInfo) -> Any:
    """The layer's rank: ``r`` capped at ``d_out`` (peft caps it; QR has at most ``d_out`` columns)."""
    return info.r.clamp(max=info.d_out) if isinstance(info.r, Tensor) else min(info.r, info.d_out)


def scale(info: LayerInfo) -> Any:
    """``s = injection_alpha / r``, or 1 where ``injection_alpha`` is ``None`` (peft's ``alpha``)."""
    alpha = info.option("injection_alpha")
    return 1.0 if alpha is None else alpha / rank(info)


def own(params: TensorDict, info: LayerInfo) -> TensorDict:
    """``params`` with a rank-padded stack member's padding zeroed (``info.r`` its own rank, a
    tensor): ``P``'s columns and ``R``'s rows past ``min(r, d_out)``. One adapter: unchanged."""
    if not isinstance(info.r, Tensor):
        return params
    keep = (torch.arange(params["deft_P"].shape[1], device=info.r.device) < rank(info)).to(params["deft_P"].dtype)
    out = {"deft_P": params["deft_P"] * keep}
    if "deft_R" in params:
        out["deft_R"] = params["deft_R"] * keep[:, None]
    return out


def project(p: Tensor, info: LayerInfo) -> tuple[Tensor, Tensor]:
    """``(Q, right) (d_out, r)`` with ``P_proj = Q rightᵀ``, in at least float32."""
    p = p.to(promoted(p.dtype, torch.float32))
    if info.option("decomposition_method") == "relu":
        return p, torch.relu(p)
    if not isinstance(info.r, Tensor):
        q = torch.linalg.qr(p).Q
        return q, q
    # A stack member: its zero padding would make QR's backward divide by zero, so the padded
    # columns hold the identity's columns there (QR is column by column: the member's own columns
    # of Q do not depend on them), and Q's padded columns are then masked out.
    keep = (torch.arange(p.shape[1], device=p.device) < rank(info)).to(p.dtype)
    q = torch.linalg.qr(p * keep + torch.eye(*p.shape, dtype=p.dtype, device=p.device) * (1 - keep)).Q
    return q * keep, q * keep


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r = rank(info)
    p = torch.empty(info.d_out, r, dtype=torch.float32).normal_(0.0, 0.02, generator=generator).to(weight.device, dtype)
    if info.option("para"):
        return {"deft_P": p}, {}
    if info.option("init") == "random":
        r_init = torch.empty(r, info.d_in, dtype=torch.float32).normal_(0.0, 0.02 * info.option("init_scale"), generator=generator)
    else:
        # R = rightᵀ W / s from the stored P: s·R − rightᵀ W is then exactly zero for s = 1
        _, right = project(p, info)
        r_init = (right.T @ weight.to(right.dtype)) / scale(info)
    return {"deft_P": p, "deft_R": r_init.to(weight.device, dtype)}, {}


def low_rank_factor(params: TensorDict, right: Tensor, weight: Tensor, info: LayerInfo) -> Tensor:
    """``s·R − rightᵀ W (r, d_in)`` (PaRa: ``−rightᵀ W``), in ``right``'s dtype."""
    m = right.T @ weight.to(right.dtype)
    if info.option("para"):
        return -m
    return scale(info) * params["deft_R"] - m  # (a narrower R promotes to right's dtype)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    params = own(params, info)
    q, right = project(params["deft_P"], info)
    # (a bf16 adapter's W plus the float32 delta: float32, rounded once by the core)
    return weight + q @ low_rank_factor(params, right, weight, info), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """``base(x) + (x (s·R − rightᵀ W)ᵀ) Qᵀ``: the removal and the injection as one rank-``r``
    path (with dropout in a training step, the injection's input dropped alone, as peft)."""
    params = own(params, info)
    q, right = project(params["deft_P"], info)
    # PaRa has no injection to drop out: no draw
    dropped = x if info.option("para") else lowrank_input(x, base, info)
    if dropped is x:
        # LoRA's kernel for base(x) + (x Aᵀ) Bᵀ (on a bf16 base: bf16 products, no fp32 copy of x)
        return base_plus_product(base, x, low_rank_factor(params, right, base.weight, info), q)
    m = right.T @ base.weight.to(right.dtype)
    h = dropped.to(q.dtype) @ (scale(info) * params["deft_R"].to(q.dtype)).T - x.to(q.dtype) @ m.T
    return base_plus_low_rank(base, x, h, q)


def _no_injection(info: LayerInfo) -> bool:
    return bool(info.option("para"))


VARIANT = Variant(
    name="deft",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # min(r, d_out) wide: padded (masked by the forms), not rank axes of size r
    tensors={
        "deft_P": Slot(lambda i: (i.d_out, rank(i)), padded_axes=(1,), peft="deft_P"),
        # PaRa (para=True) has no injection
        "deft_R": Slot(lambda i: None if _no_injection(i) else (rank(i), i.d_in), padded_axes=(0,), peft="deft_R"),
    },
    options={
        "decomposition_method": Option("relu", one_of(*METHODS), "decomposition_method"),
        "para": Option(False, FLAG, "para"),
        # peft's alpha (None: s = 1); AdapterSpec's own alpha is not used
        "injection_alpha": Option(
            None,
            Check(lambda v: v is None or (is_finite_number(v) and v != 0), "must be None or a finite non-zero number (s = injection_alpha / r)"),
            "alpha",
        ),
        "init": Option("identity", one_of(*INITS), "init_weights", mapped({"identity": True, "random": False})),
        "init_scale": Option(1.0, real(0), "init_scale"),
        "dropout": dropout_option("deft_dropout"),
    },
    default_alpha=1.0,  # not used: the scale is injection_alpha / r
)
# peft: DeftConfig (r, no rank_pattern; alpha an option since null means s = 1).
PEFT = PeftFormat(PeftMethod("DEFT", rank=("r", None)))
