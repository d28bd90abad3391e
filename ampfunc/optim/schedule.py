"""Learning-rate schedules: callables of the step count, with optax's names and formulas.

A schedule maps ``count`` (a 0-d tensor: the number of steps applied so far, which the
optimizers keep in their state) to a 0-d float32 tensor on the same device. Everything is
tensor arithmetic with no Python branching on tensor values, so a schedule costs a few 0-d
kernels, never reads back to the host, and traces under ``torch.compile(fullgraph=True)``.
Because the count lives in the optimizer state, a step skipped by
:func:`ampfunc.skip_or_apply` (which restores the old state) does not advance the schedule.

The first update of an optimizer uses ``schedule(0)``, as in optax.
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


def _check_steps(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return value


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step."""
    value = _check_number(value, "constant_schedule: value")

    def schedule(count):
        return torch.full_like(_count(count), value)

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """``init_value`` until ``transition_begin``, then linearly to ``end_value`` over
    ``transition_steps`` steps, then ``end_value``. ``transition_steps <= 0`` gives the constant
    ``init_value`` (as optax)."""
    init_value = _check_number(init_value, "linear_schedule: init_value")
    end_value = _check_number(end_value, "linear_schedule: end_value")
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
    """``init_value * ((1 - alpha) * c ** exponent + alpha)`` with
    ``c = (1 + cos(pi * min(count, decay_steps) / decay_steps)) / 2``: from ``init_value`` down to
    ``alpha * init_value`` over ``decay_steps`` steps, constant after."""
    init_value = _check_number(init_value, "cosine_decay_schedule: init_value")
    decay_steps = _check_steps(decay_steps, "cosine_decay_schedule: decay_steps")
    alpha = _check_number(alpha, "cosine_decay_schedule: alpha")
    exponent = _check_number(exponent, "cosine_decay_schedule: exponent")
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay_schedule: decay_steps must be positive, got {decay_steps}")

    def schedule(count):
        t = _count(count).clamp(max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine.pow(exponent) + alpha)

    return schedule


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int,
                                 end_value: float = 0.0, exponent: float = 1.0) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at ``decay_steps`` (counted from 0, warmup included), as optax."""
    peak_value = _check_number(peak_value, "warmup_cosine_decay_schedule: peak_value")
    end_value = _check_number(end_value, "warmup_cosine_decay_schedule: end_value")
    warmup_steps = _check_steps(warmup_steps, "warmup_cosine_decay_schedule: warmup_steps")
    decay_steps = _check_steps(decay_steps, "warmup_cosine_decay_schedule: decay_steps")
    if warmup_steps < 0 or decay_steps <= warmup_steps:
        raise ValueError("warmup_cosine_decay_schedule: need 0 <= warmup_steps < decay_steps, got "
                         f"warmup_steps={warmup_steps}, decay_steps={decay_steps}")
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha=alpha, exponent=exponent)

    def schedule(count):
        c = _count(count)
        return torch.where(c < warmup_steps, warmup(c), decay(c - warmup_steps))

    return schedule


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float, transition_begin: int = 0,
                      staircase: bool = False, end_value: Optional[float] = None) -> Schedule:
    """``init_value * decay_rate ** ((count - transition_begin) / transition_steps)`` after
    ``transition_begin`` (``init_value`` before), the exponent floored with ``staircase``, and
    bounded by ``end_value`` (a floor when decaying, a ceiling when growing), as optax.
    ``transition_steps <= 0`` gives the constant ``init_value``."""
    init_value = _check_number(init_value, "exponential_decay: init_value")
    decay_rate = _check_number(decay_rate, "exponential_decay: decay_rate")
    transition_steps = _check_steps(transition_steps, "exponential_decay: transition_steps")
    transition_begin = _check_steps(transition_begin, "exponential_decay: transition_begin")
    if decay_rate == 0.0:
        raise ValueError("exponential_decay: decay_rate must be non-zero")
    if transition_begin < 0:
        raise ValueError(f"exponential_decay: transition_begin must be >= 0, got {transition_begin}")
    if end_value is not None:
        end_value = _check_number(end_value, "exponential_decay: end_value")
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
