"""A 10,000-step soak with overflow bursts: the loss scale stays within its bounds,
memory stays flat, every state stays finite, and the compiled kernels and the plain-torch
reference skip the same steps with the same scales.

Gradients are synthesised (a fixed pool of "true" gradients times the current loss scale, cast
to fp16, so large scales overflow on their own) plus injected NaN/inf bursts, some long enough to
drive the scale to its floor. Tensors are tiny: the soak costs well under a millisecond a step.
The default run is 3,000 steps (about 10 s on two busy cores, both backends);
``AMPFUNC_FAULTS_FULL=1`` runs the full 10,000 and ``AMPFUNC_SOAK_STEPS`` any length.
"""

import gc
import math
import os
import random
import warnings

import pytest
import torch

import _faults as F
import ampfunc as af

FULL = os.environ.get("AMPFUNC_FAULTS_FULL", "") not in ("", "0")
STEPS = int(os.environ.get("AMPFUNC_SOAK_STEPS", "10000" if FULL else "3000"))
SHAPES = {"a.w": (16, 8), "a.b": (8,), "b.w": (8, 4)}


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module attributes
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _plan(steps: int, seed: int) -> list:
    """Per step: None, or the (leaf, position, value) to inject. Bursts of 1-4 steps start with
    probability 1/100, one in ten of them 10-40 steps long; two bursts of 160 steps (at a quarter
    and half way) drive the scale to its floor, and it must grow back afterwards."""
    rng = random.Random(seed)
    plan = [None] * steps
    i = 0
    while i < steps:
        if rng.random() < 0.01:
            n = rng.randint(10, 40) if rng.random() < 0.1 else rng.randint(1, 4)
            for j in range(i, min(steps, i + n)):
                plan[j] = (rng.randrange(3), rng.random(), rng.choice(F.FAULT_VALUES))
            i += n
        i += 1
    for start in (steps // 4, steps // 2):
        for j in range(start, min(steps, start + 160)):
            plan[j] = (j % 3, 0.5, F.FAULT_VALUES[j % 3])
    return plan


def _soak(plan, config: F.Config):
    g = torch.Generator().manual_seed(0)
    pool = [{k: torch.randn(s, generator=g) * 1e-2 for k, s in SHAPES.items()} for _ in range(8)]
    params = {k: torch.randn(s, generator=g).half() for k, s in SHAPES.items()}
    tx = af.mixed_precision(af.adamw(1e-3), loss_scale=config.loss_scale())
    state = tx.init(params)
    lo, hi = max(config.min_scale, F.SCALE_FLOOR), config.max_scale
    skips, scales, mem = [], [], {}
    grads = {k: torch.empty(s, dtype=torch.float16) for k, s in SHAPES.items()}
    for step, fault in enumerate(plan):
        scale = af.loss_scale_of(state).loss_scale
        for k, true in pool[step % len(pool)].items():
            grads[k].copy_(true * scale)
        if fault is not None:
            leaf, pos, value = fault
            flat = grads[list(SHAPES)[leaf]].view(-1)
            flat[int(pos * flat.numel())] = value
        finite = bool(torch.isfinite(torch.cat([t.view(-1) for t in grads.values()])).all())
        params, state = tx.step_(params, grads, state)
        s = float(af.loss_scale_of(state).loss_scale)
        assert lo <= s <= hi and 0 < s < math.inf, (step, s)
        skips.append(not finite)
        scales.append(s)
        if step % 500 == 0 or step == len(plan) - 1:
            leaves = [t for t in af.tree.tree_leaves((params, state)) if t.is_floating_point()]
            assert all(bool(torch.isfinite(t).all()) for t in leaves), step
        if step in (len(plan) // 5, len(plan) - 1):
            mem[step] = (_live_tensors(), _rss_bytes())
    # Every step with finite gradients was applied, every other one skipped.
    assert int(state.inner.step) == skips.count(False)
    return skips, scales, mem


@pytest.mark.parametrize("config", [F.Config(init_scale=2.0**16, growth_interval=5, min_scale=0.0,
                                             max_scale=math.inf)], ids=["gradscaler-parity"])
def test_soak_with_overflow_bursts(config):
    plan = _plan(STEPS, 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ext = _soak(plan, config)
        with F.reference_kernels():
            ref = _soak(plan, config)
    finally:
        torch.set_num_threads(threads)
    for skips, scales, mem in (ext, ref):
        assert any(skips) and not all(skips)
        assert min(scales) == F.SCALE_FLOOR  # the long bursts reached the floor ...
        assert scales[-1] > 1.0              # ... and the scale grew back
        (t0, r0), (t1, r1) = mem.values()
        # <=: objects left by earlier tests in the session may be collected in between
        assert t1 <= t0, f"live tensors grew from {t0} to {t1}"
        if r0 is not None:
            assert r1 - r0 < 32 * 2**20, f"resident memory grew by {(r1 - r0) / 2**20:.1f} MiB"
    assert ext[0] == ref[0]
    assert ext[1] == ref[1]
