"""The adapter tree (issue 24): a new combinator is one subclass of ``Combinator`` in one file.

``Gated`` below lives in this test file only: ``W_eff = W + gain · Σ_k gate_k · ΔW_k`` over its
parts (``gain`` a static float, ``gate (K,)`` a trainable tensor it holds itself). Defining its
constructor and ``layer_op`` is all it does, and it works through every path of the package:
merge_overlay, the lazy overlay and adapted_call, pytree flatten/unflatten (torch and optree),
torch.func.grad and vmap, save/load, stack/take/unstack. Each check compares against the explicit
float64 ``W_eff`` computed here by hand from the LoRA factors (``ΔW = (alpha/r) B A``), after
perturbing ``B`` away from its zero init.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import optree  # a test dependency (constraints.txt): the optree registration is checked, never skipped
import pytest
import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.func import functional_call

import lora_func as lf
from lora_func._layer_ops import LayerOp, SumOp
from lora_func.adapter import NODE_TYPES, Combinator, leaves, own_tensor, static_field, walk

R, ALPHA = 2, 4.0  # LoRA scale alpha / r = 2


class Gated(Combinator, tag="test_gated"):
    """``W + gain · Σ_k gate_k (W_eff_k − W)``: a toy combinator, defined here only."""

    gate: Tensor = own_tensor(shape=lambda node: (len(node.parts),))  # each field declared once
    gain: float = static_field()

    def __init__(self, parts: Sequence[lf.Adapter], gate: Tensor, gain: float) -> None:
        self._init(parts, gate=gate, gain=float(gain))

    def layer_op(self, ops: Sequence[LayerOp], present: Sequence[int]) -> LayerOp:
        return SumOp(ops, self.gain * self.gate[..., list(present)])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _lora(model: nn.Module, targets: list[str], seed: int) -> lf.Adapter:
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=R, alpha=ALPHA), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 100)
    # B is zero at init: perturb every tensor so that a part that is ignored, or scaled wrongly, shows.
    return adapter.with_params({k: (v + torch.randn(v.shape, generator=g)).detach().requires_grad_(True) for k, v in adapter.params.items()})


def _delta(adapter: lf.Adapter, module: str) -> Tensor | None:
    """``(alpha/r) B A`` of ``module``, float64, by hand (None where the adapter leaves it alone)."""
    if f"{module}.lora_A" not in adapter.params:
        return None
    a, b = (adapter.params[f"{module}.lora_{n}"].detach().double() for n in "AB")
    return (ALPHA / R) * b @ a


def _oracle(model: Net, node: Gated) -> dict[str, Tensor]:
    """The explicit W_eff of fc1 and fc2 under ``node``, float64."""
    out = {}
    for module in ("fc1", "fc2"):
        w = getattr(model, module).weight.detach().double()
        for k, part in enumerate(node.parts):
            delta = _delta(part, module)
            if delta is not None:
                w = w + node.gain * node.gate[k].detach().double() * delta
        out[f"{module}.weight"] = w
    return out


def _forward_oracle(model: Net, weights: dict[str, Tensor], x: Tensor) -> Tensor:
    h = torch.tanh(x.double() @ weights["fc1.weight"].T + model.fc1.bias.detach().double())
    return h @ weights["fc2.weight"].T + model.fc2.bias.detach().double()


@pytest.fixture
def setting():
    model = Net().eval()
    parts = [_lora(model, ["fc1"], seed=1), _lora(model, ["fc1", "fc2"], seed=2)]  # fc2: only part 1 present
    node = Gated(parts, torch.tensor([0.7, -1.3], requires_grad=True), gain=0.5)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(9))
    return model, node, x


def _assert_close(got: Tensor, want: Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_toy_is_registered_by_its_class_statement_alone():
    assert NODE_TYPES["test_gated"] is Gated
    assert Gated in pytree.SUPPORTED_NODES


def test_walk_and_leaves_give_key_prefixes_in_application_order(setting):
    _model, node, _x = setting
    nested = lf.compose(node, node.parts[0])
    assert [(prefix, type(n).__name__) for prefix, n in walk(nested)] == [
        ("", "Composed"), ("0/", "Gated"), ("0/0/", "Adapter"), ("0/1/", "Adapter"), ("1/", "Adapter"),
    ]
    assert [prefix for prefix, _ in leaves(nested)] == ["0/0/", "0/1/", "1/"]
    # The prefixes are the ones params carries.
    for prefix, leaf in leaves(nested):
        for key, value in leaf.params.items():
            assert nested.params[prefix + key] is value
    assert nested.params["0/gate"] is node.gate


def test_merged_and_lazy_paths_match_the_hand_computed_w_eff(setting):
    model, node, x = setting
    base = lf.base_params(model)
    want = _oracle(model, node)
    assert not torch.allclose(want["fc2.weight"], model.fc2.weight.detach().double(), atol=1e-3)  # the adapter acts
    merged = lf.merge_overlay(base, node)
    for key, w_eff in want.items():
        _assert_close(merged[key], w_eff)
    y = _forward_oracle(model, want, x)
    _assert_close(functional_call(model, lf.overlay(base, node), (x,)), y)
    _assert_close(lf.adapted_call(model, node, x), y)
    _assert_close(lf.adapted_call(model, node, x, merged=True), y)
    _assert_close(lf.adapted_call(model, node, x, route="module"), y)


def test_grad_reaches_the_own_tensor_and_the_parts(setting):
    model, node, _x = setting
    base = lf.base_params(model)
    cotangent = torch.randn(5, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def loss(params: dict[str, Tensor]) -> Tensor:
        return (lf.merge_overlay(base, node.with_params(params))["fc1.weight"].double() * cotangent).sum()

    grads = torch.func.grad(loss)(node.params)
    # d/d gate_k of <W_eff, G> = gain * <ΔW_k, G>, by hand.
    want = torch.stack([node.gain * (_delta(part, "fc1") * cotangent).sum() for part in node.parts])
    _assert_close(grads["gate"], want)
    assert set(grads) == set(node.params) and grads["1/fc1.lora_B"].abs().sum() > 0


def test_pytree_flatten_unflatten_and_tree_map(setting):
    _model, node, _x = setting
    leaves_, spec = pytree.tree_flatten(node)
    assert leaves_[0] is node.gate and len(leaves_) == 1 + len(node.parts[0].params) + len(node.parts[1].params)
    rebuilt = pytree.tree_unflatten(leaves_, spec)
    assert type(rebuilt) is Gated and rebuilt.gain == node.gain and rebuilt.params.keys() == node.params.keys()
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(node)[0]]
    assert paths[0] == ".gate" and paths[1].startswith("[0].params")
    doubled = pytree.tree_map(lambda t: 2 * t, node)
    assert type(doubled) is Gated and doubled.gain == node.gain
    _assert_close(doubled.gate, 2 * node.gate.detach().double())
    # Unflatten builds trees of non-tensors (vmap's in_dims, tree_map to markers): no validation.
    markers = pytree.tree_map(lambda _t: object(), node)
    assert type(markers) is Gated and not isinstance(markers.gate, Tensor)
    assert pytree.tree_map(lambda _t: None, node.parts[0]).params[next(iter(node.parts[0].params))] is None
    o_leaves, o_spec = optree.tree_flatten(node, namespace="lora_func")
    assert len(o_leaves) == len(leaves_) and all(a is b for a, b in zip(o_leaves, leaves_, strict=True))
    assert type(optree.tree_unflatten(o_spec, o_leaves)) is Gated


def test_save_load_round_trip(setting, tmp_path):
    model, node, x = setting
    path = lf.save(node, tmp_path / "gated.safetensors")
    loaded = lf.load(path, model=model)
    assert type(loaded) is Gated and loaded.gain == node.gain and loaded.gate.requires_grad
    assert loaded.params.keys() == node.params.keys()
    for key, value in node.params.items():
        assert torch.equal(loaded.params[key], value)
    _assert_close(lf.adapted_call(model, loaded, x), _forward_oracle(model, _oracle(model, node), x))


def test_stack_take_unstack_and_vmap(setting):
    model, node, _x = setting
    other = Gated([_lora(model, ["fc1"], seed=5), _lora(model, ["fc1", "fc2"], seed=6)], torch.tensor([2.0, 0.25]), gain=0.5)
    stacked = lf.stack([node, other])
    assert type(stacked) is Gated and stacked.stack_shape == (2,) and stacked.gate.shape == (2, 2)
    base = lf.base_params(model)
    merged = torch.func.vmap(lambda a: lf.merge_overlay(base, a)["fc2.weight"])(stacked)
    for k, member in enumerate((node, other)):
        _assert_close(merged[k], _oracle(model, member)["fc2.weight"])
    # vmap's in_dims as a tree of the adapter's own structure (unflattened with ints as leaves).
    in_dims = pytree.tree_map(lambda _t: 0, stacked)
    again = torch.func.vmap(lambda a: lf.merge_overlay(base, a)["fc2.weight"], in_dims=(in_dims,))(stacked)
    assert torch.equal(again, merged)
    back = lf.take(stacked, 1)
    assert type(back) is Gated and all(torch.equal(back.params[k], v) for k, v in other.params.items())
    picked = lf.take(stacked, torch.tensor([1, 0, 1]))
    assert picked.stack_shape == (3,) and torch.equal(picked.gate[2], other.gate)
    assert [type(m) for m in lf.unstack(stacked)] == [Gated, Gated]
    with pytest.raises(TypeError, match="mixed kinds"):
        lf.stack([node, Gated(other.parts, other.gate, gain=2.0)])  # another gain is another kind


def test_construction_validates_and_rebuilds_do_not(setting):
    _model, node, _x = setting
    lora = node.parts[0]
    with pytest.raises(ValueError, match="one entry per adapter"):
        lf.Combined([lora, lora], torch.ones(3))  # combine()'s checks run in the constructor
    with pytest.raises(ValueError, match="compose\\(\\) needs at least one adapter"):
        lf.Composed([])
    with pytest.raises(KeyError, match="is missing keys"):
        lf.Adapter({}, lora.buffers, lora.spec, lora.layers)
    # with_params with (batched or not) tensors of other shapes is the cheap, unchecked path.
    wide = lora.with_params({k: torch.zeros(2, *v.shape) for k, v in lora.params.items()})
    assert wide.stack_shape == (2,)


def test_a_saved_node_without_its_json_fields_is_damaged_metadata(setting, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    _model, node, _x = setting
    path = lf.save(node, tmp_path / "gated.safetensors")
    with safe_open(str(path), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tree = json.loads(metadata["tree"])
    assert tree["kind"] == "test_gated" and tree["gain"] == node.gain and tree["gate_requires_grad"] is True
    del tree["gain"]
    save_file(tensors, str(tmp_path / "damaged.safetensors"), metadata=metadata | {"tree": json.dumps(tree)})
    with pytest.raises(ValueError, match="damaged lora_func metadata .*gain"):
        lf.load(tmp_path / "damaged.safetensors")


def test_fields_are_declared_once_and_become_slots_children_and_saved_fields():
    """Each field of a node type is one class attribute: the metaclass makes it a slot (no
    instance dict), a pytree child or context entry, and a saved-file field, in declaration order."""
    model = Net()
    node = Gated([_lora(model, ["fc1"], 1), _lora(model, ["fc2"], 2)], torch.tensor([0.5, -1.5]), 2.0)
    assert list(Gated.fields) == ["parts", "gate", "gain"]
    assert not hasattr(node, "__dict__") and {"gate", "gain"} <= set(Gated.__slots__)
    assert Gated.tensor_fields() == ("gate",) and Gated.static_fields() == ("gain",)
    assert Gated.json_field_names() == ("gain", "gate_requires_grad")
    assert node.own_shapes() == {"gate": (2,)} and node.static() == (2.0,)
    keyed, _ = pytree.tree_flatten_with_path(node)
    assert [pytree.keystr(path) for path, _ in keyed][:1] == [".gate"]
    with pytest.raises(AttributeError, match="immutable"):
        node.gain = 3.0


def test_a_combinator_without_layer_op_cannot_be_built():
    """The interface is declared on the base: a subclass that leaves out layer_op is abstract."""

    class Incomplete(Combinator):
        pass

    with pytest.raises(TypeError, match="layer_op"):
        Incomplete._build(parts=())
