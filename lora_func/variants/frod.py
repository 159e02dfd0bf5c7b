"""FRoD, full-rank sparse adaptation from a hierarchical joint decomposition (AAAI 2026,
doi 10.1609/aaai.v40i31.39813), following HF peft 0.21.2's ``tuners/frod/{model,layer}.py``.

The targets are grouped by *category* (peft's ``_category_from_key``: the last two parts of the
module name, ``self_attn_q_proj`` for the ``q_proj`` of every block). Per category, a square
basis ``V (d_in, d_in)`` from the base weights of all its layers stacked (peft's
``_projection_from_weights``: an SVD when they have fewer rows than columns, else a QR and the
eigenvectors of the averaged regularised ``(Q_iᵀQ_i + α I)⁻¹``) and a seeded off-diagonal COO
pattern ``idx (2, n)`` (``torch.randperm`` from ``projection_prng_key``, the categories in sorted
order, ``n = int(d_in²·sparse_rate)``). Per layer, ``W = U diag(λ₀) Vᵀ`` solved for ``U (d_out,
d_in)`` (unit columns) and ``λ₀ (d_in,)``. The adapted weight *replaces* ``W``:

    W_eff = U (S + diag λ) Vᵀ,   S the (d_in, d_in) matrix with the trained values at idx,
    y = x V (S + diag λ)ᵀ Uᵀ + b              (the activation form: no W_eff built)

Trainable ``frod_lambda_l = λ (d_in,)`` and ``frod_lambda_s_values (n,)``; frozen ``U`` per layer
and ``V``, ``idx`` (and its size, which peft stores) per category. Init (``init="identity"``,
peft's ``init_weights=True``): ``λ = λ₀``, values 0, so ``W_eff = W``; ``init="random"``: values
``N(0, 0.1²)`` and ``λ₀ + N(0, 0.1²)`` from the generator, in peft's order (per layer, module
order: the values, then λ). With the ``dropout`` option (peft's ``frod_dropout``) a training step
computes ``y = base(x) + (W_eff − W) dropout(x)``, as peft.

Precision: ``V`` is computed as peft computes it (float32 on the CPU, whatever the dtype): a
basis whose rounding ``U`` compensates, and the very ``V`` a ``save_projection=False`` checkpoint
of peft needs (eigenvector signs fix what the trained ``S`` means). ``U`` and ``λ₀`` are solved
in float64 against the *stored* ``V`` (in the adapter dtype) and rounded once to the adapter
dtype; peft rounds them to float32 first, so a float64 peft model misses the identity at init by
~1e-7, lora_func's by float64 round-off.

Contract: the ``shared_from_weights`` trait. ``V`` needs the base weights of every layer of its
category at once, so :func:`shared_init` gets them (``weights``) and returns the grouped shared
tensors ``"frod_V@<category>"`` etc.; a layer's ``U`` needs its category's ``V``, so :func:`init`
gets the layer's view of them (``shared``). A layer built alone is its own category.

peft format (``FrodConfig``): per layer ``frod_lambda_l``, ``frod_lambda_s_values``; with
``save_projection`` ``base_model.frod_V.<category>``, ``base_model.frod_s_indices.<category>``,
``base_model.frod_s_size.<category>``. ``U`` is never saved: ``load_peft`` solves it from the
model's weight and the category's ``V`` (the file's, or recomputed), as peft does. GPT-2
``Conv1D`` as peft (``fan_in_fan_out``). The replaced weight makes it ``replaces_weight``: a
quantized base is refused (peft's FRoD adapts ``nn.Linear`` / ``Conv1D`` only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import FLAG, BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real
from lora_func.variants._kernels import lowrank_input, promoted
from lora_func.variants._options import SEED, dropout_option

INITS = ("identity", "random")
SHARED_NAMES = ("frod_V", "frod_s_indices", "frod_s_size")


def category(module: str) -> str:
    """The category a target shares ``V`` with (peft's ``_category_from_key``): the last two
    parts of its name joined by ``_`` (the last one after a block index; BERT's
    ``attention.output.dense`` is ``attention_output``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return parts[0]
    if parts[-2].isdigit():
        return parts[-1]
    found = f"{parts[-2]}_{parts[-1]}"
    if found == "output_dense" and len(parts) >= 3 and parts[-3] == "attention":
        return "attention_output"
    return found


def _block_index(module: str, fallback: int) -> int:
    """The block a target belongs to (peft's ``_layer_index_from_key``): the number after
    ``layers``, else the first number in the name, else ``fallback`` (its index among the
    targets)."""
    parts = module.split(".")
    if "layers" in parts:
        try:
            return int(parts[parts.index("layers") + 1])
        except (ValueError, IndexError):
            pass
    for part in parts:
        if part.isdigit():
            return int(part)
    return fallback


def pattern_size(d_in: int, sparse_rate: float) -> int:
    """``n``, the number of off-diagonal entries of ``S``: ``int(d_in²·sparse_rate)``, at most
    every off-diagonal entry, at least one for a positive rate (peft's rule)."""
    off_diagonal = d_in * d_in - d_in
    n = min(int(d_in * d_in * sparse_rate), off_diagonal)
    if sparse_rate > 0 and off_diagonal > 0:
        n = max(1, n)
    return n


def _projection(matrices: list[Tensor], alpha: float) -> Tensor:
    """``V (d_in, d_in)`` of one category from its layers' weights (peft's
    ``_projection_from_weights``, the same ops in the same order)."""
    stacked = torch.cat(matrices, dim=0)
    if stacked.shape[0] < stacked.shape[1]:
        return torch.linalg.svd(stacked, full_matrices=True)[2].T
    q, r = torch.linalg.qr(stacked)
    dim = r.shape[1]
    t_pi = torch.zeros((dim, dim), dtype=r.dtype)
    start = 0
    for matrix in matrices:
        q_slice = q[start : start + matrix.shape[0], :]
        start += matrix.shape[0]
        # layers of one category can be highly correlated: the ridge keeps the inverse stable
        t_pi += torch.linalg.inv(q_slice.T @ q_slice + alpha * torch.eye(dim, dtype=r.dtype))
    t_pi /= len(matrices)
    return r.T @ torch.linalg.eigh(t_pi)[1]


def _pattern(d_in: int, sparse_rate: float, generator: torch.Generator) -> Tensor:
    """``idx (2, n)`` int64: ``n`` off-diagonal positions drawn by ``randperm`` (peft's order)."""
    n = pattern_size(d_in, sparse_rate)
    if not n:
        return torch.empty(2, 0, dtype=torch.long)
    rows, cols = torch.meshgrid(torch.arange(d_in), torch.arange(d_in), indexing="ij")
    positions = torch.stack([rows.flatten(), cols.flatten()], dim=1)
    off_diagonal = positions[positions[:, 0] != positions[:, 1]]
    return off_diagonal[torch.randperm(off_diagonal.shape[0], generator=generator)[:n]].t().contiguous()


def groups(targets: str | tuple[str, ...], infos: Mapping[str, LayerInfo]) -> dict[str, dict[str, str]]:
    """Each layer's category, the group key of its ``V``, ``idx`` and size."""
    return {module: dict.fromkeys(SHARED_NAMES, category(module)) for module in infos}


def shared_init(
    infos: Mapping[str, LayerInfo],
    *,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    weights: Mapping[str, Tensor],
) -> tuple[TensorDict, TensorDict]:
    """Every category's ``V`` (in ``dtype``), ``idx`` and size (int64), keyed
    ``"<name>@<category>"``, from ``weights`` (module -> ``W (d_out, d_in)``, module order) as
    peft builds them: the layers of a category stacked in block order (two of one block and
    category: the later one's weight, as peft's dict keeps), the patterns drawn from
    ``projection_prng_key`` in sorted category order (``generator`` unused: peft's pattern is
    seeded by the option)."""
    first = next(iter(infos.values()))
    alpha, rate = float(first.option("regularization_alpha")), float(first.option("sparse_rate"))
    by_block: dict[int, dict[str, Tensor]] = {}
    for fallback, module in enumerate(infos):
        by_block.setdefault(_block_index(module, fallback), {})[category(module)] = weights[module]
    seeded = torch.Generator(device="cpu").manual_seed(int(first.option("projection_prng_key")))
    buffers: TensorDict = {}
    for name in sorted({c for layer in by_block.values() for c in layer}):
        matrices = [layer[name].detach().to(torch.float32).cpu() for _, layer in sorted(by_block.items()) if name in layer]
        widths = sorted({m.shape[1] for m in matrices})
        if len(widths) > 1:
            raise ValueError(  # error: frod-category-widths
                f"the layers of category {name!r} have different input widths {widths}; FRoD shares one (d_in, d_in) basis per "
                f"category (the last two parts of the module name): target layers of one width per category"
            )
        v = _projection(matrices, alpha)
        buffers[f"frod_V@{name}"] = v.to(device, dtype)
        buffers[f"frod_s_indices@{name}"] = _pattern(v.shape[0], rate, seeded).to(device)
        buffers[f"frod_s_size@{name}"] = torch.tensor([v.shape[0], v.shape[0]], dtype=torch.long, device=device)
    return {}, buffers


def solve(weight: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(U (d_out, d_in), λ₀ (d_in,))`` in float64 with ``W = U diag(λ₀) Vᵀ``, ``U``'s
    columns of unit norm (zero where λ₀ ≤ 1e-12); a singular ``V`` through its pseudo-inverse
    (peft's ``_calculate_frod_u_and_lambda``, without its rounding to float32)."""
    w, v64 = weight.detach().to(torch.float64).cpu(), v.detach().to(torch.float64).cpu()
    try:
        scaled = torch.linalg.solve(v64, w.T).T
    except RuntimeError:
        scaled = w @ torch.linalg.pinv(v64, rtol=1e-6).T
    lam = torch.linalg.norm(scaled, dim=0)
    u = torch.zeros_like(scaled)
    kept = lam > 1e-12
    u[:, kept] = scaled[:, kept] / lam[kept]
    return u, lam


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
    shared: TensorDict | None = None,
) -> tuple[TensorDict, TensorDict]:
    """One layer's ``λ``, ``S``'s values and ``U`` from its category's ``V`` (``shared``: the
    layer's view of the shared tensors; ``None``: the layer alone is its category, built here),
    with the category's tensors among the buffers (a layer built alone: the forms read them)."""
    if shared is None:
        shared = {k.partition("@")[0]: t for k, t in shared_init({"layer": info}, dtype=dtype, device=weight.device, generator=generator, weights={"layer": weight})[1].items()}
    v = shared["frod_V"]
    u, lam = solve(weight, v)
    n = shared["frod_s_indices"].shape[1]
    values = torch.zeros(n, dtype=dtype)
    lam = lam.to(dtype)
    if info.option("init") == "random":
        values = torch.empty(n, dtype=dtype).normal_(0.0, 0.1, generator=generator)
        lam = lam + torch.randn(lam.shape, dtype=dtype, generator=generator) * 0.1
    params = {"frod_lambda_l": lam.to(weight.device), "frod_lambda_s_values": values.to(weight.device)}
    buffers = {"frod_U": u.to(weight.device, dtype), **{name: shared[name] for name in SHARED_NAMES}}
    return params, buffers


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` (itself, with no op dispatched, where it already is)."""
    return t if t.dtype == dtype else t.to(dtype)


def core(lam: Tensor, values: Tensor, idx: Tensor, dtype: torch.dtype) -> Tensor:
    """``S + diag λ (d_in, d_in)`` in ``dtype`` (a repeated position sums, as peft's ``coalesce``)."""
    # the (d_in,) / (n,) vectors cast, not the matrix: two writes of d_in² in dtype
    return torch.diag_embed(_as(lam, dtype)).index_put((idx[0], idx[1]), _as(values, dtype), accumulate=True)


class _FrodProduct(torch.autograd.Function):
    """``x V (S + diag λ)ᵀ Uᵀ`` for ``x (..., d_in)``, computed in ``dtype``, saving for backward
    only ``z = x V`` (in ``dtype``) besides the trainables, positions and frozen ``U``, ``V``
    (already held): ``S + diag λ`` and the ``dtype`` copies of ``U``, ``V`` are rebuilt in
    backward instead of saved (peft keeps ``U``, ``V`` in the base dtype and saves ``z`` and a
    dense ``S`` on a half-precision base). Gradients: ``x`` through ``U``, the rebuilt matrix and
    ``V``; ``λ`` and the values the diagonal and the positions of ``(g U)ᵀ z``. ``U`` and ``V``
    are frozen here (:func:`activation_form` takes autograd's own path where they require grad)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, lam: Tensor, values: Tensor, idx: Tensor, u: Tensor, v: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        z = _as(x, dtype) @ _as(v, dtype)
        return (z @ core(lam, values, idx, dtype).transpose(-1, -2)) @ _as(u, dtype).transpose(-1, -2), z

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, lam, values, idx, u, v, _dtype = inputs
        ctx.save_for_backward(output[1], lam, values, idx, u, v)
        ctx.x_dtype = x.dtype
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, _grad_z: Any) -> tuple[Tensor | None, ...]:
        if grad is None:
            return None, None, None, None, None, None, None
        z, lam, values, idx, u, v = ctx.saved_tensors
        needs = ctx.needs_input_grad
        g = grad @ _as(u, z.dtype)  # the gradient of z (S + diag λ)ᵀ
        grad_x = grad_lam = grad_values = None
        if needs[0]:
            grad_x = _as((g @ core(lam, values, idx, z.dtype)) @ _as(v, z.dtype).transpose(-1, -2), ctx.x_dtype)
        if needs[1] or needs[2]:
            outer = g.reshape(-1, g.shape[-1]).transpose(-1, -2) @ z.reshape(-1, z.shape[-1])
            grad_lam = _as(torch.diagonal(outer), lam.dtype) if needs[1] else None
            grad_values = _as(outer[idx[0], idx[1]], values.dtype) if needs[2] else None
        return grad_x, grad_lam, grad_values, None, None, None, None


def product(params: TensorDict, buffers: TensorDict, x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x V (S + diag λ)ᵀ Uᵀ`` in ``dtype`` (:class:`_FrodProduct`; autograd's own ops where
    ``U`` or ``V`` require grad, and in a trace, which plans its own saved tensors)."""
    lam, values, idx, u, v = params["frod_lambda_l"], params["frod_lambda_s_values"], buffers["frod_s_indices"], buffers["frod_U"], buffers["frod_V"]
    if u.requires_grad or v.requires_grad or torch.compiler.is_compiling():
        z = x.to(dtype) @ v.to(dtype)
        return (z @ core(lam, values, idx, dtype).transpose(-1, -2)) @ u.to(dtype).transpose(-1, -2)
    return _FrodProduct.apply(x, lam, values, idx, u, v, dtype)[0]


def compute_dtype(x: Tensor, adapter: torch.dtype) -> torch.dtype:
    """The activation form's dtype: the input's where it is half precision (peft computes FRoD
    in the input dtype: nothing ``(n, d)``-sized in fp32), else the wider of the two."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else promoted(x.dtype, adapter)


def weight_form(params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo) -> tuple[Tensor, Tensor | None]:
    """``W_eff = U (S + diag λ) Vᵀ`` (``W`` unused: replaced), ``b`` unchanged."""
    lam = params["frod_lambda_l"]
    m = core(lam, params["frod_lambda_s_values"], buffers["frod_s_indices"], lam.dtype)
    return buffers["frod_U"].to(m.dtype) @ m @ buffers["frod_V"].to(m.dtype).T, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """``x V (S + diag λ)ᵀ Uᵀ + b`` (peft's order, no ``W_eff``); with dropout in a training
    step ``base(x) + (W_eff − W) dropout(x)``, as peft."""
    lam = params["frod_lambda_l"]
    dtype = compute_dtype(x, lam.dtype)
    dropped = lowrank_input(x, base, info)
    y = product(params, buffers, dropped, dtype)
    if dropped is x:
        bias = base.bias
        out = y.to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)
    return base(x) + (y - dropped.to(dtype) @ base.weight.to(dtype).transpose(-1, -2)).to(x.dtype)


VARIANT = Variant(
    name="frod",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "frod_lambda_l": Slot(lambda i: (i.d_in,), peft="frod_lambda_l"),
        "frod_lambda_s_values": Slot(lambda i: (pattern_size(i.d_in, float(i.option("sparse_rate"))),), peft="frod_lambda_s_values"),
        # solved from the layer's weight and V at init and on load, never saved (peft's too)
        "frod_U": Slot(lambda i: (i.d_out, i.d_in), buffer=True),
        "frod_V": Slot(lambda i: (i.d_in, i.d_in), buffer=True, shared=True, peft="base_model.frod_V.{group}", saved_if="save_projection"),
        "frod_s_indices": Slot(
            lambda i: (2, pattern_size(i.d_in, float(i.option("sparse_rate")))),
            buffer=True, integer=True, shared=True, peft="base_model.frod_s_indices.{group}", saved_if="save_projection",
        ),
        "frod_s_size": Slot(lambda i: (2,), buffer=True, integer=True, shared=True, peft="base_model.frod_s_size.{group}", saved_if="save_projection"),
    },
    options={
        "sparse_rate": Option(0.01, real(0, 1, closed="[]"), "sparse_rate"),
        "regularization_alpha": Option(1e-3, real(), "regularization_alpha"),
        "projection_prng_key": Option(0, SEED, "projection_prng_key"),
        "save_projection": Option(True, FLAG, "save_projection"),
        "init": Option("identity", one_of(*INITS), "init_weights", mapped({"identity": True, "random": False})),
        "dropout": dropout_option("frod_dropout"),
    },
    default_alpha=1.0,  # not used
    shared_init=shared_init,
    traits=frozenset({"replaces_weight", "shared_from_weights"}),
    groups=groups,
)
# peft: FrodConfig (no rank: U, V are full rank).
PEFT = PeftFormat(PeftMethod("FROD"))
