"""PromptSpec: the frozen, validated description of a prompt (an input-level adapter)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch

from lora_func.prompts._methods import get_method

__all__ = ["PromptSpec"]

_FLOAT_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}


def _frozen(value: Any) -> Any:
    """Lists (from JSON or the caller) as tuples: a spec is hashable (pytree context)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _json_value(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_json_value(v) for v in value)
    return value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))


@dataclasses.dataclass(frozen=True, init=False)
class PromptSpec:
    """Which prompt method, with how many virtual tokens and which options.

    Args:
      method: one of ``lora_func.prompts.list_methods()``: ``"prompt_tuning"``, ``"p_tuning"``,
        ``"prefix_tuning"``, ``"multitask_prompt_tuning"``, ``"cpt"``, ``"cartridge"``,
        ``"adaption_prompt"`` (docs/prompts.md: what each learns, how to pick).
      num_virtual_tokens: ``n``, the number of learned tokens (peft's ``num_virtual_tokens``;
        ``adapter_len`` for ``adaption_prompt``); CPT counts its ``cpt_token_ids`` (leave it
        out, or give the same number).
      dtype: dtype of the prompt's tensors (fp32 default; the prompt is cast to the model's
        dtype where it enters the model, as peft does).
      **options: the method's options (its file's docstring; unknown names raise), e.g.
        ``init="text", init_text="Classify the sentiment"`` (prompt tuning),
        ``encoder="lstm"`` (p-tuning), ``prefix_projection=True`` (prefix tuning),
        ``num_tasks=4, num_ranks=2`` (multitask), ``num_frozen_tokens=1`` (cartridge),
        ``adapter_layers=8`` (adaption prompt).
    """

    method: str
    num_virtual_tokens: int
    dtype: torch.dtype
    options: tuple[tuple[str, Any], ...]

    def __init__(self, method: str, num_virtual_tokens: int | None = None, dtype: torch.dtype | str = torch.float32, **options: Any) -> None:
        found = get_method(method)
        unknown = sorted(set(options) - set(found.options))
        if unknown:
            raise TypeError(  # error: prompt-spec-unknown-option
                f"PromptSpec: unknown option(s) {unknown} for prompt method {method!r}; it accepts "
                f"{sorted(found.options) or 'no options'}"
            )
        if isinstance(dtype, str):
            dtype = _FLOAT_DTYPES.get(dtype.removeprefix("torch."), dtype)
        if dtype not in _FLOAT_DTYPES.values():
            raise TypeError(f"PromptSpec dtype must be a floating dtype ({', '.join(_FLOAT_DTYPES)}), got {dtype!r}")  # error: prompt-spec-dtype
        resolved = {**found.options, **{k: _frozen(v) for k, v in options.items()}}
        problems = [f"{k}={v!r} must be a number, string, bool or list of them" for k, v in sorted(resolved.items()) if not _json_value(v)]
        n = num_virtual_tokens
        if found.count is not None and not problems:
            counted = found.count(resolved)
            if n is not None and n != counted:
                problems.append(f"num_virtual_tokens={n!r}, but {method} has one virtual token per entry of its options ({counted}); leave it out")
            n = counted
        elif isinstance(n, bool) or not isinstance(n, int) or n < 1:
            problems.append(f"num_virtual_tokens={n!r} must be an integer >= 1")
        if not problems:
            problems = found.check(n, resolved)  # type: ignore[arg-type]  # n is an int here: checked just above
        if problems:
            raise ValueError(f"PromptSpec({method!r}) options are invalid: {'; '.join(problems)}")  # error: prompt-spec-options
        set_ = object.__setattr__
        set_(self, "method", method)
        set_(self, "num_virtual_tokens", n)
        set_(self, "dtype", dtype)
        set_(self, "options", tuple(sorted(resolved.items())))

    def option(self, name: str) -> Any:
        return dict(self.options)[name]

    def to_json(self) -> str:
        """A JSON string from which :meth:`from_json` rebuilds an equal spec."""
        return json.dumps(
            {"method": self.method, "num_virtual_tokens": self.num_virtual_tokens, "dtype": str(self.dtype).removeprefix("torch."), "options": dict(self.options)},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> PromptSpec:
        data = json.loads(text)
        count = get_method(data["method"]).count
        return cls(data["method"], None if count is not None else data["num_virtual_tokens"], dtype=data["dtype"], **data["options"])
