"""The prompt node: a leaf of the adapter tree whose tensors are inputs, not weights.

A :class:`Prompt` is a frozen pytree (torch and optree) like :class:`lora_func.Adapter`: its
tensors are the leaves (``params`` trainable, ``buffers`` frozen), its :class:`PromptSpec`, the
model's :class:`Geometry` and the tensor shapes are the context. So ``with_params``,
``torch.func.grad``, ``vmap`` over a stack (``lora_func.stack`` of prompts of one spec),
``take`` / ``unstack`` and ``compose`` with weight-level adapters work as for any adapter. It
adapts no layer weight: ``layers`` is empty, which the weight-level machinery reads as "nothing
here".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lora_func._tree import AdapterNode, static_field, tensor_dict
from lora_func.prompts._contract import Geometry, PromptMethod, Shapes
from lora_func.prompts._methods import get_method
from lora_func.prompts.spec import PromptSpec

__all__ = ["Prompt"]


class Prompt(AdapterNode, tag="prompt"):
    """A prompt (an input-level adapter): trainable ``params`` and frozen ``buffers`` (flat dicts
    of tensors named as its method's file says, e.g. ``{"embedding": (n, d)}`` for prompt
    tuning, ``"model.layers.1.self_attn.adaption_prompt"`` for adaption prompt), its
    :class:`PromptSpec` and the model's :class:`Geometry` (static).

    Build one with :func:`lora_func.init_prompt`; apply it with :func:`lora_func.adapted_call`
    or ``with lora_func.adapted(model, prompt): model.generate(...)``. Immutable:
    ``with_params`` returns a new one; the training idiom is the adapters' one::

        grads = torch.func.grad(lambda p: loss(prompt.with_params(p)))(prompt.params)

    The constructor checks every tensor's name and shape (after one common leading stack shape).
    """

    verb = "init_prompt"
    parts: ClassVar[tuple[AdapterNode, ...]] = ()  # a leaf
    layers: ClassVar[tuple] = ()  # no layer weight is adapted
    members: ClassVar[None] = None  # never rank-padded
    shared: ClassVar[None] = None
    params: dict[str, Tensor] = tensor_dict()
    buffers: dict[str, Tensor] = tensor_dict()
    spec: PromptSpec = static_field()
    geometry: Geometry = static_field()
    param_shapes: Shapes = static_field()
    buffer_shapes: Shapes = static_field()

    def __init__(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], spec: PromptSpec, geometry: Geometry) -> None:
        problems: list[str] = [] if isinstance(spec, PromptSpec) and isinstance(geometry, Geometry) else ["spec must be a PromptSpec and geometry a Geometry"]
        param_shapes: Shapes = ()
        buffer_shapes: Shapes = ()
        stacks = set()
        if not problems:
            param_shapes, buffer_shapes = get_method(spec.method).shapes(spec.num_virtual_tokens, dict(spec.options), geometry)
            for arg, flat, shapes in (("params", params, param_shapes), ("buffers", buffers, buffer_shapes)):
                names = [name for name, _ in shapes]
                if not isinstance(flat, Mapping) or sorted(flat) != sorted(names):
                    problems.append(f"{arg} must hold exactly {names}, got {sorted(flat) if isinstance(flat, Mapping) else type(flat).__name__}")
                    continue
                for name, shape in shapes:
                    value = flat[name]
                    got = tuple(value.shape) if isinstance(value, Tensor) else None
                    if got is None or len(got) < len(shape) or got[len(got) - len(shape) :] != shape:
                        problems.append(f"{arg}[{name!r}] must be a tensor of shape (..., {shape}), got {got or type(value).__name__}")
                    elif arg == "params" and (not value.is_floating_point() or value.dtype != spec.dtype):
                        problems.append(f"{arg}[{name!r}] is {value.dtype}, the spec's dtype is {spec.dtype}")
                    else:
                        stacks.add(got[: len(got) - len(shape)])
        if len(stacks) > 1:
            problems.append(f"the tensors have different leading stack shapes {sorted(stacks)}")
        if problems:
            raise ValueError(  # error: prompt-init-tensors
                f"Prompt(params, buffers, spec, geometry): {'; '.join(problems)}; build prompts with "
                f"lora_func.init_prompt(model, spec) and new values with prompt.with_params(params)"
            )
        built = self._unchecked(params, buffers, spec, geometry, param_shapes, buffer_shapes)
        for name in self.fields:
            object.__setattr__(self, name, getattr(built, name))

    @classmethod
    def _unchecked(cls, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], spec: PromptSpec, geometry: Geometry,
                   param_shapes: Shapes, buffer_shapes: Shapes) -> Prompt:
        return cls._build(params=dict(params), buffers=dict(buffers), spec=spec, geometry=geometry,
                          param_shapes=param_shapes, buffer_shapes=buffer_shapes)

    def _rebuilt(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor]) -> Prompt:
        return self._unchecked(params, buffers, self.spec, self.geometry, self.param_shapes, self.buffer_shapes)

    @property
    def method(self) -> PromptMethod:
        return get_method(self.spec.method)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.spec.options)

    def with_params(self, params: Mapping[str, Tensor]) -> Prompt:
        """A new prompt with these trainable tensors (the keys of ``self.params``)."""
        if sorted(params) != sorted(self.params):
            missing, unexpected = sorted(set(self.params) - set(params)), sorted(set(params) - set(self.params))
            raise KeyError(f"Prompt.with_params: missing keys {missing}, unexpected keys {unexpected}")  # error: prompt-keys
        return self._rebuilt(params, self.buffers)

    def with_buffers(self, buffers: Mapping[str, Tensor]) -> Prompt:
        if sorted(buffers) != sorted(self.buffers):
            missing, unexpected = sorted(set(self.buffers) - set(buffers)), sorted(set(buffers) - set(self.buffers))
            raise KeyError(f"Prompt.with_buffers: missing keys {missing}, unexpected keys {unexpected}")  # error: prompt-buffer-keys
        return self._rebuilt(self.params, buffers)

    def detach(self) -> Prompt:
        """The same values as new leaf tensors in new storage (params requiring grad)."""
        return self._rebuilt(
            {k: v.detach().clone().requires_grad_(True) for k, v in self.params.items()},
            {k: v.detach().clone() for k, v in self.buffers.items()},
        )

    def num_parameters(self) -> int:
        return sum(int(torch.Size(shape).numel()) for _, shape in self.param_shapes)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Leading stack dims (``()`` for one prompt, ``(K,)`` after ``stack``)."""
        for flat, shapes in ((self.params, self.param_shapes), (self.buffers, self.buffer_shapes)):
            for name, shape in shapes:
                tensor = flat[name]
                return tuple(tensor.shape[: tensor.dim() - len(shape)])
        return ()

    @classmethod
    def stack_members(cls, members: Sequence[Prompt], *, new_leaves: bool = True) -> Prompt:
        """The prompts ``members`` (one spec and geometry, unstacked) along a new leading axis
        (:func:`lora_func.stack`); plain leaf params give new leaves that require grad unless
        ``new_leaves=False`` (the stack then keeps the members' autograd history)."""
        first = members[0]
        odd = [i for i, m in enumerate(members) if (m.spec, m.geometry) != (first.spec, first.geometry) or m.stack_shape]
        if odd:
            raise ValueError(  # error: prompt-stack-mismatch
                f"stack(): prompts {odd[:5]} have another spec or model than prompt 0 ({first.spec.method}, "
                f"{first.spec.num_virtual_tokens} tokens) or are stacked already; stack unstacked prompts of one PromptSpec and model"
            )
        plain = all(t.is_leaf and not torch._C._functorch.is_functorch_wrapped_tensor(t) for m in members for t in m.params.values())
        params = {k: torch.stack([m.params[k] for m in members]) for k in first.params}
        if plain and new_leaves:
            params = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        return first._rebuilt(params, {k: torch.stack([m.buffers[k] for m in members]) for k in first.buffers})

    def __getattr__(self, name: str) -> Any:
        # Only for names a Prompt lacks: code written for weight-level adapters (merge_overlay,
        # merged_state_dict, adapter_summary, ...) reads variant, member_shared, spec.targets.
        raise AttributeError(  # error: prompt-weight-level
            f"Prompt has no {name!r}: a prompt is an input-level adapter and adapts no layer weight, so weight-level "
            f"functions (merge_overlay, overlay, merged_state_dict, merge_adapters) do not take it; "
            f"apply it with lora_func.adapted_call or lora_func.adapted (docs/prompts.md)"
        )

    def __repr__(self) -> str:
        stacked = f", stack_shape={self.stack_shape}" if self.stack_shape else ""
        return f"Prompt(method={self.spec.method!r}, num_virtual_tokens={self.spec.num_virtual_tokens}, params={self.num_parameters()}{stacked})"
