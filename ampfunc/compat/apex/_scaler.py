"""apex's ``amp`` loss scaler (``apex.amp.scaler.LossScaler``), shared by ``amp`` and ``FP16_Optimizer``.

apex's last ``FP16_Optimizer`` and ``amp.initialize`` both hold this scaler, so the two facades
share this one class. Its rule, as apex wrote it:

* ``"dynamic"``: start at ``min(max_loss_scale, init_scale)`` (``2**16``, capped at ``2**24``);
  on overflow halve (never below ``min_loss_scale`` when one is given; no floor otherwise) and
  reset the count of clean steps; after ``scale_window`` (2000) clean steps in a row double
  (never above ``max_loss_scale``). ``scale_factor`` is accepted and ignored, as in apex.
* a number: a static scale that never skips; ``_unskipped`` still counts the steps.

The scale is an ampfunc loss-scale pytree (:class:`ampfunc.DynamicLossScale` /
:class:`ampfunc.StaticLossScale`) on the gradients' device, advanced by
:func:`ampfunc.update_scale`. apex's attribute names (``_loss_scale``, ``_unskipped``,
``dynamic``, ``_min_loss_scale``, ...) and methods (``loss_scale()``, ``unscale``,
``unscale_with_stashed``, ``clear_overflow_state``, ``update_scale``) are kept, and a pickled
scaler stores exactly apex's attributes, so checkpoints cross-load with apex in both directions.
"""

from __future__ import annotations

import math
import numbers

import torch

from ampfunc import ops
from ampfunc.loss_scale import SCALE_RANGE, DynamicLossScale, StaticLossScale
from ampfunc.mixed import scale_loss as _scale_loss
from ampfunc.mixed import update_scale as _update_scale

__all__ = ["LossScaler", "all_finite_flags"]


INT32_MAX = 2**31 - 1


def check_unskipped(value, dynamic: bool, name: str) -> int:
    """``value`` as an int, refused unless an integer ``>= 0`` (bools refused) that fits the
    scaler's counter: int32 (``<= 2**31 - 1``) for a dynamic scaler, any size for a static one.
    ``ValueError``/``TypeError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0 or (dynamic and value > INT32_MAX):
        limit = " and <= 2**31 - 1 (a dynamic scaler counts in int32)" if dynamic else ""
        raise ValueError(f"{name} must be an int >= 0{limit}, got {value!r}")
    return int(value)


def checked_scale(value, name: str) -> float:
    """``value`` as a float, refused unless it lies in :data:`ampfunc.loss_scale.SCALE_RANGE` once stored in
    fp32 (NaN, inf, 0, negative, subnormal and fp32-overflowing values such as ``1e39`` are: the
    next step would write NaN/inf into the params). ``TypeError`` for a bool or a non-number."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got bool")
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    stored = float(torch.tensor(number, dtype=torch.float32))
    lo, hi = SCALE_RANGE
    if not lo <= stored <= hi:
        raise ValueError(f"{name} must be a finite number in [2**-126, {hi:.4g}] once stored in fp32 (so that it "
                         f"and its inverse are finite and nonzero), got {value!r}")
    return number


def all_finite_flags(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """The AND of 0-d finiteness flags, on the first flag's device; ``None`` for no flags."""
    if not flags:
        return None
    dev = flags[0].device
    return torch.stack([f.to(dev).reshape(()) for f in flags]).all()


class LossScaler:
    """One loss's scale with apex's ``amp`` semantics (see the module docstring).

    Args:
      loss_scale: ``"dynamic"`` or a positive number (a static scale) in
        :data:`ampfunc.loss_scale.SCALE_RANGE` once stored in fp32.
      init_scale: first dynamic scale (capped at ``max_loss_scale``), likewise in
        :data:`ampfunc.loss_scale.SCALE_RANGE` (NaN, inf and ``1e39`` are refused, not capped).
      scale_factor: accepted for apex's signature; apex ignores it (factor 2 is fixed).
      scale_window: clean steps before the dynamic scale doubles.
      min_loss_scale: floor of the halving (``None`` or ``0``: no floor). As in apex it may lie
        above ``init_scale``: the scale then starts below the floor and the first overflow
        raises it to the floor.
      max_loss_scale: cap of the growth.

    Returns:
      A stateful scaler; ``loss_state`` is the held ampfunc loss scale.

    Example:
      >>> s = LossScaler("dynamic")
      >>> s.loss_scale()
      65536.0

    Cost: ``scale``/``unscale`` never sync; ``update_scale()`` and ``loss_scale()`` read one
    value back (apex's host-side API).
    """

    def __init__(self, loss_scale, init_scale: float = 2.0**16, scale_factor: float = 2.0,
                 scale_window: int = 2000, min_loss_scale: float | None = None, max_loss_scale: float = 2.0**24):
        dynamic = loss_scale == "dynamic"
        if not dynamic:
            try:
                value = float(loss_scale)
            except (TypeError, ValueError):
                raise ValueError(f"LossScaler: loss_scale must be 'dynamic' or a number, got {loss_scale!r}") from None
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"LossScaler: loss_scale must be finite and > 0, got {loss_scale!r}")
            value = checked_scale(loss_scale, "LossScaler: loss_scale")
        else:
            # min(max_loss_scale, nan or inf) would silently start at max_loss_scale.
            init_scale = checked_scale(init_scale, "LossScaler: init_scale")
        if isinstance(scale_window, bool) or not isinstance(scale_window, numbers.Real) \
                or not math.isfinite(scale_window) or int(scale_window) != scale_window or scale_window < 1:
            raise ValueError(f"LossScaler: scale_window must be an integer >= 1, got {scale_window!r}")
        for name, bound in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
            if bound is None and name == "min_loss_scale":
                continue  # no floor (apex's default)
            if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or math.isnan(bound) or bound < 0:
                raise ValueError(f"LossScaler: {name} must be a number >= 0{' or None' if name[:3] == 'min' else ''}, "
                                 f"got {bound!r}")
        if min_loss_scale is not None and min_loss_scale > SCALE_RANGE[1]:
            raise ValueError(f"LossScaler: min_loss_scale must be at most fp32's largest number "
                             f"{SCALE_RANGE[1]:.4g}, got {min_loss_scale!r}")
        if dynamic and max_loss_scale == 0:
            raise ValueError("LossScaler: max_loss_scale must be > 0 for a dynamic scale (the scale starts at "
                             "min(max_loss_scale, init_scale)), got 0")
        if min_loss_scale is not None and min_loss_scale > max_loss_scale:
            raise ValueError(f"LossScaler: min_loss_scale ({min_loss_scale}) > max_loss_scale ({max_loss_scale})")
        self._build(dynamic, min(max_loss_scale, init_scale) if dynamic else value, min_loss_scale,
                    max_loss_scale, int(scale_window), 0, torch.device("cpu"))

    def _build(self, dynamic, scale, min_loss_scale, max_loss_scale, scale_window, unskipped, device) -> None:
        self.dynamic = bool(dynamic)
        self._min_loss_scale = min_loss_scale
        self._max_loss_scale = max_loss_scale
        self._scale_seq_len = int(scale_window)
        # A static scale stays a Python float too: scale_loss checks "scale 1, nothing to do" on
        # the host every backward and must not sync for that.
        self._static_value = None if self.dynamic else float(scale)
        self._static_unskipped = 0 if self.dynamic else int(unskipped)
        self._finite: torch.Tensor | None = None  # what unscale() saw since clear_overflow_state()
        self._has_overflow = False
        if self.dynamic:
            lo = float(min_loss_scale or 0.0)
            hi = math.inf if max_loss_scale is None else float(max_loss_scale)
            scale = float(scale)
            # apex holds its scale as it is, even outside [min_loss_scale, max_loss_scale] (a floor
            # above the start: the first overflow raises the scale to the floor; a checkpoint or
            # an assignment above the cap: the next growth brings it down). The core's constructor
            # refuses such a start (and replace() would clamp the scale into the bounds), so the
            # bounds are set on the config after it.
            ls = DynamicLossScale(scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=self._scale_seq_len,
                                  min_scale=min(lo, scale), max_scale=max(hi, scale), device=device)
            self._ls = DynamicLossScale.from_tensors(ls.loss_scale, ls.growth_tracker, ls.hysteresis_tracker,
                                                     ls.config._replace(min_scale=lo, max_scale=hi).validate())
            if unskipped:
                self._unskipped = unskipped
        else:
            self._ls = StaticLossScale(float(scale), device=device)

    # -- the scale ----------------------------------------------------------------------------

    @property
    def loss_state(self):
        """The held ampfunc loss scale (a pytree of 0-d tensors)."""
        return self._ls

    def loss_scale(self) -> float:
        """The current scale as a Python float (one host read for a dynamic scale)."""
        if not self.dynamic:
            return self._static_value
        return float(self._ls.loss_scale.item())

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self.set_loss_scale(value, "LossScaler._loss_scale")

    def set_loss_scale(self, value: float, name: str = "LossScaler._loss_scale") -> None:
        """Sets the current scale (apex's ``_loss_scale = value``), dynamic or static.

        ``value`` must lie in :data:`ampfunc.loss_scale.SCALE_RANGE` once stored in fp32; anything else
        (0, negative, NaN, inf, ``1e39``) raises ``ValueError`` naming ``name`` and changes nothing.
        """
        value = checked_scale(value, name)
        ls = self._ls
        t = torch.full((), value, dtype=torch.float32, device=ls.loss_scale.device)
        if self.dynamic:
            self._ls = DynamicLossScale.from_tensors(t, ls.growth_tracker, ls.hysteresis_tracker, ls.config)
        else:
            self._static_value = float(value)
            self._ls = StaticLossScale(t)

    @property
    def _unskipped(self) -> int:
        """Clean steps since the last overflow or growth (dynamic); steps taken (static), as apex counts."""
        return int(self._ls.growth_tracker.item()) if self.dynamic else self._static_unskipped

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        # Checked before anything changes: a dynamic scaler keeps the count in an int32 tensor.
        check_unskipped(value, self.dynamic, "LossScaler._unskipped")
        if self.dynamic:
            ls = self._ls
            t = torch.full((), int(value), dtype=torch.int32, device=ls.loss_scale.device)
            self._ls = DynamicLossScale.from_tensors(ls.loss_scale, t, ls.hysteresis_tracker, ls.config)
        else:
            self._static_unskipped = int(value)

    def _follow(self, device: torch.device) -> None:
        # Keep the scale on the device of the tensors it meets, so that updates need no copies.
        if self._ls.loss_scale.device != device:
            self._ls = self._ls.to(device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.float() * scale`` (:func:`ampfunc.scale_loss`)."""
        self._follow(loss.device)
        return _scale_loss(loss, self._ls)

    def inv_scale(self, device) -> torch.Tensor:
        """0-d fp32 ``1 / scale`` on ``device``."""
        return self._ls.inv_scale_on(device)

    # -- apex's unscale protocol (what apex's FP16_Optimizer and amp handle call) ---------------

    def clear_overflow_state(self) -> None:
        self._finite = None
        self._has_overflow = False

    def _record(self, finite: torch.Tensor | None) -> None:
        if finite is not None:
            self._finite = all_finite_flags([f for f in (self._finite, finite) if f is not None])

    @torch.no_grad()
    def unscale(self, model_grads, master_grads, unused_scale=None, models_are_masters: bool = False,
                scale_override=None) -> None:
        """``master_grads = model_grads / scale`` (fp32 math), recording whether they were finite. No sync."""
        model_grads, master_grads = list(model_grads), list(master_grads)
        if not model_grads:
            return
        inv = self._inv_for(model_grads[0].device, scale_override)
        if all(m is g for m, g in zip(master_grads, model_grads)):
            self._record(ops.unscale_(model_grads, inv))
            return
        outs, finite = ops.unscale(model_grads, inv)
        torch._foreach_copy_(master_grads, outs)
        self._record(finite)

    @torch.no_grad()
    def unscale_with_stashed(self, model_grads, stashed_master_grads, master_grads, scale_override=None) -> None:
        """``master_grads = model_grads / scale + stashed`` (one rounding), recording finiteness. No sync."""
        model_grads = list(model_grads)
        if not model_grads:
            return
        inv = self._inv_for(model_grads[0].device, scale_override)
        outs, finite = ops.unscale(model_grads, inv)
        torch._foreach_copy_(list(master_grads), [o + s.float() for o, s in zip(outs, stashed_master_grads)])
        self._record(finite)

    def _inv_for(self, device, scale_override) -> torch.Tensor:
        if scale_override is not None:
            return torch.full((), 1.0 / float(scale_override), dtype=torch.float32, device=device)
        return self.inv_scale(device)

    def update_scale(self, finite: torch.Tensor | None = None) -> bool:
        """Advances the scale after a backward; returns whether the step must be skipped.

        ``finite`` (a 0-d bool tensor) defaults to what :meth:`unscale` recorded since
        :meth:`clear_overflow_state` (no gradients: a clean step, as apex counts). A dynamic
        scale reads the flag back once; a static one never skips and only counts the step.
        """
        if finite is None:
            finite = self._finite
        self._finite = None
        if not self.dynamic:
            # apex never reads the flag back for a static scale: it never skips, it only counts.
            self._static_unskipped += 1
            return False
        if finite is None:
            finite = torch.ones((), dtype=torch.bool, device=self._ls.loss_scale.device)
        self._has_overflow = not bool(finite)  # the one host read (apex's skip is decided on the host)
        self._follow(finite.device)
        self._ls = _update_scale(self._ls, finite)
        return self._has_overflow

    # -- checkpoints: exactly apex's attributes --------------------------------------------------

    def __getstate__(self) -> dict:
        dev = self._ls.loss_scale.device
        return {"dynamic": self.dynamic, "_loss_scale": self.loss_scale(), "_max_loss_scale": self._max_loss_scale,
                "_min_loss_scale": self._min_loss_scale, "_scale_seq_len": self._scale_seq_len,
                "_unskipped": self._unskipped, "_has_overflow": bool(self._has_overflow),
                "_overflow_buf": torch.tensor([int(self._has_overflow)], dtype=torch.int32, device=dev)}

    def __setstate__(self, state: dict) -> None:
        missing = [k for k in ("dynamic", "_loss_scale", "_unskipped") if k not in state]
        if missing:
            raise ValueError(f"LossScaler: a stored apex amp scaler needs {missing} (has {sorted(state)})")
        checked_scale(state["_loss_scale"], "LossScaler: the stored _loss_scale")
        check_unskipped(state["_unskipped"], bool(state["dynamic"]), "LossScaler: the stored _unskipped")
        buf = state.get("_overflow_buf")
        device = buf.device if isinstance(buf, torch.Tensor) else torch.device("cpu")
        self._build(state["dynamic"], float(state["_loss_scale"]), state.get("_min_loss_scale"),
                    state.get("_max_loss_scale", 2.0**24), state.get("_scale_seq_len", 2000),
                    int(state["_unskipped"]), device)
        self._has_overflow = bool(state.get("_has_overflow", False))

    @classmethod
    def from_apex(cls, obj) -> "LossScaler":
        """This class from any apex-shaped scaler object (apex's pickled one, or this class).

        ``apex.amp.scaler.LossScaler`` attributes (``dynamic``, ``_loss_scale``, ``_unskipped``,
        ``_min_loss_scale``, ``_max_loss_scale``, ``_scale_seq_len``) carry over exactly. apex's
        older ``fp16_utils`` scalers (``cur_scale``; dynamic ones with ``scale_window``,
        ``cur_iter``, ``last_overflow_iter``) become the same rule with floor 1 and no cap.
        Anything else raises ``TypeError`` naming its type and attributes.
        """
        if isinstance(obj, cls):
            return obj
        attrs = obj if isinstance(obj, dict) else getattr(obj, "__dict__", {})
        if "_loss_scale" in attrs and "dynamic" in attrs:
            out = cls.__new__(cls)
            out.__setstate__(dict(attrs))
            return out
        cur = attrs.get("cur_scale", None)
        if cur is None and hasattr(obj, "cur_scale"):
            cur = obj.cur_scale
        if cur is not None:
            if "scale_window" in attrs or hasattr(obj, "scale_window"):
                factor = float(getattr(obj, "scale_factor", attrs.get("scale_factor", 2.0)))
                if factor != 2.0:
                    raise ValueError(f"LossScaler.from_apex: a fp16_utils DynamicLossScaler with scale_factor="
                                     f"{factor} has no amp equivalent (amp's factor is 2)")
                window = int(getattr(obj, "scale_window", attrs.get("scale_window")))
                it = int(getattr(obj, "cur_iter", attrs.get("cur_iter", 0)))
                last = int(getattr(obj, "last_overflow_iter", attrs.get("last_overflow_iter", -1)))
                out = cls("dynamic", init_scale=float(cur), scale_window=window, min_loss_scale=1.0,
                          max_loss_scale=math.inf)
                out._unskipped = (it - last - 1) % window
                return out
            return cls(float(cur))
        raise TypeError(f"LossScaler.from_apex: {type(obj).__name__} is not an apex loss scaler "
                        f"(attributes: {sorted(attrs)})")

    def __repr__(self) -> str:
        return f"LossScaler({'dynamic' if self.dynamic else 'static'}, loss_scale={self.loss_scale()})"


# FP16_Optimizer checkpoints hold the scaler object itself (apex's format); its pickled state is
# plain numbers and one small tensor, so torch.load(weights_only=True) may accept it.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([LossScaler])
