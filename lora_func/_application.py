"""Putting an adapter on a model for one call, and again for every recompute of that call.

An :class:`Application` is what one adapted forward changes on the model, as data: a parameter
dict to reparametrize the model with (the overlay route: detached base tensors, stand-ins or
merged weights), and per target module a replacement ``forward`` (the module-call route: the
variant applied to whatever tensor the module holds when it is called). :meth:`Application.applied`
puts both on the model and takes them off in ``finally``; nothing stays on the model.

Activation checkpointing runs part of the forward a second time during backward, long after
the call that applied the adapter returned. So while an application is active, every
``torch.utils.checkpoint`` region entered in this thread gets its function wrapped to apply
the same application again around the recompute (the wrapper lives in the checkpoint's own
saved state, as long as backward may need it). This covers HF gradient checkpointing
(reentrant and not) and ``torch.utils.checkpoint`` around user blocks, however imported: the
hook sits in the two names every ``checkpoint`` call looks up in ``torch.utils.checkpoint``
(``_checkpoint_without_reentrant_generator`` and ``CheckpointFunction``). It is put there when
an application starts and torch's own are put back when the last active one (in any thread)
ends; in a thread with no active application it passes the function through untouched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint
from torch import Tensor, nn

__all__ = ["Application", "active_applications", "refuse_checkpointing_in_transform"]

_state = threading.local()


def active_applications() -> tuple[Application, ...]:
    """The applications active in this thread, outermost first."""
    return getattr(_state, "active", ())


class Application:
    """One adapted call's changes to ``model``; see the module docstring.

    Args:
      model: the model.
      params: name -> tensor to reparametrize the model with while applied (as
        ``functional_call``: tied names must map to one object).
      forwards: module name -> ``forward(module, inner_forward, *args, **kwargs)``, run in place
        of the module's forward while applied; ``inner_forward`` is what the module would have
        run (its class's forward, or an instance-level one somebody else installed).
      trainable: the adapter tensors that may need gradients; used to refuse a reentrant
        checkpoint region that would silently give them none.
      modules: ``dict(model.named_modules())`` when the caller has it already.
    """

    def __init__(
        self,
        model: nn.Module,
        params: Mapping[str, Tensor],
        forwards: Mapping[str, Callable[..., Any]],
        trainable: tuple[Tensor, ...] = (),
        modules: Mapping[str, nn.Module] | None = None,
    ) -> None:
        self.model = model
        self.params = dict(params)
        self.forwards = dict(forwards)
        self.trainable = trainable
        if self.forwards:
            modules = dict(model.named_modules()) if modules is None else modules
            self.modules = {name: modules[name] for name in self.forwards}
        else:
            self.modules = {}

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Apply for the duration of the block; a no-op when already applied in this thread (the
        forward of a checkpoint region that the hook wrapped)."""
        active = active_applications()
        if any(app is self for app in active):
            yield
            return
        _state.active = (*active, self)
        try:
            with (
                _checkpoint_hook(),
                torch.nn.utils.stateless._reparametrize_module(self.model, self.params, tie_weights=True, strict=False),
                self._forwards_installed(),
            ):
                yield
        finally:
            _state.active = active

    @contextlib.contextmanager
    def _forwards_installed(self) -> Iterator[None]:
        saved: dict[str, Any] = {}
        try:
            for name, module in self.modules.items():
                own = module.__dict__.get("forward")
                saved[name] = own
                inner = own if own is not None else type(module).forward.__get__(module)
                module.__dict__["forward"] = _bound_forward(self.forwards[name], module, inner)
        finally:
            try:
                yield
            finally:
                for name, own in saved.items():
                    module = self.modules[name]
                    if own is None:
                        module.__dict__.pop("forward", None)
                    else:
                        module.__dict__["forward"] = own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.applied():
            return self.model(*args, **kwargs)


def _bound_forward(forward: Callable[..., Any], module: nn.Module, inner: Callable[..., Any]) -> Callable[..., Any]:
    def adapted_forward(*args: Any, **kwargs: Any) -> Any:
        return forward(module, inner, *args, **kwargs)

    return adapted_forward


# ------------------------------------------------------------------ activation checkpointing


def refuse_checkpointing_in_transform(model: nn.Module | None = None) -> None:
    """Raise when activation checkpointing would run inside a ``torch.func`` transform.

    With ``model``: when HF gradient checkpointing is on in a module in training mode, or HF's
    input-requires-grad hook is set (checked at the call's boundary, before HF's hooks fail less
    clearly); without: always (a ``torch.utils.checkpoint`` region is being entered)."""
    if not torch.is_grad_enabled() or not torch._C._functorch.get_interpreter_stack():
        return
    # HF's enable_input_require_grads (set up for reentrant checkpointing) calls requires_grad_
    # in a forward hook, which torch.func refuses as well, less clearly.
    if (
        model is not None
        and getattr(model, "_require_grads_hook", None) is None
        and not any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in model.modules())
    ):
        return
    raise RuntimeError(  # error: checkpoint-in-transform
        "activation checkpointing inside a torch.func transform (grad, vmap, ...) with an adapter applied: "
        "torch's checkpoint relies on saved-tensor hooks or an autograd.Function that torch.func does not "
        "support, so the recompute could not be done. Train with loss.backward() and a torch optimiser "
        "(lora_func.train.train_step does), or switch checkpointing off for the torch.func idiom "
        "(model.gradient_checkpointing_disable(), then model.disable_input_require_grads(): its hook fails under "
        "torch.func too)"
    )


def _rebound(function: Callable[..., Any], reentrant: bool, args: tuple) -> Callable[..., Any]:
    """``function`` wrapped to re-apply this thread's active applications around every call."""
    apps = active_applications()
    if not apps or not torch.is_grad_enabled():
        return function
    refuse_checkpointing_in_transform()
    if (
        reentrant
        and any(t.requires_grad for app in apps for t in app.trainable)
        and not any(isinstance(a, Tensor) and a.requires_grad for a in args)
    ):
        raise RuntimeError(  # error: checkpoint-reentrant-no-grad
            "reentrant activation checkpointing (use_reentrant=True) of a block whose inputs do not require "
            "grad: the adapter inside the block would get no gradient. Call model.enable_input_require_grads() "
            "(as peft does), or use use_reentrant=False"
        )

    def with_adapter(*a: Any, **k: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for app in apps:
                stack.enter_context(app.applied())
            return function(*a, **k)

    return with_adapter


_hook_lock = threading.Lock()
_hook_users = 0  # applications active in any thread; the hook is in place while there is one
_hooks: tuple[Any, Any, Any, Any] | None = None  # (original generator, original class, ours, ours)


def _make_hooks() -> tuple[Any, Any, Any, Any]:
    without_reentrant = _checkpoint._checkpoint_without_reentrant_generator
    reentrant = _checkpoint.CheckpointFunction

    def checkpoint_without_reentrant(function: Callable[..., Any], preserve: bool, context_fn: Any, *rest: Any, **kwargs: Any):
        return without_reentrant(_rebound(function, False, ()), preserve, context_fn, *rest, **kwargs)

    class AdaptedCheckpointFunction(reentrant):  # type: ignore[misc, valid-type]  # a class looked up at run time
        # apply, not forward: under torch.func, Function.apply refuses before forward runs,
        # and the refusal must be ours (it says what to do).
        @classmethod
        def apply(cls, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            return reentrant.apply(_rebound(run_function, True, args), preserve_rng_state, *args)

    return without_reentrant, reentrant, checkpoint_without_reentrant, AdaptedCheckpointFunction


@contextlib.contextmanager
def _checkpoint_hook() -> Iterator[None]:
    """Route both of ``torch.utils.checkpoint``'s implementations through :func:`_rebound` while
    an application is active in any thread (inert in threads with none), and put torch's own back
    when the last one ends: outside adapted calls ``torch.utils.checkpoint`` is untouched. Not
    under ``torch.compile`` tracing: dynamo traces checkpointed regions itself."""
    global _hook_users, _hooks
    if torch.compiler.is_compiling():
        yield
        return
    with _hook_lock:
        if _hook_users == 0:
            if _hooks is None or _checkpoint.CheckpointFunction is not _hooks[1]:
                _hooks = _make_hooks()  # (again, if somebody replaced torch's since)
            # setattr: replacing a module's function and class (what the module docstring explains).
            setattr(_checkpoint, "_checkpoint_without_reentrant_generator", _hooks[2])  # noqa: B010
            setattr(_checkpoint, "CheckpointFunction", _hooks[3])  # noqa: B010
        _hook_users += 1
    try:
        yield
    finally:
        with _hook_lock:
            _hook_users -= 1
            if _hook_users == 0 and _hooks is not None:
                # Put back what was there, unless somebody replaced ours meanwhile.
                if _checkpoint._checkpoint_without_reentrant_generator is _hooks[2]:
                    setattr(_checkpoint, "_checkpoint_without_reentrant_generator", _hooks[0])  # noqa: B010
                if _checkpoint.CheckpointFunction is _hooks[3]:
                    setattr(_checkpoint, "CheckpointFunction", _hooks[1])  # noqa: B010
