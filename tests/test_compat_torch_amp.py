"""ampfunc.compat.torch_amp.GradScaler against the real torch.amp.GradScaler("cpu").

Every workflow of torch's AMP examples is run twice on identical models and data, once with
each scaler; the scale sequence, the skipped steps and the parameters must agree.
"""

import pickle

import pytest
import torch
import torch.nn.functional as F

import ampfunc as af
from ampfunc.compat import torch_amp
from ampfunc.compat.torch_amp import GradScaler

# Large enough that the first steps overflow in fp32 and the scaler must back off, as fp16
# training does at 2**16; small growth interval so growth happens within a short run.
SCALER_KW = dict(init_scale=2.0**127, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
INJECT_INF_AT = {5, 9}  # iterations at which one gradient element is set to inf after backward
# Scales the losses so that their gradients overflow fp32 at the first scales tried.
GAIN = 1e4


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _data(n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)) for _ in range(n)]


def _params(*models):
    return [p.detach().clone() for m in models for p in m.parameters()]


def _assert_params_close(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-12)


def _trace(make_scaler, workflow, iters=14):
    """Runs ``workflow`` with a scaler from ``make_scaler``; returns scales, skips and params per step."""
    return workflow(make_scaler(), iters)


def torch_scaler(**kw):
    return torch.amp.GradScaler("cpu", **{**SCALER_KW, **kw})


def ampfunc_scaler(**kw):
    return GradScaler("cpu", **{**SCALER_KW, **kw})


def _inject(i, model):
    if i in INJECT_INF_AT:
        next(model.parameters()).grad.view(-1)[0] = float("inf")


def typical_loop(scaler, iters):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05 / GAIN, momentum=0.9)
    scales, skipped, params = [], [], []
    for i, (x, y) in enumerate(_data(iters)):
        opt.zero_grad()
        loss = GAIN * F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        _inject(i, model)
        before = _params(model)
        scaler.step(opt)
        scaler.update()
        after = _params(model)
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, after)))
        scales.append(scaler.get_scale())
        params.append(after)
    return scales, skipped, params


def unscale_then_clip(scaler, iters):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 / GAIN)
    scales, skipped, params = [], [], []
    for i, (x, y) in enumerate(_data(iters)):
        opt.zero_grad()
        loss = GAIN * F.mse_loss(model(x), y) * 10
        scaler.scale(loss).backward()
        _inject(i, model)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        before = _params(model)
        scaler.step(opt)
        scaler.update()
        after = _params(model)
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, after)))
        scales.append(scaler.get_scale())
        params.append(after)
    return scales, skipped, params


def accumulation(scaler, iters, k=3):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05 / GAIN, momentum=0.5)
    scales, skipped, params = [], [], []
    data = _data(iters * k)
    for i in range(iters):
        for j in range(k):
            x, y = data[i * k + j]
            loss = GAIN * F.mse_loss(model(x), y) / k
            scaler.scale(loss).backward()
        _inject(i, model)
        before = _params(model)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = _params(model)
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, after)))
        scales.append(scaler.get_scale())
        params.append(after)
    return scales, skipped, params


def gradient_penalty(scaler, iters):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05 / GAIN)
    scales, skipped, params = [], [], []
    for i, (x, y) in enumerate(_data(iters)):
        opt.zero_grad()
        loss = GAIN * F.mse_loss(model(x), y)
        scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grads = [g * inv_scale for g in scaled_grads]
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + 0.1 * penalty
        scaler.scale(loss).backward()
        _inject(i, model)
        before = _params(model)
        scaler.step(opt)
        scaler.update()
        after = _params(model)
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, after)))
        scales.append(scaler.get_scale())
        params.append(after)
    return scales, skipped, params


def two_models_two_losses_two_optimizers(scaler, iters):
    model0, model1 = _model(0), _model(1)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.05 / GAIN, momentum=0.9)
    opt1 = torch.optim.Adam(model1.parameters(), lr=0.01)
    scales, skipped, params = [], [], []
    for i, (x, y) in enumerate(_data(iters)):
        opt0.zero_grad()
        opt1.zero_grad()
        out0, out1 = model0(x), model1(x)
        loss0 = GAIN * F.mse_loss(2 * out0 + 3 * out1, y)
        loss1 = GAIN * F.mse_loss(3 * out0 - 5 * out1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if i == 5:
            next(model1.parameters()).grad.view(-1)[0] = float("inf")  # only opt1 must skip
        scaler.unscale_(opt0)
        before = _params(model0, model1)
        scaler.step(opt0)
        scaler.step(opt1)
        scaler.update()
        after = _params(model0, model1)
        n0 = len(list(model0.parameters()))
        skipped.append((all(torch.equal(a, b) for a, b in zip(before[:n0], after[:n0])),
                        all(torch.equal(a, b) for a, b in zip(before[n0:], after[n0:]))))
        scales.append(scaler.get_scale())
        params.append(after)
    return scales, skipped, params


WORKFLOWS = [typical_loop, unscale_then_clip, accumulation, gradient_penalty, two_models_two_losses_two_optimizers]


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda w: w.__name__)
def test_workflow_matches_torch_grad_scaler(workflow):
    theirs = _trace(torch_scaler, workflow)
    ours = _trace(ampfunc_scaler, workflow)
    assert ours[0] == theirs[0]  # same scale sequence, exactly
    assert ours[1] == theirs[1]  # same skipped steps
    assert any(s if isinstance(s, bool) else any(s) for s in theirs[1])  # the run does exercise skips
    assert len(set(theirs[0])) > 2  # ... and both backoff and growth
    for a, b in zip(ours[2], theirs[2]):
        _assert_params_close(a, b)


def test_one_update_combines_the_flags_of_every_optimizer():
    # Exactly one optimizer overflowed: the scale backs off once, the other optimizer stepped.
    scales, skipped, _ = two_models_two_losses_two_optimizers(ampfunc_scaler(init_scale=2.0**10), 8)
    assert skipped[5] == (False, True)
    assert scales[5] == scales[4] / 2 and skipped[:5] == [(False, False)] * 5


def test_bf16_gradients_match_torch_on_cpu():
    def run(scaler):
        model = _model(dtype=torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.05 / GAIN)
        out = []
        for i, (x, y) in enumerate(_data(8, dtype=torch.bfloat16)):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x).float(), y.float())).backward()
            _inject(i, model)
            scaler.step(opt)
            scaler.update()
            out.append((scaler.get_scale(), _params(model)))
        return out

    for (s_ours, p_ours), (s_theirs, p_theirs) in zip(run(ampfunc_scaler(init_scale=2.0**10)),
                                                      run(torch_scaler(init_scale=2.0**10))):
        assert s_ours == s_theirs
        for a, b in zip(p_ours, p_theirs):
            assert torch.equal(a, b)


def test_fused_optimizer_steps_on_device_without_host_sync(monkeypatch):
    def run(scaler, forbid_sync):
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        flags = []
        for i, (x, y) in enumerate(_data(10)):
            opt.zero_grad()
            scaler.scale(GAIN * F.mse_loss(model(x), y)).backward()
            _inject(i, model)
            if forbid_sync:
                with monkeypatch.context() as m:
                    m.setattr(torch.Tensor, "item", _no_sync)
                    m.setattr(torch.Tensor, "__bool__", _no_sync)
                    m.setattr(torch.Tensor, "tolist", _no_sync)
                    _, found_inf = scaler.step(opt, return_found_inf=True)
                    scaler.update()
                flags.append(float(found_inf))
            else:
                scaler.step(opt)
                scaler.update()
        return flags, _params(model), opt.state_dict()["state"][0]["step"]

    flags, ours, our_steps = run(ampfunc_scaler(init_scale=2.0**100), forbid_sync=True)
    _, theirs, their_steps = run(torch_scaler(init_scale=2.0**100), forbid_sync=False)
    assert flags[5] == flags[9] == 1.0 and 0.0 in flags
    assert our_steps == their_steps == flags.count(0.0)  # skipped steps are not counted by fused Adam
    _assert_params_close(ours, theirs)


def _no_sync(*args, **kwargs):
    raise AssertionError("host sync during GradScaler.step")


def test_step_reports_whether_it_stepped():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 / GAIN)
    scaler = GradScaler("cpu", init_scale=4.0)
    x, y = _data(1)[0]
    scaler.scale(GAIN * F.mse_loss(model(x), y)).backward()
    retval, found_inf = scaler.step(opt, return_found_inf=True)
    assert retval is None and found_inf.dtype == torch.float32 and found_inf.item() == 0.0
    scaler.update()
    opt.zero_grad()
    scaler.scale(GAIN * F.mse_loss(model(x), y)).backward()
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    assert scaler.step(opt, return_found_inf=True)[1].item() == 1.0


def test_min_and_max_scale_bound_the_scale():
    ls_seq = []
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1, min_scale=2.0, max_scale=32.0)
    for overflow in [False] * 4 + [True] * 5:
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 6)).sum()).backward()
        if overflow:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        ls_seq.append(scaler.get_scale())
    assert ls_seq == [16.0, 32.0, 32.0, 32.0, 16.0, 8.0, 4.0, 2.0, 2.0]


def test_hysteresis_tolerates_overflows_before_backing_off():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradScaler("cpu", init_scale=8.0, hysteresis=2)
    seq = []
    for overflow in [True, True, True, False, True]:
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 6)).sum()).backward()
        if overflow:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        seq.append(scaler.get_scale())
    assert seq == [8.0, 4.0, 2.0, 2.0, 2.0]


# ---------------------------------------------------------------------------------------------
# API surface, state machine and errors, side by side with torch
# ---------------------------------------------------------------------------------------------


def _both(**kw):
    return ampfunc_scaler(**kw), torch_scaler(**kw)


def _backward(scaler, model, opt):
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 6)).pow(2).sum()).backward()


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares exception types and messages
        return type(e), str(e)
    return None


@pytest.mark.parametrize("scenario", ["unscale_twice", "unscale_after_step", "step_twice", "closure",
                                      "update_without_step", "step_before_scale", "fp16_grads"])
def test_errors_match_torch(scenario):
    results = []
    for scaler in _both(init_scale=4.0):
        dtype = torch.float16 if scenario == "fp16_grads" else torch.float32
        model = _model(dtype=dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1 / GAIN)

        def run():
            if scenario == "step_before_scale":
                return scaler.step(opt)
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 6, dtype=dtype)).float().pow(2).sum()).backward()
            if scenario == "unscale_twice":
                scaler.unscale_(opt)
                scaler.unscale_(opt)
            elif scenario == "unscale_after_step":
                scaler.step(opt)
                scaler.unscale_(opt)
            elif scenario == "step_twice":
                scaler.step(opt)
                scaler.step(opt)
            elif scenario == "closure":
                scaler.step(opt, closure=lambda: None)
            elif scenario == "update_without_step":
                scaler.update()
            elif scenario == "fp16_grads":
                scaler.unscale_(opt)

        results.append(_error_of(run))
    assert results[0] is not None
    assert results[0] == results[1]


def test_scale_of_nested_containers_matches_torch():
    t = [torch.ones(2), (torch.full((3,), 2.0), [torch.tensor(3.0)])]
    ours, theirs = (s.scale(t) for s in _both(init_scale=8.0))
    assert type(ours) is list and type(ours[1]) is tuple and type(ours[1][1]) is list
    for a, b in zip(af.tree.tree_leaves(ours), af.tree.tree_leaves(theirs)):
        assert torch.equal(a, b)
    d = GradScaler("cpu", init_scale=8.0).scale({"a": torch.ones(2), "b": [torch.ones(1)]})
    assert torch.equal(d["a"], torch.full((2,), 8.0)) and torch.equal(d["b"][0], torch.full((1,), 8.0))
    with pytest.raises(ValueError, match="Tensor or an iterable"):
        GradScaler("cpu").scale(3.0)


def test_update_with_new_scale_matches_torch():
    for new_scale in (1024.0, torch.tensor(512.0)):
        seqs = []
        for scaler in _both(init_scale=4.0, growth_interval=2):
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            seq = []
            for i in range(4):
                _backward(scaler, model, opt)
                scaler.step(opt)
                scaler.update(new_scale if i == 0 else None)
                seq.append((scaler.get_scale(), scaler._get_growth_tracker()))
            seqs.append(seq)
        assert seqs[0] == seqs[1]
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    for bad in (torch.ones(2), torch.ones((), requires_grad=True)):
        with pytest.raises(AssertionError, match="new_scale should be a float"):
            scaler.update(bad)


def test_getters_setters_and_state_dict_keys_match_torch():
    ours, theirs = _both(init_scale=4.0)
    for s in (ours, theirs):
        s.set_growth_factor(3.0)
        s.set_backoff_factor(0.25)
        s.set_growth_interval(7)
        s.scale(torch.ones(()))
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (3.0, 0.25, 7)
    assert ours.state_dict() == theirs.state_dict()
    assert ours.is_enabled() and ours.get_scale() == 4.0
    assert ours.loss_scale.growth_factor == 3.0  # the held loss scale carries the settings
    assert ours._scale.item() == 4.0 and ours._growth_tracker.dtype == torch.int32  # torch's attributes


def test_state_dict_round_trips_with_torch_in_both_directions():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    theirs = torch_scaler()
    for _ in range(4):
        _backward(theirs, model, opt)
        theirs.step(opt)
        theirs.update()
    ours = GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == theirs.state_dict()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == theirs.state_dict()
    # Continuing from the loaded state gives the same sequence.
    for s in (ours, theirs):
        for _ in range(5):
            _backward(s, model, opt)
            s.step(opt)
            s.update()
    assert ours.state_dict() == theirs.state_dict()


def test_state_dict_carries_non_torch_settings_only_when_used():
    assert set(GradScaler("cpu").state_dict()) == {"scale", "growth_factor", "backoff_factor",
                                                   "growth_interval", "_growth_tracker"}
    sd = GradScaler("cpu", min_scale=1.0, max_scale=2.0**20, hysteresis=3).state_dict()
    assert sd["min_scale"] == 1.0 and sd["max_scale"] == 2.0**20 and sd["hysteresis"] == 3
    other = GradScaler("cpu")
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    with pytest.raises(RuntimeError, match="state dict is empty"):
        other.load_state_dict({})


def test_pickling_only_between_iterations():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=2, max_scale=2.0**30)
    _backward(scaler, model, opt)
    scaler.step(opt)
    with pytest.raises(AssertionError, match="may only be pickled"):
        pickle.dumps(scaler)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    assert clone.loss_scale is None  # re-created lazily on the next scale(), as in torch
    _backward(clone, model, opt)
    assert clone.get_scale() == 16.0 and clone._get_growth_tracker() == 1


def test_disabled_scaler_is_a_pass_through():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 / GAIN)
    scaler = GradScaler("cpu", enabled=False)
    loss = model(torch.ones(1, 6)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = _params(model)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_scaler_without_cuda_warns_and_disables_like_torch():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler()
    assert not scaler.is_enabled()


def test_bad_settings_are_refused_naming_the_setting():
    with pytest.raises(AssertionError, match="growth factor"):
        GradScaler("cpu", growth_factor=1.0)
    with pytest.raises(AssertionError, match="backoff factor"):
        GradScaler("cpu", backoff_factor=1.0)
    with pytest.raises(ValueError, match="growth_interval"):
        GradScaler("cpu", growth_interval=0)
    with pytest.raises(ValueError, match="max_scale"):
        GradScaler("cpu", min_scale=4.0, max_scale=2.0)


def test_set_growth_interval_below_tracker_still_grows():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=10)
    for _ in range(5):
        _backward(scaler, model, opt)
        scaler.step(opt)
        scaler.update()
    scaler.set_growth_interval(2)
    _backward(scaler, model, opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0


# ---------------------------------------------------------------------------------------------
# autocast bridge and custom autograd functions
# ---------------------------------------------------------------------------------------------


def test_autocast_from_policy_runs_in_the_compute_dtype():
    a = torch.randn(4, 4)
    with torch_amp.autocast("cpu", policy="p=f32,c=bf16,o=f32"):
        assert torch.mm(a, a).dtype == torch.bfloat16
    with torch_amp.autocast("cpu", policy=af.get_policy("full")):
        assert torch.mm(a, a).dtype == torch.float32
    with torch_amp.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype == torch.bfloat16

    @torch_amp.autocast("cpu", policy="c=bf16")
    def f(x):
        return torch.mm(x, x)

    assert f(a).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="either dtype or policy"):
        torch_amp.autocast("cpu", dtype=torch.bfloat16, policy="c=bf16")


class _Square(torch.autograd.Function):
    @staticmethod
    @torch_amp.custom_fwd(cast_inputs=torch.float32)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.fwd_dtype = torch.mm(x, w).dtype
        ctx.fwd_autocast = torch.is_autocast_enabled("cpu")
        return torch.mm(x, w)

    @staticmethod
    @torch_amp.custom_bwd
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.bwd_autocast = torch.is_autocast_enabled("cpu")
        return torch.mm(g, w.t()), torch.mm(x.t(), g)


class _TorchSquare(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return torch.mm(g, w.t()), torch.mm(x.t(), g)


def test_custom_fwd_bwd_find_the_cpu_device_and_match_torch():
    x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    outs, grads = [], []
    for fn in (_Square, _TorchSquare):
        x.grad = w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn.apply(x, w)
        out.sum().backward()
        outs.append(out)
        grads.append((x.grad, w.grad))
    assert outs[0].dtype == torch.float32  # inputs were cast to fp32 and autocast was off inside
    assert outs[0].grad_fn.fwd_autocast is False and outs[0].grad_fn.fwd_dtype == torch.float32
    assert outs[0].grad_fn.bwd_autocast is False  # cast_inputs: forward ran without autocast, so does backward
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


class _Scale2(torch.autograd.Function):
    @staticmethod
    @torch_amp.custom_fwd
    def forward(ctx, x):
        ctx.fwd_autocast = torch.is_autocast_enabled("cpu")
        return x * 2

    @staticmethod
    @torch_amp.custom_bwd
    def backward(ctx, g):
        ctx.bwd_autocast = torch.is_autocast_enabled("cpu")
        ctx.bwd_dtype = torch.get_autocast_dtype("cpu")
        return g * 2


def test_custom_bwd_runs_backward_in_the_forward_autocast_state():
    x = torch.ones(3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _Scale2.apply(x)
    out.sum().backward()  # called outside the autocast region
    assert out.grad_fn.fwd_autocast is True
    assert out.grad_fn.bwd_autocast is True and out.grad_fn.bwd_dtype == torch.bfloat16
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_custom_fwd_accepts_a_policy_for_cast_inputs():
    class F32(torch.autograd.Function):
        @staticmethod
        @torch_amp.custom_fwd(cast_inputs=af.get_policy("full"))
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @torch_amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            return g * 2

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F32.apply(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    assert F32.apply(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.bfloat16  # no autocast: no cast
    with pytest.raises(TypeError, match="cast_inputs"):
        torch_amp.custom_fwd(lambda ctx, x: x, cast_inputs=3)


def test_compat_package_exports():
    from ampfunc import compat

    assert compat.GradScaler is GradScaler
    assert compat.autocast is torch_amp.autocast
    assert compat.custom_fwd is torch_amp.custom_fwd and compat.custom_bwd is torch_amp.custom_bwd
    assert GradScaler("cpu").loss_scale is None  # created on the first scale(), on that tensor's device


def test_sparse_gradients_match_torch():
    def run(scaler):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        for i in range(6):
            opt.zero_grad()
            scaler.scale(emb(torch.tensor([1, 3, 3, 7])).pow(2).sum()).backward()
            if i == 2:
                emb.weight.grad._values()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), emb.weight.detach().clone()

    (s0, w0), (s1, w1) = run(GradScaler("cpu", init_scale=8.0)), run(torch.amp.GradScaler("cpu", init_scale=8.0))
    assert s0 == s1 == 4.0 and torch.equal(w0, w1)


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, GradScaler], ids=["torch", "ampfunc"])
def test_a_fused_optimizer_without_any_grad_steps_as_a_no_op_and_update_complains_as_torchs(cls):
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    scaler = cls("cpu")
    scaler.scale(torch.ones((), requires_grad=True) * 2)  # a scaled loss that does not reach w
    scaler.step(opt)  # torch's fused path: found_inf 0, nothing to step
    assert w.detach().tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()


# ---------------------------------------------------------------------------------------------
# construction and settings: what torch takes, and ampfunc's range kept
# ---------------------------------------------------------------------------------------------


def test_the_scale_is_refused_outside_min_and_max_scale_at_construction_and_by_update():
    with pytest.raises(ValueError,
                       match=r"init_scale = 4096.0 lies outside \[min_scale, max_scale\] = \[0.0, 1024.0\]"):
        GradScaler("cpu", init_scale=4096.0, max_scale=1024.0)
    with pytest.raises(ValueError, match=r"init_scale = 2.0 lies outside \[min_scale, max_scale\] = \[16.0, inf\]"):
        GradScaler("cpu", init_scale=2.0, min_scale=16.0)
    scaler = GradScaler("cpu", init_scale=256.0, min_scale=16.0, max_scale=1024.0)
    scaler.scale(torch.tensor(1.0))
    for bad in (1.0, 4096.0, torch.tensor(8.0)):
        with pytest.raises(ValueError, match=r"update: new_scale = .* lies outside \[min_scale, max_scale\]"):
            scaler.update(bad)
        assert scaler.get_scale() == 256.0
    scaler.update(torch.tensor(16.0))  # the ends are inside
    assert scaler.get_scale() == 16.0
    scaler.load_state_dict(scaler.state_dict())  # a scaler's own checkpoint always loads back
    # an overflow at the floor stays at the floor (from below it, the backoff would raise the scale)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([float("inf")])
    scaler.step(torch.optim.SGD([p], lr=0.0))
    scaler.update()
    assert scaler.get_scale() == 16.0


def test_device_must_be_a_device_naming_torch_cuda_amps_positional_order():
    # torch.cuda.amp.GradScaler(1024.0, 4.0) meant init_scale, growth_factor; here the first
    # argument is the device, as in torch.amp.GradScaler.
    for bad in (1024.0, 65536, None):
        with pytest.raises(TypeError, match=r"device must be .*got .*torch\.cuda\.amp\.GradScaler took "
                                            r"\(init_scale, growth_factor"):
            GradScaler(bad, 4.0)
    with pytest.raises(TypeError, match="device must be"):
        GradScaler("gpu")
    assert GradScaler("cpu")._device == "cpu"
    assert GradScaler(torch.device("cpu"))._device == "cpu"  # compared with tensor.device.type, as torch does
    scaler = GradScaler(torch.device("cpu"), init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    scaler.update(torch.tensor(8.0))  # the device-type check of update(new_scale) holds
    assert scaler.get_scale() == 8.0


def test_a_disabled_scaler_takes_the_setters_like_torch():
    for cls in (torch.amp.GradScaler, GradScaler):
        scaler = cls("cpu", enabled=False)
        scaler.set_growth_factor(3.0)
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_interval(100)
        assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == \
            (3.0, 0.25, 100)
        assert scaler.state_dict() == {} and scaler.get_scale() == 1.0


class _LegacyScalerAwareSGD(torch.optim.SGD):
    """An optimizer of the legacy contract: ``step(grad_scaler=...)`` (apex FusedAdam capturable,
    old torch fused optimizers); ``records`` decides whether it records its inf check."""

    _step_supports_amp_scaling = True

    def __init__(self, params, records, **kw):
        super().__init__(params, **kw)
        self.records = records

    def step(self, closure=None, grad_scaler=None):
        if self.records:
            found_inf = sum(v.item() for v in grad_scaler._check_inf_per_device(self).values())
            if found_inf:
                return None
            inv = 1.0 / grad_scaler._get_scale_async().item()
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(inv)
        return super().step()


@pytest.mark.parametrize("records", [True, False], ids=["records-its-check", "records-nothing"])
def test_the_legacy_grad_scaler_kwarg_contract_matches_torch(records):
    results = []
    for scaler in _both(init_scale=4.0, growth_interval=1):
        p = torch.nn.Parameter(torch.ones(2))
        opt = _LegacyScalerAwareSGD([p], records, lr=0.1)
        trace = []
        for overflow in (False, True, False):
            opt.zero_grad()
            scaler.scale(p.sum()).backward()
            if overflow:
                p.grad[0] = float("inf")
            with pytest.warns(FutureWarning, match="stop passing itself"):
                scaler.step(opt)
            trace.append((_error_of(scaler.update), scaler.get_scale(), p.detach().clone()))
            if not records:  # torch's update() refuses and keeps the iteration's records
                scaler._per_optimizer_states.clear()
        results.append(trace)
    ours, theirs = results
    for (e_ours, s_ours, p_ours), (e_theirs, s_theirs, p_theirs) in zip(ours, theirs):
        assert e_ours == e_theirs and s_ours == s_theirs and torch.equal(p_ours, p_theirs)
    if not records:
        assert ours[0][0] == (AssertionError, "No inf checks were recorded prior to update.")
