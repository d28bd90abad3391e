"""Gradient clipping by global norm, as ``torch.nn.utils.clip_grad_norm_`` computes it.

One name per concept: :func:`global_norm` and :func:`clip_by_global_norm` serve single-process,
DDP and sharded (FSDP2 DTensor, or local shards with ``group``) training alike.
"""

from __future__ import annotations

import math

import torch

from ampfunc import dist, ops, shards
from ampfunc.optim.base import device_groups
from ampfunc.transform import EmptyState, FusedSpec, GradientTransformation, register_kernel
from ampfunc.tree import float_leaves_with_paths, tree_structure, tree_unflatten

__all__ = ["clip_by_global_norm", "global_norm"]


def global_norm(tree, group=None) -> torch.Tensor:
    """The L2 norm of all leaves of ``tree`` together, accumulated in fp32.

    Args:
      tree: a pytree of floating tensors (fp16/bf16 leaves do not overflow the fp32 sum).
        DTensor leaves count as whole tensors (their shards' sums are all-reduced over the mesh
        dimensions they are sharded on).
      group: a ``torch.distributed`` process group over which plain leaves are *local shards*
        of tensors sharded over it (their sums of squares are all-reduced); None for a
        single process or replicated (DDP) gradients.

    Returns:
      A 0-d fp32 tensor on the leaves' device.

    Example:
      >>> grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
      >>> af.optim.global_norm(grads).item()
      5.0
      >>> af.optim.global_norm({"x": torch.full((4,), 300.0, dtype=torch.float16)}).item()  # fp32 sum
      600.0

    Cost: one read pass, no writes (plus one all-reduce of one float with ``group`` or
    DTensors); no host sync.
    """
    _, leaves = float_leaves_with_paths(tree, "tree")
    if group is None and shards.active() is not None:  # inside a step on DTensors' local shards
        return shards.active().reduce(None, leaves)[1]
    if group is not None or dist.any_dtensor(leaves):
        return dist.sharded_global_norm(tree, group)
    # check_norm: squares summed so that the sum cannot overflow while every value is finite.
    return ops.check_norm(leaves)[1]


def clip_by_global_norm(max_norm: float, *, group=None) -> GradientTransformation:
    """Scales all updates by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` their global L2 norm.

    The coefficient is ``clip_grad_norm_``'s (norm over every leaf, ``1e-6`` added, clamped at
    1), computed and applied on the device. A non-finite gradient makes the norm non-finite and
    the result NaN, as in torch; ``mixed_precision`` skips such a step. Updates keep their dtype.

    Args:
      max_norm: the threshold, a positive number.
      group: with a ``torch.distributed`` process group the updates are taken to be local
        shards of tensors sharded over ``group`` and the norm is all-reduced over it (see
        :func:`global_norm`); DTensor leaves are handled with or without it. A transform with
        ``group`` runs on the generic path (a collective sits between the norm and the update).

    Returns:
      A stateless (:class:`~ampfunc.transform.EmptyState`) ``GradientTransformation``; without ``group``
      it is registered with the fused kernels, which fold the scaling into the optimizer pass
      when it precedes ``sgd``/``adam``/``adamw`` in a ``chain``.

    Example:
      >>> grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}  # norm 5
      >>> tx = af.clip_by_global_norm(1.0)
      >>> state = tx.init(grads)
      >>> clipped, state = tx.update(grads, state)
      >>> round(af.optim.global_norm(clipped).item(), 4)
      1.0
      >>> opt = af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3))  # fused under mixed_precision

    Cost: ``init`` allocates nothing. ``update``: one read pass for the norm, then one read and
    one write (new tensors) for the scaling; inside :func:`ampfunc.mixed_precision`,
    ``make_train_step`` and ``ModuleTrainer`` the fused kernels take the norm in their
    finiteness-check pass and fold the scaling into the optimizer pass. No host sync.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm) or max_norm <= 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be a positive number, got {max_norm!r}")
    max_norm = float(max_norm)

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        _, leaves = float_leaves_with_paths(updates, "clip_by_global_norm: updates")
        if not leaves:
            return updates, state
        sharding = shards.active() if group is None else None
        if group is not None or sharding is not None or dist.any_dtensor(leaves):
            # local shards inside a step on DTensors: the norm of the whole tensors (ampfunc.shards)
            norm = sharding.reduce(None, leaves)[1] if sharding is not None else \
                dist.sharded_global_norm(updates, group)
            return dist.scale_tree(updates, (max_norm / (norm + 1e-6)).clamp(max=1.0)), state
        _, norm = ops.check_norm(leaves)  # cannot overflow while every element is finite
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        out: list = [None] * len(leaves)
        for dev, idx in device_groups(leaves).items():
            c = coef if coef.device == dev else coef.to(dev, non_blocking=True)
            # a 0-d fp32 factor keeps each update's dtype
            for i, u in zip(idx, torch._foreach_mul([leaves[i] for i in idx], c)):
                out[i] = u
        return tree_unflatten(tree_structure(updates), out), state

    tx = GradientTransformation(init, update)
    if group is None:
        register_kernel(tx, FusedSpec("clip_by_global_norm", {"max_norm": max_norm}))
    return tx
