"""TinyLoRA (Morris et al. 2026, "Learning to Reason in 13 Parameters", arXiv 2602.04118),
following HF peft's ``tuners/tinylora/{model,layer}.py``.

LoRA-XS's frozen SVD factors of each layer's weight with the trainable ``r × r`` core replaced by
a tiny vector ``v (u,)`` projected through frozen random tensors ``P (u, r, r)``:

    W = U S Vᵀ (truncated to r),   A = √S_r V_rᵀ (r, d_in),   B = U_r √S_r (d_out, r)   (frozen)
    R = Σ_i v_i P_i (r, r),   ΔW = B R A,   y = x Wᵀ + b + ((x Aᵀ) Rᵀ) Bᵀ

no scale (``alpha`` is unused). ``P`` is drawn per layer, ``N(0, 1/r)``, from a CPU generator
seeded with ``projection_seed + position`` (the layer's index among the targets in module order,
:attr:`LayerInfo.position`), as peft draws it. The layers share their vectors by
``weight_tying`` (0: a vector per layer, 1: one for all): of ``L`` targets, ``G = max(1,
round(L (1 - weight_tying)))`` groups of ``max(1, L // G)`` consecutive layers (the last group
takes the rest), peft's rule. The ``G`` vectors are one trainable leaf ``tinylora_v (G, u)`` of
the adapter (``Variant.shared_init``): the whole adapter trains ``G · u`` numbers, and a stack of
adapters holds one ``(G, u)`` per member; ``A``, ``B`` and ``P`` are layer buffers, equal in every
member built on one base, which :func:`lora_func.stack` holds once.

Init (peft's ``init_weights=True``): ``v = 0`` (ΔW = 0); ``init="uniform"``: ``v ~ U(-init_v_bound,
init_v_bound)`` from the generator (peft draws from the global RNG). The SVD runs in fp32 on the
base weight and is cast to the base dtype before the square roots, as peft does.

peft format (``TinyLoraConfig``): per layer ``tinylora_A``, ``tinylora_B`` and, with
``save_projection`` (default), ``tinylora_P``; ``base_model.tinylora_v.<g>`` once per group.
Without ``save_projection`` the projections are re-drawn from the seed on load, as peft does.
A rank above a layer's ``min(d_in, d_out)`` is lowered to it on that layer, as peft does
(:func:`layer_ranks`; the config keeps ``r``).

``nn.Embedding`` targets as peft's: the SVD is of the stored ``(V, d)`` table, so there
``tinylora_A (r, d)``, ``tinylora_B (V, r)`` (peft's shapes and keys) and ``ΔW = (B R A)ᵀ`` in the
canonical ``(d, V)`` view; a lookup adds ``(B[ids] R) A`` (:func:`embedding_form`).

Differences from peft: ``init_weights
=False`` (peft leaves ``v`` as uninitialised memory) reads as ``init="zero"``, which only acts at
init (a checkpoint's ``v`` is its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank, lowrank_input
from lora_func.variants import FLAG, SEED, BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real, whole
from lora_func.variants._options import dropout_option

INITS = ("zero", "uniform")


def groups(info: LayerInfo) -> tuple[int, int]:
    """``(G, g)``: the number of vectors and the one this layer reads (peft's ``weight_tying``
    rule over the adapter's ``info.count`` targets)."""
    count = info.count
    num_groups = max(1, round(count * (1.0 - float(info.option("weight_tying")))))
    size = max(1, count // num_groups)
    return num_groups, min(info.position // size, num_groups - 1)


def shared_init(infos: Mapping[str, LayerInfo], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """``tinylora_v (G, u)``: zeros, or ``U(-init_v_bound, init_v_bound)``."""
    first = next(iter(infos.values()))
    num_groups, _ = groups(first)
    u, bound = first.option("u"), float(first.option("init_v_bound"))
    v = torch.zeros(num_groups, u)
    if first.option("init") == "uniform":
        v = v.uniform_(-bound, bound, generator=generator)
    return {"tinylora_v": v.to(device, dtype)}, {}


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    """The frozen SVD factors of ``weight`` and the layer's projections (peft's ``_init_svd``,
    ``_init_projection``)."""
    r = info.r
    # an embedding's SVD is of its stored (V, d) table, as peft's (its A, B hold that table's
    # factors: see the module docstring)
    stored = weight.T if info.kind == "embedding" else weight
    u, s, vh = torch.linalg.svd(stored.float(), full_matrices=False)
    root = torch.sqrt(s[:r].to(weight.dtype))
    a = root.unsqueeze(1) * vh[:r, :].to(weight.dtype)
    b = u[:, :r].to(weight.dtype) * root.unsqueeze(0)
    seeded = torch.Generator(device="cpu").manual_seed(int(info.option("projection_seed")) + info.position)
    p = torch.normal(mean=0.0, std=1.0 / (r**0.5), size=(info.option("u"), r, r), generator=seeded)
    return {}, {"tinylora_A": a.to(dtype).contiguous(), "tinylora_B": b.to(dtype).contiguous(), "tinylora_P": p.to(weight.device, dtype)}


def layer_ranks(r: int, infos: Mapping[str, LayerInfo]) -> dict[str, int]:
    """Each layer's rank: ``r``, lowered to ``min(d_in, d_out)`` on a layer that has fewer
    singular directions (peft's ``actual_r``; its config keeps ``r``)."""
    return {module: min(r, info.d_in, info.d_out) for module, info in infos.items()}


def core(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> Tensor:
    """``R = Σ_i v_i P_i (r, r)`` with the layer's group's vector."""
    _, group = groups(info)
    return torch.einsum("i,ijk->jk", params["tinylora_v"][group], buffers["tinylora_P"])


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    delta = buffers["tinylora_B"] @ core(params, buffers, info) @ buffers["tinylora_A"]
    # an embedding's factors are of its stored (V, d) table: the canonical (d, V) delta is the transpose
    return weight + (delta.T if info.kind == "embedding" else delta), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a = buffers["tinylora_A"]
    # peft's order: (x Aᵀ) Rᵀ, then Bᵀ.
    h = (lowrank_input(x, base, info).to(a.dtype) @ a.transpose(-1, -2)) @ core(params, buffers, info).transpose(-1, -2)
    return base_plus_low_rank(base, x, h, buffers["tinylora_B"])


def embedding_form(params: TensorDict, buffers: TensorDict, ids: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """TinyLoRA on an ``nn.Embedding`` (peft's ``tinylora.Embedding``): ``ids (...) -> base(ids) +
    (B[ids] R) A (..., d)``, ``B (V, r)`` and ``A (r, d)`` the stored table's SVD factors, the
    ``dropout`` option on the looked-up ``(..., r)`` rows in training (peft's order)."""
    b = buffers["tinylora_B"]
    y = base(ids)
    h = lowrank_input(cast(Any, base).replay(ids, b), base, info)  # B's rows, with the layer's own lookup
    delta = (h @ core(params, buffers, info)) @ buffers["tinylora_A"]
    return (y.to(delta.dtype) + delta).to(y.dtype)


def _a_shape(info: LayerInfo) -> tuple[int, int]:
    return (info.r, info.d_out if info.kind == "embedding" else info.d_in)


def _b_shape(info: LayerInfo) -> tuple[int, int]:
    return (info.d_in if info.kind == "embedding" else info.d_out, info.r)


VARIANT = Variant(
    name="tinylora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # The projection P is in peft's file only with save_projection (else drawn from the seed and the
    # layer's position); the G trainable vectors are held once, row by row.
    tensors={
        "tinylora_A": Slot(_a_shape, rank_axes=(0,), buffer=True, peft="tinylora_A"),
        "tinylora_B": Slot(_b_shape, rank_axes=(1,), buffer=True, peft="tinylora_B"),
        "tinylora_P": Slot(lambda i: (i.option("u"), i.r, i.r), rank_axes=(1, 2), buffer=True, peft="tinylora_P", saved_if="save_projection"),
        "tinylora_v": Slot(lambda i: (groups(i)[0], i.option("u")), shared=True, peft="base_model.tinylora_v.{}"),
    },
    options={
        "u": Option(64, whole(1, why="the length of each trainable vector"), "u"),
        "weight_tying": Option(0.0, real(0, 1, closed="[]", why="0: a vector per layer, 1: one for all"), "weight_tying"),
        "projection_seed": Option(42, SEED, "projection_seed"),
        "save_projection": Option(True, FLAG, "save_projection"),
        "init_v_bound": Option(0.02, real(0), "init_v_bound"),
        "dropout": dropout_option("tinylora_dropout"),
        "init": Option("zero", one_of(*INITS), "init_weights", mapped({"zero": True, "uniform": "uniform"}, also={False: "zero"})),
    },
    default_alpha=1.0,
    shared_init=shared_init,
    layer_ranks=layer_ranks,
    kind_forms={"linear": None, "conv1d": None, "embedding": embedding_form},
)
PEFT = PeftFormat(PeftMethod("TINYLORA", rank=("r", None)))
