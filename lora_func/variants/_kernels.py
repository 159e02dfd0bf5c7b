"""The low-rank kernels the built-in variants share: LoRA's weight and activation forms, the
scale ``alpha / r``, the dropout input, the base-plus-low-rank sums and the base-dtype product
node, kaiming init from an explicit generator.

Not part of the variant contract (:mod:`lora_func.variants` holds that): a variant may use
them, and the mixed-batch route and ghost clipping run LoRA's forms through them too. Shapes: ``x (..., d_in)``,
``A (r, d_in)``, ``B (d_out, r)``, outputs ``(..., d_out)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants._contract import BaseLayer, LayerInfo, TensorDict, layer_alpha, layer_rank

__all__ = [
    "add_low_rank",
    "base_plus_low_rank",
    "base_plus_product",
    "half_product_applies",
    "kaiming_uniform",
    "lora_activation_form",
    "lora_embedding_form",
    "lora_scale",
    "lora_weight_form",
    "lowrank_input",
    "promoted",
]


def lowrank_input(x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """The low-rank path's input: ``x`` after the variant's ``dropout`` option (peft's
    ``lora_dropout``) in a training step, else ``x`` itself. Draws from the global RNG through
    ``F.dropout``, so under ``torch.func.vmap`` it follows ``randomness=``."""
    p = dict(info.options).get("dropout", 0.0)
    if not p or not getattr(base, "training", False):
        return x
    return F.dropout(x, float(p), training=True)


def kaiming_uniform(shape: tuple[int, ...], *, a: float, generator: torch.Generator) -> Tensor:
    """``nn.init.kaiming_uniform_`` (fan_in = ``shape[1]``) drawn in fp32 on the CPU.

    Drawing on the CPU from an explicit generator makes an init reproducible across devices.
    """
    out = torch.empty(shape, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(out, a=a, generator=generator)
    return out


def lora_scale(info: LayerInfo, buffers: TensorDict | None = None) -> float | Tensor:
    """``alpha / r`` or, with ``use_rslora``, ``alpha / sqrt(r)`` (Kalajdzievski 2023).

    A Python float for a single adapter (bit-identical to peft's), a 0-d tensor inside a
    rank-padded stack (see :func:`layer_rank`)."""
    r, alpha = layer_rank(info, buffers), layer_alpha(info, buffers)
    rslora = dict(info.options).get("use_rslora", False)
    if isinstance(r, Tensor):
        return alpha / (r.sqrt() if rslora else r)
    return alpha / (math.sqrt(r) if rslora else r)


def lora_weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    """LoRA's weight form, shared by every variant that ends up a plain LoRA (lora, eva):
    ``W_eff = W + s·B A`` with ``lora_A (r, d_in)``, ``lora_B (d_out, r)``; bias unchanged."""
    return weight + lora_scale(info, buffers) * (params["lora_B"] @ params["lora_A"]), bias


def _low_rank_right(b: Tensor) -> Tensor:
    """``bᵀ (r, d_out)`` as the right operand of the low-rank product: contiguous when ``b``
    is trained (its gradient product then runs in BLAS's fast layout, see
    :func:`add_low_rank`), a view when it is frozen (a buffer such as MiCA's or TinyLoRA's
    ``B``: no gradient product to serve, so the copy would only be kept for backward)."""
    bt = b.transpose(-1, -2)
    return bt.contiguous() if b.requires_grad else bt


def add_low_rank(y: Tensor, h: Tensor, b: Tensor) -> Tensor:
    """``y + h bᵀ``: the base output ``y (..., d_out)`` plus a low-rank path whose activations
    ``h (..., r)`` are already scaled, through ``b (d_out, r)``. Returns ``y``'s dtype.

    When ``h`` and ``y`` share a dtype this is one ``addmm``: no separate product, scale and
    sum over the ``(..., d_out)`` activations (each a full pass over memory, costlier than
    the rank-``r`` product itself on a CPU). A trained ``bᵀ`` is made contiguous (an ``(r, d_out)``
    copy, tiny) because autograd computes each matmul gradient in its operand's layout: then
    both backward products (``∂b = hᵀ g`` and ``∂h = g b``) have their long axis last, which
    BLAS runs faster than the ``(d_out, r)`` / ``(n, r)``-shaped outputs of ``h @ b.T``
    (docs/benchmarks.md, "Kernel choices"). Otherwise (a half-precision base with fp32
    adapters) the product is cast to ``y``'s dtype before the sum, as peft does.
    """
    bt = _low_rank_right(b)
    if y.dtype != h.dtype:
        return y + (h @ bt).to(y.dtype)
    out = torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), bt)
    return out.reshape(y.shape)


def _fresh_output_in_place() -> bool:
    """Whether a layer's fresh output may be updated in place: plain eager autograd, no
    ``torch.func`` transform active (under ``vmap`` the base output can be unbatched while the
    low-rank term is batched) and nothing tracing."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None


def base_plus_low_rank(base: Callable[[Tensor], Tensor], x: Tensor, h: Tensor, b: Tensor) -> Tensor:
    """``base(x) + h bᵀ``, as :func:`add_low_rank`, for a base output the caller uses nowhere
    else: ``x (..., d_in)``, ``h (..., r)`` already scaled, ``b (d_out, r)``.

    In plain eager autograd the product is accumulated in place into the base layer's output
    (``addmm_``), which is a new tensor that no backward formula needs (a linear layer's
    backward reads its input and weight, not its output): an out-of-place ``addmm`` would first
    copy the whole ``(n, d_out)`` output (docs/benchmarks.md, "Kernel choices"). Under a ``torch.func`` transform or a trace, and when ``h`` and ``b`` differ in dtype
    (under autocast ``h`` comes out in bf16/fp16 while ``b`` stays fp32, and an in-place
    ``addmm_`` is not autocast), it is :func:`add_low_rank`."""
    if h.dtype != b.dtype or not _fresh_output_in_place():
        return add_low_rank(base(x), h, b)
    y = base(x.reshape(-1, x.shape[-1]))
    if y.dtype != h.dtype:
        return add_low_rank(y, h.reshape(-1, h.shape[-1]), b).reshape(*x.shape[:-1], y.shape[-1])
    y.addmm_(h.reshape(-1, h.shape[-1]), _low_rank_right(b))
    return y.view(*x.shape[:-1], y.shape[-1])


# Base dtypes whose low-rank path runs in base-dtype products (:func:`base_plus_product`):
# bf16 has fp32's exponent range, so no adapter scale can overflow there (fp16's can: DeLoRA's
# per-rank scale is ~1e4 at init), and fp16 keeps the adapter-dtype path.
_HALF_PRODUCT_DTYPES = (torch.bfloat16,)


class _BasePlusProduct(torch.autograd.Function):
    """``base(x) + (x aᵀ) bᵀ`` on a half-precision base, one autograd node per target.

    ``x (..., d_in)`` and ``weight (d_out, d_in)`` in the base dtype, ``a (r, d_in)`` and
    ``b (d_out, r)`` in the adapter dtype (fp32); ``replay`` is the model's own op with the
    base weight and bias (``replay(x) == x weightᵀ + bias``). Every product that touches the
    ``(n, ·)`` activations runs on base-dtype operands, accumulating in fp32 inside the GEMM
    (``a``, ``b`` are cast to the base dtype, ``(r, d)``-sized copies); nothing ``(n, ·)``-sized is
    ever held in fp32. Saved for backward: ``x`` itself (the tensor the model passed, so the
    targets reading the same input keep one copy), the ``(n, r)`` activations ``h = x aᵀ`` in
    the base dtype, and the weight and adapter tensors (already held). Backward computes the
    input gradient once, through ``weight + b aᵀ`` (a ``(d_out, d_in)`` sum), instead of a base
    product plus a low-rank one plus their sum: one pass over the input gradient, as the base.
    Outputs: ``(y (..., d_out), h (n, r))``; ``h`` is not differentiable (exposed only so that
    ``setup_context`` can save it).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, replay: Callable[[Tensor], Tensor]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        y = replay(x)
        a_h, b_h = a.to(x.dtype), b.to(x.dtype)
        h = x.reshape(-1, x.shape[-1]) @ a_h.transpose(-1, -2)
        out = torch.addmm(y.reshape(-1, y.shape[-1]), h, b_h.transpose(-1, -2))
        return out.view(y.shape), h, a_h, b_h

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, weight, bias, a, b, _replay = inputs
        _out, h, a_h, b_h = output
        # The base-dtype factors are (r, d)-sized: keeping them costs less than casting again.
        ctx.save_for_backward(x, weight, a_h, b_h, h)
        ctx.has_bias = bias is not None
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.mark_non_differentiable(h, a_h, b_h)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for h, a_h, b_h

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None, *_unused: Any) -> tuple[Tensor | None, ...]:
        if grad_out is None:
            return None, None, None, None, None, None
        x, weight, a_h, b_h, h = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        needs = ctx.needs_input_grad
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if needs[0]:
            grad_x = (g @ torch.addmm(weight, b_h, a_h)).view(x.shape)
        if needs[1]:
            grad_w = g.transpose(-1, -2) @ x2
        if needs[2] and ctx.has_bias:
            grad_bias = g.sum(0)
        if needs[3]:
            grad_a = ((g @ b_h).transpose(-1, -2) @ x2).to(ctx.dtypes[0])
        if needs[4]:
            grad_b = (g.transpose(-1, -2) @ h).to(ctx.dtypes[1])
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None


_promote_types_memo = functools.lru_cache(maxsize=None)(torch.promote_types)


def promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types``, memoized in eager code: called per layer and per step, it would
    otherwise be one dispatched op each time (counted by bench/counts.py). A trace (which cannot
    follow the memo) runs it once anyway."""
    if torch.compiler.is_compiling():
        return torch.promote_types(a, b)
    return _promote_types_memo(a, b)


def half_product_applies(base: BaseLayer, x: Tensor, a: Tensor) -> bool:
    """Whether :func:`base_plus_product` takes its base-dtype path: ``base`` replays a plain
    layer (``replays_weight``) whose weight is a plain bf16 tensor, ``x`` has that dtype, the
    adapter dtype ``a.dtype`` is wider, and nothing traces or autocasts (a trace fuses the casts
    itself; autocast picks its own dtypes)."""
    if not getattr(base, "replays_weight", False):
        return False  # read no weight of any other base: a chain's merges it (lora_func._lazy._StepBase)
    weight = base.weight
    return (
        type(weight) in (Tensor, torch.nn.Parameter)
        and weight.dtype in _HALF_PRODUCT_DTYPES
        and x.dtype == weight.dtype
        and promoted(a.dtype, x.dtype) == a.dtype != x.dtype
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(x.device.type)
    )


def base_plus_product(base: BaseLayer, x: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``base(x) + (x aᵀ) bᵀ`` for ``x (..., d_in)``, ``a (r, d_in)``, ``b (d_out, r)`` (any scale
    already folded into ``a`` or ``b``, in the adapter dtype), in the base output dtype.

    On a bf16 base with wider adapters (:func:`half_product_applies`) one autograd node
    (:class:`_BasePlusProduct`) whose products run on bf16 operands with fp32 accumulation;
    otherwise the adapter-dtype path of :func:`base_plus_low_rank` (the input cast to ``a``'s
    dtype). docs/dtype.md says what is computed in which dtype."""
    if half_product_applies(base, x, a):
        return _BasePlusProduct.apply(x, base.weight, base.bias, a, b, base)[0]
    return base_plus_low_rank(base, x, x.to(a.dtype) @ a.transpose(-1, -2), b)


def lora_activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """LoRA's activation form: ``base(x) + s·(x Aᵀ) Bᵀ``, ``x (..., d_in) -> (..., d_out)``.

    The low-rank path runs in the adapter dtype and is cast back to the base output dtype
    before the sum (peft's dtype order). The scale is applied to the ``(..., r)`` activations
    rather than to the ``(..., d_out)`` product (peft's order): the same math, one pass over
    the outputs fewer (:func:`add_low_rank`)."""
    lora_a, lora_b = params["lora_A"], params["lora_B"]
    dropped = lowrank_input(x, base, info)
    if dropped is x and not torch.is_grad_enabled() and x.dtype == lora_a.dtype == lora_b.dtype and _fresh_output_in_place():
        # Inference: no gradient layouts to prepare (add_low_rank's contiguous bᵀ), and the
        # scale rides on the product inside the one addmm, as peft scales its product.
        scale = lora_scale(info, buffers)
        if not isinstance(scale, Tensor):
            rows = x.reshape(-1, x.shape[-1])
            y = base(rows)
            if y.dtype == x.dtype:
                return y.addmm_(rows @ lora_a.T, lora_b.T, alpha=scale).view(*x.shape[:-1], y.shape[-1])
            return add_low_rank(y, (rows @ lora_a.T) * scale, lora_b).view(*x.shape[:-1], y.shape[-1])
    if dropped is x and half_product_applies(base, x, lora_a):
        # The scale goes on the (d_out, r) factor: the base-dtype path folds it into its products.
        return base_plus_product(base, x, lora_a, lora_b * lora_scale(info, buffers))
    h = (dropped.to(lora_a.dtype) @ lora_a.T) * lora_scale(info, buffers)
    return base_plus_low_rank(base, x, h, lora_b)


def lora_embedding_form(params: TensorDict, buffers: TensorDict, ids: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """LoRA's form on an ``nn.Embedding`` (a gather, no ``(V, d)`` merged table): ``ids (...) ->
    base(ids) + s·A[:, ids]ᵀ Bᵀ (..., d)``, with ``lora_A (r, V)``, ``lora_B (d, r)``. The rows of
    ``A`` are looked up with the layer's own lookup (``base.replay``: its padding index keeps that
    row's gradient zero, as peft's lora.Embedding); the ``(..., r)`` rows are scaled and go
    through ``B`` in the adapter dtype, cast back to the base output's (no dropout: peft applies
    none to embeddings)."""
    lora_a, lora_b = params["lora_A"], params["lora_B"]
    replay = cast(Any, base).replay  # an embedding's BaseLayer (lora_func._steps.LayerCall) has one
    h = replay(ids, lora_a.transpose(0, 1)) * lora_scale(info, buffers)
    return add_low_rank(base(ids), h, lora_b)
