"""Step statistics: sync-free counting on the hot path, host-side diagnostics off it."""

import io
import math

import pytest
import torch

import ampfunc as af
from ampfunc.monitor import StepStats, health, init_stats, nonfinite_leaves, record, skip_rate, summary

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
    assert nonfinite_leaves(grads) == ["encoder.layers.1.weight", "head.weight"]


def test_nonfinite_leaves_of_finite_or_empty_trees_is_empty():
    assert nonfinite_leaves({"w": torch.ones(2, dtype=torch.bfloat16)}) == []
    assert nonfinite_leaves({}) == []
    assert nonfinite_leaves({"n": torch.arange(3)}) == []
