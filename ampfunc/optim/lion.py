"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as ``optax.lion``.

One moment, and an update of constant magnitude: ``p -= lr * (sign(b1 * m + (1 - b1) * g) +
weight_decay * p)``, then ``m = b2 * m + (1 - b2) * g``. Fused with the kernels of
``ext/optimizers/lion.h`` (spec: :mod:`ampfunc.ops.optimizers.lion`) on every path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ampfunc import ops
from ampfunc.flat import zeros_packed
from ampfunc.optim.base import (
    ScalarOrSchedule,
    arithmetic_groups,
    as_dtype,
    check_lr,
    check_nonneg,
    checked_inputs,
    lr_at,
    on,
    step_device,
    warn_low_precision_params,
)
from ampfunc.transform import FusedSpec, GradientTransformation, register_kernel
from ampfunc.tree import (
    PyTree,
    arithmetic_dtype,
    flatten_together,
    float_leaves_with_paths,
    tree_flatten,
    tree_structure,
    tree_unflatten,
)

__all__ = ["LionState", "lion"]


class LionState(NamedTuple):
    """The state of :func:`lion`.

    Attributes:
      step: 0-d float32 tensor on the params' device, the number of applied steps.
      mu: fp32 pytree like the params (fp64 leaves for fp64 params), the moment ``m``.

    Example:
      >>> state = af.lion(1e-4).init({"w": torch.ones(2, 3)})
      >>> state.step.item(), state.mu["w"].shape
      (0.0, torch.Size([2, 3]))
    """

    step: torch.Tensor
    mu: PyTree


def _check_hparams(lr, b1, b2, weight_decay):
    check_lr(lr, "lion")
    for name, b in (("b1", b1), ("b2", b2)):
        # [0, 1) as Adam's betas: at 1 the moment would ignore the gradients (b2) or the update
        # would (b1)
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 <= b < 1.0:
            raise ValueError(f"lion: {name} must be a number in [0, 1), got {b!r}")
    check_nonneg(weight_decay, "weight_decay")


def _fused_update(grads, state, params, lr_t, b1, b2, weight_decay):
    """The update by one fused out-of-place kernel pass (:func:`ampfunc.ops.lion_update`), or None
    when the trees are not plain fp32 state of one device (the generic path then runs)."""
    trees = [grads, state.mu] + ([params] if params is not None else [])
    together = flatten_together(trees, keys_of=2 if params is not None else 1)
    if together is None or not together[0][0]:
        return None
    (gs, ms, *rest), rebuild = together
    ps = rest[0] if params is not None else None
    if not ops.kernel_ready(state.step.device, [ps or []], [gs]):
        return None
    try:
        deltas, new_m, step = ops.lion_update(ps, gs, ms, state.step, lr=lr_t, beta1=b1, beta2=b2,
                                              weight_decay=weight_decay)
    except (ValueError, TypeError, RuntimeError):
        return None
    return rebuild(deltas), LionState(step, rebuild(new_m))


def lion(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0) -> GradientTransformation:
    """Lion (Chen et al. 2023), as ``optax.lion``, with decoupled weight decay.

    Per leaf, with ``g`` the gradient in fp32 (fp64 for an fp64 param):
    ``c = b1 * m + (1 - b1) * g`` (``torch.lerp(g, m, b1)``); the update is
    ``new_p - p`` with ``new_p = p * (1 - lr * weight_decay) - lr * sign(c)`` (``sign(0) = 0``);
    then ``m = b2 * m + (1 - b2) * g`` (``torch.lerp(m, g, 1 - b2)``). Every update has the same
    magnitude per element, so Lion takes a learning rate 3-10x smaller than AdamW's (and a
    weight decay that much larger) for the same effective step.

    Args:
      lr: the learning rate, a float or a schedule (a callable of the step count), evaluated at
        the number of steps applied before this one.
      b1: the interpolation weight of the moment in the update direction, in ``[0, 1)``.
      b2: the decay rate of the moment, in ``[0, 1)``.
      weight_decay: the decoupled decay coefficient; when non-zero ``update`` needs ``params``.

    Returns:
      A ``GradientTransformation`` whose state is a :class:`LionState`; it is registered with the
      fused kernels (alone or after :func:`ampfunc.clip_by_global_norm` in a ``chain``), so
      ``mixed_precision``, ``make_train_step`` and ``ModuleTrainer`` run it in one pass.

    Example:
      >>> params = {"w": torch.ones(3)}
      >>> tx = af.lion(0.1)
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": torch.tensor([2.0, -3.0, 0.0])}, state, params)
      >>> updates["w"]
      tensor([-0.1000,  0.1000,  0.0000])

    Cost: ``init`` allocates one fp32 zero tree like the params (one buffer per device) and a
    0-d step. ``update``, when the compiled kernels take the tree (fp32 params on one CPU or CUDA
    device, fp32/fp16/bf16 grads, plain tensors), runs one fused pass reading g, p, m and writing
    the updates and the new moment (20 bytes per element in place, AdamW's 28); otherwise a
    generic path of about six ``torch._foreach`` ops per device with the same arithmetic. No host
    sync.
    """
    _check_hparams(lr, b1, b2, weight_decay)
    b1, b2, weight_decay = float(b1), float(b2), float(weight_decay)
    hparams = dict(lr=lr, b1=b1, b2=b2, weight_decay=weight_decay)

    def init(params):
        float_leaves_with_paths(params, "params")
        warn_low_precision_params(params, "lion")
        step = torch.zeros((), dtype=torch.float32, device=step_device(params))
        return LionState(step, zeros_packed(params, arithmetic_dtype))

    def update(grads, state, params=None):
        if not isinstance(state, LionState):
            raise TypeError(f"lion: state is {type(state).__name__}, expected LionState (from lion(...).init)")
        if weight_decay != 0 and params is None:
            raise ValueError("lion: weight_decay != 0 needs params; call update(grads, state, params)")
        lr_t = lr_at(lr, state.step)
        fast = _fused_update(grads, state, params, lr_t, b1, b2, weight_decay)
        if fast is not None:
            return fast
        gs, ps = checked_inputs(grads, params, state.mu, "state.mu", "lion")
        ms = tree_flatten(state.mu)[0]
        n = len(gs)
        deltas, new_m = [None] * n, [None] * n
        decay = None
        if weight_decay != 0:
            decay = 1 - lr_t * weight_decay  # float, or 0-d fp32 tensor for a schedule
        for (dev, dt), idx in arithmetic_groups(gs, ps, ms).items():
            # The kernel's operations, one foreach op each (ampfunc/ops/optimizers/lion.py).
            g = as_dtype([gs[i] for i in idx], dt)
            m = [ms[i] for i in idx]
            u = torch._foreach_sign(torch._foreach_lerp(g, m, b1))
            m = torch._foreach_lerp(m, g, 1 - b2)
            neg_lr = -lr_t if isinstance(lr_t, float) else on(lr_t, dev).to(dt).neg()
            if ps is None:
                d = torch._foreach_mul(u, neg_lr)
            else:
                p = as_dtype([ps[i] for i in idx], dt)
                base = p if decay is None else torch._foreach_mul(p, on(decay, dev))
                if isinstance(neg_lr, float):
                    new_p = torch._foreach_add(base, u, alpha=neg_lr)
                else:  # lr * sign is exact: one rounding, as the kernel's fused multiply-add
                    new_p = torch._foreach_add(base, torch._foreach_mul(u, neg_lr))
                d = torch._foreach_sub(new_p, p)
            for j, i in enumerate(idx):
                deltas[i], new_m[i] = d[j], m[j]
        unflat = lambda slot, leaves: tree_unflatten(tree_structure(slot), leaves)  # noqa: E731
        return unflat(grads, deltas), LionState(state.step + 1, unflat(state.mu, new_m))

    return register_kernel(GradientTransformation(init, update), FusedSpec("lion", hparams))
