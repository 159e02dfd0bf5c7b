"""Ghost clipping with book-keeping: DP-SGD's clipped sum for LoRA-form layers from their
inputs and output gradients, without per-example copies of the adapter.

For a layer ``y = base(x) + s · (x Aᵀ) Bᵀ`` with input ``x (B, T, d_in)`` and output gradient
``g = ∂L/∂y (B, T, d_out)`` (one row per example), ``h = s · x Aᵀ`` and ``u = s · g B``
``(B, T, r)``, example ``b``'s gradients are ``∇B_b = g_bᵀ h_b`` and ``∇A_b = u_bᵀ x_b``, so

- their squared norms are ``Σ_{t,t'} (g_t·g_t')(h_t·h_t')`` and ``Σ_{t,t'} (u_t·u_t')(x_t·x_t')``
  (ghost norms, Li et al. 2022: two ``(B, T, T)`` Gram products), or, where ``T²`` exceeds
  ``r · (d_in + d_out)``, the norms of the materialised ``(B, r, d)`` gradients (smaller then);
- the clipped sum is ``Σ_b c_b ∇B_b = gᵀ (c ⊙ h)`` and ``Σ_b c_b ∇A_b = (c ⊙ u)ᵀ x`` over all
  ``B · T`` rows (book-keeping, Bu et al. 2023: the stored ``x`` and ``g``, one backward).

Recording: the forward runs under ``vmap`` over the examples as in
:func:`lora_func.per_example_grads`; the adapter's low-rank tensors are shared (not copied per
example) and an activation tap (:func:`lora_func._steps.activation_tap`, installed for this call
only) passes each LoRA-form layer's output through :class:`_Tap`, an identity whose ``vmap``
rule sees the batched tensors: it keeps ``x`` and the output, whose gradient the one backward
returns. Every other tensor of the adapter (another variant's, a LoRA layer with dropout) keeps
a per-example copy in the same forward and backward, and its per-example gradient joins the
norm: the results equal the per-example path (tested).

Which tensors get ghost norms: ``lora_A``/``lora_B`` of every layer whose variant's activation
form is LoRA's (``lora``, rsLoRA, and the variants that only change LoRA's init: PiSSA, OLoRA,
EVA, ...) and whose ``dropout`` is 0, alone or inside a composition or combination (the tap sees
the layer's own input and output there too); not in a stack. Everything else (DoRA's tensors:
its norm term makes the gradient no outer product of ``x`` and ``g``; every other variant; a
combination's own weights; stacks; ``chunk_size``) takes the per-example path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from lora_func._kernels import lora_activation_form, lora_scale
from lora_func._steps import VariantStep, activation_tap
from lora_func._tree import leaves
from lora_func._vmapped import split_examples, vmapped
from lora_func.adapter import AdapterLike

__all__ = ["Clipping", "GhostPass", "ghost_layers", "ghost_pass"]

Clipping = Literal["auto", "ghost", "per_example"]
CLIPPINGS: tuple[Clipping, ...] = ("auto", "ghost", "per_example")


def ghost_layers(adapter: AdapterLike) -> dict[str, tuple[str, str]]:
    """The layers of ``adapter`` whose low-rank tensors get ghost norms: a key prefix per layer
    -> its ``(lora_A key, lora_B key)`` in ``adapter.params`` (empty for a stack)."""
    if adapter.stack_shape:
        return {}
    out = {}
    for prefix, leaf in leaves(adapter):
        if leaf.members is not None or leaf.variant.activation_form is not lora_activation_form:
            continue
        for layer in leaf.layers:
            names = {name for name, _ in layer.param_shapes}
            if names == {"lora_A", "lora_B"} and not dict(layer.info.options).get("dropout", 0.0):
                module = prefix + layer.target.module
                out[module] = (f"{module}.lora_A", f"{module}.lora_B")
    return out


class _Recorder:
    """What the tap keeps per layer: inputs and tapped outputs (batch first), the LoRA scale."""

    def __init__(self, by_tensor: dict[int, str]) -> None:
        self.by_tensor = by_tensor
        self.inputs: dict[str, list[Tensor]] = {}
        self.outputs: dict[str, list[Tensor]] = {}
        self.scales: dict[str, float] = {}

    def __call__(self, step: VariantStep, x: Tensor, y: Tensor) -> Tensor:
        a = step.params.get("lora_A")
        name = None if a is None else self.by_tensor.get(id(a))
        if name is None or not torch.is_grad_enabled():
            return y
        scale = lora_scale(step.info, step.buffers)
        if isinstance(scale, Tensor):  # only inside a stack; stacks take the per-example path
            return y
        self.scales[name] = scale
        out: Tensor = _Tap.apply(x, y, self, name)
        return out

    def record(self, name: str, x: Tensor, out: Tensor) -> None:
        self.inputs.setdefault(name, []).append(x)
        self.outputs.setdefault(name, []).append(out)


def _batch_first(t: Tensor, dim: int | None, size: int) -> Tensor:
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


class _Tap(torch.autograd.Function):
    """``y`` unchanged; under ``vmap`` it records ``x`` and ``y`` with the batch on dim 0 (its
    ``vmap`` rule gets the batched tensors themselves) and returns the recorded ``y``, so the
    gradient of the loss w.r.t. that tensor is the layer's per-example output gradient."""

    @staticmethod
    def forward(x: Tensor, y: Tensor, recorder: _Recorder, name: str) -> Tensor:
        return y.view_as(y)  # outside vmap: nothing recorded (the layer then falls back)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        return None, grad, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, y: Tensor, recorder: _Recorder, name: str) -> tuple[Tensor, int]:
        xs = _batch_first(x, in_dims[0], info.batch_size).detach()
        ys = _batch_first(y, in_dims[1], info.batch_size)
        # Nothing before this layer may need a gradient (the shared low-rank tensors do not):
        # a fresh leaf then, so that the backward still reaches it.
        out = ys.view_as(ys) if ys.requires_grad else ys.detach().requires_grad_(True)
        recorder.record(name, xs, out)
        return out, 0


class GhostPass:
    """One recorded forward and backward: per example the squared gradient norms and, given
    clip factors, the clipped sums, per tensor key."""

    def __init__(self, losses: Tensor, squares: Tensor, sums: Callable[[Tensor], dict[str, Tensor]]) -> None:
        self.losses, self.squares, self._sums = losses, squares, sums

    def clipped_sums(self, factor: Tensor) -> dict[str, Tensor]:
        return self._sums(factor)


def _lora_layer(
    x: Tensor, g: Tensor, a: Tensor, b: Tensor, scale: float, gram: bool
) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, Tensor]]]:
    """Per-example squared norm of ``(∇A, ∇B)`` of one layer and the clipped-sum function;
    ``x (B, T, d_in)``, ``g (B, T, d_out)`` in the compute dtype."""
    h = (x @ a.T) * scale  # (B, T, r)
    u = (g @ b) * scale  # (B, T, r)
    if gram:
        squares = ((g @ g.mT) * (h @ h.mT)).sum((1, 2)) + ((u @ u.mT) * (x @ x.mT)).sum((1, 2))

        def sums(c: Tensor) -> tuple[Tensor, Tensor]:
            c = c[:, None, None]
            return (u * c).flatten(0, 1).T @ x.flatten(0, 1), g.flatten(0, 1).T @ (h * c).flatten(0, 1)

        return squares, sums
    grad_a, grad_b = u.mT @ x, g.mT @ h  # (B, r, d_in), (B, d_out, r)
    squares = grad_a.pow(2).sum((1, 2)) + grad_b.pow(2).sum((1, 2))
    return squares, lambda c: (torch.einsum("b,bri->ri", c, grad_a), torch.einsum("b,bor->or", c, grad_b))


def ghost_pass(
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    batch: tuple,
    batch_size: int,
    layers: dict[str, tuple[str, str]],
    *,
    clipping: Clipping,
    randomness: str,
) -> GhostPass | None:
    """The recorded forward and backward of ``loss_fn`` on ``batch`` (see the module
    docstring); ``None`` when a layer of ``layers`` was not seen by the tap (its tensors
    reached the model another way, a merged overlay): the caller then takes the per-example
    path. ``clipping="ghost"`` takes Gram norms for every layer, ``"auto"`` where smaller."""
    params = adapter.params
    ghost_keys = {key for pair in layers.values() for key in pair}
    shared = {key: params[key].detach() for key in ghost_keys}
    copies = {
        key: value.detach().unsqueeze(0).expand(batch_size, *value.shape).requires_grad_(True)
        for key, value in params.items()
        if key not in ghost_keys
    }
    recorder = _Recorder({id(shared[a]): module for module, (a, _) in layers.items()})
    examples, rebuild = split_examples(batch, {}, batch_size)

    def loss(own: dict[str, Tensor], *example: Tensor) -> Any:
        example_batch, _ = rebuild(example)
        return loss_fn(adapter.with_params({**shared, **own}), *example_batch)

    with torch.enable_grad(), activation_tap(recorder):
        losses = vmapped(loss, "private_grads", randomness=randomness)(copies, *examples)
    if set(recorder.outputs) != set(layers):
        return None
    if not isinstance(losses, Tensor) or tuple(losses.shape) != (batch_size,):
        raise ValueError(  # error: privacy-ghost-loss
            f"private_grads: loss_fn must return one scalar loss per example (a 0-d tensor), got "
            f"{type(losses).__name__} of per-example shape {tuple(losses.shape[1:]) if isinstance(losses, Tensor) else '?'}"
        )
    taps = [out for module in layers for out in recorder.outputs[module]]
    with torch.enable_grad():
        grads = torch.autograd.grad(losses.sum(), [*taps, *copies.values()], allow_unused=True)
    tap_grads = iter(grads[: len(taps)])
    copy_grads = {key: torch.zeros_like(copies[key]) if g is None else g for key, g in zip(copies, grads[len(taps):], strict=True)}
    device_type = next(iter(params.values())).device.type
    per_layer = {}
    with torch.no_grad(), torch.autocast(device_type, enabled=False):
        for module, (key_a, key_b) in layers.items():
            a, b = shared[key_a], shared[key_b]
            dtype = torch.promote_types(a.dtype, torch.float32)
            xs, gs = [], []
            for x, out in zip(recorder.inputs[module], recorder.outputs[module], strict=True):
                g = next(tap_grads)
                xs.append(x.reshape(batch_size, -1, x.shape[-1]).to(dtype))
                gs.append((torch.zeros_like(out) if g is None else g).reshape(batch_size, -1, out.shape[-1]).to(dtype))
            x, g = torch.cat(xs, 1), torch.cat(gs, 1)
            r, tokens = a.shape[0], x.shape[1]
            gram = clipping == "ghost" or tokens * tokens < r * (a.shape[1] + b.shape[0])
            per_layer[module] = _lora_layer(x, g, a.to(dtype), b.to(dtype), recorder.scales[module], gram)
        lead = 1  # (B,): one norm per example
        squares = [g.flatten(lead).float().pow(2).sum(-1) for g in copy_grads.values()]
        squares += [s.float() for s, _ in per_layer.values()]
    total = torch.stack(squares).sum(0)

    def sums(factor: Tensor) -> dict[str, Tensor]:
        out = {}
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            for key, g in copy_grads.items():
                out[key] = torch.einsum("b,b...->...", factor.to(g.dtype), g)
            for module, (_, layer_sums) in per_layer.items():
                key_a, key_b = layers[module]
                grad_a, grad_b = layer_sums(factor.to(torch.promote_types(params[key_a].dtype, torch.float32)))
                out[key_a], out[key_b] = grad_a.to(params[key_a].dtype), grad_b.to(params[key_b].dtype)
        return {key: out[key] for key in params}

    return GhostPass(losses.detach(), total, sums)
