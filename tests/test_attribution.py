"""lora_func.attribution (issue 45): features against an explicit autograd loop per example, the
projection's JL bounds and reproducibility, scores against their formulas, traker and the LESS
recipe, EK-FAC influence against an independent float64 implementation of kronfluence's
algorithm (peft's LoRA layers, module hooks, one example at a time), LDS against scipy, the
planted-copy check, streaming to a memory map, and the model left untouched.

kronfluence itself is the oracle of bench/attribution.py (it cannot be a test dependency: its
wheel requires torchvision, whose only wheels for torch 2.13 are CUDA builds that fail to
import against the CPU torch, and transformers then fails to import; docs/attribution.md).
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

import lora_func as lf
from lora_func import attribution as at
from lora_func.attribution import _projection, scoring
from tests.bank_oracle import model64
from tests.contract_helpers import assert_unchanged, snapshot
from tests.models import tiny_model, tokens

REL64 = 1e-10


def randomized(adapter: lf.Adapter, seed: int, scale: float = 0.3) -> lf.Adapter:
    """The adapter with random non-symmetric values in every trainable tensor (B != 0)."""
    g = torch.Generator().manual_seed(seed)
    return adapter.with_params({k: (scale * torch.randn(v.shape, generator=g, dtype=torch.float64)).to(v.dtype) for k, v in adapter.params.items()})


def token_loss(model):
    """Mean next-token cross-entropy of one example (a batch of one)."""

    def loss_fn(adapter, ids):
        logits = lf.adapted_call(model, adapter, ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return loss_fn


def loop_features(loss_fn, adapter, *batch) -> torch.Tensor:
    """The oracle: one autograd call per example, gradients concatenated in adapter.params order."""
    rows = []
    for i in range(batch[0].shape[0]):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        loss = loss_fn(adapter.with_params(params), *(t[i : i + 1] for t in batch))
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params.values(), grads, strict=True)]))
    return torch.stack(rows)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


# ----------------------------------------------------------------------------- features


def _lora(model):
    return lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(0))


def _dora_gpt2(model):
    return lf.init_adapter(model, lf.AdapterSpec("dora", targets=["c_attn"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(0))


def _loha(model):
    return lf.init_adapter(model, lf.AdapterSpec("loha", targets=["q_proj", "v_proj"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(0))


def _composed(model):
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    oft = lf.init_adapter(model, lf.AdapterSpec("oft", targets=["q_proj", "v_proj"], r=4, dtype=torch.float64), generator=torch.Generator().manual_seed(1))
    return lf.compose(lora, oft)


CASES = {"lora-llama": ("llama", _lora), "dora-gpt2-conv1d": ("gpt2", _dora_gpt2), "loha-llama": ("llama", _loha), "compose-lora-oft": ("llama", _composed)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_features_equal_an_explicit_autograd_loop_in_float64(case):
    kind, make = CASES[case]
    model = model64(kind)
    adapter = randomized(make(model), 1)
    loss_fn = token_loss(model)
    ids = tokens(5, 7, seed=2)
    before = snapshot(model)
    got = at.features(loss_fn, adapter, ids)
    want = loop_features(loss_fn, adapter, ids)
    assert got.shape == (5, at.feature_dim(adapter)) == want.shape and got.dtype == torch.float64
    assert at.feature_dim(adapter) == sum(v.numel() for v in adapter.params.values())
    assert rel(got, want) <= REL64, rel(got, want)
    # Every tensor's block is in the row (a tensor left out or out of order would misplace one).
    offset = 0
    for key, value in adapter.params.items():
        block = got[:, offset : offset + value.numel()]
        assert block.abs().max() > 0, f"{case}: {key} has no gradient"
        offset += value.numel()
    assert_unchanged(model, before)


def test_features_on_a_bitsandbytes_4bit_base_equal_a_loop():
    from tests.quantized_models import quantized_llama

    model = quantized_llama("bnb-nf4")
    model.set_attn_implementation("eager")  # vmap over the examples
    adapter = randomized(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0)), 4, 0.1)
    loss_fn = token_loss(model)
    ids = tokens(4, 6, seed=5)
    got = at.features(loss_fn, adapter, ids)
    want = loop_features(loss_fn, adapter, ids)
    assert rel(got, want) <= 1e-5, rel(got, want)
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Params4bit"


def test_a_stack_gives_each_members_features_and_the_preconditioner_is_less_recipe():
    """A stack (K,) gives (K, B, D), member k's rows those of member k alone; the Adam
    preconditioner from a trained AdamW (and the same moments as a dict) equals LESS's
    ``obtain_gradients_with_adam`` computed by hand, example by example."""
    model = model64("llama")
    loss_fn = token_loss(model)
    members = [randomized(_lora(model), seed) for seed in (1, 2)]
    ids = tokens(4, 6, seed=3)

    def stack_loss(adapter, ids):
        logits = lf.ensemble_call(model, adapter, ids).logits
        return sum(F.cross_entropy(logits[k, :, :-1].flatten(0, 1), ids[:, 1:].flatten()) for k in range(logits.shape[0]))

    stacked = at.features(stack_loss, lf.stack(members), ids)
    assert stacked.shape == (2, 4, at.feature_dim(members[0]))
    for k, member in enumerate(members):
        assert rel(stacked[k], at.features(loss_fn, member, ids)) <= REL64

    # A few AdamW steps on member 0: its optimizer state is LESS's warm-up state.
    trained = members[0].detach()
    optimizer = torch.optim.AdamW(trained.params.values(), lr=1e-2, betas=(0.8, 0.95), eps=1e-6)
    for step in range(3):
        optimizer.zero_grad()
        loss_fn(trained, tokens(2, 6, seed=10 + step)).backward()
        optimizer.step()
    got = at.features(loss_fn, trained, ids, preconditioner=optimizer)
    raw = loop_features(loss_fn, trained, ids)
    m = torch.cat([optimizer.state[p]["exp_avg"].flatten() for p in trained.params.values()])
    v = torch.cat([optimizer.state[p]["exp_avg_sq"].flatten() for p in trained.params.values()])
    beta1, beta2, eps = 0.8, 0.95, 1e-6
    want = (beta1 * m + (1 - beta1) * raw) / torch.sqrt(beta2 * v + (1 - beta2) * raw**2 + eps)  # LESS's code, eps under the root
    assert rel(got, want) <= REL64, rel(got, want)
    moments = {k: {"exp_avg": optimizer.state[p]["exp_avg"], "exp_avg_sq": optimizer.state[p]["exp_avg_sq"]} for k, p in trained.params.items()}
    as_dict = at.features(loss_fn, trained, ids, preconditioner=at.adam_preconditioner(moments, trained, betas=(beta1, beta2), eps=eps))
    assert torch.equal(as_dict, got)
    # LESS's scores: its normalize-then-matmul of the Adam train features and plain test features.
    test = loop_features(loss_fn, trained, ids[:2])
    less = F.normalize(want, dim=1) @ F.normalize(test, dim=1).T  # LESS's calculate_influence_score, (n_train, n_test)
    assert rel(at.scores(got, at.features(loss_fn, trained, ids[:2]), method="less"), less.T) <= REL64


# ----------------------------------------------------------------------------- the projection


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 2**12 values: the test sizes span many blocks."""
    monkeypatch.setattr(_projection, "BLOCK_ELEMENTS", 1 << 12)


def _raw_and_model():
    model = model64("llama")
    adapter = randomized(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=8, dtype=torch.float64), generator=torch.Generator().manual_seed(0)), 1)
    return model, adapter, token_loss(model), tokens(8, 7, seed=2)


def test_projection_is_the_exact_gradients_times_one_seeded_sign_matrix_built_block_by_block(small_blocks):
    _, adapter, loss_fn, ids = _raw_and_model()
    k = 64
    raw = at.features(loss_fn, adapter, ids)
    dim = raw.shape[1]
    projected = at.features(loss_fn, adapter, ids, proj_dim=k, generator=torch.Generator().manual_seed(7))
    # The matrix, reassembled from its blocks (the same seed: one draw from the generator).
    seed = int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(7)))
    projection = _projection.Projection(seed, dim, k)
    rows = _projection.block_rows(k)
    blocks = [projection.block(j, torch.device("cpu"), torch.float64) for j in range(-(-dim // rows))]
    assert dim == 1792 and rows == 64 and len(blocks) == 28  # q and v (GQA: v is 16 wide) over 28 blocks
    matrix = torch.cat(blocks)
    assert matrix.shape == (dim, k) and set(matrix.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(matrix.mean())) < 0.02  # balanced signs
    assert len({repr(block[0].tolist()) for block in blocks}) == 28  # every block its own draw
    assert rel(projected, raw @ matrix / k**0.5) <= 1e-12


def test_the_whole_matrix_is_never_held(small_blocks):
    """No tensor of D x k values (or more) is made while projecting (the raw rows are D wide)."""
    _, adapter, loss_fn, ids = _raw_and_model()
    k = 256
    dim = at.feature_dim(adapter)

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel())
            return out

    with Largest():
        at.features(loss_fn, adapter, ids, proj_dim=k, generator=torch.Generator().manual_seed(0))
    assert dim == 1792
    assert Largest.largest < dim * k / 8, Largest.largest


def test_projected_norms_and_inner_products_stay_within_jl_bounds():
    _, adapter, loss_fn, ids = _raw_and_model()
    raw = at.features(loss_fn, adapter, ids)
    k = 512
    projected = at.features(loss_fn, adapter, ids, proj_dim=k, generator=torch.Generator().manual_seed(3))
    norms = raw.norm(dim=1)
    # Each deviation has std sqrt(2/k) = 0.063 (norms) and <= sqrt(2/k) of |x||y| (inner
    # products); 0.35 is 5.6 of those. A wrong scale, a block left out or a block repeated fails.
    assert ((projected.norm(dim=1) ** 2 / norms**2) - 1).abs().max() < 0.35
    gram, projected_gram = raw @ raw.T, projected @ projected.T
    assert ((projected_gram - gram).abs() / torch.outer(norms, norms)).max() < 0.35
    # And the distortion shrinks as k grows (it is a projection, not noise of a fixed size).
    wide = at.features(loss_fn, adapter, ids, proj_dim=8 * k, generator=torch.Generator().manual_seed(3))
    assert ((wide @ wide.T - gram).abs() / torch.outer(norms, norms)).max() < ((projected_gram - gram).abs() / torch.outer(norms, norms)).max()


def test_the_same_generator_reproduces_the_features_bit_for_bit():
    model = tiny_model("llama")
    adapter = randomized(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4), generator=torch.Generator().manual_seed(0)), 1)
    loss_fn, ids = token_loss(model), tokens(6, 7, seed=2)

    def run(seed, **kwargs):
        return at.features(loss_fn, adapter, ids, proj_dim=96, generator=torch.Generator().manual_seed(seed), **kwargs)

    first = run(0)
    assert torch.equal(first, run(0))
    assert torch.equal(first, run(0, chunk_size=4))  # the matrix does not depend on the chunks
    assert not torch.equal(first, run(1))
    generator = torch.Generator().manual_seed(0)
    at.features(loss_fn, adapter, ids, proj_dim=96, generator=generator)
    assert not torch.equal(first, at.features(loss_fn, adapter, ids, proj_dim=96, generator=generator))  # one draw was used
    assert torch.equal(first[2:], at.features(loss_fn, adapter, ids[2:], proj_dim=96, generator=torch.Generator().manual_seed(0)))


# ----------------------------------------------------------------------------- scores


def _random_features(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_scores_equal_their_formulas_with_ensembles_weights_and_memory_maps(tmp_path, monkeypatch):
    train, test = _random_features(0, 3, 20, 6), _random_features(1, 3, 4, 6)
    for c in range(3):
        x, t = train[c], test[c]
        cos = (t / t.norm(dim=1, keepdim=True)) @ (x / x.norm(dim=1, keepdim=True)).T
        trak = t @ torch.linalg.solve(x.T @ x + 0.5 * torch.eye(6, dtype=torch.float64), x.T)
        assert rel(at.scores(x, t), t @ x.T) <= 1e-12
        assert rel(at.scores(x, t, method="less"), cos) <= 1e-12
        assert rel(at.scores(x, t, method="trak", damping=0.5), trak) <= 1e-8
        assert rel(at.scores(x, t, method="trak"), t @ torch.linalg.solve(x.T @ x, x.T)) <= 1e-8
    # Ensembles: the mean of the members' scores, or their weighted sum.
    members = [at.scores(train[c], test[c], method="trak", damping=0.5) for c in range(3)]
    assert rel(at.scores(train, test, method="trak", damping=0.5), sum(members) / 3) <= 1e-12
    assert rel(at.scores(list(train), list(test), method="trak", damping=0.5, weights=[0.5, 2.0, -1.0]), 0.5 * members[0] + 2 * members[1] - members[2]) <= 1e-12
    # A memory map read in blocks of 7 rows gives the same scores.
    monkeypatch.setattr(scoring, "BLOCK_VALUES", 7 * 6)
    np.save(tmp_path / "train.npy", train.numpy())
    mapped = np.load(tmp_path / "train.npy", mmap_mode="r")
    for method, damping in (("tracin", 0.0), ("less", 0.0), ("trak", 0.5)):
        assert rel(at.scores(mapped, test, method=method, damping=damping), at.scores(train, test, method=method, damping=damping)) <= 1e-12
    assert at.scores(train.float(), test.float()).dtype == torch.float32


def test_trak_scores_equal_trakers_on_the_same_model_features_and_loss(tmp_path):
    """traker 0.3.2 with its no-op projector on the adapter (as a module whose parameters are the
    adapter's tensors), two checkpoints, lambda_reg: equal to ours after its one documented
    difference, a positive rescaling of each checkpoint's (XᵀX)⁻¹ by its mean absolute entry."""
    from trak import TRAKer
    from trak.modelout_functions import AbstractModelOutput
    from trak.projectors import NoOpProjector

    model = tiny_model("llama")
    spec = lf.AdapterSpec("lora", targets=["q_proj"], r=1)
    members = [randomized(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0)), seed) for seed in (1, 2)]
    train_ids, test_ids = tokens(40, 6, seed=3), tokens(5, 6, seed=4)
    module = lf.as_module(model, members[0].detach())  # its own copy: traker loads checkpoints into it
    names = [name for name, _ in module.named_parameters()]

    class Loss(AbstractModelOutput):
        def __init__(self) -> None:
            pass

        def get_output(self, m, weights, buffers, ids):
            logits = functional_call(m, (weights, buffers), (ids.unsqueeze(0),)).logits
            return F.cross_entropy(logits[0, :-1], ids[1:])

        def get_out_to_loss_grad(self, m, weights, buffers, batch):
            return torch.ones(batch[0].shape[0], 1)  # Q = 1: compare the kernel part

    lam = 1e-2
    traker = TRAKer(model=module, task=Loss(), train_set_size=40, save_dir=str(tmp_path), device="cpu", projector=NoOpProjector(device="cpu"),
                    use_half_precision=False, lambda_reg=lam, logging_level=logging.ERROR)
    for k, member in enumerate(members):
        traker.load_checkpoint({name: member.params[key].detach() for name, key in zip(names, member.params, strict=True)}, model_id=k)
        traker.featurize((train_ids,), num_samples=40)
    traker.finalize_features()
    for k, member in enumerate(members):
        traker.start_scoring_checkpoint("q", {name: member.params[key].detach() for name, key in zip(names, member.params, strict=True)}, model_id=k, num_targets=5)
        traker.score((test_ids,), num_samples=5)
    theirs = torch.from_numpy(np.array(traker.finalize_scores("q"))).T.double()

    loss_fn = token_loss(model)
    dim = at.feature_dim(members[0])
    parts = []
    for member in members:
        train, test = at.features(loss_fn, member, train_ids).double(), at.features(loss_fn, member, test_ids).double()
        # traker: X/sqrt(D), ridge lam on (XᵀX/D), (.)^-1 divided by its mean |entry|.
        scale = torch.linalg.inv(train.T @ train / dim + lam * torch.eye(dim, dtype=torch.float64)).abs().mean()
        parts.append(at.scores(train, test, method="trak", damping=lam * dim) / scale)
    assert rel(theirs, sum(parts) / 2) <= 2e-5, rel(theirs, sum(parts) / 2)  # traker inverts in float32


# ----------------------------------------------------------------------------- EK-FAC


def _peft_lora(model, r: int, alpha: float, targets, params):
    """A float64 peft LoRA on a copy of ``model`` holding ``params`` (adapter keys without part prefixes)."""
    import peft

    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))
    with torch.no_grad():
        for name, module in pm.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                key = name.removeprefix("base_model.model.")
                module.lora_A["default"].weight.copy_(params[f"{key}.lora_A"])
                module.lora_B["default"].weight.copy_(params[f"{key}.lora_B"])
    return pm.double().eval()


def ekfac_oracle(pm, train_ids, train_mask, test_ids, test_mask, damping):
    """kronfluence's EK-FAC pairwise scores (empirical Fisher, token mask) written out: peft's
    lora_A / lora_B Linear modules, their inputs and output gradients captured by module hooks,
    one example at a time, every statistic a plain float64 sum."""
    modules = {name: m for name, m in pm.named_modules() if isinstance(m, torch.nn.Linear) and name.rsplit(".", 2)[-2] in ("lora_A", "lora_B")}
    captured = {}

    def hook(name):
        def forward(module, inputs, output):
            captured[name] = [inputs[0].detach()[0], None]
            output.register_hook(lambda g: captured[name].__setitem__(1, g.detach()[0]))

        return forward

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]

    def per_example(ids, mask):
        out = []
        for i in range(ids.shape[0]):
            captured.clear()
            pm.zero_grad()
            logits = pm(ids[i : i + 1], attention_mask=mask[i : i + 1]).logits
            labels = ids[i : i + 1, 1:].masked_fill(mask[i : i + 1, 1:] == 0, -100)
            F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten()).backward()
            out.append({n: (a, g, mask[i].double()) for n, (a, g) in captured.items()})
        return out

    try:
        train = per_example(train_ids, train_mask)
        test = per_example(test_ids, test_mask)
    finally:
        for handle in handles:
            handle.remove()
    total = torch.zeros(test_ids.shape[0], train_ids.shape[0], dtype=torch.float64)
    for name in modules:
        act = sum(((a * m[:, None]).T @ (a * m[:, None]) for a, _, m in (e[name] for e in train)))
        grad = sum((g.T @ g for _, g, _ in (e[name] for e in train)))
        count = sum(float(m.sum()) for _, _, m in (e[name] for e in train))
        _, q_a = torch.linalg.eigh(act / count)
        _, q_s = torch.linalg.eigh(grad / count)

        def weight_grad(entry, name=name):
            a, g, _ = entry[name]
            return g.T @ a  # (out, in)

        lambdas = sum((q_s.T @ weight_grad(e) @ q_a) ** 2 for e in train) / len(train)
        for j, e in enumerate(test):
            pre = q_s @ ((q_s.T @ weight_grad(e) @ q_a) / (lambdas + damping)) @ q_a.T
            for i, t in enumerate(train):
                total[j, i] += (pre * weight_grad(t)).sum()
    return total


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` in get_peft_model.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_ekfac_influence_equals_kronfluences_algorithm_on_peft_layers_in_float64():
    model = model64("llama")
    spec = lambda target, seed: lf.init_adapter(model, lf.AdapterSpec("lora", targets=[target], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(seed))  # noqa: E731
    adapter = randomized(lf.compose(spec("q_proj", 0), spec("v_proj", 1)), 3)  # a composition: two LoRAs on two layers
    train_ids, test_ids = tokens(7, 8, seed=3), tokens(3, 8, seed=4)
    train_mask, test_mask = torch.ones_like(train_ids), torch.ones_like(test_ids)
    # Right padding (left padding makes this float64 Llama's fully masked rows NaN, in transformers).
    train_mask[1, -3:] = 0
    train_mask[4, -2:] = 0
    test_mask[0, -1:] = 0

    def loss_fn(a, ids, mask):
        logits = lf.adapted_call(model, a, ids, attention_mask=mask).logits
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())

    before = snapshot(model)
    curvature = at.ekfac(loss_fn, adapter, [(train_ids[:4], train_mask[:4]), (train_ids[4:], train_mask[4:])], token_mask=lambda ids, mask: mask)
    train = at.features(loss_fn, adapter, train_ids, train_mask)
    test = at.features(loss_fn, adapter, test_ids, test_mask)
    got = at.influence(curvature, train, test, damping=1e-3)
    assert_unchanged(model, before)
    assert [f.shape for f in curvature.factors[:2]] == [(2, 32), (32, 2)] and curvature.factors[0].tokens == 56 - 5

    # The composition's two parts are one peft LoRA on q and v.
    pm = _peft_lora(model, 2, 8.0, ["q_proj", "v_proj"], {key.split("/", 1)[1]: value for key, value in adapter.params.items()})
    want = ekfac_oracle(pm, train_ids, train_mask, test_ids, test_mask, 1e-3)
    assert rel(got, want) <= REL64, rel(got, want)
    # kronfluence's heuristic damping (None: 0.1 * mean(Λ) per layer) is another number.
    assert rel(at.influence(curvature, train, test, damping=None), got) > 1e-3


def test_ekfac_refuses_what_it_cannot_see():
    model = tiny_model("llama")
    dora = lf.init_adapter(model, lf.AdapterSpec("dora", targets=["q_proj"], r=2))
    with pytest.raises(ValueError, match=r"EK-FAC needs every trainable tensor.*q_proj \(dora"):
        at.ekfac(token_loss(model), dora, [(tokens(2, 5),)])
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    with pytest.raises(ValueError, match="merged weight"):
        at.ekfac(lambda a, ids: lf.adapted_call(model, a, ids, merged=True).logits.sum(), lora, [(tokens(2, 5),)])
    one_shot = iter([(tokens(2, 5),)])
    with pytest.raises(ValueError, match="2 examples on the first pass and 0 on the second"):
        at.ekfac(token_loss(model), lora, one_shot)


# ----------------------------------------------------------------------------- planted copies, LDS, files


@pytest.mark.parametrize("proj_dim", [None, 256])
def test_planted_copies_find_their_training_example_first(proj_dim):
    model = tiny_model("llama")
    adapter = randomized(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4), generator=torch.Generator().manual_seed(0)), 1, 0.1)
    loss_fn = token_loss(model)
    train_ids = tokens(16, 8, seed=11)
    copies = torch.tensor([3, 7, 11, 14])
    test_ids = train_ids[copies]
    g = torch.Generator().manual_seed(5)
    train = at.features(loss_fn, adapter, train_ids, proj_dim=proj_dim, generator=g)
    g = torch.Generator().manual_seed(5)
    test = at.features(loss_fn, adapter, test_ids, proj_dim=proj_dim, generator=g)
    found = {
        "tracin": at.scores(train, test),
        "less": at.scores(train, test, method="less"),
        "trak": at.scores(train, test, method="trak", damping=1e-3 * float(train.square().sum(1).mean())),
    }
    if proj_dim is None:
        curvature = at.ekfac(loss_fn, adapter, [(train_ids,)])
        found["ekfac"] = at.influence(curvature, train, test, damping=None)
    for method, s in found.items():
        assert torch.equal(s.argmax(1), copies), (method, s.argmax(1))


def test_lds_is_spearmans_rank_correlation_per_test_example():
    from scipy.stats import spearmanr

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 12, generator=g, dtype=torch.float64)
    subsets = torch.rand(9, 12, generator=g) < 0.5
    margins = torch.randn(9, 5, generator=g, dtype=torch.float64).round(decimals=1)  # ties among the margins
    got = at.lds(scores, subsets, margins)
    predicted = subsets.double() @ scores.T
    want = torch.tensor([spearmanr(predicted[:, j], margins[:, j]).statistic for j in range(5)], dtype=torch.float64)
    assert rel(got, want) <= 1e-12
    assert torch.allclose(at.lds(scores, subsets, predicted), torch.ones(5, dtype=torch.float64))  # a perfect attribution
    assert torch.allclose(at.lds(scores, subsets, -predicted), -torch.ones(5, dtype=torch.float64))


def test_write_features_streams_a_dataloader_to_a_memory_map(tmp_path):
    model = model64("llama")
    adapter = randomized(_lora(model), 1)
    loss_fn = token_loss(model)
    ids = tokens(10, 6, seed=4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    path = tmp_path / "train.npy"
    mapped = at.write_features(path, loss_fn, adapter, loader, proj_dim=32, generator=torch.Generator().manual_seed(0))
    assert isinstance(mapped, np.memmap) and mapped.shape == (10, 32) and mapped.dtype == np.float64
    whole = at.features(loss_fn, adapter, ids, proj_dim=32, generator=torch.Generator().manual_seed(0))
    assert rel(torch.from_numpy(np.array(mapped)), whole) <= 1e-12
    assert np.array_equal(np.load(path), np.array(mapped))
    # A stack: (K, N, D) as a view of the example-major file.
    members = [adapter, randomized(adapter, 2)]

    def stack_loss(a, ids):
        logits = lf.ensemble_call(model, a, ids).logits
        return sum(F.cross_entropy(logits[k, :, :-1].flatten(0, 1), ids[:, 1:].flatten()) for k in range(2))

    stacked = at.write_features(tmp_path / "stack.npy", stack_loss, lf.stack(members), [(ids[:6],), (ids[6:],)])
    assert stacked.shape == (2, 10, at.feature_dim(adapter))
    assert rel(torch.from_numpy(np.array(stacked[1])), at.features(loss_fn, members[1], ids)) <= 1e-12
    # A failure midway leaves the existing file as it was and no partial file.
    before = path.read_bytes()

    def batches():
        yield (ids[:4],)
        raise RuntimeError("the data loader failed")

    with pytest.raises(RuntimeError, match="data loader failed"):
        at.write_features(path, loss_fn, adapter, batches())
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["stack.npy", "train.npy"]
