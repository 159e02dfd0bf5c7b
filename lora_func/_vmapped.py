"""The whole-model ``vmap`` route of :mod:`lora_func.many` (``mixed_call``, ``ensemble_call``
with ``batching="vmap"``, ``per_example_grads``): what running a transformers model under
``torch.func.vmap`` needs checked and rearranged."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

__all__ = ["check_attention", "drop_example_dim", "outputs_as_tensors", "split_examples", "vmapped"]

_VMAP_ATTENTION = ("eager", None)


def check_attention(model: nn.Module, where: str) -> None:
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


def outputs_as_tensors(out: Any, where: str) -> Any:
    """``out`` unchanged, after checking that ``vmap`` can batch it (tensors only)."""
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        if leaf is not None and not isinstance(leaf, Tensor):
            raise TypeError(  # error: batch-non-tensor-output
                f"{where}: the model returned a {type(leaf).__name__} at output{pytree.keystr(path)}, which vmap cannot "
                f"batch (only tensors); for transformers models pass use_cache=False so that no KV cache is returned"
            )
    return out


def vmapped(fn: Callable[..., Any], where: str, **vmap_kwargs: Any) -> Callable[..., Any]:
    """``torch.func.vmap(fn, **vmap_kwargs)`` whose data-dependent-control-flow error says what
    usually causes it in a transformers model and how to fix it."""
    batched = torch.func.vmap(fn, **vmap_kwargs)

    def call(*args: Any) -> Any:
        try:
            return batched(*args)
        except RuntimeError as err:
            if "randomness error mode" in str(err):
                raise RuntimeError(  # error: batch-randomness
                    f"{where}: a random draw (dropout, or a variant that samples in training mode: MonteCLoRA, "
                    f"X-LoRA's or Poly's training draws) ran under vmap with randomness='error'; pass "
                    f"randomness='different' (an independent draw per example or member) or randomness='same' (one "
                    f"draw shared by all), or call model.eval() for a step without draws"
                ) from err
            if "data-dependent control flow" not in str(err):
                raise
            raise RuntimeError(  # error: batch-vmap-failed
                f"{where}: {err}\nThis usually means SDPA or flash attention with an attention mask: under vmap, "
                f"transformers models need eager attention (model.set_attn_implementation('eager') or "
                f"from_pretrained(..., attn_implementation='eager'))"
            ) from err

    return call


def split_examples(args: tuple, kwargs: Mapping[str, Any], batch_size: int) -> tuple[list[Tensor], Callable[[tuple], tuple]]:
    """The tensors of ``(args, kwargs)`` with ``batch_size`` on dim 0 (split per example), and a
    function that rebuilds ``(args, kwargs)`` for one example from their slices, each given a
    batch dim of 1 again, every other leaf passed through whole."""
    leaves, spec = pytree.tree_flatten((args, dict(kwargs)))
    split = [isinstance(leaf, Tensor) and leaf.dim() >= 1 and leaf.shape[0] == batch_size for leaf in leaves]

    def rebuild(examples: tuple) -> tuple:
        slices = iter(examples)
        return pytree.tree_unflatten([next(slices).unsqueeze(0) if s else leaf for leaf, s in zip(leaves, split, strict=True)], spec)

    return [leaf for leaf, s in zip(leaves, split, strict=True) if s], rebuild


def drop_example_dim(out: Any) -> Any:
    # Each example ran as a batch of 1; vmap puts the batch back on dim 0.
    return pytree.tree_map_only(Tensor, lambda t: t.squeeze(0) if t.dim() >= 1 and t.shape[0] == 1 else t, out)
