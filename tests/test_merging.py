"""merge_adapters and to_lora (issue 32): every method on the deltas, against HF peft's
add_weighted_adapter in float64, DARE's statistics, gradients and vmap, and to_lora's reported
errors against the measured ones."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lora_func as lf

peft = pytest.importorskip("peft")

# transformers deprecations reached through peft
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj", "down_proj"]  # down_proj: d_in 32 > d_out 16
# (rank, alpha, seed); weights exactly representable in fp32 (peft casts them to fp32)
ADAPTERS = {"task1": (2, 4.0, 1), "task2": (3, 5.0, 2), "task3": (4, 3.0, 3)}
WEIGHTS = [0.5, 0.75, -0.25]


def _rmsnorm_in_input_dtype(module: torch.nn.Module) -> None:
    """transformers' Llama RMSNorm computes in fp32; in float64 oracle tests it must compute in
    the input dtype on both sides."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in module.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.forward = types.MethodType(forward, m)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    _rmsnorm_in_input_dtype(model)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A float64 Llama, a peft model (a copy) holding three trained LoRA adapters of different
    ranks and alphas, and the same three loaded into lora_func with load_peft."""
    model = tiny_llama()
    pm = None
    for name, (r, alpha, _) in ADAPTERS.items():
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS)
        if pm is None:
            pm = peft.get_peft_model(copy.deepcopy(model), config, adapter_name=name)
        else:
            pm.add_adapter(name, config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    directory = tmp_path_factory.mktemp("peft")
    pm.save_pretrained(directory)
    adapters = [lf.load_peft(directory / name, model) for name in ADAPTERS]
    ids = torch.randint(2, 48, (2, 7), generator=torch.Generator().manual_seed(3))
    return types.SimpleNamespace(model=model, peft=pm, adapters=adapters, ids=ids, base=lf.base_params(model))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().max() / want.abs().max()).detach())


def lf_deltas(setup, adapter) -> dict[str, torch.Tensor]:
    """Per target module ΔW = W_eff − W, measured through merge_overlay."""
    merged = lf.merge_overlay(setup.base, adapter)
    return {k.removesuffix(".weight"): merged[k] - setup.base[k] for k in setup.base if merged[k] is not setup.base[k]}


def peft_merge(setup, name, combination_type, **kwargs):
    pm = setup.peft
    if name not in pm.peft_config:
        pm.add_weighted_adapter(list(ADAPTERS), WEIGHTS, name, combination_type=combination_type, **kwargs)
    layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules() if hasattr(m, "lora_A") and name in m.lora_A}
    deltas = {n: m.get_delta_weight(name) for n, m in layers.items()}
    pm.set_adapter(name)
    with torch.no_grad():
        logits = pm(setup.ids).logits
    return deltas, logits


def check_against_peft(setup, merged, name, combination_type, **kwargs):
    want, want_logits = peft_merge(setup, name, combination_type, **kwargs)
    got = lf_deltas(setup, merged)
    assert set(got) == set(want) and len(want) == 6
    for module in want:
        assert want[module].abs().max() > 1e-3, module  # the oracle is not trivially zero
        assert rel(got[module], want[module]) < 1e-8, (module, rel(got[module], want[module]))
    with torch.no_grad():
        logits = lf.adapted_call(setup.model, merged, setup.ids).logits
    base_logits = setup.model(setup.ids).logits
    assert rel(want_logits - base_logits, want_logits - base_logits) == 0  # finite
    assert (want_logits - base_logits).abs().max() > 1e-4  # the merge changes the output
    assert rel(logits, want_logits) < 1e-8


def full_rank(setup) -> int:
    return 16  # min(d_out, d_in) of every target


def test_cat_equals_peft_cat(setup):
    merged = lf.merge_adapters(setup.adapters, torch.tensor(WEIGHTS, dtype=torch.float64), method="cat")
    # a LoRA of rank Σ r_k with each member's scale folded in
    assert {layer.info.r for layer in merged.layers} == {9}
    check_against_peft(setup, merged, "m_cat", "cat")


def test_svd_equals_peft_svd(setup):
    merged = lf.merge_adapters(setup.adapters, WEIGHTS, method="svd", rank=3, base=setup.base)
    assert {layer.info.r for layer in merged.layers} == {3}
    check_against_peft(setup, merged, "m_svd", "svd", svd_rank=3)


@pytest.mark.parametrize("majority_sign", ["total", "frequency"])
def test_ties_equals_peft_ties_svd_at_full_rank(setup, majority_sign):
    merged = lf.merge_adapters(setup.adapters, WEIGHTS, method="ties", density=0.4, majority_sign=majority_sign, base=setup.base)
    check_against_peft(setup, merged, f"m_ties_{majority_sign}", "ties_svd", svd_rank=full_rank(setup), density=0.4,
                       majority_sign_method=majority_sign)


def test_magnitude_prune_equals_peft_at_full_rank(setup):
    merged = lf.merge_adapters(setup.adapters, WEIGHTS, method="magnitude_prune", density=0.3, base=setup.base)
    check_against_peft(setup, merged, "m_mag", "magnitude_prune_svd", svd_rank=full_rank(setup), density=0.3)


def test_linear_is_the_sum_of_deltas(setup):
    # the exact cat form (plain LoRAs) and the delta path (full-rank form) both give Σ w_k ΔW_k
    deltas = [lf_deltas(setup, a) for a in setup.adapters]
    cat_form = lf.merge_adapters(setup.adapters, WEIGHTS, method="linear")
    full_form = lf.merge_adapters(setup.adapters, WEIGHTS, method="magnitude_prune", density=1.0, base=setup.base)
    assert {layer.info.r for layer in cat_form.layers} == {9} and {layer.info.r for layer in full_form.layers} == {16}
    for merged in (cat_form, full_form):
        got = lf_deltas(setup, merged)
        assert len(got) == 6
        for module in got:
            want = sum(w * d[module] for w, d in zip(WEIGHTS, deltas))
            assert rel(got[module], want) < 1e-12
