"""Quantized base layers (QLoRA): a small registry of quantized weight kinds.

A quantized layer keeps its weight in a packed form (bitsandbytes' ``Params4bit`` /
``Int8Params``, torchao's ``NF4Tensor`` / ``Int8Tensor``) and runs its own op on it, so a
parameter-dict overlay cannot replace that weight: lora_func adapts such a target at its
module's call (``route="module"``, picked by ``route="auto"``), where the layer's frozen op
gives ``base(x)`` and the variant adds its path. Each kind says:

- ``is_weight(t)``: whether a tensor is this kind's packed weight;
- ``shape(t)``: the logical ``(d_out, d_in)`` shape of such a weight;
- ``dequantize(module)``: the weight as a dense ``(d_out, d_in)`` float tensor, for the variants
  that read ``W`` (DoRA's norm, HRA, the inits); made on demand, one layer at a time;
- ``call(module)``: the layer's frozen op ``x (..., d_in) -> (..., d_out)``, bias included,
  without changing the module (bitsandbytes' own 4-bit forward repacks its weight in place on
  some CPUs; this does not).

A further scheme (GPTQ, HQQ, torchao int4) is one :func:`register` call. The libraries are never
imported here: a kind matches only tensors of a library the program has imported already.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["QuantizedKind", "frozen_call", "frozen_forwards", "kind_of_tensor", "kinds", "logical_shape", "register"]


@dataclasses.dataclass(frozen=True)
class QuantizedKind:
    """One quantized weight kind (see the module docstring)."""

    name: str
    is_weight: Callable[[Tensor], bool]
    shape: Callable[[Tensor], tuple[int, ...]]
    dequantize: Callable[[nn.Module], Tensor]
    call: Callable[[nn.Module], Callable[[Tensor], Tensor]]


_KINDS: list[QuantizedKind] = []


def register(kind: QuantizedKind) -> QuantizedKind:
    """Add a quantized weight kind; later registrations are asked first."""
    _KINDS.insert(0, kind)
    return kind


def kinds() -> tuple[QuantizedKind, ...]:
    return tuple(_KINDS)


def kind_of_tensor(t: Any) -> QuantizedKind | None:
    """The kind whose packed weight ``t`` is, or ``None`` for a plain tensor."""
    if not isinstance(t, Tensor) or type(t) in (Tensor, nn.Parameter):
        return None
    for kind in _KINDS:
        if kind.is_weight(t):
            return kind
    return None


def logical_shape(t: Tensor) -> tuple[int, ...]:
    """``t``'s shape as the layer sees it: a packed weight's logical shape, else ``t.shape``."""
    kind = kind_of_tensor(t)
    return tuple(t.shape) if kind is None else kind.shape(t)


# ------------------------------------------------------------------------- the frozen op


class _FrozenOp(torch.autograd.Function):
    """``call(x)`` for a frozen quantized weight, usable under ``torch.func`` transforms (the
    libraries' own autograd functions lack ``setup_context``). Backward is ``g @ W`` with ``W``
    dequantized just then: nothing of the layer is kept for backward but ``call`` itself."""

    @staticmethod
    def forward(x: Tensor, call: Callable[[Tensor], Tensor], weight: Callable[[], Tensor]) -> Tensor:
        out = call(x)
        # A view (a library's reshape) could not be written in place by the variant's sum.
        return out.clone() if out._is_view() else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, _, weight = inputs
        ctx.weight, ctx.x_dtype = weight, x.dtype

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        w = ctx.weight()
        return (grad.to(w.dtype) @ w).to(ctx.x_dtype), None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, call: Callable[[Tensor], Tensor], weight: Callable[[], Tensor]) -> tuple[Tensor, int | None]:
        # A linear map acts row by row: the vmapped dimension is one more leading dimension.
        if in_dims[0] is None:
            return _FrozenOp.apply(x, call, weight), None
        return _FrozenOp.apply(x.movedim(in_dims[0], 0), call, weight), 0


def frozen_call(module: nn.Module, kind: QuantizedKind) -> Callable[[Tensor], Tensor]:
    """The layer's frozen quantized op as a differentiable map of ``x`` only."""
    call = kind.call(module)
    return lambda x: _FrozenOp.apply(x, call, lambda: kind.dequantize(module))


def frozen_forwards(
    model: nn.Module, *, exclude: Collection[str] = (), modules: Mapping[str, nn.Module] | None = None
) -> dict[str, Callable[..., Tensor]]:
    """For an :class:`lora_func._application.Application`: every quantized layer of ``model`` not in
    ``exclude`` runs :func:`frozen_call` (works under ``torch.func``, never changes the layer).
    ``modules``: ``dict(model.named_modules())`` when the caller has it already."""
    forwards = {}
    for name, module in (model.named_modules() if modules is None else modules.items()):
        kind = kind_of_tensor(getattr(module, "weight", None))
        if kind is not None and name not in exclude:
            forwards[name] = _frozen_forward(kind)
    return forwards


def _frozen_forward(kind: QuantizedKind) -> Callable[..., Tensor]:
    def forward(module: nn.Module, inner: Any, x: Tensor) -> Tensor:
        return frozen_call(module, kind)(x)

    return forward


# ------------------------------------------------------------------------- bitsandbytes


# A quantized layer of bitsandbytes or torchao, as the functions below read it: the attributes
# they use (weight.quant_state, state.CB, compute_dtype, ...) are those libraries', which are
# optional and untyped, so the layer is typed as what mypy can check (anything).
QuantizedLayer = Any


def _bnb() -> Any:
    return sys.modules.get("bitsandbytes")


def _bnb4_shape(t: Any) -> tuple[int, ...]:
    # A Params4bit holds the packed bytes; the layer's (d_out, d_in) is in its quant_state.
    return tuple(t.quant_state.shape)


def _is_params4bit(t: Tensor) -> bool:
    bnb = _bnb()
    return bnb is not None and isinstance(t, bnb.nn.Params4bit)


def _bnb4_dequantize(module: QuantizedLayer) -> Tensor:
    import bitsandbytes.functional as bf

    data, state = module.weight.data, module.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        # bitsandbytes repacked the weight in place for its CPU kernel (an eval forward under
        # no_grad), with the block scales as bf16 in another layout: unpack a copy, keeping
        # exactly the scales that kernel uses.
        state = copy.copy(state)
        state.original_nested = False
        data, state = bf._convert_weight_packed_for_cpu_inverse(data, state)
        state.absmax = state.absmax.T.reshape(-1).float()
    return bf.dequantize_4bit(data, state)


def _bnb4_call(module: QuantizedLayer) -> Callable[[Tensor], Tensor]:
    import bitsandbytes as bnb

    def call(x: Tensor) -> Tensor:
        dtype = module.compute_dtype or x.dtype
        bias = None if module.bias is None else module.bias.to(dtype)
        return bnb.matmul_4bit(x.to(dtype), module.weight, bias=bias, quant_state=module.weight.quant_state).to(x.dtype)

    return call


def _is_int8params(t: Tensor) -> bool:
    bnb = _bnb()
    return bnb is not None and isinstance(t, bnb.nn.Int8Params)


def _bnb8_dequantize(module: QuantizedLayer) -> Tensor:
    state, weight = module.state, module.weight
    cb = state.CB if state.CB is not None else weight.data
    scb = state.SCB if state.SCB is not None else weight.SCB
    return cb.float() * (scb.float()[:, None] / 127.0)


def _bnb8_call(module: QuantizedLayer) -> Callable[[Tensor], Tensor]:
    # LLM.int8 quantizes the activations too; its own forward is the op (it moves the int8
    # weight into the layer's state on the first call, the same bytes).
    return lambda x: type(module).forward(module, x)


register(QuantizedKind("bitsandbytes-int8", _is_int8params, lambda t: tuple(t.shape), _bnb8_dequantize, _bnb8_call))
register(QuantizedKind("bitsandbytes-4bit", _is_params4bit, _bnb4_shape, _bnb4_dequantize, _bnb4_call))


# ------------------------------------------------------------------------------- torchao


def _torchao_base() -> Any:
    module = sys.modules.get("torchao.utils")
    return None if module is None else getattr(module, "TorchAOBaseTensor", None)


def _is_nf4(t: Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor" and type(t).__module__.startswith("torchao.")


def _is_torchao(t: Tensor) -> bool:
    base = _torchao_base()
    return base is not None and isinstance(t, base) and hasattr(t, "dequantize")


def _torchao_call(module: QuantizedLayer) -> Callable[[Tensor], Tensor]:
    return lambda x: F.linear(x, module.weight, module.bias)


def _torchao_dequantize(module: QuantizedLayer) -> Tensor:
    return module.weight.dequantize()


def _nf4_dequantize(module: QuantizedLayer) -> Tensor:
    return module.weight.get_original_weight()


register(QuantizedKind("torchao", _is_torchao, lambda t: tuple(t.shape), _torchao_dequantize, _torchao_call))
register(QuantizedKind("torchao-nf4", _is_nf4, lambda t: tuple(t.shape), _nf4_dequantize, _torchao_call))
