"""Context-aware prompt tuning (Blau et al. 2024; peft's ``CPTConfig``): the prompt is the word
embeddings of an in-context example (``cpt_token_ids``) plus a small trained change, kept inside a
per-token ball; the loss reads the example's own labels too, optionally decayed.

Tensors: ``embedding (n, d)`` (a buffer: the word embeddings of ``cpt_token_ids``, frozen) and
``delta_embedding (n, d)`` (zeros at init). The prompt is ``embedding + P(delta)`` where ``P``
scales each row into a ball of radius ``eps`` (``opt_projection_format_epsilon`` for template
tokens, types 1 and 3 mod 4; ``opt_projection_epsilon`` for input tokens, type 2 mod 4; 1e-10
else; both times ``sqrt(d / 2048)``). As in peft, the gradient goes through ``P`` as if it were the
identity (peft projects the parameter in place before each forward; here the forward projects
and the stored tensor is left alone: :func:`projected` gives peft's stored value) and only rows of
types 1, 2, 3 mod 4 get one (peft's backward hook).

With ``labels``, the loss is peft's ``CPTEmbedding.calculate_loss``: the example's token ids are
labels too, every position whose type (``cpt_tokens_type_mask`` for the prompt,
``input_type_mask`` for the input, shifted past the prompt's largest type) is a positive multiple
of 4 is a label, and ``opt_weighted_loss_type="decay"`` weights each label group by
``opt_loss_decay_factor ** k`` (``k``: the number of later groups). The mean is over the label
positions. peft stores ``embedding + P(delta)`` as ``prompt_embeddings``; it reads back as the
buffer, with a zero ``delta_embedding``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.prompts._contract import Geometry, InitInputs, PeftRecord, PromptMethod, TensorDict, word_rows
from lora_func.prompts.prompt_tuning import prompt_config

_MIN_EPSILON = 1e-10


def _shapes(n: int, options: Mapping[str, Any], geometry: Geometry):
    return (("delta_embedding", (n, geometry.token_dim)),), (("embedding", (n, geometry.token_dim)),)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _check(n: int, options: Mapping[str, Any]) -> list[str]:
    problems = []
    ids, mask, types = options["cpt_token_ids"], options["cpt_mask"], options["cpt_tokens_type_mask"]
    if not _is_int_list(ids) or not ids or any(i < 0 for i in ids):
        problems.append(f"cpt_token_ids={ids!r} must be a non-empty list of token ids (the in-context example)")
    for name, value in (("cpt_mask", mask), ("cpt_tokens_type_mask", types)):
        if value is not None and (not _is_int_list(value) or len(value) != len(ids or ())):
            problems.append(f"{name}={value!r} must be a list of integers, one per token of cpt_token_ids ({len(ids or ())})")
    if types is not None and _is_int_list(types) and any(t < 0 for t in types):
        problems.append(f"cpt_tokens_type_mask={types!r} must hold types >= 0")
    if options["opt_weighted_loss_type"] not in ("none", "decay"):
        problems.append(f"opt_weighted_loss_type={options['opt_weighted_loss_type']!r} is not one of ['none', 'decay']")
    for name in ("opt_loss_decay_factor", "opt_projection_epsilon", "opt_projection_format_epsilon"):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            problems.append(f"{name}={value!r} must be a positive number")
    return problems


def count(options: Mapping[str, Any]) -> int:
    """The number of virtual tokens: one per example token."""
    ids = options["cpt_token_ids"]
    return len(ids) if isinstance(ids, tuple) else 0


def _types(options: Mapping[str, Any]) -> tuple[int, ...]:
    return options["cpt_tokens_type_mask"] or (1,) * len(options["cpt_token_ids"])


def _init(inputs: InitInputs) -> tuple[TensorDict, TensorDict]:
    embedding = word_rows(inputs.word_embeddings, list(inputs.options["cpt_token_ids"])).to(inputs.dtype)
    return {"delta_embedding": torch.zeros_like(embedding)}, {"embedding": embedding}


def _epsilon(options: Mapping[str, Any], d: int) -> Tensor:
    """Each token's radius ``(n,)``, in float32 as peft computes it."""
    types = torch.tensor(_types(options), dtype=torch.long)
    scale = torch.sqrt(torch.tensor([d / 2048], dtype=torch.float32))
    epsilon = torch.full((len(types),), _MIN_EPSILON, dtype=torch.float32)
    kind = torch.remainder(types, 4)
    template = (types > 0) & ((kind == 1) | (kind == 3))
    epsilon[template] = (options["opt_projection_format_epsilon"] * scale).expand(int(template.sum()))
    inputs = (types > 0) & (kind == 2)
    epsilon[inputs] = (options["opt_projection_epsilon"] * scale).expand(int(inputs.sum()))
    return epsilon


def projected(delta: Tensor, options: Mapping[str, Any]) -> Tensor:
    """``P(delta)``: each row scaled into its ball (peft's ``get_projection``), no gradient."""
    delta = delta.detach()
    epsilon = _epsilon(options, delta.shape[-1]).to(device=delta.device)
    norm = torch.linalg.vector_norm(delta, dim=-1)
    eps = epsilon.to(norm.dtype)
    # Rows of norm 0 stay 0 (peft leaves them out; the factor would be 1 there).
    return delta * (eps / norm.clamp(min=eps)).unsqueeze(-1)


def trained_rows(options: Mapping[str, Any]) -> Tensor:
    """``(n,)`` 1 for the rows that get a gradient (types 1, 2, 3 mod 4), 0 else."""
    kind = torch.remainder(torch.tensor(_types(options), dtype=torch.long), 4)
    return ((kind == 1) | (kind == 2) | (kind == 3)).to(torch.float32)


def form(params: TensorDict, buffers: TensorDict, n: int, options: Mapping[str, Any], geometry: Geometry, task_ids: Tensor | None, training: bool) -> Tensor:
    """``(n, d)``: ``embedding + P(delta)``, the gradient through ``P`` as the identity on the
    trained rows and zero on the others."""
    delta = params["delta_embedding"]
    rows = trained_rows(options).to(device=delta.device, dtype=delta.dtype).unsqueeze(-1)
    return buffers["embedding"] + projected(delta, options) + (delta - delta.detach()) * rows


def loss(logits: Tensor, labels: Tensor, input_type_mask: Tensor | None, n: int, options: Mapping[str, Any]) -> Tensor:
    """peft's CPT loss of ``logits (B, n + T, V)`` for ``labels (B, T)`` and ``input_type_mask
    (B, T)`` (default: every input token of type 4)."""
    batch, length = labels.shape
    device = labels.device
    prefix_types = torch.tensor(_types(options), dtype=torch.long, device=device).expand(batch, n)
    if input_type_mask is None:
        input_type_mask = torch.full((batch, length), 4, dtype=torch.long, device=device)
    shifted = torch.where(input_type_mask > 0, input_type_mask + prefix_types.max(), input_type_mask).to(torch.long)
    types = torch.cat([prefix_types, shifted], dim=1)
    prefix_labels = torch.tensor(options["cpt_token_ids"], dtype=torch.long, device=device).expand(batch, n)
    is_label = (types > 0) & (types % 4 == 0)
    all_labels = torch.where(is_label, torch.cat([prefix_labels, labels], dim=1), torch.full_like(types, -100))
    shift_logits, shift_labels, shift_types = logits[:, :-1, :], all_labels[:, 1:], types[:, 1:]
    per_token = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), reduction="none", ignore_index=-100)
    per_token = per_token.reshape(shift_labels.shape)
    valid = shift_labels != -100
    weights = valid.to(torch.float32)
    if options["opt_weighted_loss_type"] == "decay":
        weights = weights * _decay(shift_types, options["opt_loss_decay_factor"])
    return (per_token * weights * valid).sum() / valid.sum()


def _decay(types: Tensor, factor: float) -> Tensor:
    """``(B, T)`` float32: at a label group's positions ``factor ** k``, ``k`` the number of label
    groups (distinct label types of the row) with a larger type; 1 elsewhere (peft's loop)."""
    is_label = (types > 0) & (types % 4 == 0)
    same = types.unsqueeze(-1) == types.unsqueeze(-2)  # (B, T, T)
    earlier = torch.ones_like(same[0]).tril(-1)
    first = is_label & ~(same & earlier & is_label.unsqueeze(-2)).any(-1)  # a group's first position
    later_groups = (first.unsqueeze(-2) & (types.unsqueeze(-2) > types.unsqueeze(-1))).sum(-1)  # (B, T)
    decay = torch.pow(torch.tensor(float(factor), dtype=torch.float64), later_groups.to(torch.float64))
    return torch.where(is_label, decay, torch.ones_like(decay)).to(torch.float32)


def _config(n: int, options: Mapping[str, Any], geometry: Geometry) -> dict[str, Any]:
    return prompt_config(n, geometry) | {
        "task_type": "CAUSAL_LM",  # peft's CPT refuses any other
        "num_layers": None,
        "token_dim": None,
        "num_attention_heads": None,
        "cpt_token_ids": list(options["cpt_token_ids"]),
        "cpt_mask": list(options["cpt_mask"] or (1,) * n),
        "cpt_tokens_type_mask": list(_types(options)),
        "opt_weighted_loss_type": options["opt_weighted_loss_type"],
        "opt_loss_decay_factor": options["opt_loss_decay_factor"],
        "opt_projection_epsilon": options["opt_projection_epsilon"],
        "opt_projection_format_epsilon": options["opt_projection_format_epsilon"],
    }


def _read_config(config: Mapping[str, Any], geometry: Geometry) -> tuple[int, dict[str, Any]]:
    options = {
        name: config[name]
        for name in ("cpt_token_ids", "cpt_mask", "cpt_tokens_type_mask", "opt_weighted_loss_type", "opt_loss_decay_factor",
                     "opt_projection_epsilon", "opt_projection_format_epsilon")
        if config.get(name) is not None
    }
    options["cpt_token_ids"] = tuple(options.get("cpt_token_ids") or (0,))  # peft's default
    return len(options["cpt_token_ids"]), options


PEFT = PeftRecord(
    peft_type="CPT",
    config=_config,
    read_config=_read_config,
    to_peft=lambda params, buffers, n, options, geometry: {"prompt_embeddings": form(params, buffers, n, options, geometry, None, False).detach()},
    from_peft=lambda tensors, n, options, geometry: (
        {"delta_embedding": torch.zeros_like(tensors["prompt_embeddings"])},
        {"embedding": tensors["prompt_embeddings"]},
    ),
)

METHOD = PromptMethod(
    name="cpt",
    entry="embeds",
    options={
        "cpt_token_ids": None,
        "cpt_mask": None,
        "cpt_tokens_type_mask": None,
        "opt_weighted_loss_type": "none",
        "opt_loss_decay_factor": 1.0,
        "opt_projection_epsilon": 0.1,
        "opt_projection_format_epsilon": 0.1,
    },
    check=_check,
    shapes=_shapes,
    init=_init,
    form=form,
    peft=PEFT,
    loss=loss,
    extra_inputs=("input_type_mask",),
    count=count,
)
