"""ampfunc.compat.torch_optim: Adam/AdamW as torch.optim optimizers with low-memory states.

Specifications: with fp32 settings on fp32 params they are torch.optim.Adam/AdamW (to the
tolerance of one Adam kernel against another, tests/_helpers.assert_same: torch's CPU sqrt is an
ulp off for some inputs); with low-memory settings they are ``af.mixed_precision(af.adamw(...,
moments=m), ..., master=s).step_`` bit for bit on the same gradients; under a GradScaler (the
facade and torch's own) an overflow writes nothing and halves the scale, and a finite step is the
unscaled reference's, with no host sync; LR schedulers drive the lr; ``state_dict`` round-trips
through ``torch.save``/``torch.load(weights_only=True)`` and a resumed run continues bit for bit;
bad input is refused by name before any write.
"""

import io

import pytest
import torch
from torch import nn

import ampfunc as af
from _helpers import assert_same, exact, same_bits
from ampfunc import lowmem
from ampfunc.compat.torch_amp import GradScaler
from ampfunc.compat.torch_optim import Adam, AdamW
from ampfunc.lowmem import Q8Moment, SplitMaster

# w: 8,192 elements (32 q8 blocks); b: too small for q8 (fp32 moments); n: an fp32 norm weight.
SHAPES = {"w": (64, 128), "b": (300,), "n": (64,)}
LR, WD = 1e-2, 0.05


def _values(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _dtypes(low):
    return {"w": low, "b": low, "n": torch.float32}


def _grads(i, dtypes):
    gen = torch.Generator().manual_seed(100 + i)
    return {k: (torch.randn(s, generator=gen) * 0.1).to(dtypes[k]) for k, s in SHAPES.items()}


def _ours(cls, dtypes, **kw):
    params = [nn.Parameter(v.to(dtypes[k])) for k, v in _values().items()]
    return params, cls(params, lr=LR, weight_decay=WD, **kw)


def _reference(cls, dtypes, moments, master, amsgrad=False, lr=LR, loss_scale=None):
    make = af.adamw if cls is AdamW else af.adam
    tx = af.mixed_precision(make(lr, weight_decay=WD, amsgrad=amsgrad, moments=moments),
                            loss_scale or af.NoOpLossScale(), master=master)
    params = {k: v.to(dtypes[k]) for k, v in _values().items()}
    return tx, params, tx.init(params)


def _ref_entry(state, key):
    """What ``optimizer.state[p]`` must hold, from a ``mixed_precision`` state."""
    opt = state.inner
    entry = {"step": opt.step}
    for f in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        slot = getattr(opt, f)
        if isinstance(slot, Q8Moment):
            entry[f], entry[f + "_absmax"] = slot.codes[key], slot.absmax[key]
        elif slot is not None:
            entry[f] = slot[key]
    if isinstance(state.master, SplitMaster):
        entry["master_remainder"] = state.master.remainder[key]
    elif state.master is not None:
        entry["master"] = state.master[key]
    return entry


def _assert_is_reference(params, opt, ref_params, ref_state, what=""):
    for p, key in zip(params, SHAPES):
        assert same_bits(p.detach(), ref_params[key]), f"{what} param {key}"
        ours, theirs = opt.state[p], _ref_entry(ref_state, key)
        assert ours.keys() == theirs.keys(), what
        for name in ours:
            assert same_bits(ours[name], theirs[name]), f"{what} {key}[{name!r}]"


def _snapshot(params, opt):
    return [p.detach().clone() for p in params] + [t.clone() for e in opt.state.values() for t in e.values()]


def _set_grads(params, grads, scale=1.0):
    for p, key in zip(params, SHAPES):
        p.grad = grads[key] * scale  # exact: powers of two


# ------------------------------------------------------------------------------------------------
# The arithmetic: torch's with fp32 settings, mixed_precision's with low-memory ones
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ours_cls, torch_cls, kw", [
    (AdamW, torch.optim.AdamW, {}),
    (AdamW, torch.optim.AdamW, dict(amsgrad=True, maximize=True, betas=(0.8, 0.95), eps=1e-6)),
    (Adam, torch.optim.Adam, {}),
    (Adam, torch.optim.Adam, dict(decoupled_weight_decay=True, amsgrad=True)),
])
def test_fp32_settings_on_fp32_params_are_torch_optim(ours_cls, torch_cls, kw, kernels):
    dtypes = _dtypes(torch.float32)
    theirs = [nn.Parameter(v.clone()) for v in _values().values()]
    ref = torch_cls([{"params": theirs[:2]}, {"params": theirs[2:], "lr": LR / 4}], lr=LR, weight_decay=WD,
                    foreach=False, fused=False, **kw)
    params = [nn.Parameter(v.clone()) for v in _values().values()]
    opt = ours_cls([{"params": params[:2]}, {"params": params[2:], "lr": LR / 4}], lr=LR, weight_decay=WD, **kw)
    for i in range(12):
        grads = _grads(i, dtypes)
        _set_grads(params, grads)
        _set_grads(theirs, grads)
        opt.step()
        ref.step()
        for a, b in zip(params, theirs):
            assert_same(a.detach(), b.detach(), exact(kernels, torch_cls), f"step {i}")
    assert kernels["adam"] > 0
    ours_sd, their_sd = opt.state_dict(), ref.state_dict()
    for i, their_entry in their_sd["state"].items():
        for name, value in their_entry.items():
            assert_same(ours_sd["state"][i][name], value, name == "step", f"state[{i}][{name!r}]")
    strip = lambda g: {k: v for k, v in g.items() if k not in ("moments", "master", "foreach", "fused")}  # noqa: E731
    assert [strip(g) for g in ours_sd["param_groups"]] == [strip(g) for g in their_sd["param_groups"]]


SETTINGS = [  # (class, low-precision param dtype, moments, master, amsgrad)
    (AdamW, torch.bfloat16, "q8", "split", False),
    (AdamW, torch.bfloat16, "bf16", "split", False),
    (AdamW, torch.bfloat16, "fp32", "split", False),
    (Adam, torch.bfloat16, "q8", "split", False),
    (AdamW, torch.bfloat16, "q8", "fp32", False),   # an fp32 master copy (the plain-torch road)
    (AdamW, torch.float16, "bf16", "fp32", False),
    (AdamW, torch.bfloat16, "bf16", "split", True),
    (AdamW, torch.float32, "q8", "fp32", False),
]


@pytest.mark.parametrize("cls, low, moments, master, amsgrad", SETTINGS,
                         ids=[f"{c.__name__}-{str(d)[6:]}-{m}-{s}{'-amsgrad' if a else ''}"
                              for c, d, m, s, a in SETTINGS])
def test_low_memory_settings_are_mixed_precision_bit_for_bit(cls, low, moments, master, amsgrad, monkeypatch):
    fused = []
    kernel_step = lowmem._fused_step_
    monkeypatch.setattr(lowmem, "_fused_step_", lambda *a: fused.append(kernel_step(*a)) or fused[-1])
    dtypes = _dtypes(low)
    params, opt = _ours(cls, dtypes, moments=moments, master=master, amsgrad=amsgrad)
    tx, ref_params, ref_state = _reference(cls, dtypes, moments, master, amsgrad)
    _assert_is_reference(params, opt, ref_params, ref_state, "init")
    for i in range(8):
        grads = _grads(i, dtypes)
        if i == 5:
            grads["b"][3] = float("nan")  # skipped without a scaler too (torch would write NaN)
        _set_grads(params, grads)
        opt.step()
        ref_params, ref_state = tx.step_(ref_params, grads, ref_state)
        _assert_is_reference(params, opt, ref_params, ref_state, f"step {i}")
    assert float(opt.state[params[0]]["step"]) == 7.0
    if master == "split" and not amsgrad:  # the one-pass kernel took our steps (and the reference's)
        assert fused and all(r is not None for r in fused)


def test_param_groups_keep_their_own_settings():
    dtypes = _dtypes(torch.bfloat16)
    params = [nn.Parameter(v.to(dtypes[k])) for k, v in _values().items()]
    opt = AdamW([{"params": params[:1], "moments": "q8", "master": "split"},
                 {"params": params[1:], "lr": LR / 2}], lr=LR, weight_decay=WD)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.uint8 and "master" in opt.state[params[1]]
    tx0 = af.mixed_precision(af.adamw(LR, weight_decay=WD, moments="q8"), af.NoOpLossScale(), master="split")
    tx1 = af.mixed_precision(af.adamw(LR / 2, weight_decay=WD), af.NoOpLossScale())
    p0 = {"w": params[0].detach().clone()}
    p1 = {k: params[j].detach().clone() for j, k in enumerate(SHAPES) if j}
    s0, s1 = tx0.init(p0), tx1.init(p1)
    for i in range(4):
        grads = _grads(i, dtypes)
        _set_grads(params, grads)
        opt.step()
        p0, s0 = tx0.step_(p0, {"w": grads["w"]}, s0)
        p1, s1 = tx1.step_(p1, {k: grads[k] for k in p1}, s1)
    assert same_bits(params[0].detach(), p0["w"])
    assert same_bits(opt.state[params[0]]["exp_avg"], s0.inner.exp_avg.codes["w"])
    for j, k in enumerate(SHAPES):
        if j:
            assert same_bits(params[j].detach(), p1[k]) and same_bits(opt.state[params[j]]["master"], s1.master[k])


# ------------------------------------------------------------------------------------------------
# The GradScaler's fused road
# ------------------------------------------------------------------------------------------------


def _scaler(which, init_scale=2.0**12):
    if which == "ampfunc":
        return GradScaler("cpu", init_scale=init_scale)
    return torch.amp.GradScaler("cpu", init_scale=init_scale)


@pytest.mark.parametrize("which", ["ampfunc", "torch"])
@pytest.mark.parametrize("moments, master, low", [("q8", "split", torch.bfloat16), ("bf16", "fp32", torch.bfloat16),
                                                  ("fp32", "fp32", torch.float32)])
def test_under_a_grad_scaler_an_overflow_writes_nothing_and_finite_steps_are_the_unscaled_reference(
        which, moments, master, low):
    dtypes = _dtypes(low)
    params, opt = _ours(AdamW, dtypes, moments=moments, master=master)
    tx, ref_params, ref_state = _reference(AdamW, dtypes, moments, master)
    scaler = _scaler(which)
    scales = []
    for i in range(7):
        grads = _grads(i, dtypes)
        scaler.scale(torch.ones((), requires_grad=True))  # makes the scale tensor, as scale(loss) does
        scale = scaler.get_scale()
        _set_grads(params, grads, scale)
        overflow = i in (2, 3)
        if overflow:
            params[i % 2].grad.view(-1)[7] = float("inf") if i == 2 else float("nan")
            before = _snapshot(params, opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if overflow:
            assert all(same_bits(a, b) for a, b in zip(before, _snapshot(params, opt))), f"step {i} wrote"
            assert scales[-1] == scale / 2
        else:
            ref_params, ref_state = tx.step_(ref_params, grads, ref_state)
        _assert_is_reference(params, opt, ref_params, ref_state, f"step {i}")
    assert scales[:4] == [2.0**12, 2.0**12, 2.0**11, 2.0**10]
    assert float(opt.state[params[0]]["step"]) == 5.0
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_after_unscale_the_step_takes_found_inf_alone():
    dtypes = _dtypes(torch.bfloat16)
    params, opt = _ours(AdamW, dtypes, moments="q8", master="split")
    tx, ref_params, ref_state = _reference(AdamW, dtypes, "q8", "split")
    scaler = GradScaler("cpu", init_scale=2.0**8)
    for i in range(4):
        grads = _grads(i, dtypes)
        scaler.scale(torch.ones((), requires_grad=True))
        _set_grads(params, grads, scaler.get_scale())
        if i == 1:
            params[0].grad[0, 0] = float("inf")
            before = _snapshot(params, opt)
        scaler.unscale_(opt)  # the gradients unscaled in place (clip_grad_norm_ would go here)
        scaler.step(opt)
        scaler.update()
        if i == 1:
            assert all(same_bits(a, b) for a, b in zip(before, _snapshot(params, opt)))
        else:
            ref_params, ref_state = tx.step_(ref_params, grads, ref_state)
        _assert_is_reference(params, opt, ref_params, ref_state, f"step {i}")


def _no_sync(*args, **kwargs):
    raise AssertionError("host sync in the step")


@pytest.mark.parametrize("moments, master", [("q8", "split"), ("fp32", "fp32"), ("bf16", "fp32")])
def test_the_scaled_step_never_reads_a_tensor_back(moments, master, monkeypatch):
    dtypes = _dtypes(torch.bfloat16)
    params, opt = _ours(AdamW, dtypes, moments=moments, master=master)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    flags = []
    for i in range(4):
        scaler.scale(torch.ones((), requires_grad=True))
        _set_grads(params, _grads(i, dtypes), 2.0**10 if i < 2 else 2.0**9)
        if i == 1:
            params[1].grad[0] = float("inf")
        with monkeypatch.context() as m:
            for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
                m.setattr(torch.Tensor, name, _no_sync)
            _, found_inf = scaler.step(opt, return_found_inf=True)
            scaler.update()
        flags.append(float(found_inf))
    assert flags == [0.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------------------
# torch.optim's machinery: LR schedulers, params without grads, zero_grad, checkpoints
# ------------------------------------------------------------------------------------------------


def test_an_lr_scheduler_changes_the_lr_the_step_uses():
    dtypes = _dtypes(torch.bfloat16)
    params, opt = _ours(AdamW, dtypes, moments="q8", master="split")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    hi, ref_params, ref_state = _reference(AdamW, dtypes, "q8", "split")
    lo = af.mixed_precision(af.adamw(LR * 0.1, weight_decay=WD, moments="q8"), af.NoOpLossScale(), master="split")
    lrs = []
    for i in range(4):
        grads = _grads(i, dtypes)
        _set_grads(params, grads)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        ref_params, ref_state = (hi if i < 2 else lo).step_(ref_params, grads, ref_state)
        _assert_is_reference(params, opt, ref_params, ref_state, f"step {i}")
    assert lrs == [LR, LR, pytest.approx(LR * 0.1), pytest.approx(LR * 0.1)]
    assert lrs[2] == LR * 0.1  # StepLR's product, the float the reference was built with


@pytest.mark.parametrize("master", ["split", "fp32"])
def test_params_without_grad_are_skipped(master):
    dtypes = _dtypes(torch.bfloat16)
    params, opt = _ours(AdamW, dtypes, moments="q8", master=master)
    frozen = [t.clone() for t in [params[1].detach()] + list(opt.state[params[1]].values())[1:]]
    # The reference steps the params that have grads: w and n.
    tx = af.mixed_precision(af.adamw(LR, weight_decay=WD, moments="q8"), af.NoOpLossScale(), master=master)
    ref_params = {k: v.to(dtypes[k]) for k, v in _values().items() if k != "b"}
    ref_state = tx.init(ref_params)
    for i in range(3):
        grads = _grads(i, dtypes)
        params[0].grad, params[1].grad, params[2].grad = grads["w"], None, grads["n"]
        opt.step()
        ref_params, ref_state = tx.step_(ref_params, {k: grads[k] for k in ref_params}, ref_state)
        assert same_bits(params[0].detach(), ref_params["w"]) and same_bits(params[2].detach(), ref_params["n"])
        now = [params[1].detach()] + list(opt.state[params[1]].values())[1:]
        assert all(same_bits(a, b) for a, b in zip(frozen, now))
    # Only the fp32 param has a gradient: with fp32 master copies in the group, its copy follows it.
    params[0].grad, params[1].grad = None, None
    params[2].grad = _grads(9, dtypes)["n"]
    w_before = params[0].detach().clone()
    opt.step()
    assert same_bits(params[0].detach(), w_before)
    if master == "fp32":
        assert torch.equal(opt.state[params[2]]["master"], params[2].detach())
        assert torch.equal(opt.state[params[0]]["master"].bfloat16(), params[0].detach())


def test_zero_grad_clears_the_grads_as_torch():
    params, opt = _ours(AdamW, _dtypes(torch.bfloat16), moments="bf16", master="split")
    _set_grads(params, _grads(0, _dtypes(torch.bfloat16)))
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    opt.step()  # nothing to step
    assert float(opt.state[params[0]]["step"]) == 0.0


@pytest.mark.parametrize("moments, master, low", [("q8", "split", torch.bfloat16), ("bf16", "fp32", torch.float16),
                                                  ("fp32", "fp32", torch.float32)])
def test_a_state_dict_round_trips_through_torch_save_and_resumes_bit_for_bit(moments, master, low):
    dtypes = _dtypes(low)
    params, opt = _ours(AdamW, dtypes, moments=moments, master=master)
    for i in range(3):
        _set_grads(params, _grads(i, dtypes))
        opt.step()
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    sd = loaded["optimizer"]
    assert set(sd) == {"state", "param_groups"} and sorted(sd["state"]) == [0, 1, 2]
    assert sd["param_groups"][0]["params"] == [0, 1, 2] and sd["param_groups"][0]["moments"] == moments
    resumed_params = [nn.Parameter(t.clone()) for t in loaded["params"]]
    resumed = AdamW(resumed_params, lr=LR * 3, weight_decay=0.0, moments=moments, master=master)
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["lr"] == LR and resumed.param_groups[0]["weight_decay"] == WD
    for i in range(3, 6):
        grads = _grads(i, dtypes)
        _set_grads(params, grads)
        _set_grads(resumed_params, grads)
        opt.step()
        resumed.step()
        for a, b in zip(_snapshot(params, opt), _snapshot(resumed_params, resumed)):
            assert same_bits(a, b), f"step {i}"


def test_a_torch_adamw_state_dict_loads_into_fp32_settings():
    dtypes = _dtypes(torch.float32)
    theirs = [nn.Parameter(v.clone()) for v in _values().values()]
    ref = torch.optim.AdamW(theirs, lr=LR, weight_decay=WD, foreach=False)
    for i in range(2):
        _set_grads(theirs, _grads(i, dtypes))
        ref.step()
    params = [nn.Parameter(p.detach().clone()) for p in theirs]
    opt = AdamW(params)
    opt.load_state_dict(ref.state_dict())
    for i in range(2, 5):
        _set_grads(theirs, _grads(i, dtypes))
        _set_grads(params, _grads(i, dtypes))
        ref.step()
        opt.step()
    for a, b in zip(params, theirs):
        assert_same(a.detach(), b.detach(), False)


# ------------------------------------------------------------------------------------------------
# Bad input, refused by name before any write
# ------------------------------------------------------------------------------------------------


def test_fp16_params_with_a_split_master_are_refused_naming_the_param():
    with pytest.raises(ValueError, match=r"param_groups\[0\].*'params\[1\]' is float16.*master='split'"):
        AdamW([nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), nn.Parameter(torch.ones(4).half())],
              master="split")
    opt = AdamW([nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], master="split")
    with pytest.raises(ValueError, match="float16"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3).half())]})
    assert len(opt.param_groups) == 1 and len(opt.state) == 1


@pytest.mark.parametrize("kw, error, match", [
    (dict(moment="q8"), TypeError, "moment"),
    (dict(moments="q4"), ValueError, "moments must be one of"),
    (dict(master="fp16"), ValueError, "master must be one of"),
    (dict(capturable=True), ValueError, "capturable=True"),
    (dict(differentiable=True), ValueError, "differentiable=True"),
    (dict(lr=torch.tensor(1e-3)), TypeError, "lr as a Tensor"),
    (dict(betas=(0.9, 1.0)), ValueError, "Invalid beta parameter at index 1"),
    (dict(lr=-1.0), ValueError, "Invalid learning rate"),
    (dict(fused="yes"), TypeError, "fused must be None or a bool"),
])
def test_unsupported_options_are_refused_by_name(kw, error, match):
    with pytest.raises(error, match=match):
        AdamW([nn.Parameter(torch.ones(4))], **kw)


def test_a_state_dict_of_another_moments_setting_is_refused_naming_both_before_any_write():
    dtypes = _dtypes(torch.bfloat16)
    params_q8, opt_q8 = _ours(AdamW, dtypes, moments="q8", master="split")
    params_bf, opt_bf = _ours(AdamW, dtypes, moments="bf16", master="split")
    for opt, params in ((opt_q8, params_q8), (opt_bf, params_bf)):
        _set_grads(params, _grads(0, dtypes))
        opt.step()
    before = _snapshot(params_bf, opt_bf)
    with pytest.raises(ValueError, match=r"saved with moments='q8' but this optimizer's has moments='bf16'"):
        opt_bf.load_state_dict(opt_q8.state_dict())
    # the group entry dropped: the entries themselves name the setting
    sd = opt_q8.state_dict()
    sd["param_groups"] = [{k: v for k, v in g.items() if k != "moments"} for g in sd["param_groups"]]
    with pytest.raises(ValueError, match="moments='fp32'.*no such entry"):
        opt_bf.load_state_dict(sd)
    sd["param_groups"][0]["moments"] = "bf16"
    with pytest.raises(ValueError, match=r"exp_avg_absmax.*moments='bf16'"):
        opt_bf.load_state_dict(sd)
    split_sd = opt_bf.state_dict()
    _, opt_fp32 = _ours(AdamW, dtypes, moments="bf16", master="fp32")
    with pytest.raises(ValueError, match="saved with master='split' but this optimizer's has master='fp32'"):
        opt_fp32.load_state_dict(split_sd)
    assert all(same_bits(a, b) for a, b in zip(before, _snapshot(params_bf, opt_bf)))
    assert opt_bf.param_groups[0]["moments"] == "bf16"


def test_a_changed_layout_setting_or_a_bad_grad_scale_is_refused_before_any_write():
    dtypes = _dtypes(torch.bfloat16)
    params, opt = _ours(AdamW, dtypes, moments="q8", master="split")
    _set_grads(params, _grads(0, dtypes))
    before = _snapshot(params, opt)
    opt.param_groups[0]["moments"] = "fp32"
    with pytest.raises(ValueError, match=r"\['moments'\] changed from 'q8' to 'fp32'"):
        opt.step()
    opt.param_groups[0]["moments"] = "q8"
    opt.grad_scale = 1024.0
    with pytest.raises(TypeError, match="optimizer.grad_scale must be a one-element real tensor"):
        opt.step()
    del opt.grad_scale
    opt.param_groups[0]["lr"] = "fast"
    with pytest.raises(TypeError, match="lr must be a number"):
        opt.step()
    assert all(same_bits(a, b) for a, b in zip(before, _snapshot(params, opt)))
    opt.param_groups[0]["lr"] = LR
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 1.0


def test_found_inf_is_honoured_on_its_own_and_grad_scale_unscales():
    """The fused road's contract itself, as a scaler sets it: a nonzero found_inf skips a step
    whose gradients are finite (another rank's overflow, a scale set by hand), writing nothing."""
    dtypes = _dtypes(torch.bfloat16)
    params, opt = _ours(AdamW, dtypes, moments="q8", master="split")
    tx, ref_params, ref_state = _reference(AdamW, dtypes, "q8", "split")
    grads = _grads(0, dtypes)
    _set_grads(params, grads, 4.0)
    before = _snapshot(params, opt)
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(1.0)
    opt.step()
    assert all(same_bits(a, b) for a, b in zip(before, _snapshot(params, opt)))
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    ref_params, ref_state = tx.step_(ref_params, grads, ref_state)
    _assert_is_reference(params, opt, ref_params, ref_state)
    del opt.grad_scale, opt.found_inf
    _set_grads(params, _grads(1, dtypes))
    opt.step()  # without a scaler: scale 1 again
    ref_params, ref_state = tx.step_(ref_params, _grads(1, dtypes), ref_state)
    _assert_is_reference(params, opt, ref_params, ref_state)
