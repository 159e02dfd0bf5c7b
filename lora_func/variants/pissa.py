"""PiSSA (Meng, Wang, Zhang 2024, arXiv 2404.02948): LoRA initialised on the principal
singular triplets of the base weight, on top of the frozen residual.

``U, S, Vh = svd(W)`` (fp32); ``S_r = S[:r] / s``; trainable ``lora_A = diag(√S_r) Vh[:r]``
``(r, d_in)`` and ``lora_B = U[:, :r] diag(√S_r)`` ``(d_out, r)``; frozen buffer
``W_res = W − s·B A`` ``(d_out, d_in)``. ``W_eff = W_res + s·B A`` (= ``W`` at init up to SVD
round-off), bias unchanged. ``s = alpha/r`` (``alpha/√r`` with ``use_rslora``); ``s·B A``
at init is ``U_r diag(S_r) Vh_r`` whatever ``alpha`` is.

The base model is never touched: ``W_res`` lives in the adapter's buffers and reaches the
model through the overlay (peft instead overwrites the base weight in place). The forms
below therefore *replace* the base weight: they use the incoming ``W`` only for its dtype,
device and shape, never its values (see docs/variants/pissa.md).

``niter=0`` (default) takes the full SVD (peft ``init_lora_weights="pissa"``); ``niter=K>0``
is the randomized SVD of ``torch.svd_lowrank(W, q=r, niter=K)`` (peft ``"pissa_niter_K"``),
re-implemented here step for step so that its Gaussian test matrix comes from the given CPU
``generator`` instead of torch's global RNG.

PiSSA in peft's format: peft overwrites the base weight with the residual ``W_res = W − s·B0 A0``,
so a PiSSA checkpoint as peft saves it by default is relative to a base nobody else has.
``save_peft`` therefore writes what peft's ``save_pretrained(path_initial_model_for_weight_conversion=...)``
writes: the plain LoRA ``ΔW = s·(B A − B0 A0) = s·[B, −B0][A; A0]`` of rank ``2r`` (same scale)
relative to the untouched base. lora_func does not keep ``A0, B0``: it recovers them from
``s·B0 A0 = W − W_res`` by an SVD (rank ``r`` exactly, up to fp32 round-off), which needs the
base weights (``model=``) and works for any PiSSA adapter, including a randomized-SVD one or one
loaded from a file. A peft PiSSA checkpoint saved without the conversion
(``init_lora_weights="pissa"``) loads as a pissa adapter whose residual is recomputed from the
base exactly as peft does on load.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftLayer, Slot, TensorDict, Variant, whole
from lora_func.variants import lora
from lora_func.variants._kernels import base_plus_low_rank, base_plus_product, half_product_applies, lora_scale, lowrank_input


def svd_lowrank(weight: Tensor, q: int, niter: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.svd_lowrank(weight, q, niter)`` (Halko et al. 2009, Alg. 4.4 + 5.1), with the
    Gaussian test matrix drawn on the CPU from ``generator``.

    Same operations in the same order as ``torch._lowrank._svd_lowrank`` (torch 2.13), so on
    the CPU it equals ``torch.manual_seed(seed); torch.svd_lowrank(...)`` for a generator
    seeded with ``seed``; on any other device the draw is the same CPU draw, moved. Returns
    ``U (m, q), S (q,), V (n, q)`` with ``weight ≈ U diag(S) Vᵀ``.
    """
    m, n = weight.shape[-2:]
    a = weight.mH if m < n else weight  # work on the tall orientation, as torch does
    gauss = torch.randn(a.shape[-1], q, generator=generator, dtype=a.dtype).to(a.device)
    basis = torch.linalg.qr(torch.matmul(a, gauss)).Q
    for _ in range(niter):
        basis = torch.linalg.qr(torch.matmul(a.mH, basis)).Q
        basis = torch.linalg.qr(torch.matmul(a, basis)).Q
    small = torch.matmul(basis.mH, a)
    u, s, vh = torch.linalg.svd(small, full_matrices=False)
    v = vh.mH
    u = basis.matmul(u)
    if m < n:
        u, v = v, u
    return u, s, v


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, s, niter = info.r, lora_scale(info), info.option("niter")
    # fp32 at least (fp64 bases keep fp64): the SVD and the residual never run in half precision.
    w = weight.to(torch.promote_types(weight.dtype, torch.float32))
    if niter == 0:
        u, sv, vh = torch.linalg.svd(w, full_matrices=False)
        u_r, s_r, vh_r = u[:, :r], sv[:r], vh[:r]
    else:
        u_r, s_r, v_r = svd_lowrank(w, r, niter, generator)
        vh_r = v_r.T
    s_r = s_r / s
    # peft's exact operations (tuners/lora/layer.py pissa_init), so the tensors match it bit for bit.
    lora_a = torch.diag(torch.sqrt(s_r)) @ vh_r
    lora_b = u_r @ torch.diag(torch.sqrt(s_r))
    w_res = w - s * lora_b @ lora_a
    # The residual keeps the more precise of the base and adapter dtypes, so an adapter-dtype
    # opt-out (e.g. bf16 adapter on an fp32 base) does not round the frozen base part.
    res_dtype = torch.promote_types(weight.dtype, dtype)
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}
    return params, {"W_res": w_res.to(weight.device, res_dtype).contiguous()}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    # ``weight`` is deliberately unused beyond its dtype: PiSSA replaces the base by W_res.
    w_res = buffers["W_res"].to(weight.dtype)
    return w_res + lora_scale(info, buffers) * (params["lora_B"] @ params["lora_A"]), bias


class ResidualLayer:
    """The base layer with the frozen residual ``W_res (d_out, d_in)`` in place of its weight
    (peft's residualised base: ``F.linear`` in the base dtype, the layer's bias and training
    flag kept), so the residual family's low-rank path runs as LoRA's does, through
    :func:`base_plus_product`'s one node on a half-precision base."""

    replays_weight = True

    def __init__(self, w_res: Tensor, base: BaseLayer) -> None:
        self.weight = w_res.to(base.weight.dtype)
        self.bias = base.bias
        self.training = getattr(base, "training", False)

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def residual_plus_low_rank(residual: ResidualLayer, x: Tensor, dropped: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``residual(x) + (dropped aᵀ) bᵀ`` (``a (r, d_in)``, ``b (d_out, r)``, any scale folded
    into ``b``): LoRA's kernels with the residual as the base."""
    if dropped is x and half_product_applies(residual, x, a):
        return base_plus_product(residual, x, a, b)
    return base_plus_low_rank(residual, x, dropped.to(a.dtype) @ a.T, b)


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # Not base(x): the base op multiplies by W, and base(x) − x (W − W_res)ᵀ would cancel two
    # large terms. The residual runs like the base layer would (base dtype, bias included),
    # as peft's residualised base layer does; the low-rank path as in LoRA.
    dropped = lowrank_input(x, base, info)
    lora_b = params["lora_B"] * lora_scale(info, buffers)
    return residual_plus_low_rank(ResidualLayer(buffers["W_res"], base), x, dropped, params["lora_A"], lora_b)


def as_peft_lora(params: TensorDict, buffers: TensorDict, weight: Tensor | None, info: LayerInfo) -> PeftLayer:
    """PiSSA as a plain LoRA of rank 2r on the untouched base (peft's conversion):
    ``A' = [A; A0] (2r, d_in)``, ``B' = [B, −B0] (d_out, 2r)``, same scale; ``weight (d_out, d_in)``
    is the untouched base weight."""
    assert weight is not None  # export_needs_base: the writer passes the base weight
    r, s = info.r, lora_scale(info)

    def tensors() -> TensorDict:
        w_res = buffers["W_res"]
        compute = torch.promote_types(w_res.dtype, torch.float32)
        # s·B0 A0 = W − W_res; its top-r SVD gives factors with exactly that product up to round-off.
        initial = weight.to(compute) - w_res.to(compute)
        u, sv, vh = torch.linalg.svd(initial, full_matrices=False)
        root = torch.sqrt(sv[:r] / s)
        a0, b0 = root[:, None] * vh[:r], u[:, :r] * root[None, :]
        dtype = params["lora_A"].dtype
        lora_a = torch.cat([params["lora_A"], a0.to(dtype)], dim=0)
        lora_b = torch.cat([params["lora_B"], -b0.to(dtype)], dim=1)
        return {"lora_A": lora_a, "lora_B": lora_b}

    rslora = dict(info.options).get("use_rslora", False)
    # peft's conversion: rank 2r, alpha 2·alpha (alpha·√2 with rsLoRA), so the scale is unchanged.
    return PeftLayer(tensors, r=2 * r, alpha=info.alpha * (math.sqrt(2) if rslora else 2))


# The frozen residual that replaces the base weight: peft's file never holds it (peft rebuilds its
# residualised base on load, and so does load_peft, with the variant's init on the base).
RESIDUAL = {"W_res": Slot(lambda i: (i.d_out, i.d_in), buffer=True)}
# The adapter is relative to the exact base it was built from, replaces its weight, and takes r
# of its singular (or QR) directions.
RESIDUAL_TRAITS = frozenset({"records_base", "replaces_weight", "rank_within_layer"})


def residual_variant(name: str, init: Any, **changes: Any) -> Variant:
    """A LoRA-family variant on a frozen residual (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA): LoRA's
    tensors plus ``W_res``, this file's forms, ``init`` and ``changes`` (its options)."""
    return lora.derived(
        name,
        init,
        tensors=lora.TENSORS | RESIDUAL,
        weight_form=weight_form,
        activation_form=activation_form,
        traits=RESIDUAL_TRAITS,
        **changes,
    )


def stored_converted(label: str, *, init: str | None = None) -> PeftFormat:
    """A residual variant's peft format: written as a plain LoRA on the untouched base (peft's
    ``path_initial_model_for_weight_conversion`` output, :func:`as_peft_lora`); a peft checkpoint
    saved without the conversion (``init_lora_weights=init``) reads as this variant with its
    residual recomputed from the base, as peft does on load (``init=None``: never read)."""
    return lora.stored_as_lora(
        reads=None if init is None else {"use_dora": False, "init_lora_weights": init},
        export=as_peft_lora,
        export_needs_base=(
            f"peft's format stores {label} as a LoRA relative to the untouched base, and its initial factors are "
            f"recovered from W − W_res"
        ),
    )


# niter=0: the full SVD (peft's init_lora_weights="pissa"); K > 0: peft's "pissa_niter_K", which a
# converted checkpoint does not record.
VARIANT = residual_variant("pissa", init, options=lora.OPTIONS | {"niter": Option(0, whole(0, why="0: full SVD; K > 0: randomized SVD with K subspace iterations, peft's 'pissa_niter_K'"))})
PEFT = stored_converted("PiSSA", init="pissa")
