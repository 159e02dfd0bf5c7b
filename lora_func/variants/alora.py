"""aLoRA (activated LoRA, Greenewald et al. 2025, arXiv 2504.12397) as peft's
``LoraConfig(alora_invocation_tokens=[...])``: LoRA that acts only from the last occurrence of an
invocation sequence on, so that the KV cache of everything before it is the base model's.

LoRA's tensors and init (``A (r, d_in)`` kaiming-uniform, ``B = 0``), ``s = alpha/r`` (``alpha/√r``
with ``use_rslora``). For an input whose invocation starts ``o`` tokens before its end (peft's
``alora_offsets``: ``o = T − start``; ``0`` where the sequence is absent), a target layer with
``T`` tokens adds ``s·(x_t Aᵀ) Bᵀ`` on its last ``min(o, T)`` tokens only (peft's ``pos >= T −
o``), the others are the base's (and get no gradient): a prompt's prefill adapts the invocation
and what follows, each decoding step (``T = 1``) its one token.

The offset is one shared integer buffer of the adapter, ``<shared>.alora_offset``: the forms are
pure functions of the adapter and the layer input, and a layer never sees the model's
``input_ids``. :func:`offsets` finds it per row of ``input_ids (B, T)`` as peft does, and
:func:`invoked` sets it: ``adapted_call(model, invoked(adapter, o), ids)`` for one row (or rows of
one offset); for a batch, one member per row, ``lora_func.stack([invoked(adapter, o) for o in
offsets(ids, tokens)])`` through ``lora_func.mixed_call(model, members, torch.arange(B), ids,
batching="layers")`` (or ``mixed_adapted`` around ``generate``: the offsets of the prompt serve every decoding
step, as peft's) or ``torch.func.vmap`` over rows. Until invoked (``init_adapter``, ``load_peft``)
the offset is "from the start": the adapter acts on every token, as LoRA.

peft cannot merge aLoRA. lora_func's merged path (a weight for every token) is LoRA's ``W_eff``
while the offset is non-zero, the base at offset 0: exact for an adapter acting on every token or
on none, not for a partial invocation (use the lazy or module-call route then).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, Check, LayerInfo, Option, Slot, TensorDict, lora
from lora_func.variants._options import nullable
from lora_func.variants._kernels import base_plus_low_rank, lora_scale, lowrank_input

OFFSET = "alora_offset"
# "from the start": at least every layer input's length, so every token is adapted
EVERY_TOKEN = 2**62


def offsets(input_ids: Tensor, invocation_tokens: tuple[int, ...] | list[int] | Tensor) -> Tensor:
    """peft's ``calculate_alora_offsets`` for ``input_ids (B, T)``: per row, ``T −`` the start of the
    last occurrence of ``invocation_tokens``, or ``0`` where it does not occur: ``(B,)`` int64.
    No invocation tokens: every row from the start (:data:`EVERY_TOKEN`; peft reads an empty list
    as a plain LoRA)."""
    tokens = torch.as_tensor(invocation_tokens, dtype=input_ids.dtype, device=input_ids.device)
    rows, length, k = input_ids.shape[0], input_ids.shape[-1], tokens.numel()
    if k == 0 or length < k:
        return torch.full((rows,), EVERY_TOKEN if k == 0 else 0, dtype=torch.int64, device=input_ids.device)
    found = (input_ids.unfold(-1, k, 1) == tokens).all(-1)  # (B, T - k + 1): a match starts there
    last = (length - k) - found.flip(-1).to(torch.int64).argmax(-1)
    return torch.where(found.any(-1), length - last, 0).to(torch.int64)


class _WithBuffers(Protocol):
    def with_buffers(self, buffers: Any) -> Any: ...


def invoked(adapter: _WithBuffers, offset: int | Tensor) -> Any:
    """``adapter`` (an ``alora`` adapter) acting from ``offset`` tokens before the end of each
    input (``offsets(...)[b]``; ``0``: not at all)."""
    shared = f"<shared>.{OFFSET}"
    return adapter.with_buffers({shared: torch.as_tensor(offset, dtype=torch.int64)})


def _token_mask(offset: Tensor, x: Tensor) -> Tensor:
    """Which of the layer input's tokens are adapted: ``(T, 1)`` for ``x (..., T, d_in)``, the token
    axis second to last (also for one row, ``(T, d_in)``, as the mixed route and ``vmap`` over
    examples hand it; peft would take a 2-D input as one token per row)."""
    length = x.shape[-2] if x.dim() >= 2 else 1
    first = length - torch.clamp(offset, max=length)
    return (torch.arange(length, device=x.device) >= first.to(x.device))[:, None]


def shared_init(infos: Any, *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    return {}, {OFFSET: torch.tensor(EVERY_TOKEN, dtype=torch.int64, device=device)}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    on = (buffers[OFFSET] > 0).to(weight.dtype)
    return weight + on * lora_scale(info, buffers) * (params["lora_B"] @ params["lora_A"]), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """``base(x) + s·(x Aᵀ) Bᵀ`` on the adapted tokens only (the others' low-rank activations zeroed
    before ``B``, so they get no gradient either)."""
    lora_a = params["lora_A"]
    h = (lowrank_input(x, base, info).to(lora_a.dtype) @ lora_a.T) * lora_scale(info, buffers)
    h = h * _token_mask(buffers[OFFSET], x).to(h.dtype)
    return base_plus_low_rank(base, x, h, params["lora_B"])


def _tokens(value: Any) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


VARIANT = lora.derived(
    "alora",
    lora.init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors=lora.TENSORS | {OFFSET: Slot(lambda i: (), buffer=True, integer=True, shared=True)},
    shared_init=shared_init,
    # (peft writes null when aLoRA is off: such a config is plain LoRA's, read as the default here)
    options=lora.OPTIONS | {"invocation_tokens": Option((), Check(_tokens, "must be token ids >= 0"), "alora_invocation_tokens", nullable(()))},
    # gated per token: not LoRA's product on every row
    low_rank=None,
)
PEFT = lora.stored_as_lora(reads=lora.plain_reads(alora_invocation_tokens=lambda tokens: tokens is not None))
