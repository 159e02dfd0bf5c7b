"""Helpers for the peft checkpoint tests: peft models of every method lora_func maps, built on
tiny models, perturbed at random, and peft's warnings expected explicitly."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import DeloraConfig, EvaConfig, HRAConfig, IA3Config, LoraConfig, PeftModel, get_peft_model

from tests.models import tiny_model

# Layers with d_in != d_out on every model, so a transposed factor cannot go unnoticed.
TARGETS = {
    "llama": ["q_proj", "v_proj", "down_proj"],
    "qwen2": ["q_proj", "v_proj", "down_proj"],
    "gpt2": ["c_attn", "c_fc"],
}
# IA3: output scaling on attention projections, input scaling (feed-forward) on the MLP output.
IA3_TARGETS = {
    "llama": (["k_proj", "v_proj"], ["down_proj"]),
    "qwen2": (["q_proj", "v_proj"], ["down_proj"]),
    "gpt2": (["c_attn"], ["mlp.c_proj"]),
}
# One module per model for rank_pattern / alpha_pattern, by short name (peft's usual style) ...
SHORT_PATTERN = {"llama": "down_proj", "qwen2": "down_proj", "gpt2": "c_fc"}
# ... and by full module name.
FULL_PATTERN = {
    "llama": "model.layers.1.self_attn.q_proj",
    "qwen2": "model.layers.1.self_attn.q_proj",
    "gpt2": "transformer.h.1.attn.c_attn",
}
R, ALPHA = 4, 6.0


@contextmanager
def peft_warnings():
    """The warnings peft 0.21 gives on transformers 5 and for EVA/PiSSA here, each named."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*low_cpu_mem_usage=False.*", category=UserWarning)
        warnings.filterwarnings("ignore", message="PiSSA changes the base weights.*", category=UserWarning)
        yield


def peft_config(case: str, kind: str):
    """The peft config of one test case on one tiny model."""
    fan = kind == "gpt2"  # GPT-2 Conv1D: set explicitly (peft would set it with a warning)
    targets = TARGETS[kind]
    if case == "lora":
        short = SHORT_PATTERN[kind]
        return LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, fan_in_fan_out=fan, lora_dropout=0.0,
                          rank_pattern={short: 2}, alpha_pattern={short: 3.0})
    if case == "rslora":
        full = FULL_PATTERN[kind]
        return LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, fan_in_fan_out=fan, use_rslora=True,
                          rank_pattern={full: 2}, alpha_pattern={full: 5.0})
    if case == "dora":
        return LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, fan_in_fan_out=fan, use_dora=True)
    if case in ("pissa", "pissa-converted"):
        return LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, fan_in_fan_out=fan, init_lora_weights="pissa")
    if case == "eva":  # an EVA checkpoint: per-layer ranks and alphas (peft's calibration is not needed for the format)
        short = SHORT_PATTERN[kind]
        return LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, fan_in_fan_out=fan, init_lora_weights="eva",
                          eva_config=EvaConfig(rho=1.5), rank_pattern={short: 3}, alpha_pattern={short: 4.5})
    if case == "ia3":
        out, ff = IA3_TARGETS[kind]
        return IA3Config(target_modules=out + ff, feedforward_modules=ff, fan_in_fan_out=fan)
    if case == "hra":
        return HRAConfig(r=R, target_modules=targets)
    if case == "delora":
        return DeloraConfig(r=R, target_modules=targets, delora_lambda=10)
    raise ValueError(case)


def perturb(peft_model, scale: float = 0.1, seed: int = 5) -> None:
    """Independent Gaussian noise on every trainable peft tensor, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(peft_model.named_parameters()):
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def saved_peft_model(case: str, kind: str, directory: Path):
    """A perturbed peft model of ``case`` saved under ``directory``; returns the peft model.

    ``pissa-converted`` saves the initial adapter first and then peft's conversion to a plain
    LoRA (``path_initial_model_for_weight_conversion``)."""
    with peft_warnings():
        model = get_peft_model(tiny_model(kind), peft_config(case, kind)).eval()
        if case == "pissa-converted":
            model.save_pretrained(directory / "initial")
        perturb(model)
        if case == "pissa-converted":
            model.save_pretrained(directory / "adapter", path_initial_model_for_weight_conversion=str(directory / "initial"))
        else:
            model.save_pretrained(directory / "adapter")
    return model


def load_in_peft(kind: str, directory: Path):
    with peft_warnings():
        return PeftModel.from_pretrained(tiny_model(kind), str(directory)).eval()
