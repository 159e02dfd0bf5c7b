"""LoHa, LoKr, GraLoRA and MiSS beyond the contract suite, against HF peft 0.21 in float64
(RMSNorm patched to compute in the input dtype on both sides; relative 1e-9): a peft adapter
with perturbed trainables loads with ``load_peft`` and gives peft's logits and per-tensor
gradients on both paths; ``save_peft`` output loads in peft with the same logits; a seeded
training step with the dropouts set equals peft's; ``init_adapter`` trains. Plus each method's
own structure (LoKr's layouts and factorization, LoHa's two activation forms)."""

from __future__ import annotations

import copy
import math
import types

import peft
import pytest
import torch
from torch.func import grad

import lora_func as lf
from lora_func.io.peft import peft_problems
from lora_func.variants import LayerInfo
from lora_func.variants import gralora, loha, lokr, miss
from tests.contract_helpers import loss_fn
from tests.models import tiny_model, tokens
from tests.peft_helpers import LinearBase, ce_loss

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

LLAMA_TARGETS = ["q_proj", "v_proj", "down_proj"]  # 32x32 with bias, 48 -> 32 without
REL = 1e-9


def _rmsnorm_in_input_dtype(model: torch.nn.Module) -> None:
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm"):
            m.forward = types.MethodType(forward, m)


def f64_model(kind: str = "llama") -> torch.nn.Module:
    model = tiny_model(kind, dtype=torch.float64)
    _rmsnorm_in_input_dtype(model)
    return model


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().max() / want.abs().max()).detach())


def peft_trainables(pm) -> dict[str, torch.Tensor]:
    """``{<module>.<tensor name>: parameter}`` of a peft model's trainable adapter tensors."""
    out = {}
    for name, p in pm.named_parameters():
        if p.requires_grad:
            rest = name.removeprefix("base_model.model.").replace(".default", "").removesuffix(".weight")
            out[rest] = p
    return out


def make_peft(config, kind: str = "llama", *, seed: int = 5, scale: float = 0.3):
    """A float64 base, a peft model on a copy with every trainable perturbed (independent
    Gaussian noise, so no tensor is zero and no factor symmetric)."""
    base = f64_model(kind)
    pm = peft.get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                assert p.dtype == torch.float64
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return base, pm.eval()


def check_against_peft(base, pm, tmp_path, *, n_layers: int, kind: str = "llama") -> lf.Adapter:
    """load_peft of pm's checkpoint: peft's logits and per-tensor gradients on the lazy and the
    merged path; save_peft of it loads in peft with the same logits. Returns the adapter."""
    pm.save_pretrained(tmp_path / "peft")
    adapter = lf.load_peft(tmp_path / "peft", base)
    trainables = peft_trainables(pm)
    assert sorted(adapter.params) == sorted(trainables) and len(adapter.layers) == n_layers
    ids = tokens(batch=2, length=7, seed=4)
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    base_logits = base(ids).logits
    assert (want - base_logits).abs().max() > 1e-2, "the perturbed adapter must change the output"
    params = lf.base_params(base)
    for merged in (False, True):
        got = lf.adapted_call(base, adapter, ids, merged=merged).logits
        assert rel(got, want) < REL, (merged, rel(got, want))
        grads = grad(loss_fn(base, params, adapter, ids, merged=merged))(adapter.params)
        for key, g in grads.items():
            peft_g = trainables[key].grad
            assert peft_g.abs().max() > 0, key
            assert rel(g, peft_g) < REL, (key, merged, rel(g, peft_g))
    # lora_func -> peft: the config's fields read back as the same options, ranks and alphas
    lf.save_peft(adapter, tmp_path / "lf", model=base)
    again = lf.load_peft(tmp_path / "lf", base)
    assert again.spec.options == adapter.spec.options and again.layers == adapter.layers
    reloaded = peft.PeftModel.from_pretrained(f64_model(kind), tmp_path / "lf").eval()
    with torch.no_grad():
        assert rel(reloaded(input_ids=ids).logits, want) < REL
    return adapter


def check_trains(variant: str, kind: str = "llama", steps: int = 10, lr: float = 0.02, **spec_kwargs) -> None:
    """init_adapter, then Adam on one batch: the loss falls well below its start."""
    model = tiny_model(kind)
    targets = LLAMA_TARGETS if kind == "llama" else ["c_attn", "c_fc"]
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=targets, **spec_kwargs), generator=torch.Generator().manual_seed(0))
    ids = tokens(batch=4, length=12, seed=2)
    loss = loss_fn(model, lf.base_params(model), adapter, ids)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        value = loss(params)
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    assert losses[-1] < losses[0] - 0.5, (variant, losses)


def info(variant, r, d_in, d_out, alpha=6.0, **options) -> LayerInfo:
    opts = {**lf.get_variant(variant).default_options, **options}
    return LayerInfo(d_in=d_in, d_out=d_out, r=r, alpha=alpha, has_bias=False, options=tuple(sorted(opts.items())))


# ============================================================================================ LoHa


@pytest.mark.parametrize(
    ("init_weights", "rank_pattern"), [(True, {}), (False, {"down_proj": 3})], ids=["default", "random-rank-pattern"]
)
def test_loha_matches_peft(init_weights, rank_pattern, tmp_path):
    # alpha / r exactly representable in fp32: peft rounds the scale to fp32 (torch.tensor(alpha / r)).
    config = peft.LoHaConfig(r=4, alpha=6, target_modules=LLAMA_TARGETS, init_weights=init_weights, rank_pattern=rank_pattern,
                             alpha_pattern={"q_proj": 3.0})
    base, pm = make_peft(config)
    adapter = check_against_peft(base, pm, tmp_path, n_layers=6)
    ranks = {layer.target.module.rsplit(".", 1)[-1]: (layer.info.r, layer.info.alpha) for layer in adapter.layers}
    assert ranks == {"q_proj": (4, 3.0), "v_proj": (4, 6.0), "down_proj": (3 if rank_pattern else 4, 6.0)}
    assert dict(adapter.spec.options)["init"] == ("default" if init_weights else "random")


def test_loha_init_is_peft_s():
    model = tiny_model("llama")
    spec = lf.AdapterSpec("loha", targets=["down_proj"], r=4, dtype=torch.float64)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    for layer in adapter.layers:
        p = {n: adapter.params[f"{layer.target.module}.{n}"] for n in loha.NAMES}
        assert all(t.dtype == torch.float64 for t in p.values())
        assert p["hada_w1_a"].shape == (32, 4) and p["hada_w1_b"].shape == (4, 48)
        assert torch.count_nonzero(p["hada_w2_b"]) == 0
        for name, fan_in in (("hada_w1_a", 4), ("hada_w1_b", 48), ("hada_w2_a", 4)):
            bound = 1 / math.sqrt(fan_in)  # kaiming_uniform(a=√5)
            assert bound >= p[name].abs().max() > 0.95 * bound, name  # a = √6 would give 0.93 bound
    ids = tokens()
    assert torch.equal(lf.adapted_call(model, adapter, ids).logits, model(ids).logits)


@pytest.mark.parametrize(("r", "face"), [(2, True), (12, False)])
def test_loha_both_activation_forms_equal_the_dense_update(r, face):
    """The rank-r² path (small r) and the dense-update path (r² ≥ d_in d_out / (d_in + d_out))
    against ΔW = s (W1a W1b) ⊙ (W2a W2b) built in float64, values and gradients."""
    d_in, d_out = 14, 10
    assert loha.uses_face_splitting(r, d_in, d_out, 3) is face
    g = torch.Generator().manual_seed(r)
    p = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in loha.peft_shapes(r, d_in, d_out).items()}
    w, b, x = torch.randn(d_out, d_in, generator=g, dtype=torch.float64), torch.randn(d_out, generator=g, dtype=torch.float64), torch.randn(3, d_in, generator=g, dtype=torch.float64)
    i = info("loha", r, d_in, d_out)
    up = torch.randn(3, d_out, generator=g, dtype=torch.float64)

    def oracle(p):
        dw = (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"]) * (6.0 / r)
        return x @ (w + dw).T + b

    def lazy(p):
        return loha.activation_form(p, {}, x, LinearBase(w, b), i)

    assert rel(lazy(p), oracle(p)) < 1e-12
    for name in loha.NAMES:
        want = grad(lambda q: (oracle(q) * up).sum())(p)[name]
        assert rel(grad(lambda q: (lazy(q) * up).sum())(p)[name], want) < 1e-12, name


# ============================================================================================ LoKr


LOKR_CASES = {
    # r=2: W1 whole, W2 factored on every layer (32 = 4·8, 48 = 6·8)
    "default": dict(r=2, alpha=3),
    # decompose_both with r=1: both factored
    "decompose-both": dict(r=1, alpha=2, decompose_both=True),
    # r=4 on 32x32 (max(k, n)/2 = 4): W2 whole there, factored on down_proj via rank_pattern
    "whole-and-pattern": dict(r=4, alpha=6, rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 1.5}, init_weights="lycoris"),
    # decompose_factor 2: 32 = 2·16, 48 = 2·24
    "factor": dict(r=3, alpha=6, decompose_factor=2, init_weights=False),
}


@pytest.mark.parametrize("case", list(LOKR_CASES))
def test_lokr_matches_peft(case, tmp_path):
    config = peft.LoKrConfig(target_modules=LLAMA_TARGETS, **LOKR_CASES[case])
    base, pm = make_peft(config)
    adapter = check_against_peft(base, pm, tmp_path, n_layers=6)
    names = {layer.target.module.rsplit(".", 1)[-1]: sorted(n for n, _ in layer.param_shapes) for layer in adapter.layers}
    if case == "whole-and-pattern":
        assert names["q_proj"] == ["lokr_w1", "lokr_w2"] and names["down_proj"] == ["lokr_w1", "lokr_w2_a", "lokr_w2_b"]
    if case == "decompose-both":
        assert names["q_proj"] == ["lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"]


def test_lokr_factorization_and_layout_are_peft_s():
    from peft.tuners.lokr.layer import factorization

    for d in (1, 2, 7, 12, 32, 48, 96, 127, 128, 256, 768, 3072, 4096, 11008):
        for f in (-1, 1, 2, 4, 5, 16):
            assert lokr.factorization(d, f) == factorization(d, f), (d, f)
    opts = {"decompose_both": True, "decompose_factor": -1}
    assert lokr.layout(3, 48, 32, opts) == {"lokr_w1": (4, 6), "lokr_w2_a": (8, 3), "lokr_w2_b": (3, 8)}  # 3 < max(4, 6)/2 is false
    assert lokr.layout(2, 48, 32, opts) == {"lokr_w1_a": (4, 2), "lokr_w1_b": (2, 6), "lokr_w2_a": (8, 2), "lokr_w2_b": (2, 8)}
    assert lokr.layout(1, 48, 32, opts) == {"lokr_w1_a": (4, 1), "lokr_w1_b": (1, 6), "lokr_w2_a": (8, 1), "lokr_w2_b": (1, 8)}
    assert lokr.layout(4, 32, 32, opts) == {"lokr_w1": (4, 4), "lokr_w2": (8, 8)}


@pytest.mark.parametrize("init", ["default", "lycoris", "random"])
def test_lokr_inits(init):
    model = tiny_model("llama")
    spec = lf.AdapterSpec("lokr", targets=["down_proj"], r=2, init=init, decompose_both=True)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    zero = {"default": {"lokr_w1", "lokr_w1_a"}, "lycoris": {"lokr_w2", "lokr_w2_b"}, "random": set()}[init]
    for layer in adapter.layers:
        assert sorted(n for n, _ in layer.param_shapes) == ["lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"]
        for name, _ in layer.param_shapes:
            t = adapter.params[f"{layer.target.module}.{name}"]
            assert (torch.count_nonzero(t) == 0) == (name in zero), name
    ids = tokens()
    same = torch.equal(lf.adapted_call(model, adapter, ids).logits, model(ids).logits)
    assert same == (init != "random")


def test_lokr_activation_form_is_the_kronecker_identity():
    """(W1 ⊗ W2) x = vec(W1 X W2ᵀ) against torch.kron built in float64, for each layout, and
    never builds a (d_out, d_in) matrix."""
    from tests.peft_helpers import NoDenseProducts

    d_in, d_out = 12, 10  # 12 = 3·4, 10 = 2·5
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(d_out, d_in, generator=g, dtype=torch.float64), torch.randn(d_out, generator=g, dtype=torch.float64)
    x = torch.randn(2, 3, d_in, generator=g, dtype=torch.float64)
    for r, both in ((1, True), (1, False), (4, False)):
        i = info("lokr", r, d_in, d_out, alpha=5.0, decompose_both=both)
        p = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in lokr.layout(r, d_in, d_out, dict(i.options)).items()}
        w1 = p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"]
        w2 = p["lokr_w2"] if "lokr_w2" in p else p["lokr_w2_a"] @ p["lokr_w2_b"]
        want = x @ (w + torch.kron(w1, w2) * 5.0 / r).T + b
        with NoDenseProducts(d_in, d_out):
            got = lokr.activation_form(p, {}, x, LinearBase(w, b), i)
        assert rel(got, want) < 1e-12, (r, both)
        assert rel(lokr.weight_form(p, {}, w, b, i)[0], w + torch.kron(w1, w2) * 5.0 / r) < 1e-12
        # Many rows (rows·m·k >= d_out·d_in): the dense update, the same values.
        many = torch.randn(40, d_in, generator=g, dtype=torch.float64)
        assert rel(lokr.activation_form(p, {}, many, LinearBase(w, b), i), many @ (w + torch.kron(w1, w2) * 5.0 / r).T + b) < 1e-12


# ========================================================================================= GraLoRA

GPT2_TARGETS = ["c_attn", "c_fc"]


@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        ("llama", dict(r=4, alpha=6, gralora_k=2)),
        ("llama", dict(r=6, alpha=6, gralora_k=2, hybrid_r=2, init_weights=False)),
        ("gpt2", dict(r=8, alpha=4, gralora_k=4, hybrid_r=1, fan_in_fan_out=True)),
    ],
    ids=["k2", "hybrid-random", "gpt2-k4-hybrid"],
)
def test_gralora_matches_peft(kind, kwargs, tmp_path):
    targets = LLAMA_TARGETS if kind == "llama" else GPT2_TARGETS
    base, pm = make_peft(peft.GraloraConfig(target_modules=targets, **kwargs), kind)
    adapter = check_against_peft(base, pm, tmp_path, n_layers=6 if kind == "llama" else 4, kind=kind)
    opts = dict(adapter.spec.options)
    assert (opts["gralora_k"], opts["hybrid_r"]) == (kwargs["gralora_k"], kwargs.get("hybrid_r", 0))


def test_gralora_blocks_are_k_by_k_lora_blocks():
    """ΔW's block (m, n) is its own rank-s LoRA: B[m][n-th s rows]ᵀ A[n][:, m-th s columns]ᵀ,
    built here block by block in float64, against both forms."""
    k, s, d_in, d_out = 3, 2, 12, 15
    r = k * s
    g = torch.Generator().manual_seed(1)
    i = info("gralora", r, d_in, d_out, alpha=4.0, gralora_k=k)
    p = {n: torch.randn(sh, generator=g, dtype=torch.float64) for n, sh in gralora.peft_shapes(r, d_in, d_out, dict(i.options)).items()}
    dw = torch.zeros(d_out, d_in, dtype=torch.float64)
    bi, bo = d_in // k, d_out // k
    for m in range(k):
        for n in range(k):
            a_block = p["gralora_A"][n][:, m * s:(m + 1) * s]  # (d_in/k, s)
            b_block = p["gralora_B"][m][n * s:(n + 1) * s, :]  # (s, d_out/k)
            dw[m * bo:(m + 1) * bo, n * bi:(n + 1) * bi] = (a_block @ b_block).T
    dw *= 4.0 / r
    w, b, x = torch.randn(d_out, d_in, generator=g, dtype=torch.float64), torch.randn(d_out, generator=g, dtype=torch.float64), torch.randn(2, 3, d_in, generator=g, dtype=torch.float64)
    assert torch.linalg.matrix_rank(dw) > r  # higher rank than a LoRA of the same parameters
    assert rel(gralora.weight_form(p, {}, w, b, i)[0], w + dw) < 1e-12
    assert rel(gralora.activation_form(p, {}, x, LinearBase(w, b), i), x @ (w + dw).T + b) < 1e-12


# ============================================================================================ MiSS


@pytest.mark.parametrize(
    ("init_weights", "extra"), [(True, {}), ("mini", {"mini_r": 4}), ("bat", {}), (False, {})], ids=["miss", "mini", "bat", "random"]
)
def test_miss_matches_peft(init_weights, extra, tmp_path):
    # r=5 does not divide 32 or 48 (peft's zero-padded last chunk); bat needs r | both sizes.
    r = 4 if init_weights == "bat" else 5
    base, pm = make_peft(peft.MissConfig(r=r, target_modules=LLAMA_TARGETS, init_weights=init_weights, **extra))
    adapter = check_against_peft(base, pm, tmp_path, n_layers=6)
    assert dict(adapter.spec.options)["init"] == {True: "miss", False: "random"}.get(init_weights, init_weights)


def test_miss_tiles_the_block():
    """ΔW[o, j] = block[j mod r, o] (miss), the block tiled along d_out too (mini), and bat's
    block-affine W[b, c] M_b + M_b, each built by loops in float64."""
    d_in, d_out = 7, 6
    g = torch.Generator().manual_seed(2)
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    for how, r, shape in (("miss", 3, (3, 6)), ("mini", 3, (3, 2)), ("bat", 2, (3, 2, 2))):
        ww = w if how != "bat" else torch.randn(6, 4, generator=g, dtype=torch.float64)
        i = info("miss", r, ww.shape[1], d_out, init=how, mini_r=2)
        block = torch.randn(shape, generator=g, dtype=torch.float64)
        want = torch.zeros_like(ww)
        for o in range(d_out):
            for j in range(ww.shape[1]):
                if how == "miss":
                    want[o, j] = block[j % r, o]
                elif how == "mini":
                    want[o, j] = block[j % r, o % 2]
        if how == "bat":
            for b_ in range(3):
                for c in range(2):
                    blk = ww[b_ * 2:(b_ + 1) * 2, c * 2:(c + 1) * 2]
                    want[b_ * 2:(b_ + 1) * 2, c * 2:(c + 1) * 2] = blk @ block[b_] + block[b_]
        x = torch.randn(4, ww.shape[1], generator=g, dtype=torch.float64)
        assert rel(miss.weight_form({"miss_block": block}, {}, ww, None, i)[0], ww + want) < 1e-12, how
        assert rel(miss.activation_form({"miss_block": block}, {}, x, LinearBase(ww, None), i), x @ (ww + want).T) < 1e-12, how


# ================================================================================ dropout vs peft


@pytest.mark.parametrize(
    ("variant", "config"),
    [
        ("loha", lambda: peft.LoHaConfig(r=4, alpha=6, target_modules=LLAMA_TARGETS, rank_dropout=0.5)),
        ("loha", lambda: peft.LoHaConfig(r=4, alpha=6, target_modules=LLAMA_TARGETS, module_dropout=0.5)),
        ("lokr", lambda: peft.LoKrConfig(r=2, alpha=3, target_modules=LLAMA_TARGETS, rank_dropout=0.5, rank_dropout_scale=True)),
        ("lokr", lambda: peft.LoKrConfig(r=2, alpha=3, target_modules=LLAMA_TARGETS, rank_dropout=0.4)),
        ("lokr", lambda: peft.LoKrConfig(r=2, alpha=3, target_modules=LLAMA_TARGETS, module_dropout=0.5)),
        # input dropout, drawn anew for the hybrid path
        ("gralora", lambda: peft.GraloraConfig(r=4, alpha=6, hybrid_r=2, target_modules=LLAMA_TARGETS, gralora_dropout=0.3)),
        ("miss", lambda: peft.MissConfig(r=4, target_modules=LLAMA_TARGETS, miss_dropout=0.3)),
    ],
    ids=["loha-rank", "loha-module", "lokr-rank-scaled", "lokr-rank", "lokr-module", "gralora-hybrid", "miss"],
)
def test_a_seeded_training_step_equals_peft(variant, config, tmp_path):
    """The dropouts (LoHa/LoKr rank_dropout and module_dropout, GraLoRA's and MiSS's input
    dropout) draw what peft draws, in its order: the same seed gives
    peft's training-mode logits; eval mode and the merged path have no dropout. (With both set,
    peft skips the row draw of a dropped layer and the streams part: see _lycoris.output_keep.)"""
    base, pm = make_peft(config())
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, base)
    opts = dict(adapter.spec.options)
    assert sum(v for k, v in opts.items() if k.endswith("dropout")) > 0 and adapter.spec.variant == variant
    ids = tokens(batch=2, length=7, seed=4)
    with torch.no_grad():
        plain = pm(input_ids=ids).logits
        pm.train()
        base.train()
        seen = set()
        for seed in range(4):
            torch.manual_seed(seed)
            want = pm(input_ids=ids).logits
            torch.manual_seed(seed)
            got = lf.adapted_call(base, adapter, ids).logits
            assert rel(got, want) < REL, seed
            seen.add(round(float((want - plain).abs().max()), 6))
            assert rel(lf.adapted_call(base, adapter, ids, merged=True).logits, plain) < REL
        base.eval()
        assert rel(lf.adapted_call(base, adapter, ids).logits, plain) < REL
    assert len(seen) > 1 and max(seen) > 1e-3, "the dropout must act (and differ between seeds)"


# ================================================================================ training, refusals


@pytest.mark.parametrize(
    ("variant", "kwargs"),
    [("loha", {"r": 4}), ("lokr", {"r": 2, "alpha": 16.0}), ("gralora", {"r": 4, "hybrid_r": 2}), ("miss", {"r": 4})],
)
def test_init_adapter_trains(variant, kwargs):
    check_trains(variant, **kwargs)


def test_peft_refuses_gpt2_conv1d_for_loha_and_lokr_lora_func_does_not():
    """Keeps docs/variants.md's table honest: peft's LyCORIS tuners refuse GPT-2 Conv1D."""
    for config in (peft.LoHaConfig(r=2, target_modules=["c_attn"]), peft.LoKrConfig(r=2, target_modules=["c_attn"])):
        with pytest.raises(TypeError, match="not supported"):
            peft.get_peft_model(tiny_model("gpt2"), config)
    for variant in ("loha", "lokr"):
        adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec(variant, targets=["c_attn"], r=2))
        assert {layer.target.layout for layer in adapter.layers} == {"conv1d"}
        assert "refuses" in peft_problems(adapter)[0]


def test_option_errors_name_the_option():
    with pytest.raises(ValueError, match=r"loha option rank_dropout=1.0 must be in \[0, 1\)"):
        lf.AdapterSpec("loha", targets=["q_proj"], rank_dropout=1.0)
    with pytest.raises(ValueError, match=r"lokr option module_dropout=-0.1"):
        lf.AdapterSpec("lokr", targets=["q_proj"], module_dropout=-0.1)
    with pytest.raises(ValueError, match=r"lokr option init='zeros' is not one of \['default', 'lycoris', 'random'\]"):
        lf.AdapterSpec("lokr", targets=["q_proj"], init="zeros")
    with pytest.raises(ValueError, match=r"lokr option decompose_factor=0 must be -1"):
        lf.AdapterSpec("lokr", targets=["q_proj"], decompose_factor=0)
