"""``torch.amp``-compatible ``GradScaler``, ``autocast`` and ``custom_fwd``/``custom_bwd``.

Migration is an import change::

    from ampfunc.compat.torch_amp import GradScaler, autocast   # was: from torch.amp import ...

    scaler = GradScaler("cuda")
    with autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                     # optional, e.g. before clip_grad_norm_
    scaler.step(optimizer)
    scaler.update()

:class:`GradScaler` keeps torch's constructor, methods, properties, errors and ``state_dict``
keys. It is a stateful shell over ampfunc's pure core: its only numeric state is a
:class:`ampfunc.DynamicLossScale` (configured ``min_scale=0, max_scale=inf, hysteresis=1`` by
default, which reproduces torch's scale sequence step for step), replaced by
:func:`ampfunc.update_scale` at each :meth:`GradScaler.update`. Gradients are unscaled in place
by :func:`ampfunc.ops.unscale_`, the same door every ampfunc primitive uses. Beyond torch it
offers ``min_scale``/``max_scale``/``hysteresis``, bf16 gradients, and
``step(..., return_found_inf=True)`` which reports whether the step was taken as a device
tensor (no host sync on the path of optimizers with ``_step_supports_amp_scaling``, e.g.
``torch.optim.Adam(fused=True)``).
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections import abc, defaultdict
from typing import Any, Callable

import torch
import torch.amp.grad_scaler as _torch_grad_scaler

from ampfunc import ops
from ampfunc.loss_scale import DynamicConfig, DynamicLossScale, _scale_tensor, _valid_scale
from ampfunc.mixed import scale_loss, update_scale
from ampfunc.policy import Policy, get_policy

__all__ = ["GradScaler", "OptState", "autocast", "custom_fwd", "custom_bwd"]


# torch's own per-optimizer bookkeeping: frameworks read these entries (``stage`` is torch's
# OptState, ``found_inf_per_device`` maps a device to a 0-d fp32 tensor, 1. if that device's
# grads held an inf/NaN), so the facade keeps exactly torch's objects.
OptState = _torch_grad_scaler.OptState
_refresh_per_optimizer_state = _torch_grad_scaler._refresh_per_optimizer_state


def _is_scalar_float(t: torch.Tensor) -> bool:
    return t.numel() == 1 and t.dim() == 0 and torch.is_floating_point(t)


def _device_type(device) -> str:
    """GradScaler's ``device`` as the device type string torch compares with ``tensor.device.type``."""
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        try:
            return torch.device(device).type
        except RuntimeError:
            pass
    # Typically torch.cuda.amp.GradScaler's positional order, GradScaler(1024.0, 2.0), after the
    # import swap: torch.amp.GradScaler's first argument is the device.
    raise TypeError(f"GradScaler: device must be a device type string such as 'cuda' or 'cpu', or a torch.device, "
                    f"got {device!r} ({type(device).__name__}). torch.amp.GradScaler (and this class) take "
                    "(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled); "
                    "torch.cuda.amp.GradScaler took (init_scale, growth_factor, ...): write "
                    "GradScaler('cuda', init_scale, ...) or pass the settings by keyword")


class GradScaler:
    """``torch.amp.GradScaler`` with the same API, on ampfunc's pure loss-scale primitives.

    Args (as torch): ``device`` (a device type string, ``"cuda"``, ``"cpu"``, ..., or a
    ``torch.device``, whose type is kept; with ``"cuda"`` and no CUDA the scaler warns and
    disables itself, as torch does), ``init_scale=2.**16``, ``growth_factor=2.0``,
    ``backoff_factor=0.5``, ``growth_interval=2000``, ``enabled=True``. The first positional
    argument is ``device``, as in ``torch.amp.GradScaler``; ``torch.cuda.amp.GradScaler``'s was
    ``init_scale``, so ``GradScaler(1024.0)`` is refused naming the two orders.

    Keyword-only extras: ``min_scale=0.0`` (floor of the backoff; torch has none),
    ``max_scale=inf`` (cap of the growth), ``hysteresis=1`` (overflowing steps tolerated
    before backing off). With the defaults the scale sequence equals torch's exactly.
    ``init_scale`` must lie in ``[min_scale, max_scale]``.

    torch's private attributes are kept with torch's meaning, for frameworks and subclasses
    that read or assign them: ``_scale``, ``_growth_tracker`` (tensors, ``None`` before the
    first ``scale()``; assigning ``None`` resets lazily), ``_growth_factor``,
    ``_backoff_factor``, ``_growth_interval``, ``_init_scale``, ``_enabled``, and the hook
    ``_maybe_opt_step`` through which ``step`` decides a plain optimizer's step. Assignments
    are checked like the public setters before anything changes.

    Costs: ``scale``/``unscale_``/``update`` never sync with the host. ``step`` reads one flag
    back to decide whether to call ``optimizer.step()`` (as torch does), except for optimizers
    that set ``_step_supports_amp_scaling`` (torch's fused optimizers), which receive
    ``grad_scale``/``found_inf`` tensors and skip on the device. ``get_scale``,
    ``state_dict``, pickling and assigning ``_scale``/``_growth_tracker`` read back (one sync).
    """

    def __init__(self, device: str | torch.device = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 min_scale: float = 0.0, max_scale: float = math.inf, hysteresis: int = 1) -> None:
        self._device = _device_type(device)
        self._enabled = enabled
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                          stacklevel=2)
            self._enabled = False
        # torch's _scale and _growth_tracker, plus the hysteresis counter that goes with the
        # growth tracker: 0-d tensors created by the first scale() on its tensor's device (as
        # in torch), None until then or after a reset by assignment.
        self._scale_t: torch.Tensor | None = None
        self._growth_tracker_t: torch.Tensor | None = None
        self._hysteresis_tracker_t: torch.Tensor | None = None
        if not self._enabled:
            # torch's disabled scaler still stores what set_growth_factor & co. are given.
            self._config = DynamicConfig(growth_factor, backoff_factor, growth_interval, min_scale, max_scale,
                                         hysteresis)
            self._init_scale_value = init_scale
            return
        if growth_factor <= 1.0:
            raise AssertionError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise AssertionError("The backoff factor must be < 1.0.")
        # Validated here so that a bad setting fails at construction, naming the setting.
        self._config = DynamicConfig(growth_factor, backoff_factor, growth_interval, min_scale, max_scale,
                                     hysteresis).validate()
        # Refused at construction unless finite and nonzero in fp32 (torch accepts 0 or inf and
        # then writes inf/NaN into the run) and within [min_scale, max_scale]: named, before
        # anything is built.
        self._init_scale_value = self._checked_scale_value(init_scale, "GradScaler: init_scale")
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = int(hysteresis)
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)

    # -- the loss scale -----------------------------------------------------------------------

    @property
    def loss_scale(self) -> DynamicLossScale | None:
        """The current :class:`ampfunc.DynamicLossScale` (``None`` before the first ``scale()``)."""
        return self._ls if self._enabled else None

    @property
    def _ls(self) -> DynamicLossScale | None:
        """The held scale and trackers as one :class:`DynamicLossScale` (no copy), ``None``
        unless both ``_scale`` and ``_growth_tracker`` are held."""
        if self._scale_t is None or self._growth_tracker_t is None:
            return None
        return DynamicLossScale.from_tensors(self._scale_t, self._growth_tracker_t, self._hysteresis_tracker_t,
                                             self._config)

    @_ls.setter
    def _ls(self, ls: DynamicLossScale) -> None:
        self._scale_t, self._growth_tracker_t, self._hysteresis_tracker_t = \
            ls.loss_scale, ls.growth_tracker, ls.hysteresis_tracker

    def _checked_scale_value(self, value, name: str) -> float:
        """``value`` (a number or a one-element real tensor, read once) as a float, refused
        unless it lies in SCALE_RANGE in fp32 and in ``[min_scale, max_scale]``."""
        scale = float(_scale_tensor(value, "cpu", name))
        c = self._config
        if not (c.min_scale <= scale <= c.max_scale):
            raise ValueError(f"{name} = {scale!r} lies outside [min_scale, max_scale] = [{c.min_scale!r}, "
                             f"{c.max_scale!r}]; widen min_scale or max_scale (torch's setting is 0 and inf)")
        return scale

    @property
    def _init_scale(self) -> float:
        """torch's attribute: the scale the first ``scale()`` (or a reset) starts from."""
        return self._init_scale_value

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        if self._enabled:
            value = self._checked_scale_value(value, "GradScaler._init_scale")
        self._init_scale_value = value

    @property
    def _scale(self) -> torch.Tensor | None:
        """torch's attribute: the 0-d fp32 scale tensor (``None`` before the first ``scale()``).

        Assignable as in torch: a one-element floating tensor without grad, on the growth
        tracker's device, in SCALE_RANGE and ``[min_scale, max_scale]`` (read once), is held
        as a 0-d fp32 tensor (the tensor itself when it already is one); a number is taken on the
        growth tracker's device; ``None`` drops it, and the next ``scale()`` starts again from
        ``_init_scale`` once ``_growth_tracker`` is ``None`` too. Anything else is refused,
        naming ``_scale``, before anything changes. In-place writes (``_scale *= 0.5``,
        ``_scale.fill_(x)``) act on the held tensor, as in torch, and cannot be checked before
        they happen: a value they leave outside SCALE_RANGE skips the steps.
        """
        return self._scale_t

    @_scale.setter
    def _scale(self, value: torch.Tensor | float | None) -> None:
        if value is None or value is self._scale_t:  # None resets; the held tensor was written in place
            self._scale_t = value
            return
        name = "GradScaler._scale"
        tracker = self._growth_tracker_t
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or not torch.is_floating_point(value) or value.requires_grad \
                    or value.layout != torch.strided:
                raise TypeError(f"{name} must be a one-element floating tensor without grad (torch's 0-d fp32 "
                                f"scale), got a {value.dtype} tensor of shape {tuple(value.shape)}"
                                + (" that requires grad" if value.requires_grad else ""))
            if tracker is not None and value.device != tracker.device:
                raise ValueError(f"{name} must be on the device of _growth_tracker ({tracker.device}), got a "
                                 f"tensor on {value.device}")
            device = value.device
        elif tracker is None:
            raise TypeError(f"{name} must be a tensor while _growth_tracker is None (no device to put a number "
                            f"on), got {type(value).__name__}")
        else:
            device = tracker.device
        self._checked_scale_value(value, name)
        if isinstance(value, torch.Tensor):  # torch holds the tensor itself; ours must be 0-d fp32
            self._scale_t = (value if value.dim() == 0 else value.reshape(())).to(torch.float32)
        else:
            self._scale_t = torch.tensor(float(value), dtype=torch.float32).to(device)

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """torch's attribute: the 0-d int32 count of clean steps since the last change.

        Assignable as in torch: an integer (a one-element integer tensor on the scale's device,
        or a number, put on the scale's device) in ``[0, 2**31 - 1]`` (read once), held as a
        0-d int32 tensor; ``None`` drops it. Anything else is refused, naming
        ``_growth_tracker``, before anything changes.
        """
        return self._growth_tracker_t

    @_growth_tracker.setter
    def _growth_tracker(self, value: torch.Tensor | int | None) -> None:
        if value is None:
            self._growth_tracker_t = self._hysteresis_tracker_t = None
            return
        if value is self._growth_tracker_t:  # written in place
            return
        name = "GradScaler._growth_tracker"
        scale = self._scale_t
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype == torch.bool or value.is_floating_point() or value.is_complex() \
                    or value.layout != torch.strided:
                raise TypeError(f"{name} must be a one-element integer tensor (torch's 0-d int32 tracker), got a "
                                f"{value.dtype} tensor of shape {tuple(value.shape)}")
            if scale is not None and value.device != scale.device:
                raise ValueError(f"{name} must be on the device of _scale ({scale.device}), got a tensor on "
                                 f"{value.device}")
            device, count = value.device, int(value.item())
        elif isinstance(value, int) and not isinstance(value, bool):
            if scale is None:
                raise TypeError(f"{name} must be a tensor while _scale is None (no device to put a number on), "
                                f"got {type(value).__name__}")
            device, count = scale.device, value
        else:
            raise TypeError(f"{name} must be an integer or a one-element integer tensor, got {type(value).__name__}")
        if not (0 <= count <= 2**31 - 1):
            raise ValueError(f"{name} must be in [0, 2**31 - 1] (a count of clean steps, held in int32), "
                             f"got {count!r}")
        if isinstance(value, torch.Tensor):  # torch holds the tensor itself; ours must be 0-d int32
            self._growth_tracker_t = (value if value.dim() == 0 else value.reshape(())).to(torch.int32)
        else:
            self._growth_tracker_t = torch.tensor(count, dtype=torch.int32).to(device)
        hysteresis = self._hysteresis_tracker_t
        self._hysteresis_tracker_t = (
            torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=device) if hysteresis is None
            else hysteresis.to(device))

    def _settings(self) -> DynamicConfig:
        return self._config

    def _set_setting(self, where: str, **change) -> None:
        if not self._enabled:
            # As torch's disabled scaler: stored, not checked (a disabled scaler never uses them).
            self._config = self._config._replace(**change)
            return
        try:
            self._config = self._config._replace(**change).validate()
        except (TypeError, ValueError) as e:
            hint = ""
            if change.get("growth_factor") == 1 or change.get("backoff_factor") == 1:
                hint = ("; for a constant scale construct GradScaler(device, init_scale=s, min_scale=s, "
                        "max_scale=s)")
            raise type(e)(f"{where}: {str(e).removeprefix('DynamicLossScale: ')}{hint}") from None

    def _setting_attribute(field: str):  # noqa: N805 -- called in the class body
        """torch's attribute ``_<field>`` (read by ``update``): reads the setting; assigning it is
        ``set_<field>``, with its checks."""
        return property(lambda self: getattr(self._config, field),
                        lambda self, value: self._set_setting(f"GradScaler._{field}", **{field: value}),
                        doc=f"torch's ``_{field}`` (read by ``update``); assigning it is ``set_{field}``.")

    _growth_factor = _setting_attribute("growth_factor")
    _backoff_factor = _setting_attribute("backoff_factor")
    _growth_interval = _setting_attribute("growth_interval")
    del _setting_attribute

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        """torch's hook: creates ``_scale`` and ``_growth_tracker`` on ``dev`` (``AssertionError``
        while a growth tracker is held)."""
        if self._growth_tracker_t is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        dev = torch.device(dev)
        self._scale_t = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker_t = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._hysteresis_tracker_t = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)

    def _check_initialized(self, funcname: str) -> DynamicLossScale:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale_t is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker_t is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._ls

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's hook: ``(_scale, _growth_tracker)``, or torch's ``AssertionError`` before ``scale()``."""
        ls = self._check_initialized(funcname)
        return ls.loss_scale, ls.growth_tracker

    # -- scale --------------------------------------------------------------------------------

    def scale(self, outputs):
        """``outputs`` times the current scale: a tensor, or a (nested) list/tuple/dict of them.

        A scalar floating loss goes through :func:`ampfunc.scale_loss` (``loss.float() * scale``,
        so the product is fp32 even for an fp16 loss); other tensors are multiplied as torch
        does (``t * scale``, keeping ``t``'s dtype). Returns ``outputs`` unchanged when disabled.
        No host sync.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale_t is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return self._scale_one(outputs)

        def apply(value):
            if isinstance(value, torch.Tensor):
                if self._scale_t is None:
                    self._lazy_init_scale_growth_tracker(value.device)
                return self._scale_one(value)
            if isinstance(value, abc.Mapping):
                return type(value)((k, apply(v)) for k, v in value.items())
            if isinstance(value, abc.Iterable) and not isinstance(value, (str, bytes)):
                mapped = map(apply, value)
                if isinstance(value, (list, tuple)):
                    if hasattr(value, "_fields"):  # NamedTuple
                        return type(value)(*mapped)
                    return type(value)(mapped)
                return mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _scale_one(self, t: torch.Tensor) -> torch.Tensor:
        if _is_scalar_float(t):
            # The held scale as a loss scale (no copy; the trackers play no part in scaling).
            return scale_loss(t, DynamicLossScale.from_tensors(self._scale_t, self._growth_tracker_t,
                                                               self._hysteresis_tracker_t, self._config))
        return t * self._scale_t.to(device=t.device, non_blocking=True)

    # -- unscale ------------------------------------------------------------------------------

    @staticmethod
    def _grads_by_device(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> dict[torch.device, list[torch.Tensor]]:
        grads: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        # torch unscales dense and sparse COO gradients; a compressed layout (CSR, CSC, BSR, BSC)
        # has no values view to unscale: refused by name before any gradient is touched.
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                grad = getattr(param, "grad", None)
                if isinstance(grad, torch.Tensor) and grad.layout not in (torch.strided, torch.sparse_coo):
                    raise TypeError(f"GradScaler: the gradient of optimizer.param_groups[{g}]['params'][{i}] (shape "
                                    f"{tuple(param.shape)}) has layout {grad.layout}; gradients are unscaled dense or "
                                    "sparse COO (as torch's GradScaler), not in a compressed layout (densify it with "
                                    ".to_dense(), or keep the param in the COO layout with .to_sparse())")
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not isinstance(param, torch.Tensor):
                    raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if param.grad.is_sparse:
                    if param.grad.dtype is torch.float16:
                        # Coalescing may itself overflow, so check the coalesced values (torch's rule).
                        param.grad = param.grad.coalesce()
                    to_unscale = param.grad._values()
                else:
                    to_unscale = param.grad
                grads[to_unscale.device].append(to_unscale)
        return grads

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch's hook: multiplies the optimizer's grads by ``inv_scale`` in place and flags non-finite ones.

        As torch: fp16 grads raise ``ValueError`` unless ``allow_fp16``; sparse fp16 grads are
        coalesced first. Returns ``{device: found_inf}`` for each device holding grads, each a
        fresh 0-d fp32 copy of ``found_inf`` set to ``1.`` if that device's grads held an
        inf/NaN, or if the scale is not valid (held outside ``SCALE_RANGE``, e.g. set to 0 by hand,
        or ``inv_scale`` not finite and nonzero): such a step is skipped instead of writing NaN
        into the params (``found_inf`` itself is not written). One pass per device
        (:func:`ampfunc.ops.unscale_`), no host sync.
        """
        per_device_found_inf: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            # The kernel judges the gradients it reads; a scale set by hand outside SCALE_RANGE (0,
            # negative, inf, NaN) gives an inverse that turns finite gradients into NaN/inf (or
            # zeros), so the scale's validity is part of the flag: such a step is skipped.
            valid = self._valid_scale_flag(inv_scale)
            for device, grads in self._grads_by_device(optimizer, allow_fp16).items():
                inv = inv_scale.to(device=device, non_blocking=True)
                finite = ops.unscale_(grads, inv).reshape(()).to(device) & valid.to(device=device, non_blocking=True)
                found = found_inf.to(device=device, non_blocking=True, copy=True)
                per_device_found_inf[device] = found.masked_fill_(~finite, 1.0)
        return per_device_found_inf

    def _valid_scale_flag(self, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """0-d bool: the held scale lies in SCALE_RANGE and ``inv_scale`` (if given) is finite
        and nonzero. No host sync."""
        valid = _valid_scale(self._scale_t) if self._scale_t is not None else torch.ones((), dtype=torch.bool)
        if inv_scale is not None:
            inv = inv_scale.detach().reshape(())
            valid = valid.to(inv.device) & torch.isfinite(inv) & (inv != 0)
        return valid

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale, in place, and records whether they are finite.

        As torch: at most once per optimizer per iteration, after all gradients are accumulated;
        a second call raises ``RuntimeError``, as does a call after :meth:`step`. fp16 gradients
        raise ``ValueError("Attempting to unscale FP16 gradients.")`` (in-place fp16 unscaling
        loses precision); fp32 and bf16 gradients are accepted. The record is torch's
        ``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]``. One read and one write
        of the gradients (:func:`ampfunc.ops.unscale_`), no host sync.
        """
        if not self._enabled:
            return
        ls = self._check_initialized("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.zeros((), dtype=torch.float32, device=ls.loss_scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, ls.inv_scale, found_inf, False)
        state["stage"] = OptState.UNSCALED

    def _found_inf_of(self, state: dict[str, Any]) -> torch.Tensor:
        """The optimizer's per-device found_inf summed on the scale's device (torch's combination)."""
        found = [t.to(device=self._scale_t.device, non_blocking=True)
                 for t in state["found_inf_per_device"].values()]
        if not found:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        return found[0] if len(found) == 1 else torch.stack([f.reshape(()) for f in found]).sum()

    # -- step ---------------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, return_found_inf: bool = False, **kwargs: Any):
        """Unscales (unless :meth:`unscale_` already did) and calls ``optimizer.step()`` if the grads are finite.

        Returns what ``optimizer.step(*args, **kwargs)`` returned (``None`` when skipped). With
        ``return_found_inf=True`` returns ``(retval, found_inf)``, ``found_inf`` a 0-d fp32
        tensor on the scale's device, non-zero when the recorded flags say the step was skipped
        (read after ``_maybe_opt_step``, so flags a subclass combines in place are included); it
        costs no host sync of its own.

        Optimizers with ``_step_supports_amp_scaling`` (torch's fused Adam/AdamW/SGD) get
        ``optimizer.grad_scale`` and ``optimizer.found_inf`` and unscale and skip on the device:
        the finiteness check is a read-only pass and nothing is read back to the host. One whose
        ``step`` takes ``grad_scaler`` (the legacy contract) gets the scaler and records its own
        checks, as in torch (``update`` complains if it recorded none). Other optimizers go
        through torch's hook ``self._maybe_opt_step(optimizer, optimizer_state, *args,
        **kwargs)`` (subclasses that override it, e.g. to all-reduce the flags, are called), which
        reads the flag on the host to decide whether to step: one sync (torch reads one per device).

        A ``closure`` raises ``RuntimeError`` (the closure would run the backward pass after
        the gradients were checked), as in torch.
        """
        if not self._enabled:
            retval = optimizer.step(*args, **kwargs)
            return (retval, torch.zeros(())) if return_found_inf else retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_initialized("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            retval, found_inf = self._fused_step(optimizer, state, args, kwargs)
        else:
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            if not state["found_inf_per_device"]:
                raise AssertionError("No inf checks were recorded for this optimizer.")
            retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
            found_inf = self._found_inf_of(state) if return_found_inf else None
        state["stage"] = OptState.STEPPED
        return (retval, found_inf) if return_found_inf else retval

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any,
                        **kwargs: Any):
        """torch's hook: calls ``optimizer.step(*args, **kwargs)`` unless ``optimizer_state``'s
        recorded flags (``found_inf_per_device``) hold an inf/NaN; returns its result or ``None``.

        :meth:`step` routes every optimizer without ``_step_supports_amp_scaling`` through it,
        so subclasses override it as they do torch's (torch_xla, NeMo: combine the flags across
        ranks first). Cost: one host read of the summed flags (torch reads one per device).
        """
        retval = None
        # The one host read of the step: a plain optimizer cannot skip on the device.
        if not bool(self._found_inf_of(optimizer_state)):
            retval = optimizer.step(*args, **kwargs)
        return retval

    def _fused_step(self, optimizer, state, args, kwargs):
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            # Legacy contract (apex FusedAdam capturable, old torch fused optimizers): the
            # optimizer pulls the scale and the inf checks from the scaler itself.
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning, stacklevel=3)
            retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            # Whatever the optimizer recorded (through _check_inf_per_device) is the verdict, as in
            # torch: none recorded (an optimizer that ignores the scaler) is not made up here after
            # the fact; update() then raises torch's "No inf checks were recorded".
            found_inf = self._found_inf_of(state) if state["found_inf_per_device"] else \
                torch.zeros((), dtype=torch.float32, device=self._scale_t.device)
            return retval, found_inf
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        # No grad anywhere: torch hands the fused optimizer a found_inf of 0 (its step is a
        # no-op) and only update() then complains that no inf check was recorded.
        found_inf = self._found_inf_of(state) if state["found_inf_per_device"] else \
            torch.zeros((), dtype=torch.float32, device=self._scale_t.device)
        scale = self._get_scale_async()
        # Already unscaled by unscale_(): keep whatever grad_scale the user set (None -> no unscale).
        optimizer.grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] is OptState.UNSCALED
                                else scale * getattr(optimizer, "grad_scale", 1))
        optimizer.found_inf = found_inf
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        return retval, found_inf

    # torch's private hooks used by the legacy fused-optimizer contract and by frameworks.
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale_t

    def _check_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        """torch's hook: records (and returns) ``{device: found_inf}`` for the optimizer's grads,
        leaving them as they are.

        A read-only pass per device (:func:`ampfunc.ops.all_finite`; torch multiplies by 1
        instead); fp16 grads are allowed. A scale outside ``SCALE_RANGE`` (set by hand) is
        recorded as an inf, so the step is skipped. No host sync.
        """
        self._check_initialized("_check_inf_per_device")
        per_device: dict[torch.device, torch.Tensor] = {}
        valid = self._valid_scale_flag()  # a hand-set invalid scale must skip the fused step too
        for device, grads in self._grads_by_device(optimizer, allow_fp16=True).items():
            finite = ops.all_finite(grads).reshape(()).to(device) & valid.to(device=device, non_blocking=True)
            per_device[device] = (~finite).to(torch.float32)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return per_device

    def _found_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        """torch's hook: the ``{device: found_inf}`` recorded for ``optimizer`` this iteration."""
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # -- update -------------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advances the scale: back off if any optimizer's step overflowed, else count towards growth.

        ``new_scale`` (a number or a 0-d tensor without grad on this scaler's device type)
        sets the scale instead, leaving the growth tracker as it is (torch's rule). As in torch,
        another tensor raises ``AssertionError`` (wrong device type, ``numel() != 1``,
        ``requires_grad``); a one-element tensor that is not 0-d (shape ``(1,)``), which torch
        cannot copy into its 0-d scale, raises ``ValueError`` naming ``new_scale`` and its shape,
        and so does a scale that is 0, negative, NaN or inf in fp32 (torch would take it), or one
        outside ``[min_scale, max_scale]`` (settings torch does not have), before anything
        changes. Call once per iteration, after every ``step``. Pure update of the held loss
        scale (:func:`ampfunc.update_scale`); no host sync, except that ``new_scale`` is read once.
        """
        if not self._enabled:
            return
        ls = self._check_initialized("update")
        if new_scale is not None:
            if not isinstance(new_scale, (int, float)) or isinstance(new_scale, bool):
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if not isinstance(new_scale, torch.Tensor):
                    raise AssertionError(reason)
                if new_scale.device.type != self._device or new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AssertionError(reason)
                if new_scale.dim() != 0:
                    # torch copies it into its 0-d scale: "output with shape [] doesn't match the
                    # broadcast shape [1]".
                    raise ValueError(f"GradScaler.update: new_scale must be a float or a 0-d tensor (as "
                                     f"torch.amp.GradScaler takes it), got a tensor of shape "
                                     f"{tuple(new_scale.shape)}; pass new_scale.reshape(())")
            # An explicitly set scale is read once to refuse 0/inf/NaN (unlike torch, which then
            # fills the run with inf/NaN) and a scale outside [min_scale, max_scale], from which
            # the next backoff would *raise* the scale to min_scale; the scale stays on its device.
            value = self._checked_scale_value(new_scale, "GradScaler.update: new_scale")
            self._scale_t = torch.tensor(value, dtype=torch.float32).to(ls.loss_scale.device)
        else:
            found = [t.to(device=ls.loss_scale.device, non_blocking=True).reshape(())
                     for s in self._per_optimizer_states.values() for t in s["found_inf_per_device"].values()]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update.")
            combined = found[0] if len(found) == 1 else torch.stack(found).sum()
            self._ls = update_scale(ls, combined == 0)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- getters and setters ------------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (``1.0`` when disabled). Syncs with the device."""
        if not self._enabled:
            return 1.0
        scale = self._get_scale_async()
        return self._init_scale if scale is None else float(scale.item())

    def get_growth_factor(self) -> float:
        return self._settings().growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._set_setting("GradScaler.set_growth_factor", growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self._settings().backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._set_setting("GradScaler.set_backoff_factor", backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self._settings().growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Unlike torch, a growth interval lowered below the current tracker still triggers growth
        at the next clean step (ampfunc compares with ``>=``; torch's ``==`` never fires again)."""
        self._set_setting("GradScaler.set_growth_interval", growth_interval=new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        tracker = self._growth_tracker_t
        return self._init_growth_tracker if tracker is None else int(tracker.item())

    def _get_hysteresis_tracker(self) -> int:
        tracker = self._hysteresis_tracker_t
        return self._init_hysteresis_tracker if tracker is None else int(tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    # -- checkpoints --------------------------------------------------------------------------

    def _non_torch_settings(self) -> dict[str, Any]:
        c = self._settings()
        if (c.min_scale, c.max_scale, c.hysteresis) == (0.0, math.inf, 1):
            return {}
        return {"min_scale": c.min_scale, "max_scale": c.max_scale, "hysteresis": c.hysteresis,
                "_hysteresis_tracker": self._get_hysteresis_tracker()}

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``); ``{}`` when disabled. The extras
        ``min_scale``, ``max_scale``, ``hysteresis``, ``_hysteresis_tracker`` appear only when
        they differ from torch's behaviour, so a default scaler's checkpoint loads into
        ``torch.amp.GradScaler`` and back. Call after :meth:`update`. Syncs with the device.
        """
        if not self._enabled:
            return {}
        c = self._settings()
        return {"scale": self.get_scale(), "growth_factor": c.growth_factor, "backoff_factor": c.backoff_factor,
                "growth_interval": c.growth_interval, "_growth_tracker": self._get_growth_tracker(),
                **self._non_torch_settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict` of this class or of ``torch.amp.GradScaler``; a no-op when disabled.

        Every entry is checked before anything is loaded, so a refused state dict leaves the
        scaler as it was: ``scale`` must lie in :data:`ampfunc.loss_scale.SCALE_RANGE` once
        stored in fp32 (0, negative, NaN, inf and ``1e39`` are refused, as at construction;
        torch would take them and then write inf/NaN into the params), and in
        ``[min_scale, max_scale]``; ``growth_factor``, ``backoff_factor``, ``growth_interval``
        (and the extras ``min_scale``, ``max_scale``, ``hysteresis``) follow the constructor's
        rules; ``_growth_tracker`` must be an integer in ``[0, 2**31 - 1]`` (torch's int32
        tracker), ``_hysteresis_tracker`` one in ``[1, hysteresis]``. Numbers may be Python
        numbers or one-element tensors (bools are refused).

        Args:
          state_dict: a mapping with torch's five entries (``scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``, ``_growth_tracker``) and optionally
            ``min_scale``, ``max_scale``, ``hysteresis``, ``_hysteresis_tracker``.

        Returns:
          None.

        Raises:
          RuntimeError: ``state_dict`` is empty (saved from a disabled scaler), as torch.
          KeyError: a required entry is missing (torch's error type), naming it.
          TypeError, ValueError: an entry of the wrong type or out of range, naming it.

        Example:
          >>> scaler = GradScaler("cpu")
          >>> scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
          >>> scaler.get_scale()
          8.0

        Cost: a few host-side checks; rebuilds the 0-d scale tensors when they exist.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"GradScaler.load_state_dict: state_dict must be a mapping (from state_dict()), "
                            f"got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        where = "GradScaler.load_state_dict"
        for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
            if key not in state_dict:
                raise KeyError(f"{where}: state_dict has no {key!r} entry (keys: {sorted(map(str, state_dict))})")

        def number(key: str, integer: bool):
            value = state_dict[key]
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 or value.dtype == torch.bool or value.is_complex() \
                        or value.device.type == "meta":
                    raise TypeError(f"{where}: state_dict[{key!r}] must be a number or a one-element real tensor, "
                                    f"got a {value.dtype} tensor of shape {tuple(value.shape)}")
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{where}: state_dict[{key!r}] must be {'an integer' if integer else 'a number'}, "
                                f"got {type(value).__name__}")
            if integer:
                if not (isinstance(value, int) or (math.isfinite(value) and value == int(value))):
                    raise ValueError(f"{where}: state_dict[{key!r}] must be an integer, got {value!r}")
                return int(value)
            return float(value)

        change = {key: number(key, key == "growth_interval")
                  for key in ("growth_factor", "backoff_factor", "growth_interval")}
        for key in ("min_scale", "max_scale", "hysteresis"):
            if key in state_dict:
                change[key] = number(key, key == "hysteresis")
        try:
            config = self._settings()._replace(**change).validate()
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
        if isinstance(state_dict["scale"], bool):
            raise TypeError(f"{where}: state_dict['scale'] must be a number or a one-element tensor, got bool")
        scale = float(_scale_tensor(state_dict["scale"], "cpu", f"{where}: state_dict['scale']"))
        if not (config.min_scale <= scale <= config.max_scale):
            raise ValueError(f"{where}: state_dict['scale'] = {scale!r} lies outside [min_scale, max_scale] = "
                             f"[{config.min_scale!r}, {config.max_scale!r}]")
        growth_tracker = number("_growth_tracker", True)
        if not (0 <= growth_tracker <= 2**31 - 1):
            raise ValueError(f"{where}: state_dict['_growth_tracker'] must be an integer in [0, 2**31 - 1] (a count "
                             f"of clean steps, held in int32), got {growth_tracker!r}")
        hysteresis_tracker = config.hysteresis
        if "_hysteresis_tracker" in state_dict:
            hysteresis_tracker = number("_hysteresis_tracker", True)
            if not (1 <= hysteresis_tracker <= config.hysteresis):
                raise ValueError(f"{where}: state_dict['_hysteresis_tracker'] must be an integer in [1, hysteresis] = "
                                 f"[1, {config.hysteresis}], got {hysteresis_tracker!r}")
        # Everything checked: load.
        self._config = config
        self._init_scale_value = scale
        self._init_growth_tracker = growth_tracker
        self._init_hysteresis_tracker = hysteresis_tracker
        # The held tensors (if any) take the loaded values on their devices, as torch fills them.
        if self._scale_t is not None:
            self._scale_t = torch.full((), scale, dtype=torch.float32, device=self._scale_t.device)
        if self._growth_tracker_t is not None:
            device = self._growth_tracker_t.device
            self._growth_tracker_t = torch.full((), growth_tracker, dtype=torch.int32, device=device)
            self._hysteresis_tracker_t = torch.full((), hysteresis_tracker, dtype=torch.int32, device=device)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                     "of an iteration, or at the end after scaler.update().")
            state["_init_scale_value"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_scale_t"] = state["_growth_tracker_t"] = state["_hysteresis_tracker_t"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        # Pickles from before _scale/_growth_tracker became assignable held "_ls" (always None
        # in a pickle) and a plain "_init_scale".
        state.pop("_ls", None)
        if "_init_scale" in state:
            state["_init_scale_value"] = state.pop("_init_scale")
        for name in ("_scale_t", "_growth_tracker_t", "_hysteresis_tracker_t"):
            state.setdefault(name, None)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        if not self._enabled:
            return f"GradScaler(device={self._device!r}, enabled=False)"
        return f"GradScaler(device={self._device!r}, loss_scale={self._ls!r}, config={self._settings()})"


# ----------------------------------------------------------------------------------------------
# autocast and custom autograd functions
# ----------------------------------------------------------------------------------------------


def autocast(device_type: str = "cuda", dtype: torch.dtype | None = None, enabled: bool = True,
             cache_enabled: bool | None = None, *, policy: Policy | str | None = None) -> torch.autocast:
    """``torch.autocast``, optionally driven by an ampfunc :class:`~ampfunc.Policy`.

    Without ``policy`` this is exactly ``torch.autocast(device_type, dtype, enabled,
    cache_enabled)``. With ``policy`` (a :class:`Policy` or a spec such as ``"c=f16"``) the
    region runs in the policy's compute dtype, and is a disabled region when that dtype is
    fp32/fp64 (``policy.autocast(device_type)``). Usable as a context manager and a decorator.
    """
    if policy is None:
        return torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    if dtype is not None:
        raise ValueError("autocast: pass either dtype or policy, not both "
                         f"(got dtype={dtype} and policy={policy})")
    pol = get_policy(policy)
    extra = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    if not enabled:
        return torch.autocast(device_type, enabled=False, **extra)
    return pol.autocast(device_type, **extra)


def _device_type_of(args, kwargs) -> str:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
        if isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    return v.device.type
    return "cpu"


def _cast_dtype(cast_inputs) -> torch.dtype | None:
    if cast_inputs is None or isinstance(cast_inputs, torch.dtype):
        return cast_inputs
    if isinstance(cast_inputs, (Policy, str)):
        return get_policy(cast_inputs).compute_dtype
    raise TypeError(f"custom_fwd: cast_inputs must be a torch.dtype, a Policy or a policy string, "
                    f"got {type(cast_inputs).__name__}")


def custom_fwd(fwd: Callable | None = None, *, device_type: str | None = None, cast_inputs=None):
    """Decorator for the ``forward`` of a ``torch.autograd.Function`` (``torch.amp.custom_fwd``).

    With ``device_type`` it is ``torch.amp.custom_fwd(fwd, device_type=..., cast_inputs=...)``.
    Without it the device type is taken from the first tensor argument at each call (so the
    same Function runs under CPU or CUDA autocast), and remembered for :func:`custom_bwd`.
    ``cast_inputs`` may be a dtype, a :class:`Policy` or a policy spec (its compute dtype):
    inside an autocast region, floating inputs are cast to it and ``forward`` runs with
    autocast off; outside autocast it has no effect.
    """
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    dtype = _cast_dtype(cast_inputs)
    if device_type is not None:
        return torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=dtype)
    per_device: dict[str, Callable] = {}

    @functools.wraps(fwd)
    def forward(ctx, *args, **kwargs):
        dt = _device_type_of(args, kwargs)
        fn = per_device.get(dt)
        if fn is None:
            fn = per_device[dt] = torch.amp.custom_fwd(fwd, device_type=dt, cast_inputs=dtype)
        ctx._ampfunc_device_type = dt
        return fn(ctx, *args, **kwargs)

    return forward


def custom_bwd(bwd: Callable | None = None, *, device_type: str | None = None):
    """Decorator for the ``backward`` of a ``torch.autograd.Function`` (``torch.amp.custom_bwd``):
    runs it with the autocast state its forward ran with. Without ``device_type`` the device
    type recorded by :func:`custom_fwd` is used (else that of the first gradient)."""
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)
    if device_type is not None:
        return torch.amp.custom_bwd(bwd, device_type=device_type)
    per_device: dict[str, Callable] = {}

    @functools.wraps(bwd)
    def backward(ctx, *grads):
        dt = getattr(ctx, "_ampfunc_device_type", None) or _device_type_of(grads, {})
        fn = per_device.get(dt)
        if fn is None:
            fn = per_device[dt] = torch.amp.custom_bwd(bwd, device_type=dt)
        return fn(ctx, *grads)

    return backward
