"""Tiny transformers models built from configs (no downloads), deterministic per seed."""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 61  # prime and small: logits differ per token, embeddings stay tiny
# Weight std. The transformers default (0.02) is tuned for hidden sizes in the thousands; at
# hidden size 32 it leaves attention scores ~0 (softmax ~uniform), so adapters on q_proj/k_proj
# would move the logits by ~1e-6 and a bug there could hide. 0.2 gives attention-score std ~0.2
# and logits std ~1.
INIT_RANGE = 0.2

# Default targets per model: q/v (nn.Linear) for Llama-family, c_attn (Conv1D) for GPT-2.
DEFAULT_TARGETS = {
    "llama": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
}
# The contract suite's two layer kinds, each on a model that has it.
LAYER_KIND_MODEL = {"linear": "llama", "conv1d": "gpt2"}


def tiny_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A 2-layer model with hidden size 32, random weights from ``seed``, eval mode, eager attention
    (SDPA has no vmap batching rule on CPU and warns)."""
    torch.manual_seed(seed)
    if kind == "llama":
        # attention_bias: q/k/v/o carry a bias (a variant that mishandles the bias shows);
        # the MLP has none (the bias-free path is exercised too).
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_bias=True,
            initializer_range=INIT_RANGE,
        )
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=INIT_RANGE,
        )
        model = Qwen2ForCausalLM(config)
    elif kind == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            initializer_range=INIT_RANGE,
        )
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "eager"
    randomize_biases(model)
    return model.to(dtype).eval()


def randomize_biases(model: nn.Module) -> None:
    """Random biases (std 0.1), so that a variant that mishandles the bias is visible."""
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter):
                bias.normal_(0.0, 0.1)


def tokens(batch: int = 2, length: int = 8, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


class Net(nn.Module):
    """``head(relu(proj(x)))``: one square target, so a Linear and a Conv1D ``proj`` have the
    same name and the same stored shape."""

    def __init__(self, proj: nn.Module | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = proj if proj is not None else nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(x)))
