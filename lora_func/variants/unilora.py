"""Uni-LoRA (Li et al. 2025, "Uni-LoRA: One Vector Is All You Need", arXiv 2506.00799),
following HF peft's ``tuners/unilora/{model,layer}.py``.

Every entry of every layer's LoRA factors is one entry of a single trainable vector
``θ (D,)`` (``theta_d_length``), times a fixed scale:

    A[i, j] = θ[idx_A[i, j]] · s_A[i, j]   (r, d_in),   B[i, j] = θ[idx_B[i, j]] · s_B[i, j]   (d_out, r)
    ΔW = B A,   y = x Wᵀ + b + (x Aᵀ) Bᵀ

no scale (``alpha`` is unused). The indices are one balanced assignment over all the adapter's
``N = Σ r (d_in + d_out)`` factor entries (every index ``N // D`` or ``N // D + 1`` times, shuffled
by ``numpy.random.default_rng(proj_seed)``, peft's ``generate_index``), cut in module order into
each layer's ``A`` then ``B`` (a layer finds its piece from :attr:`LayerInfo.position` and
:attr:`LayerInfo.layout`); each entry's scale is ``1/√(times its index is used)``. The indices
(int64) and scales are layer buffers, equal in every adapter of one seed and targets, which
:func:`lora_func.stack` holds once; ``θ`` is the adapter's one trainable leaf
(``Variant.shared_init``): a stack of adapters holds one ``(D,)`` per member.

Init (peft's ``init_weights=True``): ``θ ~ U(-init_theta_d_bound, init_theta_d_bound)``;
``init="normal"`` (peft's ``init_weights=False``): ``θ ~ N(0, 1)``, both from the generator (peft
draws from the global RNG). ΔW is not zero at init (peft's behaviour).

peft format (``UniLoraConfig``): ``base_model.unilora_theta_d`` once, and per layer
``unilora_indices_A/B`` and ``unilora_scales_A/B`` only with ``save_indices``; without them
(peft's default) the checkpoint holds no per-layer tensor, the layers are the config's
``target_modules`` on the model, and their indices and scales are re-created from ``proj_seed``,
as peft does. Difference from peft: such a checkpoint with ``layers_to_transform`` /
``layers_pattern`` is refused (lora_func finds its layers from ``target_modules`` alone).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank, lowrank_input
from lora_func.variants import FLAG, SEED, BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real, whole
from lora_func.variants._options import dropout_option

INITS = ("uniform", "normal")


@functools.lru_cache(maxsize=4)
def assignment(total: int, length: int, seed: int) -> tuple[Tensor, Tensor]:
    """``(indices (total,) int64, 1/√count (length,) fp32)``: peft's ``generate_index`` and its
    per-index scale, computed once per adapter (every layer's init slices it)."""
    import numpy as np  # peft's generator; numpy comes with transformers

    base_count, remaining = divmod(total, length)
    rng = np.random.default_rng(seed)
    data = np.repeat(np.arange(length), base_count)
    if remaining > 0:
        data = np.concatenate([data, rng.choice(length, size=remaining, replace=False)])
    rng.shuffle(data)
    indices = torch.as_tensor(data, dtype=torch.long)
    counts = torch.bincount(indices, minlength=length)
    scale = torch.zeros(length, dtype=torch.float32)
    used = counts > 0
    scale[used] = counts[used].float().rsqrt()
    return indices, scale


def shared_init(infos: Mapping[str, LayerInfo], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """``unilora_theta_d (D,)``: ``U(-bound, bound)`` or ``N(0, 1)``."""
    first = next(iter(infos.values()))
    length = first.option("theta_d_length")
    if first.option("init") == "normal":
        theta = torch.randn(length, generator=generator)
    else:
        bound = float(first.option("init_theta_d_bound"))
        theta = torch.empty(length).uniform_(-bound, bound, generator=generator)
    return {"unilora_theta_d": theta.to(device, dtype)}, {}


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    """The layer's piece of the adapter's index assignment, and its scales."""
    layout = info.layout or ((info.d_in, info.d_out, info.r),)
    sizes = [r * (d_in + d_out) for d_in, d_out, r in layout]
    indices, scale = assignment(sum(sizes), info.option("theta_d_length"), info.option("proj_seed"))
    start = sum(sizes[: info.position])
    idx_a = indices[start : start + info.r * info.d_in].view(info.r, info.d_in)
    idx_b = indices[start + info.r * info.d_in : start + sizes[info.position]].view(info.d_out, info.r)
    device = weight.device
    return {}, {
        "unilora_indices_A": idx_a.to(device).clone(),  # not a view of the cached assignment
        "unilora_indices_B": idx_b.to(device).clone(),
        # peft casts the fp32 scales to the base dtype; here to the adapter's.
        "unilora_scales_A": scale[idx_a].to(device, dtype),
        "unilora_scales_B": scale[idx_b].to(device, dtype),
    }


def factors(params: TensorDict, buffers: TensorDict) -> tuple[Tensor, Tensor]:
    """``(A (r, d_in), B (d_out, r))``: the layer's entries of θ, scaled."""
    theta = params["unilora_theta_d"]
    a = theta[buffers["unilora_indices_A"]] * buffers["unilora_scales_A"]
    b = theta[buffers["unilora_indices_B"]] * buffers["unilora_scales_B"]
    return a, b


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    a, b = factors(params, buffers)
    return weight + b @ a, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a, b = factors(params, buffers)
    h = lowrank_input(x, base, info).to(a.dtype) @ a.transpose(-1, -2)
    return base_plus_low_rank(base, x, h, b)


def _indices(**declared: object) -> dict[str, Slot]:
    # In a rank-padded stack the padded indices are 0 and the padded scales 0: those entries are zeros.
    a, b = (lambda i: (i.r, i.d_in)), (lambda i: (i.d_out, i.r))
    return {
        "unilora_indices_A": Slot(a, rank_axes=(0,), buffer=True, integer=True, peft="unilora_indices_A", saved_if="save_indices"),
        "unilora_indices_B": Slot(b, rank_axes=(1,), buffer=True, integer=True, peft="unilora_indices_B", saved_if="save_indices"),
        "unilora_scales_A": Slot(a, rank_axes=(0,), buffer=True, peft="unilora_scales_A", saved_if="save_indices"),
        "unilora_scales_B": Slot(b, rank_axes=(1,), buffer=True, peft="unilora_scales_B", saved_if="save_indices"),
    }


VARIANT = Variant(
    name="unilora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # Without save_indices peft's file holds only θ: every layer's buffers are re-created.
    tensors=_indices() | {"unilora_theta_d": Slot(lambda i: (i.option("theta_d_length"),), shared=True, peft="base_model.unilora_theta_d")},
    options={
        "theta_d_length": Option(256, whole(1, why="the length of θ"), "theta_d_length"),
        "proj_seed": Option(42, SEED, "proj_seed"),
        "init_theta_d_bound": Option(0.02, real(0, closed="()"), "init_theta_d_bound"),
        "save_indices": Option(False, FLAG, "save_indices"),
        "dropout": dropout_option("unilora_dropout"),
        "init": Option("uniform", one_of(*INITS), "init_weights", mapped({"uniform": True, "normal": False})),
    },
    default_alpha=1.0,
    shared_init=shared_init,
)
PEFT = PeftFormat(PeftMethod("UNILORA", rank=("r", None)))
