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

from lora_func.variants._kernels import base_plus_low_rank, check_dropout, lowrank_input
from lora_func.variants import (
    BaseLayer,
    LayerInfo,
    PeftFormat,
    PeftMethod,
    TensorDict,
    Variant,
    is_finite_number,
)
from lora_func.variants._bank import check_seed

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


def check_options(options: Mapping[str, Any]) -> None:
    check_dropout("unilora", options)
    check_seed("unilora", "proj_seed", options)
    if options["theta_d_length"] < 1:
        raise ValueError(f"unilora option theta_d_length={options['theta_d_length']!r} must be a positive integer (the length of θ)")  # error: unilora-length
    if options["init"] not in INITS:
        raise ValueError(f"unilora option init={options['init']!r} is not one of {list(INITS)}")  # error: unilora-init
    if not (is_finite_number(options["init_theta_d_bound"]) and options["init_theta_d_bound"] > 0):
        raise ValueError(f"unilora option init_theta_d_bound={options['init_theta_d_bound']!r} must be a finite number > 0")  # error: unilora-init-bound


def _peft_config(options: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "theta_d_length": options["theta_d_length"],
        "proj_seed": options["proj_seed"],
        "init_theta_d_bound": float(options["init_theta_d_bound"]),
        "save_indices": options["save_indices"],
        "unilora_dropout": float(options["dropout"]),
        "init_weights": options["init"] == "uniform",
    }


def _peft_reads(config: Mapping[str, Any], module: str) -> dict[str, Any]:
    return {
        "theta_d_length": int(config.get("theta_d_length", 256)),
        "proj_seed": int(config.get("proj_seed", 42)),
        "init_theta_d_bound": float(config.get("init_theta_d_bound", 0.02)),
        "save_indices": bool(config.get("save_indices", False)),
        "dropout": float(config.get("unilora_dropout") or 0.0),
        "init": "uniform" if config.get("init_weights", True) else "normal",
    }


def _peft_shapes(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    a, b = (info.r, info.d_in), (info.d_out, info.r)
    return {"unilora_indices_A": a, "unilora_indices_B": b, "unilora_scales_A": a, "unilora_scales_B": b}


PEFT_METHOD = PeftMethod(
    "UNILORA",
    {"bias": "none"},
    ("modules_to_save",),
    rank_in_config=True,
    checks={
        "theta_d_length": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "proj_seed": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63,
        "init_theta_d_bound": lambda v: is_finite_number(v) and v > 0,
        "save_indices": lambda v: isinstance(v, bool),
        "unilora_dropout": lambda v: v is None or (is_finite_number(v) and 0 <= v < 1),
        "init_weights": lambda v: isinstance(v, bool),
    },
    layers_from_config=True,
)

_BUFFERS = ("unilora_indices_A", "unilora_indices_B", "unilora_scales_A", "unilora_scales_B")

VARIANT = Variant(
    name="unilora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    options={"theta_d_length": 256, "proj_seed": 42, "init_theta_d_bound": 0.02, "save_indices": False, "dropout": 0.0, "init": "uniform"},
    default_alpha=1.0,
    # In a rank-padded stack the padded indices are 0 and the padded scales 0: those entries are zeros.
    rank_axes={"unilora_indices_A": 0, "unilora_indices_B": 1, "unilora_scales_A": 0, "unilora_scales_B": 1},
    check_options=check_options,
    shared_init=shared_init,
    integer_buffers=frozenset({"unilora_indices_A", "unilora_indices_B"}),
    peft=PeftFormat(
        PEFT_METHOD,
        {name: name for name in _BUFFERS},
        lambda r, d_in, d_out: {},  # info_shapes
        _peft_config,
        _peft_reads,
        buffers=frozenset(_BUFFERS),
        shared_keys={"unilora_theta_d": "base_model.unilora_theta_d"},
        info_shapes=_peft_shapes,
        saved_buffers=lambda options: frozenset(_BUFFERS if options["save_indices"] else ()),
    ),
)
