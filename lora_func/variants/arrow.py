"""Arrow (Ostapenko et al. 2024, arXiv 2405.11157) as peft's ``LoraConfig(arrow_config=ArrowConfig(...))``
router over a library of task LoRAs: training-free, per-token routing by the experts' top
singular directions.

Per layer, the ``E`` task LoRAs stacked: trainable ``lora_A (E, r, d_in)``, ``lora_B (E, d_out,
r)``; buffers ``arrow_scales (E,)`` (each expert's own ``alpha/r``) and ``arrow_prototypes (E,
d_in)``: expert ``e``'s prototype is the top right singular vector of ``ΔW_e = B_e A_e``, by peft's
power iteration (15 steps of ``v ← Aᵀ(BᵀB)(A v)``, normalised, in fp32, from ``randn(d_in)`` of a
generator seeded with ``rng_seed``), fixed when the adapter is built (peft computes them once, on
the first forward). For each token ``x`` (a row of the layer input):

    sim_e = |x · p_e|,   keep the top_k experts,   c = softmax(sim_kept / router_temperature)   (0 elsewhere)
    y = x Wᵀ + b + Σ_e c_e · s_e · (x A_eᵀ) B_eᵀ

Nothing is learned by the router; the experts stay trainable (the routing coefficients are
computed from them, as peft's, with the prototypes held fixed). The coefficients depend on the
token, so there is no merged weight (the ``no_merged_weight`` trait: ``lora_func.adapted`` takes
the lazy route for it, merged routes refuse it; peft refuses to merge an Arrow router too); with
one expert Arrow is that LoRA (``lora_func.routed.arrow_experts`` gives it back).

Build one with :func:`lora_func.routed.arrow` from LoRA adapters (``load_peft`` of each task
checkpoint), optionally with GenKnowSub (``general=``: the mean of general-knowledge LoRAs' ``A``
and ``B`` subtracted from each task expert's, before the prototypes, as peft's ``use_gks``).
peft has no one-file Arrow checkpoint (``create_arrow_model`` loads the task LoRAs by path): this
variant has no ``PEFT`` record; ``lora_func.routed.arrow_experts`` gives the experts back as LoRA
adapters for ``save_peft``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import SEED, BaseLayer, LayerInfo, Option, Slot, TensorDict, Variant, real, whole
from lora_func.variants._contract import refuse_merge
from lora_func.variants._kernels import kaiming_uniform, lora_scale

ITERATIONS = 15  # peft's power-iteration steps
EPS = 1e-8


def top_right_singular(lora_a: Tensor, lora_b: Tensor, seed: int) -> Tensor:
    """peft's ``top_right_singular_vec_from_BA``: the top right singular vector ``(d_in,)`` of ``B A``
    (``A (r, d_in)``, ``B (d_out, r)``) by 15 normalised power-iteration steps in fp32 from
    ``randn(d_in)`` of a generator seeded with ``seed``, cast back to ``A``'s dtype. Sign arbitrary."""
    a32, b32 = lora_a.detach().to(torch.float32), lora_b.detach().to(torch.float32)
    c = b32.T @ b32
    generator = torch.Generator(device=a32.device.type).manual_seed(int(seed))
    v = torch.randn(a32.size(1), dtype=a32.dtype, device=a32.device, generator=generator)
    v = v / (v.norm() + EPS)
    for _ in range(ITERATIONS):
        w = a32.T @ (c @ (a32 @ v))
        v = w / (w.norm() + EPS)
    return v.to(lora_a.dtype)


def prototypes(lora_a: Tensor, lora_b: Tensor, seed: int) -> Tensor:
    """Every expert's prototype ``(E, d_in)`` from ``lora_A (E, r, d_in)``, ``lora_B (E, d_out, r)``."""
    return torch.stack([top_right_singular(lora_a[e], lora_b[e], seed) for e in range(lora_a.shape[0])])


def _experts(info: LayerInfo) -> int:
    return int(info.option("num_experts"))


TENSORS = {
    "lora_A": Slot(lambda i: (_experts(i), int(i.r), i.d_in), rank_axes=(1,)),
    "lora_B": Slot(lambda i: (_experts(i), i.d_out, int(i.r)), rank_axes=(2,)),
    "arrow_scales": Slot(lambda i: (_experts(i),), buffer=True),
    "arrow_prototypes": Slot(lambda i: (_experts(i), i.d_in), buffer=True),
}


def init(
    weight: Tensor, bias: Tensor | None, info: LayerInfo, *, dtype: torch.dtype, generator: torch.Generator, calibration: Any = None
) -> tuple[TensorDict, TensorDict]:
    """``E`` LoRA inits (kaiming-uniform ``A``, ``B = 0``), each at scale ``alpha/r``: a library to
    fill (``routed.arrow`` builds one from trained LoRAs)."""
    experts, r = _experts(info), int(info.r)
    lora_a = torch.stack([kaiming_uniform((r, info.d_in), a=math.sqrt(5), generator=generator) for _ in range(experts)])
    lora_b = torch.zeros((experts, info.d_out, r))
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}
    scale = float(lora_scale(info))
    buffers = {
        "arrow_scales": torch.full((experts,), scale, dtype=dtype, device=weight.device),
        "arrow_prototypes": prototypes(params["lora_A"], params["lora_B"], info.option("rng_seed")),
    }
    return params, buffers


def coefficients(tokens: Tensor, protos: Tensor, info: LayerInfo) -> Tensor:
    """The routing coefficients ``(t, E)`` of ``tokens (t, d_in)``: softmax over each token's
    ``top_k`` experts by ``|token · prototype|``, divided by the temperature, 0 elsewhere."""
    sim = torch.abs(tokens @ protos.T)
    top_v, idx = torch.topk(sim, int(info.option("top_k")), dim=1)
    full = torch.full_like(sim, float("-inf")).scatter(1, idx, top_v)
    return torch.softmax(full / float(info.option("router_temperature")), dim=1)


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """peft's ``ArrowLoraLinearLayer.forward``, op for op: ``base(x) + Σ_e c_e s_e (x A_eᵀ) B_eᵀ``
    per token."""
    lora_a, lora_b = params["lora_A"], params["lora_B"]
    y = base(x)
    tokens = x.to(lora_a.dtype).reshape(-1, x.shape[-1])
    coeff = coefficients(tokens, buffers["arrow_prototypes"].to(lora_a.dtype), info)
    z = torch.einsum("tf, erf -> ter", tokens, lora_a)
    out = torch.einsum("ter, eor -> teo", z, lora_b) * buffers["arrow_scales"].to(lora_a.dtype).view(1, -1, 1)
    delta = torch.einsum("te, teo -> to", coeff, out)
    return y + delta.view(*x.shape[:-1], delta.shape[-1]).to(y.dtype)


def weight_form(params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo) -> tuple[Tensor, Tensor | None]:
    # Routed per token: no single weight (the no_merged_weight trait). With one expert it is that
    # LoRA: lora_func.routed.arrow_experts gives it back as a plain adapter, which merges.
    return refuse_merge("arrow")


def _check(options: Mapping[str, Any]) -> None:
    if options["top_k"] > options["num_experts"]:
        raise ValueError(  # error: arrow-top-k
            f"arrow: top_k={options['top_k']} is more than num_experts={options['num_experts']}; route to at most every expert"
        )


VARIANT = Variant(
    name="arrow",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors=TENSORS,
    options={
        "num_experts": Option(3, whole(1), None),
        "top_k": Option(3, whole(1), "top_k"),
        "router_temperature": Option(1.0, real(0, None, closed="()"), "router_temperature"),
        "rng_seed": Option(0, SEED, "rng_seed"),
    },
    check=_check,
    default_alpha=8.0,
    traits=frozenset({"no_merged_weight"}),
)
