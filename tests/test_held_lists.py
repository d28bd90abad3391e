"""``ops.held_lists``: the lists an in-place step passes every call, held described between calls.

While the object lives, a call through the direct door that passes one of those very lists gets
the held descriptions once every tensor is found unchanged, and otherwise describes the list
anew: the numbers, the errors and the version counters are those of the same call without it,
whatever happened to the tensors between calls (a ``.data`` assignment, ``set_``, ``resize_``,
a resized storage, ``torch.utils.swap_tensors``, a lazy clone, a replaced list item).
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import ampfunc as af
from ampfunc import ops

ops.load()
DOOR = ops._DIRECT[0]
pytestmark = pytest.mark.skipif(DOOR is None, reason="compiled kernels not built")

SIZES = (1, 7, 33, 1000, 4097)
HYPERS = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True)


def _lists(seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(s, generator=gen) for s in SIZES]
    g = [torch.randn(s, generator=gen) for s in SIZES]
    m = [torch.randn(s, generator=gen).abs() * 0.1 for s in SIZES]
    v = [torch.randn(s, generator=gen).abs() * 0.1 for s in SIZES]
    return p, g, m, v


def _twin(lists):
    return [[t.clone() for t in lst] for lst in lists]


def _step(p, g, m, v, step):
    with torch.no_grad():
        return ops.adam_step_checked_(p, g, m, v, None, None, step, torch.ones(()), **HYPERS)


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _pair():
    """Two copies of one step's lists, the first held: (held lists, plain lists, the holder)."""
    held = _lists()
    plain = _twin(held)
    holder = ops.held_lists([held[0], held[2], held[3]])
    assert len(holder) == 3
    return held, plain, holder


def test_held_steps_equal_plain_steps_bit_for_bit():
    (p, g, m, v), (q, h, n, w), _holder = _pair()
    s1, s2 = torch.zeros(()), torch.zeros(())
    for _ in range(3):
        assert bool(_step(p, g, m, v, s1)) and bool(_step(q, h, n, w, s2))
    _same(p, q), _same(m, n), _same(v, w)
    assert torch.equal(s1, s2)


def test_held_step_bumps_version_counters():
    (p, g, m, v), _, _holder = _pair()
    before = [t._version for t in p + m + v]
    _step(p, g, m, v, torch.zeros(()))
    assert [t._version for t in p + m + v] == [b + 1 for b in before]
    assert all(t._version == 0 for t in g)  # read only


def test_data_assignment_is_seen_and_written():
    (p, g, m, v), (q, h, n, w), _holder = _pair()
    _step(p, g, m, v, torch.zeros(()))
    _step(q, h, n, w, torch.zeros(()))
    fresh = torch.randn(SIZES[3])
    p[3].data = fresh.clone()
    q[3].data = fresh.clone()
    _step(p, g, m, v, torch.zeros(()))
    _step(q, h, n, w, torch.zeros(()))
    _same(p, q)
    assert p[3].data_ptr() != fresh.data_ptr() and not torch.equal(p[3], fresh)  # the new memory was written


def test_data_assignment_that_aliases_two_params_is_refused_and_nothing_written():
    (p, g, m, v), _, _holder = _pair()
    _step(p, g, m, v, torch.zeros(()))
    big = torch.randn(SIZES[3] + SIZES[4])
    p[3].data = big[:SIZES[3]]
    p[4].data = big[SIZES[3] - 1:SIZES[3] - 1 + SIZES[4]]  # one element shared with p[3]
    snapshot = _twin((p, m, v))
    with pytest.raises(ValueError, match=r"params\[3\] and params\[4\] overlap in memory"):
        _step(p, g, m, v, torch.zeros(()))
    _same(p, snapshot[0]), _same(m, snapshot[1]), _same(v, snapshot[2])


@pytest.mark.parametrize("change", ["set_", "resize_", "dtype"])
def test_metadata_changes_reach_validation(change):
    (p, g, m, v), _, _holder = _pair()
    _step(p, g, m, v, torch.zeros(()))
    with torch.no_grad():
        if change == "set_":
            p[3].set_(torch.randn(SIZES[3] + 1))
        elif change == "resize_":
            p[3].resize_(SIZES[3] - 1)
        else:
            p[3].data = p[3].data.double()
    expected = (TypeError, r"params\[3\] has dtype torch.float64") if change == "dtype" else \
        (ValueError, r"grads\[3\] has shape \(1000,\) but params\[3\] has shape")
    with pytest.raises(expected[0], match=expected[1]):
        _step(p, g, m, v, torch.zeros(()))


def test_storage_resized_under_a_param_is_seen():
    (p, g, m, v), _, _holder = _pair()
    _step(p, g, m, v, torch.zeros(()))
    p[4].untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"params\[4\] has no data"):
        _step(p, g, m, v, torch.zeros(()))


def test_swap_tensors_is_seen():
    (p, g, m, v), (q, h, n, w), _holder = _pair()
    other = torch.randn(SIZES[2])
    other2 = other.clone()
    torch.utils.swap_tensors(p[2], other)
    q[2] = other2
    _step(p, g, m, v, torch.zeros(()))
    _step(q, h, n, w, torch.zeros(()))
    _same(p, q)


def test_lazy_clone_keeps_its_values():
    (p, g, m, v), _, _holder = _pair()
    _step(p, g, m, v, torch.zeros(()))
    clone = torch._lazy_clone(p[3])  # p[3]'s storage is copy-on-write from here
    before = clone.clone()
    _step(p, g, m, v, torch.zeros(()))
    assert torch.equal(clone, before) and not torch.equal(p[3], before)


def test_replaced_list_item_is_stepped():
    (p, g, m, v), (q, h, n, w), _holder = _pair()
    new = torch.randn(SIZES[1])
    p[1], q[1] = new, new.clone()
    _step(p, g, m, v, torch.zeros(()))
    _step(q, h, n, w, torch.zeros(()))
    _same(p, q)


def test_requires_grad_under_grad_mode_is_left_to_the_dispatcher():
    # The door does not take a tensor that requires grad under grad mode; neither does a held
    # list. The dispatcher's road does not bump version counters, the door's does: the counters
    # tell which road ran.
    (p, g, m, v), (q, h, n, w), _holder = _pair()
    _step(p, g, m, v, torch.zeros(()))
    _step(q, h, n, w, torch.zeros(()))
    for lst in (p, q):
        lst[0].requires_grad_(True)
    before = [t._version for t in p]
    for lists in ((p, g, m, v), (q, h, n, w)):
        ops.adam_step_checked_(*lists, None, None, torch.zeros(()), torch.ones(()), **HYPERS)
    assert [t._version for t in p] == before == [t._version for t in q]
    _same(p, q)


def test_a_list_held_by_another_holder_is_not_held_twice():
    (p, g, m, v), _, holder = _pair()
    assert len(ops.held_lists([p, g])) == 1  # g only: p is holder's
    del holder
    gc.collect()
    assert len(ops.held_lists([p])) == 1


def test_dropping_the_holder_lets_the_tensors_go():
    p, g, m, v = _lists()
    counts = [sys.getrefcount(t) for t in p]
    holder = ops.held_lists([p])
    assert [sys.getrefcount(t) for t in p] == [c + 1 for c in counts]
    del holder
    gc.collect()
    assert [sys.getrefcount(t) for t in p] == counts


def _run_engine(hold, monkeypatch, swap_at=None):
    made = []
    with monkeypatch.context() as mp:
        real = ops.held_lists
        mp.setattr(ops, "held_lists", lambda lists: made.append(real(lists) if hold else None) or made[-1])
        gen = torch.Generator().manual_seed(3)
        params = {f"w{i}": torch.randn(s, generator=gen) for i, s in enumerate(SIZES)}
        grads = {k: torch.randn(t.shape, generator=gen) for k, t in params.items()}
        tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
        state = tx.init(params)
        for i in range(4):
            if i == swap_at:
                params["w3"].data = torch.full_like(params["w3"], 0.5)
            params, state = tx.step_(params, grads, state)
        # held once, and again after the .data assignment? No: the lists are the same objects,
        # so the door takes the changed tensor's marks again itself
        assert len(made) == 1 and (made[0] is None) != hold and (not hold or len(made[0]) == 3)
        return params, state


def test_engine_in_place_step_with_held_lists_matches_without(monkeypatch):
    for swap_at in (None, 2):
        a, sa = _run_engine(True, monkeypatch, swap_at)
        b, sb = _run_engine(False, monkeypatch, swap_at)
        _same(a.values(), b.values())
        _same(sa.inner.exp_avg.values(), sb.inner.exp_avg.values())
        _same(sa.inner.exp_avg_sq.values(), sb.inner.exp_avg_sq.values())


def test_a_written_scalar_inside_a_held_param_is_refused():
    # Validation remembers what it found of unchanged held lists; a new written scalar (here the
    # step counter, a view into a param) is still checked against them.
    (p, g, m, v), _, _holder = _pair()
    for _ in range(2):
        _step(p, g, m, v, torch.zeros(()))
    inside = p[4][5:6].view(())
    before = p[4].clone()
    with pytest.raises(ValueError, match=r"params\[4\] and step overlap in memory"):
        _step(p, g, m, v, inside)
    assert torch.equal(p[4], before)


def test_alternating_steps_each_keep_their_validation_and_are_still_checked():
    # Two models stepped in turn (a GAN's two optimizers): validation remembers what it found of
    # each one's held lists, and each call is still checked where something changed since.
    (pa, ga, ma, va), plain_a, _holder_a = _pair()
    b = _lists(seed=1)
    plain_b = _twin(b)
    _holder_b = ops.held_lists([b[0], b[2], b[3]])
    steps = [torch.zeros(()) for _ in range(4)]
    for _ in range(3):
        _step(pa, ga, ma, va, steps[0])
        _step(*b, steps[1])
        _step(*plain_a, steps[2])
        _step(*plain_b, steps[3])
    _same(pa, plain_a[0]), _same(ma, plain_a[2]), _same(va, plain_a[3])
    _same(b[0], plain_b[0]), _same(b[2], plain_b[2]), _same(b[3], plain_b[3])
    # a step counter inside one of A's params, after B's call
    before = pa[4].clone()
    with pytest.raises(ValueError, match=r"params\[4\] and step overlap in memory"):
        _step(pa, ga, ma, va, pa[4][5:6].view(()))
    assert torch.equal(pa[4], before)
    _step(*b, steps[1])
    _step(*plain_b, steps[3])
    # two of A's params made to share memory, after B's call
    big = torch.randn(SIZES[3] + SIZES[4])
    pa[3].data = big[:SIZES[3]]
    pa[4].data = big[SIZES[3] - 1:SIZES[3] - 1 + SIZES[4]]
    snapshot = _twin((pa, ma, va))
    with pytest.raises(ValueError, match=r"params\[3\] and params\[4\] overlap in memory"):
        _step(pa, ga, ma, va, steps[0])
    _same(pa, snapshot[0]), _same(ma, snapshot[1]), _same(va, snapshot[2])
    # a gradient of the wrong shape for B, after A's call
    gb = list(b[1])
    gb[2] = torch.randn(SIZES[2] + 1)
    with pytest.raises(ValueError, match=r"grads\[2\] has shape \(34,\) but params\[2\] has shape \(33,\)"):
        _step(b[0], gb, b[2], b[3], steps[1])
    _step(*b, steps[1])
    _step(*plain_b, steps[3])
    _same(b[0], plain_b[0]), _same(b[2], plain_b[2]), _same(b[3], plain_b[3])


def test_gradients_are_checked_on_every_call():
    (p, g, m, v), _, _holder = _pair()
    for _ in range(2):
        _step(p, g, m, v, torch.zeros(()))
    g2 = list(g)
    g2[2] = torch.randn(SIZES[2] + 1)
    with pytest.raises(ValueError, match=r"grads\[2\] has shape \(34,\) but params\[2\] has shape \(33,\)"):
        _step(p, g2, m, v, torch.zeros(()))
    g2[2] = torch.randn(SIZES[2], dtype=torch.float64)  # check() takes it; the step does not
    with pytest.raises(TypeError, match=r"grads\[2\] has dtype torch.float64"):
        _step(p, g2, m, v, torch.zeros(()))
    _step(p, g, m, v, torch.zeros(()))  # and the held lists still serve


def test_held_lists_in_another_role_are_validated_in_it():
    (p, g, m, v), _, _holder = _pair()
    _step(p, g, m, v, torch.zeros(()))
    with pytest.raises(ValueError, match=r"overlap in memory"):
        _step(p, g, p, v, torch.zeros(()))  # the params passed as the first moments too


def test_inference_tensors_are_refused_outside_inference_mode_and_stepped_inside():
    with torch.inference_mode():
        held = _lists()
        plain = _twin(held)
    p, g, m, v = held
    holder = ops.held_lists([p, m, v])
    assert len(holder) == 3
    before = _twin((p, m, v))
    with pytest.raises(ValueError, match=r"params\[0\] is an inference tensor"):
        _step(p, g, m, v, torch.zeros(()))
    _same(p, before[0]), _same(m, before[1]), _same(v, before[2])
    with torch.inference_mode():
        for lists in (held, plain):
            for _ in range(2):
                _step(*lists, torch.zeros(()))
    for a, b in zip(held, plain):
        _same(a, b)


@pytest.mark.parametrize("where", [(0, 4321), (2, 0), (1, 4999)])  # (list: params, m, v; index)
def test_many_tensors_checked_across_threads(where):
    # From a few thousand tensors on, the call's held tensors are checked in one parallel region;
    # a change anywhere in any list is still found.
    gen = torch.Generator().manual_seed(5)
    n = 5000
    held = [[torch.randn(3, generator=gen).abs() for _ in range(n)] for _ in range(4)]  # (v >= 0)
    plain = _twin(held)
    p, g, m, v = held
    holder = ops.held_lists([p, m, v])
    assert len(holder) == 3
    for lists in (held, plain):
        _step(*lists, torch.zeros(()))
    which, i = where
    lst = (p, m, v)[which]
    twin = (plain[0], plain[2], plain[3])[which]
    fresh = torch.full((3,), 0.25)
    lst[i].data = fresh.clone()
    twin[i].data = fresh.clone()
    for lists in (held, plain):
        _step(*lists, torch.zeros(()))
    for a, b in zip(held, plain):
        _same(a, b)
    assert not torch.equal(lst[i], fresh)


def _many(n=5000, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(3, generator=gen).abs() for _ in range(n)] for _ in range(4)]


def _door_step(p, g, m, v):
    """The door's in-place checked Adam step (its result: NotImplemented when it hands the call
    back to the dispatcher)."""
    h = HYPERS
    with torch.no_grad():
        return DOOR.adam_step_checked_(p, g, m, v, [], [], torch.zeros(()), torch.ones(()), h["lr"], None,
                                       h["beta1"], h["beta2"], h["eps"], h["weight_decay"], False,
                                       h["decoupled_weight_decay"], False)


@pytest.mark.parametrize("container", [list, tuple])
def test_gradients_read_in_the_parallel_check_step_as_described_anew(container):
    # With thousands of held tensors, the gradients are described for reading in the same parallel
    # region as the held lists' check: the same numbers, version counters and errors.
    held = _many()
    plain = _twin(held)
    p, g, m, v = held
    _holder = ops.held_lists([p, m, v])
    versions = [t._version for t in g]
    for _ in range(2):
        _step(p, container(g), m, v, torch.zeros(()))
        _step(*plain, torch.zeros(()))
    for a, b in zip(held, plain):
        _same(a, b)
    assert [t._version for t in g] == versions  # read, not written
    bad = list(g)
    bad[4321] = torch.randn(4)
    with pytest.raises(ValueError, match=r"grads\[4321\] has shape \(4,\) but params\[4321\] has shape \(3,\)"):
        _step(p, container(bad), m, v, torch.zeros(()))
    bad[4321] = torch.randn(3, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"grads\[4321\] has dtype torch.float64"):
        _step(p, container(bad), m, v, torch.zeros(()))
    for a, b in zip(held, plain):
        _same(a, b)


def test_a_lazily_cloned_gradient_is_read_where_it_is():
    # Reading a copy-on-write gradient does not copy it (nor its source), whether it was described
    # in the parallel region (the held call) or on its own (the plain one).
    held = _many()
    plain = _twin(held)
    p, g, m, v = held
    _holder = ops.held_lists([p, m, v])
    g[17] = torch._lazy_clone(plain[1][17])
    _step(p, g, m, v, torch.zeros(()))
    _step(*plain, torch.zeros(()))
    for a, b in zip(held, plain):
        _same(a, b)
    assert torch._C._is_cow_tensor(g[17]) and torch._C._is_cow_tensor(plain[1][17])


@pytest.mark.parametrize("odd", ["requires_grad", "meta", "sparse", "neg_view", "none", "subclass"])
def test_a_gradient_the_dispatcher_must_see_sends_the_call_to_it(odd):
    # The door takes the call only when every gradient is a plain CPU tensor, judged in the
    # parallel region as in the serial description; otherwise it hands the call back, with
    # nothing written.
    held = _many()
    p, g, m, v = held
    _holder = ops.held_lists([p, m, v])
    assert _door_step(p, g, m, v) is not NotImplemented  # the arguments as the door takes them
    before = _twin((p, m, v))
    odd_g = list(g)
    i = 2500
    if odd == "requires_grad":
        odd_g[i] = g[i].clone().requires_grad_()
    elif odd == "meta":
        odd_g[i] = torch.empty(3, device="meta")
    elif odd == "sparse":
        odd_g[i] = torch.eye(3)[0].to_sparse()
    elif odd == "neg_view":
        odd_g[i] = torch._neg_view(g[i])
    elif odd == "none":
        odd_g[i] = None
    else:
        odd_g[i] = g[i].as_subclass(_Logged)
    if odd == "requires_grad":
        with torch.enable_grad():
            h = HYPERS
            assert DOOR.adam_step_checked_(p, odd_g, m, v, [], [], torch.zeros(()), torch.ones(()), h["lr"], None,
                                           h["beta1"], h["beta2"], h["eps"], h["weight_decay"], False,
                                           h["decoupled_weight_decay"], False) is NotImplemented
    else:
        assert _door_step(p, odd_g, m, v) is NotImplemented
    _same(p, before[0]), _same(m, before[1]), _same(v, before[2])


class _Logged(torch.Tensor):
    """A subclass the dispatcher hands every op to (__torch_dispatch__)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def test_held_moments_beside_params_not_held_are_checked_against_them():
    # An out-of-place step with its moments held but not its params: each call's params are
    # another list, so the moments' shapes are compared with them every call.
    p, g, m, v = _lists()
    holder = ops.held_lists([m, v])
    assert len(holder) == 2
    step = torch.zeros(())
    kw = {k: h for k, h in HYPERS.items()}
    with torch.no_grad():
        for _ in range(2):
            ops.adam_step(p, g, m, v, None, None, step, torch.ones(()), torch.ones((), dtype=torch.bool), **kw)
        other = [t.clone() for t in p]
        other[2] = torch.randn(SIZES[2] + 5)
        grads = [t.clone() for t in g]
        grads[2] = torch.randn(SIZES[2] + 5)
        with pytest.raises(ValueError, match=r"exp_avgs\[2\] has shape \(33,\) but params\[2\] has shape \(38,\)"):
            ops.adam_step(other, grads, m, v, None, None, step, torch.ones(()), torch.ones((), dtype=torch.bool),
                          **kw)
