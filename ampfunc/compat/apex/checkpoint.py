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

The other way, a facade checkpoint already stores apex's attributes, but under ampfunc's class
name; :func:`save_for_apex` writes the scaler under apex's name, so a machine with apex and
without ampfunc loads it as ``apex.amp.scaler.LossScaler``::

    checkpoint.save_for_apex({"optimizer": optimizer.state_dict()}, "for_apex.pt")
"""

from __future__ import annotations

import copyreg
import pickle
import types

import torch

from ampfunc.compat.apex._scaler import LossScaler

__all__ = ["load", "save_for_apex", "pickle_module", "apex_pickle_module", "ApexRecord"]


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
      >>> ckpt = load("apex_checkpoint.pt", map_location="cpu")  # doctest: +SKIP

    Cost: as ``torch.load``. Unpickles arbitrary objects (``weights_only=False``): trusted files only.
    """
    return torch.load(f, map_location=map_location, pickle_module=pickle_module, weights_only=False, **kwargs)


class _ApexName:
    """Stands for ``apex.amp.scaler.LossScaler`` in a pickle being written (never instantiated)."""


class Pickler(pickle._Pickler):
    """A pickle ``Pickler`` that writes ampfunc's amp loss scaler as apex's class, with apex's attributes.

    It is pickle's pure-Python pickler (the C one cannot name a class of a module that is not
    importable here): slower, which only matters for the few objects of a checkpoint that are
    not tensor storages.
    """

    def reducer_override(self, obj):
        if type(obj) is LossScaler:
            # apex's class is created without __init__ (object.__new__, pickle's own
            # reconstructor) and its __dict__ filled with the attributes apex's __init__ sets.
            return copyreg._reconstructor, (_ApexName, object, None), obj.__getstate__()
        return NotImplemented

    def save_global(self, obj, name=None):
        if obj is _ApexName:
            if self.proto >= 4:
                self.save("apex.amp.scaler")
                self.save("LossScaler")
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + b"apex.amp.scaler\nLossScaler\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[type] = save_global


apex_pickle_module = types.SimpleNamespace(Pickler=Pickler, Unpickler=pickle.Unpickler, load=pickle.load,
                                           dump=lambda obj, f, protocol=2: Pickler(f, protocol).dump(obj),
                                           __name__=__name__ + ".apex_pickle_module")
"""Pass as ``torch.save(..., pickle_module=apex_pickle_module)``."""


def save_for_apex(obj, f, **kwargs) -> None:
    """``torch.save(obj, f)`` with ampfunc's amp loss scalers written as ``apex.amp.scaler.LossScaler``.

    Args:
      obj: what to save, e.g. ``{"optimizer": fp16_optimizer.state_dict()}``.
      f: a path or a writable file-like object, as for ``torch.save``.
      **kwargs: passed to ``torch.save``.

    Example:
      >>> save_for_apex({"optimizer": optimizer.state_dict()}, "for_apex.pt")  # doctest: +SKIP

    Cost: as ``torch.save``, with Python's (slower) pickler for the non-tensor objects. The file
    loads where apex is installed (``torch.load(..., weights_only=False)``), and with :func:`load`.
    """
    torch.save(obj, f, pickle_module=apex_pickle_module, **kwargs)
