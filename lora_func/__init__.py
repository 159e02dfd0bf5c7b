"""lora_func: LoRA-family adapters as pure functions on torch.func.

The names below are grouped as docs/api.md groups them. Namespaces for the rest:
``lora_func.variants`` (the variant contract and registry), ``lora_func.prompts`` (prompt methods), ``lora_func.merging`` (the merge
building blocks: trim, elect_sign, disjoint_mean, drop), ``lora_func.quantized`` (quantized
weight kinds), ``lora_func.distributed`` (data-parallel helpers), ``lora_func.privacy`` (DP-SGD: the pieces
behind ``private_grads``, the accountant), ``lora_func.optimizers`` (LoRA+, LoRA-FA, Riemannian:
optimisers and pure transforms), ``lora_func.rank_budget`` (AdaLoRA's schedule), ``lora_func.subspace_budget`` (AdaMSS's ASA), ``lora_func.train`` (training utilities),
``lora_func.attribution`` (training-data attribution: features, TracIn/LESS/TRAK scores, EK-FAC
influence, LDS).
"""

# Describing and building an adapter.
from lora_func.adapter import Adapter, AdapterLayer
from lora_func.build import init_adapter
from lora_func.spec import AdapterSpec
from lora_func.variants import get_variant, list_variants

# Applying an adapter (the model is never modified).
from lora_func._model import base_params, check_base_params
from lora_func.call import adapted, adapted_call, make_plan
from lora_func.plan import Plan
from lora_func.overlay import merge_overlay, overlay, overlay_mode

# Combining adapters.
from lora_func.adapter import Combined, Composed, combine, compose
from lora_func.merging import LoraConversion, merge_adapters, to_lora

# Many adapters at once: a stack under torch.func.vmap, or one adapter per row inside the layers.
from lora_func.stacking import stack, take, unstack
from lora_func.many import ensemble_call, mixed_call, per_example_grads
from lora_func.many import mixed_adapted
from lora_func import routed  # routed LoRA: Poly / MHR task routing (lora_func.routed.task_call, ...)

# Saving, loading, exporting.
from lora_func.export import merged_state_dict
from lora_func.io import load, load_peft, save, save_peft

# Input-level adapters (prompt learning): a prompt is applied by the same calls.
from lora_func.prompts import Prompt, PromptSpec, init_prompt

# Checks.
from lora_func.checks import check_finite

# Private training (DP-SGD): clipped, noised gradients; accounting; Poisson sampling.
from lora_func import privacy  # (lora_func.privacy.clipped_sum, Accountant, ...)
from lora_func.privacy import PoissonBatchSampler, epsilon, noise_for_epsilon, private_grads

# Optimiser methods (LoRA+, LoRA-FA, Riemannian) and AdaLoRA's rank budget, as pure functions.
from lora_func import optimizers, rank_budget  # (lora_func.optimizers.riemannian_precondition, ...)
from lora_func.optimizers import lorafa_optimizer, loraplus_optimizer, riemannian_optimizer
from lora_func.rank_budget import apply_mask, budget_init, budget_step, kasa_penalty, orth_penalty
from lora_func import subspace_budget  # AdaMSS's subspace allocation (lora_func.subspace_budget.asa_step, ...)

# Training-data attribution: per-example gradient features, TracIn/LESS/TRAK scores, EK-FAC influence, LDS.
from lora_func import attribution  # (lora_func.attribution.features, scores, ekfac, influence, lds, ...)

# Ecosystem: peft habits, optree/torchopt, nn.Module frameworks (Trainer, accelerate, DDP).
from lora_func import _optree  # (registers the adapter types with optree, if installed)
from lora_func import distributed  # (lora_func.distributed.all_reduce_mean, ...)
from lora_func.summary import AdapterSummary, adapter_summary

BUILDING = ["Adapter", "AdapterLayer", "AdapterSpec", "get_variant", "init_adapter", "list_variants"]
APPLYING = ["Plan", "adapted", "adapted_call", "base_params", "check_base_params", "make_plan", "merge_overlay", "overlay", "overlay_mode"]
COMBINING = ["Combined", "Composed", "LoraConversion", "combine", "compose", "merge_adapters", "to_lora"]
MANY_ADAPTERS = ["ensemble_call", "mixed_adapted", "mixed_call", "per_example_grads", "stack", "take", "unstack"]
FILES = ["load", "load_peft", "merged_state_dict", "save", "save_peft"]
PROMPTS = ["Prompt", "PromptSpec", "init_prompt"]
CHECKS = ["check_finite"]
PRIVACY = ["PoissonBatchSampler", "epsilon", "noise_for_epsilon", "private_grads"]
TRAINING_METHODS = ["apply_mask", "budget_init", "budget_step", "kasa_penalty", "lorafa_optimizer", "loraplus_optimizer", "orth_penalty", "riemannian_optimizer"]
ECOSYSTEM = ["AdaptedModule", "AdapterSummary", "adapter_summary", "as_module"]

__all__ = [*BUILDING, *APPLYING, *COMBINING, *MANY_ADAPTERS, *FILES, *PROMPTS, *CHECKS, *PRIVACY, *TRAINING_METHODS, *ECOSYSTEM]

__version__ = "0.1.0"

def __getattr__(name: str):
    # The module bridge subclasses transformers' PreTrainedModel, whose import costs seconds:
    # loaded on first use only.
    if name in ("AdaptedModule", "as_module"):
        from lora_func import bridge

        return getattr(bridge, name)
    raise AttributeError(f"module 'lora_func' has no attribute {name!r}")  # error: unknown-attribute
