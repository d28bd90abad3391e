"""Adam and AdamW, with torch.optim's names, defaults and arithmetic.

The update reproduces ``torch.optim.Adam`` / ``AdamW`` (single-tensor path) operation for
operation in fp32, with one difference in *where* the bias corrections are computed: torch
reads the step count back to the host (``.item()``) and computes them in Python doubles; here
they are computed in float64 on the device from ``state.step``, then rounded to fp32 as torch
rounds its Python scalars. On CPU the trajectories agree to the last bit.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ampfunc import ops
from ampfunc.flat import zeros_packed
from ampfunc.lowmem import check_moments, init_moment, update_stored
from ampfunc.optim.base import (
    ScalarOrSchedule,
    arithmetic_groups,
    as_dtype,
    check_beta,
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

__all__ = ["AdamState", "adam", "adamw", "scale_by_adam"]


class AdamState(NamedTuple):
    """The state of :func:`adam`, :func:`adamw` and :func:`scale_by_adam`.

    Attributes:
      step: 0-d float32 tensor on the params' device, the number of applied steps.
      exp_avg: fp32 pytree like the params (fp64 leaves for fp64 params), the first moment ``m``;
        with ``moments="bf16"`` its leaves are bf16, with ``moments="q8"`` it is an
        :class:`ampfunc.lowmem.Q8Moment` (codes and per-block absmax trees).
      exp_avg_sq: like ``exp_avg``, the second moment ``v``.
      max_exp_avg_sq: like ``exp_avg``, the running maximum of ``v``, with
        ``amsgrad``; else ``None`` (always ``None`` for :func:`scale_by_adam`).

    Example:
      >>> state = af.adamw(1e-3).init({"w": torch.ones(2, 3)})
      >>> state.step.item(), state.exp_avg["w"].shape, state.max_exp_avg_sq
      (0.0, torch.Size([2, 3]), None)
    """

    step: torch.Tensor
    exp_avg: PyTree
    exp_avg_sq: PyTree
    max_exp_avg_sq: Optional[PyTree]


def _check_hparams(where, lr, b1, b2, eps, weight_decay, **flags):
    check_lr(lr, where)
    check_beta(b1, "b1", 0, where)
    check_beta(b2, "b2", 1, where)
    check_nonneg(eps, "epsilon")
    check_nonneg(weight_decay, "weight_decay")
    for name, value in flags.items():
        check_bool(value, name, where)


def _fused_update(kind, grads, state, params, lr_t, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled):
    """The update by one fused out-of-place kernel pass (:func:`ampfunc.ops.adam_update`: reads
    g, p, m, v once, writes the updates and the new moments), with the generic path's
    arithmetic; None when the trees are not plain fp32 state of one device (the generic path
    then runs, and names the leaf path of anything wrong)."""
    trees = [grads, state.exp_avg, state.exp_avg_sq] + ([params] if params is not None else []) + \
        ([state.max_exp_avg_sq] if amsgrad else [])
    together = flatten_together(trees, keys_of=3 if params is not None else 1)
    if together is None or not together[0][0]:
        return None
    (gs, ms, vs, *rest), rebuild = together
    ps = rest.pop(0) if params is not None else None
    vmaxs = rest.pop(0) if amsgrad else None
    # grads and params are looked at here; the state lists (made by init / the last update) are
    # left to the op's own validation (it refuses a value that is not a tensor, so dict values
    # taken as leaves are safe), and anything it refuses goes to the generic path, which either
    # computes it (e.g. state on several devices) or raises naming the leaf path.
    if not ops.kernel_ready(state.step.device, [ps or []], [gs]):
        return None
    try:
        deltas, new_m, new_v, new_vmax, step = ops.adam_update(
            ps, gs, ms, vs, vmaxs, state.step, lr=lr_t, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, amsgrad=amsgrad, decoupled_weight_decay=decoupled, maximize=maximize)
    except (ValueError, TypeError, RuntimeError):  # RuntimeError: the dispatcher's, for a non-tensor
        return None
    new_state = AdamState(step, rebuild(new_m), rebuild(new_v), rebuild(new_vmax) if amsgrad else None)
    return rebuild(deltas), new_state


def _rebuild(grads, state, deltas, new_m, new_v, new_vmax, step, amsgrad):
    unflat = lambda slot, leaves: tree_unflatten(tree_structure(slot), leaves)  # noqa: E731
    new_state = AdamState(step, unflat(state.exp_avg, new_m), unflat(state.exp_avg_sq, new_v),
                          unflat(state.max_exp_avg_sq, new_vmax) if amsgrad else None)
    return tree_unflatten(tree_structure(grads), deltas), new_state


def _make(kind: str, lr, b1, b2, eps, weight_decay, amsgrad, maximize, decoupled: bool,
          moments: str = "fp32") -> GradientTransformation:
    _check_hparams(kind, lr, b1, b2, eps, weight_decay, amsgrad=amsgrad, maximize=maximize)
    check_moments(moments, kind)
    beta1, beta2 = float(b1), float(b2)
    hparams = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                   maximize=maximize)
    if moments != "fp32":
        hparams["moments"] = moments

    def init(params):
        float_leaves_with_paths(params, "params")
        warn_low_precision_params(params, kind)
        if moments != "fp32":
            zeros = lambda: init_moment(params, moments, kind)  # noqa: E731
        else:
            zeros = lambda: zeros_packed(params, arithmetic_dtype)  # noqa: E731  (one buffer per moment: see zeros_packed)
        step = torch.zeros((), dtype=torch.float32, device=step_device(params))
        return AdamState(step, zeros(), zeros(), zeros() if amsgrad else None)

    def update(grads, state, params=None):
        if moments == "fp32":
            return update32(grads, state, params)
        # bf16 / q8 moments: rebuilt in fp32, the fp32 update, stored again (the reference of
        # the fused step; the engine runs the fused kernels on the rebuilt numbers).
        if not isinstance(state, AdamState):
            raise TypeError(f"{kind}: state is {type(state).__name__}, expected AdamState (from {kind}(...).init)")
        fields = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        return update_stored(update32, fields, moments, grads, state, params, kind)

    def update32(grads, state, params=None):
        if not isinstance(state, AdamState):
            raise TypeError(f"{kind}: state is {type(state).__name__}, expected AdamState (from {kind}(...).init)")
        if weight_decay != 0 and params is None:
            raise ValueError(f"{kind}: weight_decay != 0 needs params; call update(grads, state, params)")
        if amsgrad and state.max_exp_avg_sq is None:
            raise ValueError(f"{kind}: amsgrad=True but state.max_exp_avg_sq is None; "
                             f"was the state made without amsgrad?")
        if not amsgrad and state.max_exp_avg_sq is not None:
            raise ValueError(f"{kind}: state.max_exp_avg_sq is set but amsgrad=False (it would be dropped); "
                             f"was the state made with amsgrad?")
        lr_t = lr_at(lr, state.step)
        fast = _fused_update(kind, grads, state, params, lr_t, beta1, beta2, eps, weight_decay, amsgrad, maximize,
                             decoupled) if moments == "fp32" else None
        if fast is not None:
            return fast
        gs, ps = checked_inputs(grads, params, state.exp_avg, "state.exp_avg", kind)
        checked_inputs(grads, None, state.exp_avg_sq, "state.exp_avg_sq", kind)
        ms = tree_flatten(state.exp_avg)[0]
        vs = tree_flatten(state.exp_avg_sq)[0]
        vmaxs = tree_flatten(state.max_exp_avg_sq)[0] if amsgrad else [None] * len(gs)
        n = len(gs)
        step = state.step + 1
        # Bias corrections in float64 on the device (torch: Python doubles after a host read).
        step64 = step.to(torch.float64)
        bc1 = 1 - torch.pow(beta1, step64)
        bc2 = 1 - torch.pow(beta2, step64)
        lr64 = lr_t if isinstance(lr_t, float) else lr_t.to(torch.float64)
        # Rounded per group to its arithmetic dtype, as torch rounds its Python doubles.
        neg_step_size64, bc2_sqrt64 = -(lr64 / bc1), bc2.sqrt()
        decay = None
        if decoupled and weight_decay != 0:
            decay = 1 - lr_t * weight_decay  # float, or 0-d fp32 tensor for a schedule

        deltas, new_m, new_v, new_vmax = [None] * n, [None] * n, [None] * n, [None] * n
        for (dev, dt), idx in arithmetic_groups(gs, ps, ms).items():
            # One foreach launch per op, device and dtype (fp32, fp64 for fp64 params); each op
            # is the one torch's Adam performs.
            neg_step_size, bc2_sqrt = neg_step_size64.to(dt), bc2_sqrt64.to(dt)
            g = as_dtype([gs[i] for i in idx], dt)
            if maximize:
                g = torch._foreach_neg(g)
            p = as_dtype([ps[i] for i in idx], dt) if ps is not None else None
            new_p = p
            if weight_decay != 0:
                if decoupled:
                    new_p = torch._foreach_mul(p, on(decay, dev))
                else:
                    g = torch._foreach_add(g, p, alpha=weight_decay)
            m = torch._foreach_lerp([ms[i] for i in idx], g, 1 - beta1)
            v = torch._foreach_mul([vs[i] for i in idx], beta2)
            torch._foreach_addcmul_(v, g, g, value=1 - beta2)
            root = ops.sqrt_rounded if dt == torch.float32 else torch._foreach_sqrt
            if amsgrad:
                vmax = torch._foreach_maximum([vmaxs[i] for i in idx], v)
                denom = list(root(vmax))
            else:
                denom = list(root(v))
            torch._foreach_div_(denom, on(bc2_sqrt, dev))
            torch._foreach_add_(denom, eps)
            # torch: param.addcdiv_(exp_avg, denom, value=-step_size) == p + (-step_size * m) / denom
            step_term = torch._foreach_mul(m, on(neg_step_size, dev))
            torch._foreach_div_(step_term, denom)
            if new_p is None:
                d = step_term
            else:
                d = torch._foreach_sub(torch._foreach_add(new_p, step_term), p)
            for j, i in enumerate(idx):
                deltas[i], new_m[i], new_v[i] = d[j], m[j], v[j]
                if amsgrad:
                    new_vmax[i] = vmax[j]

        return _rebuild(grads, state, deltas, new_m, new_v, new_vmax, step, amsgrad)

    return register_kernel(GradientTransformation(init, update), FusedSpec(kind, hparams))


def adam(lr: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False, *,
         moments: str = "fp32") -> GradientTransformation:
    """Adam as ``torch.optim.Adam`` computes it (L2 weight decay added to the gradient).

    Per leaf, with ``g`` the gradient in fp32 (fp64 for an fp64 param) and ``t`` the new step
    count: ``g = -g`` if ``maximize``; ``g += weight_decay * p``; ``m = lerp(m, g, 1 - b1)``;
    ``v = b2 * v + (1 - b2) * g^2``; the update is
    ``-lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``, with
    ``vmax = max(vmax, v)`` in place of ``v`` in the denominator under ``amsgrad``. It is
    returned as the delta ``new_p - p`` so that :func:`ampfunc.apply_updates` lands on torch's
    in-place result (the step term alone when ``params`` is not passed). The bias corrections
    are computed on the device from ``state.step`` (torch reads the count to the host).

    Args:
      lr: the learning rate, a float or a schedule (a callable of the step count, see
        :func:`ampfunc.optim.linear_schedule` and co.), evaluated at the number of steps applied
        before this one.
      b1: the decay rate of the first moment (torch's ``betas[0]``), in ``[0, 1)``.
      b2: the decay rate of the second moment (torch's ``betas[1]``), in ``[0, 1)``.
      eps: added to the denominator for numerical stability.
      weight_decay: the L2 penalty coefficient (added to the gradient); when non-zero
        ``update`` needs ``params``.
      amsgrad: use the running maximum of the second moment (keeps ``max_exp_avg_sq``).
      maximize: maximize the objective (the gradient is negated).
      moments: how the moments are stored between steps: ``"fp32"`` (torch's), ``"bf16"``
        (rounded to nearest even, 2 bytes each) or ``"q8"`` (8-bit block-wise codes through
        bitsandbytes' dynamic maps with an fp32 absmax per block of 256: about 1 byte each;
        leaves under 4,096 elements or not a multiple of 256 stay fp32; see
        :mod:`ampfunc.lowmem`). Each step rebuilds them in fp32, updates them with the
        arithmetic above and stores them again.

    Returns:
      A ``GradientTransformation`` whose state is an :class:`AdamState`; it is registered with
      the fused kernels (alone or after :func:`ampfunc.clip_by_global_norm` in a ``chain``).

    Example:
      >>> params = {"w": torch.ones(2, 3)}
      >>> grads = {"w": torch.full((2, 3), 0.5)}
      >>> tx = af.adam(1e-3)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = af.apply_updates(params, updates)
      >>> state.step.item()
      1.0

    Cost: ``init`` allocates two fp32 zero trees like the params (three with ``amsgrad``), one
    buffer per device each, and a 0-d step. ``update``, when the compiled kernels take the tree
    (fp32 params on one CPU or CUDA device, fp32/fp16/bf16 grads, plain tensors), runs one fused
    kernel pass: it reads g, p, m, v (and vmax) once and writes new tensors for the updates and
    the new moments; otherwise a generic path of about ten ``torch._foreach`` ops per device
    computes the same arithmetic. With ``moments="bf16"``/``"q8"``: about 2/1 bytes per element
    per moment instead of 4; the update (generic path) decodes and re-encodes each moment
    (``mixed_precision`` runs the fused kernel on the decoded numbers). No host sync.
    """
    return _make("adam", lr, b1, b2, eps, weight_decay, amsgrad, maximize, decoupled=False, moments=moments)


def adamw(lr: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False, *,
          moments: str = "fp32") -> GradientTransformation:
    """AdamW as ``torch.optim.AdamW`` computes it: :func:`adam` with decoupled weight decay.

    The params are decayed before the Adam step, ``p *= 1 - lr * weight_decay``, instead of
    adding ``weight_decay * p`` to the gradient; everything else is :func:`adam`'s arithmetic.
    The update is returned as the delta ``new_p - p``.

    Args:
      lr: the learning rate, a float or a schedule (a callable of the step count), evaluated at
        the number of steps applied before this one.
      b1: the decay rate of the first moment (torch's ``betas[0]``), in ``[0, 1)``.
      b2: the decay rate of the second moment (torch's ``betas[1]``), in ``[0, 1)``.
      eps: added to the denominator for numerical stability.
      weight_decay: the decoupled decay coefficient (default ``1e-2``, torch's); when non-zero
        ``update`` needs ``params``.
      amsgrad: use the running maximum of the second moment (keeps ``max_exp_avg_sq``).
      maximize: maximize the objective (the gradient is negated).
      moments: ``"fp32"``, ``"bf16"`` or ``"q8"``: how the moments are stored between steps,
        as :func:`adam`'s.

    Returns:
      A ``GradientTransformation`` whose state is an :class:`AdamState`; it is registered with
      the fused kernels (alone or after :func:`ampfunc.clip_by_global_norm` in a ``chain``).

    Example:
      >>> params = {"w": torch.ones(2, 3)}
      >>> grads = {"w": torch.full((2, 3), 0.5)}
      >>> tx = af.adamw(1e-3)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = af.apply_updates(params, updates)
      >>> bool((params["w"] < 1).all())
      True

    Cost: as :func:`adam`: ``init`` allocates two fp32 zero trees like the params (three with
    ``amsgrad``) and a 0-d step; ``update`` runs one fused kernel pass (reads g, p, m, v once,
    writes new updates and moments) when the compiled kernels take the tree, else the generic
    ``torch._foreach`` path with the same arithmetic. No host sync.
    """
    return _make("adamw", lr, b1, b2, eps, weight_decay, amsgrad, maximize, decoupled=True, moments=moments)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """The Adam direction without the learning rate (optax's ``scale_by_adam``).

    For building optimizers by composition:
    ``chain(scale_by_adam(), masked(add_decayed_weights(wd), mask), scale_by_learning_rate(lr))``
    is AdamW with decay on selected leaves only. Per leaf, with ``t`` the new step count:
    ``m = lerp(m, g, 1 - b1)``, ``v = b2 * v + (1 - b2) * g^2``, output
    ``m / (1 - b1^t) / (sqrt(v) / sqrt(1 - b2^t) + eps)`` in fp32. The numbers are close to,
    not bit-identical with, :func:`adamw`'s (a different order of operations, and torch's own
    ``sqrt``).

    Args:
      b1: the decay rate of the first moment, in ``[0, 1)``.
      b2: the decay rate of the second moment, in ``[0, 1)``.
      eps: added to the denominator for numerical stability.

    Returns:
      A ``GradientTransformation`` whose state is an :class:`AdamState` (``max_exp_avg_sq`` is
      ``None``); ``update`` does not need ``params``.

    Example:
      >>> params = {"w": torch.ones(3)}
      >>> grads = {"w": torch.tensor([1.0, -2.0, 0.0])}
      >>> tx = af.optim.scale_by_adam()
      >>> state = tx.init(params)
      >>> direction, state = tx.update(grads, state)
      >>> torch.allclose(direction["w"], torch.tensor([1.0, -1.0, 0.0]))  # first step: ~sign(g)
      True
      >>> opt = af.chain(af.optim.scale_by_adam(), af.optim.scale_by_learning_rate(1e-3))  # Adam, composed

    Cost: ``init`` allocates two fp32 zero trees like the params (one buffer per device each) and
    a 0-d step. ``update`` has no fused kernel: about eight ``torch._foreach`` ops per device
    (each a pass over the moments or the direction), allocating the new moments and the output.
    No host sync.
    """
    _check_hparams("scale_by_adam", 1.0, b1, b2, eps, 0.0)
    b1, b2 = float(b1), float(b2)

    def init(params):
        float_leaves_with_paths(params, "params")
        zeros = lambda: zeros_packed(params, arithmetic_dtype)  # noqa: E731  (one buffer per moment: see zeros_packed)
        return AdamState(torch.zeros((), dtype=torch.float32, device=step_device(params)), zeros(), zeros(), None)

    def update(updates, state, params=None):
        if not isinstance(state, AdamState):
            raise TypeError(f"scale_by_adam: state is {type(state).__name__}, expected AdamState")
        gs, _ = checked_inputs(updates, None, state.exp_avg, "state.exp_avg", "scale_by_adam")
        ms, vs = tree_flatten(state.exp_avg)[0], tree_flatten(state.exp_avg_sq)[0]
        step = state.step + 1
        step64 = step.to(torch.float64)
        inv_bc1_64 = 1 / (1 - torch.pow(b1, step64))
        bc2_sqrt64 = (1 - torch.pow(b2, step64)).sqrt()
        n = len(gs)
        out, new_m, new_v = [None] * n, [None] * n, [None] * n
        for (dev, dt), idx in arithmetic_groups(gs, None, ms).items():
            inv_bc1, bc2_sqrt = inv_bc1_64.to(dt), bc2_sqrt64.to(dt)
            g = as_dtype([gs[i] for i in idx], dt)
            m = torch._foreach_lerp([ms[i] for i in idx], g, 1 - b1)
            v = torch._foreach_mul([vs[i] for i in idx], b2)
            torch._foreach_addcmul_(v, g, g, value=1 - b2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, on(bc2_sqrt, dev))
            torch._foreach_add_(denom, eps)
            direction = torch._foreach_mul(m, on(inv_bc1, dev))
            torch._foreach_div_(direction, denom)
            for j, i in enumerate(idx):
                out[i], new_m[i], new_v[i] = direction[j], m[j], v[j]
        unflat = lambda slot, leaves: tree_unflatten(tree_structure(slot), leaves)  # noqa: E731
        new_state = AdamState(step, unflat(state.exp_avg, new_m), unflat(state.exp_avg_sq, new_v), None)
        return tree_unflatten(tree_structure(updates), out), new_state

    return GradientTransformation(init, update)
