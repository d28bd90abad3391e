"""Elementary transforms to build optimizers from (optax's names): scaling, learning rates,
decoupled weight decay."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ampfunc.optim.base import ScalarOrSchedule, check_lr, check_nonneg, checked_inputs, lr_at, on, step_device
from ampfunc.transform import EmptyState, GradientTransformation, masked
from ampfunc.tree import tree_structure, tree_unflatten

__all__ = ["ScaleByScheduleState", "scale", "scale_by_schedule", "scale_by_learning_rate", "add_decayed_weights"]


class ScaleByScheduleState(NamedTuple):
    """The state of :func:`scale_by_schedule`.

    Attributes:
      count: 0-d float32, the number of updates seen (the schedule's argument).

    Example:
      >>> tx = af.optim.scale_by_schedule(af.optim.linear_schedule(1.0, 0.0, 10))
      >>> state = tx.init({"w": torch.ones(2)})
      >>> _, state = tx.update({"w": torch.ones(2)}, state)
      >>> float(state.count)
      1.0
    """

    count: torch.Tensor


def scale(step_size: float) -> GradientTransformation:
    """Multiplies every update by a constant ``step_size`` (optax's ``scale``).

    Args:
      step_size: the factor, a finite number (negative to turn a direction into a descent step).

    Returns:
      A stateless (:class:`~ampfunc.transform.EmptyState`) ``GradientTransformation``; updates keep their
      dtype and ``update`` does not need ``params``.

    Example:
      >>> grads = {"w": torch.full((2, 3), 0.5)}
      >>> tx = af.optim.scale(-0.5)
      >>> state = tx.init(grads)
      >>> updates, state = tx.update(grads, state)
      >>> updates["w"][0, 0].item()
      -0.25

    Cost: ``init`` allocates nothing; ``update`` reads each update once and writes a new tensor
    of its size. No host sync.
    """
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
    """Multiplies every update by ``schedule(count)`` (optax's ``scale_by_schedule``).

    ``count``, the number of updates seen, is kept in the state, so a skipped step, which
    restores the state, does not advance it. The first update uses ``schedule(0)``.

    Args:
      schedule: a callable of the 0-d float32 count returning a float or a 0-d tensor (e.g.
        :func:`ampfunc.optim.linear_schedule`).

    Returns:
      A ``GradientTransformation`` whose state is a ``ScaleByScheduleState`` (``count``, 0-d
      float32 on the params' device); ``update`` does not need ``params``.

    Example:
      >>> grads = {"w": torch.full((2, 3), 0.5)}
      >>> tx = af.optim.scale_by_schedule(af.optim.linear_schedule(1.0, 0.0, transition_steps=2))
      >>> state = tx.init(grads)
      >>> updates, state = tx.update(grads, state)
      >>> updates["w"][0, 0].item(), state.count.item()
      (0.5, 1.0)
      >>> updates, state = tx.update(grads, state)
      >>> updates["w"][0, 0].item(), state.count.item()
      (0.25, 2.0)

    Cost: ``init`` allocates a 0-d counter; ``update`` evaluates the schedule (a few 0-d ops),
    reads each update once and writes a new tensor of its size. No host sync.
    """
    if not callable(schedule):
        raise TypeError(f"scale_by_schedule: schedule must be callable, got {type(schedule).__name__}")

    def init(params):
        return ScaleByScheduleState(torch.zeros((), dtype=torch.float32, device=step_device(params)))

    def update(updates, state, params=None):
        if not isinstance(state, ScaleByScheduleState):
            raise TypeError(f"scale_by_schedule: state is {type(state).__name__}, expected ScaleByScheduleState "
                            "(from scale_by_schedule(...).init)")
        us, _ = checked_inputs(updates, None, None, "", "scale_by_schedule")
        factor = lr_at(schedule, state.count)
        out = [u * on(factor, u.device) for u in us]
        return tree_unflatten(tree_structure(updates), out), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiplies updates by ``-learning_rate``, turning a direction into a descent step (optax's).

    ``chain(..., scale_by_learning_rate(lr))`` ends a hand-made optimizer: it is
    :func:`scale` ``(-lr)`` for a float and :func:`scale_by_schedule` of ``-schedule`` for a
    schedule.

    Args:
      learning_rate: a float ``>= 0`` or a schedule (a callable of the step count).
      flip_sign: multiply by ``-learning_rate`` (the default, a descent step); ``False``
        multiplies by ``learning_rate`` itself (optax's option, for an ascent or a direction
        already negated).

    Returns:
      A ``GradientTransformation``: stateless (:class:`~ampfunc.transform.EmptyState`) for a float, with
      a ``ScaleByScheduleState`` (the count) for a schedule; ``update`` does not need ``params``.

    Example:
      >>> grads = {"w": torch.full((2, 3), 0.5)}
      >>> tx = af.optim.scale_by_learning_rate(0.5)
      >>> state = tx.init(grads)
      >>> updates, state = tx.update(grads, state)
      >>> updates["w"][0, 0].item()
      -0.25
      >>> opt = af.chain(af.optim.scale_by_adam(), af.optim.scale_by_learning_rate(af.optim.constant_schedule(1e-3)))

    Cost: that of :func:`scale` (float) or :func:`scale_by_schedule` (schedule): one read and
    one new tensor per update, plus the schedule's few 0-d ops. No host sync.
    """
    check_lr(learning_rate, "scale_by_learning_rate")
    if not isinstance(flip_sign, bool):
        raise TypeError(f"scale_by_learning_rate: flip_sign must be a bool, got {flip_sign!r}")
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * float(learning_rate))


def add_decayed_weights(weight_decay: float = 0.0, mask=None) -> GradientTransformation:
    """Adds ``weight_decay * params`` to the updates (optax's ``add_decayed_weights``).

    Before a rescaling transform (e.g. :func:`scale_by_adam`) this is L2 decay; right before
    :func:`scale_by_learning_rate` it is decoupled (AdamW-style) decay. Use
    :func:`ampfunc.masked` to exempt norms and biases. With ``weight_decay == 0`` the updates
    are returned as they are.

    Args:
      weight_decay: the decay coefficient, a float ``>= 0``; when non-zero ``update`` needs
        ``params``.
      mask: optax's option: a pytree of bools like the params, or a function of the params
        returning one; only the leaves where it is ``True`` decay (``masked(add_decayed_weights(
        weight_decay), mask)``). ``None``: every leaf.

    Returns:
      A stateless (:class:`~ampfunc.transform.EmptyState`) ``GradientTransformation``; updates keep their
      dtype (params are cast to it).

    Example:
      >>> params = {"w": torch.ones(2, 3)}
      >>> grads = {"w": torch.full((2, 3), 0.5)}
      >>> tx = af.add_decayed_weights(0.5)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"][0, 0].item()  # 0.5 + 0.5 * 1
      1.0
      >>> adamw = af.chain(af.optim.scale_by_adam(), af.add_decayed_weights(1e-2),
      ...                  af.optim.scale_by_learning_rate(1e-3))

    Cost: ``init`` allocates nothing; ``update`` reads each update and param once and writes a
    new tensor of the update's size (plus a cast copy of a param whose dtype differs); nothing
    with ``weight_decay == 0``. No host sync.
    """
    check_nonneg(weight_decay, "weight_decay")
    if mask is not None:
        return masked(add_decayed_weights(weight_decay), mask)

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
