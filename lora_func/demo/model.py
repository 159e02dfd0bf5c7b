"""The demo's default model (a small pretrained Llama shipped in ``assets/``) and the loader that
also takes any local Hugging Face causal-LM directory.

``assets/`` holds ``config.json``, ``model.safetensors`` (bf16) and ``tokenizer.json``: a
word-level tokenizer over :func:`lora_func.demo.corpus.vocabulary`, wrapped as a
``PreTrainedTokenizerFast`` so that ``AutoTokenizer`` loads it like any other. They are
written by ``scripts/pretrain_tiny_lm.py``.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from lora_func.demo.corpus import vocabulary

__all__ = ["ASSETS", "QUANTIZE", "SPECIAL_TOKENS", "build_tokenizer", "default_targets", "load_model", "quantization_config", "tiny_config"]

ASSETS = Path(str(resources.files("lora_func.demo") / "assets"))
SPECIAL_TOKENS = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>"}

# Attention projections by model family, first match wins: LoRA on attention is the usual
# default (peft's for Llama is q/v; all four gives the demo's small task more room).
_ATTENTION_TARGETS = (
    ("q_proj", "k_proj", "v_proj", "o_proj"),  # Llama, Qwen2, Mistral, Phi-3 ...
    ("c_attn",),  # GPT-2 (Conv1D, fused q/k/v)
    ("query_key_value",),  # GPT-NeoX, Falcon
)


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast``: ids 0-3 are ``<pad> <unk> <bos> <eos>``, then
    the corpus words; every encoded text starts with ``<bos>``; words split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    vocab = {token: i for i, token in enumerate(specials + vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def tiny_config(vocab_size: int):
    """The shipped model's architecture: Llama, 4 layers, hidden 128, 4 query / 2 key-value
    heads (grouped-query attention), tied embeddings; about 1.2 M parameters."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=640, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )


Quantize = Literal["nf4", "int8"]
QUANTIZE: tuple[Quantize, ...] = ("nf4", "int8")


def quantization_config(quantize: Quantize, dtype: torch.dtype):
    """bitsandbytes' config for ``quantize``: ``"nf4"`` (QLoRA's 4-bit NormalFloat, double
    quantization, compute in ``dtype``) or ``"int8"`` (LLM.int8)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(  # error: demo-quantize-needs-bitsandbytes
            f"quantize={quantize!r} needs bitsandbytes (pip install bitsandbytes); lora_func does not depend on it"
        ) from err
    from transformers import BitsAndBytesConfig

    if quantize == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"quantize={quantize!r} is not one of {list(QUANTIZE)}")  # error: demo-quantize-unknown


def load_model(
    model_dir: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32, device: str = "cpu", quantize: Quantize | None = None
):
    """``(model, tokenizer)`` from ``model_dir`` (any local causal-LM directory that
    ``AutoModelForCausalLM`` and ``AutoTokenizer`` read), or the shipped tiny model when
    ``None``. The model is in eval mode with eager attention (what ``torch.func.vmap`` needs);
    a tokenizer without a pad token gets its eos token as pad. ``quantize`` (``"nf4"`` or
    ``"int8"``, bitsandbytes) loads the linear layers of the decoder quantized, the rest in
    ``dtype``: a QLoRA base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ASSETS if model_dir is None else Path(model_dir)
    if not (path / "config.json").is_file():
        hint = "run scripts/pretrain_tiny_lm.py to rebuild the shipped model" if model_dir is None else "pass a directory saved by save_pretrained()"
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model directory; {hint}")  # error: demo-no-config
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Cast after loading: ``from_pretrained``'s dtype keyword changed name across transformers
    # versions (torch_dtype -> dtype); the shipped bf16 weights upcast exactly.
    if quantize is not None:
        config = quantization_config(quantize, dtype)
        # Typed as the nn.Module it is: transformers' wrapper around PreTrainedModel.to hides its signature.
        quantized: nn.Module = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", quantization_config=config, dtype=dtype)
        return quantized.to(device).eval(), tokenizer
    model: nn.Module = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def default_targets(model: nn.Module) -> list[str]:
    """The attention projections of ``model`` as an ``AdapterSpec`` target list (module-name
    suffixes), for the families in ``_ATTENTION_TARGETS``."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for family in _ATTENTION_TARGETS:
        if set(family) <= names:
            return list(family)
    raise ValueError(  # error: demo-targets
        f"cannot guess the attention projections of {type(model).__name__}; pass targets explicitly "
        f"(e.g. --targets q_proj,v_proj)"
    )
