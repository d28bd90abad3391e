"""amp's process-wide state (apex keeps the same: one amp configuration per process)."""

from __future__ import annotations

from typing import Any

__all__ = ["maybe_print"]


class _Handle:
    """The active amp configuration: the functions it patched, restorable by ``_deactivate``."""

    def __init__(self, patch_torch_functions: bool):
        self.patch_torch_functions = patch_torch_functions
        self._active = True
        self._patched: list[tuple[Any, str, Any]] = []

    def is_active(self) -> bool:
        return self._active

    def _deactivate(self) -> None:
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        self._active = False


class _AmpState:
    def __init__(self):
        self.opt_properties = None  # properties.Properties of the last initialize()
        self.loss_scalers: list = []  # ampfunc.compat.apex._scaler.LossScaler, one per loss
        self.handle: _Handle | None = None
        self.verbosity = 1
        # apex's escape hatch for models whose params are not all fp32 at initialize().
        self.allow_incoming_model_not_fp32 = False


_amp_state = _AmpState()


def maybe_print(msg: str) -> None:
    if _amp_state.verbosity > 0:
        print(msg)


def _active_handle() -> _Handle | None:
    h = _amp_state.handle
    return h if h is not None and h.is_active() else None
