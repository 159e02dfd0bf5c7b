"""BOFT, Butterfly Orthogonal Finetuning (Liu et al., ICLR 2024, arXiv 2311.06243), following
HF peft 0.21's ``tuners/boft/layer.py`` (``BOFTLayer.update_layer``, ``block_butterfly_perm``,
``cayley_batch``, ``Linear.forward``).

The layer input is rotated by a product of ``m = boft_n_butterfly_factor`` sparse orthogonal
matrices, and the output (without the bias) scaled per feature:

    y = s ⊙ (x M Wᵀ) + b,   M = B_{m−1} ⋯ B_1 B_0,   B_i = P_i blockdiag(R_{i,0}, …) P_iᵀ
    W_eff = diag(s) W Mᵀ,   bias unchanged

Trainable ``boft_R (m, k, b, b)`` (``k = boft_block_num`` blocks of size ``b =
boft_block_size``, ``k·b = d_in``) and ``boft_s (d_out,)``. Each block is the Cayley map
``(I − S)(I + S)⁻¹`` of its skew part ``S = (R − Rᵀ)/2``. ``P_i`` is the butterfly permutation of
factor ``i``: within each stretch of ``b·2^i`` input features, the ``2^{i+1}`` chunks of ``b/2``
features are reordered even chunks first, then odd ones (``P_0 = I``), so factor ``i`` mixes
features ``b·2^{i−1}`` apart and ``m`` factors reach ``b·2^{m−1}`` features.

Activation form, for fewer input rows ``n`` than output features (generation, small batches):
the input rotated factor by factor (``B_{m−1}`` first) in its own dtype as peft does; each
permutation an ``einops`` rearrange of the feature axis (``(blk two c r) <-> (blk c two r)``),
each block diagonal one batched product; ``n·d_in·b·m`` multiply-adds, no ``d_in × d_in`` matrix
(peft builds ``M`` densely every forward, ``m·d_in³`` multiply-adds). For ``n >= d_out`` rotating
the ``d_out`` rows of ``W`` instead costs less, so it runs on ``W_eff`` (one GEMM in the base
dtype). Weight form: ``Mᵀ`` applied to the rows of ``W`` the same way, then ``diag(s)``.

Init (``init="identity"``, peft's ``init_weights=True``): ``R = 0`` (every block ``I``), ``s = 1``.
``init="random"`` (``init_weights=False``): ``R ~ N(0, 0.1²)``, ``s ~ N(1, 0.1²)``.
``boft_dropout`` (peft's multiplicative dropout, training steps only): in one factor drawn at
random, ``int(p·k)`` blocks drawn at random are replaced by the identity.

Differences from peft: peft applies ``boft_n_butterfly_factor > 1`` only when its CUDA
extension (``fbd_cuda``) compiles; without it (every CPU) it silently uses one factor and
stores ``boft_R (1, k, b, b)``. lora_func always applies the factors asked for (the math of
peft's CUDA path); ``load_peft`` of such a one-factor checkpoint adds the missing factors at the
identity (peft's outputs exactly, with a warning). GPT-2 ``Conv1D`` is supported (peft refuses it). peft's ``bias`` other than
``"none"`` is refused on load, as for every variant.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from lora_func.variants._conv import CONV_KINDS, peft_conv_layers
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real, whole
from lora_func.variants._orthogonal import cayley, rotate_blocks

INITS = ("identity", "random")


def layer_blocks(d_in: int, options: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(m, k, b)``: butterfly factors, blocks per factor and block size on a layer with
    ``d_in`` inputs, after peft's checks (``BOFTLayer.update_layer``); a ``ValueError`` names
    the sizes that do not fit."""
    m, size, num = options["boft_n_butterfly_factor"], options["boft_block_size"], options["boft_block_num"]
    if num:
        size = d_in // num
    else:
        num = d_in // size if size else 0
    spread = size * 2 ** (m - 1)
    if not size or size * num != d_in or d_in % spread or (m > 1 and (size % 2 or num % 2)):
        raise ValueError(  # error: boft-blocks
            f"boft: boft_block_size={options['boft_block_size']}, boft_block_num={options['boft_block_num']} and "
            f"boft_n_butterfly_factor={m} do not fit a layer with d_in={d_in}: block size × block count must equal "
            f"d_in, d_in must be a multiple of block size × 2^(factors−1), and with more than one factor both must be "
            f"even; pick a block size that divides every target's input features (e.g. boft_block_size=4)"
        )
    return m, num, size


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    m, k, b = layer_blocks(info.d_in, dict(info.options))
    if info.option("init") == "random":
        # peft's normal_(std=0.1) and normal_(mean=1, std=0.1), draw for draw and bit for bit
        blocks = torch.empty((m, k, b, b), dtype=torch.float32).normal_(0.0, 0.1, generator=generator)
        scale = torch.empty((info.d_out,), dtype=torch.float32).normal_(1.0, 0.1, generator=generator)
    else:
        blocks, scale = torch.zeros((m, k, b, b), dtype=torch.float32), torch.ones((info.d_out,), dtype=torch.float32)
    return {"boft_R": blocks.to(weight.device, dtype), "boft_s": scale.to(weight.device, dtype)}, {}


def orthogonal_blocks(params: TensorDict, *, dropout: float = 0.0) -> Tensor:
    """``(m, k, b, b)``: the Cayley map of each block's skew part, in the adapter dtype; with
    ``dropout`` (a training step), ``int(dropout·k)`` blocks of one random factor set to ``I``."""
    raw = params["boft_R"]
    blocks = cayley(0.5 * (raw - raw.transpose(-1, -2)))
    m, k, b = blocks.shape[-4], blocks.shape[-3], blocks.shape[-1]
    dropped = int(dropout * k)
    if not dropped:
        return blocks
    # peft's MultiplicativeDropoutLayer: one factor, `dropped` of its blocks; no .item().
    factor = torch.randint(0, m, (), device=blocks.device)
    chosen = torch.rand(k, device=blocks.device).argsort() < dropped
    mask = ((torch.arange(m, device=blocks.device) == factor)[:, None] & chosen[None, :]).to(blocks.dtype)[..., None, None]
    return blocks * (1 - mask) + torch.eye(b, dtype=blocks.dtype, device=blocks.device) * mask


def _factor(x: Tensor, blocks: Tensor, i: int) -> Tensor:
    """``x (..., d_in) P_i blockdiag(blocks) P_iᵀ`` for butterfly factor ``i`` (``blocks (k, b, b)``)."""
    if i == 0:
        return rotate_blocks(x, blocks)  # P_0 = I
    half = blocks.shape[-1] // 2
    gathered = rearrange(x, "... (blk two c r) -> ... (blk c two r)", two=2, c=2**i, r=half)
    return rearrange(rotate_blocks(gathered, blocks), "... (blk c two r) -> ... (blk two c r)", two=2, c=2**i, r=half)


def rotate_input(x: Tensor, blocks: Tensor) -> Tensor:
    """``x M`` for ``x (..., d_in)``: the factors ``B_{m−1}`` first, ``B_0`` last."""
    for i in reversed(range(blocks.shape[-4])):
        x = _factor(x, blocks[i], i)
    return x


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    blocks = orthogonal_blocks(params).to(weight.dtype).transpose(-1, -2)
    return params["boft_s"].to(weight.dtype)[:, None] * _rotate_rows(weight, blocks), bias


def _rotate_rows(weight: Tensor, transposed: Tensor) -> Tensor:
    """``W Mᵀ``: each row ``w`` of ``weight`` times ``Mᵀ = B_0ᵀ B_1ᵀ ⋯ B_{m−1}ᵀ``, with
    ``B_iᵀ = P_i blockdiag(R_iᵀ) P_iᵀ``; ``transposed`` holds the blocks ``R_iᵀ``."""
    for i in range(transposed.shape[-4]):
        weight = _factor(weight, transposed[i], i)
    return weight


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    training = getattr(base, "training", False)
    blocks = orthogonal_blocks(params, dropout=info.option("boft_dropout") if training else 0.0)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows >= info.d_out:
        # As many rows as output features or more: rotating the weight's d_out rows costs less
        # than rotating the input's rows (each factor a pass over either), so the layer runs on
        # W_eff = diag(s) W Mᵀ in the base dtype, with the base bias (one GEMM).
        weight = base.weight
        w_eff = params["boft_s"][:, None] * _rotate_rows(weight.to(blocks.dtype), blocks.transpose(-1, -2))
        return torch.nn.functional.linear(x, w_eff.to(x.dtype), base.bias)
    # peft's order: the rotation in the input's dtype, the base layer, then the scale.
    y = base(rotate_input(x, blocks.to(x.dtype)))
    scale = params["boft_s"]
    out = y.to(scale.dtype) * scale
    if base.bias is not None:
        # peft's (y − b) ⊙ s + b, as y ⊙ s + b ⊙ (1 − s): one pass over the output fewer, and
        # exactly y where s = 1 (at init).
        out = out + base.bias.to(scale.dtype) * (1 - scale)
    return out.to(y.dtype)


def check_options(options: Mapping[str, Any]) -> None:
    size, num = options["boft_block_size"], options["boft_block_num"]
    if size < 0 or num < 0 or (size == 0) == (num == 0):
        raise ValueError(  # error: boft-block-options
            f"boft options boft_block_size={size} and boft_block_num={num}: give exactly one of them > 0 (the other 0), "
            f"as peft: e.g. boft_block_size=4 (default) or boft_block_num=8, boft_block_size=0"
        )


def _layer_shapes(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    m, k, b = layer_blocks(info.d_in, dict(info.options))
    return {"boft_R": (m, k, b, b), "boft_s": (info.d_out,)}


def _convert_in(found: TensorDict, options: Mapping[str, Any]) -> TensorDict:
    """A layer of a checkpoint peft wrote without its CUDA extension: the config asks for ``m``
    butterfly factors, but peft built and saved one (``boft_R (1, k, b, b)``) and computes with it.
    The other factors are added at the identity (``R = 0``: each ``B_i = I``), so the adapter
    computes exactly what peft computes; they train here, as with peft's extension."""
    blocks, factors = found.get("boft_R"), options["boft_n_butterfly_factor"]
    if blocks is None or blocks.dim() != 4 or blocks.shape[0] != 1 or factors == 1:
        return found
    warnings.warn(
        f"a BOFT checkpoint with boft_n_butterfly_factor={factors} holds one butterfly factor (peft saved it "
        f"without its CUDA extension, which applies the one factor); loaded with the other {factors - 1} at the "
        f"identity: the outputs are peft's, and those factors train too",
        UserWarning,
        stacklevel=6,
    )
    return {**found, "boft_R": torch.cat([blocks, blocks.new_zeros((factors - 1, *blocks.shape[1:]))])}


def _reshape(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...], to_peft: bool) -> Tensor:
    """``boft_s`` on a conv: peft's ``(1, d_out)`` for the ``(d_out, 1)`` of its Linear layers."""
    if kind not in CONV_KINDS or name != "boft_s" or tensor.dim() != 2:
        return tensor
    return tensor.transpose(0, 1) if (tensor.shape[1] if to_peft else tensor.shape[0]) == 1 else tensor


VARIANT = Variant(
    name="boft",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # boft_s is stored as (d_out, 1)
    tensors={
        "boft_R": Slot(lambda i: _layer_shapes(i)["boft_R"], peft="boft_R"),
        "boft_s": Slot(lambda i: (i.d_out,), peft="boft_s", matrix=1),
    },
    options={
        "boft_block_size": Option(4, whole(0), "boft_block_size"),
        "boft_block_num": Option(0, whole(0), "boft_block_num"),
        "boft_n_butterfly_factor": Option(1, whole(1, why="1: plain block-diagonal OFT"), "boft_n_butterfly_factor"),
        "boft_dropout": Option(0.0, real(0, 1), "boft_dropout"),
        "init": Option("identity", one_of(*INITS), "init_weights", mapped({"identity": True, "random": False})),
    },
    check=check_options,
    default_alpha=1.0,
    kind_forms={"linear": None, "conv1d": None, "conv": None},
)
# A checkpoint peft wrote without its CUDA extension holds one factor whatever the config says:
# boft_R goes through _convert_in (its own imported name).
# peft's BOFT adapts nn.Conv2d with square kernels, boft_s stored (1, d_out) there.
PEFT = PeftFormat(
    PeftMethod("BOFT"),
    conv1d=False,
    imported={"boft_R": "boft_R"},
    convert_in=_convert_in,
    export=peft_conv_layers("BOFT", (2,), square=True),
    reshape=_reshape,
)
