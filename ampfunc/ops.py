"""The one door to the tensor work of mixed precision.

Every primitive in ampfunc calls these functions for its arithmetic over lists of tensors.
Each function here has a plain-torch reference implementation (``_ref_*``), built from
``torch._foreach_*`` and ``torch._amp_foreach_non_finite_check_and_unscale_`` so that even the
reference is one launch per (device, dtype) group rather than one per leaf. The compiled
extension in ``ext/`` (when built) serves the same functions with fused kernels; the results are
the same bit for bit where the reference's arithmetic order allows it.

No function here reads a tensor value back to the host.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "backend",
    "all_finite",
    "check",
    "unscale",
    "unscale_",
    "update_scale",
    "update_scale_",
]


def backend() -> str:
    """Which implementation serves the ops: ``"reference"`` (plain torch) for now."""
    return "reference"


def _flag_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Read-only checks
# ----------------------------------------------------------------------------------------------


def _ref_all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    dev = _flag_device(tensors)
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=dev)
    flags = []
    for group in _groups(tensors).values():
        # max |x| is finite iff every element is; NaN propagates through amax.
        maxes = torch._foreach_norm(group, float("inf"))
        flags.append(torch.stack([m.to(torch.float32) for m in maxes]).to(dev).isfinite().all())
    return torch.stack(flags).all()


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-d bool: every element of every tensor is finite. One read pass, no writes."""
    return _ref_all_finite(list(tensors))


def _ref_check(tensors: Sequence[torch.Tensor], per_leaf: bool = False):
    tensors = list(tensors)
    dev = _flag_device(tensors)
    if not tensors:
        finite = torch.ones((), dtype=torch.bool, device=dev)
        sumsq = torch.zeros((), dtype=torch.float32, device=dev)
        return (finite, sumsq, torch.zeros(0, dtype=torch.bool, device=dev)) if per_leaf else (finite, sumsq)
    maxabs = [None] * len(tensors)
    norms = [None] * len(tensors)
    for idx in _groups_idx(tensors).values():
        group = [tensors[i] for i in idx]
        for i, m, n in zip(idx, torch._foreach_norm(group, float("inf")), torch._foreach_norm(group, 2, dtype=torch.float32)):
            maxabs[i] = m.to(torch.float32).to(dev)
            norms[i] = n.to(dev)
    leaf_finite = torch.stack(maxabs).isfinite()
    finite = leaf_finite.all()
    sumsq = torch.stack(norms).square().sum()
    if per_leaf:
        return finite, sumsq, ~leaf_finite
    return finite, sumsq


def check(tensors: Sequence[torch.Tensor], per_leaf: bool = False):
    """``(finite, sumsq)``: 0-d bool (all elements finite) and 0-d fp32 sum of squares.

    One read-only pass over the tensors (the reference makes two). With ``per_leaf=True`` a
    third result is a bool vector, ``True`` where that tensor holds a non-finite value.
    ``sumsq`` is accumulated in fp32 whatever the input dtype.
    """
    return _ref_check(tensors, per_leaf)


# ----------------------------------------------------------------------------------------------
# Unscale
# ----------------------------------------------------------------------------------------------


def _ref_unscale(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor):
    tensors = list(tensors)
    dev = _flag_device(tensors)
    found_inf = torch.zeros((), dtype=torch.float32, device=dev)
    outs = [t.to(torch.float32, copy=True) for t in tensors]
    for idx in _groups_idx(outs).values():
        group = [outs[i] for i in idx]
        d = group[0].device
        fi = found_inf if d == dev else torch.zeros((), dtype=torch.float32, device=d)
        torch._amp_foreach_non_finite_check_and_unscale_(group, fi, inv_scale.to(d, torch.float32))
        if fi is not found_inf:
            found_inf = found_inf + fi.to(dev)
    return outs, found_inf == 0


def unscale(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor):
    """``(outs, finite)``: new fp32 tensors ``t * inv_scale`` and a 0-d bool flag.

    The product is taken in fp32 (as ``torch.amp.GradScaler`` does); finiteness is judged on
    the inputs. One read of the inputs and one fp32 write.
    """
    return _ref_unscale(tensors, inv_scale)


def _ref_unscale_(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    tensors = list(tensors)
    dev = _flag_device(tensors)
    found_inf = torch.zeros((), dtype=torch.float32, device=dev)
    for idx in _groups_idx(tensors).values():
        group = [tensors[i] for i in idx]
        d = group[0].device
        fi = found_inf if d == dev else torch.zeros((), dtype=torch.float32, device=d)
        torch._amp_foreach_non_finite_check_and_unscale_(group, fi, inv_scale.to(d, torch.float32))
        if fi is not found_inf:
            found_inf = found_inf + fi.to(dev)
    return found_inf == 0


def unscale_(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """In place ``t *= inv_scale`` (product in fp32, stored in ``t``'s dtype); returns ``finite``."""
    return _ref_unscale_(tensors, inv_scale)


# ----------------------------------------------------------------------------------------------
# Loss-scale update
# ----------------------------------------------------------------------------------------------


def _ref_update_scale(scale, growth_tracker, hysteresis_tracker, finite, *, growth_factor, backoff_factor,
                      growth_interval, min_scale, max_scale, hysteresis):
    finite = finite.to(device=scale.device, dtype=torch.bool).reshape(())
    s64 = scale.to(torch.float64)
    # torch.amp rounding: products in double, stored in fp32; a growth that overflows fp32
    # is not applied (the tracker still resets).
    grown = (s64 * growth_factor).to(torch.float32)
    grown = torch.where(grown.isfinite(), grown.clamp(max=max_scale), scale)
    backed = (s64 * backoff_factor).to(torch.float32).clamp(min=min_scale)
    next_tracker = growth_tracker + 1
    grow = finite & (next_tracker >= growth_interval)
    backoff = (~finite) & (hysteresis_tracker <= 1)
    new_scale = torch.where(grow, grown, torch.where(backoff, backed, scale))
    zero = torch.zeros_like(growth_tracker)
    new_tracker = torch.where(finite & ~grow, next_tracker, zero)
    new_hyst = torch.where(finite, torch.full_like(hysteresis_tracker, hysteresis),
                           (hysteresis_tracker - 1).clamp(min=1))
    return new_scale, new_tracker, new_hyst


def update_scale(scale, growth_tracker, hysteresis_tracker, finite, *, growth_factor, backoff_factor,
                 growth_interval, min_scale, max_scale, hysteresis):
    """The next ``(scale, growth_tracker, hysteresis_tracker)`` of a dynamic loss scale.

    On a finite step the hysteresis counter refills and the tracker counts up; when it
    reaches ``growth_interval`` the scale is multiplied by ``growth_factor`` (capped at
    ``max_scale``, not applied when it would overflow fp32) and the tracker resets. On a
    non-finite step the tracker resets and the counter counts down; when it is exhausted the
    scale is multiplied by ``backoff_factor`` (floored at ``min_scale``). All on the device:
    a handful of 0-d kernels, no host sync.
    """
    return _ref_update_scale(scale, growth_tracker, hysteresis_tracker, finite, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval,
                             min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis)


def update_scale_(scale, growth_tracker, hysteresis_tracker, finite, **config) -> None:
    """In-place :func:`update_scale` (the three state tensors are overwritten)."""
    s, g, h = update_scale(scale, growth_tracker, hysteresis_tracker, finite, **config)
    scale.copy_(s)
    growth_tracker.copy_(g)
    hysteresis_tracker.copy_(h)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _groups_idx(tensors: Sequence[torch.Tensor]) -> dict:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _groups(tensors: Sequence[torch.Tensor]) -> dict:
    return {k: [tensors[i] for i in idx] for k, idx in _groups_idx(tensors).items()}
