"""Collect the inputs of target layers on calibration batches (for data-driven variants: EVA).

The model runs through ``torch.func.functional_call`` with a parameter dict from
:func:`lora_func.base_params` in which every target weight is replaced by a recording
stand-in (:class:`RecordingWeight`). The stand-in computes the layer exactly as the model
does and keeps a detached copy of the layer's input: no hooks, no module changes, the model's
tensors and modes untouched.

Token rows are kept where ``attention_mask == 1`` and ``labels != -100`` (as peft's
``prepare_model_inputs_fn_language_modeling`` with ``use_label_mask=True``), so padding and
ignored positions never reach the statistics.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_func._application import Application
from lora_func._routing import WeightStandIn, replace_weights, weight_use
from lora_func._sharded import is_fsdp_model
from lora_func._model import base_params
from lora_func.quantized import frozen_call, frozen_forwards, kind_of_tensor
from lora_func.targeting import Target

__all__ = ["IGNORE_INDEX", "RecordingWeight", "layer_gradient_batches", "layer_input_batches"]

IGNORE_INDEX = -100  # label value of positions that carry no loss (transformers' convention)


class RecordingWeight(WeightStandIn):
    """Stand-in for a target weight that records the layer's input and otherwise *is* the weight.

    It intercepts, via ``__torch_function__``, the ops that consume a weight as a linear map
    (``F.linear`` for nn.Linear, ``torch.addmm`` / ``torch.matmul`` for GPT-2 Conv1D), appends
    the input ``x`` (detached, as ``(n, d_in)``) to ``records``, and returns the op computed
    with the real weight. Every other op (metadata reads, an embedding lookup through a tied
    weight, ...) runs on the real weight unchanged.
    """

    _weight: Tensor
    _name: str
    _layout: str
    records: list[Tensor]

    @staticmethod
    def __new__(cls, weight: Tensor, *, name: str, layout: str) -> RecordingWeight:
        out = cast(Any, Tensor)._make_wrapper_subclass(  # private in torch, absent from its stubs
            cls, weight.shape, strides=weight.stride(), dtype=weight.dtype, device=weight.device, requires_grad=False
        )
        out._weight, out._name, out._layout, out.records = weight, name, layout, []
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's stub: no keyword
        return f"RecordingWeight({self._name}, shape={tuple(self._weight.shape)}, dtype={self._weight.dtype})"

    def _record(self, x: Tensor) -> None:
        d_in = self._weight.shape[1] if self._layout == "linear" else self._weight.shape[0]
        self.records.append(x.detach().reshape(-1, d_in))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}

        def find(value: Any) -> RecordingWeight | None:
            return value if type(value) is cls else None

        use = weight_use(func, args, kwargs, find)
        if use is not None:
            use.entry._record(use.x)
        args, kwargs = replace_weights(args, kwargs, find, lambda t: t._weight)
        return func(*args, **kwargs)

    # An op that bypasses __torch_function__ runs on the real weight (WeightStandIn's default):
    # calibration runs under no_grad, so that is correct; the op is not recorded, which
    # layer_input_batches reports as a layer that saw no input.


class _CallRecorder:
    """A module-call forward that records the layer's input, then runs the layer (a quantized
    one through its frozen op)."""

    def __init__(self, d_in: int) -> None:
        self.d_in = d_in
        self.records: list[Tensor] = []

    def __call__(self, module: nn.Module, inner: Any, x: Tensor) -> Tensor:
        self.records.append(x.detach().reshape(-1, self.d_in))
        kind = kind_of_tensor(module.weight)
        return inner(x) if kind is None else frozen_call(module, kind)(x)


class _GradRecorder:
    """A module-call forward (FSDP) that gives ``∂loss/∂W`` of its layer: it keeps the layer's input
    and, through a hook, its output's gradient (the output made to need one by adding ``0·probe``)."""

    def __init__(self, d_in: int) -> None:
        self.d_in = d_in
        self.probe = torch.zeros((), requires_grad=True)
        self.inputs: list[Tensor] = []
        self.grads: dict[int, Tensor] = {}

    def __call__(self, module: nn.Module, inner: Any, x: Tensor) -> Tensor:
        y = inner(x) + 0 * self.probe
        call = len(self.inputs)
        self.inputs.append(x.detach().reshape(-1, self.d_in))
        y.register_hook(lambda g: self.grads.__setitem__(call, g.reshape(-1, g.shape[-1])))
        return y

    def weight_grad(self) -> Tensor | None:
        """``Σ_calls gᵀ x (d_out, d_in)``; ``None`` if the loss did not reach the layer."""
        if not self.grads:
            return None
        return sum((self.grads[i].T.to(x.dtype) @ x for i, x in enumerate(self.inputs) if i in self.grads), torch.zeros(()))


def _forward_keys(model: nn.Module) -> tuple[set[str], bool]:
    """Names ``model.forward`` accepts explicitly (never ``labels``), and whether it takes ``use_cache``."""
    params = inspect.signature(model.forward).parameters
    named = {
        n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "labels"
    }
    return named, "use_cache" in named


def _check_batch(batch: Any, index: int, vocab: int | None = None) -> tuple[Tensor, Tensor]:
    """Validate one calibration batch; return ``(input_ids, keep)`` with ``keep`` a ``(B, T)`` bool mask."""
    if not isinstance(batch, Mapping):
        raise TypeError(  # error: calib-batch-type
            f"calibration batch {index} is a {type(batch).__name__}; expected a dict with 'input_ids' "
            f"(batch, seq) and optionally 'attention_mask' and 'labels'"
        )
    if "input_ids" not in batch:
        raise ValueError(  # error: calib-no-input-ids
            f"calibration batch {index} has no 'input_ids' (keys: {sorted(batch)}); each batch needs "
            f"'input_ids' (batch, seq) and optionally 'attention_mask' and 'labels'"
        )
    ids = batch["input_ids"]
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.is_floating_point():
        got = f"shape {tuple(ids.shape)}, dtype {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"calibration batch {index}: 'input_ids' must be an integer tensor (batch, seq), got {got}")  # error: calib-input-ids-type
    if ids.numel() == 0:
        # A zero-length batch has no token to record; the model would fail on it deep inside.
        raise ValueError(  # error: calib-empty-batch
            f"calibration batch {index}: 'input_ids' has shape {tuple(ids.shape)}, no tokens; pass batches of at "
            f"least one row and one token (drop empty examples before batching)"
        )
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        # Else the embedding lookup fails deep inside with "index out of range in self".
        raise ValueError(  # error: calib-ids-range
            f"calibration batch {index}: 'input_ids' has ids outside [0, {vocab}) (min {int(ids.min())}, max "
            f"{int(ids.max())}); tokenize with the model's own tokenizer (its vocabulary has {vocab} entries)"
        )
    keep = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    for key, drop in (("attention_mask", None), ("labels", IGNORE_INDEX)):
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(ids.shape):
            got = str(tuple(value.shape)) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(  # error: calib-mask-shape
                f"calibration batch {index}: '{key}' has shape {got}, but 'input_ids' has shape {tuple(ids.shape)}"
            )
        keep = keep & (value.to(ids.device) != 0 if drop is None else value.to(ids.device) != drop)
    return ids, keep


def _cached(batches: Iterable[Mapping[str, Tensor]], cycle: bool) -> Iterator[tuple[int, Any]]:
    """``enumerate(batches)``, then (with ``cycle``) the same batch objects again, forever (as
    ``itertools.cycle``, which peft uses: a shuffling DataLoader is not reshuffled)."""
    seen = []
    for index, batch in enumerate(batches):
        if cycle:
            seen.append(batch)
        yield index, batch
    if not seen and cycle:
        return
    while cycle:
        yield from enumerate(seen)


def _checked(model: nn.Module, targets: list[Target]) -> tuple[dict[str, Tensor], set[str], bool, int | None]:
    """The checks every calibration pass makes before running the model; returns the base
    parameters, the names ``model.forward`` accepts, whether it takes ``use_cache``, the vocabulary size."""
    if not targets:
        raise ValueError("layer_input_batches needs at least one target layer")  # error: calib-no-targets
    training = sorted(n or "<root>" for n, m in model.named_modules() if m.training)
    if training:
        raise ValueError(  # error: calib-training-mode
            f"calibration runs the model as it is, and modules {training[:5]}{' ...' if len(training) > 5 else ''} "
            f"are in training mode (dropout would make the statistics random); call model.eval() first"
        )
    accepted, takes_use_cache = _forward_keys(model)
    base = base_params(model)
    meta = sorted(t.module for t in targets if base[t.weight_key].is_meta)
    if meta:
        raise ValueError(  # error: calib-meta-model
            f"calibration runs the model on data, and targets {meta[:3]}{' ...' if len(meta) > 3 else ''} are on the meta "
            f"device (shapes only, no values); materialise the model first (from_pretrained, or to_empty() and "
            f"load_state_dict), then call init_adapter"
        )
    # The token embedding's size (transformers' accessor, else the model's first nn.Embedding).
    accessor = getattr(model, "get_input_embeddings", None)
    embeddings = accessor() if callable(accessor) else next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    vocab = getattr(embeddings, "num_embeddings", None)
    return base, accepted, takes_use_cache, vocab


def layer_input_batches(
    model: nn.Module,
    targets: Sequence[Target],
    batches: Iterable[Mapping[str, Tensor]],
    *,
    cycle: bool = True,
) -> Iterator[dict[str, Tensor]]:
    """Per calibration batch, the inputs of every target layer: ``{module name: rows (n, d_in)}``.

    Args:
      model: the model, in eval mode (it is run as it is; lora_func never changes its mode).
      targets: the layers to record (``lora_func.targeting.find_targets``).
      batches: an iterable of dicts with ``input_ids (B, T)`` and optionally
        ``attention_mask (B, T)`` and ``labels (B, T)``. Other keys that ``model.forward``
        accepts by name (``position_ids``, ...) are passed on; ``labels`` never is (no loss
        is computed) and keys the model does not accept are ignored.
      cycle: after the last batch, start again with the same batch objects (cached on the
        first pass, like ``itertools.cycle``) until the consumer stops; ``False`` gives one pass.

    Yields:
      ``{module: rows}`` in target order, ``rows`` fp32 on the layer's device, one row per
      token with ``attention_mask == 1`` and ``labels != -100``, in (batch, position) order.
      Each batch costs one forward pass under ``torch.no_grad``.

    Raises:
      ValueError: empty ``targets`` or ``batches``, a model in training mode, a malformed
        batch, or a target that saw no input (or an input that does not line up with the
        batch's tokens) during the forward pass.
    """
    targets = list(targets)
    base, accepted, takes_use_cache, vocab = _checked(model, targets)
    # FSDP2 swaps its own parameters at each module's call: record there, reparametrize nothing.
    fsdp = is_fsdp_model(dict(model.named_modules()))
    empty = True
    for index, batch in _cached(batches, cycle):
        empty = False
        ids, keep = _check_batch(batch, index, vocab)
        inputs = {k: v for k, v in batch.items() if k in accepted}
        if takes_use_cache:
            inputs["use_cache"] = False
        params = {} if fsdp else dict(base)
        standins: dict[str, RecordingWeight | _CallRecorder] = {}
        forwards = {}
        for t in targets:
            if fsdp or kind_of_tensor(base[t.weight_key]) is not None:
                # A quantized layer runs its own op on its packed weight: record at its call.
                recorder = _CallRecorder(t.d_in)
                forwards[t.module] = standins[t.module] = recorder
                continue
            standin = RecordingWeight(base[t.weight_key], name=t.module, layout=t.layout)
            for key in (t.weight_key, *t.tied_keys):
                params[key] = standin
            standins[t.module] = standin
        with torch.no_grad():
            Application(model, params, {**frozen_forwards(model, exclude=forwards), **forwards})(**inputs)
        n_tokens = ids.numel()
        out = {}
        for module, recorded in standins.items():
            if not recorded.records:
                raise ValueError(  # error: calib-target-unused
                    f"calibration batch {index}: target {module} saw no input during the forward pass "
                    f"(is it used by the model through F.linear / addmm / matmul?)"
                )
            rows = []
            for x in recorded.records:
                if x.shape[0] != n_tokens:
                    raise ValueError(  # error: calib-rows-mismatch
                        f"calibration batch {index}: target {module} got an input of {x.shape[0]} rows, which does "
                        f"not line up with the batch's {tuple(ids.shape)} = {n_tokens} tokens; cannot apply the mask"
                    )
                rows.append(x[keep.reshape(-1).to(x.device)].float())
            out[module] = rows[0] if len(rows) == 1 else torch.cat(rows)
            if not bool(torch.isfinite(out[module]).all()):
                # The statistics (an SVD of these rows) would fail or come out NaN.
                raise ValueError(  # error: calib-non-finite
                    f"calibration batch {index}: the inputs of target {module} hold NaN or inf: the model computes "
                    f"non-finite activations on this batch (a non-finite weight upstream, or an overflow in half "
                    f"precision); check the model on this batch (fix or reload its weights, or run it in float32)"
                )
        del params, standins
        yield out
    if empty:
        raise ValueError("calibration data is empty: pass at least one batch with 'input_ids'")  # error: calib-empty


def layer_gradient_batches(
    model: nn.Module, targets: Sequence[Target], batches: Iterable[Mapping[str, Tensor]]
) -> Iterator[dict[str, Tensor]]:
    """Per calibration batch, the gradient of the model's own loss with respect to every target
    weight: ``{module name: ∂loss/∂W (d_out, d_in)}`` (the canonical layout; transposed on GPT-2
    ``Conv1D``), in the weight's dtype. One pass over ``batches`` (dicts as for
    :func:`layer_input_batches`); each batch costs one forward and one backward pass.

    The loss is ``model(**batch, labels=labels).loss``: ``labels`` the batch's, else its
    ``input_ids`` with ``attention_mask == 0`` positions set to ``-100`` (a causal LM's loss on
    its own tokens, as transformers' language-modelling collator makes it). The model runs as it
    is (eval mode required, as for :func:`layer_input_batches`), its weights reparametrized by
    copies that need gradients: nothing of the model changes, no ``.grad`` is written.

    Raises:
      ValueError: what :func:`layer_input_batches` raises; a quantized target (its packed weight
        has no gradient); a model whose output has no ``loss``; a target the loss does not reach.
    """
    targets = list(targets)
    base, accepted, takes_use_cache, vocab = _checked(model, targets)
    # FSDP2 swaps its own parameters at each module's call: the gradient is taken there, from the
    # layer's input and output gradient, not by reparametrizing the weight.
    fsdp = is_fsdp_model(dict(model.named_modules()))
    quantized = sorted(t.module for t in targets if kind_of_tensor(base[t.weight_key]) is not None)
    if quantized:
        raise ValueError(  # error: calib-grad-quantized
            f"calibration from gradients needs float target weights, and {quantized[:3]}{' ...' if len(quantized) > 3 else ''} "
            f"are quantized (a packed weight has no gradient); build the adapter on the float model (peft's LoRA-GA "
            f"refuses quantized models too)"
        )
    empty = True
    for index, batch in _cached(batches, cycle=False):
        empty = False
        ids, keep = _check_batch(batch, index, vocab)
        inputs = {k: v for k, v in batch.items() if k in accepted}
        if takes_use_cache:
            inputs["use_cache"] = False
        labels = batch.get("labels")
        inputs["labels"] = ids.masked_fill(~keep, IGNORE_INDEX) if labels is None else labels
        recorders = {t.module: _GradRecorder(t.d_in) for t in targets} if fsdp else {}
        weights = {} if fsdp else {t.module: base[t.weight_key].detach().requires_grad_(True) for t in targets}
        params = {} if fsdp else dict(base)
        for t in targets if not fsdp else ():
            for key in (t.weight_key, *t.tied_keys):
                params[key] = weights[t.module]
        with torch.enable_grad():
            out = Application(model, params, {**frozen_forwards(model, exclude=recorders), **recorders})(**inputs)
            loss = getattr(out, "loss", None)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise ValueError(  # error: calib-grad-no-loss
                    f"calibration batch {index}: the model returned no scalar .loss given labels=; calibration from "
                    f"gradients takes the model's own loss (a transformers model with labels, e.g. *ForCausalLM)"
                )
            if fsdp:
                torch.autograd.grad(loss, [r.probe for r in recorders.values()], allow_unused=True)
                grads = tuple(r.weight_grad() for r in recorders.values())
            else:
                grads = torch.autograd.grad(loss, list(weights.values()), allow_unused=True)
        out = {}
        for t, grad in zip(targets, grads, strict=True):
            if grad is None:
                raise ValueError(  # error: calib-grad-unused
                    f"calibration batch {index}: the loss does not depend on target {t.module}; leave it out of the targets"
                )
            out[t.module] = grad.T if t.layout == "conv1d" and not fsdp else grad
        yield out
    if empty:
        raise ValueError("no calibration batch to take gradients on: pass at least one batch with 'input_ids'")  # error: calib-grad-empty
