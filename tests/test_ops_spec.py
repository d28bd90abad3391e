"""One definition per fused op (ampfunc/ops/_spec.py): what derives from the spec table agrees
with it, and the C++ side's table (ext/glue/spec.h) agrees with the Python one."""

import inspect
import re

import pytest
import torch

from ampfunc import ops
from ampfunc.ops import _spec

# The schemas the ops had when they were written by hand: the table must derive them exactly.
_WRITTEN_BY_HAND = {
    "adam_step_": (
        "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] model_params, Tensor(f!) step, Tensor grad_scale, "
        "Tensor finite, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
        "bool amsgrad, bool decoupled_weight_decay, bool maximize) -> ()"),
    "sgd_update": (
        "sgd_update(Tensor[] params, Tensor[] grads, Tensor[] momentum_buffers, Tensor step, Tensor grad_scale, "
        "float lr, Tensor? lr_tensor, float weight_decay, float momentum, float dampening, bool nesterov, "
        "bool maximize) -> (Tensor[] updates, Tensor[] new_momentum_buffers, Tensor new_step)"),
    "sgd_step": (
        "sgd_step(Tensor[] params, Tensor[] grads, Tensor[] momentum_buffers, Tensor[] model_params, Tensor step, "
        "Tensor grad_scale, Tensor finite, float lr, Tensor? lr_tensor, float weight_decay, float momentum, "
        "float dampening, bool nesterov, bool maximize) -> (Tensor[] new_params, Tensor[] new_momentum_buffers, "
        "Tensor[] new_model_params, Tensor new_step)"),
    "apply_updates": "apply_updates(Tensor[] params, Tensor[] updates) -> Tensor[]",
    "check": "check(Tensor[] tensors, bool per_leaf) -> (Tensor finite, Tensor sumsq, Tensor leaf_nonfinite)",
}


@pytest.mark.parametrize("name", sorted(_WRITTEN_BY_HAND))
def test_the_schema_derived_from_the_spec_is_the_one_written_by_hand(name):
    derived = torch._C.parse_schema("ampfunc::" + _spec.OPS[name].schema())
    assert str(derived) == str(torch._C.parse_schema("ampfunc::" + _WRITTEN_BY_HAND[name]))


def test_every_op_of_the_table_is_registered_with_its_schema():
    for name, spec in _spec.OPS.items():
        registered = getattr(torch.ops.ampfunc, name).default._schema
        assert str(registered) == str(torch._C.parse_schema("ampfunc::" + spec.schema())), name


def test_each_optimizer_has_its_four_functions_with_the_specs_signature():
    for opt in _spec.OPTIMIZERS.values():
        for suffix in ("_step_", "_step", "_step_checked", "_update"):
            fn = getattr(ops, opt.name + suffix)
            params = inspect.signature(fn).parameters
            assert [h.name for h in opt.hypers] == [n for n, p in params.items()
                                                    if p.kind is p.KEYWORD_ONLY and n != "lr"], fn.__name__
            assert all(params[h.name].default == h.default for h in opt.hypers)
            assert fn.__doc__ and opt.name in fn.__name__


def test_the_cpp_spec_table_is_the_python_one():
    if ops.backend() == "reference":
        pytest.skip("compiled kernels not built")
    door = ops._DIRECT[0]
    if door is None:
        pytest.skip("the direct door is off (AMPFUNC_DIRECT=0)")
    cpp = door.spec()
    python = {o.name: {"state": [(s.name, s.when) for s in o.state], "hypers": [(h.name, h.kind) for h in o.hypers]}
              for o in _spec.OPTIMIZERS.values()}
    assert {k: {"state": list(v["state"]), "hypers": list(v["hypers"])} for k, v in cpp.items()} == python


def test_a_state_list_a_hyper_parameter_turns_off_is_neither_validated_nor_returned():
    # momentum 0: momentum_buffers is not looked at (a wrong dtype there is no error) and comes back empty
    p, g = [torch.zeros(3)], [torch.ones(3)]
    bad = [torch.zeros(3, dtype=torch.int32)]
    d, b, s = ops.sgd_update(p, g, bad, torch.zeros(()), lr=0.1)
    assert b == [] and torch.equal(d[0], torch.full((3,), -0.1))
    with pytest.raises(TypeError, match=r"momentum_buffers\[0\] has dtype torch.int32"):
        ops.sgd_update(p, g, bad, torch.zeros(()), lr=0.1, momentum=0.9)


def _adam_args(n=3):
    return ([torch.ones(n)], [torch.ones(n)], [torch.zeros(n)], [torch.zeros(n)], [], [], torch.zeros(()),
            torch.ones(()))


def _sgd_args(n=3):
    return [torch.ones(n)], [torch.ones(n)], [torch.zeros(n)], [], torch.zeros(()), torch.ones(())


_FINITE = torch.ones((), dtype=torch.bool)
_HYPER_DOORS = {
    "adam_step_": lambda kw: ops.adam_step_(*_adam_args(), _FINITE, **kw),
    "adam_step": lambda kw: ops.adam_step(*_adam_args(), _FINITE, **kw),
    "adam_step_checked": lambda kw: ops.adam_step_checked(*_adam_args(), **kw),
    "adam_update": lambda kw: ops.adam_update(*(_adam_args()[:4] + ([],) + _adam_args()[6:]), **kw),
    "sgd_step_": lambda kw: ops.sgd_step_(*_sgd_args(), _FINITE, **kw),
    "sgd_step": lambda kw: ops.sgd_step(*_sgd_args(), _FINITE, **kw),
    "sgd_step_checked": lambda kw: ops.sgd_step_checked(*_sgd_args(), **kw),
    "sgd_update": lambda kw: ops.sgd_update(*(_sgd_args()[:3] + _sgd_args()[4:]), **kw),
}
_BAD_HYPERS = {
    "adam": [dict(lr=float("nan")), dict(lr=-1e-3), dict(lr=float("inf")), dict(lr=1e39), dict(lr=0.1, beta1=1.0),
             dict(lr=0.1, beta2=1.0), dict(lr=0.1, beta1=-0.1), dict(lr=0.1, beta2=float("nan")),
             dict(lr=0.1, eps=-1e-8), dict(lr=0.1, weight_decay=float("nan"))],
    "sgd": [dict(lr=float("nan")), dict(lr=-0.1), dict(lr=0.1, momentum=-0.9), dict(lr=0.1, dampening=float("nan")),
            dict(lr=0.1, weight_decay=-1.0)],
}


@pytest.mark.parametrize("op", sorted(_HYPER_DOORS))
def test_the_ops_refuse_hyper_parameters_the_optimizers_refuse_naming_them(op, monkeypatch):
    written = []
    monkeypatch.setattr(ops, "_call", lambda *a, **k: written.append(a))  # nothing may reach the kernels
    monkeypatch.setattr(ops, "_through_door", lambda *a, **k: written.append(a))
    for kw in _BAD_HYPERS[op.split("_")[0]]:
        bad = next(k for k in kw if k != "lr") if len(kw) > 1 else "lr"
        with pytest.raises(ValueError, match=rf"^ampfunc: {bad} must be .*, got {re.escape(repr(kw[bad]))} \({op}\)$"):
            _HYPER_DOORS[op](kw)
    assert written == []


def test_hyper_parameters_at_the_edges_of_their_ranges_still_step():
    params, grads, m, v, vmax, model, step, scale = _adam_args()
    ops.adam_step_(params, grads, m, v, vmax, model, step, scale, _FINITE, lr=0.0, beta1=0.0, beta2=0.0, eps=0.0)
    assert step.item() == 1.0 and torch.equal(params[0], torch.ones(3))
    # a tensor lr is read on the device: not checked at the door (no host sync)
    ops.adam_step_(params, grads, m, v, vmax, model, step, scale, _FINITE, lr=torch.tensor(0.5))
    assert step.item() == 2.0
