"""Influence functions with EK-FAC curvature on the adapter's own layers (kronfluence's semantics).

A LoRA-form layer ``y = base(x) + s · (x Aᵀ) Bᵀ`` is two linear maps, as peft builds it
(``lora_B(lora_A(x)) * s``): ``A (r, d_in)`` with input ``x`` and output ``h = x Aᵀ``, and
``B (d_out, r)`` with input ``h``. EK-FAC (George et al. 2018; Grosse et al. 2023, as the
``kronfluence`` package computes it) approximates the Gauss-Newton / Fisher block of each map's
weight ``W (out, in)`` by ``(Q_S ⊗ Q_A) diag(Λ) (Q_S ⊗ Q_A)ᵀ``:

- ``C_A = Σ a aᵀ / N`` over every token of every example (``a``: the map's input; ``d_in × d_in``
  for ``A``, ``r × r`` for ``B``), ``C_S = Σ g gᵀ / N`` (``g``: the gradient at the map's output,
  ``s · g_y B`` for ``A`` (``r × r``), ``s · g_y`` for ``B`` (``d_out × d_out``)), ``N`` the
  tokens (a token mask zeroes masked inputs and counts only unmasked tokens);
- ``Q_A``, ``Q_S`` their eigenvectors (``torch.linalg.eigh`` in float64);
- the corrected eigenvalues ``Λ = Σ_examples (Q_Sᵀ ∇W Q_A)² / n`` from the per-example gradients
  (a second pass over the data).

The influence of training example ``z`` on test example ``q`` is ``∇ℓ_qᵀ H⁻¹ ∇ℓ_z`` summed over
the maps, ``H⁻¹ G = Q_S ((Q_Sᵀ G Q_A) / (Λ + λ)) Q_Aᵀ`` (kronfluence's pairwise score; ``λ``
its ``damping_factor``: ``1e-8`` by default, ``None`` for ``0.1 · mean(Λ)`` per map). The per-
example gradients are :func:`lora_func.attribution.features` rows (``proj_dim=None``); the
token statistics come from one recorded pass: each LoRA layer's input and output gradient under
``vmap`` over the examples, read by an activation tap (nothing is installed on the model).

Supported: every layer of the adapter a LoRA-form variant (``Variant.low_rank``: ``lora``,
``eva``) on ``nn.Linear`` or GPT-2 ``Conv1D``, alone or composed, any base (quantized too); not
stacks, combinations' own weights, other variants (their tensors are no linear map of the
layer input), nor dropout in train mode.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lora_func._layer_ops import TapInput, VariantOp, activation_tap
from lora_func._tree import leaves
from lora_func.adapter import AdapterLike, leaf_adapters
from lora_func.attribution._checks import batch_size, check_callable, check_chunk_size
from lora_func.attribution.featurize import _batch_args, feature_dim
from lora_func.attribution.scoring import scores
from lora_func.many import Randomness, per_example_grads
from lora_func.variants import BaseLayer, get_variant, list_variants

__all__ = ["EKFAC", "Factor", "ekfac", "influence"]

HEURISTIC_DAMPING = 0.1  # kronfluence's HEURISTIC_DAMPING_SCALE: damping=None is 0.1 * mean(Λ)


@dataclasses.dataclass(frozen=True)
class Factor:
    """The EK-FAC factors of one adapter tensor seen as a linear map's weight ``(out, in)``.

    Attributes:
      key: the tensor's key in ``adapter.params``; ``offset``: where its values start in a
        feature row (``adapter.params`` order).
      shape: ``(out, in)``: ``(r, d_in)`` for ``lora_A``, ``(d_out, r)`` for ``lora_B``.
      gradient_eigenvectors ``(out, out)``, activation_eigenvectors ``(in, in)``: ``Q_S``, ``Q_A``
        (float64); gradient_eigenvalues, activation_eigenvalues: theirs (K-FAC's).
      lambdas: ``Λ (out, in)``, the corrected eigenvalues (float64).
      tokens: the tokens the covariances averaged over; examples: the examples ``Λ`` did.
    """

    key: str
    offset: int
    shape: tuple[int, int]
    gradient_eigenvectors: Tensor
    activation_eigenvectors: Tensor
    gradient_eigenvalues: Tensor
    activation_eigenvalues: Tensor
    lambdas: Tensor
    tokens: float
    examples: int

    def precondition(self, grads: Tensor, damping: float | None) -> Tensor:
        """``H⁻¹ G`` of gradients ``(n, out, in)``, in their dtype."""
        dtype = grads.dtype
        q_s, q_a = self.gradient_eigenvectors.to(grads.device, dtype), self.activation_eigenvectors.to(grads.device, dtype)
        lambdas = self.lambdas.to(grads.device)
        extra = HEURISTIC_DAMPING * float(lambdas.mean()) if damping is None else damping
        rotated = q_s.T @ grads @ q_a
        rotated = rotated / (lambdas + extra).to(dtype)
        return q_s @ rotated @ q_a.T


@dataclasses.dataclass(frozen=True)
class EKFAC:
    """EK-FAC curvature of an adapter (:func:`ekfac`): one :class:`Factor` per trainable tensor.

    ``dim``: ``D``, the width of the raw features it preconditions; ``keys``: the adapter's
    tensor keys in feature order.
    """

    factors: tuple[Factor, ...]
    dim: int
    keys: tuple[str, ...]

    def precondition(self, features: Tensor, *, damping: float | None = 1e-8) -> Tensor:
        """``H⁻¹ g`` of each row of ``features (n, D)`` (raw features of the same adapter):
        ``(n, D)`` in the features' dtype. ``damping``: kronfluence's ``damping_factor``."""
        damping = _check_damping(damping, "EKFAC.precondition")
        _check_width(self, features, "features", "EKFAC.precondition")
        rows = features if features.is_floating_point() else features.float()
        out = torch.empty_like(rows)
        for factor in self.factors:
            size = factor.shape[0] * factor.shape[1]
            block = rows[:, factor.offset : factor.offset + size].reshape(-1, *factor.shape)
            out[:, factor.offset : factor.offset + size] = factor.precondition(block, damping).reshape(rows.shape[0], size)
        return out


def _check_damping(damping: Any, where: str) -> float | None:
    if damping is None:
        return None
    if not isinstance(damping, (int, float)) or isinstance(damping, bool) or not math.isfinite(damping) or damping < 0:
        raise ValueError(  # error: attribution-ekfac-damping
            f"{where}: damping must be a finite number >= 0, or None for kronfluence's heuristic 0.1 * mean(Λ) per "
            f"layer, got {damping!r}"
        )
    return float(damping)


def _check_width(curvature: EKFAC, features: Any, argument: str, where: str) -> None:
    if not isinstance(features, Tensor) or features.dim() != 2 or features.shape[1] != curvature.dim:
        shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
        raise ValueError(  # error: attribution-ekfac-dim
            f"{where}: {argument} must be the raw features (n, D={curvature.dim}) of the adapter the curvature was fitted "
            f"on (features(..., proj_dim=None)), got {shape}"
        )


@dataclasses.dataclass
class _Layer:
    """One LoRA-form layer during the covariance pass: its tensors, scale and statistics."""

    key_a: str
    key_b: str
    a: Tensor
    b: Tensor
    scale: float | None = None
    inputs: list[Tensor | None] = dataclasses.field(default_factory=list)
    masks: list[Tensor | None] = dataclasses.field(default_factory=list)
    sums: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    tokens: float = 0.0

    def record(self, x: Tensor, mask: Tensor | None) -> int:
        self.inputs.append(x)
        self.masks.append(mask)
        return len(self.inputs) - 1

    def backward(self, index: int, g: Tensor) -> None:
        x, mask = self.inputs[index], self.masks[index]
        assert x is not None and self.scale is not None
        self.inputs[index] = None
        dtype = torch.promote_types(torch.promote_types(x.dtype, self.a.dtype), torch.float32)
        x, g = x.to(dtype).flatten(0, -2), g.to(dtype).flatten(0, -2)  # (B·rows, d)
        a, b = self.a.to(dtype), self.b.to(dtype)
        h = x @ a.T  # lora_A's output, lora_B's input (B·rows, r)
        if mask is not None:
            weights = mask.to(dtype).reshape(-1, 1)
            x, h = x * weights, h * weights
            self.tokens += float(mask.sum())
        else:
            self.tokens += x.shape[0]
        grad_b = self.scale * g  # at lora_B's output (d_out)
        grad_a = grad_b @ b  # at lora_A's output (r)
        for name, rows in (("act_a", x), ("grad_a", grad_a), ("act_b", h), ("grad_b", grad_b)):
            product = rows.T @ rows
            self.sums[name] = product if name not in self.sums else self.sums[name] + product


class _Recorder:
    """The activation tap of the covariance pass: each LoRA layer's input (under ``vmap``, batch
    first) and, in the backward, its output gradient, by the identity of its tensors."""

    def __init__(self, layers: dict[str, _Layer], where: str) -> None:
        self.layers = layers
        self.where = where
        self.ids: dict[int, str] = {}
        self.by_key = {layer.key_a: module for module, layer in layers.items()}
        self.mask: Tensor | None = None

    def record_input(self, module: str, x: Tensor) -> int:
        x = x.reshape(x.shape[0], -1, x.shape[-1])  # (B, rows, d_in): one example's tokens per row block
        mask = self.mask
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(  # error: attribution-ekfac-mask
                f"{self.where}: token_mask gave shape {tuple(mask.shape)} but {module}'s input has {x.shape[1]} "
                f"tokens per example (batch of {x.shape[0]}); return one 0/1 entry per token, (B, T)"
            )
        return self.layers[module].record(x, mask)

    def output_grad(self, module: str, index: int, grad: Tensor) -> None:
        self.layers[module].backward(index, grad.reshape(grad.shape[0], -1, grad.shape[-1]))

    def bind(self, params: dict[str, Tensor]) -> None:
        self.ids = {id(t): key for key, t in params.items()}

    def weight(self, step: VariantOp) -> None:
        hit = sorted(self.ids[id(t)] for t in step.params.values() if id(t) in self.ids)
        if hit:
            raise ValueError(  # error: attribution-ekfac-merged
                f"{self.where}: adapter tensor {hit[0]} reaches the model through a merged weight, where EK-FAC cannot see its "
                f"layer's input; call the model with the lazy path (adapted_call(..., merged=False), the default)"
            )

    def activation(self, step: VariantOp, x: Tensor, base: BaseLayer, y: Tensor) -> Tensor:
        names = {name: self.ids[id(t)] for name, t in step.params.items() if id(t) in self.ids}
        if not names:
            return y
        form = step.variant.low_rank
        module = self.by_key.get(names.get(form.a, "") if form is not None else "")
        if module is None:
            return y  # (ekfac checked that every tensor is a LoRA layer's: not reached)
        layer = self.layers[module]
        if dict(step.info.options).get("dropout", 0.0) and getattr(base, "training", False):
            raise ValueError(  # error: attribution-ekfac-dropout
                f"{self.where}: {module} applies LoRA dropout (the model is in train mode), so its A sees another input "
                f"than the layer; fit the curvature in eval mode (model.eval())"
            )
        assert form is not None
        scale = form.scale(step.info, step.buffers)
        layer.scale = float(scale)
        out: Tensor = TapInput.apply(x, y, None, self, module)
        return out


def _lora_layers(adapter: AdapterLike, where: str) -> dict[str, _Layer]:
    """Every layer of ``adapter`` as a :class:`_Layer`, after checking that EK-FAC covers every
    trainable tensor."""
    if adapter.stack_shape:
        raise ValueError(  # error: attribution-ekfac-stacked
            f"{where}: the adapter is a stack {tuple(adapter.stack_shape)}; fit one curvature per member "
            f"(lora_func.take(stack, k) or unstack)"
        )
    params = adapter.params
    layers: dict[str, _Layer] = {}
    problems: list[str] = []
    refused: set[str] = set()
    for prefix, leaf in leaves(adapter):
        form = leaf.variant.low_rank
        for layer in leaf.layers:
            module = prefix + layer.target.module
            names = {name for name, _ in layer.param_shapes}
            if form is None or leaf.shared is not None or layer.target.layout not in ("linear", "conv1d") or names != {form.a, form.b}:
                problems.append(f"{module} ({leaf.spec.variant} on a {layer.target.layout} layer)")
                refused.update(f"{module}.{name}" for name in names)
            else:
                key_a, key_b = f"{module}.{form.a}", f"{module}.{form.b}"
                layers[module] = _Layer(key_a, key_b, params[key_a].detach(), params[key_b].detach())
    covered = {key for layer in layers.values() for key in (layer.key_a, layer.key_b)}
    problems += [f"{key} (not a layer's tensor)" for key in params if key not in covered and key not in refused]
    if problems:
        supported = sorted(name for name in list_variants() if get_variant(name).low_rank is not None)
        raise ValueError(  # error: attribution-ekfac-unsupported
            f"{where}: EK-FAC needs every trainable tensor to be a LoRA-form layer's A or B (variants {supported} on "
            f"nn.Linear / Conv1D layers, alone or composed), got {problems[:4]}; use scores(..., method='trak') or "
            f"'tracin' for other adapters"
        )
    return layers


def _eigh(total: Tensor, count: float) -> tuple[Tensor, Tensor]:
    """kronfluence's eigendecomposition: the covariance ``total / count`` in float64, symmetrised."""
    covariance = total.to(torch.float64) / count
    covariance = (covariance + covariance.T) * 0.5
    values, vectors = torch.linalg.eigh(covariance)
    return values, vectors


def _chunks(args: tuple, size: int, step: int) -> Iterable[tuple[int, tuple]]:
    leaves_, spec = pytree.tree_flatten(args)
    split = [isinstance(leaf, Tensor) and leaf.dim() >= 1 for leaf in leaves_]
    for start in range(0, size, step):
        yield start, pytree.tree_unflatten([leaf[start : start + step] if s else leaf for leaf, s in zip(leaves_, split, strict=True)], spec)


def ekfac(
    loss_fn: Callable[..., Any],
    adapter: AdapterLike,
    batches: Iterable[Any],
    *,
    token_mask: Callable[..., Tensor] | None = None,
    chunk_size: int | None = None,
    randomness: Randomness = "error",
) -> EKFAC:
    """Fit EK-FAC curvature on the adapter's LoRA layers (kronfluence's ``fit_all_factors``
    with ``strategy="ekfac"``; the module docstring has the math).

    Args:
      loss_fn: ``loss_fn(adapter, *example) -> 0-d loss`` as for :func:`features` (one example
        as a batch of one): kronfluence's ``compute_train_loss``. With the true labels it fits
        the empirical Fisher (kronfluence's ``use_empirical_fisher=True``); a loss on labels
        sampled from the model's outputs gives kronfluence's default, the true Fisher (pass
        ``randomness="different"`` if it samples under ``vmap``).
      adapter: LoRA-form layers only (``lora``, ``eva``; composed too), not stacked.
      batches: an iterable of batches that can be iterated twice (a list, a ``DataLoader``): one
        pass for the covariances, one for ``Λ``. A tuple or list is a batch's arguments.
      token_mask: kronfluence's ``get_attention_mask``: ``token_mask(*batch) -> (B, T)`` 0/1, so
        that padded positions' inputs stay out of the covariances and the token count.
      chunk_size: that many examples at a time (memory), as in :func:`features`.

    Returns an :class:`EKFAC`; :func:`influence` scores with it.
    """
    where = "ekfac"
    check_callable(loss_fn, where)
    leaf_adapters(adapter, f"{where}(loss_fn, adapter, batches)")
    step = check_chunk_size(chunk_size, where)
    if token_mask is not None and not callable(token_mask):
        raise TypeError(f"{where}: token_mask must be None or a function token_mask(*batch) -> (B, T), got {type(token_mask).__name__}")  # error: attribution-ekfac-token-mask
    layers = _lora_layers(adapter, where)
    recorder = _Recorder(layers, where)

    def recorded(adapter_: AdapterLike, *example: Any) -> Any:
        recorder.bind(adapter_.params)
        return loss_fn(adapter_, *example)

    seen = 0
    with activation_tap(recorder):
        for batch in batches:
            args = _batch_args(batch)
            size = batch_size(args, where)
            mask = None if token_mask is None else token_mask(*args)
            for start, chunk in _chunks(args, size, step or size):
                recorder.mask = None if mask is None else mask[start : start + (step or size)].detach()
                per_example_grads(recorded, adapter, *chunk, randomness=randomness)
            seen += size
    unseen = sorted(module for module, layer in layers.items() if layer.scale is None or not layer.tokens)
    if seen == 0 or unseen:
        raise ValueError(  # error: attribution-ekfac-no-data
            f"{where}: {'batches gave no examples' if seen == 0 else f'layers {unseen[:4]} saw no tokens (never called, or every token masked)'}; "
            f"fit on batches that run every adapted layer"
        )
    eigen: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
    for layer in layers.values():
        act_a, grad_a = _eigh(layer.sums["act_a"], layer.tokens), _eigh(layer.sums["grad_a"], layer.tokens)
        act_b, grad_b = _eigh(layer.sums["act_b"], layer.tokens), _eigh(layer.sums["grad_b"], layer.tokens)
        eigen[layer.key_a] = (grad_a[1], act_a[1], grad_a[0], act_a[0])
        eigen[layer.key_b] = (grad_b[1], act_b[1], grad_b[0], act_b[0])
    # Second pass: Λ from the per-example gradients in the eigenbases.
    sums: dict[str, Tensor] = {}
    examples = 0
    for batch in batches:
        args = _batch_args(batch)
        size = batch_size(args, where)
        for _, chunk in _chunks(args, size, step or size):
            grads = per_example_grads(loss_fn, adapter, *chunk, randomness=randomness)
            for key, (q_s, q_a, _, _) in eigen.items():
                g = grads[key].to(torch.float64)
                rotated = (q_s.T @ g @ q_a).square().sum(0)
                sums[key] = rotated if key not in sums else sums[key] + rotated
        examples += size
    if examples != seen:
        raise ValueError(  # error: attribution-ekfac-batches-once
            f"{where}: batches gave {seen} examples on the first pass and {examples} on the second; the factors need two "
            f"passes over the same data: pass a list of batches or a DataLoader, not a one-shot iterator"
        )
    factors = []
    offset = 0
    tokens = {key: layer.tokens for layer in layers.values() for key in (layer.key_a, layer.key_b)}
    for key, value in adapter.params.items():
        q_s, q_a, s_values, a_values = eigen[key]
        out_dim, in_dim = value.shape
        factors.append(Factor(key, offset, (out_dim, in_dim), q_s, q_a, s_values, a_values, sums[key] / examples, tokens[key], examples))
        offset += value.numel()
    return EKFAC(tuple(factors), feature_dim(adapter), tuple(adapter.params))


def influence(curvature: EKFAC, train: Any, test: Tensor, *, damping: float | None = 1e-8) -> Tensor:
    """Influence scores ``(n_test, n_train)``: ``test_j · H⁻¹ train_i`` with the EK-FAC inverse of
    ``curvature`` (kronfluence's pairwise scores: positive when training on ``i`` lowers the
    test loss).

    ``train`` ``(n_train, D)`` and ``test`` ``(n_test, D)``: raw features
    (:func:`lora_func.attribution.features` with ``proj_dim=None``) of the adapter the curvature
    was fitted on; ``train`` may be a memory map (:func:`lora_func.attribution.write_features`).
    ``damping``: kronfluence's ``damping_factor`` (``None``: ``0.1 · mean(Λ)`` per layer).
    """
    where = "influence"
    if not isinstance(curvature, EKFAC):
        raise TypeError(f"{where}: curvature must be an EKFAC from lora_func.attribution.ekfac(...), got {type(curvature).__name__}")  # error: attribution-ekfac-type
    damping = _check_damping(damping, where)
    _check_width(curvature, test, "test", where)
    width = getattr(train, "shape", (0, 0))
    if len(width) != 2 or width[1] != curvature.dim:
        raise ValueError(  # error: attribution-ekfac-train-dim
            f"{where}: train must be the raw features (n, D={curvature.dim}) of the adapter the curvature was fitted on, got "
            f"{tuple(width) if hasattr(train, 'shape') else type(train).__name__}"
        )
    return scores(train, curvature.precondition(test, damping=damping), method="tracin")
