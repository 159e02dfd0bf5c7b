"""VeRA beyond the contract suite: the shared basis is peft's draw for draw; peft checkpoints
(perturbed, with and without ``save_projection``, Llama and GPT-2 Conv1D) load with peft's logits
and per-tensor gradients in float64; ``save_peft`` loads in peft; ``init_adapter`` trains; and a
stack of 256 members trains in one ``ensemble_call`` step holding one copy of the basis."""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_func as lf
from lora_func.adapter import SHARED
from tests import bank_oracle
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss
from tests.variant_checks import assert_config_checks, assert_peft_round_trip

# peft warns on every save_projection=False config, and reads transformers 5's deprecated attribute
pytestmark = [
    pytest.mark.filterwarnings("ignore:Specified to not:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


def _config(kind: str, save_projection: bool = True, **kwargs) -> peft.VeraConfig:
    return peft.VeraConfig(r=4, target_modules=TARGETS[kind], save_projection=save_projection, projection_prng_key=5, **kwargs)


@pytest.fixture(scope="module")
def llama64():
    return bank_oracle.model64("llama")


def test_the_basis_and_the_init_are_peft_s_draw_for_draw():
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(tiny_model("llama"), _config("llama", d_initial=0.25))
    adapter = lf.init_adapter(model, lf.AdapterSpec("vera", targets=TARGETS["llama"], r=4, projection_prng_key=5, d_initial=0.25))
    # Sized to the largest d_out (32) and d_in (48) of the layers, each taken separately.
    assert adapter.buffers[f"{SHARED}.vera_A"].shape == (4, 48) and adapter.buffers[f"{SHARED}.vera_B"].shape == (32, 4)
    assert torch.equal(adapter.buffers[f"{SHARED}.vera_A"], pm.base_model.vera_A["default"])
    assert torch.equal(adapter.buffers[f"{SHARED}.vera_B"], pm.base_model.vera_B["default"])
    for name, p in pm.named_parameters():
        if p.requires_grad:
            assert torch.equal(adapter.params[bank_oracle.lf_key(name)], p), name
    other = lf.init_adapter(model, lf.AdapterSpec("vera", targets=TARGETS["llama"], r=4, projection_prng_key=6))
    assert not torch.equal(other.buffers[f"{SHARED}.vera_A"], adapter.buffers[f"{SHARED}.vera_A"])


@pytest.mark.parametrize(("kind", "save_projection"), [("llama", True), ("llama", False), ("gpt2", True)])
def test_a_peft_checkpoint_loads_with_peft_s_logits_and_gradients(llama64, tmp_path, kind, save_projection):
    model = llama64 if kind == "llama" else bank_oracle.model64("gpt2")
    pm = bank_oracle.peft_model(model, _config(kind, save_projection))
    adapter, _ = bank_oracle.check_against_peft(model, pm, tmp_path)
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert ("base_model.vera_A" in stored) is save_projection
    # Without the basis in the file it is re-created from projection_prng_key, as peft does.
    assert torch.equal(adapter.buffers[f"{SHARED}.vera_A"], pm.base_model.vera_A["default"])
    assert adapter.spec.option("save_projection") is save_projection and adapter.spec.option("projection_prng_key") == 5


@pytest.mark.parametrize("save_projection", [True, False])
def test_save_peft_loads_in_peft(llama64, tmp_path, save_projection):
    adapter = lf.init_adapter(llama64, lf.AdapterSpec("vera", targets=TARGETS["llama"], r=4, dtype=torch.float64, projection_prng_key=3, save_projection=save_projection))
    g = torch.Generator().manual_seed(2)
    adapter = adapter.with_params({k: v.detach() + torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    lf.save_peft(adapter, tmp_path, model=llama64)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "VERA" and config["r"] == 4 and config["projection_prng_key"] == 3 and config["save_projection"] is save_projection
    assert config["init_weights"] is True and config["d_initial"] == 0.1 and config["vera_dropout"] == 0.0
    assert all(t.dtype == torch.float64 for t in adapter.buffers.values())
    assert ("base_model.vera_B" in load_file(tmp_path / "adapter_model.safetensors")) is save_projection
    ids = tokens(2, 9, seed=4)
    want = lf.adapted_call(llama64, adapter, ids).logits
    assert bank_oracle.rel(bank_oracle.peft_reload_logits(llama64, tmp_path, ids), want) < bank_oracle.RTOL
    back = lf.load_peft(tmp_path, llama64)
    assert all(torch.equal(back.params[k], adapter.params[k]) for k in adapter.params)
    assert all(torch.equal(back.buffers[k], adapter.buffers[k]) for k in adapter.buffers)


def test_a_checkpoint_missing_its_basis_or_of_another_shape_is_refused(llama64, tmp_path):
    pm = bank_oracle.peft_model(llama64, _config("llama"))
    pm.save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if k != "base_model.vera_A"}, path)
    with pytest.raises(ValueError, match=r"says it holds the shared vera_A \(base_model.vera_A\)"):
        lf.load_peft(tmp_path, llama64)
    save_file(tensors | {"base_model.vera_A": tensors["base_model.vera_A"][:, :32].contiguous()}, path)
    with pytest.raises(ValueError, match=r"the shared base_model.vera_A has shape \(4, 32\), the adapted layers need \(4, 48\)"):
        lf.load_peft(tmp_path, llama64)


def test_init_adapter_trains():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("vera", targets=TARGETS["llama"], r=8), generator=torch.Generator().manual_seed(0))
    losses = bank_oracle.adam_losses(model, adapter, lr=0.05)
    assert losses[-1] < 0.8 * losses[0], losses



def test_a_stack_of_256_members_holds_one_basis_and_trains_in_one_ensemble_step():
    model = tiny_model("llama")
    spec = lf.AdapterSpec("vera", targets=TARGETS["llama"], r=16)
    members = [lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(i)) for i in range(256)]
    stacked = lf.stack(members)
    one = members[0]
    basis = sum(t.numel() * t.element_size() for t in one.buffers.values())
    vectors = sum(t.numel() * t.element_size() for t in one.params.values())
    assert basis == 4 * (16 * 48 + 32 * 16) and vectors == 4 * (2 * (32 + 16 + 32) + 6 * 16)
    assert bank_oracle.storage_bytes(stacked) == basis + 256 * vectors  # not 256 * (basis + vectors)
    assert torch.equal(lf.unstack(stacked)[200].buffers[f"{SHARED}.vera_A"], one.buffers[f"{SHARED}.vera_A"])
    ids = tokens(2, 9, seed=1)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in stacked.params.items()}
    with torch.no_grad():  # members differ: a random λ_b each
        params = {k: (v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9)) if "lambda_b" in k else v).requires_grad_(True) for k, v in params.items()}

    def losses(p):
        out = lf.ensemble_call(model, stacked.with_params(p), ids).logits
        return torch.stack([ce_loss(o, ids) for o in out])

    before = losses(params)
    before.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params.values())
    with torch.no_grad():
        after = losses({k: v - 1.0 * v.grad for k, v in params.items()})
    assert bool((after < before).all()), int((after < before).sum())


def test_a_config_without_the_seed_fields_reads_as_peft_s_defaults(llama64, tmp_path):
    """peft's defaults: projection_prng_key 0, save_projection True, init_weights True."""
    pm = bank_oracle.peft_model(llama64, peft.VeraConfig(r=4, target_modules=TARGETS["llama"]))
    pm.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    for name in ("projection_prng_key", "save_projection", "init_weights", "d_initial", "vera_dropout"):
        del config[name]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    adapter = lf.load_peft(tmp_path, llama64)
    assert dict(adapter.spec.options) == dict(lf.AdapterSpec("vera", targets=["q_proj"]).options)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"vera_dropout": 0.25, "init_weights": False}))
    assert lf.load_peft(tmp_path, llama64).spec.options == lf.AdapterSpec("vera", targets=["q_proj"], dropout=0.25, init="random").options
    path = tmp_path / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(path).items() if "vera_A" not in k and "vera_B" not in k}, path)
    with pytest.raises(ValueError, match="says it holds the shared vera_A"):
        lf.load_peft(tmp_path, llama64)  # save_projection defaults to True


def test_peft_config_checks_and_round_trip():
    assert_config_checks("vera", peft.VeraConfig, {
        "projection_prng_key": [-1, 2**63, 1.5, True], "save_projection": [1], "vera_dropout": [-0.1, 1.0, float("nan")],
        "d_initial": [float("inf"), "0.1"], "init_weights": [0],
    }, good={"projection_prng_key": [0, 2**63 - 1], "vera_dropout": [None, 0.0, 0.99], "d_initial": [0.0, -1.0]})
    assert_peft_round_trip("vera", {"projection_prng_key": 5, "save_projection": False, "dropout": 0.3, "d_initial": 0.5, "init": "random"})
