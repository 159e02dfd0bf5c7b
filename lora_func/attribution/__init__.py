"""Training-data attribution on adapters: which training examples made the model answer this?

Everything starts from exact per-example gradients of the adapter (:func:`lora_func.per_example_grads`):

- :func:`features` (and :func:`write_features`, streaming a dataset to a memory-mapped ``.npy``):
  each example's gradient over the adapter's trainable tensors as a row, optionally
  preconditioned (LESS's Adam direction, :func:`adam_preconditioner`) and projected to
  ``proj_dim`` columns by a seeded random projection generated block by block;
- :func:`scores`: TracIn (dot products), LESS (cosines), TRAK (the after-kernel inverse), with
  ensembling over checkpoints or stack members;
- :func:`ekfac` and :func:`influence`: influence functions with EK-FAC curvature fitted on the
  adapter's LoRA layers, with kronfluence's semantics;
- :func:`lds`: the linear datamodeling score, to judge an attribution against retrained models.

docs/attribution.md has the recipes, what each method assumes, and the oracles they are tested
against (traker, the LESS recipe, kronfluence).
"""

from lora_func.attribution.curvature import EKFAC, Factor, ekfac, influence
from lora_func.attribution.featurize import feature_dim, features, write_features
from lora_func.attribution.precondition import AdamPreconditioner, adam_preconditioner
from lora_func.attribution.scoring import METHODS, lds, scores

__all__ = [
    "EKFAC",
    "METHODS",
    "AdamPreconditioner",
    "Factor",
    "adam_preconditioner",
    "ekfac",
    "feature_dim",
    "features",
    "influence",
    "lds",
    "scores",
    "write_features",
]
