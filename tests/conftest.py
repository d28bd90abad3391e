"""Fixtures the tests share. The plain helpers are in _helpers.py."""

from __future__ import annotations

import pytest

import ampfunc as af
from _helpers import make_params
from ampfunc.compat.apex.amp import _amp_state


@pytest.fixture
def params():
    """A fresh :func:`_helpers.make_params` tree for each test that asks for it."""
    return make_params()


@pytest.fixture(params=["reference", "compiled"])
def kernels(request, monkeypatch):
    """Which optimizer kernels ``af.ops.adam_step_`` / ``af.ops.sgd_step_`` (and their checked
    forms) run (``reference``: the plain-torch twins, through their validating op wrappers;
    ``compiled``: the library), and a count of their calls: the apex facades' fused steps are
    held to both."""
    if request.param == "compiled" and af.ops.backend() == "reference":
        pytest.skip("the compiled library is not built here")
    calls = {"adam": 0, "sgd": 0, "backend": request.param}
    adam, sgd = af.ops.adam_step_, af.ops.sgd_step_

    def adam_step_(params, grads, m, v, vmax, model, step, grad_scale, finite, **h):
        calls["adam"] += 1
        if request.param == "compiled":
            return adam(params, grads, m, v, vmax, model, step, grad_scale, finite, **h)
        af.ops._ref_adam_step_op(params, grads, m, v, vmax or [], model or [], step, grad_scale, finite, h["lr"], None,
                                 h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["amsgrad"],
                                 h["decoupled_weight_decay"], h["maximize"])

    def sgd_step_(params, grads, bufs, model, step, grad_scale, finite, **h):
        calls["sgd"] += 1
        if request.param == "compiled":
            return sgd(params, grads, bufs, model, step, grad_scale, finite, **h)
        af.ops._ref_sgd_step_op(params, grads, bufs or [], model or [], step, grad_scale, finite, h["lr"], None,
                                h["weight_decay"], h["momentum"], h["dampening"], h["nesterov"], h["maximize"])

    # The in-place steps that take their own skip decision run here as what they stand for
    # (check, then the counted step above with its flag).
    def adam_step_checked_(params, grads, m, v, vmax, model, step, grad_scale, **h):
        finite = af.ops._finite_for(list(grads), grad_scale)
        adam_step_(params, grads, m, v, vmax, model, step, grad_scale, finite, **h)
        return finite

    def sgd_step_checked_(params, grads, bufs, model, step, grad_scale, **h):
        finite = af.ops._finite_for(list(grads), grad_scale)
        sgd_step_(params, grads, bufs, model, step, grad_scale, finite, **h)
        return finite

    monkeypatch.setattr(af.ops, "adam_step_", adam_step_)
    monkeypatch.setattr(af.ops, "sgd_step_", sgd_step_)
    monkeypatch.setattr(af.ops, "adam_step_checked_", adam_step_checked_)
    monkeypatch.setattr(af.ops, "sgd_step_checked_", sgd_step_checked_)
    return calls


@pytest.fixture
def fresh_amp_state():
    """Leaves apex amp's process-wide state as a fresh import has it, whatever the test did."""
    yield
    if _amp_state.handle is not None:
        _amp_state.handle._deactivate()
    _amp_state.allow_incoming_model_not_fp32 = False
