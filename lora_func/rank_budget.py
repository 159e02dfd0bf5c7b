"""AdaLoRA's rank budget and orthogonality penalty, and KaSA's regulariser, as pure functions of an adapter.

peft keeps AdaLoRA's allocator as state mutated inside the training loop
(``model.base_model.update_and_allocate(step)`` after ``optimizer.step()``, masking the
singular values in place). Here the same computation is a function of explicit values::

    state = budget_init(adapter)
    for step, batch in enumerate(batches, start=1):
        loss = task_loss(adapter, batch) + orth_penalty(adapter)
        grads = torch.func.grad(...)(adapter.params)       # or loss.backward()
        adapter = adapter.with_params(optimizer_step(adapter.params, grads))
        state, mask = budget_step(state, adapter, grads, step)
        adapter = apply_mask(adapter, mask)                # a new adapter; None: unchanged

``budget_step`` is peft's ``AdaLoraModel.update_and_allocate`` step for step, given the same
(post-step) parameters and the same gradients: the sensitivity ``|p ⊙ g|`` of every ``lora_A``,
``lora_E``, ``lora_B`` entry smoothed by an EMA (``beta1``) with an uncertainty EMA (``beta2``);
a budget of triplets that stays at ``init_r`` per layer until ``tinit``, decreases cubically to
``target_r`` per layer at ``total_step - tfinal`` and stays there; every ``deltaT`` steps of the
decrease (and once at ``total_step - tfinal``) the triplets whose score (the ``E`` entry's plus the
row/column means of ``A`` and ``B``) is at most the ``(init budget − budget)``-th smallest are masked.
After ``total_step - tfinal`` the final mask is returned at every step, as peft re-applies it.
The settings are the adapter spec's options (``AdapterSpec("adalora", ..., target_r=, tinit=,
...)``), so the schedule is reproducible from a saved adapter.

Where peft fails (a masking step whose budget equals the initial one: ``torch.kthvalue(k=0)``),
nothing is masked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lora_func.adapter import AdapterLike, leaf_adapters, leaves

__all__ = ["BudgetState", "apply_mask", "budget", "budget_init", "budget_step", "kasa_penalty", "orth_penalty", "ranks"]

VARIANT = "adalora"


class BudgetState(NamedTuple):
    """The allocator's state: a pytree of tensors keyed by the adapter's flat keys.

    Attributes:
      exp_avg_ipt: the EMA of each trainable entry's sensitivity ``|p ⊙ g|`` (shape of the tensor).
      exp_avg_unc: the EMA of its uncertainty ``|ipt − exp_avg_ipt|``.
      final_mask: the mask fixed at ``total_step - tfinal`` (``lora_E`` key -> bool ``(r,)``),
        re-applied at every later step; ``None`` before.
    """

    exp_avg_ipt: dict[str, Tensor]
    exp_avg_unc: dict[str, Tensor]
    final_mask: dict[str, Tensor] | None = None


def _layers(adapter: AdapterLike, where: str) -> tuple[list[tuple[str, str, str]], Mapping[str, Any]]:
    """``[(A key, E key, B key)]`` of every AdaLoRA layer, in application order, and the settings."""
    leaf_adapters(adapter, where)
    found, settings = [], []
    for prefix, leaf in leaves(adapter):
        if leaf.spec.variant != VARIANT:
            continue
        settings.append(dict(leaf.spec.options))
        found += [tuple(f"{prefix}{layer.target.module}.{n}" for n in ("lora_A", "lora_E", "lora_B")) for layer in leaf.layers]
    if not found:
        raise ValueError(f"{where}: the adapter has no adalora part; build one with AdapterSpec('adalora', ...)")  # error: budget-no-adalora
    if any(s != settings[0] for s in settings):
        raise ValueError(  # error: budget-settings-differ
            f"{where}: the adalora parts of this adapter have different schedule settings; one budget needs one set"
        )
    return [(a, e, b) for a, e, b in found], settings[0]


def _zeros(adapter: AdapterLike, keys: list[str]) -> dict[str, Tensor]:
    return {k: torch.zeros_like(adapter.params[k]).detach() for k in keys}


def budget_init(adapter: AdapterLike) -> BudgetState:
    """The allocator's initial state for ``adapter``'s AdaLoRA layers (zeros)."""
    layers, _ = _layers(adapter, "budget_init(adapter)")
    keys = [k for triplet in layers for k in triplet]
    return BudgetState(_zeros(adapter, keys), _zeros(adapter, keys), None)


def budget(adapter: AdapterLike, step: int) -> tuple[int, bool]:
    """peft's ``budget_schedule``: the number of triplets kept at ``step`` and whether ``step``
    masks (the decreasing phase, every ``deltaT`` steps). The initial budget is the sum of the
    layers' ranks; the target is ``target_r`` per layer."""
    layers, s = _layers(adapter, "budget(adapter)")
    init_bgt = sum(int(adapter.params[a].shape[-2]) for a, _, _ in layers)
    target_bgt = s["target_r"] * len(layers)
    tinit, tfinal, total = s["tinit"], s["tfinal"], s["total_step"]
    if step <= tinit:
        return init_bgt, False
    if step > total - tfinal:
        return target_bgt, True
    mul_coeff = 1 - (step - tinit) / (total - tfinal - tinit)
    return int((init_bgt - target_bgt) * (mul_coeff**3) + target_bgt), step % s["deltaT"] == 0


def _mask_to_budget(state: BudgetState, layers: list[tuple[str, str, str]], init_bgt: int, kept: int) -> dict[str, Tensor]:
    scores = {}
    for a, e, b in layers:
        score = {k: state.exp_avg_ipt[k] * state.exp_avg_unc[k] for k in (a, e, b)}
        # A's row means (r, 1) and B's column means (r,) as one (r, 2), summed with E's (r, 1).
        rows = torch.cat([score[a].mean(-1, keepdim=True), score[b].mean(-2)[..., None]], dim=-1)
        scores[e] = score[e].reshape(*score[e].shape[:-2], -1) + rows.sum(-1)
    k = init_bgt - kept
    if k <= 0:
        return {e: torch.ones_like(s, dtype=torch.bool) for e, s in scores.items()}
    threshold = torch.kthvalue(torch.cat(list(scores.values()), dim=-1), k=k, dim=-1).values[..., None]
    return {e: s > threshold for e, s in scores.items()}


def budget_step(
    state: BudgetState, adapter: AdapterLike, grads: Mapping[str, Tensor], step: int
) -> tuple[BudgetState, dict[str, Tensor] | None]:
    """One step of AdaLoRA's allocator (peft's ``update_and_allocate(step)``): ``adapter`` holds the
    parameters after this step's update, ``grads`` this step's gradients of ``adapter.params``
    (those of every ``lora_A``, ``lora_E``, ``lora_B``), ``step`` the 1-based step (a Python int).
    Returns the new state and the mask (``lora_E`` key -> bool ``(r,)``, ``True``: kept) to apply
    with :func:`apply_mask`, or ``None`` when this step masks nothing (peft leaves ``E`` alone)."""
    layers, s = _layers(adapter, "budget_step(adapter)")
    keys = [k for triplet in layers for k in triplet]
    missing = sorted(set(keys) - set(grads))
    if missing:
        raise KeyError(f"budget_step: grads lacks {missing[:3]}: pass the gradients of every adalora tensor (of adapter.params)")  # error: budget-missing-grads
    end = s["total_step"] - s["tfinal"]
    if step > end:
        return state, state.final_mask
    init_bgt = sum(int(adapter.params[a].shape[-2]) for a, _, _ in layers)
    if step < end:
        beta1, beta2 = s["beta1"], s["beta2"]
        ipt_avg, unc_avg = dict(state.exp_avg_ipt), dict(state.exp_avg_unc)
        for k in keys:
            ipt = (adapter.params[k].detach() * grads[k].detach()).abs()
            ipt_avg[k] = beta1 * state.exp_avg_ipt[k] + (1 - beta1) * ipt
            unc_avg[k] = beta2 * state.exp_avg_unc[k] + (1 - beta2) * (ipt - ipt_avg[k]).abs()
        state = BudgetState(ipt_avg, unc_avg, None)
        kept, masks = budget(adapter, step)
        return state, (_mask_to_budget(state, layers, init_bgt, kept) if masks else None)
    # step == total_step - tfinal: the final allocation at the target budget, then the EMAs reset.
    kept, _ = budget(adapter, step)
    final = _mask_to_budget(state, layers, init_bgt, kept)
    fresh = budget_init(adapter)
    return BudgetState(fresh.exp_avg_ipt, fresh.exp_avg_unc, final), final


def apply_mask(adapter: AdapterLike, mask: Mapping[str, Tensor] | None) -> AdapterLike:
    """A new adapter whose ``lora_E`` entries are zero where ``mask`` is ``False`` (peft's
    ``masked_fill_`` on the singular values); ``None``: ``adapter`` itself."""
    if mask is None:
        return adapter
    params = dict(adapter.params)
    for key, keep in mask.items():
        params[key] = params[key] * keep[..., None].to(params[key].dtype)
    return adapter.with_params(params)


def ranks(mask: Mapping[str, Tensor]) -> dict[str, int]:
    """Each layer's kept rank under ``mask``, by module name (the ``lora_E`` key without its suffix)."""
    return {key.removesuffix(".lora_E"): int(keep.sum()) for key, keep in mask.items()}


def orth_penalty(adapter: AdapterLike) -> Tensor:
    """peft's AdaLoRA regulariser, added to the loss: ``orth_reg_weight`` times the mean over the
    ``lora_A`` and ``lora_B`` tensors of ``‖A Aᵀ − I‖_F`` and ``‖Bᵀ B − I‖_F``; differentiable.
    A triplet whose ``A`` row (or ``B`` column) is zero counts as absent (``I``'s entry 0): peft
    penalises only the triplets its resized tensors hold.
    A stacked adapter gets one value per member."""
    layers, s = _layers(adapter, "orth_penalty(adapter)")
    terms = []
    for a_key, _, b_key in layers:
        for cov in (adapter.params[a_key] @ adapter.params[a_key].mT, adapter.params[b_key].mT @ adapter.params[b_key]):
            # I over the triplets that exist: a zero row of A (column of B) is a triplet that peft
            # cut away (a rank_pattern checkpoint, padded on load), absent from peft's penalty.
            eye = torch.diag_embed((cov.diagonal(dim1=-2, dim2=-1) != 0).to(cov.dtype))
            terms.append(torch.linalg.matrix_norm(cov - eye))
    return s["orth_reg_weight"] * (sum(terms[1:], terms[0]) / len(terms))




def kasa_penalty(adapter: AdapterLike) -> Tensor:
    """peft's KaSA regulariser (``LoraModel._get_kasa_loss``), added to the loss: the sum over the
    KaSA layers of ``beta·‖ΔΣ‖² + gamma·(‖BᵀB − I‖_F + ‖A Aᵀ − I‖_F)`` with ``ΔΣ = lora_diag``,
    ``beta`` and ``gamma`` the spec's options; differentiable, in the adapter dtype (at least
    fp32; peft computes in fp32). A stacked adapter gets one value per member."""
    leaf_adapters(adapter, "kasa_penalty(adapter)")
    terms = []
    for prefix, leaf in leaves(adapter):
        if leaf.spec.variant != "kasa":
            continue
        options = dict(leaf.spec.options)
        for layer in leaf.layers:
            key = f"{prefix}{layer.target.module}."
            diag, a, b = (adapter.params[key + n] for n in ("lora_diag", "lora_A", "lora_B"))
            compute = torch.promote_types(a.dtype, torch.float32)
            diag, a, b = diag.to(compute), a.to(compute), b.to(compute)
            eye = torch.eye(diag.shape[-1], dtype=compute, device=diag.device)
            orth = torch.linalg.matrix_norm(b.mT @ b - eye) + torch.linalg.matrix_norm(a @ a.mT - eye)
            terms.append(options["beta"] * diag.square().sum(-1) + options["gamma"] * orth)
    if not terms:
        raise ValueError("kasa_penalty(adapter): the adapter has no kasa part; build one with AdapterSpec('kasa', ...)")  # error: kasa-penalty-no-kasa
    return sum(terms[1:], terms[0])
