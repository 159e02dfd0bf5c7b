"""Data-parallel adapter training on torch.distributed (gloo, CPU).

The main test spawns two gloo processes. Each starts from a *different* local init,
broadcasts rank 0's adapter, and trains N steps on its half of a fixed batch with averaged
gradients, once with the torch.func.grad idiom (all_reduce_mean) and once with torch.optim
(all_reduce_mean_grads_). The result must equal N steps on the full batch in one process
(atol 1e-6), must differ from training on one half alone (so a no-op all-reduce fails), both
ranks must hold the same adapter, and rank 0's saved file must reload identically.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call, grad

import lora_func as lf
from tests.models import VOCAB, tiny_model
from tests.spawn import run_ranks
from tests.tolerance import assert_close_to_scale

STEPS = 3
LR = 0.5
BATCH, LENGTH = 4, 8  # two equal halves of 2 sequences, no padding
JOIN_TIMEOUT_S = 120


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g)


def _adapter(model: torch.nn.Module, seed: int) -> lf.Adapter:
    """A LoRA adapter with a random nonzero lora_B (so every tensor gets a gradient at step 0)."""
    spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=8)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(1000 + seed)
    params = {
        k: (torch.randn(v.shape, generator=g) * 0.3 if k.endswith("lora_B") else v.detach()).requires_grad_(True)
        for k, v in adapter.params.items()
    }
    return adapter.with_params(params)


def _loss_fn(model: torch.nn.Module, adapter: lf.Adapter):
    base = lf.base_params(model)

    def loss(params, ids):
        logits = functional_call(model, lf.overlay(base, adapter.with_params(params)), (ids,)).logits
        # Mean over tokens of each example, then over examples: with equal halves, the mean
        # of the two half-batch losses (and gradients) is the full-batch one.
        per_token = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
        )
        return per_token.view(ids.shape[0], -1).mean(1).mean()

    return loss


def _train_func(model, adapter, ids, reduce):
    loss = _loss_fn(model, adapter)
    params = {k: v.detach() for k, v in adapter.params.items()}
    for _ in range(STEPS):
        grads = reduce(grad(loss)(params, ids))
        params = {k: params[k] - LR * grads[k] for k in params}
    return adapter.with_params(params)


def _train_optim(model, adapter, ids, reduce_):
    loss = _loss_fn(model, adapter)
    adapter = adapter.detach()
    optimizer = torch.optim.SGD(adapter.params.values(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss(adapter.params, ids).backward()
        reduce_(adapter.params)
        optimizer.step()
    return adapter.detach()


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model("llama")
        # Each rank starts from its own init; broadcast_adapter makes them rank 0's.
        adapter = lf.distributed.broadcast_adapter(_adapter(model, seed=rank))
        half = _batch().chunk(world)[rank]

        def reduce(grads):
            before = {k: v.clone() for k, v in grads.items()}
            out = lf.distributed.all_reduce_mean(grads)
            assert all(torch.equal(grads[k], before[k]) for k in grads), "all_reduce_mean modified its input"
            assert all(out[k].data_ptr() != grads[k].data_ptr() for k in grads)
            return out

        func = _train_func(model, adapter, half, reduce)
        optim = _train_optim(model, adapter, half, lf.distributed.all_reduce_mean_grads_)
        lf.save(func, os.path.join(out_dir, f"func_rank{rank}.safetensors"))
        lf.save(optim, os.path.join(out_dir, f"optim_rank{rank}.safetensors"))
        if rank == 0:  # the in-memory adapters' outputs, to compare with the reloaded files
            with torch.no_grad():
                for mode, trained in (("func", func), ("optim", optim)):
                    torch.save(lf.adapted_call(model, trained, _batch()).logits, os.path.join(out_dir, f"{mode}_logits.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path: Path) -> None:
    run_ranks(_worker, world, (world, str(tmp_path / "rendezvous"), str(tmp_path)), JOIN_TIMEOUT_S)


def _max_diff(a: lf.Adapter, b: lf.Adapter) -> float:
    assert set(a.params) == set(b.params)
    return max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)


def test_two_gloo_ranks_on_half_batches_match_one_process_on_the_full_batch(tmp_path):
    _spawn(2, tmp_path)

    model = tiny_model("llama")
    init = _adapter(model, seed=0)  # rank 0's init, which broadcast_adapter gave every rank
    ids = _batch()
    reference = _train_func(model, init, ids, lambda g: g)
    half_only = _train_func(model, init, ids.chunk(2)[0], lambda g: g)
    assert _max_diff(reference, init) > 1e-2, "training did not move the adapter"
    assert _max_diff(reference, half_only) > 1e-3, "the halves are too alike to tell a no-op all-reduce apart"

    for mode in ("func", "optim"):
        ranks = [lf.load(tmp_path / f"{mode}_rank{r}.safetensors", model=model) for r in range(2)]
        for k in reference.params:  # every rank took the same steps
            assert torch.equal(ranks[0].params[k], ranks[1].params[k]), (mode, k)
        for k in reference.params:
            assert_close_to_scale(ranks[0].params[k], reference.params[k], msg=f"{mode} {k}")
        # The adapter saved on rank 0 reloads identically: bit-equal outputs to rank 0's
        # in-memory adapter (computed there with one thread; same here).
        reloaded = lf.load(tmp_path / f"{mode}_rank0.safetensors", model=tiny_model("llama"))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                got = lf.adapted_call(model, reloaded, ids).logits
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(got, torch.load(tmp_path / f"{mode}_logits.pt")), mode
        # params agree within 1e-6; logits of size ~1 then agree to ~1e-5 (reduction order differs)
        ref_logits = lf.adapted_call(model, reference, ids).logits
        torch.testing.assert_close(got, ref_logits, rtol=1e-5, atol=1e-4)


# --- in-process checks (no process group, or a world of one) ---------------------------------


def test_helpers_raise_a_clear_error_without_a_process_group():
    assert not dist.is_initialized()
    model = tiny_model("llama")
    adapter = _adapter(model, seed=0)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        lf.distributed.all_reduce_mean({k: torch.ones(2) for k in ("a", "b")})
    with pytest.raises(RuntimeError, match="not initialised"):
        lf.distributed.all_reduce_mean_grads_(adapter.params)
    with pytest.raises(RuntimeError, match="not initialised"):
        lf.distributed.broadcast_adapter(adapter)


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_world_of_one_returns_new_equal_tensors_in_order_with_mixed_dtypes(world_of_one):
    g = torch.Generator().manual_seed(0)
    grads = {
        "z": torch.randn(3, 4, generator=g),
        "a": torch.randn(5, generator=g).to(torch.float64),
        "m": torch.randn(2, 3, generator=g).t(),  # non-contiguous
        "h": torch.randn(4, generator=g).to(torch.bfloat16),
    }
    before = {k: v.clone() for k, v in grads.items()}
    out = lf.distributed.all_reduce_mean(grads)
    assert list(out) == list(grads)
    for k, g in grads.items():
        assert out[k].shape == g.shape and out[k].dtype == g.dtype
        assert torch.equal(out[k], before[k]) and torch.equal(g, before[k])
        assert out[k].untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
    assert lf.distributed.all_reduce_mean({}) == {}


def test_world_of_one_optim_and_broadcast_helpers(world_of_one):
    model = tiny_model("llama")
    adapter = _adapter(model, seed=0)
    with pytest.raises(ValueError, match="have no .grad"):
        lf.distributed.all_reduce_mean_grads_(adapter.params)
    got = lf.distributed.broadcast_adapter(adapter)
    assert got is not adapter and got.spec == adapter.spec and got.layers == adapter.layers
    for k, v in adapter.params.items():
        assert torch.equal(got.params[k], v) and got.params[k].is_leaf and got.params[k].requires_grad
        assert got.params[k].data_ptr() != v.data_ptr()
    for k, v in adapter.buffers.items():
        assert torch.equal(got.buffers[k], v)
    with pytest.raises(TypeError, match="expects an Adapter"):
        lf.distributed.broadcast_adapter(adapter.params)  # type: ignore[arg-type]
