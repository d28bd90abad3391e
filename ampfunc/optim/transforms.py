"""Elementary transforms to build optimizers from (optax's names): scaling, learning rates,
decoupled weight decay."""

from __future__ import annotations

import math

from typing import NamedTuple

import torch

from ampfunc.optim.base import ScalarOrSchedule, check_lr, check_nonneg, checked_inputs, lr_at, on, step_device
from ampfunc.transform import EmptyState, GradientTransformation
from ampfunc.tree import tree_structure, tree_unflatten

__all__ = ["ScaleByScheduleState", "scale", "scale_by_schedule", "scale_by_learning_rate", "add_decayed_weights"]


class ScaleByScheduleState(NamedTuple):
    """``count``: 0-d float32, the number of updates seen (the schedule's argument)."""

    count: torch.Tensor


def scale(step_size: float) -> GradientTransformation:
    """Multiplies every update by ``step_size``. Stateless; one read and write."""
    if isinstance(step_size, bool) or not isinstance(step_size, (int, float)):
        raise TypeError(f"scale: step_size must be a float, got {type(step_size).__name__}")
    if not math.isfinite(step_size):
        raise ValueError(f"scale: step_size must be finite, got {step_size!r}")

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        us, _ = checked_inputs(updates, None, None, "", "scale")
        return tree_unflatten(tree_structure(updates), [u * step_size for u in us]), state

    return GradientTransformation(init, update)


def scale_by_schedule(schedule) -> GradientTransformation:
    """Multiplies every update by ``schedule(count)``, ``count`` kept in the state (so a skipped
    step, which restores the state, does not advance it). No host sync."""
    if not callable(schedule):
        raise TypeError(f"scale_by_schedule: schedule must be callable, got {type(schedule).__name__}")

    def init(params):
        return ScaleByScheduleState(torch.zeros((), dtype=torch.float32, device=step_device(params)))

    def update(updates, state, params=None):
        us, _ = checked_inputs(updates, None, None, "", "scale_by_schedule")
        factor = lr_at(schedule, state.count)
        out = [u * on(factor, u.device) for u in us]
        return tree_unflatten(tree_structure(updates), out), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """Multiplies updates by ``-learning_rate`` (a float or a schedule), turning a direction into
    a descent step, as optax. ``chain(..., scale_by_learning_rate(lr))`` ends a hand-made
    optimizer."""
    check_lr(learning_rate, "scale_by_learning_rate")
    if callable(learning_rate):
        return scale_by_schedule(lambda count: -learning_rate(count))
    return scale(-float(learning_rate))


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """Adds ``weight_decay * params`` to the updates (L2 / decoupled decay depending on where it
    sits in a chain). Needs ``params``. Use :func:`ampfunc.masked` to exempt norms and biases."""
    check_nonneg(weight_decay, "weight_decay")

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        if weight_decay == 0:
            return updates, state
        if params is None:
            raise ValueError("add_decayed_weights: needs params; call update(updates, state, params)")
        us, ps = checked_inputs(updates, params, None, "", "add_decayed_weights")
        out = [u.add(p.to(u.dtype), alpha=weight_decay) for u, p in zip(us, ps)]
        return tree_unflatten(tree_structure(updates), out), state

    return GradientTransformation(init, update)
