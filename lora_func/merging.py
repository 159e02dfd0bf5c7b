"""Merging adapters on their deltas, and any adapter as a plain LoRA.

Every method acts on each target's ``ΔW_k = W_eff_k − W`` (the update adapter ``k`` makes to
the frozen weight, whatever its variant or composition), never on factors separately:

- ``linear``: ``Σ_k w_k ΔW_k`` (task arithmetic);
- ``cat``: the same sum, exact for plain LoRA adapters as one LoRA of rank ``Σ_k r_k`` (each
  member's ``w_k · s_k`` folded into its ``A``), peft's ``cat``;
- ``svd``: the weighted sum truncated to ``rank`` by SVD;
- ``ties``: :func:`trim` each ``ΔW_k`` to its top ``density`` by magnitude, :func:`elect_sign`,
  then the :func:`disjoint_mean` of the weighted kept values (Yadav et al. 2023);
- ``dare_linear`` / ``dare_ties``: :func:`drop` each entry with probability ``1 − density`` and
  rescale the kept ones by ``1 / density`` (Yu et al. 2023), then a weighted sum or TIES' sign
  election and disjoint mean;
- ``magnitude_prune``: :func:`trim`, then the weighted sum.

The building blocks are public pure functions of tensors with a leading task axis
``(K, d_out, d_in)``, so a new method is a few lines. The masks they build are piecewise
constant (no gradient through them); gradients flow to the weights and the adapters' tensors
through the kept values, and everything works under ``torch.func.grad`` and ``vmap``
(``density`` may be a batched 0-d tensor: a density sweep in one call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal, cast

import torch
from torch import Tensor

from lora_func._model import adapter_layer, layer_info, weight_fingerprint
from lora_func.adapter import Adapter, AdapterLike, leaf_adapters
from lora_func.checks import MAX_LISTED, non_finite_keys
from lora_func.overlay import merge_overlay
from lora_func.spec import AdapterSpec
from lora_func.targeting import Target, canonical_weight, stored_shape
from lora_func.variants import LowRank, Variant, get_variant, list_variants

__all__ = ["LoraConversion", "disjoint_mean", "drop", "elect_sign", "merge_adapters", "to_lora", "trim"]

METHODS = ("linear", "cat", "svd", "ties", "dare_linear", "dare_ties", "magnitude_prune")
_NEEDS_DENSITY = ("ties", "dare_linear", "dare_ties", "magnitude_prune")


def _plain_lora(variant: Variant) -> bool:
    """Whether the variant's ΔW is a plain LoRA's ``s·B A`` on the model's weight (its
    :class:`~lora_func.variants.LowRank` declaration, no residual replacing the weight): such
    adapters merge without ``base`` and concatenate exactly (``method="cat"``)."""
    return variant.low_rank is not None and not variant.replaces_weight


def _plain_loras() -> list[str]:
    return [name for name in list_variants() if _plain_lora(get_variant(name))]


# ------------------------------------------------------------------ building blocks


def _as_density(density: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(density, dtype=torch.float64, device=like.device)


def trim(delta: Tensor, density: float | Tensor) -> Tensor:
    """The 0/1 mask ``(d_out, d_in)`` of ``delta``'s top ``floor(density · numel)`` entries by
    magnitude (peft's ``magnitude_based_pruning``; equal magnitudes at the threshold all kept).

    ``delta (d_out, d_in)`` (any shape); ``density`` a float in ``[0, 1]`` or a 0-d tensor
    (batched under ``vmap``). The mask is built from detached values and has ``delta``'s
    dtype: ``delta * trim(delta, d)`` passes gradients through the kept entries only.
    """
    magnitude = delta.detach().abs().reshape(-1)
    n = magnitude.numel()
    kept = torch.floor(_as_density(density, delta) * n).long().clamp(0, n)  # peft: int(density * numel)
    ordered = magnitude.sort(descending=True).values
    threshold = ordered.gather(0, (kept - 1).clamp(min=0).reshape(1)).reshape(())
    mask = (magnitude >= threshold) & (kept > 0)
    return mask.reshape(delta.shape).to(delta.dtype)


def elect_sign(deltas: Tensor, method: Literal["total", "frequency"] = "total") -> Tensor:
    """TIES' sign election: the 0/1 mask ``(K, ...)`` of the entries of ``deltas (K, ...)``
    whose sign is the majority sign of their position, the sign of ``Σ_k deltas[k]``
    (``"total"``) or of the count of signs (``"frequency"``), ties counted positive; zero
    entries are never elected (peft's ``calculate_majority_sign_mask``)."""
    values = deltas.detach()
    sign = values.sign()
    weight = values.sum(0) if method == "total" else sign.sum(0)
    majority = torch.where(weight >= 0, 1.0, -1.0).to(values.dtype)
    return (sign == majority).to(deltas.dtype)


def disjoint_mean(deltas: Tensor, mask: Tensor) -> Tensor:
    """``Σ_k mask[k] · deltas[k] / max(1, Σ_k mask[k])`` per entry: the mean over the tasks
    that keep an entry (TIES' disjoint merge). ``deltas``, ``mask`` ``(K, ...)`` -> ``(...)``."""
    return (deltas * mask).sum(0) / mask.sum(0).clamp(min=1.0)


def drop(delta: Tensor, density: float | Tensor, noise: Tensor) -> Tensor:
    """DARE's random drop: ``delta`` where ``noise < density``, rescaled by ``1 / density``,
    else 0 (each entry kept with probability ``density`` when ``noise ~ U[0, 1)``, the
    expected value unchanged). ``noise`` has ``delta``'s shape; drawing it outside makes the
    drop reproducible and lets a density sweep share one draw (nested masks)."""
    d = _as_density(density, delta)
    keep = (noise < d).to(delta.dtype)
    return delta * keep / d.to(delta.dtype)


# ------------------------------------------------------------------ the deltas of adapters


def _check_adapters(adapters: Sequence[AdapterLike], where: str) -> list[AdapterLike]:
    if isinstance(adapters, AdapterLike) or not isinstance(adapters, Sequence) or not adapters:
        raise TypeError(  # error: merge-adapters-list
            f"{where}: adapters must be a non-empty list of adapters (Adapter, Composed, Combined), got "
            f"{type(adapters).__name__}; pass e.g. [adapter_a, adapter_b]"
        )
    for i, adapter in enumerate(adapters):
        leaf_adapters(adapter)  # raises not-an-adapter for anything else
        if adapter.stack_shape:
            raise ValueError(  # error: merge-stacked
                f"{where}: adapters[{i}] is a stack of shape {adapter.stack_shape}; merge single adapters "
                f"(lora_func.unstack or lora_func.take one member), or vmap the merge over the stack"
            )
    _check_devices(adapters, where)
    _check_finite_adapters(adapters, where)
    return list(adapters)


def _label(i: int, where: str) -> str:
    """How a message names adapter ``i``: ``adapters[i]``, or ``adapter`` for to_lora's one."""
    return "adapter" if where == "to_lora" else f"adapters[{i}]"


def _tensors(adapter: AdapterLike) -> dict[str, Tensor]:
    return {**adapter.params, **adapter.buffers}


def _check_devices(adapters: Sequence[AdapterLike], where: str) -> None:
    """All the adapters' tensors on one device: a merge of a CPU and a CUDA (or meta) adapter
    would fail inside a product, naming neither."""
    devices = [sorted({str(t.device) for t in _tensors(a).values()}) for a in adapters]
    if len({d for per in devices for d in per}) > 1:
        shown = ", ".join(f"adapters[{i}] on {per}" for i, per in enumerate(devices))
        raise ValueError(  # error: merge-devices
            f"{where}: the adapters' tensors are on different devices ({shown}); move them to one device first "
            f"(adapter.with_params({{k: v.to(device) ...}}), or lora_func.load(path, model=model) onto the model's)"
        )


def _check_finite_adapters(adapters: Sequence[AdapterLike], where: str) -> None:
    """No NaN/inf in any adapter (the merge would be NaN, or an SVD of it fail); skipped under a
    torch.func transform, whose tensors cannot be read."""
    for i, adapter in enumerate(adapters):
        tensors = {k: t for k, t in _tensors(adapter).items() if not _wrapped(t)}
        bad = non_finite_keys(tensors)
        if bad:
            raise ValueError(  # error: merge-non-finite
                f"{where}: {_label(i, where)} holds NaN or inf in {bad[:MAX_LISTED]}{' ...' if len(bad) > MAX_LISTED else ''}: "
                f"the merge would be non-finite; merge finite adapters (lora_func.check_finite(adapter.params, ...) finds "
                f"them in training)"
            )


def _targets(adapters: Sequence[AdapterLike], where: str = "merge_adapters") -> dict[str, Target]:
    """Every adapted weight key -> its target, in first-seen order; one shape and layout per key
    (adapters built on models of other widths share module names, not shapes)."""
    out: dict[str, Target] = {}
    first: dict[str, int] = {}
    for i, adapter in enumerate(adapters):
        for leaf in leaf_adapters(adapter):
            for layer in leaf.layers:
                t = layer.target
                seen = out.setdefault(t.weight_key, t)
                first.setdefault(t.weight_key, i)
                if (seen.layout, stored_shape(seen)) != (t.layout, stored_shape(t)):
                    raise ValueError(  # error: merge-shapes
                        f"{where}: adapters[{i}] adapts {t.module} as a {t.layout} layer of shape {stored_shape(t)}, but "
                        f"adapters[{first[t.weight_key]}] as a {seen.layout} layer of shape {stored_shape(seen)}: they were built "
                        f"on different models; merge adapters of one base model"
                    )
    return out


def _work_dtype(adapters: Sequence[AdapterLike], base: Mapping[str, Tensor] | None, targets: Mapping[str, Target]) -> torch.dtype:
    dtype = torch.float32
    for adapter in adapters:
        for leaf in leaf_adapters(adapter):
            dtype = torch.promote_types(dtype, leaf.spec.dtype)
    if base is not None:
        for key in targets:
            if key in base and base[key].is_floating_point():
                dtype = torch.promote_types(dtype, base[key].dtype)
    return dtype


def _base_for(
    adapters: Sequence[AdapterLike], base: Mapping[str, Tensor] | None, targets: Mapping[str, Target], dtype: torch.dtype, where: str
) -> dict[str, Tensor]:
    """The target weights (and biases) the deltas are measured on, in ``dtype`` (at least fp32:
    ΔW of a bf16 base is not rounded to bf16)."""
    if base is None:
        needing = sorted({leaf.variant.name for a in adapters for leaf in leaf_adapters(a) if not _plain_lora(leaf.variant)})
        if needing:
            raise ValueError(  # error: merge-needs-base
                f"{where}: the delta of {needing} depends on the base weight; pass base=lora_func.base_params(model)"
            )
        out: dict[str, Tensor] = {}
        device = next(iter(leaf_adapters(adapters[0])[0].params.values())).device
        for key, t in targets.items():
            out[key] = torch.zeros(stored_shape(t), dtype=dtype, device=device)
            if t.bias_key is not None:
                out[t.bias_key] = torch.zeros(t.d_out, dtype=dtype, device=device)
        return out
    out = {}
    for t in targets.values():
        for name in (t.weight_key, t.bias_key):
            if name is not None:
                out[name] = base[name].detach().to(dtype)
    return out


def _check_base(base: object, adapters: Sequence[AdapterLike], targets: Mapping[str, Target], where: str) -> None:
    if not isinstance(base, Mapping):
        raise TypeError(  # error: merge-base-type
            f"{where}: base must be the dict of lora_func.base_params(model), got {type(base).__name__}"
        )
    missing = sorted(k for t in targets.values() for k in (t.weight_key, t.bias_key) if k is not None and k not in base)
    if missing:
        raise KeyError(  # error: merge-base-keys
            f"{where}: base has no {missing[:5]}, which the adapters adapt; pass base=lora_func.base_params(model) of "
            f"the model the adapters were built for"
        )
    for i, adapter in enumerate(adapters):
        for leaf in leaf_adapters(adapter):
            other = sorted(
                layer.target.module for layer in leaf.layers
                if layer.base_fingerprint is not None and not _wrapped(base[layer.target.weight_key])
                and weight_fingerprint(base[layer.target.weight_key]) != layer.base_fingerprint
            )
            if other:
                raise ValueError(  # error: merge-base-fingerprint
                    f"{where}: {_label(i, where)} ({leaf.variant.name}) was derived from other base weights than base's at "
                    f"{other[:5]} (a residual of another model's weights: its delta on this base would be wrong); pass "
                    f"base=lora_func.base_params(model) of the model it was built on"
                )


def _check_bias(adapters: Sequence[AdapterLike], targets: Mapping[str, Target], where: str) -> None:
    for i, adapter in enumerate(adapters):
        for leaf in leaf_adapters(adapter):
            if leaf.variant.changes_bias and any(layer.target.bias_key is not None for layer in leaf.layers):
                biased = sorted(layer.target.module for layer in leaf.layers if layer.target.bias_key is not None)
                raise ValueError(  # error: merge-bias-change
                    f"{where}: adapters[{i}] ({leaf.variant.name!r}) changes the bias of {biased[:3]}, and a merged LoRA "
                    f"carries no bias change; merge adapters that leave the biases alone, or apply "
                    f"lora_func.combine(adapters, weights) (exact, any variant)"
                )


def _deltas(
    adapters: Sequence[AdapterLike], base: Mapping[str, Tensor] | None, where: str
) -> tuple[dict[str, Target], dict[str, Tensor]]:
    """``{weight key: ΔW (K, d_out, d_in)}``: each adapter's ``W_eff − W`` on every target any of
    them adapts (zero where one leaves a layer alone), canonical layout, at least fp32."""
    targets = _targets(adapters, where)
    _check_bias(adapters, targets, where)
    if base is not None:
        _check_base(base, adapters, targets, where)
    dtype = _work_dtype(adapters, base, targets)
    on = _base_for(adapters, base, targets, dtype, where)
    per_adapter = []
    for i, adapter in enumerate(adapters):
        merged = merge_overlay(on, adapter)
        deltas = {key: canonical_weight(merged[key] - on[key], t.layout) for key, t in targets.items()}
        bad = non_finite_keys({targets[key].module: d for key, d in deltas.items() if not _wrapped(d)})
        if bad:
            raise ValueError(  # error: merge-delta-non-finite
                f"{where}: the delta of {_label(i, where)} at {bad[:MAX_LISTED]} holds NaN or inf (its tensors are finite: a "
                f"base weight that holds NaN/inf, or an overflow); pass a finite base=, or adapters in a wider dtype"
            )
        per_adapter.append(deltas)
    return targets, {key: torch.stack([d[key] for d in per_adapter]) for key in targets}


# ------------------------------------------------------------------ LoRA results


def _lora(factors: Mapping[str, tuple[Tensor, Tensor]], targets: Mapping[str, Target], dtype: torch.dtype) -> Adapter:
    """A plain LoRA with ``ΔW = B A`` per target (``alpha = r`` per layer: scale 1)."""
    ranks = {key: a.shape[-2] for key, (a, _) in factors.items()}
    r = max(ranks.values())
    spec = AdapterSpec("lora", targets=sorted(targets[key].module for key in factors), r=r, alpha=float(r), dtype=dtype)
    params: dict[str, Tensor] = {}
    layers = []
    for key, (a, b) in factors.items():
        t = targets[key]
        info = layer_info(spec, t, r=ranks[key], alpha=float(ranks[key]))
        tensors = {"lora_A": a.to(dtype), "lora_B": b.to(dtype)}
        params |= {f"{t.module}.{name}": v for name, v in tensors.items()}
        layers.append(adapter_layer(t, info, tensors, {}, None))
    return Adapter(params, {}, spec, layers)


def _exact_factors(delta: Tensor) -> tuple[Tensor, Tensor]:
    """``(A, B)`` with ``B A = ΔW`` exactly: the identity on the smaller side (rank min(d_out, d_in))."""
    d_out, d_in = delta.shape[-2:]
    if d_in <= d_out:
        return torch.eye(d_in, dtype=delta.dtype, device=delta.device), delta
    return delta, torch.eye(d_out, dtype=delta.dtype, device=delta.device)


def _svd_factors(delta: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``(A (k, d_in), B (d_out, k))``: the best rank-``k`` approximation ``U_k S_k V_kᵀ`` (B = U S,
    as peft), ``k = min(rank, d_out, d_in)``; at ``k = min(d_out, d_in)`` the exact factors.

    Differentiable with finite gradients everywhere. The autograd formula of ``torch.linalg.svd``
    divides by ``s_i² − s_j²`` for every pair of singular values, so a ``ΔW`` with repeated ones
    (the zeros of any low-rank delta: a merge of LoRAs) gives NaN. The truncation only depends on
    the split between the top ``k`` and the rest: ``A = V_kᵀ``, ``B = ΔW V_k``, and ``V_k`` moves
    with ``ΔW`` through the pairs across the split (``dV_k = Σ_{j∉top, i∈top} v_j (v_jᵀ d(ΔWᵀΔW)
    v_i) / (s_i² − s_j²)``, with the null space of ``ΔW`` through ``(I − VVᵀ) dΔWᵀ u_i / s_i``) and
    the rotation of the top ``k`` among themselves (the same sum over pairs within the top, which
    cancels in ``B A``); never through pairs within the rest. That is the exact derivative of the
    factors wherever the top ``k`` singular values are distinct and ``s_k > s_{k+1}``, and of their
    product ``B A`` wherever ``s_k > s_{k+1}``. A pair of equal singular values contributes nothing:
    within the top ``k`` that is exact for ``B A`` (the product does not see the rotation); across
    the split the truncation is not differentiable, and the value is finite (along a path that
    keeps ``ΔW``'s rank at most ``k``, such as a merge's weights when the merge's rank is at most
    ``k``, it is the exact derivative, the identity)."""
    d_out, d_in = delta.shape[-2:]
    m = min(d_out, d_in)
    if rank >= m:
        return _exact_factors(delta)
    u, s, vh = torch.linalg.svd(delta.detach(), full_matrices=False)
    k = rank
    v = vh.mT
    v_top, v_rest, s_top, s_rest, u_top = v[..., :k], v[..., k:], s[..., :k], s[..., k:], u[..., :k]
    s_max = s[..., :1]  # (..., 1)
    tol = max(d_out, d_in) * torch.finfo(s.dtype).eps * s_max  # a singular value (or gap) below the SVD's round-off is none
    gap = s_top[..., None, :] ** 2 - s_rest[..., :, None] ** 2  # (m - k, k): s_i² − s_j², i top, j rest
    wide = gap > (tol * s_max)[..., None]
    across = torch.where(wide, 1 / torch.where(wide, gap, 1), 0)
    within = s_top[..., None, :] ** 2 - s_top[..., :, None] ** 2  # (k, k): s_i² − s_j², both in the top k
    apart = within.abs() > (tol * s_max)[..., None]
    rotate = torch.where(apart, 1 / torch.where(apart, within, 1), 0)
    # Live in ΔW (value 0, derivative dV_k): the pairs across the split, and within the top k the
    # rotation of distinct singular vectors among themselves (it cancels in B A) ...
    projected = delta @ v_top
    move = v_rest @ (((delta @ v_rest).mT @ projected) * across) + v_top @ ((projected.mT @ projected) * rotate)
    if d_in > m:  # ... and the null space of ΔW (no singular value of its own)
        inverse = torch.where(s_top > tol, 1 / torch.where(s_top > tol, s_top, 1), 0)
        pulled = delta.mT @ (u_top * inverse[..., None, :])
        move = move + pulled - v @ (v.mT @ pulled)
    v_k = v_top + (move - move.detach())
    b = delta @ v_k
    return v_k.mT, u_top * s_top[..., None, :] + (b - b.detach())


def _energy_rank(delta: Tensor, energy: float) -> int:
    s = torch.linalg.svdvals(delta.detach())
    total = (s**2).sum()
    if total == 0:
        return 1
    captured = torch.cumsum(s**2, 0) / total
    return int(min(int((captured < energy - 1e-12).sum()) + 1, s.numel()))


# ------------------------------------------------------------------ merge_adapters


def _wrapped(t: Tensor) -> bool:
    """Whether ``t`` is inside a torch.func transform (``vmap``/``grad``): its values cannot be read."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def _check_merge_arguments(
    method: str, weights: Tensor, k: int, density: float | Tensor | None, rank: int | None, majority_sign: str
) -> None:
    if method not in METHODS:
        raise ValueError(f"merge_adapters: unknown method {method!r}; choose one of {list(METHODS)}")  # error: merge-method
    if weights.shape != (k,) or not weights.is_floating_point():
        raise ValueError(  # error: merge-weights-shape
            f"merge_adapters: weights has shape {tuple(weights.shape)} dtype {weights.dtype}, but there are {k} adapters; "
            f"pass one float weight per adapter, shape ({k},)"
        )
    if not _wrapped(weights) and not bool(torch.isfinite(weights.detach()).all()):
        raise ValueError(  # error: merge-weights-finite
            f"merge_adapters: weights {weights.detach().tolist()} hold a NaN or inf; pass finite weights"
        )
    if method in _NEEDS_DENSITY:
        if density is None:
            raise ValueError(f"merge_adapters(method={method!r}) needs density=, the fraction of each delta kept, in (0, 1]")  # error: merge-density-missing
        if isinstance(density, Tensor):
            if density.dim() != 0 or not density.is_floating_point():
                raise ValueError(f"merge_adapters: density must be a float or a 0-d float tensor, got shape {tuple(density.shape)} {density.dtype}")  # error: merge-density-tensor
            if not _wrapped(density) and not 0 < float(density.detach()) <= 1:
                raise ValueError(f"merge_adapters: density tensor {float(density.detach())} is outside (0, 1] (the fraction kept)")  # error: merge-density-tensor-range
        elif isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"merge_adapters: density={density!r} must be a number in (0, 1] (the fraction kept)")  # error: merge-density-range
    elif density is not None:
        raise ValueError(f"merge_adapters(method={method!r}) takes no density; it is for {list(_NEEDS_DENSITY)}")  # error: merge-density-unused
    if majority_sign not in ("total", "frequency"):
        raise ValueError(f"merge_adapters: majority_sign={majority_sign!r}; choose 'total' or 'frequency'")  # error: merge-majority-sign
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"merge_adapters: rank={rank!r} must be a positive int (or None: the exact merge)")  # error: merge-rank
    if method == "svd" and rank is None:
        raise ValueError("merge_adapters(method='svd') needs rank=, the rank the weighted sum is truncated to")  # error: merge-svd-rank


def _cat_factors(adapters: Sequence[AdapterLike], weights: Tensor, targets: Mapping[str, Target], dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
    """peft's ``cat``: per target ``A = [w_k s_k A_k]``, ``B = [B_k]`` over the adapters that adapt it."""
    for i, adapter in enumerate(adapters):
        if not isinstance(adapter, Adapter) or not _plain_lora(adapter.variant):
            raise ValueError(  # error: merge-cat-lora
                f"merge_adapters(method='cat'): adapters[{i}] is {type(adapter).__name__} of "
                f"{sorted({leaf.variant.name for leaf in leaf_adapters(adapter)})}, not a plain LoRA ({', '.join(_plain_loras())}); 'cat' "
                f"concatenates LoRA factors. Use method='linear' (exact for any variant) or lora_func.to_lora first"
            )
    a_parts: dict[str, list[Tensor]] = {key: [] for key in targets}
    b_parts: dict[str, list[Tensor]] = {key: [] for key in targets}
    for k, adapter in enumerate(adapters):
        lora = cast(Adapter, adapter)  # a plain LoRA: checked above
        form = cast(LowRank, lora.variant.low_rank)
        for layer in lora.layers:
            params, buffers = lora.layer_tensors(layer)
            tensors, key = params | buffers, layer.target.weight_key
            s = form.scale(layer.info, buffers)
            a_parts[key].append(tensors[form.a].to(dtype) * (weights[k].to(dtype) * s))
            b_parts[key].append(tensors[form.b].to(dtype))
    return {key: (torch.cat(a_parts[key], 0), torch.cat(b_parts[key], 1)) for key in targets}


def merge_adapters(
    adapters: Sequence[AdapterLike],
    weights: Tensor | Sequence[float],
    *,
    method: str,
    density: float | Tensor | None = None,
    rank: int | None = None,
    majority_sign: Literal["total", "frequency"] = "total",
    generator: torch.Generator | None = None,
    base: Mapping[str, Tensor] | None = None,
) -> Adapter:
    """One plain LoRA that merges ``adapters`` on their deltas ``ΔW_k = W_eff_k − W`` per target.

    Args:
      adapters: ``K`` adapters of any variant, composition or combination, on one base.
      weights: ``(K,)``: tensor (may require grad, may be batched under ``vmap``) or floats.
      method: ``"linear"`` ``Σ_k w_k ΔW_k``; ``"cat"`` the same, as peft's ``cat`` (plain
        LoRA inputs: a LoRA of rank ``Σ_k r_k`` per layer, ``w_k s_k`` folded into ``A_k``);
        ``"svd"`` the sum truncated to ``rank``; ``"ties"`` :func:`trim` to ``density``,
        :func:`elect_sign` (of the trimmed, unweighted deltas, as peft), :func:`disjoint_mean`
        of the weighted ones; ``"dare_linear"`` / ``"dare_ties"`` :func:`drop` with keep
        probability ``density`` (rescaled by ``1/density``), then the sum / TIES' election and
        mean; ``"magnitude_prune"`` :func:`trim`, then the weighted sum.
      density: the fraction of each ``ΔW_k`` kept (``(0, 1]``; a float or a 0-d tensor,
        batched under ``vmap`` for a sweep); only for the pruning methods.
      rank: ``None``: the exact result: ``cat`` form for ``"cat"`` and for ``"linear"`` on
        plain LoRAs (``Σ_k r_k · (d_out + d_in)`` numbers per layer), else per layer a LoRA of
        rank ``min(d_out, d_in)`` whose ``A`` (or ``B``) is the identity and the other factor
        the merged ``ΔW``: ``min(d_out, d_in) · (d_out + d_in)`` numbers per layer, more than the
        dense ``ΔW`` and far more than LoRA inputs of rank ``r`` (``r · (d_out + d_in)``): for a
        square ``d x d`` layer twice the dense weight and ``d / r`` times a rank-``r`` input;
        ``save_peft`` warns when it writes one. ``k``: the best rank-``k`` LoRA by SVD of the
        merged ``ΔW`` (peft's ``*_svd`` types), ``k · (d_out + d_in)`` numbers per layer; at
        ``k >= min(d_out, d_in)`` the exact form. Differentiable with finite gradients (see
        :func:`_svd_factors`: exact where the truncation is differentiable).
      majority_sign: ``"total"`` or ``"frequency"`` (TIES).
      generator: the CPU or device ``torch.Generator`` of DARE's draws (reproducible); ``None``
        uses the global RNG. Under ``vmap`` a DARE merge needs ``randomness="same"`` (every
        member drops with the same draw) or ``"different"``.
      base: ``lora_func.base_params(model)``: the weights the deltas are measured on. Needed
        unless every leaf is a plain LoRA (whose ``ΔW = s B A`` does not read ``W``).

    Returns a LoRA ``Adapter`` (``alpha = r`` per layer, scale 1; per-layer ranks may differ:
    ``save_peft`` writes a ``rank_pattern``), of the size ``rank`` says, in the adapters' dtype
    promoted with the base's and at least fp32. Its tensors carry the graph back to
    ``weights`` (a tensor, or a list holding tensors) and the adapters' tensors (learned
    merges); ``.detach()`` gives a fresh LoRA to train or save. Biases are not merged: an
    adapter that changes a layer's bias (IA3 on a biased layer) is refused. Refused too, before
    any work: adapters on different devices, or built on models of other widths (a layer of one
    name and two shapes), NaN/inf in an adapter or its delta, and an adapter derived from other
    base weights than ``base``'s (PiSSA, OLoRA, ...: by its recorded fingerprint).
    """
    where = "merge_adapters"
    adapters = _check_adapters(adapters, where)
    if not isinstance(weights, Tensor):
        try:
            if isinstance(weights, Sequence) and any(isinstance(w, Tensor) for w in weights):
                # tensors that may require grad (learned weights): stacked, so their graph is kept
                weights = torch.stack([torch.as_tensor(w).to(torch.float64) for w in weights])
            else:
                weights = torch.as_tensor(weights, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            weights = torch.tensor([[]])  # not numbers: reported with the expected form
    _check_merge_arguments(method, weights, len(adapters), density, rank, majority_sign)
    if method == "cat":
        targets = _targets(adapters, where)
        _check_bias(adapters, targets, where)
        dtype = _work_dtype(adapters, None, targets)
        factors = _cat_factors(adapters, weights, targets, dtype)
        if rank is None:
            return _lora(factors, targets, dtype)
        return _lora({key: _svd_factors(b @ a, rank) for key, (a, b) in factors.items()}, targets, dtype)
    if method == "linear" and rank is None and all(isinstance(a, Adapter) and _plain_lora(a.variant) for a in adapters):
        return merge_adapters(adapters, weights, method="cat", base=base)
    targets, deltas = _deltas(adapters, base, where)
    dtype = next(iter(deltas.values())).dtype
    merged: dict[str, Tensor] = {}
    for key, delta in deltas.items():
        w = weights.to(delta.dtype).reshape(-1, *([1] * (delta.dim() - 1)))
        if method in ("ties", "magnitude_prune"):
            delta = delta * torch.stack([trim(d, cast("float | Tensor", density)) for d in delta])  # checked: not None
        elif method in ("dare_linear", "dare_ties"):
            noise = torch.rand(delta.shape, generator=generator, dtype=delta.dtype, device=delta.device)
            delta = drop(delta, cast("float | Tensor", density), noise)  # checked: not None
        if method in ("ties", "dare_ties"):
            merged[key] = disjoint_mean(delta * w, elect_sign(delta, majority_sign))
        else:
            merged[key] = (delta * w).sum(0)
    if rank is None:
        return _lora({key: _exact_factors(d) for key, d in merged.items()}, targets, dtype)
    return _lora({key: _svd_factors(d, rank) for key, d in merged.items()}, targets, dtype)


# ------------------------------------------------------------------ to_lora


@dataclasses.dataclass(frozen=True)
class LoraConversion:
    """What :func:`to_lora` returns: ``adapter`` (a plain LoRA) and ``errors``, per target module
    the relative Frobenius error ``‖ΔW − ΔW_lora‖_F / ‖ΔW‖_F`` of that layer (0 when ΔW is 0),
    as floats. Unpacks as ``lora, errors = to_lora(...)``."""

    adapter: Adapter
    errors: dict[str, float]

    def __iter__(self):
        return iter((self.adapter, self.errors))


def to_lora(
    adapter: AdapterLike,
    *,
    rank: int | None = None,
    energy: float | None = None,
    base: Mapping[str, Tensor] | None = None,
) -> LoraConversion:
    """``adapter`` (any variant, composition, combination or merge) as a plain LoRA, by SVD of
    each target's ``ΔW = W_eff − W``, with the error it makes per layer.

    Give exactly one of ``rank`` (a positive int: every layer's rank, ``min(rank, d_out, d_in)``)
    or ``energy`` (in ``(0, 1]``: per layer the smallest rank whose singular values keep that
    fraction of ``‖ΔW‖_F²``; ranks then differ per layer, ``save_peft`` writes a
    ``rank_pattern``). ``base``: ``lora_func.base_params(model)``, needed unless every leaf is a
    plain LoRA. The result exports everywhere a LoRA does (``save_peft``: peft, vLLM, LoRAX).
    Biases are not converted (an adapter that changes a bias is refused). Size: ``k · (d_out +
    d_in)`` numbers per layer of rank ``k``. Differentiable with finite gradients, as
    :func:`merge_adapters`' ``rank=k``; the same refusals.
    """
    where = "to_lora"
    if (rank is None) == (energy is None):
        raise ValueError("to_lora: give exactly one of rank= (an int) or energy= (a fraction of ‖ΔW‖², in (0, 1])")  # error: to-lora-rank-or-energy
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"to_lora: rank={rank!r} must be a positive int")  # error: to-lora-rank
    if energy is not None and (isinstance(energy, bool) or not isinstance(energy, (int, float)) or not 0 < energy <= 1):
        raise ValueError(f"to_lora: energy={energy!r} must be a number in (0, 1]")  # error: to-lora-energy
    (adapter,) = _check_adapters([adapter], where)
    targets, deltas = _deltas([adapter], base, where)
    factors, errors = {}, {}
    for key, delta in deltas.items():
        d = delta[0]
        k = rank if rank is not None else _energy_rank(d, cast(float, energy))  # one of the two: checked
        a, b = factors[key] = _svd_factors(d, k)
        with torch.no_grad():
            norm = torch.linalg.matrix_norm(d)
            errors[targets[key].module] = 0.0 if norm == 0 else float(torch.linalg.matrix_norm(d - b @ a) / norm)
    return LoraConversion(_lora(factors, targets, d.dtype), errors)

