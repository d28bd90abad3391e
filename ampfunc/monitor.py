"""Step statistics of a mixed-precision run: steps, skipped steps, the scale, overflowing leaves.

The hot path is :func:`record`: a pure function of tensors (a few 0-d kernels, no host sync),
so it can run every step, inside ``torch.compile`` or a CUDA graph, next to
``skip_or_apply``::

    stats = af.monitor.init_stats()
    for x, y in loader:
        ...
        grads, finite = af.unscale_and_check(grads, ls)
        ...
        ls = af.update_scale(ls, finite)
        stats = af.monitor.record(stats, finite, ls)
    for warning in af.monitor.health(stats):          # reads the stats back: once, when you log
        print(warning)

:func:`summary`, :func:`health` and :func:`nonfinite_paths` read values back to the host. They
are diagnostics, meant for logging intervals and for the step that overflowed, not for every
step.

:class:`TrainingMonitor` is the fuller picture, an immutable pytree updated the same way: a
window of loss, scale and skip history kept on the device, per-leaf overflow counts (which
parameters produce the infs), the scaler statistics, and health alerts returned as a dict::

    mon = af.TrainingMonitor(params, window=100)
    ...
    mon = mon.record(finite, ls, loss=loss, leaf_nonfinite=af.monitor.leaf_nonfinite(grads))
    if step % 100 == 0:
        print(mon.check_health())   # {"status": "healthy", "alerts": [], ...}; one sync
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, NamedTuple, Optional, Union

import optree
import torch
import torch.distributed as torch_dist
import torch.utils._pytree as torch_pytree

from ampfunc import ops
from ampfunc.lowmem import Q8Moment
from ampfunc.tree import NAMESPACE, PyTree, leaves_with_paths, path_to_str

__all__ = ["StepStats", "init_stats", "record", "skip_rate", "summary", "health", "nonfinite_paths",
           "moment_overflows", "TrainingMonitor", "MonitorConfig", "leaf_nonfinite", "LeafFlagsHook"]


class StepStats(NamedTuple):
    """Counters of a run, all 0-d tensors on one device (a pytree: ``torch.save`` it with the state).

    Made by :func:`init_stats`, advanced by :func:`record`.

    Attributes:
      steps: int64, steps recorded.
      skipped: int64, steps whose gradients were not finite.
      consecutive_skips: int64, skipped steps since the last finite one.
      last_scale: fp32, the loss scale recorded with the latest step (NaN before any).

    Example:
      >>> stats = af.monitor.record(af.monitor.init_stats(), torch.tensor(False), 1024.0)
      >>> int(stats.steps), int(stats.skipped), int(stats.consecutive_skips), float(stats.last_scale)
      (1, 1, 1, 1024.0)
    """

    steps: torch.Tensor
    skipped: torch.Tensor
    consecutive_skips: torch.Tensor
    last_scale: torch.Tensor


def init_stats(device: Union[torch.device, str, None] = None) -> StepStats:
    """Zeroed :class:`StepStats`: no step recorded yet.

    Args:
      device: where the counters live (default: the default device, CPU unless changed); put
        them where ``finite`` lives, or :func:`record` moves them there.

    Returns:
      :class:`StepStats` with ``steps``, ``skipped`` and ``consecutive_skips`` 0 and
      ``last_scale`` NaN.

    Example:
      >>> stats = af.monitor.init_stats()
      >>> int(stats.steps), float(stats.last_scale)
      (0, nan)

    Cost: four 0-d tensors allocated and filled; no host sync.
    """
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
    raise TypeError("record: loss_scale must be a loss scale, a 0-d tensor or a number, "
                    f"got {type(loss_scale).__name__}")


def record(stats: StepStats, finite: Union[torch.Tensor, bool], loss_scale: Any = 1.0) -> StepStats:
    """The stats after one more step whose gradients were ``finite``.

    Pure: ``stats`` is not modified. The new stats live on the device of ``finite`` (moved
    there if they were elsewhere).

    Args:
      stats: the :class:`StepStats` so far.
      finite: the step's flag, a one-element bool tensor or a Python ``bool`` (a float or
        integer flag is refused: a NaN would read as True).
      loss_scale: the scale after the step's update (a loss scale object, a one-element tensor
        or a number); ``1.0`` (the default) when training without scaling.

    Returns:
      New :class:`StepStats`.

    Example:
      >>> ls, stats = af.DynamicLossScale(), af.monitor.init_stats()
      >>> for ok in (True, False, False):
      ...     ls = af.update_scale(ls, torch.tensor(ok))
      ...     stats = af.monitor.record(stats, torch.tensor(ok), ls)
      >>> int(stats.skipped), int(stats.consecutive_skips), float(stats.last_scale)
      (2, 2, 16384.0)

    Cost: about six 0-d kernels; a number ``loss_scale`` becomes a new 0-d tensor (a
    host-to-device copy off the CPU). No host sync.
    """
    if not isinstance(stats, StepStats):
        raise TypeError(f"record: stats must be StepStats (from init_stats()), got {type(stats).__name__}")
    if isinstance(finite, bool):
        finite = torch.tensor(finite, device=stats.steps.device)
    if not isinstance(finite, torch.Tensor) or finite.numel() != 1 or finite.dtype != torch.bool:
        # A float flag would read NaN as True: the flags of ampfunc's steps are bool tensors.
        raise ValueError(f"record: finite must be a 0-d bool tensor, got {finite!r}")
    finite = finite.detach().reshape(())
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
    """The fraction of recorded steps that were skipped.

    Args:
      stats: :class:`StepStats`.

    Returns:
      0-d fp32 tensor, ``skipped / steps`` (0 before any step), on the stats' device.

    Example:
      >>> stats = af.monitor.init_stats()
      >>> for ok in (True, True, True, False):
      ...     stats = af.monitor.record(stats, torch.tensor(ok))
      >>> float(af.monitor.skip_rate(stats))
      0.25

    Cost: four 0-d kernels; no host sync.
    """
    return stats.skipped.to(torch.float32) / stats.steps.clamp(min=1).to(torch.float32)


def _to_host(tensors) -> list:
    """The tensors on the CPU, in one device-to-host copy (so one sync off the CPU).

    A copy per tensor would sync once each: the tensors travel as one int64 vector of their
    words (:func:`_as_words`) and come back as they were (:func:`_from_words`).
    """
    tensors = [t.detach() for t in tensors]
    if not tensors or all(t.device.type == "cpu" for t in tensors):
        return tensors
    if len({t.device for t in tensors}) > 1:  # one copy per device would still sync once each
        return [t.cpu() for t in tensors]
    return _from_words(_as_words(tensors).cpu(), tensors)


def _as_words(tensors) -> torch.Tensor:
    """The tensors as one int64 vector, each value kept exactly: fp32 by its bits (NaN
    payloads included), int32/int64/bool by value."""
    words = []
    for t in tensors:
        flat = t.reshape(-1)
        if t.dtype == torch.float32:
            flat = flat.view(torch.int32)
        elif t.dtype not in (torch.int64, torch.int32, torch.bool):
            raise TypeError(f"monitor: a counter of dtype {t.dtype} cannot be read back exactly")
        words.append(flat.to(torch.int64))
    return torch.cat(words)


def _from_words(words: torch.Tensor, like) -> list:
    """:func:`_as_words` undone: tensors of ``like``'s dtypes and shapes from ``words``."""
    out, at = [], 0
    for t in like:
        chunk = words[at:at + t.numel()]
        at += t.numel()
        chunk = chunk.to(torch.int32).view(torch.float32) if t.dtype == torch.float32 else chunk.to(t.dtype)
        out.append(chunk.reshape(t.shape))
    return out


def _as_written(x: float) -> Fraction | float:
    """A threshold as the user wrote it, for the alerts' text: the rational of its shortest
    decimal form (``0.055`` is 55/1000, shown as ``5.5%``). An infinite threshold stays a float."""
    x = float(x)
    return Fraction(repr(x)) if math.isfinite(x) else x


def _ratio_above(numerator, denominator, threshold: float) -> bool:
    """Whether ``numerator / denominator`` is above ``threshold``: the one rule of every alert.

    The ratio is computed exactly (the measured values are the exact rationals they hold, a
    mean of losses included) and rounded once to a float, then compared with ``>`` to the
    threshold (a float). Rounding is monotonic and the threshold is the float of whatever the
    user meant, so a ratio exactly at that value never alerts: 3 skips of 10 at ``0.3``, 1 of
    3 at ``1 / 3``, a loss of 63 over a median of 45 at ``1.4``, a scale halved at ``2.0``.
    (Float arithmetic rounds twice: ``1 - 7 / 10`` is ``0.30000000000000004``, ``1.4 * 45``
    is ``62.99999999999999``.)"""
    if all(isinstance(x, (int, Fraction)) or math.isfinite(x) for x in (numerator, denominator)):
        try:
            ratio = float(Fraction(numerator) / Fraction(denominator))
        except OverflowError:  # a ratio past the largest float
            ratio = math.inf
    else:
        ratio = numerator / denominator
    return ratio > float(threshold)


def _percent(x: float) -> str:
    """A threshold fraction as a percentage that shows every digit given (0.055: ``5.5%``)."""
    written = _as_written(x)
    return f"{float(written * 100):g}%"


def summary(stats: StepStats) -> dict:
    """Python numbers for logging: steps, skipped, skip_rate, consecutive_skips, last_scale.

    Args:
      stats: the :class:`StepStats` that :func:`record` returned.

    Returns:
      A dict of Python ints and floats.

    Example:
      >>> stats = af.monitor.init_stats()
      >>> for ok in (True, False, True, True):
      ...     stats = af.monitor.record(stats, torch.tensor(ok), 512.0)
      >>> af.monitor.summary(stats)
      {'steps': 4, 'skipped': 1, 'skip_rate': 0.25, 'consecutive_skips': 0, 'last_scale': 512.0}

    Cost: reads the stats back to the host in one copy (one sync): call it when you log, not
    every step.
    """
    steps, skipped, consecutive, scale = (t.item() for t in _to_host(stats))
    return {
        "steps": int(steps),
        "skipped": int(skipped),
        "skip_rate": skipped / steps if steps else 0.0,
        "consecutive_skips": int(consecutive),
        "last_scale": float(scale),
    }


def health(stats: StepStats, *, max_skip_rate: float = 0.05, max_consecutive_skips: int = 5,
           min_scale: float = 1.0, state: Any = None, group=None) -> list[str]:
    """Human-readable warnings about a run; an empty list when nothing looks wrong.

    Warns when the loss scale has collapsed (the gradients overflow even unscaled): the last
    scale is below ``min_scale``, or at it while the last step was skipped (a
    :class:`DynamicLossScale` stops at its ``min_scale``, 1.0 by default, so its collapse is
    the floor, not below it), when more than ``max_skip_rate`` of the steps were
    skipped, and when at least ``max_consecutive_skips`` steps in a row were skipped. No
    warning before the first step.

    Args:
      stats: :class:`StepStats`.
      max_skip_rate: the largest fraction of skipped steps that does not warn.
      max_consecutive_skips: the run of skipped steps that warns.
      min_scale: the floor of the loss scale: below it, or at it with the last step
        skipped, the scale counts as collapsed.
      state: the optimizer (or mixed-precision, train-step, trainer) state, to report the
        params whose second moment overflowed (:func:`moment_overflows`); ``None`` skips it.
      group: with a sharded ``state``, the process group its shards lie over: the moment
        flags are combined across it (:func:`moment_overflows`; a collective, call it on
        every rank).

    Returns:
      A list of warning strings.

    Example:
      >>> stats = af.monitor.init_stats()
      >>> for _ in range(6):
      ...     stats = af.monitor.record(stats, torch.tensor(False), 0.5)
      >>> len(af.monitor.health(stats))  # collapsed scale, skip rate, consecutive skips
      3
      >>> af.monitor.health(af.monitor.record(af.monitor.init_stats(), torch.tensor(True), 1024.0))
      []

    Cost: copies the four counters to the host: a host sync (call it when you log); with
    ``state``, one read pass over its second moments and a second sync.
    """
    if not 0 <= max_skip_rate <= 1:
        raise ValueError(f"health: max_skip_rate must be in [0, 1], got {max_skip_rate!r}")
    if not max_consecutive_skips >= 1:
        raise ValueError(f"health: max_consecutive_skips must be >= 1, got {max_consecutive_skips!r}")
    if not min_scale >= 0:
        raise ValueError(f"health: min_scale must be >= 0, got {min_scale!r}")
    s = summary(stats)
    warnings = []
    overflowed = moment_overflows(state, group=group) if state is not None else []
    if overflowed:
        warnings.append(_moment_alert(overflowed))
    if s["steps"] == 0:
        return warnings
    scale = s["last_scale"]
    # At the floor with the last step skipped counts too: the dynamic scales stop at min_scale.
    if not math.isnan(scale) and (scale < min_scale or (scale <= min_scale and s["consecutive_skips"] > 0)):
        where = "below" if scale < min_scale else "at the floor"
        warnings.append(
            f"loss scale collapsed to {scale:g} ({where} {min_scale:g}): gradients overflow even "
            "without scaling; the run is diverging or needs more range (bf16, or fp32 for the "
            "overflowing layers; see nonfinite_paths)"
        )
    if _ratio_above(s["skipped"], s["steps"], max_skip_rate):
        warnings.append(
            f"{s['skip_rate']:.1%} of steps skipped ({s['skipped']} of {s['steps']}), above "
            f"{_percent(max_skip_rate)}: the effective number of updates is lower than the step count"
        )
    if s["consecutive_skips"] >= max_consecutive_skips:
        warnings.append(
            f"{s['consecutive_skips']} consecutive skipped steps: no update since; "
            "check the loss and the gradients for inf/nan (nonfinite_paths)"
        )
    return warnings


# Optimizer-state fields that hold a running average of squared gradients (Adam's and AdamW's
# exp_avg_sq and AMSGrad's max, RMSprop's and Adadelta's square_avg). A finite gradient squared
# past fp32's max (|g| above ~1.8e19 / sqrt(1 - beta2): 5.8e20 at Adam's 0.999) makes such a
# moment inf in a step that is applied, and an inf moment stays inf (beta2 * inf + g**2 is inf):
# the param's update m / (sqrt(v) + eps) is 0 from then on. So the moment is its own sticky flag,
# read when the user logs: nothing is written per step and nothing is added to the state.
_SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg"})


def _second_moments(state: Any) -> list[tuple[str, torch.Tensor]]:
    """``[(param path, moment), ...]``: the floating second-moment leaves of ``state``, each with
    the path below its field (the param's path in the state's tree of moments)."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(state, namespace=NAMESPACE)
    out = []
    for acc, leaf in zip(accessors, leaves):
        if not isinstance(leaf, torch.Tensor) or not torch.is_floating_point(leaf):
            continue
        names = [path_to_str((entry,)) for entry in acc]
        at = next((k for k, name in enumerate(names) if name in _SECOND_MOMENTS), None)
        if at is not None:
            # A q8 moment (lowmem.Q8Moment) holds the tree twice, as codes and absmax: an
            # overflow is an inf absmax (or an inf in a leaf kept fp32), named by the param.
            skip = 2 if len(acc) > at + 1 and isinstance(acc[:at + 1](state), Q8Moment) else 1
            below = acc[at + skip:]
            out.append((path_to_str(below) if len(below) else _param_above(state, acc, at), leaf))
    return out


def _param_above(state: Any, acc, at: int) -> str:
    """The param a bare moment leaf belongs to, named by the path above its field.

    In a ``torch.optim`` state dict (``{"state": {id: {"exp_avg_sq": t}}, "param_groups": [...]}``)
    the id is looked up in the groups and the param named as the rest of the library names a
    torch optimizer's params, ``param_groups[g]['params'][i]``; elsewhere the path above the
    field (``"state.3"``)."""
    if at >= 2 and path_to_str(acc[at - 2:at - 1]) == "state":
        holder = acc[:at - 2](state)
        key = acc[at - 1].entry
        groups = holder.get("param_groups") if isinstance(holder, dict) else None
        if isinstance(groups, (list, tuple)):
            for g, group in enumerate(groups):
                ids = group.get("params", []) if isinstance(group, dict) else []
                if key in ids:
                    return f"param_groups[{g}]['params'][{list(ids).index(key)}]"
    return path_to_str(acc[:at])


def _moment_flags(state: Any, group=None) -> tuple[list[str], torch.Tensor | None]:
    """The second moments' param paths and, on the device, whether each holds an inf or a NaN.

    Each rank checks its own shards; the flags are then combined (MAX) over ``group`` and, for
    DTensor moments, over every dimension of their mesh, so every rank names the same params."""
    moments = _second_moments(state)
    if not moments:
        return [], None
    meshes = {}
    locals_ = []
    for _, t in moments:
        # a DTensor, known by what it has (ampfunc.dist sits a layer above this module)
        if getattr(t, "device_mesh", None) is not None and callable(getattr(t, "to_local", None)):
            meshes.setdefault(id(t.device_mesh), t.device_mesh)
            t = t.to_local()
        locals_.append(t.detach())
    flags = ops.check(locals_, per_leaf=True)[2]
    groups = [mesh.get_group(d) for mesh in meshes.values() for d in range(mesh.ndim)]
    if group is not None:
        groups.append(group)
    if groups:
        counts = flags.to(torch.int32)  # gloo reduces no bool
        for g in groups:
            torch_dist.all_reduce(counts, op=torch_dist.ReduceOp.MAX, group=g)
        flags = counts > 0
    return [p for p, _ in moments], flags


def _overflowed(paths: list[str], flags: list) -> list[str]:
    return list(dict.fromkeys(p for p, bad in zip(paths, flags) if bad))  # a param's two moments: once


def _moment_alert(paths: list[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return (f"the optimizer's second moment (exp_avg_sq) overflowed to inf for {shown}: a finite gradient above "
            "~5.8e20 (Adam's beta2=0.999; ~1.8e19 / sqrt(1 - beta2)) squared past fp32's max in an applied step, "
            "and those params have not moved since (their updates are 0 while the moment stays inf). Clip the "
            "gradients (af.clip_by_global_norm) or fix the layer that produced them, then reset those leaves' "
            "moments to 0 (or resume from a checkpoint taken before)")


def moment_overflows(state: Any, *, group=None) -> list[str]:
    """Paths of the params whose optimizer second moment is no longer finite.

    Adam's ``exp_avg_sq`` (and AMSGrad's ``max_exp_avg_sq``, RMSprop's ``square_avg``) overflows
    to inf when a finite gradient squared passes fp32's max (about ``|g| > 5.8e20`` at
    ``beta2=0.999``): the step is applied (the gradient was finite), and from then on that
    param's update is 0, silently, since an inf moment stays inf. The moment is its own flag: a
    state of any step (plain ``adam``/``adamw``, ``mixed_precision`` ``update``/``step``/
    ``step_``, ``make_train_step``'s ``TrainState``, ``ModuleTrainer.state``, ``from_torch``)
    is checked when you log; nothing is written or read per step. Param paths are the paths
    under the moment's field (a flat trainer names its buffers, ``"float32@cpu"``); a
    ``torch.optim`` state dict's params are named ``param_groups[g]['params'][i]``.

    Args:
      state: an optimizer state, or any pytree holding one.
      group: a ``torch.distributed`` process group whose ranks each hold a shard of the state
        (plain local shards, as a sharded step keeps them): the per-leaf flags are combined
        across it, so every rank names a param that overflowed on any rank. DTensor moments
        are combined over their mesh without it. With either, this is a collective: call it on
        every rank of the group (or mesh), at the same point. None: this rank's state only.

    Returns:
      The param paths (strings), in flattening order, each once.

    Example:
      >>> tx = af.adamw(1e-3)
      >>> params = {"w": torch.ones(2)}
      >>> _, state = tx.update({"w": torch.tensor([1e21, 1.0])}, tx.init(params), params)
      >>> af.monitor.moment_overflows(state)
      ['w']

    Cost: one read pass over the second moments (``ops.check(..., per_leaf=True)``), then the
    per-leaf flags are read back to the host: a host sync (call it when you log). With
    ``group`` or DTensor moments, one all-reduce (MAX) of one int32 per moment leaf per group.
    """
    paths, flags = _moment_flags(state, group)
    return _overflowed(paths, flags.tolist()) if flags is not None else []


def nonfinite_paths(grads: PyTree) -> list[str]:
    """Paths of the floating tensor leaves of ``grads`` that hold an inf or a NaN.

    A diagnostic for a step that overflowed. Non-floating leaves cannot overflow and are not
    listed.

    Args:
      grads: a pytree of tensors.

    Returns:
      A list of leaf paths (strings), in flattening order.

    Example:
      >>> af.monitor.nonfinite_paths({"b": torch.zeros(2), "w": torch.tensor([1.0, float("inf")])})
      ['w']

    Cost: one read pass over the floating leaves (``ops.check(..., per_leaf=True)``), then the
    per-leaf flags are read back to the host: a host sync.
    """
    pairs = [(p, x) for p, x in leaves_with_paths(grads) if isinstance(x, torch.Tensor) and torch.is_floating_point(x)]
    if not pairs:
        return []
    _, _, bad = ops.check([x for _, x in pairs], per_leaf=True)
    return [path for (path, _), is_bad in zip(pairs, bad.tolist()) if is_bad]


# ----------------------------------------------------------------------------------------------
# TrainingMonitor: windowed history on the device, health alerts, per-leaf overflow counts
# ----------------------------------------------------------------------------------------------


class MonitorConfig(NamedTuple):
    """The static half of a :class:`TrainingMonitor` (pytree metadata, never a tensor).

    Built by the monitor from its keyword arguments; ``validate()`` checks it.

    Attributes:
      leaf_paths: the floating leaves whose overflows are counted, in flattening order.
      window: steps of loss/scale/skip history kept on the device (>= 2).
      explode_factor: the loss alert's threshold: recent mean loss over the window's median (> 1).
      max_skip_rate: the skip alert's threshold, a fraction of the window's steps in [0, 1].
      min_steps: the steps the window must hold before the skip alert is checked (a full
        window when it is smaller).
      scale_drop_factor: the scale alert's threshold: the recent highest scale over the scale now
        (> 1; a drop of exactly this factor does not alert, like every threshold here).
      scale_drop_steps: the steps over which that drop is measured.

    Example:
      >>> mon = af.TrainingMonitor({"w": torch.ones(2)}, window=20, max_skip_rate=0.1)
      >>> mon.config.leaf_paths, mon.config.window, mon.config.max_skip_rate
      (('w',), 20, 0.1)
    """

    leaf_paths: tuple = ()
    window: int = 100
    explode_factor: float = 3.0
    max_skip_rate: float = 0.3
    min_steps: int = 10
    scale_drop_factor: float = 10.0
    scale_drop_steps: int = 10

    def validate(self) -> "MonitorConfig":
        if not isinstance(self.window, int) or self.window < 2:
            raise ValueError(f"TrainingMonitor: window must be an int >= 2, got {self.window!r}")
        for name in ("explode_factor", "scale_drop_factor"):
            if not getattr(self, name) > 1:
                raise ValueError(f"TrainingMonitor: {name} must be > 1, got {getattr(self, name)!r}")
        if not 0 <= self.max_skip_rate <= 1:
            raise ValueError(f"TrainingMonitor: max_skip_rate must be in [0, 1], got {self.max_skip_rate!r}")
        if not 1 <= self.scale_drop_steps or not 1 <= self.min_steps:
            raise ValueError("TrainingMonitor: scale_drop_steps and min_steps must be >= 1, "
                             f"got {self.scale_drop_steps!r} and {self.min_steps!r}")
        if not all(isinstance(p, str) for p in self.leaf_paths):
            raise TypeError("TrainingMonitor: leaf_paths must be strings")
        return self


def _floating_leaves(tree: PyTree) -> list[tuple[str, torch.Tensor]]:
    return [(p, x) for p, x in leaves_with_paths(tree) if isinstance(x, torch.Tensor) and torch.is_floating_point(x)]


def leaf_nonfinite(grads: PyTree) -> torch.Tensor:
    """Per floating leaf of ``grads``, whether it holds an inf or a NaN.

    The per-leaf flags :meth:`TrainingMonitor.record` counts. Inside a mixed-precision step the
    check pass that decides the skip can produce the same flags at no extra cost
    (:class:`~ampfunc.monitor.LeafFlagsHook`).

    Args:
      grads: a pytree of tensors (non-floating leaves are left out).

    Returns:
      A bool vector, one entry per floating leaf in flattening order, on the first such leaf's
      device (empty, on the CPU, when there is none).

    Example:
      >>> af.monitor.leaf_nonfinite({"a": torch.ones(2), "b": torch.tensor([float("nan")])})
      tensor([False,  True])

    Cost: one read pass over the gradients (``ops.check(..., per_leaf=True)``); no host sync.
    """
    tensors = [x for _, x in _floating_leaves(grads)]
    if not tensors:
        return torch.zeros(0, dtype=torch.bool)
    return ops.check(tensors, per_leaf=True)[2]


class LeafFlagsHook:
    """Catches a step's per-leaf overflow flags for :meth:`TrainingMonitor.record`, in its leaf order.

    Set it as a mixed-precision step's check hook (``tx.engine.on_check = hook``, also
    ``ModuleTrainer.engine``): the step's own check pass then hands over one flag per gradient
    leaf, on the device; :meth:`take` returns them ordered as ``monitor.leaf_paths`` (one gather,
    no host sync) and clears them. Eager steps only: inside ``torch.compile`` the hook is not
    called and :meth:`take` returns ``None`` (record without per-leaf counts, or call
    :func:`leaf_nonfinite` on the gradients).

    Args:
      monitor: the :class:`TrainingMonitor` whose leaf order the flags take.

    Example:
      >>> params = {"a": torch.ones(2), "b": torch.ones(2)}
      >>> tx = af.mixed_precision(af.sgd(0.1), af.DynamicLossScale(8.0))
      >>> state, mon = tx.init(params), af.TrainingMonitor(params)
      >>> hook = af.monitor.LeafFlagsHook(mon)
      >>> tx.engine.on_check = hook
      >>> grads = {"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}
      >>> params, state = tx.step(params, grads, state)
      >>> hook.take()
      tensor([False,  True])
    """

    def __init__(self, monitor: "TrainingMonitor"):
        self.leaf_paths = tuple(monitor.leaf_paths)
        self._flags: Optional[torch.Tensor] = None
        self._order: dict = {}  # the step's leaf paths -> gather index into the monitor's order

    def __call__(self, finite: torch.Tensor, leaf_nonfinite: torch.Tensor, leaf_paths) -> None:
        paths = tuple(leaf_paths() if callable(leaf_paths) else leaf_paths)
        index = self._order.get(paths)
        if index is None:
            position = {p: i for i, p in enumerate(paths)}
            missing = [p for p in self.leaf_paths if p not in position]
            if missing:
                raise ValueError(f"LeafFlagsHook: the step's gradients have no leaf {missing[0]!r} of the monitor "
                                 f"(build the monitor from the params the step updates)")
            index = torch.tensor([position[p] for p in self.leaf_paths], dtype=torch.int64)
            self._order[paths] = index
        if index.device != leaf_nonfinite.device:
            index = self._order[paths] = index.to(leaf_nonfinite.device)
        self._flags = leaf_nonfinite.detach().index_select(0, index)

    def take(self) -> Optional[torch.Tensor]:
        """The last step's flags in the monitor's leaf order (then cleared), or ``None``."""
        flags, self._flags = self._flags, None
        return flags


_MON_FIELDS = ("steps", "skipped", "consecutive_skips", "scale", "growth_tracker", "loss_window",
               "scale_window", "finite_window", "leaf_overflows", "loss_given_window")


class TrainingMonitor:
    """The health of a mixed-precision run, kept on the device and read when you log.

    An immutable pytree, like the loss scales: tensors are children, the settings
    (:class:`MonitorConfig`) are metadata. :meth:`record` returns the monitor after one more
    step without reading anything back, so it runs every step (inside ``torch.compile``, a
    CUDA graph, next to ``skip_or_apply``). It keeps the totals (steps, skipped steps,
    consecutive skips, the scale and growth tracker), the last ``window`` steps' loss, scale and
    finite flag in ring buffers, and per floating leaf of the params the number of steps whose
    gradient for that leaf held an inf or a NaN.

    The readers -- :meth:`check_health`, :meth:`scaler_stats`, :meth:`overflows`,
    :meth:`history`, :meth:`as_dict` -- copy the tensors to the host once each: call them at
    logging intervals.

    Args:
      params: a pytree whose floating leaves name the counted leaves (paths as in
        ``af.tree.leaves_with_paths``), or ``None`` to count none.
      window: steps of history kept (>= 2).
      device: where the tensors live (default: the first floating leaf's device, else CPU).
      **thresholds: the other fields of :class:`MonitorConfig` (``explode_factor``, ...).

    Attributes:
      steps: 0-d int64 tensor, steps recorded.
      skipped: 0-d int64 tensor, steps whose gradients were not finite.
      consecutive_skips: 0-d int64 tensor, skipped steps since the last finite one.
      scale: 0-d fp32 tensor, the last recorded loss scale (NaN before any step).
      growth_tracker: 0-d int64 tensor, the last recorded dynamic scale's growth tracker (0 for
        other scales).
      leaf_overflows: int64 vector, per leaf path the steps whose gradient held an inf/NaN.
      leaf_paths: the counted leaves' paths.
      config: the :class:`MonitorConfig`.

    Example:
      >>> params = {"enc.w": torch.ones(3), "head.w": torch.ones(2)}
      >>> mon, ls = af.TrainingMonitor(params, window=50), af.DynamicLossScale()
      >>> grads = {"enc.w": torch.ones(3), "head.w": torch.tensor([1.0, float("inf")])}
      >>> flags = af.monitor.leaf_nonfinite(grads)
      >>> finite = ~flags.any()
      >>> ls = af.update_scale(ls, finite)
      >>> mon = mon.record(finite, ls, loss=0.7, leaf_nonfinite=flags)
      >>> mon.overflows()
      {'head.w': 1}
      >>> mon.check_health()["status"]
      'healthy'

    Cost: ``record`` is under twenty small kernels over at most ``window`` + #leaves elements;
    no host sync. Each reader copies the tensors to the host: a host sync.
    """

    __slots__ = ("_tensors", "_config")

    def __init__(self, params: PyTree = None, *, window: int = 100, device=None, **thresholds):
        pairs = _floating_leaves(params) if params is not None else []
        config = MonitorConfig(tuple(p for p, _ in pairs), window, **thresholds).validate()
        if device is None:
            device = pairs[0][1].device if pairs else "cpu"
        i64 = dict(dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        tensors = (
            torch.zeros((), **i64), torch.zeros((), **i64), torch.zeros((), **i64),
            torch.full((), math.nan, **f32), torch.zeros((), **i64),
            torch.full((window,), math.nan, **f32), torch.full((window,), math.nan, **f32),
            torch.ones(window, dtype=torch.bool, device=device),
            torch.zeros(len(config.leaf_paths), **i64),
            # Which window slots hold a recorded loss: NaN in the loss window is then a loss
            # that was NaN (a diverged run), not a step recorded without one.
            torch.zeros(window, dtype=torch.bool, device=device),
        )
        self._tensors, self._config = tensors, config

    @classmethod
    def from_tensors(cls, tensors, config: MonitorConfig) -> "TrainingMonitor":
        obj = cls.__new__(cls)
        obj._tensors, obj._config = tuple(tensors), config
        return obj

    config = property(lambda self: self._config)
    leaf_paths = property(lambda self: self._config.leaf_paths)
    steps = property(lambda self: self._tensors[0])
    skipped = property(lambda self: self._tensors[1])
    consecutive_skips = property(lambda self: self._tensors[2])
    scale = property(lambda self: self._tensors[3])
    growth_tracker = property(lambda self: self._tensors[4])
    leaf_overflows = property(lambda self: self._tensors[8])

    def to(self, device) -> "TrainingMonitor":
        return TrainingMonitor.from_tensors([t.to(device) for t in self._tensors], self._config)

    # -- the hot path ----------------------------------------------------------------------

    def record(self, finite: Union[torch.Tensor, bool], loss_scale: Any = 1.0, *, loss: Any = None,
               leaf_nonfinite: Optional[torch.Tensor] = None) -> "TrainingMonitor":
        """The monitor after one more step. Pure; no host sync.

        Args:
          finite: 0-d bool tensor (or a bool), ``False`` when the step was skipped.
          loss_scale: the loss scale after the step's update (a loss scale, a 0-d tensor or a
            number; ``1.0`` without scaling). A :class:`DynamicLossScale`'s growth tracker is
            kept too.
          loss: the step's (unscaled) loss, a 0-d tensor or a number; ``None`` records no loss
            (NaN in :meth:`history`, skipped by the loss checks). A recorded NaN or inf loss
            is a diverged run: :meth:`check_health` raises the loss alert.
          leaf_nonfinite: bool vector over ``leaf_paths`` (from :func:`leaf_nonfinite` or the
            step's check pass); ``None`` counts nothing for this step.

        Returns:
          A new :class:`TrainingMonitor`.
        """
        steps, skipped, consec, _, _, loss_w, scale_w, finite_w, leaf_counts, given_w = self._tensors
        device = steps.device
        if isinstance(finite, bool):
            finite = torch.tensor(finite, device=device)
        if not isinstance(finite, torch.Tensor) or finite.numel() != 1 or finite.dtype != torch.bool:
            raise ValueError(f"TrainingMonitor.record: finite must be a 0-d bool tensor, got {finite!r}")
        finite = finite.detach().reshape(()).to(device=device, dtype=torch.bool)
        scale = _scale_tensor(loss_scale, device)
        tracker = getattr(loss_scale, "growth_tracker", None)
        tracker = (tracker.detach().reshape(()).to(device=device, dtype=torch.int64)
                   if isinstance(tracker, torch.Tensor) else torch.zeros((), dtype=torch.int64, device=device))
        given = torch.full((), loss is not None, dtype=torch.bool, device=device)  # a fill, not a copy
        if loss is None:
            loss_t = torch.full((), math.nan, dtype=torch.float32, device=device)
        elif isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"TrainingMonitor.record: loss must be a scalar, got shape {tuple(loss.shape)}")
            loss_t = loss.detach().reshape(()).to(device=device, dtype=torch.float32)
        else:
            loss_t = torch.tensor(float(loss), dtype=torch.float32, device=device)
        if leaf_nonfinite is None:
            new_counts = leaf_counts
        else:
            if not isinstance(leaf_nonfinite, torch.Tensor) or leaf_nonfinite.shape != leaf_counts.shape \
                    or leaf_nonfinite.dtype != torch.bool:
                shape = tuple(leaf_nonfinite.shape) if isinstance(leaf_nonfinite, torch.Tensor) else leaf_nonfinite
                if isinstance(leaf_nonfinite, torch.Tensor) and leaf_nonfinite.dtype != torch.bool:
                    shape = f"{shape} of dtype {leaf_nonfinite.dtype}"
                raise ValueError(f"TrainingMonitor.record: leaf_nonfinite must be a bool vector of "
                                 f"{leaf_counts.numel()} flags (one per leaf path), got {shape}")
            new_counts = leaf_counts + leaf_nonfinite.detach().to(device=device, dtype=torch.int64)
        overflow = (~finite).to(torch.int64)
        # ring buffers: slot steps % window, chosen on the device (no index read back)
        here = torch.arange(loss_w.numel(), device=device) == torch.remainder(steps, loss_w.numel())
        return TrainingMonitor.from_tensors((
            steps + 1, skipped + overflow, (consec + 1) * overflow, scale, tracker,
            torch.where(here, loss_t, loss_w), torch.where(here, scale, scale_w), torch.where(here, finite, finite_w),
            new_counts, torch.where(here, given, given_w),
        ), self._config)

    def record_state(self, state: Any, *, loss: Any = None,
                     leaf_nonfinite: Optional[torch.Tensor] = None) -> "TrainingMonitor":
        """:meth:`record` from the state a mixed-precision step returned.

        ``state``: anything with the step's ``finite`` flag and the next ``loss_scale`` (the
        states of ``mixed_precision``, ``make_train_step`` and ``ModuleTrainer``). Pure; no host
        sync.
        """
        finite, ls = getattr(state, "finite", None), getattr(state, "loss_scale", None)
        if not isinstance(finite, torch.Tensor) or ls is None:
            raise TypeError(f"TrainingMonitor.record_state: {type(state).__name__} carries no finite flag and "
                            "loss scale (pass the state a mixed-precision step returned, or use record())")
        return self.record(finite, ls, loss=loss, leaf_nonfinite=leaf_nonfinite)

    # -- readers (one host sync each) ------------------------------------------------------

    def _host(self, state: Any = None, group=None) -> dict:
        paths, flags = _moment_flags(state, group) if state is not None else ([], None)
        t = _to_host(self._tensors + ((flags,) if flags is not None else ()))  # one transfer
        moments = _overflowed(paths, t[len(self._tensors)].tolist()) if flags is not None else []
        steps, window = int(t[0]), self._config.window
        n = min(steps, window)
        order = [(steps - n + i) % window for i in range(n)]  # oldest first
        return {
            "steps": steps, "skipped": int(t[1]), "consecutive_skips": int(t[2]), "scale": float(t[3]),
            "growth_tracker": int(t[4]), "loss": t[5][order].tolist(), "scale_hist": t[6][order].tolist(),
            "finite": t[7][order].tolist(), "first_step": steps - n, "leaf_counts": t[8].tolist(),
            "loss_given": t[9][order].tolist(), "moment_overflows": moments,
        }

    def history(self) -> dict:
        """The window, oldest first: ``{"step": [...], "loss": [...], "loss_scale": [...], "finite": [...]}``.

        ``step`` counts from 0 over the whole run. Reads the monitor back (one sync).
        """
        h = self._host()
        return {"step": list(range(h["first_step"], h["steps"])), "loss": h["loss"],
                "loss_scale": h["scale_hist"], "finite": h["finite"]}

    def scaler_stats(self) -> dict:
        """``{"current_scale", "growth_tracker", "total_steps", "skipped_steps", "skip_rate"}`` over the run.

        The scaler statistics of the practice guide; ``growth_tracker`` is the dynamic scale's
        count of clean steps since its last change (0 for other scales). One sync.
        """
        return self._stats(self._host())

    @staticmethod
    def _stats(h) -> dict:
        return {"current_scale": h["scale"], "growth_tracker": h["growth_tracker"], "total_steps": h["steps"],
                "skipped_steps": h["skipped"], "skip_rate": h["skipped"] / h["steps"] if h["steps"] else 0.0}

    def overflows(self) -> dict:
        """``{leaf path: steps whose gradient for it held an inf/NaN}``, leaves that ever did, most first.

        One sync.
        """
        return self._overflows(self._host())

    def _overflows(self, h) -> dict:
        pairs = [(p, c) for p, c in zip(self._config.leaf_paths, h["leaf_counts"]) if c]
        return dict(sorted(pairs, key=lambda pc: -pc[1]))

    def check_health(self, state: Any = None, *, group=None) -> dict:
        """The run's health over the window, in the practice guide's shape.

        Returns ``{"status": "healthy" | "unhealthy" | "no_data", "current_loss",
        "current_scale", "skip_rate" (over the window), "alerts": [sentences], "checks":
        {"loss_exploding", "skip_rate_high", "scale_falling": bool}, "overflowing_leaves":
        {path: count}}``. The alerts:

        * loss exploding: a non-finite (inf or NaN) recorded loss in the window, or the mean of the last few losses
          over the median of the earlier ones above ``explode_factor``;
        * skip rate high: the window's skipped steps over its steps above ``max_skip_rate``
          (once it holds ``min_steps``);
        * scale falling: the highest scale of the last ``scale_drop_steps`` steps over the scale
          now above ``scale_drop_factor`` (10x);
        * moment overflow (with ``state``, the step's optimizer/mixed-precision/train state): a
          param's optimizer second moment is inf, so it no longer moves (:func:`moment_overflows`;
          ``checks["moment_overflow"]``, ``"moment_overflows": [paths]``).

        Every threshold is compared by one rule: the measured ratio, computed exactly from the
        values read back and rounded once to a float, alerts when it is strictly above the
        threshold. A ratio exactly at the threshold never alerts, whatever the rounding of the
        threshold as written: 3 skips of 10 at ``max_skip_rate=0.3``, 1 of 3 at ``1 / 3``, one
        halving (1024 to 512) at ``scale_drop_factor=2``, a loss of 63 over a median of 45 at
        ``explode_factor=1.4``.

        With a sharded ``state`` (each rank holding its shard), pass ``group``, the process
        group of the shards: the moment flags are combined across it (one all-reduce MAX of
        one int32 per moment leaf, before the one sync), so every rank, the one that logs
        included, sees a param that overflowed on any rank; DTensor moments are combined over
        their mesh without it. Then it is a collective: call it on every rank.

        One sync (with ``state``, also one read pass over its second moments).
        """
        return self._health(self._host(state, group))

    def _health(self, h) -> dict:
        c = self._config
        if h["steps"] == 0:
            moments = h["moment_overflows"]  # a state can tell before any step is recorded
            alerts = [_moment_alert(moments)] if moments else []
            return {"status": "unhealthy" if moments else "no_data", "alerts": alerts,
                    "checks": {"moment_overflow": True} if moments else {}, "moment_overflows": moments}
        losses = [x for x, given in zip(h["loss"], h["loss_given"]) if given]
        # Every alert is one rule (_ratio_above): the measured ratio, exact and rounded once, above
        # its threshold; a value exactly at a threshold never trips it by a rounding.
        window_steps = len(h["finite"])
        window_skipped = window_steps - sum(h["finite"])
        window_skip_rate = window_skipped / window_steps
        checks = {"loss_exploding": False, "skip_rate_high": False, "scale_falling": False,
                  "moment_overflow": bool(h["moment_overflows"])}
        alerts = [_moment_alert(h["moment_overflows"])] if h["moment_overflows"] else []
        if not all(math.isfinite(x) for x in losses):
            checks["loss_exploding"] = True
            alerts.append("loss is not finite: the run diverged (learning rate too high, or a layer "
                          "overflowing in the forward pass)")
        elif len(losses) >= 4:
            k = max(1, min(5, len(losses) // 4))
            recent, earlier = sum(losses[-k:]) / k, sorted(losses[:-k])
            median = earlier[len(earlier) // 2]
            exact_recent = sum(Fraction(x) for x in losses[-k:]) / k
            if median > 0 and _ratio_above(exact_recent, median, c.explode_factor):
                checks["loss_exploding"] = True
                alerts.append(f"loss exploding: the last {k} steps average {recent:.4g}, {recent / median:.1f}x "
                              f"the window's median {median:.4g} (learning rate too high or gradients exploding)")
        # a window smaller than min_steps never holds that many steps: a full window is enough
        if window_steps >= min(c.min_steps, c.window) \
                and _ratio_above(window_skipped, window_steps, c.max_skip_rate):
            checks["skip_rate_high"] = True
            alerts.append(f"{window_skip_rate:.1%} of the last {window_steps} steps skipped (above "
                          f"{_percent(c.max_skip_rate)}): gradients overflow often; see overflowing_leaves")
        scales = [s for s in h["scale_hist"][-c.scale_drop_steps:] if not math.isnan(s)]
        if scales and scales[-1] > 0 and _ratio_above(max(scales), scales[-1], c.scale_drop_factor):
            checks["scale_falling"] = True
            alerts.append(f"loss scale fell {max(scales) / scales[-1]:.3g}x within {len(scales)} steps "
                          f"(to {scales[-1]:g}): inf/NaN gradients step after step")
        return {
            "status": "unhealthy" if alerts else "healthy",
            "current_loss": losses[-1] if losses else math.nan,
            "current_scale": h["scale"],
            "skip_rate": round(window_skip_rate, 4),
            "alerts": alerts,
            "checks": checks,
            "overflowing_leaves": self._overflows(h),
            "moment_overflows": h["moment_overflows"],
        }

    def as_dict(self, state: Any = None, *, group=None) -> dict:
        """One flat dict of Python values for a logger (one sync).

        Keys: ``steps``, ``skipped``, ``skip_rate``, ``consecutive_skips``, ``loss``,
        ``loss_scale``, ``growth_tracker``, ``status``, ``alerts``, ``overflows``. With
        ``state``, the alerts include a param whose second moment overflowed (:meth:`check_health`;
        ``group`` as there).
        """
        h = self._host(state, group)
        health_ = self._health(h)
        stats = self._stats(h)
        return {
            "steps": h["steps"], "skipped": h["skipped"], "skip_rate": stats["skip_rate"],
            "consecutive_skips": h["consecutive_skips"], "loss": h["loss"][-1] if h["loss"] else math.nan,
            "loss_scale": h["scale"], "growth_tracker": h["growth_tracker"], "status": health_["status"],
            "alerts": health_["alerts"], "overflows": self._overflows(h),
        }

    def __repr__(self) -> str:
        return (f"TrainingMonitor(steps={self.steps!r}, skipped={self.skipped!r}, window={self._config.window}, "
                f"leaves={len(self._config.leaf_paths)})")

    def __getstate__(self):
        return {"tensors": self._tensors, "config": tuple(self._config)}

    def __setstate__(self, state):
        tensors = tuple(state["tensors"])
        if len(tensors) == len(_MON_FIELDS) - 1:
            # Saved before the loss_given window existed: a loss was recorded where it is not NaN.
            tensors += (~torch.isnan(tensors[5]),)
        self._tensors, self._config = tensors, MonitorConfig(*state["config"])


optree.register_pytree_node(TrainingMonitor, lambda m: (m._tensors, m._config, _MON_FIELDS),
                            lambda config, children: TrainingMonitor.from_tensors(children, config),
                            namespace=NAMESPACE)
torch_pytree.register_pytree_node(TrainingMonitor, lambda m: (list(m._tensors), m._config),
                                  lambda children, config: TrainingMonitor.from_tensors(children, config),
                                  serialized_type_name="ampfunc.TrainingMonitor")


# torch.load(weights_only=True) (the default) accepts stats saved with the training state.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([StepStats, TrainingMonitor, MonitorConfig])
