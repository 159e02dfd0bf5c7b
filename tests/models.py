"""Tiny transformers models built from configs (no downloads), deterministic per seed."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutput

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
# The other target kinds (lora_func.targeting.KINDS), each on a model that has it: the Llama's
# embedding, GPT-2's LayerNorms (with a bias), a conv LM (Conv1d and Conv2d), a tiny Mixtral's
# expert parameters.
DEFAULT_TARGETS |= {
    "llama_embedding": ["embed_tokens"],
    "gpt2_norm": ["ln_1", "ln_f"],
    "convlm": ["seq", "grid"],
    "gconvlm": ["seq", "grid"],
    "attention": ["attn"],
    "parameters": [],
    "mixtral": [],
}
# Extra AdapterSpec arguments per model (expert parameters are named by target_parameters).
MODEL_SPEC = {"mixtral": {"target_parameters": ["gate_up_proj", "down_proj"]}, "parameters": {"target_parameters": ["hold.w"]}}
# The contract suite's layer kinds, each on a model that has it.
LAYER_KIND_MODEL = {
    "linear": "llama",
    "conv1d": "gpt2",
    "embedding": "llama_embedding",
    "conv": "convlm",
    "grouped_conv": "gconvlm",
    "parameter": "parameters",
    "mha": "attention",
    "norm": "gpt2_norm",
    "experts": "mixtral",
}


class ConvLM(nn.Module):
    """A tiny causal LM with convolutions: token embedding (dim 16), a causal ``nn.Conv1d`` over
    the sequence (``seq``, kernel 3, bias), a ``nn.Conv2d`` over (4 channel groups x 4, time)
    (``grid``, kernel (3, 2), no bias), a Linear head; returns ``.logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.seq = nn.Conv1d(16, 16, 3, padding=2)
        self.grid = nn.Conv2d(4, 4, (3, 2), padding=(1, 1), bias=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        h = self.embed(input_ids).transpose(1, 2)  # (B, 16, T)
        t = h.shape[-1]
        h = torch.relu(self.seq(h)[..., :t])  # causal: the first t outputs of the padded conv
        g = self.grid(h.reshape(h.shape[0], 4, 4, t))[..., :t]  # (B, 4, 4, T)
        h = h + torch.tanh(g.reshape(h.shape[0], 16, t))
        return CausalLMOutput(logits=self.head(h.transpose(1, 2)))


class GroupedConvLM(ConvLM):
    """:class:`ConvLM` with grouped convolutions: ``seq`` in 4 groups, ``grid`` in 2."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Conv1d(16, 16, 3, padding=2, groups=4)
        self.grid = nn.Conv2d(4, 4, (3, 2), padding=(1, 1), groups=2, bias=False)


class AttentionLM(nn.Module):
    """A tiny LM on an ``nn.MultiheadAttention``: token embedding (dim 8), causal self-attention
    (2 heads, batch first), a Linear head; returns ``.logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        h = self.embed(input_ids)
        t = h.shape[-2]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=h.device), diagonal=1)
        # keys and values another tensor than the queries, need_weights: torch's plain path (bmm and
        # softmax), which torch.func.vmap batches (its fused kernels have no batching rule)
        kv = h.clone()
        return CausalLMOutput(logits=self.head(h + self.attn(h, kv, kv, attn_mask=causal, need_weights=True)[0]))


class ParameterHolder(nn.Module):
    """A module that holds bare parameters and uses them itself: ``w (6, 8)`` and ``experts (3, 6, 8)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 8))
        self.experts = nn.Parameter(torch.randn(3, 6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.T + torch.einsum("...i,eoi->...o", x, self.experts) / 3


class ParameterLM(nn.Module):
    """A tiny LM through :class:`ParameterHolder` (``hold``): embedding (dim 8), ``hold``, a Linear
    head; returns ``.logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.hold = ParameterHolder()
        self.head = nn.Linear(6, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        return CausalLMOutput(logits=self.head(torch.tanh(self.hold(self.embed(input_ids)))))


def tiny_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2) -> nn.Module:
    """A 2-layer model with hidden size 32, random weights from ``seed``, eval mode, eager attention
    (SDPA has no vmap batching rule on CPU and warns). ``layers``: the Llama's or GPT-2's blocks
    (one where a test's cost grows with the layers and a second adds nothing to it)."""
    torch.manual_seed(seed)
    if kind in ("convlm", "gconvlm", "attention", "parameters"):
        model = {"convlm": ConvLM, "gconvlm": GroupedConvLM, "attention": AttentionLM, "parameters": ParameterLM}[kind]()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, INIT_RANGE)
        return model.to(dtype).eval()
    if kind in ("llama", "llama_embedding"):
        # attention_bias: q/k/v/o carry a bias (a variant that mishandles the bias shows);
        # the MLP has none (the bias-free path is exercised too).
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
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
    elif kind == "mixtral":
        # eager experts: a per-expert loop (torch.func transforms see through it; grouped_mm is
        # covered by the peft oracle tests).
        config = MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=INIT_RANGE, experts_implementation="eager",
        )
        model = MixtralForCausalLM(config)
    elif kind in ("gpt2", "gpt2_norm"):
        config = GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64,
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
