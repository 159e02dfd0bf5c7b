"""OFT, Orthogonal Finetuning (Qiu et al., NeurIPS 2023, arXiv 2306.07280; the Cayley–Neumann
form from Qiu et al. 2025, arXiv 2506.19847, "OFTv2"), following HF peft 0.21's
``tuners/oft/layer.py`` (``OFTRotationModule``, ``Linear``).

peft 0.21 rotates the layer INPUT (it rotated the weight's output side before 0.14): the input
features are split into ``k`` blocks of size ``b`` (``k·b = d_in``), each multiplied by its
own orthogonal ``b × b`` block ``R_i``:

    y = base(x R) = x R Wᵀ + b,   R = blockdiag(R_0, …, R_{k−1}),   W_eff = W Rᵀ,   bias unchanged

Trainable ``oft_R (k, b(b−1)/2)``: each row the strict upper triangle of a skew matrix
``Q_i = U_i − U_iᵀ``, mapped to ``R_i`` by peft's truncated Cayley–Neumann series
``I + 2Q + 2Q² + ⋯ + Q^m`` (``use_cayley_neumann=True``, default, ``num_cayley_neumann_terms``)
or the exact Cayley map ``(I − Q)(I + Q)⁻¹`` (``use_cayley_neumann=False``). With
``block_share`` one block (``oft_R (1, b(b−1)/2)``) serves every block of the input. With
``coft`` each skew block is pulled back onto a Frobenius ball of radius ``eps/√k`` (COFT).

The block size per layer is ``oft_block_size`` (or ``d_in / num_blocks``, peft's ``r``); one that
does not divide ``d_in`` is moved to the nearest size that does, as peft moves it
(``adjust_oft_parameters``; peft warns), so one spec fits layers of different widths.

Activation form: the input rotated block by block (an ``einops`` reshape to ``(…, k, b)`` and
one batched product, ``n·d_in·b`` multiply-adds), then the base layer: no ``d_in × d_in`` or
merged matrix. Weight form: ``W Rᵀ`` block by block.

Init (``init="identity"``, peft's ``init_weights=True``): zeros, so ``R = I`` exactly.
``init="random"`` (peft's ``init_weights=False``): normal, std 0.1.

Differences from peft, on purpose: COFT's projection is applied straight through (the forms
use the projected value, the gradient w.r.t. the stored tensor is peft's) but the stored tensor
is not overwritten (peft writes the projection into its parameter before every forward), so an
optimiser step starts from the unprojected tensor. ``module_dropout`` is applied in training
steps (peft 0.21 builds the layer but its ``Linear.forward`` never calls it). GPT-2 ``Conv1D``
is supported (peft refuses it). peft's ``bias="all"|"oft_only"`` is refused on load, as for
every variant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._conv import peft_conv_layers
from lora_func.variants import FLAG, BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real, whole
from lora_func.variants._orthogonal import (
    block_multiplicative_dropout,
    block_size_of,
    cayley,
    cayley_neumann,
    coft_project,
    rotate_blocks,
    skew_from_upper,
)

INITS = ("identity", "random")


def _nearest_divisor(n: int, wanted: int) -> int:
    """peft's ``adjust_oft_parameters``: the divisor of ``n`` nearest to ``wanted`` (the lower
    one on a tie), ``n`` itself when ``wanted >= n``."""
    if wanted >= n:
        return n
    higher = wanted
    while higher <= n and n % higher:
        higher += 1
    lower = wanted
    while lower > 1 and n % lower:
        lower -= 1
    return lower if wanted - lower <= higher - wanted else higher


def layer_blocks(d_in: int, options: Mapping[str, Any]) -> tuple[int, int]:
    """``(k, b)``: the number of blocks and the block size on a layer with ``d_in`` inputs."""
    if options["num_blocks"]:
        k = _nearest_divisor(d_in, options["num_blocks"])
        return k, d_in // k
    b = _nearest_divisor(d_in, options["oft_block_size"])
    return d_in // b, b


def _stored_shape(d_in: int, options: Mapping[str, Any]) -> tuple[int, int]:
    k, b = layer_blocks(d_in, options)
    return (1 if options["block_share"] else k), b * (b - 1) // 2


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    shape = _stored_shape(info.d_in, dict(info.options))
    if info.option("init") == "random":
        vec = torch.randn(shape, generator=generator, dtype=torch.float32) * 0.1
    else:
        vec = torch.zeros(shape, dtype=torch.float32)
    return {"oft_R": vec.to(weight.device, dtype)}, {}


def rotation_blocks(params: TensorDict, info: LayerInfo, *, training: bool = False) -> Tensor:
    """The orthogonal blocks ``(k_stored, b, b)`` (``k_stored = 1`` with ``block_share``), in
    the adapter dtype, with ``module_dropout`` applied when ``training``."""
    vec = params["oft_R"]
    b = block_size_of(vec.shape[-1])
    if info.option("coft"):
        vec = coft_project(vec, b, info.option("eps"))
    q = skew_from_upper(vec, b)
    blocks = cayley_neumann(q, info.option("num_cayley_neumann_terms")) if info.option("use_cayley_neumann") else cayley(q)
    p = info.option("module_dropout")
    return block_multiplicative_dropout(blocks, p) if training and p else blocks


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    blocks = rotation_blocks(params, info).to(weight.dtype)
    # W Rᵀ: each row of W times the transposed blocks, i.e. (R W_rowᵀ)ᵀ block by block.
    return rotate_blocks(weight, blocks.transpose(-1, -2)), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    blocks = rotation_blocks(params, info, training=getattr(base, "training", False))
    # peft's order: the input cast to the adapter dtype, rotated, cast back, then the base layer.
    return base(rotate_blocks(x.to(blocks.dtype), blocks).to(x.dtype))


def check_options(options: Mapping[str, Any]) -> None:
    size, num = options["oft_block_size"], options["num_blocks"]
    if size < 0 or num < 0 or (size == 0) == (num == 0):
        raise ValueError(  # error: oft-blocks
            f"oft options oft_block_size={size} and num_blocks={num}: give exactly one of them > 0 (the other 0), as "
            f"peft's oft_block_size and r: e.g. oft_block_size=32 (default) or num_blocks=4, oft_block_size=0"
        )


VARIANT = Variant(
    name="oft",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={"oft_R": Slot(lambda i: _stored_shape(i.d_in, dict(i.options)), peft="oft_R.weight")},
    options={
        "oft_block_size": Option(32, whole(0), "oft_block_size"),
        # peft's r is the number of blocks, not a rank
        "num_blocks": Option(0, whole(0), "r"),
        "block_share": Option(False, FLAG, "block_share"),
        "coft": Option(False, FLAG, "coft"),
        "eps": Option(6e-5, real(0, closed="()", why="COFT's radius"), "eps"),
        "use_cayley_neumann": Option(True, FLAG, "use_cayley_neumann"),
        "num_cayley_neumann_terms": Option(5, whole(1), "num_cayley_neumann_terms"),
        "module_dropout": Option(0.0, real(0, 1), "module_dropout"),
        "init": Option("identity", one_of(*INITS), "init_weights", mapped({"identity": True, "random": False})),
    },
    check=check_options,
    default_alpha=1.0,
    kind_forms={"linear": None, "conv1d": None, "conv": None},
)
# peft's OFT adapts nn.Conv2d with square kernels (it reads a kernel as k[0]·k[0]).
PEFT = PeftFormat(PeftMethod("OFT"), conv1d=False, export=peft_conv_layers("OFT", (2,), square=True))
