"""The prompt-method contract: what one method file of :mod:`lora_func.prompts` provides.

A prompt method learns inputs instead of weights. It is a handful of pure functions of explicit
tensors and a peft record, never an ``nn.Module``:

- ``shapes(n, options, geometry)``: the name and shape of each trainable and frozen tensor;
- ``init(InitInputs)``: those tensors' first values (from a ``torch.Generator``, the model's
  word embeddings, a tokenizer, a source prompt);
- ``form``: what the tensors put into the model, by the method's ``entry``:
  ``"embeds"``: ``(n, d)`` virtual-token embeddings put before the input's (prompt tuning,
  p-tuning, multitask prompt tuning, CPT; ``(B, n, d)`` with one task per row);
  ``"kv"``: ``(n, num_layers * 2 * kv_dim)``, peft's flat key/value prefix, put in the KV cache
  ahead of the input (prefix tuning, cartridge);
  ``"attention"``: a replacement for each adapted attention module's forward (adaption prompt);
- ``peft``: a :class:`PeftRecord`, how peft 0.21 stores it (config fields, the tensors of
  ``adapter_model.safetensors``) both ways.

The shared machinery (the spec, the node, the call integration in :mod:`lora_func.prompts._apply`,
the checkpoint io in :mod:`lora_func.io`) reads these; nothing asks a method's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "ENTRIES",
    "Entry",
    "Geometry",
    "InitInputs",
    "PeftRecord",
    "PromptMethod",
    "Shapes",
    "TensorDict",
    "linear_init",
    "normal",
    "text_ids",
    "word_rows",
]

TensorDict = dict[str, Tensor]
Shapes = tuple[tuple[str, tuple[int, ...]], ...]
Entry = Literal["embeds", "kv", "attention"]
ENTRIES: tuple[str, ...] = ("embeds", "kv", "attention")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What a prompt knows of its model, read from ``model.config`` at init (static).

    Attributes:
      model_type: ``config.model_type`` (``"llama"``, ``"gpt2"``).
      token_dim: the width of the input embeddings (``hidden_size`` / ``n_embd``).
      num_layers: decoder layers.
      num_heads: attention heads; ``kv_heads``: key/value heads (grouped-query attention);
        ``head_dim``: the width of one head.
      vocab_size: rows of the input embedding.
      modules: the attention modules an ``"attention"`` method adapts (else ``()``).
    """

    model_type: str
    token_dim: int
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    modules: tuple[str, ...] = ()

    @property
    def kv_dim(self) -> int:
        """The width of one layer's keys (``kv_heads * head_dim``): peft's ``token_dim`` for prefix methods."""
        return self.kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class InitInputs:
    """What an init may read: the number of virtual tokens, the options, the geometry, the
    generator to draw from, the dtype to return, the model's word embeddings ``(vocab, d)``,
    a tokenizer (text inits), a source prompt's tensors (multitask), and ``prefill(ids) ->
    [(key, value) per layer]`` the frozen model's KV cache of ``ids (1, T)`` (cartridge)."""

    n: int
    options: Mapping[str, Any]
    geometry: Geometry
    generator: torch.Generator | None
    dtype: torch.dtype
    word_embeddings: Tensor
    tokenizer: Any = None
    source: Mapping[str, Tensor] | None = None
    prefill: Callable[[Tensor], list[tuple[Tensor, Tensor]]] | None = None


@dataclasses.dataclass(frozen=True)
class PeftRecord:
    """How peft 0.21 stores one method.

    Attributes:
      peft_type: peft's ``peft_type`` (``"PROMPT_TUNING"``).
      config: ``(n, options, geometry) -> dict``: the method's fields of ``adapter_config.json``.
      read_config: ``(config dict, geometry) -> (n, options)``: the prompt a checkpoint holds
        (a method whose checkpoint holds its encoder's output reads as its encoder-free form).
      to_peft: ``(params, buffers, n, options, geometry) -> {key: tensor}``: the tensors of
        ``adapter_model.safetensors`` (keys without peft's ``base_model.model.`` prefix where
        they name a module).
      from_peft: ``(tensors, n, options, geometry) -> (params, buffers)``: the inverse.
    """

    peft_type: str
    config: Callable[[int, Mapping[str, Any], Geometry], dict[str, Any]]
    read_config: Callable[[Mapping[str, Any], Geometry], tuple[int, dict[str, Any]]]
    to_peft: Callable[[TensorDict, TensorDict, int, Mapping[str, Any], Geometry], TensorDict]
    from_peft: Callable[[Mapping[str, Tensor], int, Mapping[str, Any], Geometry], tuple[TensorDict, TensorDict]]


@dataclasses.dataclass(frozen=True)
class PromptMethod:
    """One prompt method (see the module docstring).

    Attributes:
      name: the method's name in ``PromptSpec(method, ...)``.
      entry: ``"embeds"``, ``"kv"`` or ``"attention"`` (how it reaches the model).
      options: option name -> default (``PromptSpec(..., **options)``).
      check: ``(n, options) -> [problem, ...]`` about the resolved options (empty when fine).
      shapes: ``(n, options, geometry) -> (param shapes, buffer shapes)``.
      init: ``InitInputs -> (params, buffers)``.
      form: ``"embeds"``: ``(params, buffers, n, options, geometry, task_ids, training) ->
        (n, d)`` or ``(B, n, d)``; ``"kv"``: the same signature without ``task_ids`` meaning,
        returning ``(n, num_layers * 2 * kv_dim)``; ``"attention"``: ``(prompt, gate, geometry,
        module, inner, args, kwargs) -> the module's output``.
      peft: its :class:`PeftRecord`.
      tasks: whether it takes ``task_ids`` (one task per batch row).
      loss: ``(logits (B, n + T, V), labels (B, T), extra kwargs, n, options) -> 0-d loss`` for a
        method whose loss is not the model's (CPT), else ``None``.
      extra_inputs: keyword arguments of a call that the method reads (and the model never sees).
      geometry_modules: for ``"attention"``: ``(model, options) -> module names`` it adapts.
      count: ``options -> n`` for a method whose number of virtual tokens its options fix (CPT).
    """

    name: str
    entry: Entry
    options: Mapping[str, Any]
    check: Callable[[int, Mapping[str, Any]], list[str]]
    shapes: Callable[[int, Mapping[str, Any], Geometry], tuple[Shapes, Shapes]]
    init: Callable[[InitInputs], tuple[TensorDict, TensorDict]]
    form: Callable[..., Any]
    peft: PeftRecord
    tasks: bool = False
    loss: Callable[..., Tensor] | None = None
    extra_inputs: tuple[str, ...] = ()
    geometry_modules: Callable[[Any, Mapping[str, Any]], tuple[str, ...]] | None = None
    count: Callable[[Mapping[str, Any]], int] | None = None  # n from the options (CPT: one per example token)


def word_rows(word_embeddings: Tensor, ids: Tensor | list[int]) -> Tensor:
    """Rows ``ids`` of the word embeddings, detached, in float32 first (peft's text inits cast
    there) then the caller's dtype."""
    index = torch.as_tensor(ids, dtype=torch.long, device=word_embeddings.device)
    return word_embeddings.detach()[index].clone().to(torch.float32)


def text_ids(tokenizer: Any, text: str, n: int) -> list[int]:
    """peft's TEXT init token ids: the tokenized text, trimmed to ``n`` or repeated until ``n``."""
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) < n:
        ids = ids * -(-n // len(ids))
    return ids[:n]


def normal(shape: tuple[int, ...], generator: torch.Generator | None, std: float = 1.0) -> Tensor:
    """``torch.empty(shape).normal_(0, std)`` in float32 (``nn.Embedding``'s init, peft's draws)."""
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def linear_init(d_out: int, d_in: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """``nn.Linear(d_in, d_out)``'s default init, draw for draw: weight Kaiming-uniform(a=√5), then
    the bias uniform in ±1/√d_in."""
    weight = torch.empty(d_out, d_in, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(weight, a=5**0.5, generator=generator)
    bound = 1 / d_in**0.5 if d_in > 0 else 0.0
    bias = torch.empty(d_out, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    return weight, bias
