"""FRoD beyond the contract suite, against HF peft 0.21.2 in float64.

peft computes each category's basis ``V`` in float32 (as lora_func does: see variants/frod.py),
then solves each layer's ``U`` and ``λ`` in float64 and rounds them to float32
(``_calculate_frod_u_and_lambda``'s ``.float()``) whatever the model's dtype; lora_func rounds
them once, to the adapter dtype. The oracle is peft's own code with that rounding removed
(:func:`peft_unrounded`: the method re-written without ``.float()``, nothing else changed);
peft's forward is then differentiated by autograd as it is. Checked: a peft checkpoint with
perturbed trainables (several blocks, three categories on the tiny Llama, GPT-2 ``Conv1D``; with
and without ``save_projection``) loads with peft's logits and per-tensor gradients (lazy and
merged, relative 1e-9), ``save_peft`` loads in peft; ``init_adapter`` gives peft's V, pattern,
U, λ and values from the same seeds (both ``init_weights``); dropout in a training step equals
peft's under one global RNG seed; the categories' widths are checked.
"""

from __future__ import annotations

import copy
import warnings

import peft
import peft.tuners.frod.layer as peft_frod
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import lora_func as lf
from tests import bank_oracle
from tests.models import tokens

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning", "ignore:Sparse invariant checks:UserWarning")

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


def _unrounded(self, V, W):
    """peft's ``_calculate_frod_u_and_lambda`` without its final ``.float()`` (peft 0.21.2)."""
    w = W.detach().to(torch.float64).cpu()
    v = V.detach().to(torch.float64).cpu()
    try:
        bi = torch.linalg.solve(v, w.T).T
    except RuntimeError:
        bi = w @ torch.linalg.pinv(v, rtol=1e-6).T
    lambda_l = torch.linalg.norm(bi, dim=0)
    u = torch.zeros_like(bi)
    nonzero = lambda_l > 1e-12
    u[:, nonzero] = bi[:, nonzero] / lambda_l[nonzero]
    return u, lambda_l


@pytest.fixture
def peft_unrounded(monkeypatch):
    monkeypatch.setattr(peft_frod.FrodLayer, "_calculate_frod_u_and_lambda", _unrounded)


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def _config(kind: str, **kwargs) -> peft.FrodConfig:
    return peft.FrodConfig(**{"target_modules": TARGETS[kind], "sparse_rate": 0.05, "progressbar": False, "fan_in_fan_out": kind == "gpt2", **kwargs})


CASES = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("llama", {"save_projection": False, "projection_prng_key": 5, "regularization_alpha": 0.01}, id="llama-no-projection"),
    pytest.param("gpt2", {}, id="gpt2-conv1d"),
    pytest.param("gpt2", {"save_projection": False}, id="gpt2-conv1d-no-projection"),
]


@pytest.mark.parametrize(("kind", "options"), CASES)
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path, kind, options, peft_unrounded):
    model = llama64 if kind == "llama" else bank_oracle.model64("gpt2")
    pm = bank_oracle.peft_model(model, _config(kind, **options), scale=0.3)
    adapter, _ = bank_oracle.check_against_peft(model, pm, tmp_path)
    saved = options.get("save_projection", True)
    assert adapter.spec.option("save_projection") is saved
    assert adapter.spec.option("projection_prng_key") == options.get("projection_prng_key", 0)
    # save_peft writes what peft reads back to the same logits, the projection as the option says
    lf.save_peft(adapter, tmp_path / "ours", model=model)
    written = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    projections = sorted(k for k in written if k.startswith("base_model.frod_"))
    categories = {"llama": ["mlp_down_proj", "self_attn_q_proj", "self_attn_v_proj"], "gpt2": ["attn_c_attn", "mlp_c_fc"]}[kind]
    assert projections == ([f"base_model.frod_{t}.{c}" for t in ("V", "s_indices", "s_size") for c in categories] if saved else [])
    assert not [k for k in written if "frod_U" in k]  # U is solved on load, never saved (as peft)
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        ours = lf.adapted_call(model, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(model, tmp_path / "ours", ids), ours) < bank_oracle.RTOL


def test_the_file_s_projection_is_the_one_its_layers_are_solved_against(llama64, tmp_path, peft_unrounded):
    """A ``save_projection`` file's V is what its model was trained with, which a recomputation
    elsewhere (another LAPACK: another eigenvector sign) may not give. The model of such a file:
    peft's layers built on another V (V·Q, Q orthogonal), U and λ solved against it as peft
    solves them, then trained (perturbed). load_peft solves U against the file's V and equals
    that model; peft's own reload keeps the U it solved against its recomputed V (it never
    re-solves U after reading V) and gives another model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(llama64), _config("llama")).eval()
    bases = pm.base_model.frod_V["self_attn_q_proj"]
    q = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64))[0]
    bases["default"] = bases["default"] @ q
    for name, module in pm.named_modules():
        if isinstance(module, peft_frod.FrodLayer) and name.endswith("q_proj"):
            u, lam = _unrounded(module, bases["default"], module.get_base_layer().weight)
            module.frod_U["default"] = u
            module.frod_lambda_l["default"].data.copy_(lam)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, llama64)
    assert torch.equal(adapter.buffers["<shared>.frod_V@self_attn_q_proj"], bases["default"])
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        ours, want = lf.adapted_call(llama64, adapter, ids).logits, pm(input_ids=ids).logits
    assert bank_oracle.rel(ours, want) < bank_oracle.RTOL
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path, ids), want) > 1e-3


def test_peft_s_own_float32_rounding_is_the_only_difference(llama64, tmp_path):
    """Without the unrounded oracle, peft's logits on the float64 model differ from lora_func's
    only by the float32 round-off of U: the one difference the oracle removes."""
    pm = bank_oracle.peft_model(llama64, _config("llama"), scale=0.3)
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, llama64)
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        err = bank_oracle.rel(lf.adapted_call(llama64, adapter, ids).logits, pm(input_ids=ids).logits)
    assert 1e-12 < err < 1e-5, err


@pytest.mark.parametrize("init_weights", [True, False])
def test_init_adapter_gives_peft_s_tensors_from_the_same_seeds(llama64, init_weights, peft_unrounded):
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(llama64), _config("llama", init_weights=init_weights, projection_prng_key=3))
    spec = lf.AdapterSpec(
        "frod", TARGETS["llama"], sparse_rate=0.05, projection_prng_key=3, init="identity" if init_weights else "random", dtype=torch.float64
    )
    adapter = lf.init_adapter(llama64, spec, generator=torch.Generator().manual_seed(7))
    peft_params = {bank_oracle.lf_key(n): p for n, p in pm.named_parameters() if "frod_" in n}
    assert sorted(peft_params) == sorted(adapter.params)
    for key, p in peft_params.items():
        assert torch.equal(adapter.params[key], p), key
    tuner = pm.base_model
    for category in ("mlp_down_proj", "self_attn_q_proj", "self_attn_v_proj"):
        for name in ("V", "s_indices", "s_size"):
            assert torch.equal(adapter.buffers[f"<shared>.frod_{name}@{category}"], getattr(tuner, f"frod_{name}")[category]["default"]), (name, category)
    for name, module in pm.named_modules():
        if isinstance(module, peft_frod.FrodLayer):
            assert torch.equal(adapter.buffers[f"{bank_oracle.lf_key(name)}.frod_U"], module.frod_U["default"]), name
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        base, ours = llama64(ids).logits, lf.adapted_call(llama64, adapter, ids).logits
    if init_weights:  # W_eff = W up to float64 round-off (peft's float32 U: ~1e-7)
        assert (ours - base).abs().max() < 1e-12 * base.abs().max()
    else:
        assert (ours - base).abs().max() > 1e-3


def test_dropout_in_a_training_step_equals_peft_s(llama64, tmp_path, peft_unrounded):
    """frod_dropout drops the update's input only (y = W x + b + (W_eff − W) dropout(x)), from
    the global RNG in module order: one seed, peft's logits and gradients."""
    pm = bank_oracle.peft_model(llama64, _config("llama", frod_dropout=0.4), scale=0.3)
    pm.save_pretrained(tmp_path)
    adapter = lf.load_peft(tmp_path, llama64)
    assert adapter.spec.option("dropout") == 0.4
    ids = tokens(2, 9, seed=3)
    model, got = bank_oracle.dropout_step_against_peft(llama64, pm, adapter, ids)
    torch.manual_seed(1)
    other = lf.adapted_call(model, adapter, ids).logits
    assert (other - got).abs().max() > 1e-4, "the dropout mask must come from the RNG"
    with torch.no_grad():
        assert not torch.equal(lf.adapted_call(llama64, adapter, ids).logits, got)  # eval: no dropout


class _Block(nn.Module):
    def __init__(self, d_in: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, 3)


def test_a_category_of_different_widths_is_refused():
    """``blocks.0.proj`` and ``blocks.1.proj`` are one category (``proj``): one ``(d_in, d_in)``
    basis cannot serve inputs 4 and 6 wide (peft's ``torch.cat`` fails there)."""
    model = nn.Module()
    model.blocks = nn.ModuleList([_Block(4), _Block(6)])
    with pytest.raises(ValueError, match=r"category 'proj' have different input widths \[4, 6\]"):
        lf.init_adapter(model, lf.AdapterSpec("frod", ["proj"]), generator=torch.Generator().manual_seed(0))


NAMES = [
    "proj", "blocks.0", "model.layers.3.self_attn.q_proj", "encoder.layer.11.attention.self.query",
    "encoder.layer.0.attention.output.dense", "encoder.layer.0.output.dense", "output.dense", "classifier.dense",
    "vision_model.encoder.layers.0.self_attn.q_proj", "model.layers.x.mlp.up_proj", "h.2.attn.c_attn", "model.layers",
    # the number after "layers" that is not the first number; BERT's attention output one level deeper
    "model.2.layers.5.self_attn.q_proj", "bert.encoder.layer.0.attention.output.dense", "attention.output.dense",
]


def test_categories_and_block_indices_are_peft_s():
    """The grouping of targets into categories and their block order, name by name, as peft's
    ``_category_from_key`` and ``_layer_index_from_key`` (fallback: the target's index)."""
    from peft.tuners.frod.model import _category_from_key, _layer_index_from_key

    from lora_func.variants import frod

    for i, name in enumerate(NAMES):
        assert frod.category(name) == _category_from_key(name), name
        assert frod._block_index(name, i + 7) == _layer_index_from_key(name, i + 7), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_product_node_equals_autograd_s_own_ops(dtype):
    """The one autograd node (U, V frozen: it saves z only) and autograd's own ops (taken where U
    or V require grad, and in a trace) give the same output and gradients of x, λ and the values;
    on a bf16 input both compute in bf16 (peft's dtype), with float64 trainables."""
    from lora_func.variants import frod

    g = torch.Generator().manual_seed(0)
    d_in, d_out, n = 7, 5, 9
    params = {"frod_lambda_l": torch.randn(d_in, generator=g, dtype=torch.float64), "frod_lambda_s_values": torch.randn(n, generator=g, dtype=torch.float64)}
    idx = torch.stack([torch.randint(0, d_in, (n,), generator=g), torch.randint(0, d_in, (n,), generator=g)])
    buffers = {"frod_U": torch.randn(d_out, d_in, generator=g, dtype=torch.float64), "frod_V": torch.randn(d_in, d_in, generator=g, dtype=torch.float64), "frod_s_indices": idx}
    x = torch.randn(2, 3, d_in, generator=g, dtype=torch.float64).to(dtype)
    probe = torch.randn(2, 3, d_out, generator=g, dtype=torch.float64).to(dtype)
    results = []
    for frozen in (True, False):
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        b = {k: v.clone().requires_grad_(not frozen and v.is_floating_point()) for k, v in buffers.items()}
        xx = x.clone().requires_grad_(True)
        y = frod.product(p, b, xx, frod.compute_dtype(xx, torch.float64))
        assert y.dtype == dtype
        grads = torch.autograd.grad((y * probe).sum(), [xx, *p.values()])
        results.append((y, *grads))
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    for got, want in zip(*results, strict=True):
        assert bank_oracle.rel(got.double(), want.double()) < tol
    m = torch.diag(params["frod_lambda_l"]).index_put((idx[0], idx[1]), params["frod_lambda_s_values"], accumulate=True)
    want = x.double() @ (buffers["frod_U"] @ m @ buffers["frod_V"].T).T
    assert bank_oracle.rel(results[0][0].double(), want) < (1e-12 if dtype == torch.float64 else 3e-2)


@pytest.mark.parametrize("sparse_rate", [0.0, 1e-4, 1.0])
def test_the_shared_tensors_at_the_edge_rates_are_peft_s(llama64, sparse_rate):
    """No position at rate 0, one at a rate below one entry, every off-diagonal one at rate 1:
    the categories' V, positions and sizes as peft builds them (shared_init on the targets'
    weights, as init_adapter passes them)."""
    from lora_func._model import target_weights
    from lora_func.targeting import find_targets
    from lora_func.variants import frod

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(llama64), _config("llama", sparse_rate=sparse_rate, projection_prng_key=2))
    spec = lf.AdapterSpec("frod", TARGETS["llama"], sparse_rate=sparse_rate, projection_prng_key=2, dtype=torch.float64)
    targets = find_targets(llama64, spec)
    infos = {t.module: lf.variants.LayerInfo(t.d_in, t.d_out, 8, 1.0, False, spec.options) for t in targets}
    _, shared = frod.shared_init(infos, dtype=torch.float64, device=torch.device("cpu"), generator=torch.Generator(), weights=target_weights(llama64, targets, spec))
    for key, tensor in shared.items():
        name, _, category = key.partition("@")
        assert torch.equal(tensor, getattr(pm.base_model, name)[category]["default"]), key
        assert tensor.dtype == (torch.float64 if name == "frod_V" else torch.int64), key
    widths = {"mlp_down_proj": 48, "self_attn_q_proj": 32, "self_attn_v_proj": 32}
    for category, d in widths.items():
        n = shared[f"frod_s_indices@{category}"].shape[1]
        assert n == {0.0: 0, 1e-4: 1, 1.0: d * d - d}[sparse_rate] == frod.pattern_size(d, sparse_rate)
    assert frod.pattern_size(1, 0.5) == 0  # a 1-wide layer has no off-diagonal entry


def test_a_singular_basis_is_solved_through_its_pseudo_inverse_as_peft(llama64, peft_unrounded):
    """q_proj's weights all zero: the category's V is singular (zero), U and λ come from the
    pseudo-inverse (all zero: U's columns left zero where λ is), as peft's; the other categories
    as usual; the adapter is the identity at init."""
    model = copy.deepcopy(llama64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), _config("llama"))
    adapter = lf.init_adapter(model, lf.AdapterSpec("frod", TARGETS["llama"], sparse_rate=0.05, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    for name, module in pm.named_modules():
        if isinstance(module, peft_frod.FrodLayer):
            key = bank_oracle.lf_key(name)
            assert torch.equal(adapter.buffers[f"{key}.frod_U"], module.frod_U["default"]), name
            assert torch.equal(adapter.params[f"{key}.frod_lambda_l"], module.frod_lambda_l["default"]), name
    q = "model.layers.0.self_attn.q_proj"
    assert not adapter.buffers[f"{q}.frod_U"].any() and not adapter.params[f"{q}.frod_lambda_l"].any()
    assert adapter.buffers["<shared>.frod_V@self_attn_v_proj"].abs().sum() > 0
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        assert bank_oracle.rel(lf.adapted_call(model, adapter, ids).logits, model(ids).logits) < 1e-12


def test_a_non_finite_or_meta_weight_is_refused_naming_its_module(llama64):
    """Every layer of a category reads its V: one NaN weight would make them all NaN, so it is
    refused naming that module (the init-non-finite-weight error), as a meta model is (init-meta-weight)."""
    model = copy.deepcopy(llama64)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    spec = lf.AdapterSpec("frod", TARGETS["llama"], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj: its weight holds 1 non-finite"):
        lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        meta = bank_oracle.model64("llama")
    with pytest.raises(ValueError, match="meta device"):
        lf.init_adapter(meta, spec, generator=torch.Generator().manual_seed(0))


def test_a_category_with_fewer_rows_than_columns_takes_the_svd_as_peft(llama64, peft_unrounded):
    """One block's v_proj (16 x 32) and down_proj (32 x 48): fewer stacked rows than columns, so V
    is the stack's full set of right singular vectors (peft's SVD branch), and the layers' U, λ
    are solved against it; init_adapter gives peft's tensors."""
    regex = r"model\.layers\.0\.(self_attn\.v_proj|mlp\.down_proj)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(llama64), peft.FrodConfig(target_modules=regex, sparse_rate=0.05, progressbar=False))
    adapter = lf.init_adapter(llama64, lf.AdapterSpec("frod", regex, sparse_rate=0.05, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    for category in ("mlp_down_proj", "self_attn_v_proj"):
        v = adapter.buffers[f"<shared>.frod_V@{category}"]
        assert v.shape[0] == v.shape[1] and torch.equal(v, pm.base_model.frod_V[category]["default"]), category
    for name, module in pm.named_modules():
        if isinstance(module, peft_frod.FrodLayer):
            assert torch.equal(adapter.buffers[f"{bank_oracle.lf_key(name)}.frod_U"], module.frod_U["default"]), name


def test_a_layer_built_alone_is_its_own_category(llama64):
    """``init`` without ``shared`` (a layer built alone: one-layer tools and tests) builds the
    layer's own category from its weight: the tensors init_adapter gives the only target of
    its category, the category's ones among the buffers for the forms."""
    from lora_func.variants import frod

    module = "model.layers.1.self_attn.q_proj"
    spec = lf.AdapterSpec("frod", module.replace(".", r"\."), sparse_rate=0.05, projection_prng_key=4, dtype=torch.float64)
    adapter = lf.init_adapter(llama64, spec, generator=torch.Generator().manual_seed(0))
    weight = llama64.get_submodule(module).weight.detach()
    info = adapter.layers[0].info
    params, buffers = frod.init(weight, None, info, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for name, tensor in (params | buffers).items():
        want = adapter.buffers.get(f"<shared>.{name}@self_attn_q_proj", adapter.params.get(f"{module}.{name}", adapter.buffers.get(f"{module}.{name}")))
        assert torch.equal(tensor, want), name
    assert sorted(params | buffers) == ["frod_U", "frod_V", "frod_lambda_l", "frod_lambda_s_values", "frod_s_indices", "frod_s_size"]


def test_a_file_s_singular_basis_and_a_tiny_direction_are_solved_as_peft(llama64, tmp_path):
    """U solved against a file's V as peft's own solver does it (its ``_calculate_frod_u_and_lambda``
    without the float32 rounding): q_proj's V exactly singular (a zero column: the
    pseudo-inverse, rtol 1e-6, with a singular value of 1.5e-6 kept), v_proj's V the identity
    with one input direction of block 0's weight of norm 1.5e-12 (above the 1e-12 below which
    peft leaves U's column zero)."""
    from safetensors.torch import save_file

    model = copy.deepcopy(llama64)
    with torch.no_grad():
        w = model.model.layers[0].self_attn.v_proj.weight
        w[:, 0] = 1.5e-12 * w[:, 0] / w[:, 0].norm()
    pm = bank_oracle.peft_model(model, _config("llama"), scale=0.3)
    pm.save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(path))
    q = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64))[0]
    scales = torch.ones(32, dtype=torch.float64)
    scales[-2], scales[-1] = 1.5e-6, 0.0
    tensors["base_model.frod_V.self_attn_q_proj"] = (q * scales).contiguous()
    tensors["base_model.frod_V.self_attn_v_proj"] = torch.eye(32, dtype=torch.float64)
    save_file(tensors, str(path))
    adapter = lf.load_peft(tmp_path, model)
    for name, module in pm.named_modules():
        if isinstance(module, peft_frod.FrodLayer) and "mlp" not in name:
            category = "self_attn_q_proj" if name.endswith("q_proj") else "self_attn_v_proj"
            u, _ = _unrounded(None, tensors[f"base_model.frod_V.{category}"], module.get_base_layer().weight)
            assert torch.equal(adapter.buffers[f"{bank_oracle.lf_key(name)}.frod_U"], u), name
    u = adapter.buffers["model.layers.0.self_attn.v_proj.frod_U"]
    assert abs(float(u[:, 0].norm()) - 1.0) < 1e-9  # the tiny direction's column: unit, not zero


@pytest.mark.parametrize("trained", ["frod_lambda_l", "frod_lambda_s_values"])
def test_the_product_node_gives_the_gradient_of_one_trained_tensor_alone(trained):
    """λ or the values trained alone (the other frozen, x not requiring grad): the node's gradient
    of it is autograd's own, and is not zero."""
    from lora_func.variants import frod

    g = torch.Generator().manual_seed(1)
    d_in, d_out, n = 6, 4, 5
    idx = torch.stack([torch.randperm(d_in, generator=g)[:n], torch.randperm(d_in, generator=g)[:n]])
    buffers = {"frod_U": torch.randn(d_out, d_in, generator=g, dtype=torch.float64), "frod_V": torch.randn(d_in, d_in, generator=g, dtype=torch.float64), "frod_s_indices": idx}
    base = {"frod_lambda_l": torch.randn(d_in, generator=g, dtype=torch.float64), "frod_lambda_s_values": torch.randn(n, generator=g, dtype=torch.float64)}
    x = torch.randn(3, d_in, generator=g, dtype=torch.float64)
    grads = []
    for frozen in (True, False):
        p = {k: v.clone().requires_grad_(k == trained) for k, v in base.items()}
        b = {k: v.clone().requires_grad_(not frozen and v.is_floating_point()) for k, v in buffers.items()}
        (grad,) = torch.autograd.grad(frod.product(p, b, x, torch.float64).square().sum(), [p[trained]])
        grads.append(grad)
    assert grads[1].abs().max() > 0 and bank_oracle.rel(grads[0], grads[1]) < 1e-12


@pytest.mark.parametrize("unfrozen", ["frod_U", "frod_V"])
def test_a_basis_that_requires_grad_gets_its_gradient(unfrozen):
    """U or V alone requiring grad (a user training the basis): autograd's own ops carry its
    gradient (the node would leave it out): x (U (S + diag λ) Vᵀ)ᵀ differentiated directly."""
    from lora_func.variants import frod

    g = torch.Generator().manual_seed(2)
    d = 4
    params = {"frod_lambda_l": torch.randn(d, generator=g, dtype=torch.float64), "frod_lambda_s_values": torch.randn(2, generator=g, dtype=torch.float64)}
    buffers = {"frod_U": torch.randn(3, d, generator=g, dtype=torch.float64), "frod_V": torch.randn(d, d, generator=g, dtype=torch.float64), "frod_s_indices": torch.tensor([[0, 1], [2, 3]])}
    buffers[unfrozen].requires_grad_(True)
    x = torch.randn(5, d, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad(frod.product(params, buffers, x, torch.float64).square().sum(), [buffers[unfrozen]])
    w = buffers["frod_U"] @ frod.core(params["frod_lambda_l"], params["frod_lambda_s_values"], buffers["frod_s_indices"], torch.float64) @ buffers["frod_V"].T
    (want,) = torch.autograd.grad((x @ w.T).square().sum(), [buffers[unfrozen]])
    assert bank_oracle.rel(got, want) < 1e-12


def test_sparse_rate_is_a_fraction():
    """peft's range: [0, 1] (FrodConfig refuses others); the option's check names it."""
    lf.AdapterSpec("frod", ["q_proj"], sparse_rate=1.0)
    with pytest.raises(ValueError, match="sparse_rate"):
        lf.AdapterSpec("frod", ["q_proj"], sparse_rate=1.5)



def test_init_weights_reads_and_writes_as_peft_s():
    """peft's init_weights=False is init="random", True (and absent) "identity"; written back the same."""
    from lora_func.io._peft_config import config_of
    from tests.variant_checks import read_options

    assert read_options("frod", {"peft_type": "FROD", "init_weights": False})["init"] == "random"
    assert read_options("frod", {"peft_type": "FROD", "init_weights": True})["init"] == read_options("frod", {"peft_type": "FROD"})["init"] == "identity"
    variant, fmt = lf.get_variant("frod"), lf.variants.peft_format("frod")
    assert config_of(variant, fmt, dict(lf.AdapterSpec("frod", ["q_proj"], init="random").options))["init_weights"] is False


@pytest.mark.parametrize("training", [False, True], ids=["eval", "dropout"])
def test_a_wider_adapter_on_a_float32_model_equals_the_float32_adapter(training):
    """A float64 FRoD adapter on a float32 Llama (eval, and a training step with dropout under one
    seed: the mask is drawn on the float32 input either way) gives the float32 adapter's logits
    within float32 round-off, in the model's dtype; the adapter moves the logits far more."""
    from tests.models import tiny_model

    model = tiny_model("llama", dtype=torch.float32).train(training)
    ids, outs = tokens(), {}
    for dtype in (torch.float32, torch.float64):
        spec = lf.AdapterSpec("frod", targets=["q_proj", "v_proj"], dtype=dtype, dropout=0.3, sparse_rate=0.1)
        adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(1)
        adapter = adapter.with_params({k: (v + 0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64).to(dtype)).detach() for k, v in adapter.params.items()})
        torch.manual_seed(3)
        outs[dtype] = lf.adapted_call(model, adapter, ids).logits.detach()
    assert outs[torch.float64].dtype == torch.float32
    scale = outs[torch.float32].abs().max()
    assert (outs[torch.float64] - outs[torch.float32]).abs().max() <= 1e-5 * scale
    torch.manual_seed(3)
    assert (outs[torch.float64] - model(ids).logits.detach()).abs().max() > 0.1 * scale
