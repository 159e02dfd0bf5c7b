"""The registry of prompt methods: one per method file of :mod:`lora_func.prompts`."""

from __future__ import annotations

from lora_func.prompts import adaption_prompt, cartridge, cpt, multitask, p_tuning, prefix_tuning, prompt_tuning
from lora_func.prompts._contract import PromptMethod

__all__ = ["METHODS", "get_method", "list_methods"]

METHODS: dict[str, PromptMethod] = {
    m.METHOD.name: m.METHOD for m in (prompt_tuning, p_tuning, prefix_tuning, multitask, cpt, cartridge, adaption_prompt)
}
# peft's peft_type -> the method that reads its checkpoints.
BY_PEFT_TYPE: dict[str, PromptMethod] = {method.peft.peft_type: method for method in METHODS.values()}


def list_methods() -> list[str]:
    """The prompt methods' names, sorted."""
    return sorted(METHODS)


def get_method(name: object) -> PromptMethod:
    """The :class:`PromptMethod` named ``name``; a ``ValueError`` lists the known ones."""
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unknown prompt method {name!r}; known prompt methods: {', '.join(list_methods())}")  # error: prompt-method-unknown
    return METHODS[name]
