"""Adaption prompt (LLaMA-Adapter, Zhang et al. 2023; peft's ``AdaptionPromptConfig``): in each of
the top ``adapter_layers`` attention modules, ``n`` (peft's ``adapter_len``) learned tokens that
every position attends to through a separate softmax, scaled by a zero-initialised gate and added
to the module's output.

Tensors, per adapted attention module ``m``: ``m.adaption_prompt (1, n, hidden)`` (standard
normal, drawn in the model's dtype as peft does) and ``m.adaption_gate (1,)`` (zero). For
module ``m`` with input ``x`` and output ``o``: keys ``K = k_proj(prompt)``, values
``V = v_proj(prompt)`` (no rotary embedding; GPT-2: ``c_attn(prompt)``'s key and value parts),
queries ``Q`` as the module computes them (rotated), and ``o + o_proj(gate * softmax(Q Kᵀ /
√head_dim) V)`` (GPT-2: no ``c_proj`` on the added part, as peft). peft supports the attention
modules of ``llama`` and ``mistral`` (``self_attn``) and ``gpt2`` (``attn``); so does this.
peft stores ``base_model.model.<m>.adaption_prompt`` and ``.adaption_gate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.prompts._contract import Geometry, InitInputs, PeftRecord, PromptMethod, TensorDict

# model_type -> the attention module name peft's AdaptionPromptConfig targets there.
MODEL_TYPES = {"llama": "self_attn", "mistral": "self_attn", "gpt2": "attn"}


def attention_modules(model: Any, options: Mapping[str, Any]) -> tuple[str, ...]:
    """The top ``adapter_layers`` attention modules of ``model``, in layer order (peft's choice:
    the modules whose name ends with ``.<target>``, the last ``adapter_layers`` of them)."""
    target = MODEL_TYPES[model.config.model_type]
    found = [name for name, _ in model.named_modules() if name.endswith(f".{target}")]
    return tuple(found[len(found) - options["adapter_layers"] :]) if options["adapter_layers"] <= len(found) else tuple(found)


def _shapes(n: int, options: Mapping[str, Any], geometry: Geometry):
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for module in geometry.modules:
        shapes += [(f"{module}.adaption_prompt", (1, n, geometry.token_dim)), (f"{module}.adaption_gate", (1,))]
    return tuple(shapes), ()


def _check(n: int, options: Mapping[str, Any]) -> list[str]:
    layers = options["adapter_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return [f"adapter_layers={layers!r} must be an integer >= 1 (how many attention modules, from the top, get a prompt)"]
    return []


def _init(inputs: InitInputs) -> tuple[TensorDict, TensorDict]:
    params: TensorDict = {}
    model_dtype = inputs.word_embeddings.dtype
    for module in inputs.geometry.modules:
        prompt = torch.empty(1, inputs.n, inputs.geometry.token_dim, dtype=model_dtype).normal_(generator=inputs.generator)
        params[f"{module}.adaption_prompt"] = prompt.to(inputs.dtype)
        params[f"{module}.adaption_gate"] = torch.zeros(1, dtype=inputs.dtype)
    return params, {}


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _per_row(t: Tensor, batch: int) -> Tensor:
    """``t (P, ...)`` with ``P`` one prompt or one per row as ``(batch, ...)`` (rows repeated for
    beams: ``repeat_interleave``)."""
    return t.expand(batch, *t.shape[1:]) if t.shape[0] == 1 else t.repeat_interleave(batch // t.shape[0], dim=0)


def _added(query: Tensor, keys: Tensor, values: Tensor, gate: Tensor, head_dim: int) -> Tensor:
    """``gate * softmax(Q Kᵀ / √hd) V`` as ``(B, q_len, heads * hd)``; the softmax in float32,
    as peft (its "upcast attention")."""
    dtype = query.dtype
    scores = torch.matmul(query, keys.transpose(2, 3).to(dtype)) / math.sqrt(head_dim)
    scores = gate.reshape(-1, 1, 1, 1) * F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    out = torch.matmul(scores, values)
    return out.transpose(1, 2).reshape(query.shape[0], query.shape[2], -1)


def form(prompt: Tensor, gate: Tensor, geometry: Geometry, module: Any, inner: Any, args: tuple, kwargs: dict) -> Any:
    """The adapted module's output for ``prompt (P, n, hidden)``, ``gate (P,)``."""
    outputs = inner(*args, **kwargs)
    output, rest = outputs[0], tuple(outputs[1:])
    hidden = args[0] if args else kwargs["hidden_states"]
    batch, q_len = output.shape[0], output.shape[1]
    rows, n, head_dim = prompt.shape[0], prompt.shape[1], module.head_dim
    heads = geometry.num_heads
    gate = _per_row(gate, batch)
    if geometry.model_type == "gpt2":
        _, key, value = module.c_attn(prompt).split(output.shape[2], dim=2)
        keys = _per_row(key.view(rows, n, heads, head_dim), batch).transpose(1, 2)
        values = _per_row(value.view(rows, n, heads, head_dim), batch).transpose(1, 2)
        query = module.c_attn(hidden).split(module.split_size, dim=2)[0]
        query = query.view(*query.shape[:-1], -1, head_dim).transpose(1, 2)
        added = _added(query, keys, values, gate, head_dim)
    else:
        kv_heads, repeats = geometry.kv_heads, geometry.num_heads // geometry.kv_heads
        keys = _per_row(module.k_proj(prompt).view(rows, n, kv_heads, head_dim), batch).transpose(1, 2).repeat_interleave(repeats, dim=1)
        values = _per_row(module.v_proj(prompt).view(rows, n, kv_heads, head_dim), batch).transpose(1, 2).repeat_interleave(repeats, dim=1)
        query = module.q_proj(hidden).view(batch, q_len, heads, head_dim).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        query = query * cos.unsqueeze(1) + _rotate_half(query) * sin.unsqueeze(1)
        added = module.o_proj(_added(query, keys, values, gate, head_dim))
    return ((output + added).to(query.dtype), *rest)


def _from_peft(tensors: Mapping[str, Tensor], n: int, options: Mapping[str, Any], geometry: Geometry) -> tuple[TensorDict, TensorDict]:
    return {f"{m}.{t}": tensors[f"{m}.{t}"] for m in geometry.modules for t in ("adaption_prompt", "adaption_gate")}, {}


PEFT = PeftRecord(
    peft_type="ADAPTION_PROMPT",
    config=lambda n, options, geometry: {
        "adapter_len": n,
        "adapter_layers": options["adapter_layers"],
        "target_modules": MODEL_TYPES[geometry.model_type],
    },
    read_config=lambda config, geometry: (int(config["adapter_len"]), {"adapter_layers": int(config["adapter_layers"])}),
    to_peft=lambda params, buffers, n, options, geometry: dict(params),
    from_peft=_from_peft,
)

METHOD = PromptMethod(
    name="adaption_prompt",
    entry="attention",
    options={"adapter_layers": 1},
    check=_check,
    shapes=_shapes,
    init=_init,
    form=form,
    peft=PEFT,
    geometry_modules=attention_modules,
)
