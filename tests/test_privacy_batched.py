"""Batched losses (lora_func.privacy.batched_loss): one batched call, no vmap, the same clipped
sums as the explicit loop of per-example gradients.

The oracle is tests/test_privacy.py's loop (torch.func.grad per example, clipped, averaged),
at a bound between the examples' norms. The ``spy`` fixture makes the vmap paths raise and
records the batched pass's result and which way each layer took (ghost Gram norms, ghost
per-example gradients, or the variant's own form per example), so a test cannot pass by
silently falling back to the vmap path; the fallback tests assert the opposite.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import lora_func as lf
from lora_func.privacy import batched_loss, clipped_sum, ghost, noised_mean, private_grads
from lora_func.privacy import grads as grads_module
from tests.models import tiny_model, tokens
from tests.test_privacy import B, _adapter, _assert_rel, _between, _case, _lm_loss, _loop

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


def _example_losses(model, adapter, ids):
    """Each example's mean next-token cross-entropy from one batched call: (B,)."""
    logits = lf.adapted_call(model, adapter, ids).logits
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return per_token.view(ids.shape[0], -1).mean(1)


class _Spy:
    def __init__(self) -> None:
        self.passes: list[bool] = []  # per batched pass: whether it was used (not None)
        self.layers: list[str] = []  # per layer: "gram", "grads" (ghost) or "form" (its own form per example)
        self.vmap_allowed = False


@pytest.fixture
def spy(monkeypatch):
    seen = _Spy()
    batched, finish, per_example = ghost.batched_pass, ghost._Layer.finish, ghost._FormCall.per_example

    def batched_spy(*args, **kwargs):
        out = batched(*args, **kwargs)
        seen.passes.append(out is not None)
        return out

    def finish_spy(self, batch_size):
        seen.layers.append("gram" if self.gram else "grads")
        return finish(self, batch_size)

    def form_spy(self):
        seen.layers.append("form")
        return per_example(self)

    def no_vmap(original):
        def guarded(*args, **kwargs):
            assert seen.vmap_allowed, "the batched loss fell back to the vmap path"
            return original(*args, **kwargs)

        return guarded

    monkeypatch.setattr(grads_module, "batched_pass", batched_spy)
    monkeypatch.setattr(ghost._Layer, "finish", finish_spy)
    monkeypatch.setattr(ghost._FormCall, "per_example", form_spy)
    monkeypatch.setattr(grads_module, "ghost_pass", no_vmap(grads_module.ghost_pass))
    monkeypatch.setattr(grads_module, "per_example_grads", no_vmap(grads_module.per_example_grads))
    return seen


@pytest.mark.parametrize(
    ("name", "clipping", "layers"),
    [
        ("lora-llama", "ghost", ["gram"] * 4),
        ("lora-llama", "auto", ["grads"] * 4),  # 8 tokens, r=2: per-example gradients hold less
        ("lora-llama-nf4", "ghost", ["gram"] * 4),
        ("dora-gpt2-conv1d", "auto", ["form"] * 2),  # Conv1D sees (B·T, d): rows regrouped per example
        ("dora-llama-nf4", "auto", ["form"] * 4),
    ],
)
def test_a_batched_loss_equals_the_loop_without_vmap_on_a_float_and_an_nf4_base(name, clipping, layers, spy):
    model, adapter, ids, _, c, want, norms = _case(name)
    total = clipped_sum(batched_loss(functools.partial(_example_losses, model)), adapter, ids, max_grad_norm=c, clipping=clipping)
    _assert_rel({k: v / B for k, v in total.grads.items()}, want, 1e-5)
    assert total.clipped == int((norms > c).sum()) and total.count == B
    assert spy.passes == [True] and spy.layers == layers


def test_noise_has_std_sigma_c_over_b_and_the_generator_reproduces_it(spy):
    model, adapter, ids, _, c, clean, _ = _case("lora-llama")
    loss = batched_loss(functools.partial(_example_losses, model))
    sigma = 0.7
    total = clipped_sum(loss, adapter, ids, max_grad_norm=c)
    deviations = torch.stack([
        torch.cat([(noisy[k] - clean[k]).flatten() for k in clean])
        for noisy in (noised_mean(total, noise_multiplier=sigma, generator=torch.Generator().manual_seed(s)) for s in range(32))
    ]).double()
    assert deviations.numel() > 10_000 and abs(float(deviations.std()) / (sigma * c / B) - 1) < 0.05
    first, again = (private_grads(loss, adapter, ids, max_grad_norm=c, noise_multiplier=sigma, generator=torch.Generator().manual_seed(0))
                    for _ in range(2))
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = private_grads(loss, adapter, ids, max_grad_norm=c, noise_multiplier=sigma, generator=torch.Generator().manual_seed(1))
    assert all(not torch.allclose(other[k], first[k]) for k in first)
    assert spy.passes == [True] * 4


def _equals_the_loop(model, adapter, ids, clipping="auto"):
    _, norms = _loop(functools.partial(_lm_loss, model), adapter, ids, 1.0)
    c = _between(norms)
    want, _ = _loop(functools.partial(_lm_loss, model), adapter, ids, c)
    got = private_grads(batched_loss(functools.partial(_example_losses, model)), adapter, ids, max_grad_norm=c,
                        noise_multiplier=0.0, clipping=clipping)
    _assert_rel(got, want, 1e-5)


def test_a_composition_with_another_variant_stays_batched(spy):
    # LoRA's layers by ghost norms, IA3's (another form, a shared layer with LoRA) per example from its own form.
    model = tiny_model("llama")
    composed = lf.compose(_adapter(model, "lora", ["q_proj", "v_proj"]), _adapter(model, "ia3", ["v_proj", "k_proj"], seed=1))
    _equals_the_loop(model, composed, tokens(4, 8, seed=2), "ghost")
    assert spy.passes == [True] and sorted(spy.layers) == ["form"] * 4 + ["gram"] * 4


def test_an_embedding_lora_stays_batched_per_example_from_its_own_form(spy):
    # LoRA on embed_tokens gathers rows of A (no x Aᵀ product): no ghost form, its gradients from its form.
    model = tiny_model("llama")
    _equals_the_loop(model, _adapter(model, "lora", ["embed_tokens", "q_proj"]), tokens(4, 8, seed=2), "ghost")
    assert spy.passes == [True] and sorted(spy.layers) == ["form", "gram", "gram"]


@pytest.mark.parametrize(
    "case",
    ["combine", "merged", "weight-read", "per_example", "chunk_size"],
)
def test_what_one_batched_call_cannot_serve_runs_the_vmap_path_exactly(case, spy):
    model = tiny_model("llama")
    ids = tokens(4, 8, seed=2)
    spy.vmap_allowed = True
    lora = _adapter(model, "lora", ["q_proj", "v_proj"])
    if case == "combine":  # combine's own weights are in no layer's activation
        adapter = lf.combine([lora, _adapter(model, "lora", ["v_proj"], seed=1)], weights=[0.7, 0.4])
    elif case == "weight-read":  # HiRA reads the LoRA-merged weight of v_proj: LoRA's tensors reach it as a weight
        adapter = lf.compose(lora, _adapter(model, "hira", ["v_proj"], seed=1))
    else:
        adapter = lora
    _, norms = _loop(functools.partial(_lm_loss, model), adapter, ids, 1.0)
    c = _between(norms)
    want, _ = _loop(functools.partial(_lm_loss, model), adapter, ids, c)
    example_losses = functools.partial(_example_losses, model)
    if case == "merged":
        def example_losses(a, ids):
            logits = lf.adapted_call(model, a, ids, merged=True).logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1).mean(1)
    kwargs = {"clipping": "per_example"} if case == "per_example" else {"chunk_size": 2} if case == "chunk_size" else {}
    got = private_grads(batched_loss(example_losses), adapter, ids, max_grad_norm=c, noise_multiplier=0.0, **kwargs)
    _assert_rel(got, want, 1e-5)
    # combine is refused before any work; merged and weight-read after the forward; the others never try.
    assert spy.passes == {"merged": [False], "weight-read": [False]}.get(case, [])


def test_a_ghost_tensor_that_also_reaches_the_model_as_a_weight_is_no_longer_dropped_under_vmap():
    # compose(lora, hira) on v_proj: HiRA reads W + s·B A. The vmap ghost pass kept only the
    # activation path of LoRA's tensors (16 % off); it now falls back to per-example gradients.
    model = tiny_model("llama")
    adapter = lf.compose(_adapter(model, "lora", ["q_proj", "v_proj"]), _adapter(model, "hira", ["v_proj"], seed=1))
    ids = tokens(4, 8, seed=2)
    loss_fn = functools.partial(_lm_loss, model)
    _, norms = _loop(loss_fn, adapter, ids, 1.0)
    c = _between(norms)
    want, _ = _loop(loss_fn, adapter, ids, c)
    _assert_rel(private_grads(loss_fn, adapter, ids, max_grad_norm=c, noise_multiplier=0.0, clipping="ghost"), want, 1e-5)


@pytest.mark.parametrize("clipping", ["auto", "per_example"])
def test_a_batched_loss_of_the_wrong_shape_is_refused_on_either_path(clipping):
    model, adapter, ids, _, c, _, _ = _case("lora-llama")

    def batch_mean(a, ids):  # averaged over the batch: one value, not one per example
        return _example_losses(model, a, ids).mean()

    with pytest.raises(ValueError, match=r"returned a tensor of shape \(\) for a batch of (6 examples|1 example); .*one loss per example"):
        private_grads(batched_loss(batch_mean), adapter, ids, max_grad_norm=c, noise_multiplier=0.0, clipping=clipping)
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(6, 1\)"):
        private_grads(batched_loss(lambda a, ids: _example_losses(model, a, ids)[:, None]), adapter, ids, max_grad_norm=c,
                      noise_multiplier=0.0)
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        batched_loss("loss")


def test_private_step_and_the_train_private_mode_take_the_batched_path(spy):
    from lora_func.privacy import DPSGD, private_step_
    from lora_func.train import TrainState, train_step

    model, adapter, ids, _, c, want, _ = _case("lora-llama")
    leaves = adapter.with_params({k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()})
    optimizer = torch.optim.SGD(leaves.params.values(), lr=1.0)
    before = {k: v.detach().clone() for k, v in leaves.params.items()}
    private_step_(optimizer, leaves, batched_loss(functools.partial(_example_losses, model)), [(ids[:4],), (ids[4:],)],
                  DPSGD(max_grad_norm=c, noise_multiplier=0.0))
    _assert_rel({k: before[k] - v.detach() for k, v in leaves.params.items()}, want, 1e-5)
    assert spy.passes == [True, True]
    # lora_func.train's private mode: its causal-LM loss is a batched loss.
    spy.passes.clear()
    live = adapter.detach()
    state = TrainState(live, torch.optim.SGD(live.params.values(), lr=1.0))
    train_step(model, state, {"input_ids": ids}, privacy=DPSGD(max_grad_norm=c, noise_multiplier=0.0), micro_batch_size=3)
    _assert_rel({k: before[k] - v.detach() for k, v in live.params.items()}, want, 1e-5)
    assert spy.passes == [True, True]
