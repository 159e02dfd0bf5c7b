"""VB-LoRA, LoRA from a shared vector bank (Li, Han, Ji, NeurIPS 2024, arXiv 2405.15179),
following HF peft's ``tuners/vblora/{model,layer}.py``.

One trainable bank ``vblora_vector_bank (N, L)`` (``num_vectors`` × ``vector_length``) is
shared by every adapted layer. Each layer's LoRA factors are built from it, sub-vector by
sub-vector: every length-``L`` piece of ``A (r, d_in)`` and ``B (d_out, r)`` is a mixture of
``k = topk`` bank vectors, weighted by a softmax over the ``k`` largest of its trainable logits:

    mix(z) = Σ_{j ∈ topk(z)} softmax(z_topk)_j · bank_j
    A[i, t·L:(t+1)·L] = mix(vblora_logits_A[i, t])         vblora_logits_A (r, d_in/L, N)
    B[t·L:(t+1)·L, i] = mix(vblora_logits_B[t, i])         vblora_logits_B (d_out/L, r, N)
    ΔW = B A,   y = x Wᵀ + b + (x Aᵀ) Bᵀ

no scale (``alpha`` is unused). ``d_in`` and ``d_out`` of every layer must be multiples of
``vector_length``. The bank is one trainable leaf of the adapter (``Variant.shared_init``): its
gradient is the sum over the layers, and a stack of adapters holds one bank per member.

Init as peft: ``bank ~ U(-init_vector_bank_bound, init_vector_bank_bound)``, logits ``~ N(0,
init_logits_std²)``, both from the given generator (peft draws them from the global RNG). ΔW is
not zero at init (peft's behaviour): the adapted model differs from the base from the start.

peft format (``VBLoRAConfig``): the two logits per layer and ``base_model.vblora_vector_bank``
once; with ``save_only_topk_weights=True`` (option) each logits tensor is stored as its top-k
indices (the smallest integer type that holds ``num_vectors``) and the first ``k − 1`` softmax
weights, as peft stores it, and read back as peft does (``log`` of the weights at the indices).
Difference from peft: the other logits of such a checkpoint are the dtype's lowest finite value
(peft: ``-inf``), so the adapter stays finite and can be trained further (peft refuses to).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank, lowrank_input
from lora_func.variants import FLAG, BaseLayer, LayerInfo, Option, PeftFormat, PeftLayer, PeftMethod, Slot, TensorDict, Variant, real, whole
from lora_func.variants._options import dropout_option
from lora_func.variants._bank import one_rank


def _sizes(info: LayerInfo) -> tuple[int, int, int]:
    """``(vector_length, num_vectors, topk)``."""
    return info.option("vector_length"), info.option("num_vectors"), info.option("topk")


def shared_init(infos: Mapping[str, LayerInfo], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """``vblora_vector_bank (num_vectors, vector_length) ~ U(-bound, bound)``."""
    first = next(iter(infos.values()))
    one_rank("vblora", infos)
    length, count, _ = _sizes(first)
    uneven = sorted(m for m, info in infos.items() if info.d_in % length or info.d_out % length)
    if uneven:
        sizes = ", ".join(f"{m} ({infos[m].d_out}x{infos[m].d_in})" for m in uneven[:4])
        raise ValueError(  # error: vblora-vector-length
            f"vblora: vector_length={length} must divide d_in and d_out of every layer, and does not for {sizes}; "
            f"pick a common divisor of the layers' sizes, or leave those layers out"
        )
    bound = float(first.option("init_vector_bank_bound"))
    bank = torch.empty(count, length).uniform_(-bound, bound, generator=generator)
    return {"vblora_vector_bank": bank.to(device, dtype)}, {}


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    length, count, _ = _sizes(info)
    std = float(info.option("init_logits_std"))
    logits_a = torch.randn(info.r, info.d_in // length, count, generator=generator) * std
    logits_b = torch.randn(info.d_out // length, info.r, count, generator=generator) * std
    return {"vblora_logits_A": logits_a.to(weight.device, dtype), "vblora_logits_B": logits_b.to(weight.device, dtype)}, {}


def mixture(logits: Tensor, bank: Tensor, topk: int) -> Tensor:
    """``(..., N) logits -> (..., L)``: the softmax over the ``topk`` largest logits, weighting
    their bank vectors (peft's ``_get_low_rank_matrix``)."""
    top, indices = logits.topk(topk, dim=-1)
    return (torch.softmax(top, dim=-1).unsqueeze(-1) * bank[indices]).sum(-2)


def factors(params: TensorDict, info: LayerInfo) -> tuple[Tensor, Tensor]:
    """``(A (r, d_in), B (d_out, r))`` from the logits and the bank."""
    bank, topk = params["vblora_vector_bank"], info.option("topk")
    logits_a, logits_b = params["vblora_logits_A"], params["vblora_logits_B"]
    a = mixture(logits_a, bank, topk).reshape(logits_a.shape[0], -1)
    # (d_out/L, r, L) -> (d_out/L, L, r) -> (d_out, r)
    b = mixture(logits_b, bank, topk).transpose(-1, -2).reshape(-1, logits_b.shape[1])
    if not isinstance(info.r, int):
        # A member of a rank-padded stack: its padded logits are zeros, whose mixture is not, so
        # the padded ranks are masked on the factors (info.r is the member's own rank).
        keep = (torch.arange(a.shape[0], device=a.device) < info.r).to(a.dtype)
        a, b = a * keep.unsqueeze(-1), b * keep
    return a, b


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    a, b = factors(params, info)
    return weight + b @ a, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a, b = factors(params, info)
    h = lowrank_input(x, base, info).to(a.dtype) @ a.transpose(-1, -2)
    return base_plus_low_rank(base, x, h, b)


def check_options(options: Mapping[str, Any]) -> None:
    if options["topk"] > options["num_vectors"]:
        raise ValueError(  # error: vblora-topk
            f"vblora option topk={options['topk']} exceeds num_vectors={options['num_vectors']}: each sub-vector mixes topk of the bank's vectors"
        )


_LOGITS = ("vblora_logits_A", "vblora_logits_B")


def _index_dtype(count: int) -> torch.dtype:
    """peft's choice: the smallest integer type that holds ``count`` vector indices."""
    for limit, dtype in ((2**8, torch.uint8), (2**15, torch.int16), (2**31, torch.int32)):
        if count < limit:
            return dtype
    return torch.int64


def _export(params: TensorDict, buffers: TensorDict, weight: Tensor | None, info: LayerInfo) -> PeftLayer:
    """The logits as they are, or (``save_only_topk_weights``) each as its top-k indices and the
    first k − 1 softmax weights (peft's ``_get_adapter_state_dict``)."""
    if not info.option("save_only_topk_weights"):
        return PeftLayer(lambda: {name: params[name] for name in _LOGITS}, r=info.r)

    def tensors() -> TensorDict:
        out = {}
        for name in _LOGITS:
            top, indices = params[name].detach().topk(info.option("topk"))
            out[f"{name}_topk_indices"] = indices.to(_index_dtype(info.option("num_vectors")))
            out[f"{name}_topk_weights"] = torch.softmax(top, dim=-1)[..., :-1].contiguous()
        return out

    return PeftLayer(tensors, r=info.r)


def _convert_in(found: TensorDict, options: Mapping[str, Any]) -> TensorDict:
    """Top-k indices and weights back to logits, as peft does: ``log`` of the k weights (the last
    is one minus the others) at the indices, the dtype's lowest finite value elsewhere."""
    count = options["num_vectors"]
    out = {}
    for name in _LOGITS:
        indices, weights = found.get(f"{name}_topk_indices"), found.get(f"{name}_topk_weights")
        if indices is None or weights is None or indices.shape[:-1] != weights.shape[:-1] or indices.shape[-1] != weights.shape[-1] + 1:
            have = {k: tuple(v.shape) for k, v in found.items()}
            raise ValueError(  # error: vblora-topk-tensors
                f"vblora: a save_only_topk_weights layer needs {name}_topk_indices (..., k) and {name}_topk_weights "
                f"(..., k-1), got {have}; re-save the checkpoint"
            )
        weights = torch.cat([weights, 1 - weights.sum(-1, keepdim=True)], dim=-1)
        logits = torch.full((*weights.shape[:-1], count), torch.finfo(weights.dtype).min, dtype=weights.dtype)
        out[name] = logits.scatter(-1, indices.long(), torch.log(weights))
    return out


def _peft_shapes(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    length, count, _ = _sizes(info)
    return {"vblora_logits_A": (info.r, info.d_in // length, count), "vblora_logits_B": (info.d_out // length, info.r, count)}


VARIANT = Variant(
    name="vblora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "vblora_logits_A": Slot(lambda i: _peft_shapes(i)["vblora_logits_A"], rank_axes=(0,), peft="vblora_logits_A"),
        "vblora_logits_B": Slot(lambda i: _peft_shapes(i)["vblora_logits_B"], rank_axes=(1,), peft="vblora_logits_B"),
        "vblora_vector_bank": Slot(lambda i: (i.option("num_vectors"), i.option("vector_length")), shared=True, peft="base_model.vblora_vector_bank"),
    },
    options={
        "num_vectors": Option(256, whole(1), "num_vectors"),
        "vector_length": Option(256, whole(1), "vector_length"),
        "topk": Option(2, whole(1), "topk"),
        "dropout": dropout_option("vblora_dropout"),
        "init_vector_bank_bound": Option(0.02, real(0), "init_vector_bank_bound"),
        "init_logits_std": Option(0.1, real(0), "init_logits_std"),
        "save_only_topk_weights": Option(False, FLAG, "save_only_topk_weights"),
    },
    check=check_options,
    default_alpha=1.0,
    shared_init=shared_init,
)
PEFT = PeftFormat(
    PeftMethod("VBLORA", rank=("r", None)),
    export=_export,
    imported={f"{name}_topk_{part}": f"{name}_topk_{part}" for name in _LOGITS for part in ("indices", "weights")},
    convert_in=_convert_in,
)
