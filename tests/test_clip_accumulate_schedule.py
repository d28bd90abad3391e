"""clip_by_global_norm against clip_grad_norm_, gradient accumulation, and schedules."""

import math

import pytest
import torch

import ampfunc as af
from _helpers import random_like
from ampfunc.transform import EmptyState
from ampfunc.tree import select_tree, tree_leaves


def make_params():
    """A nested tree (a dict holding a list), not the flat dict of conftest.make_params."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 3, generator=g), "b": torch.randn(8, generator=g), "v": [torch.randn(5, generator=g)]}


def grads_at(params, k, scale=1.0):
    return random_like(params, 50 + k, scale)


# ---------------------------------------------------------------------------------------------
# clip_by_global_norm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm, scale", [(1.0, 1.0), (100.0, 1.0), (0.5, 1e-3), (2.0, 30.0)])
def test_clip_by_global_norm_matches_clip_grad_norm(max_norm, scale):
    params = make_params()
    grads = grads_at(params, 0, scale)
    tx = af.clip_by_global_norm(max_norm)
    clipped, state = tx.update(grads, tx.init(params), params)
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in tree_leaves(grads)]
    for h, g in zip(holders, tree_leaves(grads)):
        h.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(holders, max_norm)
    for a, h in zip(tree_leaves(clipped), holders):
        torch.testing.assert_close(a, h.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(af.optim.global_norm(grads), total, rtol=1e-6, atol=0)
    assert state == af.transform.EmptyState()


def test_clip_leaves_small_gradients_unchanged_and_keeps_dtypes():
    params = make_params()
    grads = af.tree.tree_cast(grads_at(params, 1, 1e-3), torch.float16)
    clipped, _ = af.clip_by_global_norm(1.0).update(grads, af.transform.EmptyState())
    for a, e in zip(tree_leaves(clipped), tree_leaves(grads)):
        assert a.dtype == torch.float16 and torch.equal(a, e)


def test_clip_norm_of_fp16_gradients_is_accumulated_in_fp32():
    big = {"g": torch.full((4096,), 1000.0, dtype=torch.float16)}  # sum of squares overflows fp16
    clipped, _ = af.clip_by_global_norm(1.0).update(big, af.transform.EmptyState())
    assert torch.isfinite(clipped["g"]).all()
    torch.testing.assert_close(af.optim.global_norm(clipped).to(torch.float32), torch.tensor(1.0), rtol=2e-3, atol=0)


def test_clip_carries_a_fused_spec_and_rejects_a_bad_max_norm():
    assert af.clip_by_global_norm(2.5).fused == af.transform.FusedSpec("clip_by_global_norm", {"max_norm": 2.5})
    for bad in [0.0, -1.0, float("nan")]:
        with pytest.raises(ValueError, match="max_norm"):
            af.clip_by_global_norm(bad)


# ---------------------------------------------------------------------------------------------
# accumulate
# ---------------------------------------------------------------------------------------------


def test_accumulate_applies_the_inner_optimizer_to_the_mean_every_k_calls():
    params = make_params()
    k = 3
    tx = af.accumulate(af.adam(lr=0.1), every_k=k)
    ref = af.adam(lr=0.1)
    state, ref_state = tx.init(params), ref.init(params)
    for n in range(2 * k):
        updates, state = tx.update(grads_at(params, n), state, params)
        if (n + 1) % k:
            assert all(torch.count_nonzero(u) == 0 for u in tree_leaves(updates))
        else:
            window = [grads_at(params, m) for m in range(n + 1 - k, n + 1)]
            mean = af.tree.tree_map(lambda *gs: sum(gs) / k, *window)
            ref_updates, ref_state = ref.update(mean, ref_state, params)
            for a, e in zip(tree_leaves(updates), tree_leaves(ref_updates)):
                torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-9)
        params = af.apply_updates(params, updates)
    assert state.mini_step.item() == 0
    assert state.inner.step.item() == 2  # the inner count advances per applied update only


def test_non_finite_mini_step_is_dropped_and_does_not_advance_the_counter():
    params = make_params()
    tx = af.accumulate(af.sgd(lr=1.0), every_k=2)
    state = tx.init(params)
    g0, g1, g2 = grads_at(params, 0), grads_at(params, 1), grads_at(params, 2)
    _, state = tx.update(g0, state, params)
    poisoned = af.tree.tree_map(lambda x: x.clone(), g1)
    poisoned["w"][0, 0] = float("nan")
    poisoned["v"][0][1] = float("inf")
    updates, state = tx.update(poisoned, state, params)
    assert state.mini_step.item() == 1  # dropped: still waiting for a second good mini-step
    assert all(torch.count_nonzero(u) == 0 for u in tree_leaves(updates))
    assert all(torch.isfinite(s).all() for s in tree_leaves(state.grad_sum))
    updates, state = tx.update(g2, state, params)
    for u, a, b in zip(tree_leaves(updates), tree_leaves(g0), tree_leaves(g2)):
        torch.testing.assert_close(u, -(a + b) / 2, rtol=1e-6, atol=1e-6)  # delta of fp32 params
    assert state.mini_step.item() == 0


def test_accumulate_state_is_a_named_tuple_of_tensors_and_fp32():
    params = af.tree.tree_cast(make_params(), torch.bfloat16)
    tx = af.accumulate(af.sgd(0.1, momentum=0.9), every_k=4)
    state = tx.init(params)
    assert isinstance(state, af.optim.AccumulateState)
    assert state.mini_step.dtype == torch.int32
    assert all(s.dtype == torch.float32 for s in tree_leaves(state.grad_sum))
    _, state = tx.update(af.tree.tree_cast(grads_at(params, 0), torch.float16), state, params)
    assert all(s.dtype == torch.float32 for s in tree_leaves(state.grad_sum))


def test_accumulate_rejects_bad_every_k_and_mismatched_grads():
    with pytest.raises(ValueError, match="every_k"):
        af.accumulate(af.sgd(0.1), every_k=0)
    params = make_params()
    tx = af.accumulate(af.sgd(0.1), every_k=2)
    grads = grads_at(params, 0)
    del grads["b"]
    with pytest.raises(ValueError, match="'b'|b\\b"):
        tx.update(grads, tx.init(params), params)


# ---------------------------------------------------------------------------------------------
# schedules
# ---------------------------------------------------------------------------------------------


def values(schedule, n):
    return [schedule(torch.tensor(float(i))).item() for i in range(n)]


def test_schedules_follow_optax_formulas():
    close = lambda a, b: all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) for x, y in zip(a, b))  # noqa: E731
    assert close(values(af.optim.constant_schedule(0.3), 3), [0.3] * 3)
    assert close(values(af.optim.linear_schedule(1.0, 0.0, transition_steps=4, transition_begin=2), 8),
                 [1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    cos = [0.5 * (1 + math.cos(math.pi * min(i, 10) / 10)) for i in range(14)]
    assert close(values(af.optim.cosine_decay_schedule(2.0, 10, alpha=0.1), 14), [2.0 * (0.9 * c + 0.1) for c in cos])
    warm = values(af.optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14, end_value=0.1), 16)
    expected = [i / 4 for i in range(4)] + [1.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * min(i, 10) / 10)) + 0.1)
                                            for i in range(12)]
    assert close(warm, expected)
    assert close(values(af.optim.exponential_decay(1.0, transition_steps=2, decay_rate=0.5), 5),
                 [1.0, 0.5 ** 0.5, 0.5, 0.5 ** 1.5, 0.25])
    assert close(values(af.optim.exponential_decay(1.0, 2, 0.5, transition_begin=1, staircase=True, end_value=0.3), 7),
                 [1.0, 1.0, 1.0, 0.5, 0.5, 0.3, 0.3])


def test_schedules_return_0d_float32_on_the_count_device():
    for s in [af.optim.constant_schedule(1.0), af.optim.linear_schedule(1.0, 0.1, 10),
              af.optim.cosine_decay_schedule(1.0, 10),
              af.optim.warmup_cosine_decay_schedule(0.0, 1.0, 2, 10), af.optim.exponential_decay(1.0, 5, 0.9)]:
        out = s(torch.tensor(3.0))
        assert out.shape == () and out.dtype == torch.float32


def test_schedules_compile_with_fullgraph():
    torch._dynamo.reset()
    for s in [af.optim.linear_schedule(1.0, 0.1, 10, transition_begin=2),
              af.optim.warmup_cosine_decay_schedule(0.0, 1.0, 2, 10),
              af.optim.exponential_decay(1.0, 5, 0.9, staircase=True, end_value=0.5)]:
        compiled = torch.compile(s, fullgraph=True, backend="eager", dynamic=False)
        for i in [0.0, 3.0, 20.0]:
            c = torch.tensor(i)
            assert torch.equal(compiled(c), s(c))


def test_skipped_step_does_not_advance_the_schedule():
    params = make_params()
    sched = af.optim.linear_schedule(1.0, 0.0, transition_steps=10)
    for tx in [af.sgd(lr=sched), af.adam(lr=sched), af.optim.scale_by_learning_rate(sched)]:
        state = tx.init(params)
        _, state = tx.update(grads_at(params, 0), state, params)
        grads = grads_at(params, 1)
        first, tried = tx.update(grads, state, params)
        state_after_skip = select_tree(torch.tensor(False), tried, state)  # what skip_or_apply(False, ...) does
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(state_after_skip), tree_leaves(state)))
        again, _ = tx.update(grads, state_after_skip, params)  # same lr as the skipped attempt
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(first), tree_leaves(again)))


def test_schedule_is_evaluated_at_the_number_of_applied_steps():
    params = {"w": torch.zeros(3)}
    grads = {"w": torch.ones(3)}
    tx = af.sgd(lr=af.optim.linear_schedule(1.0, 0.0, transition_steps=4))
    state = tx.init(params)
    seen = []
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        seen.append(-updates["w"][0].item())
    assert seen == [1.0, 0.75, 0.5]


@pytest.mark.parametrize("make, what", [
    (lambda: af.optim.cosine_decay_schedule(1.0, 0), "decay_steps"),
    (lambda: af.optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 5), "warmup_steps"),
    (lambda: af.optim.exponential_decay(1.0, 10, 0.0), "decay_rate"),
    (lambda: af.optim.linear_schedule(float("nan"), 0.0, 10), "init_value"),
])
def test_schedule_settings_are_validated(make, what):
    with pytest.raises(ValueError, match=what):
        make()


# ---------------------------------------------------------------------------------------------
# elementary transforms
# ---------------------------------------------------------------------------------------------


def test_chain_of_elementary_transforms_equals_sgd_with_weight_decay():
    params = make_params()
    hand = af.chain(af.add_decayed_weights(0.1), af.optim.scale_by_learning_rate(0.05))
    native = af.sgd(0.05, weight_decay=0.1)
    a, _ = hand.update(grads_at(params, 0), hand.init(params), params)
    b, _ = native.update(grads_at(params, 0), native.init(params), params)
    for x, y in zip(tree_leaves(a), tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_adamw_built_from_scale_by_adam_with_masked_decay_tracks_native_adamw():
    """Composition reproduces the native optimizer (to fp32 rounding: the lr is applied as a
    separate multiply), and masked() exempts leaves from the decay."""
    params = make_params()
    mask = {"w": True, "b": False, "v": [True]}
    hand = af.chain(af.optim.scale_by_adam(), af.masked(af.add_decayed_weights(0.1), mask),
                    af.optim.scale_by_learning_rate(0.01))
    native = af.partition({"decay": af.adamw(0.01, weight_decay=0.1), "plain": af.adamw(0.01, weight_decay=0.0)},
                          {"w": "decay", "b": "plain", "v": ["decay"]})
    hs, ns, hp, np_ = hand.init(params), native.init(params), params, params
    for k in range(20):
        hu, hs = hand.update(grads_at(hp, k), hs, hp)
        nu, ns = native.update(grads_at(np_, k), ns, np_)
        hp, np_ = af.apply_updates(hp, hu), af.apply_updates(np_, nu)
    for a, e in zip(tree_leaves(hp), tree_leaves(np_)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_inside_mixed_precision_an_overflowing_mini_step_is_skipped_and_not_counted():
    params = af.tree.tree_cast(make_params(), torch.float16)
    tx = af.mixed_precision(af.accumulate(af.adamw(1e-3), every_k=2),
                            loss_scale=af.DynamicLossScale(init_scale=2.0 ** 10))
    state = tx.init(params)
    counters = []
    for k in range(5):
        grads = af.tree.tree_map(lambda g: (g * 2.0 ** 10).to(torch.float16), grads_at(make_params(), k))
        if k == 2:
            grads["w"][0, 0] = float("inf")
        params, state = tx.step(params, grads, state)
        counters.append((state.inner.mini_step.item(), state.inner.inner.step.item()))
    # (mini-steps pending, inner steps applied): the overflow at k=2 changes neither
    assert counters == [(1, 0.0), (0, 1.0), (0, 1.0), (1, 1.0), (0, 2.0)]


def test_clip_with_a_group_uses_the_all_reduced_norm_and_leaves_the_fused_path():
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        grads = {"w": torch.full((4,), 3.0), "b": torch.full((2,), 4.0)}
        sharded = af.clip_by_global_norm(1.0, group=group)
        assert sharded.fused is None  # a collective sits between the norm and the update
        out, _ = sharded.update(grads, sharded.init(grads))
        ref, _ = af.clip_by_global_norm(1.0).update(grads, EmptyState())
        for k in grads:
            torch.testing.assert_close(out[k], ref[k])
    finally:
        dist.destroy_process_group()


def test_clip_with_a_group_rounds_fp16_updates_once_as_without_one():
    # dist.scale_tree is the group path's scaling: the fp32 coefficient must not be rounded to
    # fp16 before the product (62 of 1000 elements differed).
    g = torch.Generator().manual_seed(3)
    tree = {"w": (torch.randn(1000, generator=g) * 3).half()}
    coef = torch.tensor(0.3712345)
    grouped = af.dist.scale_tree(tree, coef)["w"]
    once = torch._foreach_mul([tree["w"]], coef)[0]
    assert grouped.dtype == torch.float16 and torch.equal(grouped, once)
    assert torch.equal(once, (tree["w"].float() * coef).half())
