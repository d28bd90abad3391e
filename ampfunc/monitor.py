"""Step statistics of a mixed-precision run: steps, skipped steps, the scale, overflowing leaves.

The hot path is :func:`record`: a pure function of tensors (a few 0-d kernels, no host sync),
so it can run every step, inside ``torch.compile`` or a CUDA graph, next to
``skip_or_apply``::

    stats = af.init_stats()
    for x, y in loader:
        ...
        grads, finite = af.unscale_and_check(grads, ls)
        ...
        ls = af.update_scale(ls, finite)
        stats = af.record(stats, finite, ls)
    for warning in af.health(stats):          # reads the stats back: once, when you log
        print(warning)

:func:`summary`, :func:`health` and :func:`nonfinite_leaves` read values back to the host. They
are diagnostics, meant for logging intervals and for the step that overflowed, not for every
step.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Union

import torch

from ampfunc import ops
from ampfunc.tree import PyTree, leaves_with_paths

__all__ = ["StepStats", "init_stats", "record", "skip_rate", "summary", "health", "nonfinite_leaves"]


class StepStats(NamedTuple):
    """Counters of a run, all 0-d tensors on one device (a pytree: ``torch.save`` it with the state).

    ``steps`` (int64): steps recorded. ``skipped`` (int64): steps whose gradients were not
    finite. ``consecutive_skips`` (int64): skipped steps since the last finite one.
    ``last_scale`` (fp32): the loss scale recorded with the latest step (NaN before any).
    """

    steps: torch.Tensor
    skipped: torch.Tensor
    consecutive_skips: torch.Tensor
    last_scale: torch.Tensor


def init_stats(device: Union[torch.device, str, None] = None) -> StepStats:
    """Zeroed :class:`StepStats` on ``device`` (CPU by default; put them where ``finite`` lives)."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return StepStats(zero, zero.clone(), zero.clone(), torch.full((), math.nan, dtype=torch.float32, device=device))


def _scale_tensor(loss_scale: Any, device: torch.device) -> torch.Tensor:
    scale = getattr(loss_scale, "loss_scale", loss_scale)  # a LossScale object or the scale itself
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"record: loss_scale must be a scalar, got a tensor of shape {tuple(scale.shape)}")
        return scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return torch.tensor(float(scale), dtype=torch.float32, device=device)
    raise TypeError(f"record: loss_scale must be a loss scale, a 0-d tensor or a number, got {type(loss_scale).__name__}")


def record(stats: StepStats, finite: Union[torch.Tensor, bool], loss_scale: Any = 1.0) -> StepStats:
    """The stats after one more step whose gradients were ``finite`` (a 0-d bool tensor).

    ``loss_scale`` is the scale after the step's update (a loss scale object, a 0-d tensor or
    a number); pass ``1.0`` (the default) when training without scaling. Pure: ``stats`` is
    not modified. Cost: a handful of 0-d kernels; no host sync. The new stats live on the
    device of ``finite`` (moved there once if they were elsewhere).
    """
    if not isinstance(stats, StepStats):
        raise TypeError(f"record: stats must be StepStats (from init_stats()), got {type(stats).__name__}")
    if isinstance(finite, bool):
        finite = torch.tensor(finite, device=stats.steps.device)
    if not isinstance(finite, torch.Tensor) or finite.numel() != 1:
        raise ValueError(f"record: finite must be a 0-d bool tensor, got {finite!r}")
    finite = finite.detach().reshape(()).to(torch.bool)
    device = finite.device
    if stats.steps.device != device:
        stats = StepStats(*(t.to(device) for t in stats))
    overflow = (~finite).to(torch.int64)
    return StepStats(
        steps=stats.steps + 1,
        skipped=stats.skipped + overflow,
        consecutive_skips=(stats.consecutive_skips + 1) * overflow,
        last_scale=_scale_tensor(loss_scale, device),
    )


def skip_rate(stats: StepStats) -> torch.Tensor:
    """0-d fp32 tensor: skipped / steps (0 before any step). No host sync."""
    return stats.skipped.to(torch.float32) / stats.steps.clamp(min=1).to(torch.float32)


def summary(stats: StepStats) -> dict:
    """Python numbers for logging: steps, skipped, skip_rate, consecutive_skips, last_scale.

    Reads the stats back to the host (one sync): call it when you log, not every step.
    """
    values = torch.stack([t.to(device="cpu", dtype=torch.float64) for t in stats]).tolist()
    steps, skipped, consecutive, scale = values
    return {
        "steps": int(steps),
        "skipped": int(skipped),
        "skip_rate": skipped / steps if steps else 0.0,
        "consecutive_skips": int(consecutive),
        "last_scale": scale,
    }


def health(stats: StepStats, *, max_skip_rate: float = 0.05, max_consecutive_skips: int = 5,
           min_scale: float = 1.0) -> list[str]:
    """Human-readable warnings about a run; an empty list when nothing looks wrong.

    Warns when the last loss scale is below ``min_scale`` (the scale has collapsed: the
    gradients overflow even unscaled), when more than ``max_skip_rate`` of the steps were
    skipped, and when at least ``max_consecutive_skips`` steps in a row were skipped. Reads
    the stats back to the host (one sync).
    """
    s = summary(stats)
    warnings = []
    if s["steps"] == 0:
        return warnings
    scale = s["last_scale"]
    if not math.isnan(scale) and scale < min_scale:
        warnings.append(
            f"loss scale collapsed to {scale:g} (below {min_scale:g}): gradients overflow even "
            "without scaling; the run is diverging or needs more range (bf16, or fp32 for the "
            "overflowing layers; see nonfinite_leaves)"
        )
    if s["skip_rate"] > max_skip_rate:
        warnings.append(
            f"{s['skip_rate']:.1%} of steps skipped ({s['skipped']} of {s['steps']}), above "
            f"{max_skip_rate:.0%}: the effective number of updates is lower than the step count"
        )
    if s["consecutive_skips"] >= max_consecutive_skips:
        warnings.append(
            f"{s['consecutive_skips']} consecutive skipped steps: no update since; "
            "check the loss and the gradients for inf/nan (nonfinite_leaves)"
        )
    return warnings


def nonfinite_leaves(grads: PyTree) -> list[str]:
    """Paths of the floating tensor leaves of ``grads`` that hold an inf or a NaN.

    A diagnostic for a step that overflowed: it runs ``ops.check(..., per_leaf=True)`` (one
    read pass) and then reads the per-leaf flags back to the host (one sync). Non-floating
    leaves cannot overflow and are not listed.
    """
    pairs = [(p, x) for p, x in leaves_with_paths(grads) if isinstance(x, torch.Tensor) and torch.is_floating_point(x)]
    if not pairs:
        return []
    _, _, bad = ops.check([x for _, x in pairs], per_leaf=True)
    return [path for (path, _), is_bad in zip(pairs, bad.tolist()) if is_bad]


# torch.load(weights_only=True) (the default) accepts stats saved with the training state.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([StepStats])
