"""Tiny quantized Llamas (bitsandbytes and torchao, all on the CPU) and their float oracles.

A quantized model is made the way users make one: save a tiny float model and load it back with
``quantization_config=BitsAndBytesConfig(...)``, or quantize its decoder layers with torchao.
The oracle of a quantized model is a float model holding its dequantized weights, dequantized
here with the libraries' own functions (not lora_func's registry).
"""

from __future__ import annotations

import functools
import tempfile
import warnings
from collections.abc import Callable

import torch
from torch import nn
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from tests.models import randomize_biases

VOCAB = 61


def float_llama(seed: int = 0) -> LlamaForCausalLM:
    """Hidden 64 (bitsandbytes' CPU kernels want output sizes in multiples of 32), 2 layers,
    biased attention projections, weights of std 0.2 as tests/models.py, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attention_bias=True, initializer_range=0.2,
    )
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    randomize_biases(model)
    return model.eval()


@functools.cache
def _saved_float(seed: int) -> str:
    directory = tempfile.mkdtemp(prefix="lora-func-qtest-")
    float_llama(seed).save_pretrained(directory)
    return directory


def _bnb(**config) -> Callable[[int], nn.Module]:
    def make(seed: int) -> nn.Module:
        quant = BitsAndBytesConfig(**config)
        return LlamaForCausalLM.from_pretrained(_saved_float(seed), quantization_config=quant, dtype=torch.float32).eval()

    return make


def _decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]


def _torchao_nf4(seed: int) -> nn.Module:
    from torchao.quantization import to_nf4

    model = float_llama(seed)
    for _, module in _decoder_linears(model):
        module.weight = nn.Parameter(to_nf4(module.weight.detach(), 32, 32), requires_grad=False)
    return model


def _torchao_int8(seed: int) -> nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = float_llama(seed)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and ".layers." in f".{fqn}")
    return model


SCHEMES: dict[str, Callable[[int], nn.Module]] = {
    "bnb-nf4": _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "bnb-nf4-double": _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32),
    "bnb-fp4": _bnb(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
    "torchao-nf4": _torchao_nf4,
    "torchao-int8": _torchao_int8,
}
# LLM.int8 on the first layer's q/v only (see the int8 test: int8 activations downstream of an
# adapter would turn round-off into 1/127 jumps).
_NOT_FIRST_QV = ["k_proj", "o_proj", "mlp", "layers.1", "lm_head"]
INT8 = {"bnb-int8": _bnb(load_in_8bit=True), "bnb-int8-first": _bnb(load_in_8bit=True, llm_int8_skip_modules=_NOT_FIRST_QV)}


def quantized_llama(scheme: str, seed: int = 0) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the libraries' notices on CPU kernels and casts
        return SCHEMES[scheme](seed) if scheme in SCHEMES else INT8[scheme](seed)


def dequantized_weight(module: nn.Module) -> torch.Tensor | None:
    """The float weight a quantized layer stands for, by the library's own dequantization."""
    weight = module.weight
    name = type(weight).__name__
    if name == "Params4bit":
        import bitsandbytes.functional as bf

        return bf.dequantize_4bit(weight.data, weight.quant_state).float()
    if name == "NF4Tensor":
        return weight.get_original_weight().float()
    if hasattr(weight, "dequantize") and name != "Parameter":
        return weight.dequantize().float()
    return None


def float_oracle(quantized: nn.Module, seed: int = 0) -> nn.Module:
    """The float model whose weights are the quantized model's, dequantized."""
    oracle = float_llama(seed)
    modules = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in oracle.named_modules():
            if isinstance(module, nn.Linear) and name in modules:
                weight = dequantized_weight(modules[name])
                if weight is not None:
                    module.weight.copy_(weight)
                if module.bias is not None:
                    module.bias.copy_(modules[name].bias.float())
    return oracle


def state_bytes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state (quantization state included) as copied bytes; a
    tensor subclass by its inner tensors (copying one through its own ops may re-quantize)."""
    out: dict[str, torch.Tensor] = {}

    def add(key: str, t: torch.Tensor) -> None:
        if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            for inner in t.__tensor_flatten__()[0]:
                add(f"{key}/{inner}", getattr(t, inner))
            return
        data = t.detach().as_subclass(torch.Tensor)
        out[key] = data.clone().reshape(-1).view(torch.uint8) if data.numel() else data.clone()

    for key, value in model.state_dict().items():
        add(key, value)
    return out
