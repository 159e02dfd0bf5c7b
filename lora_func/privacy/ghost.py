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
only) passes each LoRA-form layer's output through :class:`lora_func._layer_ops.TapInput`, an identity whose ``vmap``
rule sees the batched tensors: it keeps ``x`` (a view of the activation, no copy), and in the
one backward the layer's output gradient arrives per example. A layer whose per-example
gradients hold less than ``g`` and the Gram products (``T · (d_out + T) >= r · (d_in + d_out)``,
most layers beyond a few dozen tokens) turns them into its ``(B, r, d)`` gradients right then and
drops ``x`` and ``g``; the others keep ``g`` for the Gram norms and the book-keeping sum.
Every other tensor of the adapter (another variant's, a LoRA layer with dropout) keeps
a per-example copy in the same forward and backward, and its per-example gradient joins the
norm: the results equal the per-example path (tested).

A batched loss (:func:`lora_func.privacy.batched_loss`, ``(B,)`` from one call) runs without
``vmap`` (:func:`batched_pass`): the same tap records each ghost layer's input (batch on dim 0)
and puts its output through :class:`lora_func._layer_ops.TapOutputGrad`; every other adapted layer's call is recorded too
(:class:`_FormCall`: its step, base layer, input and, in the backward, output gradient), and
its per-example gradients come from its own form, ``vmap`` over the examples of that one
layer's ``vjp``. The tap also sees every weight form: an adapter tensor that reaches the model
through a merged weight (which neither recording would see) sends the call to the ``vmap`` path.

Which tensors get ghost norms: ``lora_A``/``lora_B`` of every layer whose variant's activation
form is a frozen part plus LoRA's product (the variant's ``LowRank`` declaration: ``lora`` with or
without rsLoRA, the LoRA inits, ``pissa`` and the other residual inits: a frozen residual instead
of ``W``) and whose ``dropout`` is 0, alone or inside a composition or combination (the tap sees the layer's
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

from lora_func._layer_ops import TapInput, TapOutputGrad, VariantOp, activation_tap
from lora_func._tree import leaves
from lora_func._vmapped import split_examples, vmapped
from lora_func.adapter import Adapter, AdapterLike
from lora_func.many import Randomness
from lora_func.variants import BaseLayer

__all__ = ["Clipping", "GhostPass", "batched_pass", "check_batched_losses", "ghost_layers", "ghost_pass", "kept_rows"]

Clipping = Literal["auto", "ghost", "per_example"]


def ghost_layers(adapter: AdapterLike) -> dict[str, tuple[str, str]]:
    """The layers of ``adapter`` whose low-rank tensors get ghost norms: a key prefix per layer
    -> its ``(lora_A key, lora_B key)`` in ``adapter.params`` (empty for a stack)."""
    if adapter.stack_shape:
        return {}
    out = {}
    for prefix, leaf in leaves(adapter):
        # A variant that declares its form "a frozen part + s · (x Aᵀ) Bᵀ" (Variant.low_rank;
        # the frozen part is W, or a residual replacing it): its gradients are LoRA's. (A prompt
        # leaf is no weight-level Adapter: none.)
        form = leaf.variant.low_rank if isinstance(leaf, Adapter) else None
        if leaf.members is not None or form is None:
            continue
        for layer in leaf.layers:
            names = {name for name, _ in layer.param_shapes}
            # Linear and Conv1D layers only (an embedding's LoRA gathers rows: another form).
            linear = layer.target.layout in ("linear", "conv1d")
            if names == {form.a, form.b} and linear and not dict(layer.info.options).get("dropout", 0.0):
                module = prefix + layer.target.module
                out[module] = (f"{module}.{form.a}", f"{module}.{form.b}")
    return out


class _Layer:
    """One LoRA-form layer during a ghost pass: its calls' inputs (batch first), and either
    its accumulated per-example gradients (``gram=False``: computed in the backward as each
    output gradient arrives, then ``x`` and ``g`` are dropped) or the output gradients kept for
    the Gram norms and the book-keeping sum after the backward (``gram=True``)."""

    def __init__(self, a: Tensor, b: Tensor, scale: float, clipping: Clipping) -> None:
        self.dtype = torch.promote_types(a.dtype, torch.float32)
        self.a, self.b, self.scale, self.clipping = a, b, scale, clipping
        self._scaled: tuple[Tensor, Tensor] | None = None
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
        if self._scaled is None:
            # The scale on the factors once, not on every call's (B, T, r) products; made in the
            # backward, not held through the forward's peak.
            self._scaled = self.a.to(self.dtype) * self.scale, self.b.to(self.dtype) * self.scale
        a, b = self._scaled
        return x @ a.T, g @ b  # h = s·x Aᵀ, u = s·g B: (B, T, r)

    def finish(self, batch_size: int) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, Tensor]]]:
        """Per-example squared norms and the clipped-sum function ``c (B,) -> (ΣcA, ΣcB)``."""
        if not self.gram:
            grad_a = self.grad_a if self.grad_a is not None else self.a.new_zeros(batch_size, *self.a.shape, dtype=self.dtype)
            grad_b = self.grad_b if self.grad_b is not None else self.b.new_zeros(batch_size, *self.b.shape, dtype=self.dtype)
            squares = grad_a.pow(2).sum((1, 2)) + grad_b.pow(2).sum((1, 2))
            return squares, lambda c: (torch.einsum("b,bri->ri", c, kept_rows(grad_a, c)), torch.einsum("b,bor->or", c, kept_rows(grad_b, c)))
        # Several calls of one layer: their rows side by side (the gradient sums over all of them).
        xs = [_rows(t, self.dtype) for t in self.inputs if t is not None]
        # A call whose output did not reach the loss has g = 0.
        gs = [self.grads[i] if i in self.grads else x.new_zeros(*x.shape[:2], self.b.shape[0]) for i, x in enumerate(xs)]
        x, g = torch.cat(xs, 1), torch.cat(gs, 1)
        h, u = self._lowrank(x, g)
        squares = ((g @ g.mT) * (h @ h.mT)).sum((1, 2)) + ((u @ u.mT) * (x @ x.mT)).sum((1, 2))

        def sums(c: Tensor) -> tuple[Tensor, Tensor]:
            u_, x_, g_, h_ = (kept_rows(t, c) for t in (u, x, g, h))
            c = c[:, None, None]
            return (u_ * c).flatten(0, 1).T @ x_.flatten(0, 1), g_.flatten(0, 1).T @ (h_ * c).flatten(0, 1)

        return squares, sums


def kept_rows(t: Tensor, factor: Tensor) -> Tensor:
    """``t (B, ...)`` with the rows of examples whose clip factor is 0 set to 0: a skipped example
    (a NaN or inf loss or gradient, :func:`lora_func.privacy.clipped_sum`) contributes nothing,
    where ``0 · NaN`` would be NaN. ``t`` itself (no copy) when no example is skipped."""
    skipped = factor == 0
    if not bool(skipped.any()):
        return t
    return torch.where(skipped.reshape(-1, *([1] * (t.dim() - 1))), torch.zeros((), dtype=t.dtype, device=t.device), t)


def _rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``(B, ..., d) -> (B, T, d)`` in ``dtype``."""
    return t.reshape(t.shape[0], -1, t.shape[-1]).to(dtype)


class _FormCall:
    """One call of an adapted layer without a ghost form, in a batched pass: its step, base
    layer and input ``x (B, ...)``, and (after the backward) its output gradient; then the
    per-example gradients of its tracked tensors from the variant's own form, by
    ``vmap`` over the examples of ``vjp`` (the layer's forward and backward once more, exact)."""

    def __init__(self, step: VariantOp, base: BaseLayer, x: Tensor, names: dict[str, str], *, flat: bool) -> None:
        # flat: the layer saw the examples' rows stacked, (B·T, d) (GPT-2's Conv1D), x is its (B, T, d) view
        self.step, self.base, self.x, self.names, self.flat = step, base, x, names, flat
        self.device_type = x.device.type
        self.autocast = torch.is_autocast_enabled(self.device_type), torch.get_autocast_dtype(self.device_type)
        self.grad: Tensor | None = None

    def backward(self, index: int, g: Tensor) -> None:
        self.grad = g

    def per_example(self) -> dict[str, Tensor]:
        """Adapter key -> ``(B, *shape)`` gradients of this call (empty if its output did not reach the loss)."""
        if self.grad is None:
            return {}
        step, base, names = self.step, self.base, self.names
        own = {name: step.params[name] for name in names}

        def one(x: Tensor, g: Tensor) -> dict[str, Tensor]:
            # One example as the layer saw the batch: its rows (flat), or a batch of one.
            x = x if self.flat else x.unsqueeze(0)

            def form(p: dict[str, Tensor]) -> Tensor:
                return step.form({**step.params, **p}, step.buffers, x, base, step.info)

            vjp = torch.func.vjp(form, own)
            out, pull = vjp[0], vjp[1]
            grads: dict[str, Tensor] = pull(g.reshape(out.shape).to(out.dtype))[0]
            return grads

        enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled):
            grads = torch.func.vmap(one)(self.x, self.grad)
        return {names[name]: g.to(own[name].dtype) for name, g in grads.items()}


class _Recorder:
    """The activation tap of one pass (:class:`lora_func._layer_ops.ActivationTap`).

    Under ``vmap`` (``batch_size=None``) it routes each ghost layer's output through
    :class:`~lora_func._layer_ops.TapInput`; in a batched pass (``batch_size=B``) it records each ghost layer's input
    and each other adapted layer's call (:class:`_FormCall`) and puts the output through
    :class:`~lora_func._layer_ops.TapOutputGrad`. ``tracked``: ``id`` of each adapter tensor the pass must see -> its key;
    ``invalid`` says why the pass cannot be used (a tracked tensor reached the model through
    a weight form, a ghost layer ran another form, a batch not on dim 0)."""

    def __init__(self, tracked: dict[int, str], ghost: dict[str, str], shared: dict[str, Tensor],
                 keys: dict[str, tuple[str, str]], clipping: Clipping, anchor: Tensor, batch_size: int | None) -> None:
        self.tracked, self.ghost, self.shared, self.keys, self.clipping, self.anchor = tracked, ghost, shared, keys, clipping, anchor
        self.batch_size = batch_size
        self.layers: dict[str, _Layer | _FormCall] = {}
        self.seen: set[str] = set()
        self.invalid: str | None = None
        self.device_type = anchor.device.type

    def record_input(self, name: str, x: Tensor) -> int:
        layer = self.layers[name]
        assert isinstance(layer, _Layer)
        return layer.record(x)

    def output_grad(self, name: str, index: int, grad: Tensor) -> None:
        with torch.autocast(self.device_type, enabled=False):
            if self.batch_size is not None:  # a batched pass: (B, T, d_out) rows, as the input's
                grad = grad.reshape(self.batch_size, -1, grad.shape[-1])
            self.layers[name].backward(index, grad)

    def weight(self, step: VariantOp) -> None:
        hit = sorted(self.tracked[id(t)] for t in step.params.values() if id(t) in self.tracked)
        if hit:
            self.invalid = f"{hit[0]} reaches the model through a merged weight"

    def activation(self, step: VariantOp, x: Tensor, base: BaseLayer, y: Tensor) -> Tensor:
        names = {name: self.tracked[id(t)] for name, t in step.params.items() if id(t) in self.tracked}
        if not names or not torch.is_grad_enabled():
            return y
        self.seen.update(names.values())
        given = x
        if self.batch_size is not None:
            rows = _example_rows(x, self.batch_size)
            if rows is None:
                self.invalid = f"the input {tuple(x.shape)} of {sorted(names.values())[0]} has no batch of {self.batch_size} on dim 0"
                return y
            x = rows
        form = step.variant.low_rank
        module = self.ghost.get(names.get(form.a, "")) if form is not None else None
        if module is None:
            if self.batch_size is None or any(key in self.ghost for key in names.values()):
                self.invalid = f"{sorted(names.values())} mix a ghost layer's tensors into another form"
                return y
            name = f"call {len(self.layers)}"
            self.layers[name] = _FormCall(step, base, x.detach(), names, flat=x is not given)
            return TapOutputGrad.apply(y, self.anchor, self, name, 0, 0)
        assert form is not None  # a ghost layer's variant declares it
        scale = form.scale(step.info, step.buffers)
        if step.form is not step.variant.activation_form or set(names) != {form.a, form.b} or isinstance(scale, Tensor):
            self.invalid = f"ghost layer {module} ran another form"
            return y
        layer = self.layers.get(module)
        if not isinstance(layer, _Layer):
            key_a, key_b = self.keys[module]
            layer = self.layers[module] = _Layer(self.shared[key_a], self.shared[key_b], scale, self.clipping)
        if self.batch_size is None:
            out: Tensor = TapInput.apply(x, y, self.anchor, self, module)
            return out
        index = layer.record(x.detach())
        return TapOutputGrad.apply(y, self.anchor, self, module, index, 0)


def _example_rows(x: Tensor, batch_size: int) -> Tensor | None:
    """``x`` with the batch on dim 0: ``x`` itself, or the ``(B, T, d)`` view of a layer input
    that holds the examples' rows stacked (``(B·T, d)``, a flattening view of a contiguous
    tensor whose dim 0 is the batch, as GPT-2's Conv1D makes); ``None`` when neither."""
    if x.dim() >= 2 and x.shape[0] == batch_size:
        return x
    root = x._base
    if (x.dim() == 2 and root is not None and root.dim() >= 2 and root.shape[0] == batch_size and root.is_contiguous()
            and x.is_contiguous() and x.data_ptr() == root.data_ptr() and x.numel() == root.numel()):
        return x.view(batch_size, -1, x.shape[-1])
    return None


class GhostPass:
    """One recorded forward and backward: per example the squared gradient norm over all
    tensors and, given clip factors, the clipped sums per tensor key."""

    def __init__(self, losses: Tensor, squares: Tensor, sums: Callable[[Tensor], dict[str, Tensor]]) -> None:
        self.losses, self.squares, self._sums = losses, squares, sums

    def clipped_sums(self, factor: Tensor) -> dict[str, Tensor]:
        return self._sums(factor)


def _tracking(adapter: AdapterLike, layers: dict[str, tuple[str, str]], keys: Any) -> tuple[dict[str, Tensor], dict[int, str], dict[str, str]]:
    """The detached ``keys`` of ``adapter.params``, ``id`` -> key of each, and ghost key -> its layer."""
    params = adapter.params
    detached = {key: params[key].detach() for key in keys}
    ghost = {key: module for module, pair in layers.items() for key in pair}
    return detached, {id(t): key for key, t in detached.items()}, ghost


def _anchor(adapter: AdapterLike) -> Tensor:
    first = next(iter(adapter.params.values()))
    return torch.zeros((), dtype=first.dtype, device=first.device, requires_grad=True)


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
    """The recorded forward and backward of ``loss_fn`` on ``batch`` under ``vmap`` (see the
    module docstring); ``None`` when a layer of ``layers`` was not seen by the tap or its
    tensors also reached the model another way (a merged overlay, a weight form read by a
    later part of a composition), or the loss is not one scalar per example: the caller then
    takes the per-example path (which names a bad loss). ``clipping="ghost"`` takes Gram norms
    for every layer, ``"auto"`` where they hold less."""
    params = adapter.params
    shared, tracked, ghost = _tracking(adapter, layers, [key for pair in layers.values() for key in pair])
    copies = {
        key: value.detach().unsqueeze(0).expand(batch_size, *value.shape).requires_grad_(True)
        for key, value in params.items()
        if key not in shared
    }
    anchor = _anchor(adapter)
    recorder = _Recorder(tracked, ghost, shared, layers, clipping, anchor, None)
    examples, rebuild = split_examples(batch, {}, batch_size)

    def loss(own: dict[str, Tensor], *example: Tensor) -> Any:
        example_batch, _ = rebuild(example)
        return loss_fn(adapter.with_params({**shared, **own}), *example_batch)

    with torch.enable_grad(), activation_tap(recorder):
        losses = vmapped(loss, "private_grads", randomness=randomness)(copies, *examples)
    if (recorder.invalid is not None or set(recorder.layers) != set(layers) or not isinstance(losses, Tensor)
            or tuple(losses.shape) != (batch_size,)):
        return None  # (a loss that is not one scalar per example: the per-example path says so)
    with torch.enable_grad():
        grads = torch.autograd.grad(losses.sum(), [anchor, *copies.values()], allow_unused=True)
    per_example = {key: torch.zeros_like(copies[key]) if g is None else g for key, g in zip(copies, grads[1:], strict=True)}
    return _assemble(losses, per_example, recorder, adapter, batch_size)


def batched_pass(
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    batch: tuple,
    batch_size: int,
    layers: dict[str, tuple[str, str]],
    *,
    clipping: Clipping,
) -> GhostPass | None:
    """The recorded forward and backward of a batched loss (``loss_fn(adapter, *batch) -> (B,)``,
    :func:`lora_func.privacy.batched_loss`) without ``vmap``: one ordinary batched call, every
    adapter tensor detached; ghost layers (``layers``) as under ``vmap``, every other adapted
    layer's call recorded (:class:`_FormCall`) and its per-example gradients taken from its own
    form after the one backward. ``None`` (nothing computed but the forward) when some adapter
    tensor was not seen in a layer's activation, or reached the model through a weight form, or
    a layer's input has no batch on dim 0: the caller then runs the ``vmap`` path. Raises when
    the loss is not of shape ``(B,)``."""
    params = adapter.params
    detached, tracked, ghost = _tracking(adapter, layers, params)
    anchor = _anchor(adapter)
    recorder = _Recorder(tracked, ghost, detached, layers, clipping, anchor, batch_size)
    with torch.enable_grad(), activation_tap(recorder):
        losses = loss_fn(adapter.with_params(detached), *batch)
    check_batched_losses(losses, batch_size)
    if recorder.invalid is not None or recorder.seen != set(params) or not set(layers) <= set(recorder.layers):
        return None
    if losses.requires_grad:
        with torch.enable_grad():
            torch.autograd.grad(losses.sum(), [anchor], allow_unused=True)
    per_example: dict[str, Tensor] = {}
    for layer in recorder.layers.values():
        if isinstance(layer, _FormCall):
            for key, g in layer.per_example().items():
                per_example[key] = g if key not in per_example else per_example[key] + g
    for key in set(params) - set(ghost) - set(per_example):  # seen, but no output reached the loss
        per_example[key] = params[key].detach().new_zeros(batch_size, *params[key].shape)
    return _assemble(losses, per_example, recorder, adapter, batch_size)


def check_batched_losses(losses: Any, batch_size: int) -> Tensor:
    """``losses`` if it is a tensor of shape ``(batch_size,)`` (a batched loss's result)."""
    if not isinstance(losses, Tensor) or tuple(losses.shape) != (batch_size,):
        got = f"a tensor of shape {tuple(losses.shape)}" if isinstance(losses, Tensor) else f"a {type(losses).__name__}"
        raise ValueError(  # error: privacy-batched-loss-shape
            f"batched_loss: loss_fn returned {got} for a batch of {batch_size} example{'s' * (batch_size != 1)}; a batched loss returns one loss per "
            f"example, shape ({batch_size},): reduce over each example's tokens only, not over the batch (e.g. "
            f"cross_entropy(..., reduction='none').view({batch_size}, -1).mean(1)); a loss of one example at a time goes to "
            f"private_grads without batched_loss"
        )
    return losses


def _assemble(losses: Tensor, per_example: dict[str, Tensor], recorder: _Recorder, adapter: AdapterLike, batch_size: int) -> GhostPass:
    """The pass's per-example squared norms and clipped-sum function, from the ``(B, *shape)``
    per-example gradients of some keys and the ghost layers of ``recorder``."""
    params, device_type = adapter.params, recorder.device_type
    ghost_layers = {module: layer for module, layer in recorder.layers.items() if isinstance(layer, _Layer)}
    with torch.no_grad(), torch.autocast(device_type, enabled=False):
        finished = {module: layer.finish(batch_size) for module, layer in ghost_layers.items()}
        squares = [g.flatten(1).float().pow(2).sum(-1) for g in per_example.values()]
        squares += [s.float() for s, _ in finished.values()]
        total = torch.stack(squares).sum(0)

    def sums(factor: Tensor) -> dict[str, Tensor]:
        out = {}
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            for key, g in per_example.items():
                out[key] = torch.einsum("b,b...->...", factor.to(g.dtype), kept_rows(g, factor))
            for module, (_, layer_sums) in finished.items():
                key_a, key_b = recorder.keys[module]
                grad_a, grad_b = layer_sums(factor.to(ghost_layers[module].dtype))
                out[key_a], out[key_b] = grad_a.to(params[key_a].dtype), grad_b.to(params[key_b].dtype)
        return {key: out[key] for key in params}

    return GhostPass(losses.detach(), total, sums)
