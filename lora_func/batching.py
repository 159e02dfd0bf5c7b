"""Batching across adapters: mixed-adapter batches, ensembles and per-example gradients.

All three are ``torch.func.vmap`` over pure functions of the adapter tensors, so they
compose with ``torch.func.grad`` (training), with each other and with ``torch.compile``:

- :func:`mixed_call`: example ``i`` of a batch runs with adapter ``index[i]`` of a stack, for
  inference *and* training (gradients reach every stack member its examples used);
- :func:`ensemble_call`: the same inputs through each of ``K`` stacked adapters at once;
- :func:`per_example_grads`: one gradient per example, ``vmap(grad(loss))``.

Under ``vmap`` the model runs once, batched, and the lazy overlay never builds a merged
weight: the frozen weights are shared by every example, only the low-rank paths are batched.
Two consequences of running a transformers model under ``vmap`` (checked on torch 2.13):

- attention must be ``"eager"``: SDPA and flash attention have no ``vmap`` batching rule (a
  slow per-example loop with a warning) and with an attention mask they branch on its values,
  which ``vmap`` refuses. :func:`mixed_call` and :func:`ensemble_call` check the model's
  ``config._attn_implementation`` up front; :func:`per_example_grads` explains the error.
- dropout in train mode draws random numbers, which ``vmap`` refuses unless told how:
  pass ``randomness="different"`` (an independent mask per example, like a batched call) or
  ``"same"``; in eval mode nothing is drawn.

For mixed-adapter batches there is a second route that does not run the model under ``vmap``:
:func:`lora_func.mixed_adapted` / :func:`lora_func.mixed_adapted_call` (:mod:`lora_func.mixed`)
apply each row's adapter inside the target layers only, so any attention implementation, the
KV cache and ``model.generate`` work, and training goes through ``loss.backward()``. Prefer it;
:func:`mixed_call` remains for a per-example loss and for stacks of composed/combined adapters.

See docs/functional.md for the patterns and their costs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from lora_func.adapter import AdapterLike, leaf_adapters
from lora_func.stacking import take
from lora_func.checks import check_base, check_model, detached_base
from lora_func.core import adapted_call

__all__ = ["ensemble_call", "mixed_call", "per_example_grads"]

_VMAP_ATTENTION = ("eager", None)
_INDEX_DTYPES = (torch.int64, torch.int32)  # what tensor indexing accepts as indices (uint8 would be a mask)


def _check_attention(model: nn.Module, where: str) -> None:
    """Raise unless ``model`` (a transformers model, or any module) attends eagerly."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in _VMAP_ATTENTION:
        raise ValueError(  # error: batch-eager-attention
            f"{where} runs {type(model).__name__} under torch.func.vmap, but its attention implementation is "
            f"{implementation!r}, which has no vmap batching rule (slow per-example loop, and an error with an "
            f"attention mask); use eager attention: model.set_attn_implementation('eager') or "
            f"from_pretrained(..., attn_implementation='eager')"
        )


def _check_arguments(where: str, model: Any, adapters: Any, base: Any) -> None:
    check_model(model, where)
    leaf_adapters(adapters)
    if base is not None:
        check_base(base, where)


def _stack_size(adapters: AdapterLike, where: str) -> int:
    shape = adapters.stack_shape
    if len(shape) != 1:
        raise ValueError(  # error: batch-not-stacked
            f"{where} needs adapters stacked along one leading axis (stack_shape (K,)), got stack_shape {shape}; "
            f"build them with lora_func.stack([adapter_0, adapter_1, ...])"
        )
    return shape[0]


def _outputs_as_tensors(out: Any, where: str) -> Any:
    """``out`` unchanged, after checking that ``vmap`` can batch it (tensors only)."""
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        if leaf is not None and not isinstance(leaf, Tensor):
            raise TypeError(  # error: batch-non-tensor-output
                f"{where}: the model returned a {type(leaf).__name__} at output{pytree.keystr(path)}, which vmap cannot "
                f"batch (only tensors); for transformers models pass use_cache=False so that no KV cache is returned"
            )
    return out


def _vmapped(fn: Callable[..., Any], where: str, **vmap_kwargs: Any) -> Callable[..., Any]:
    """``torch.func.vmap(fn, **vmap_kwargs)`` whose data-dependent-control-flow error says what
    usually causes it in a transformers model and how to fix it."""
    batched = torch.func.vmap(fn, **vmap_kwargs)

    def call(*args: Any) -> Any:
        try:
            return batched(*args)
        except RuntimeError as err:
            if "data-dependent control flow" not in str(err):
                raise
            raise RuntimeError(  # error: batch-vmap-failed
                f"{where}: {err}\nThis usually means SDPA or flash attention with an attention mask: under vmap, "
                f"transformers models need eager attention (model.set_attn_implementation('eager') or "
                f"from_pretrained(..., attn_implementation='eager'))"
            ) from err

    return call


def _split_examples(args: tuple, kwargs: Mapping[str, Any], batch_size: int) -> tuple[list[Tensor], Callable[[tuple], tuple]]:
    """The tensors of ``(args, kwargs)`` with ``batch_size`` on dim 0 (split per example), and a
    function that rebuilds ``(args, kwargs)`` for one example from their slices, each given a
    batch dim of 1 again, every other leaf passed through whole."""
    leaves, spec = pytree.tree_flatten((args, dict(kwargs)))
    split = [isinstance(leaf, Tensor) and leaf.dim() >= 1 and leaf.shape[0] == batch_size for leaf in leaves]

    def rebuild(examples: tuple) -> tuple:
        slices = iter(examples)
        return pytree.tree_unflatten([next(slices).unsqueeze(0) if s else leaf for leaf, s in zip(leaves, split, strict=True)], spec)

    return [leaf for leaf, s in zip(leaves, split, strict=True) if s], rebuild


def _drop_example_dim(out: Any) -> Any:
    # Each example ran as a batch of 1; vmap puts the batch back on dim 0.
    return pytree.tree_map_only(Tensor, lambda t: t.squeeze(0) if t.dim() >= 1 and t.shape[0] == 1 else t, out)


def mixed_call(
    model: nn.Module,
    adapters: AdapterLike,
    index: Tensor,
    *args: Any,
    merged: bool = False,
    base: Mapping[str, Tensor] | None = None,
    strict: bool = False,
    randomness: str = "error",
    **kwargs: Any,
) -> Any:
    """``model(*args, **kwargs)`` where example ``i`` uses adapter ``index[i]`` of ``adapters``.

    Args:
      adapters: a stack of ``K`` adapters (:func:`lora_func.stack`, ``stack_shape (K,)``).
      index: ``(B,)`` int64 (or int32) tensor, values in ``[0, K)``; repeats are fine.
      args, kwargs: the model's inputs. The batch dim is dim 0: every tensor whose dim 0 has
        size ``B`` (``input_ids (B, T)``, ``attention_mask (B, T)``, ``labels (B, T)``) is
        split, and each example runs as a batch of one (``(1, T)``) with its own adapter and
        its own attention-mask row, exactly as in a per-example loop; every other argument
        (non-tensors, ``position_ids (1, T)``) is passed whole to every example.

    Returns the model's output batched on dim 0 again, e.g. ``logits (B, T, V)``; a 0-d output
    (the loss a model computes from ``labels``) comes back per example, ``(B,)``. Outputs must be
    tensors: pass ``use_cache=False`` to transformers models.

    Pure: ``torch.func.grad(lambda p: loss(mixed_call(model, adapters.with_params(p), index,
    ids)))(adapters.params)`` gives each stack member the gradient of the examples that used it
    (zero for members no example used). Needs eager attention (checked); a model with dropout
    in train mode needs ``randomness="different"``. ``merged=True`` builds every example's
    merged weights (``B`` dense copies per target): keep the default lazy path.

    :func:`lora_func.mixed_adapted_call` computes the same rows without ``vmap`` of the model
    (any attention, KV cache, ``generate`` through :func:`lora_func.mixed_adapted`); this
    function remains for the per-example loss and composed/combined stacks.
    """
    where = "mixed_call"
    _check_arguments(where, model, adapters, base)
    # A base from named_parameters() would give the model .grad in a training step.
    base = None if base is None else detached_base(base)
    size = _stack_size(adapters, where)
    if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype not in _INDEX_DTYPES:
        shown = f"a {index.dtype} tensor of shape {tuple(index.shape)}" if isinstance(index, Tensor) else type(index).__name__
        raise TypeError(f"mixed_call: index must be a 1-D int64 or int32 tensor (one adapter index per example), got {shown}")  # error: mixed-index-type
    outside = sorted({int(i) for i in index.tolist() if not 0 <= i < size})
    if outside:
        # Checked here, not left to tensor indexing: a negative index would silently pick a
        # member counted from the end.
        raise IndexError(  # error: mixed-index-range
            f"mixed_call: index has values outside [0, {size}) (the stack has {size} adapters): index {', '.join(map(str, outside[:5]))}; "
            f"negative positions are refused, not counted from the end"
        )
    _check_attention(model, where)
    batch_size = index.shape[0]
    examples, rebuild = _split_examples(args, kwargs, batch_size)
    if not examples:
        raise ValueError(  # error: mixed-batch-size
            f"mixed_call: no tensor argument has the batch size len(index)={batch_size} on dim 0; index needs one "
            f"entry per example of the batch"
        )
    per_example = take(adapters, index)

    def one(adapter: AdapterLike, *example: Tensor) -> Any:
        example_args, example_kwargs = rebuild(example)
        out = adapted_call(model, adapter, *example_args, merged=merged, base=base, strict=strict, **example_kwargs)
        return _drop_example_dim(_outputs_as_tensors(out, where))

    return _vmapped(one, where, randomness=randomness)(per_example, *examples)


def ensemble_call(
    model: nn.Module,
    adapters: AdapterLike,
    *args: Any,
    merged: bool = False,
    base: Mapping[str, Tensor] | None = None,
    strict: bool = False,
    randomness: str = "error",
    chunk_size: int | None = None,
    **kwargs: Any,
) -> Any:
    """``model(*args, **kwargs)`` through each of the ``K`` stacked ``adapters``, in one call.

    The inputs are shared (not split); every output gets a leading ``K`` axis, e.g. ``logits
    (K, B, T, V)``. The lazy path (default) shares the frozen weights across members and holds
    no merged weight, so memory grows with ``K`` only through activations; ``chunk_size`` runs
    the members that many at a time (``torch.func.vmap``'s option) to bound it. Composes with
    ``grad`` (train an ensemble in one step). Needs eager attention (checked); pass
    ``use_cache=False`` to transformers models.
    """
    where = "ensemble_call"
    _check_arguments(where, model, adapters, base)
    base = None if base is None else detached_base(base)
    _stack_size(adapters, where)
    _check_attention(model, where)

    def one(adapter: AdapterLike) -> Any:
        out = adapted_call(model, adapter, *args, merged=merged, base=base, strict=strict, **kwargs)
        return _outputs_as_tensors(out, where)

    return _vmapped(one, where, randomness=randomness, chunk_size=chunk_size)(adapters)


def per_example_grads(
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    *batch: Any,
    has_aux: bool = False,
    randomness: str = "error",
    chunk_size: int | None = None,
) -> Any:
    """The gradient of ``loss_fn(adapter, *example)`` for every example of ``batch``.

    Equal to ``torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, ...))`` (tested), at the
    cost of one batched backward: each example gets its own copy of ``adapter.params`` (an
    ``expand``, no copy), the forward runs under ``vmap`` over (copy, example) pairs, and one
    reverse pass (``torch.autograd.grad`` of the summed losses) gives each copy the gradient
    of its own example's loss. That reverse pass runs in the ordinary autograd engine, which
    accumulates in place and keeps fused backward kernels, where ``grad`` under ``vmap``
    decomposes some of them (docs/benchmarks.md, the functional section, has the comparison).

    Args:
      loss_fn: ``loss_fn(adapter, *example) -> loss`` (0-d), or ``(loss, aux)`` with
        ``has_aux=True``. It sees each example as a batch of one: tensors keep a dim 0 of
        size 1 (``input_ids (1, T)``), so a function written for a batch works unchanged.
      adapter: one adapter (not stacked); the gradients are w.r.t. ``adapter.params``.
      batch: the examples; every tensor in it is split along dim 0 (all with the same size
        ``B``), every other value is passed whole.
      chunk_size: run that many examples at a time in the forward (see ``torch.func.vmap``);
        the backward still holds every example's activations, as a batched backward does.

    Returns a dict like ``adapter.params`` whose tensors have a leading ``(B,)`` axis (and the
    per-example aux, batched, with ``has_aux=True``), detached. Transformers models need eager
    attention (SDPA with an attention mask fails under ``vmap``; the error says so), and
    dropout in train mode needs ``randomness="different"``.
    """
    where = "per_example_grads"
    if not callable(loss_fn):
        raise TypeError(  # error: per-example-not-callable
            f"per_example_grads: loss_fn must be a function loss_fn(adapter, *example) -> 0-d loss, got "
            f"{type(loss_fn).__name__}; the adapter is the second argument: per_example_grads(loss_fn, adapter, *batch)"
        )
    leaf_adapters(adapter)
    sizes = sorted({t.shape[0] for t in pytree.tree_leaves(batch) if isinstance(t, Tensor) and t.dim() >= 1})
    scalars = [t for t in pytree.tree_leaves(batch) if isinstance(t, Tensor) and t.dim() == 0]
    if len(sizes) != 1 or scalars:
        raise ValueError(  # error: per-example-batch
            f"per_example_grads: every tensor in batch must have the batch on dim 0, all of one size B; got dim-0 "
            f"sizes {sizes}{' and 0-d tensors' if scalars else ''}; pass shared tensors through loss_fn's closure"
        )
    batch_size = sizes[0]
    examples, rebuild = _split_examples(batch, {}, batch_size)
    # One leaf per parameter with a leading (B,) axis: example b reads slice b only, so the
    # gradient of the summed losses w.r.t. slice b is example b's gradient.
    copies = {
        key: value.detach().unsqueeze(0).expand(batch_size, *value.shape).requires_grad_(True)
        for key, value in adapter.params.items()
    }

    def loss(params: dict[str, Tensor], *example: Tensor) -> Any:
        example_batch, _ = rebuild(example)
        return loss_fn(adapter.with_params(params), *example_batch)

    with torch.enable_grad():
        out = _vmapped(loss, where, randomness=randomness, chunk_size=chunk_size)(copies, *examples)
        losses, aux = out if has_aux else (out, None)
        if not isinstance(losses, Tensor) or tuple(losses.shape) != (batch_size,):
            raise ValueError(  # error: per-example-loss
                f"per_example_grads: loss_fn must return one scalar loss per example (a 0-d tensor{', aux' if has_aux else ''}), "
                f"got {type(losses).__name__} of per-example shape {tuple(losses.shape[1:]) if isinstance(losses, Tensor) else '?'}"
            )
        grads = torch.autograd.grad(losses.sum(), list(copies.values()), allow_unused=True)
    out_grads = {key: torch.zeros_like(copies[key]) if g is None else g for key, g in zip(copies, grads, strict=True)}
    if not has_aux:
        return out_grads
    return out_grads, pytree.tree_map_only(Tensor, Tensor.detach, aux)
