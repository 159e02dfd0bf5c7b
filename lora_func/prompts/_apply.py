"""A prompt applied to a model for one call or one ``with`` block, as peft applies it.

The model is never modified: a prompt reaches it through an
:class:`lora_func._application.Application` (so its changes are undone in ``finally`` and re-applied
when activation checkpointing recomputes), by its method's ``entry``:

- ``"embeds"`` and ``"kv"``: the model's own ``forward`` (the root module's, for the call) is
  wrapped to do what peft's ``PeftModelForCausalLM.forward`` does: the attention mask gets ``n``
  leading ones; ``"embeds"``: the input embeddings (the model's embedding module, so a
  weight-level adapter on it applies) get the ``n`` virtual-token embeddings in front, labels
  get ``n`` leading ``-100`` (position ids and token type ids are dropped, as peft drops them);
  ``"kv"``: the KV cache starts with the prefix (a ``transformers.DynamicCache``), position ids
  move by ``n``. A call whose cache already holds tokens is a decoding step: nothing is injected
  again, only the mask grows.
- ``"attention"``: each adapted attention module's ``forward`` is wrapped (LLaMA-Adapter's gated
  prompt attention).

``with lora_func.adapted(model, prompt)`` also wraps ``model.prepare_inputs_for_generation`` as
peft's ``PeftModelForCausalLM.prepare_inputs_for_generation`` does, so ``model.generate`` puts the
virtual tokens in the KV cache once (prefill) and extends the mask at every step.

One prompt per batch row (``mixed_call`` / ``mixed_adapted`` / ``mixed_call`` /
``ensemble_call`` with a stack of prompts): each row's prompt is computed from that row's member
(``vmap`` over the rows) and put in that row only.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_func._application import Application, active_applications, refuse_checkpointing_in_transform
from lora_func._model import base_params, check_base_params
from lora_func._tree import AdapterNode, walk
from lora_func.adapter import Combinator, Composed
from lora_func.checks import check_base
from lora_func.prompts._node import Prompt
from lora_func.prompts.build import embedding_weight, input_embeddings
from lora_func.quantized import frozen_forwards

__all__ = [
    "PREPARED",
    "PromptApplication",
    "contains_prompt",
    "mixed_prompt_application",
    "prompt_adapted",
    "prompt_call",
    "split_prompt",
]

# A key that the generation hook puts in the inputs it prepares, so that the wrapped forward
# passes them through as they are (the prompt is in them already); popped before the model sees it.
PREPARED = "_lora_func_prompt_prepared"


def contains_prompt(adapter: Any) -> bool:
    """Whether ``adapter`` (any adapter tree) holds a :class:`Prompt`. Called on every adapted
    call: a plain adapter answers at once (no parts), without a walk of the tree."""
    if isinstance(adapter, Prompt):
        return True
    return isinstance(adapter, AdapterNode) and any(contains_prompt(part) for part in adapter.parts)


def split_prompt(adapter: AdapterNode, where: str) -> tuple[Prompt, AdapterNode | None]:
    """``(the prompt, the weight-level rest or None)`` of a prompt or a ``compose`` of one prompt
    and weight-level adapters."""
    prompts = [node for _, node in walk(adapter) if isinstance(node, Prompt)]
    bad = [type(node).__name__ for _, node in walk(adapter) if isinstance(node, Combinator) and not isinstance(node, Composed)]
    if len(prompts) > 1 or bad:
        raise ValueError(  # error: prompt-composition
            f"{where}: an adapter may hold one prompt, composed (lora_func.compose) with weight-level adapters; got "
            f"{len(prompts)} prompts{' inside ' + ', '.join(sorted(set(bad))) if bad else ''}. Apply one prompt per call "
            f"(several prompts per batch: lora_func.mixed_call with a stack of prompts)"
        )
    return prompts[0], _without(adapter, prompts[0])


def _without(node: AdapterNode, prompt: Prompt) -> AdapterNode | None:
    if node is prompt:
        return None
    if not isinstance(node, Composed):
        return node
    parts = [rest for part in node.parts if (rest := _without(part, prompt)) is not None]
    return None if not parts else parts[0] if len(parts) == 1 else Composed(parts)


# ----------------------------------------------------------------------------- the prompt's values


def _repeat_rows(t: Tensor, batch: int, where: str) -> Tensor:
    """``t (R, ...)`` for ``batch = m * R`` rows laid out as ``repeat_interleave(m)`` (beams)."""
    rows = t.shape[0]
    if batch == rows:
        return t
    if rows == 0 or batch % rows:
        raise ValueError(  # error: prompt-rows
            f"{where}: the batch has {batch} rows but the per-row prompts (index) have {rows}; pass one index entry per "
            f"row (a multiple m * {rows} is read as repeat_interleave(m): num_beams, num_return_sequences)"
        )
    return t.repeat_interleave(batch // rows, dim=0)


class _State:
    """What the wrapped forwards read: the prompt (per row or not), whether a call's batch is
    per row, and the method."""

    def __init__(self, prompt: Prompt, rows: bool, where: str) -> None:
        self.prompt, self.rows, self.where = prompt, rows, where
        self.method = prompt.method
        self.n = prompt.spec.num_virtual_tokens
        self.options = dict(prompt.spec.options)

    def values(self, batch: int, task_ids: Tensor | None, training: bool) -> Tensor:
        """``(batch, n, width)``: every row's prompt (embeddings, or the flat KV prefix)."""
        prompt, method, n, options, geometry = self.prompt, self.method, self.n, self.options, self.prompt.geometry

        def one(params: dict[str, Tensor], buffers: dict[str, Tensor], task: Tensor | None) -> Tensor:
            return method.form(params, buffers, n, options, geometry, task, training)

        if task_ids is not None and task_ids.shape[0] != batch:
            task_ids = _repeat_rows(task_ids, batch, self.where)  # generate's beams: one task per input row
        if self.rows:
            params, buffers = ({k: _repeat_rows(v, batch, self.where) for k, v in d.items()} for d in (prompt.params, prompt.buffers))
            if task_ids is not None:
                return torch.vmap(one, in_dims=(0, 0, 0), randomness="different")(params, buffers, task_ids)
            return torch.vmap(lambda p, b: one(p, b, None), randomness="different")(params, buffers)
        out = one(prompt.params, prompt.buffers, task_ids)
        return out.expand(batch, *out.shape) if out.dim() == 2 else out

    def check_batch(self, batch: int) -> None:
        if self.rows:
            _repeat_rows(torch.empty(self.prompt.stack_shape[0], 0), batch, self.where)


def _kv_cache(flat: Tensor, prompt: Prompt) -> Any:
    """peft's ``get_prompt`` for prefix methods: the flat prefix ``(B, n, L * 2 * kv_dim)`` as a
    ``DynamicCache`` holding each layer's ``(B, kv_heads, n, head_dim)`` keys and values."""
    from transformers import DynamicCache

    g = prompt.geometry
    batch, n = flat.shape[:2]
    layers = flat.reshape(batch, n, g.num_layers * 2, g.kv_heads, g.head_dim).permute(2, 0, 3, 1, 4).split(2)
    return DynamicCache(layers)


def _cache_length(cache: Any) -> int:
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return int(cache[0][0].shape[-2])  # a legacy tuple


def _named(inner: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (positional ones named by the forward's signature)."""
    if not args:
        return dict(kwargs)
    names = [p.name for p in inspect.signature(inner).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _extended_mask(mask: Tensor, n: int) -> Tensor:
    return torch.cat([torch.ones(mask.shape[0], n, dtype=mask.dtype, device=mask.device), mask], dim=1)


def _drop(kw: dict[str, Any], name: str, message: str) -> None:
    if kw.get(name) is not None:
        warnings.warn(message, UserWarning, stacklevel=4)
    kw.pop(name, None)


def _root_forward(state: _State) -> Callable[..., Any]:
    """The model's forward with the prompt (``"embeds"`` / ``"kv"`` entries)."""

    def forward(module: nn.Module, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if kwargs.pop(PREPARED, False):
            return inner(*args, **kwargs)  # prepared by the generation hook: the prompt is in
        kw = _named(inner, args, kwargs)
        _check_call(module, state.prompt, kw, state.where)
        task_ids = kw.pop("task_ids", None)
        extra = {name: kw.pop(name, None) for name in state.method.extra_inputs}
        ids, embeds = kw.pop("input_ids", None), kw.pop("inputs_embeds", None)
        batch = (ids if ids is not None else embeds).shape[0]
        state.check_batch(batch)
        n = state.n
        decoding = _cache_length(kw.get("past_key_values")) > 0
        if kw.get("attention_mask") is not None:
            kw["attention_mask"] = _extended_mask(kw["attention_mask"], n)
        _drop(kw, "token_type_ids", "Token type ids are not supported for parameter efficient tuning. Ignoring token type ids")
        if state.method.entry == "kv":
            if kw.get("position_ids") is not None:
                kw["position_ids"] = kw["position_ids"] + n
            if not decoding:
                dtype = embedding_weight(module).dtype
                kw["past_key_values"] = _kv_cache(state.values(batch, None, module.training).to(dtype), state.prompt)
            return inner(input_ids=ids, inputs_embeds=embeds, **kw)
        _drop(kw, "position_ids", "Position ids are not supported for parameter efficient tuning. Ignoring position ids.")
        if decoding:  # the virtual tokens are in the cache already
            return inner(input_ids=ids, inputs_embeds=embeds, **kw)
        if embeds is None:
            embeds = input_embeddings(module)(ids)
        prompts = state.values(batch, task_ids, module.training).to(embeds.dtype)
        labels = kw.pop("labels", None)
        if labels is not None and state.method.loss is None:
            kw["labels"] = torch.cat([torch.full((batch, n), -100, dtype=labels.dtype, device=labels.device), labels], dim=1)
        out = inner(inputs_embeds=torch.cat([prompts, embeds], dim=1), **kw)
        if labels is not None and state.method.loss is not None:
            out["loss"] = state.method.loss(out.logits, labels, *extra.values(), n, state.options)
        return out

    return forward


def _attention_forwards(state: _State) -> dict[str, Callable[..., Any]]:
    """Each adapted attention module's forward (``"attention"`` entry)."""
    prompt = state.prompt
    out = {}
    for module_name in prompt.geometry.modules:
        values, gate = prompt.params[f"{module_name}.adaption_prompt"], prompt.params[f"{module_name}.adaption_gate"]
        if state.rows:  # (R, 1, n, hidden), (R, 1)
            values, gate = values.flatten(0, 1), gate.flatten(0, 1)

        def forward(module: nn.Module, inner: Callable[..., Any], *args: Any, _v: Tensor = values, _g: Tensor = gate, **kwargs: Any) -> Any:
            hidden = args[0] if args else kwargs["hidden_states"]
            state.check_batch(hidden.shape[0])
            return state.method.form(_v.to(hidden.dtype), _g.to(hidden.dtype), prompt.geometry, module, inner, args, kwargs)

        out[module_name] = forward
    return out


# ----------------------------------------------------------------------------- generation


def _prepare(state: _State, model: nn.Module, inner: Callable[..., Any]) -> Callable[..., Any]:
    """peft's ``PeftModelForCausalLM.prepare_inputs_for_generation`` around the model's own."""

    def prepare(*args: Any, task_ids: Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        _check_call(model, state.prompt, {"task_ids": task_ids}, state.where)
        model_kwargs = inner(*args, **kwargs)
        n, kv = state.n, state.method.entry == "kv"
        ids = model_kwargs.get("input_ids")
        if ids is None:
            raise ValueError(  # error: prompt-generate-embeds
                f"{state.where}: generate with a {state.prompt.spec.method} prompt takes input_ids (the prompt's virtual "
                f"tokens are put in front of their embeddings), not inputs_embeds"
            )
        cache = model_kwargs.get("past_key_values")
        if cache is not None and _cache_length(cache) >= ids.shape[1]:
            ids = model_kwargs["input_ids"] = ids[:, -1:]
        batch = ids.shape[0]
        state.check_batch(batch)
        mask = model_kwargs.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dim() != 2:
                raise ValueError(  # error: prompt-generate-mask
                    f"{state.where}: generate with a prompt needs a 2-D attention mask (batch, length); this cache "
                    f"prepared a {type(mask).__name__ if not isinstance(mask, Tensor) else f'{mask.dim()}-D'} one "
                    f"(a static or compiled cache): use the default dynamic cache"
                )
            model_kwargs["attention_mask"] = _extended_mask(mask, n)
        if kv and model_kwargs.get("position_ids") is not None:
            model_kwargs["position_ids"] = model_kwargs["position_ids"] + n
        elif model_kwargs.get("position_ids") is not None:
            model_kwargs["position_ids"] = None
        model_kwargs.pop("token_type_ids", None)
        if _cache_length(cache) == 0:  # prefill: the prompt goes in
            if kv:
                dtype = embedding_weight(model).dtype
                model_kwargs["past_key_values"] = _kv_cache(state.values(batch, None, model.training).to(dtype), state.prompt)
            else:
                embeds = input_embeddings(model)(ids)
                prompts = state.values(batch, task_ids, model.training).to(embeds.dtype)
                model_kwargs["inputs_embeds"] = torch.cat([prompts, embeds], dim=1)
                model_kwargs["input_ids"] = None
        if not kv:
            model_kwargs.pop("cache_position", None)
        model_kwargs[PREPARED] = True
        return model_kwargs

    # generate checks its keyword arguments against this signature (and, through **kwargs, the
    # forward's, which the wrapped forward hides): name them all, as peft's wrapper meets them.
    names = {**inspect.signature(inner).parameters, **inspect.signature(type(model).forward).parameters}
    keyword = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in names if name not in ("self", "args", "kwargs")]
    prepare.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # a function object takes any attribute; mypy knows none
        [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL), *keyword,
         *([] if "task_ids" in names else [inspect.Parameter("task_ids", inspect.Parameter.KEYWORD_ONLY, default=None)]),
         inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    )
    return prepare


class PromptApplication(Application):
    """An :class:`Application` that, where the prompt enters the inputs, also wraps the
    model's ``prepare_inputs_for_generation`` while applied (for ``model.generate``)."""

    def __init__(self, *args: Any, state: _State, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = state

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        if any(app is self for app in active_applications()):
            yield
            return
        with super().applied(), self._generation():
            wrapped = self.model.__dict__.get("forward") if "" in self.forwards else None
            if wrapped is not None:
                # generate reads the forward's signature (it makes position ids from the mask when
                # the forward takes them): the wrapper answers as the model's forward does.
                wrapped.__signature__ = inspect.signature(type(self.model).forward.__get__(self.model))
            yield

    @contextlib.contextmanager
    def _generation(self) -> Iterator[None]:
        model = self.model
        if self.state.method.entry == "attention" or not hasattr(model, "prepare_inputs_for_generation"):
            yield
            return
        own = model.__dict__.get("prepare_inputs_for_generation")
        inner = cast(Callable[..., Any], model.prepare_inputs_for_generation)
        model.__dict__["prepare_inputs_for_generation"] = _prepare(self.state, model, inner)
        try:
            yield
        finally:
            if own is None:
                model.__dict__.pop("prepare_inputs_for_generation", None)
            else:
                model.__dict__["prepare_inputs_for_generation"] = own


def _application(model: nn.Module, prompt: Prompt, rows: bool, params: Mapping[str, Tensor], where: str) -> PromptApplication:
    state = _State(prompt, rows, where)
    forwards = _attention_forwards(state) if state.method.entry == "attention" else {"": _root_forward(state)}
    modules = dict(model.named_modules())
    forwards = {**frozen_forwards(model, exclude=forwards, modules=modules), **forwards}
    return PromptApplication(model, params, forwards, trainable=tuple(prompt.params.values()), modules=modules, state=state)


def _detached(base: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``base`` detached, one object per object (tied names stay tied)."""
    seen: dict[int, Tensor] = {}
    return {key: seen.setdefault(id(t), t.detach() if t.requires_grad else t) for key, t in base.items()}


# ----------------------------------------------------------------------------- checks


def _check_call(model: nn.Module, prompt: Prompt, kwargs: Mapping[str, Any], where: str) -> None:
    """The call's prompt inputs, checked before any work."""
    method, spec = prompt.method, prompt.spec
    task_ids = kwargs.get("task_ids")
    problem = None
    if method.tasks and task_ids is None:
        problem = f"a {spec.method} prompt needs task_ids=... (a 1-D int tensor, one task per batch row)"
    elif not method.tasks and task_ids is not None:
        problem = f"task_ids are read by multitask prompts only; this prompt is {spec.method}"
    elif task_ids is not None:
        tasks = spec.option("num_tasks")
        if not isinstance(task_ids, Tensor) or task_ids.dtype not in (torch.int64, torch.int32) or task_ids.dim() != 1:
            problem = f"task_ids must be a 1-D int64/int32 tensor, got {repr(task_ids)[:200]}"
        elif not torch._C._functorch.is_functorch_wrapped_tensor(task_ids) and bool(((task_ids < 0) | (task_ids >= tasks)).any()):
            problem = f"task_ids {sorted(set(task_ids.tolist()))} must be in [0, num_tasks={tasks})"
    if problem is not None:
        raise ValueError(f"{where}: {problem} (task_ids: one task per batch row, for multitask prompts)")  # error: prompt-task-ids
    unread = sorted(name for name in ("input_type_mask",) if kwargs.get(name) is not None and name not in method.extra_inputs)
    if unread:
        raise ValueError(f"{where}: {unread} are read by CPT prompts only; this prompt is {spec.method}")  # error: prompt-extra-input
    if method.entry == "kv" and any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in model.modules()):
        raise ValueError(  # error: prompt-kv-checkpointing
            f"{where}: {spec.method} puts its prefix in the KV cache, which activation checkpointing would fill twice "
            f"(peft refuses it too); call model.gradient_checkpointing_disable(), or use prompt tuning"
        )


def _check_unstacked(prompt: Prompt, where: str) -> None:
    if prompt.stack_shape:
        raise ValueError(  # error: prompt-stacked-call
            f"{where}: the prompt is stacked (stack_shape {prompt.stack_shape}); one call applies one prompt. Run a stack "
            f"under torch.func.vmap (or lora_func.ensemble_call), or one prompt per row with lora_func.mixed_call"
        )


# ----------------------------------------------------------------------------- the entry points


def prompt_call(
    model: nn.Module,
    adapter: AdapterNode,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    base: Mapping[str, Tensor] | None,
    call_weights: Callable[..., Any],
    where: str = "adapted_call",
) -> Any:
    """``adapted_call`` of an adapter that holds a prompt: the prompt's application around the
    weight-level rest's ``adapted_call`` (``call_weights(rest, *args, **kwargs)``), or around the
    model reparametrized with the detached base (no ``.grad`` on the model)."""
    prompt, weights = split_prompt(adapter, where)
    _check_unstacked(prompt, where)
    _check_call(model, prompt, kwargs, where)
    refuse_checkpointing_in_transform(model)
    if weights is not None:
        with _application(model, prompt, False, {}, where).applied():
            return call_weights(weights, *args, **kwargs)
    if base is None:
        params = base_params(model)
    else:
        check_base(base, where)
        check_base_params(model, base)
        params = _detached(base)
    return _application(model, prompt, False, params, where)(*args, **kwargs)


@contextlib.contextmanager
def prompt_adapted(model: nn.Module, adapter: AdapterNode, weights_block: Callable[[AdapterNode], Any], where: str = "adapted") -> Iterator[nn.Module]:
    """``adapted`` of an adapter that holds a prompt: the weight-level rest's block
    (``weights_block(rest)``), the prompt's application and its generation hook."""
    prompt, weights = split_prompt(adapter, where)
    _check_unstacked(prompt, where)
    with contextlib.ExitStack() as stack:
        if weights is not None:
            stack.enter_context(weights_block(weights))
        stack.enter_context(_application(model, prompt, False, {}, where).applied())
        yield model


def mixed_prompt_application(
    model: nn.Module, adapters: Any, index: Any, base: Mapping[str, Tensor] | None, where: str, checked_index: Callable[[Any, int, str], Tensor]
) -> Application:
    """One prompt per batch row: ``adapters`` a stack of prompts (or a list of prompts of one
    spec), row ``b`` uses member ``index[b]`` (checked by ``checked_index(index, K, where)``)."""
    from lora_func.stacking import take

    if isinstance(adapters, (list, tuple)):
        if not all(isinstance(a, Prompt) for a in adapters):
            raise TypeError(f"{where}: a list of prompts must hold only lora_func Prompts, got {sorted({type(a).__name__ for a in adapters})}")  # error: prompt-mixed-list
        # Stacked with their history (not lora_func.stack's new leaves): gradients reach each listed prompt.
        adapters = Prompt.stack_members(list(adapters), new_leaves=False) if adapters and all(not a.stack_shape for a in adapters) else adapters
    if not isinstance(adapters, Prompt) or len(adapters.stack_shape) != 1:
        raise ValueError(  # error: prompt-mixed-not-stacked
            f"{where}: per-row prompts need one stack of prompts (lora_func.stack([p0, p1, ...]), stack_shape (K,)) or a "
            f"list of prompts of one spec, got {repr(adapters)[:200]}"
        )
    rows = cast(Prompt, take(adapters, checked_index(index, adapters.stack_shape[0], where)))
    if base is None:
        params = base_params(model)
    else:
        check_base(base, where)
        check_base_params(model, base)
        params = _detached(base)
    refuse_checkpointing_in_transform(model)
    return _application(model, rows, True, params, where)
