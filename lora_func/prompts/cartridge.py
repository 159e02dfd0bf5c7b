"""Cartridges (Eyuboglu et al. 2025; peft's ``CartridgeConfig``): a trainable KV cache of ``n``
tokens, its first ``num_frozen_tokens`` frozen (an attention sink), served as prefix tuning's is.

Tensors, in peft's flat prefix layout ``(tokens, num_layers * 2 * kv_dim)``:
``frozen_embedding (num_frozen_tokens, ...)`` (a buffer: no gradient) and
``trainable_embedding (n - num_frozen_tokens, ...)``. Inits: ``"random"`` (standard normal,
frozen rows first, as peft's ``reset_parameters``), ``"text"``: the first ``n`` cached keys and
values of the frozen model run on ``init_text``'s tokens (peft's
``initialize_kv_prefix_from_text(..., use_chat_template=False)``; needs ``tokenizer=``). peft saves
the whole cache as ``prompt_embeddings`` and splits it on load by ``num_frozen_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.prompts._contract import Geometry, InitInputs, PeftRecord, PromptMethod, TensorDict, normal
from lora_func.prompts.prefix_tuning import kv_config, prefix_width
from lora_func.prompts.prompt_tuning import read_n


def _frozen(n: int, options: Mapping[str, Any]) -> int:
    return options["num_frozen_tokens"]


def _shapes(n: int, options: Mapping[str, Any], geometry: Geometry):
    frozen, width = _frozen(n, options), prefix_width(geometry)
    buffers = (("frozen_embedding", (frozen, width)),) if frozen else ()
    return (("trainable_embedding", (n - frozen, width)),), buffers


def _check(n: int, options: Mapping[str, Any]) -> list[str]:
    problems = []
    frozen = options["num_frozen_tokens"]
    if isinstance(frozen, bool) or not isinstance(frozen, int) or not 0 <= frozen < n:
        problems.append(f"num_frozen_tokens={frozen!r} must be an integer in [0, num_virtual_tokens={n}) (at least one token trains)")
    if options["init"] not in ("random", "text"):
        problems.append(f"init={options['init']!r} is not one of ['random', 'text']")
    text = options["init_text"]
    if options["init"] == "text" and not (isinstance(text, str) and text):
        problems.append("init='text' needs init_text='...' (the text whose cached keys and values start the cartridge)")
    if options["init"] != "text" and text is not None:
        problems.append(f"init_text is read only with init='text', got init={options['init']!r}")
    return problems


def flat_prefix(cache: list[tuple[Tensor, Tensor]], n: int) -> Tensor:
    """peft's ``prompt_embeddings_from_past_key_values``: the first ``n`` tokens of a batch-one
    cache ``[(key (1, H, T, hd), value) per layer]`` as ``(n, num_layers * 2 * H * hd)``."""
    per_layer = [t[0, :, :n, :].transpose(0, 1) for k, v in cache for t in (k, v)]  # (n, H, hd) each
    return torch.stack(per_layer, dim=1).reshape(n, -1)


def _init(inputs: InitInputs) -> tuple[TensorDict, TensorDict]:
    n, frozen, g = inputs.n, _frozen(inputs.n, inputs.options), inputs.generator
    width = prefix_width(inputs.geometry)
    if inputs.options["init"] == "text":
        assert inputs.prefill is not None  # init_prompt hands it
        ids = torch.tensor([list(inputs.tokenizer(inputs.options["init_text"])["input_ids"])], dtype=torch.long)
        whole = flat_prefix(inputs.prefill(ids), n).detach().to(torch.float32)
    else:
        whole = torch.cat([normal((frozen, width), g), normal((n - frozen, width), g)])
    whole = whole.to(inputs.dtype)
    return {"trainable_embedding": whole[frozen:].clone()}, ({"frozen_embedding": whole[:frozen].clone()} if frozen else {})


def form(params: TensorDict, buffers: TensorDict, n: int, options: Mapping[str, Any], geometry: Geometry, task_ids: Tensor | None, training: bool) -> Tensor:
    """``(n, num_layers * 2 * kv_dim)``: the frozen rows, then the trainable ones."""
    if "frozen_embedding" not in buffers:
        return params["trainable_embedding"]
    return torch.cat([buffers["frozen_embedding"], params["trainable_embedding"]])


def _from_peft(tensors: Mapping[str, Tensor], n: int, options: Mapping[str, Any], geometry: Geometry) -> tuple[TensorDict, TensorDict]:
    whole, frozen = tensors["prompt_embeddings"], _frozen(n, options)
    return {"trainable_embedding": whole[frozen:]}, ({"frozen_embedding": whole[:frozen]} if frozen else {})


PEFT = PeftRecord(
    peft_type="CARTRIDGE",
    config=lambda n, options, geometry: kv_config(n, geometry) | {"num_frozen_tokens": options["num_frozen_tokens"]},
    read_config=lambda config, geometry: (read_n(config), {"num_frozen_tokens": int(config.get("num_frozen_tokens", 1))}),
    to_peft=lambda params, buffers, n, options, geometry: {"prompt_embeddings": form(params, buffers, n, options, geometry, None, False)},
    from_peft=_from_peft,
)

METHOD = PromptMethod(
    name="cartridge",
    entry="kv",
    options={"num_frozen_tokens": 1, "init": "random", "init_text": None},
    check=_check,
    shapes=_shapes,
    init=_init,
    form=form,
    peft=PEFT,
)
