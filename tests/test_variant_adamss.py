"""AdaMSS against peft 0.21 (AdamssConfig) on a float64 tiny Llama (RMSNorm in the input dtype on
both sides): the init equals peft's bit for bit (its seeded SVD, k-means, QR; both B inits; the
dynamic rank), a peft checkpoint with perturbed trainables loads with load_peft and gives peft's
logits and per-tensor gradients on both routes, save_peft output loads in peft, init_adapter
trains, and the pure ASA schedule (lora_func.subspace_budget), trained side by side with peft and
its AdamssAsaCallback, prunes the same subspaces at every step and keeps the same parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import AdamssConfig, PeftModel, get_peft_model
from peft.tuners.adamss.asa_callback import AdamssAsaCallback
from transformers import TrainerControl, TrainerState

import lora_func as lf
from lora_func import subspace_budget as sb
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss
from tests.bank_oracle import rmsnorm_in_input_dtype

F64 = torch.float64
TARGETS = ["q_proj", "v_proj", "down_proj"]  # q 32->32 and v 32->16 with a bias, down 48->32 without
CONFIG = {"r": 12, "num_subspaces": 3, "subspace_rank": 2}
ASA = {"use_asa": True, "asa_target_subspaces": 4, "init_warmup": 2, "final_warmup": 14, "mask_interval": 3}




@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", dtype=F64)
    rmsnorm_in_input_dtype(m)
    return m


def _peft(model, seed=None, perturb=True, **extra):
    config = AdamssConfig(target_modules=TARGETS, **(CONFIG | extra))
    if seed is not None:
        torch.manual_seed(seed)  # peft's Gram-matrix SVDs and random B draw from the global RNG
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        pm = get_peft_model(copy.deepcopy(model), config)
    if perturb:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in sorted(pm.named_parameters()):
                if ".adamss_" in n:
                    p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return pm


def _layers(pm):
    """``{lora_func module name: peft AdaMSS layer}``."""
    return {n.removeprefix("base_model.model."): m for n, m in pm.named_modules() if hasattr(m, "adamss_A") and "default" in m.adamss_A}


def _subspaces(layer):
    """peft's ``(A_k, B_k, first row of B_k in lora_func's adamss_B)`` per subspace."""
    out, start = [], 0
    for a, b in zip(layer.adamss_A["default"], layer.adamss_B["default"], strict=True):
        out.append((a, b, start))
        start += b.shape[0]
    return out


def _assert_equals_peft(adapter, pm, grads=None, rtol=0.0):
    """Every subspace's A_k and B_k (or their gradients) equal peft's; the padding is zero."""
    for key, layer in _layers(pm).items():
        a_all, b_all = (grads or adapter.params)[f"{key}.adamss_A"], (grads or adapter.params)[f"{key}.adamss_B"]
        for k, (a, b, start) in enumerate(_subspaces(layer)):
            own, rows = a.shape[0], b.shape[0]
            for mine, want in ((a_all[k, :own], a), (b_all[start : start + rows, :own], b)):
                want = want.grad if grads is not None else want.detach()
                assert (mine - want).abs().max() <= rtol * want.abs().max(), (key, k)
            assert not a_all[k, own:].any() and not b_all[start : start + rows, own:].any(), (key, k)
        if grads is None:
            assert torch.equal(adapter.buffers[f"{key}.adamss_newB"], layer.adamss_newB["default"]), key
            assert torch.equal(adapter.buffers[f"{key}.scatter_index"], layer.scatter_index["default"]), key


@pytest.mark.parametrize(
    "peft_extra, options",
    [
        ({}, {}),
        ({"init_weights": None}, {"init": "random"}),
        ({"use_dynamic_rank": True, "svd_threshold": 0.3}, {"use_dynamic_rank": True, "svd_threshold": 0.3}),
    ],
    ids=["orthogonal", "random-B", "dynamic-rank"],
)
def test_init_equals_peft_bit_for_bit(model, peft_extra, options):
    pm = _peft(model, seed=5, perturb=False, **peft_extra)
    spec = lf.AdapterSpec("adamss", targets=TARGETS, dtype=F64, **(CONFIG | options))
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5))
    _assert_equals_peft(adapter, pm)
    ranks = {tuple(adapter.buffers[f"{k}.subspace_ranks"].tolist()) for k in _layers(pm)}
    assert len(ranks) > 1  # some subspace has a rank below subspace_rank: the padding is exercised


@pytest.fixture(scope="module")
def loaded(model, tmp_path_factory):
    pm = _peft(model).eval()
    directory = tmp_path_factory.mktemp("adamss")
    pm.save_pretrained(directory)
    return pm, lf.load_peft(directory, model)


def test_peft_checkpoint_loads_with_peft_logits_and_gradients(model, loaded):
    pm, adapter = loaded
    assert adapter.spec.variant == "adamss" and adapter.spec.r == 12
    assert {k: v for k, v in adapter.spec.options if k in CONFIG} == {k: v for k, v in CONFIG.items() if k != "r"}
    assert len(adapter.layers) == 6
    _assert_equals_peft(adapter, pm)
    ids = tokens(2, 8, seed=4)
    pm.zero_grad()
    out = pm(input_ids=ids)
    ce_loss(out.logits, ids).backward()
    base = lf.base_params(model)
    for merged in (False, True):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        logits = lf.adapted_call(model, adapter.with_params(params), ids, base=base, merged=merged).logits
        assert (logits - out.logits).abs().max() <= 1e-9 * out.logits.abs().max()
        ce_loss(logits, ids).backward()
        for layer in _layers(pm).values():
            assert all(t.grad.abs().max() > 1e-8 for a, b, _ in _subspaces(layer) for t in (a, b))
        _assert_equals_peft(adapter, pm, grads={k: p.grad for k, p in params.items()}, rtol=1e-9)


def test_save_peft_loads_in_peft(model, loaded, tmp_path):
    pm, adapter = loaded
    trained = adapter.with_params({k: v + 0.05 * torch.randn_like(v) for k, v in adapter.params.items()})
    lf.save_peft(trained, tmp_path, model=model)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        again = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path).eval()
    config = again.peft_config["default"]
    assert (config.peft_type.value, config.r, config.num_subspaces, config.subspace_rank, config.init_weights) == ("ADAMSS", 12, 3, 2, "orthogonal")
    ids = tokens(2, 8, seed=5)
    want = lf.adapted_call(model, trained, ids).logits
    torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-12 * want.abs().max().item())
    assert (want - pm(ids).logits).abs().max() > 1e-3  # the saved values, not the checkpoint's


def test_init_adapter_trains(model):
    spec = lf.AdapterSpec("adamss", targets=TARGETS, dtype=F64, **CONFIG)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    ids = tokens(2, 8, seed=6)
    base = lf.base_params(model)
    torch.testing.assert_close(lf.adapted_call(model, adapter, ids, base=base).logits, model(ids).logits, rtol=0, atol=0)

    def loss(params):
        return ce_loss(lf.adapted_call(model, adapter.with_params(params), ids, base=base).logits, ids)

    params = dict(adapter.params)
    first = loss(params).item()
    for _ in range(5):
        grads = torch.func.grad(loss)(params)
        params = {k: v - 0.5 * grads[k] for k, v in params.items()}
    assert loss(params).item() < first - 1e-3


def test_asa_schedule_equals_peft_callback_step_by_step(model, tmp_path):
    """peft trains 16 SGD steps with its AdamssAsaCallback after each; lora_func trains the same
    loop functionally (asa_step + keep_frozen) from the same start. The pruned subspaces must be
    peft's at every step and the parameters peft's (1e-9) throughout."""
    pm = _peft(model, **ASA).train()
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, model)
    assert {k: v for k, v in adapter.spec.options if k in ASA} == ASA
    layers = _layers(pm)
    optimizer = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.3)
    callback, control = AdamssAsaCallback(), TrainerControl()
    base = lf.base_params(model)
    state = sb.asa_init(adapter)
    masked_steps, kept = [], []
    for step in range(1, 17):
        ids = tokens(2, 8, seed=100 + step)
        optimizer.zero_grad()
        ce_loss(pm(input_ids=ids).logits, ids).backward()
        optimizer.step()
        callback.on_optimizer_step(None, TrainerState(global_step=step), control, model=pm)

        def loss(params, ids=ids, adapter=adapter):
            return ce_loss(lf.adapted_call(model, adapter.with_params(params), ids, base=base).logits, ids)

        grads = torch.func.grad(loss)(dict(adapter.params))
        updated = adapter.with_params({k: v - 0.3 * grads[k] for k, v in adapter.params.items()})
        adapter = sb.keep_frozen(adapter, updated, state.active)
        state, mask = sb.asa_step(state, adapter, grads, step)
        for key, layer in layers.items():  # the EMAs, subspace by subspace (peft's None: reset or pruned)
            for k, (a, b, start) in enumerate(_subspaces(layer)):
                own, rows = a.shape[0], b.shape[0]
                for ema, name, mine in (("ipt", "A", (k, slice(0, own))), ("unc", "A", (k, slice(0, own))), ("ipt", "B", (slice(start, start + rows), slice(0, own))), ("unc", "B", (slice(start, start + rows), slice(0, own)))):
                    want = getattr(layer, f"exp_avg_{ema}_{name}")["default"][k]
                    have = getattr(state, f"exp_avg_{ema}")[f"{key}.adamss_{name}"][mine]
                    if want is None:
                        assert not have.any() or not state.active[key][k], (step, key, k)
                    else:
                        assert (have - want).abs().max() <= 1e-9 * want.abs().max(), (step, key, k, ema, name)
        peft_active = {key: [a.requires_grad for a in layer.adamss_A["default"]] for key, layer in layers.items()}
        assert {key: v.tolist() for key, v in state.active.items()} == peft_active, step
        if mask is not None:
            masked_steps.append(step)
            kept.append(sum(sum(v) for v in peft_active.values()))
        _assert_equals_peft(adapter, pm, rtol=1e-9)
    assert masked_steps == [3, 6, 9, 12]
    # peft keeps the subspaces scoring strictly above the target-th best: target - 1 of them, unless
    # no more than target are still active (then all stay: step 12, target 4, 4 active).
    assert [sb.asa_target(adapter, s) for s in masked_steps] == [14, 8, 5, 4] and kept == [13, 7, 4, 4]


def test_asa_refuses_and_schedule_values(model, loaded):
    _, adapter = loaded
    with pytest.raises(ValueError, match="use_asa=True"):
        sb.asa_init(adapter)
    asa = lf.init_adapter(model, lf.AdapterSpec("adamss", targets=["q_proj"], **CONFIG, **ASA), generator=torch.Generator().manual_seed(0))
    with pytest.raises(KeyError, match="lacks"):
        sb.asa_step(sb.asa_init(asa), asa, {}, 3)
    with pytest.raises(ValueError, match="no adamss part"):
        sb.asa_init(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"])))
    # 2 layers x 3 subspaces: all 6 before and at init_warmup, 4 from final_warmup on.
    assert [sb.asa_target(asa, s) for s in (1, 2, 8, 14, 15)] == [None, 6, int(4 + 2 * 0.5**3), 4, 4]
    with pytest.raises(ValueError, match="init_warmup=14 >= final_warmup=14"):
        lf.AdapterSpec("adamss", targets=["q_proj"], use_asa=True, init_warmup=14, final_warmup=14)


def test_a_stack_of_different_ranks_equals_each_member_alone(model):
    """Members of r = 4, 12, 7 (different SVDs, clusters and ranks) under one vmap: the SVD axis
    zero-padded; each member's logits and per-tensor gradients equal it alone."""
    ids, base = tokens(2, 8, seed=7), lf.base_params(model)
    members = []
    for i, r in enumerate((4, 12, 7)):
        adapter = lf.init_adapter(model, lf.AdapterSpec("adamss", targets=TARGETS, dtype=F64, **(CONFIG | {"r": r})), generator=torch.Generator().manual_seed(i))
        g = torch.Generator().manual_seed(20 + i)
        members.append(adapter.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=F64) for k, v in adapter.params.items()}))

    def loss(params, adapter):
        return ce_loss(torch.func.functional_call(model, lf.overlay(base, adapter.with_params(params)), (ids,)).logits, ids)

    stacked = lf.stack(members)
    assert stacked.members is not None
    grads, values = torch.func.vmap(lambda a: torch.func.grad_and_value(loss)(a.params, a))(stacked)
    for k, (member, back) in enumerate(zip(members, lf.unstack(stacked.with_params(grads)), strict=True)):
        g_alone, v_alone = torch.func.grad_and_value(loss)(member.params, member)
        assert abs(values[k] - v_alone) <= 1e-12 * abs(v_alone), k
        for key, want in g_alone.items():
            assert want.abs().max() > 0 and (back.params[key] - want).abs().max() <= 1e-10 * want.abs().max(), (k, key)
