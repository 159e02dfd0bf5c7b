"""OSF, orthogonal subspace fine-tuning (Nayak et al. 2025, arXiv 2504.07097, "sculpting subspaces"),
following HF peft 0.21's ``tuners/osf/{layer,utils}.py``.

The SVD of each target weight ``W = U S Vᵀ`` (fp32, ``min(d_out, d_in) = m`` directions) is split
at ``k`` (the option ``effective_rank``): the top ``k`` directions (``U_high``, ``V_high``) stay
frozen, the other ``m − k`` are trained as ``osf_U (d_out, m−k)``, ``osf_S (m−k,)``, ``osf_V (m−k,
d_in)``, starting at their SVD values (``osf_U0``, ``osf_S0``, ``osf_V0``, frozen copies):

    W_eff = W + U diag(S) V − U0 diag(S0) V0 = W + [U S − U0 S0, U0 S0] [V; V − V0]
    y = base(x) + (x [V; V − V0]ᵀ) [U S − U0 S0, U0 S0]ᵀ

(the update as one product of rank ``2(m − k)``, as peft's, its differences taken on the factors).

As peft's gradient hooks, the gradients of ``osf_U`` and ``osf_V`` are projected off the frozen
subspace: ``∂U ← (I − U_high U_highᵀ) ∂U`` and ``∂V ← ∂V (I − V_highᵀ V_high)``, computed as peft
does: with ``U0 U0ᵀ ∂U`` where ``U`` is square (``d_out ≤ d_in``, the two agree) and with the
stored ``osf_U_high (d_out, k)`` otherwise (likewise ``V``, with ``osf_V_high (k, d_in)`` where
``d_out < d_in``). The forward value is the parameter itself (one autograd node per tensor whose
backward projects): ``torch.func.grad``, per-example gradients and optimisers see peft's gradient.

``effective_rank`` (peft's): ``None`` = ``m // 2`` per layer, an integer, or a fraction in ``(0, 1]``
of ``m`` (``int(m · f)``), resolved per layer into its ``LayerInfo.r`` (``k``); a layer where
``k`` is 0 or ``m`` (nothing frozen, or nothing to train) is refused. ``r`` of the spec and
``alpha`` are not used. peft saves ``U``, ``S``, ``V``; ``load_peft`` recomputes the SVD of the base
for the frozen ones, as peft does.

Init (``init="svd"``, peft's ``init_weights=True``): the SVD values, no change at init (exactly:
the factors' differences are zero). ``init="random"`` (``init_weights=False``): ``U``, ``S``, ``V``
``~ N(0, 1)`` in the base dtype, from the generator (peft draws from the global RNG).

Differences from peft: peft's ``rank_pattern`` is refused on load (compose adapters built with
different ``effective_rank`` on different layers instead); GPT-2 ``Conv1D`` is supported (peft's
OSF silently skips it, so ``save_peft`` refuses it there); ``init="random"`` draws from the
generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_product
from lora_func.variants import BaseLayer, Check, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, is_finite_number, mapped, one_of

INITS = ("svd", "random")


def _valid_rank(value: Any) -> bool:
    """peft's ``effective_rank``: ``None``, an integer >= 1, or a fraction in ``(0, 1]``."""
    if value is None:
        return True
    if isinstance(value, int):
        return not isinstance(value, bool) and value >= 1
    return is_finite_number(value) and 0 < value <= 1


def resolve(value: Any, smaller: int) -> int:
    """peft's ``_resolve_rank``: the frozen count ``k`` on a layer whose smaller side is ``smaller``."""
    if value is None:
        return smaller // 2
    k = int(smaller * value) if isinstance(value, float) else int(value)
    return max(min(smaller, k), 0)


def effective_ranks(r: int, infos: Mapping[str, LayerInfo]) -> dict[str, int]:
    """Each layer's ``k`` (its ``LayerInfo.r``) from the ``effective_rank`` option."""
    out = {}
    for module, info in infos.items():
        smaller = min(info.d_in, info.d_out)
        k = resolve(info.option("effective_rank"), smaller)
        if not 0 < k < smaller:
            raise ValueError(  # error: osf-effective-rank
                f"osf option effective_rank={info.option('effective_rank')!r} freezes {k} of the {smaller} directions of "
                f"{module} ({info.d_out}x{info.d_in}): OSF needs at least one frozen and one trained direction; pass an "
                f"integer in [1, {smaller - 1}], a fraction, or None (half)"
            )
        out[module] = k
    return out


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    k, base_dtype = info.r, weight.dtype
    u, s, vh = torch.linalg.svd(weight.to(torch.float32), full_matrices=False)
    # peft's decompose_weight_matrix: the fp32 SVD in the base dtype
    u, s, vh = u.to(base_dtype), s.to(base_dtype), vh.to(base_dtype)
    low = {"osf_U0": u[:, k:], "osf_S0": s[k:], "osf_V0": vh[k:, :]}
    if info.option("init") == "random":
        params = {name: torch.randn(low[f"{name}0"].shape, generator=generator, dtype=base_dtype) for name in ("osf_U", "osf_S", "osf_V")}
    else:
        # copies: S0 and V0 are contiguous slices that `.contiguous()` below would hand back as
        # they are, so an optimizer's in-place step on osf_S / osf_V would move the frozen copies too
        params = {name: low[f"{name}0"].clone() for name in ("osf_U", "osf_S", "osf_V")}
    buffers = dict(low)
    if info.d_out > info.d_in:
        buffers["osf_U_high"] = u[:, :k]
    if info.d_out < info.d_in:
        buffers["osf_V_high"] = vh[:k, :]
    return (
        {n: t.to(weight.device, dtype).contiguous() for n, t in params.items()},
        {n: t.to(weight.device, dtype).contiguous() for n, t in buffers.items()},
    )


def _projection(grad: Tensor, basis: Tensor, left: bool, complement: bool) -> Tensor:
    """``grad`` projected with ``basis``: on the left (``U``: ``basis (d_out, ·)``) or the right
    (``V``: ``basis (·, d_in)``), onto the basis's span or, ``complement``, off it (peft's hooks,
    in peft's operation order)."""
    part = basis @ (basis.transpose(-1, -2) @ grad) if left else (grad @ basis.transpose(-1, -2)) @ basis
    return grad - part if complement else part


class _ProjectedGradient(torch.autograd.Function):
    """The identity on ``t``, whose backward is :func:`_projection` of the gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(t: Tensor, basis: Tensor, left: bool, complement: bool) -> Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        _, basis, ctx.left, ctx.complement = inputs
        ctx.save_for_backward(basis)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (basis,) = ctx.saved_tensors
        return _projection(grad, basis, ctx.left, ctx.complement), None, None, None


def _projected_ops(t: Tensor, basis: Tensor, left: bool, complement: bool) -> Tensor:
    """:class:`_ProjectedGradient` in plain ops, for a trace (dynamo does not trace the node): the
    value ``t`` exactly (the projection of a zero tensor is zero), the gradient the same ops'."""
    d = t - t.detach()
    return t.detach() + _projection(d, basis, left, complement)


def _project(t: Tensor, buffers: TensorDict, side: str) -> Tensor:
    """``t`` (``osf_U`` or ``osf_V``) with its gradient projected off the frozen subspace: with the
    stored ``osf_<side>_high`` (off its span), or where the factor is square with ``osf_<side>0``
    (onto its span, the same projection)."""
    left = side == "U"
    high = buffers.get(f"osf_{side}_high")
    basis, complement = (buffers[f"osf_{side}0"], False) if high is None else (high, True)
    if torch.compiler.is_compiling():
        return _projected_ops(t, basis, left, complement)
    return _ProjectedGradient.apply(t, basis, left, complement)


def _trained(params: TensorDict, buffers: TensorDict) -> tuple[Tensor, Tensor, Tensor]:
    """``(U, S, V)`` with their gradients projected off the frozen subspace (peft's hooks)."""
    return _project(params["osf_U"], buffers, "U"), params["osf_S"], _project(params["osf_V"], buffers, "V")


def factors(params: TensorDict, buffers: TensorDict) -> tuple[Tensor, Tensor]:
    """``(a (2(m−k), d_in), b (d_out, 2(m−k)))`` with ``b a = U diag(S) V − U0 diag(S0) V0``:
    ``a = [V; V − V0]``, ``b = [U S − U0 S0, U0 S0]``. The differences are taken on the factors,
    not on the layer's outputs: exactly zero at init, and a small update is not lost in the
    difference of two large products (peft's ``[U S, −U0 S0] [V; V0]``)."""
    u, s, v = _trained(params, buffers)
    initial = buffers["osf_U0"] * buffers["osf_S0"].unsqueeze(0)
    a = torch.cat([v, v - buffers["osf_V0"]], dim=0)
    b = torch.cat([u * s.unsqueeze(0) - initial, initial], dim=1)
    return a, b


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    a, b = factors(params, buffers)
    return weight + b @ a, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a, b = factors(params, buffers)
    return base_plus_product(base, x, a, b)


def _low(info: LayerInfo) -> int:
    """``m − k``: the trained directions of the layer."""
    return min(info.d_in, info.d_out) - info.r


VARIANT = Variant(
    name="osf",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "osf_U": Slot(lambda i: (i.d_out, _low(i)), peft="osf_svd_params.U_low"),
        "osf_S": Slot(lambda i: (_low(i),), peft="osf_svd_params.S_low"),
        "osf_V": Slot(lambda i: (_low(i), i.d_in), peft="osf_svd_params.V_low"),
        "osf_U0": Slot(lambda i: (i.d_out, _low(i)), buffer=True),
        "osf_S0": Slot(lambda i: (_low(i),), buffer=True),
        "osf_V0": Slot(lambda i: (_low(i), i.d_in), buffer=True),
        "osf_U_high": Slot(lambda i: (i.d_out, i.r) if i.d_out > i.d_in else None, buffer=True),
        "osf_V_high": Slot(lambda i: (i.r, i.d_in) if i.d_out < i.d_in else None, buffer=True),
    },
    options={
        "effective_rank": Option(None, Check(_valid_rank, "must be None (half), an integer >= 1 or a fraction in (0, 1]"), "effective_rank"),
        "init": Option("svd", one_of(*INITS), "init_weights", mapped({"svd": True, "random": False})),
    },
    default_alpha=1.0,
    layer_ranks=effective_ranks,
)
# peft: OSFConfig, no `bias`, rank or alpha field (the frozen count is the option effective_rank);
# its rank_pattern (regexes -> effective ranks) is refused; nn.Linear only.
PEFT = PeftFormat(PeftMethod("OSF", {}, ("modules_to_save", "rank_pattern"), fan_in_fan_out=False), conv1d=False)
