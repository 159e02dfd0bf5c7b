"""AdaMSS's adaptive subspace allocation (ASA) as a pure function of the adapter.

peft keeps ASA as state mutated inside the training loop (``AdamssAsaCallback``, i.e.
``model.base_model.update_and_allocate(step)`` after ``optimizer.step()``, which sets
``requires_grad = False`` on the pruned subspaces' parameters). Here the same computation is a
function of explicit values, in the shape of :mod:`lora_func.rank_budget`'s AdaLoRA schedule::

    state = asa_init(adapter)
    for step, batch in enumerate(batches, start=1):
        grads = torch.func.grad(loss)(adapter.params)
        updated = adapter.with_params(optimizer_step(adapter.params, grads))
        adapter = keep_frozen(adapter, updated, state.active)   # pruned subspaces stay as they were
        state, mask = asa_step(state, adapter, grads, step)      # mask: None, or the new active set

``asa_step`` is peft's ``AdamssModel.update_and_allocate`` step for step, given the same
(post-step) parameters and gradients: from ``init_warmup`` to ``final_warmup`` (inclusive) each
active subspace's entries get the sensitivity ``|p ⊙ g|``, an uncertainty EMA
(``asa_uncertainty_beta``, of ``|sensitivity − its EMA before the step|``) and a sensitivity EMA
(``asa_importance_beta``); every ``mask_interval`` steps of that window the subspaces are scored
(the mean of sensitivity × uncertainty over the subspace's ``A_k`` plus that over its ``B_k``),
the still-active subspaces over all layers that score strictly above the ``target``-th best stay active (``target − 1`` of them, peft's rule; all when at most ``target`` are active) (``target =
asa_target_subspaces + (K_total − asa_target_subspaces) · (1 − progress)^asa_schedule_exponent``,
``K_total`` all the adapter's subspaces), the others are pruned for good (peft freezes them: they
keep their values and still act in the forward), and the EMAs restart from zero. Settings are the
spec's options (``AdapterSpec("adamss", ..., use_asa=True, asa_target_subspaces=, ...)``).

It fits the rank budget's machinery in its signature ``(state, adapter, grads, step) -> (state,
mask)``, not in its mechanics: AdaLoRA zeroes single singular values (its masked triplets can
come back), ASA freezes whole subspaces (``A_k`` and ``B_k``) and never reactivates one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lora_func.adapter import AdapterLike, leaf_adapters, leaves

__all__ = ["AsaState", "asa_init", "asa_step", "asa_target", "keep_frozen"]

VARIANT = "adamss"


class AsaState(NamedTuple):
    """ASA's state: tensors keyed by the adapter's flat keys.

    Attributes:
      exp_avg_ipt: the sensitivity EMA of each ``adamss_A`` / ``adamss_B`` entry (shape of the tensor).
      exp_avg_unc: the uncertainty EMA, likewise.
      active: module name -> bool ``(K,)``, the subspaces still trained (peft's ``requires_grad``).
    """

    exp_avg_ipt: dict[str, Tensor]
    exp_avg_unc: dict[str, Tensor]
    active: dict[str, Tensor]


def _layers(adapter: AdapterLike, where: str) -> tuple[list[tuple[str, str]], Mapping[str, Any]]:
    """``[(key prefix of the layer, module name)]`` of every AdaMSS layer in application order, and the settings."""
    leaf_adapters(adapter, where)
    found, settings = [], []
    for prefix, leaf in leaves(adapter):
        if leaf.spec.variant != VARIANT:
            continue
        if leaf.stack_shape:
            raise ValueError(  # error: asa-stacked
                f"{where}: the adamss part is a stack (stack_shape {leaf.stack_shape}); ASA prunes one adapter's subspaces: "
                f"run it per member (lora_func.unstack)"
            )
        settings.append(dict(leaf.spec.options))
        found += [(f"{prefix}{layer.target.module}.", layer.target.module) for layer in leaf.layers]
    if not found:
        raise ValueError(f"{where}: the adapter has no adamss part; build one with AdapterSpec('adamss', ..., use_asa=True)")  # error: asa-no-adamss
    if any(s != settings[0] for s in settings) or not settings[0]["use_asa"]:
        raise ValueError(  # error: asa-settings
            f"{where}: ASA needs one set of adamss settings with use_asa=True (peft's AdamssConfig(use_asa=True)); this "
            f"adapter's adamss parts have use_asa={sorted({s['use_asa'] for s in settings})} and "
            f"{len({tuple(sorted(s.items())) for s in settings})} distinct settings"
        )
    return found, settings[0]


def asa_init(adapter: AdapterLike) -> AsaState:
    """ASA's initial state for ``adapter``'s AdaMSS layers: zero EMAs, every subspace active."""
    layers, _ = _layers(adapter, "asa_init(adapter)")
    keys = [f"{p}{n}" for p, _ in layers for n in ("adamss_A", "adamss_B")]
    zeros = {k: torch.zeros_like(adapter.params[k]).detach() for k in keys}
    active = {m: torch.ones(adapter.params[f"{p}adamss_A"].shape[0], dtype=torch.bool) for p, m in layers}
    return AsaState(zeros, {k: v.clone() for k, v in zeros.items()}, active)


def asa_target(adapter: AdapterLike, step: int) -> int | None:
    """peft's ``_schedule_threshold``: the number of subspaces kept at ``step`` (``None`` before
    ``init_warmup``), decreasing from all the adapter's subspaces to ``asa_target_subspaces`` at
    ``final_warmup``."""
    layers, s = _layers(adapter, "asa_target(adapter)")
    total = sum(int(adapter.params[f"{p}adamss_A"].shape[0]) for p, _ in layers)
    if step < s["init_warmup"]:
        return None
    if step > s["final_warmup"]:
        return int(s["asa_target_subspaces"])
    progress = 1.0 - (step - s["init_warmup"]) / (s["final_warmup"] - s["init_warmup"])
    progress = max(0.0, min(1.0, progress))
    return int(s["asa_target_subspaces"] + (total - s["asa_target_subspaces"]) * (progress ** s["asa_schedule_exponent"]))


def _subspace_blocks(adapter: AdapterLike, prefix: str) -> list[tuple[tuple[int, slice], tuple[slice, slice]]]:
    """Per subspace ``k``: its ``A_k`` entries ``(k, :ρ_k)`` and its ``B_k`` entries ``(rows, :ρ_k)``."""
    ranks = adapter.buffers[f"{prefix}subspace_ranks"].tolist()
    sizes = torch.bincount(adapter.buffers[f"{prefix}subspace"], minlength=len(ranks)).tolist()
    out, start = [], 0
    for k, (own, size) in enumerate(zip(ranks, sizes, strict=True)):
        out.append(((k, slice(0, own)), (slice(start, start + size), slice(0, own))))
        start += size
    return out


def asa_step(state: AsaState, adapter: AdapterLike, grads: Mapping[str, Tensor], step: int) -> tuple[AsaState, dict[str, Tensor] | None]:
    """One step of ASA (peft's ``update_and_allocate(step)``): ``adapter`` holds the parameters
    after this step's update, ``grads`` this step's gradients of ``adapter.params`` (of every
    ``adamss_A`` / ``adamss_B``; a pruned subspace's entries are not read), ``step`` the step
    peft's callback passes (``state.global_step``, 1 after the first update). Returns the new
    state and, at a pruning step, the new active set (module name -> bool ``(K,)``), else ``None``."""
    layers, s = _layers(adapter, "asa_step(adapter)")
    missing = sorted({f"{p}{n}" for p, _ in layers for n in ("adamss_A", "adamss_B")} - set(grads))
    if missing:
        raise KeyError(f"asa_step: grads lacks {missing[:3]}: pass the gradients of every adamss tensor (of adapter.params)")  # error: asa-missing-grads
    if not s["init_warmup"] <= step <= s["final_warmup"]:
        return state, None
    beta, beta_unc = s["asa_importance_beta"], s["asa_uncertainty_beta"]
    ipt_avg, unc_avg = dict(state.exp_avg_ipt), dict(state.exp_avg_unc)
    blocks = {p: _subspace_blocks(adapter, p) for p, _ in layers}
    for prefix, module in layers:
        for name, which in (("adamss_A", 0), ("adamss_B", 1)):
            key = f"{prefix}{name}"
            ipt = (adapter.params[key].detach() * grads[key].detach()).abs()
            unc_new = state.exp_avg_unc[key].mul(beta_unc).add((ipt - state.exp_avg_ipt[key]).abs(), alpha=1 - beta_unc)
            ipt_new = state.exp_avg_ipt[key].mul(beta).add(ipt, alpha=1 - beta)
            keep = torch.zeros_like(ipt, dtype=torch.bool)
            for k, block in enumerate(blocks[prefix]):
                keep[block[which]] = bool(state.active[module][k])
            ipt_avg[key], unc_avg[key] = torch.where(keep, ipt_new, ipt_avg[key]), torch.where(keep, unc_new, unc_avg[key])
    if step % s["mask_interval"] != 0:
        return AsaState(ipt_avg, unc_avg, state.active), None
    scored = []
    for prefix, module in layers:
        prod = {n: ipt_avg[f"{prefix}{n}"] * unc_avg[f"{prefix}{n}"] for n in ("adamss_A", "adamss_B")}
        for k, (a_block, b_block) in enumerate(blocks[prefix]):
            if state.active[module][k]:  # peft scores only the subspaces whose EMAs it kept
                score = prod["adamss_A"][a_block].contiguous().mean() + prod["adamss_B"][b_block].contiguous().mean()
                scored.append((module, k, score))
    target = asa_target(adapter, step)
    active = {m: v.clone() for m, v in state.active.items()}
    if scored and target is not None:
        scores = torch.stack([score for _, _, score in scored])
        threshold = float("-inf") if target >= len(scored) else -torch.kthvalue(-scores, target)[0].item()
        for module, k, score in scored:
            active[module][k] = float(score) > threshold
    fresh = asa_init(adapter)
    return AsaState(fresh.exp_avg_ipt, fresh.exp_avg_unc, active), active


def keep_frozen(previous: AdapterLike, updated: AdapterLike, active: Mapping[str, Tensor]) -> AdapterLike:
    """``updated`` with every pruned subspace's ``A_k`` and ``B_k`` entries as in ``previous``: what
    peft's ``requires_grad = False`` does to an optimizer step, whatever the optimizer."""
    layers, _ = _layers(updated, "keep_frozen(updated)")
    params = dict(updated.params)
    for prefix, module in layers:
        a_key, b_key = f"{prefix}adamss_A", f"{prefix}adamss_B"
        keep_a = active[module].to(params[a_key].device)
        keep_b = keep_a[updated.buffers[f"{prefix}subspace"]]
        params[a_key] = torch.where(keep_a[:, None, None], params[a_key], previous.params[a_key])
        params[b_key] = torch.where(keep_b[:, None], params[b_key], previous.params[b_key])
    return updated.with_params(params)
