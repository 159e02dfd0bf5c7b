"""Input-level adapters: peft's prompt-learning family as pure functions (docs/prompts.md).

A :class:`Prompt` is a small pytree of tensors that reaches the model for the duration of a call
(``lora_func.adapted_call``, ``with lora_func.adapted(...)`` for ``generate``), as virtual-token
embeddings, a KV-cache prefix or gated prompt attention; the model is never modified. Methods
(one file each: its math, its inits and its peft record): ``prompt_tuning``, ``p_tuning``,
``prefix_tuning``, ``multitask_prompt_tuning``, ``cpt``, ``cartridge``, ``adaption_prompt``.
"""

from lora_func.prompts._contract import Geometry, PromptMethod
from lora_func.prompts._methods import get_method, list_methods
from lora_func.prompts._node import Prompt
from lora_func.prompts.build import init_prompt
from lora_func.prompts.cpt import projected as _cpt_projected
from lora_func.prompts.spec import PromptSpec

__all__ = ["Geometry", "Prompt", "PromptMethod", "PromptSpec", "cpt_projected", "get_method", "init_prompt", "list_methods"]


def cpt_projected(prompt: Prompt) -> Prompt:
    """A CPT prompt whose ``delta_embedding`` is projected into its balls: the value peft's
    ``CPTEmbedding`` stores after each forward (it projects its parameter in place). The forward
    of either prompt is the same; call this after each optimiser step to follow peft's training
    trajectory exactly (a step then starts from the projected value, as in peft)."""
    if not isinstance(prompt, Prompt) or prompt.spec.method != "cpt":
        raise TypeError(f"cpt_projected: expected a cpt Prompt, got {repr(prompt)[:200]}")  # error: prompt-cpt-projected
    delta = prompt.params["delta_embedding"]
    return prompt.with_params({"delta_embedding": _cpt_projected(delta, prompt.options).requires_grad_(delta.requires_grad)})
