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

from lora_func.variants import (
    BaseLayer,
    LayerInfo,
    PeftFormat,
    PeftLayer,
    PeftMethod,
    TensorDict,
    Variant,
    is_finite_number,
)

INITS = ("orthogonal", "random")
# The ASA schedule's settings (peft's AdamssConfig fields and defaults), held as spec options.
ASA = {
    "use_asa": False,
    "asa_target_subspaces": 50,
    "init_warmup": 50,
    "final_warmup": 1000,
    "mask_interval": 100,
    "asa_importance_beta": 0.85,
    "asa_uncertainty_beta": 0.85,
    "asa_schedule_exponent": 3.0,
}
OPTIONS = {
    "num_subspaces": 5,
    "subspace_rank": 1,
    "init": "orthogonal",
    "use_dynamic_rank": False,
    "svd_threshold": 0.1,
    "random_seed": 0,
} | ASA
# The most subspaces a peft checkpoint's layer may hold (its keys are adamss_A.<k>, one per k).
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
    bad = [f"{k}={options[k]!r}" for k in ("num_subspaces", "subspace_rank") if not _is_int(options[k], 1)]
    bad += [f"{k}={options[k]!r}" for k in ("random_seed", "init_warmup", "final_warmup") if not _is_int(options[k], 0)]
    if options["init"] not in INITS:
        bad.append(f"init={options['init']!r} (one of {list(INITS)})")
    if not (is_finite_number(options["svd_threshold"]) and 0 <= options["svd_threshold"] < 1):
        bad.append(f"svd_threshold={options['svd_threshold']!r}")
    bad += [f"{k}={options[k]!r}" for k in ("asa_importance_beta", "asa_uncertainty_beta") if not (is_finite_number(options[k]) and 0 <= options[k] < 1)]
    if options["use_asa"]:  # peft's AdamssConfig checks these only with use_asa
        bad += [f"{k}={options[k]!r}" for k in ("asa_target_subspaces", "mask_interval") if not _is_int(options[k], 1)]
        if not (is_finite_number(options["asa_schedule_exponent"]) and options["asa_schedule_exponent"] > 0):
            bad.append(f"asa_schedule_exponent={options['asa_schedule_exponent']!r}")
        if not bad and options["init_warmup"] >= options["final_warmup"]:
            bad.append(f"init_warmup={options['init_warmup']} >= final_warmup={options['final_warmup']} (no pruning ramp)")
    if bad:
        raise ValueError(  # error: adamss-options
            f"adamss options {bad} are invalid: num_subspaces and subspace_rank are ints >= 1, random_seed, init_warmup and "
            f"final_warmup ints >= 0, init one of {list(INITS)}, svd_threshold and the ASA betas in [0, 1); with use_asa, "
            f"asa_target_subspaces and mask_interval ints >= 1, asa_schedule_exponent > 0 and init_warmup < final_warmup "
            f"(peft's AdamssConfig)"
        )


# --------------------------------------------------------------------- peft's AdamssConfig


def _shapes(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    """The stored tensors' shapes (the clustering's buffers are recomputed on load)."""
    rank, k, rho = svd_rank(info), subspaces(info), int(info.option("subspace_rank"))
    return {"adamss_A": (k, rho, rank), "adamss_B": (info.d_out, rho), "adamss_newB": (rank, info.d_in + int(info.has_bias))}


def _peft_config(options: Mapping[str, Any]) -> dict[str, Any]:
    fields = ("num_subspaces", "subspace_rank", "use_dynamic_rank", "svd_threshold", "random_seed", *ASA)
    return {k: options[k] for k in fields} | {"init_weights": "orthogonal" if options["init"] == "orthogonal" else None}


def _peft_reads(config: Mapping[str, Any], module: str) -> dict[str, Any]:
    read = {k: config.get(k, default) for k, default in OPTIONS.items() if k != "init"}
    read["init"] = "orthogonal" if config.get("init_weights", "orthogonal") == "orthogonal" else "random"
    for k in ("svd_threshold", "asa_importance_beta", "asa_uncertainty_beta", "asa_schedule_exponent"):
        read[k] = float(read[k])
    return read


def _convert_in(found: TensorDict, config: Mapping[str, Any]) -> TensorDict:
    """peft's per-subspace ``A_k (ρ_k, R)`` and ``B_k (|S_k|, ρ_k)`` as ``adamss_A (K, ρ, R)`` and
    ``adamss_B (d_out, ρ)``, zero-padded to ``ρ = subspace_rank``."""
    rho = int(config.get("subspace_rank", 1))
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


def _is_flag(value: Any) -> bool:
    return isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return is_finite_number(value)


PEFT_METHOD = PeftMethod(
    "ADAMSS",
    {},  # AdamssConfig has no bias field
    rank_in_config=True,
    checks={
        "num_subspaces": lambda v: _is_int(v, 1),
        "subspace_rank": lambda v: _is_int(v, 1),
        "random_seed": lambda v: _is_int(v, 0),
        "init_weights": lambda v: v in ("orthogonal", None, False),
        "use_dynamic_rank": _is_flag,
        "svd_threshold": _is_number,
        "use_asa": _is_flag,
        **{k: _is_number for k in ASA if k != "use_asa"},
    },
)

VARIANT = Variant(
    name="adamss",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    options=OPTIONS,
    default_alpha=1.0,  # not used: AdaMSS has no scale
    changes_bias=True,
    # A stack of adapters of different r pads the SVD axis with zeros: V's padded rows are zero (a
    # buffer), so the padding never acts and A's padded columns get exactly zero gradient.
    padded_axes={"adamss_A": 2, "adamss_newB": 0},
    check_options=check_options,
    integer_buffers=frozenset({"scatter_index", "subspace", "subspace_ranks"}),
    peft=PeftFormat(
        PEFT_METHOD,
        {"adamss_A": "adamss_A", "adamss_B": "adamss_B", "adamss_newB": "adamss_newB"},
        lambda r, d_in, d_out: {},  # unused: info_shapes
        _peft_config,
        _peft_reads,
        buffers=frozenset({"adamss_newB", "scatter_index", "subspace", "subspace_ranks"}),
        conv1d=False,
        export=_export,
        recompute_buffers=True,
        info_shapes=_shapes,
        imported={
            "adamss_newB": "adamss_newB",
            **{f"adamss_{m}.{i}": f"{m}.{i}" for i in range(MAX_SUBSPACES) for m in ("A", "B")},
        },
        convert_in=_convert_in,
        optional=frozenset({"adamss_newB"}),
    ),
)
