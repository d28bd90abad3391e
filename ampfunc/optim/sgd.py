"""Stochastic gradient descent, with torch.optim.SGD's names, defaults and arithmetic.

The update reproduces ``torch.optim.SGD`` (single-tensor path) operation for operation in fp32,
so a trajectory matches torch's to the last bit on CPU, and within fp32 rounding elsewhere.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ampfunc import ops
from ampfunc.flat import zeros_packed
from ampfunc.lowmem import Q8Moment, check_moment, check_moments, init_moment, update_stored
from ampfunc.optim.base import (
    ScalarOrSchedule,
    arithmetic_groups,
    as_dtype,
    check_bool,
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

__all__ = ["SgdState", "sgd"]


class SgdState(NamedTuple):
    """The state of :func:`sgd`.

    Attributes:
      step: 0-d float32 tensor on the params' device, the number of applied steps.
      momentum_buffer: fp32 pytree like the params (fp64 leaves for fp64 params), or ``None``
        when ``momentum == 0``; with ``moments="bf16"`` its leaves are bf16 (fp64 ones stay
        fp64), with ``moments="q8"`` it is an :class:`ampfunc.lowmem.Q8Moment` (codes and
        per-block absmax trees).

    Example:
      >>> state = af.sgd(0.1, momentum=0.9).init({"w": torch.ones(2, 3)})
      >>> state.step.item(), state.momentum_buffer["w"].shape
      (0.0, torch.Size([2, 3]))
      >>> af.sgd(0.1).init({"w": torch.ones(2, 3)}).momentum_buffer is None
      True
    """

    step: torch.Tensor
    momentum_buffer: Optional[PyTree]


def _fused_update(grads, state, params, lr_t, momentum, dampening, weight_decay, nesterov, maximize):
    """The update by one fused out-of-place kernel pass (:func:`ampfunc.ops.sgd_update`: reads
    g, p and the buffer once, writes the updates and the new buffer), with the generic path's
    arithmetic bit for bit; None when the trees are not plain fp32 state of one device (the
    generic path then runs, and names the leaf path of anything wrong)."""
    trees = [grads] + ([params] if params is not None else []) + ([state.momentum_buffer] if momentum != 0 else [])
    together = flatten_together(trees, keys_of=1 if len(trees) > 1 else 0)
    if together is None or not together[0][0]:
        return None
    (gs, *rest), rebuild = together
    ps = rest.pop(0) if params is not None else None
    bufs = rest.pop(0) if momentum != 0 else None
    # grads and params are looked at here; the buffers (made by init / the last update) are left
    # to the op's own validation (it refuses a value that is not a tensor, so dict values taken
    # as leaves are safe), and anything it refuses goes to the generic path, which either
    # computes it or raises naming the leaf path.
    if not ops.kernel_ready(state.step.device, [ps or []], [gs]):
        return None
    try:
        deltas, new_bufs, step = ops.sgd_update(ps, gs, bufs, state.step, lr=lr_t, weight_decay=weight_decay,
                                                momentum=momentum, dampening=dampening, nesterov=nesterov,
                                                maximize=maximize)
    except (ValueError, TypeError, RuntimeError):  # RuntimeError: the dispatcher's, for a non-tensor
        return None
    new_buf = rebuild(new_bufs) if momentum != 0 else None
    return rebuild(deltas), SgdState(step, new_buf)


def sgd(lr: ScalarOrSchedule, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False, maximize: bool = False, *, moments: str = "fp32") -> GradientTransformation:
    """SGD as ``torch.optim.SGD`` computes it, as a pure transform.

    Per leaf, with ``g`` the gradient in fp32 (fp64 for an fp64 param): ``g = -g`` if
    ``maximize``; ``g += weight_decay * p``; with momentum ``buf = g`` on the first step and
    ``buf = momentum * buf + (1 - dampening) * g`` after (decided on the device from
    ``state.step``, no host sync); ``g = g + momentum * buf`` with ``nesterov`` else
    ``g = buf``; the update is ``-lr * g``, returned as the delta ``(p - lr * g) - p`` so that
    :func:`ampfunc.apply_updates` lands on torch's in-place result (as ``-lr * g`` when
    ``params`` is not passed).

    Args:
      lr: the learning rate, a float or a schedule (a callable of the step count, see
        :func:`ampfunc.optim.linear_schedule` and co.), evaluated at the number of steps applied
        before this one.
      momentum: the momentum factor; 0 keeps no buffer.
      dampening: the dampening of the momentum's gradient term.
      weight_decay: the L2 penalty coefficient (added to the gradient); when non-zero
        ``update`` needs ``params``.
      nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
      maximize: maximize the objective (the gradient is negated).
      moments: how the momentum buffer is stored between steps: ``"fp32"`` (torch's), ``"bf16"``
        (rounded to nearest even, 2 bytes each) or ``"q8"`` (8-bit block-wise codes through
        bitsandbytes' signed dynamic map with an fp32 absmax per block of 256: about 1 byte
        each; leaves under 4,096 elements or not a multiple of 256 stay fp32; see
        :mod:`ampfunc.lowmem`). Each step rebuilds the buffer in fp32, updates it with the
        arithmetic above and stores it again. ``"bf16"`` and ``"q8"`` need ``momentum > 0``
        (without momentum there is no buffer to store: refused, ``ValueError``).

    Returns:
      A ``GradientTransformation`` whose state is an :class:`SgdState`; it is registered with
      the fused kernels (alone or after :func:`ampfunc.clip_by_global_norm` in a ``chain``).

    Example:
      >>> params = {"w": torch.ones(2, 3)}
      >>> grads = {"w": torch.full((2, 3), 0.5)}
      >>> tx = af.sgd(0.5, momentum=0.9)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = af.apply_updates(params, updates)
      >>> params["w"][0, 0].item()
      0.75

    Cost: ``init`` allocates a 0-d step and, with momentum, one fp32 zero tree like the params
    (one buffer per device). ``update``, when the compiled kernels take the tree (fp32 params on
    one CPU or CUDA device, fp32/fp16/bf16 grads, plain tensors), runs one fused kernel pass: it
    reads g, p (and the buffer) once and writes new tensors for the updates (and the new
    buffer); otherwise a generic path of a few ``torch._foreach`` ops per device computes the
    same arithmetic. With ``moments="bf16"``/``"q8"``: about 2/1 bytes per element for the buffer
    instead of 4 (``init`` allocates it in that layout); ``update`` decodes the buffer into new
    fp32 tensors, runs the generic path above and encodes the new buffer (q8: an absmax per block
    and a search of the map per element); ``mixed_precision`` decodes, runs the fused fp32 kernel
    and encodes, in plain torch around it (the one-pass low-memory kernel is Adam's). No host
    sync.
    """
    check_lr(lr, "sgd")
    check_nonneg(momentum, "momentum")
    check_nonneg(dampening, "dampening")
    check_nonneg(weight_decay, "weight_decay")
    check_bool(nesterov, "nesterov", "sgd")
    check_bool(maximize, "maximize", "sgd")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    check_moments(moments, "sgd")
    if moments != "fp32" and momentum == 0:
        raise ValueError(f"sgd: moments={moments!r} stores the momentum buffer, but momentum == 0 keeps none: "
                         "pass momentum > 0, or leave moments='fp32'")
    hparams = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                   nesterov=nesterov, maximize=maximize)
    if moments != "fp32":
        hparams["moments"] = moments

    def init(params):
        float_leaves_with_paths(params, "params")
        warn_low_precision_params(params, "sgd")
        step = torch.zeros((), dtype=torch.float32, device=step_device(params))
        if momentum == 0:
            buf = None
        elif moments != "fp32":
            buf = init_moment(params, moments, "sgd")
        else:
            buf = zeros_packed(params, arithmetic_dtype)
        return SgdState(step, buf)

    def update(grads, state, params=None):
        if moments == "fp32":
            if isinstance(getattr(state, "momentum_buffer", None), Q8Moment):  # names the setting it was made with
                check_moment(state.momentum_buffer, grads, "fp32", "state.momentum_buffer", "sgd")
            return update32(grads, state, params)
        # A bf16 / q8 buffer: rebuilt in fp32, the fp32 update, stored again (the signed map:
        # momentum takes both signs). The engine of mixed_precision does the same around the
        # fp32 twin of this transform.
        if not isinstance(state, SgdState):
            raise TypeError(f"sgd: state is {type(state).__name__}, expected SgdState (from sgd(...).init)")
        if state.momentum_buffer is None:
            raise ValueError("sgd: state.momentum_buffer is None but momentum != 0; "
                             "was the state made by an sgd without momentum?")
        return update_stored(update32, ("momentum_buffer",), moments, grads, state, params, "sgd")

    def update32(grads, state, params=None):
        if not isinstance(state, SgdState):
            raise TypeError(f"sgd: state is {type(state).__name__}, expected SgdState (from sgd(...).init)")
        if weight_decay != 0 and params is None:
            raise ValueError("sgd: weight_decay != 0 needs params; call update(grads, state, params)")
        if momentum != 0 and state.momentum_buffer is None:
            raise ValueError("sgd: state.momentum_buffer is None but momentum != 0; "
                             "was the state made by an sgd without momentum?")
        if momentum == 0 and state.momentum_buffer is not None:
            raise ValueError("sgd: state.momentum_buffer is set but momentum == 0 (it would be dropped); "
                             "was the state made by an sgd with momentum?")
        lr_t = lr_at(lr, state.step)
        # Low-memory buffers take the generic path: the fused kernel packs its new buffers into one
        # fp32 allocation, which the leaves kept in fp32 would hold alive whole.
        fast = _fused_update(grads, state, params, lr_t, momentum, dampening, weight_decay, nesterov,
                             maximize) if moments == "fp32" else None
        if fast is not None:
            return fast
        gs, ps = checked_inputs(grads, params, state.momentum_buffer, "state.momentum_buffer", "sgd")
        bufs = tree_flatten(state.momentum_buffer)[0] if momentum != 0 else None
        first = state.step == 0
        deltas: list = [None] * len(gs)
        new_bufs: list = [None] * len(gs)
        for (dev, dt), idx in arithmetic_groups(gs, ps, bufs).items():
            # One foreach launch per op, device and dtype (fp32, fp64 for fp64 params); each op
            # is the one torch's SGD performs.
            g = as_dtype([gs[i] for i in idx], dt)
            if maximize:
                g = torch._foreach_neg(g)
            p = as_dtype([ps[i] for i in idx], dt) if ps is not None else None
            if weight_decay != 0:
                g = torch._foreach_add(g, p, alpha=weight_decay)
            if momentum != 0:
                old = [bufs[i] for i in idx]
                buf = torch._foreach_mul(old, momentum)
                torch._foreach_add_(buf, g, alpha=1 - dampening)
                if dampening != 0:
                    # torch starts the buffer as a copy of the first gradient. With zero dampening
                    # the formula already gives that (the buffer starts at zero); otherwise the
                    # choice is made on the device, so no step reads the count to the host.
                    f = on(first, dev)
                    buf = [torch.where(f, gi, bi) for gi, bi in zip(g, buf)]
                for j, i in enumerate(idx):
                    new_bufs[i] = buf[j]
                g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
            lr_i = on(lr_t, dev)
            if p is None:
                d = torch._foreach_mul(g, -lr_i) if isinstance(lr_i, float) else torch._foreach_neg(
                    torch._foreach_mul(g, lr_i))
            else:
                if isinstance(lr_i, float):
                    new_p = torch._foreach_add(p, g, alpha=-lr_i)
                elif dt == torch.float32:  # fused, as the kernels and torch's add(alpha=-lr) compute it
                    new_p = ops.fma_rounded(g, lr_i.neg(), p)
                else:
                    new_p = torch._foreach_sub(p, torch._foreach_mul(g, lr_i.to(dt)))
                d = torch._foreach_sub(new_p, p)
            for j, i in enumerate(idx):
                deltas[i] = d[j]
        spec = tree_structure(grads)
        new_buf = tree_unflatten(tree_structure(state.momentum_buffer), new_bufs) if momentum != 0 else None
        return tree_unflatten(spec, deltas), SgdState(state.step + 1, new_buf)

    return register_kernel(GradientTransformation(init, update), FusedSpec("sgd", hparams))
