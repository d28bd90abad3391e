"""Step statistics: sync-free counting on the hot path, host-side diagnostics off it."""

import io
import math

import pytest
import torch

import ampfunc as af
from ampfunc.monitor import StepStats, health, init_stats, nonfinite_paths, record, skip_rate, summary

T, F = True, False


def run(flags, scales=None):
    stats = init_stats()
    scales = scales or [2.0 ** 16] * len(flags)
    for ok, s in zip(flags, scales):
        stats = record(stats, torch.tensor(ok), s)
    return stats


def test_init_stats_is_zero_with_no_scale_yet():
    stats = init_stats()
    assert (stats.steps.item(), stats.skipped.item(), stats.consecutive_skips.item()) == (0, 0, 0)
    assert math.isnan(stats.last_scale.item())
    assert all(t.dim() == 0 for t in stats)


def test_record_counts_steps_skips_and_consecutive_skips_over_a_sequence_of_flags():
    flags = [T, F, F, T, T, F, F, F, T, F]
    stats = init_stats()
    consecutive = 0
    for i, ok in enumerate(flags):
        stats = record(stats, torch.tensor(ok), 2.0 ** 10)
        consecutive = 0 if ok else consecutive + 1
        assert stats.steps.item() == i + 1
        assert stats.skipped.item() == flags[: i + 1].count(F)
        assert stats.consecutive_skips.item() == consecutive
    assert skip_rate(stats).item() == pytest.approx(6 / 10)


def test_record_is_pure():
    stats = init_stats()
    before = [t.clone() for t in stats]
    new = record(stats, torch.tensor(False), 8.0)
    for t, b in zip(stats, before):
        assert torch.equal(t, b) or (t.isnan().all() and b.isnan().all())
    assert new.skipped.item() == 1


def test_record_takes_the_scale_from_a_loss_scale_a_tensor_or_a_number():
    ls = af.DynamicLossScale(init_scale=1024.0)
    assert record(init_stats(), torch.tensor(True), ls).last_scale.item() == 1024.0
    assert record(init_stats(), torch.tensor(True), torch.tensor(4.0)).last_scale.item() == 4.0
    assert record(init_stats(), torch.tensor(True), 2).last_scale.item() == 2.0
    assert record(init_stats(), torch.tensor(True)).last_scale.item() == 1.0
    assert record(init_stats(), torch.tensor(True), ls).last_scale.dtype == torch.float32


def test_record_follows_a_dynamic_loss_scale_through_overflows():
    ls = af.DynamicLossScale(init_scale=2.0 ** 16, growth_interval=2)
    stats = init_stats()
    for ok in [F, F, T, T, F]:
        finite = torch.tensor(ok)
        ls = af.update_scale(ls, finite)
        stats = record(stats, finite, ls)
    assert stats.last_scale.item() == ls.loss_scale.item() == 2.0 ** 14
    assert summary(stats) == {"steps": 5, "skipped": 3, "skip_rate": 0.6, "consecutive_skips": 1,
                              "last_scale": 2.0 ** 14}


def test_record_rejects_non_scalar_flags_and_bad_scales():
    with pytest.raises(ValueError, match="finite"):
        record(init_stats(), torch.tensor([True, False]), 1.0)
    with pytest.raises(ValueError, match="shape"):
        record(init_stats(), torch.tensor(True), torch.ones(2))
    with pytest.raises(TypeError, match="loss_scale"):
        record(init_stats(), torch.tensor(True), "big")
    with pytest.raises(TypeError, match="StepStats"):
        record((0, 0, 0, 0), torch.tensor(True), 1.0)


def test_record_accepts_a_python_bool():
    assert record(init_stats(), False, 1.0).skipped.item() == 1


def test_record_runs_under_torch_compile_fullgraph():
    # No host sync on the hot path: the whole update compiles into one graph.
    compiled = torch.compile(record, fullgraph=True, backend="eager")
    stats = compiled(init_stats(), torch.tensor(False), torch.tensor(2.0))
    stats = compiled(stats, torch.tensor(True), torch.tensor(4.0))
    assert (stats.steps.item(), stats.skipped.item(), stats.consecutive_skips.item()) == (2, 1, 0)


def test_skip_rate_is_zero_before_any_step():
    assert skip_rate(init_stats()).item() == 0.0


def test_stats_round_trip_through_torch_save():
    stats = run([T, F, T])
    buf = io.BytesIO()
    torch.save(stats, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert isinstance(loaded, StepStats)
    assert all(torch.equal(a, b) for a, b in zip(loaded, stats))


def test_health_is_quiet_for_a_clean_run_and_before_any_step():
    assert health(init_stats()) == []
    assert health(run([T] * 50)) == []


def test_health_warns_when_the_scale_collapses_below_one():
    warnings = health(run([T, T], scales=[2.0, 0.5]))
    assert len(warnings) == 1 and "collapsed to 0.5" in warnings[0]


def test_health_warns_when_skip_rate_exceeds_five_percent():
    warnings = health(run([F] + [T] * 9))
    assert len(warnings) == 1 and "10.0% of steps skipped (1 of 10)" in warnings[0]
    assert health(run([F] + [T] * 19)) == []  # exactly 5% is tolerated


def test_health_warns_about_consecutive_skips():
    warnings = health(run([T] * 200 + [F] * 6), max_skip_rate=1.0)
    assert len(warnings) == 1 and warnings[0].startswith("6 consecutive skipped steps")
    assert health(run([T] * 200 + [F] * 4), max_skip_rate=1.0) == []


def test_nonfinite_leaves_names_the_paths_holding_inf_or_nan():
    grads = {
        "encoder": {"layers": [{"weight": torch.ones(3)}, {"weight": torch.tensor([1.0, float("inf")])}]},
        "head": {"weight": torch.tensor([float("nan")], dtype=torch.float16), "bias": torch.zeros(2)},
        "step": torch.tensor(7),
        "unused": None,
    }
    assert nonfinite_paths(grads) == ["encoder.layers.1.weight", "head.weight"]


def test_nonfinite_leaves_of_finite_or_empty_trees_is_empty():
    assert nonfinite_paths({"w": torch.ones(2, dtype=torch.bfloat16)}) == []
    assert nonfinite_paths({}) == []
    assert nonfinite_paths({"n": torch.arange(3)}) == []


# -- TrainingMonitor: history, health alerts, scaler statistics, per-leaf overflow counts ------

from ampfunc.monitor import TrainingMonitor, leaf_nonfinite  # noqa: E402


def healthy_run(steps=60, window=20):
    """Loss decaying with noise, dynamic scale growing every 10 clean steps, no overflow."""
    ls = af.DynamicLossScale(init_scale=2.0 ** 10, growth_interval=10)
    mon = TrainingMonitor(window=window)
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        loss = 2.0 * 0.97 ** i * (1 + 0.2 * torch.rand((), generator=g).item())
        ls = af.update_scale(ls, torch.tensor(True))
        mon = mon.record(torch.tensor(True), ls, loss=torch.tensor(loss))
    return mon, ls


def test_a_healthy_run_is_healthy_with_scaler_statistics():
    mon, ls = healthy_run()
    h = mon.check_health()
    assert h["status"] == "healthy" and h["alerts"] == [] and not any(h["checks"].values())
    assert h["skip_rate"] == 0.0 and h["current_scale"] == ls.loss_scale.item() == 2.0 ** 16
    assert mon.scaler_stats() == {"current_scale": 2.0 ** 16, "growth_tracker": 0, "total_steps": 60,
                                  "skipped_steps": 0, "skip_rate": 0.0}
    assert TrainingMonitor().check_health()["status"] == "no_data"


def test_history_is_the_last_window_oldest_first():
    mon = TrainingMonitor(window=4)
    for i in range(6):
        mon = mon.record(torch.tensor(i != 4), 2.0 ** i, loss=float(i))
    h = mon.history()
    assert h == {"step": [2, 3, 4, 5], "loss": [2.0, 3.0, 4.0, 5.0], "loss_scale": [4.0, 8.0, 16.0, 32.0],
                 "finite": [True, True, False, True]}


def test_exploding_loss_alert_trips_on_a_blow_up_and_on_an_inf_loss():
    mon, _ = healthy_run(steps=30)
    for loss in (5.0, 20.0, 80.0, 320.0, 1280.0):
        mon = mon.record(torch.tensor(True), 1024.0, loss=loss)
    h = mon.check_health()
    assert h["status"] == "unhealthy" and h["checks"]["loss_exploding"]
    assert not h["checks"]["skip_rate_high"] and not h["checks"]["scale_falling"]
    assert len(h["alerts"]) == 1 and h["alerts"][0].startswith("loss exploding")
    mon, _ = healthy_run(steps=30)
    h = mon.record(torch.tensor(True), 1024.0, loss=float("inf")).check_health()
    assert h["checks"]["loss_exploding"] and "not finite" in h["alerts"][0]


def test_skip_rate_alert_trips_over_the_window_not_over_the_run():
    mon, _ = healthy_run(steps=200, window=20)
    for i in range(8):  # 8 skips of the last 20 steps (40%), 4% of the run
        mon = mon.record(torch.tensor(i % 2 == 0), 2.0 ** 16, loss=0.01)
        mon = mon.record(torch.tensor(False), 2.0 ** 16, loss=0.01) if i % 2 == 0 else mon
    h = mon.check_health()
    assert h["checks"]["skip_rate_high"] and not h["checks"]["scale_falling"], h
    assert h["skip_rate"] == 0.4 and mon.scaler_stats()["skip_rate"] < 0.05
    assert "of the last 20 steps skipped" in h["alerts"][0]
    # a couple of start-up skips in a short window is not an alert
    mon = TrainingMonitor(window=20)
    for ok in [False, False] + [True] * 3:
        mon = mon.record(torch.tensor(ok), 1.0, loss=1.0)
    assert mon.check_health()["status"] == "healthy"


def test_scale_falling_tenfold_within_ten_steps_trips_and_a_slow_fall_does_not():
    ls = af.DynamicLossScale(init_scale=2.0 ** 16, growth_interval=1000)
    mon = TrainingMonitor(window=100, max_skip_rate=1.0)
    for ok in [True] * 20 + [False] * 4:  # 2^16 -> 2^12: 16x within 4 steps
        ls = af.update_scale(ls, torch.tensor(ok))
        mon = mon.record(torch.tensor(ok), ls, loss=1.0)
    h = mon.check_health()
    assert h["checks"]["scale_falling"] and "fell 16x" in h["alerts"][0], h
    slow = TrainingMonitor(window=100, max_skip_rate=1.0)
    ls = af.DynamicLossScale(init_scale=2.0 ** 16, growth_interval=1000)
    for ok in ([True] * 4 + [False]) * 5:  # one halving per 5 steps: 4x in any 10 steps
        ls = af.update_scale(ls, torch.tensor(ok))
        slow = slow.record(torch.tensor(ok), ls, loss=1.0)
    assert slow.check_health()["status"] == "healthy"


def test_the_monitor_names_and_counts_the_leaf_that_overflowed():
    params = {"encoder": {"w": torch.ones(3), "b": torch.zeros(3)}, "head": {"w": torch.ones(2)},
              "steps": torch.tensor(3)}
    mon = TrainingMonitor(params, window=8)
    assert mon.leaf_paths == ("encoder.b", "encoder.w", "head.w")
    for step in range(5):
        grads = {"encoder": {"w": torch.ones(3), "b": torch.zeros(3)}, "head": {"w": torch.ones(2)},
                 "steps": torch.tensor(3)}
        if step in (1, 3):
            grads["head"]["w"] = torch.tensor([1.0, float("inf")])
        if step == 3:
            grads["encoder"]["b"] = torch.tensor([float("nan"), 0.0, 0.0])
        flags = leaf_nonfinite(grads)
        finite = ~flags.any()
        mon = mon.record(finite, 1.0, loss=1.0, leaf_nonfinite=flags)
    assert mon.overflows() == {"head.w": 2, "encoder.b": 1}
    d = mon.as_dict()
    assert d["overflows"] == {"head.w": 2, "encoder.b": 1} and d["skipped"] == 2 and d["steps"] == 5
    assert set(d) >= {"steps", "skipped", "skip_rate", "loss", "loss_scale", "growth_tracker", "status", "alerts"}
    assert mon.check_health()["overflowing_leaves"] == {"head.w": 2, "encoder.b": 1}


def test_record_is_pure_sync_free_and_compiles_fullgraph():
    mon = TrainingMonitor({"a": torch.ones(2), "b": torch.ones(2)}, window=4)
    before = [t.clone() for t in mon._tensors]
    compiled = torch.compile(lambda m, f, s, l, fl: m.record(f, s, loss=l, leaf_nonfinite=fl),
                             fullgraph=True, backend="eager")
    new = compiled(mon, torch.tensor(False), torch.tensor(8.0), torch.tensor(2.5), torch.tensor([True, False]))
    assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(mon._tensors, before))
    assert new.overflows() == {"a": 1} and new.history()["loss"] == [2.5]


def test_the_monitor_is_a_pytree_that_round_trips_through_torch_save():
    mon, _ = healthy_run(steps=7, window=5)
    leaves = af.tree.tree_leaves(mon)
    assert len(leaves) == 10 and all(isinstance(t, torch.Tensor) for t in leaves)
    buf = io.BytesIO()
    torch.save(mon, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded.config == mon.config and loaded.as_dict() == mon.as_dict()


def test_monitor_rejects_bad_settings_and_inputs():
    with pytest.raises(ValueError, match="window"):
        TrainingMonitor(window=1)
    with pytest.raises(ValueError, match="max_skip_rate"):
        TrainingMonitor(max_skip_rate=2.0)
    mon = TrainingMonitor({"a": torch.ones(2)})
    with pytest.raises(ValueError, match="1 flags"):
        mon.record(torch.tensor(True), leaf_nonfinite=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="finite"):
        mon.record(torch.tensor([True, True]))


def test_record_state_reads_the_finite_flag_and_scale_of_a_step_state():
    tx = af.mixed_precision(af.sgd(0.1), loss_scale=af.DynamicLossScale(init_scale=4.0))
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    mon = TrainingMonitor(params)
    for g in (torch.ones(2), torch.tensor([1.0, float("inf")]), torch.ones(2)):
        params, state = tx.step(params, {"w": g}, state)
        mon = mon.record_state(state, loss=1.0)
    assert mon.history()["finite"] == [True, False, True]
    assert mon.scaler_stats()["skipped_steps"] == int(state.skipped) == 1
    assert mon.scaler_stats()["current_scale"] == float(af.loss_scale_of(state).loss_scale) == 2.0
    with pytest.raises(TypeError, match="finite flag"):
        mon.record_state({"w": 1})


def test_the_steps_own_check_pass_feeds_the_per_leaf_counts():
    from ampfunc.monitor import LeafFlagsHook

    # b, a: dict order differs from the monitor's (sorted) path order; the hook maps between them
    params = {"b": torch.ones(3), "a": torch.ones(2)}
    for inner in (af.adamw(0.1), af.from_torch(torch.optim.SGD, lr=0.1)):  # fused plan, generic plan
        tx = af.mixed_precision(inner, loss_scale=af.DynamicLossScale(init_scale=4.0))
        state, p = tx.init(params), params
        mon = TrainingMonitor(params)
        hook = LeafFlagsHook(mon)
        tx.engine.on_check = hook
        for ga, gb in [(1.0, 1.0), (float("inf"), 1.0), (1.0, float("nan")), (float("inf"), 1.0)]:
            p, state = tx.step(p, {"b": torch.full((3,), gb), "a": torch.full((2,), ga)}, state)
            mon = mon.record_state(state, loss=1.0, leaf_nonfinite=hook.take())
        assert mon.overflows() == {"a": 2, "b": 1} and int(state.skipped) == 3
        assert hook.take() is None


def test_a_nan_loss_is_a_diverged_run_and_a_step_without_a_loss_is_not():
    mon, _ = healthy_run(steps=30)
    for loss in (torch.tensor(float("nan")), float("nan")):
        h = mon.record(torch.tensor(True), 1024.0, loss=loss).check_health()
        assert h["checks"]["loss_exploding"] and "not finite" in h["alerts"][0], h
    quiet = mon
    for _ in range(5):  # steps recorded without a loss say nothing about it
        quiet = quiet.record(torch.tensor(True), 1024.0)
    h = quiet.check_health()
    assert h["status"] == "healthy" and h["current_loss"] == mon.check_health()["current_loss"]
    assert quiet.history()["loss"][-1] != quiet.history()["loss"][-1]  # NaN in the history


def test_a_monitor_pickled_before_the_loss_given_window_still_loads():
    mon = TrainingMonitor(window=4).record(torch.tensor(True), 1.0, loss=2.0).record(torch.tensor(True), 1.0)
    old = {"tensors": mon._tensors[:9], "config": tuple(mon.config)}  # the nine tensors of earlier releases
    restored = TrainingMonitor.__new__(TrainingMonitor)
    restored.__setstate__(old)
    assert restored.history()["loss"][0] == 2.0 and restored.check_health()["current_loss"] == 2.0
    assert restored.record(torch.tensor(True), 1.0, loss=float("nan")).check_health()["checks"]["loss_exploding"]


def test_the_readers_move_the_counters_as_exact_words():
    from ampfunc.monitor import _as_words, _from_words
    tensors = [torch.tensor(2 ** 60 + 1), torch.tensor([float("nan"), -0.0, 3.5, float("inf")]),
               torch.tensor([True, False]), torch.tensor(-7, dtype=torch.int32)]
    back = _from_words(_as_words(tensors), tensors)
    for a, b in zip(tensors, back):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b)


def test_health_warns_when_a_dynamic_scale_sits_at_its_floor_overflowing():
    # DynamicLossScale stops at min_scale (1.0 by default, health's default too): a scale that
    # collapsed sits at the floor, never below it. 30 straight overflows from 2**4.
    ls, stats = af.DynamicLossScale(2.0**4), init_stats()
    for _ in range(30):
        ls = af.update_scale(ls, torch.tensor(False))
        stats = record(stats, torch.tensor(False), ls)
    assert float(ls.loss_scale) == 1.0
    warnings = health(stats)
    assert any(w.startswith("loss scale collapsed to 1 (at the floor 1)") for w in warnings), warnings


def test_health_at_the_floor_is_quiet_while_steps_are_applied():
    # an unscaled bf16/fp32 run (NoOpLossScale: 1.0) is not a collapse, nor a scale that
    # reached the floor and then stepped fine
    assert health(run([T] * 50, scales=[1.0] * 50)) == []
    stats = record(init_stats(), torch.tensor(True), af.NoOpLossScale())
    assert health(stats) == []
    assert health(run([F] * 3 + [T] * 97, scales=[4.0, 2.0, 1.0] + [1.0] * 97)) == []


def test_a_window_smaller_than_min_steps_alerts_once_it_is_full():
    # the window never holds min_steps (10) steps: a full window is enough (it never fired)
    mon = af.TrainingMonitor({"w": torch.ones(2)}, window=8)
    for _ in range(8):
        mon = mon.record(torch.tensor(False), af.DynamicLossScale(1.0), loss=1.0)
    report = mon.check_health()
    assert report["checks"]["skip_rate_high"] and report["status"] == "unhealthy"


@pytest.mark.parametrize("flags", [torch.tensor([0.5, float("nan")]), torch.tensor([3, -1])])
def test_leaf_flags_must_be_bools(flags):
    mon = af.TrainingMonitor({"a": torch.ones(2), "b": torch.ones(2)})
    with pytest.raises(ValueError, match=r"leaf_nonfinite must be a bool vector of 2 flags .*dtype"):
        mon.record(torch.tensor(True), 1.0, leaf_nonfinite=flags)


# -- thresholds compared exactly: a value at a threshold never trips it by a float rounding -------------


def test_the_skip_rate_alert_does_not_fire_at_exactly_its_threshold():
    # 3 skips in a window of 10 is 30%, not above a 30% threshold (1 - 7/10 is 0.30000000000000004)
    mon = TrainingMonitor(window=10, max_skip_rate=0.3)
    for ok in [T] * 7 + [F] * 3:
        mon = mon.record(torch.tensor(ok), 1.0, loss=1.0)
    h = mon.check_health()
    assert not h["checks"]["skip_rate_high"] and h["status"] == "healthy", h
    assert h["skip_rate"] == 0.3
    # one more skip in the window (4 of 10) is above it
    mon = mon.record(torch.tensor(F), 1.0, loss=1.0)
    h = mon.check_health()
    assert h["checks"]["skip_rate_high"] and "40.0% of the last 10 steps skipped (above 30%)" in h["alerts"][0], h
    # a threshold written with more digits is shown with them
    mon = TrainingMonitor(window=200, max_skip_rate=0.055)
    for ok in [T] * 188 + [F] * 12:
        mon = mon.record(torch.tensor(ok), 1.0, loss=1.0)
    assert "(above 5.5%)" in mon.check_health()["alerts"][0]


def test_health_skip_rate_at_its_threshold_is_quiet():
    # 3 of 10 steps skipped against max_skip_rate=0.3: at the threshold, not above it
    assert health(run([T] * 7 + [F] * 3, [2.0 ** 16] * 10), max_skip_rate=0.3, max_consecutive_skips=10) == []
    warnings = health(run([T] * 6 + [F] * 4), max_skip_rate=0.3, max_consecutive_skips=10)
    assert len(warnings) == 1 and "above 30%" in warnings[0]
    # 7 of 100 against 0.07 (100 * 0.07 is 7.000000000000001, 7 / 100 is not 0.07 in binary)
    assert health(run([T] * 93 + [F] * 7), max_skip_rate=0.07, max_consecutive_skips=10) == []
    # thresholds with no short decimal: 1 of 3 at 1/3, 2 of 3 at 2/3, 1 of 7 at 1/7
    for skipped, steps, rate in ((1, 3, 1 / 3), (2, 3, 2 / 3), (1, 7, 1 / 7)):
        flags = [T] * (steps - skipped) + [F] * skipped
        assert health(run(flags), max_skip_rate=rate, max_consecutive_skips=10) == [], (skipped, steps)


def test_a_window_at_a_threshold_of_one_third_is_quiet():
    mon = TrainingMonitor(window=9, min_steps=3, max_skip_rate=1 / 3)
    for finite in [T, T, F, T, T, F, T, T, F]:
        mon = mon.record(torch.tensor(finite), 1.0, loss=1.0)
    assert not mon.check_health()["checks"]["skip_rate_high"]


@pytest.mark.parametrize("kw", [dict(max_skip_rate=float("nan")), dict(max_skip_rate=5), dict(max_skip_rate=-1),
                                dict(max_consecutive_skips=0), dict(min_scale=-1.0)])
def test_health_refuses_thresholds_that_cannot_mean_anything(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        health(run([T, T]), **kw)


def test_the_loss_alert_does_not_fire_at_exactly_explode_factor_times_the_median():
    # median 45, last loss 63 = 1.4 * 45 exactly (the float 1.4 * 45 is 62.99999999999999)
    mon = TrainingMonitor(window=4, explode_factor=1.4)
    for loss in (45.0, 45.0, 45.0, 63.0):
        mon = mon.record(torch.tensor(T), 1.0, loss=loss)
    assert not mon.check_health()["checks"]["loss_exploding"]
    mon = mon.record(torch.tensor(T), 1.0, loss=64.0)
    assert mon.check_health()["checks"]["loss_exploding"]


def test_the_scale_alert_does_not_fire_at_exactly_scale_drop_factor():
    # one rule for every alert: at exactly the threshold is quiet, above it alerts
    for factor, at, above in ((2.0, (1024.0, 512.0), (1024.0, 256.0)),
                              (1.1, (55.0, 50.0), (55.0, 49.5)),   # the float 1.1 * 50 is 55.00000000000001
                              (10.0, (1000.0, 100.0), (1000.0, 99.0))):
        mon = TrainingMonitor(window=10, scale_drop_factor=factor)
        for s in at:
            mon = mon.record(torch.tensor(T), s, loss=1.0)
        h = mon.check_health()
        assert not h["checks"]["scale_falling"] and h["status"] == "healthy", (factor, h)
        mon = TrainingMonitor(window=10, scale_drop_factor=factor)
        for s in above:
            mon = mon.record(torch.tensor(T), s, loss=1.0)
        h = mon.check_health()
        assert h["checks"]["scale_falling"] and "loss scale fell" in h["alerts"][0], (factor, h)


def test_the_loss_alert_does_not_fire_at_a_factor_with_no_short_decimal():
    # 4 over a median of 3 is exactly the 4 / 3 the user wrote (its shortest decimal is below 4 / 3)
    mon = TrainingMonitor(window=4, explode_factor=4 / 3)
    for loss in (3.0, 3.0, 3.0, 4.0):
        mon = mon.record(torch.tensor(T), 1.0, loss=loss)
    assert not mon.check_health()["checks"]["loss_exploding"]
    mon = mon.record(torch.tensor(T), 1.0, loss=4.5)
    assert mon.check_health()["checks"]["loss_exploding"]


# -- a second moment that overflowed to inf in an applied step: reported from the state, when you log --------


BIG = 1e21  # finite in fp32; its square (1e42) is not


def _moment_params():
    return {"enc.w": torch.ones(3), "head.b": torch.ones(2)}


def _big_grads(scale=1.0):
    return {"enc.w": torch.tensor([BIG, 1.0, 1.0]) * scale, "head.b": torch.ones(2) * scale}


def _pure(tx):
    p = _moment_params()
    _, state = tx.update(_big_grads(), tx.init(p), p)
    return state


def _mixed(inner, how, dtype=torch.float32):
    tx = af.mixed_precision(inner, loss_scale=af.StaticLossScale(256.0))
    p = {k: v.to(dtype) for k, v in _moment_params().items()}
    state = tx.init(p)
    g = _big_grads(256.0)  # fp32 gradients (fp16 cannot hold 1e21), for fp16 params too
    if how == "update":
        _, state = tx.update(g, state, p)
    else:
        _, state = getattr(tx, how)(p, g, state)
    assert bool(state.finite)  # the gradient was finite: the step was applied
    return state


MOMENT_PATHS = {
    "adam.update": lambda: _pure(af.adam(1e-3)),
    "adamw.update": lambda: _pure(af.adamw(1e-3)),
    "adam-amsgrad.update": lambda: _pure(af.adam(1e-3, amsgrad=True)),
    "chain-adamw.update": lambda: _pure(af.chain(af.identity(), af.adamw(1e-3))),
    "from_torch-Adam.update": lambda: _pure(af.from_torch(torch.optim.Adam, lr=1e-3)),
    "from_torch-RMSprop.update": lambda: _pure(af.from_torch(torch.optim.RMSprop, lr=1e-3)),
    "mp-adamw.update": lambda: _mixed(af.adamw(1e-3), "update"),
    "mp-adamw.step": lambda: _mixed(af.adamw(1e-3), "step"),
    "mp-adamw.step_": lambda: _mixed(af.adamw(1e-3), "step_"),
    "mp-adamw-f16-master.step_": lambda: _mixed(af.adamw(1e-3), "step_", torch.float16),
    "mp-from_torch-Adam.step_": lambda: _mixed(af.from_torch(torch.optim.Adam, lr=1e-3), "step_"),
}


@pytest.mark.parametrize("path", sorted(MOMENT_PATHS))
def test_a_second_moment_overflowed_in_an_applied_step_is_reported_naming_the_leaf(path):
    state = MOMENT_PATHS[path]()
    assert af.monitor.moment_overflows(state) == ["enc.w"]
    warnings = health(run([T]), state=state)
    assert len(warnings) == 1 and "overflowed to inf for 'enc.w'" in warnings[0]
    assert "clip_by_global_norm" in warnings[0]
    mon = TrainingMonitor(_moment_params()).record(torch.tensor(T), 256.0, loss=1.0)
    h = mon.check_health(state)
    assert h["status"] == "unhealthy" and h["checks"]["moment_overflow"] and h["moment_overflows"] == ["enc.w"]
    assert sum("second moment" in a for a in h["alerts"]) == 1  # once, however many moments the leaf has
    assert mon.as_dict(state)["status"] == "unhealthy"
    # without the state (or with a healthy one) nothing is reported
    assert mon.check_health()["status"] == "healthy" and not mon.check_health()["checks"]["moment_overflow"]


def test_the_overflowed_param_no_longer_moves_and_the_report_persists_through_a_checkpoint():
    tx = af.mixed_precision(af.adam(1e-3), loss_scale=af.StaticLossScale(1.0))  # no weight decay to move it
    params = _moment_params()
    state = tx.init(params)
    params, state = tx.step_(params, _big_grads(), state)
    frozen = params["enc.w"].clone()
    for _ in range(3):  # ordinary gradients afterwards: the leaf's first element never moves again
        params, state = tx.step_(params, {"enc.w": torch.ones(3), "head.b": torch.ones(2)}, state)
    assert params["enc.w"][0] == frozen[0] and not torch.equal(params["enc.w"][1:], frozen[1:])
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert af.monitor.moment_overflows(torch.load(buf)) == ["enc.w"]


def test_make_train_step_and_module_trainer_states_report_the_overflowed_leaf():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    train = af.make_train_step(model, lambda fwd, x: (fwd(x) * BIG).sum(), af.adamw(1e-3), "p=f32,c=f32,o=f32")
    state, out = train.step(train.init(), torch.ones(4, 3))
    assert bool(out.finite) and sorted(af.monitor.moment_overflows(state)) == ["0.bias", "0.weight"]
    trainer = af.ModuleTrainer(model, af.adamw(1e-3))
    (model(torch.ones(4, 3)) * BIG).sum().backward()
    assert bool(trainer.step())
    assert sorted(af.monitor.moment_overflows(trainer.state)) == ["0.bias", "0.weight"]
    mon = TrainingMonitor(af.params_of(model)).record_state(trainer.state, loss=1.0)
    assert sorted(mon.check_health(trainer.state)["moment_overflows"]) == ["0.bias", "0.weight"]


def test_healthy_states_and_states_without_second_moments_report_nothing():
    p = _moment_params()
    for tx in (af.adamw(1e-3), af.sgd(0.1, momentum=0.9), af.from_torch(torch.optim.RMSprop, lr=1e-3)):
        _, state = tx.update({k: torch.full_like(v, 1e3) for k, v in p.items()}, tx.init(p), p)
        assert af.monitor.moment_overflows(state) == []
        assert health(run([T]), state=state) == []
    assert af.monitor.moment_overflows({}) == [] and af.monitor.moment_overflows(None) == []
    # a state alone, before any step is recorded, still tells
    h = TrainingMonitor().check_health(_pure(af.adamw(1e-3)))
    assert h["status"] == "unhealthy" and h["moment_overflows"] == ["enc.w"]


def test_a_torch_optimizer_state_dict_names_the_param_by_group_and_index():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-2}])
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.state[model[1].bias]["exp_avg_sq"].fill_(float("inf"))
    named = ["param_groups[1]['params'][1]"]
    assert af.monitor.moment_overflows(opt.state_dict()) == named
    assert af.monitor.moment_overflows({"optimizer": opt.state_dict(), "epoch": 3}) == named  # inside a checkpoint
    assert af.monitor.moment_overflows(opt.state_dict()["state"]) == ["3"]  # the entries alone: the param's id
    assert "param_groups[1]['params'][1]" in health(run([T]), state=opt.state_dict())[0]
