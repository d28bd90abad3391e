"""Loading checkpoints that apex wrote, on a machine without apex.

apex's ``FP16_Optimizer.state_dict()`` stores its loss-scaler object, so ``torch.load`` of such a
checkpoint needs the class ``apex.amp.scaler.LossScaler`` (or, from older apex,
``apex.fp16_utils.loss_scaler.LossScaler`` / ``DynamicLossScaler``). :func:`load` unpickles
those names as ampfunc's scaler (or as a plain record of their attributes that
``FP16_Optimizer.load_state_dict`` converts), so::

    from ampfunc.compat.apex import checkpoint
    ckpt = checkpoint.load("apex_run.pt", map_location="cpu")
    optimizer.load_state_dict(ckpt["optimizer"])        # ampfunc's FP16_Optimizer

Everything else in the file is unpickled as ``torch.load(weights_only=False)`` does, so load only
files you trust.
"""

from __future__ import annotations

import pickle
import types

import torch

from ampfunc.compat.apex._scaler import LossScaler

__all__ = ["load", "pickle_module", "ApexRecord"]


class ApexRecord:
    """The attributes of an apex object this library has no class for (older ``fp16_utils`` scalers)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ApexRecord({self.__dict__!r})"


_RENAMES = {
    ("apex.amp.scaler", "LossScaler"): LossScaler,
    ("apex.fp16_utils.loss_scaler", "LossScaler"): ApexRecord,
    ("apex.fp16_utils.loss_scaler", "DynamicLossScaler"): ApexRecord,
}


class Unpickler(pickle.Unpickler):
    """A pickle ``Unpickler`` that reads apex's scaler classes as ampfunc's."""

    def find_class(self, module, name):
        target = _RENAMES.get((module, name))
        if target is not None:
            return target
        return super().find_class(module, name)


def _load(file, **kwargs):
    return Unpickler(file, **kwargs).load()


pickle_module = types.SimpleNamespace(Unpickler=Unpickler, load=_load, __name__=__name__ + ".pickle_module")
"""Pass as ``torch.load(..., pickle_module=pickle_module, weights_only=False)``."""


def load(f, map_location=None, **kwargs):
    """``torch.load(f, map_location)`` of a checkpoint apex wrote, without apex installed.

    Args:
      f: a path or a file-like object, as for ``torch.load``.
      map_location: as for ``torch.load`` (``"cpu"`` for a checkpoint written on CUDA).
      **kwargs: passed to ``torch.load``.

    Returns:
      The unpickled checkpoint; apex's loss scalers come back as
      :class:`ampfunc.compat.apex.amp.LossScaler` (or :class:`ApexRecord` for older ones).

    Example:
      >>> ckpt = load("apex_checkpoint.pt", map_location="cpu")

    Cost: as ``torch.load``. Unpickles arbitrary objects (``weights_only=False``): trusted files only.
    """
    return torch.load(f, map_location=map_location, pickle_module=pickle_module, weights_only=False, **kwargs)
