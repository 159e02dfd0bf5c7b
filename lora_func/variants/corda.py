"""CorDA (Yang et al. 2024, arXiv 2406.05223): LoRA initialised on the singular triplets of the
base weight times the covariance of its inputs on calibration data, on top of the frozen residual,
as peft's ``init_lora_weights="corda"`` with ``preprocess_corda``.

Calibration (peft's ``calib_cov_distribution``): per batch, the layer's input rows ``X (n, d_in)``
in fp32 divided by ``|max X|``, ``C += Xᵀ X``; ``C`` divided by the number of batches. Init
(peft's ``collect_eigens_for_layer``, ``crop_corda_eigens``, ``corda_init``): ``C' = C + d·mean(diag C)·I``
with the damping ``d`` doubled from 0.01 until ``‖C' C'⁻¹ − I‖ < 0.05``; ``U, S, Vh = svd(W C')``,
``V = (Vh C'⁻¹)ᵀ``; ``corda_method="ipm"`` keeps the ``r`` largest triplets (instruction-previewed:
adapt the directions the task uses), ``"kpm"`` the ``r`` smallest (knowledge-preserving: leave the
used directions alone); ``S ← S / s``; trainable ``lora_A = diag(√S) Vᵀ (r, d_in)``,
``lora_B = U diag(√S) (d_out, r)``; frozen ``W_res = W − s·B A``; ``W_eff = W_res + s·B A``.

peft overwrites the base weight with ``W_res``; lora_func keeps the base untouched and ``W_res`` in
the adapter, with PiSSA's forms and peft conversion (``save_peft`` writes the rank-``2r`` LoRA on the
untouched base). peft's unconverted CorDA checkpoint cannot be read: its residual depends on the
calibration covariance, which the checkpoint does not hold.

peft hooks each forward call and squeezes a batch axis of one: it calibrates on batches of one
sequence. lora_func's calibration rows drop padding (``attention_mask == 0``) and ``labels == -100``
tokens; on unpadded batches of one sequence the two are the same. One pass over the batches is
used; it ends where the first batch's inputs recur (so a first batch repeated later in the data ends it early).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import Calibration, LayerInfo, Option, TensorDict, lora, one_of
from lora_func.variants._kernels import lora_scale
from lora_func.variants.pissa import residual_variant, stored_converted

METHODS = ("ipm", "kpm")


def calibrate(
    layer_inputs: Iterable[Mapping[str, Tensor]], infos: Mapping[str, LayerInfo], *, generator: torch.Generator
) -> dict[str, tuple[LayerInfo, Tensor]]:
    """``{module: (info, C (d_in, d_in))}``: each target's input covariance, peft's normalisation."""
    sums: dict[str, Tensor] = {}
    count = 0
    first: Tensor | None = None
    for batch in layer_inputs:
        # The calibration iterator cycles through the batches (for EVA's convergence loop); one pass
        # is peft's: it ends when the first batch's inputs come round again.
        probe = batch[next(iter(infos))]
        if first is not None and probe.shape == first.shape and torch.equal(probe, first):
            break
        first = probe if first is None else first
        count += 1
        for module in infos:
            rows = batch[module].detach().float()
            rows = rows / torch.max(rows).abs()
            sums[module] = sums[module] + rows.T @ rows if module in sums else rows.T @ rows
    assert count > 0  # layer_input_batches refuses empty calibration data
    return {module: (info, sums[module] / count) for module, info in infos.items()}


def _damped(covariance: Tensor) -> tuple[Tensor, Tensor]:
    """peft's damping loop: ``(C', C'⁻¹)``."""
    eye = torch.eye(covariance.shape[0], dtype=covariance.dtype, device=covariance.device)
    damp = 0.01
    for _ in range(64):  # peft loops without bound; a covariance that no damping fixes (zero, non-finite) stops here
        fixed = covariance + torch.diag(torch.ones(covariance.shape[0], device=covariance.device) * torch.mean(torch.diag(covariance)) * damp)
        inverse, singular = torch.linalg.inv_ex(fixed)
        if not singular.item() and torch.dist(fixed @ inverse, eye).item() < 0.05:
            return fixed, inverse
        damp *= 2
    raise ValueError(  # error: corda-covariance
        f"corda: the calibration covariance cannot be inverted at any damping (mean diagonal "
        f"{torch.mean(torch.diag(covariance)).item():.3g}): the layer's inputs were all zero or non-finite; calibrate on other batches"
    )


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    if not isinstance(calibration, Tensor):
        raise ValueError(  # error: corda-needs-calibration
            "corda needs calibration data: init_adapter(model, spec, calibration=[batch, ...]) (batches as for the "
            "model's forward; peft's preprocess_corda run_model)"
        )
    r, s = info.r, lora_scale(info)
    w = weight.to(torch.promote_types(weight.dtype, torch.float32))
    fixed, inverse = _damped(calibration.to(w.device, w.dtype))
    u, sv, vh = torch.linalg.svd(w @ fixed, full_matrices=False)
    v = (vh @ inverse).T
    keep = slice(None, r) if info.option("corda_method") == "ipm" else slice(-r, None)
    u, sv, v = u[:, keep], sv[keep] / s, v[:, keep]
    lora_a = v.T.mul(sv.sqrt().view(-1, 1)).contiguous()
    lora_b = u.mul(sv.sqrt()).contiguous()
    w_res = w - s * lora_b @ lora_a
    res_dtype = torch.promote_types(weight.dtype, dtype)
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}
    return params, {"W_res": w_res.to(weight.device, res_dtype).contiguous()}


VARIANT = residual_variant(
    "corda", init, options=lora.OPTIONS | {"corda_method": Option("ipm", one_of(*METHODS))}, calibration=Calibration(calibrate)
)
# Unconverted CorDA checkpoints are not read: see the module docstring.
PEFT = stored_converted("CorDA")
