"""lora_func.many (mixed_call, ensemble_call, per_example_grads): mixed-adapter batches, ensembles and per-example gradients, each against
a Python loop (outputs and gradients, per tensor, after perturbing every adapter so they differ),
with per-example attention masks (left padding)."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad
from torch.utils._python_dispatch import TorchDispatchMode

import lora_func as lf
from lora_func.many import ensemble_call, mixed_call, per_example_grads
from tests.contract_helpers import assert_unchanged, perturbed_adapters, snapshot, probe as _probe
from tests.models import tiny_model, tokens


def _close(got: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Equal up to fp32 round-off relative to the tensor's scale (batched and per-example
    kernels sum in different orders; a wrong example or adapter is off by O(scale))."""
    got, expected = got.detach(), expected.detach()
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(scale, 1.0), msg=msg or None)


def _adapters(model, kind: str, variant: str = "lora", ranks=(2, 2, 2, 2)):
    return perturbed_adapters(model, kind, variant, ranks)


def _batch(size: int = 4, length: int = 8):
    ids = tokens(size, length, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on some rows: each example needs its own mask row
    mask[-1, :1] = 0
    return ids, mask


def _leaves(adapter) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in adapter.params.items()}


@pytest.mark.parametrize(("kind", "variant"), [("llama", "lora"), ("gpt2", "lora"), ("llama", "dora")])
def test_mixed_call_equals_a_per_example_loop_outputs_and_gradients(kind, variant):
    model = tiny_model(kind)
    snap = snapshot(model)
    adapters = _adapters(model, kind, variant)
    stacked = lf.stack(adapters)
    index = torch.tensor([2, 0, 2, 1])  # a repeat, and member 3 unused
    ids, mask = _batch()

    got = mixed_call(model, stacked, index, ids, attention_mask=mask, use_cache=False).logits
    loop = [lf.adapted_call(model, adapters[int(k)], ids[j : j + 1], attention_mask=mask[j : j + 1]).logits[0] for j, k in enumerate(index)]
    for j in range(len(ids)):
        _close(got[j], loop[j])
    # Power: the adapters differ enough that one adapter for the whole batch gives other logits.
    one = lf.adapted_call(model, adapters[0], ids, attention_mask=mask).logits
    assert not torch.allclose(got[0], one[0], atol=1e-3)

    probe = _probe(got.shape)

    def mixed_loss(p):
        return (mixed_call(model, stacked.with_params(p), index, ids, attention_mask=mask, use_cache=False).logits * probe).sum()

    grads = grad(mixed_loss)(_leaves(stacked))
    for k, adapter in enumerate(adapters):
        rows = [j for j, i in enumerate(index.tolist()) if i == k]

        def member_loss(p, adapter=adapter, rows=rows):
            a = adapter.with_params(p)
            return sum((lf.adapted_call(model, a, ids[j : j + 1], attention_mask=mask[j : j + 1]).logits[0] * probe[j]).sum() for j in rows)

        expected = grad(member_loss)(_leaves(adapter)) if rows else {key: torch.zeros_like(v) for key, v in adapter.params.items()}
        for key in adapter.params:
            if rows:
                _close(grads[key][k], expected[key], f"member {k} {key}")
                assert expected[key].abs().max() > 0, key
            else:
                assert torch.equal(grads[key][k], expected[key]), f"unused member {k} got a gradient in {key}"
    assert_unchanged(model, snap)


def test_mixed_call_on_a_rank_padded_stack_equals_the_originals():
    model = tiny_model("llama")
    adapters = _adapters(model, "llama", ranks=(1, 2, 4))
    stacked = lf.stack(adapters)
    index = torch.tensor([2, 1, 0, 2])
    ids, mask = _batch()
    probe = _probe((4, 8, 61))

    def mixed_loss(p):
        return (mixed_call(model, stacked.with_params(p), index, ids, attention_mask=mask, use_cache=False).logits * probe).sum()

    grads, value = torch.func.grad_and_value(mixed_loss)(_leaves(stacked))
    expected = sum((lf.adapted_call(model, adapters[int(k)], ids[j : j + 1], attention_mask=mask[j : j + 1]).logits[0] * probe[j]).sum() for j, k in enumerate(index))
    _close(value, expected)
    # Member 0 (r=1) is used once, by example 2: its gradient is that example's, padding exactly 0.
    own = grad(lambda p: (lf.adapted_call(model, adapters[0].with_params(p), ids[2:3], attention_mask=mask[2:3]).logits[0] * probe[2]).sum())(_leaves(adapters[0]))
    for key, g in own.items():
        padded = grads[key][0]
        rank_axis = 0 if key.endswith("lora_A") else 1
        _close(padded.narrow(rank_axis, 0, 1), g, key)
        assert torch.equal(padded.narrow(rank_axis, 1, padded.shape[rank_axis] - 1), torch.zeros_like(padded.narrow(rank_axis, 1, padded.shape[rank_axis] - 1)))


def test_mixed_call_returns_per_example_losses_and_passes_shared_arguments_whole():
    model = tiny_model("llama")
    adapters = _adapters(model, "llama", ranks=(2, 2))
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    index = torch.tensor([1, 0, 0, 1])
    positions = torch.arange(8)[None]  # (1, T): shared by every example
    out = mixed_call(model, lf.stack(adapters), index, ids, attention_mask=mask, labels=labels, position_ids=positions, use_cache=False)
    assert out.loss.shape == (4,)
    for j, k in enumerate(index.tolist()):
        ref = lf.adapted_call(model, adapters[k], ids[j : j + 1], attention_mask=mask[j : j + 1], labels=labels[j : j + 1], position_ids=positions)
        _close(out.loss[j], ref.loss)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_per_example_grads_equal_a_loop(kind):
    model = tiny_model(kind)
    (adapter,) = _adapters(model, kind, ranks=(2,))
    ids, mask = _batch()
    weights = _probe((4, 7, 61), seed=3)

    def loss_fn(a, ids_, mask_, weights_):
        logits = lf.adapted_call(model, a, ids_, attention_mask=mask_).logits
        return (logits[:, :-1].log_softmax(-1) * weights_).sum(), logits.detach().sum()

    got, aux = per_example_grads(loss_fn, adapter, ids, mask, weights, has_aux=True)
    with torch.no_grad():  # computes its own reverse pass: fine under no_grad
        chunked, _ = per_example_grads(loss_fn, adapter, ids, mask, weights, has_aux=True, chunk_size=3)
    # The torch.func idiom it replaces (same numbers, ~10 % slower on the CPU benchmark).
    idiom = torch.func.vmap(
        grad(lambda p, *ex: loss_fn(adapter.with_params(p), *(t[None] for t in ex))[0]), in_dims=(None, 0, 0, 0)
    )(_leaves(adapter), ids, mask, weights)
    assert aux.shape == (4,) and not aux.requires_grad
    for j in range(len(ids)):
        expected, expected_aux = grad(loss_fn, has_aux=True)(adapter, ids[j : j + 1], mask[j : j + 1], weights[j : j + 1])
        _close(aux[j], expected_aux)
        for key in adapter.params:
            _close(got[key][j], expected.params[key], f"example {j} {key}")
            _close(chunked[key][j], got[key][j])
            _close(idiom[key][j], got[key][j])
    # Examples differ (the loop would not catch a broadcast of example 0's gradient otherwise).
    assert not torch.allclose(got[next(iter(got))][0], got[next(iter(got))][1])


def test_ensemble_call_equals_a_loop_and_builds_no_merged_weight():
    model = tiny_model("llama")
    adapters = _adapters(model, "llama", ranks=(2, 2, 2))
    stacked = lf.stack(adapters)
    ids, mask = _batch(2, 5)  # 10 tokens: no activation has a target weight's shape (32, 32) or (16, 32)
    got = ensemble_call(model, stacked, ids, attention_mask=mask, use_cache=False).logits
    probe = _probe(got.shape)
    grads = grad(lambda p: (ensemble_call(model, stacked.with_params(p), ids, attention_mask=mask, use_cache=False).logits * probe).sum())(_leaves(stacked))
    for k, adapter in enumerate(adapters):
        _close(got[k], lf.adapted_call(model, adapter, ids, attention_mask=mask).logits)
        expected = grad(lambda p, a=adapter, k=k: (lf.adapted_call(model, a.with_params(p), ids, attention_mask=mask).logits * probe[k]).sum())(_leaves(adapter))
        for key in adapter.params:
            _close(grads[key][k], expected[key], f"member {k} {key}")

    weight_shapes = {tuple(lf.base_params(model)[layer.target.weight_key].shape) for layer in adapters[0].layers}

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.merged = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                # A new (K, d_out, d_in) tensor is the members' merged copies of a target weight.
                self.merged += isinstance(t, torch.Tensor) and not t._is_view() and t.dim() == 3 and t.shape[0] == 3 and tuple(t.shape[1:]) in weight_shapes
            return out

    for merged, expect_copies in ((False, False), (True, True)):
        with torch.no_grad(), Shapes() as seen:
            ensemble_call(model, stacked, ids, attention_mask=mask, use_cache=False, merged=merged)
        assert (seen.merged > 0) == expect_copies, f"merged={merged}: {seen.merged} merged-weight stacks"


def test_dropout_in_train_mode_needs_randomness():
    model = tiny_model("gpt2")
    model.config.attn_pdrop = 0.5
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    model.train()
    adapters = _adapters(model, "gpt2", ranks=(2, 2))
    ids, _ = _batch()
    index = torch.tensor([0, 1, 1, 0])
    with pytest.raises(RuntimeError, match="randomness"):
        mixed_call(model, lf.stack(adapters), index, ids, use_cache=False)
    torch.manual_seed(0)
    out = mixed_call(model, lf.stack(adapters), index, ids, use_cache=False, randomness="different").logits
    assert out.shape == (4, 8, 61) and out.isfinite().all()


# ----------------------------------------------------------------------------------- errors


@pytest.fixture
def llama():
    return tiny_model("llama")


def test_errors_name_the_problem_and_the_fix(llama):
    snap = snapshot(llama)
    adapters = _adapters(llama, "llama", ranks=(2, 2))
    stacked = lf.stack(adapters)
    ids, mask = _batch()
    index = torch.tensor([0, 1, 0, 1])
    with pytest.raises(TypeError, match=r"index must be a 1-D int64 or int32 tensor.*torch.float32"):
        mixed_call(llama, stacked, index.float(), ids)
    with pytest.raises(ValueError, match=r"stack_shape \(K,\)\), got stack_shape \(\); pass a list of adapters or lora_func.stack"):
        mixed_call(llama, adapters[0], index, ids)
    with pytest.raises(ValueError, match=r"len\(index\)=3"):
        mixed_call(llama, stacked, index[:3], ids)
    with pytest.raises(IndexError, match=r"outside \[0, 2\)"):
        mixed_call(llama, stacked, torch.tensor([0, 1, 2, 0]), ids)
    # The vmap route's refusals (the default in-layer route returns the cache and runs SDPA).
    with pytest.raises(TypeError, match=r"DynamicCache at output\['past_key_values'\].*use_cache=False"):
        mixed_call(llama, stacked, index, ids, batching="vmap")
    with pytest.raises(TypeError, match=r"DynamicCache.*use_cache=False"):
        ensemble_call(llama, stacked, ids, batching="vmap")
    with pytest.raises(ValueError, match=r"all of one size B; got dim-0 sizes \[3, 4\]"):
        per_example_grads(lambda a, x, m: x.sum(), adapters[0], ids, mask[:3])
    llama.config._attn_implementation = "sdpa"
    for call in (lambda: mixed_call(llama, stacked, index, ids, batching="vmap"), lambda: ensemble_call(llama, stacked, ids, batching="vmap")):
        with pytest.raises(ValueError, match=r"attention implementation is 'sdpa'.*set_attn_implementation\('eager'\)"):
            call()

    def loss(a, x, m):
        return lf.adapted_call(llama, a, x, attention_mask=m).logits.sum()

    with pytest.raises(RuntimeError, match=r"(?s)data-dependent control flow.*SDPA or flash attention.*attn_implementation='eager'"):
        per_example_grads(loss, adapters[0], ids, mask)
    llama.config._attn_implementation = "eager"
    assert_unchanged(llama, snap)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers deprecations hit through peft/opacus
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # Opacus' hooks on a frozen-input model
def test_the_benchmark_runs_at_tiny_size(capsys):
    import runpy
    from pathlib import Path

    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "functional.py"))
    threads = torch.get_num_threads()
    try:
        results = bench["main"](["--quick"])
    finally:
        torch.set_num_threads(threads)  # main() pins one thread for its timings
    assert set(results) == {"per_example_over_batched", "mixed_over_single"}
    out = capsys.readouterr().out
    assert "per_example_grads" in out and "mixed_call" in out and "merged weights" in out


def test_mixed_call_and_the_in_layer_route_agree_on_logits_and_member_gradients():
    """The two mixed-adapter routes (whole model under vmap; per-row adapters inside the target
    layers) on the same stack, index and eager model: same logits, same per-member gradients."""
    model = tiny_model("llama")
    stacked = lf.stack(_adapters(model, "llama", "dora", ranks=(2, 2, 2)))
    index = torch.tensor([1, 2, 1, 0])
    ids, mask = _batch()
    probe = _probe((4, 8, 61))

    def loss(route, p):
        return (route(model, stacked.with_params(p), index, ids, attention_mask=mask, use_cache=False).logits * probe).sum()

    params = _leaves(stacked)
    vmapped = grad(lambda p: loss(mixed_call, p))(params)
    in_layers = grad(lambda p: loss(lf.mixed_call, p))(params)
    for key in params:
        _close(in_layers[key], vmapped[key], key)
        assert vmapped[key].abs().max() > 0
    _close(lf.mixed_call(model, stacked, index, ids, attention_mask=mask, batching="layers").logits, mixed_call(model, stacked, index, ids, attention_mask=mask, use_cache=False).logits)


# ------------------------------------------------------------- the in-layer route (the default)


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_ensemble_call_runs_sdpa_and_trains_every_member_with_backward(variant):
    """The default route applies each member inside the target layers, so SDPA attention (which
    has no vmap rule) works; outputs, loss.backward() gradients per member and chunking equal a
    loop over the members (DoRA: the per-row vmap path, LoRA: the gathered products)."""
    model = tiny_model("llama")
    model.config._attn_implementation = "sdpa"
    adapters = _adapters(model, "llama", variant=variant, ranks=(2, 3, 2))
    leaves = [a.detach() for a in adapters]
    stacked = lf.stack(leaves)
    ids, mask = _batch(2, 6)
    got = ensemble_call(model, stacked, ids, attention_mask=mask)
    probe = _probe(got.logits.shape)
    (got.logits * probe).sum().backward()
    chunked = ensemble_call(model, stacked, ids, attention_mask=mask, chunk_size=2).logits
    for k, adapter in enumerate(leaves):
        member = lf.take(stacked, k).detach()
        expected = lf.adapted_call(model, member, ids, attention_mask=mask).logits
        _close(got.logits[k], expected, f"member {k}")
        _close(chunked[k], expected, f"member {k}, chunked")
        (expected * probe[k]).sum().backward()
        for key, tensor in member.params.items():
            padded = stacked.params[key].grad[k]
            own = padded[tuple(slice(0, n) for n in tensor.shape)]
            _close(own, tensor.grad, f"member {k} {key}")
    assert got.past_key_values is not None  # the KV cache comes back (for K * B rows)


def test_ensemble_and_mixed_call_keep_the_vmap_route_where_only_it_answers():
    model = tiny_model("gpt2")
    adapters = _adapters(model, "gpt2", ranks=(2, 2))
    stacked = lf.stack(adapters)
    ids, _ = _batch(2, 6)
    # A loss from labels: one per member (vmap), not one mean over K * B rows.
    out = ensemble_call(model, stacked, ids, labels=ids, use_cache=False)
    assert out.loss.shape == (2,)
    for k, adapter in enumerate(adapters):
        _close(out.loss[k], lf.adapted_call(model, adapter, ids, labels=ids).loss)
    # Train mode with dropout: randomness="error" still refuses (as vmap does), "different" runs in the layers.
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    with pytest.raises(RuntimeError, match="randomness"):
        ensemble_call(model, stacked, ids, use_cache=False)
    assert ensemble_call(model, stacked, ids, randomness="different").logits.shape == (2, 2, 6, 61)
    model.eval()
    with pytest.raises(ValueError, match=r"batching='rows' is not one of \['auto', 'layers', 'vmap'\]"):
        mixed_call(model, stacked, torch.tensor([0, 1]), ids, batching="rows")
    # mixed_call on the default route equals the per-example vmap route.
    index = torch.tensor([1, 0])
    _close(mixed_call(model, stacked, index, ids).logits, mixed_call(model, stacked, index, ids, batching="vmap", use_cache=False).logits)
