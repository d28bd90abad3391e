"""Loss scales: immutable pytrees of 0-d tensors plus static configuration (jmp's model).

A loss scale multiplies the loss before the backward pass so that small fp16 gradients do not
flush to zero, and divides the gradients afterwards. Three kinds:

* :class:`NoOpLossScale` -- no scaling (fp32 or bf16 training);
* :class:`StaticLossScale` -- a fixed factor;
* :class:`DynamicLossScale` -- backs off when a step overflows and grows after
  ``growth_interval`` clean steps, as ``torch.amp.GradScaler`` and apex do.

Each is registered as a pytree node (optree namespace ``"ampfunc"`` and ``torch.utils._pytree``):
its tensors are the children and its configuration is static metadata, so a loss scale can be
selected with :func:`ampfunc.skip_or_apply`, saved with ``torch.save``, passed through
``torch.func`` transforms and ``torch.compile``. Nothing here reads a tensor back to the host.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch
import torch.utils._pytree as torch_pytree

from ampfunc import ops
from ampfunc.tree import (
    NAMESPACE,
    PyTree,
    arithmetic_dtype,
    check_flag,
    float_leaves_with_paths,
    tree_flatten,
    tree_unflatten,
)

__all__ = ["LossScale", "NoOpLossScale", "StaticLossScale", "DynamicLossScale", "DynamicConfig", "SCALE_RANGE"]

#: Every loss scale ampfunc holds lies in this closed range: the normal fp32 numbers. Its lower end
#: is the smallest scale whose fp32 inverse is finite with room to spare (``2**-126``, fp32's
#: smallest normal number), its upper end fp32's largest. Construction refuses a scale outside it,
#: and :func:`ampfunc.update_scale` never leaves it, whatever ``min_scale`` and ``max_scale``
#: say (with ``min_scale=0`` the floor is ``2**-126``: torch's GradScaler instead reaches 0 after
#: ~150 overflowing steps and then writes inf into every parameter). A scale that got outside it
#: anyway (a tensor set by hand) has a NaN :attr:`LossScale.inv_scale`, so every step with it is
#: skipped rather than applied.
SCALE_RANGE = (2.0**-126, float(torch.finfo(torch.float32).max))


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"scale_loss: the loss must be a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"scale_loss: the loss must be a scalar (one element), got shape {tuple(loss.shape)}; "
            "reduce it (e.g. .mean()) before scaling"
        )
    if not torch.is_floating_point(loss):
        raise TypeError(f"scale_loss: the loss must be floating point, got dtype {loss.dtype}")
    return loss


def _scale_tensor(value, device, name) -> torch.Tensor:
    """``value`` (a number or a one-element real tensor) as a 0-d fp32 tensor on ``device``,
    refused unless it lies in :data:`SCALE_RANGE` once stored in fp32. A tensor is read back to
    the host once, here at construction (never in a step)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a tensor of dtype {value.dtype}")
        if value.device.type == "meta":
            raise ValueError(f"{name} is a tensor on the meta device (it has no value)")
        out = value.detach().reshape(()).to(device=device if device is not None else value.device,
                                            dtype=torch.float32, copy=True)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number or a one-element tensor, got {type(value).__name__}")
    else:
        out = torch.tensor(float(value), dtype=torch.float32, device=device)
    stored = float(out.item())
    lo, hi = SCALE_RANGE
    if not (lo <= stored <= hi):
        given = value.item() if isinstance(value, torch.Tensor) else value
        raise ValueError(f"{name} must be a finite number in [2**-126, {hi:.4g}] once stored in fp32 (so that "
                         f"it and its inverse are finite and nonzero), got {given!r} (stored as {stored!r})")
    return out


def _valid_scale(loss_scale: torch.Tensor) -> torch.Tensor:
    """0-d bool: ``loss_scale`` lies in :data:`SCALE_RANGE` (NaN, 0, subnormal and inf do not)."""
    return (loss_scale >= SCALE_RANGE[0]) & (loss_scale <= SCALE_RANGE[1])


def _fp32_unscaled(tree: PyTree, inv_scale: torch.Tensor | None, what: str):
    """``(tree in fp32 times inv_scale, finite)``; errors name the non-floating leaf.

    fp64 leaves stay fp64 (the product taken in fp64): an fp64 model's gradients would lose
    29 bits in fp32, and its optimizer computes in fp64. ``inv_scale=None`` means no scaling:
    the leaves are only cast (fp32 and fp64 leaves are returned as they are) and checked with
    one read-only pass.
    """
    _, leaves = float_leaves_with_paths(tree, what)
    _, spec = tree_flatten(tree)
    if inv_scale is None:
        return tree_unflatten(spec, [t.to(arithmetic_dtype(t.dtype)) for t in leaves]), ops.all_finite(leaves)
    if any(t.dtype == torch.float64 for t in leaves) or (torch.is_grad_enabled() and
                                                         any(t.requires_grad for t in leaves)):
        # A gradient penalty differentiates through the unscale (grads taken with
        # create_graph=True), and the kernels have no backward; the kernels also write fp32
        # only. Plain torch ops then, the same values (the product in fp32, fp64 for fp64
        # leaves), with the finite flag from the check pass.
        outs = [t.to(arithmetic_dtype(t.dtype)) * inv_scale.to(arithmetic_dtype(t.dtype)) for t in leaves]
        return tree_unflatten(spec, outs), ops.all_finite([t.detach() for t in leaves])
    outs, finite = ops.unscale(leaves, inv_scale)
    return tree_unflatten(spec, outs), finite


class LossScale:
    """The interface of every loss scale (jmp's ``LossScale``).

    Methods: ``scale(loss)`` (the loss in fp32 times the scale), ``unscale(tree)`` and
    ``unscale_and_check(tree)`` (floating leaves in fp32, fp64 ones in fp64, times
    ``inv_scale``, and whether they were all finite), ``is_valid()``. None of them reads a tensor
    back to the host. The next scale after a step is :func:`ampfunc.update_scale` (in place:
    :func:`ampfunc.mixed.update_scale_`), which calls the subclass's ``_adjust``/``_adjust_``.

    Attributes:
      loss_scale: 0-d fp32 tensor, the factor the loss is multiplied by.
      inv_scale: 0-d fp32 tensor, ``1 / loss_scale`` (NaN when the scale lies outside
        :data:`SCALE_RANGE`).

    Example:
      >>> ls = af.StaticLossScale(1024.0)
      >>> isinstance(ls, af.loss_scale.LossScale)
      True
      >>> ls.scale(torch.tensor(0.5))
      tensor(512.)
      >>> grads, finite = ls.unscale_and_check({"w": torch.tensor([1024.0, float("inf")])})
      >>> bool(finite)
      False
    """

    __slots__ = ()

    @property
    def loss_scale(self) -> torch.Tensor:
        raise AttributeError

    @property
    def inv_scale(self) -> torch.Tensor:
        """0-d fp32 ``1 / loss_scale``, the reciprocal taken in double (as GradScaler does).

        NaN when the scale lies outside :data:`SCALE_RANGE` (0, subnormal, inf or NaN: only a
        tensor set by hand gets there), so gradients unscaled by it are not finite and the step
        is skipped instead of writing inf or NaN into the state. Two 0-d ops, no host sync.
        """
        s = self.loss_scale
        inv = s.to(torch.float64).reciprocal().to(torch.float32)
        return torch.where(_valid_scale(s), inv, torch.full_like(inv, float("nan")))

    def is_valid(self) -> torch.Tensor:
        """0-d bool tensor: the scale lies in :data:`SCALE_RANGE` (so its inverse is finite and
        nonzero). A step must be skipped when it is False; on the device, no host sync."""
        return _valid_scale(self.loss_scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.float() * loss_scale``: one scalar multiply."""
        loss = _check_loss(loss)
        return loss.to(torch.float32) * self.loss_scale.to(loss.device)

    def inv_scale_on(self, device) -> torch.Tensor:
        """:attr:`inv_scale` on ``device`` (a no-op move when the scale already lives there)."""
        return self.inv_scale.to(device)

    def unscale(self, tree: PyTree) -> PyTree:
        """Every floating leaf as fp32 times ``inv_scale``: one read and one fp32 write per leaf."""
        return self.unscale_and_check(tree, "unscale")[0]

    def unscale_and_check(self, tree: PyTree, what: str = "grads") -> tuple[PyTree, torch.Tensor]:
        """``(fp32 leaves times inv_scale, finite)``; see :func:`ampfunc.unscale_and_check`.

        ``finite`` is also False when the scale itself is not valid (:meth:`is_valid`), even for
        a tree without elements.
        """
        out, finite = _fp32_unscaled(tree, self.inv_scale, what)
        return out, finite & self.is_valid().to(finite.device)

    def _adjust(self, finite: torch.Tensor) -> "LossScale":
        """The loss scale after a step whose gradients were ``finite`` (a 0-d bool tensor; a
        Python ``bool`` is accepted too). Fixed scales return themselves."""
        check_flag(finite, "update_scale: finite")
        return self

    def _adjust_(self, finite: torch.Tensor) -> "LossScale":
        """In-place :meth:`_adjust`; fixed scales only check the flag and return themselves."""
        check_flag(finite, "update_scale_: finite")
        return self

    def check_writable(self, where: str) -> None:
        """Raises, naming the field, when :meth:`_adjust_` could not write this scale; in-place
        steps call it before their first write, so a bad scale leaves the params untouched.
        Fixed scales write nothing. Cost: a few attribute reads; no host sync."""


class NoOpLossScale(LossScale):
    """No loss scaling, for fp32 or bf16 training.

    ``scale`` returns the loss itself (not cast), ``unscale`` only casts the floating leaves to
    fp32 (fp32 leaves are returned as they are) and :func:`ampfunc.update_scale` returns it unchanged. Takes
    no arguments and holds no tensors (an empty pytree node).

    Attributes:
      loss_scale: 0-d fp32 tensor ``1.0``, made on the CPU at each access.
      inv_scale: 0-d fp32 tensor ``1.0``, likewise.

    Example:
      >>> ls = af.NoOpLossScale()
      >>> loss = torch.tensor(0.25, dtype=torch.bfloat16)
      >>> ls.scale(loss) is loss
      True
      >>> grads, finite = ls.unscale_and_check({"w": torch.ones(2, dtype=torch.bfloat16)})
      >>> grads["w"].dtype, bool(finite)
      (torch.float32, True)
    """

    __slots__ = ()

    @property
    def loss_scale(self) -> torch.Tensor:
        return torch.ones((), dtype=torch.float32)

    @property
    def inv_scale(self) -> torch.Tensor:
        return torch.ones((), dtype=torch.float32)

    def inv_scale_on(self, device) -> torch.Tensor:
        # Made on the device (a fill, no host-to-device copy), so CUDA graph capture works.
        return torch.ones((), dtype=torch.float32, device=device)

    def is_valid(self) -> torch.Tensor:
        return torch.ones((), dtype=torch.bool)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return _check_loss(loss)

    def unscale_and_check(self, tree: PyTree, what: str = "grads") -> tuple[PyTree, torch.Tensor]:
        """fp32 casts of the leaves (no multiply) and the finite flag from one read-only pass."""
        return _fp32_unscaled(tree, None, what)

    def to(self, device) -> "NoOpLossScale":
        return self

    def __repr__(self) -> str:
        return "NoOpLossScale()"

    def __eq__(self, other) -> bool:
        return type(other) is NoOpLossScale

    def __hash__(self) -> int:
        return hash(NoOpLossScale)


class StaticLossScale(LossScale):
    """A fixed loss scale (apex's ``static_loss_scale``).

    :func:`ampfunc.update_scale` only checks the flag and returns the scale unchanged.

    Args:
      loss_scale: a number or a one-element real tensor (read back to the host once, here). It
        must lie in :data:`SCALE_RANGE` once stored in fp32: ``StaticLossScale(1e-50)`` (0 in
        fp32), ``StaticLossScale(2**-130)`` (inverse infinite in fp32), ``StaticLossScale(1e39)``
        (inf), NaN, 0 and negative scales raise ``ValueError`` naming ``loss_scale``.
      device: where the 0-d scale tensor lives (default: the given tensor's device, else the
        default device).

    Attributes:
      loss_scale: 0-d fp32 tensor, the scale.

    Example:
      >>> ls = af.StaticLossScale(128.0)
      >>> float(ls.loss_scale)
      128.0
      >>> af.update_scale(ls, torch.tensor(False)) is ls
      True
    """

    __slots__ = ("_loss_scale",)

    def __init__(self, loss_scale: float | torch.Tensor, device=None):
        self._loss_scale = _scale_tensor(loss_scale, device, "StaticLossScale: loss_scale")

    @property
    def loss_scale(self) -> torch.Tensor:
        return self._loss_scale

    def _adjust(self, finite: torch.Tensor) -> "StaticLossScale":
        check_flag(finite, "update_scale: finite")
        return self

    def to(self, device) -> "StaticLossScale":
        return _static_unflatten(None, (self._loss_scale.to(device),))

    def __repr__(self) -> str:
        return f"StaticLossScale({self._loss_scale!r})"

    def __getstate__(self):
        return {"loss_scale": self._loss_scale}

    def __setstate__(self, state):
        self._loss_scale = state["loss_scale"]


class DynamicConfig(NamedTuple):
    """The static (hashable) settings of a :class:`DynamicLossScale`: its pytree metadata.

    ``validate()`` checks the settings (``ValueError``/``TypeError`` naming the one at fault)
    and returns them normalised to Python floats and ints.

    Attributes:
      growth_factor: the factor the scale grows by, a finite number > 1.
      backoff_factor: the factor the scale backs off by, in (0, 1).
      growth_interval: consecutive finite steps before a growth, an integer >= 1.
      min_scale: the floor of a backoff, >= 0 (the kernels never go below ``2**-126``).
      max_scale: the cap of a growth, >= ``min_scale`` and > 0 (``inf`` allowed).
      hysteresis: consecutive non-finite steps that cause a backoff, an integer >= 1.

    Example:
      >>> ls = af.DynamicLossScale(growth_interval=500)
      >>> ls.config.growth_interval, ls.config.hysteresis
      (500, 1)
      >>> af.loss_scale.DynamicConfig(backoff_factor=0.25).validate().backoff_factor
      0.25
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1

    def validate(self) -> "DynamicConfig":
        def bad(name, value, rule):
            raise ValueError(f"DynamicLossScale: {name} must be {rule}, got {value!r}")

        for name, value in self._asdict().items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"DynamicLossScale: {name} must be a Python number, got {type(value).__name__}"
                                + (" (a tensor setting would be read on the host every step)"
                                   if isinstance(value, torch.Tensor) else ""))

        if not (self.growth_factor > 1.0) or not math.isfinite(self.growth_factor):
            bad("growth_factor", self.growth_factor, "a finite number > 1")
        if not (0.0 < self.backoff_factor < 1.0):
            bad("backoff_factor", self.backoff_factor, "in (0, 1)")
        # isfinite first: int() of an infinity or a NaN raises its own, anonymous error.
        if not math.isfinite(self.growth_interval) or int(self.growth_interval) != self.growth_interval \
                or self.growth_interval < 1:
            bad("growth_interval", self.growth_interval, "an integer >= 1")
        if not (self.min_scale >= 0.0) or not math.isfinite(self.min_scale):
            bad("min_scale", self.min_scale, "a finite number >= 0")
        if self.min_scale > SCALE_RANGE[1]:
            bad("min_scale", self.min_scale, f"at most fp32's largest number {SCALE_RANGE[1]:.4g}")
        if not (self.max_scale >= self.min_scale) or self.max_scale <= 0:
            bad("max_scale", self.max_scale, f"> 0 and >= min_scale ({self.min_scale})")
        if not math.isfinite(self.hysteresis) or int(self.hysteresis) != self.hysteresis or self.hysteresis < 1:
            bad("hysteresis", self.hysteresis, "an integer >= 1")
        return self._replace(growth_interval=int(self.growth_interval), hysteresis=int(self.hysteresis),
                             growth_factor=float(self.growth_factor), backoff_factor=float(self.backoff_factor),
                             min_scale=float(self.min_scale), max_scale=float(self.max_scale))


class DynamicLossScale(LossScale):
    """A loss scale that backs off when a step overflows and grows after clean steps.

    After a step whose gradients are not all finite, the scale is multiplied by
    ``backoff_factor`` (floored at ``min_scale``) -- once ``hysteresis`` consecutive such steps
    have been seen; every finite step refills the hysteresis counter (DeepSpeed's consecutive
    hysteresis). After ``growth_interval`` consecutive finite steps the scale is multiplied by
    ``growth_factor`` (capped at ``max_scale``). With ``min_scale=0, max_scale=inf,
    hysteresis=1`` the sequence of scales equals ``torch.amp.GradScaler``'s step for step,
    rounding included (products in double, stored in fp32; a growth that would overflow fp32 is
    not applied) -- except that the scale never goes below ``2**-126`` (:data:`SCALE_RANGE`),
    where GradScaler would reach 0 and then write inf into the parameters. apex's
    ``DynamicLossScaler(init_scale=2**32, scale_window=1000)`` is
    ``DynamicLossScale(2.**32, growth_interval=1000, min_scale=1, max_scale=inf)``.

    :func:`ampfunc.update_scale` (pure: three 0-d copies and one small kernel) and
    :func:`ampfunc.mixed.update_scale_` (in place: one small kernel) run on the scale's device;
    no host sync. ``replace(**settings)`` changes
    settings and keeps the tensors. Construction errors name the setting at fault.

    Args:
      init_scale: the first scale, a number or a one-element tensor (read back to the host
        once, here). It must lie in :data:`SCALE_RANGE` once stored in fp32 and in
        ``[min_scale, max_scale]``: ``DynamicLossScale(2.**32)`` is refused (above the default
        ``max_scale=2**24``; pass ``max_scale=float("inf")`` as apex's configuration does), so
        are NaN, 0, negative and fp32-infinite scales such as ``1e39``.
      growth_factor: the growth multiplier, a finite number > 1.
      backoff_factor: the backoff multiplier, in (0, 1).
      growth_interval: consecutive finite steps per growth.
      min_scale: the backoff floor (the scale never goes below ``2**-126`` whatever it says).
      max_scale: the growth cap.
      hysteresis: consecutive non-finite steps per backoff.
      device: where the tensors live (default: ``init_scale``'s device, else the default
        device).

    Attributes:
      loss_scale: 0-d fp32 tensor, the current scale.
      growth_tracker: 0-d int32 tensor, clean steps since the last change.
      hysteresis_tracker: 0-d int32 tensor, counts down from ``hysteresis`` on each overflow;
        an overflow that finds it at 1 backs the scale off.
      config: the :class:`DynamicConfig` (each setting is also an attribute).

    Example:
      >>> ls = af.DynamicLossScale(2.0**15, growth_interval=2)
      >>> ls = af.update_scale(ls, torch.tensor(False))    # overflow: back off
      >>> float(ls.loss_scale)
      16384.0
      >>> for _ in range(2):                                 # 2 clean steps: grow
      ...     ls = af.update_scale(ls, torch.tensor(True))
      >>> float(ls.loss_scale), int(ls.growth_tracker)
      (32768.0, 0)
    """

    __slots__ = ("_loss_scale", "_growth_tracker", "_hysteresis_tracker", "_config")

    def __init__(self, init_scale: float | torch.Tensor = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, min_scale: float = 1.0,
                 max_scale: float = 2.0**24, hysteresis: int = 1, device=None):
        config = DynamicConfig(growth_factor, backoff_factor, growth_interval, min_scale, max_scale,
                               hysteresis).validate()
        scale = _scale_tensor(init_scale, device, "DynamicLossScale: init_scale")
        value = float(scale.item())
        if not (config.min_scale <= value <= config.max_scale):
            raise ValueError(f"DynamicLossScale: init_scale {value!r} lies outside [min_scale, max_scale] = "
                             f"[{config.min_scale!r}, {config.max_scale!r}]; widen max_scale or min_scale "
                             "(apex's setting is max_scale=float('inf'))")
        self._set(scale, torch.zeros((), dtype=torch.int32, device=scale.device),
                  torch.full((), config.hysteresis, dtype=torch.int32, device=scale.device), config)

    def _set(self, loss_scale, growth_tracker, hysteresis_tracker, config):
        self._loss_scale = loss_scale
        self._growth_tracker = growth_tracker
        self._hysteresis_tracker = hysteresis_tracker
        self._config = config

    @classmethod
    def from_tensors(cls, loss_scale, growth_tracker, hysteresis_tracker, config: DynamicConfig) -> "DynamicLossScale":
        """Builds one from its parts without copying (used by unflattening and in-place updates)."""
        obj = cls.__new__(cls)
        obj._set(loss_scale, growth_tracker, hysteresis_tracker, config)
        return obj

    @property
    def loss_scale(self) -> torch.Tensor:
        return self._loss_scale

    @property
    def growth_tracker(self) -> torch.Tensor:
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> torch.Tensor:
        return self._hysteresis_tracker

    @property
    def config(self) -> DynamicConfig:
        return self._config

    growth_factor = property(lambda self: self._config.growth_factor)
    backoff_factor = property(lambda self: self._config.backoff_factor)
    growth_interval = property(lambda self: self._config.growth_interval)
    min_scale = property(lambda self: self._config.min_scale)
    max_scale = property(lambda self: self._config.max_scale)
    hysteresis = property(lambda self: self._config.hysteresis)

    def replace(self, **config) -> "DynamicLossScale":
        """The same scale with some settings changed (e.g. ``growth_interval=500``).

        The scale stays within the new ``[min_scale, max_scale]`` (clamped into it, as a growth
        or a backoff is bounded: raising the floor above the scale raises the scale to it) and
        the hysteresis budget within the new ``hysteresis``; the trackers carry over otherwise,
        so a run continues where it was. ``self`` is left as it is.

        Args:
          **config: fields of :class:`DynamicConfig`, checked as the constructor checks them.

        Returns:
          A new :class:`DynamicLossScale` (sharing the unchanged tensors with ``self``).

        Example:
          >>> ls = af.DynamicLossScale(1024.0).replace(min_scale=4096.0)
          >>> float(ls.loss_scale), ls.config.min_scale
          (4096.0, 4096.0)

        Cost: a 0-d op on the scale's device per clamped tensor (none when only the interval
        or the factors change); no host sync.
        """
        new = self._config._replace(**config).validate()
        scale, hysteresis = self._loss_scale, self._hysteresis_tracker
        if (new.min_scale, new.max_scale) != (self._config.min_scale, self._config.max_scale):
            scale = scale.clamp(new.min_scale, new.max_scale)
        if new.hysteresis < self._config.hysteresis:
            hysteresis = hysteresis.clamp(max=new.hysteresis)
        return DynamicLossScale.from_tensors(scale, self._growth_tracker, hysteresis, new)

    def _adjust(self, finite: torch.Tensor) -> "DynamicLossScale":
        """The next loss scale after a step whose gradients were ``finite`` (0-d bool tensor).

        Pure; a handful of 0-d kernels on the scale's device, no host sync.
        """
        finite = check_flag(finite, "update_scale: finite")
        s, g, h = ops.update_scale(self._loss_scale, self._growth_tracker, self._hysteresis_tracker, finite,
                                   **self._kernel_config())
        return DynamicLossScale.from_tensors(s, g, h, self._config)

    def check_writable(self, where: str) -> None:
        """Raises when :meth:`_adjust_` could not write this scale: ``TypeError`` naming the
        tensor that is not one element of its dtype (fp32 scale, int32 trackers) on the scale's
        device, ``ValueError`` naming a setting out of range (a state assembled by hand, e.g.
        ``from_tensors`` or a whole state cast to fp64). Cost: a few attribute reads."""
        device = self._loss_scale.device if isinstance(self._loss_scale, torch.Tensor) else None
        for name, t, dtype in (("loss_scale", self._loss_scale, torch.float32),
                               ("growth_tracker", self._growth_tracker, torch.int32),
                               ("hysteresis_tracker", self._hysteresis_tracker, torch.int32)):
            if not (isinstance(t, torch.Tensor) and t.numel() == 1 and t.dtype == dtype and t.device == device
                    and t.layout == torch.strided):
                got = (f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise TypeError(f"{where}: state.loss_scale.{name} must be a one-element {dtype} tensor on the "
                                f"scale's device ({device}), got a {got}; rebuild the scale (DynamicLossScale(...)"
                                " or .to(device)) instead of casting its tensors")
        try:
            self._config.validate()
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: state.loss_scale: {e}") from None

    def _adjust_(self, finite: torch.Tensor) -> "DynamicLossScale":
        """In-place :meth:`_adjust` (the donating fast path); returns ``self``."""
        finite = check_flag(finite, "update_scale_: finite")
        ops.update_scale_(self._loss_scale, self._growth_tracker, self._hysteresis_tracker, finite,
                          **self._kernel_config())
        return self

    def _kernel_config(self) -> dict:
        # The backoff floor never goes below SCALE_RANGE's low end: a scale of 0 (or one whose
        # fp32 inverse overflows) would turn the next finite step into inf/NaN parameters.
        # Growth cannot leave the range: the kernels do not apply a growth that overflows fp32.
        config = self._config._asdict()
        config["min_scale"] = max(config["min_scale"], SCALE_RANGE[0])
        return config

    def to(self, device) -> "DynamicLossScale":
        return DynamicLossScale.from_tensors(self._loss_scale.to(device), self._growth_tracker.to(device),
                                             self._hysteresis_tracker.to(device), self._config)

    def __repr__(self) -> str:
        c = self._config
        return (f"DynamicLossScale(loss_scale={self._loss_scale!r}, growth_tracker={self._growth_tracker!r}, "
                f"hysteresis_tracker={self._hysteresis_tracker!r}, growth_factor={c.growth_factor}, "
                f"backoff_factor={c.backoff_factor}, growth_interval={c.growth_interval}, "
                f"min_scale={c.min_scale}, max_scale={c.max_scale}, hysteresis={c.hysteresis})")

    def __getstate__(self):
        return {"loss_scale": self._loss_scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker, "config": tuple(self._config)}

    def __setstate__(self, state):
        self._set(state["loss_scale"], state["growth_tracker"], state["hysteresis_tracker"],
                  DynamicConfig(*state["config"]))


# ----------------------------------------------------------------------------------------------
# pytree registration: tensors are children, configuration is metadata.
# ----------------------------------------------------------------------------------------------

_DYN_FIELDS = ("loss_scale", "growth_tracker", "hysteresis_tracker")


def _dyn_flatten(ls: DynamicLossScale):
    return (ls._loss_scale, ls._growth_tracker, ls._hysteresis_tracker), ls._config, _DYN_FIELDS


def _dyn_unflatten(config, children):
    return DynamicLossScale.from_tensors(*children, config)


def _static_flatten(ls: StaticLossScale):
    return (ls._loss_scale,), None, ("loss_scale",)


def _static_unflatten(_, children):
    obj = StaticLossScale.__new__(StaticLossScale)
    obj._loss_scale = children[0]
    return obj


def _noop_flatten(ls):
    return (), None, ()


def _noop_unflatten(_, children):
    return NoOpLossScale()


for _cls, _flat, _unflat in ((DynamicLossScale, _dyn_flatten, _dyn_unflatten),
                             (StaticLossScale, _static_flatten, _static_unflatten),
                             (NoOpLossScale, _noop_flatten, _noop_unflatten)):
    optree.register_pytree_node(_cls, _flat, _unflat, namespace=NAMESPACE)
    torch_pytree.register_pytree_node(
        _cls,
        (lambda f: lambda x: f(x)[:2])(_flat),
        (lambda u: lambda children, ctx: u(ctx, tuple(children)))(_unflat),
        serialized_type_name=f"ampfunc.{_cls.__name__}",
    )

# torch.load(weights_only=True) (the default) accepts ampfunc states.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([DynamicLossScale, StaticLossScale, NoOpLossScale, DynamicConfig])
