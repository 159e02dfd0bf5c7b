"""LoRA (Hu et al. 2021, arXiv 2106.09685), with the rsLoRA scale (arXiv 2312.03732).

Trainable ``lora_A (r, d_in)`` and ``lora_B (d_out, r)``;
``y = x Wᵀ + b + s · (x Aᵀ) Bᵀ``, ``W_eff = W + s·B A``, ``s = alpha/r`` (or
``alpha/sqrt(r)`` with ``use_rslora``). Init as peft: ``A ~ kaiming_uniform(a=√5)``
(or ``N(0, 1/r²)`` with ``init="gaussian"``), ``B = 0``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lora_func._kernels import (
    check_dropout,
    kaiming_uniform,
    lora_activation_form,
    lora_scale,
    lora_embedding_form,
    lora_weight_form,
)
from lora_func.variants import (
    LayerInfo,
    PeftFormat,
    PeftMethod,
    TensorDict,
    Variant,
    is_finite_number,
)
from lora_func.variants._contract import LowRank

INITS = ("kaiming", "gaussian", "orthogonal")

# ------------------------------------------------------------------ peft's format (LoraConfig)

# LoRA inits that leave the base untouched: the checkpoint is a plain LoRA on the original base.
PEFT_PLAIN_INITS = (True, False, "gaussian", "orthogonal")
# LoraConfig fields lora_func has no equivalent for: any truthy value is refused.
PEFT_UNSUPPORTED_FIELDS = (
    "lora_bias", "layer_replication", "alora_invocation_tokens", "use_qalora", "use_bdlora",
    "arrow_config", "monteclora_config", "velora_config", "trainable_token_indices", "modules_to_save",
    "megatron_config",
)
PEFT_KEYS = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight"}


def _converted_init(config: Mapping[str, Any]) -> str:
    init, use_dora = config.get("init_lora_weights", True), bool(config.get("use_dora", False))
    return (
        f"it was initialised with init_lora_weights={init!r}{' and use_dora' if use_dora else ''}: peft changed "
        f"its base weights for it, so the checkpoint is relative to a base lora_func does not have; save it in peft with "
        f"save_pretrained(..., path_initial_model_for_weight_conversion=<dir of the initial adapter>) to get a "
        f"plain LoRA on the original base"
    )


# Every variant that peft stores as a LoraConfig (lora, dora, pissa, eva) shares this method.
PEFT_METHOD = PeftMethod(
    "LORA",
    {"bias": "none"},
    PEFT_UNSUPPORTED_FIELDS,
    rank_of=("lora_A", 0),
    rank_pattern=True,
    alpha=True,
    checks={
        "lora_dropout": lambda v: v is None or (is_finite_number(v) and 0 <= v < 1),
        "use_rslora": lambda v: isinstance(v, bool),
        "use_dora": lambda v: isinstance(v, bool),
        "init_lora_weights": lambda v: isinstance(v, (bool, str)),
    },
    unread=_converted_init,
)


def peft_shapes(r: int, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
    """``lora_A (r, d_in)``, ``lora_B (d_out, r)``."""
    return {"lora_A": (r, d_in), "lora_B": (d_out, r)}


def peft_config(
    options: Mapping[str, Any], *, use_dora: bool = False, init: str | bool = True, eva_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The LoraConfig fields a variant stored as LoRA writes (the same for every layer)."""
    return {
        "lora_dropout": float(options.get("dropout", 0.0)),
        "use_rslora": bool(options.get("use_rslora", False)),
        "use_dora": use_dora,
        "init_lora_weights": init,
        "eva_config": eva_config,
    }


def peft_reads(config: Mapping[str, Any], *, use_dora: bool, inits: Sequence[Any], kasa: bool = False) -> dict[str, Any] | None:
    """The options shared by the variants stored as LoRA, when the config's ``use_dora``,
    ``init_lora_weights`` and ``kasa_config`` (set or not) are this variant's."""
    if bool(config.get("use_dora", False)) != use_dora or config.get("init_lora_weights", True) not in inits:
        return None
    if bool(config.get("kasa_config")) != kasa:
        return None
    # dropout is peft's lora_dropout: it acts in training steps only.
    return {"use_rslora": bool(config.get("use_rslora", False)), "dropout": float(config.get("lora_dropout") or 0.0)}


def _reads(config: Mapping[str, Any], module: str) -> dict[str, Any] | None:
    options = peft_reads(config, use_dora=False, inits=PEFT_PLAIN_INITS)
    init = config.get("init_lora_weights")
    return None if options is None else options | {"init": init if init in ("gaussian", "orthogonal") else "kaiming"}


# LoRA on nn.Embedding: peft's lora.Embedding stores A (r, num_embeddings) and B (dim, r), the
# lora_func shapes of the canonical view (d_in = num_embeddings), under other names.
PEFT_KEYS_BY_KIND = {"embedding": {"lora_A": "lora_embedding_A", "lora_B": "lora_embedding_B"}}


def peft_kind_shape(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A LoRA tensor in peft's shape on a target of ``kind`` with stored weight ``shape``: on a
    conv, ``lora_A (r, in·prod(k)) -> (r, in, *k)`` (a conv with the base kernel) and ``lora_B
    (out, r) -> (out, r, 1, ...)`` (a 1x1 conv); on an expert parameter ``(E, ·, ·)``, peft's
    ``lora_A (r·E, d_in)`` (expert-major rows) and ``lora_B (d_out, r·E)`` (expert-minor columns)."""
    if kind == "conv":
        return tensor.reshape(tensor.shape[0], *shape[1:]) if name == "lora_A" else tensor.reshape(*tensor.shape, *[1] * (len(shape) - 2))
    if kind == "experts":
        return tensor.reshape(-1, tensor.shape[-1]) if name == "lora_A" else tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)
    return tensor


def lora_kind_shape(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The inverse of :func:`peft_kind_shape`; a tensor of another shape comes back unchanged
    (the loader's shape check then names it)."""
    if kind == "conv":
        # A (r, in, *k) matches the base kernel's (in, *k), B (out, r, 1, ...) is a 1x1 conv.
        fits = tuple(tensor.shape[1:]) == tuple(shape[1:]) if name == "lora_A" else tuple(tensor.shape[2:]) == (1,) * (len(shape) - 2)
        return tensor.flatten(1) if fits else tensor
    if kind == "experts" and tensor.dim() == 2:
        experts = shape[0]
        if name == "lora_A" and tensor.shape[0] % experts == 0:
            return tensor.reshape(experts, -1, tensor.shape[-1])
        if name == "lora_B" and tensor.shape[1] % experts == 0:
            return tensor.reshape(tensor.shape[0], -1, experts).permute(2, 0, 1)
    return tensor


PEFT = PeftFormat(
    PEFT_METHOD,
    PEFT_KEYS,
    peft_shapes,
    peft_config,
    _reads,
    keys_by_kind=PEFT_KEYS_BY_KIND,
    to_peft=peft_kind_shape,
    from_peft=lora_kind_shape,
)

# The activation form is base(x) + s·(dropout(x) Aᵀ) Bᵀ (lora_activation_form): shared with eva.
LOW_RANK = LowRank("lora_A", "lora_B", lora_scale)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, d_in, d_out = info.r, info.d_in, info.d_out
    if info.option("init") == "gaussian":
        lora_a = torch.randn((r, d_in), generator=generator, dtype=torch.float32) / r
    elif info.option("init") == "orthogonal":
        return orthogonal_init(weight, info, dtype=dtype, generator=generator)
    else:
        lora_a = kaiming_uniform((r, d_in), a=math.sqrt(5), generator=generator)
    lora_b = torch.zeros((d_out, r), dtype=torch.float32)
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}
    return params, {}


def orthogonal_init(weight: Tensor, info: LayerInfo, *, dtype: torch.dtype, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """peft's ``init_lora_weights="orthogonal"`` (its draws in its order): ``Q = qr(N(0, 1)^{r×r})``,
    ``A = (N^{d_in×r/2} Q[0::2])ᵀ / 10``, ``B = (N^{r/2×d_out})ᵀ Q[1::2] / 10``; ``B A = 0`` (the rows
    of ``Q`` are orthonormal) up to round-off, with both factors non-zero. ``r`` even."""
    r = info.r
    if isinstance(r, int) and r % 2:
        raise ValueError(f"lora option init='orthogonal' needs an even rank (A and B take alternate rows of one orthogonal matrix), got r={r}")  # error: lora-orthogonal-odd-r
    q, _ = torch.linalg.qr(torch.randn((r, r), generator=generator))
    lora_a = torch.randn((info.d_in, r // 2), generator=generator).mm(q[0::2, :]).T / 10.0
    lora_b = torch.randn((r // 2, info.d_out), generator=generator).T.mm(q[1::2, :]) / 10.0
    return {"lora_A": lora_a.contiguous().to(weight.device, dtype), "lora_B": lora_b.contiguous().to(weight.device, dtype)}, {}


def check_options(options: Mapping[str, Any]) -> None:
    check_dropout("lora", options)
    if options["init"] not in INITS:
        raise ValueError(f"lora option init={options['init']!r} is not one of {list(INITS)}")  # error: lora-init


VARIANT = Variant(
    name="lora",
    init=init,
    weight_form=lora_weight_form,
    activation_form=lora_activation_form,
    options={"use_rslora": False, "init": "kaiming", "dropout": 0.0},
    default_alpha=8.0,
    rank_axes={"lora_A": 0, "lora_B": 1},
    check_options=check_options,
    peft=PEFT,
    low_rank=LOW_RANK,
    # The merged path serves every kind; peft has LoRA on all of these (nn.Embedding, conv
    # layers, target_parameters) but norms.
    kinds=frozenset({"linear", "conv1d", "embedding", "conv", "experts"}),
    kind_forms={"embedding": lora_embedding_form},  # a gather instead of a merged (V, d) table
)
