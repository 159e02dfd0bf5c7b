"""Multitask prompt tuning (Wang et al. 2023; peft's ``MultitaskPromptTuningConfig``): one shared
prompt, scaled elementwise per task by a rank-``num_ranks`` matrix; each batch row picks its task
with ``task_ids``.

Tensors: ``embedding (n, d)`` (the shared prompt), ``prefix_task_cols (num_tasks, n, r)`` and
``prefix_task_rows (num_tasks, r, d)``. Row ``b``'s prompt is
``embedding * (prefix_task_cols[t] @ prefix_task_rows[t])`` with ``t = task_ids[b]``.
Inits, as peft's ``prompt_tuning_init``: ``"random"`` and ``"text"`` (prompt tuning's, for the
shared prompt; the task factors normal with std 0.02, draw for draw), and from a source prompt
(``source=`` a multitask prompt, e.g. ``load_peft`` of the source training's checkpoint):
``"average_source_tasks"`` (the source's prompt, its task factors averaged over tasks),
``"exact_source_task"`` (the source's prompt and task ``init_task``'s factors),
``"only_source_shared"`` (the source's prompt, new task factors). peft stores
``prompt_embeddings``, ``prefix_task_cols`` and ``prefix_task_rows``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lora_func.prompts._contract import Geometry, InitInputs, PeftRecord, PromptMethod, TensorDict
from lora_func.prompts.prompt_tuning import check_init, embedding_init, prompt_config, read_n

SOURCE_INITS = ("average_source_tasks", "exact_source_task", "only_source_shared")
INITS = ("random", "text", *SOURCE_INITS)


def _shapes(n: int, options: Mapping[str, Any], geometry: Geometry):
    tasks, ranks = options["num_tasks"], options["num_ranks"]
    return (
        ("embedding", (n, geometry.token_dim)),
        ("prefix_task_cols", (tasks, n, ranks)),
        ("prefix_task_rows", (tasks, ranks, geometry.token_dim)),
    ), ()


def _check(n: int, options: Mapping[str, Any]) -> list[str]:
    problems = check_init(options, INITS)
    for name in ("num_tasks", "num_ranks"):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be an integer >= 1")
    task = options["init_task"]
    if isinstance(task, bool) or not isinstance(task, int) or task < 0:
        problems.append(f"init_task={task!r} must be an integer >= 0 (a task of the source prompt)")
    if options["init"] in ("average_source_tasks", "exact_source_task") and options["num_tasks"] != 1:
        problems.append(f"init={options['init']!r} gives one task's factors: num_tasks must be 1, got {options['num_tasks']!r}")
    return problems


def _init(inputs: InitInputs) -> tuple[TensorDict, TensorDict]:
    options, g = inputs.options, inputs.generator
    # peft builds the PromptEmbedding first (its draws), then the task factors.
    embedding = embedding_init(inputs) if options["init"] in ("random", "text") else embedding_init_random(inputs)
    shapes = dict(_shapes(inputs.n, options, inputs.geometry)[0])
    cols = torch.empty(shapes["prefix_task_cols"], dtype=torch.float32).normal_(0.0, 0.02, generator=g)
    rows = torch.empty(shapes["prefix_task_rows"], dtype=torch.float32).normal_(0.0, 0.02, generator=g)
    source = inputs.source
    if options["init"] in SOURCE_INITS:
        assert source is not None  # init_prompt checks
        embedding = source["embedding"].detach().clone()
        if options["init"] == "average_source_tasks":
            cols, rows = (source[k].detach().mean(0, keepdim=True).clone() for k in ("prefix_task_cols", "prefix_task_rows"))
        elif options["init"] == "exact_source_task":
            task = options["init_task"]
            cols, rows = (source[k].detach()[task : task + 1].clone() for k in ("prefix_task_cols", "prefix_task_rows"))
    params = {"embedding": embedding, "prefix_task_cols": cols, "prefix_task_rows": rows}
    return {k: v.to(inputs.dtype) for k, v in params.items()}, {}


def embedding_init_random(inputs: InitInputs) -> Tensor:
    """The shared prompt's random draw (peft draws it before loading the source over it)."""
    return embedding_init(replace(inputs, options={**inputs.options, "init": "random"}))


def form(params: TensorDict, buffers: TensorDict, n: int, options: Mapping[str, Any], geometry: Geometry, task_ids: Tensor | None, training: bool) -> Tensor:
    """``(B, n, d)`` for ``task_ids (B,)`` (``(n, d)`` for a 0-d task id): peft's
    ``MultitaskPromptEmbedding.forward``."""
    assert task_ids is not None  # the call checks
    cols = params["prefix_task_cols"][task_ids]
    rows = params["prefix_task_rows"][task_ids]
    return params["embedding"] * torch.matmul(cols, rows)


PEFT = PeftRecord(
    peft_type="MULTITASK_PROMPT_TUNING",
    config=lambda n, options, geometry: prompt_config(n, geometry)
    | {"prompt_tuning_init": "RANDOM", "num_tasks": options["num_tasks"], "num_ranks": options["num_ranks"]},
    read_config=lambda config, geometry: (
        read_n(config),
        {"init": "random", "num_tasks": int(config.get("num_tasks", 1)), "num_ranks": int(config.get("num_ranks", 1))},
    ),
    to_peft=lambda params, buffers, n, options, geometry: {
        "prompt_embeddings": params["embedding"],
        "prefix_task_cols": params["prefix_task_cols"],
        "prefix_task_rows": params["prefix_task_rows"],
    },
    from_peft=lambda tensors, n, options, geometry: (
        {"embedding": tensors["prompt_embeddings"], "prefix_task_cols": tensors["prefix_task_cols"], "prefix_task_rows": tensors["prefix_task_rows"]},
        {},
    ),
)

METHOD = PromptMethod(
    name="multitask_prompt_tuning",
    entry="embeds",
    options={"init": "random", "init_text": None, "num_tasks": 1, "num_ranks": 1, "init_task": 0},
    check=_check,
    shapes=_shapes,
    init=_init,
    form=form,
    peft=PEFT,
    tasks=True,
)
