"""apex's removed mixed-precision modules, rebuilt on ampfunc: ``fp16_utils`` and ``amp``.

``from apex import amp`` becomes ``from ampfunc.compat.apex import amp``; ``from
apex.fp16_utils import FP16_Optimizer`` becomes ``from ampfunc.compat.apex.fp16_utils import
FP16_Optimizer``. Unlike apex, both work on CPU as well as on CUDA.
"""

import importlib

__all__ = ["amp", "fp16_utils", "checkpoint"]


def __getattr__(name):
    # Submodules load on first use (``ampfunc.compat.apex.amp`` works without an explicit import).
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
