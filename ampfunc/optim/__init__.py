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

# The other optimizer modules of this package (one file each with an ``__all__``, e.g. lion.py)
# are picked up as they are, their states allowed through torch.load: adding an optimizer edits
# no list here (nor in ampfunc/__init__.py, which exports the factory named after its module).
import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402

_picked_up_optimizers: list[str] = []  # modules picked up whose namesake factory is top level

for _info in _pkgutil.iter_modules(__path__):
    if _info.name == "base" or _info.name.startswith("_"):
        continue
    _module = _importlib.import_module(f"{__name__}.{_info.name}")
    for _name in getattr(_module, "__all__", ()):
        if _name not in __all__:
            globals()[_name] = getattr(_module, _name)
            __all__.append(_name)
            if _name == _info.name:
                _picked_up_optimizers.append(_name)
            _obj = globals()[_name]
            if isinstance(_obj, type) and issubclass(_obj, tuple) and hasattr(_obj, "_fields") and \
                    hasattr(_torch.serialization, "add_safe_globals"):
                _torch.serialization.add_safe_globals([_obj])
