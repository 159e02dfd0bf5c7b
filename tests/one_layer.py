"""One-layer models for property and mutation-killer tests: ``x -> proj(x)`` with proj an
``nn.Linear`` (with or without bias) or transformers' GPT-2 ``Conv1D``, plus an embedding so
that ``input_ids`` work too (EVA's calibration runs the model on token batches)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.func import functional_call
from transformers.pytorch_utils import Conv1D

import lora_func as lf
from lora_func.targeting import canonical_weight
from tests.variant_table import ROWS

VOCAB = 23


class OneLayer(nn.Module):
    """``x -> proj(x)``; ``input_ids`` go through an embedding first (for EVA's calibration)."""

    def __init__(self, layout: str, d_in: int, d_out: int, bias: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_in)
        if layout == "linear":
            self.proj: nn.Module = nn.Linear(d_in, d_out, bias=bias)
        else:
            self.proj = Conv1D(d_out, d_in)  # transformers' GPT-2 layer: weight (d_in, d_out), always a bias

    def forward(self, input_ids: Tensor | None = None, x: Tensor | None = None) -> Tensor:
        return self.proj(self.emb(input_ids) if x is None else x)


def one_layer(layout: str, d_in: int, d_out: int, bias: bool, dtype: torch.dtype, seed: int) -> OneLayer:
    """Random weights ``~ N(0, 1/d_in)`` and a random bias ``~ N(0, 0.25)`` (a bias bug shows)."""
    torch.manual_seed(seed)
    model = OneLayer(layout, d_in, d_out, bias)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.proj.weight.copy_(torch.randn(model.proj.weight.shape, generator=g) / math.sqrt(d_in))
        if model.proj.bias is not None:
            model.proj.bias.copy_(0.5 * torch.randn(model.proj.bias.shape, generator=g))
    return model.to(dtype).eval()


def calibration(seed: int, n: int = 3) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (4, 8), generator=g)} for _ in range(n)]


def run(model: nn.Module, params: dict[str, Tensor], x: Tensor) -> Tensor:
    return functional_call(model, params, (), {"x": x})


def perturbed(adapter: lf.Adapter, seed: int, scale: float | None = None) -> lf.Adapter:
    """Every trainable tensor plus independent Gaussian noise (the row's scale by default)."""
    scale = ROWS[adapter.spec.variant].perturb_scale if scale is None else scale
    g = torch.Generator().manual_seed(seed)
    return adapter.with_params(
        {
            k: (v.detach() + scale * torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype)).requires_grad_(True)
            for k, v in adapter.params.items()
        }
    )


def oracle_forms(model: OneLayer, adapter: lf.Adapter, p: dict[str, Tensor] | None = None, w_eff_fn=None) -> tuple[Tensor, Tensor | None]:
    """``(W_eff (d_out, d_in), b_eff)`` in float64 from the row's explicit formula (or
    ``w_eff_fn``, with the row's signature); ``p`` (float64 params, e.g. with
    ``requires_grad``) replaces the adapter's params."""
    (layer,) = adapter.layers
    params, buffers = adapter.layer_tensors(layer)
    base = lf.base_params(model)
    w = canonical_weight(base["proj.weight"], layer.target.layout).double()
    bias = base["proj.bias"].double() if layer.target.bias_key else None
    p64 = p if p is not None else {k: v.detach().double() for k, v in params.items()}
    w_eff_fn = w_eff_fn or ROWS[adapter.spec.variant].w_eff
    return w_eff_fn(p64, {k: v.detach().double() for k, v in buffers.items()}, w, bias, layer.info)
