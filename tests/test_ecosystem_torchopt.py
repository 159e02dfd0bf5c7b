"""optree registration of the adapter types, and fully functional training with torchopt.

Oracles: torch's own pytree (the same leaves, in the same order) and torch.optim.Adam stepping
each adapter's leaf tensors in a plain Python loop.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torchopt
from torch.func import grad, vmap

import lora_func as lf
from lora_func.train import causal_lm_loss
from tests.models import VOCAB, tiny_model

LR, STEPS = 5e-2, 3
# float64 model and adapters: the losses and gradients of the oracle and of the functional loop
# agree to ~1e-12 whatever order vmap rounds in, so only torchopt's own rounding is left.
F64 = torch.float64


def _model():
    return tiny_model("llama", dtype=F64)


def _adapter(model, seed: int, r: int = 2) -> lf.Adapter:
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=r, dtype=F64), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(100 + seed)  # lora_B is zero at init: perturb every tensor
    return adapter.with_params({k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=F64) for k, v in adapter.params.items()})


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _loss(model, base):
    def loss(adapter, ids):
        return causal_lm_loss(lf.adapted_call(model, adapter, ids, base=base).logits, ids)

    return loss


def _torch_adam(model, adapter: lf.Adapter, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The oracle: torch.optim.Adam on fresh leaf copies, one backward per step."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
    optimizer = torch.optim.Adam(params.values(), lr=LR)
    loss = _loss(model, lf.base_params(model))
    for ids in batches:
        optimizer.zero_grad()
        loss(adapter.with_params(params), ids).backward()
        optimizer.step()
    return {k: v.detach() for k, v in params.items()}


def _torchopt_loop(model, adapter: lf.Adapter, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchopt's Adam on one adapter at a time, no vmap, no stack."""
    loss = _loss(model, lf.base_params(model))
    optimizer = torchopt.adam(lr=LR)
    params = {k: v.detach() for k, v in adapter.params.items()}
    state = optimizer.init(params)
    for ids in batches:
        updates, state = optimizer.update(grad(lambda p: loss(adapter.with_params(p), ids))(params), state, inplace=False)
        params = torchopt.apply_updates(params, updates, inplace=False)
    return params


def _assert_close(got: dict, want: dict, start: dict, rel: float) -> None:
    assert list(got) == list(want)
    for k in want:
        moved = (want[k] - start[k]).abs().max().item()
        assert moved > 1e-3, f"{k} did not move"
        # Against torch.optim (rel=1e-3): torchopt computes Adam's bias correction 1 - 0.999**t
        # in float32 (its step count is a float32 tensor), a relative error ~1e-5 per step that
        # Adam's normalisation compounds (seen: 1.6e-4 of the movement after 3 steps), while
        # everything else here is float64. A lost step or moment, or mixed stack members, is off
        # by a large part of the movement.
        diff = (got[k] - want[k]).abs().max().item()
        assert diff <= rel * moved, f"{k}: max abs diff {diff:.3g}, movement {moved:.3g}"


def test_optree_sees_the_leaves_torch_pytree_sees_and_rebuilds_the_same_types():
    import torch.utils._pytree as torch_pytree

    model = _model()
    a, b = _adapter(model, 0), _adapter(model, 1)
    ia3 = lf.init_adapter(model, lf.AdapterSpec("ia3", targets=["k_proj"], dtype=F64))  # one with buffers-free params of another shape
    for tree in (a, lf.compose(a, ia3), lf.combine([a, b], [0.3, 0.7]), lf.stack([a, b])):
        for namespace in ("", "lora_func"):
            leaves, treespec = optree.tree_flatten(tree, namespace=namespace)
            want = torch_pytree.tree_leaves(tree)
            assert len(leaves) == len(want) > 1 and all(x is y for x, y in zip(leaves, want, strict=True))
            again = optree.tree_unflatten(treespec, leaves)
            assert type(again) is type(tree) and torch_pytree.tree_structure(again) == torch_pytree.tree_structure(tree)
    doubled = optree.tree_map(lambda t: 2 * t, a)
    assert isinstance(doubled, lf.Adapter) and torch.equal(doubled.params[next(iter(a.params))], 2 * next(iter(a.params.values())))


def test_torchopt_adam_over_an_adapter_itself_equals_torch_optim_adam():
    model = _model()
    adapter = _adapter(model, 0)
    batches = [_ids(s) for s in range(STEPS)]
    loss = _loss(model, lf.base_params(model))
    optimizer = torchopt.adam(lr=LR)
    state = optimizer.init(adapter)  # the Adapter itself: optree walks it
    current = adapter
    for ids in batches:
        grads = grad(loss)(current, ids)  # an Adapter of gradients
        assert isinstance(grads, lf.Adapter)
        updates, state = optimizer.update(grads, state, inplace=False)
        current = torchopt.apply_updates(current, updates, inplace=False)
    assert isinstance(current, lf.Adapter)
    _assert_close(current.params, _torch_adam(model, adapter, batches), adapter.params, rel=1e-3)


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_vmapped_pure_step_over_a_stack_of_adapters_keeps_per_member_optimiser_state():
    model = _model()
    members = [_adapter(model, s) for s in range(3)]
    base = lf.base_params(model)
    optimizer = torchopt.adam(lr=LR)

    def step(adapter, opt_state, ids):
        """Pure, on Adapter objects: optree walks the adapter and its gradient alike."""
        grads = grad(lambda a: causal_lm_loss(lf.adapted_call(model, a, ids, base=base).logits, ids))(adapter)
        updates, opt_state = optimizer.update(grads, opt_state, inplace=False)
        return torchopt.apply_updates(adapter, updates, inplace=False), opt_state

    stacked = lf.stack(members)
    states = vmap(optimizer.init)(stacked)  # every moment and step count with the K axis
    # Each member its own batches: a step that mixed members' data or moments would show.
    batches = [torch.stack([_ids(10 * m + s) for m in range(3)]) for s in range(STEPS)]
    for ids in batches:
        stacked, states = vmap(step)(stacked, states, ids)
    got = lf.unstack(stacked)
    for m, member in enumerate(members):
        own = [ids[m] for ids in batches]
        # The same optimiser on this member alone, no vmap, no stack: equal up to float64 rounding.
        _assert_close(got[m].params, _torchopt_loop(model, member, own), member.params, rel=1e-10)
        # torch.optim.Adam, independent of torchopt (see _assert_close for the tolerance).
        _assert_close(got[m].params, _torch_adam(model, member, own), member.params, rel=1e-3)


def test_without_optree_nothing_is_registered_and_lora_func_still_imports():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['optree'] = None\n"  # makes `import optree` raise ImportError
        "import lora_func, lora_func._optree as o; assert not o.registered(); print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]

