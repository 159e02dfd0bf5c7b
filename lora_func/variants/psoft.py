"""PSOFT, orthogonal fine-tuning in the principal subspace (openreview FSHrinMArK), following HF
peft 0.21's ``tuners/psoft/layer.py`` (``OrthLayer``, ``Linear``).

``A (r, d_in)`` and ``B (d_out, r)`` come from the SVD of ``W`` and are frozen; an ``r × r`` map
``R`` between them is trained:

    ΔW = s · B (R − I) A,   s = alpha / r,   y = base(x) + ((x Aᵀ) (s · (R − I))ᵀ) Bᵀ

``R`` is orthogonal by the Cayley map ``(I + Q)(I − Q)⁻¹`` of a skew ``Q`` (trainable
``psoft_R (r(r−1)/2,)``, its strict upper triangle, ``psoft_orth=True``), or by peft's truncated
Cayley–Neumann series ``I + 2Q + 2Q² + ⋯ + Q^m`` (``use_cayley_neumann``, ``num_cayley_neumann_terms``;
with ``cayley_neumann_eps``, ``Q`` is scaled onto the Frobenius ball of that radius where it lies
outside); with ``psoft_orth=False`` it is a free ``psoft_R (r, r)``. The optional magnitude vectors
``psoft_vector_b``, ``psoft_vector_a (r,)`` (``psoft_mag_b`` / ``psoft_mag_a``) scale its rows and
columns: ``R ← diag(b) R diag(a)``.

``A``, ``B`` (peft's ``ab_svd_init``): with ``U S Vᵀ`` the SVD of ``W`` in fp32 (``psoft_svd="full"``,
or ``"lowrank"``: ``torch.svd_lowrank(W, r, psoft_svd_lowrank_niter)`` drawn from a generator seeded
with ``random_seed``, peft's draw) and ``S' = S[:r] / s``: ``"psoft_init"`` ``A = Vᵀ[:r]``, ``B =
U[:, :r] diag(S')``; ``"pissa_init"`` ``A = diag(√S') Vᵀ[:r]``, ``B = U[:, :r] diag(√S')``. peft does
not save them: ``load_peft`` computes them from the base, as peft does.

Init (``init="identity"``, peft's ``init_weights=True``): ``Q = 0`` (``R = I``; a free ``R = I``),
vectors one: no change at init. ``init="random"``: ``Q ~ N(0, 0.1²)`` (a free ``R = I + N(0,
0.1²)``), from the generator (peft draws from the global RNG).

In a stack of adapters of different ranks (``lora_func.stack``), ``A``, ``B`` and the vectors are
zero-padded along their rank axes, a free ``R`` along both axes, and the triangle ``psoft_R`` at its
end: the forms read each member's ``r × r`` triangle from the padded vector by its own rank.

Differences from peft: ``init="random"`` and the low-rank SVD draw from generators; GPT-2
``Conv1D`` is supported (peft's PSOFT takes ``nn.Linear`` only, so ``save_peft`` refuses it there);
a float64 base is adapted (peft's init refuses it: its SVD runs in fp32 on any base, and so does
this one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lora_func.variants import FLAG, SEED, BaseLayer, Check, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, is_finite_number, mapped, one_of, whole
from lora_func.variants._kernels import lowrank_input
from lora_func.variants._options import dropout_option
from lora_func.variants._orthogonal import block_size_of, cayley, cayley_neumann, skew_from_upper
from lora_func.variants.pissa import svd_lowrank

INITS = ("identity", "random")


def _svd(weight: Tensor, info: LayerInfo) -> tuple[Tensor, Tensor, Tensor]:
    """``(U[:, :r] (d_out, r), S[:r] (r,), Vᵀ[:r] (r, d_in))`` of ``weight`` in fp32 (peft's ``_compute_svd_factors``)."""
    w, r = weight.to(torch.float32), info.r
    if info.option("psoft_svd") == "lowrank":
        seeded = torch.Generator().manual_seed(info.option("random_seed"))
        u, s, v = svd_lowrank(w, r, info.option("psoft_svd_lowrank_niter"), seeded)
        return u[:, :r], s[:r], v[:, :r].t()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return u[:, :r], s[:r], vh[:r, :]


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, random = info.r, info.option("init") == "random"
    if info.option("psoft_orth"):
        rotation = torch.nn.init.normal_(torch.empty(r * (r - 1) // 2), 0.0, 0.1, generator=generator) if random else torch.zeros(r * (r - 1) // 2)
    else:
        rotation = torch.eye(r) + torch.randn((r, r), generator=generator) * 0.1 if random else torch.eye(r)
    params = {"psoft_R": rotation}
    params |= {f"psoft_vector_{side}": torch.ones(r) for side in "ba" if info.option(f"psoft_mag_{side}")}
    u, s, vh = _svd(weight, info)
    scaled = s / (info.alpha / r)
    if info.option("ab_svd_init") == "pissa_init":
        root = torch.sqrt(scaled)
        a, b = torch.diag(root) @ vh, u @ torch.diag(root)
    else:
        a, b = vh, u @ torch.diag(scaled)
    buffers = {"psoft_A": a.contiguous(), "psoft_B": b.contiguous()}
    return {k: v.to(weight.device, dtype) for k, v in params.items()}, {k: v.to(weight.device, dtype) for k, v in buffers.items()}


def _skew(vec: Tensor, r_max: int, info: LayerInfo) -> Tensor:
    """The skew ``Q (r_max, r_max)`` of a triangle ``vec``. In a rank-padded stack (``info.r`` a
    0-d tensor, ``vec`` zero-padded at its end) the member's ``r × r`` triangle, row-major as
    peft's, read by its own ``r`` into the top-left corner; zero elsewhere."""
    if not isinstance(info.r, Tensor):
        return skew_from_upper(vec[None], block_size_of(vec.shape[-1]))[0]
    r = info.r.round().long()
    i, j = (torch.arange(r_max, device=vec.device)[:, None], torch.arange(r_max, device=vec.device)[None, :])
    index = i * r - i * (i + 1) // 2 + (j - i - 1)  # (i, j)'s place in a row-major triangle of size r
    inside = (i < j) & (j < r)
    upper = torch.where(inside, vec[index.clamp(0, vec.shape[-1] - 1)], torch.zeros((), dtype=vec.dtype, device=vec.device))
    return upper - upper.transpose(-1, -2)


def rotation(params: TensorDict, r_max: int, info: LayerInfo) -> Tensor:
    """``R (r, r)``: Cayley (or Cayley–Neumann) of the skew triangle, or the free matrix, rows and
    columns scaled by the magnitude vectors (peft's ``OrthLayer.get_matrix``)."""
    if info.option("psoft_orth"):
        q = _skew(params["psoft_R"], r_max, info)
        if info.option("use_cayley_neumann"):
            eps = info.option("cayley_neumann_eps")
            if eps is not None:
                norm = torch.linalg.norm(q, ord="fro")
                q = torch.where(torch.isfinite(norm) & (norm > eps), q * (eps / (norm + 1e-12)), q)
            rot = cayley_neumann(q, info.option("num_cayley_neumann_terms"))
        else:
            # peft's solve(I − Q, I + Q, left=False) = (I + Q)(I − Q)⁻¹: the Cayley map of −Q = Qᵀ
            # (a transposed view, bit for bit peft's operands)
            rot = cayley(q.transpose(-1, -2))
    else:
        rot = params["psoft_R"]
    if "psoft_vector_b" in params:
        rot = params["psoft_vector_b"][:, None] * rot
    if "psoft_vector_a" in params:
        rot = rot * params["psoft_vector_a"][None, :]
    return rot


def _core(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> Tensor:
    """``s · (R − I)`` ``(r, r)``: ``ΔW = B (s · (R − I)) A``."""
    r = buffers["psoft_A"].shape[0]
    rot = rotation(params, r, info)
    return (rot - torch.eye(r, dtype=rot.dtype, device=rot.device)) * (info.alpha / info.r)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + buffers["psoft_B"] @ _core(params, buffers, info) @ buffers["psoft_A"], bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a, b, core = buffers["psoft_A"], buffers["psoft_B"], _core(params, buffers, info)
    # peft's ((x Aᵀ) Rᵀ − x Aᵀ) Bᵀ s with s(R − I) applied to the (n, r) activations: (x Aᵀ) s(R − I)ᵀ Bᵀ,
    # in the adapter dtype (A is frozen: the input's cast copy is not kept for backward; B too: its
    # transposed view, no contiguous copy, which only a gradient of B would use)
    h = (lowrank_input(x, base, info).to(a.dtype) @ a.transpose(-1, -2)) @ core.transpose(-1, -2)
    y = base(x)
    return y + (h @ b.transpose(-1, -2)).to(y.dtype)


def _triangle(info: LayerInfo) -> tuple[int, ...]:
    return (info.r * (info.r - 1) // 2,) if info.option("psoft_orth") else (info.r, info.r)


EPS = Check(lambda v: v is None or (is_finite_number(v) and 0 < v < 1), "must be None or in (0, 1)")


VARIANT = Variant(
    name="psoft",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        # the triangle (r(r−1)/2,) pads at its end, a free R (r, r) on both axes
        "psoft_R": Slot(_triangle, padded_axes=(0, 1), peft="psoft_R.weight"),
        "psoft_vector_b": Slot(lambda i: (i.r,) if i.option("psoft_mag_b") else None, rank_axes=(0,), peft="psoft_R.vector_b"),
        "psoft_vector_a": Slot(lambda i: (i.r,) if i.option("psoft_mag_a") else None, rank_axes=(0,), peft="psoft_R.vector_a"),
        "psoft_A": Slot(lambda i: (i.r, i.d_in), rank_axes=(0,), buffer=True),
        "psoft_B": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,), buffer=True),
    },
    options={
        "ab_svd_init": Option("psoft_init", one_of("psoft_init", "pissa_init"), "ab_svd_init"),
        "psoft_svd": Option("full", one_of("full", "lowrank"), "psoft_svd"),
        "psoft_svd_lowrank_niter": Option(10, whole(0), "psoft_svd_lowrank_niter"),
        "random_seed": Option(0, SEED, "random_seed"),
        "psoft_orth": Option(True, FLAG, "psoft_orth"),
        "psoft_mag_b": Option(True, FLAG, "psoft_mag_b"),
        "psoft_mag_a": Option(True, FLAG, "psoft_mag_a"),
        "use_cayley_neumann": Option(False, FLAG, "use_cayley_neumann"),
        "num_cayley_neumann_terms": Option(5, whole(1), "num_cayley_neumann_terms"),
        "cayley_neumann_eps": Option(None, EPS, "cayley_neumann_eps"),
        "dropout": dropout_option("psoft_dropout"),
        "init": Option("identity", one_of(*INITS), "init_weights", mapped({"identity": True, "random": False})),
    },
    default_alpha=32.0,
    traits=frozenset({"rank_within_layer"}),
)
# peft: PsoftConfig, one r for every layer, alpha psoft_alpha, no `bias` field; nn.Linear only.
PEFT = PeftFormat(PeftMethod("PSOFT", {}, rank=("r", None), alpha="psoft_alpha"), conv1d=False)
