"""X-LoRA (Buehler & Buehler 2024, arXiv 2402.07148) as peft's ``XLoraModel``: a mixture of ``K``
LoRA experts whose per-token, per-layer weights (the *scalings*) a small classifier predicts from
the hidden states of a first pass of the model.

Per target layer, the ``K`` experts stacked: trainable ``lora_A (K, r, d_in)``, ``lora_B (K,
d_out, r)``, and a buffer ``xlora_scales (K,)`` (each expert's own ``alpha/r``). Shared by the
adapter: the classifier, ``xlora_depth`` linear layers ``classifier_{i}_weight`` /
``classifier_{i}_bias`` (peft's ``internal_xlora_classifier.layers``: ReLU, and dropout in
training, between them) from ``hidden_size`` to ``K`` (or ``L·K`` with ``layerwise_scalings``),
and the buffer ``xlora_scalings (L, K)`` that the forms read (``L`` the number of targets). For a
token ``x`` of layer ``l`` with scalings ``s (K,)`` (row ``l`` of ``xlora_scalings``, top-k
masked and re-normalised as the options say):

    y = x Wᵀ + b + g · Σ_k s_k · scale_k · (x A_kᵀ) B_kᵀ        (g: global_scaling_weight)

In a training step (``base.training``) expert ``k`` reads ``dropout_k(x)`` instead of ``x`` with
``expert_dropout[k]`` (the experts' own LoRA dropouts, as peft applies each expert's
``lora_dropout``): one mask per expert from the global RNG, in peft's order (so under ``vmap`` it
follows ``randomness=``).

The adapter as it is stored holds ``xlora_scalings`` filled with ``scaling_pass_value``: a plain
call (``adapted_call``) is peft's *scalings pass*, whose last hidden state the classifier reads,
and has a merged weight (the scalings are constant). The routed call
(:func:`lora_func.routed.xlora_call`) then runs the model again with the classifier's per-token
scalings ``(batch, tokens, L, K)`` as that buffer, an input of the call: there the mixture differs
per token, so the merged path refuses (``xlora-merge``). Build one with
:func:`lora_func.routed.xlora` from LoRA adapters; peft's checkpoints are read and written by
:func:`lora_func.routed.load_xlora` / :func:`lora_func.routed.save_xlora` (no ``PEFT`` record:
peft stores the classifier and the experts in separate files).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants import DROPOUT, FLAG, BaseLayer, Check, Codec, LayerInfo, Option, Slot, TensorDict, Variant, real, whole
from lora_func.variants._kernels import kaiming_uniform, lora_scale

SCALINGS = "xlora_scalings"
MAX_DEPTH = 8  # classifier layers a spec may ask for (one tensor slot pair each)


def _experts(info: LayerInfo) -> int:
    return int(info.option("num_experts"))


def classifier_shapes(info: LayerInfo) -> list[tuple[int, int]]:
    """``(out, in)`` of each classifier layer (peft's ``XLoraClassifier``)."""
    depth, size, hidden = int(info.option("xlora_depth")), int(info.option("xlora_size")), int(info.option("hidden_size"))
    classes = _experts(info) * (info.count if info.option("layerwise_scalings") else 1)
    if depth == 1:
        return [(classes, hidden)]
    return [(size, hidden)] + [(size, size)] * (depth - 2) + [(classes, size)]


def _classifier_slot(i: int, part: str) -> Slot:
    def shape(info: LayerInfo) -> tuple[int, ...] | None:
        shapes = classifier_shapes(info)
        return None if i >= len(shapes) else (shapes[i] if part == "weight" else shapes[i][:1])

    return Slot(shape, shared=True)


TENSORS = {
    "lora_A": Slot(lambda i: (_experts(i), int(i.r), i.d_in), rank_axes=(1,)),
    "lora_B": Slot(lambda i: (_experts(i), i.d_out, int(i.r)), rank_axes=(2,)),
    "xlora_scales": Slot(lambda i: (_experts(i),), buffer=True),
    SCALINGS: Slot(lambda i: (i.count, _experts(i)), buffer=True, shared=True),
    **{f"classifier_{i}_{part}": _classifier_slot(i, part) for i in range(MAX_DEPTH) for part in ("weight", "bias")},
}


def shared_init(infos: Mapping[str, LayerInfo], *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """The classifier (each layer as ``nn.Linear``'s default init, from ``generator``) and the
    stored scalings ``(L, K)``, all ``scaling_pass_value``."""
    info = next(iter(infos.values()))
    params: TensorDict = {}
    for i, (out, fan_in) in enumerate(classifier_shapes(info)):
        bound = 1 / math.sqrt(fan_in)
        params[f"classifier_{i}_weight"] = kaiming_uniform((out, fan_in), a=math.sqrt(5), generator=generator).to(device, dtype)
        params[f"classifier_{i}_bias"] = (torch.rand((out,), generator=generator) * 2 * bound - bound).to(device, dtype)
    value = float(info.option("scaling_pass_value"))
    return params, {SCALINGS: torch.full((len(infos), _experts(info)), value, dtype=dtype, device=device)}


def init(
    weight: Tensor, bias: Tensor | None, info: LayerInfo, *, dtype: torch.dtype, generator: torch.Generator, calibration: Any = None
) -> tuple[TensorDict, TensorDict]:
    """``K`` LoRA inits (kaiming-uniform ``A``, ``B = 0``), each at scale ``alpha/r``
    (:func:`lora_func.routed.xlora` builds one from trained LoRAs)."""
    experts, r = _experts(info), int(info.r)
    lora_a = torch.stack([kaiming_uniform((r, info.d_in), a=math.sqrt(5), generator=generator) for _ in range(experts)])
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": torch.zeros((experts, info.d_out, r), dtype=dtype, device=weight.device)}
    return params, {"xlora_scales": torch.full((experts,), float(lora_scale(info)), dtype=dtype, device=weight.device)}


def classify(params: TensorDict, hidden: Tensor, info: LayerInfo, training: bool = False) -> Tensor:
    """peft's ``XLoraClassifier.forward``: the scalings ``(..., L, K)`` of the last hidden state
    ``hidden (..., hidden_size)`` (``params``: the adapter's shared params by short name)."""
    depth = int(info.option("xlora_depth"))
    h = hidden.to(params["classifier_0_weight"].dtype)
    for i in range(depth):
        h = F.linear(h, params[f"classifier_{i}_weight"], params[f"classifier_{i}_bias"])
        if i < depth - 1:
            h = F.dropout(torch.relu(h), float(info.option("xlora_dropout_p")), training=training)
    experts = _experts(info)
    if info.option("layerwise_scalings"):
        scalings = h.reshape(*h.shape[:-1], info.count, experts)
    else:
        scalings = h.unsqueeze(-2).expand(*h.shape[:-1], info.count, experts)
    if info.option("enable_softmax"):
        scalings = torch.softmax(scalings / float(info.option("softmax_temperature")), dim=-1)
    return scalings


def layer_scalings(scalings: Tensor, info: LayerInfo) -> Tensor:
    """This layer's expert weights ``(..., K)`` from the scalings ``(..., L, K)``: peft's
    ``get_maybe_topk_scalings`` (the ``top_k_lora`` largest kept, the rest 0; with
    ``enable_softmax_topk`` a softmax over the kept ones)."""
    s = scalings[..., info.position, :]
    top_k = int(info.option("top_k_lora"))
    if top_k:
        _, idx = torch.topk(s, k=top_k, dim=-1)
        mask = torch.zeros_like(s, dtype=torch.bool).scatter(-1, idx, True)
        s = s * mask.to(s.dtype)
    if info.option("enable_softmax_topk"):
        kept = s != 0
        s = torch.softmax(s.masked_fill(~kept, float("-inf")), dim=-1).masked_fill(~kept, 0.0)
    return s


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """peft's ``XLoraLinearLayer.forward``: ``base(x) + g Σ_k s_k scale_k (x A_kᵀ) B_kᵀ``, ``s``
    per token where the scalings are per token (``(..., L, K)`` with ``x (..., d_in)``), else one
    ``(L, K)`` for every token."""
    lora_a, lora_b = params["lora_A"], params["lora_B"]
    y = base(x)
    s = layer_scalings(buffers[SCALINGS].to(lora_a.dtype), info)
    if s.dim() > 1:  # per token: GPT-2's Conv1D op sees the tokens flattened, (batch·tokens, d_in)
        s = s.reshape(*x.shape[:-1], s.shape[-1])
    weights = s * buffers["xlora_scales"].to(lora_a.dtype) * float(info.option("global_scaling_weight"))
    xa = x.to(lora_a.dtype)
    dropouts = info.option("expert_dropout")
    if any(dropouts) and getattr(base, "training", False):
        # peft's training step: expert k's input dropout(x · s_k), experts in order, each its own
        # mask of x's shape from the global RNG (none for an expert without dropout); the
        # scaling commutes with the mask, so it is applied with the others below.
        dropped = torch.stack([F.dropout(xa, p, training=True) if p else xa for p in dropouts], dim=-2)  # (..., K, d_in)
        h = torch.einsum("...ki, kri -> ...kr", dropped, lora_a)
    else:
        h = torch.einsum("...i, kri -> ...kr", xa, lora_a)
    out = torch.einsum("...kr, kor -> ...ko", h, lora_b)
    delta = (out * weights.unsqueeze(-1)).sum(-2)
    return y + delta.to(y.dtype)


def weight_form(params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo) -> tuple[Tensor, Tensor | None]:
    scalings = buffers[SCALINGS]
    if scalings.dim() > 2:
        raise ValueError(  # error: xlora-merge-per-token
            f"xlora: the scalings are per token (shape {tuple(scalings.shape)}: each token has its own mixture of the "
            f"{_experts(info)} experts), so there is no merged weight (peft cannot merge X-LoRA either); run the routed "
            f"call on the lazy path (lora_func.routed.xlora_call(..., merged=False), xlora_adapted), or merge the "
            f"experts themselves (lora_func.routed.xlora_experts)"
        )
    s = layer_scalings(scalings.to(weight.dtype), info)
    weights = s * buffers["xlora_scales"].to(weight.dtype) * float(info.option("global_scaling_weight"))
    delta = torch.einsum("k, kor, kri -> oi", weights, params["lora_B"].to(weight.dtype), params["lora_A"].to(weight.dtype))
    return weight + delta, bias


def _check(options: Mapping[str, Any]) -> None:
    if options["expert_dropout"] and len(options["expert_dropout"]) != options["num_experts"]:
        raise ValueError(  # error: xlora-expert-dropout
            f"xlora: expert_dropout={list(options['expert_dropout'])} gives {len(options['expert_dropout'])} probabilities for "
            f"num_experts={options['num_experts']}; give one per expert (each expert's LoRA dropout), or none (())"
        )
    if options["top_k_lora"] > options["num_experts"]:
        raise ValueError(  # error: xlora-top-k
            f"xlora: top_k_lora={options['top_k_lora']} is more than num_experts={options['num_experts']}; keep at most every expert (0: all)"
        )


_TOP_K = Codec(lambda v: None if v == 0 else v, lambda v: 0 if v is None else v)  # peft: null = every expert

VARIANT = Variant(
    name="xlora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors=TENSORS,
    shared_init=shared_init,
    options={
        "num_experts": Option(2, whole(1), None),
        "hidden_size": Option(4096, whole(1), "hidden_size"),
        "enable_softmax": Option(True, FLAG, "enable_softmax"),
        "enable_softmax_topk": Option(False, FLAG, "enable_softmax_topk"),
        "layerwise_scalings": Option(False, FLAG, "layerwise_scalings"),
        "xlora_depth": Option(1, whole(1, MAX_DEPTH + 1, why=f"lora_func declares at most {MAX_DEPTH} classifier layers as tensor slots; peft has no limit"), "xlora_depth"),
        "xlora_size": Option(2048, whole(1), "xlora_size"),
        "xlora_dropout_p": Option(0.2, real(0, 1), "xlora_dropout_p"),
        "use_trainable_adapters": Option(False, FLAG, "use_trainable_adapters"),
        "softmax_temperature": Option(1.0, real(0, None, closed="()"), "softmax_temperature"),
        "top_k_lora": Option(0, whole(0), "top_k_lora", _TOP_K),
        "scaling_pass_value": Option(0.0, None, "scaling_pass_value"),
        "global_scaling_weight": Option(1.0, None, "global_scaling_weight"),
        # each expert's own LoRA dropout (peft keeps it in the expert's LoraConfig, lora_dropout)
        "expert_dropout": Option((), Check(lambda v: all(DROPOUT.test(p) for p in v), "must hold one probability in [0, 1) per expert, or be empty"), None),
    },
    check=_check,
    default_alpha=8.0,
)
