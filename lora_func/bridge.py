"""An adapted model as an ``nn.Module``, for frameworks that train modules: HF ``Trainer``,
``accelerate``, torch DDP, Lightning.

The base model stays outside the module tree: its tensors are not parameters of the bridge, so
they get no gradients, no optimiser state, and are never saved; only the adapter is. The
forward is :func:`lora_func.adapted_call` with the bridge's current parameters, so the model is
as untouched as with the functional API.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from pathlib import Path
from typing import Any, cast

from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from lora_func.adapter import AdapterLike
from lora_func.checks import check_model_and_adapter
from lora_func.call import adapted_call
from lora_func.io import load, load_peft, peft_problems, save, save_peft

__all__ = ["NATIVE_FILE", "AdaptedModule", "as_module"]

NATIVE_FILE = "adapter.safetensors"  # save_pretrained's file for adapters peft cannot express
_PEFT_CONFIG = "adapter_config.json"
# Trainer(resume_from_checkpoint=...) reloads a non-peft module only through a sharded-checkpoint
# index naming its state-dict keys; this small file and index are that, for the bridge's tensors.
_RESUME_FILE = "bridge_parameters.safetensors"
_RESUME_INDEX = "model.safetensors.index.json"


def _encode(key: str) -> str:
    # nn.ParameterDict forbids "." in names; "-" never occurs in transformers module names.
    return key.replace(".", "-")


def _parameter_names(keys: list[str]) -> dict[str, str]:
    """``bridge parameter name -> adapter key``; positional names only if ``-`` made two keys equal."""
    names = {_encode(k): k for k in keys}
    return names if len(names) == len(keys) else {f"p{i}": k for i, k in enumerate(keys)}


def _hf(model: nn.Module) -> PreTrainedModel:
    """The base as the transformers model whose methods the bridge forwards to (checkpointing,
    the input embeddings): only called when the base has them."""
    return cast(PreTrainedModel, model)


class AdaptedModule(PreTrainedModel):
    """``model`` with ``adapter`` applied, as a module whose parameters are the adapter's
    trainable tensors (see :func:`as_module`).

    A ``PreTrainedModel`` so that ``transformers.Trainer`` saves it with :meth:`save_pretrained`
    (the adapter) instead of a state dict; nothing else of ``PreTrainedModel`` is relied on.
    """

    config_class = PreTrainedConfig
    base_model_prefix = ""
    _no_split_modules: list[str] = []
    # The base model computes attention, not the bridge: whatever it was configured with
    # PreTrainedModel.__init__ must accept (it refuses e.g. sdpa for a class without these).
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    # Set in __init__ past nn.Module.__setattr__ (not submodules: see there).
    base: nn.Module
    _template: AdapterLike
    names: dict[str, str]

    def __new__(cls, model: nn.Module, *args: Any, **kwargs: Any) -> AdaptedModule:
        # Trainer reads the labels a model takes and whether it can return a loss from its
        # *class*'s forward signature (find_labels, can_return_loss): each bridge is an instance
        # of a subclass whose forward has the base model's signature, named after the base
        # class (``AdaptedLlamaForCausalLM``).
        if cls is AdaptedModule:
            cls = _bridge_class(model)
        return super().__new__(cls)

    def __init__(self, model: nn.Module, adapter: AdapterLike) -> None:
        config = getattr(model, "config", None)
        # A copy: PreTrainedModel.__init__ may adjust the config (attention implementation),
        # and the user's model must not change.
        super().__init__(copy.deepcopy(config) if isinstance(config, PreTrainedConfig) else PreTrainedConfig())
        # What Trainer reads from the model it trains, forwarded from the base: the loss type
        # (a causal LM's loss shifts labels, so Trainer counts labels[..., 1:] for
        # num_items_in_batch), whether forward takes loss kwargs (then Trainer passes
        # num_items_in_batch and does not divide by the accumulation steps itself), the main
        # input's name.
        # (transformers declares loss_type a str; a model without one holds None, as here.)
        object.__setattr__(self, "loss_type", getattr(model, "loss_type", None))
        if hasattr(model, "accepts_loss_kwargs"):
            self.accepts_loss_kwargs = model.accepts_loss_kwargs
        self.main_input_name = getattr(model, "main_input_name", self.main_input_name)
        # Not a submodule (plain attribute set past nn.Module.__setattr__): the base's tensors
        # must not be parameters of the bridge.
        object.__setattr__(self, "base", model)
        object.__setattr__(self, "_template", adapter)
        object.__setattr__(self, "names", _parameter_names(list(adapter.params)))
        by_key = {key: name for name, key in self.names.items()}
        # nn.Parameter(t.detach()) shares t's storage: training the bridge moves the adapter the
        # user passed, as a torch.optim optimiser over adapter.params would.
        self.adapter_params = nn.ParameterDict(
            {by_key[key]: nn.Parameter(tensor.detach(), requires_grad=True) for key, tensor in adapter.params.items()}
        )

    @property
    def adapter(self) -> AdapterLike:
        """The adapter with the bridge's current parameters (the same tensor objects), keyed by
        the adapter's own names; ``lf.save(bridge.adapter, path)`` and every lora_func function
        take it."""
        return self._template.with_params({self.names[name]: p for name, p in self.adapter_params.items()})

    def _adapted_forward(self, *args: Any, **kwargs: Any) -> Any:
        return adapted_call(self.base, self.adapter, *args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> AdaptedModule:
        # .to(device) / .cuda() move the base too, as if it were a submodule.
        self.base._apply(fn, recurse)
        return super()._apply(fn, recurse)

    # Checkpointing is the base model's (HF's own layers): the bridge's forward is adapted_call,
    # which re-applies the adapter in every recompute.
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, *args: Any, **options: Any) -> None:
        if not self.base.training:
            # The bridge never changes the base's mode, and HF checkpoints only in training mode:
            # enabling it on an eval-mode base would silently checkpoint nothing.
            raise ValueError(  # error: bridge-checkpointing-eval-base
                f"activation checkpointing through the bridge: the base {type(self.base).__name__} is in eval mode, and "
                f"HF checkpoints only in training mode (the bridge never changes the base's mode); call model.train() on "
                f"the base model first"
            )
        _hf(self.base).activation_checkpointing_enable(activation_checkpointing_kwargs, *args, **options)

    def activation_checkpointing_disable(self) -> None:
        _hf(self.base).activation_checkpointing_disable()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **options: Any) -> None:
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **options)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    def get_input_embeddings(self) -> nn.Module:
        return _hf(self.base).get_input_embeddings()

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, *ignored_args: Any, **ignored: Any) -> Path:
        """Write the adapter, nothing of the base: peft's format (``adapter_config.json`` +
        ``adapter_model.safetensors``, :func:`lora_func.save_peft`) when peft has the variant,
        else ``adapter.safetensors`` (:func:`lora_func.save`). ``transformers.Trainer`` calls it
        for ``save_model`` and for every checkpoint (its ``state_dict=`` is ignored: the
        adapter is the state). The bridge's parameters are also written under their own names
        with a ``model.safetensors.index.json`` (a few KB: the adapter again), the one form
        ``Trainer(resume_from_checkpoint=...)`` reloads into a module that is not a peft model."""
        directory = Path(save_directory)
        if not is_main_process:
            return directory
        adapter = self.adapter
        detached = adapter.with_params({k: v.detach() for k, v in adapter.params.items()})
        if peft_problems(detached, model=self.base):
            # What peft cannot express (antipasto, combine, hra/delora on Conv1D, tied targets):
            # the native format has everything.
            directory.mkdir(parents=True, exist_ok=True)
            save(detached, directory / NATIVE_FILE)
        else:
            save_peft(detached, directory, model=self.base)
        tensors = {f"adapter_params.{name}": p.detach().contiguous() for name, p in self.adapter_params.items()}
        save_file(tensors, str(directory / _RESUME_FILE), metadata={"format": "pt"})
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": dict.fromkeys(tensors, _RESUME_FILE),
        }
        (directory / _RESUME_INDEX).write_text(json.dumps(index, indent=1))
        return directory

    @classmethod
    def from_pretrained(cls, save_directory: str | os.PathLike, *, model: nn.Module, **ignored: Any) -> AdaptedModule:  # type: ignore[override]  # model= is required: the base is not in the checkpoint
        """The bridge over ``model`` with the adapter that :meth:`save_pretrained` (or peft)
        wrote to ``save_directory``."""
        directory = Path(save_directory)
        if (directory / _PEFT_CONFIG).is_file():
            return cls(model, load_peft(directory, model))
        if (directory / NATIVE_FILE).is_file():
            return cls(model, load(directory / NATIVE_FILE, model=model))
        raise FileNotFoundError(  # error: bridge-no-adapter-files
            f"AdaptedModule.from_pretrained: {directory} holds neither {_PEFT_CONFIG} (peft format) nor "
            f"{NATIVE_FILE}; pass the directory that save_pretrained or Trainer.save_model wrote"
        )


def _bridge_class(model: nn.Module) -> type[AdaptedModule]:
    """A subclass of :class:`AdaptedModule` whose ``forward`` has ``model.forward``'s signature:
    Trainer drops every batch column that is not a forward argument (it finds nothing in
    ``(*args, **kwargs)``) and looks for label arguments on the class."""

    def forward(self: AdaptedModule, *args: Any, **kwargs: Any) -> Any:
        return self._adapted_forward(*args, **kwargs)

    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C forward: keep (*args, **kwargs)
        signature = None
    if signature is not None:
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        vars(forward)["__signature__"] = signature.replace(parameters=[self_param, *signature.parameters.values()])  # what inspect reads
    name = f"Adapted{type(model).__name__}"
    return type(name, (AdaptedModule,), {"forward": forward, "__module__": __name__, "__qualname__": name})


def as_module(model: nn.Module, adapter: AdapterLike) -> AdaptedModule:
    """``model`` with ``adapter`` applied, as an ``nn.Module`` for module-based training
    frameworks (HF ``Trainer``, ``accelerate``, DDP, Lightning)::

        bridge = lf.as_module(model, adapter)
        Trainer(model=bridge, args=args, train_dataset=data).train()
        trained = bridge.adapter

    Its parameters are exactly the adapter's trainable tensors (sharing their storage, named
    like the adapter's keys with ``.`` -> ``-``: ``bridge.names`` maps back); the base model
    is not a submodule, so its tensors get no gradient, no optimiser state and are not saved.
    ``bridge(...)`` is ``lora_func.adapted_call(model, bridge.adapter, ...)``; ``.to()`` moves
    the base too (a device move you ask for), while ``.train()`` / ``.eval()`` leave the base's
    mode as you set it (Trainer calls them; lora_func never changes the model behind your back,
    so the base's dropout is on only if you put the model in train mode yourself). ``save_pretrained`` /
    ``from_pretrained`` write and read the adapter (peft's format where peft has the
    variant), which is what ``Trainer.save_model`` and Trainer checkpoints then contain.
    """
    check_model_and_adapter(model, adapter, "as_module")
    if adapter.stack_shape:
        raise ValueError(  # error: bridge-stacked
            f"as_module(model, adapter): adapter is stacked (stack_shape {adapter.stack_shape}); a module runs one "
            f"adapter: pick one with lora_func.take(adapter, i), or train the stack with torch.func.vmap"
        )
    return AdaptedModule(model, adapter)

