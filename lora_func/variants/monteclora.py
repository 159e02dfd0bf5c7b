"""MonteCLoRA (Monte Carlo LoRA, arXiv 2411.04358) as peft's ``LoraConfig(monteclora_config=MontecloraConfig(...))``:
LoRA whose ``A`` is, in training steps, a mixture of ``n = num_samples`` Gaussian perturbations of
itself, with a learnt per-rank variance and learnt mixture weights, plus a KL penalty.

Trainable: LoRA's ``lora_A (r, d_in)``, ``lora_B (d_out, r)`` (LoRA's init), and peft's sampler
parameters ``monteclora_std_prior (r,)`` and ``monteclora_expert_weights_prior (n,)`` (``U[0, 1)``
draws, after ``A``, as peft). Outside training (and on the merged path) it is LoRA: ``W_eff = W +
s·B A``. In a training step (lazy and module-call routes), per layer and call, from the global RNG
(so ``torch.func.vmap`` follows its ``randomness=``: ``"error"`` refuses, as for dropout):
``z (n, d_in, r)`` and ``ζ (n,)`` standard normal, ``χ (r,)`` chi-square with ``r`` degrees of
freedom (the diagonal of peft's Wishart(r, I) sample, the only part it reads);
``v = max(exp(2·std_prior) ⊙ χ, 1e-3)``; noise ``ε_k = sample_scaler · z_k diag(√v)``;
``α = max(exp(expert_weights_prior), 1e-6)``, ``μ = log α − mean(log α)``, ``w = softmax(μ + ζ ⊙
√(max(α⁻¹(1 − 2/n) + Σα⁻¹/n², 1e-6) + 1e-6))`` (peft's normal approximation of a Dirichlet);
``Aᵀ ← Σ_k w_k (Aᵀ + ε_k)``; then LoRA's ``base(x) + s·(dropout(x) Aᵀ) Bᵀ``. Square roots in at
least fp32 (peft: its Cholesky factors in fp32).

The penalty, peft's ``LoraModel._get_monteclora_loss`` (add it to the loss): :func:`penalty`, the
mean over the layers of ``kl_loss_weight·(KL_dir + KL_wish + KL_mvn) + [use_entropy] Σ w²`` with
peft's formulas. peft's ``KL_mvn`` and entropy read the variances ``v`` and weights ``w`` of the
layer's last forward (state it keeps); lora_func's forms keep no state, so :func:`penalty` draws
its own ``χ``, ``ζ`` from the global RNG (the same distribution: an estimate of the same penalty,
not the same number). peft's sampler state (``gaussian_var_prior``, ``expert_weights``) is held as
two buffers so that a checkpoint round-trips; nothing reads them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from lora_func.variants import FLAG, BaseLayer, LayerInfo, Option, Slot, TensorDict, lora, real, whole
from lora_func.variants._kernels import base_plus_low_rank, lora_activation_form, lora_scale, lowrank_input

STD, EXPERTS = "monteclora_std_prior", "monteclora_expert_weights_prior"
VAR, WEIGHTS = "monteclora_gaussian_var_prior", "monteclora_expert_weights"
_SAMPLER = "lora_monteclora_sampler."


def draw(num_samples: int, d_in: int, r: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One step's draws from the global RNG, in ``like``'s dtype and device: ``z (n, d_in, r)``,
    ``χ (r,)`` (each a sum of ``r`` squared standard normals) and ``ζ (n,)``."""
    z = torch.randn((num_samples, d_in, r), dtype=like.dtype, device=like.device)
    chi = torch.randn((r, r), dtype=like.dtype, device=like.device).square().sum(-1)
    zeta = torch.randn((num_samples,), dtype=like.dtype, device=like.device)
    return z, chi, zeta


def _root(v: Tensor) -> Tensor:
    """``√v`` in at least fp32, back in ``v``'s dtype (peft's fp32 Cholesky factor of ``diag(v)``)."""
    return v.to(torch.promote_types(v.dtype, torch.float32)).sqrt().to(v.dtype)


def variances(std_prior: Tensor, chi: Tensor) -> Tensor:
    """peft's ``wishart_reparameterization``'s diagonal: ``max(exp(std_prior)² ⊙ χ, 1e-3)``."""
    std = std_prior.exp()
    return torch.clip(std * std * chi, min=1e-3)


def mixture_weights(expert_prior: Tensor, zeta: Tensor) -> Tensor:
    """peft's ``dirichlet_reparameterization`` then ``softmax``: ``(n,)`` weights summing to 1."""
    n = expert_prior.shape[-1]
    alpha = torch.clamp(expert_prior.exp(), min=1e-6)
    mu = torch.log(alpha) - torch.log(alpha).mean()
    spread = torch.clamp(1 / alpha * (1 - 2 / n) + 1 / (n**2) * (1 / alpha).sum(), min=1e-6)
    return torch.softmax(_root(spread + 1e-6) * zeta + mu, dim=-1)


def sampled_a(params: TensorDict, info: LayerInfo) -> Tensor:
    """``A (r, d_in)`` averaged over its ``num_samples`` perturbations, from fresh draws."""
    lora_a = params["lora_A"]
    r, d_in = lora_a.shape
    z, chi, zeta = draw(info.option("num_samples"), d_in, r, lora_a)
    noise = info.option("sample_scaler") * (z * _root(variances(params[STD], chi)))
    weights = mixture_weights(params[EXPERTS], zeta)
    return torch.einsum("n,nij->ij", weights, lora_a.T + noise).T


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    """LoRA's init, then peft's sampler parameters (``U[0, 1)``: std prior, then expert prior) and
    its state (``gaussian_var_prior = I``, ``expert_weights = 1/n``)."""
    params, _ = lora.init(weight, bias, info, dtype=dtype, generator=generator)
    r, n = info.r, info.option("num_samples")
    params[STD] = torch.rand(r, generator=generator).to(weight.device, dtype)
    params[EXPERTS] = torch.rand(n, generator=generator).to(weight.device, dtype)
    buffers = {VAR: torch.eye(r, dtype=dtype, device=weight.device), WEIGHTS: torch.full((n,), 1 / n, dtype=dtype, device=weight.device)}
    return params, buffers


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    if not getattr(base, "training", False):
        return lora_activation_form(params, buffers, x, base, info)
    lora_a = sampled_a(params, info)
    h = (lowrank_input(x, base, info).to(lora_a.dtype) @ lora_a.T) * lora_scale(info, buffers)
    return base_plus_low_rank(base, x, h, params["lora_B"])


def layer_penalty(params: TensorDict, info: LayerInfo, chi: Tensor, zeta: Tensor) -> Tensor:
    """peft's ``get_variational_loss`` of one layer (training), for the draws ``χ (r,)`` and ``ζ
    (n,)``: ``kl_loss_weight·(KL_dir + KL_wish + KL_mvn) + [use_entropy] Σ w²``."""
    std_prior, expert_prior = params[STD], params[EXPERTS]
    n, r = expert_prior.shape[-1], std_prior.shape[-1]
    # peft's dirichlet_kl, its formula as written (log Γ through exp(lgamma))
    alpha2 = torch.exp(expert_prior)
    alpha1 = torch.full_like(alpha2, info.option("dirichlet_prior"))

    def gamma(t: Tensor) -> Tensor:
        return torch.lgamma(t).exp()

    kl_dir = (
        torch.log(gamma(alpha2.sum()) / gamma(alpha1.sum()))
        + torch.log(gamma(alpha2) / gamma(alpha1)).sum()
        + ((alpha2 - alpha1) * (torch.digamma(alpha2) - torch.digamma(alpha2.sum()))).sum()
    )
    var = std_prior.exp() ** 2  # diag(std stdᵀ), std = diag(exp(std_prior))
    kl_wish = 0.5 * (-torch.log(var).sum() * r + var.sum() * r - r**2)
    v = torch.clamp(variances(std_prior, chi), min=1e-6)
    kl_mvn = n * 0.5 * (v.sum() - torch.log(v).sum() - r)
    total = info.option("kl_loss_weight") * (kl_dir + kl_wish + kl_mvn)
    if info.option("use_entropy"):
        total = total + (mixture_weights(expert_prior, zeta) ** 2).sum()
    return total


class _Layered(Protocol):
    """What :func:`penalty` reads of an adapter (:class:`lora_func.Adapter`)."""

    layers: Iterable[Any]

    def layer_tensors(self, layer: Any) -> tuple[TensorDict, TensorDict]: ...


def penalty(adapter: _Layered) -> Tensor:
    """peft's ``_get_monteclora_loss`` for a ``monteclora`` adapter: the mean over its layers of
    :func:`layer_penalty`, each with its own draws from the global RNG (module docstring)."""
    terms = []
    for layer in adapter.layers:
        params, _ = adapter.layer_tensors(layer)
        r, n = params[STD].shape[-1], params[EXPERTS].shape[-1]
        _, chi, zeta = draw(n, 0, r, params[STD])
        terms.append(layer_penalty(params, layer.info, chi, zeta))
    return torch.stack(terms).mean()


VARIANT = lora.derived(
    "monteclora",
    init,
    activation_form=activation_form,
    tensors=lora.TENSORS
    | {
        STD: Slot(lambda i: (i.r,), rank_axes=(0,), peft=_SAMPLER + "std_prior"),
        EXPERTS: Slot(lambda i: (i.option("num_samples"),), peft=_SAMPLER + "expert_weights_prior"),
        VAR: Slot(lambda i: (i.r, i.r), rank_axes=(0, 1), buffer=True, peft=_SAMPLER + "gaussian_var_prior"),
        WEIGHTS: Slot(lambda i: (i.option("num_samples"),), buffer=True, peft=_SAMPLER + "expert_weights"),
    },
    options=lora.OPTIONS
    | {
        "num_samples": Option(8, whole(1, why="the Monte Carlo perturbations mixed per step"), "monteclora_config.num_samples"),
        "use_entropy": Option(False, FLAG, "monteclora_config.use_entropy"),
        "dirichlet_prior": Option(0.1, real(0, closed="()", why="the Dirichlet prior's concentration"), "monteclora_config.dirichlet_prior"),
        "sample_scaler": Option(1e-4, real(0, why="the perturbations' scale"), "monteclora_config.sample_scaler"),
        "kl_loss_weight": Option(1e-5, real(0, why="the KL terms' weight in the penalty"), "monteclora_config.kl_loss_weight"),
    },
    # LoRA's product outside training only: sampling in training is not the LowRank form
    low_rank=None,
)
PEFT = lora.stored_as_lora(reads=lora.plain_reads(monteclora_config=bool))
