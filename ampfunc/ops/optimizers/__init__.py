"""The fused optimizers, one module each: its :class:`~ampfunc.ops._spec.Optimizer` spec and its
plain-torch reference twin. Every module here is imported (and so registered) by this package:
adding an optimizer adds a module, and no list to edit."""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
