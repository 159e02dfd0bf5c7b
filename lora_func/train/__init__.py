"""Training utilities for adapters: a loss, one step, a loop, and an exact resume.

Built on the public API only. The model is never trained: its tensors reach the forward pass
through :func:`lora_func.adapted_call` (detached), so only the adapter's tensors get gradients.

One step (:func:`train_step`) does, in order:

1. forward under ``torch.autocast`` when ``autocast_dtype`` is set (bf16 or fp16 matmuls),
   the loss in fp32;
2. backward, through a ``torch.amp.GradScaler`` when one is given: fp16 activation gradients
   underflow to zero without one (fp16's smallest normal is 6e-5);
3. ``scaler.unscale_`` *before* clipping, so the clip threshold means the true gradient norm;
4. clipping of the global gradient norm;
5. the optimiser step: with a scaler, a step whose gradients are inf/NaN is skipped and the
   scale lowered (that is the scaler's job, not an error); without one, a non-finite loss or
   gradient raises ``FloatingPointError`` naming the step and the tensors.

Private mode: ``train_step(..., privacy=lora_func.privacy.DPSGD(...))`` (and ``fit``) takes a
DP-SGD step instead: every example clipped, noise drawn once per step, optional micro-batches;
no scaler and no ``max_grad_norm`` with it. ``save_checkpoint`` / ``load_checkpoint`` with
``privacy=`` keep the noise generator's state (docs/guide/privacy.md).

Adapters stay fp32 on a bf16/fp16 base (``AdapterSpec``'s default): see docs/guide/precision.md.

Exact resume: :func:`fit` takes ``batch_at(step)``, a pure function of the step number, so
the data order does not depend on how many steps ran before; :func:`save_checkpoint` writes
the adapter (``lora_func.save``, bit-exact), the optimiser state and the scaler state;
:func:`load_checkpoint` rebuilds them, and training continues bit-identically.
"""

from lora_func.train.checkpoint import load_checkpoint, save_checkpoint
from lora_func.train.loop import (
    adapter_loss,
    causal_lm_loss,
    fit,
    make_optimizer,
    train_step,
)
from lora_func.train.state import IGNORE_INDEX, StepStats, TrainState

__all__ = [
    "IGNORE_INDEX",
    "StepStats",
    "TrainState",
    "adapter_loss",
    "causal_lm_loss",
    "fit",
    "load_checkpoint",
    "make_optimizer",
    "save_checkpoint",
    "train_step",
]
