"""Persistence: lora_func's own safetensors format and HF peft's checkpoint format."""

from lora_func.io.native import load, save
from lora_func.io.peft import load_peft, peft_problems, save_peft

__all__ = ["load", "load_peft", "peft_problems", "save", "save_peft"]
