"""Learning-rate schedules: callables of the step count, with optax's names and formulas.

A schedule maps ``count`` (a 0-d tensor: the number of steps applied so far, which the
optimizers keep in their state) to a 0-d float32 tensor on the same device. Everything is
tensor arithmetic with no Python branching on tensor values, so a schedule costs a few 0-d
kernels, never reads back to the host, and traces under ``torch.compile(fullgraph=True)``.
Because the count lives in the optimizer state, a step skipped by
:func:`ampfunc.skip_or_apply` (which restores the old state) does not advance the schedule.

The first update of an optimizer uses ``schedule(0)``, as in optax.

Values are learning rates: every setting that would make a schedule return a negative, NaN or
infinite float32 value (a negative value or ``decay_rate``, a negative ``exponent``, a value
above float32's max such as ``1e39``) is refused at construction with a ``ValueError`` naming
the schedule and the setting. Only a growing :func:`exponential_decay` without ``end_value``
can still reach float32's inf, after enough steps (as in optax).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

__all__ = [
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
    "exponential_decay",
]

Schedule = Callable[[torch.Tensor], torch.Tensor]


def _count(count) -> torch.Tensor:
    if not isinstance(count, torch.Tensor):
        count = torch.tensor(count)
    return count.to(torch.float32)


def _check_number(value, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


_F32_MAX = float(torch.finfo(torch.float32).max)


def _check_value(value, what: str) -> float:
    """A value the schedule returns: finite, ``>= 0`` (torch.optim refuses a negative lr, which
    ascends the loss) and at most float32's max (the schedule computes in float32; a larger one
    would be inf, or fail to convert, at step time)."""
    value = _check_number(value, what)
    if not 0.0 <= value <= _F32_MAX:
        raise ValueError(f"{what} must be >= 0 and at most float32's max ({_F32_MAX:.8g}), got {value!r}")
    return value


def _check_steps(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not -2 ** 63 <= value < 2 ** 63:
        raise ValueError(f"{what} must fit int64, got {value}")
    return value


def _check_exponent(value, what: str) -> float:
    value = _check_number(value, what)
    if value <= 0:
        raise ValueError(f"{what} must be > 0 (the cosine factor reaches 0 at the end of the decay, where "
                         f"0 ** exponent is inf for a negative exponent), got {value!r}")
    return value


def _cosine(init_value: float, decay_steps: int, alpha: float, exponent: float) -> Schedule:
    def schedule(count):
        t = _count(count).clamp(max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine.pow(exponent) + alpha)

    return schedule


def constant_schedule(value: float) -> Schedule:
    """A constant schedule: ``value`` at every step.

    Args:
      value: the value, a number ``>= 0`` and at most float32's max (``3.4028235e38``).

    Returns:
      A schedule: a callable mapping ``count`` (the number of steps applied, a tensor or an int)
      to a float32 tensor of its shape (0-d for an optimizer's count) on its device.

    Example:
      >>> sched = af.optim.constant_schedule(0.5)
      >>> float(sched(torch.tensor(3))), float(sched(100))
      (0.5, 0.5)

    Cost: building it allocates nothing; each call is a cast of the count and one fill on its
    device (an int count first becomes a CPU tensor). No host sync.
    """
    value = _check_value(value, "constant_schedule: value")

    def schedule(count):
        return torch.full_like(_count(count), value)

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """A linear schedule from ``init_value`` to ``end_value``, as optax's.

    ``init_value`` until ``transition_begin``, then linearly to ``end_value`` over
    ``transition_steps`` steps, then ``end_value``. ``transition_steps <= 0`` gives the constant
    ``init_value`` (as optax).

    Args:
      init_value: the value up to ``transition_begin``, a number ``>= 0`` and at most float32's
        max (``3.4028235e38``): a negative learning rate would ascend the loss.
      end_value: the value from ``transition_begin + transition_steps`` on, likewise.
      transition_steps: the length of the ramp in steps, an int (``<= 0``: constant).
      transition_begin: the step at which the ramp starts, an int ``>= 0``.

    Returns:
      A schedule: a callable mapping ``count`` (the number of steps applied, a tensor or an int)
      to a float32 tensor of its shape (0-d for an optimizer's count) on its device.

    Example:
      >>> sched = af.optim.linear_schedule(1.0, 0.0, transition_steps=4)
      >>> [float(sched(c)) for c in (0, 2, 4, 9)]
      [1.0, 0.5, 0.0, 0.0]
      >>> tx = af.sgd(sched)  # the optimizer evaluates it at its own step count

    Cost: building it allocates nothing; each call is a few 0-d tensor ops on the count's device
    (an int count first becomes a CPU tensor). No host sync.
    """
    init_value = _check_value(init_value, "linear_schedule: init_value")
    end_value = _check_value(end_value, "linear_schedule: end_value")
    transition_steps = _check_steps(transition_steps, "linear_schedule: transition_steps")
    transition_begin = _check_steps(transition_begin, "linear_schedule: transition_begin")
    if transition_begin < 0:
        raise ValueError(f"linear_schedule: transition_begin must be >= 0, got {transition_begin}")
    if transition_steps <= 0:
        return constant_schedule(init_value)

    def schedule(count):
        t = (_count(count) - transition_begin).clamp(0, transition_steps)
        frac = 1 - t / transition_steps
        return (init_value - end_value) * frac + end_value

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """A cosine decay from ``init_value`` to ``alpha * init_value``, as optax's.

    ``init_value * ((1 - alpha) * c ** exponent + alpha)`` with
    ``c = (1 + cos(pi * min(count, decay_steps) / decay_steps)) / 2``: from ``init_value`` down to
    ``alpha * init_value`` over ``decay_steps`` steps, constant after.

    Args:
      init_value: the value at step 0, a number ``>= 0`` and at most float32's max
        (``3.4028235e38``).
      decay_steps: the length of the decay in steps, a positive int.
      alpha: the final value as a fraction of ``init_value``, a finite number ``>= 0`` (``> 1``
        grows) with ``alpha * init_value`` at most float32's max.
      exponent: the power applied to the cosine factor ``c``, a finite number ``> 0`` (a negative
        one makes ``c = 0`` at ``decay_steps`` an infinite value).

    Returns:
      A schedule: a callable mapping ``count`` (the number of steps applied, a tensor or an int)
      to a float32 tensor of its shape (0-d for an optimizer's count) on its device.

    Example:
      >>> sched = af.optim.cosine_decay_schedule(1.0, decay_steps=4, alpha=0.5)
      >>> [float(sched(c)) for c in (0, 2, 4, 9)]
      [1.0, 0.75, 0.5, 0.5]

    Cost: building it allocates nothing; each call is a few 0-d tensor ops on the count's device
    (an int count first becomes a CPU tensor). No host sync.
    """
    init_value = _check_value(init_value, "cosine_decay_schedule: init_value")
    decay_steps = _check_steps(decay_steps, "cosine_decay_schedule: decay_steps")
    alpha = _check_number(alpha, "cosine_decay_schedule: alpha")
    exponent = _check_exponent(exponent, "cosine_decay_schedule: exponent")
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay_schedule: decay_steps must be positive, got {decay_steps}")
    if alpha < 0 or alpha > _F32_MAX or alpha * init_value > _F32_MAX:
        raise ValueError(f"cosine_decay_schedule: alpha must be >= 0 with alpha * init_value at most float32's "
                         f"max ({_F32_MAX:.8g}), got alpha={alpha!r}, init_value={init_value!r}")
    return _cosine(init_value, decay_steps, alpha, exponent)


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int,
                                 end_value: float = 0.0, exponent: float = 1.0) -> Schedule:
    """A linear warmup followed by a cosine decay, as optax's.

    Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay (:func:`cosine_decay_schedule`) to ``end_value`` at ``decay_steps`` (counted from 0,
    warmup included), constant after.

    Args:
      init_value: the value at step 0, a number ``>= 0`` and at most float32's max
        (``3.4028235e38``).
      peak_value: the value at the end of the warmup, likewise.
      warmup_steps: the length of the warmup in steps, an int ``>= 0``.
      decay_steps: the step at which ``end_value`` is reached, an int ``> warmup_steps``.
      end_value: the final value, likewise (reached only when ``peak_value != 0``; a zero peak
        decays to 0), with ``end_value / peak_value`` at most float32's max.
      exponent: the power applied to the cosine factor, a finite number ``> 0``.

    Returns:
      A schedule: a callable mapping ``count`` (the number of steps applied, a tensor or an int)
      to a float32 tensor of its shape (0-d for an optimizer's count) on its device.

    Example:
      >>> sched = af.optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6)
      >>> [float(sched(c)) for c in (0, 1, 2, 6, 9)]
      [0.0, 0.5, 1.0, 0.0, 0.0]

    Cost: building it allocates nothing; each call is a few 0-d tensor ops on the count's device
    (an int count first becomes a CPU tensor). No host sync.
    """
    init_value = _check_value(init_value, "warmup_cosine_decay_schedule: init_value")
    peak_value = _check_value(peak_value, "warmup_cosine_decay_schedule: peak_value")
    end_value = _check_value(end_value, "warmup_cosine_decay_schedule: end_value")
    exponent = _check_exponent(exponent, "warmup_cosine_decay_schedule: exponent")
    warmup_steps = _check_steps(warmup_steps, "warmup_cosine_decay_schedule: warmup_steps")
    decay_steps = _check_steps(decay_steps, "warmup_cosine_decay_schedule: decay_steps")
    if warmup_steps < 0 or decay_steps <= warmup_steps:
        raise ValueError("warmup_cosine_decay_schedule: need 0 <= warmup_steps < decay_steps, got "
                         f"warmup_steps={warmup_steps}, decay_steps={decay_steps}")
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    if alpha > _F32_MAX:
        raise ValueError(f"warmup_cosine_decay_schedule: end_value / peak_value must be at most float32's max "
                         f"({_F32_MAX:.8g}), got end_value={end_value!r}, peak_value={peak_value!r}")
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    decay = _cosine(peak_value, decay_steps - warmup_steps, alpha, exponent)

    def schedule(count):
        c = _count(count)
        return torch.where(c < warmup_steps, warmup(c), decay(c - warmup_steps))

    return schedule


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float, transition_begin: int = 0,
                      staircase: bool = False, end_value: Optional[float] = None) -> Schedule:
    """An exponential decay of ``init_value`` by ``decay_rate`` per ``transition_steps``, as optax's.

    ``init_value * decay_rate ** ((count - transition_begin) / transition_steps)`` after
    ``transition_begin`` (``init_value`` before), the exponent floored with ``staircase``, and
    bounded by ``end_value`` (a floor when decaying, a ceiling when growing).
    ``transition_steps <= 0`` gives the constant ``init_value``.

    Args:
      init_value: the value up to ``transition_begin``, a number ``>= 0`` and at most float32's
        max (``3.4028235e38``).
      transition_steps: the number of steps per factor of ``decay_rate``, an int (``<= 0``:
        constant).
      decay_rate: the factor per ``transition_steps``, a number ``> 0`` and at most float32's max
        (``> 1`` grows; a negative rate would give NaN at fractional exponents). A growing
        schedule without ``end_value`` reaches float32's inf eventually.
      transition_begin: the step at which the decay starts, an int ``>= 0``.
      staircase: decay in whole steps (the exponent floored) instead of continuously, a bool.
      end_value: a bound on the value (a floor when ``decay_rate < 1``, else a ceiling), a number
        ``>= 0`` and at most float32's max, or None.

    Returns:
      A schedule: a callable mapping ``count`` (the number of steps applied, a tensor or an int)
      to a float32 tensor of its shape (0-d for an optimizer's count) on its device.

    Example:
      >>> sched = af.optim.exponential_decay(1.0, transition_steps=2, decay_rate=0.5, staircase=True,
      ...                              end_value=0.25)
      >>> [float(sched(c)) for c in range(7)]
      [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.25]

    Cost: building it allocates nothing; each call is a few 0-d tensor ops on the count's device
    (an int count first becomes a CPU tensor). No host sync.
    """
    init_value = _check_value(init_value, "exponential_decay: init_value")
    decay_rate = _check_number(decay_rate, "exponential_decay: decay_rate")
    transition_steps = _check_steps(transition_steps, "exponential_decay: transition_steps")
    transition_begin = _check_steps(transition_begin, "exponential_decay: transition_begin")
    if not 0.0 < decay_rate <= _F32_MAX:
        raise ValueError(f"exponential_decay: decay_rate must be > 0 and at most float32's max ({_F32_MAX:.8g}) "
                         f"(a negative rate gives NaN at fractional exponents), got {decay_rate!r}")
    if not isinstance(staircase, bool):
        raise TypeError(f"exponential_decay: staircase must be a bool, got {type(staircase).__name__}")
    if transition_begin < 0:
        raise ValueError(f"exponential_decay: transition_begin must be >= 0, got {transition_begin}")
    if end_value is not None:
        end_value = _check_value(end_value, "exponential_decay: end_value")
    if transition_steps <= 0:
        return constant_schedule(init_value)

    def schedule(count):
        t = _count(count) - transition_begin
        p = t / transition_steps
        if staircase:
            p = torch.floor(p)
        decayed = init_value * torch.pow(torch.full_like(p, decay_rate), p)
        decayed = torch.where(t <= 0, torch.full_like(p, init_value), decayed)
        if end_value is not None:
            bound = torch.full_like(p, end_value)
            decayed = torch.maximum(decayed, bound) if decay_rate < 1 else torch.minimum(decayed, bound)
        return decayed

    return schedule
