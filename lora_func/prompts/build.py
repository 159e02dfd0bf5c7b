"""init_prompt: a prompt's tensors for a model, and the model geometry a prompt records."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_func.checks import check_model
from lora_func.prompts._contract import Geometry, InitInputs, PromptMethod
from lora_func.prompts._methods import get_method
from lora_func.prompts._node import Prompt
from lora_func.prompts.adaption_prompt import MODEL_TYPES
from lora_func.prompts.spec import PromptSpec

__all__ = ["embedding_weight", "geometry_of", "init_prompt", "input_embeddings"]


def input_embeddings(model: nn.Module) -> nn.Module:
    """The model's input embedding module (transformers' ``get_input_embeddings()``)."""
    return cast(Any, model).get_input_embeddings()


def embedding_weight(model: nn.Module) -> Tensor:
    """The model's input embedding weight ``(vocab, d)``."""
    return cast(Tensor, input_embeddings(model).weight)


def _config_value(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def geometry_of(model: nn.Module, method: PromptMethod, options: dict[str, Any], where: str) -> Geometry:
    """The :class:`Geometry` of ``model`` for ``method`` (its attention modules for
    ``adaption_prompt``), after checking the model is one the method supports."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    embeddings = input_embeddings(model) if hasattr(model, "get_input_embeddings") else None
    hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_value(config, "num_attention_heads", "n_head", "num_heads")
    model_type = getattr(config, "model_type", None)
    problem = None
    if not isinstance(getattr(embeddings, "weight", None), Tensor) or None in (hidden, layers, heads):
        problem = "it is not a transformers model with a config (hidden size, layers, heads) and input embeddings"
    elif getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        problem = "it is an encoder-decoder model (peft's two-submodule prompts are not supported: decoder-only models)"
    elif method.entry == "attention" and model_type not in MODEL_TYPES:
        problem = f"peft's adaption prompt supports the attention modules of {sorted(MODEL_TYPES)}, not model_type {model_type!r}"
    elif method.entry == "kv" and (model_type in ("bloom", "chatglm") or any(t != "full_attention" for t in getattr(config, "layer_types", None) or ())):
        problem = f"its KV cache is not one prefix of every layer (model_type {model_type!r}: another cache layout or sliding layers)"
    modules: tuple[str, ...] = ()
    if problem is None and method.geometry_modules is not None:
        modules = method.geometry_modules(model, options)
        if len(modules) < options.get("adapter_layers", 0):
            problem = f"adapter_layers={options['adapter_layers']} but it has {len(modules)} attention modules"
    if problem is not None:
        raise ValueError(f"{where}: {type(model).__name__} does not fit prompt method {method.name!r}: {problem}")  # error: prompt-model-unsupported
    kv_heads = _config_value(config, "num_key_value_heads") or heads
    head_dim = _config_value(config, "head_dim") or hidden // heads
    return Geometry(
        model_type=str(model_type), token_dim=int(hidden), num_layers=int(layers), num_heads=int(heads), kv_heads=int(kv_heads),
        head_dim=int(head_dim), vocab_size=int(embedding_weight(model).shape[0]), modules=modules,
    )


def _prefill(model: nn.Module) -> Any:
    def prefill(ids: Tensor) -> list[tuple[Tensor, Tensor]]:
        device = embedding_weight(model).device
        ids = ids.to(device)
        with torch.no_grad():
            cache = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).past_key_values
        return [(layer.keys, layer.values) for layer in cache.layers]

    return prefill


def init_prompt(
    model: nn.Module,
    spec: PromptSpec,
    *,
    generator: torch.Generator | None = None,
    tokenizer: Any = None,
    source: Prompt | None = None,
) -> Prompt:
    """A new prompt of ``spec`` for ``model``; reads the model (its config, word embeddings and,
    for a cartridge's text init, its KV cache of the text), never writes it.

    Args:
      model: a transformers causal LM (Llama-family and GPT-2 are tested against peft).
      spec: the :class:`PromptSpec`.
      generator: the random draws (``None``: the global RNG). A seeded generator draws exactly
        what peft draws after ``torch.manual_seed`` with the same seed (same method, options and
        dtype): its inits are peft's, in peft's order.
      tokenizer: for ``init="text"`` (``tokenizer(text)["input_ids"]``, as peft tokenizes).
      source: for a multitask prompt's ``init="average_source_tasks"``, ``"exact_source_task"``
        or ``"only_source_shared"``: the source training's multitask prompt (e.g. loaded with
        :func:`lora_func.load_peft`), of the same ``n`` and model width.

    Returns a :class:`Prompt` whose params are leaf tensors with ``requires_grad=True``, on the
    device of the model's input embeddings.
    """
    where = "init_prompt"
    check_model(model, where)
    if not isinstance(spec, PromptSpec):
        raise TypeError(f"init_prompt: spec must be a lora_func.PromptSpec, got {type(spec).__name__}; e.g. PromptSpec('prompt_tuning', num_virtual_tokens=8)")  # error: prompt-init-spec
    method = get_method(spec.method)
    options = dict(spec.options)
    geometry = geometry_of(model, method, options, where)
    if options.get("init") == "text" and not callable(tokenizer):
        raise ValueError(  # error: prompt-init-tokenizer
            f"init_prompt: the {spec.method} spec has init='text', which needs tokenizer=... (a callable returning "
            f"{{'input_ids': [...]}}, e.g. a transformers tokenizer), got {type(tokenizer).__name__}"
        )
    source_tensors = None
    if str(options.get("init", "")).endswith(("_source_tasks", "_source_task", "_source_shared")):
        ok = isinstance(source, Prompt) and source.spec.method == spec.method and not source.stack_shape and (
            source.spec.num_virtual_tokens, source.geometry.token_dim) == (spec.num_virtual_tokens, geometry.token_dim)
        if not ok or source is None:
            raise ValueError(  # error: prompt-init-source
                f"init_prompt: init={options['init']!r} starts from a source multitask prompt: pass source=... (a "
                f"multitask_prompt_tuning Prompt of {spec.num_virtual_tokens} tokens on a model of width "
                f"{geometry.token_dim}, e.g. lora_func.load_peft of the source checkpoint), got {source!r}"
            )
        source_tensors = source.params
        if options["init"] == "exact_source_task" and options["init_task"] >= source.params["prefix_task_cols"].shape[0]:
            raise ValueError(  # error: prompt-init-source-task
                f"init_prompt: init_task={options['init_task']} but the source prompt has "
                f"{source.params['prefix_task_cols'].shape[0]} tasks; pass 0 <= init_task < that"
            )
    words = embedding_weight(model)
    inputs = InitInputs(
        n=spec.num_virtual_tokens, options=options, geometry=geometry, generator=generator, dtype=spec.dtype,
        word_embeddings=words.detach(), tokenizer=tokenizer, source=source_tensors,
        prefill=_prefill(model) if options.get("init") == "text" and method.entry == "kv" else None,
    )
    params, buffers = method.init(inputs)
    device = words.device
    return Prompt(
        {k: v.detach().to(device).requires_grad_(True) for k, v in params.items()},
        {k: v.detach().to(device) for k, v in buffers.items()},
        spec,
        geometry,
    )
