"""The direct door and the output pool of the compiled CPU kernels.

Eager calls on plain CPU tensors skip the dispatcher (``ampfunc.ops._call`` -> the library's
``direct`` module) and run the same implementation as ``torch.ops.ampfunc.*``: the same bits, the
same errors, the same version-counter bumps. Anything the dispatcher would route elsewhere
(autograd, subclasses, modes, other devices) is handed back and takes ``torch.ops``. The
out-of-place kernels take their outputs from a pool of dead outputs' blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _helpers import SpyDoor
from ampfunc import ops

ops.load()
DOOR = ops._DIRECT[0]
pytestmark = pytest.mark.skipif(DOOR is None, reason="compiled kernels not built")


def _tree(seed, n=5, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 7, 33, 1000, 40000][:n]
    return [torch.randn(s, generator=gen).to(dtype) for s in sizes]


def _grads(seed):
    g = _tree(seed)
    g[1] = g[1].half()  # grads of any float dtype
    g[3] = torch.randn(2000, generator=torch.Generator().manual_seed(seed))[::2]  # non-contiguous
    return g


def _scalars():
    return (torch.zeros(()), torch.full((), 0.5), torch.ones((), dtype=torch.bool))


def _args(name):
    """Fresh arguments of op ``name`` (the schema's order, lists as lists)."""
    p, g, m, v, vmax = _tree(0), _grads(1), _tree(2), [t.abs() for t in _tree(3)], [t.abs() for t in _tree(4)]
    model = [t.half() for t in p]
    step, gs, fin = _scalars()
    lr_t = torch.full((), 1e-2)
    return {
        "check": ([*g], True),
        "check_norm": ([*g], torch.full((), 0.25), True),
        "unscale_": ([t.clone() for t in g], torch.full((), 0.25)),
        "unscale": ([*g], torch.full((), 0.25)),
        "sgd_step_": (p, g, m, model, step, gs, fin, 0.05, None, 0.01, 0.9, 0.1, True, False),
        "sgd_step": (p, g, m, model, step, gs, fin, 0.05, lr_t, 0.01, 0.9, 0.1, False, True),
        "adam_step_": (p, g, m, v, vmax, model, step, gs, fin, 1e-3, None, 0.9, 0.99, 1e-8, 0.01, True, True, False),
        "adam_step": (p, g, m, v, [], [], step, gs, fin, 1e-3, lr_t, 0.9, 0.99, 1e-8, 0.1, False, False, False),
        "sgd_update": (p, g, m, step, gs, 0.05, None, 0.01, 0.9, 0.0, False, False),
        "adam_update": (p, g, m, v, vmax, step, gs, 1e-3, None, 0.9, 0.99, 1e-8, 0.01, True, True, False),
        "apply_updates": (p, _tree(5)),
        # the generic optimizers' (ext/optimizers.h): one binding per form for all of them
        "lion_step_": (p, g, m, model, step, gs, fin, 1e-2, None, 0.9, 0.99, 0.1),
        "lion_step": (p, g, m, model, step, gs, fin, 0.0, lr_t, 0.8, 0.95, 0.0),
        "lion_step_checked": (p, g, m, model, step, gs, 1e-2, None, 0.9, 0.99, 0.1),
        "lion_update": (p, g, m, step, gs, 0.0, lr_t, 0.9, 0.99, 0.1),
    }[name]


OPS = ["check", "check_norm", "unscale_", "unscale", "sgd_step_", "sgd_step", "adam_step_", "adam_step",
       "sgd_update", "adam_update", "apply_updates", "lion_step_", "lion_step", "lion_update"]


def _clone(args):
    return tuple([t.clone() for t in a] if isinstance(a, list) else a.clone() if isinstance(a, torch.Tensor) else a
                 for a in args)


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flat(y)]
    return []


@pytest.mark.parametrize("name", OPS)
def test_the_direct_door_gives_the_dispatchers_bits_in_its_outputs_and_in_place_writes(name):
    a, b = _args(name), None
    b = _clone(a)
    out_direct = getattr(DOOR, name)(*a)
    assert out_direct is not NotImplemented
    out_op = getattr(torch.ops.ampfunc, name)(*b)
    for x, y in zip(_flat(out_direct) + _flat(a), _flat(out_op) + _flat(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y) or torch.equal(x.nan_to_num(), y.nan_to_num())


WRITTEN = {"unscale_": [0], "sgd_step_": [0, 2, 3, 4], "adam_step_": [0, 2, 3, 4, 5, 6], "lion_step_": [0, 2, 3, 4]}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_in_place_calls_bump_the_version_counter_of_each_written_tensor_once(name):
    # as in-place torch ops do (ADInplaceOrView), so autograd notices a step taken on a tensor it
    # saved for backward; the tensors only read keep their version
    a = _args(name)
    before = [[t._version for t in _flat(x)] for x in a]
    getattr(DOOR, name)(*a)
    for i, x in enumerate(a):
        bumped = [t._version - v for t, v in zip(_flat(x), before[i])]
        assert bumped == [1 if i in WRITTEN[name] else 0] * len(bumped), (i, bumped)


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_call_because_the_door_hands_it_back():
    args = _args("check")
    with _Counting() as mode:
        assert DOOR.check(*args) is NotImplemented
        ops.check(args[0])
    assert any("ampfunc.check" in s for s in mode.seen)


@pytest.mark.parametrize("odd", ["requires_grad", "meta", "sparse", "neg_view", "none", "inference_ok"])
def test_the_door_takes_only_what_the_dispatcher_would_send_to_the_cpu_kernel(odd):
    g = _grads(1)
    if odd == "requires_grad":
        g[0] = g[0].clone().requires_grad_()
    elif odd == "meta":
        g[0] = torch.empty(3, device="meta")
    elif odd == "sparse":
        g[0] = torch.eye(3).to_sparse()
    elif odd == "neg_view":
        g[0] = torch._neg_view(g[0])
    elif odd == "none":
        g[0] = None
    if odd == "inference_ok":
        with torch.inference_mode():
            t = [x.clone() for x in g]
            assert DOOR.check(t, False) is not NotImplemented
        return
    assert DOOR.check(g, False) is NotImplemented
    with torch.no_grad():
        if odd == "requires_grad":  # without grad mode the door takes it
            assert DOOR.check(g, False) is not NotImplemented


BAD = {
    "shape": lambda a: (a[0], [t[:1] if i == 2 else t for i, t in enumerate(a[1])], *a[2:]),
    "fp16_param": lambda a: ([t.half() if i == 0 else t for i, t in enumerate(a[0])], *a[1:]),
    "aliased_state": lambda a: (a[0], a[1], [a[0][i] if i == 1 else t for i, t in enumerate(a[2])], *a[3:]),
    "short_list": lambda a: (a[0], a[1][:-1], *a[2:]),
}


@pytest.mark.parametrize("name", ["adam_step_", "lion_step_"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_input_gets_the_dispatchers_error_through_the_door_and_nothing_is_written(bad, name):
    a, b = BAD[bad](_args(name)), BAD[bad](_args(name))
    snapshot = [t.clone() for t in _flat(a)]
    versions = [t._version for t in _flat(a)]
    with pytest.raises((ValueError, TypeError)) as direct:
        getattr(DOOR, name)(*a)
    with pytest.raises((ValueError, TypeError)) as dispatched:
        getattr(torch.ops.ampfunc, name)(*b)
    assert type(direct.value) is type(dispatched.value)
    assert str(direct.value).splitlines()[0] == str(dispatched.value).splitlines()[0]
    assert str(direct.value).startswith("ampfunc: ")
    for t, s in zip(_flat(a), snapshot):
        assert torch.equal(t, s)
    # the door bumps once the arguments are validated, before the first write: a refused call
    # leaves every version counter as it was (autograd would otherwise see a phantom write)
    assert [t._version for t in _flat(a)] == versions


@pytest.mark.parametrize("name", ["sgd_step_", "adam_step_", "lion_step_"])
def test_a_skipped_step_through_the_door_bumps_as_a_taken_one(name):
    # the door bumps once the arguments are validated, before the skip is read: what a version
    # counter says does not depend on the step's finiteness (a torch in-place op bumps even when
    # it writes the values already there)
    a = list(_args(name))
    a[{"sgd_step_": 6, "adam_step_": 8, "lion_step_": 6}[name]] = torch.tensor(False)
    before = [[t._version for t in _flat(x)] for x in a]
    snapshot = [t.clone() for t in _flat(a)]
    getattr(DOOR, name)(*a)
    for i, x in enumerate(a):
        bumped = [t._version - v for t, v in zip(_flat(x), before[i])]
        assert bumped == [1 if i in WRITTEN[name] else 0] * len(bumped), (i, bumped)
    assert all(torch.equal(t, s) for t, s in zip(_flat(a), snapshot))


def test_the_profiler_records_a_direct_call_under_the_ops_name():
    args = _args("adam_step_")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops._call("adam_step_", *args)
    assert "ampfunc::adam_step_" in {e.key for e in prof.key_averages()}


def test_kernel_ready_in_c_answers_as_the_python_loop():
    f32, f16 = _tree(0), _tree(1, dtype=torch.float16)
    p = torch.nn.Parameter(torch.zeros(3))
    cases = [([f32], [f16], True), ([f16], [], False), ([f32], [[torch.zeros(2, dtype=torch.float64)]], False),
             ([[p]], [], None), ([[torch.zeros(2, device="meta")]], [], False), ([[1.0]], [], False)]
    for fp32_lists, float_lists, want in cases:
        if want is None:  # a parameter requiring grad: fine without grad mode, refused with it
            with torch.no_grad():
                assert ops.kernel_ready(torch.device("cpu"), fp32_lists, float_lists)
            assert not ops.kernel_ready(torch.device("cpu"), fp32_lists, float_lists)
        else:
            assert ops.kernel_ready(torch.device("cpu"), fp32_lists, float_lists) is want


def test_out_of_place_outputs_reuse_the_blocks_of_dead_outputs():
    p, g = _tree(0), _tree(1)
    ups = ops.apply_updates(p, g)  # sizes seen once
    del ups
    before = ops.pool_stats()
    for _ in range(3):
        out = ops.apply_updates(p, g)
        assert all(torch.equal(o, x + y) for o, x, y in zip(out, p, g))
        del out
    after = ops.pool_stats()
    assert after["hits"] - before["hits"] >= 3 * len(p)
    assert after["cached_bytes"] <= after["limit_bytes"]


def test_a_pooled_output_is_an_ordinary_tensor_that_outlives_empty_cache_and_can_grow():
    p, g = _tree(0), _tree(1)
    out = ops.apply_updates(p, g)
    want = [o.clone() for o in out]
    ops.empty_cache()
    assert ops.pool_stats()["cached_bytes"] == 0
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    big = out[-1]
    big.resize_(2 * big.numel())
    big[-1] = 3.0
    assert torch.equal(big[: want[-1].numel()], want[-1]) and big[-1] == 3.0
    del out, big
    assert ops.pool_stats()["cached_bytes"] > 0
    assert ops.empty_cache() > 0


def test_AMPFUNC_CPU_POOL_MB_0_turns_the_pool_off():
    code = ("import torch; from ampfunc import ops; ops.load(); p=[torch.ones(1000)]*1; "
            "[ops.apply_updates([torch.ones(1000)], [torch.ones(1000)]) for _ in range(3)]; s=ops.pool_stats(); "
            "assert s['limit_bytes'] == 0 and s['hits'] == 0 and s['cached_bytes'] == 0, s; print('ok')")
    env = {**os.environ, "AMPFUNC_CPU_POOL_MB": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_grads_of_and_clear_grads_read_and_drop_dot_grad_as_python_does():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    params = list(model.parameters())
    params[-1].grad = None
    got = ops.grads_of(params)
    assert [g is p.grad for g, p in zip(got, params)] == [True] * len(params)
    assert got[-1] is None
    ops.clear_grads(params)
    assert all(p.grad is None for p in params)
    with pytest.raises(TypeError):
        ops.grads_of([params[0], 1.0])
    with pytest.raises(TypeError):
        ops.clear_grads([params[0], "x"])


def test_new_optimizer_state_and_updates_are_views_of_one_block_per_list():
    p, g = _tree(0), _tree(1)
    m, v = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
    one = torch.ones(())
    updates, new_m, new_v, _, _ = ops.adam_update(p, g, m, v, None, torch.zeros(()), one, lr=1e-3)
    for outs in (updates, new_m, new_v):
        assert len({t.untyped_storage().data_ptr() for t in outs}) == 1  # one allocation per list
        assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 for t in outs)  # each on its own lines
        assert [t.shape for t in outs] == [x.shape for x in p]
    # ...yet each is a tensor of its own: writing one leaves its neighbours and their versions alone
    before = [t.clone() for t in new_m]
    versions = [t._version for t in new_m]
    new_m[2].add_(1.0)
    assert new_m[2]._version == versions[2] + 1
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(new_m, before)) if i != 2)
    assert [t._version for i, t in enumerate(new_m) if i != 2] == [x for i, x in enumerate(versions) if i != 2]
    # the new params stay separate allocations (saving one param saves that param only)
    new_p, *_ = ops.adam_step(p, g, m, v, None, None, torch.zeros(()), one, torch.ones((), dtype=torch.bool),
                              lr=1e-3)
    assert len({t.untyped_storage().data_ptr() for t in new_p}) == len(p)


@pytest.mark.parametrize("n", [3, 5000])  # shorter and longer than the prefetch distance
def test_copy_on_write_params_are_materialized_before_an_in_place_step_writes(n):
    base = [torch.ones(4) for _ in range(n)]
    params = [torch._lazy_clone(b) for b in base]  # share base's data until written
    grads = [torch.full((4,), 2.0) for _ in range(n)]
    m, v = [torch.zeros(4) for _ in range(n)], [torch.zeros(4) for _ in range(n)]
    ops.adam_step_(params, grads, m, v, None, None, torch.zeros(()), torch.ones(()),
                   torch.ones((), dtype=torch.bool), lr=0.1)
    assert all(torch.equal(b, torch.ones(4)) for b in base)
    assert all(float(p[0]) < 1.0 for p in params)


def test_a_long_list_with_one_tensor_the_door_cannot_take_goes_to_the_dispatcher():
    n = 5000  # the refused tensor deep in a list read with prefetching
    p = [torch.randn(3) for _ in range(n)]
    p[4321] = torch.randn(3, requires_grad=True)  # grad mode is on: the door must hand it back
    u = [torch.randn(3) for _ in range(n)]
    with torch.no_grad():
        want = [a + b for a, b in zip(p, u)]
    assert DOOR.apply_updates(p, u) is NotImplemented
    out = ops.apply_updates(p, u)
    assert all(torch.equal(o, w) for o, w in zip(out, want))


# ---------------------------------------------------------------------------------------------
# adam_step_checked: the pure step's check folded into its pass (door only; elsewhere composed)
# ---------------------------------------------------------------------------------------------


def _checked_args(poison, amsgrad):
    p, g, m, v, vmax = _tree(0), _grads(1), _tree(2), [t.abs() for t in _tree(3)], [t.abs() for t in _tree(4)]
    model = [t.half() for t in p]
    gs = torch.full((), 0.5)
    if poison == "inf":
        g[4][123] = float("inf")  # in the largest tensor, split between the threads
    elif poison == "nan_fp16":
        g[1][3] = float("nan")
    elif poison == "nan_scale":
        gs = torch.full((), float("nan"))
    return (p, g, m, v, vmax if amsgrad else [], model, torch.full((), 3.0), gs)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("poison", ["none", "inf", "nan_fp16", "nan_scale"])
@pytest.mark.parametrize("lr", [1e-2, "tensor"])
def test_adam_step_checked_is_check_then_adam_step_bit_for_bit(poison, amsgrad, lr):
    # one pass instead of two, the same outputs and flag as the two ops it replaces; a skipped
    # step hands back copies of the inputs and the old step count, and the inputs are only read
    a = _checked_args(poison, amsgrad)
    snapshot = [t.clone() for t in _flat(a)]
    lr = torch.full((), 1e-2) if lr == "tensor" else lr
    kw = dict(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, amsgrad=amsgrad,
              decoupled_weight_decay=True, maximize=False)
    got = ops.adam_step_checked(*a, **kw)
    for t, s in zip(_flat(a), snapshot):  # bit for bit, the poisoned NaN included
        torch.testing.assert_close(t, s, rtol=0, atol=0, equal_nan=True)
    finite = ops.check(a[1])[0] & ~a[7].isnan()
    want = ops.adam_step(*a, finite, **kw) + (finite,)
    assert bool(got[6]) == (poison == "none")
    for x, y in zip(_flat(list(got)), _flat(list(want))):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if poison != "none":
        assert float(got[5]) == 3.0
        assert all(torch.equal(x, y) for x, y in zip(got[0], a[0]))


def test_adam_step_checked_hands_back_to_the_composition_for_what_the_door_does_not_take():
    # a grad requiring grad under grad mode goes to the dispatcher's ops: the same answer
    a = _checked_args("none", False)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, amsgrad=False,
              decoupled_weight_decay=False, maximize=False)
    b = (a[0], [t.clone().requires_grad_() if i == 0 else t for i, t in enumerate(a[1])], *a[2:])
    assert DOOR.adam_step_checked(*b[:8], 1e-2, None, 0.9, 0.99, 1e-8, 0.0, False, False, False) is NotImplemented
    for x, y in zip(_flat(list(ops.adam_step_checked(*b, **kw))), _flat(list(ops.adam_step_checked(*a, **kw)))):
        assert torch.equal(x, y)


def test_adam_step_checked_refuses_bad_input_as_adam_step_does():
    a = list(_checked_args("none", False))
    a[2] = [t[:1] if i == 2 else t for i, t in enumerate(a[2])]  # a moment of the wrong shape
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, amsgrad=False,
              decoupled_weight_decay=False, maximize=False)
    with pytest.raises(ValueError) as checked:
        ops.adam_step_checked(*a, **kw)
    with pytest.raises(ValueError) as plain:
        ops.adam_step(*a, torch.ones((), dtype=torch.bool), **kw)
    assert str(checked.value).splitlines()[0] == str(plain.value).splitlines()[0]


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["plain", "momentum"])
@pytest.mark.parametrize("poison", ["none", "inf", "nan_fp16", "nan_scale"])
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_sgd_step_checked_is_check_then_sgd_step_bit_for_bit(poison, momentum, first):
    p, g, bufs, _, _, model, step, gs = _checked_args(poison, False)
    a = (p, g, bufs, model, torch.full((), 0.0 if first else 3.0), gs)
    snapshot = [t.clone() for t in _flat(a)]
    kw = dict(lr=0.05, weight_decay=0.01, momentum=momentum, dampening=0.1, nesterov=momentum != 0, maximize=False)
    got = ops.sgd_step_checked(*a, **kw)
    for t, s in zip(_flat(a), snapshot):
        torch.testing.assert_close(t, s, rtol=0, atol=0, equal_nan=True)
    finite = ops.check(g)[0] & ~gs.isnan()
    want = ops.sgd_step(*a, finite, **kw) + (finite,)
    assert bool(got[4]) == (poison == "none")
    for x, y in zip(_flat(list(got)), _flat(list(want))):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("door", [True, False], ids=["direct", "torch"])
def test_bump_versions_and_requires_grad_changed_on_both_doors(door, monkeypatch):
    if not door:
        monkeypatch.setattr(ops._loading, "_DIRECT", [None])
    ts = [torch.zeros(2, requires_grad=True), torch.zeros(3), torch.zeros(1, requires_grad=True)]
    before = [t._version for t in ts]
    ops.bump_versions(ts)
    assert [t._version for t in ts] == [v + 1 for v in before]
    assert ops.requires_grad_changed(ts, bytes([1, 0, 1])) == -1
    ts[1].requires_grad_(True)
    assert ops.requires_grad_changed(ts, bytes([1, 0, 1])) == 1
    assert ops.requires_grad_changed(ts, bytes([0, 1, 1])) == 0


# ---------------------------------------------------------------------------------------------
# ampfunc.tree's per-leaf loops, run by the door in C: the same answers as their Python twins
# ---------------------------------------------------------------------------------------------


class _Key(str):
    """A key equal to a str but not the same object (compared with ==, as list(d) != keys does)."""


def _tree_cases():
    t = [torch.zeros(1) for _ in range(4)]
    d = {f"k{i}": x for i, x in enumerate(t)}
    return {
        "same dict": [d, d],
        "same keys": [d, {k: torch.ones(1) for k in d}, {k: 3 for k in d}],
        "equal keys": [d, {_Key(k): v for k, v in d.items()}],
        "equal str keys": [d, {"".join(["k", str(i)]): x for i, x in enumerate(t)}, d],
        "one str key differs": [d, {"".join(["k", str(i if i != 2 else 7)]): x for i, x in enumerate(t)}],
        "str then equal keys": [d, {"".join(["k", str(i)]): x for i, x in enumerate(t)},
                                {_Key(k): v for k, v in d.items()}],
        "other order": [d, dict(reversed(list(d.items())))],
        "other key": [d, {**{k: v for k, v in d.items() if k != "k3"}, "k9": t[3]}],
        "shorter": [d, {"k0": t[0]}],
        "empty": [{}, {}],
        "not a dict": [d, list(t)],
        "ordered dict": [d, __import__("collections").OrderedDict(d)],
        "first not a dict": [list(t), d],
        "no trees": [],
    }


@pytest.mark.parametrize("case", sorted(_tree_cases()))
def test_the_tree_loops_in_c_answer_as_their_python_twins(case, monkeypatch):
    from ampfunc import tree

    trees = _tree_cases()[case]
    if case.startswith(("equal str", "one str", "str then")):
        assert all(a is not b for a, b in zip(trees[0], trees[1]))  # other objects, compared by value
    c_values = tree.dict_values_aligned(trees)
    with monkeypatch.context() as mp:
        mp.setattr(tree, "_door", lambda: None)
        py_values = tree.dict_values_aligned(trees)
    assert (c_values is None) == (py_values is None)
    if py_values is None:
        return
    assert [[id(x) for x in vs] for vs in c_values] == [[id(x) for x in vs] for vs in py_values]
    for vs in py_values:
        for other in py_values:
            with monkeypatch.context() as mp:
                mp.setattr(tree, "_door", lambda: None)
                want_same, want_plain = tree.same_objects(vs, other), tree.plain_tensors(vs)
            assert tree.same_objects(vs, other) is want_same
            assert tree.plain_tensors(vs) is want_plain


@pytest.mark.parametrize("door", [True, False], ids=["c", "python"])
def test_dict_values_aligned_hands_back_a_known_list_only_while_the_dict_holds_its_very_objects(door, monkeypatch):
    from ampfunc import tree

    if not door:
        monkeypatch.setattr(tree, "_door", lambda: None)
    params = {f"l{i}": torch.zeros(2) for i in range(5)}
    grads = {k: torch.ones(2) for k in params}
    state = {k: torch.zeros(2) for k in params}
    first = tree.dict_values_aligned([params, grads, state])
    again = tree.dict_values_aligned([params, grads, state], [first[0], None, first[2]])
    assert again[0] is first[0] and again[2] is first[2]  # the known lists themselves
    assert again[1] is not first[1] and again[1] == first[1]  # no known list: a new one
    state["l3"] = torch.zeros(2)  # one tensor replaced: that tree's values are a new list
    moved = tree.dict_values_aligned([params, grads, state], [first[0], None, first[2]])
    assert moved[0] is first[0] and moved[2] is not first[2] and moved[2][3] is state["l3"]
    short = tree.dict_values_aligned([params, grads, state], [first[0][:4], None, None])
    assert short[0] is not first[0] and [id(x) for x in short[0]] == [id(x) for x in first[0]]


def test_plain_tensors_in_c_refuses_subclasses_and_non_tensors_by_exact_type():
    from ampfunc import tree

    class Sub(torch.Tensor):
        pass

    x = torch.zeros(2)
    assert tree.plain_tensors([x, torch.nn.Parameter(torch.zeros(1))]) is True
    assert tree.plain_tensors([x, x.as_subclass(Sub)]) is False
    assert tree.plain_tensors([x, None]) is False
    assert tree.plain_tensors([]) is True
    assert tree.same_objects([x, x], [x, x.view(2)]) is False  # equal values, other object
    assert tree.same_objects([x], [x, x]) is False


def test_a_long_in_place_call_bumps_every_written_tensor_once_and_no_read_one():
    # longer than the bump loop's prefetch distance, with views of one buffer among the leaves
    n = 50
    moments = torch.zeros(2, n * 3)
    p, g = [torch.randn(3) for _ in range(n)], [torch.randn(3) for _ in range(n)]
    m, v = list(moments[0].view(n, 3).unbind()), list(moments[1].view(n, 3).unbind())
    step = torch.zeros(())
    before = [[t._version for t in lst] for lst in (p, g, m, v)]
    DOOR.adam_step_(p, g, m, v, [], [], step, torch.ones(()), torch.ones((), dtype=torch.bool), 1e-3, None, 0.9,
                    0.99, 1e-8, 0.0, False, False, False)
    assert [t._version - b for t, b in zip(p, before[0])] == [1] * n
    assert [t._version - b for t, b in zip(g, before[1])] == [0] * n
    # the views of one buffer share its counter, as torch's in-place ops on views do: one bump
    # per written view
    assert [t._version - b for t, b in zip(m + v, before[2] + before[3])] == [2 * n] * (2 * n)
    assert moments._version == 2 * n and step._version == 1


# ---------------------------------------------------------------------------------------------
# The generic optimizers (ext/optimizers.h): the door's one binding per form serves every one
# ---------------------------------------------------------------------------------------------




def _lion_kw(lr=1e-2):
    return dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1)


@pytest.mark.parametrize("form", ["step_", "step", "step_checked", "update"])
def test_eager_generic_optimizer_calls_take_the_direct_door(form, monkeypatch):
    spy = SpyDoor(DOOR)
    monkeypatch.setattr(ops._loading, "_DIRECT", [spy])
    p, g, m = _tree(0), _grads(1), _tree(2)
    step, gs, fin = _scalars()
    if form == "step_":
        ops.lion_step_(p, g, m, None, step, gs, fin, **_lion_kw())
    elif form == "step":
        ops.lion_step(p, g, m, None, step, gs, fin, **_lion_kw())
    elif form == "step_checked":
        ops.lion_step_checked(p, g, m, None, step, gs, **_lion_kw())
    else:
        ops.lion_update(p, g, m, step, gs, **_lion_kw())
    assert spy.calls == [(f"lion_{form}", True)]


def test_mixed_precision_lion_step_in_place_takes_the_direct_door(monkeypatch):
    import ampfunc as af

    params = {"a": torch.randn(5), "b": torch.randn(3, 2)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    mp = af.mixed_precision(af.lion(1e-2, weight_decay=0.1), loss_scale=af.NoOpLossScale())
    state = mp.init(params)
    spy = SpyDoor(DOOR)
    monkeypatch.setattr(ops._loading, "_DIRECT", [spy])
    mp.step_(params, grads, state)
    assert ("lion_step_checked_", True) in spy.calls  # the check and the step in one call
    assert not [c for c in spy.calls if c[0] in ("check", "lion_step_")]
    assert not [c for c in spy.calls if not c[1]]  # nothing handed back to the dispatcher


@pytest.mark.parametrize("poison", ["none", "inf", "nan_scale"])
@pytest.mark.parametrize("lr", [1e-2, "tensor"])
def test_lion_step_checked_through_the_door_is_check_then_lion_step_bit_for_bit(poison, lr):
    p, g, m, _, _, model, step, gs = _checked_args(poison, False)
    a = (p, g, m, model, step, gs)
    snapshot = [t.clone() for t in _flat(a)]
    kw = _lion_kw(torch.full((), 1e-2) if lr == "tensor" else lr)
    got = ops.lion_step_checked(*a, **kw)
    for t, s in zip(_flat(a), snapshot):
        torch.testing.assert_close(t, s, rtol=0, atol=0, equal_nan=True)
    finite = ops.check(g)[0] & ~gs.isnan()
    want = torch.ops.ampfunc.lion_step(*a, finite, *([0.0, kw["lr"]] if lr == "tensor" else [kw["lr"], None]),
                                       0.9, 0.99, 0.1) + (finite,)
    assert bool(got[4]) == (poison == "none")
    for x, y in zip(_flat(list(got)), _flat(list(want))):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _raised(fn, *args):
    try:
        fn(*args)
    except (ValueError, TypeError) as e:
        return type(e), str(e).splitlines()[0]
    return None


@pytest.mark.parametrize("bad", sorted(BAD))
def test_lion_step_checked_through_the_door_refuses_bad_input_as_lion_step_does(bad):
    # (an out-of-place step only reads its inputs: a state aliasing a param is no error for either)
    a = BAD[bad](_args("lion_step_checked"))
    direct = _raised(DOOR.lion_step_checked, *a)
    dispatched = _raised(torch.ops.ampfunc.lion_step, *a[:6], torch.ones((), dtype=torch.bool), *a[6:])
    assert direct == dispatched
    assert (direct is None) == (bad == "aliased_state")


def test_a_generic_optimizer_call_the_door_cannot_take_goes_to_the_dispatcher():
    a = list(_args("lion_step"))
    a[1] = [t.clone().requires_grad_() if i == 0 else t for i, t in enumerate(a[1])]  # grad mode is on
    assert DOOR.lion_step(*a) is NotImplemented
    out = ops.lion_step(*a[:7], lr=1e-2, beta1=0.8, beta2=0.95)  # served by torch.ops.ampfunc
    assert len(out) == 4 and all(torch.isfinite(t).all() for t in out[0])
    u = _args("lion_update")
    with _Counting() as mode:  # a dispatch mode: handed back, and the mode sees the op
        assert DOOR.lion_update(*u) is NotImplemented
        ops.lion_update(*u[:5], lr=1e-2)
    assert any("ampfunc.lion_update" in s for s in mode.seen)


def test_a_compiled_generic_optimizer_step_calls_the_library_op():
    # traced calls keep torch.ops.ampfunc (the door is for eager calls only)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step_fn(p, g, m, step):
        ops.lion_step_(p, g, m, None, step, torch.ones(()), torch.ones((), dtype=torch.bool), **_lion_kw())

    eager, compiled = (_tree(0), _tree(2), torch.zeros(())), (_tree(0), _tree(2), torch.zeros(()))
    g = _tree(1)
    step_fn(eager[0], g, eager[1], eager[2])
    torch._dynamo.reset()
    torch.compile(step_fn, fullgraph=True, backend=backend)(compiled[0], g, compiled[1], compiled[2])
    assert any("ampfunc.lion_step_" in s for s in seen), seen
    for x, y in zip(_flat(list(eager)), _flat(list(compiled))):
        assert torch.equal(x, y)


def test_fresh_copies_are_detached_contiguous_copies_from_the_pool():
    param = torch.nn.Parameter(torch.randn(64, 48))
    strided = torch.randn(48, 64).t()
    ints = torch.arange(300, dtype=torch.int16)
    copies = ops.fresh_copies([param, strided, ints])
    for src, copy in zip([param, strided, ints], copies):
        assert torch.equal(src.detach(), copy) and copy.is_contiguous() and copy.dtype == src.dtype
        assert copy.data_ptr() != src.data_ptr() and not copy.requires_grad and copy.grad_fn is None
    hits = ops.pool_stats()["hits"]
    del copies, copy
    again = ops.fresh_copies([param, strided, ints])  # the dropped copies' blocks come back
    assert ops.pool_stats()["hits"] >= hits + 3
    assert torch.equal(again[1], strided)


def test_fresh_copies_of_what_the_door_does_not_serve_are_clones():
    x = torch.randn(4, 4, device="meta")
    (copy,) = ops.fresh_copies([x])
    assert copy.device.type == "meta" and copy.shape == (4, 4)
    with torch.no_grad():
        assert ops.fresh_copies([]) == []
