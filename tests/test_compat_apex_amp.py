"""ampfunc.compat.apex.amp against the behaviour apex documents and tests.

apex is not installable here; the reference is plain fp32 torch (SGD with momentum) run by
hand, in which exactly the steps amp must skip are skipped. Parameter values are small
integers and dyadic fractions, so fp16 copies hold them exactly and results can be compared
tightly at every opt level.
"""

import itertools
import types

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import Parameter

from ampfunc.compat.apex import amp
from ampfunc.compat.apex.amp import _amp_state

# apex amp keeps process-wide state: every test here starts from a fresh one.
pytestmark = pytest.mark.usefixtures("fresh_amp_state")


class MyModel(nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = Parameter(1.0 + unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return ((x * self.weight0.float()) * self.weight1.float()).sum()


X = torch.ones(2)
# loss k -> which optimizers own the params its backward reaches
LOSS_OPTIMIZERS = {0: (0,), 1: (1,), 2: (0, 1)}


def _losses(m0, m1):
    return [m0(X), m1(X), m0(X) + m1(X)]


def _optimizers(m0, m1):
    return (torch.optim.SGD(m0.parameters(), lr=0.25, momentum=0.125),
            torch.optim.SGD(m1.parameters(), lr=0.5, momentum=0.25))


def reference_run(iters, skipped):
    """fp32 torch; optimizer j does not step at iteration i when (i, j) in ``skipped``.

    Returns per-iteration grads (both models' params in order) and the final params.
    """
    m0, m1 = MyModel(1), MyModel(2)
    opts = _optimizers(m0, m1)
    grads = []
    for i in range(iters):
        for o in opts:
            o.zero_grad()
        for loss in _losses(m0, m1):
            loss.backward()
        grads.append([p.grad.clone() for m in (m0, m1) for p in m.parameters()])
        for j, o in enumerate(opts):
            if (i, j) not in skipped:
                o.step()
    return grads, [p.detach().clone() for m in (m0, m1) for p in m.parameters()]


def _zero(how, models, opts):
    if how == "none":
        for m in models:
            for p in m.parameters():
                p.grad = None
    elif how == "model":
        for m in models:
            m.zero_grad()
    else:
        for o in opts:
            o.zero_grad()


INJECTIONS = [None] + [(1, backward, model, param) for backward in range(3) for model in LOSS_OPTIMIZERS[backward]
                       for param in ("weight0", "weight1")]


def _amp_run(opt_level, num_losses, injection, how_to_zero, iters=3):
    m0, m1 = MyModel(1), MyModel(2)
    o0, o1 = _optimizers(m0, m1)
    # O0/O3 default to a static scale of 1, which never skips; the injection cases ask for a dynamic one.
    loss_scale = "dynamic" if injection is not None else None
    [m0, m1], [o0, o1] = amp.initialize([m0, m1], [o0, o1], opt_level=opt_level, verbosity=0,
                                        num_losses=num_losses, loss_scale=loss_scale)
    for k, s in enumerate(_amp_state.loss_scalers):
        s._loss_scale = 4.0 * 4**k  # small enough for fp16 grads (apex's test does the same)
    models, opts = (m0, m1), (o0, o1)
    master_grads = []
    for i in range(iters):
        _zero(how_to_zero, models, opts)
        for k, loss in enumerate(_losses(m0, m1)):
            owners = [opts[j] for j in LOSS_OPTIMIZERS[k]]
            with amp.scale_loss(loss, owners if len(owners) > 1 else owners[0],
                                loss_id=k if num_losses == 3 else 0) as scaled:
                scaled.backward()
                if injection is not None and injection[:2] == (i, k):
                    getattr(models[injection[2]], injection[3]).grad[0] = float("inf")
        master_grads.append([p.grad.detach().float().clone() for o in opts for p in amp.master_params(o)])
        for o in opts:
            o.step()
    masters = [p.detach().clone() for o in opts for p in amp.master_params(o)]
    return master_grads, [p.detach().clone() for m in models for p in m.parameters()], masters


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("num_losses", [1, 3])
def test_two_models_two_optimizers_three_losses_with_injected_inf(opt_level, num_losses):
    _, unskipped_params = reference_run(3, set())
    for injection, how_to_zero in itertools.product(INJECTIONS, ("none", "model", "optimizer")):
        skipped = set() if injection is None else {(injection[0], j) for j in LOSS_OPTIMIZERS[injection[1]]}
        ref_grads, ref_params = reference_run(3, skipped)
        if skipped:  # the skip is visible in the final params, so a missed or extra skip fails
            assert any(not torch.equal(a, b) for a, b in zip(ref_params, unskipped_params))
        grads, params, masters = _amp_run(opt_level, num_losses, injection, how_to_zero)
        where = f"{opt_level} num_losses={num_losses} inject={injection} zero={how_to_zero}"
        for i in range(3):
            n0 = 2  # params of model 0 (= optimizer 0) come first
            for j, sl in ((0, slice(0, n0)), (1, slice(n0, None))):
                if (i, j) in skipped:
                    continue  # that optimizer's grads hold the inf; its step is skipped
                for g, r in zip(grads[i][sl], ref_grads[i][sl]):
                    torch.testing.assert_close(g, r, msg=f"grads, iteration {i}, {where}")
        for p, r, m in zip(params, ref_params, masters):
            torch.testing.assert_close(p.float(), r, msg=f"final params, {where}")
            assert torch.equal(p, m.to(p.dtype)), where


def test_opt_levels_set_model_dtypes_master_weights_and_scale():
    expected = {"O0": (torch.float32, False, False), "O1": (torch.float32, False, True),
                "O2": (torch.float16, True, True), "O3": (torch.float16, False, False)}
    for level, (dtype, has_masters, dynamic) in expected.items():
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        assert model[0].weight.dtype == dtype, level
        # O2 keeps BatchNorm fp32 (keep_batchnorm_fp32=True); O3 does not.
        assert model[1].weight.dtype == (torch.float32 if level != "O3" else torch.float16), level
        opt.zero_grad()  # the masters are made here, from the model's weights now (apex's lazy init)
        masters = list(amp.master_params(opt))
        assert all(m.dtype == torch.float32 for m in masters) == (level != "O3")
        assert (masters[0] is not model[0].weight) == has_masters, level
        assert _amp_state.loss_scalers[0].dynamic == dynamic, level
        out = model(torch.randn(5, 3))
        assert out.dtype == torch.float32, level  # outputs cast back to fp32


def test_list_in_list_out_symmetry():
    def fresh():
        m = MyModel(1)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    m, o = fresh()
    assert amp.initialize(m, verbosity=0, opt_level="O0") is m
    m, o = fresh()
    out = amp.initialize(m, o, opt_level="O2", verbosity=0)
    assert out[0] is m and out[1] is o
    m, o = fresh()
    out = amp.initialize([m], [o], opt_level="O2", verbosity=0)
    assert isinstance(out[0], list) and isinstance(out[1], list) and out[0][0] is m and out[1][0] is o
    m, o = fresh()
    out = amp.initialize([m], o, opt_level="O2", verbosity=0)
    assert isinstance(out[0], list) and out[1] is o


def _accumulate(opt_level, delay):
    model = MyModel(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 8.0
    for it in range(6):
        x = torch.tensor([1.0, 0.5]) * (it % 3 + 1)
        last = it % 3 == 2
        with amp.scale_loss(model(x), opt, delay_unscale=delay and not last) as scaled:
            scaled.backward()
        if last:
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], amp.state_dict()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gradient_accumulation_with_delay_unscale_equals_without(opt_level):
    with_delay = _accumulate(opt_level, True)
    without = _accumulate(opt_level, False)
    for a, b in zip(with_delay[0], without[0]):
        assert torch.equal(a, b)
    # The scale advances once per unscale: once per accumulated step with delay_unscale, else per backward.
    assert with_delay[1]["loss_scaler0"]["unskipped"] == 2 and without[1]["loss_scaler0"]["unskipped"] == 6
    assert not torch.equal(with_delay[0][0], MyModel(1).weight0.to(with_delay[0][0].dtype))  # steps happened


def test_skip_prints_and_leaves_params_untouched(capsys):
    model = MyModel(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=1)
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(X) * 1e6, opt) as scaled:  # 2**16 * grads overflow fp16
        scaled.backward()
    opt.step()
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(m.grad is None for m in amp.master_params(opt))


def test_min_and_max_loss_scale():
    model = MyModel(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, min_loss_scale=256.0, max_loss_scale=1024.0)
    scales = [_amp_state.loss_scalers[0].loss_scale()]  # starts at min(max_loss_scale, 2**16)
    for _ in range(4):
        with amp.scale_loss(model(X), opt) as scaled:
            scaled.backward()
            model.weight0.grad[0] = float("nan")
        opt.step()
        scales.append(_amp_state.loss_scalers[0].loss_scale())
    assert scales == [1024.0, 512.0, 256.0, 256.0, 256.0]
    with pytest.raises(ValueError, match="min_loss_scale"):
        amp.initialize(MyModel(1), opt_level="O1", min_loss_scale=8.0, max_loss_scale=4.0, verbosity=0)


def test_state_dict_round_trip_and_errors(capsys):
    model = MyModel(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, num_losses=2)
    _amp_state.loss_scalers[1]._loss_scale = 128.0
    with amp.scale_loss(model(X), opt, loss_id=1) as scaled:
        scaled.backward()
    sd = amp.state_dict()
    assert sd == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0},
                  "loss_scaler1": {"loss_scale": 128.0, "unskipped": 1}}
    _amp_state.loss_scalers[1]._loss_scale = 2.0
    amp.load_state_dict(sd)
    assert amp.state_dict() == sd
    with pytest.raises(RuntimeError, match='Unexpected key.*"bogus"'):
        amp.load_state_dict({"bogus": {}})
    amp.load_state_dict({"loss_scaler0": sd["loss_scaler0"]})
    assert "state_dict contains 1 entries, while 2 loss_scalers are used" in capsys.readouterr().out


def test_bad_settings_and_misuse_are_refused_clearly():
    def fresh():
        m = MyModel(1)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    with pytest.raises(RuntimeError, match="Unexpected optimization level O4.*letter O"):
        amp.initialize(*fresh(), opt_level="O4")
    with pytest.raises(ValueError, match="O1 inserts casts around Torch functions"):
        amp.initialize(*fresh(), opt_level="O1", cast_model_type=torch.float16)
    with pytest.raises(ValueError, match="master_weights with O1"):
        amp.initialize(*fresh(), opt_level="O1", master_weights=True)
    with pytest.raises(ValueError, match="loss_scale must be 'dynamic' or a number"):
        amp.initialize(*fresh(), opt_level="O2", loss_scale="dynamik")
    half = MyModel(1).half()
    with pytest.raises(TypeError, match="Found param weight0 of models\\[0\\] with dtype torch.float16"):
        amp.initialize(half, opt_level="O2", verbosity=0)
    m, o = fresh()
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="already processed"):
        amp.initialize(m.float(), o, opt_level="O2", verbosity=0)
    with pytest.raises(ValueError, match="loss_id=1 but amp.initialize was called with num_losses=1"):
        with amp.scale_loss(m(X), o, loss_id=1):
            pass
    with pytest.raises(RuntimeError, match="was not returned by amp.initialize"):
        with amp.scale_loss(m(X), torch.optim.SGD(MyModel(2).parameters(), lr=0.1)):
            pass


def test_disabled_amp_is_a_pass_through():
    m = MyModel(1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m2, o2 = amp.initialize(m, o, enabled=False)
    assert m2 is m and o2 is o and m.weight0.dtype == torch.float32
    loss = m(X)
    with amp.scale_loss(loss, o) as scaled:
        assert scaled is loss


class Batch:
    """A user batch type that amp casts through its ``to(dtype)`` method."""

    def __init__(self, t):
        self.t = t

    def to(self, dtype):
        return Batch(self.t.to(dtype))


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = Parameter(torch.ones(3))
        self.seen = None

    def forward(self, x, extras, batch, array, name, ids):
        self.seen = dict(x=x.dtype, extras=[e.dtype for e in extras["list"]], batch=batch.t.dtype,
                         array=type(array), name=name, ids=ids.dtype, device=x.device)
        return (x.float() * self.w.float()).sum(), {"half": self.w * 1}


def test_patched_forward_casts_floating_inputs_only_and_outputs_to_fp32():
    model = Probe()
    model = amp.initialize(model, opt_level="O2", verbosity=0)
    x = torch.randn(3)
    out = model(x, {"list": [torch.randn(2), torch.randn(1)]}, Batch(torch.randn(2)), np.ones(2), "name",
                ids=torch.arange(3))
    assert model.seen == dict(x=torch.float16, extras=[torch.float16, torch.float16], batch=torch.float16,
                              array=np.ndarray, name="name", ids=torch.int64, device=x.device)
    assert out[0].dtype == torch.float32 and out[1]["half"].dtype == torch.float32


def test_cast_model_outputs_overrides_the_output_dtype():
    model = amp.initialize(Probe(), opt_level="O2", verbosity=0, cast_model_outputs=torch.float16)
    out = model(torch.randn(3), {"list": []}, Batch(torch.randn(1)), np.ones(1), "n", ids=torch.arange(1))
    assert out[0].dtype == torch.float16


def test_o1_runs_the_forward_under_autocast_and_returns_fp32():
    model = amp.initialize(nn.Sequential(nn.Linear(4, 4)), opt_level="O1", verbosity=0)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(torch.randn(2, 4))
    assert seen == [torch.float16] and out.dtype == torch.float32 and model[0].weight.dtype == torch.float32


def test_registered_and_decorated_functions_cast_under_o1_only():
    ns = types.SimpleNamespace(mm=lambda a, b: a @ b, add=lambda a, b: a + b, to_half=lambda a: a)
    amp.register_float_function(ns, "mm")
    amp.register_half_function(ns, "to_half")
    amp.register_promote_function(ns, "add")
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_half_function(ns, "nope")

    @amp.float_function
    def decorated(a):
        return a * 2

    h = torch.ones(2, 2, dtype=torch.float16)
    assert decorated(h).dtype == torch.float16  # no amp yet: pass-through
    model = amp.initialize(MyModel(1), opt_level="O1", verbosity=0)
    assert ns.mm(h, h).dtype == torch.float32
    assert ns.to_half(torch.ones(2)).dtype == torch.float16
    assert ns.add(h, torch.ones(2, 2)).dtype == torch.float32
    assert decorated(h).dtype == torch.float32
    with pytest.raises(RuntimeError, match="after amp.initialize"):
        amp.register_half_function(ns, "add")
    _amp_state.handle._deactivate()  # restores the original functions
    assert ns.mm(h, h).dtype == torch.float16 and decorated(h).dtype == torch.float16
    del model


def test_registrations_are_not_applied_by_other_opt_levels():
    ns = types.SimpleNamespace(mm=lambda a, b: a @ b)
    amp.register_float_function(ns, "mm")
    amp.initialize(MyModel(1), opt_level="O2", verbosity=0)
    h = torch.ones(2, 2, dtype=torch.float16)
    assert ns.mm(h, h).dtype == torch.float16
    amp._USER_REGISTRY.clear()


def test_clip_master_grads_after_scale_loss_clips_unscaled_grads():
    model = MyModel(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 1024.0
    with amp.scale_loss(model(X), opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    ref = MyModel(1)
    ref(X).backward()
    expected = torch.cat([p.grad for p in ref.parameters()]).norm()
    torch.testing.assert_close(norm, expected)
    assert torch.cat([p.grad for p in amp.master_params(opt)]).norm().item() == pytest.approx(1.0, rel=1e-5)


def test_lr_scheduler_wraps_the_patched_step_and_skips_still_work():
    model = MyModel(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 4.0
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(X), opt) as scaled:
        scaled.backward()
        model.weight1.grad[1] = float("inf")
    opt.step()
    sched.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    with amp.scale_loss(model(X), opt) as scaled:
        scaled.backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0625
    # one step at lr 0.125 with grad d(sum w0*w1)/dw0 = w1 = [2, 3]
    torch.testing.assert_close(model.weight0.float(), torch.tensor([1.0, 2.0]) - 0.125 * torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_param_group_added_after_initialize_trains_like_the_reference(opt_level):
    ref0, ref1 = MyModel(1), MyModel(2)
    ref_opt = torch.optim.SGD([{"params": ref0.parameters(), "lr": 0.25}, {"params": ref1.parameters(), "lr": 0.5}],
                              momentum=0.125)
    m0, m1 = MyModel(1), MyModel(2)
    opt = torch.optim.SGD(m0.parameters(), lr=0.25, momentum=0.125)
    [m0, m1], opt = amp.initialize([m0, m1], opt, opt_level=opt_level, verbosity=0, loss_scale=4.0)
    opt.add_param_group({"params": list(m1.parameters()), "lr": 0.5})
    for _ in range(3):
        ref_opt.zero_grad()
        (ref0(X) + ref1(X)).backward()
        ref_opt.step()
        opt.zero_grad()
        with amp.scale_loss(m0(X) + m1(X), opt) as scaled:
            scaled.backward()
        opt.step()
    for p, r in zip(list(m0.parameters()) + list(m1.parameters()), list(ref0.parameters()) + list(ref1.parameters())):
        torch.testing.assert_close(p.float(), r.detach())
    assert all(m.dtype == torch.float32 for m in amp.master_params(opt)) == (opt_level != "O3")
