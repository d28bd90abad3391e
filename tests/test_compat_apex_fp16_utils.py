"""ampfunc.compat.apex.fp16_utils against the rules apex documents.

apex cannot be installed here (and has removed these modules), so each behaviour is checked
against an explicit reference: an fp32 Adam on fp32 master copies driven by hand, and
apex's documented DynamicLossScaler rule written out in Python floats.
"""

import io
import math
import pickle
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _helpers import fp16_optimizer_loop
from ampfunc.compat.apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
)


class ApexDynamicRule:
    """apex's DynamicLossScaler.update_scale, verbatim in Python floats (the documented rule)."""

    def __init__(self, init_scale=2**32, scale_factor=2.0, scale_window=1000):
        self.cur_scale, self.scale_factor, self.scale_window = init_scale, scale_factor, scale_window
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow):
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class AmpDynamicRule:
    """apex amp's LossScaler("dynamic") rule in Python floats, which apex's last FP16_Optimizer uses:
    start at min(max, init); overflow halves (floored only by a given min) and resets the count;
    ``scale_window`` clean steps in a row double (capped at max)."""

    def __init__(self, init_scale=2.0**16, scale_window=2000, min_loss_scale=None, max_loss_scale=2.0**24):
        self.cur_scale, self.window = min(max_loss_scale, init_scale), scale_window
        self.min, self.max, self.unskipped = min_loss_scale, max_loss_scale, 0

    def update_scale(self, overflow):
        if overflow:
            self.cur_scale = max(self.min, self.cur_scale / 2.0) if self.min else self.cur_scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.cur_scale, self.unskipped = min(self.max, self.cur_scale * 2.0), 0


class StaticRule:
    def __init__(self, scale):
        self.cur_scale = scale

    def update_scale(self, overflow):
        pass


# ---------------------------------------------------------------------------------------------
# DynamicLossScaler and LossScaler
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_dynamic_loss_scaler_follows_apex_rule_over_random_overflows(seed):
    rng = random.Random(seed)
    kw = dict(init_scale=rng.choice([2**32, 2**16, 8.0]), scale_factor=2.0, scale_window=rng.choice([1, 2, 5]))
    ours, rule = DynamicLossScaler(**kw), ApexDynamicRule(**kw)
    for _ in range(200):
        overflow = rng.random() < 0.25
        ours.update_scale(overflow if rng.random() < 0.5 else torch.tensor(overflow))
        rule.update_scale(overflow)
        if rule.cur_scale > 2.0**127:
            # apex's Python double could grow past fp32; the fp32 scale does not grow to inf.
            assert ours.loss_scale == 2.0**127
            rule.cur_scale = 2.0**127
        assert ours.loss_scale == rule.cur_scale
        assert (ours.cur_iter, ours.last_overflow_iter) == (rule.cur_iter, rule.last_overflow_iter)
    assert ours.loss_scale >= 1


def test_dynamic_loss_scaler_floor_is_one_and_non_power_of_two_factor_rounds_to_fp32():
    ours, rule = DynamicLossScaler(init_scale=4.0, scale_factor=3.0, scale_window=2), ApexDynamicRule(4.0, 3.0, 2)
    for overflow in [True] * 4 + [False] * 9 + [True] + [False] * 4:
        ours.update_scale(overflow)
        rule.update_scale(overflow)
        assert ours.loss_scale == pytest.approx(rule.cur_scale, rel=1e-6)  # fp32 storage vs Python double
    assert ours.loss_state.min_scale == 1.0


def test_dynamic_loss_scaler_defaults_and_overflow_check():
    s = DynamicLossScaler()
    assert (s.loss_scale, s.scale_factor, s.scale_window) == (2.0**32, 2.0, 1000)
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    p.grad = torch.ones(3)
    assert s.has_overflow([p, q]) is False  # q has no grad: ignored
    p.grad[1] = float("nan")
    assert s.has_overflow([p, q]) is True
    assert DynamicLossScaler._has_inf_or_nan(torch.tensor([1.0, -float("inf")]))
    # apex summed each tensor, flagging finite tensors whose sum overflows; every element is checked here.
    assert not DynamicLossScaler._has_inf_or_nan(torch.full((4,), 3e38))


def test_loss_scaler_is_static():
    s = LossScaler(128.0)
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    assert s.has_overflow([p]) is False and s.loss_scale == 128.0
    s.update_scale(True)
    assert s.loss_scale == 128.0
    s.cur_scale = 64.0
    w = nn.Parameter(torch.full((2,), 3.0))
    s.backward((w * w).sum())
    assert torch.equal(w.grad, torch.full((2,), 64.0 * 6.0))
    assert s.scale_gradient(None, (torch.ones(2), None), None)[0].tolist() == [64.0, 64.0]


# ---------------------------------------------------------------------------------------------
# FP16_Optimizer against an fp32 Adam reference on master copies
# ---------------------------------------------------------------------------------------------


class Mixed(nn.Module):
    """fp16 layers plus one fp32 parameter (apex allows mixing)."""

    def __init__(self, with_fp32=True):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16).half()
        self.fc2 = nn.Linear(16, 4).half()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4)) if with_fp32 else None

    def forward(self, x):
        out = self.fc2(torch.relu(self.fc1(x))).float()
        return out * self.gain if self.gain is not None else out


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g).half(), torch.randn(16, 4, generator=g)) for _ in range(n)]


def _groups(named, split):
    if not split:
        return [{"params": list(named.values())}]
    first = [v for k, v in named.items() if k.startswith("fc1")]
    rest = [v for k, v in named.items() if not k.startswith("fc1")]
    return [{"params": first, "lr": 1e-3}, {"params": rest, "lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.01}]


def reference_run(data, rule, split=False, clip=None, with_fp32=True):
    """By hand: fp16 model forward, scaled fp32 loss, master grads = fp16 grads / scale in fp32,
    torch Adam on the fp32 masters unless any grad overflowed, masters rounded into the model."""
    model = Mixed(with_fp32)
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(_groups(masters, split), lr=1e-3)
    scales, norms = [], []
    for x, y in data:
        model.zero_grad()
        scale = rule.cur_scale
        (F.mse_loss(model(x), y).float() * scale).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        overflow = (isinstance(rule, (ApexDynamicRule, AmpDynamicRule))
                    and not all(g.isfinite().all() for g in grads.values()))
        rule.update_scale(overflow)
        scales.append(rule.cur_scale)
        if overflow:
            norms.append(-1)
            continue
        for n, m in masters.items():
            m.grad = grads[n].float() * (1.0 / scale)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(list(masters.values()), clip))
        opt.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(masters[n])
    return model, masters, scales, norms


def fp16_optimizer_run(data, split=False, clip=None, with_fp32=True, **kw):
    model = Mixed(with_fp32)
    opt = FP16_Optimizer(torch.optim.Adam(_groups(dict(model.named_parameters()), split), lr=1e-3),
                         verbose=False, **kw)
    scales, norms = [], []
    for x, y in data:
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x), y))
        if clip is not None:
            norms.append(opt.clip_master_grads(clip))
        opt.step()
        scales.append(opt.loss_scale)
    return model, opt, scales, norms


def _assert_matches_reference(model, opt, ref_model, ref_masters):
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert p.dtype == q.dtype, n
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)  # fp16 params: one rounding apart at most
    by_id = {id(p): n for n, p in model.named_parameters()}
    for model_p, master in zip(opt.all_fp16_params, opt.all_fp32_from_fp16_params):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, ref_masters[by_id[id(model_p)]], rtol=1e-6, atol=1e-7)
    for p in opt.all_fp32_from_fp32_params:
        torch.testing.assert_close(p, ref_masters[by_id[id(p)]], rtol=1e-6, atol=1e-7)


CASES = {
    "default": dict(kw={}, rule=lambda: StaticRule(1.0)),
    "static_loss_scale_128": dict(kw=dict(static_loss_scale=128.0), rule=lambda: StaticRule(128.0)),
    "dynamic": dict(kw=dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**20, "scale_window": 4}),
                    rule=lambda: AmpDynamicRule(2.0**20, 4)),
    "two_param_groups": dict(kw=dict(static_loss_scale=64.0), rule=lambda: StaticRule(64.0), split=True),
    "clip_master_grads": dict(kw=dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**18}),
                              rule=lambda: AmpDynamicRule(2.0**18), clip=0.01),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp16_optimizer_adam_matches_fp32_adam_reference(case):
    c = CASES[case]
    data = _data(16)
    model, opt, scales, norms = fp16_optimizer_run(data, split=c.get("split", False), clip=c.get("clip"), **c["kw"])
    ref_model, ref_masters, ref_scales, ref_norms = reference_run(data, c["rule"](), split=c.get("split", False),
                                                                  clip=c.get("clip"))
    assert scales == ref_scales
    if case in ("dynamic", "clip_master_grads"):
        assert len(set(scales)) > 1  # the run does skip steps and change the scale
    if c.get("clip") is not None:
        assert [n == -1 for n in norms] == [n == -1 for n in ref_norms]
        torch.testing.assert_close(torch.tensor([float(n) for n in norms]), torch.tensor([float(n) for n in ref_norms]),
                                   rtol=1e-5, atol=0)
    _assert_matches_reference(model, opt, ref_model, ref_masters)


def test_skipped_step_leaves_params_and_state_untouched_and_says_so(capsys):
    model = Mixed()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-3), dynamic_loss_scale=True, verbose=False,
                         dynamic_loss_args={"init_scale": 2.0**32, "max_loss_scale": 2.0**32})
    x, y = _data(1)[0]
    opt.backward(F.mse_loss(model(x), y))  # 2**32 overflows fp16 gradients
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.overflow and opt.step() is None
    assert "Gradient overflow.  Skipping step, reducing loss scale to 2147483648.0" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state_dict()["optimizer_state_dict"]["state"] == {}
    assert opt.clip_master_grads(1.0) == -1 and opt.inspect_master_grad_data() is None


def test_several_losses_with_delayed_master_grad_update():
    x, y = _data(1)[0]
    grads = []
    for delayed in (True, False):
        model = Mixed()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=256.0, verbose=False)
        out = model(x)
        if delayed:
            opt.backward(F.mse_loss(out, y), update_master_grads=False, retain_graph=True)
            opt.backward(out.abs().mean(), update_master_grads=False)
            opt.update_master_grads()
        else:
            opt.backward(F.mse_loss(out, y) + out.abs().mean())
        grads.append([g for group in opt.inspect_master_grad_data() for g in group])
    for a, b in zip(*grads):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-4)  # fp16 .grad accumulation vs one pass


def test_closure_works_with_static_scale():
    data = _data(3)
    results = []
    for use_closure in (True, False):
        model = Mixed()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=32.0, verbose=False)
        for x, y in data:
            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                opt.backward(loss)
                return loss

            if use_closure:
                opt.step(closure)
            else:
                closure()
                opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _closure_run(make_inner, use_closure, inject, steps=3, dynamic_loss_args=None):
    """``steps`` iterations with dynamic scaling; the evaluations counted in ``inject`` (1-based,
    over the whole run) get an infinite loss. ``use_closure=False`` is apex's plain loop, where an
    overflowing backward makes ``step()`` skip and the iteration is repeated by hand."""
    model = Mixed()
    opt = FP16_Optimizer(make_inner(model), dynamic_loss_scale=True, verbose=False,
                         dynamic_loss_args=dynamic_loss_args or {"init_scale": 2.0**12, "scale_window": 2})
    calls = fp16_optimizer_loop(opt, model, _data(steps), use_closure,
                                lambda call: float("inf") if call in inject else 1.0)
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for g in opt.param_groups for p in g["params"]]
    return [p.detach().clone() for p in model.parameters()], state, opt.loss_scale, calls


@pytest.mark.parametrize("make_inner", [
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),         # the fused step's optimizer
    lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3),                   # master grads + torch's step
], ids=["sgd", "rmsprop"])
def test_closure_with_dynamic_scale_reruns_an_overflowing_evaluation_at_the_reduced_scale(make_inner, capsys):
    # apex's last FP16_Optimizer: step(closure) works with dynamic scaling; an evaluation whose
    # grads overflowed prints "OVERFLOW within closure! ..." and the closure runs again at the
    # halved scale. The optimizer only ever sees the clean evaluation: the result is apex's plain
    # loop with the overflowing iteration skipped and repeated, bit for bit.
    inject = (2, 3)  # the second iteration overflows twice before it steps
    got = _closure_run(make_inner, True, inject)
    out = capsys.readouterr().out
    assert out.count("OVERFLOW within closure! Skipping step, reducing loss scale to") == 2
    assert "reducing loss scale to 2048.0" in out and "reducing loss scale to 1024.0" in out
    want = _closure_run(make_inner, False, inject)
    assert got[2] == want[2] == 2048.0 and got[3] == want[3] == 5  # 1024, then 2 clean steps grow it
    for a, b in zip(got[0], want[0]):
        assert torch.equal(a, b)
    assert len(got[1]) == len(want[1])
    for sa, sb in zip(got[1], want[1]):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


def test_closure_reevaluated_by_lbfgs_reruns_only_the_overflowing_evaluation(capsys):
    # LBFGS evaluates the closure several times per step, moving the masters in between. An
    # overflow in a later evaluation re-runs that evaluation at the same weights with half the
    # scale (power-of-two scales give the same unscaled grads), so the trajectory is the clean
    # run's, with one more evaluation.
    make_inner = lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4)  # noqa: E731
    args = {"init_scale": 2.0**12, "scale_window": 10**6}
    clean = _closure_run(make_inner, True, (), dynamic_loss_args=args)
    got = _closure_run(make_inner, True, (3,), dynamic_loss_args=args)
    assert "OVERFLOW within closure! Skipping step, reducing loss scale to 2048.0" in capsys.readouterr().out
    assert got[3] == clean[3] + 1 and (clean[2], got[2]) == (4096.0, 2048.0)
    for a, b in zip(got[0], clean[0]):
        assert torch.equal(a, b)


def test_closure_that_overflows_at_the_floor_raises_and_changes_nothing(capsys):
    # apex re-runs such a closure forever; the facade stops once the scale cannot be lowered, and
    # the optimizer has not stepped on any of the overflowing evaluations.
    model = Mixed()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0**16, "min_loss_scale": 2.0**14}, verbose=False)
    (x, y), = _data(1)
    opt.zero_grad()
    opt.backward(F.mse_loss(model(x), y))
    opt.step()  # creates the momentum buffers
    before = ([p.detach().clone() for p in model.parameters()],
              [m.detach().clone() for m in opt.all_fp32_from_fp16_params],
              [opt.state[p]["momentum_buffer"].clone() for g in opt.param_groups for p in g["params"]])
    calls = [0]

    def closure():
        calls[0] += 1
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * float("inf")
        opt.backward(loss)
        return loss

    with pytest.raises(RuntimeError, match=r"overflowed again at loss scale 16384\.0, which the dynamic scale "
                                           r"cannot lower \(min_loss_scale=16384\.0"):
        opt.step(closure)
    assert calls[0] == 3  # at 2**16, 2**15 and 2**14
    assert capsys.readouterr().out.count("OVERFLOW within closure!") == 2
    after = ([p.detach() for p in model.parameters()], opt.all_fp32_from_fp16_params,
             [opt.state[p]["momentum_buffer"] for g in opt.param_groups for p in g["params"]])
    for xs, ys in zip(before, after):
        for a, b in zip(xs, ys):
            assert torch.equal(a, b)
    assert opt.first_closure_call_this_step is True and opt.loss_scale == 2.0**14
    # and the next step runs its closure (a flag left set skipped it, closure unrun)
    calls[0] = 0

    def clean():
        calls[0] += 1
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        opt.backward(loss)
        return loss

    assert opt.step(clean) is not None and calls[0] == 1


def test_state_dict_keys_and_resume_bit_for_bit():
    data = _data(10)
    model = Mixed()
    kw = dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**20, "scale_window": 2}, verbose=False)
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-3), **kw)

    def train(m, o, batches):
        for x, y in batches:
            o.zero_grad()
            o.backward(F.mse_loss(m(x), y))
            o.step()

    train(model, opt, data[:5])
    sd = opt.state_dict()
    assert set(sd) == {"loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                       "optimizer_state_dict", "fp32_from_fp16"}
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": sd}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)  # weights_only loading accepts the scaler object
    model2 = Mixed()
    model2.load_state_dict(ckpt["model"])
    opt2 = FP16_Optimizer(torch.optim.Adam(model2.parameters(), lr=1e-3), **kw)
    opt2.load_state_dict(ckpt["optimizer"])
    train(model, opt, data[5:])
    train(model2, opt2, data[5:])
    assert opt2.loss_scale == opt.loss_scale
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.all_fp32_from_fp16_params, opt2.all_fp32_from_fp16_params):
        assert torch.equal(a, b)  # masters restored exactly, not re-derived from fp16
    with pytest.raises(ValueError, match="do not match"):
        FP16_Optimizer(torch.optim.Adam(Mixed(with_fp32=False).fc1.parameters()), verbose=False).load_state_dict(sd)


def test_pickling_is_refused():
    opt = FP16_Optimizer(torch.optim.SGD(Mixed().parameters(), lr=0.1), verbose=False)
    with pytest.raises(RuntimeError, match="serialized using state_dict"):
        pickle.dumps(opt)


def test_loss_scale_property_zero_grad_and_promoted_attributes():
    model = Mixed()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
    opt.loss_scale = 512.0
    assert opt.loss_scale == 512.0 and opt.loss_scaler.loss_scale() == 512.0 and opt.loss_scaler._loss_scale == 512.0
    x, y = _data(1)[0]
    opt.backward(F.mse_loss(model(x), y))
    assert model.fc1.weight.grad is not None and opt.param_groups[0]["params"][0].grad is not None
    opt.zero_grad()
    assert float(model.fc1.weight.grad.abs().sum()) == 0
    assert float(opt.param_groups[0]["params"][0].grad.abs().sum()) == 0
    opt.zero_grad(set_grads_to_None=True)
    assert model.fc1.weight.grad is None and all(p.grad is None for p in opt.param_groups[0]["params"])
    assert opt.state is opt.optimizer.state
    opt.param_groups[0]["lr"] = 0.5
    assert opt.optimizer.param_groups[0]["lr"] == 0.5


def test_bad_param_dtype_is_refused_naming_it_and_optimizer_untouched():
    p16 = nn.Parameter(torch.ones(2, dtype=torch.float16))
    p64 = nn.Parameter(torch.ones(2, dtype=torch.float64))
    inner = torch.optim.SGD([{"params": [p16]}, {"params": [p64]}], lr=0.1)
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\]\[0\] has dtype torch.float64"):
        FP16_Optimizer(inner, verbose=False)
    assert inner.param_groups[0]["params"][0] is p16
    with pytest.raises(TypeError, match="dynamic_loss_args"):
        FP16_Optimizer(torch.optim.SGD([p16], lr=0.1), dynamic_loss_scale=True, dynamic_loss_args={"window": 3})


def test_verbose_prints_ingested_params(capsys):
    FP16_Optimizer(torch.optim.SGD(Mixed().parameters(), lr=0.1))
    out = capsys.readouterr().out
    assert "FP16_Optimizer processing param group 0:" in out and "torch.float16" in out and "torch.float32" in out


def test_existing_optimizer_state_moves_to_the_masters_in_fp32():
    p = nn.Parameter(torch.ones(3, dtype=torch.float16))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3, dtype=torch.float16)
    inner.step()
    opt = FP16_Optimizer(inner, verbose=False)
    master = opt.param_groups[0]["params"][0]
    assert opt.state[master]["momentum_buffer"].dtype == torch.float32 and p not in opt.state


# ---------------------------------------------------------------------------------------------
# fp16util
# ---------------------------------------------------------------------------------------------


class DummyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.bn_plain = nn.BatchNorm2d(4, affine=False)

    def forward(self, x):
        return self.bn_plain(self.bn(self.conv(x)))


class DummyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = DummyBlock()
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 2)
        self.register_buffer("gain", torch.ones(2))

    def forward(self, x):
        return self.fc(self.norm(self.block(x).mean((2, 3)))) * self.gain


def test_fp16_model_keeps_only_affine_batchnorm_fp32_and_outputs_fp16():
    model = FP16Model(DummyNet())
    affine_bn = {id(t) for t in list(model.network.block.bn.parameters()) + list(model.network.block.bn.buffers())}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point():
            continue  # num_batches_tracked
        expected = torch.float32 if id(t) in affine_bn else torch.float16
        assert t.dtype == expected, name
    assert model(torch.randn(2, 3, 8, 8)).dtype == torch.float16



class BNWithProj(nn.BatchNorm1d):
    """An affine BatchNorm subclass holding a child module."""

    def __init__(self):
        super().__init__(4)
        self.proj = nn.Linear(4, 4)


def test_convert_network_keeps_only_the_batchnorms_own_tensors_fp32():
    # apex's convert_network skips the affine BatchNorm module itself (convert_module is not
    # recursive) and still visits its children: they are cast, the BatchNorm's own weight, bias
    # and running stats stay fp32. Also when the network itself is the BatchNorm.
    for net, bn in ((lambda m: (nn.Sequential(m), m))(BNWithProj()), (lambda m: (m, m))(BNWithProj())):
        convert_network(net, torch.half)
        assert {n: t.dtype for n, t in bn.named_parameters(recurse=False)} == \
            {"weight": torch.float32, "bias": torch.float32}
        assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32
        assert bn.proj.weight.dtype == bn.proj.bias.dtype == torch.float16
    model = FP16Model(nn.Sequential(nn.Linear(4, 4), BNWithProj()))
    assert model.network[1].weight.dtype == torch.float32 and model.network[1].proj.weight.dtype == torch.float16
    assert model(torch.randn(3, 4)).dtype == torch.float16


def test_convert_network_casts_a_tensor_a_batchnorm_shares_with_another_module():
    # apex converts every module but the affine BatchNorms, so a tied tensor is cast through the
    # other module that holds it.
    net = nn.ModuleDict({"bn": nn.BatchNorm1d(4), "lin": nn.Linear(4, 4)})
    net["lin"].bias = net["bn"].weight  # named_parameters lists it once, as "bn.weight"
    convert_network(net, torch.half)
    assert net["bn"].weight is net["lin"].bias and net["bn"].weight.dtype == torch.float16
    assert net["bn"].bias.dtype == torch.float32

def test_network_to_half_and_bn_convert_float():
    net = network_to_half(DummyNet())
    assert net[1].block.bn.weight.dtype == torch.float32 and net[1].fc.weight.dtype == torch.float16
    assert net(torch.randn(2, 3, 8, 8)).dtype == torch.float16
    m = BN_convert_float(nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3)).half())
    assert m[0].weight.dtype == torch.float32 and m[1].weight.dtype == torch.float16


def test_convert_module_casts_own_params_grads_and_buffers_only():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    seq[0].weight.grad = torch.ones(2, 2)
    convert_module(seq[0], torch.float16)
    assert seq[0].weight.dtype == seq[0].weight.grad.dtype == torch.float16 and seq[1].weight.dtype == torch.float32


@pytest.mark.parametrize("flat_master", [False, True])
def test_manual_master_params_round_trip(flat_master):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).half()
    model_params, master_params = prep_param_lists(model, flat_master=flat_master)
    assert len(master_params) == (1 if flat_master else 4) and all(m.dtype == torch.float32 for m in master_params)
    scale = 1024.0
    (model(torch.randn(5, 4).half()).float().sum() * scale).backward()
    model_grads_to_master_grads(model_params, master_params, flat_master=flat_master)
    for m in master_params:
        m.grad.mul_(1.0 / scale)
    expected = torch.cat([p.grad.float().flatten() / scale for p in model_params])
    assert torch.equal(torch.cat([m.grad.flatten() for m in master_params]), expected)
    opt = torch.optim.SGD(master_params, lr=0.5)
    opt.step()
    master_params_to_model_params(model_params, master_params, flat_master=flat_master)
    flat = torch.cat([m.detach().flatten() for m in master_params])
    assert torch.equal(torch.cat([p.detach().flatten() for p in model_params]), flat.half())


def test_flat_master_refuses_mixed_dtypes_naming_them():
    model = nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="mixes parameter dtypes.*torch.float16.*torch.float32"):
        prep_param_lists(model, flat_master=True)


def test_model_param_without_grad_clears_master_grad():
    model = nn.Linear(2, 2).half()
    model_params, master_params = prep_param_lists(model)
    master_params[0].grad = torch.ones(2, 2)
    model_grads_to_master_grads(model_params, master_params)
    assert master_params[0].grad is None



def test_flat_master_refuses_a_param_without_grad_naming_it_and_writes_nothing():
    # One flat master grad cannot skip a param the way flat_master=False does (master grad None),
    # and zeros would let momentum / weight decay move it: refused, naming the param.
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(2, 2)}).half()
    model_params, master_params = prep_param_lists(model, flat_master=True)
    model["used"](torch.randn(5, 3).half()).float().sum().backward()
    before = master_params[0].grad.clone()
    with pytest.raises(ValueError, match=r"model_params\[2\] \(shape \(2, 2\), torch.float16\) has no grad.*"
                                         r"flat_master=False"):
        model_grads_to_master_grads(model_params, master_params, flat_master=True)
    assert torch.equal(master_params[0].grad, before)


def test_flat_master_grad_is_reallocated_after_zero_grad_set_to_none():
    # torch's optimizer.zero_grad() sets the master's grad to None; the copy allocates it again,
    # as flat_master=False does.
    model = nn.Linear(3, 2).half()
    model_params, master_params = prep_param_lists(model, flat_master=True)
    torch.optim.SGD(master_params, lr=0.1).zero_grad()
    assert master_params[0].grad is None
    model(torch.randn(5, 3).half()).float().sum().backward()
    model_grads_to_master_grads(model_params, master_params, flat_master=True)
    assert torch.equal(master_params[0].grad, torch.cat([p.grad.float().flatten() for p in model_params]))


def test_flat_master_of_a_model_without_trainable_params_is_refused_naming_it():
    with pytest.raises(ValueError, match="the ReLU has no trainable parameters"):
        prep_param_lists(nn.ReLU(), flat_master=True)
    frozen = nn.Linear(2, 2).half().requires_grad_(False)
    with pytest.raises(ValueError, match="the Linear has no trainable parameters"):
        prep_param_lists(frozen, flat_master=True)
    assert prep_param_lists(frozen) == ([], [])  # unflattened: empty lists, as apex

def test_to_python_float():
    assert to_python_float(torch.tensor(2.5)) == 2.5 and to_python_float([3.0]) == 3.0
    assert math.isnan(to_python_float(torch.tensor(float("nan"))))
