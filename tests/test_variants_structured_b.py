"""OFT, BOFT, RoAd and HiRA beyond the contract suite: HF peft 0.21 as the oracle in float64
(a perturbed peft adapter loads with ``load_peft`` and gives peft's logits and per-tensor
gradients; ``save_peft`` output loads in peft with the same logits), ``init_adapter`` trains,
peft's Cayley–Neumann series term by term, the multiplicative block dropouts, COFT's straight
-through projection, and the refusals that docs/variants.md states (peft refuses GPT-2
``Conv1D`` for OFT/BOFT/RoAd; lora_func supports it)."""

from __future__ import annotations

import copy
import types
import warnings

import peft
import peft.tuners.boft.layer as peft_boft
import pytest
import torch
from torch.func import grad
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import lora_func as lf
from lora_func.io import peft_problems
from lora_func.variants import LayerInfo, get_variant
from lora_func.variants._orthogonal import cayley_neumann, skew_from_upper
from lora_func.variants.boft import orthogonal_blocks
from lora_func.variants.oft import rotation_blocks
from tests import peft_helpers
from tests.contract_helpers import loss_fn
from tests.models import tiny_model, tokens

REL = 1e-9
TARGETS = ["q_proj", "v_proj", "down_proj"]
NAMES = ("oft_R", "boft_R", "boft_s", "road_theta", "road_alpha", "hira_A", "hira_B")


def _rmsnorm_in_input_dtype(model: torch.nn.Module) -> None:
    """transformers' Llama RMSNorm computes in fp32; in float64 oracle tests it must compute in
    the input dtype on both sides."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.forward = types.MethodType(forward, m)


@pytest.fixture(scope="module")
def llama64():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         bos_token_id=0, eos_token_id=1, attention_bias=True)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    _rmsnorm_in_input_dtype(model)
    return model


@pytest.fixture(scope="module")
def gpt2_64():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=48, n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(torch.float64).eval()
    model.config._attn_implementation = "eager"
    return model


class _BlockDiag:
    """Stands in for peft's CUDA ``FastBlockDiag`` (``(m, k, b, b) -> (m, k·b, k·b)``), so that
    peft applies ``boft_n_butterfly_factor > 1`` on the CPU as its CUDA path does."""

    @staticmethod
    def apply(blocks):
        return torch.stack([torch.block_diag(*factor) for factor in blocks])


@pytest.fixture
def butterfly(monkeypatch):
    """peft's BOFT with its CUDA path (``factor`` > 1) or without, never compiling anything."""

    def use(factor: int) -> None:
        monkeypatch.setattr(peft_boft, "_FBD_CUDA", object() if factor > 1 else False)
        monkeypatch.setattr(peft_boft, "FastBlockDiag", _BlockDiag)

    return use


CASES = {
    # block size 5 fits neither d_in 16 nor 32: peft (with a warning) and lora_func take 4
    "oft-adjusted": ("llama", peft.OFTConfig(target_modules=TARGETS, oft_block_size=5), 1),
    "oft-share-exact": ("llama", peft.OFTConfig(target_modules=TARGETS, r=2, oft_block_size=0, block_share=True, use_cayley_neumann=False), 1),
    "oft-coft-3terms": ("llama", peft.OFTConfig(target_modules=TARGETS, oft_block_size=4, coft=True, eps=0.5, num_cayley_neumann_terms=3), 1),
    "boft": ("llama", peft.BOFTConfig(target_modules=TARGETS, boft_block_size=4), 1),
    "boft-butterfly": ("llama", peft.BOFTConfig(target_modules=TARGETS, boft_block_num=4, boft_block_size=0, boft_n_butterfly_factor=2), 2),
    "road_1": ("llama", peft.RoadConfig(target_modules=TARGETS, group_size=4, variant="road_1"), 1),
    "road_2": ("llama", peft.RoadConfig(target_modules=TARGETS, group_size=8, variant="road_2"), 1),
    "road_4": ("llama", peft.RoadConfig(target_modules=TARGETS, group_size=4, variant="road_4"), 1),
    "hira": ("llama", peft.HiraConfig(target_modules=TARGETS, r=3), 1),
    "hira-gpt2": ("gpt2", peft.HiraConfig(target_modules=["c_attn", "mlp.c_proj"], r=2), 1),
    # peft 0.21's HiRA ignores rank_pattern (every layer gets r): the reader must too
    "hira-rank-pattern": ("llama", peft.HiraConfig(target_modules=TARGETS, r=3, rank_pattern={"q_proj": 2}), 1),
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().abs().max() / want.detach().abs().max())


def _perturbed_peft(model, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: the block size adjusted, transformers' deprecations
        pm = peft.get_peft_model(copy.deepcopy(model), copy.deepcopy(config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return pm


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_checkpoint_loads_with_peft_logits_and_gradients_and_saves_back(case, llama64, gpt2_64, butterfly, tmp_path):
    kind, config, factor = CASES[case]
    model = llama64 if kind == "llama" else gpt2_64
    butterfly(factor)
    pm = _perturbed_peft(model, config)
    pm.save_pretrained(tmp_path / "peft")
    ids = tokens(batch=2, length=7, seed=4) % 48
    pm.zero_grad()
    out = pm(input_ids=ids).logits
    peft_helpers.ce_loss(out, ids).backward()
    want = out.detach()
    assert _rel(want, model(ids).logits) > 1e-4, "the perturbed adapter should change the output"
    peft_grads = {peft_helpers.peft_key_to_lf(n, NAMES): p.grad for n, p in pm.named_parameters() if p.requires_grad}

    adapter = lf.load_peft(tmp_path / "peft", model)
    assert adapter.spec.variant == case.split("-")[0].split("_")[0] and adapter.spec.dtype == torch.float64
    assert sorted(adapter.params) == sorted(peft_grads)
    base = lf.base_params(model)
    for merged in (False, True):
        assert _rel(lf.adapted_call(model, adapter, ids, merged=merged).logits, want) < REL, f"logits merged={merged}"
        grads = grad(loss_fn(model, base, adapter, ids, merged=merged))(adapter.params)
        for key, g in grads.items():
            assert peft_grads[key].abs().max() > 0, key
            assert _rel(g, peft_grads[key].reshape(g.shape)) < REL, f"grad {key} merged={merged}"

    if case.startswith("boft"):
        # 21 rows >= d_out = 16: BOFT's activation form runs on the merged weight (14 rows above
        # rotate the input): the same logits and gradients as peft there too.
        long_ids = tokens(batch=3, length=7, seed=5) % 48
        pm.zero_grad()
        out = pm(input_ids=long_ids).logits
        peft_helpers.ce_loss(out, long_ids).backward()
        assert _rel(lf.adapted_call(model, adapter, long_ids).logits, out) < REL
        grads = grad(loss_fn(model, base, adapter, long_ids))(adapter.params)
        for name, p in pm.named_parameters():
            if p.requires_grad:
                key = peft_helpers.peft_key_to_lf(name, NAMES)
                assert _rel(grads[key], p.grad.reshape(grads[key].shape)) < REL, f"long grad {key}"

    lf.save_peft(adapter, tmp_path / "back", model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "back").eval()
    with torch.no_grad():
        assert _rel(reloaded(input_ids=ids).logits, want) < REL


@pytest.mark.parametrize(
    ("variant", "kwargs"),
    [
        ("oft", {"oft_block_size": 8}),
        ("boft", {"boft_block_size": 4, "boft_n_butterfly_factor": 2}),
        ("road", {"group_size": 4, "road_variant": "road_4"}),
        ("hira", {"r": 4}),
    ],
)
def test_init_adapter_trains(variant, kwargs):
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=TARGETS, **kwargs), generator=torch.Generator().manual_seed(0))
    adapter = adapter.detach()
    optimizer = torch.optim.Adam(adapter.params.values(), lr=3e-2)
    ids, base = tokens(batch=4, length=12, seed=2), lf.base_params(model)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = loss_fn(model, base, adapter, ids)(adapter.params)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("terms", [1, 2, 3, 4, 5, 7])
def test_cayley_neumann_is_peft_series_term_by_term(terms):
    """peft 0.21's loop makes 3 and 4 terms the same series; an off-by-one in the last power
    (coefficient 1, not 2) shows at every count above 2."""
    from peft.tuners.oft.layer import OFTRotationModule

    b = 5
    vec = torch.randn(3, b * (b - 1) // 2, generator=torch.Generator().manual_seed(terms), dtype=torch.float64)
    module = OFTRotationModule(3, vec.shape[1], b, 3 * b, num_cayley_neumann_terms=terms)
    want = module._cayley_batch(vec, b, True, terms)
    got = cayley_neumann(skew_from_upper(vec, b), terms)
    assert torch.equal(skew_from_upper(vec, b), module._pytorch_skew_symmetric(vec, b))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def _info(variant: str, d_in: int, **options) -> LayerInfo:
    spec = lf.AdapterSpec(variant, targets=["x"], **options)
    return LayerInfo(d_in=d_in, d_out=8, r=1, alpha=1.0, has_bias=False, options=spec.options)


def test_module_dropout_sets_int_p_k_blocks_to_identity_in_training_only():
    info = _info("oft", 32, oft_block_size=4, module_dropout=0.3)
    vec = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    eye = torch.eye(4)
    kept = rotation_blocks({"oft_R": vec}, info)
    assert not any(torch.allclose(block, eye) for block in kept)
    seen = set()
    for _ in range(6):
        dropped = rotation_blocks({"oft_R": vec}, info, training=True)
        identity = [i for i, block in enumerate(dropped) if torch.equal(block, eye)]
        assert len(identity) == 2  # int(0.3 * 8)
        assert all(torch.equal(dropped[i], kept[i]) for i in range(8) if i not in identity)
        seen.add(tuple(identity))
    assert len(seen) > 1, "the dropped blocks must be drawn at random"
    shared = _info("oft", 32, oft_block_size=4, module_dropout=0.9, block_share=True)
    assert torch.equal(rotation_blocks({"oft_R": vec[:1]}, shared, training=True), rotation_blocks({"oft_R": vec[:1]}, shared))


def test_boft_dropout_drops_blocks_of_one_factor():
    raw = torch.randn(3, 8, 2, 2, generator=torch.Generator().manual_seed(0))
    kept = orthogonal_blocks({"boft_R": raw})
    factors = set()
    for _ in range(8):
        dropped = orthogonal_blocks({"boft_R": raw}, dropout=0.5)
        changed = [(f, k) for f in range(3) for k in range(8) if not torch.equal(dropped[f, k], kept[f, k])]
        assert len(changed) == 4 and len({f for f, _ in changed}) == 1
        assert all(torch.equal(dropped[f, k], torch.eye(2)) for f, k in changed)
        factors.add(changed[0][0])
    assert len(factors) > 1


def test_coft_projects_straight_through():
    """The forms see each skew block pulled onto the ball of radius eps/√k; the gradient w.r.t. the
    stored tensor is the gradient at the projected point (peft projects its parameter in place)."""
    info = _info("oft", 8, oft_block_size=4, coft=True, eps=0.2)
    plain = _info("oft", 8, oft_block_size=4)
    vec = torch.randn(2, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    norms = skew_from_upper(vec, 4).flatten(1).norm(dim=1, keepdim=True)
    radius = float(torch.tensor(0.2) / torch.tensor(2.0).sqrt())  # peft's fp32 radius eps/√k
    projected = torch.where(norms <= radius, vec, radius * (vec / norms))
    assert (norms > radius).all()
    upstream = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss(v, i):
        return (rotation_blocks({"oft_R": v}, i) * upstream).sum()

    assert torch.equal(rotation_blocks({"oft_R": vec}, info), rotation_blocks({"oft_R": projected}, plain))
    assert torch.equal(grad(loss)(vec, info), grad(loss)(projected, plain))


@pytest.mark.parametrize(
    ("variant", "config"),
    [("oft", peft.OFTConfig(target_modules=["c_attn"], oft_block_size=4)), ("boft", peft.BOFTConfig(target_modules=["c_attn"], boft_block_size=4)),
     ("road", peft.RoadConfig(target_modules=["c_attn"], group_size=4))],
)
def test_peft_refuses_conv1d_lora_func_adapts_it(variant, config, butterfly):
    """Keeps docs/variants.md's table honest: peft 0.21 refuses GPT-2 Conv1D for these three."""
    butterfly(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((TypeError, ValueError)):
            peft.get_peft_model(tiny_model("gpt2"), config)
    options = {"oft": {"oft_block_size": 4}, "boft": {}, "road": {"group_size": 4}}[variant]
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec(variant, targets=["c_attn"], **options))
    assert {layer.target.layout for layer in adapter.layers} == {"conv1d"}
    assert lf.variants.peft_format(variant).conv1d is False
    assert peft_problems(adapter)


def test_stacking_members_of_different_block_sizes_names_the_method_and_the_options():
    model = tiny_model("llama")
    a = lf.init_adapter(model, lf.AdapterSpec("oft", targets=["q_proj"], oft_block_size=4))
    b = lf.init_adapter(model, lf.AdapterSpec("oft", targets=["q_proj"], oft_block_size=8))
    with pytest.raises(ValueError, match=r"variant='oft'.*oft_block_size.*only adapters of one variant, targets, dtype and options stack"):
        lf.stack([a, b])
    # different ranks of HiRA stack, zero-padded: each member as alone
    c = lf.init_adapter(model, lf.AdapterSpec("hira", targets=["q_proj"], r=2))
    d = lf.init_adapter(model, lf.AdapterSpec("hira", targets=["q_proj"], r=4))
    g = torch.Generator().manual_seed(0)
    c, d = (m.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in m.params.items()}) for m in (c, d))
    ids = tokens()
    out = torch.func.vmap(lambda m: lf.adapted_call(model, m, ids).logits)(lf.stack([c, d]))
    for i, member in enumerate((c, d)):
        torch.testing.assert_close(out[i], lf.adapted_call(model, member, ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("variant", "options", "stats"),
    [
        # (tensor, mean, std, or "kaiming" bound 1/√d_in, or "zeros"/"ones")
        ("hira", {"init": "kaiming"}, {"hira_A": "kaiming", "hira_B": "zeros"}),
        ("hira", {"init": "gaussian"}, {"hira_A": (0.0, 1 / 40), "hira_B": "zeros"}),
        ("hira", {"init": "random"}, {"hira_A": (0.0, 1.0), "hira_B": (0.0, 1.0)}),
        ("oft", {"init": "identity", "oft_block_size": 8}, {"oft_R": "zeros"}),
        ("oft", {"init": "random", "oft_block_size": 8}, {"oft_R": (0.0, 0.1)}),
        ("boft", {"init": "identity", "boft_block_size": 8}, {"boft_R": "zeros", "boft_s": "ones"}),
        ("boft", {"init": "random", "boft_block_size": 8}, {"boft_R": (0.0, 0.1), "boft_s": (1.0, 0.1)}),
        ("road", {"init": "identity", "group_size": 8}, {"road_theta": "zeros", "road_alpha": "ones"}),
        ("road", {"init": "random", "group_size": 8, "road_variant": "road_4"}, {"road_theta": (0.0, 0.5), "road_alpha": (1.0, 0.5)}),
    ],
)
def test_init_distributions_are_peft_s(variant, options, stats):
    """peft's inits (reset_*_parameters), on a 400 × 300 layer, in the requested dtype and device."""
    d_in, d_out = 400, 320
    spec = lf.AdapterSpec(variant, targets=["x"], r=40, **options)
    info = LayerInfo(d_in=d_in, d_out=d_out, r=40, alpha=1.0, has_bias=False, options=spec.options)
    params, buffers = get_variant(variant).init(torch.randn(d_out, d_in), None, info, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert buffers == {} and sorted(params) == sorted(stats)
    for name, want in stats.items():
        t = params[name]
        assert t.dtype == torch.float64, name
        if want == "zeros":
            assert torch.count_nonzero(t) == 0, name
        elif want == "ones":
            assert torch.equal(t, torch.ones_like(t)), name
        elif want == "kaiming":
            bound = 1 / d_in**0.5  # kaiming_uniform(a=√5) over fan_in = d_in
            assert t.abs().max() <= bound and t.abs().max() > 0.98 * bound, name
        else:
            mean, std = want
            n = t.numel()  # within 4 standard errors; a mutant scale (2x, 1/r vs 1/r²) is far off
            assert abs(float(t.mean()) - mean) < 4 * std / n**0.5 and abs(float(t.std()) / std - 1) < 4 / (2 * n) ** 0.5, (name, float(t.mean()), float(t.std()))


@pytest.mark.parametrize(
    ("variant", "options", "peft_config"),
    [
        ("oft", {"oft_block_size": 0, "num_blocks": 4, "block_share": True, "coft": True, "eps": 1e-3, "use_cayley_neumann": False,
                 "num_cayley_neumann_terms": 3, "module_dropout": 0.1, "init": "random"}, peft.OFTConfig),
        ("oft", {}, peft.OFTConfig),
        ("boft", {"boft_block_size": 0, "boft_block_num": 8, "boft_n_butterfly_factor": 2, "boft_dropout": 0.2, "init": "random"}, peft.BOFTConfig),
        ("boft", {}, peft.BOFTConfig),
        ("road", {"road_variant": "road_4", "group_size": 8, "init": "random"}, peft.RoadConfig),
        ("road", {}, peft.RoadConfig),
        ("hira", {"init": "gaussian", "dropout": 0.25}, peft.HiraConfig),
        ("hira", {"init": "random"}, peft.HiraConfig),
        ("hira", {}, peft.HiraConfig),
    ],
)
def test_peft_config_fields_round_trip(variant, options, peft_config):
    """Every option is written to the config field peft reads (peft's own config class takes the
    fields and keeps their values) and read back to the same option; a config without the
    fields reads as peft's defaults."""
    from lora_func.io._peft_config import _config_problems, config_of
    from tests.variant_checks import read_options

    fmt = lf.variants.peft_format(variant)
    spec = lf.AdapterSpec(variant, targets=["x"], **options)
    fields = config_of(lf.get_variant(variant), fmt, dict(spec.options))
    config = peft_config(target_modules=["x"], **fields)
    for name, value in fields.items():
        assert getattr(config, name) == value, name
    assert _config_problems({"peft_type": fmt.method.peft_type, **fields}) == []
    assert read_options(variant, fields) == dict(spec.options)
    assert read_options(variant, {}) == dict(lf.AdapterSpec(variant, targets=["x"]).options)


def test_oft_block_size_adjustment_is_peft_s():
    """A block size (or count) that does not divide d_in moves to the nearest divisor, as peft's
    adjust_oft_parameters moves it, over every d_in <= 64 and request <= 70."""
    from peft.tuners.oft.layer import OFTLayer

    from lora_func.variants.oft import layer_blocks

    for d_in in range(1, 65):
        for wanted in range(1, 71):
            # peft adjusts only a size (or count) that does not divide d_in or exceeds it
            fits = d_in % wanted == 0 and wanted <= d_in
            peft_s = wanted if fits else OFTLayer.adjust_oft_parameters(None, d_in, wanted)
            by_size = layer_blocks(d_in, {"oft_block_size": wanted, "num_blocks": 0})
            by_count = layer_blocks(d_in, {"oft_block_size": 0, "num_blocks": wanted})
            assert by_size == (d_in // peft_s, peft_s) and by_count == (peft_s, d_in // peft_s), (d_in, wanted)
            assert all(type(v) is int for v in (*by_size, *by_count))
