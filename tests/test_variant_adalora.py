"""AdaLoRA against peft 0.21 (AdaLoraConfig) on a float64 tiny Llama (RMSNorm in the input dtype on
both sides): a peft checkpoint with perturbed trainables loads with load_peft and gives peft's
logits and per-tensor gradients of the loss with the orthogonality penalty; save_peft output loads
in peft; init_adapter trains; and the pure budget schedule, fed peft's own parameters and gradients
for 50 steps of a training loop, returns peft's masks (and ranks) at every step."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from peft import AdaLoraConfig, PeftModel, get_peft_model

import lora_func as lf
from lora_func import rank_budget as rb
from tests import peft_helpers
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

F64 = torch.float64
TARGETS = ["q_proj", "v_proj", "down_proj"]  # v_proj 32->16, down_proj 48->32
NAMES = ("lora_A", "lora_E", "lora_B")
SCHEDULE = {"target_r": 2, "tinit": 5, "tfinal": 10, "deltaT": 2, "total_step": 50, "beta1": 0.8, "beta2": 0.9}


def _rmsnorm_in_input_dtype(model: torch.nn.Module) -> None:
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.forward = types.MethodType(forward, m)


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", dtype=F64)
    _rmsnorm_in_input_dtype(m)
    return m


def _peft(model, **extra):
    # r = init_r = 8 (peft's default r): lora_func reads a checkpoint whose r equals its init_r.
    config = AdaLoraConfig(init_r=8, lora_alpha=6.0, target_modules=TARGETS, orth_reg_weight=0.3, **(SCHEDULE | extra))
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        pm = get_peft_model(copy.deepcopy(model), config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in sorted(pm.named_parameters()):
            if any(f".{t}." in n for t in NAMES):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return pm


def _peft_loss(pm, ids):
    """peft's AdaLoraModel.forward, which adds its orthogonality term to the model's loss, over a
    float64 cross-entropy (transformers computes its loss in fp32; a PeftModel without a task type
    calls the transformers model directly and drops the term)."""
    model = pm.base_model.model
    inner = model.forward

    def forward(*args, labels=None, **kwargs):
        out = inner(*args, **kwargs)
        out.loss = ce_loss(out.logits, labels)
        return out

    model.forward = forward
    try:
        return pm.base_model(input_ids=ids, labels=ids)
    finally:
        del model.forward


def _lf_key(name: str) -> str:
    return peft_helpers.peft_key_to_lf(name, NAMES)


@pytest.fixture(scope="module")
def loaded(model, tmp_path_factory):
    pm = _peft(model).eval()
    directory = tmp_path_factory.mktemp("adalora")
    pm.save_pretrained(directory)
    return pm, lf.load_peft(directory, model)


def test_peft_checkpoint_loads_with_peft_logits_and_gradients(model, loaded):
    pm, adapter = loaded
    assert adapter.spec.variant == "adalora" and adapter.spec.r == 8
    assert {k: v for k, v in adapter.spec.options if k in SCHEDULE} == SCHEDULE
    ids = tokens(2, 8, seed=4)
    peft_params = {_lf_key(n): p for n, p in pm.named_parameters() if any(f".{t}." in n for t in NAMES)}
    assert sorted(peft_params) == sorted(adapter.params) and len(peft_params) == 18
    for k, p in peft_params.items():
        assert torch.equal(adapter.params[k], p.detach()), k
    pm.zero_grad()
    out = _peft_loss(pm, ids)
    out.loss.backward()
    base = lf.base_params(model)
    for merged in (False, True):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        current = adapter.with_params(params)
        logits = lf.adapted_call(model, current, ids, base=base, merged=merged).logits
        scale = out.logits.abs().max()
        assert (logits - out.logits).abs().max() <= 1e-9 * scale
        loss = ce_loss(logits, ids) + rb.orth_penalty(current)
        assert abs(loss.item() - out.loss.item()) <= 1e-12 * out.loss.item()
        loss.backward()
        for k, p in peft_params.items():
            assert p.grad.abs().max() > 1e-6, k
            assert (params[k].grad - p.grad).abs().max() <= 1e-9 * p.grad.abs().max(), k


def test_save_peft_loads_in_peft(model, loaded, tmp_path):
    pm, adapter = loaded
    lf.save_peft(adapter, tmp_path, model=model)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        again = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path).eval()
    config = again.peft_config["default"]
    assert (config.peft_type.value, config.init_r, config.lora_alpha, config.total_step, config.target_r) == ("ADALORA", 8, 6.0, 50, 2)
    ids = tokens(2, 8, seed=5)
    want = lf.adapted_call(model, adapter, ids).logits
    torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-12 * want.abs().max().item())


def test_init_adapter_trains_and_matches_peft_init_statistics(model):
    spec = lf.AdapterSpec("adalora", targets=TARGETS, r=6, init_r=6, alpha=6.0, dtype=F64, total_step=20)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    a = torch.cat([v.flatten() for k, v in adapter.params.items() if k.endswith(("lora_A", "lora_B"))])
    assert abs(a.std().item() - 0.02) < 0.003  # peft: A, B ~ N(0, 0.02²), E = 0
    assert all(not v.any() for k, v in adapter.params.items() if k.endswith("lora_E"))
    ids = tokens(2, 8, seed=6)
    base = lf.base_params(model)

    def loss(params):
        current = adapter.with_params(params)
        return ce_loss(lf.adapted_call(model, current, ids, base=base).logits, ids) + rb.orth_penalty(current)

    params = dict(adapter.params)
    first = loss(params).item()
    for _ in range(5):
        grads = torch.func.grad(loss)(params)
        params = {k: v - 0.5 * grads[k] for k, v in params.items()}
    assert loss(params).item() < first - 1e-3


def test_budget_schedule_equals_peft_rank_allocator_step_by_step(model):
    """peft trains 50 SGD steps and calls update_and_allocate(step) after each, as its docs say;
    the pure schedule gets the same post-step parameters and gradients and must return peft's
    mask at every step where peft masks (None where peft leaves E alone)."""
    pm = _peft(model).train()
    names = {n: _lf_key(n) for n, p in pm.named_parameters() if any(f".{t}." in n for t in NAMES)}
    params = {names[n]: p for n, p in pm.named_parameters() if n in names}
    adapter = lf.init_adapter(model, lf.AdapterSpec("adalora", targets=TARGETS, r=8, init_r=8, alpha=6.0, dtype=F64, orth_reg_weight=0.3, **SCHEDULE))
    optimizer = torch.optim.SGD(params.values(), lr=0.2)
    config = pm.peft_config["default"]
    state = rb.budget_init(adapter)
    seen_ranks, masked_steps = [], []
    for step in range(1, 51):
        ids = tokens(2, 8, seed=100 + step)
        optimizer.zero_grad()
        _peft_loss(pm, ids).loss.backward()
        optimizer.step()
        grads = {k: p.grad.detach().clone() for k, p in params.items()}
        current = adapter.with_params({k: p.detach().clone() for k, p in params.items()})
        before = config.rank_pattern
        pm.base_model.update_and_allocate(step)
        state, mask = rb.budget_step(state, current, grads, step)
        peft_masked = config.rank_pattern is not before or step > 40
        allocator = pm.base_model.rankallocator
        if step < 40:  # the EMAs themselves, entry by entry (reset after the final allocation)
            for n, ema in allocator.exp_avg_ipt.items():
                key = n.removesuffix(".default")
                assert torch.equal(state.exp_avg_ipt[key], ema) and torch.equal(state.exp_avg_unc[key], allocator.exp_avg_unc[n]), (step, key)
        assert (mask is not None) == peft_masked, step
        if step >= 40:  # the final allocation: peft resets its EMAs and re-applies the same mask after
            assert allocator.exp_avg_ipt == {} and not any(v.any() for v in state.exp_avg_ipt.values()), step
            assert state.final_mask is not None and mask is state.final_mask, step
        if mask is None:
            continue
        masked_steps.append(step)
        want = {k.removesuffix(".default"): v for k, v in config.rank_pattern.items()}
        assert sorted(want) == sorted(mask)
        for key, keep in mask.items():
            assert keep.tolist() == want[key], (step, key)
        after = rb.apply_mask(current, mask)
        for key in mask:
            assert torch.equal(after.params[key], params[key].detach()), (step, key)
        seen_ranks.append(sum(rb.ranks(mask).values()))
    # the budget phase masked every deltaT steps from tinit on, then the final mask at 40 and after.
    assert masked_steps == [*range(6, 40, 2), *range(40, 51)]
    assert seen_ranks[-1] <= 2 * 6 and seen_ranks[0] < 8 * 6 and len(set(seen_ranks)) > 3
    assert len(set(rb.ranks(mask).values())) > 1  # per-layer ranks differ: an allocation, not a uniform cut


def test_budget_helpers_refuse_and_are_pure(model, loaded):
    _, adapter = loaded
    with pytest.raises(ValueError, match="no adalora part"):
        rb.budget_init(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"])))
    with pytest.raises(KeyError, match="lacks"):
        rb.budget_step(rb.budget_init(adapter), adapter, {}, 1)
    before = {k: v.clone() for k, v in adapter.params.items()}
    mask = {k: torch.zeros(8, dtype=torch.bool) for k in adapter.params if k.endswith("lora_E")}
    masked = rb.apply_mask(adapter, mask)
    assert all(torch.equal(adapter.params[k], v) for k, v in before.items())
    assert all(not masked.params[k].any() for k in mask)
    assert rb.budget(adapter, 5) == (48, False) and rb.budget(adapter, 41) == (12, True)
    assert rb.budget(adapter, 6) == (int(36 * (1 - 1 / 35) ** 3 + 12), True)
    even = lf.init_adapter(model, lf.AdapterSpec("adalora", targets=["q_proj"], r=4, init_r=4, target_r=2, tinit=4, deltaT=3, total_step=20))
    assert rb.budget(even, 4) == (8, False) and rb.budget(even, 6)[1]  # step == tinit still warms up
    assert rb.budget(even, 20) == (4, False) and rb.budget(even, 21) == (4, True)  # 20 % deltaT != 0: the end itself is cubic
    # A masking step whose budget is the initial one (target_r = init_r): peft's kthvalue(k=0) fails; nothing is masked.
    flat = lf.init_adapter(model, lf.AdapterSpec("adalora", targets=["q_proj"], r=4, init_r=4, target_r=4, total_step=20))
    ones = {k: torch.ones_like(v) for k, v in flat.params.items()}
    _, keep = rb.budget_step(rb.budget_init(flat), flat, ones, 1)
    assert keep is not None and all(m.all() for m in keep.values())
