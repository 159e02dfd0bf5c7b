"""Tolerances stated relative to the scale of what is compared.

fp32 round-off depends on the CPU's kernels (AVX-512 or AVX2 GEMM blocking, a half batch or
a full one, the order of a reduction): two exact computations of values ~10 differ by a few
ulps, ~1e-6 absolute. A bound of ``atol=1e-6`` is then a bound of about one ulp and fails on
another machine. The bounds here are multiples of fp32's epsilon times the compared
quantity's largest magnitude; the failures they must catch (an adapter ignored on a path, a
wrong scale, a recompute without the adapter) move results by 1e-3 of their scale or more.

To see a test's margin on other kernels, run it with ``MKL_ENABLE_INSTRUCTIONS=AVX2
ATEN_CPU_CAPABILITY=avx2`` (what an AMD EPYC gets from MKL).
"""

from __future__ import annotations

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7
# Two fp32 evaluations of one function whose op order or blocking differs: ~100 ulps of the
# largest magnitude (the measured worst is below 20; a 1e-4 relative error is 800 ulps).
FP32_REL = 1e-5


def scale_of(want: torch.Tensor) -> float:
    return float(want.detach().double().abs().max()) if want.numel() else 0.0


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, rel: float = FP32_REL, msg: str = "") -> None:
    """``max |got - want| <= rel * max |want|`` (shapes equal), with the numbers in the message."""
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = scale_of(want)
    err = float((got.detach().double() - want.detach().double()).abs().max()) if want.numel() else 0.0
    assert err <= rel * scale, f"{msg}: max |got - want| = {err:.3g} > {rel:g} x max |want| ({scale:.3g})"
