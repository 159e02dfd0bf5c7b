"""VeRA, Vector-based Random Matrix Adaptation (Kopiczko, Blankevoort, Asano, ICLR 2024,
arXiv 2310.11454), following HF peft's ``tuners/vera/{model,layer}.py``.

One pair of frozen random matrices is shared by every adapted layer: ``vera_A (r, D_in)`` and
``vera_B (D_out, r)``, sized to the largest ``d_in`` and ``d_out`` over the layers (each taken
separately, peft's ``_find_dim``); a layer reads the top-left slices ``A = vera_A[:, :d_in]``,
``B = vera_B[:d_out, :]``. Each layer trains two vectors, ``vera_lambda_b (d_out,)`` and
``vera_lambda_d (r,)``:

    ΔW = Λ_b B Λ_d A,   Λ = diag(λ),   y = x Wᵀ + b + λ_b ⊙ ((λ_d ⊙ (x Aᵀ)) Bᵀ)

no scale (``alpha`` is unused). ``vera_A`` / ``vera_B`` are the adapter's shared buffers
(``Variant.shared_init``): one leaf each, saved once, and in a stack of adapters built from one
seed one copy for all members. They are peft's draws exactly: a CPU ``torch.Generator`` seeded
with ``projection_prng_key`` draws ``vera_A`` then ``vera_B``, each ``U(-√(6/fan_in),
√(6/fan_in))`` with ``fan_in`` its second axis (peft's ``_kaiming_init``); ``init_adapter``'s
generator is not used for them, so every adapter of one key has the same basis.

Init (peft's ``init_weights=True``): ``λ_b = 0``, ``λ_d = d_initial``, so ΔW = 0.
``init="random"`` is peft's ``init_weights=False``: ``λ_b = 1``, ``λ_d ~ N(0, 1)`` (from the
generator; peft draws from the global RNG).

peft format (``VeraConfig``): the two vectors per layer, and ``base_model.vera_A`` /
``base_model.vera_B`` once when ``save_projection`` (default). With ``save_projection=False``
the checkpoint holds no basis: ``load_peft`` re-creates it from ``projection_prng_key`` as peft
does, and ``save_peft`` leaves it out. Differences from peft: ``init="random"`` draws from the
given generator, not the global RNG; one rank for every layer (peft has no ``rank_pattern``
for VeRA either).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank, lowrank_input
from lora_func.variants import FLAG, SEED, BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real
from lora_func.variants._bank import largest, largest_of, one_rank, peft_kaiming
from lora_func.variants._options import dropout_option

INITS = ("zero", "random")


def shared_init(infos: Mapping[str, LayerInfo], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """``vera_A (r, D_in)``, ``vera_B (D_out, r)``: peft's draws from ``projection_prng_key``."""
    first = next(iter(infos.values()))
    r = one_rank("vera", infos)
    d_out, d_in = largest(infos)
    seeded = torch.Generator(device="cpu").manual_seed(first.option("projection_prng_key"))
    vera_a = peft_kaiming((r, d_in), seeded)
    vera_b = peft_kaiming((d_out, r), seeded)
    return {}, {"vera_A": vera_a.to(device, dtype), "vera_B": vera_b.to(device, dtype)}


def vectors(prefix: str, info: LayerInfo, d: int, *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> TensorDict:
    """``<prefix>_lambda_b (d_out,)`` and ``<prefix>_lambda_d (d,)``: peft's ``init_weights=True``
    ``λ_b = 0``, ``λ_d = d_initial`` (ΔW = 0), or ``init="random"``: ``λ_b = 1``, ``λ_d ~ N(0, 1)``
    (from the generator; peft draws from the global RNG)."""
    if info.option("init") == "random":
        lambda_b, lambda_d = torch.ones(info.d_out), torch.randn(d, generator=generator)
    else:
        lambda_b, lambda_d = torch.zeros(info.d_out), torch.full((d,), float(info.option("d_initial")))
    return {f"{prefix}_lambda_b": lambda_b.to(device, dtype), f"{prefix}_lambda_d": lambda_d.to(device, dtype)}


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    return vectors("vera", info, info.r, dtype=dtype, device=weight.device, generator=generator), {}


def factors(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> tuple[Tensor, Tensor]:
    """``(Λ_d A (r, d_in), Λ_b B (d_out, r))``: the layer's slices of the shared basis, scaled."""
    a = buffers["vera_A"][:, : info.d_in]
    b = buffers["vera_B"][: info.d_out, :]
    return params["vera_lambda_d"].unsqueeze(-1) * a, params["vera_lambda_b"].unsqueeze(-1) * b


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    a, b = factors(params, buffers, info)
    return weight + b @ a, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a = buffers["vera_A"][:, : info.d_in]
    b = params["vera_lambda_b"].unsqueeze(-1) * buffers["vera_B"][: info.d_out, :]
    # λ_d on the (n, r) activations (peft's order); λ_b folded into the (d_out, r) factor.
    h = (lowrank_input(x, base, info).to(a.dtype) @ a.transpose(-1, -2)) * params["vera_lambda_d"]
    return base_plus_low_rank(base, x, h, b)


def basis_options(prefix: str) -> dict[str, Option]:
    """The options VeRA and PVeRA share: the basis's seed and whether peft's file holds it, the
    vectors' init, the dropout (peft's ``<prefix>_dropout``)."""
    return {
        "projection_prng_key": Option(0, SEED, "projection_prng_key"),
        "save_projection": Option(True, FLAG, "save_projection"),
        "d_initial": Option(0.1, real(), "d_initial"),
        "dropout": dropout_option(f"{prefix}_dropout"),
        "init": Option("zero", one_of(*INITS), "init_weights", mapped({"zero": True, "random": False})),
    }


def basis_slot(prefix: str, name: str, shape: Any, **axes: Any) -> Slot:
    """A tensor of the frozen basis every layer slices, ``base_model.<prefix>_<name>`` in peft's
    file with ``save_projection`` (re-drawn from the seed otherwise)."""
    return Slot(shape, buffer=True, shared=True, peft=f"base_model.{prefix}_{name}", saved_if="save_projection", **axes)


VARIANT = Variant(
    name="vera",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "vera_lambda_b": Slot(lambda i: (i.d_out,), peft="vera_lambda_b"),
        "vera_lambda_d": Slot(lambda i: (i.r,), rank_axes=(0,), peft="vera_lambda_d"),
        "vera_A": basis_slot("vera", "A", lambda i: (i.r, largest_of(i)[1]), rank_axes=(0,)),
        "vera_B": basis_slot("vera", "B", lambda i: (largest_of(i)[0], i.r), rank_axes=(1,)),
    },
    options=basis_options("vera"),
    default_alpha=1.0,
    shared_init=shared_init,
)
PEFT = PeftFormat(PeftMethod("VERA", rank=("r", None)))
