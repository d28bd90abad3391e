"""Gradient clipping by global norm, as ``torch.nn.utils.clip_grad_norm_`` computes it."""

from __future__ import annotations

import math

import torch

from ampfunc import ops
from ampfunc.optim.base import FusedSpec, device_groups
from ampfunc.transform import EmptyState, GradientTransformation
from ampfunc.tree import float_leaves_with_paths, tree_structure, tree_unflatten

__all__ = ["clip_by_global_norm", "global_norm"]


def global_norm(tree) -> torch.Tensor:
    """0-d fp32 L2 norm of all leaves of ``tree`` together (accumulated in fp32 whatever the leaf
    dtype, so fp16 grads do not overflow it). One read pass; no host sync."""
    _, leaves = float_leaves_with_paths(tree, "tree")
    _, sumsq = ops.check(leaves)
    return sumsq.sqrt()


def clip_by_global_norm(max_norm: float, *, group=None) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` their global L2 norm.

    With ``group`` (a ``torch.distributed`` process group) the updates are taken to be shards
    (FSDP2 DTensors, or local shards of tensors sharded over ``group``) and the norm is the
    all-reduced norm of the whole tensors: this is :func:`ampfunc.dist.clip_by_global_norm`,
    which runs on the generic path (its norm needs a collective between the two kernel passes).

    The coefficient is ``clip_grad_norm_``'s (norm over every leaf, ``1e-6`` added, clamped at
    1), computed and applied on the device: no host sync. A non-finite gradient makes the norm
    non-finite and the result NaN, as in torch; ``mixed_precision`` skips such a step.
    Updates keep their dtype. Stateless (:class:`EmptyState`). Cost: one read pass for the norm,
    one read and one write for the scaling (the fused path folds both into the optimizer pass).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm) or max_norm <= 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be a positive number, got {max_norm!r}")
    max_norm = float(max_norm)
    if group is not None:
        from ampfunc import dist  # late: dist builds on the optimizer package

        return dist.clip_by_global_norm(max_norm, group)

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        _, leaves = float_leaves_with_paths(updates, "updates")
        if not leaves:
            return updates, state
        _, sumsq = ops.check(leaves)
        coef = (max_norm / (sumsq.sqrt() + 1e-6)).clamp(max=1.0)
        out: list = [None] * len(leaves)
        for dev, idx in device_groups(leaves).items():
            c = coef if coef.device == dev else coef.to(dev, non_blocking=True)
            # a 0-d fp32 factor keeps each update's dtype
            for i, u in zip(idx, torch._foreach_mul([leaves[i] for i in idx], c)):
                out[i] = u
        return tree_unflatten(tree_structure(updates), out), state

    return GradientTransformation(init, update, FusedSpec("clip_by_global_norm", {"max_norm": max_norm}))
