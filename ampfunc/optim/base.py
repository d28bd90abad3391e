"""Shared pieces of the optimizer family: learning-rate handling and input checks.

(:class:`~ampfunc.transform.FusedSpec`, the spec a native optimizer registers so that the
engine runs it with the fused kernels, lives in :mod:`ampfunc.transform` beside the registry;
it is re-exported here for the optimizer modules.)
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from ampfunc.transform import FusedSpec
from ampfunc.tree import (
    PyTree,
    check_same_structure,
    float_leaves_with_paths,
    leaves_with_paths,
    tree_flatten,
    tree_leaves,
)

__all__ = ["FusedSpec", "Schedule", "ScalarOrSchedule"]

Schedule = Callable[[torch.Tensor], Union[torch.Tensor, float]]
ScalarOrSchedule = Union[float, Schedule]


def check_lr(lr: Any, where: str) -> None:
    """``ValueError`` for a negative/NaN float lr (torch's message); schedules pass unchecked."""
    if callable(lr):
        return
    if isinstance(lr, torch.Tensor):
        raise TypeError(
            f"{where}: lr must be a Python float or a schedule (a callable of the step count), "
            f"not a tensor; wrap it: lr=lambda count: lr_tensor"
        )
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(f"{where}: lr must be a float or a schedule, got {type(lr).__name__}")
    if not lr >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid learning rate: {lr}")


def check_nonneg(value: Any, what: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{what} must be a float, got {type(value).__name__}")
    if not value >= 0.0:
        raise ValueError(f"Invalid {what} value: {value}")


def lr_at(lr: ScalarOrSchedule, count: torch.Tensor) -> Union[float, torch.Tensor]:
    """The learning rate for the step taken when ``count`` steps have been applied.

    A float is returned as is (so the update uses exactly torch's scalar arithmetic); a schedule
    is evaluated on the device and returned as a 0-d float32 tensor. No host sync.
    """
    if not callable(lr):
        return float(lr)
    value = lr(count)
    if not isinstance(value, torch.Tensor):
        return float(value)
    return value.to(device=count.device, dtype=torch.float32).reshape(())


def checked_inputs(grads: PyTree, params: PyTree | None, slot: PyTree | None, slot_name: str,
                   where: str) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Leaves of ``grads`` (and ``params``), after checking them against each other.

    Raises ``ValueError`` naming the leaf path where ``grads``, ``params`` and the state slot
    ``slot`` disagree in structure or shape, and ``TypeError`` naming a non-floating leaf. Costs
    one flatten per tree and a dtype/shape look per leaf; paths are only built to name a fault.
    """
    g, g_spec = tree_flatten(grads)
    trees = {"grads": grads}
    if params is not None:
        trees["params"] = params
    if slot is not None:
        trees[slot_name] = slot
    flat = {"grads": g}
    for name, tree in list(trees.items())[1:]:
        leaves, spec = tree_flatten(tree)
        if spec != g_spec:
            try:
                check_same_structure(grads, tree, "grads", name)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        flat[name] = leaves
    for name, leaves in flat.items():
        if not all(isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves):
            float_leaves_with_paths(trees[name], name)  # raises, naming the leaf and its dtype
        if name == "grads":
            continue
        for i, (gi, xi) in enumerate(zip(g, leaves)):
            if gi.shape != xi.shape:
                path = leaves_with_paths(grads)[i][0]
                raise ValueError(f"{where}: leaf {path!r} has shape {tuple(gi.shape)} in grads "
                                 f"and {tuple(xi.shape)} in {name}")
    return g, flat.get("params")


def step_device(params: PyTree) -> torch.device:
    """Where a transform keeps its 0-d counters: the device of the first leaf (CPU if none)."""
    leaves = [x for x in tree_leaves(params) if isinstance(x, torch.Tensor)]
    return leaves[0].device if leaves else torch.device("cpu")


def on(x: Any, device: torch.device) -> Any:
    """``x`` on ``device`` when it is a tensor elsewhere (0-d scalars; non-blocking)."""
    if isinstance(x, torch.Tensor) and x.device != device:
        return x.to(device, non_blocking=True)
    return x


def device_groups(tensors: list) -> dict:
    """Indices of ``tensors`` grouped by device, in first-seen order (one foreach launch each)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups


def as_fp32(tensors: list) -> list:
    """The tensors in fp32 (no copy for those already fp32)."""
    return [t.to(torch.float32) for t in tensors]
