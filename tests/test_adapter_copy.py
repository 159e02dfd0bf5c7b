"""``copy.copy``, ``copy.deepcopy``, ``pickle`` and ``torch.save`` of adapter nodes (a frozen
node refuses the slot restore their default path uses: each raised ``adapter-immutable``)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import lora_func as lf
from tests.models import tiny_model, tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", dtype=torch.float64)


def _nodes(model):
    g = torch.Generator().manual_seed(3)
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2), generator=g)
    lora = lora.with_params({k: (v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype)).detach() for k, v in lora.params.items()})
    vera = lf.init_adapter(model, lf.AdapterSpec("vera", targets=["v_proj"], r=2), generator=g)  # shared tensors
    vera = vera.with_params({k: (v + 0.1).detach() for k, v in vera.params.items()})
    return {"adapter": lora, "shared": vera, "composed": lf.compose([lora, vera]), "stack": lf.stack([lora, lora.with_params({k: -v.detach() for k, v in lora.params.items()})])}


def _round_trips():
    def pickled(node):
        return pickle.loads(pickle.dumps(node))

    def torch_saved(node):
        buffer = io.BytesIO()
        torch.save(node, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    return {"deepcopy": copy.deepcopy, "pickle": pickled, "torch.save": torch_saved}


@pytest.mark.parametrize("how", sorted(_round_trips()))
def test_a_deep_copy_is_equal_independent_and_runs_the_same(model, how):
    ids = tokens()
    for name, node in _nodes(model).items():
        again = _round_trips()[how](node)
        assert type(again) is type(node) and again.static() == node.static(), name
        assert sorted(again.params) == sorted(node.params) and sorted(again.buffers) == sorted(node.buffers), name
        for key, tensor in node.params.items():
            assert torch.equal(again.params[key], tensor) and again.params[key] is not tensor, (name, key)
            assert again.params[key].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr(), (name, key)
        if name != "stack":
            torch.testing.assert_close(lf.adapted_call(model, again, ids).logits, lf.adapted_call(model, node, ids).logits, rtol=0, atol=0)
        before = {k: v.clone() for k, v in node.params.items()}
        with torch.no_grad():
            next(iter(again.params.values())).add_(1.0)  # the copy's tensors are its own
        assert all(torch.equal(node.params[k], v) for k, v in before.items()), name


def test_a_shallow_copy_shares_the_tensors_and_stays_frozen(model):
    for name, node in _nodes(model).items():
        again = copy.copy(node)
        assert type(again) is type(node)
        assert all(again.params[k] is v for k, v in node.params.items()), name
        with pytest.raises(AttributeError, match="immutable"):
            again.params = {}
