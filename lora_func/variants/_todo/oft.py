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

from lora_func.variants import (
    BaseLayer,
    LayerInfo,
    PeftFormat,
    PeftMethod,
    TensorDict,
    Variant,
    is_finite_number,
)
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
    if options["num_cayley_neumann_terms"] < 1:
        raise ValueError(  # error: oft-neumann-terms
            f"oft option num_cayley_neumann_terms={options['num_cayley_neumann_terms']} must be >= 1 (peft's default 5)"
        )
    if not 0.0 <= options["module_dropout"] < 1.0:
        raise ValueError(f"oft option module_dropout={options['module_dropout']!r} must be in [0, 1)")  # error: oft-module-dropout
    if not options["eps"] > 0:
        raise ValueError(f"oft option eps={options['eps']!r} must be > 0 (COFT's radius; peft's default 6e-5)")  # error: oft-eps
    if options["init"] not in INITS:
        raise ValueError(f"oft option init={options['init']!r} is not one of {list(INITS)}")  # error: oft-init


_OPTION_FIELDS = ("block_share", "coft", "eps", "use_cayley_neumann", "num_cayley_neumann_terms", "module_dropout")
_DEFAULTS: dict[str, Any] = {
    "oft_block_size": 32,
    "num_blocks": 0,
    "block_share": False,
    "coft": False,
    "eps": 6e-5,
    "use_cayley_neumann": True,
    "num_cayley_neumann_terms": 5,
    "module_dropout": 0.0,
    "init": "identity",
}


def _peft_config(options: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "r": options["num_blocks"],
        "oft_block_size": options["oft_block_size"],
        "init_weights": options["init"] == "identity",
        **{name: options[name] for name in _OPTION_FIELDS},
    }


def _peft_reads(config: Mapping[str, Any], module: str) -> dict[str, Any]:
    # A field missing from the config has OFTConfig's default.
    options = {name: config.get(name, _DEFAULTS[name]) for name in _OPTION_FIELDS}
    options["eps"] = float(options["eps"])
    options["module_dropout"] = float(options["module_dropout"])
    return options | {
        "num_blocks": int(config.get("r", 0)),
        "oft_block_size": int(config.get("oft_block_size", 32)),
        "init": "identity" if config.get("init_weights", True) else "random",
    }


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


VARIANT = Variant(
    name="oft",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    options=_DEFAULTS,
    default_alpha=1.0,
    uses_rank=False,
    check_options=check_options,
    # peft: OFTConfig; its r is the number of blocks (lora_func's num_blocks), not a rank.
    peft=PeftFormat(
        PeftMethod(
            "OFT",
            {"bias": "none"},
            checks={
                "r": _is_count,
                "oft_block_size": _is_count,
                "block_share": lambda v: isinstance(v, bool),
                "coft": lambda v: isinstance(v, bool),
                "eps": lambda v: is_finite_number(v) and v > 0,
                "use_cayley_neumann": lambda v: isinstance(v, bool),
                "num_cayley_neumann_terms": lambda v: _is_count(v) and v >= 1,
                "module_dropout": lambda v: is_finite_number(v) and 0 <= v < 1,
                "init_weights": lambda v: isinstance(v, bool),
            },
        ),
        {"oft_R": "oft_R.weight"},
        lambda r, d_in, d_out: {"oft_R": _stored_shape(d_in, _DEFAULTS)},
        _peft_config,
        _peft_reads,
        conv1d=False,
        layer_shapes=lambda info: {"oft_R": _stored_shape(info.d_in, dict(info.options))},
    ),
)
