"""``ops.*_step_checked_``: the in-place step that takes its own skip decision.

It is ``check`` followed by ``*_step_`` with that flag (and-ed with the scale not being NaN),
bit for bit, on both doors: eager CPU calls run the two passes in one call through the direct
door; the reference backend, CUDA and traced calls compose the two ops. The engine's in-place
fused step uses it whenever nothing runs between the check and the step.
"""

from __future__ import annotations

import pytest
import torch

import ampfunc as af
from _helpers import SpyDoor
from ampfunc import ops

ops.load()
DOOR = ops._DIRECT[0]
DOORS = [pytest.param(True, id="direct", marks=pytest.mark.skipif(DOOR is None, reason="compiled kernels not built")),
         pytest.param(False, id="composed")]


def _use_door(direct, monkeypatch):
    if not direct:
        monkeypatch.setattr(ops._loading, "_DIRECT", [None])


def _tree(seed, sizes=(1, 7, 33, 1000, 40000)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in sizes]


def _grads(seed, poison):
    g = _tree(seed)
    g[1] = g[1].half()  # gradients of any float dtype
    if poison == "inf":
        g[4][123] = float("inf")
    elif poison == "nan_fp16":
        g[1][3] = float("nan")
    return g


# name -> (state lists, hyper-parameters); each call gets fresh lists. Adam's ops take three state
# lists, the third (max_exp_avg_sqs) empty without amsgrad.
OPTIMIZERS = {
    "adam": (2, dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, amsgrad=False,
                     decoupled_weight_decay=True, maximize=False)),
    "amsgrad": (3, dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, amsgrad=True,
                        decoupled_weight_decay=False, maximize=False)),
    "sgd": (1, dict(weight_decay=0.01, momentum=0.9, dampening=0.1, nesterov=True, maximize=False)),
    "lion": (1, dict(beta1=0.9, beta2=0.99, weight_decay=0.1)),
}


def _op(name, suffix):
    return getattr(ops, ("adam" if name == "amsgrad" else name) + suffix)


def _args(name, poison="none"):
    """(params, grads, *state, model_params, step, grad_scale): fresh tensors."""
    n_state, _ = OPTIMIZERS[name]
    state = [[t.abs() for t in _tree(2 + k)] for k in range(n_state)] + ([[]] if name == "adam" else [])
    gs = torch.full((), float("nan") if poison == "nan_scale" else 0.5)
    return (_tree(0), _grads(1, poison), *state, [t.half() for t in _tree(0)], torch.full((), 3.0), gs)


def _clone(args):
    return tuple([t.clone() for t in a] if isinstance(a, list) else a.clone() for a in args)


def _flat(args):
    return [t for a in args for t in (a if isinstance(a, list) else [a])]


@pytest.mark.parametrize("direct", DOORS)
@pytest.mark.parametrize("poison", ["none", "inf", "nan_fp16", "nan_scale"])
@pytest.mark.parametrize("lr", [1e-2, "tensor"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_it_is_check_then_the_in_place_step_bit_for_bit(name, lr, poison, direct, monkeypatch):
    _use_door(direct, monkeypatch)
    _, hyper = OPTIMIZERS[name]
    kw = dict(hyper, lr=torch.full((), 1e-2) if lr == "tensor" else lr)
    a, b = _args(name, poison), None
    b = _clone(a)
    finite = _op(name, "_step_checked_")(*a, **kw)
    want = ops.check(b[1])[0] & ~b[-1].isnan()
    _op(name, "_step_")(*b, want, **kw)
    assert finite.dtype == torch.bool and finite.shape == () and bool(finite) == bool(want) == (poison == "none")
    for x, y in zip(_flat(a), _flat(b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    if poison != "none":  # a skipped step writes nothing: the step count stays
        assert float(a[-2]) == 3.0 and torch.equal(a[0][4], _tree(0)[4])


@pytest.mark.skipif(DOOR is None, reason="compiled kernels not built")
@pytest.mark.parametrize("poison", ["none", "inf"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_through_the_door_each_written_tensor_is_bumped_once_taken_or_skipped(name, poison):
    # as the door's in-place step does: autograd sees one write per call, whatever the flag said;
    # the gradients and the scale are only read
    a = _args(name, poison)
    before = [[t._version for t in (x if isinstance(x, list) else [x])] for x in a]
    _op(name, "_step_checked_")(*a, **dict(OPTIMIZERS[name][1], lr=1e-2))
    for i, x in enumerate(a):
        bumped = [t._version - v for t, v in zip(x if isinstance(x, list) else [x], before[i])]
        written = i not in (1, len(a) - 1)  # everything but the grads and grad_scale
        assert bumped == [1 if written else 0] * len(bumped), (i, bumped)


BAD = {
    "grad_shape": lambda a: (a[0], [t[:1] if i == 2 else t for i, t in enumerate(a[1])], *a[2:]),
    "short_grads": lambda a: (a[0], a[1][:-1], *a[2:]),
    "fp16_param": lambda a: ([t.half() if i == 0 else t for i, t in enumerate(a[0])], *a[1:]),
    "aliased_state": lambda a: (a[0], a[1], [a[0][i] if i == 1 else t for i, t in enumerate(a[2])], *a[3:]),
    "int_grad": lambda a: (a[0], [t.int() if i == 3 else t for i, t in enumerate(a[1])], *a[2:]),
}


@pytest.mark.parametrize("direct", DOORS)
@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("name", ["adam", "sgd", "lion"])
def test_bad_input_gets_the_composed_ops_error_and_nothing_is_written(name, bad, direct, monkeypatch):
    _use_door(direct, monkeypatch)
    kw = dict(OPTIMIZERS[name][1], lr=1e-2)
    a = BAD[bad](_args(name))
    snapshot = [t.clone() for t in _flat(a)]
    versions = [t._version for t in _flat(a)]
    with pytest.raises((ValueError, TypeError)) as checked:
        _op(name, "_step_checked_")(*a, **kw)
    monkeypatch.setattr(ops._loading, "_DIRECT", [None])  # the composition, through the dispatcher
    with pytest.raises((ValueError, TypeError)) as composed:
        _op(name, "_step_")(*a, ops.check(a[1])[0] & ~a[-1].isnan(), **kw)
    assert type(checked.value) is type(composed.value)
    assert str(checked.value).splitlines()[0] == str(composed.value).splitlines()[0]
    assert all(torch.equal(t, s) for t, s in zip(_flat(a), snapshot))
    assert [t._version for t in _flat(a)] == versions


def test_a_call_the_door_cannot_take_is_composed_with_the_same_numbers():
    if DOOR is None:
        pytest.skip("compiled kernels not built")
    kw = dict(OPTIMIZERS["adam"][1], lr=1e-2)
    a = _args("adam")
    b = _clone(a)
    b = (b[0], [b[1][0].requires_grad_(), *b[1][1:]], *b[2:])
    assert DOOR.adam_step_checked_(*b[:8], 1e-2, None, 0.9, 0.99, 1e-8, 0.01, False, True, False) is NotImplemented
    ops.adam_step_checked_(*b, **kw)  # a gradient requiring grad, grad mode on: the dispatcher's ops
    ops.adam_step_checked_(*a, **kw)
    for x, y in zip(_flat(a), _flat(b)):
        assert torch.equal(x, y.detach())


@pytest.mark.parametrize("inner, want", [
    (lambda: af.adamw(1e-2), ["adam_step_checked_"]),
    (lambda: af.lion(1e-3), ["lion_step_checked_"]),
    (lambda: af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2)), ["check_norm", "adam_step_"]),
], ids=["adamw", "lion", "clip+adamw"])
def test_the_engines_in_place_step_is_one_call_unless_a_norm_comes_between(inner, want, monkeypatch):
    if DOOR is None:
        pytest.skip("compiled kernels not built")
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = af.mixed_precision(inner(), af.DynamicLossScale(2.0**4))
    state = tx.init(params)
    spy = SpyDoor(DOOR)
    monkeypatch.setattr(ops._loading, "_DIRECT", [spy])
    tx.step_(params, grads, state)
    assert [(name, True) for name in want] == [c for c in spy.calls if c[0].startswith(("check", "adam", "lion"))]


def test_the_engines_in_place_step_skips_and_halves_the_scale_on_an_overflow():
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"w": torch.full((4, 3), float("inf")), "b": torch.randn(3)}
    tx = af.mixed_precision(af.adamw(1e-2), af.DynamicLossScale(2.0**4))
    state = tx.init(params)
    before = [t.clone() for t in af.tree.tree_leaves((params, state.inner))]
    params, state = tx.step_(params, grads, state)
    assert not bool(state.finite) and int(state.skipped) == 1
    assert float(state.loss_scale.loss_scale) == 2.0**3
    assert all(torch.equal(a, b) for a, b in zip(af.tree.tree_leaves((params, state.inner)), before))
