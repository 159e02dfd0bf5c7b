"""layer_input_batches: the recorded layer inputs equal what forward hooks see (oracle), masked
by attention_mask and labels == -100, with the model untouched and bad batches refused."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import lora_func as lf
from lora_func.calibration import layer_input_batches
from lora_func.targeting import find_targets
from tests.contract_helpers import assert_unchanged, snapshot
from tests.models import tiny_model, tokens


def _batches(n=2, seed=0):
    out = []
    for i in range(n):
        ids = tokens(3, 7, seed=seed + i)
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0  # right padding
        mask[2, :1] = 0  # left padding
        labels = ids.clone()
        labels[1, 3] = -100
        labels[1, -1] = -100
        labels[2, 2] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _hooked_rows(model, modules, batch):
    """Oracle: forward pre-hooks on a copy of the model; the mask applied by an explicit loop."""
    seen = {}
    handles = [
        model.get_submodule(m).register_forward_pre_hook(lambda mod, args, m=m: seen.setdefault(m, args[0].detach().clone()))
        for m in modules
    ]
    try:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch.get("labels")
    batch_size, length = ids.shape
    out = {}
    for m, x in seen.items():
        flat = x.reshape(batch_size, length, -1)
        rows = [
            flat[b, t]
            for b in range(batch_size)
            for t in range(length)
            if mask[b, t] == 1 and (labels is None or labels[b, t] != -100)
        ]
        out[m] = torch.stack(rows).float()
    return out


CASES = [
    pytest.param("llama", ["q_proj", "v_proj", "down_proj"], "error", id="llama-linear"),
    pytest.param("gpt2", ["c_attn", "c_fc", "lm_head"], "both", id="gpt2-conv1d-and-tied-lm_head"),
]


@pytest.mark.parametrize(("kind", "names", "tied"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_equal_hooked_inputs_with_padding_and_ignored_labels_removed(kind, names, tied, dtype):
    model = tiny_model(kind, dtype=dtype)
    oracle_model = tiny_model(kind, dtype=dtype)
    targets = find_targets(model, lf.AdapterSpec("lora", targets=names, tied=tied))
    batches = _batches()
    got = list(layer_input_batches(model, targets, batches, cycle=False))
    assert len(got) == len(batches)
    for batch, rows in zip(batches, got, strict=True):
        expected = _hooked_rows(oracle_model, [t.module for t in targets], batch)
        assert list(rows) == [t.module for t in targets]
        keep = int(((batch["attention_mask"] == 1) & (batch["labels"] != -100)).sum())
        assert keep == 21 - 6
        for t in targets:
            x = rows[t.module]
            assert x.dtype == torch.float32 and not x.requires_grad
            assert x.shape == (keep, t.d_in), t.module
            assert torch.equal(x, expected[t.module]), t.module


def test_without_labels_only_the_attention_mask_applies():
    model = tiny_model("gpt2")
    targets = find_targets(model, lf.AdapterSpec("lora", targets=["c_attn"]))
    batch = {k: v for k, v in _batches(1)[0].items() if k != "labels"}
    (rows,) = layer_input_batches(model, targets, [batch], cycle=False)
    expected = _hooked_rows(tiny_model("gpt2"), [targets[0].module], batch)
    assert rows[targets[0].module].shape[0] == int(batch["attention_mask"].sum()) == 18
    assert torch.equal(rows[targets[0].module], expected[targets[0].module])
    only_ids = {"input_ids": batch["input_ids"]}
    (rows,) = layer_input_batches(model, targets, [only_ids], cycle=False)
    assert rows[targets[0].module].shape[0] == batch["input_ids"].numel()


def test_model_untouched_no_hooks_and_grad_mode_restored():
    model = tiny_model("llama")
    snap = snapshot(model)
    targets = find_targets(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"]))
    ids = tokens()
    before = model(ids).logits
    for rows in layer_input_batches(model, targets, _batches(), cycle=False):
        assert torch.is_grad_enabled(), "no_grad must not leak to the consumer"
        assert all(r.grad_fn is None for r in rows.values())
    assert_unchanged(model, snap)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module.training
    assert torch.equal(model(ids).logits, before)


def test_labels_never_reach_the_model_and_unknown_keys_are_ignored(monkeypatch):
    model = tiny_model("llama")
    calls = []
    original = model.forward

    @functools.wraps(original)
    def spy(*args, **kwargs):
        calls.append(dict(kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    targets = find_targets(model, lf.AdapterSpec("lora", targets=["q_proj"]))
    batch = {**_batches(1)[0], "token_type_ids": torch.zeros(3, 7, dtype=torch.long), "note": "x"}
    batch["position_ids"] = torch.arange(7).expand(3, 7)
    list(layer_input_batches(model, targets, [batch], cycle=False))
    (kwargs,) = calls
    assert sorted(kwargs) == ["attention_mask", "input_ids", "position_ids", "use_cache"]
    assert kwargs["use_cache"] is False


def test_cycle_replays_the_same_batches_in_order():
    model = tiny_model("gpt2")
    targets = find_targets(model, lf.AdapterSpec("lora", targets=["c_attn"]))
    batches = _batches(2)
    one_shot = iter(batches)  # an iterator can be read once; the batches are cached
    stream = layer_input_batches(model, targets, one_shot)
    got = [next(stream)[targets[0].module] for _ in range(5)]
    for i, rows in enumerate(got):
        assert torch.equal(rows, got[i % 2])
    assert not torch.equal(got[0], got[1])
    assert len(list(layer_input_batches(model, targets, batches, cycle=False))) == 2


class Toy(nn.Module):
    """A non-transformers model: one layer used twice, one unused, one fed a pooled vector."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.pooled = nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None, pool=False):
        h = self.used(self.used(self.emb(input_ids)))
        return self.pooled(h.mean(1)) if pool else h


def test_layer_used_twice_gives_both_inputs():
    torch.manual_seed(0)
    model = Toy().eval()
    targets = find_targets(model, lf.AdapterSpec("lora", targets=["used"]))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    (rows,) = layer_input_batches(model, targets, [{"input_ids": ids, "attention_mask": mask}], cycle=False)
    with torch.no_grad():
        first = model.emb(ids)
        second = model.used(first)
    keep = mask.bool()
    assert torch.equal(rows["used"], torch.cat([first[keep], second[keep]]))


def test_unused_or_misaligned_layers_are_errors():
    model = Toy().eval()
    batch = {"input_ids": torch.tensor([[1, 2, 3]])}
    unused = find_targets(model, lf.AdapterSpec("lora", targets=["unused"]))
    with pytest.raises(ValueError, match="target unused saw no input"):
        list(layer_input_batches(model, unused, [batch], cycle=False))
    pooled = find_targets(model, lf.AdapterSpec("lora", targets=["pooled"]))
    with pytest.raises(ValueError, match=r"target pooled got an input of 1 rows.*\(1, 3\) = 3 tokens"):
        list(layer_input_batches(model, pooled, [{**batch, "pool": True}], cycle=False))


BAD_BATCHES = [
    pytest.param([{"attention_mask": torch.ones(2, 3)}], ValueError, r"batch 0 has no 'input_ids'", id="no-input_ids"),
    pytest.param(
        [{"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4)}],
        ValueError,
        r"'attention_mask' has shape \(2, 4\), but 'input_ids' has shape \(2, 3\)",
        id="mask-shape",
    ),
    pytest.param(
        [{"input_ids": torch.ones(2, 3, dtype=torch.long)}, {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(3)}],
        ValueError,
        r"batch 1: 'labels' has shape \(3,\)",
        id="labels-shape",
    ),
    pytest.param([torch.ones(2, 3, dtype=torch.long)], TypeError, r"batch 0 is a Tensor", id="not-a-dict"),
    pytest.param([{"input_ids": torch.ones(3, dtype=torch.long)}], ValueError, r"integer tensor \(batch, seq\)", id="1d-ids"),
    pytest.param([{"input_ids": torch.ones(2, 3)}], ValueError, r"integer tensor \(batch, seq\)", id="float-ids"),
    pytest.param([], ValueError, r"calibration data is empty", id="empty"),
]


@pytest.mark.parametrize(("batches", "error", "message"), BAD_BATCHES)
def test_bad_batches_are_clear_errors(batches, error, message):
    model = tiny_model("gpt2")
    targets = find_targets(model, lf.AdapterSpec("lora", targets=["c_attn"]))
    with pytest.raises(error, match=message):
        list(layer_input_batches(model, targets, batches))


def test_training_mode_and_no_targets_are_errors():
    model = tiny_model("gpt2")
    targets = find_targets(model, lf.AdapterSpec("lora", targets=["c_attn"]))
    with pytest.raises(ValueError, match="at least one target"):
        list(layer_input_batches(model, [], _batches()))
    model.train()
    with pytest.raises(ValueError, match=r"training mode.*model\.eval\(\)"):
        list(layer_input_batches(model, targets, _batches()))
    assert model.training  # refused, not changed
