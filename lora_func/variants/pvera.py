"""PVeRA, probabilistic VeRA (Fein-Ashley et al. 2025, arXiv 2512.07703), following HF peft's
``tuners/pvera/{model,layer}.py``.

VeRA (:mod:`lora_func.variants.vera`) whose middle activations are a Gaussian sample. One pair
of frozen random matrices is shared by every layer, ``pvera_A (2r, D_in)`` and ``pvera_B (D_out,
r)`` (the largest ``d_in`` / ``d_out`` over the layers); a layer reads ``A = pvera_A[:, :d_in]``,
``B = pvera_B[:d_out, :]`` and trains ``pvera_lambda_b (d_out,)`` and ``pvera_lambda_d (2r,)``:

    [μ, log σ²] = λ_d ⊙ (x Aᵀ)          (split in two halves of r)
    z = μ + ε ⊙ exp(log σ² / 2),  ε ~ N(0, 1)     in a training step (or with sample_at_inference)
    z = μ                                         otherwise
    y = x Wᵀ + b + λ_b ⊙ (z Bᵀ)

so at inference ``ΔW = Λ_b B Λ_{d,:r} A_{:r}`` (what the weight form and peft's merge use; the
second halves of λ_d and A only act in training). ``ε`` comes from the global RNG
(``torch.randn_like``, as peft without ``generator_seed``), so under ``vmap`` it follows
``randomness=``. No scale (``alpha`` is unused).

The basis is peft's draw for draw: a CPU generator seeded with ``projection_prng_key`` draws
``pvera_A`` then ``pvera_B`` with ``kaiming_uniform_`` (``a = 0``). Init (peft's
``init_weights=True``): ``λ_b = 0``, ``λ_d = d_initial``; ``init="random"``: ``λ_b = 1``,
``λ_d ~ N(0, 1)`` (from the generator).

peft format (``PveraConfig``): the two vectors per layer, ``base_model.pvera_A`` /
``base_model.pvera_B`` once when ``save_projection``, re-created from the seed otherwise.
Differences from peft: peft's ``generator_seed`` (a per-layer stateful generator for ε) is not
offered: ε comes from the global RNG; a checkpoint with it loads with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank, lowrank_input
from lora_func.variants import FLAG, BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant
from lora_func.variants._bank import largest, largest_of, one_rank
from lora_func.variants.vera import basis_options, basis_slot, vectors

def shared_init(infos: Mapping[str, LayerInfo], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """``pvera_A (2r, D_in)``, ``pvera_B (D_out, r)``: peft's draws from ``projection_prng_key``."""
    first = next(iter(infos.values()))
    r = one_rank("pvera", infos)
    d_out, d_in = largest(infos)
    seeded = torch.Generator(device="cpu").manual_seed(first.option("projection_prng_key"))
    pvera_a = torch.nn.init.kaiming_uniform_(torch.empty(2 * r, d_in), generator=seeded)
    pvera_b = torch.nn.init.kaiming_uniform_(torch.empty(d_out, r), generator=seeded)
    return {}, {"pvera_A": pvera_a.to(device, dtype), "pvera_B": pvera_b.to(device, dtype)}


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    return vectors("pvera", info, 2 * info.r, dtype=dtype, device=weight.device, generator=generator), {}


def _halves(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(positions of the μ half, of the log σ² half, 0/1 mask or None)`` in ``λ_d`` / ``pvera_A``,
    each ``(r,)``. One adapter: ``[0, r)`` and ``[r, 2r)``. A member of a rank-padded stack (its
    ``info.r`` a tensor) holds its own ``[μ (r) | log σ² (r)]`` then zeros, padded to ``2 r_max``:
    its halves start at 0 and at its own ``r``, entries past ``r`` masked."""
    r_max = buffers["pvera_B"].shape[-1]
    idx = torch.arange(r_max, device=params["pvera_lambda_d"].device)
    if not isinstance(info.r, Tensor):
        return idx, idx + r_max, None
    own = idx < info.r
    return idx, torch.where(own, idx + info.r.long(), idx), own


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    mu_at, _, own = _halves(params, buffers, info)
    lambda_mu = params["pvera_lambda_d"][..., mu_at]
    a_mu = buffers["pvera_A"][mu_at, : info.d_in]
    if own is not None:
        lambda_mu = lambda_mu * own.to(lambda_mu.dtype)
    a = lambda_mu.unsqueeze(-1) * a_mu
    b = params["pvera_lambda_b"].unsqueeze(-1) * buffers["pvera_B"][: info.d_out, :]
    return weight + b @ a, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a = buffers["pvera_A"][:, : info.d_in]
    b = params["pvera_lambda_b"].unsqueeze(-1) * buffers["pvera_B"][: info.d_out, :]
    h = (lowrank_input(x, base, info).to(a.dtype) @ a.transpose(-1, -2)) * params["pvera_lambda_d"]
    mu_at, logvar_at, own = _halves(params, buffers, info)
    if own is None:
        mu, logvar = h.chunk(2, dim=-1)
    else:  # a member of a rank-padded stack: its own halves, the padding masked
        keep = own.to(h.dtype)
        mu, logvar = h[..., mu_at] * keep, h[..., logvar_at] * keep
    if getattr(base, "training", False) or info.option("sample_at_inference"):
        mu = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
    return base_plus_low_rank(base, x, mu, b)


VARIANT = Variant(
    name="pvera",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # λ_d and pvera_A hold [μ half | log σ² half], split at r: a rank-padded stack pads them at the
    # end (padded axes) and the forms find each member's halves from its own r (_halves); pvera_B's
    # rank axis is masked as usual (a padded μ entry meets only a zero column of B).
    tensors={
        "pvera_lambda_b": Slot(lambda i: (i.d_out,), peft="pvera_lambda_b"),
        "pvera_lambda_d": Slot(lambda i: (2 * i.r,), padded_axes=(0,), peft="pvera_lambda_d"),
        "pvera_A": basis_slot("pvera", "A", lambda i: (2 * i.r, largest_of(i)[1]), padded_axes=(0,)),
        "pvera_B": basis_slot("pvera", "B", lambda i: (largest_of(i)[0], i.r), rank_axes=(1,)),
    },
    options=basis_options("pvera") | {"sample_at_inference": Option(False, FLAG, "sample_at_inference")},
    default_alpha=1.0,
    shared_init=shared_init,
)
PEFT = PeftFormat(
    PeftMethod(
        "PVERA",
        {"bias": "none", "generator_seed": None},
        rank=("r", None),
        training_only={"generator_seed": "lora_func draws PVeRA's noise from the global RNG (torch.manual_seed), not from a per-layer generator"},
    )
)
