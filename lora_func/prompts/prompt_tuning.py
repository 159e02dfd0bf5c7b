"""Prompt tuning (Lester et al. 2021; peft's ``PromptTuningConfig``): ``n`` trainable embeddings
put before the input's.

Tensors: ``embedding (n, d)`` (``d`` the model's embedding width). Inits, as peft's
``prompt_tuning_init``: ``"random"`` (standard normal, ``nn.Embedding``'s init, draw for draw),
``"sample_vocab"`` (rows of the model's word embeddings at uniformly drawn token ids; peft draws
the discarded normal first, and so do we), ``"text"`` (the word embeddings of ``init_text``'s
tokens, repeated or trimmed to ``n``; needs ``tokenizer=`` at init). peft stores the embedding as
``prompt_embeddings``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.prompts._contract import Geometry, InitInputs, PeftRecord, PromptMethod, TensorDict, normal, text_ids, word_rows

INITS = ("random", "sample_vocab", "text")


def check_init(options: Mapping[str, Any], inits: tuple[str, ...] = INITS) -> list[str]:
    problems = []
    if options["init"] not in inits:
        problems.append(f"init={options['init']!r} is not one of {list(inits)}")
    text = options.get("init_text")
    if options["init"] == "text" and not (isinstance(text, str) and text):
        problems.append("init='text' needs init_text='...' (the text whose token embeddings start the prompt)")
    if options["init"] != "text" and text is not None:
        problems.append(f"init_text is read only with init='text', got init={options['init']!r}")
    return problems


def embedding_init(inputs: InitInputs) -> Tensor:
    """peft's ``PromptEmbedding`` weight ``(n, d)`` in float32, draw for draw."""
    n, d = inputs.n, inputs.geometry.token_dim
    drawn = normal((n, d), inputs.generator)
    init = inputs.options["init"]
    if init == "sample_vocab":
        ids = torch.randint(0, inputs.geometry.vocab_size, (n,), dtype=torch.long, generator=inputs.generator)
        return word_rows(inputs.word_embeddings, ids)
    if init == "text":
        return word_rows(inputs.word_embeddings, text_ids(inputs.tokenizer, inputs.options["init_text"], n))
    return drawn


def _check(n: int, options: Mapping[str, Any]) -> list[str]:
    return check_init(options)


def _shapes(n: int, options: Mapping[str, Any], geometry: Geometry):
    return (("embedding", (n, geometry.token_dim)),), ()


def _init(inputs: InitInputs) -> tuple[TensorDict, TensorDict]:
    return {"embedding": embedding_init(inputs).to(inputs.dtype)}, {}


def form(params: TensorDict, buffers: TensorDict, n: int, options: Mapping[str, Any], geometry: Geometry, task_ids: Tensor | None, training: bool) -> Tensor:
    """``(n, d)``: the embedding itself."""
    return params["embedding"]


def prompt_config(n: int, geometry: Geometry) -> dict[str, Any]:
    """The fields every peft prompt-learning config has (``PromptLearningConfig``)."""
    return {
        "num_virtual_tokens": n,
        "token_dim": geometry.token_dim,
        "num_transformer_submodules": 1,
        "num_attention_heads": geometry.num_heads,
        "num_layers": geometry.num_layers,
    }


def read_n(config: Mapping[str, Any]) -> int:
    return int(config["num_virtual_tokens"])


PEFT = PeftRecord(
    peft_type="PROMPT_TUNING",
    config=lambda n, options, geometry: prompt_config(n, geometry) | {"prompt_tuning_init": "RANDOM"},
    read_config=lambda config, geometry: (read_n(config), {"init": "random"}),
    to_peft=lambda params, buffers, n, options, geometry: {"prompt_embeddings": params["embedding"]},
    from_peft=lambda tensors, n, options, geometry: ({"embedding": tensors["prompt_embeddings"]}, {}),
)

METHOD = PromptMethod(
    name="prompt_tuning",
    entry="embeds",
    options={"init": "random", "init_text": None},
    check=_check,
    shapes=_shapes,
    init=_init,
    form=form,
    peft=PEFT,
)
