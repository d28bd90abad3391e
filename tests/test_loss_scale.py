"""Loss scales: the scale sequence, its rounding, hysteresis, limits, validation and pytree-ness."""

import io
import math
import random

import pytest
import torch

import ampfunc as af
from ampfunc.tree import leaves_with_paths, select_tree


def _grad_scaler_sequence(overflows, **kw):
    """Scales produced by the real torch.amp.GradScaler for a given overflow pattern."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **kw)
    scales = []
    for overflow in overflows:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if overflow:
            p.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _ampfunc_sequence(overflows, **kw):
    ls = af.DynamicLossScale(min_scale=0.0, max_scale=math.inf, **kw)
    scales = []
    for overflow in overflows:
        ls = af.update_scale(ls, torch.tensor(not overflow))
        scales.append(ls.loss_scale.item())
    return scales


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_scale_reproduces_grad_scaler_for_any_factors(seed):
    rng = random.Random(seed)
    kw = dict(init_scale=rng.choice([2.0**16, 1000.0, 3.3e4]),
              growth_factor=rng.choice([2.0, 1.7, 3.0, 1.0001]),
              backoff_factor=rng.choice([0.5, 0.37, 0.9, 0.125]),
              growth_interval=rng.choice([1, 2, 3, 7]))
    overflows = [rng.random() < 0.3 for _ in range(60)]
    ours = _ampfunc_sequence(overflows, **kw)
    theirs = _grad_scaler_sequence(overflows, **kw)
    assert ours == theirs  # exact: same fp32 values, step for step


def test_growth_that_would_overflow_fp32_is_not_applied_like_grad_scaler():
    kw = dict(init_scale=2.0**120, growth_factor=16.0, backoff_factor=0.5, growth_interval=1)
    overflows = [False] * 4 + [True] + [False] * 3
    ours = _ampfunc_sequence(overflows, **kw)
    assert ours == _grad_scaler_sequence(overflows, **kw)
    assert all(math.isfinite(s) for s in ours)


def test_torch_reference_sequence_from_its_test_suite():
    # growth 2, backoff .25, interval 2, scale 4: two clean steps -> 8, then an overflow -> 2.
    ls = af.DynamicLossScale(4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2, min_scale=0.0)
    ls = af.update_scale(ls, torch.tensor(True))
    assert (ls.loss_scale.item(), ls.growth_tracker.item()) == (4.0, 1)
    ls = af.update_scale(ls, torch.tensor(True))
    assert (ls.loss_scale.item(), ls.growth_tracker.item()) == (8.0, 0)
    ls = af.update_scale(ls, torch.tensor(False))
    assert (ls.loss_scale.item(), ls.growth_tracker.item()) == (2.0, 0)


def test_min_and_max_scale_clamp_the_sequence():
    ls = af.DynamicLossScale(4.0, growth_interval=1, min_scale=1.0, max_scale=16.0)
    for _ in range(5):
        ls = af.update_scale(ls, torch.tensor(True))
    assert ls.loss_scale.item() == 16.0
    for _ in range(10):
        ls = af.update_scale(ls, torch.tensor(False))
    assert ls.loss_scale.item() == 1.0


def test_hysteresis_tolerates_k_minus_one_consecutive_overflows_and_refills_on_finite_steps():
    ls = af.DynamicLossScale(1024.0, hysteresis=3, growth_interval=100)
    seq = []
    for finite in [False, False, True, False, False, False, False]:
        ls = af.update_scale(ls, torch.tensor(finite))
        seq.append((ls.loss_scale.item(), ls.hysteresis_tracker.item()))
    assert seq == [(1024.0, 2), (1024.0, 1), (1024.0, 3),  # refilled by the finite step
                   (1024.0, 2), (1024.0, 1), (512.0, 1), (256.0, 1)]


def test_overflow_resets_growth_progress():
    ls = af.DynamicLossScale(8.0, growth_interval=3)
    for finite in [True, True, False, True, True]:
        ls = af.update_scale(ls, torch.tensor(finite))
    assert ls.loss_scale.item() == 4.0 and ls.growth_tracker.item() == 2


def test_inv_scale_is_the_double_reciprocal_stored_in_fp32():
    ls = af.DynamicLossScale(3.0)
    assert ls.inv_scale.dtype == torch.float32
    assert ls.inv_scale.item() == torch.tensor(1 / 3.0, dtype=torch.float64).float().item()


@pytest.mark.parametrize("kwargs, setting", [
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=-2.0), "init_scale"),
    (dict(init_scale=math.inf), "init_scale"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(min_scale=-1.0), "min_scale"),
    (dict(min_scale=4.0, max_scale=2.0), "max_scale"),
    (dict(hysteresis=0), "hysteresis"),
])
def test_invalid_settings_raise_naming_the_setting(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        af.DynamicLossScale(**kwargs)


def test_static_scale_rejects_non_positive_and_never_changes():
    with pytest.raises(ValueError, match="loss_scale"):
        af.StaticLossScale(0.0)
    ls = af.StaticLossScale(128.0)
    assert af.update_scale(ls, torch.tensor(False)).loss_scale.item() == 128.0
    assert af.scale_loss(torch.tensor(2.0, dtype=torch.float16), ls).dtype == torch.float32


def test_noop_scale_leaves_the_loss_and_casts_grads_to_fp32():
    ls = af.NoOpLossScale()
    loss = torch.tensor(1.5, dtype=torch.bfloat16)
    assert af.scale_loss(loss, ls) is loss
    g, finite = af.unscale_and_check({"w": torch.ones(2, dtype=torch.bfloat16)}, ls)
    assert g["w"].dtype == torch.float32 and bool(finite)


def test_loss_scale_is_a_pytree_with_named_leaves_and_static_config():
    ls = af.DynamicLossScale(hysteresis=2)
    assert [p for p, _ in leaves_with_paths({"ls": ls})] == [
        "ls.loss_scale", "ls.growth_tracker", "ls.hysteresis_tracker"]
    new = af.update_scale(ls, torch.tensor(False))
    kept = select_tree(torch.tensor(False), new, ls)
    assert isinstance(kept, af.DynamicLossScale) and kept.config == ls.config
    assert kept.hysteresis_tracker.item() == 2


def test_loss_scale_flows_through_torch_pytree():
    import torch.utils._pytree as pytree
    leaves, spec = pytree.tree_flatten(af.DynamicLossScale(8.0))
    assert [x.item() for x in leaves] == [8.0, 0, 1]
    assert pytree.tree_unflatten(leaves, spec).loss_scale.item() == 8.0


def test_save_and_load_with_weights_only_round_trips():
    ls = af.update_scale(af.DynamicLossScale(512.0, growth_interval=7, hysteresis=2), torch.tensor(False))
    buf = io.BytesIO()
    torch.save({"ls": ls, "static": af.StaticLossScale(4.0), "noop": af.NoOpLossScale()}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert back["ls"].config == ls.config
    assert torch.equal(back["ls"].hysteresis_tracker, ls.hysteresis_tracker)
    assert back["static"].loss_scale.item() == 4.0 and isinstance(back["noop"], af.NoOpLossScale)


def test_update_scale_over_a_dict_of_per_loss_scales():
    scales = {"a": af.DynamicLossScale(8.0), "b": af.DynamicLossScale(8.0)}
    scales = af.update_scale(scales, {"a": torch.tensor(True), "b": torch.tensor(False)})
    assert scales["a"].loss_scale.item() == 8.0 and scales["b"].loss_scale.item() == 4.0


def test_update_scale_in_place_matches_pure():
    a = af.DynamicLossScale(64.0, growth_interval=2, hysteresis=2)
    b = af.DynamicLossScale(64.0, growth_interval=2, hysteresis=2)
    for finite in [True, False, False, True, True, True, False]:
        f = torch.tensor(finite)
        a = af.update_scale(a, f)
        assert af.mixed.update_scale_(b, f) is b
        assert torch.equal(a.loss_scale, b.loss_scale)
        assert torch.equal(a.growth_tracker, b.growth_tracker)
        assert torch.equal(a.hysteresis_tracker, b.hysteresis_tracker)


# ----------------------------------------------------------------------------------------------
# Issue 10, items 1, 2, 7 and 9: a scale or inverse of 0 or inf never reaches a step.
# ----------------------------------------------------------------------------------------------

LO, HI = af.loss_scale.SCALE_RANGE


@pytest.mark.parametrize("inplace", [False, True])
def test_gradscaler_parity_setting_never_underflows_to_zero(inplace):
    # torch's GradScaler reaches 0 after ~150 overflowing steps from 2**16; ours stops at 2**-126.
    ls = af.DynamicLossScale(2.0**16, min_scale=0.0, max_scale=math.inf)
    for _ in range(300):
        ls = af.mixed.update_scale_(ls, torch.tensor(False)) if inplace else af.update_scale(ls, torch.tensor(False))
    assert ls.loss_scale.item() == LO
    assert math.isfinite(ls.inv_scale.item()) and ls.inv_scale.item() > 0
    assert ls.is_valid().item()


def test_gradscaler_parity_holds_until_the_floor():
    overflows = [True] * 180
    ours = af.DynamicLossScale(2.0**16, min_scale=0.0, max_scale=math.inf)
    theirs = _grad_scaler_sequence(overflows)
    for i, overflow in enumerate(overflows):
        ours = af.update_scale(ours, torch.tensor(not overflow))
        assert ours.loss_scale.item() == max(theirs[i], LO), i
    assert theirs[-1] == 0.0  # what torch does: the next finite step writes inf


@pytest.mark.parametrize("inner", [af.adam(1e-3), af.from_torch(torch.optim.Adam, lr=1e-3)], ids=["fused", "generic"])
def test_long_overflow_run_then_finite_step_keeps_params_finite(inner):
    params = {"w": torch.randn(8)}
    tx = af.mixed_precision(inner, loss_scale=af.DynamicLossScale(2.0**16, min_scale=0.0, max_scale=math.inf))
    state = tx.init(params)
    bad = {"w": torch.full((8,), float("inf"))}
    for _ in range(200):
        params, state = tx.step(params, bad, state)
    before = params["w"].clone()
    scaled = {"w": torch.full((8,), 1e-3) * af.loss_scale_of(state).loss_scale}  # grads of the scaled loss
    params, state = tx.step(params, scaled, state)
    leaves = [t for t in af.tree.tree_leaves((params, state)) if t.is_floating_point()]
    assert all(torch.isfinite(t).all() for t in leaves)
    assert not torch.equal(params["w"], before)  # the finite step was applied


@pytest.mark.parametrize("value", [1e-50, 2.0**-130, 2.0**-127, 1e39, float("inf"), float("nan"), 0.0, -2.0,
                                   torch.tensor(float("nan")), torch.tensor(0.0), torch.tensor(-2.0),
                                   torch.tensor(float("inf")), torch.tensor(1e-50, dtype=torch.float64)])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_scales_outside_the_fp32_normal_range_are_refused(value, kind):
    with pytest.raises(ValueError, match="init_scale" if kind == "dynamic" else "loss_scale"):
        if kind == "static":
            af.StaticLossScale(value)
        else:
            af.DynamicLossScale(value, min_scale=0.0, max_scale=math.inf)


def test_scale_range_ends_are_accepted_and_their_inverses_finite():
    for v in (LO, HI):
        ls = af.StaticLossScale(v)
        assert ls.loss_scale.item() == v
        inv = ls.inv_scale.item()
        assert math.isfinite(inv) and inv > 0


def test_init_scale_outside_min_max_is_refused():
    with pytest.raises(ValueError, match=r"init_scale .*max_scale"):
        af.DynamicLossScale(2.0**32)  # default max_scale is 2**24
    with pytest.raises(ValueError, match=r"init_scale .*min_scale"):
        af.DynamicLossScale(0.5)  # default min_scale is 1
    assert af.DynamicLossScale(2.0**32, max_scale=math.inf).loss_scale.item() == 2.0**32


def test_hand_set_invalid_scale_skips_every_step_instead_of_poisoning():
    # A scale set by hand (from_tensors does not read values) with 0 or inf: inv_scale is NaN,
    # unscale_and_check says "not finite", and the composed step is skipped.
    for bad in (0.0, float("inf"), float("nan"), 1e-45):
        ls = af.DynamicLossScale.from_tensors(torch.tensor(bad), torch.zeros((), dtype=torch.int32),
                                              torch.ones((), dtype=torch.int32), af.loss_scale.DynamicConfig())
        assert not ls.is_valid().item()
        assert math.isnan(ls.inv_scale.item())
        _, finite = af.unscale_and_check({"w": torch.ones(3)}, ls)
        assert not finite.item()
        _, finite = af.unscale_and_check({}, ls)  # no elements: still not a clean step
        assert not finite.item()


@pytest.mark.parametrize("flag", [torch.tensor(float("nan")), torch.tensor(1.0), torch.tensor(1),
                                  1, 1.0, None, "yes", torch.tensor([True, True])])
@pytest.mark.parametrize("ls", [af.DynamicLossScale(), af.StaticLossScale(8.0), af.NoOpLossScale()],
                         ids=["dynamic", "static", "noop"])
def test_update_scale_refuses_non_bool_or_shaped_flags(flag, ls):
    before = [t.clone() for t in af.tree.tree_leaves(ls)]
    with pytest.raises((TypeError, ValueError), match="finite"):
        af.update_scale(ls, flag)
    with pytest.raises((TypeError, ValueError), match="finite"):
        af.mixed.update_scale_(ls, flag)
    assert all(torch.equal(a, b) for a, b in zip(before, af.tree.tree_leaves(ls)))


def test_python_bool_flags_are_accepted():
    ls = af.DynamicLossScale(8.0, growth_interval=1)
    assert af.update_scale(ls, True).loss_scale.item() == 16.0
    assert af.update_scale(ls, False).loss_scale.item() == 4.0


@pytest.mark.parametrize("name,value", [("growth_factor", torch.tensor(2.0)), ("min_scale", "1"),
                                        ("hysteresis", True), ("max_scale", None)])
def test_non_number_settings_are_refused_naming_them(name, value):
    with pytest.raises(TypeError, match=name):
        af.DynamicLossScale(**{name: value})


@pytest.mark.parametrize("method", ["step", "step_"])
@pytest.mark.parametrize("inner", [lambda: af.adam(1e-3), lambda: af.from_torch(torch.optim.Adam, lr=1e-3)],
                         ids=["fused", "generic"])
@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_hand_set_invalid_scale_skips_the_composed_step(bad, inner, method):
    params = {"w": torch.ones(3, dtype=torch.float16)}
    ls = af.DynamicLossScale.from_tensors(torch.tensor(bad), torch.zeros((), dtype=torch.int32),
                                          torch.ones((), dtype=torch.int32), af.loss_scale.DynamicConfig())
    tx = af.mixed_precision(inner(), loss_scale=ls)
    state = tx.init(params)
    new_params, new_state = getattr(tx, method)(params, {"w": torch.ones(3, dtype=torch.float16)}, state)
    assert torch.equal(new_params["w"], torch.ones(3, dtype=torch.float16))
    assert torch.equal(new_state.master["w"], torch.ones(3))
    if bad == 0.0:  # a zero scale backs off to the floor (here min_scale=1) and trains again
        assert af.loss_scale_of(new_state).loss_scale.item() == 1.0


# ---------------------------------------------------------------------------------------------
# replace: new settings mid-run, the scale kept within them
# ---------------------------------------------------------------------------------------------


def test_replace_keeps_the_scale_within_new_bounds_so_an_overflow_never_raises_it():
    ls = af.DynamicLossScale(1024.0).replace(min_scale=4096.0)
    assert float(ls.loss_scale) == 4096.0 and ls.config.min_scale == 4096.0
    after = af.update_scale(ls, torch.tensor(False))
    assert float(after.loss_scale) == 4096.0  # at the floor: a backoff stays there
    capped = af.DynamicLossScale(1024.0).replace(max_scale=10.0)
    assert float(capped.loss_scale) == 10.0
    assert float(af.update_scale(capped, torch.tensor(True)).loss_scale) == 10.0


def test_replace_of_the_interval_or_factors_keeps_the_tensors_and_leaves_self_alone():
    ls = af.DynamicLossScale(256.0, growth_interval=3)
    ls = af.update_scale(ls, torch.tensor(True))
    other = ls.replace(growth_interval=2, growth_factor=4.0)
    assert other.loss_scale is ls.loss_scale and other.growth_tracker is ls.growth_tracker
    assert ls.config.growth_interval == 3 and other.config.growth_interval == 2
    assert float(af.update_scale(other, torch.tensor(True)).loss_scale) == 1024.0  # tracker carried over
    narrowed = ls.replace(min_scale=512.0)
    assert float(ls.loss_scale) == 256.0 and float(narrowed.loss_scale) == 512.0


def test_replace_lowering_hysteresis_lowers_the_remaining_budget():
    ls = af.DynamicLossScale(1024.0, hysteresis=3).replace(hysteresis=1)
    scales = []
    for _ in range(3):
        ls = af.update_scale(ls, torch.tensor(False))
        scales.append(float(ls.loss_scale))
    assert scales == [512.0, 256.0, 128.0]


def test_replace_refuses_what_the_constructor_refuses():
    ls = af.DynamicLossScale(1024.0)
    with pytest.raises(ValueError, match="max_scale"):
        ls.replace(min_scale=8.0, max_scale=4.0)
    with pytest.raises(ValueError, match="hysteresis"):
        ls.replace(hysteresis=0)
