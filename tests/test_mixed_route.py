"""lora_func.many (mixed_adapted, mixed_call): per-row adapters inside the target layers, against per-sequence oracles.

Oracles: a Python loop of ``lf.adapted_call`` per example (logits, per-adapter gradients) and
``with lf.adapted(model, its_adapter): model.generate(...)`` per sequence (generation). Every
adapter is perturbed with its own random non-symmetric noise, and each test asserts that the
adapters really give different outputs (a route that ignored the index would fail). Attention
is SDPA (the models' default; the old vmap route needed eager) and the KV cache is on.
"""

from __future__ import annotations

import pytest
import torch

import lora_func as lf
from lora_func.variants import list_variants
from tests.contract_helpers import assert_unchanged, build, perturbed, perturbed_adapters, snapshot, probe as _probe
from tests.models import DEFAULT_TARGETS, tiny_model, tokens
from tests.variant_table import ROWS

K = 4


def _close(got: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """fp32, atol 1e-5 relative to the tensor's scale (batched and per-example kernels sum in
    different orders; a wrong row or adapter is off by O(scale))."""
    got, expected = got.detach(), expected.detach()
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(scale, 1.0), msg=msg or None)


def _sdpa(model):
    model.config._attn_implementation = "sdpa"
    return model


def _tenants(model, kind: str, variant: str = "lora", count: int = K, ranks=None) -> list[lf.Adapter]:
    return perturbed_adapters(model, kind, variant, [2] * count if ranks is None else ranks[:count])


def _batch(size: int = 5, length: int = 8):
    ids = tokens(size, length, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[-1, -2:] = 0  # right padding (training batches)
    return ids, mask


def _loop_logits(model, adapters, index, ids, mask) -> list[torch.Tensor]:
    return [lf.adapted_call(model, adapters[int(k)], ids[j : j + 1], attention_mask=mask[j : j + 1]).logits[0] for j, k in enumerate(index)]


def _check_logits_and_gradients(model, adapters, index, ids, mask) -> None:
    """Logits equal the per-example loop; each adapter's .grad equals the loop's gradient of
    the loss restricted to its rows (zero for an adapter no row uses)."""
    snap = snapshot(model)
    for a in adapters:
        for t in a.params.values():
            t.grad = None
    out = lf.mixed_call(model, adapters, index, ids, attention_mask=mask, batching="layers").logits
    loop = _loop_logits(model, adapters, index, ids, mask)
    for j in range(len(ids)):
        _close(out[j], loop[j], f"row {j}")
    # Power: the same rows through one adapter give other logits.
    one = lf.adapted_call(model, adapters[int(index[0])], ids, attention_mask=mask).logits
    assert any(not torch.allclose(out[j], one[j], atol=1e-3) for j in range(len(ids)) if index[j] != index[0])
    probe = _probe(out.shape)
    (out * probe).sum().backward()
    for k, adapter in enumerate(adapters):
        rows = [j for j, i in enumerate(index.tolist()) if i == k]
        leaves = {key: v.detach().requires_grad_(True) for key, v in adapter.params.items()}
        if rows:
            mine = adapter.with_params(leaves)
            loss = sum((lf.adapted_call(model, mine, ids[j : j + 1], attention_mask=mask[j : j + 1]).logits[0] * probe[j]).sum() for j in rows)
            expected = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True), strict=True))
        for key, t in adapter.params.items():
            if not rows:
                assert t.grad is None or torch.count_nonzero(t.grad) == 0, f"unused adapter {k} got a gradient in {key}"
                continue
            want = expected[key] if expected[key] is not None else torch.zeros_like(t)
            if t.grad is None and key.rsplit(".", 1)[-1] in ROWS[adapter.spec.variant].training_only:
                continue  # acts in training steps only (Row.training_only)
            assert t.grad is not None, f"adapter {k} {key}: no gradient"
            _close(t.grad, want, f"adapter {k} {key}")
    assert_unchanged(model, snap)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("layer_kind", ["linear", "conv1d"])
@pytest.mark.parametrize("variant", sorted(ROWS))
def test_every_variant_logits_and_per_adapter_gradients_equal_a_per_example_loop(variant, layer_kind):
    row = ROWS[variant]
    model, adapter = build(row, layer_kind)
    _sdpa(model)
    # K tenants of the same structure (same calibration / residual buffers), each perturbed alike in
    # scale, independently in values.
    adapters = [perturbed(adapter, max(row.perturb_scale, 0.1), seed=30 + i) for i in range(3)]
    index = torch.tensor([2, 0, 2, 1, 0])
    ids, mask = _batch()
    _check_logits_and_gradients(model, adapters, index, ids, mask)


def test_the_variant_table_covers_every_registered_variant():
    assert set(ROWS) == set(list_variants())


def test_an_unused_adapter_and_differing_ranks_through_a_list():
    model = _sdpa(tiny_model("llama"))
    adapters = _tenants(model, "llama", ranks=(1, 2, 4, 2))
    index = torch.tensor([2, 1, 0, 2, 1])  # adapter 3 unused
    ids, mask = _batch()
    _check_logits_and_gradients(model, adapters, index, ids, mask)
    # The list members keep their own shapes (the rank padding is internal).
    assert tuple(adapters[0].params["model.layers.0.self_attn.q_proj.lora_A"].grad.shape) == (1, 32)


def test_a_stacked_adapter_under_torch_func_grad_gives_each_member_its_rows_gradient():
    model = _sdpa(tiny_model("gpt2"))
    adapters = _tenants(model, "gpt2")
    stacked = lf.stack(adapters)
    index = torch.tensor([3, 1, 3, 0, 1])  # member 2 unused
    ids, mask = _batch()
    probe = _probe((5, 8, 61))

    def loss(p):
        return (lf.mixed_call(model, stacked.with_params(p), index, ids, attention_mask=mask, batching="layers").logits * probe).sum()

    grads = torch.func.grad(loss)({k: v.detach() for k, v in stacked.params.items()})
    for k, adapter in enumerate(adapters):
        rows = [j for j, i in enumerate(index.tolist()) if i == k]

        def own(p, adapter=adapter, rows=rows):
            a = adapter.with_params(p)
            return sum((lf.adapted_call(model, a, ids[j : j + 1], attention_mask=mask[j : j + 1]).logits[0] * probe[j]).sum() for j in rows)

        expected = torch.func.grad(own)({key: v.detach() for key, v in adapter.params.items()}) if rows else None
        for key in adapter.params:
            if rows:
                _close(grads[key][k], expected[key], f"member {k} {key}")
                assert expected[key].abs().max() > 0
            else:
                assert torch.count_nonzero(grads[key][k]) == 0


def test_a_model_loss_from_labels_is_the_batch_loss_of_the_per_row_logits():
    model = _sdpa(tiny_model("llama"))
    adapters = _tenants(model, "llama")
    index = torch.tensor([0, 1, 2, 3, 0])
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    out = lf.mixed_call(model, adapters, index, ids, attention_mask=mask, labels=labels, batching="layers")
    logits = torch.stack(_loop_logits(model, adapters, index, ids, mask))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    _close(out.loss, expected)


# ------------------------------------------------------------------------------ generation


def _generation_setup(kind: str, variant: str = "lora"):
    model = _sdpa(tiny_model(kind))
    adapters = _tenants(model, kind, variant)
    ids = tokens(6, 7, seed=11)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as generation needs
    mask[4, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    index = torch.tensor([3, 0, 1, 2, 0, 3])
    return model, adapters, index, ids, mask


def _alone(model, adapter, ids, mask, **generation):
    with torch.no_grad(), lf.adapted(model, adapter):
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **generation)


GREEDY = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "use_cache": True}


@pytest.mark.parametrize(("kind", "variant"), [("llama", "lora"), ("gpt2", "lora"), ("llama", "dora"), ("gpt2", "hra")])
def test_greedy_generation_token_for_token_equals_each_sequence_alone(kind, variant):
    model, adapters, index, ids, mask = _generation_setup(kind, variant)
    snap = snapshot(model)
    with torch.no_grad(), lf.mixed_adapted(model, adapters, index) as same:
        assert same is model
        got = model.generate(ids, attention_mask=mask, pad_token_id=0, **GREEDY)
    for j, k in enumerate(index.tolist()):
        assert torch.equal(got[j], _alone(model, adapters[k], ids[j : j + 1], mask[j : j + 1], **GREEDY)[0]), f"sequence {j}"
    # Power: the adapters lead to different generations (so a route that used one adapter fails).
    first = _alone(model, adapters[0], ids, mask, **GREEDY)
    assert not torch.equal(got, first)
    assert len({tuple(_alone(model, a, ids[:1], mask[:1], **GREEDY)[0, 7:].tolist()) for a in adapters}) > 1
    assert_unchanged(model, snap)
    assert not any("forward" in vars(m) for m in model.modules()), "a replaced forward was left on the model"


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sampled_generation_with_a_fixed_seed_equals_each_adapter_on_the_whole_batch(kind):
    """Sampling draws one (rows, vocab) block per step from the global RNG, so a sequence sampled
    alone draws other numbers. The oracle keeps the draws: the whole batch generated with adapter
    k under the same seed gives, on the rows that use k, exactly the mixed batch's tokens (each
    row's distribution depends on its own tokens and adapter only)."""
    model, adapters, index, ids, mask = _generation_setup(kind)
    sampling = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": True, "top_k": 0, "use_cache": True}
    torch.manual_seed(1234)
    with torch.no_grad(), lf.mixed_adapted(model, adapters, index):
        got = model.generate(ids, attention_mask=mask, pad_token_id=0, **sampling)
    per_adapter = []
    for adapter in adapters:
        torch.manual_seed(1234)
        per_adapter.append(_alone(model, adapter, ids, mask, **sampling))
    for j, k in enumerate(index.tolist()):
        assert torch.equal(got[j], per_adapter[k][j]), f"sequence {j}"
    assert not torch.equal(got, per_adapter[0])


def test_beam_search_and_return_sequences_expand_the_index_per_sequence():
    model, adapters, index, ids, mask = _generation_setup("llama")
    beams = {"max_new_tokens": 5, "min_new_tokens": 5, "num_beams": 3, "num_return_sequences": 2, "do_sample": False}
    with torch.no_grad(), lf.mixed_adapted(model, adapters, index):
        got = model.generate(ids, attention_mask=mask, pad_token_id=0, **beams)
    assert got.shape[0] == 2 * len(ids)
    for j, k in enumerate(index.tolist()):
        alone = _alone(model, adapters[k], ids[j : j + 1], mask[j : j + 1], **beams)
        assert torch.equal(got[2 * j : 2 * j + 2], alone), f"sequence {j}"


def test_a_batch_that_is_not_a_multiple_of_the_index_is_refused_and_the_model_restored():
    model, adapters, index, ids, mask = _generation_setup("llama")
    with pytest.raises(ValueError, match="the batch has 4 rows on dim 0, but len\\(index\\)=6"):
        with lf.mixed_adapted(model, adapters, index):
            model(ids[:4], attention_mask=mask[:4])
    assert "forward" not in vars(model.model.layers[0].self_attn.q_proj)
    plain = model(ids, attention_mask=mask).logits
    with torch.no_grad():
        torch.testing.assert_close(plain, model(ids, attention_mask=mask).logits)


# ------------------------------------------------------------------- checkpointing, quantized


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_with_the_same_per_row_adapters(reentrant):
    model = _sdpa(tiny_model("llama"))
    adapters = _tenants(model, "llama")
    index = torch.tensor([1, 0, 3, 2, 1])
    ids, mask = _batch()

    def grads():
        for a in adapters:
            for t in a.params.values():
                t.grad = None
        out = lf.mixed_call(model, adapters, index, ids, attention_mask=mask, use_cache=False, batching="layers").logits
        (out * _probe(out.shape)).sum().backward()
        return [{k: t.grad.clone() for k, t in a.params.items()} for a in adapters]

    plain = grads()
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()  # as peft does: the blocks' inputs must require grad
    try:
        checkpointed = grads()
    finally:
        model.activation_checkpointing_disable()
        if reentrant:
            model.disable_input_require_grads()
        model.eval()
    for want, got in zip(plain, checkpointed, strict=True):
        for key in want:
            _close(got[key], want[key], key)
            assert want[key].abs().max() > 0


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_lora_on_a_quantized_base_equals_each_row_on_the_module_route():
    from tests.quantized_models import quantized_llama

    model = quantized_llama("bnb-nf4")
    adapters = []
    for i in range(3):
        spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2)
        adapters.append(perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(i)), 0.3, seed=40 + i))
    index = torch.tensor([2, 0, 1, 2])
    ids = tokens(4, 8, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        got = lf.mixed_call(model, adapters, index, ids, attention_mask=mask, batching="layers").logits
        for j, k in enumerate(index.tolist()):
            _close(got[j], lf.adapted_call(model, adapters[k], ids[j : j + 1], attention_mask=mask[j : j + 1]).logits[0], f"row {j}")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_other_variants_on_a_quantized_base_are_refused_naming_the_supported_ones():
    from tests.quantized_models import quantized_llama

    model = quantized_llama("bnb-nf4")
    spec = lf.AdapterSpec("dora", targets=["q_proj"], r=2)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="'eva', 'lora'"):
        lf.mixed_call(model, [adapter, adapter], torch.tensor([0, 1]), tokens(2, 4), batching="layers")


def test_an_in_place_update_of_a_stack_inside_a_block_is_seen_by_the_next_call():
    """The gathered LoRA factors are reused across calls while grad is off (decoding steps);
    an in-place change of the stack's tensors must invalidate them. (A list is stacked once, on
    entering the block: its values at entry are used.)"""
    model = _sdpa(tiny_model("llama"))
    stacked = lf.stack([a.detach() for a in _tenants(model, "llama", count=2)])
    index = torch.tensor([1, 0, 1])
    ids = tokens(3, 6, seed=2)
    with torch.no_grad(), lf.mixed_adapted(model, stacked, index):
        before = model(ids).logits
        stacked.params["model.layers.0.self_attn.q_proj.lora_B"][1].mul_(-2.0)
        after = model(ids).logits
    for j, k in enumerate(index.tolist()):
        _close(after[j], lf.adapted_call(model, lf.take(stacked, k), ids[j : j + 1]).logits[0], f"row {j}")
    assert not torch.allclose(before[0], after[0], atol=1e-3)
    _close(before[1], after[1])  # row 1 uses adapter 0, unchanged


def test_dropout_acts_per_row_in_training_only():
    """peft's lora_dropout in a training step: each row draws its own mask (rows with the same
    input and adapter differ), and in eval mode the route is deterministic and exact."""
    model = _sdpa(tiny_model("llama"))
    spec = lf.AdapterSpec("lora", targets=DEFAULT_TARGETS["llama"], r=2, dropout=0.5)
    adapters = [perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(i)), 0.3, seed=i) for i in range(2)]
    ids = tokens(1, 6, seed=3).repeat(2, 1)
    index = torch.tensor([0, 0])
    model.train()
    try:
        torch.manual_seed(0)
        trained = lf.mixed_call(model, adapters, index, ids, batching="layers").logits
    finally:
        model.eval()
    assert not torch.allclose(trained[0], trained[1], atol=1e-4)
    evaluated = lf.mixed_call(model, adapters, index, ids, batching="layers").logits
    _close(evaluated[0], lf.adapted_call(model, adapters[0], ids[:1]).logits[0])
    _close(evaluated[0], evaluated[1])


@pytest.mark.parametrize("as_sequence", [list, tuple], ids=["list", "tuple"])
def test_a_python_sequence_of_positions_is_an_index(as_sequence):
    """mixed_adapted and mixed_call take a list or tuple of ints as the index tensor."""
    model = _sdpa(tiny_model("llama"))
    adapters = _tenants(model, "llama", ranks=(2, 2, 2))
    positions = [2, 0, 1, 0, 2]
    ids, mask = _batch()
    want = lf.mixed_call(model, adapters, torch.tensor(positions), ids, attention_mask=mask, batching="layers").logits
    got = lf.mixed_call(model, adapters, as_sequence(positions), ids, attention_mask=mask, batching="layers").logits
    assert torch.equal(got, want)
    with torch.no_grad(), lf.mixed_adapted(model, adapters, as_sequence(positions)):
        inside = model(ids, attention_mask=mask).logits
    assert torch.equal(inside, want.detach())
    with pytest.raises(TypeError, match="int64 or int32 tensor"):  # bools and floats are not positions
        lf.mixed_call(model, adapters, as_sequence([True, False, True, False, True]), ids, batching="layers")


# ----------------------------------------------------------------------------- the low-rank declaration


def _declaring_variants() -> list[str]:
    return [name for name in list_variants() if lf.get_variant(name).low_rank is not None]


def test_the_built_in_low_rank_variants_declare_it():
    assert set(_declaring_variants()) >= {"lora", "eva"}


@pytest.mark.parametrize("name", _declaring_variants())
def test_a_low_rank_declaration_is_the_activation_form(name):
    """``Variant.low_rank`` says the activation form is ``base(x) + s (x Aᵀ) Bᵀ``: check it on
    random factors (B non-zero) against the declared names and scale, each factor a param or a
    buffer as the tensor schema says (MiCA's B is frozen); with the ``replaces_weight`` trait the
    base is the variant's residual ``W_res`` (PiSSA's family), else the layer's own op."""
    from lora_func._layer_ops import LayerCall
    from lora_func.variants import LayerInfo

    variant = lf.get_variant(name)
    form = variant.low_rank
    g = torch.Generator().manual_seed(3)
    d_in, d_out, r = 6, 5, 3
    info = LayerInfo(d_in, d_out, r, 7.0, True, tuple(sorted(variant.default_options.items())))
    factors = {form.a: torch.randn(r, d_in, generator=g), form.b: torch.randn(d_out, r, generator=g)}
    params = {k: v for k, v in factors.items() if not variant.tensors[k].buffer}
    buffers = {k: v for k, v in factors.items() if variant.tensors[k].buffer}
    weight, bias, x = torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g), torch.randn(2, 4, d_in, generator=g)
    base = LayerCall(weight, bias, lambda t: torch.nn.functional.linear(t, weight, bias))
    frozen = base
    if variant.replaces_weight:
        buffers["W_res"] = w_res = torch.randn(d_out, d_in, generator=g)
        frozen = LayerCall(w_res, bias, lambda t: torch.nn.functional.linear(t, w_res, bias))
    got = variant.activation_form(params, buffers, x, base, info)
    scale = form.scale(info, None)
    want = frozen(x) + scale * (x @ factors[form.a].T) @ factors[form.b].T
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got - base(x)).abs().max() > 0.1


def test_the_batched_path_follows_the_declaration_not_the_function(monkeypatch):
    """A variant with LoRA's forms but no ``low_rank`` runs its form per row (under vmap), one that
    declares it takes the batched ``bmm`` path whatever its activation form's identity; both give
    the per-row loop's logits."""
    import dataclasses

    import lora_func.many as many
    from lora_func.variants import _REGISTRY, _discover

    lora = lf.get_variant("lora")
    _discover()
    undeclared = dataclasses.replace(lora, name="lora_undeclared", low_rank=None)
    wrapped = dataclasses.replace(lora, name="lora_wrapped", activation_form=lambda *a: lora.activation_form(*a))
    monkeypatch.setitem(_REGISTRY, undeclared.name, undeclared)
    monkeypatch.setitem(_REGISTRY, wrapped.name, wrapped)
    bmm_calls = []
    real_bmm = torch.bmm

    def counting_bmm(*args, **kwargs):
        bmm_calls.append(1)
        return real_bmm(*args, **kwargs)

    monkeypatch.setattr(many.torch, "bmm", counting_bmm)
    model = _sdpa(tiny_model("llama"))
    index = torch.tensor([1, 0, 1])
    ids, mask = _batch(3)
    for name, batched in (("lora_undeclared", False), ("lora_wrapped", True)):
        adapters = _tenants(model, "llama", name, count=2)
        bmm_calls.clear()
        with torch.no_grad():
            got = lf.mixed_call(model, adapters, index, ids, attention_mask=mask, batching="layers").logits
        assert bool(bmm_calls) is batched, name
        for j, (g, want) in enumerate(zip(got, _loop_logits(model, adapters, index, ids, mask), strict=True)):
            _close(g, want, f"{name} row {j}")
