"""RandLoRA, full-rank updates from shared random bases (Albert, Zhang, Ajanthan et al., ICLR
2025, arXiv 2502.00987), following HF peft's ``tuners/randlora/{model,layer}.py``.

Two frozen random bases are shared by every adapted layer, sized from the largest ``d_out`` and
``d_in`` over the layers (``D = max`` and ``m = min`` of the two): ``randlora_A (r, 1, m)`` and
``randlora_B (D, n, r)`` with ``n = ⌈m / r⌉`` bases. A layer with ``d = min(d_in, d_out)``,
``d' = max(d_in, d_out)`` uses ``n_l = ⌈d / r⌉`` bases and trains ``randlora_lambda (r, n_l)``
and ``randlora_gamma (n_l, d)``:

    U_A = flatten_{0,1}(λ[:, :, None] ⊙ A[:, :, :d] ⊙ γ[None])     (r·n_l, d)
    U_B = flatten_{1,2}(B[:d', :n_l, :])                             (d', n_l·r)
    ΔW = s · U_B U_A          if d_in ≤ d_out   (U_B rows are outputs)
    ΔW = s · (U_B U_A)ᵀ       otherwise         (U_B rows are inputs)

with ``s = randlora_alpha / r``: a sum of ``n_l`` rank-``r`` terms, full rank ``d``. (U_A's
rows are ordered (rank, basis) and U_B's columns (basis, rank), so each rank-``r`` term pairs
differently drawn columns: a fixed random pairing, peft's, kept exactly.)

The bases are peft's draws exactly: a CPU generator seeded with ``projection_prng_key`` draws
``A`` then the ``n`` slices of ``B`` with ``kaiming_uniform_(a=√5)`` on bf16 tensors, each then
divided by its standard deviation in bf16 (peft's ``_kaiming_init``); ``sparse=True`` (ternary
``{-1, 0, 1}`` with probability ``1/6`` each sign) and ``very_sparse=True`` (``1/(2√m)``) draw
``torch.rand`` instead, as peft does. Init (peft's ``init_weights=True``): ``λ = 0`` (ΔW = 0),
``γ = 1 / max(n_l, d)``; ``init="random"``: ``λ ~ N(0, 1)``, ``γ = 1 / max(d_in, d_out)``.

peft format (``RandLoraConfig``): λ and γ per layer, ``base_model.randlora_A`` /
``base_model.randlora_B`` once when ``save_projection`` (peft also writes a copy of the bases
under every layer; ``load_peft`` ignores those, ``save_peft`` does not write them, and peft
loads the result). Differences from peft: the bases are drawn in bf16 always (peft uses fp16 on
accelerators without bf16, pre-Ampere CUDA); ``alpha`` is unused (the scale is the
``randlora_alpha`` option, as in peft's config).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank, lowrank_input
from lora_func.variants import FLAG, SEED, BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real
from lora_func.variants._bank import largest, largest_of, one_rank
from lora_func.variants._options import dropout_option

INITS = ("zero", "random")


def _bases(d: int, r: int) -> int:
    """``⌈d / r⌉``: the number of rank-``r`` bases that make a rank-``d`` update."""
    return math.ceil(d / r)


def _ternary(uniform: Tensor, sparsity: float) -> Tensor:
    out = torch.zeros(uniform.shape)
    out[uniform < 1 / (2 * sparsity)] = -1
    out[uniform > 1 - 1 / (2 * sparsity)] = 1
    return out


def _kaiming_bf16(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    out = torch.empty(shape, dtype=torch.bfloat16)
    return torch.nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=generator)


def shared_init(infos: Mapping[str, LayerInfo], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """``randlora_A (r, 1, m)``, ``randlora_B (D, ⌈m/r⌉, r)``: peft's draws from ``projection_prng_key``."""
    first = next(iter(infos.values()))
    r = one_rank("randlora", infos)
    d_out, d_in = largest(infos)
    big, small = max(d_out, d_in), min(d_out, d_in)
    seeded = torch.Generator(device="cpu").manual_seed(first.option("projection_prng_key"))
    n = _bases(small, r)
    if first.option("sparse") or first.option("very_sparse"):
        sparsity = math.sqrt(small) if first.option("very_sparse") else 3
        a = _ternary(torch.rand((r, 1, small), generator=seeded), sparsity)
        b = _ternary(torch.rand((big, n, r), generator=seeded), sparsity)
    else:
        a = _kaiming_bf16((r, 1, small), seeded)
        b = torch.cat([_kaiming_bf16((big, 1, r), seeded) for _ in range(n)], dim=1)
    a, b = a / a.std(), b / b.std()
    return {}, {"randlora_A": a.to(device, dtype), "randlora_B": b.to(device, dtype)}


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    d = min(info.d_in, info.d_out)
    n = _bases(d, info.r)
    if info.option("init") == "random":
        lam = torch.randn(info.r, n, generator=generator)
        gamma = torch.full((n, d), 1 / max(info.d_in, info.d_out))
    else:
        lam = torch.zeros(info.r, n)
        gamma = torch.full((n, d), 1 / max(n, d))
    return {"randlora_lambda": lam.to(weight.device, dtype), "randlora_gamma": gamma.to(weight.device, dtype)}, {}


def factors(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> tuple[Tensor, Tensor]:
    """``(U_A (r·n_l, d), s · U_B (d', n_l·r))`` of the layer (see the module docstring)."""
    lam, gamma = params["randlora_lambda"], params["randlora_gamma"]
    n, d = gamma.shape
    big = max(info.d_in, info.d_out)
    u_a = lam.unsqueeze(-1) * buffers["randlora_A"][:, :, :d] * gamma.unsqueeze(0)  # (r, n_l, d)
    if isinstance(info.r, Tensor):
        return _padded_factors(u_a, buffers["randlora_B"][:big], info.r, d, info)
    u_b = buffers["randlora_B"][:big, :n, :].flatten(1)
    return u_a.flatten(0, 1), u_b * (info.option("randlora_alpha") / info.r)


def _padded_factors(u_a: Tensor, bases: Tensor, r: Tensor, d: int, info: LayerInfo) -> tuple[Tensor, Tensor]:
    """:func:`factors` of a member of a rank-padded stack: its own ``r`` (a 0-d tensor) and
    ``n_l = ⌈d / r⌉`` inside tensors padded to ``(r_max, n_max)``. U_A's row ``(ρ, b)`` is the
    member's flat row ``k = ρ·n_l + b``, which pairs with its U_B column ``k = b′·r + ρ′``: that
    column (basis ``k // r``, rank ``k % r`` of ``randlora_B``) is gathered to stand beside it, so
    the pairing is the member's own; rows past ``(r, n_l)`` are masked."""
    r_max, n_max = u_a.shape[0], u_a.shape[1]
    rho = torch.arange(r_max, device=u_a.device).unsqueeze(-1)
    basis = torch.arange(n_max, device=u_a.device)
    own_r = r.long()
    n_own = torch.div(d + own_r - 1, own_r, rounding_mode="floor")  # ⌈d / r⌉
    own = (rho < own_r) & (basis < n_own)  # (r_max, n_max)
    k = rho * n_own + basis
    b_at = torch.where(own, torch.div(k, own_r, rounding_mode="floor"), 0)
    r_at = torch.where(own, k % own_r, 0)
    u_b = bases[:, b_at, r_at]  # (d', r_max, n_max): the member's U_B column of each U_A row
    u_a = u_a * own.to(u_a.dtype).unsqueeze(-1)
    return u_a.flatten(0, 1), u_b.flatten(1) * (info.option("randlora_alpha") / r)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    u_a, u_b = factors(params, buffers, info)
    delta = u_b @ u_a
    return weight + (delta if info.d_in <= info.d_out else delta.transpose(-1, -2)), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    u_a, u_b = factors(params, buffers, info)
    dropped = lowrank_input(x, base, info).to(u_a.dtype)
    if info.d_in <= info.d_out:  # x U_Aᵀ (n, r·n_l), then through U_B (d_out, r·n_l)
        return base_plus_low_rank(base, x, dropped @ u_a.transpose(-1, -2), u_b)
    # ΔW = (U_B U_A)ᵀ: x ΔWᵀ = (x U_B) U_A, U_B (d_in, n_l·r), U_A (r·n_l, d_out)
    return base_plus_low_rank(base, x, dropped @ u_b, u_a.transpose(-1, -2))


def _layer_shapes(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    d = min(info.d_in, info.d_out)
    return {"randlora_lambda": (info.r, _bases(d, info.r)), "randlora_gamma": (_bases(d, info.r), d)}


def _shared_shapes(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    d_out, d_in = largest_of(info)
    small, r = min(d_out, d_in), info.r
    return {"randlora_A": (r, 1, small), "randlora_B": (max(d_out, d_in), _bases(small, r), r)}


VARIANT = Variant(
    name="randlora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # A rank-padded stack pads the rank axes and the basis axes (⌈d/r⌉ and ⌈m/r⌉ bases: more for a
    # smaller r); the forms rebuild each member's own pairing of U_A's rows with U_B's columns from
    # its own r (_padded_factors).
    tensors={
        "randlora_lambda": Slot(lambda i: _layer_shapes(i)["randlora_lambda"], rank_axes=(0,), padded_axes=(1,), peft="randlora_lambda"),
        "randlora_gamma": Slot(lambda i: _layer_shapes(i)["randlora_gamma"], padded_axes=(0,), peft="randlora_gamma"),
        "randlora_A": Slot(lambda i: _shared_shapes(i)["randlora_A"], rank_axes=(0,), buffer=True, shared=True, peft="base_model.randlora_A", saved_if="save_projection"),
        "randlora_B": Slot(
            lambda i: _shared_shapes(i)["randlora_B"], rank_axes=(2,), padded_axes=(1,), buffer=True, shared=True, peft="base_model.randlora_B", saved_if="save_projection"
        ),
    },
    options={
        "projection_prng_key": Option(0, SEED, "projection_prng_key"),
        "save_projection": Option(True, FLAG, "save_projection"),
        "sparse": Option(False, FLAG, "sparse"),
        "very_sparse": Option(False, FLAG, "very_sparse"),
        "randlora_alpha": Option(640.0, real(), "randlora_alpha"),
        "dropout": dropout_option("randlora_dropout"),
        "init": Option("zero", one_of(*INITS), "init_weights", mapped({"zero": True, "random": False})),
    },
    default_alpha=1.0,
    shared_init=shared_init,
)
PEFT = PeftFormat(PeftMethod("RANDLORA", rank=("r", None)))
