"""C3A, Circular Convolution Adaptation (Chen et al., ACL 2025, arXiv 2407.19342), following HF
peft's ``tuners/c3a/layer.py`` and ``tuners/c3a/utils.py``.

Trainable ``c3a_kernel (d_out/b, d_in/b, b)``: one length-``b`` kernel per ``b × b`` block of
the weight; ``b = r`` (lora_func's ``r`` is peft's ``block_size``, so peft's per-layer
``block_size_pattern`` is the rank pattern; ``b`` must divide ``d_in`` and ``d_out``). Block
``(i, j)`` of ``ΔW`` is the circulant matrix of kernel ``w_ij`` (a circular cross-correlation):

    ΔW[i·b + s, j·b + t] = w_ij[(t − s) mod b] / d_in,   W_eff = W + ΔW,   bias unchanged

Activation form (peft's ``BlockCircularConvolution``), never building ``ΔW``: with ``x`` split
into ``d_in/b`` blocks ``x_j`` of length ``b``,

    y = base(x) + Re(fft(Σ_j ifft(x_j) ⊙ fft(w_ij))) / d_in

one FFT of the input blocks, a ``(d_out/b) × (d_in/b)`` product per frequency (``b`` of them,
``d_in·d_out/b`` multiply-adds per row instead of the dense ``d_in·d_out``) and one FFT back.
torch's own FFT autograd gives peft's hand-written backward. Weight form: the circulant blocks
gathered from the kernel (no FFT). Both run in the adapter dtype, at least fp32 (no
half-precision FFT on the CPU); peft computes them in fp32 whatever the model's dtype.

Init (``init="zeros"``, peft's ``init_weights=True``): zeros, the identity. ``"xavier_uniform"``
(peft's ``init_weights=False`` too), ``"kaiming_uniform"``, ``"gaussian"`` (standard normal):
peft's random inits. peft refuses GPT-2 ``Conv1D``; lora_func adapts it (same math on the
canonical ``(d_out, d_in)`` weight).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of

INITS = ("zeros", "xavier_uniform", "kaiming_uniform", "gaussian")


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    b = info.r
    if info.d_in % b or info.d_out % b:
        divisors = [k for k in range(1, min(info.d_in, info.d_out) + 1) if info.d_in % k == 0 and info.d_out % k == 0]
        raise ValueError(  # error: c3a-block-size
            f"c3a: r={b} (peft's block_size) must divide d_in={info.d_in} and d_out={info.d_out}; the largest that "
            f"does is r={divisors[-1]}"
        )
    shape = (info.d_out // b, info.d_in // b, b)
    kind = info.option("init")
    if kind == "zeros":
        kernel = torch.zeros(shape)
    elif kind == "gaussian":
        kernel = torch.randn(shape, generator=generator)
    else:
        bound = math.sqrt(1.0 / info.d_in) if kind == "kaiming_uniform" else math.sqrt(3.0) * math.sqrt(2.0 / (info.d_in + info.d_out))
        kernel = torch.empty(shape).uniform_(-bound, bound, generator=generator)
    return {"c3a_kernel": kernel.to(weight.device, dtype)}, {}


def _compute_dtype(t: Tensor) -> torch.dtype:
    # fp32 or fp64 (torch.promote_types would run as an op of the step)
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def delta(kernel: Tensor, d_in: int) -> Tensor:
    """``ΔW (d_out, d_in)``: the circulant blocks ``ΔW[i·b + s, j·b + t] = w_ij[(t − s) mod b] / d_in``."""
    m, n, b = kernel.shape[-3:]
    offsets = torch.arange(b, device=kernel.device)
    index = (offsets[None, :] - offsets[:, None]) % b  # (s, t) -> (t - s) mod b
    blocks = kernel[..., index]  # (m, n, s, t)
    return blocks.transpose(-3, -2).reshape(*kernel.shape[:-3], m * b, n * b) / d_in


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + delta(params["c3a_kernel"], info.d_in).to(weight.dtype), bias


def circular_convolution(x: Tensor, kernel: Tensor) -> Tensor:
    """``x ΔWᵀ · d_in`` for ``x (..., d_in)``, ``kernel (m, n, b)``: peft's block circular
    convolution, ``Re(fft(Σ_j ifft(x_j) ⊙ fft(w_ij)))``, as ``(..., m·b)``."""
    m, n, b = kernel.shape
    blocks = torch.fft.ifft(x.reshape(*x.shape[:-1], n, b))
    mixed = torch.einsum("...nb,mnb->...mb", blocks, torch.fft.fft(kernel))
    return torch.fft.fft(mixed).real.reshape(*x.shape[:-1], m * b)


class _CircularConvolution(torch.autograd.Function):
    """:func:`circular_convolution` saving only its real inputs for backward (autograd through the
    FFTs would keep the complex spectra of the input and of the intermediate: 2-4x the bytes),
    with the gradients as FFTs too. With ``g_i`` the output gradient's blocks and ``G_i = fft(g_i)``
    (one spectrum for both):

        ∂x_j = Re(ifft(Σ_i G_i ⊙ fft(w_ij))),   ∂w_ij = Re(fft(Σ_rows G_i ⊙ ifft(x_j)))

    (the first is ``Re(fft(Σ_i ifft(g_i) ⊙ b·ifft(w_ij)))``, the adjoint of the forward, with
    ``ifft(v) = conj(fft(v))/b`` for real ``v``; peft 0.21's hand-written backward has
    ``Re(fft(Σ_i G_i ⊙ ifft(w_ij)))`` there, the conjugate spectrum: a wrong input gradient.)
    ``generate_vmap_rule``: vmap and ``torch.func`` see through it (torch.compile gets the plain
    FFTs, see ``activation_form``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, kernel: Tensor) -> Tensor:
        return circular_convolution(x, kernel)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        x, kernel = ctx.saved_tensors
        m, n, b = kernel.shape
        g = grad_out.reshape(*grad_out.shape[:-1], m, b)
        x_blocks = x.reshape(*x.shape[:-1], n, b)
        spectrum = torch.fft.fft(g)
        grad_x = torch.fft.ifft(torch.einsum("...mb,mnb->...nb", spectrum, torch.fft.fft(kernel))).real
        grad_kernel = torch.fft.fft(torch.einsum("...mb,...nb->mnb", spectrum, torch.fft.ifft(x_blocks))).real
        return grad_x.reshape(x.shape), grad_kernel


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    kernel = params["c3a_kernel"]
    ct = _compute_dtype(kernel)
    y = base(x)
    # Under torch.compile, autograd through the FFTs (the compiler plans what to save itself;
    # dynamo's handling of a custom Function here warns about instantiating it).
    conv = circular_convolution if torch.compiler.is_compiling() else _CircularConvolution.apply
    # 1/d_in on the output, as peft: on the kernel it would write less, but the scaled kernel
    # is a new tensor that backward keeps (more saved bytes than peft's).
    return y + (cast(Tensor, conv(x.to(ct), kernel.to(ct))) / info.d_in).to(y.dtype)


VARIANT = Variant(
    name="c3a",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # r is the block size: it must divide d_in and d_out (checked by init)
    tensors={"c3a_kernel": Slot(lambda i: (i.d_out // i.r, i.d_in // i.r, i.r), peft="c3a_kernel")},
    options={"init": Option("zeros", one_of(*INITS), "init_weights", mapped({"zeros": True, **{name: name for name in INITS[1:]}}, also={False: "xavier_uniform"}))},
    default_alpha=1.0,  # not used: the scale is 1/d_in
)
# peft: C3AConfig; block_size / block_size_pattern are lora_func's r / rank pattern.
PEFT = PeftFormat(PeftMethod("C3A", rank=("block_size", "block_size_pattern")), conv1d=False)
