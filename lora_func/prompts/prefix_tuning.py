"""Prefix tuning (Li & Liang 2021; peft's ``PrefixTuningConfig``): ``n`` trainable keys and values
in front of every layer's attention, put in the KV cache ahead of the input.

The prefix is peft's flat ``(n, num_layers * 2 * kv_dim)`` (``kv_dim = kv_heads * head_dim``, so
grouped-query models get their key/value width, as peft's config preparation gives them): per
virtual token, layer ``l``'s key then value, head-major. Tensors:
``prefix_projection=False``: ``embedding (n, num_layers * 2 * kv_dim)`` is the prefix;
``prefix_projection=True``: ``embedding (n, kv_dim)`` through ``transform.0`` (``kv_dim -> h``),
tanh, ``transform.2`` (``h -> num_layers * 2 * kv_dim``), ``h = encoder_hidden_size`` (default
``kv_dim``). ``init="zero"`` (peft's ``init_weights="zero"``) zeroes the prefix (or the last
projection); otherwise peft's defaults, draw for draw. peft saves the prefix itself (the
projection's output), and a checkpoint reads as ``prefix_projection=False``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.prompts._contract import Geometry, InitInputs, PeftRecord, PromptMethod, TensorDict, linear_init, normal
from lora_func.prompts.prompt_tuning import prompt_config, read_n


def prefix_width(geometry: Geometry) -> int:
    return geometry.num_layers * 2 * geometry.kv_dim


def _hidden(options: Mapping[str, Any], geometry: Geometry) -> int:
    return options["encoder_hidden_size"] or geometry.kv_dim


def _shapes(n: int, options: Mapping[str, Any], geometry: Geometry):
    if not options["prefix_projection"]:
        return (("embedding", (n, prefix_width(geometry))),), ()
    kv, h = geometry.kv_dim, _hidden(options, geometry)
    return (
        ("embedding", (n, kv)),
        ("transform.0.weight", (h, kv)),
        ("transform.0.bias", (h,)),
        ("transform.2.weight", (prefix_width(geometry), h)),
        ("transform.2.bias", (prefix_width(geometry),)),
    ), ()


def _check(n: int, options: Mapping[str, Any]) -> list[str]:
    problems = []
    if not isinstance(options["prefix_projection"], bool):
        problems.append(f"prefix_projection={options['prefix_projection']!r} must be True or False")
    size = options["encoder_hidden_size"]
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        problems.append(f"encoder_hidden_size={size!r} must be an integer >= 1 (or None: the key/value width)")
    if options["init"] not in ("random", "zero"):
        problems.append(f"init={options['init']!r} is not one of ['random', 'zero']")
    return problems


def _init(inputs: InitInputs) -> tuple[TensorDict, TensorDict]:
    options, geometry, g = inputs.options, inputs.geometry, inputs.generator
    shapes = dict(_shapes(inputs.n, options, geometry)[0])
    params = {"embedding": normal(shapes["embedding"], g)}
    if options["prefix_projection"]:
        for i in (0, 2):
            weight = shapes[f"transform.{i}.weight"]
            params[f"transform.{i}.weight"], params[f"transform.{i}.bias"] = linear_init(weight[0], weight[1], g)
    if options["init"] == "zero":
        last = "transform.2" if options["prefix_projection"] else None
        for name in ([f"{last}.weight", f"{last}.bias"] if last else ["embedding"]):
            params[name] = torch.zeros_like(params[name])
    return {name: params[name].to(inputs.dtype) for name in shapes}, {}


def form(params: TensorDict, buffers: TensorDict, n: int, options: Mapping[str, Any], geometry: Geometry, task_ids: Tensor | None, training: bool) -> Tensor:
    """``(n, num_layers * 2 * kv_dim)``: peft's flat prefix."""
    x = params["embedding"]
    if options["prefix_projection"]:
        x = F.linear(torch.tanh(F.linear(x, params["transform.0.weight"], params["transform.0.bias"])), params["transform.2.weight"], params["transform.2.bias"])
    return x


def kv_config(n: int, geometry: Geometry) -> dict[str, Any]:
    """The prompt-learning fields of a prefix method: peft's token_dim and heads are the
    key/value ones (its grouped-query preparation)."""
    return prompt_config(n, geometry) | {"token_dim": geometry.kv_dim, "num_attention_heads": geometry.kv_heads}


PEFT = PeftRecord(
    peft_type="PREFIX_TUNING",
    config=lambda n, options, geometry: kv_config(n, geometry)
    | {"prefix_projection": False, "encoder_hidden_size": _hidden(options, geometry), "init_weights": None},
    read_config=lambda config, geometry: (read_n(config), {"prefix_projection": False}),
    to_peft=lambda params, buffers, n, options, geometry: {"prompt_embeddings": form(params, buffers, n, options, geometry, None, False)},
    from_peft=lambda tensors, n, options, geometry: ({"embedding": tensors["prompt_embeddings"]}, {}),
)

METHOD = PromptMethod(
    name="prefix_tuning",
    entry="kv",
    options={"prefix_projection": False, "encoder_hidden_size": None, "init": "random"},
    check=_check,
    shapes=_shapes,
    init=_init,
    form=form,
    peft=PEFT,
)
