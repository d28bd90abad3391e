"""Shared pieces of the optimizer family: learning-rate handling and input checks.

(:class:`~ampfunc.transform.FusedSpec`, the spec a native optimizer registers so that the
engine runs it with the fused kernels, lives in :mod:`ampfunc.transform` beside the registry.)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Union

import torch

from ampfunc.tree import (
    PyTree,
    arithmetic_dtype,
    check_same_structure,
    float_leaves_with_paths,
    leaves_with_paths,
    tree_flatten,
    tree_leaves,
)

__all__ = ["Schedule", "ScalarOrSchedule"]

Schedule = Callable[[torch.Tensor], Union[torch.Tensor, float]]
ScalarOrSchedule = Union[float, Schedule]


_WARNED_LOW_PRECISION: set = set()


def warn_low_precision_params(params: PyTree, where: str) -> None:
    """Warns once per process and optimizer when a param leaf is fp16/bf16.

    Without an fp32 master copy (:func:`ampfunc.mixed_precision` and ``ModuleTrainer`` keep
    one; ``make_train_step`` has the policy's params dtype for its params), updates smaller
    than the param's resolution vanish when added, and in fp16 a finite gradient above ~1e19
    makes Adam's ``exp_avg_sq`` inf for good. torch.optim is silent about both. Cost: one
    flatten of ``params`` at init; nothing per step.
    """
    if where in _WARNED_LOW_PRECISION:
        return
    for path, leaf in leaves_with_paths(params):
        if isinstance(leaf, torch.Tensor) and leaf.dtype in (torch.float16, torch.bfloat16):
            _WARNED_LOW_PRECISION.add(where)
            dtype = str(leaf.dtype).split(".")[-1]
            # The advice names each front-end's own way: make_train_step and ModuleTrainer
            # refuse a mixed_precision wrapper (they run that step themselves).
            warnings.warn(
                f"{where}: params leaf {path!r} is {dtype} and the optimizer keeps no fp32 master copy: "
                f"updates below {dtype}'s resolution are lost and its state may overflow. To keep fp32 "
                "masters: with make_train_step, a policy whose params are fp32 (e.g. \"p=f32,c=bf16\" or "
                "\"p=f32,c=f16\", not \"half\"/\"bf16\"/\"p=bf16\"); with ModuleTrainer, "
                "master_dtype=torch.float32 (the default); in an optax-style loop (tx.init/tx.update), "
                "ampfunc.mixed_precision(tx, loss_scale=...) (warned once)",
                UserWarning, stacklevel=3)
            return


_F32_MAX = float(torch.finfo(torch.float32).max)


def check_lr(lr: Any, where: str) -> None:
    """``ValueError`` for a negative, NaN or infinite float lr, or one beyond fp32's range
    (torch's message); schedules are checked by their constructors, a callable of your own
    passes unchecked."""
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
    if lr > _F32_MAX:  # inf included: the fp32 update would be inf, and NaN where a gradient is 0
        raise ValueError(f"{where}: Invalid learning rate: {lr} (the update runs in fp32, whose largest "
                         f"number is {_F32_MAX:.8g})")


def check_bool(value: Any, name: str, where: str) -> None:
    """``TypeError`` naming the flag unless it is a Python ``bool``: a truthy string or number
    (``amsgrad="yes"``, ``has_aux=1``) would be taken silently, and ``"False"`` reads as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a bool (True or False), got {type(value).__name__} {value!r}")


def check_beta(value: Any, name: str, index: int, where: str) -> None:
    """``b1``/``b2``: a Python float in ``[0, 1)``, refused naming the argument otherwise.

    A pair is torch's ``betas``, which here is two arguments: the message says so (the old
    positional call ``adam(1e-3, (0.9, 0.999))`` lands the pair in ``b1``)."""
    if isinstance(value, (tuple, list)):
        raise TypeError(
            f"{where}: {name} must be a float in [0, 1), got the {type(value).__name__} {value!r}; torch's "
            f"betas=(beta1, beta2) is two arguments here, b1 and b2: {where}(lr, b1=0.9, b2=0.999)")
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a Python float, not a tensor; pass {name}=float(t)")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a float in [0, 1), got {type(value).__name__} {value!r}")
    if not 0.0 <= value < 1.0:  # also rejects NaN
        raise ValueError(f"{where}: {name} must be in [0, 1) (torch's betas[{index}]), got {value!r}")


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
            # Fresh every step: also refuse sparse and meta leaves (params and slots were
            # checked by init), naming the leaf rather than failing inside an op.
            if not all(x.layout is torch.strided and not x.is_meta for x in leaves):
                float_leaves_with_paths(trees[name], f"{where}: {name}")
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


def arithmetic_groups(grads: list, params: list | None, slot: list | None) -> dict:
    """Indices of the leaves grouped by (device, arithmetic dtype), in first-seen order (one
    foreach launch each). A leaf's arithmetic dtype is its state slot's (made by ``init`` with
    :func:`~ampfunc.tree.arithmetic_dtype`), else that of its param, else of its gradient."""
    groups: dict = {}
    for i, g in enumerate(grads):
        dt = slot[i].dtype if slot is not None else arithmetic_dtype((params[i] if params is not None else g).dtype)
        groups.setdefault((g.device, dt), []).append(i)
    return groups


def as_dtype(tensors: list, dtype: torch.dtype) -> list:
    """The tensors in ``dtype`` (no copy for those already in it)."""
    return [t.to(dtype) for t in tensors]
