"""WaveFT, Exploring Sparsity for Parameter Efficient Fine Tuning Using Wavelets (Bilican et al.,
2025, arXiv 2505.12532), following HF peft 0.21's ``tuners/waveft/layer.py`` (``get_delta_weight``)
and ``tuners/waveft/waverec2d.py`` (the inverse transform, ported in ``variants/_wavelet.py``).

Trainable ``waveft_spectrum (n,)``: ``n`` wavelet coefficients at fixed positions
``waveft_indices (2, n)`` (int64 row, column of the ``(d_out, d_in)`` matrix; a buffer);
``n = r`` (lora_func's ``r`` is peft's ``n_frequency``, so peft's per-layer
``n_frequency_pattern`` is the rank pattern):

    C = the coefficients scattered into a (P_out, P_in) zero matrix, offset by ((P_out − d_out)/2, (P_in − d_in)/2)
    ΔW = scaling · IDWT2(C)[:d_out, :d_in],   W_eff = W + ΔW,   bias unchanged

``P = d + L − 2`` rounded up to even (``L`` the family's filter length, peft's
``WAVELET_REDUCTIONS``), so that one level of the inverse transform (``C``'s quadrants
``[[cA, cH], [cV, cD]]`` -> ``(P − L + 2)``) gives ``d`` or ``d + 1`` rows; peft's centred crop of
the one extra row or column starts at 0. ``use_idwt=False``: ``ΔW = scaling · C`` unpadded (the
coefficients used as the weight delta directly). Positions: the first ``n`` entries of
``torch.randperm(d_out·d_in)`` from a CPU generator seeded with ``random_loc_seed`` (peft's default
777), as (row, column) of the row-major index, the same seed on every layer, as peft; peft does
not save them and neither does ``save_peft``: ``load_peft`` re-derives them
(``recompute_buffers``). Init: ``init_weights=True`` (peft's default) zeros, the identity;
``False``: ``0.01 · randn``, as peft.

Both forms build the dense ``ΔW`` (a scatter and one stride-2 transposed convolution, in the
adapter dtype, as peft computes it in its spectrum's dtype); the activation form adds it
(rounded to the base dtype) to ``W`` and runs one product, where peft's forward runs
``base(x) + x ΔWᵀ`` (two products: more writes and ops, docs/benchmarks.md). GPT-2 ``Conv1D``:
peft and lora_func both adapt it (``ΔW`` is ``(d_out, d_in)`` on Conv1D too).
``proportional_parameters=True`` spreads a budget of ``r`` per layer over the targets in
proportion to their ``d_in·d_out``, as peft (``Variant.layer_ranks``, applied by ``init_adapter``
and ``load_peft``); ``save_peft`` writes the resulting sizes as peft's ``n_frequency_pattern``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import FLAG, BaseLayer, Codec, LayerInfo, Option, PeftFormat, PeftMethod, TensorDict, Variant, one_of
from lora_func.variants._sparse import linear_plus_dense, own_values, scatter_dense, spectrum_init, spectrum_options, spectrum_tensors
from lora_func.variants._wavelet import FAMILIES, idwt2, reduction


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    return spectrum_init("waveft", "coefficients", info, std=0.01, dtype=dtype, device=weight.device, generator=generator)


def _padded(d: int, family: str) -> int:
    """peft's padded size of one axis: ``d`` plus the family's reduction, rounded up to even."""
    size = d + reduction(family)
    return size + size % 2


def delta(params: TensorDict, buffers: TensorDict, info: LayerInfo) -> Tensor:
    """``ΔW (d_out, d_in)`` in the adapter dtype."""
    spectrum = params["waveft_spectrum"]
    # In a stack of different r, info.r is the member's own (a tensor): its padding is masked.
    values = own_values(spectrum, info.r)
    rows, cols = buffers["waveft_indices"]
    scaling = info.option("scaling")
    if not info.option("use_idwt"):
        return scatter_dense(values, buffers["waveft_indices"], (info.d_out, info.d_in)) * scaling
    family = info.option("wavelet_family")
    p_out, p_in = _padded(info.d_out, family), _padded(info.d_in, family)
    shifted = torch.stack([rows + (p_out - info.d_out) // 2, cols + (p_in - info.d_in) // 2])
    full = idwt2(scatter_dense(values, shifted, (p_out, p_in)), family)  # (d_out or d_out + 1, d_in or d_in + 1)
    return full[: info.d_out, : info.d_in] * scaling


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + delta(params, buffers, info), bias  # both in the adapter dtype


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    return linear_plus_dense(base, x, delta(params, buffers, info))


def layer_ranks(r: int, infos: Mapping[str, LayerInfo]) -> dict[str, int]:
    """Each layer's ``n``: its own (the spec's ``r`` or a checkpoint's ``n_frequency_pattern``), or
    with ``proportional_parameters`` peft's ``WaveFTModel._calculate_proportional_parameters``
    (which then ignores the pattern), a budget of ``r`` per layer spread in proportion to the
    layers' sizes: ``max(1, round(r · len(infos) · d_in·d_out / Σ d_in·d_out))`` (Python's round:
    half to even)."""
    if not any(info.option("proportional_parameters") for info in infos.values()):
        return {module: info.r for module, info in infos.items()}
    total = sum(info.d_in * info.d_out for info in infos.values())
    return {module: max(1, round(info.d_in * info.d_out / total * (r * len(infos)))) for module, info in infos.items()}


VARIANT = Variant(
    name="waveft",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # r is the number of coefficients, up to d_in·d_out (checked by init); the positions are not in
    # the checkpoint (peft re-derives them from random_loc_seed).
    tensors=spectrum_tensors("waveft"),
    options=spectrum_options(scaling=25.0, init_weights=True)
    | {
        # peft 0.21 has filters for these only (its config also lists db11-db38, sym11-sym20 and
        # coif5-coif17, whose forward fails in peft itself)
        "wavelet_family": Option("db1", one_of(*FAMILIES), "wavelet_family"),
        "use_idwt": Option(True, FLAG, "use_idwt"),
        # Per-layer sizes from proportional_parameters are written as n_frequency_pattern with
        # proportional_parameters false: peft then builds the same layers whatever n_frequency is.
        "proportional_parameters": Option(False, FLAG, "proportional_parameters", Codec(lambda v: False, lambda v: v)),
    },
    default_alpha=1.0,  # not used: the scale is the scaling option
    layer_ranks=layer_ranks,
)
# peft: WaveFTConfig; n_frequency / n_frequency_pattern are lora_func's r / rank pattern.
PEFT = PeftFormat(PeftMethod("WAVEFT", rank=("n_frequency", "n_frequency_pattern")))
