"""Persistence: lora_func's own safetensors format (peft's format lives beside it)."""

from lora_func.io.native import load, save

__all__ = ["load", "save"]
