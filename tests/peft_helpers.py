"""Helpers shared by the tests that compare against HF peft or probe one layer."""

from __future__ import annotations

import re

import torch
from torch.overrides import TorchFunctionMode


def peft_key_to_lf(name: str, tensor_names: tuple[str, ...]) -> str:
    """``base_model.model.<module>.<tensor>.default[.weight]`` -> ``<module>.<tensor>``."""
    pattern = rf"^base_model\.model\.(.+)\.({'|'.join(map(re.escape, tensor_names))})\.default(?:\.weight)?$"
    match = re.match(pattern, name)
    assert match, f"unexpected peft tensor {name}"
    return f"{match[1]}.{match[2]}"


def ce_loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of logits ``(..., T, V)`` against ``ids (..., T)``."""
    return torch.nn.functional.cross_entropy(out[..., :-1, :].reshape(-1, out.shape[-1]), ids[..., 1:].reshape(-1))


def copy_into_peft(peft_model, adapter) -> dict:
    """Copy a lora/dora adapter's values into the peft model's LoRA layers (same targets); returns
    ``{module name: peft layer}``."""
    layers = {n.removeprefix("base_model.model."): m for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    with torch.no_grad():
        for key, module in layers.items():
            module.lora_A["default"].weight.copy_(adapter.params[f"{key}.lora_A"])
            module.lora_B["default"].weight.copy_(adapter.params[f"{key}.lora_B"])
            if f"{key}.lora_magnitude_vector" in adapter.params:
                module.lora_magnitude_vector["default"].weight.copy_(adapter.params[f"{key}.lora_magnitude_vector"])
    return layers


class NoWeightBase:
    """A BaseLayer whose dense weight must not be read (checks an activation form is low-rank)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._w, self.bias = weight, bias

    @property
    def weight(self) -> torch.Tensor:
        raise AssertionError("the activation form read the dense base weight")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self._w, self.bias)


class LinearBase:
    """A plain BaseLayer: ``F.linear`` with ``weight (d_out, d_in)`` and ``bias (d_out,)``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


_PRODUCTS = {
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm,
    torch.addmm, torch.Tensor.addmm, torch.Tensor.addmm_, torch.bmm, torch.einsum, torch.outer, torch.nn.functional.linear,
}


class NoDenseProducts(TorchFunctionMode):
    """Fails when a product builds a dense matrix over the layer's feature axes (both of its
    last two sizes in ``{d_in, d_out}``: a merged weight, a ``(d_in, d_in)`` rotation): an
    activation form may read the frozen weight but must stay low-rank. Pick test sizes whose
    ranks and row counts differ from ``d_in`` and ``d_out``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.dims = {d_in, d_out}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _PRODUCTS and isinstance(out, torch.Tensor) and out.dim() >= 2 and {out.shape[-2], out.shape[-1]} <= self.dims:
            raise AssertionError(f"the activation form built a dense {tuple(out.shape)} matrix with {getattr(func, '__name__', func)}")
        return out
