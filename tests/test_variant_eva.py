"""EVA: peft parity (exact with full SVD, subspace-level with peft's randomized SVD, exact
forward/backward from peft's own EVA weights), rank redistribution and dropping, masking,
shared decompositions, whitening, determinism and errors."""

from __future__ import annotations

import itertools
import math
import warnings
from contextlib import contextmanager

import peft.tuners.lora.eva as peft_eva
import pytest
import torch
from peft import EvaConfig, LoraConfig, get_eva_state_dict, get_peft_model, initialize_lora_eva_weights
from peft.utils.incremental_pca import IncrementalPCA
from torch.func import functional_call, grad

import lora_func as lf
from lora_func.variants._kernels import lora_scale
from lora_func.variants import LayerInfo
from lora_func.variants import eva
from tests.contract_helpers import calibration_batches
from tests.models import tiny_model, tokens

PEFT_PREFIX = "base_model.model."


class _FullSvdIPCA(IncrementalPCA):
    """peft's IncrementalPCA with the exact SVD instead of its randomized one."""

    def __init__(self, *args, **kwargs):
        kwargs["lowrank"] = False
        super().__init__(*args, **kwargs)


@pytest.fixture
def peft_full_svd(monkeypatch):
    monkeypatch.setattr(peft_eva, "IncrementalPCA", _FullSvdIPCA)


@contextmanager
def _peft_warnings():
    """The warnings peft/transformers raise here, each expected explicitly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
        yield


def peft_state_dict(kind, targets, r, batches, **eva_options):
    cfg = LoraConfig(r=r, lora_alpha=8, target_modules=targets, init_lora_weights="eva", eva_config=EvaConfig(**eva_options))
    return get_eva_state_dict(tiny_model(kind), batches, peft_config=cfg, show_progress_bar=False)


def ours(kind, targets, r, batches, seed=0, alpha=8.0, **options):
    model = tiny_model(kind)
    spec = lf.AdapterSpec("eva", targets=targets, r=r, alpha=alpha, **options)
    return model, lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed), calibration=batches)


def a_of(adapter):
    return {layer.target.module: adapter.params[f"{layer.target.module}.lora_A"].detach() for layer in adapter.layers}


def info_of(adapter):
    return {layer.target.module: layer.info for layer in adapter.layers}


def all_modules(kind, targets):
    return [n for n, _ in tiny_model(kind).named_modules() if any(n.endswith("." + t) for t in targets)]


LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

EXACT_CASES = [
    pytest.param("llama", LLAMA_ALL, 2, {}, id="llama-all-r2"),
    pytest.param("llama", ["q_proj", "v_proj", "down_proj"], 2, {"rho": 3.0}, id="llama-qv-down-rho3"),
    # (the -drop cases are chosen so that peft drops a layer on these tiny models; asserted below)
    pytest.param("qwen2", ["q_proj", "o_proj", "gate_proj"], 2, {}, id="qwen2-drop"),
    pytest.param("gpt2", ["c_attn", "c_proj", "c_fc"], 2, {}, id="gpt2-drop"),
    pytest.param("gpt2", ["c_attn", "c_fc"], 3, {"rho": 3.0, "tau": 0.95, "whiten": True}, id="gpt2-whiten"),
]


@pytest.mark.parametrize(("kind", "targets", "r", "options"), EXACT_CASES)
def test_equals_peft_with_exact_svd(peft_full_svd, kind, targets, r, options):
    """With the exact SVD on both sides the whole algorithm (incremental PCA, convergence,
    sharing, redistribution, whitening) is deterministic: ranks, dropped layers and every A
    must equal peft's get_eva_state_dict."""
    batches = calibration_batches()
    expected = peft_state_dict(kind, targets, r, batches, **options)
    _, adapter = ours(kind, targets, r, batches, svd="full", **options)
    got, infos = a_of(adapter), info_of(adapter)
    peft_ranks = {m: a.shape[0] for m, a in expected.items()}
    assert sorted(peft_ranks) == sorted(all_modules(kind, targets))
    assert {m: infos[m].r if m in infos else 0 for m in peft_ranks} == peft_ranks
    for m, a in expected.items():
        if a.shape[0]:
            torch.testing.assert_close(got[m].double(), a.double(), atol=1e-6, rtol=0, msg=m)
    # redistribution: the ranks add up to the budget, each at most round(r·rho); alpha rescaled
    rho = options.get("rho", 2.0)
    assert sum(peft_ranks.values()) == r * len(peft_ranks)
    assert max(peft_ranks.values()) <= round(r * rho)
    for m, info in infos.items():
        assert info.alpha == pytest.approx(8.0 * info.r / r), m
    if kind != "llama" and "rho" not in options:
        assert 0 in peft_ranks.values(), "this case is meant to drop a layer"


@pytest.mark.parametrize(
    ("kind", "targets"), [("llama", ["q_proj", "v_proj"]), ("gpt2", ["c_attn"])], ids=["llama", "gpt2"]
)
def test_default_randomized_svd_close_to_peft_default(kind, targets):
    """Both sides with their randomized SVDs (different random matrices): same ranks, and the
    subspaces agree by mean |cos| of A's rows (peft's own EVA test accepts > 0.75)."""
    batches = calibration_batches()
    expected = peft_state_dict(kind, targets, 4, batches)
    _, adapter = ours(kind, targets, 4, batches)
    got = a_of(adapter)
    assert {m: a.shape[0] for m, a in expected.items()} == {m: a.shape[0] for m, a in got.items()}
    for m, a in expected.items():
        cos = torch.nn.functional.cosine_similarity(got[m].double(), a.double()).abs().mean()
        assert cos > 0.75, (m, cos)


def _peft_model(kind, targets, r, batches, **config):
    cfg = LoraConfig(r=r, lora_alpha=8, target_modules=targets, init_lora_weights="eva", eva_config=EvaConfig(), **config)
    with _peft_warnings():
        model = get_peft_model(tiny_model(kind), cfg, low_cpu_mem_usage=True)
    state = get_eva_state_dict(model, batches, show_progress_bar=False)
    initialize_lora_eva_weights(model, eva_state_dict=dict(state), show_progress_bar=False)
    return model


@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
@pytest.mark.parametrize(
    ("kind", "targets"),
    [("llama", ["q_proj", "v_proj", "down_proj"]), ("qwen2", ["q_proj", "o_proj", "gate_proj"]), ("gpt2", ["c_attn", "c_proj"])],
    ids=["llama", "qwen2", "gpt2"],
)
def test_forward_and_grads_equal_peft_model_from_its_eva_weights(peft_full_svd, kind, targets, use_rslora):
    """peft's EVA-initialised model (get_eva_state_dict -> initialize_lora_eva_weights) and the
    lora_func adapter: same layers, ranks, scales and A; after a random perturbation of peft's
    A and B copied into the adapter, the logits and every adapter gradient are equal."""
    batches = calibration_batches()
    r = 2
    peft_model = _peft_model(kind, targets, r, batches, use_rslora=use_rslora)
    model, adapter = ours(kind, targets, r, batches, svd="full", use_rslora=use_rslora)
    lora_layers = {
        n.removeprefix(PEFT_PREFIX): m for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A
    }
    infos = info_of(adapter)
    assert sorted(lora_layers) == sorted(infos)
    assert len(infos) < len(all_modules(kind, targets)) or kind == "llama"  # qwen2/gpt2 drop a layer here
    assert len({info.r for info in infos.values()}) > 1, "ranks should be redistributed in this case"
    g = torch.Generator().manual_seed(5)
    params = {}
    with torch.no_grad():
        for name, layer in lora_layers.items():
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            assert layer.scaling["default"] == pytest.approx(lora_scale(infos[name]), rel=1e-12), name
            torch.testing.assert_close(adapter.params[f"{name}.lora_A"], a, atol=1e-6, rtol=0, msg=name)
            a.add_(0.1 * torch.randn(a.shape, generator=g))
            b.add_(0.1 * torch.randn(b.shape, generator=g))
            params[f"{name}.lora_A"] = a.detach().clone().requires_grad_(True)
            params[f"{name}.lora_B"] = b.detach().clone().requires_grad_(True)
    adapter = adapter.with_params(params)
    ids = tokens(2, 8, seed=4)

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    peft_logits = peft_model(ids).logits
    loss_of(peft_logits).backward()
    base = lf.base_params(model)
    for make in (lf.overlay, lf.merge_overlay):
        out = functional_call(model, make(base, adapter), (ids,)).logits
        assert (out - model(ids).logits).abs().max() > 1e-3
        torch.testing.assert_close(out, peft_logits, atol=1e-5, rtol=0)
        grads = grad(lambda p: loss_of(functional_call(model, make(base, adapter.with_params(p)), (ids,)).logits))(params)  # noqa: B023
        for name, layer in lora_layers.items():
            for short in ("lora_A", "lora_B"):
                expected = getattr(layer, short)["default"].weight.grad
                assert expected.abs().max() > 0
                torch.testing.assert_close(grads[f"{name}.{short}"], expected, atol=1e-5, rtol=1e-4, msg=f"{name}.{short}")


def test_whitening_divides_each_row_once_unlike_peft_on_shared_inputs(peft_full_svd):
    """A_white = A / sqrt(S) row by row. peft divides a *view* of the shared components in
    place once per sharing layer, so for q/k/v (3 layers, one decomposition) its row i ends up
    divided by sqrt(S_i) once per layer of the group whose rank exceeds i; on an unshared
    layer (o_proj) peft and lora_func agree."""
    batches = calibration_batches()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_white = peft_state_dict("llama", targets, 2, batches, whiten=True)
    _, plain = ours("llama", targets, 2, batches, svd="full")
    _, white = ours("llama", targets, 2, batches, svd="full", whiten=True)
    ranks = {m: info.r for m, info in info_of(white).items()}
    plain, white = a_of(plain), a_of(white)
    for m in plain:
        assert plain[m].shape == white[m].shape == peft_white[m].shape
        # each row is the plain row times one positive factor 1/sqrt(S_i), S_i decreasing
        factor = white[m].norm(dim=1) / plain[m].norm(dim=1)
        torch.testing.assert_close(white[m], plain[m] * factor[:, None], atol=1e-6, rtol=1e-5)
        assert (factor > 0).all() and (factor[1:] >= factor[:-1]).all() and ((factor - 1).abs() > 0.05).all(), m
        peft_factor = peft_white[m].norm(dim=1).float()
        if m.endswith("o_proj"):
            torch.testing.assert_close(white[m].double(), peft_white[m].double(), atol=1e-6, rtol=0)
        else:
            attn = m.rsplit(".", 1)[0]
            group = [ranks[f"{attn}.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
            times = torch.tensor([sum(rank > i for rank in group) for i in range(len(factor))])
            assert times.max() == 3
            torch.testing.assert_close(peft_factor, factor**times, rtol=1e-4, atol=0)


def test_redistribution_and_dropping_on_synthetic_inputs():
    """Layer 'low' gets rank-4 inputs, layer 'iso' isotropic noise: with r=2, rho=2 (4
    components each, budget 4) all four components of 'low' explain more variance than any
    of 'iso', so 'low' gets rank 4 (alpha·4/2) and 'iso' is left out. A spans the inputs'
    principal subspace (full-batch PCA oracle)."""
    g = torch.Generator().manual_seed(0)
    d = 16
    basis = torch.linalg.qr(torch.randn(d, 4, generator=g, dtype=torch.float64)).Q.float()  # (d, 4)
    batches = []
    for _ in range(3):
        coeff = torch.randn(64, 4, generator=g) * torch.tensor([2.4, 2.2, 2.0, 1.8])
        low = coeff @ basis.T + 0.01 * torch.randn(64, d, generator=g) + 3.0  # a mean to remove
        batches.append({"low": low, "iso": torch.randn(64, d, generator=g)})
    infos = {m: LayerInfo(d_in=d, d_out=8, r=2, alpha=6.0, has_bias=False, options=_options()) for m in ("iso", "low")}
    out = eva.calibrate(itertools.cycle(batches), infos, generator=torch.Generator().manual_seed(1))
    assert list(out) == ["low"]
    info, a = out["low"]
    assert (info.r, info.alpha, info.d_in, info.d_out) == (4, 12.0, d, 8)
    assert a.shape == (4, d)
    rows = torch.cat([b["low"] for b in batches]).double()
    _, _, vh = torch.linalg.svd(rows - rows.mean(0), full_matrices=False)
    # same subspace: projecting A's rows on the oracle's top-4 directions keeps their norm
    proj = a.double() @ vh[:4].T
    torch.testing.assert_close(proj.norm(dim=1), a.double().norm(dim=1), atol=1e-4, rtol=0)
    cos = torch.nn.functional.cosine_similarity(a.double(), vh[:4]).abs()
    assert (cos > 0.99).all(), cos


def _options(**overrides):
    return tuple(sorted({**eva.VARIANT.default_options, **overrides}.items()))


def test_dropped_layer_gets_no_adapter_and_save_load_keeps_ranks(peft_full_svd, tmp_path):
    """The layers and ranks (oracle: peft's get_eva_state_dict, exact SVD) survive save/load."""
    batches = calibration_batches()
    targets = ["c_attn", "c_proj", "c_fc"]
    peft_ranks = {m: a.shape[0] for m, a in peft_state_dict("gpt2", targets, 2, batches).items()}
    model, adapter = ours("gpt2", targets, 2, batches, svd="full")
    modules = {layer.target.module for layer in adapter.layers}
    dropped = sorted(set(all_modules("gpt2", targets)) - modules)
    assert dropped, "this case drops a layer"
    assert dropped == sorted(m for m, rank in peft_ranks.items() if rank == 0)
    assert not any(k.startswith(tuple(f"{m}." for m in dropped)) for k in adapter.params)
    ids = tokens()
    assert torch.equal(lf.adapted_call(model, adapter, ids).logits, model(ids).logits)
    loaded = lf.load(lf.save(adapter, tmp_path / "eva.safetensors"), model=model)
    assert loaded.layers == adapter.layers
    assert {layer.target.module: layer.info.r for layer in loaded.layers} == {m: r for m, r in peft_ranks.items() if r}
    assert len({layer.info.r for layer in loaded.layers}) > 1, "ranks should be redistributed in this case"


def test_padding_and_ignored_labels_do_not_reach_the_statistics():
    """Right-padded positions and labels == -100 positions are excluded: changing those tokens'
    ids (later positions, so a causal model's other positions are unchanged) gives the same
    adapter bit for bit, while changing one kept token changes it."""
    base = [{k: v.clone() for k, v in b.items()} for b in calibration_batches(n=3)]
    for b in base:
        b["labels"] = b["input_ids"].clone()
        b["labels"][1, -4:] = -100
        b["labels"][2, :] = torch.where(torch.arange(16) % 5 == 4, -100, b["labels"][2])
        b["labels"][2, -1] = -100

    def with_ids(change):
        out = []
        for b in base:
            ids = b["input_ids"].clone()
            change(ids)
            out.append({**b, "input_ids": ids})
        return out

    def build(batches):
        return ours("llama", ["q_proj", "v_proj"], 2, batches, svd="full")[1]

    reference = build(base)

    def change_excluded(ids):
        ids[0, -3:] = (ids[0, -3:] + 7) % 50 + 3  # attention_mask == 0 there
        ids[1, -4:] = (ids[1, -4:] + 11) % 50 + 3  # labels == -100 there
        ids[2, -1] = (ids[2, -1] + 13) % 50 + 3

    def change_kept(ids):
        ids[3, 5] = (ids[3, 5] + 7) % 50 + 3

    same = build(with_ids(change_excluded))
    other = build(with_ids(change_kept))
    assert same.layers == reference.layers
    for key in reference.params:
        assert torch.equal(same.params[key], reference.params[key]), key
    assert any(not torch.equal(other.params[k], reference.params[k]) for k in reference.params)


def test_layers_with_identical_inputs_share_one_decomposition(monkeypatch):
    """q/k/v (and gate/up) see the same normed hidden states: one incremental PCA per group
    (detected by equal inputs on the first batch), identical A; different blocks differ."""
    first_fits = []
    original = eva._partial_fit

    def spy(state, rows, *args):
        if state is None:
            first_fits.append(tuple(rows.shape))
        return original(state, rows, *args)

    monkeypatch.setattr(eva, "_partial_fit", spy)
    _, adapter = ours("llama", LLAMA_ALL, 2, calibration_batches(), svd="full", rho=1.0)
    # per block: {q, k, v}, {o}, {gate, up}, {down} -> 4 decompositions, 2 blocks
    assert len(first_fits) == 8
    a = a_of(adapter)
    for block in (0, 1):
        attn, mlp = f"model.layers.{block}.self_attn", f"model.layers.{block}.mlp"
        assert torch.equal(a[f"{attn}.q_proj"], a[f"{attn}.k_proj"]) and torch.equal(a[f"{attn}.q_proj"], a[f"{attn}.v_proj"])
        assert torch.equal(a[f"{mlp}.gate_proj"], a[f"{mlp}.up_proj"])
        assert not torch.allclose(a[f"{attn}.q_proj"], a[f"{attn}.o_proj"][:, : a[f"{attn}.q_proj"].shape[1]])
    assert not torch.allclose(a["model.layers.0.self_attn.q_proj"], a["model.layers.1.self_attn.q_proj"])


def test_deterministic_given_the_generator_and_global_rng_untouched():
    batches = calibration_batches()
    model = tiny_model("gpt2")  # (seeds the global RNG itself)
    spec = lf.AdapterSpec("eva", targets=["c_attn"], r=4)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(3), calibration=batches)
    assert torch.equal(torch.get_rng_state(), state), "calibration must not use the global RNG"
    _, again = ours("gpt2", ["c_attn"], 4, batches, seed=3)
    _, other = ours("gpt2", ["c_attn"], 4, batches, seed=4)
    assert again.layers == first.layers
    for key in first.params:
        assert torch.equal(again.params[key], first.params[key]), key
    # the randomized SVD (q = 2k = 16 < d_in = 32) depends on the generator's draw
    assert any(not torch.equal(other.params[k], first.params[k]) for k in first.params)


@pytest.mark.parametrize("shape", [(40, 12), (9, 30)], ids=["tall", "wide"])
def test_randomized_svd_is_torch_svd_lowrank_with_the_seeded_matrix(shape):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(shape[0], 5, generator=g, dtype=torch.float64) @ torch.randn(5, shape[1], generator=g, dtype=torch.float64)
    s, vh = eva._randomized_svd(a, 8, 4, seed=77)
    with torch.random.fork_rng():
        torch.manual_seed(77)
        _, s_ref, v_ref = torch.svd_lowrank(a, q=8, niter=4)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(vh, v_ref.mH, atol=1e-12, rtol=0)
    # rank 5 < q: the randomized SVD is exact
    torch.testing.assert_close(s[:5], torch.linalg.svdvals(a)[:5], atol=1e-9, rtol=1e-9)


def test_too_few_token_rows_is_a_clear_error():
    ids = tokens(1, 6, seed=2)
    batches = [{"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])}]
    with pytest.raises(ValueError, match=r"5 usable token rows.*h\.0\.attn\.c_attn.*fewer than the 8 principal components"):
        ours("gpt2", ["c_attn"], 4, batches)


def test_not_converging_is_a_clear_error():
    with pytest.raises(ValueError, match=r"did not converge after max_batches=1 .*tau=0\.99"):
        ours("gpt2", ["c_attn"], 2, calibration_batches(), max_batches=1)
    infos = {"x": LayerInfo(d_in=8, d_out=8, r=1, alpha=1.0, has_bias=False, options=_options(tau=1.0))}
    finite = [{"x": torch.randn(20, 8, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    with pytest.raises(ValueError, match=r"ran out after 3 batches"):
        eva.calibrate(iter(finite), infos, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rho": 0.5}, "rho"),
        ({"tau": 1.5}, "tau"),
        ({"svd": "qr"}, "svd"),
        ({"max_batches": 0}, "max_batches"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        lf.AdapterSpec("eva", targets=["c_attn"], **options)


def test_needs_calibration():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="calibration"):
        lf.init_adapter(model, lf.AdapterSpec("eva", targets=["c_attn"]))
    info = LayerInfo(d_in=32, d_out=96, r=2, alpha=8.0, has_bias=True, options=_options())
    with pytest.raises(ValueError, match="principal directions"):
        eva.init(torch.zeros(96, 32), None, info, dtype=torch.float32, generator=torch.Generator())


def test_lora_scale_follows_the_layer_rank():
    info = LayerInfo(d_in=4, d_out=4, r=4, alpha=12.0, has_bias=False, options=_options(use_rslora=True))
    assert lora_scale(info) == pytest.approx(12.0 / math.sqrt(4))
