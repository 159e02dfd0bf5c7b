"""What each of the two gloo processes of tests/test_fsdp.py runs (importable by a spawned child).

Every scenario builds a tiny model (the same seed on both ranks), shards it with FSDP2
(``fully_shard`` per block and on the root), and compares it with an independent oracle
computed in the same process on an unsharded copy through the parameter-dict overlay
(``functional_call(model, lf.overlay(...))``), on the full batch. Each rank writes its
measurements (max-abs differences, norms, flags) to ``<out>/rank<r>.pt``; the test asserts
on them, so a failure names the scenario and the quantity.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.func import functional_call, grad

import lora_func as lf
from tests.contract_helpers import calibration_batches
from tests.models import VOCAB, tiny_model
from tests.variant_table import ROWS

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_ALL = ["c_attn", "c_proj", "c_fc"]  # attention and MLP Conv1D layers (c_proj is in both)
CASES = {
    "llama-lora": ("llama", "lora", LLAMA_ALL),
    "llama-dora": ("llama", "dora", LLAMA_ALL),
    "gpt2-lora": ("gpt2", "lora", GPT2_ALL),
}
# (reshard_after_forward, HF activation checkpointing, merged path): each case runs all four.
CONFIGS = [(True, False, False), (False, False, True), (True, True, False), (False, True, True)]
STEPS, LR = 4, 0.01
BATCH, LENGTH = 4, 8


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers) if hasattr(model, "model") else list(model.transformer.h)


def shard(model: torch.nn.Module, *, reshard: bool = True, mp: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """torchtune's layout: one FSDP2 unit per decoder block, the root holds the rest."""
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch() -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(11))


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Token mean per example, then example mean: the mean of equal shards' losses is the full one."""
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none"
    )
    return per_token.view(ids.shape[0], -1).mean(1).mean()


def perturbed(adapter: lf.Adapter, seed: int = 3, scale: float = 0.1) -> lf.Adapter:
    g = torch.Generator().manual_seed(seed)
    return adapter.with_params(
        {k: (v.detach() + scale * torch.randn(v.shape, generator=g)).requires_grad_(True) for k, v in adapter.params.items()}
    )


def oracle_logits(model: torch.nn.Module, adapter: lf.Adapter | None, ids: torch.Tensor, merged: bool = False) -> torch.Tensor:
    base = lf.base_params(model)
    params = base if adapter is None else (lf.merge_overlay if merged else lf.overlay)(base, adapter)
    return functional_call(model, params, (ids,)).logits


def oracle_training(model: torch.nn.Module, adapter: lf.Adapter, ids: torch.Tensor, merged: bool = False) -> dict[str, Any]:
    """One process, full batch, no sharding, no checkpointing, the same path (lazy or merged):
    step-0 logits and gradients, and the adapter after STEPS AdamW steps."""
    adapter = adapter.detach()
    logits0 = oracle_logits(model, adapter, ids, merged)
    grads0 = {k: g.detach() for k, g in zip(adapter.params, torch.autograd.grad(loss_of(logits0, ids), list(adapter.params.values())))}
    optimizer = torch.optim.AdamW(adapter.params.values(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss_of(oracle_logits(model, adapter, ids, merged), ids).backward()
        optimizer.step()
    with torch.no_grad():
        after = oracle_logits(model, adapter, ids, merged)
    return {"logits0": logits0.detach(), "grads0": grads0, "params": {k: v.detach() for k, v in adapter.params.items()}, "after": after}


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def dict_maxdiff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(maxdiff(a[k], b[k]) for k in a)


def reldiff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want|`` relative to the oracle's scale ``max |want|``: the agreement measure
    of every sharded-vs-one-process comparison. fp32 round-off differs between CPUs' kernels
    (AVX-512 vs AVX2 GEMM blocking, half vs full batch), so a bound on the absolute difference
    of values ~10 is a bound of about one ulp; relative to the scale it is not."""
    scale = float(want.detach().float().abs().max())
    return maxdiff(got, want) / max(scale, torch.finfo(torch.float32).tiny)


def dict_reldiff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """:func:`reldiff` per tensor (each to its own scale), the worst."""
    assert sorted(got) == sorted(want)
    return max(reldiff(got[k], want[k]) for k in want)


def training_scenario(kind: str, variant: str, targets: list[str], reshard: bool, checkpointing: bool, merged: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch()
    half = ids.chunk(world)[rank]
    spec = lf.AdapterSpec(variant, targets=targets, r=4, alpha=8)

    reference_model = tiny_model(kind).requires_grad_(False)
    start = perturbed(lf.init_adapter(reference_model, spec, generator=torch.Generator().manual_seed(5)))
    oracle = oracle_training(reference_model, start, ids, merged)
    base_logits = oracle_logits(reference_model, None, ids).detach()

    model = tiny_model(kind).requires_grad_(False)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF checkpoints only in training mode (the tiny models have no dropout)
    shard(model, reshard=reshard)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5))).detach()
    out: dict[str, Any] = {"init": dict_maxdiff(adapter.params, start.params)}

    with torch.no_grad():  # the sequence the issue names: no_grad forward, then train, then forward
        out["nograd_logits"] = reldiff(lf.adapted_call(model, adapter, ids, merged=merged).logits, oracle["logits0"])
    out["adapter_effect"] = maxdiff(oracle["logits0"], base_logits)
    # What the bounds must still see: lora_B off by 1e-3 (a wrong scale), on the oracle itself.
    off = start.with_params({k: v.detach() * (1.001 if k.endswith("lora_B") else 1.0) for k, v in start.params.items()})
    with torch.no_grad():
        out["scale_error_effect"] = reldiff(oracle_logits(reference_model, off, ids), oracle["logits0"])

    optimizer = torch.optim.AdamW(adapter.params.values(), lr=LR)
    calls = []  # a target's calls in one step: 2 when checkpointing recomputes its block in backward
    first_target = next(m for name, m in model.named_modules() if name.endswith(tuple(targets)))
    hook = first_target.register_forward_pre_hook(lambda *_: calls.append(1))
    for step in range(STEPS):
        optimizer.zero_grad()
        logits = lf.adapted_call(model, adapter, half, merged=merged).logits
        loss_of(logits, half).backward()
        if step == 0:
            out["target_calls_per_step"] = len(calls)
            hook.remove()
        lf.distributed.all_reduce_mean_grads_(adapter.params)
        if step == 0:
            out["logits"] = reldiff(logits, oracle["logits0"].chunk(world)[rank])
            grads = {k: v.grad.detach().clone() for k, v in adapter.params.items()}
            out["grads"] = dict_reldiff(grads, oracle["grads0"])
            out["min_grad_norm"] = min(float(g.norm()) for g in grads.values())
        optimizer.step()
    out["adamw"] = dict_reldiff({k: v.detach() for k, v in adapter.params.items()}, oracle["params"])
    out["moved"] = dict_maxdiff({k: v.detach() for k, v in adapter.params.items()}, start.params)
    with torch.no_grad():
        out["after_logits"] = reldiff(lf.adapted_call(model, adapter, ids, merged=merged).logits, oracle["after"])
    out["model_grads"] = sum(p.grad is not None for p in model.parameters())
    out["forwards_left"] = sum("forward" in m.__dict__ for m in model.modules())
    return out


def func_scenario(kind: str, variant: str, targets: list[str]) -> dict[str, Any]:
    """The torch.func idiom on a sharded model: grad of a pure loss, then all_reduce_mean."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch()
    spec = lf.AdapterSpec(variant, targets=targets, r=4, alpha=8)
    reference_model = tiny_model(kind).requires_grad_(False)
    start = perturbed(lf.init_adapter(reference_model, spec, generator=torch.Generator().manual_seed(5)))
    oracle = oracle_training(reference_model, start, ids)
    model = shard(tiny_model(kind).requires_grad_(False))

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return loss_of(lf.adapted_call(model, start.with_params(params), x).logits, x)

    grads = lf.distributed.all_reduce_mean(grad(loss)({k: v.detach() for k, v in start.params.items()}, ids.chunk(world)[rank]))
    return {"grads": dict_reldiff(grads, oracle["grads0"]), "min_grad_norm": min(float(g.norm()) for g in grads.values())}


def mixed_precision_scenario(kind: str, variant: str, targets: list[str]) -> dict[str, Any]:
    """bf16 compute (MixedPrecisionPolicy), fp32 adapter: close to the fp32 oracle, far from no adapter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch()
    spec = lf.AdapterSpec(variant, targets=targets, r=4, alpha=8)
    reference_model = tiny_model(kind).requires_grad_(False)
    start = perturbed(lf.init_adapter(reference_model, spec, generator=torch.Generator().manual_seed(5)), scale=0.3)
    oracle = oracle_training(reference_model, start, ids)
    base_logits = oracle_logits(reference_model, None, ids).detach()
    model = shard(
        tiny_model(kind).requires_grad_(False),
        mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    adapter = start.detach()
    logits = lf.adapted_call(model, adapter, ids.chunk(world)[rank]).logits
    loss_of(logits, ids.chunk(world)[rank]).backward()
    lf.distributed.all_reduce_mean_grads_(adapter.params)
    rows = oracle["logits0"].chunk(world)[rank]
    errors = [float((v.grad - oracle["grads0"][k]).norm() / oracle["grads0"][k].norm()) for k, v in adapter.params.items()]
    # One process on a bf16 copy of the model: what bf16 compute alone does to the same quantities.
    single = start.detach()
    bf16_model = tiny_model(kind, dtype=torch.bfloat16).requires_grad_(False)
    single_logits = oracle_logits(bf16_model, single, ids)
    loss_of(single_logits, ids).backward()
    single_errors = [float((v.grad - oracle["grads0"][k]).norm() / oracle["grads0"][k].norm()) for k, v in single.params.items()]
    to_single = [float((v.grad - single.params[k].grad).norm() / single.params[k].grad.norm()) for k, v in adapter.params.items()]
    return {
        "dtype": str(logits.dtype),
        "to_oracle": maxdiff(logits, rows),
        "to_base": maxdiff(logits, base_logits.chunk(world)[rank]),
        "max_grad_relative_error": max(errors),
        "single_bf16_grad_relative_error": max(single_errors),
        "grad_relative_error_to_single_bf16": max(to_single),
        "single_bf16_to_oracle": maxdiff(single_logits, oracle["logits0"]),
        "to_single_bf16": maxdiff(logits, single_logits.chunk(world)[rank]),
    }


_INIT_MODELS: dict[str, Any] = {}


def _init_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The unsharded and the sharded tiny Llama of every variant's init scenario, built (and
    sharded) once per process: init_adapter and adapted_call never change a model
    (tests/test_base_untouched.py), and each scenario checks the reference is still the fresh
    model's bytes (``reference_unchanged``), so a scenario cannot pass on an earlier one's damage."""
    if not _INIT_MODELS:
        _INIT_MODELS["reference"] = tiny_model("llama")
        _INIT_MODELS["fresh"] = {k: v.clone() for k, v in _INIT_MODELS["reference"].state_dict().items()}
        _INIT_MODELS["sharded"] = shard(tiny_model("llama").requires_grad_(False))
    return _INIT_MODELS["reference"], _INIT_MODELS["sharded"]


def init_scenario(variant: str) -> dict[str, Any]:
    """init_adapter on the sharded model equals it on the unsharded one, tensors and fingerprints."""
    row = ROWS[variant]
    # lora_bias: the tiny Llama's attention projections have a bias, its MLP has none
    targets = LLAMA_ALL[:4] if variant == "lora_bias" else LLAMA_ALL
    spec = lf.AdapterSpec(variant, targets=targets, **row.spec_kwargs)
    calibration = calibration_batches() if row.calibration else None
    unsharded, model = _init_models()
    reference = lf.init_adapter(unsharded, spec, generator=torch.Generator().manual_seed(9), calibration=calibration)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(9), calibration=calibration)
    same = sorted(adapter.params) == sorted(reference.params) and sorted(adapter.buffers) == sorted(reference.buffers)
    same = same and all(torch.equal(adapter.params[k], reference.params[k]) for k in reference.params)
    same = same and all(torch.equal(adapter.buffers[k], reference.buffers[k]) for k in reference.buffers)
    fingerprints = [(a.base_fingerprint, b.base_fingerprint) for a, b in zip(adapter.layers, reference.layers)]
    # The adapter must act on the sharded model as on the unsharded one.
    moved = perturbed(adapter)
    ids = batch()
    with torch.no_grad():
        effect = reldiff(lf.adapted_call(model, moved, ids).logits, oracle_logits(unsharded, moved, ids))
    return {
        "reference_unchanged": all(torch.equal(v, _INIT_MODELS["fresh"][k]) for k, v in unsharded.state_dict().items()),
        "same": bool(same),
        "fingerprints_equal": all(a == b for a, b in fingerprints),
        "fingerprinted": sum(a is not None for a, _ in fingerprints),
        "logits": effect,
    }


def save_scenario(out_dir: str) -> dict[str, Any]:
    """Train on the sharded model, save from rank 0; the test reloads the file on an unsharded model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(tiny_model("llama").requires_grad_(False))
    spec = lf.AdapterSpec("dora", targets=LLAMA_ALL, r=4, alpha=8)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(2))).detach()
    optimizer = torch.optim.AdamW(adapter.params.values(), lr=LR)
    ids = batch()
    for _ in range(2):
        optimizer.zero_grad()
        half = ids.chunk(world)[rank]
        loss_of(lf.adapted_call(model, adapter, half).logits, half).backward()
        lf.distributed.all_reduce_mean_grads_(adapter.params)
        optimizer.step()
    with torch.no_grad():
        logits = lf.adapted_call(model, adapter, ids).logits
    if rank == 0:
        lf.save(adapter, os.path.join(out_dir, "sharded.safetensors"))
        torch.save(logits, os.path.join(out_dir, "sharded_logits.pt"))
        torch.save({k: v.detach() for k, v in adapter.params.items()}, os.path.join(out_dir, "sharded_params.pt"))
    dist.barrier()
    return {}


def refusal_scenario() -> dict[str, Any]:
    """Each refusal raises before any work, naming the culprit, and leaves the model usable."""
    model = shard(tiny_model("llama").requires_grad_(False))
    spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=8)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1)))
    ids = batch()
    messages: dict[str, str] = {}
    for name, call in {
        "overlay_route": lambda: lf.adapted_call(model, adapter, ids, route="overlay"),
        "overlay_dict": lambda: lf.overlay(lf.base_params(model), adapter),
        "merge_overlay_dict": lambda: lf.merge_overlay(lf.base_params(model), adapter),
        "target_alone": _call_a_target_outside_its_unit,
    }.items():
        try:
            call()
            messages[name] = "no error"
        except (ValueError, RuntimeError, KeyError) as err:
            messages[name] = f"{type(err).__name__}: {err}"
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    try:
        lf.adapted_call(model, adapter, ids)
        messages["unfrozen"] = "no error"
    except ValueError as err:
        messages["unfrozen"] = f"{type(err).__name__}: {err}"
    model.requires_grad_(False)
    with torch.no_grad():  # still usable after the refusals
        messages["after"] = str(reldiff(lf.adapted_call(model, adapter, ids).logits, oracle_logits(tiny_model("llama"), adapter, ids)))
    return messages


class _Outer(torch.nn.Module):
    """Calls a layer of a fully_shard-ed block directly, bypassing the block's forward (and so
    FSDP2's all-gather): the layer's weight is still a DTensor when it is called."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block[0](x)


def _call_a_target_outside_its_unit() -> None:
    torch.manual_seed(0)
    outer = _Outer().requires_grad_(False)
    fully_shard(outer.block)
    adapter = lf.init_adapter(outer, lf.AdapterSpec("lora", targets=["0"], r=2), generator=torch.Generator().manual_seed(0))
    lf.adapted_call(outer, adapter, torch.randn(2, 8))


def run(rank: int, world: int, init_file: str, out_dir: str, scenarios: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for name in scenarios:
            try:
                results[name] = _scenario(name, out_dir)
            except Exception:  # noqa: BLE001  (reported to the test with the scenario's name)
                results[name] = {"error": traceback.format_exc()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _scenario(name: str, out_dir: str) -> dict[str, Any]:
    kind, _, rest = name.partition(":")
    if kind == "train":
        case, *flags = rest.split("/")
        reshard, checkpointing, merged = (flag == "1" for flag in flags)
        return training_scenario(*CASES[case], reshard, checkpointing, merged)
    if kind == "func":
        return func_scenario(*CASES[rest])
    if kind == "bf16":
        return mixed_precision_scenario(*CASES[rest])
    if kind == "init":
        return init_scenario(rest)
    if kind == "save":
        return save_scenario(out_dir)
    if kind == "refuse":
        return refusal_scenario()
    if kind == "nf4":
        return nf4_scenario()
    if kind == "context":
        return context_scenario()
    if kind == "mixed":
        return mixed_scenario()
    raise ValueError(name)


def nf4_scenario() -> dict[str, Any]:
    """FSDP + QLoRA (torchtune's recipe): torchao NF4 targets sharded by FSDP2, against one
    process on the same NF4 model unsharded (its own route is checked against a dequantized
    float model in tests/test_quantized.py)."""
    from tests.quantized_models import quantized_llama

    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch()
    spec = lf.AdapterSpec("lora", targets=LLAMA_ALL, r=4, alpha=8)
    reference_model = quantized_llama("torchao-nf4").requires_grad_(False)
    start = perturbed(lf.init_adapter(reference_model, spec, generator=torch.Generator().manual_seed(5)))
    adapter = start.detach()
    logits0 = lf.adapted_call(reference_model, adapter, ids).logits
    loss_of(logits0, ids).backward()
    oracle_grads = {k: v.grad.detach() for k, v in adapter.params.items()}
    with torch.no_grad():
        base_logits = reference_model(ids).logits

    model = shard(quantized_llama("torchao-nf4").requires_grad_(False))
    sharded = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5))).detach()
    half = ids.chunk(world)[rank]
    logits = lf.adapted_call(model, sharded, half).logits
    loss_of(logits, half).backward()
    lf.distributed.all_reduce_mean_grads_(sharded.params)
    weight = model.model.layers[0].self_attn.q_proj.weight
    return {
        "weight_type": f"{type(weight).__name__}/{type(getattr(weight, '_local_tensor', weight)).__name__}",
        "init": dict_maxdiff(sharded.params, start.params),
        "logits": reldiff(logits, logits0.chunk(world)[rank]),
        "adapter_effect": maxdiff(logits0, base_logits),
        "grads": dict_reldiff({k: v.grad for k, v in sharded.params.items()}, oracle_grads),
        "min_grad_norm": min(float(g.norm()) for g in oracle_grads.values()),
    }


def context_scenario() -> dict[str, Any]:
    """``lf.adapted`` (the stateful block, e.g. around generate) on a sharded model, merged and lazy."""
    model = shard(tiny_model("llama").requires_grad_(False))
    spec = lf.AdapterSpec("dora", targets=LLAMA_ALL, r=4, alpha=8)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(4)))
    ids = batch()
    reference = tiny_model("llama")
    out: dict[str, Any] = {}
    with torch.no_grad():
        base_before = model(ids).logits
        for merged in (True, False):
            with lf.adapted(model, adapter, merged=merged):
                inside = model(ids).logits
            out[f"merged={merged}"] = reldiff(inside, oracle_logits(reference, adapter, ids, merged))
        out["effect"] = maxdiff(inside, base_before)
        out["base_after"] = maxdiff(model(ids).logits, base_before)
        out["greedy_equal"] = False
        with lf.adapted(model, adapter):
            tokens = model.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
        with lf.adapted(reference, adapter):
            expected = reference.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
        out["greedy_equal"] = bool(torch.equal(tokens, expected))
        plain = model.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
        out["greedy_differs_from_base"] = not torch.equal(tokens, plain)
    out["forwards_left"] = sum("forward" in m.__dict__ for m in model.modules())
    return out


def mixed_scenario() -> dict[str, Any]:
    """Per-row adapters (lf.mixed_call / lf.mixed_adapted) on a sharded model: each row
    equals its own adapter on the unsharded model, in a training step and in generation."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(tiny_model("llama").requires_grad_(False), reshard=False)  # gathered weights stay between calls
    reference = tiny_model("llama")
    spec = lf.AdapterSpec("lora", targets=LLAMA_ALL, r=4, alpha=8)
    adapters = [perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(s)), seed=20 + s, scale=0.3) for s in range(3)]
    ids = batch()
    index = torch.tensor([2, 0, 1, 2])
    half, rows = ids.chunk(world)[rank], index.chunk(world)[rank]
    logits = lf.mixed_call(model, adapters, rows, half, batching="layers").logits
    loss_of(logits, half).backward()
    expected = torch.cat([oracle_logits(reference, adapters[int(k)], half[i : i + 1]) for i, k in enumerate(rows)])
    used = sorted({int(k) for k in rows})
    with torch.no_grad():
        with lf.mixed_adapted(model, adapters, rows):
            tokens = model.generate(half[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
        alone = []
        for i, k in enumerate(rows):
            with lf.adapted(reference, adapters[int(k)]):
                alone.append(reference.generate(half[i : i + 1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0))
    return {
        "logits": reldiff(logits, expected),
        "grads_of_used": min(float(adapters[k].params[n].grad.norm()) for k in used for n in adapters[k].params),
        "greedy_equal": bool(torch.equal(tokens, torch.cat(alone))),
        "forwards_left": sum("forward" in m.__dict__ for m in model.modules()),
    }
