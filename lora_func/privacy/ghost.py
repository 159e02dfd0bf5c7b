"""Ghost clipping with book-keeping: DP-SGD's clipped sum for LoRA-form layers from their
inputs and output gradients, without per-example copies of the adapter.

For a layer ``y = base(x) + s · (x Aᵀ) Bᵀ`` with input ``x (B, T, d_in)`` and output gradient
``g = ∂L/∂y (B, T, d_out)`` (one row per example), ``h = s · x Aᵀ`` and ``u = s · g B``
``(B, T, r)``, example ``b``'s gradients are ``∇B_b = g_bᵀ h_b`` and ``∇A_b = u_bᵀ x_b``, so

- their squared norms are ``Σ_{t,t'} (g_t·g_t')(h_t·h_t')`` and ``Σ_{t,t'} (u_t·u_t')(x_t·x_t')``
  (ghost norms, Li et al. 2022: two ``(B, T, T)`` Gram products), or the norms of the
  materialised ``(B, r, d)`` gradients where those hold less (see below);
- the clipped sum is ``Σ_b c_b ∇B_b = gᵀ (c ⊙ h)`` and ``Σ_b c_b ∇A_b = (c ⊙ u)ᵀ x`` over all
  ``B · T`` rows (book-keeping, Bu et al. 2023: the stored ``x`` and ``g``, one backward).

Recording: the forward runs under ``vmap`` over the examples as in
:func:`lora_func.per_example_grads`; the adapter's low-rank tensors are shared (not copied per
example) and an activation tap (:func:`lora_func._layer_ops.activation_tap`, installed for this call
only) passes each LoRA-form layer's output through :class:`_Tap`, an identity whose ``vmap``
rule sees the batched tensors: it keeps ``x`` (a view of the activation, no copy), and in the
one backward the layer's output gradient arrives per example. A layer whose per-example
gradients hold less than ``g`` and the Gram products (``T · (d_out + T) >= r · (d_in + d_out)``,
most layers beyond a few dozen tokens) turns them into its ``(B, r, d)`` gradients right then and
drops ``x`` and ``g``; the others keep ``g`` for the Gram norms and the book-keeping sum.
Every other tensor of the adapter (another variant's, a LoRA layer with dropout) keeps
a per-example copy in the same forward and backward, and its per-example gradient joins the
norm: the results equal the per-example path (tested).

Which tensors get ghost norms: ``lora_A``/``lora_B`` of every layer whose variant's activation
form is a frozen part plus LoRA's product (``lora`` with or without rsLoRA, ``eva``: LoRA with a
data-driven init, ``pissa``: a frozen residual instead of ``W``) and whose ``dropout`` is 0, alone or inside a composition or combination (the tap sees the layer's
own input and output there too); not in a stack. Everything else takes the per-example path in
the same pass: DoRA's tensors (its norm term makes the gradient no outer product of ``x`` and
``g``), every other variant, a combination's own weights, LoRA with dropout; and stacks and ``chunk_size`` run per example
altogether.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from lora_func._kernels import lora_activation_form, lora_scale
from lora_func._layer_ops import VariantOp, activation_tap
from lora_func._tree import leaves
from lora_func._vmapped import split_examples, vmapped
from lora_func.adapter import AdapterLike
from lora_func.variants import pissa
from lora_func.many import Randomness

# Activation forms that are "a frozen part + s · (x Aᵀ) Bᵀ" in lora_A/lora_B: LoRA's, and
# PiSSA's (its frozen part is the residual W_res instead of W). Their gradients are the same.
LORA_FORMS = frozenset({lora_activation_form, pissa.activation_form})

__all__ = ["Clipping", "GhostPass", "ghost_layers", "ghost_pass"]

Clipping = Literal["auto", "ghost", "per_example"]


def ghost_layers(adapter: AdapterLike) -> dict[str, tuple[str, str]]:
    """The layers of ``adapter`` whose low-rank tensors get ghost norms: a key prefix per layer
    -> its ``(lora_A key, lora_B key)`` in ``adapter.params`` (empty for a stack)."""
    if adapter.stack_shape:
        return {}
    out = {}
    for prefix, leaf in leaves(adapter):
        if leaf.members is not None or leaf.variant.activation_form not in LORA_FORMS:
            continue
        for layer in leaf.layers:
            names = {name for name, _ in layer.param_shapes}
            if names == {"lora_A", "lora_B"} and not dict(layer.info.options).get("dropout", 0.0):
                module = prefix + layer.target.module
                out[module] = (f"{module}.lora_A", f"{module}.lora_B")
    return out


class _Layer:
    """One LoRA-form layer during a ghost pass: its calls' inputs (batch first), and either
    its accumulated per-example gradients (``gram=False``: computed in the backward as each
    output gradient arrives, then ``x`` and ``g`` are dropped) or the output gradients kept for
    the Gram norms and the book-keeping sum after the backward (``gram=True``)."""

    def __init__(self, a: Tensor, b: Tensor, scale: float, clipping: Clipping) -> None:
        self.dtype = torch.promote_types(a.dtype, torch.float32)
        # The scale on the factors once, not on every call's (B, T, r) products.
        self.a, self.b, self.clipping = a.to(self.dtype) * scale, b.to(self.dtype) * scale, clipping
        self.inputs: list[Tensor | None] = []
        self.grads: dict[int, Tensor] = {}  # by call index (the backward meets the calls in reverse)
        self.gram: bool | None = None
        self.grad_a: Tensor | None = None
        self.grad_b: Tensor | None = None

    def record(self, x: Tensor) -> int:
        if self.gram is None:
            # Which holds less: g (B, T, d_out) and the (B, T, T) Gram products, or the (B, r, d) gradients.
            tokens, (r, d_in), d_out = x[0].numel() // x.shape[-1], self.a.shape, self.b.shape[0]
            self.gram = self.clipping == "ghost" or tokens * (d_out + tokens) < r * (d_in + d_out)
        self.inputs.append(x)
        return len(self.inputs) - 1

    def backward(self, index: int, g: Tensor) -> None:
        x = self.inputs[index]
        assert x is not None
        x, g = _rows(x, self.dtype), _rows(g, self.dtype)
        if self.gram:
            self.grads[index] = g
            return
        self.inputs[index] = None  # this call is done: keep its (B, r, d) gradients only
        h, u = self._lowrank(x, g)
        grad_a, grad_b = u.mT @ x, g.mT @ h
        self.grad_a = grad_a if self.grad_a is None else self.grad_a + grad_a
        self.grad_b = grad_b if self.grad_b is None else self.grad_b + grad_b

    def _lowrank(self, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        return x @ self.a.T, g @ self.b  # h = s·x Aᵀ, u = s·g B: (B, T, r) (self.a, self.b carry s)

    def finish(self, batch_size: int) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, Tensor]]]:
        """Per-example squared norms and the clipped-sum function ``c (B,) -> (ΣcA, ΣcB)``."""
        if not self.gram:
            grad_a = self.grad_a if self.grad_a is not None else self.a.new_zeros(batch_size, *self.a.shape)
            grad_b = self.grad_b if self.grad_b is not None else self.b.new_zeros(batch_size, *self.b.shape)
            squares = grad_a.pow(2).sum((1, 2)) + grad_b.pow(2).sum((1, 2))
            return squares, lambda c: (torch.einsum("b,bri->ri", c, grad_a), torch.einsum("b,bor->or", c, grad_b))
        # Several calls of one layer: their rows side by side (the gradient sums over all of them).
        xs = [_rows(t, self.dtype) for t in self.inputs if t is not None]
        # A call whose output did not reach the loss has g = 0.
        gs = [self.grads[i] if i in self.grads else x.new_zeros(*x.shape[:2], self.b.shape[0]) for i, x in enumerate(xs)]
        x, g = torch.cat(xs, 1), torch.cat(gs, 1)
        h, u = self._lowrank(x, g)
        squares = ((g @ g.mT) * (h @ h.mT)).sum((1, 2)) + ((u @ u.mT) * (x @ x.mT)).sum((1, 2))

        def sums(c: Tensor) -> tuple[Tensor, Tensor]:
            c = c[:, None, None]
            return (u * c).flatten(0, 1).T @ x.flatten(0, 1), g.flatten(0, 1).T @ (h * c).flatten(0, 1)

        return squares, sums


def _rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``(B, ..., d) -> (B, T, d)`` in ``dtype``."""
    return t.reshape(t.shape[0], -1, t.shape[-1]).to(dtype)


class _Recorder:
    """The activation tap of one ghost pass: routes each LoRA-form layer's output through
    :class:`_Tap` and collects what the layer needs."""

    def __init__(self, by_tensor: dict[int, str], shared: dict[str, Tensor], keys: dict[str, tuple[str, str]],
                 clipping: Clipping, anchor: Tensor) -> None:
        self.by_tensor, self.shared, self.keys, self.clipping, self.anchor = by_tensor, shared, keys, clipping, anchor
        self.layers: dict[str, _Layer] = {}
        self.device_type = anchor.device.type

    def __call__(self, step: VariantOp, x: Tensor, y: Tensor) -> Tensor:
        a = step.params.get("lora_A")
        name = None if a is None else self.by_tensor.get(id(a))
        if name is None or not torch.is_grad_enabled():
            return y
        scale = lora_scale(step.info, step.buffers)
        if isinstance(scale, Tensor):  # only inside a stack; stacks take the per-example path
            return y
        if name not in self.layers:
            key_a, key_b = self.keys[name]
            self.layers[name] = _Layer(self.shared[key_a], self.shared[key_b], scale, self.clipping)
        out: Tensor = _Tap.apply(x, y, self, name)
        return out


def _batch_first(t: Tensor, dim: int | None, size: int) -> Tensor:
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


class _Tap(torch.autograd.Function):
    """``y`` unchanged. Its ``vmap`` rule gets the batched tensors themselves: it records ``x``
    (batch first) and puts ``y`` through :class:`_Grad`, whose backward hands the layer its
    per-example output gradient. Outside ``vmap`` nothing is recorded (the caller checks)."""

    @staticmethod
    def forward(x: Tensor, y: Tensor, recorder: _Recorder, name: str) -> Tensor:
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        return None, grad, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, y: Tensor, recorder: _Recorder, name: str) -> tuple[Tensor, int]:
        index = recorder.layers[name].record(_batch_first(x, in_dims[0], info.batch_size).detach())
        # y keeps its layout (where vmap put the batch): moving it would make later views copy.
        dim = in_dims[1]
        if dim is None:
            y, dim = y.expand(info.batch_size, *y.shape), 0
        return _Grad.apply(y, recorder.anchor, recorder, name, index, dim), dim


class _Grad(torch.autograd.Function):
    """Identity on ``y`` (batch on dim ``dim``) whose backward gives the layer its output
    gradient, batch first. It also takes the pass's 0-d ``anchor`` (which requires grad), so
    that the one backward, asked for the anchor's gradient, reaches every tapped layer even
    where nothing before it needs a gradient (the shared low-rank tensors do not)."""

    @staticmethod
    def forward(y: Tensor, anchor: Tensor, recorder: _Recorder, name: str, index: int, dim: int) -> Tensor:
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.recorder, ctx.name, ctx.index, ctx.dim = inputs[2:]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:
        with torch.no_grad(), torch.autocast(ctx.recorder.device_type, enabled=False):
            ctx.recorder.layers[ctx.name].backward(ctx.index, grad.detach().movedim(ctx.dim, 0))
        return grad, None, None, None, None, None


class GhostPass:
    """One recorded forward and backward: per example the squared gradient norm over all
    tensors and, given clip factors, the clipped sums per tensor key."""

    def __init__(self, losses: Tensor, squares: Tensor, sums: Callable[[Tensor], dict[str, Tensor]]) -> None:
        self.losses, self.squares, self._sums = losses, squares, sums

    def clipped_sums(self, factor: Tensor) -> dict[str, Tensor]:
        return self._sums(factor)


def ghost_pass(
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    batch: tuple,
    batch_size: int,
    layers: dict[str, tuple[str, str]],
    *,
    clipping: Clipping,
    randomness: Randomness,
) -> GhostPass | None:
    """The recorded forward and backward of ``loss_fn`` on ``batch`` (see the module
    docstring); ``None`` when a layer of ``layers`` was not seen by the tap (its tensors
    reached the model another way, a merged overlay) or the loss is not one scalar per
    example: the caller then takes the per-example path (which names a bad loss). ``clipping="ghost"`` takes Gram norms for every layer, ``"auto"`` where they hold less."""
    params = adapter.params
    ghost_keys = {key for pair in layers.values() for key in pair}
    shared = {key: params[key].detach() for key in ghost_keys}
    copies = {
        key: value.detach().unsqueeze(0).expand(batch_size, *value.shape).requires_grad_(True)
        for key, value in params.items()
        if key not in ghost_keys
    }
    first = next(iter(params.values()))
    anchor = torch.zeros((), dtype=first.dtype, device=first.device, requires_grad=True)
    recorder = _Recorder({id(shared[a]): module for module, (a, _) in layers.items()}, shared, layers, clipping, anchor)
    examples, rebuild = split_examples(batch, {}, batch_size)

    def loss(own: dict[str, Tensor], *example: Tensor) -> Any:
        example_batch, _ = rebuild(example)
        return loss_fn(adapter.with_params({**shared, **own}), *example_batch)

    with torch.enable_grad(), activation_tap(recorder):
        losses = vmapped(loss, "private_grads", randomness=randomness)(copies, *examples)
    if set(recorder.layers) != set(layers) or not isinstance(losses, Tensor) or tuple(losses.shape) != (batch_size,):
        return None  # (a loss that is not one scalar per example: the per-example path says so)
    with torch.enable_grad():
        grads = torch.autograd.grad(losses.sum(), [anchor, *copies.values()], allow_unused=True)
    copy_grads = {key: torch.zeros_like(copies[key]) if g is None else g for key, g in zip(copies, grads[1:], strict=True)}
    with torch.no_grad(), torch.autocast(first.device.type, enabled=False):
        finished = {module: layer.finish(batch_size) for module, layer in recorder.layers.items()}
        squares = [g.flatten(1).float().pow(2).sum(-1) for g in copy_grads.values()]
        squares += [s.float() for s, _ in finished.values()]
        total = torch.stack(squares).sum(0)

    def sums(factor: Tensor) -> dict[str, Tensor]:
        out = {}
        with torch.no_grad(), torch.autocast(first.device.type, enabled=False):
            for key, g in copy_grads.items():
                out[key] = torch.einsum("b,b...->...", factor.to(g.dtype), g)
            for module, (_, layer_sums) in finished.items():
                key_a, key_b = layers[module]
                grad_a, grad_b = layer_sums(factor.to(recorder.layers[module].dtype))
                out[key_a], out[key_b] = grad_a.to(params[key_a].dtype), grad_b.to(params[key_b].dtype)
        return {key: out[key] for key in params}

    return GhostPass(losses.detach(), total, sums)
