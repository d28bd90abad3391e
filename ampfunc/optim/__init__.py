"""Optimizers and gradient transforms: native pure optimizers with torch.optim's math, an adapter
for any torch.optim optimizer, clipping, gradient accumulation and learning-rate schedules.

Every function here is a :class:`~ampfunc.transform.GradientTransformation` factory or a
schedule, and every class a state. The optimizers and the common transforms are also at the top
level (``af.adamw(1e-3)``, ``af.from_torch(torch.optim.RMSprop)``, ``af.clip_by_global_norm``);
the building blocks (``scale_by_adam``, ``scale``, ``scale_by_learning_rate``,
``scale_by_schedule``, ``global_norm``), the schedules and the states live here only.
"""

from ampfunc.optim.accumulate import AccumulateState, accumulate
from ampfunc.optim.adam import AdamState, adam, adamw, scale_by_adam
from ampfunc.optim.clip import clip_by_global_norm, global_norm
from ampfunc.optim.from_torch import TorchOptimizerState, from_torch
from ampfunc.optim.schedule import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    linear_schedule,
    warmup_cosine_decay_schedule,
)
from ampfunc.optim.sgd import SgdState, sgd
from ampfunc.optim.transforms import (
    ScaleByScheduleState,
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
)
from ampfunc.transform import FusedSpec

__all__ = [
    "FusedSpec",
    "SgdState",
    "sgd",
    "AdamState",
    "adam",
    "adamw",
    "scale_by_adam",
    "TorchOptimizerState",
    "from_torch",
    "clip_by_global_norm",
    "global_norm",
    "AccumulateState",
    "accumulate",
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
    "exponential_decay",
    "ScaleByScheduleState",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "add_decayed_weights",
]

# States are NamedTuples of tensors; allow them through torch.load's default weights_only=True
# so a checkpoint of an optimizer state loads without opting out of safe loading.
import torch as _torch

if hasattr(_torch.serialization, "add_safe_globals"):
    _torch.serialization.add_safe_globals([SgdState, AdamState, TorchOptimizerState, AccumulateState,
                                           ScaleByScheduleState])
