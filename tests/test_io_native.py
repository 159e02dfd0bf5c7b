"""lora_func's own format beyond the contract suite's full round trip (tests/test_contract.py):
trainable-only files whose buffers are rebuilt from the model (bit-exact, or refused naming the
layer), composed / combined / rank-padded stacked adapters, corrupted and edited files, and
atomic writes."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.func import vmap

import lora_func as lf
from lora_func.io import native
from lora_func.variants.antipasto import with_steering
from tests.contract_helpers import assert_unchanged, build, logits, perturbed, snapshot
from tests.models import LAYER_KIND_MODEL, tiny_model, tokens
from tests.variant_table import ROWS

KINDS = ("linear", "conv1d")
CASES = [pytest.param(ROWS[v], kind, id=f"{v}-{kind}") for v in sorted(ROWS) for kind in KINDS]


def stored_names(path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return sorted(f.keys())


def assert_same_adapter(a, b, *, leaves: bool = True) -> None:
    """Same structure, static info and tensors (bit for bit, same dtype), part by part; with
    ``leaves``, ``b``'s params are leaf tensors that require grad as ``a``'s do."""
    assert type(a) is type(b)
    if isinstance(a, lf.Adapter):
        assert a.spec == b.spec and a.layers == b.layers and a.members == b.members
    else:
        assert len(a.parts) == len(b.parts)
        for pa, pb in zip(a.parts, b.parts, strict=True):
            assert_same_adapter(pa, pb, leaves=leaves)
    for flat_a, flat_b in ((a.params, b.params), (a.buffers, b.buffers)):
        assert sorted(flat_a) == sorted(flat_b)
        for key in flat_a:
            assert flat_b[key].dtype == flat_a[key].dtype and torch.equal(flat_b[key], flat_a[key].detach()), key
    for key, value in b.params.items() if leaves else ():
        assert value.is_leaf and value.requires_grad == a.params[key].requires_grad, key


def assert_same_outputs(model_a, a, model_b, b, ids) -> None:
    from lora_func.adapter import leaf_adapters

    # (a variant without a merged weight: the lazy path only)
    for merged in (False, True)[: 1 + all(leaf.variant.merges for leaf in leaf_adapters(a))]:
        before = lf.adapted_call(model_a, a, ids, merged=merged).logits
        after = lf.adapted_call(model_b, b, ids, merged=merged).logits
        assert torch.equal(before, after), f"merged={merged}"
        assert not torch.equal(after, model_b(ids).logits)


# ------------------------------------------------------------------------------ trainable only


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_trainable_only_rebuilds_the_buffers_bit_exactly(row, kind, tmp_path):
    model, adapter = build(row, kind)
    adapter = perturbed(adapter, row.perturb_scale)
    full = lf.save(adapter, tmp_path / "full.safetensors")
    small = lf.save(adapter, tmp_path / "small.safetensors", trainable_only=True)
    assert stored_names(small) == sorted(f"params/{k}" for k in adapter.params)
    if sum(b.numel() * b.element_size() for b in adapter.buffers.values()) > 256:  # (a tiny buffer weighs less than its digest)
        assert small.stat().st_size < full.stat().st_size
    fresh = tiny_model(LAYER_KIND_MODEL[kind])
    if row.calibration and adapter.buffers:  # corda: its residual depends on the calibration data, not in the file
        with pytest.raises(ValueError, match="calibration"):
            lf.load(small, model=fresh)
        return
    loaded = lf.load(small, model=fresh)
    assert_same_adapter(adapter, loaded)
    assert_same_outputs(model, adapter, fresh, loaded, tokens())


def test_trainable_only_needs_the_model_only_when_there_are_buffers(tmp_path):
    model = tiny_model("llama")
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    assert_same_adapter(lora, lf.load(lf.save(lora, tmp_path / "lora.safetensors", trainable_only=True)))
    delora = lf.init_adapter(model, lf.AdapterSpec("delora", targets=["q_proj"], r=2))
    path = lf.save(delora, tmp_path / "delora.safetensors", trainable_only=True)
    with pytest.raises(ValueError, match=r"only the trainable tensors .*pass model=.*\['model.layers.0.self_attn.q_proj'"):
        lf.load(path)


@pytest.mark.parametrize(
    ("variant", "options", "change"),
    [
        ("delora", {}, "other-base"),  # column norms differ; DeLoRA records no fingerprint
        ("antipasto", {}, "steered"),  # a buffer changed after init
        ("pissa", {"niter": 2}, None),  # randomized SVD: the draw is not in the file
    ],
    ids=["delora-other-base", "antipasto-steered", "pissa-randomized"],
)
def test_trainable_only_refuses_buffers_it_cannot_rebuild(variant, options, change, tmp_path):
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=["q_proj"], r=2, **options), generator=torch.Generator().manual_seed(5))
    if change == "steered":
        adapter = adapter.with_buffers(with_steering(adapter.buffers, 0.5))
    path = lf.save(adapter, tmp_path / "a.safetensors", trainable_only=True)
    target = tiny_model("llama", seed=1) if change == "other-base" else model
    snap = snapshot(target)
    with pytest.raises(ValueError, match=rf"buffers of layer model.layers.0.self_attn.q_proj \({variant}\) .* differ .*trainable_only=False"):
        lf.load(path, model=target)
    assert_unchanged(target, snap)
    lf.load(lf.save(adapter, tmp_path / "full.safetensors"), model=model)  # the full file is fine


# ------------------------------------------------------------------ composed, combined, stacked


def test_composed_and_combined_round_trip(tmp_path):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)

    def make(variant, targets, **kwargs):
        return perturbed(lf.init_adapter(model, lf.AdapterSpec(variant, targets=targets, r=2, **kwargs), generator=g), 0.2, seed=len(targets))

    mix = lf.combine([make("lora", ["q_proj", "v_proj"]), make("ia3", ["v_proj"])], torch.tensor([0.7, -0.4], requires_grad=True))
    adapter = lf.compose(make("pissa", ["q_proj"]), mix, make("dora", ["k_proj", "q_proj", "o_proj"]))
    ids = tokens()
    for trainable_only in (False, True):
        path = lf.save(adapter, tmp_path / f"c{trainable_only}.safetensors", trainable_only=trainable_only)
        fresh = tiny_model("llama")
        loaded = lf.load(path, model=fresh)
        assert_same_adapter(adapter, loaded)
        assert loaded.parts[1].weights.requires_grad
        assert_same_outputs(model, adapter, fresh, loaded, ids)
    fixed = lf.combine([make("lora", ["q_proj"]), make("lora", ["q_proj"])], [0.5, 0.5])
    assert not lf.load(lf.save(fixed, tmp_path / "fixed.safetensors")).weights.requires_grad


def test_rank_padded_stack_round_trip(tmp_path):
    model = tiny_model("gpt2")
    members = [
        perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["c_attn"], r=r), generator=torch.Generator().manual_seed(r)), 0.1, seed=r)
        for r in (2, 4)
    ]
    stacked = lf.stack(members)
    loaded = lf.load(lf.save(stacked, tmp_path / "s.safetensors"), model=model)
    assert_same_adapter(stacked, loaded)
    for original, back in zip(members, lf.unstack(loaded), strict=True):
        assert_same_adapter(original, back, leaves=False)
    base, ids = lf.base_params(model), tokens()
    run = lambda a: logits(model, lf.overlay(base, a), ids)  # noqa: E731
    assert torch.equal(vmap(run)(loaded), vmap(run)(stacked))
    with pytest.raises(ValueError, match=r"stacked adapter \(stack_shape \(2,\)\).*unstack"):
        lf.save(stacked, tmp_path / "t.safetensors", trainable_only=True)
    assert not (tmp_path / "t.safetensors").exists()


# --------------------------------------------------------------------- damaged files, atomicity


@pytest.fixture
def saved(tmp_path):
    model = tiny_model("llama")
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("pissa", targets=["q_proj"], r=2)), 0.1)
    return model, adapter, lf.save(adapter, tmp_path / "a.safetensors")


def _rewrite(path, *, metadata=None, drop=None):
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = {k: v for k, v in load_file(str(path)).items() if drop is None or drop not in k}
    out = path.with_name("edited.safetensors")
    save_file(tensors, str(out), metadata=meta | (metadata or {}))
    return out


def test_corrupted_edited_and_misplaced_files_are_refused_clearly(saved, tmp_path):
    model, adapter, path = saved
    snap = snapshot(model)
    flipped = tmp_path / "flipped.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # one bit of one tensor value: safetensors itself would not notice
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"flipped.safetensors is corrupted: its tensors or metadata do not match the checksum"):
        lf.load(flipped, model=model)
    with pytest.raises(ValueError, match=r"damaged lora_func metadata \(JSONDecodeError"):
        lf.load(_rewrite(path, metadata={"tree": "{"}))
    tree = json.loads(load_meta(path)["tree"])
    del tree["layers"][0]["info"]["r"]
    with pytest.raises(ValueError, match=r"damaged lora_func metadata \(TypeError"):
        lf.load(_rewrite(path, metadata={"tree": json.dumps(tree)}))
    with pytest.raises(ValueError, match=r"inconsistent: missing tensors \['buffers/model.layers.1.self_attn.q_proj.W_res'\]"):
        lf.load(_rewrite(path, drop="layers.1.self_attn.q_proj.W_res"))
    with pytest.raises(ValueError, match=r"a.safetensors does not fit GPT2LMHeadModel: \['model.layers.0.self_attn.q_proj.weight: not in the model'"):
        lf.load(path, model=tiny_model("gpt2"))
    with pytest.raises(ValueError, match=r"does not fit LlamaForCausalLM: .*derived from different base weights"):
        lf.load(path, model=tiny_model("llama", seed=1))
    with pytest.raises(ValueError, match=r"format_version '99'; this lora_func reads \['1', '2'\]: load it with"):
        lf.load(_rewrite(path, metadata={"format_version": "99"}))
    with pytest.raises(TypeError, match=r"save\(\) expects an Adapter, Composed or Combined, got dict"):
        lf.save(adapter.params, tmp_path / "x.safetensors")
    assert_unchanged(model, snap)
    assert_same_adapter(adapter, lf.load(path, model=model))


def test_saving_one_adapter_again_gives_the_same_bytes(saved, tmp_path):
    """The header is canonical (metadata keys sorted): safetensors alone writes the metadata in
    a random order on every save, so a file's bytes (and any hash of it, and which field a
    given byte offset falls in) would change from save to save."""
    _model, adapter, path = saved
    again = [lf.save(adapter, tmp_path / f"again{i}.safetensors").read_bytes() for i in range(5)]
    assert all(data == path.read_bytes() for data in again)
    length = int.from_bytes(again[0][:8], "little")
    metadata = json.loads(again[0][8 : 8 + length])["__metadata__"]
    assert list(metadata) == sorted(metadata)


def _version_1_digest(tensors) -> str:
    """How lora_func format_version "1" computed a file's digest: the tensors only."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        data = tensors[name].contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def test_a_version_1_file_still_loads_and_its_tensors_are_still_checked(saved, tmp_path):
    model, adapter, path = saved
    tensors = load_file(str(path))
    old = _rewrite(path, metadata={"format_version": "1", "digest": _version_1_digest(tensors)})
    assert_same_adapter(adapter, lf.load(old, model=model))
    flipped = tmp_path / "flipped.safetensors"
    data = bytearray(old.read_bytes())
    data[-3] ^= 0x10
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="flipped.safetensors is corrupted"):
        lf.load(flipped, model=model)
    # A version "2" file relabelled "1" (its digest covers the metadata too) is refused.
    with pytest.raises(ValueError, match="edited.safetensors is corrupted"):
        lf.load(_rewrite(path, metadata={"format_version": "1"}), model=model)


def load_meta(path):
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata())


def test_an_interrupted_save_leaves_the_previous_file_intact(saved, monkeypatch):
    model, adapter, path = saved
    before = path.read_bytes()

    def dies_halfway(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(native, "save_file", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        lf.save(perturbed(adapter, 1.0, seed=9), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.safetensors"]


def test_a_loaded_adapter_computes_bit_for_bit_what_the_saved_one_did(tmp_path):
    """safetensors hands tensors back 8-byte aligned, and MKL's float64 GEMM sums in another order on
    an operand that is not 64-byte aligned (PEANuT's ``Wᵀ Aᵀ`` with tanh at depth 2 came back one ulp
    off on both paths): ``load`` gives every tensor 64-byte-aligned memory."""
    from tests.one_layer import one_layer, perturbed, run

    model = one_layer("linear", 8, 8, True, torch.float64, seed=5035)
    spec = lf.AdapterSpec("peanut", targets=["proj"], r=8, depth=2, act_fn="tanh", dtype=torch.float64)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5036)), seed=5038)
    loaded = lf.load(lf.save(adapter, tmp_path / "a.safetensors"), model=model)
    assert all(t.data_ptr() % 64 == 0 for t in [*loaded.params.values(), *loaded.buffers.values()])
    x, base = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), lf.base_params(model)
    for make in (lf.merge_overlay, lf.overlay):
        assert torch.equal(run(model, make(base, loaded), x), run(model, make(base, adapter), x)), make.__name__
