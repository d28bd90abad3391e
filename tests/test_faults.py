"""Fault injection: NaN/+inf/-inf in gradients and losses, in bursts, on every path,
fp16/bf16/fp32, compiled kernels and plain-torch reference. The invariants are asserted after
every step by the harness (tests/_faults.py); here the two backends' skip and scale sequences
must also be equal.

``AMPFUNC_FAULTS_FULL=1`` runs a larger sweep (more seeds and steps, hysteresis 2, the
GradScaler-parity setting with a burst long enough to reach the scale floor on every path).
"""

import math
import os
import zlib

import pytest
import torch

import _faults as F

FULL = os.environ.get("AMPFUNC_FAULTS_FULL", "") not in ("", "0")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
STEPS = 200 if FULL else 48
SEEDS = [0, 1, 2] if FULL else [0]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("path", list(F.PATHS))
def test_faults_never_enter_the_state_and_backends_agree(path, dtype):
    for seed in SEEDS:
        plan = F.make_plan(STEPS, _seed(path, str(dtype), seed))
        assert sum(f is not None for f in plan) >= 4
        ext = F.run(path, dtype, plan, seed=seed)
        with F.reference_kernels():
            ref = F.run(path, dtype, plan, seed=seed)
        assert ext.skips == ref.skips
        assert ext.scales == ref.scales
        assert any(ext.skips) and not all(ext.skips)


PARITY = F.Config(init_scale=2.0**16, growth_interval=3, min_scale=0.0, max_scale=math.inf)
FLOOR_PATHS = list(F.PATHS) if FULL else ["mp-adamw.step_", "mp-rmsprop.step_", "primitives", "GradScaler"]


@pytest.mark.parametrize("path", FLOOR_PATHS)
def test_gradscaler_parity_setting_survives_a_burst_that_reaches_the_floor(path):
    # 2**16 halves to the floor 2**-126 in 142 steps; torch's GradScaler would reach 0 and then
    # write inf into every parameter on the first finite step.
    plan = [None] * 4 + F.burst(160, 7) + [None] * 8
    assert all(f is not None for f in plan[4:164])
    rec = F.run(path, torch.float32, plan, config=PARITY, check_every=8)
    assert min(rec.scales) == F.SCALE_FLOOR
    assert rec.skips[-8:] == [False] * 8


@pytest.mark.skipif(not FULL, reason="set AMPFUNC_FAULTS_FULL=1")
@pytest.mark.parametrize("path", list(F.PATHS))
def test_hysteresis_two_under_faults(path):
    config = F.Config(hysteresis=2)
    plan = F.make_plan(STEPS, _seed("hysteresis", path))
    ext = F.run(path, torch.float16, plan, config=config)
    with F.reference_kernels():
        ref = F.run(path, torch.float16, plan, config=config)
    assert ext == ref


def test_reference_switch_really_switches():
    from ampfunc import ops

    if ops.backend() == "reference":
        pytest.skip("the compiled kernels are not loaded in this process")
    plan = F.make_plan(4, 0)
    F.REFERENCE_CALLS[0] = 0
    F.run("mp-adamw.step_", torch.float16, plan)
    assert F.REFERENCE_CALLS[0] == 0
    with F.reference_kernels():
        F.run("mp-adamw.step_", torch.float16, plan)
    assert F.REFERENCE_CALLS[0] > 0
    calls = F.REFERENCE_CALLS[0]
    F.run("mp-adamw.step_", torch.float16, plan)
    assert F.REFERENCE_CALLS[0] == calls  # the compiled kernels serve again after the block


def test_plans_cover_every_fault_kind():
    plan = [f for seed in range(5) for f in F.make_plan(100, seed) if f is not None]
    assert {f.kind for f in plan} == {"grad", "loss"}
    assert {str(f.value) for f in plan} == {"nan", "inf", "-inf"}
    assert max(len(f.leaves) for f in plan) == 3
