"""peft's ``layer_replication`` (``peft/tuners/tuners_utils.py::replicate_layers``) against HF peft
0.21, float64: peft rebuilds the model deeper in place, the repeated layers sharing the base
weights, each with its own LoRA. lora_func builds the same deeper model as a view
(``lora_func.replication.replicated``): a new module tree on the base's storage, the base
untouched. ``load_peft`` onto the view gives peft's logits (both routes) and every tensor's
gradient (relative 1e-9); ``save_peft(..., model=view)`` writes the option and peft reloads it with
lora_func's logits; onto the plain base the checkpoint is refused, naming the option and the view.
"""

from __future__ import annotations

import copy
import json
import types
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn
from torch.func import grad

import lora_func as lf
from lora_func.replication import replicated
from tests.models import tiny_model, tokens
from tests.peft_coverage import _in_input_dtype
from tests.peft_helpers import ce_loss

# layers 0 1 1 (a repeated layer after its original), and 1 0 1 (every layer moved: new cache slots)
MAPS = {"repeat": [[0, 2], [1, 2]], "reorder": [[1, 2], [0, 2]]}


def _llama():
    return _in_input_dtype(tiny_model("llama", dtype=torch.float64))


def _close(got, want, what, rtol=1e-9):
    scale = want.abs().max()
    assert (got - want).abs().max() <= rtol * scale, f"{what}: off by {float((got - want).abs().max() / scale):.2e} relative"


@pytest.mark.parametrize("name", sorted(MAPS))
def test_a_layer_replication_checkpoint_loads_onto_the_view_as_peft_s(name, tmp_path):
    layer_map = MAPS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(_llama(), LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"], layer_replication=layer_map)).eval()
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, p in sorted(peft_model.named_parameters()):
                if p.requires_grad:
                    p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        peft_model.save_pretrained(tmp_path / "peft")
    base = _llama()
    fresh = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(ValueError, match=r"layer_replication=\[\[.*lora_func\.replication\.replicated\(model"):
        lf.load_peft(tmp_path / "peft", base)
    view = replicated(base, layer_map)
    adapter = lf.load_peft(tmp_path / "peft", view)
    assert len(adapter.layers) == 6 and len(view.model.layers) == 3 and view.config.num_hidden_layers == 3
    ids = tokens()
    want = peft_model(ids).logits
    assert (want - base(ids).logits).abs().max() > 1e-2
    for route in ("overlay", "module"):
        _close(lf.adapted_call(view, adapter, ids, route=route).logits, want, route)
    peft_model.zero_grad()
    ce_loss(peft_model(ids).logits, ids).backward()
    grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    got = grad(lambda params: ce_loss(lf.adapted_call(view, adapter.with_params(params), ids).logits, ids))(dict(adapter.params))
    lf.save_peft(adapter.with_params(got), tmp_path / "grads", model=view)
    as_peft = load_file(str(tmp_path / "grads" / "adapter_model.safetensors"))
    assert sorted(as_peft) == sorted(grads) and any(".layers.2." in k for k in grads)
    for key, g in grads.items():
        assert g.abs().max() > 0, key
        _close(as_peft[key], g, key)
    # the base is untouched: its layers, its config, its tensors
    assert len(base.model.layers) == 2 and base.config.num_hidden_layers == 2
    assert all(torch.equal(t, fresh[k]) for k, t in base.state_dict().items())


def test_save_peft_of_an_adapter_on_the_view_loads_in_peft(tmp_path):
    base = _llama()
    view = replicated(base, MAPS["repeat"])
    adapter = lf.init_adapter(view, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    adapter = adapter.with_params({k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    # layer 1 and its repeat hold different adapters on the same base weight
    assert not torch.equal(adapter.params["model.layers.1.self_attn.q_proj.lora_B"], adapter.params["model.layers.2.self_attn.q_proj.lora_B"])
    assert view.model.layers[2].self_attn.q_proj.weight.data_ptr() == base.model.layers[1].self_attn.q_proj.weight.data_ptr()
    # the cost: no weight copied, every tensor of the view on the base's storage
    storage = lambda m: {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]}  # noqa: E731
    assert storage(view) == storage(base) and len(list(view.parameters())) > len(list(base.parameters()))
    lf.save_peft(adapter, tmp_path, model=view)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["layer_replication"] == MAPS["repeat"]
    ids = tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(_llama(), tmp_path).eval()
    _close(loaded(ids).logits, lf.adapted_call(view, adapter, ids).logits, "peft on save_peft")


class _Stack(nn.Module):
    """A layer list at the top (no ``.model``), a config without ``num_hidden_layers``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        for layer in self.layers:
            nn.init.normal_(layer.weight, generator=g)
        self.config = types.SimpleNamespace(hidden_size=4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _EncoderList(nn.Module):
    """``.encoder`` is itself a module list, with no ``.layer``: not where peft looks."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])


def test_a_top_level_layer_list_replicates_as_peft_s_and_other_layouts_are_refused():
    """On a model that is its layer list's direct parent, ``replicated`` runs the layers peft's
    ``replicate_layers`` runs (the outputs equal) and leaves a config without
    ``num_hidden_layers`` as peft does (without one); peft's other layouts are looked up only as
    peft does (an ``.encoder`` module list without ``.layer`` is refused by both), and a map's
    ranges are non-empty ``[start, end)`` pairs of ints (not bools, not floats)."""
    from peft.tuners.tuners_utils import replicate_layers

    base, layer_map = _Stack(), [[0, 2], [1, 3]]
    theirs = copy.deepcopy(base)
    replicate_layers(theirs, layer_map)
    view = replicated(base, layer_map)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    assert len(view.layers) == len(theirs.layers) == 4 and len(base.layers) == 3
    assert torch.equal(view(x), theirs(x)) and not torch.equal(view(x), base(x))
    assert not hasattr(view.config, "num_hidden_layers") and not hasattr(theirs.config, "num_hidden_layers")
    with pytest.raises(ValueError, match="Could not locate"):
        replicate_layers(_EncoderList(), [[0, 1]])
    with pytest.raises(ValueError, match="no layer list"):
        replicated(_EncoderList(), [[0, 1]])
    for bad in ([[0, True]], [[0.0, 2]], [[0, 2], [1, 1]]):
        with pytest.raises(ValueError, match="not \\[start, end\\) ranges"):
            replicated(base, bad)
