"""LoRA-GA (Wang et al. 2024, arXiv 2407.05000): LoRA initialised on the singular vectors of the
loss gradient of the base weight on a few calibration batches, so that the first steps follow full
fine-tuning's, on top of the frozen residual; peft's ``init_lora_weights="lora_ga"`` with
``preprocess_loraga`` and ``LoraGAConfig(direction, scale, stable_gamma)``.

Calibration (peft's ``estimate_gradients``): ``G = mean over batches of ∂loss/∂W (d_out, d_in)``, the
loss the model's own on each batch (``labels`` the batch's, else its ``input_ids``; see
:func:`lora_func.calibration.layer_gradient_batches`). Init (peft's ``lora_ga_init``):
``U, S, V = svd_lowrank(G, q=min(4r, d_in, d_out), niter=4)`` (fp32 at least, the Gaussian test
matrix from the generator), the first ``2r`` triplets split between the factors by ``direction``:
``"ArB2r"`` (default) ``A = Vᵀ[:r]``, ``B = U[:, r:2r] diag(S[r:2r])``; ``"A2rBr"`` ``A = Vᵀ[r:2r]``,
``B = U[:, :r] diag(S[:r])``; ``"ArBr"`` A the odd, B the even indices; ``"random"`` ``r`` indices
of a random permutation of ``2r`` (from the generator) for both. Then ``scale``: ``"stable"``
``B ← B·d_out^¼/√stable_gamma``; ``"weight_svd"`` ``B ← B·σ₁(W)/S_B[0]`` (``σ₁`` from
``svd_lowrank(W, q=r, niter=4)``, a second draw); ``"gd_scale"`` ``A ← A/s``, ``B ← B/s``;
``"unit"`` as is. Trainable ``lora_A (r, d_in)``, ``lora_B (d_out, r)``; frozen ``W_res = W − s·B A``
(``B``, ``A`` rounded to the base dtype first, as peft); ``W_eff = W_res + s·B A``, ``s = alpha/r``
(``alpha/√r`` with ``use_rslora``). ``2r <= min(d_in, d_out)``.

peft overwrites the base weight with ``W_res``; lora_func keeps the base untouched and ``W_res`` in
the adapter, with PiSSA's forms and peft conversion: ``save_peft`` writes the rank-``2r`` LoRA on the
untouched base (peft's ``path_initial_model_for_weight_conversion`` output). peft's unconverted
LoRA-GA checkpoint cannot be read: its residual depends on the calibration gradients.

Where lora_func differs from peft: peft runs the calibration in training mode (dropout on) and
averages each weight's gradient over the backward passes that reached it; lora_func runs the model
in eval mode (reproducible) and averages over the batches (the same on models without dropout, one
backward per batch). On GPT-2 ``Conv1D`` peft's ``"stable"`` scale reads ``d_in`` for ``d_out`` (the
stored weight's first axis); lora_func uses ``d_out`` on both layer kinds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import Calibration, LayerInfo, Option, TensorDict, lora, one_of, real
from lora_func.variants._kernels import lora_scale
from lora_func.variants.pissa import residual_variant, stored_converted, svd_lowrank

DIRECTIONS = ("ArB2r", "A2rBr", "ArBr", "random")
SCALES = ("stable", "weight_svd", "gd_scale", "unit")
NITER = 4  # peft's svd_lowrank(niter=4)


def calibrate(
    layer_grads: Iterable[Mapping[str, Tensor]], infos: Mapping[str, LayerInfo], *, generator: torch.Generator
) -> dict[str, tuple[LayerInfo, Tensor]]:
    """``{module: (info, G (d_out, d_in))}``: each target's loss gradient, averaged over the batches."""
    sums: dict[str, Tensor] = {}
    count = 0
    for batch in layer_grads:
        count += 1
        for module in infos:
            sums[module] = sums[module] + batch[module] if module in sums else batch[module]
    return {module: (info, sums[module] / count) for module, info in infos.items()}


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    if not isinstance(calibration, Tensor) or tuple(calibration.shape) != (info.d_out, info.d_in):
        raise ValueError(  # error: lora-ga-needs-calibration
            "lora_ga needs calibration data: init_adapter(model, spec, calibration=[batch, ...]) (batches as for the "
            "model's forward, with 'labels' or causal-LM 'input_ids'; peft's preprocess_loraga train_step)"
        )
    r, s = info.r, lora_scale(info)
    if isinstance(r, int) and 2 * r > min(info.d_in, info.d_out):
        raise ValueError(  # error: lora-ga-rank
            f"lora_ga: 2r = {2 * r} exceeds min(d_in, d_out) = {min(info.d_in, info.d_out)}: A and B take 2r singular "
            f"triplets of the gradient between them; lower r"
        )
    compute = torch.promote_types(calibration.dtype, torch.float32)
    grad = calibration.to(weight.device, compute)
    u, sv, v = svd_lowrank(grad, min(4 * r, *grad.shape), NITER, generator)
    u, sv, vh = u[:, : 2 * r], sv[: 2 * r], v.T[: 2 * r]
    direction = info.option("direction")
    # A's rows of Vᵀ and B's columns of U (peft's names: "ArB2r" is A from the first r, B from r..2r).
    picks: tuple[Tensor | slice, Tensor | slice]
    if direction == "random":
        indices = torch.randperm(2 * r, generator=generator)[:r].to(weight.device)
        picks = (indices, indices)
    else:
        picks = {
            "ArBr": (slice(1, 2 * r, 2), slice(0, 2 * r, 2)),
            "A2rBr": (slice(r, 2 * r), slice(None, r)),
            "ArB2r": (slice(None, r), slice(r, 2 * r)),
        }[direction]
    a_rows, b_cols = picks
    lora_a, s_b, lora_b = vh[a_rows], sv[b_cols], u[:, b_cols]
    lora_b = lora_b @ torch.diag(s_b)
    scale = info.option("scale")
    if scale == "stable":
        lora_b = lora_b * (info.d_out**0.25 / info.option("stable_gamma") ** 0.5)
    elif scale == "weight_svd":
        _, weight_s, _ = svd_lowrank(weight.to(compute), r, NITER, generator)
        if s_b[0] > 0:
            lora_b = lora_b * (weight_s[0] / s_b[0])
    elif scale == "gd_scale":
        lora_a, lora_b = lora_a / s, lora_b / s
    # peft rounds the factors to the base dtype before it takes the residual.
    lora_a, lora_b = lora_a.to(weight.dtype).contiguous(), lora_b.to(weight.dtype).contiguous()
    w = weight.to(compute)
    w_res = w - s * (lora_b.to(compute) @ lora_a.to(compute))
    res_dtype = torch.promote_types(weight.dtype, dtype)
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}
    return params, {"W_res": w_res.to(weight.device, res_dtype).contiguous()}


VARIANT = residual_variant(
    "lora_ga",
    init,
    options=lora.OPTIONS
    | {
        "direction": Option("ArB2r", one_of(*DIRECTIONS)),
        "scale": Option("stable", one_of(*SCALES)),
        "stable_gamma": Option(16.0, real(0, closed="()", why="the 'stable' scale divides by its root")),
    },
    calibration=Calibration(calibrate, on="gradients"),
)
# Unconverted LoRA-GA checkpoints are not read: see the module docstring.
PEFT = stored_converted("LoRA-GA")
