"""Gradient accumulation (optax ``MultiSteps``-like), with non-finite mini-steps dropped."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ampfunc import ops
from ampfunc.optim.base import checked_inputs, step_device
from ampfunc.transform import GradientTransformation, refuse_outermost_only
from ampfunc.tree import PyTree, arithmetic_dtype, select_tree, tree_flatten, tree_map, tree_structure, tree_unflatten

__all__ = ["AccumulateState", "accumulate"]


class AccumulateState(NamedTuple):
    """The state of :func:`accumulate`.

    Attributes:
      mini_step: 0-d int32 tensor on the params' device, the number of finite mini-steps summed
        since ``inner`` last applied.
      grad_sum: fp32 pytree like the params (fp64 leaves for fp64 params), the sum of those
        mini-steps' gradients.
      inner: the inner transform's state (advanced only by applied updates).

    Example:
      >>> state = af.accumulate(af.sgd(0.1), every_k=4).init({"w": torch.ones(2, 3)})
      >>> state.mini_step.item(), state.grad_sum["w"].dtype, type(state.inner).__name__
      (0, torch.float32, 'SgdState')
    """

    mini_step: torch.Tensor
    grad_sum: PyTree
    inner: Any


def accumulate(inner: GradientTransformation, every_k: int) -> GradientTransformation:
    """Runs ``inner`` on the mean of every ``every_k`` finite mini-step gradients.

    Each call adds the gradients to an fp32 sum and returns zero updates, except the call that
    completes ``every_k`` finite mini-steps: it returns ``inner``'s updates for the mean
    ``sum / every_k`` (the same as ``loss / k`` per micro-batch in a torch loop) and resets the
    sum. A mini-step whose gradients hold any inf/NaN is dropped: it is not summed in and it does
    **not** advance ``mini_step``, so every applied update averages exactly ``every_k`` good
    mini-batches (the same as when :func:`ampfunc.mixed_precision` skips that call and restores
    this state). Only ``inner``'s state advances when it applies, so its step count and
    schedule count applied updates, not mini-steps. All decisions are made on the device.

    Args:
      inner: the ``GradientTransformation`` to run on the averaged gradients (e.g.
        :func:`ampfunc.adamw`).
      every_k: the number of finite mini-steps per applied update, an int ``>= 1``.

    Returns:
      A ``GradientTransformation`` whose state is an :class:`AccumulateState`; its ``update``
      passes ``params`` on to ``inner``.

    Example:
      >>> params = {"w": torch.ones(2, 3)}
      >>> tx = af.accumulate(af.sgd(0.25), every_k=2)
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": torch.full((2, 3), 1.0)}, state, params)
      >>> bool((updates["w"] == 0).all()), state.mini_step.item()
      (True, 1)
      >>> updates, state = tx.update({"w": torch.full((2, 3), float("nan"))}, state, params)
      >>> state.mini_step.item()  # dropped
      1
      >>> updates, state = tx.update({"w": torch.full((2, 3), 3.0)}, state, params)
      >>> updates["w"][0, 0].item(), state.mini_step.item()  # -0.25 * mean(1, 3)
      (-0.5, 0)

    Cost: ``init`` allocates one fp32 zero tree like the params (``zeros_like`` per leaf; fp64
    for fp64 params), a 0-d counter and ``inner``'s state. ``update`` makes one read pass over the gradients for the
    finiteness check, then per leaf four new fp32 tensors of its size (the masked gradient, the
    new sum, the mean, the kept sum; plus a cast for non-fp32 gradients); ``inner.update`` runs on
    every call, and its updates and state are selected with ``torch.where`` (one more read and
    write of each). No host sync.
    """
    if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"accumulate: every_k must be an int >= 1, got {every_k!r}")
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"accumulate: inner is {type(inner).__name__}, not a GradientTransformation")
    # Inside, mixed_precision would never see the overflowing mini-steps accumulate drops: its
    # scale would not back off, and every step would be dropped for good.
    refuse_outermost_only(inner, "accumulate: inner")

    def init(params):
        grad_sum = tree_map(lambda p: torch.zeros_like(p, dtype=arithmetic_dtype(p.dtype)), params)  # fp64 stays fp64
        mini_step = torch.zeros((), dtype=torch.int32, device=step_device(params))
        return AccumulateState(mini_step, grad_sum, inner.init(params))

    def update(grads, state, params=None):
        if not isinstance(state, AccumulateState):
            raise TypeError(f"accumulate: state is {type(state).__name__}, expected AccumulateState")
        gs, _ = checked_inputs(grads, params, state.grad_sum, "state.grad_sum", "accumulate")
        finite = ops.all_finite(gs).to(state.mini_step.device)
        sums = tree_flatten(state.grad_sum)[0]
        new_sums = []
        for g, s in zip(gs, sums):
            f = finite if finite.device == g.device else finite.to(g.device, non_blocking=True)
            # where (not multiply) so that a NaN in a dropped mini-step cannot leak into the sum
            new_sums.append(s + torch.where(f, g.to(s.dtype), 0.0))
        mini_step = state.mini_step + finite.to(torch.int32)
        apply = mini_step >= every_k
        mean = tree_unflatten(tree_structure(state.grad_sum), [s / every_k for s in new_sums])
        inner_updates, inner_state = inner.update(mean, state.inner, params)
        zero = lambda x: torch.zeros((), dtype=x.dtype, device=x.device)  # noqa: E731
        updates = tree_map(lambda u: torch.where(apply.to(u.device), u, zero(u)), inner_updates)
        kept = [torch.where(apply.to(s.device), zero(s), s) for s in new_sums]
        new_state = AccumulateState(
            torch.where(apply, torch.zeros_like(mini_step), mini_step),
            tree_unflatten(tree_structure(state.grad_sum), kept),
            select_tree(apply, inner_state, state.inner),
        )
        return updates, new_state

    return GradientTransformation(init, update)
