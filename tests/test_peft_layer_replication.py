"""peft's ``layer_replication`` (``peft/tuners/tuners_utils.py::replicate_layers``): peft rebuilds
the model deeper, the repeated layers sharing the base weights, each with its own LoRA.
lora_func keeps the base untouched and adapts weights by name, so it refuses the config, naming
the option and the way round it: the deeper base with independent layers (the repeated layers'
weights once more in memory) and the config without the option load exactly (float64, peft's logits)."""

from __future__ import annotations

import copy
import json
import shutil
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import replicate_layers

import lora_func as lf
from tests.models import tiny_model, tokens

LAYER_MAP = [[0, 2], [1, 2]]  # layers 0, 1, 1: three layers from two


def test_layer_replication_is_refused_with_the_way_round_it_which_is_exact(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(tiny_model("llama", dtype=torch.float64), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], layer_replication=LAYER_MAP)).eval()
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, p in sorted(peft_model.named_parameters()):
                if p.requires_grad:
                    p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        peft_model.save_pretrained(tmp_path / "peft")
    base = tiny_model("llama", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"layer_replication=\[\[0, 2\], \[1, 2\]\]: peft rebuilds the model deeper.*replicate_layers"):
        lf.load_peft(tmp_path / "peft", base)
    # the way round it: independent copies of the repeated layers, the option dropped
    deeper = tiny_model("llama", dtype=torch.float64)
    replicate_layers(deeper, LAYER_MAP)
    deeper.model.layers = torch.nn.ModuleList([copy.deepcopy(layer) for layer in deeper.model.layers])
    shutil.copytree(tmp_path / "peft", tmp_path / "plain")
    config_path = tmp_path / "plain" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    del config["layer_replication"]
    config_path.write_text(json.dumps(config))
    adapter = lf.load_peft(tmp_path / "plain", deeper)
    assert len(adapter.layers) == 6  # q_proj and v_proj of three layers, each copy its own
    ids = tokens()
    want = peft_model(ids).logits
    got = lf.adapted_call(deeper, adapter, ids).logits
    assert (got - want).abs().max() <= 1e-9 * want.abs().max()
    assert (want - base(ids).logits).abs().max() > 1e-2
    # the cost: the repeated layer's weights once more (docs/io.md)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(deeper) - count(base) == count(base.model.layers[1])
