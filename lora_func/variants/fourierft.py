"""FourierFT, Parameter-Efficient Fine-Tuning with Discrete Fourier Transform (Gao et al.,
ICML 2024, arXiv 2405.03003), following HF peft's ``tuners/fourierft/layer.py``.

Trainable ``fourierft_spectrum (n,)``: ``n`` spectral coefficients at fixed positions
``fourierft_indices (2, n)`` (int64 row, column; a buffer) of a ``(d_out, d_in)`` spectrum
``F``; ``n = r`` (lora_func's ``r`` is peft's ``n_frequency``, so peft's per-layer
``n_frequency_pattern`` is the rank pattern):

    ΔW = scaling · Re(IDFT2(F)) = scaling · Re(ifft2(F)),   W_eff = W + ΔW,   bias unchanged

``ifft2`` includes the ``1/(d_out·d_in)`` normalisation. Positions: the first ``n`` entries of
``torch.randperm(d_out·d_in)`` from a CPU generator seeded with ``random_loc_seed`` (peft's
default 777), as (row, column) of the row-major index; the same seed on every layer, as peft.
peft does not save the positions: it re-derives them from the seed, and so does ``load_peft``
(``recompute_buffers``). Init (``init_weights=False``, peft's default): a standard-normal
spectrum, so the adapter is NOT the identity at init (peft's and the paper's choice);
``init_weights=True``: zeros, the identity.

Both forms build the dense ``ΔW`` by a scatter and one ``ifft2`` in the adapter dtype, at least
fp32 (there is no half-precision FFT on the CPU; peft computes it in fp32 too). The activation
form adds ``ΔW`` (rounded to the base dtype) to ``W`` and runs one product (peft's forward runs
``base(x) + x ΔWᵀ``, two products: more writes and ops, docs/benchmarks.md). GPT-2 ``Conv1D``:
peft and lora_func both adapt it (peft's ``ΔW`` is ``(d_out, d_in)`` on Conv1D too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, PeftFormat, PeftMethod, TensorDict, Variant
from lora_func.variants._sparse import linear_plus_dense, own_values, scatter_dense, spectrum_init, spectrum_options, spectrum_tensors
from lora_func.variants._kernels import promoted


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    return spectrum_init("fourierft", "frequencies", info, std=1.0, dtype=dtype, device=weight.device, generator=generator)


def delta(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> Tensor:
    """``ΔW (d_out, d_in)`` in the adapter dtype (the FFT in at least fp32)."""
    spectrum = params["fourierft_spectrum"]
    ct = promoted(spectrum.dtype, torch.float32)
    # In a stack of different r, info.r is the member's own (a tensor): its padding is masked.
    dense = scatter_dense(own_values(spectrum, info.r).to(ct), buffers["fourierft_indices"], (info.d_out, info.d_in))
    return (torch.fft.ifft2(dense).real * info.option("scaling")).to(spectrum.dtype)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + delta(params, buffers, info).to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    return linear_plus_dense(base, x, delta(params, buffers, info))


VARIANT = Variant(
    name="fourierft",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # r is the number of frequencies, up to d_in·d_out (checked by init); the positions are not in
    # the checkpoint (peft re-derives them from random_loc_seed).
    tensors=spectrum_tensors("fourierft"),
    options=spectrum_options(scaling=150.0, init_weights=False),
    default_alpha=1.0,  # not used: the scale is the scaling option
)
# peft: FourierFTConfig; n_frequency / n_frequency_pattern are lora_func's r / rank pattern.
PEFT = PeftFormat(PeftMethod("FOURIERFT", rank=("n_frequency", "n_frequency_pattern")))
