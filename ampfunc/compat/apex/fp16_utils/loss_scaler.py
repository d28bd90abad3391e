"""apex's ``LossScaler`` (static) and ``DynamicLossScaler``, holding ampfunc loss-scale pytrees.

apex kept the scale as a Python float and checked overflow with one host sync per gradient
tensor. Here the scale is a :class:`ampfunc.StaticLossScale` / :class:`ampfunc.DynamicLossScale`
that lives on the gradients' device and is replaced by :func:`ampfunc.update_scale`; the
overflow check is one :func:`ampfunc.ops.all_finite` pass. apex's API is host-side (``has_overflow``
returns a Python bool, ``loss_scale`` a Python float), so those two read one value back.
"""

from __future__ import annotations

import math

import torch

from ampfunc import ops
from ampfunc.compat.apex._scaler import checked_scale
from ampfunc.loss_scale import DynamicLossScale, StaticLossScale
from ampfunc.mixed import scale_loss, update_scale

__all__ = ["LossScaler", "DynamicLossScaler"]


class _ScalerBase:
    """What both scalers share: the held loss scale, scaling a loss, scaling module gradients."""

    _ls: StaticLossScale | DynamicLossScale

    def _follow(self, device: torch.device) -> None:
        # Keep the scale on the device of the tensors it meets, so that updates need no copies.
        if self._ls.loss_scale.device != device:
            self._ls = self._ls.to(device)

    @property
    def loss_state(self):
        """The held ampfunc loss scale (a pytree of 0-d tensors)."""
        return self._ls

    @property
    def loss_scale(self) -> float:
        """The current scale as a Python float (one host read)."""
        return float(self._ls.loss_scale.item())

    @property
    def cur_scale(self) -> float:
        return self.loss_scale

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        self._follow(loss.device)
        return scale_loss(loss, self._ls)

    def scale_gradient(self, module, grad_in, grad_out):
        """A backward hook that multiplies the module's input gradients by the scale (apex's helper)."""
        return tuple(None if g is None else g * self._ls.loss_scale.to(g.device) for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss.float() * scale).backward(retain_graph=retain_graph)``."""
        self._scaled(loss).backward(retain_graph=retain_graph)

    @staticmethod
    def _grads(params) -> list[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None]


class LossScaler(_ScalerBase):
    """A fixed loss scale (``FP16_Optimizer(static_loss_scale=...)``): never reports overflow.

    ``cur_scale`` may be assigned (``FP16_Optimizer.loss_scale = 256.``); ``update_scale`` is a
    no-op, as in apex.
    """

    def __init__(self, scale: float = 1):
        self._ls = StaticLossScale(checked_scale(scale, "LossScaler: scale"))

    @_ScalerBase.cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._ls = StaticLossScale(checked_scale(value, "LossScaler.cur_scale"), device=self._ls.loss_scale.device)

    def has_overflow(self, params) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x) -> bool:
        return False

    def update_scale(self, overflow) -> None:
        pass

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.loss_scale})"


class DynamicLossScaler(_ScalerBase):
    """apex's dynamic scaler: halve on overflow (floor 1), double after ``scale_window`` clean steps.

    The rule is :class:`ampfunc.DynamicLossScale` with ``growth_factor=scale_factor``,
    ``backoff_factor=1/scale_factor``, ``growth_interval=scale_window``, ``min_scale=1``,
    ``max_scale=inf``. The scale is stored in fp32 (apex used a Python double): sequences are
    identical for power-of-two factors; growth that would overflow fp32 is not applied.

    ``has_overflow(params)`` checks every element of every gradient (apex summed each tensor,
    which also flagged finite tensors whose sum overflowed) and returns a Python bool: one
    read pass and one host read. ``cur_iter`` and ``last_overflow_iter`` are kept as in apex.
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000):
        # apex's own names in the errors (the rule's would be growth_factor, growth_interval)
        if isinstance(scale_factor, bool) or not isinstance(scale_factor, (int, float)) or \
                not 1.0 < scale_factor < math.inf:
            raise ValueError(f"DynamicLossScaler: scale_factor must be a finite number > 1, got {scale_factor!r}")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"DynamicLossScaler: scale_window must be an int >= 1, got {scale_window!r}")
        init_scale = checked_scale(init_scale, "DynamicLossScaler: init_scale")
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self._ls = DynamicLossScale(float(init_scale), growth_factor=self.scale_factor,
                                    backoff_factor=1.0 / self.scale_factor, growth_interval=self.scale_window,
                                    min_scale=1.0, max_scale=math.inf)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @_ScalerBase.cur_scale.setter
    def cur_scale(self, value: float) -> None:
        ls = self._ls
        value = torch.full((), checked_scale(value, "DynamicLossScaler.cur_scale"), dtype=torch.float32,
                           device=ls.loss_scale.device)
        self._ls = DynamicLossScale.from_tensors(value, ls.growth_tracker, ls.hysteresis_tracker, ls.config)

    def has_overflow(self, params) -> bool:
        """True if any gradient of ``params`` holds an inf or NaN (one host read)."""
        grads = self._grads(params)
        return bool(grads) and not bool(ops.all_finite(grads))

    has_overflow_serial = has_overflow

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return not bool(ops.all_finite([x]))

    def update_scale(self, overflow) -> None:
        """Advances the scale after a step; ``overflow`` is a bool or a 0-d bool tensor.

        The scale itself is updated on its device (:func:`ampfunc.update_scale`); a tensor
        ``overflow`` is read back once to keep apex's ``last_overflow_iter``.
        """
        if isinstance(overflow, torch.Tensor):
            self._follow(overflow.device)
            finite = ~overflow.reshape(()).to(torch.bool)
            overflow = bool(overflow)
        else:
            overflow = bool(overflow)
            finite = torch.tensor(not overflow, device=self._ls.loss_scale.device)
        self._update(finite, overflow)

    def _update(self, finite: torch.Tensor, overflow: bool) -> None:
        self._follow(finite.device)
        self._ls = update_scale(self._ls, finite)
        if overflow:
            self.last_overflow_iter = self.cur_iter
        self.cur_iter += 1

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(cur_scale={self.loss_scale}, scale_factor={self.scale_factor}, "
                f"scale_window={self.scale_window}, cur_iter={self.cur_iter})")


# Checkpoints of FP16_Optimizer hold the scaler object itself (apex's format); let
# torch.load(weights_only=True) accept it.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler])
