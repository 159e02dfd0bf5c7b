"""Poly (Polytropon, Ponti et al. 2022, arXiv 2202.13914) and MHR (Multi-Head Routing, Caccia et
al. 2022, arXiv 2211.03831) as peft's ``PolyConfig``: every target holds an inventory of
``n_skills`` LoRA skills and a router that mixes them per task.

Per layer: trainable ``poly_lora_A (n_splits, n_skills, d_in/n_splits, r)``, ``poly_lora_B
(n_splits, n_skills, r, d_out/n_splits)`` and the router's ``poly_router (n_tasks,
n_splits·n_skills)`` (peft's ``poly_router.module_logits``; every layer has its own). For task
``t``, with ``z = poly_router[t]`` seen as ``(n_splits, n_skills)``:

    w = σ(z) / (Σ_skills σ(z) + 1e-12)                     (training: a relaxed Bernoulli sample of z)
    A_t = concat_q Σ_s w[q, s] A[q, s]   (d_in, r)          B_t = concat_q Σ_s w[q, s] B[q, s]   (r, d_out)
    y = x Wᵀ + b + (x A_t) B_t / r,      W_eff = W + (A_t B_t)ᵀ / r

``n_splits = 1`` is Poly; ``n_splits > 1`` is MHR: the input and output features are cut into
``n_splits`` blocks (``d_in`` and ``d_out`` must divide), each block with its own skill mixture.
``alpha`` is unused (the scale is ``1/r``, as peft's). Init as peft's: every ``A[q, s]`` the
transpose of a kaiming-uniform ``(r, d_in/n_splits)``, ``B = 0`` (``init_weights=False``: kaiming
too), the router ``U(-1e-3, 1e-3)``.

The task is one shared integer buffer of the adapter, ``<shared>.poly_task`` (0-d, default 0):
the forms stay pure functions of the adapter and the layer input. :func:`for_task` sets it.
peft's ``task_ids (B,)`` (one task per batch row) is the mixed route over the adapter's task
members (``lora_func.routed.task_members``, which share the skills and routers without copying)
indexed by ``task_ids``: ``lora_func.routed.task_call(model, adapter, input_ids, task_ids=...)``.

In a training step (``base.training``) the mixture is a relaxed Bernoulli sample (temperature 1)
of the logits, one per batch row (dim 0 of the layer input), drawn from the global RNG as peft
does: one ``torch.rand((rows, n_splits, n_skills))`` per layer and call (under ``vmap``:
``randomness=``); the
merged path (``weight_form``) always uses the expected ``σ(z)`` mixture (an inference path).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from lora_func.variants import FLAG, BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, one_of, whole
from lora_func.variants._kernels import kaiming_uniform

TASK = "poly_task"
EPS = 1e-12  # peft's router EPS


def _splits(info: LayerInfo) -> int:
    n = int(info.option("n_splits"))
    if info.d_in % n or info.d_out % n:
        raise ValueError(  # error: poly-splits
            f"poly: n_splits={n} must divide the layer's input and output features (d_in={info.d_in}, "
            f"d_out={info.d_out}); pick n_splits dividing every target's sizes, or leave it 1 (Poly)"
        )
    return n


def _shape_a(info: LayerInfo) -> tuple[int, ...]:
    n = _splits(info)
    return (n, int(info.option("n_skills")), info.d_in // n, int(info.r))


def _shape_b(info: LayerInfo) -> tuple[int, ...]:
    n = _splits(info)
    return (n, int(info.option("n_skills")), int(info.r), info.d_out // n)


TENSORS = {
    "poly_lora_A": Slot(_shape_a, rank_axes=(3,), peft="poly_lora_A"),
    "poly_lora_B": Slot(_shape_b, rank_axes=(2,), peft="poly_lora_B"),
    "poly_router": Slot(lambda i: (int(i.option("n_tasks")), _splits(i) * int(i.option("n_skills"))), peft="poly_router.module_logits"),
    TASK: Slot(lambda i: (), buffer=True, integer=True, shared=True),
}


def shared_init(infos: Any, *, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    return {}, {TASK: torch.zeros((), dtype=torch.int64, device=device)}


def init(
    weight: Tensor, bias: Tensor | None, info: LayerInfo, *, dtype: torch.dtype, generator: torch.Generator, calibration: Any = None
) -> tuple[TensorDict, TensorDict]:
    n, skills, r = _splits(info), int(info.option("n_skills")), int(info.r)
    d_in, d_out = info.d_in // n, info.d_out // n
    # peft's draw order: skill by skill, each split in turn; every block the transpose of nn.Linear's default init

    def blocks(rows: int, cols: int) -> Tensor:
        drawn = {(k, q): kaiming_uniform((rows, cols), a=math.sqrt(5), generator=generator).T for k in range(skills) for q in range(n)}
        return torch.stack([torch.stack([drawn[(k, q)] for k in range(skills)]) for q in range(n)])

    lora_a = blocks(r, d_in)
    lora_b = blocks(d_out, r) if not info.option("init_weights") else torch.zeros((n, skills, r, d_out))
    # (uniform_ itself: its a + (b - a)·u rounds as peft's nn.init.uniform_, a rescaled rand does not)
    router = torch.empty((int(info.option("n_tasks")), n * skills)).uniform_(-1e-3, 1e-3, generator=generator)
    params = {"poly_lora_A": lora_a, "poly_lora_B": lora_b, "poly_router": router}
    return {k: v.contiguous().to(weight.device, dtype) for k, v in params.items()}, {}


def mixture(router: Tensor, task: Tensor, info: LayerInfo, training: bool, rows: int | None = None) -> Tensor:
    """The skill weights ``(n_splits, n_skills)`` of ``task`` (0-d int64) from ``router (n_tasks,
    n_splits·n_skills)``: each split's normalised sigmoids. In training a relaxed Bernoulli sample,
    one per batch row where ``rows`` is given (``(rows, n_splits, n_skills)``, peft's draw: one
    ``torch.rand`` of that shape)."""
    # index_select, not router[task]: no data-dependent shape for torch.compile
    logits = router.index_select(0, task.reshape(1).to(router.device)).view(_splits(info), int(info.option("n_skills")))
    if training and rows is not None:
        logits = logits.expand(rows, *logits.shape)
    logits = _relaxed_bernoulli(logits) if training else torch.sigmoid(logits)
    return logits / (logits.sum(-1, keepdim=True) + EPS)


def _clamp_probs(p: Tensor) -> Tensor:
    eps = torch.finfo(p.dtype).eps
    return p.clamp(min=eps, max=1 - eps)


def _relaxed_bernoulli(logits: Tensor) -> Tensor:
    """``RelaxedBernoulli(temperature=1, logits=logits).rsample()``, peft's training-time mixture, with
    torch's draws and ops (one ``torch.rand`` from the global RNG) but no value-dependent argument
    validation, so it runs under ``vmap``."""
    probs = _clamp_probs(torch.sigmoid(logits))
    uniforms = _clamp_probs(torch.rand(logits.shape, dtype=probs.dtype, device=probs.device))
    finfo = torch.finfo(logits.dtype)
    sample = torch.sigmoid(uniforms.log() - (-uniforms).log1p() + probs.log() - (-probs).log1p())
    return sample.clamp(min=finfo.tiny, max=1.0 - finfo.eps)


def factors(params: TensorDict, buffers: TensorDict, info: LayerInfo, training: bool, rows: int | None = None) -> tuple[Tensor, Tensor]:
    """The task's LoRA factors ``A_t (d_in, r)`` and ``B_t (r, d_out)`` (peft's layout, ``x A_t B_t``);
    with ``rows`` in training, one pair per row (``(rows, d_in, r)``, ``(rows, r, d_out)``), each
    from the row's own mixture."""
    lora_a, lora_b = params["poly_lora_A"], params["poly_lora_B"]
    w = mixture(params["poly_router"], buffers[TASK], info, training, rows).to(lora_a.dtype)
    r = lora_a.shape[-1]
    a = torch.einsum("...qs,qsdr->...qdr", w, lora_a).reshape(*w.shape[:-2], info.d_in, r)
    b = torch.einsum("...qs,qsrd->...qrd", w, lora_b).transpose(-3, -2).reshape(*w.shape[:-2], r, info.d_out)
    return a, b


def weight_form(params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo) -> tuple[Tensor, Tensor | None]:
    a, b = factors(params, buffers, info, training=False)
    return weight + (a @ b).T.to(weight.dtype) / info.r, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    training = bool(getattr(base, "training", False))
    y = base(x)
    if training and x.dim() >= 3:  # peft draws one mixture per batch row (dim 0)
        a, b = factors(params, buffers, info, training, rows=x.shape[0])
        rows = x.to(a.dtype).reshape(x.shape[0], -1, x.shape[-1])
        return y + (rows.bmm(a).bmm(b) / info.r).reshape(*x.shape[:-1], b.shape[-1]).to(y.dtype)
    a, b = factors(params, buffers, info, training)
    return y + ((x.to(a.dtype) @ a) @ b / info.r).to(y.dtype)


class _WithBuffers(Protocol):
    buffers: Any
    spec: Any

    def with_buffers(self, buffers: Any) -> Any: ...


def for_task(adapter: _WithBuffers, task: int | Tensor) -> Any:
    """``adapter`` (a ``poly`` adapter) routed for ``task`` (an int or 0-d int64 tensor, ``0 <= task
    < n_tasks``): the same tensors, the task buffer set."""
    key = f"<shared>.{TASK}"
    if key not in adapter.buffers:
        raise ValueError(f"for_task: the adapter has no {key} buffer; it is not a poly adapter")  # error: poly-not-poly
    tasks = int(adapter.spec.option("n_tasks"))
    value = torch.as_tensor(task)
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor(value)
    if value.dim() != 0 or value.is_floating_point() or value.is_complex() or (not wrapped and not 0 <= int(value) < tasks):
        raise ValueError(  # error: poly-task
            f"for_task: task must be one integer in [0, n_tasks={tasks}), got {repr(task)[:100]}; for one task per batch row "
            f"use lora_func.routed.task_call(model, adapter, ..., task_ids=...)"
        )
    return adapter.with_buffers({**adapter.buffers, key: value.to(dtype=torch.int64, device=adapter.buffers[key].device)})


VARIANT = Variant(
    name="poly",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors=TENSORS,
    shared_init=shared_init,
    options={
        "n_tasks": Option(1, whole(1), "n_tasks"),
        "n_skills": Option(4, whole(1), "n_skills"),
        "n_splits": Option(1, whole(1), "n_splits"),
        "poly_type": Option("poly", one_of("poly"), "poly_type"),
        "init_weights": Option(True, FLAG, "init_weights"),
    },
    default_alpha=1.0,  # unused: the scale is 1/r
)

# peft: PolyConfig (nn.Linear targets only); no alpha, no rank pattern.
PEFT = PeftFormat(PeftMethod("POLY", fixed={}, rank=("r", None), fan_in_fan_out=False), conv1d=False)
