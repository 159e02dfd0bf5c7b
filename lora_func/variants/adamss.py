"""AdaMSS, adaptive multi-subspaces (Zheng et al., NeurIPS 2025, "AdaMSS: Adaptive
Multi-Subspace Approach for Parameter-Efficient Fine-Tuning"), following HF peft's
``tuners/adamss/{layer,utils,model}.py``.

The base weight (with the bias as an extra column, ``W' = [W | b]`` of ``d_in' = d_in + 1``
columns where the layer has a bias) is decomposed by a seeded randomized SVD of rank ``R =
min(r, d_out, d_in')``: ``W' ≈ U Σ V``, ``U (d_out, R)``, ``V (R, d_in')``. The output rows are
clustered into ``K = min(num_subspaces, d_out)`` subspaces by k-means on the rows of ``U``; each
subspace ``k`` (rows ``S_k``) trains ``A_k (ρ_k, R)`` and ``B_k (|S_k|, ρ_k)``, ``ρ_k =
min(|S_k|, subspace_rank)`` (or, with ``use_dynamic_rank``, the number of singular values of
``U_{S_k} U_{S_k}ᵀ`` above ``svd_threshold`` times the largest, at most ``subspace_rank``):

    ΔW'[S_k] = B_k A_k V,     W_eff = W + ΔW'[:, :d_in],   b_eff = b + ΔW'[:, d_in]

(no scale; ``alpha`` is unused). Init as peft: ``A_k = Qᵀ`` with ``Q`` the QR factor of
``U_{S_k}ᵀ P_k``, ``P_k`` the top ``ρ_k`` singular vectors of ``U_{S_k} U_{S_k}ᵀ`` (a
randomized SVD whose draws come from the init's generator, where peft draws them from the global
RNG); ``B_k = 0`` (``init="orthogonal"``, peft's ``init_weights="orthogonal"``: the identity) or
``B_k ~ N(0, 0.01²)`` (``init="random"``, peft's ``init_weights=None``). The SVD of ``W'`` is
peft's exactly: fp32, ``torch.svd_lowrank(niter=2)`` with its draws from a generator seeded with
``random_seed`` (peft seeds the global RNG in a ``fork_rng``); the k-means is scikit-learn's
``KMeans(init="random", n_init=1, max_iter=10, random_state=123456789)`` on ``U`` in fp32, as
peft calls it (scikit-learn is needed to build or load an AdaMSS adapter, as in peft).

Tensors, one set per layer (the subspaces stacked so that a layer is a few tensors whatever
``K``): trainable ``adamss_A (K, ρ, R)`` (``ρ = subspace_rank``; rows past ``ρ_k`` are padding)
and ``adamss_B (d_out, ρ)`` (the ``B_k`` one after another, peft's order: rows sorted by subspace,
then by index); buffers ``adamss_newB`` (``V``, peft's name), ``scatter_index (d_out,)`` (the row
of ``W`` of each ``adamss_B`` row, peft's), ``subspace (d_out,)`` (the subspace of each
``adamss_B`` row) and ``subspace_ranks (K,)`` (``ρ_k``). The forms mask the padding, so it never
reaches the output and its gradient is exactly zero. The activation form is three products,
``((x V_{:, :d_in}ᵀ + V_{:, d_in}) Aᵀ) Mᵀ`` with ``M (d_out, K·ρ)`` the ``B_k`` placed at their
rows and subspaces, plus ``base(x)``.

Adaptive subspace allocation (ASA, peft's ``use_asa`` and ``AdamssAsaCallback``): the schedule's
settings are the spec's options and the schedule itself is a pure function,
:mod:`lora_func.subspace_budget`.

peft's format (``AdamssConfig``): ``adamss_A.<k>``, ``adamss_B.<k>`` per subspace and
``adamss_newB`` per layer; the clustering is not stored (peft recomputes it from the base on
load, and so does ``load_peft``: the subspaces, ranks and ``V`` come from the base weights, as
peft's). peft refuses GPT-2 ``Conv1D``; lora_func adapts it (``W`` in the canonical ``(d_out,
d_in)`` layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import FLAG, BaseLayer, Codec, LayerInfo, Option, PeftFormat, PeftLayer, PeftMethod, Slot, TensorDict, Variant, one_of, real, whole

INITS = ("orthogonal", "random")
# The ASA schedule's settings (peft's AdamssConfig fields and defaults), held as spec options.
ASA = {
    "use_asa": Option(False, FLAG, "use_asa"),
    "asa_target_subspaces": Option(50, whole(0), "asa_target_subspaces"),
    "init_warmup": Option(50, whole(0), "init_warmup"),
    "final_warmup": Option(1000, whole(0), "final_warmup"),
    "mask_interval": Option(100, whole(0), "mask_interval"),
    "asa_importance_beta": Option(0.85, real(0, 1), "asa_importance_beta"),
    "asa_uncertainty_beta": Option(0.85, real(0, 1), "asa_uncertainty_beta"),
    "asa_schedule_exponent": Option(3.0, real(), "asa_schedule_exponent"),
}
OPTIONS = {
    "num_subspaces": Option(5, whole(1), "num_subspaces"),
    "subspace_rank": Option(1, whole(1), "subspace_rank"),
    # peft's init_weights: "orthogonal", or None / False for a random init
    "init": Option("orthogonal", one_of(*INITS), "init_weights", Codec(lambda v: v if v == "orthogonal" else None, lambda v: "random" if v in (None, False) else v)),
    "use_dynamic_rank": Option(False, FLAG, "use_dynamic_rank"),
    "svd_threshold": Option(0.1, real(0, 1), "svd_threshold"),
    "random_seed": Option(0, whole(0), "random_seed"),
} | ASA

MAX_SUBSPACES = 256


def svd_rank(info: LayerInfo) -> int:
    """``R = min(r, d_out, d_in')``, peft's clamp of ``r`` (``d_in' = d_in + 1`` with a bias)."""
    return min(info.r, info.d_out, info.d_in + int(info.has_bias))


def subspaces(info: LayerInfo) -> int:
    """``K = min(num_subspaces, d_out)``: k-means makes at most one subspace per output row."""
    return min(int(info.option("num_subspaces")), info.d_out)


def _svd_lowrank(a: Tensor, q: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.svd_lowrank(a, q, niter=2)`` step for step, its one draw from ``generator``."""
    transposed = a.shape[-2] < a.shape[-1]
    if transposed:
        a = a.mH
    basis = torch.linalg.qr(a @ torch.randn(a.shape[-1], q, dtype=a.dtype, generator=generator)).Q
    for _ in range(2):
        basis = torch.linalg.qr(a.mH @ basis).Q
        basis = torch.linalg.qr(a @ basis).Q
    u, s, vh = torch.linalg.svd(basis.mH @ a, full_matrices=False)
    u, v = basis @ u, vh.mH
    return (v, s, u) if transposed else (u, s, v)


def _kmeans(rows: Tensor, k: int) -> Tensor:
    """peft's ``clustering_Z``: scikit-learn's k-means labels of ``rows`` (fp32)."""
    try:
        from sklearn.cluster import KMeans
    except ImportError:
        raise ImportError(  # error: adamss-sklearn
            "adamss: building or loading an AdaMSS adapter clusters the weight's singular vectors with scikit-learn's "
            "KMeans, as peft does; install it: pip install scikit-learn (or lora-func[adamss])"
        ) from None
    labels = KMeans(n_clusters=k, init="random", n_init=1, max_iter=10, random_state=123456789).fit_predict(rows.numpy())
    return torch.from_numpy(labels).long()


def _with_bias(weight: Tensor, bias: Tensor | None) -> Tensor:
    return weight if bias is None else torch.cat((weight, bias.unsqueeze(1)), dim=1)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    rank, k, rho = svd_rank(info), subspaces(info), int(info.option("subspace_rank"))
    w = _with_bias(weight, bias).detach().to("cpu", torch.float32)
    seeded = torch.Generator().manual_seed(int(info.option("random_seed")))
    u, _, v = _svd_lowrank(w, rank, seeded)
    u, newb = u[:, :rank], v[:, :rank].T
    labels = _kmeans(u, k)
    segments = [torch.where(labels == i)[0] for i in range(k)]
    empty = [i for i, seg in enumerate(segments) if seg.numel() == 0]
    if empty:
        raise ValueError(  # error: adamss-empty-subspace
            f"adamss: k-means left subspaces {empty} of {k} without rows (d_out={info.d_out}); peft fails on such a layer "
            f"too: lower num_subspaces"
        )
    lora_a = torch.zeros(k, rho, rank, dtype=dtype)
    blocks, ranks = [], []
    for i, seg in enumerate(segments):
        data = u[seg, :rank]
        gram = data @ data.T
        if info.option("use_dynamic_rank"):
            _, s_row, _ = _svd_lowrank(gram, min(gram.shape), generator)
            own = max(min(int((s_row > info.option("svd_threshold") * s_row[0]).sum()), rho, len(s_row)), 1)
        else:
            own = max(min(len(seg), rho), 1)
        u_gram, _, _ = _svd_lowrank(gram, min(gram.shape[0], own), generator)
        q, _ = torch.linalg.qr(data.T @ u_gram[:, :own], mode="reduced")
        lora_a[i, :own] = q.T.to(weight.dtype).to(dtype)
        if info.option("init") == "orthogonal":
            block = torch.zeros(len(seg), rho, dtype=dtype)
        else:  # peft's randn in the base dtype, times 0.01
            block = torch.nn.functional.pad(torch.randn(len(seg), own, dtype=weight.dtype, generator=generator) * 0.01, (0, rho - own))
        blocks.append(block.to(dtype))
        ranks.append(own)
    params = {"adamss_A": lora_a, "adamss_B": torch.cat(blocks)}
    buffers = {
        "adamss_newB": newb.to(weight.dtype).to(dtype),
        "scatter_index": torch.cat(segments),
        "subspace": torch.cat([torch.full((len(seg),), i) for i, seg in enumerate(segments)]),
        "subspace_ranks": torch.tensor(ranks),
    }
    return {n: t.to(weight.device) for n, t in params.items()}, {n: t.to(weight.device) for n, t in buffers.items()}


def _factors(params: TensorDict, buffers: TensorDict) -> tuple[Tensor, Tensor]:
    """``A (K·ρ, R)`` and ``M (d_out, K·ρ)`` (the ``B_k`` at their rows of ``W`` and their
    subspace's columns), padding masked: ``ΔW' = M A V``."""
    a, b = params["adamss_A"], params["adamss_B"]
    k, rho = a.shape[-3], a.shape[-2]
    keep = (torch.arange(rho, device=a.device) < buffers["subspace_ranks"][..., None]).to(a.dtype)  # (K, ρ)
    order = torch.argsort(buffers["scatter_index"])  # adamss_B's row of each row of W
    sub = buffers["subspace"][order]
    one_hot = (sub[:, None] == torch.arange(k, device=sub.device)).to(b.dtype)  # (d_out, K); F.one_hot reads max() (not under vmap)
    placed = one_hot[:, :, None] * (b[order] * keep[sub])[:, None, :]  # (d_out, K, ρ)
    # A's padded rows meet only M's zero columns: masking B masks both (and both gradients).
    return a.reshape(k * rho, -1), placed.reshape(b.shape[-2], k * rho)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    a, m = _factors(params, buffers)
    delta = m @ (a @ buffers["adamss_newB"].to(a.dtype))  # (d_out, d_in')
    if bias is None:
        return weight + delta, None
    return weight + delta[:, : info.d_in], bias + delta[:, info.d_in]


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a, m = _factors(params, buffers)
    v = buffers["adamss_newB"].to(a.dtype)
    h = x.to(a.dtype) @ v[:, : info.d_in].T
    if info.has_bias:  # peft appends a column of ones to x for the bias column of V
        h = h + v[:, info.d_in]
    y = base(x)
    return y + ((h @ a.T) @ m.T).to(y.dtype)


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_options(options: Mapping[str, Any]) -> None:
    bad = []
    if options["use_asa"]:  # peft's AdamssConfig checks these only with use_asa
        bad += [f"{k}={options[k]!r}" for k in ("asa_target_subspaces", "mask_interval") if options[k] < 1]
        if not options["asa_schedule_exponent"] > 0:
            bad.append(f"asa_schedule_exponent={options['asa_schedule_exponent']!r}")
        if not bad and options["init_warmup"] >= options["final_warmup"]:
            bad.append(f"init_warmup={options['init_warmup']} >= final_warmup={options['final_warmup']} (no pruning ramp)")
    if bad:
        raise ValueError(  # error: adamss-options
            f"adamss options {bad} are invalid: with use_asa, asa_target_subspaces and mask_interval are ints >= 1, "
            f"asa_schedule_exponent > 0 and init_warmup < final_warmup (peft's AdamssConfig)"
        )


# --------------------------------------------------------------------- peft's AdamssConfig


def _shapes(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    """The stored tensors' shapes (the clustering's buffers are recomputed on load)."""
    rank, k, rho = svd_rank(info), subspaces(info), int(info.option("subspace_rank"))
    return {"adamss_A": (k, rho, rank), "adamss_B": (info.d_out, rho), "adamss_newB": (rank, info.d_in + int(info.has_bias))}


def _convert_in(found: TensorDict, options: Mapping[str, Any]) -> TensorDict:
    """peft's per-subspace ``A_k (ρ_k, R)`` and ``B_k (|S_k|, ρ_k)`` as ``adamss_A (K, ρ, R)`` and
    ``adamss_B (d_out, ρ)``, zero-padded to ``ρ = subspace_rank``."""
    rho = int(options["subspace_rank"])
    k = len({name.split(".")[1] for name in found if name.startswith(("A.", "B."))})
    pairs = [(found.get(f"A.{i}"), found.get(f"B.{i}")) for i in range(k)]
    if not all(a is not None and b is not None and a.dim() == b.dim() == 2 and a.shape[0] <= rho and b.shape[1] == a.shape[0] for a, b in pairs):
        shapes = {name: tuple(t.shape) for name, t in sorted(found.items()) if name != "adamss_newB"}
        raise ValueError(  # error: adamss-peft-subspaces
            f"this AdaMSS checkpoint's layer holds the subspaces {shapes}; it needs adamss_A.<k> (rank_k, R) and adamss_B.<k> "
            f"(rows_k, rank_k) for k = 0..K-1 with rank_k <= subspace_rank={rho}; re-save the checkpoint with peft"
        )
    out = {
        "adamss_A": torch.stack([torch.nn.functional.pad(a, (0, 0, 0, rho - a.shape[0])) for a, _ in pairs if a is not None]),
        "adamss_B": torch.cat([torch.nn.functional.pad(b, (0, rho - b.shape[1])) for _, b in pairs if b is not None]),
    }
    return out | ({"adamss_newB": found["adamss_newB"]} if "adamss_newB" in found else {})


def _export(params: TensorDict, buffers: TensorDict, weight: Tensor | None, info: LayerInfo) -> PeftLayer:
    """Each subspace's ``A_k``, ``B_k`` at its own rank and rows, as peft's lists hold them."""

    def tensors() -> TensorDict:
        a, b, ranks = params["adamss_A"], params["adamss_B"], buffers["subspace_ranks"].tolist()
        sizes = torch.bincount(buffers["subspace"], minlength=len(ranks)).tolist()
        out = {"adamss_newB": buffers["adamss_newB"]}
        for i, (own, rows) in enumerate(zip(ranks, torch.split(b, sizes), strict=True)):
            out[f"A.{i}"], out[f"B.{i}"] = a[i, :own].contiguous(), rows[:, :own].contiguous()
        return out

    return PeftLayer(tensors, r=info.r)


def _slot(name: str, **declared: Any) -> Slot:
    return Slot(lambda i: _shapes(i)[name], peft=name, **declared)


VARIANT = Variant(
    name="adamss",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # A stack of adapters of different r pads the SVD axis with zeros: V's padded rows are zero (a
    # buffer), so the padding never acts and A's padded columns get exactly zero gradient. The
    # clustering's buffers are not in peft's file: recomputed on load (k-means from random_seed).
    tensors={
        "adamss_A": _slot("adamss_A", padded_axes=(2,)),
        "adamss_B": _slot("adamss_B"),
        "adamss_newB": _slot("adamss_newB", padded_axes=(0,), buffer=True),
        "scatter_index": Slot(lambda i: (i.d_out,), buffer=True, integer=True),
        "subspace": Slot(lambda i: (i.d_out,), buffer=True, integer=True),
        "subspace_ranks": Slot(lambda i: (subspaces(i),), buffer=True, integer=True),
    },
    options=OPTIONS,
    check=check_options,
    default_alpha=1.0,  # not used: AdaMSS has no scale
    traits=frozenset({"changes_bias"}),
)
# peft: AdamssConfig (no bias field); r in the config. Each subspace's A_k, B_k are stored apart.
PEFT = PeftFormat(
    PeftMethod("ADAMSS", {}, rank=("r", None)),
    conv1d=False,
    export=_export,
    imported={f"adamss_{m}.{i}": f"{m}.{i}" for i in range(MAX_SUBSPACES) for m in ("A", "B")},
    convert_in=_convert_in,
)
