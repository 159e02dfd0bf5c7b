"""EVA: Explained Variance Adaptation (Paischer et al. 2024, arXiv 2410.07170).

A data-driven initialisation of LoRA. ``calibrate`` runs peft's algorithm
(``peft/tuners/lora/eva.py``, peft 0.21.2) on the target layers' inputs:

1. Layers whose inputs are identical on the first calibration batch (q/k/v of one
   attention block) share one decomposition; the first of them in module order owns it.
2. Per owner, a mean-centred incremental PCA (peft's ``IncrementalPCA.partial_fit``:
   fp64 mean/variance, randomized SVD with ``q = 2k``, 4 subspace iterations) with
   ``k = round(r·rho)`` components is updated batch by batch (cycling over the batches, as
   peft's ``itertools.cycle``) until, for every layer, the cosine similarity of each needed
   component to the previous step is ``>= tau``.
3. After every step the ranks are redistributed: all layers' explained-variance ratios are
   pooled and the top ``Σ_l r_l`` are kept; a layer's rank is the number of its components
   kept (0: the layer gets no adapter).
4. ``A_l`` = the top ``rank_l`` principal directions (rows), divided by
   ``sqrt(singular value)`` with ``whiten``; ``B = 0``. When the rank changed,
   ``alpha_l = alpha·rank_l/r`` (peft's ``adjust_scaling_factors``; peft applies the same
   factor with rsLoRA).

The forward is LoRA's: ``W_eff = W + s·B A``, ``s = alpha_l / rank_l`` (``/ sqrt(rank_l)``
with ``use_rslora``). See docs/variants/eva.md for where lora_func differs from peft.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import torch
from torch import Tensor

from lora_func.variants import FLAG, Calibration, LayerInfo, Option, TensorDict, lora, one_of, real, whole

SVD_METHODS = ("lowrank", "full")
LOWRANK_NITER = 4  # peft IncrementalPCA(lowrank=True) default: lowrank_q = 2·n_components, niter = 4


# ----------------------------------------------------------------------------------- init


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    if not isinstance(calibration, Tensor) or tuple(calibration.shape) != (info.r, info.d_in):
        got = tuple(calibration.shape) if isinstance(calibration, Tensor) else type(calibration).__name__
        raise ValueError(  # error: eva-init-directions
            f"eva init expects the principal directions ({info.r}, {info.d_in}) from eva's calibrate, got {got}; "
            f"build EVA adapters with init_adapter(model, spec, calibration=batches)"
        )
    # contiguous: the SVD returns transposed views, and a strided A would make the adapter's
    # matmuls differ in the last bit from the same adapter after save/load.
    lora_a = calibration.to(device=weight.device, dtype=dtype).contiguous()
    lora_b = torch.zeros((info.d_out, info.r), dtype=dtype, device=weight.device)
    return {"lora_A": lora_a, "lora_B": lora_b}, {}


# ------------------------------------------------------------------- incremental PCA (peft)


def _randomized_svd(a: Tensor, q: int, niter: int, seed: int) -> tuple[Tensor, Tensor]:
    """``torch.svd_lowrank(a, q, niter)`` (Halko et al. 2009, Alg. 5.1) returning ``(S, Vh)``,
    with the random test matrix drawn from a CPU generator seeded with ``seed`` instead of the
    global RNG (peft forks the global RNG and seeds it with 42 on every call): the same
    matrix on every call and on every device, and the global RNG untouched."""
    tall = a.shape[0] >= a.shape[1]
    a_t = a if tall else a.mH
    r = torch.randn(a_t.shape[-1], q, generator=torch.Generator().manual_seed(seed), dtype=a.dtype).to(a.device)
    basis = torch.linalg.qr(a_t @ r).Q
    for _ in range(niter):
        basis = torch.linalg.qr(a_t.mH @ basis).Q
        basis = torch.linalg.qr(a_t @ basis).Q
    u, s, vh = torch.linalg.svd(basis.mH @ a_t, full_matrices=False)
    # a_t ≈ (Q u) s vh; for a wide ``a`` the right singular vectors are Q u.
    return s, (vh if tall else (basis @ u).mH)


def _svd(x: Tensor, k: int, method: str, seed: int) -> tuple[Tensor, Tensor]:
    if method == "full":
        _, s, vh = torch.linalg.svd(x, full_matrices=False)
    else:
        s, vh = _randomized_svd(x, 2 * k, LOWRANK_NITER, seed)
    # peft's svd_flip(u_based_decision=False): the largest-|.| entry of each row of Vh is positive.
    signs = torch.sign(vh.gather(1, vh.abs().argmax(dim=1, keepdim=True)))
    return s, vh * signs


def _partial_fit(state: dict[str, Any] | None, rows: Tensor, k: int, method: str, seed: int) -> dict[str, Any]:
    """One step of peft's ``IncrementalPCA.partial_fit`` (sklearn's IPCA), as a pure function.

    dtypes follow peft: fp64 running mean/variance; the first SVD is in the rows' dtype
    (fp32), later ones in fp64 (peft's stacked matrix is promoted by the fp64 mean correction).
    """
    x = rows.clone()
    n_new = x.shape[0]
    n_old = 0 if state is None else state["n"]
    n_tot = n_old + n_new
    last_sum = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device) if state is None else state["mean"] * n_old
    new_sum = x.sum(dim=0, dtype=torch.float64)
    mean = (last_sum + new_sum) / n_tot
    temp = x - new_sum / n_new
    correction = temp.sum(dim=0, dtype=torch.float64).square()
    new_unnormalized_var = temp.square().sum(dim=0, dtype=torch.float64) - correction / n_new
    if state is None:
        var = new_unnormalized_var / n_tot
        stacked = (x.to(torch.float64) - mean).to(x.dtype)
    else:
        last_over_new = n_old / n_new
        var = (
            state["var"] * n_old
            + new_unnormalized_var
            + last_over_new / n_tot * (last_sum / last_over_new - new_sum).square()
        ) / n_tot
        batch_mean = x.mean(dim=0)
        correction_factor = math.sqrt((n_old / n_tot) * n_new)
        mean_correction = correction_factor * (state["mean"] - batch_mean)
        stacked = torch.vstack((state["singular"].view(-1, 1) * state["components"], x - batch_mean, mean_correction))
    s, vh = _svd(stacked, k, method, seed)
    return {
        "n": n_tot,
        "mean": mean,
        "var": var,
        "components": vh[:k],
        "singular": s[:k],
        "ratio": (s.square() / torch.sum(var * n_tot))[:k],
    }


# ------------------------------------------------------------------------- rank redistribution


def _distribute(
    ratios: Mapping[str, Tensor], owner: Mapping[str, str], k: Mapping[str, int], budget: int
) -> dict[str, int]:
    """peft's ``_get_rank_distribution``: pool the explained-variance ratios of every layer (a
    layer sharing a decomposition contributes its owner's), keep the ``budget`` largest.

    Layers are pooled owners first, then sharers, each in module order; the sort is stable,
    so ties go to the earlier layer (peft's sort is not stable; its final swap only makes
    sure an owner has the largest rank of its group, which a stable sort already gives).
    """
    order = [m for m in owner if owner[m] == m] + [m for m in owner if owner[m] != m]
    keys = [m for m in order for _ in range(k[m])]
    values = torch.cat([ratios[owner[m]][: k[m]].to(torch.float64) for m in order])
    kept = torch.argsort(values, descending=True, stable=True)[:budget].tolist()
    counts = dict.fromkeys(owner, 0)
    for i in kept:
        counts[keys[i]] += 1
    for m, o in owner.items():
        if m != o and counts[o] < counts[m]:
            counts[o], counts[m] = counts[m], counts[o]
    return counts


# ------------------------------------------------------------------------------- calibrate


def _group(first: Mapping[str, Tensor]) -> dict[str, str]:
    """``{layer: owner}``: the first layer (in order) whose first-batch inputs are identical."""
    owner: dict[str, str] = {}
    buckets: dict[tuple, list[str]] = {}
    for m, x in first.items():
        xd = x.to(torch.float64)
        key = (tuple(x.shape), x.dtype, float(xd.sum()), float(xd.abs().sum()))
        match = next((o for o in buckets.get(key, []) if torch.equal(first[o], x)), None)
        if match is None:
            buckets.setdefault(key, []).append(m)
            owner[m] = m
        else:
            owner[m] = match
    return owner


def calibrate(
    layer_inputs: Iterable[Mapping[str, Tensor]],
    infos: Mapping[str, LayerInfo],
    *,
    generator: torch.Generator,
) -> dict[str, tuple[LayerInfo, Tensor]]:
    """peft's EVA on ``layer_inputs`` (per batch ``{module: rows (n, d_in)}``, masked).

    Returns ``{module: (LayerInfo with the layer's rank and alpha, A (rank, d_in))}`` for
    every layer whose rank is at least 1, in ``infos`` order. Deterministic given
    ``generator`` (one seed is drawn from it for the randomized SVD).
    """
    names = list(infos)
    if not names:
        raise ValueError("eva calibrate needs at least one target layer")  # error: eva-no-targets
    opts = dict(infos[names[0]].options)
    rho, tau, whiten, method, max_batches = (
        opts["rho"], opts["tau"], opts["whiten"], opts["svd"], opts["max_batches"]
    )
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64))
    budget = sum(infos[m].r for m in names)
    batches = iter(layer_inputs)
    batch = _get(next(batches, None), names, 0)
    if batch is None:
        raise ValueError("eva calibrate: the calibration data yielded no batch")  # error: eva-no-batch
    owner = _group(batch)
    members: dict[str, list[str]] = {}
    for m in names:
        members.setdefault(owner[m], []).append(m)
    k = {m: min(round(infos[m].r * rho), infos[m].d_in) for m in names}
    for group in members.values():  # peft: layers sharing inputs get the largest max_components
        for m in group:
            k[m] = max(k[g] for g in group)
    states: dict[str, dict[str, Any]] = {}
    converged = {o: torch.zeros(k[o], dtype=torch.bool) for o in members}
    similarity = {o: torch.full((k[o],), float("nan")) for o in members}
    done = dict.fromkeys(members, False)
    ranks = dict(k)
    steps = 0
    while True:
        for o in members:  # peft: a layer stops updating once its needed components converged
            done[o] = bool(converged[o][: ranks[o]].all())
        if all(done.values()):
            break
        if steps == max_batches:
            _not_converged(f"after max_batches={max_batches} calibration batches", members, done, ranks, similarity, tau)
        if steps > 0:
            batch = _get(next(batches, None), names, steps)
            if batch is None:
                _not_converged(f"when the calibration data ran out after {steps} batches", members, done, ranks, similarity, tau)
        for o, group in members.items():
            if done[o]:
                continue
            rows = batch[o]
            if rows.shape[0] < k[o]:
                raise ValueError(  # error: eva-few-rows
                    f"eva: calibration batch {steps} has {rows.shape[0]} usable token rows (attention_mask == 1, "
                    f"labels != -100) for layer(s) {group}, fewer than the {k[o]} principal components needed "
                    f"(round(r·rho) = round({infos[o].r}·{rho})); use larger batches or lower r or rho"
                )
            previous = states[o]["components"] if o in states else None
            states[o] = _partial_fit(states.get(o), rows, k[o], method, seed)
            if previous is not None:
                sim = torch.nn.functional.cosine_similarity(states[o]["components"], previous.to(states[o]["components"].dtype))
                similarity[o] = sim.cpu().float()
                converged[o] = (sim >= tau).cpu()
        steps += 1
        ranks = _distribute({o: s["ratio"] for o, s in states.items()}, owner, k, budget)

    out: dict[str, tuple[LayerInfo, Tensor]] = {}
    for m in names:
        rank, info, state = ranks[m], infos[m], states[owner[m]]
        if rank == 0:
            continue
        directions = state["components"][:rank]
        if whiten:
            directions = directions / state["singular"][:rank].sqrt().reshape(-1, 1)
        alpha = info.alpha
        if rank != info.r and opts["adjust_scaling_factors"]:
            alpha = info.alpha * (rank / info.r)
        new = dataclasses.replace(info, r=rank, alpha=alpha)
        out[m] = (new, directions)
    return out


def _get(batch: Mapping[str, Tensor] | None, names: list[str], index: int) -> Mapping[str, Tensor] | None:
    if batch is not None:
        missing = [m for m in names if m not in batch]
        if missing:
            raise ValueError(f"eva calibrate: batch {index} has no inputs for layer(s) {missing}")  # error: eva-missing-layer
    return batch


def _not_converged(
    when: str,
    members: Mapping[str, list[str]],
    done: Mapping[str, bool],
    ranks: Mapping[str, int],
    similarity: Mapping[str, Tensor],
    tau: float,
) -> NoReturn:
    pending = {
        ", ".join(group): f"min cos {float(similarity[o][: ranks[o]].min()):.4f} over {ranks[o]} component(s)"
        for o, group in members.items()
        if not done[o]
    }
    raise ValueError(  # error: eva-not-converged
        f"eva did not converge {when}: layers still below tau={tau}: {pending}; pass more calibration "
        f"batches, raise max_batches, or lower tau"
    )


# The options peft keeps in LoraConfig.eva_config are stored there; svd and max_batches are
# lora_func's (how the decomposition is computed and how long it may take).
VARIANT = lora.derived(
    "eva",
    init,
    options=lora.OPTIONS
    | {
        "rho": Option(2.0, real(1, why="a layer's rank is at most round(r·rho)"), "eva_config.rho"),
        "tau": Option(0.99, real(0, 1, closed="[]", why="a cosine similarity threshold"), "eva_config.tau"),
        "whiten": Option(False, FLAG, "eva_config.whiten"),
        "adjust_scaling_factors": Option(True, FLAG, "eva_config.adjust_scaling_factors"),
        "svd": Option("lowrank", one_of(*SVD_METHODS)),
        "max_batches": Option(1000, whole(1)),
    },
    calibration=Calibration(calibrate),
    traits=frozenset({"rank_within_layer"}),
)
PEFT = lora.stored_as_lora(reads={"use_dora": False, "init_lora_weights": "eva"}, writes={"init_lora_weights": "eva"})
