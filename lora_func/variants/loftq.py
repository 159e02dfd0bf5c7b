"""LoftQ (Li et al. 2023, arXiv 2310.08659) as peft's ``init_lora_weights="loftq"`` with
``LoftQConfig(loftq_bits, loftq_iter)``: a quantized base and a LoRA that together approximate the
float weight better than the quantized weight alone.

peft's ``loftq_init`` per target, ``W (d_out, d_in)`` in fp32: ``res = W``; ``loftq_iter`` times:
``Q = dequant(quant(res))``, ``L, R = split(svd_r(W − Q))`` with ``L = U_r diag(√S_r)``,
``R = diag(√S_r) Vh_r``, then (but after the last round) ``res = W − L R``. Trainable
``lora_A = R (r, d_in)``, ``lora_B = L (d_out, r)``; frozen buffer ``W_res = Q`` (the quantized base,
dequantized, in the base dtype); ``W_eff = W_res + s·B A``, ``s = alpha/r`` (``alpha/√r`` with
``use_rslora``). As in peft the factors approximate ``W − Q`` without the scale: the correction at
init is ``s·(W − Q)_r``, exactly LoftQ's with ``alpha = r`` (``s = 1``, the LoftQ authors' setting).

The quantizers are bitsandbytes' (which peft 0.21 calls; its own ``NFQuantizer`` was removed in
peft 0.20), written here in torch so that the init needs no bitsandbytes and runs on any device:
``loftq_bits=4``: NF4, blocks of 64 consecutive entries of the row-major weight, each scaled by its
fp32 absmax (``Params4bit(compress_statistics=False, quant_type="nf4")``), rounding to the nearest
NF4 level (bitsandbytes' ``quantize_4bit``); ``loftq_bits=8``: LLM.int8's row-wise absmax quantization of
the fp16-rounded weight (``Int8Params``). Both equal bitsandbytes' kernels on the CPU bit for bit
(tests/test_init_loftq.py); bitsandbytes' own CPU 4-bit dequantization differs where ``d_in`` is not
a multiple of 64 (its blocks then straddle rows), lora_func's is the block-wise definition.

peft writes ``Q`` into the base weight; lora_func keeps the base untouched and ``Q`` in the adapter
(as for PiSSA), so the adapter is the "replace base" mode that never touches the base. The
quantization is a deterministic function of the base, so a LoftQ checkpoint is the factors and the
config: ``save_peft`` writes them as they are, and peft loading them onto the untouched base runs
``loftq_init`` again and gets the same ``Q``, as ``load_peft`` does. On an already quantized base
(QLoRA) the variant is refused (its dense ``Q`` would take full-precision memory). On GPT-2
``Conv1D`` lora_func quantizes ``W (d_out, d_in)`` (blocks along its rows); peft quantizes the stored
``(d_in, d_out)`` weight, so ``save_peft`` refuses such an adapter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lora_func.variants import LayerInfo, Option, TensorDict, lora, one_of, whole
from lora_func.variants.pissa import residual_variant

BLOCKSIZE = 64  # bitsandbytes' Params4bit default
# bitsandbytes' NF4 levels (functional.get_4bit_type("nf4")), sorted.
NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def nf4_roundtrip(weight: Tensor) -> Tensor:
    """``dequantize_4bit(quantize_4bit(weight, blocksize=64, quant_type="nf4"))`` as bitsandbytes
    computes them (its "default" kernels), fp32: each block of 64 consecutive entries (the last
    one shorter) divided by its absmax, rounded to the nearest NF4 level, times the absmax."""
    flat = weight.reshape(-1).float()
    n = flat.numel()
    full = n - n % BLOCKSIZE
    code = torch.tensor(NF4, device=weight.device)
    bounds = (code[:-1] + code[1:]) / 2
    blocks = flat[:full].reshape(-1, BLOCKSIZE)
    absmax = blocks.abs().max(dim=-1)[0]
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1)
    out = code[torch.bucketize(scaled, bounds)] * absmax.view(-1, 1)
    if full < n:
        last = flat[full:].abs().max().clamp(min=1e-38)
        tail = code[torch.bucketize(torch.clamp(flat[full:] / last, -1, 1), bounds)] * last
        return torch.cat([out.reshape(-1), tail]).reshape(weight.shape)
    return out.reshape(weight.shape)


def int8_roundtrip(weight: Tensor) -> Tensor:
    """bitsandbytes' ``Int8Params`` round trip, fp32: the weight rounded to fp16, each row divided
    by its absmax, times 127, rounded to int8, and back (``int8_vectorwise_dequant``)."""
    half = weight.to(torch.float16)
    stats = half.abs().max(dim=1).values.float()
    codes = torch.round(half * (127.0 / stats.unsqueeze(-1))).to(torch.int8)
    return codes * stats.view(-1, 1) * 7.874015718698502e-3


def loftq_factors(weight: Tensor, r: int, bits: int, iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """peft's ``loftq_init``: ``(Q (d_out, d_in), A = R (r, d_in), B = L (d_out, r))`` in fp32."""
    roundtrip = nf4_roundtrip if bits == 4 else int8_roundtrip
    w = weight.to(torch.float32)
    res = w
    for i in range(iters):
        quantized = roundtrip(res)
        u, s, vh = torch.linalg.svd(w - quantized, full_matrices=False)
        # peft's split: L = U sqrt(diag(S))[:, :r], R = sqrt(diag(S))[:r] Vh.
        lower = u @ torch.sqrt(torch.diag(s)[:, :r])
        upper = torch.sqrt(torch.diag(s)[:r, :]) @ vh
        if i + 1 < iters:
            res = w - lower @ upper
    return quantized, upper, lower


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    quantized, lora_a, lora_b = loftq_factors(weight, info.r, info.option("loftq_bits"), info.option("loftq_iter"))
    res_dtype = torch.promote_types(weight.dtype, dtype)
    params = {"lora_A": lora_a.to(weight.device, dtype).contiguous(), "lora_B": lora_b.to(weight.device, dtype).contiguous()}
    # peft casts Q to the base dtype; the buffer keeps the more precise of base and adapter dtypes (PiSSA's rule).
    return params, {"W_res": quantized.to(weight.dtype).to(weight.device, res_dtype).contiguous()}


VARIANT = residual_variant(
    "loftq",
    init,
    options=lora.OPTIONS
    | {
        # NF4 (bitsandbytes' 4-bit) or LLM.int8: the quantizations peft's LoftQ supports
        "loftq_bits": Option(4, one_of(4, 8), "loftq_config.loftq_bits"),
        "loftq_iter": Option(1, whole(1, why="alternating quantize/SVD rounds"), "loftq_config.loftq_iter"),
    },
)
# A peft LoftQ checkpoint: the quantized base recomputed from the untouched base, as peft does on
# load. peft quantizes a GPT-2 Conv1D weight in its stored (d_in, d_out) layout (and its factors
# then do not fit the layer); lora_func quantizes W (d_out, d_in): not peft's, so not written.
PEFT = lora.stored_as_lora(reads={"use_dora": False, "init_lora_weights": "loftq"}, writes={"init_lora_weights": "loftq"}, conv1d=False)
