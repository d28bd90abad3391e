"""The warning about fp16/bf16 params with no fp32 master gives advice each front-end can follow.

make_train_step and ModuleTrainer refuse a ``mixed_precision`` wrapper (they run that step
themselves), so "wrap the optimizer in mixed_precision" is advice only an optax-style loop can
take; the warning names each front-end's own way, and following it silences the warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampfunc as af
from ampfunc.optim import base


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(base, "_WARNED_LOW_PRECISION", set())


def _master_warnings(make):
    base._WARNED_LOW_PRECISION.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught if "no fp32 master" in str(w.message)]


def _loss(fwd, x):
    return fwd(x).square().mean()


def test_make_train_step_is_told_to_use_a_policy_with_fp32_params_and_that_works(fresh_warnings):
    msgs = _master_warnings(lambda: af.make_train_step(nn.Linear(2, 2), _loss, af.sgd(1e-4), "half").init())
    assert len(msgs) == 1 and 'with make_train_step, a policy whose params are fp32 (e.g. "p=f32,c=bf16"' in msgs[0]
    # the advice taken: no warning, fp32 params (the masters), half compute
    state = None

    def follow():
        nonlocal state
        state = af.make_train_step(nn.Linear(2, 2), _loss, af.sgd(1e-4), "p=f32,c=bf16").init()

    assert _master_warnings(follow) == []
    assert state.params["weight"].dtype == torch.float32


def test_a_module_trainer_without_masters_is_told_its_master_dtype(fresh_warnings):
    msgs = _master_warnings(lambda: af.ModuleTrainer(nn.Linear(2, 2).half(), af.sgd(0.1), master_dtype=torch.float16))
    assert len(msgs) == 1 and "with ModuleTrainer, master_dtype=torch.float32" in msgs[0]
    assert _master_warnings(lambda: af.ModuleTrainer(nn.Linear(2, 2).half(), af.sgd(0.1))) == []


def test_an_optax_style_loop_is_told_to_wrap_the_optimizer_in_mixed_precision(fresh_warnings):
    params = {"w": torch.ones(2, dtype=torch.bfloat16)}
    msgs = _master_warnings(lambda: af.sgd(0.1).init(params))
    assert len(msgs) == 1 and "in an optax-style loop (tx.init/tx.update), ampfunc.mixed_precision(tx" in msgs[0]
    assert _master_warnings(lambda: af.mixed_precision(af.sgd(0.1), af.NoOpLossScale()).init(params)) == []
