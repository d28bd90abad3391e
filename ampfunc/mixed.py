"""The five mixed-precision primitives and the composed :func:`mixed_precision` transform.

The primitives, in the order a step uses them::

    p = af.cast_params(params, torch.float16, keep=af.norm_layers(model))   # (policy.py)
    loss = af.scale_loss(loss, ls)                  # loss.float() * scale
    grads, finite = af.unscale_and_check(grads, ls) # fp32 grads / scale, 0-d bool flag
    new = af.skip_or_apply(finite, new, old)        # per leaf new if finite else old
    ls = af.update_scale(ls, finite)                # the next loss scale

All are pure (inputs untouched, new tensors out) and none reads a tensor back to the host,
so a step built from them can be captured in a CUDA graph or compiled with
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from ampfunc import ops
from ampfunc.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from ampfunc.transform import GradientTransformation, apply_updates
from ampfunc.tree import (
    PyTree,
    check_same_structure,
    float_leaves_with_paths,
    select_tree,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
    register_state_classes,
    aligned_leaves,
)

__all__ = [
    "scale_loss",
    "unscale",
    "unscale_and_check",
    "skip_or_apply",
    "update_scale",
    "unscale_and_check_",
    "skip_or_apply_",
    "update_scale_",
    "agree_finite",
    "MixedPrecisionState",
    "MixedPrecision",
    "mixed_precision",
    "loss_scale_of",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_loss_scale(ls, where: str):
    if not isinstance(ls, LossScale):
        raise TypeError(f"{where}: expected a loss scale (NoOpLossScale, StaticLossScale or DynamicLossScale), "
                        f"got {type(ls).__name__}")


def scale_loss(loss: torch.Tensor, ls: LossScale) -> torch.Tensor:
    """``loss.float() * ls.loss_scale`` (the loss unchanged for :class:`NoOpLossScale`).

    ``loss`` must be a scalar floating tensor; a non-scalar loss raises ``ValueError``.
    """
    _check_loss_scale(ls, "scale_loss")
    return ls.scale(loss)


def unscale(tree: PyTree, ls: LossScale) -> PyTree:
    """Every floating leaf of ``tree`` in fp32 divided by the loss scale, with no finiteness check.

    For quantities computed from the scaled loss outside the optimizer step: gradient
    penalties (``torch.autograd.grad`` of the scaled loss), per-loss gradients. One read, one
    fp32 write per leaf.
    """
    _check_loss_scale(ls, "unscale")
    return ls.unscale(tree)


def agree_finite(finite: torch.Tensor, group) -> torch.Tensor:
    """``finite`` and-reduced over the ranks of ``group`` (an all-reduce MAX of the overflow flag).

    Runs on the device as a collective: no host sync. Every rank gets the same flag, so every
    rank skips the same steps and its loss scale stays identical.
    """
    import torch.distributed as dist

    overflow = (~finite).to(torch.float32)
    dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)
    return overflow == 0


def unscale_and_check(grads: PyTree, ls: LossScale, *, group=None) -> tuple[PyTree, torch.Tensor]:
    """``(grads_fp32 / scale, finite)``.

    ``grads`` may hold fp32, fp16 or bf16 leaves (``None`` entries stay ``None``); every result
    leaf is a new fp32 tensor (with :class:`NoOpLossScale`, fp32 leaves are passed through as
    they are: there is nothing to divide). ``finite`` is a 0-d bool tensor on the device of the first leaf:
    ``True`` when every gradient element was finite. With ``group`` (a ``torch.distributed``
    process group) every rank agrees on ``finite``. Costs one read of the gradients and one fp32
    write; no host sync. A non-floating leaf raises ``TypeError`` naming its path.
    """
    _check_loss_scale(ls, "unscale_and_check")
    out, finite = ls.unscale_and_check(grads, "unscale_and_check: grads")
    if group is not None:
        finite = agree_finite(finite, group)
    return out, finite


def skip_or_apply(finite: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """Per leaf ``new if finite else old``, chosen on the device (``torch.where``).

    Works on any pytrees of identical structure: params, optimizer states, loss scales, or a
    tuple of them. A skipped step (``finite`` False) returns values bit-identical to ``old``.
    One read of both trees and one write.
    """
    return select_tree(finite, new, old)


def update_scale(ls, finite):
    """The loss scale for the next step (``ls.adjust(finite)``).

    ``ls`` may also be a dict or list of loss scales, one per loss (apex's ``num_losses``), with
    ``finite`` either one flag for all or a matching dict/list of flags.
    """
    if isinstance(ls, Mapping):
        flags = finite if isinstance(finite, Mapping) else {k: finite for k in ls}
        return {k: update_scale(v, flags[k]) for k, v in ls.items()}
    if isinstance(ls, (list, tuple)):
        flags = finite if isinstance(finite, (list, tuple)) else [finite] * len(ls)
        return type(ls)(update_scale(v, f) for v, f in zip(ls, flags))
    _check_loss_scale(ls, "update_scale")
    return ls.adjust(finite)


# ----------------------------------------------------------------------------------------------
# In-place twins: the same numbers, written into the given tensors (the donating fast path)
# ----------------------------------------------------------------------------------------------


def unscale_and_check_(grads: PyTree, ls: LossScale, *, group=None) -> tuple[PyTree, torch.Tensor]:
    """In-place :func:`unscale_and_check`: each gradient is multiplied by ``1/scale`` where it is.

    The product is taken in fp32 and stored in the gradient's own dtype, so fp32 gradients get
    exactly the values of the pure version; bf16 gradients are rounded back to bf16. fp16
    gradients are refused (``TypeError`` naming the leaf), as ``GradScaler.unscale_`` refuses
    them: dividing in place in fp16 loses the small values loss scaling exists to keep. Returns
    ``(grads, finite)`` with ``grads`` the same tree. One read and one write, no allocation.
    """
    _check_loss_scale(ls, "unscale_and_check_")
    paths, leaves = float_leaves_with_paths(grads, "unscale_and_check_: grads")
    for path, leaf in zip(paths, leaves):
        if leaf.dtype == torch.float16:
            raise TypeError(f"unscale_and_check_: grads leaf {path!r} is float16; unscaling fp16 in place "
                            "loses precision -- use the pure unscale_and_check (fp32 out)")
    if isinstance(ls, NoOpLossScale):
        finite = ops.all_finite(leaves)
    else:
        device = leaves[0].device if leaves else ls.loss_scale.device
        finite = ops.unscale_(leaves, ls.inv_scale_on(device))
    if group is not None:
        finite = agree_finite(finite, group)
    return grads, finite


def skip_or_apply_(finite: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """In-place :func:`skip_or_apply`: ``old`` is overwritten with ``new`` when ``finite``.

    Returns ``old`` (the same tensors). On the device, no host sync; one read of both trees and
    one write of ``old``.
    """
    chosen = skip_or_apply(finite, new, old)
    for dst, src in zip(tree_leaves(old), tree_leaves(chosen)):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    return old


def update_scale_(ls, finite):
    """In-place :func:`update_scale`: a :class:`DynamicLossScale`'s tensors are overwritten
    (static and no-op scales have nothing to update). Returns ``ls``."""
    if isinstance(ls, Mapping):
        flags = finite if isinstance(finite, Mapping) else {k: finite for k in ls}
        for k, v in ls.items():
            update_scale_(v, flags[k])
        return ls
    _check_loss_scale(ls, "update_scale_")
    if isinstance(ls, DynamicLossScale):
        ls.adjust_(finite)
    return ls


# ----------------------------------------------------------------------------------------------
# The composed transform
# ----------------------------------------------------------------------------------------------


class MixedPrecisionState(NamedTuple):
    """``master``: fp32 copy of the params when any is fp16/bf16, else ``None``;
    ``inner``: the inner optimizer's state; ``loss_scale``: the scale for the next loss."""

    master: Any
    inner: Any
    loss_scale: LossScale


register_state_classes(MixedPrecisionState)


class MixedPrecision(NamedTuple):
    """A mixed-precision transform: optax's ``init``/``update`` plus whole-step helpers.

    * ``init(params) -> state``
    * ``update(grads, state, params) -> (updates, state)``: pure; ``apply_updates(params,
      updates)`` gives the new params.
    * ``step(params, grads, state) -> (params, state)``: pure; the new params directly (for
      fp16/bf16 params, exactly the cast of the fp32 master).
    * ``step_(params, grads, state) -> (params, state)``: the same numbers, computed in place:
      ``params`` and ``state`` are donated (their tensors are overwritten and returned).

    ``grads`` are the gradients of the *scaled* loss (``scale_loss(loss, loss_scale_of(state))``).
    """

    init: Callable
    update: Callable
    step: Callable
    step_: Callable
    inner: GradientTransformation


def _needs_master(params: PyTree, master_dtype: torch.dtype) -> bool:
    return any(p.dtype != master_dtype for p in tree_leaves(params))


def _first_device(tree: PyTree) -> torch.device:
    leaves = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]
    return leaves[0].device if leaves else torch.device("cpu")


def _copy_into(dst: PyTree, src: PyTree) -> None:
    for d, s in zip(tree_leaves(dst), tree_leaves(src)):
        if isinstance(d, torch.Tensor) and d is not s:
            d.copy_(s)


def mixed_precision(inner: GradientTransformation, loss_scale: LossScale | None = None,
                    master_dtype: torch.dtype = torch.float32, *, group=None) -> MixedPrecision:
    """Wraps ``inner`` (any optimizer transform) into a whole mixed-precision step.

    One step: unscale the gradients of the scaled loss and check them (one pass), run ``inner``
    on fp32 gradients against the fp32 master params, keep the old params/state on the device
    if any gradient was not finite, and advance the loss scale. When the params are fp16/bf16 an
    fp32 master copy lives in the state (apex ``FP16_Optimizer`` / amp O2) and the params handed
    back are the master cast to each param's dtype. ``group`` makes all ranks of a process group
    agree on skipping. ``loss_scale`` defaults to ``DynamicLossScale()``.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"mixed_precision: inner must be a GradientTransformation, got {type(inner).__name__}")
    if loss_scale is None:
        loss_scale = DynamicLossScale()
    _check_loss_scale(loss_scale, "mixed_precision")
    if not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
        raise ValueError(f"mixed_precision: master_dtype must be a floating dtype, got {master_dtype!r}")
    fused_plan = _fused_plan(inner)

    def init(params):
        float_leaves_with_paths(params, "mixed_precision.init: params")
        master = None
        if _needs_master(params, master_dtype):
            master = tree_map(lambda p: p.detach().to(master_dtype, copy=True), params)
        inner_state = inner.init(master if master is not None else params)
        return MixedPrecisionState(master, inner_state, loss_scale.to(_first_device(params)))

    def _check(params, grads, state, where):
        _check_state(state, where)
        check_same_structure(grads, params, "grads", "params")
        if state.master is not None:
            check_same_structure(state.master, params, "state.master", "params")

    def _generic(params, grads, state):
        """(new reference params, new inner state, finite, new loss scale); pure."""
        grads32, finite = unscale_and_check(grads, state.loss_scale, group=group)
        ref = state.master if state.master is not None else params
        updates, new_inner = inner.update(grads32, state.inner, ref)
        new_ref = apply_updates(ref, updates)
        new_ref, new_inner = skip_or_apply(finite, (new_ref, new_inner), (ref, state.inner))
        return new_ref, new_inner, finite, update_scale(state.loss_scale, finite)

    def step(params, grads, state):
        _check(params, grads, state, "mixed_precision.step")
        if fused_plan is not None:
            # Out of place in one optimizer pass (new tensors, inputs untouched); None when the
            # kernels cannot run these trees.
            out = fused_plan.step(params, grads, state, group=group)
            if out is not None:
                return out
        new_ref, new_inner, _, new_ls = _generic(params, grads, state)
        if state.master is None:
            return new_ref, MixedPrecisionState(None, new_inner, new_ls)
        new_params = tree_map(lambda m, p: m.to(p.dtype), new_ref, params)
        return new_params, MixedPrecisionState(new_ref, new_inner, new_ls)

    def update(grads, state, params):
        if params is None:
            raise ValueError("mixed_precision.update needs params (the master copy and the skip depend on them)")
        new_params, new_state = step(params, grads, state)
        # Deltas in fp32: apply_updates adds them in fp32 and rounds once to each param's dtype.
        updates = tree_map(lambda n, p: n.to(torch.float32) - p.to(torch.float32), new_params, params)
        return updates, new_state

    def step_(params, grads, state):
        if fused_plan is not None:
            _check_state(state, "mixed_precision.step_")
            slot_trees = fused_plan.slot_trees(state)  # None: the inner state is not the kernel's layout
            masters = [state.master] if state.master is not None else []
            # Every list handed to the kernel must share one leaf order: the cheap dict-values
            # order when all the trees allow it (and then their structures agree), else optree's,
            # flattening each tree once (a 10,000-leaf dict costs milliseconds per flatten).
            leaves = aligned_leaves([params, grads] + masters + (slot_trees or []))
            if leaves is not None:
                p, g, m, slots = leaves[0], leaves[1], (leaves[2] if masters else None), leaves[2 + len(masters):]
            else:
                (p, g, m), slots = _flat_checked(params, grads, state, "mixed_precision.step_"), None
            if slot_trees is not None and fused_plan.supports_leaves(p, m, state):
                if slots is None:
                    slots = [tree_leaves(t) for t in slot_trees]
                fused_plan.step_leaves_(p, g, m, slots, state, group=group)
                return params, state
        _check(params, grads, state, "mixed_precision.step_")
        new_params, new_state = step(params, grads, state)
        _copy_into(params, new_params)
        _copy_into(state, new_state)
        return params, state

    return MixedPrecision(init, update, step, step_, inner)


def _check_state(state, where):
    if not isinstance(state, MixedPrecisionState):
        raise TypeError(f"{where}: state must be the MixedPrecisionState from init, got {type(state).__name__}")


def _flat_checked(params, grads, state, where):
    """``(params, grads, master)`` leaf lists, one optree flatten per tree; mismatches name the leaf."""
    _check_state(state, where)
    p, p_spec = tree_flatten(params)
    g, g_spec = tree_flatten(grads)
    if g_spec != p_spec:
        check_same_structure(grads, params, "grads", "params")
    m = None
    if state.master is not None:
        m, m_spec = tree_flatten(state.master)
        if m_spec != p_spec:
            check_same_structure(state.master, params, "state.master", "params")
    return p, g, m


def _fused_plan(inner: GradientTransformation):
    """The fused kernel plan for ``inner`` (see ``ampfunc.fused``), or None for the generic path."""
    from ampfunc import fused  # imported late: fused builds on ops and the optimizer specs

    return fused.plan_for(inner)


def loss_scale_of(state: Any) -> LossScale:
    """The loss scale held in a (possibly nested) state: the scale to use for the next loss."""
    if isinstance(state, MixedPrecisionState):
        return state.loss_scale
    if isinstance(state, LossScale):
        return state
    children = state.values() if isinstance(state, Mapping) else state if isinstance(state, (tuple, list)) else ()
    for child in children:
        try:
            return loss_scale_of(child)
        except ValueError:
            continue
    raise ValueError(f"loss_scale_of: no MixedPrecisionState or loss scale found in {type(state).__name__}")
