"""P-tuning (Liu et al. 2021; peft's ``PromptEncoderConfig``): ``n`` virtual-token embeddings
computed by a small encoder from ``n`` trainable inputs, put before the input's.

Tensors: ``embedding (n, d)`` and the encoder's, named as peft's ``PromptEncoder`` names them:
``encoder="mlp"``: ``mlp_head.{0,2,4}.{weight,bias}`` (``d -> h -> h -> d``, ReLU between);
``encoder="lstm"``: a bidirectional ``encoder_num_layers``-layer LSTM
(``lstm_head.{weight,bias}_{ih,hh}_l<k>[_reverse]``, dropout ``encoder_dropout`` between layers
in train mode) then ``mlp_head.{0,2}`` (``2h -> 2h -> d``, ReLU); ``encoder="none"``: the
embedding is the prompt (what a peft checkpoint holds: peft saves the encoder's output, and loads
it without the encoder). ``h = encoder_hidden_size`` (default ``d``). Inits are ``nn.Embedding``'s
and ``nn.Linear`` / ``nn.LSTM``'s defaults, in peft's order, draw for draw.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.prompts._contract import Geometry, InitInputs, PeftRecord, PromptMethod, TensorDict, linear_init, normal
from lora_func.prompts.prompt_tuning import prompt_config, read_n

ENCODERS = ("mlp", "lstm", "none")


def _hidden(options: Mapping[str, Any], geometry: Geometry) -> int:
    return options["encoder_hidden_size"] or geometry.token_dim


def _lstm_names(layers: int) -> list[tuple[int, str]]:
    return [(layer, suffix) for layer in range(layers) for suffix in ("", "_reverse")]


def _shapes(n: int, options: Mapping[str, Any], geometry: Geometry):
    d, h = geometry.token_dim, _hidden(options, geometry)
    shapes: list[tuple[str, tuple[int, ...]]] = [("embedding", (n, d))]
    if options["encoder"] == "mlp":
        for i, (d_out, d_in) in zip((0, 2, 4), ((h, d), (h, h), (d, h)), strict=True):
            shapes += [(f"mlp_head.{i}.weight", (d_out, d_in)), (f"mlp_head.{i}.bias", (d_out,))]
    elif options["encoder"] == "lstm":
        for layer, suffix in _lstm_names(options["encoder_num_layers"]):
            d_in = d if layer == 0 else 2 * h
            shapes += [
                (f"lstm_head.weight_ih_l{layer}{suffix}", (4 * h, d_in)),
                (f"lstm_head.weight_hh_l{layer}{suffix}", (4 * h, h)),
                (f"lstm_head.bias_ih_l{layer}{suffix}", (4 * h,)),
                (f"lstm_head.bias_hh_l{layer}{suffix}", (4 * h,)),
            ]
        for i, (d_out, d_in) in zip((0, 2), ((2 * h, 2 * h), (d, 2 * h)), strict=True):
            shapes += [(f"mlp_head.{i}.weight", (d_out, d_in)), (f"mlp_head.{i}.bias", (d_out,))]
    return tuple(shapes), ()


def _check(n: int, options: Mapping[str, Any]) -> list[str]:
    problems = []
    if options["encoder"] not in ENCODERS:
        problems.append(f"encoder={options['encoder']!r} is not one of {list(ENCODERS)}")
    size = options["encoder_hidden_size"]
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        problems.append(f"encoder_hidden_size={size!r} must be an integer >= 1 (or None: the model's embedding width)")
    layers = options["encoder_num_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        problems.append(f"encoder_num_layers={layers!r} must be an integer >= 1")
    dropout = options["encoder_dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"encoder_dropout={dropout!r} must be a probability in [0, 1)")
    return problems


def _init(inputs: InitInputs) -> tuple[TensorDict, TensorDict]:
    options, geometry, g = inputs.options, inputs.geometry, inputs.generator
    params = {"embedding": normal((inputs.n, geometry.token_dim), g)}
    shapes = dict(_shapes(inputs.n, options, geometry)[0])
    h = _hidden(options, geometry)
    if options["encoder"] == "lstm":
        bound = 1 / h**0.5  # nn.LSTM.reset_parameters: every tensor uniform in ±1/√h, in parameter order
        for name, shape in shapes.items():
            if name.startswith("lstm_head."):
                params[name] = torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=g)
    for name, shape in shapes.items():
        if name.startswith("mlp_head.") and name.endswith(".weight"):
            params[name], params[name.replace(".weight", ".bias")] = linear_init(shape[0], shape[1], g)
    return {name: params[name].to(inputs.dtype) for name in shapes}, {}


def _lstm(x: Tensor, params: TensorDict, layers: int, dropout: float, training: bool) -> Tensor:
    """A bidirectional ``nn.LSTM(batch_first=True)`` over one sequence ``x (n, d_in)`` from zero
    states: ``(n, 2h)`` (gates in torch's order: input, forget, cell, output)."""
    n = x.shape[0]
    for layer in range(layers):
        directions = []
        for suffix, steps in (("", range(n)), ("_reverse", range(n - 1, -1, -1))):
            w_ih, w_hh = params[f"lstm_head.weight_ih_l{layer}{suffix}"], params[f"lstm_head.weight_hh_l{layer}{suffix}"]
            b_ih, b_hh = params[f"lstm_head.bias_ih_l{layer}{suffix}"], params[f"lstm_head.bias_hh_l{layer}{suffix}"]
            inputs = F.linear(x, w_ih, b_ih)  # (n, 4h)
            h = c = x.new_zeros(w_hh.shape[1])
            out: list[Tensor] = [h] * n
            for t in steps:
                i, f, g, o = (inputs[t] + F.linear(h, w_hh, b_hh)).chunk(4)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                out[t] = h
            directions.append(torch.stack(out))
        x = torch.cat(directions, dim=-1)
        if training and dropout and layer < layers - 1:
            x = F.dropout(x, dropout, training=True)
    return x


def form(params: TensorDict, buffers: TensorDict, n: int, options: Mapping[str, Any], geometry: Geometry, task_ids: Tensor | None, training: bool) -> Tensor:
    """``(n, d)``: the encoder applied to the embedding (peft's ``PromptEncoder.forward``)."""
    x = params["embedding"]
    if options["encoder"] == "lstm":
        x = _lstm(x, params, options["encoder_num_layers"], options["encoder_dropout"], training)
        return F.linear(torch.relu(F.linear(x, params["mlp_head.0.weight"], params["mlp_head.0.bias"])), params["mlp_head.2.weight"], params["mlp_head.2.bias"])
    if options["encoder"] == "mlp":
        for i in (0, 2, 4):
            x = F.linear(x, params[f"mlp_head.{i}.weight"], params[f"mlp_head.{i}.bias"])
            x = torch.relu(x) if i < 4 else x
    return x


def _config(n: int, options: Mapping[str, Any], geometry: Geometry) -> dict[str, Any]:
    return prompt_config(n, geometry) | {
        "encoder_reparameterization_type": "LSTM" if options["encoder"] == "lstm" else "MLP",
        "encoder_hidden_size": _hidden(options, geometry),
        "encoder_num_layers": options["encoder_num_layers"],
        "encoder_dropout": options["encoder_dropout"],
    }


def _to_peft(params: TensorDict, buffers: TensorDict, n: int, options: Mapping[str, Any], geometry: Geometry) -> TensorDict:
    # peft saves the encoder's output (get_prompt_embedding_to_save), eval mode.
    return {"prompt_embeddings": form(params, buffers, n, options, geometry, None, False)}


PEFT = PeftRecord(
    peft_type="P_TUNING",
    config=_config,
    # A checkpoint holds the encoder's output: it reads as the encoder-free form.
    read_config=lambda config, geometry: (read_n(config), {"encoder": "none"}),
    to_peft=_to_peft,
    from_peft=lambda tensors, n, options, geometry: ({"embedding": tensors["prompt_embeddings"]}, {}),
)

METHOD = PromptMethod(
    name="p_tuning",
    entry="embeds",
    options={"encoder": "mlp", "encoder_hidden_size": None, "encoder_num_layers": 2, "encoder_dropout": 0.0},
    check=_check,
    shapes=_shapes,
    init=_init,
    form=form,
    peft=PEFT,
)
