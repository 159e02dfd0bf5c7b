"""Helpers shared by the tests that compare against HF peft or probe one layer."""

from __future__ import annotations

import re

import torch


def peft_key_to_lf(name: str, tensor_names: tuple[str, ...]) -> str:
    """``base_model.model.<module>.<tensor>.default[.weight]`` -> ``<module>.<tensor>``."""
    pattern = rf"^base_model\.model\.(.+)\.({'|'.join(map(re.escape, tensor_names))})\.default(?:\.weight)?$"
    match = re.match(pattern, name)
    assert match, f"unexpected peft tensor {name}"
    return f"{match[1]}.{match[2]}"


def ce_loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of logits ``(..., T, V)`` against ``ids (..., T)``."""
    return torch.nn.functional.cross_entropy(out[..., :-1, :].reshape(-1, out.shape[-1]), ids[..., 1:].reshape(-1))


class NoWeightBase:
    """A BaseLayer whose dense weight must not be read (checks an activation form is low-rank)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._w, self.bias = weight, bias

    @property
    def weight(self) -> torch.Tensor:
        raise AssertionError("the activation form read the dense base weight")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self._w, self.bias)
