"""lora_func: LoRA-family adapters as pure functions on torch.func."""

from lora_func.adapter import Adapter, AdapterLayer, Combined, Composed, combine, compose, stack, take, unstack
from lora_func.batching import ensemble_call, mixed_call, per_example_grads
from lora_func.mixed import mixed_adapted, mixed_adapted_call
from lora_func.checks import check_finite
from lora_func.core import adapted, adapted_call, base_params, check_params, init_adapter, merge_overlay, overlay, overlay_calls
from lora_func.distributed import all_reduce_mean, all_reduce_mean_grads_, broadcast_adapter
from lora_func.export import merge
from lora_func.io import load, load_peft, save, save_peft
from lora_func.spec import AdapterSpec
from lora_func.variants import get_variant, list_variants

# Ecosystem: peft habits, optree/torchopt, nn.Module frameworks (Trainer, accelerate, DDP).
from lora_func import _optree  # noqa: F401  (registers the adapter types with optree, if installed)
from lora_func.summary import AdapterSummary, adapter_summary

__all__ = [
    "AdaptedModule",
    "Adapter",
    "AdapterLayer",
    "AdapterSpec",
    "AdapterSummary",
    "Combined",
    "Composed",
    "adapted",
    "adapted_call",
    "adapter_summary",
    "all_reduce_mean",
    "all_reduce_mean_grads_",
    "as_module",
    "base_params",
    "broadcast_adapter",
    "check_finite",
    "check_params",
    "combine",
    "compose",
    "ensemble_call",
    "get_variant",
    "init_adapter",
    "list_variants",
    "load",
    "load_peft",
    "merge",
    "merge_overlay",
    "mixed_adapted",
    "mixed_adapted_call",
    "mixed_call",
    "overlay",
    "overlay_calls",
    "per_example_grads",
    "save",
    "save_peft",
    "stack",
    "take",
    "unstack",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    # The module bridge subclasses transformers' PreTrainedModel, whose import costs seconds:
    # loaded on first use only.
    if name in ("AdaptedModule", "as_module"):
        from lora_func import bridge

        return getattr(bridge, name)
    raise AttributeError(f"module 'lora_func' has no attribute {name!r}")
