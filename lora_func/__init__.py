"""lora_func: LoRA-family adapters as pure functions on torch.func."""

from lora_func.adapter import Adapter, AdapterLayer, stack, take, unstack
from lora_func.core import adapted_call, base_params, check_params, init_adapter, merge_overlay, overlay
from lora_func.distributed import all_reduce_mean, all_reduce_mean_grads_, broadcast_adapter
from lora_func.io import load, save
from lora_func.spec import AdapterSpec
from lora_func.variants import get_variant, list_variants

__all__ = [
    "Adapter",
    "AdapterLayer",
    "AdapterSpec",
    "adapted_call",
    "all_reduce_mean",
    "all_reduce_mean_grads_",
    "base_params",
    "broadcast_adapter",
    "check_params",
    "get_variant",
    "init_adapter",
    "list_variants",
    "load",
    "merge_overlay",
    "overlay",
    "save",
    "stack",
    "take",
    "unstack",
]

__version__ = "0.1.0"
