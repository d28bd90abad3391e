"""Settings and inputs that used to be accepted and then poisoned training (NaN/inf params, an
ascending optimizer, a step skipped forever) or failed later with an anonymous error.

Each is refused where it is given, with a ValueError/TypeError naming the setting, and where a
step is involved the params and state are unchanged after the error.
"""

import math

import pytest
import torch

import ampfunc as af
from ampfunc import fp8
from ampfunc.compat.apex import amp
from ampfunc.compat.apex.amp import _amp_state
from ampfunc.compat.apex.fp16_utils import FP16_Optimizer
from ampfunc.tree import tree_clone, tree_leaves

NAN, INF = float("nan"), float("inf")


def _same(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(
        (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(la, lb))


# ----------------------------------------------------------------------------------------------
# 1. schedules: values that give NaN/inf/negative learning rates are refused at construction
# ----------------------------------------------------------------------------------------------

_BAD_SCHEDULES = [
    ("exponential_decay", "decay_rate", lambda: af.optim.exponential_decay(1e-3, transition_steps=10, decay_rate=-0.5)),
    ("exponential_decay", "decay_rate", lambda: af.optim.exponential_decay(1e-3, 10, 1e39)),
    ("exponential_decay", "init_value", lambda: af.optim.exponential_decay(-1e-3, 10, 0.5)),
    ("exponential_decay", "end_value", lambda: af.optim.exponential_decay(1e-3, 10, 0.5, end_value=-1.0)),
    ("exponential_decay", "transition_steps", lambda: af.optim.exponential_decay(1e-3, 10**40, 0.5)),
    ("exponential_decay", "staircase", lambda: af.optim.exponential_decay(1e-3, 10, 0.5, staircase=1)),
    ("cosine_decay_schedule", "exponent", lambda: af.optim.cosine_decay_schedule(1e-3, decay_steps=2, exponent=-1.0)),
    ("cosine_decay_schedule", "exponent", lambda: af.optim.cosine_decay_schedule(1e-3, 2, exponent=0.0)),
    ("cosine_decay_schedule", "alpha", lambda: af.optim.cosine_decay_schedule(1e-3, 2, alpha=-0.5)),
    ("cosine_decay_schedule", "alpha", lambda: af.optim.cosine_decay_schedule(1e30, 2, alpha=1e10)),
    ("cosine_decay_schedule", "init_value", lambda: af.optim.cosine_decay_schedule(INF, 2)),
    ("cosine_decay_schedule", "decay_steps", lambda: af.optim.cosine_decay_schedule(1.0, 10**40)),
    ("linear_schedule", "end_value", lambda: af.optim.linear_schedule(1e-3, -1e-3, 2)),
    ("linear_schedule", "init_value", lambda: af.optim.linear_schedule(1e39, 0.0, 2)),
    ("linear_schedule", "transition_begin", lambda: af.optim.linear_schedule(1.0, 0.0, 2, transition_begin=2**63)),
    ("constant_schedule", "value", lambda: af.optim.constant_schedule(1e39)),
    ("constant_schedule", "value", lambda: af.optim.constant_schedule(-0.1)),
    ("warmup_cosine_decay_schedule", "peak_value", lambda: af.optim.warmup_cosine_decay_schedule(0.0, -1.0, 2, 10)),
    ("warmup_cosine_decay_schedule", "end_value", lambda: af.optim.warmup_cosine_decay_schedule(0.0, 1.0, 2, 10, 1e39)),
    ("warmup_cosine_decay_schedule", "exponent", lambda: af.optim.warmup_cosine_decay_schedule(0.0, 1.0, 2, 10,
                                                                                         exponent=-2.0)),
    ("warmup_cosine_decay_schedule", "end_value / peak_value",
     lambda: af.optim.warmup_cosine_decay_schedule(0.0, 1e-40, 2, 10, end_value=1e30)),
]


@pytest.mark.parametrize("schedule, setting, make", _BAD_SCHEDULES,
                         ids=[f"{s}-{k}-{i}" for i, (s, k, _) in enumerate(_BAD_SCHEDULES)])
def test_schedule_bad_setting_is_refused_naming_it(schedule, setting, make):
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    assert schedule in str(info.value) and setting in str(info.value), str(info.value)


def test_constant_schedule_1e39_names_float32():
    with pytest.raises(ValueError, match=r"constant_schedule: value .*float32"):
        af.optim.constant_schedule(1e39)


def test_valid_optax_style_schedules_still_work():
    grow = af.optim.exponential_decay(1.0, transition_steps=2, decay_rate=2.0, end_value=3.0)  # growth, capped
    assert [float(grow(c)) for c in (0, 2, 4, 9)] == [1.0, 2.0, 3.0, 3.0]
    to_zero = af.optim.linear_schedule(1.0, 0.0, transition_steps=4)  # an end value of 0
    assert [float(to_zero(c)) for c in (0, 2, 4, 9)] == [1.0, 0.5, 0.0, 0.0]
    assert float(af.optim.linear_schedule(0.5, 0.0, transition_steps=0)(7)) == 0.5  # optax: constant
    up = af.optim.cosine_decay_schedule(1.0, 4, alpha=2.0)  # alpha > 1 grows
    assert float(up(4)) == 2.0
    assert float(af.optim.constant_schedule(float(torch.finfo(torch.float32).max))(0)) == float(
        torch.finfo(torch.float32).max)
    warm = af.optim.warmup_cosine_decay_schedule(0.0, 1.0, 2, 6, end_value=0.0)
    assert all(math.isfinite(float(warm(c))) and float(warm(c)) >= 0 for c in range(10))


# ----------------------------------------------------------------------------------------------
# 2. apex facades: a loss scale that is 0, negative, NaN, inf or 1e39
# ----------------------------------------------------------------------------------------------

_BAD_SCALES = [0.0, -1.0, NAN, INF, 1e39]


def _fp16_opt(dynamic: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).half()
    kw = {"dynamic_loss_scale": True} if dynamic else {"static_loss_scale": 8.0}
    return model, FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False, **kw)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("bad", _BAD_SCALES)
def test_fp16_optimizer_loss_scale_setter_refuses(dynamic, bad):
    model, opt = _fp16_opt(dynamic)
    opt.loss_scale = 128.0  # a valid value is taken (2**16 would overflow these fp16 grads)
    before = opt.loss_scale
    with pytest.raises(ValueError, match="FP16_Optimizer.loss_scale"):
        opt.loss_scale = bad
    assert opt.loss_scale == before
    # The next step is the step the old scale gives: finite model and masters.
    w0 = model.weight.detach().clone()
    opt.zero_grad()
    opt.backward(model(torch.ones(4, 3).half()).float().sum())
    opt.step()
    assert not opt.overflow
    assert torch.isfinite(model.weight).all() and not torch.equal(model.weight, w0)
    assert torch.isfinite(opt.fp32_from_fp16_groups[0][0]).all()


@pytest.mark.parametrize("bad", [NAN, INF, 1e39, 0.0, -4.0])
def test_fp16_optimizer_dynamic_init_scale_refused(bad):
    model = torch.nn.Linear(3, 2).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"dynamic_loss_args\['init_scale'\]"):
        FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": bad}, verbose=False)
    assert all(p.dtype == torch.float16 for p in inner.param_groups[0]["params"])  # the optimizer untouched


@pytest.fixture
def _amp_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, num_losses=2)
    yield model, opt
    if _amp_state.handle is not None:
        _amp_state.handle._deactivate()


@pytest.mark.parametrize("bad", _BAD_SCALES)
def test_amp_loss_scaler_setter_refuses(_amp_model, bad):
    model, opt = _amp_model
    with pytest.raises(ValueError, match="_loss_scale"):
        _amp_state.loss_scalers[0]._loss_scale = bad
    assert _amp_state.loss_scalers[0].loss_scale() == 65536.0
    with amp.scale_loss(model(torch.ones(4, 3)).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_amp_load_state_dict_checks_every_entry_first(_amp_model):
    sd = amp.state_dict()
    bad = {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 3}, "loss_scaler1": {"loss_scale": NAN, "unskipped": 0}}
    with pytest.raises(ValueError, match=r"loss_scaler1.*loss_scale"):
        amp.load_state_dict(bad)
    assert amp.state_dict() == sd  # loss_scaler0 was not loaded either


# ----------------------------------------------------------------------------------------------
# 3. from_torch given another optimizer's (or configuration's) state
# ----------------------------------------------------------------------------------------------

_FOREIGN = [
    ("sum", "Adagrad", lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3),
     lambda: af.from_torch(torch.optim.Adagrad, lr=1e-3)),
    ("momentum_buffer", "RMSprop", lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3),
     lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3, momentum=0.9)),
    ("max_exp_avg_sq", "Adam", lambda: af.from_torch(torch.optim.Adam, lr=1e-3),
     lambda: af.from_torch(torch.optim.Adam, lr=1e-3, amsgrad=True)),
    ("momentum_buffer", "SGD", lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3),
     lambda: af.from_torch(torch.optim.SGD, lr=1e-3, momentum=0.9)),
]


@pytest.mark.parametrize("key, cls, made_by, used_by", _FOREIGN, ids=[f"{k}-{c}" for k, c, _, _ in _FOREIGN])
def test_from_torch_foreign_state_is_refused_naming_the_key(key, cls, made_by, used_by):
    torch.manual_seed(0)
    params = {"enc.w": torch.randn(4, 3), "head.b": torch.randn(3)}
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = made_by().init(params)
    state0, params0 = tree_clone(state), tree_clone(params)
    with pytest.raises(ValueError) as info:
        used_by().update(grads, state, params)
    msg = str(info.value)
    assert f"from_torch({cls})" in msg and repr(key) in msg and "different optimizer or configuration" in msg, msg
    assert "'enc.w'" in msg
    assert _same(state, state0) and _same(params, params0)

    # In place: nothing is written before the error.
    tx_a = af.mixed_precision(made_by(), af.DynamicLossScale())
    tx_b = af.mixed_precision(used_by(), af.DynamicLossScale())
    mp_state = tx_a.init(params)
    mp_state0 = tree_clone(mp_state)
    with pytest.raises(ValueError, match="different optimizer or configuration"):
        tx_b.step_(params, grads, mp_state)
    assert _same(params, params0) and _same(mp_state, mp_state0)


# ----------------------------------------------------------------------------------------------
# 4. fp8 recipes
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [fp8.DelayedScaling, fp8.CurrentScaling])
@pytest.mark.parametrize("margin", [200, 19, 135, -113])
def test_fp8_margin_out_of_range_is_refused(recipe, margin):
    with pytest.raises(ValueError, match=rf"{recipe.__name__}: margin must be an int in \[-112, 18\]"):
        recipe(margin=margin)


@pytest.mark.parametrize("recipe", [fp8.DelayedScaling, fp8.CurrentScaling])
@pytest.mark.parametrize("setting, value", [("history_len", True), ("margin", False), ("margin", 1.0),
                                            ("history_len", 2.0), ("power_of_2", 1)])
def test_fp8_recipe_types_are_checked(recipe, setting, value):
    with pytest.raises(TypeError, match=rf"{recipe.__name__}: {setting}"):
        recipe(**{setting: value})


def test_fp8_margin_edges_accepted_and_finite():
    fp8.DelayedScaling(margin=-112)
    fp8.CurrentScaling(margin=18)
    meta = fp8.Fp8Meta(torch.zeros(2), torch.ones(()))
    for margin in (-112, 0, 18):
        for fp8_max in (448.0, 57344.0):
            scale, _ = fp8.advance_meta(meta, torch.tensor(3.0), fp8_max, fp8.DelayedScaling(2, margin=margin))
            assert torch.isfinite(scale) and scale > 0 and torch.isfinite(scale.reciprocal())


def test_fp8_training_with_largest_margin_does_not_skip():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    pol = fp8.fp8_policy(model)
    pol = fp8.Fp8Policy(pol.layers, recipe=fp8.DelayedScaling(margin=18))
    train = af.make_train_step(model, lambda fwd, x: fwd(x).float().square().mean(), af.adamw(1e-3), fp8=pol)
    state = train.init()
    for _ in range(3):
        state, out = train.step(state, torch.randn(8, 16))
    assert int(state.skipped) == 0 and math.isfinite(float(out.loss))


# ----------------------------------------------------------------------------------------------
# 5. GradScaler.update(new_scale): torch takes a float or a 0-d tensor
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_grad_scaler_update_refuses_non_0d_new_scale(shape):
    scaler = af.compat.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"new_scale .*0-d tensor.*shape \(1"):
        scaler.update(torch.full(shape, 2.0))
    assert scaler.get_scale() == 4.0 and scaler._get_growth_tracker() == 0
    # torch refuses it too (its 0-d scale cannot take the copy)
    ref = torch.amp.GradScaler("cpu", init_scale=4.0)
    ref.scale(torch.tensor(1.0))
    with pytest.raises(RuntimeError):
        ref.update(torch.full(shape, 2.0))


def test_grad_scaler_update_accepts_what_torch_accepts():
    for new_scale in (2.0, torch.tensor(2.0), torch.tensor(2.0, dtype=torch.float64), torch.tensor(2)):
        scaler = af.compat.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.tensor(1.0))
        scaler.update(new_scale)
        assert scaler.get_scale() == 2.0
    scaler = af.compat.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(AssertionError, match="1-element"):  # torch's own refusal, kept
        scaler.update(torch.tensor([2.0, 3.0]))


# ----------------------------------------------------------------------------------------------
# 6. checkpoints and loads: bad entries refused before anything changes (GradScaler, FP16_Optimizer,
#    amp), a hand-set invalid GradScaler scale skips, apex checkpoints load weights_only, streams
# ----------------------------------------------------------------------------------------------

def _gs_after_one_step(**kw):
    torch.manual_seed(0)
    scaler = af.compat.GradScaler("cpu", init_scale=1024.0, growth_interval=7, **kw)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    return scaler


_GS_BAD_LOADS = [
    ("scale", {"scale": 0.0}, ValueError), ("scale", {"scale": -1.0}, ValueError),
    ("scale", {"scale": NAN}, ValueError), ("scale", {"scale": INF}, ValueError),
    ("scale", {"scale": 1e39}, ValueError), ("scale", {"scale": "8"}, TypeError),
    ("scale", {"scale": True}, TypeError),
    ("_growth_tracker", {"_growth_tracker": -5}, ValueError),
    ("_growth_tracker", {"_growth_tracker": 2**31}, ValueError),
    ("_growth_tracker", {"_growth_tracker": 2.5}, ValueError),
    ("_growth_tracker", {"_growth_tracker": True}, TypeError),
    ("growth_interval", {"growth_interval": 0}, ValueError),
    ("growth_factor", {"growth_factor": None}, TypeError),
    ("_hysteresis_tracker", {"min_scale": 1.0, "max_scale": 2.0**24, "hysteresis": 2, "_hysteresis_tracker": 99},
     ValueError),
    ("scale", {"min_scale": 4096.0, "max_scale": 2.0**24, "hysteresis": 1}, ValueError),  # scale 1024 < min_scale
]


@pytest.mark.parametrize("key, change, error", _GS_BAD_LOADS,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(_GS_BAD_LOADS)])
def test_grad_scaler_load_state_dict_refuses_bad_entries_before_loading(key, change, error):
    scaler = _gs_after_one_step()
    before, settings = scaler.state_dict(), scaler._settings()
    # growth_factor changed too: a partial load would show in the settings
    bad = {**scaler.state_dict(), "growth_factor": 3.0, **change}
    with pytest.raises(error, match=rf"load_state_dict.*{key}"):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before and scaler._settings() == settings


def test_grad_scaler_load_state_dict_still_takes_torch_and_tensor_entries():
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=5)
    scaler = _gs_after_one_step()
    scaler.load_state_dict(theirs.state_dict())
    assert scaler.state_dict() == theirs.state_dict()
    scaler.load_state_dict({**theirs.state_dict(), "scale": torch.tensor(16.0), "_growth_tracker": torch.tensor(3)})
    assert scaler.get_scale() == 16.0 and scaler._get_growth_tracker() == 3
    with pytest.raises(KeyError, match="_growth_tracker"):
        scaler.load_state_dict({k: v for k, v in theirs.state_dict().items() if k != "_growth_tracker"})


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "adamw-fused"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_-step"])
@pytest.mark.parametrize("bad", [0.0, -1.0, NAN, INF])
def test_grad_scaler_hand_set_invalid_scale_skips_the_step(bad, unscale, fused):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = (torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = af.compat.GradScaler("cpu")
    scaler.scale(torch.zeros(()))
    scaler._scale.fill_(bad)  # set by hand, as frameworks reach into torch's attribute
    scaler.scale(model(torch.randn(3, 4)).square().mean()).backward()
    params = [p.detach().clone() for p in model.parameters()]
    if unscale:
        scaler.unscale_(opt)
    _, found_inf = scaler.step(opt, return_found_inf=True)
    assert bool(found_inf)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    scaler.update()
    if bad in (0.0, -1.0):  # backs off to the floor and trains again
        assert scaler.get_scale() == 2.0**-126


def _fp16_adam(fp32_shape):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3).half())
    norm = torch.nn.Parameter(torch.randn(fp32_shape))
    opt = FP16_Optimizer(torch.optim.Adam([w, norm], lr=1e-2), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 8.0}, verbose=False)
    return (w, norm), opt


def _fp16_adam_step(ps, opt):
    opt.zero_grad()
    opt.backward((ps[0].float() ** 2).sum() + (ps[1] ** 2).sum())
    opt.step()


@pytest.mark.parametrize("saved_shape, loaded_shape", [((5,), (6,)), ((4, 3), (3, 4))],
                         ids=["fp32-param-resized", "fp32-param-transposed"])
def test_fp16_optimizer_load_refuses_optimizer_state_of_other_shapes(saved_shape, loaded_shape):
    import io
    ps, opt = _fp16_adam(saved_shape)
    for _ in range(2):
        _fp16_adam_step(ps, opt)
    assert "exp_avg" in opt.state[ps[1]]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    ps2, opt2 = _fp16_adam(loaded_shape)
    _fp16_adam_step(ps2, opt2)
    snap = tree_clone((opt2.optimizer.state_dict(), opt2.fp32_from_fp16_groups, [p.detach() for p in ps2]))
    scale = opt2.loss_scale
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*'exp_avg'"):
        opt2.load_state_dict(torch.load(buf))
    assert _same(snap, (opt2.optimizer.state_dict(), opt2.fp32_from_fp16_groups, [p.detach() for p in ps2]))
    assert opt2.loss_scale == scale
    _fp16_adam_step(ps2, opt2)  # still trains


def test_fp16_optimizer_load_refuses_swapped_fp16_and_fp32_params():
    import io
    torch.manual_seed(0)
    a16, b32 = torch.nn.Parameter(torch.randn(4, 3).half()), torch.nn.Parameter(torch.randn(5))
    opt = FP16_Optimizer(torch.optim.Adam([a16, b32], lr=1e-2), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 8.0}, verbose=False)
    opt.zero_grad()
    opt.backward((a16.float() ** 2).sum() + (b32 ** 2).sum())
    opt.step()
    assert "exp_avg" in opt.state[b32]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    b2, a2 = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(4, 3).half())
    opt2 = FP16_Optimizer(torch.optim.Adam([b2, a2], lr=1e-2), dynamic_loss_scale=True, verbose=False)
    snap = tree_clone((opt2.optimizer.state_dict(), opt2.fp32_from_fp16_groups))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*'exp_avg'"):
        opt2.load_state_dict(torch.load(buf))
    assert _same(snap, (opt2.optimizer.state_dict(), opt2.fp32_from_fp16_groups))


def test_fp16_optimizer_load_of_matching_state_still_resumes():
    import io
    ps, opt = _fp16_adam((5,))
    for _ in range(2):
        _fp16_adam_step(ps, opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    ps2, opt2 = _fp16_adam((5,))
    opt2.load_state_dict(torch.load(buf))
    assert torch.equal(opt2.state[ps2[1]]["exp_avg"], opt.state[ps[1]]["exp_avg"])
    _fp16_adam_step(ps2, opt2)


def test_amp_load_state_dict_refuses_unskipped_beyond_int32_before_loading(_amp_model):
    sd = amp.state_dict()
    bad = {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 2**31},
           "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}}
    with pytest.raises(ValueError, match=r"loss_scaler0.*unskipped.*2\*\*31"):
        amp.load_state_dict(bad)
    assert amp.state_dict() == sd
    ok = {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 2**31 - 1},
          "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}}
    amp.load_state_dict(ok)
    assert amp.state_dict() == ok


def test_apex_scaler_unskipped_setter_refuses_beyond_int32():
    from ampfunc.compat.apex._scaler import LossScaler
    ls = LossScaler("dynamic")
    with pytest.raises(ValueError, match="_unskipped"):
        ls._unskipped = 2**31
    assert ls._unskipped == 0


def test_apex_checkpoints_load_weights_only_after_importing_compat_apex(tmp_path):
    import subprocess
    import sys
    model = torch.nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    from ampfunc.compat.apex.fp16_utils import DynamicLossScaler
    path = tmp_path / "apex_facade.pt"
    torch.save({"optimizer": opt.state_dict(), "old_scaler": DynamicLossScaler()}, path)
    code = ("import sys, torch, ampfunc.compat.apex\n"
            f"ck = torch.load({str(path)!r})\n"
            "print(type(ck['optimizer']['loss_scaler']).__name__, type(ck['old_scaler']).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["LossScaler", "DynamicLossScaler"]


def test_checkpoint_stream_holds_several_checkpoints_back_to_back():
    import io
    buf = io.BytesIO()
    af.checkpoint.save({"step": torch.tensor(1)}, buf)
    end_first = buf.tell()
    af.checkpoint.save({"step": torch.tensor(2)}, buf)
    buf.seek(0)
    assert int(af.checkpoint.load(buf)["step"]) == 1 and buf.tell() == end_first
    assert int(af.checkpoint.load(buf)["step"]) == 2 and buf.tell() == len(buf.getvalue())
    with pytest.raises(af.checkpoint.CheckpointError, match="end"):
        af.checkpoint.load(buf)
    # a truncated second checkpoint is still refused, and the stream is put back where it was
    cut = io.BytesIO(buf.getvalue()[:-7])
    af.checkpoint.load(cut)
    at = cut.tell()
    with pytest.raises(af.checkpoint.CheckpointError, match="truncated"):
        af.checkpoint.load(cut)
    assert cut.tell() == at
    # corrupted payload bytes in the first checkpoint are refused too
    blob = bytearray(buf.getvalue())
    blob[end_first - 10] ^= 0xFF
    with pytest.raises(af.checkpoint.CheckpointError, match="corrupted"):
        af.checkpoint.load(io.BytesIO(bytes(blob)))


def test_checkpoint_path_with_extra_bytes_still_refused(tmp_path):
    path = tmp_path / "two.ckpt"
    with open(path, "wb") as fh:
        af.checkpoint.save({"step": torch.tensor(1)}, fh)
        af.checkpoint.save({"step": torch.tensor(2)}, fh)
    with pytest.raises(af.checkpoint.CheckpointError, match="extra bytes"):
        af.checkpoint.load(path)
    with open(path, "rb") as fh:
        assert [int(af.checkpoint.load(fh)["step"]) for _ in range(2)] == [1, 2]


# ----------------------------------------------------------------------------------------------
# 7. recommend_policy: cpu_flags as a string, capability / n_params / device_memory checked
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", ["avx512_bf16", "fpu vme sse avx512_bf16 amx_bf16", "fpu,AVX512_BF16",
                                   ["AMX_BF16"], ("fpu sse", "avx512_bf16")])
def test_recommend_policy_cpu_flags_string_or_list_case_insensitive(flags):
    assert af.recommend_policy("cpu", cpu_flags=flags).precision == "bf16"


@pytest.mark.parametrize("flags", ["", "avx2 avx512f", "avx512_bf16x", []])
def test_recommend_policy_cpu_flags_without_bf16(flags):
    assert af.recommend_policy("cpu", cpu_flags=flags).precision == "fp32"


@pytest.mark.parametrize("kwargs, error, name", [
    ({"cpu_flags": 3}, TypeError, "cpu_flags"),
    ({"cpu_flags": [b"avx512_bf16"]}, TypeError, "cpu_flags"),
    ({"cpu_flags": b"avx512_bf16"}, TypeError, "cpu_flags"),
    ({"n_params": True}, TypeError, "n_params"),
    ({"n_params": 1.5}, TypeError, "n_params"),
    ({"n_params": -1}, ValueError, "n_params"),
    ({"device_memory": float("nan")}, TypeError, "device_memory"),
    ({"device_memory": "80GB"}, TypeError, "device_memory"),
    ({"device_memory": True}, TypeError, "device_memory"),
    ({"device_memory": 8e9}, TypeError, "device_memory"),
    ({"device_memory": 0}, ValueError, "device_memory"),
    ({"device_memory": -2 ** 30}, ValueError, "device_memory"),
    ({"n_params": 10 ** 400}, ValueError, "n_params"),
    ({"device_memory": 2 ** 63}, ValueError, "device_memory"),
    ({"capability": (8, 0)}, ValueError, "capability.*CPU"),
])
def test_recommend_policy_cpu_plan_refuses(kwargs, error, name):
    with pytest.raises(error, match=name):
        af.recommend_policy("cpu", **kwargs)


@pytest.mark.parametrize("capability, error", [
    ((True, 0), TypeError), ((8, False), TypeError), ((8.0, 0), TypeError), ("80", TypeError), (8, TypeError),
    ((8,), ValueError), ((8, 0, 0), ValueError), ((-1, 0), ValueError),
])
def test_recommend_policy_capability_must_be_an_int_pair(capability, error):
    with pytest.raises(error, match="capability"):
        af.recommend_policy("cuda", capability=capability)


def test_recommend_policy_cpu_flags_for_a_cuda_plan_refused():
    with pytest.raises(ValueError, match="cpu_flags"):
        af.recommend_policy("cuda", capability=(8, 0), cpu_flags="avx512_bf16")
    with pytest.raises(ValueError, match="capability.*cpu_flags|cpu_flags.*capability"):
        af.recommend_policy(capability=(8, 0), cpu_flags="avx512_bf16")
    assert af.recommend_policy(cpu_flags="avx512_bf16").device == "cpu"  # cpu_flags plans a CPU


# -- 8. amp.initialize and the fp16_utils scalers refuse before they change anything ------------


@pytest.mark.parametrize("kwargs, name", [
    ({"loss_scale": float("inf")}, "loss_scale"), ({"loss_scale": 1e39}, "loss_scale"),
    ({"min_loss_scale": -5.0}, "min_loss_scale"), ({"max_loss_scale": float("nan")}, "max_loss_scale"),
    ({"max_loss_scale": None}, "max_loss_scale"),
])
def test_amp_initialize_refuses_bad_scale_settings_before_casting_anything(kwargs, name):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"amp.initialize\(.*{name}"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0, **kwargs)
    assert model[0].weight.dtype == torch.float32 and not hasattr(opt, "_amp_stash")
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)  # the fixed retry works
    assert model[0].weight.dtype == torch.float16


def test_a_second_amp_initialize_says_it_undoes_the_first_ones_registrations():
    if _amp_state.handle is not None:  # a fresh process, as far as amp can tell
        _amp_state.handle._deactivate()
    amp.register_float_function(torch, "sigmoid")
    amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
    with pytest.warns(UserWarning, match="called before"):
        amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
    _amp_state.handle._deactivate()


@pytest.mark.parametrize("make, name", [
    (lambda: __import__("ampfunc.compat.apex.fp16_utils", fromlist=["x"]).DynamicLossScaler(scale_factor=0),
     "scale_factor"),
    (lambda: __import__("ampfunc.compat.apex.fp16_utils", fromlist=["x"]).DynamicLossScaler(scale_factor=1),
     "scale_factor"),
    (lambda: __import__("ampfunc.compat.apex.fp16_utils", fromlist=["x"]).DynamicLossScaler(scale_window=2.5),
     "scale_window"),
    (lambda: __import__("ampfunc.compat.apex.fp16_utils", fromlist=["x"]).LossScaler("abc"), "scale"),
])
def test_fp16_utils_scalers_name_their_own_bad_settings(make, name):
    with pytest.raises((TypeError, ValueError), match=name):
        make()


def test_fp16_utils_dynamic_scaler_refuses_an_infinite_cur_scale():
    from ampfunc.compat.apex.fp16_utils import DynamicLossScaler
    s = DynamicLossScaler(init_scale=256.0)
    with pytest.raises(ValueError, match="cur_scale"):
        s.cur_scale = float("inf")
    assert s.cur_scale == 256.0


def test_amp_initialize_refuses_one_optimizer_passed_twice_before_patching_it():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"optimizers\[1\] is the same optimizer"):
        amp.initialize(model, [opt, opt], opt_level="O2", verbosity=0)
    assert model.weight.dtype == torch.float32 and not hasattr(opt, "_amp_stash")
