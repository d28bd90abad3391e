"""FP8 linear layers (ampfunc/fp8.py): the scaled matmul against its emulation, saturation, the
scaling state's arithmetic, the overwrite-with-gradient loop, composition with the mixed-precision
step and the loss scale, one compiled graph, bit-exact resume, and a short training fidelity run.
"""

import io
import math
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

import ampfunc as af
from ampfunc import fp8 as f8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

HAS_SCALED_MM = f8.fp8_available("cpu")
needs_scaled_mm = pytest.mark.skipif(not HAS_SCALED_MM, reason="torch._scaled_mm takes no fp8 on this CPU build")
BACKENDS = ["emulate"] + (["scaled_mm"] if HAS_SCALED_MM else [])


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 10))


def data(n=8, batch=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 32, generator=g) * 3, torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def dequant(q, scale):
    return q.to(torch.float32) / scale


# -- quantisation and saturation ------------------------------------------------------------------


def test_quantize_saturates_e4m3_and_keeps_inf_in_e5m2():
    one = torch.tensor(1.0)
    x = torch.tensor([1000.0, -1000.0, math.inf, -math.inf, 1.0])
    q = f8.quantize(x, one, f8.E4M3).float()
    assert q.tolist() == [448.0, -448.0, 448.0, -448.0, 1.0]
    g = torch.tensor([1e6, -1e6, math.inf, -math.inf, 2.0])
    qg = f8.quantize(g, one, f8.E5M2).float()
    assert qg.tolist() == [57344.0, -57344.0, math.inf, -math.inf, 2.0]
    assert f8.quantize(torch.tensor([math.nan]), one, f8.E5M2).float().isnan().all()
    # The scale multiplies before the cast: 100 * 8 = 800 saturates at 448.
    assert f8.quantize(torch.tensor([100.0]), torch.tensor(8.0), f8.E4M3).float().item() == 448.0
    with pytest.raises(ValueError, match="float8"):
        f8.quantize(x, one, torch.bfloat16)


# -- the scaling state ------------------------------------------------------------------------------


def test_delayed_scaling_history_and_scales_advance_as_specified():
    recipe = f8.DelayedScaling(history_len=3, margin=1)
    meta = f8.Fp8Meta(torch.zeros(3), torch.ones(()))
    fmax = 448.0
    # Step 0: empty history -> the current amax gives the scale (not the stale scale of 1).
    used, meta = f8.advance_meta(meta, torch.tensor(4.0), fmax, recipe)
    assert used.item() == fmax / 2 / 4.0
    assert meta.amax_history.tolist() == [4.0, 0.0, 0.0]
    assert meta.scale.item() == fmax / 2 / 4.0
    # Step 1: the scale computed after step 0 is used; the history's max is still 4.
    used, meta = f8.advance_meta(meta, torch.tensor(2.0), fmax, recipe)
    assert used.item() == fmax / 2 / 4.0
    assert meta.amax_history.tolist() == [2.0, 4.0, 0.0]
    assert meta.scale.item() == fmax / 2 / 4.0
    # 0, inf and NaN are not recorded and change nothing.
    for bad in (0.0, math.inf, math.nan):
        used2, meta2 = f8.advance_meta(meta, torch.tensor(bad), fmax, recipe)
        assert used2.item() == meta.scale.item()
        assert torch.equal(meta2.amax_history, meta.amax_history) and torch.equal(meta2.scale, meta.scale)
    used, meta = f8.advance_meta(meta, torch.tensor(8.0), fmax, recipe)
    assert meta.amax_history.tolist() == [8.0, 2.0, 4.0] and meta.scale.item() == fmax / 2 / 8.0
    # The 4 and the 8 roll out of the window of 3: the max becomes 1.
    for a in (1.0, 1.0, 1.0):
        used, meta = f8.advance_meta(meta, torch.tensor(a), fmax, recipe)
    assert used.item() == fmax / 2 / 8.0  # computed after the step whose window still held the 8
    assert meta.amax_history.tolist() == [1.0, 1.0, 1.0] and meta.scale.item() == fmax / 2


def test_most_recent_current_and_power_of_two():
    meta = f8.Fp8Meta(torch.tensor([8.0, 0.0]), torch.tensor(56.0))
    _, m = f8.advance_meta(meta, torch.tensor(2.0), 448.0, f8.DelayedScaling(2, amax_compute="most_recent"))
    assert m.scale.item() == 224.0
    used, m = f8.advance_meta(meta, torch.tensor(3.0), 448.0, f8.CurrentScaling(2))
    assert used.item() == pytest.approx(448.0 / 3.0) and m.scale.item() == used.item()
    used, _ = f8.advance_meta(meta, torch.tensor(3.0), 448.0, f8.CurrentScaling(2, power_of_2=True))
    assert used.item() == 128.0
    used, _ = f8.advance_meta(meta, torch.tensor(0.0), 448.0, f8.CurrentScaling(2))
    assert used.item() == 1.0
    # A subnormal amax gives fp32's max, not inf.
    used, _ = f8.advance_meta(meta, torch.tensor(1e-45), 57344.0, f8.CurrentScaling(2))
    assert used.item() == torch.finfo(torch.float32).max


def test_recipe_and_policy_errors():
    with pytest.raises(ValueError, match="history_len"):
        f8.DelayedScaling(history_len=0)
    with pytest.raises(ValueError, match="amax_compute"):
        f8.DelayedScaling(amax_compute="mean")
    model = mlp()
    with pytest.raises(ValueError, match="'nope' names no module"):
        f8.fp8_policy(model, exclude=("nope",))
    with pytest.raises(ValueError, match="backend"):
        f8.fp8_policy(model, backend="cuda")
    pol = f8.fp8_policy(model, exclude=("5",))
    assert pol.layers == ("0", "3")
    with pytest.raises(ValueError, match=r"one Fp8LinearState per layer \['0', '3'\], got \['0'\]"):
        pol.apply(model, af.params_of(model), {"0": pol.init()["0"]}, torch.randn(2, 32))


def test_a_model_with_no_linear_to_convert_runs_unchanged_with_a_warning():
    model = mlp()
    x, y = data(1)[0]
    params = af.params_of(model)
    # Nothing left after exclude / include, or no Linear at all: a warning, and the model runs as it is.
    cases = [(model, {"include": ("1",)}), (model, {"exclude": ("0", "3", "5")}),
             (nn.Sequential(nn.LayerNorm(32), nn.GELU()), {})]
    for net, kw in cases:
        with pytest.warns(UserWarning, match="no nn.Linear layer to run in FP8"):
            pol = f8.fp8_policy(net, backend="emulate", **kw)
        assert pol.layers == () and pol.init() == {}
        p = af.params_of(net)
        assert torch.equal(pol.apply(net, p, pol.init(), x), functional_call(net, p, (x,)))
    # It composes with make_train_step as a policy with no layers (the state has no FP8 entries).
    with pytest.warns(UserWarning):
        pol = f8.fp8_policy(model, exclude=("",))
    train = af.make_train_step(model, lambda fwd, x, y: F.cross_entropy(fwd(x), y), af.sgd(0.1), "p=f32,c=f32,o=f32",
                               fp8=pol)
    state = train.init()
    assert state.fp8 == {}
    state, out = train.step(state, x, y)
    ref = F.cross_entropy(functional_call(model, params, (x,)), y)
    assert torch.equal(out.loss, ref)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_a_non_floating_input_is_refused_naming_the_layer(dtype):
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",), backend="emulate")
    x = (torch.randn(4, 32) * 3).to(dtype)
    with pytest.raises(TypeError, match=f"layer '0': the input must be a floating tensor.*got {dtype}"):
        pol.apply(model, af.params_of(model), pol.init(), x)
    with pytest.raises(TypeError, match=f"layer '0': the input must be a floating tensor.*got {dtype}"), \
            pol.autocast(model, pol.init()):
        model(x)
    w = model[0].weight
    with pytest.raises(TypeError, match=f"fp8_linear: the input must be a floating tensor.*got {dtype}"):
        f8.fp8_linear(x, w, None, pol.init()["0"])
    with pytest.raises(TypeError, match="fp8_linear: the weight must be a floating tensor.*got torch.int64"):
        f8.fp8_linear(torch.randn(4, 32), w.long(), None, pol.init()["0"])


def test_a_state_of_another_history_length_is_refused_by_name_and_resized_as_te_does():
    model = mlp()
    long_pol = f8.fp8_policy(model, exclude=("5",), recipe=f8.DelayedScaling(history_len=8), backend="emulate")
    short_pol = f8.fp8_policy(model, exclude=("5",), recipe=f8.DelayedScaling(history_len=2), backend="emulate")
    params = af.params_of(model)
    x = torch.randn(4, 32)
    saved = long_pol.init()
    # Record input amaxes 8, 1, 1, 1 on layer '0' under the long recipe.
    meta = saved["0"].input
    for a in (8.0, 1.0, 1.0, 1.0):
        _, meta = f8.advance_meta(meta, torch.tensor(a), 448.0, long_pol.recipe)
    saved["0"] = saved["0"]._replace(input=meta)
    assert meta.scale.item() == 56.0  # the window of 8 still holds the 8
    # Resumed under history_len=2: refused by name on every door (nothing runs on the stale window).
    with pytest.raises(ValueError, match=r"state\['0'\]\.input\.amax_history has shape \(8,\) but the recipe's "
                                         r"history_len is 2.*resize_history"):
        short_pol.apply(model, params, saved, x)
    with pytest.raises(ValueError, match=r"state\['0'\]\.input\.amax_history has shape \(8,\)"), \
            short_pol.autocast(model, short_pol.track(saved)):
        model(x)
    with pytest.raises(ValueError, match=r"fp8_linear: state\.input\.amax_history has shape \(8,\)"):
        f8.fp8_linear(x, model[0].weight, None, saved["0"], short_pol.recipe)
    with pytest.raises(ValueError, match=r"advance_meta: meta\.amax_history has shape \(8,\)"):
        f8.advance_meta(meta, torch.tensor(1.0), 448.0, short_pol.recipe)
    # Transformer Engine's adjust_amax_history_length: the newest entries kept, zeros appended.
    resized = short_pol.resize_history(saved)
    assert resized["0"].input.amax_history.tolist() == [1.0, 1.0]
    assert torch.equal(resized["0"].input.scale, saved["0"].input.scale)
    _, m = f8.advance_meta(resized["0"].input, torch.tensor(1.0), 448.0, short_pol.recipe)
    assert m.scale.item() == 448.0  # the window of 2 no longer holds the 8
    grown = long_pol.resize_history(short_pol.init())
    assert all(m.amax_history.shape == (8,) for st in grown.values() for m in st)
    _, new8 = grad(lambda p, s: short_pol.apply(model, p, s, x).sum(), argnums=(0, 1))(params, resized)
    assert all(m.amax_history.shape == (2,) for st in new8.values() for m in st)
    with pytest.raises(TypeError, match=r"resize_history: state\['0'\] must be an Fp8LinearState"):
        short_pol.resize_history({**saved, "0": (1, 2)})


def test_a_float64_input_or_weight_is_refused_naming_the_layer():
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",), backend="emulate")
    x = torch.randn(4, 32, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"layer '0': the input must be a floating tensor \(float32, bfloat16 or "
                                        r"float16\), got torch.float64"):
        pol.apply(model, af.params_of(model), pol.init(), x)
    with pytest.raises(TypeError, match="layer '0': the input .*got torch.float64"), pol.autocast(model, pol.init()):
        model(x)
    with pytest.raises(TypeError, match="fp8_linear: the weight .*got torch.float64"):
        f8.fp8_linear(torch.randn(4, 32), model[0].weight.double(), None, pol.init()["0"])


def test_a_state_whose_scale_is_not_0d_is_refused_by_name():
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",), backend="emulate")
    state = pol.init()
    state["3"] = state["3"]._replace(weight=state["3"].weight._replace(scale=torch.ones(3)))
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"state\['3'\]\.weight\.scale has shape \(3,\), expected a 0-d tensor"):
        pol.apply(model, af.params_of(model), state, x)
    with pytest.raises(ValueError, match=r"fp8_linear: state\.weight\.scale has shape \(3,\)"):
        f8.fp8_linear(torch.randn(4, 64), model[3].weight, None, state["3"])
    with pytest.raises(ValueError, match=r"advance_meta: meta\.scale has shape \(1,\)"):
        f8.advance_meta(f8.Fp8Meta(torch.zeros(16), torch.ones(1)), torch.tensor(1.0), 448.0, pol.recipe)


def test_resize_history_refuses_a_state_of_other_layers_by_name():
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",), recipe=f8.DelayedScaling(history_len=2), backend="emulate")
    saved = f8.fp8_policy(model, backend="emulate").init()  # layers '0', '3' and '5'
    with pytest.raises(ValueError, match=r"resize_history: .*per layer \['0', '3'\]; layers not in the policy: "
                                         r"\['5'\], missing: \[\]"):
        pol.resize_history(saved)
    with pytest.raises(ValueError, match=r"layers not in the policy: \[\], missing: \['3'\]"):
        pol.resize_history({"0": saved["0"]})
    with pytest.raises(TypeError, match="resize_history: state must be a dict"):
        pol.resize_history([saved["0"]])


class _PlainSubclass(nn.Linear):
    """An nn.Linear subclass that keeps nn.Linear's forward (a marker type, as torch's own
    NonDynamicallyQuantizableLinear)."""


class _ScaledForward(nn.Linear):
    def forward(self, x):
        return 2 * F.linear(x, self.weight, self.bias)


class _WithAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = _PlainSubclass(32, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.custom = _ScaledForward(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.custom(self.attn(h, h, h, need_weights=False)[0]))


def test_linear_subclasses_run_in_fp8_and_the_layers_left_out_are_named():
    torch.manual_seed(0)
    model = _WithAttention()
    with pytest.warns(UserWarning, match=r"stay in high precision: 'attn.out_proj' \(a MultiheadAttention's out_proj"
                                         r".*'custom' \(_ScaledForward overrides nn.Linear.forward"):
        pol = f8.fp8_policy(model, backend="emulate")
    assert pol.layers == ("inp", "head")
    # the subclass that keeps nn.Linear's forward really runs in FP8: its state advances
    x = torch.randn(2, 5, 32)
    params = af.params_of(model)
    _, new = grad(lambda p, s: pol.apply(model, p, s, x).sum(), argnums=(0, 1))(params, pol.init())
    assert new["inp"].input.amax_history[0] == x.abs().amax()
    # MultiheadAttention's out_proj never reaches F.linear: listed by hand, its state would never move
    by_hand = f8.Fp8Policy(("attn.out_proj",), backend="emulate")
    _, untouched = grad(lambda p, s: by_hand.apply(model, p, s, x).sum(), argnums=(0, 1))(params, by_hand.init())
    assert untouched["attn.out_proj"].input.amax_history.abs().sum() == 0
    # excluding the two says so: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f8.fp8_policy(model, exclude=("attn", "custom"), backend="emulate").layers == ("inp", "head")


# -- the matmul and the linear against the emulation ------------------------------------------------


@needs_scaled_mm
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32, 64, 48), (7, 40, 13)])  # the second is padded to multiples of 16
def test_scaled_matmul_equals_emulation(out_dtype, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 10).to(f8.E4M3)
    b = (torch.randn(n, k, generator=g) * 1e3).to(f8.E5M2).t()  # row-major (n, k) seen as (k, n)
    ai, bi = torch.tensor(0.25), torch.tensor(1 / 512)
    ours = f8.scaled_matmul(a, b, ai, bi, out_dtype, "scaled_mm")
    ref = f8.scaled_matmul(a, b, ai, bi, out_dtype, "emulate")
    assert ours.dtype == ref.dtype == out_dtype and ours.shape == (m, n)
    tol = dict(rtol=1e-5, atol=1e-4) if out_dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(ours, ref, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_forward_backward_against_emulation(backend, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 6, 32, generator=g) * 3).to(dtype)
    w = (torch.randn(48, 32, generator=g) * 0.1).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    gy = (torch.randn(4, 6, 48, generator=g) * 1e-3).to(dtype)
    recipe = f8.DelayedScaling(history_len=4)
    state = f8.fp8_policy(torch.nn.Sequential(torch.nn.Linear(32, 48)), recipe=recipe).init()["0"]
    # Take a step so that the scales in use come from the state (delayed), not the bootstrap.
    _, (_, _, _, state) = _linear_vjp(x * 1.25, w * 1.25, b, gy * 1.25, state, recipe, backend)
    (y, (dx, dw, db, new_state)) = _linear_vjp(x, w, b, gy, state, recipe, backend)

    # The emulation, written out: quantise with the state's scales, dequantise, fp32 matmul.
    sx, sw, sg = state.input.scale, state.weight.scale, state.grad_output.scale
    xq = dequant(f8.quantize(x.reshape(-1, 32), sx, f8.E4M3), sx)
    wq = dequant(f8.quantize(w, sw, f8.E4M3), sw)
    gq = dequant(f8.quantize(gy.reshape(-1, 48), sg, f8.E5M2), sg)
    y_ref = ((xq @ wq.t()).to(dtype) + b).reshape(4, 6, 48)
    dx_ref = (gq @ wq).to(dtype).reshape(x.shape)
    dw_ref = (gq.t() @ xq).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    torch.testing.assert_close(dw, dw_ref, **tol)
    torch.testing.assert_close(db, gy.reshape(-1, 48).sum(0), rtol=1e-2, atol=1e-5)
    # Against full precision: fp8's 3 mantissa bits, a few percent.
    rel = (y.float() - F.linear(x.float(), w.float(), b.float())).norm() / F.linear(x.float(), w.float()).norm()
    assert rel < 0.08
    # The "gradient" of the state is the advanced state.
    for i, (t, fmax) in enumerate(((x, 448.0), (w, 448.0), (gy, 57344.0))):
        _, expect = f8.advance_meta(state[i], t.abs().amax().float(), fmax, recipe)
        got = new_state[i]
        assert torch.equal(got.amax_history, expect.amax_history) and torch.equal(got.scale, expect.scale)


def _linear_vjp(x, w, b, gy, state, recipe, backend):
    def f(x, w, b, state):
        return f8.fp8_linear(x, w, b, state, recipe, backend=backend)

    y, vjp = torch.func.vjp(f, x, w, b, state)
    return y, vjp(gy)


def test_backward_overflow_reaches_the_check_and_is_not_recorded():
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",))
    params, state8 = af.params_of(model), pol.init()
    x, y = data(1)[0]

    def loss_fn(params, state8, mult):
        return F.cross_entropy(pol.apply(model, params, state8, x), y) * mult

    grads, new8 = grad(loss_fn, argnums=(0, 1))(params, state8, torch.tensor(math.inf))
    _, finite = af.unscale_and_check(grads, af.NoOpLossScale())
    assert not finite
    # The inf amax of the output gradient is not pushed: its history stays empty, its scale 1.
    for name in pol.layers:
        assert torch.equal(new8[name].grad_output.amax_history, state8[name].grad_output.amax_history)
        assert new8[name].grad_output.scale.item() == 1.0
        assert new8[name].input.amax_history[0] > 0  # the forward amaxes were finite


# -- the loop: mixed_precision, loss scale, stateful ------------------------------------------------


def run_functional(steps, backend="emulate", start=None, record=None):
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",), backend=backend)
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2)),
                            loss_scale=af.DynamicLossScale(2.0**8, growth_interval=3))
    keep = af.norm_layers(model)

    def loss_fn(params, state8, x, y, mult, ls):
        p = af.cast_params(params, torch.bfloat16, keep=keep)
        loss = F.cross_entropy(pol.apply(model, p, state8, x.bfloat16()).float(), y) * mult
        return af.scale_loss(loss, ls), loss

    grad_fn = grad(loss_fn, argnums=(0, 1), has_aux=True)

    def step(params, opt_state, state8, x, y, mult):
        (grads, new8), loss = grad_fn(params, state8, x, y, mult, af.loss_scale_of(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return af.apply_updates(params, updates), opt_state, new8, loss

    if start is None:
        params = {k: v.clone() for k, v in af.params_of(model).items()}
        start = (0, params, tx.init(params), pol.init())
    i0, params, opt_state, state8 = start
    losses = []
    for i, (x, y) in enumerate(data(1) * steps, start=i0):  # one batch, learned by heart
        # Step 2 overflows in the backward (e5m2 carries the inf): skipped, the loss scale backs off.
        # (An inf in a forward operand would saturate at e4m3's 448 instead.)
        mult = torch.tensor(math.inf if i == 2 else 1.0)
        params, opt_state, state8, loss = step(params, opt_state, state8, x, y, mult)
        losses.append(loss)
        if record is not None and i + 1 == record[0]:
            record[1] = (i + 1, params, opt_state, state8)
    return params, opt_state, state8, losses, step


def test_mixed_precision_loop_trains_skips_and_resumes_bit_exactly():
    snap = [4, None]
    params, opt_state, state8, losses, _ = run_functional(8, record=snap)
    assert not math.isfinite(losses[2]) and all(math.isfinite(l) for i, l in enumerate(losses) if i != 2)
    assert float(af.loss_scale_of(opt_state).loss_scale) < 2.0**8 * 2  # backed off once at least
    assert losses[-1] < losses[0]
    # The overflowing gradient amax was not recorded: 8 forward amaxes, 7 gradient amaxes.
    for st in state8.values():
        for meta in st:
            assert torch.isfinite(meta.amax_history).all() and torch.isfinite(meta.scale)
        assert (st.input.amax_history > 0).sum() == 8 and (st.grad_output.amax_history > 0).sum() == 7
    # A checkpoint taken at step 4 (torch.save, weights_only load) resumes to the same bits.
    buf = io.BytesIO()
    torch.save(snap[1], buf)
    buf.seek(0)
    resumed = torch.load(buf)
    p2, o2, s2, _, _ = run_functional(4, start=resumed)
    for a, b in zip(af.tree.tree_leaves((params, opt_state, state8)), af.tree.tree_leaves((p2, o2, s2))):
        assert torch.equal(a, b)


def test_stateful_autocast_matches_functional():
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",), backend="emulate")
    state8 = pol.init()
    x, y = data(1)[0]
    grads, new8 = grad(lambda p, s: F.cross_entropy(pol.apply(model, p, s, x), y), argnums=(0, 1))(
        af.params_of(model), state8)
    live = pol.track(state8)
    with pol.autocast(model, live):
        F.cross_entropy(model(x), y).backward()
    got8 = pol.from_grads(live)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    for a, b in zip(af.tree.tree_leaves(got8), af.tree.tree_leaves(new8)):
        assert torch.equal(a, b)
    # Outside the context the model is plain again.
    assert torch.equal(model(x), functional_call(model, af.params_of(model), (x,)))


def test_module_trainer_loop_with_fp8_autocast():
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",))
    trainer = af.ModuleTrainer(model, af.adamw(1e-2), loss_scale=af.DynamicLossScale(2.0**8))
    state8 = pol.init()
    x, y = data(1)[0]
    losses, flags = [], []
    for i in range(5):
        live = pol.track(state8)
        with pol.autocast(model, live):
            loss = F.cross_entropy(model(x), y) * (math.inf if i == 2 else 1.0)
        trainer.scale(loss).backward()
        flags.append(bool(trainer.step()))
        state8 = pol.from_grads(live)
        losses.append(float(loss.detach()))
    assert flags == [True, True, False, True, True]
    assert losses[-1] < losses[0]
    for st in state8.values():
        assert (st.input.amax_history > 0).sum() == 5 and (st.grad_output.amax_history > 0).sum() == 4
        assert not any(t.requires_grad for t in af.tree.tree_leaves(st))


def test_make_train_step_carries_the_fp8_state():
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",))
    train = af.make_train_step(model, lambda fwd, x, y, m: F.cross_entropy(fwd(x), y) * m, af.adamw(1e-2),
                               "p=f32,c=bf16,o=f32", loss_scale=af.DynamicLossScale(2.0**8), fp8=pol)
    state = train.init()
    assert set(state.fp8) == set(pol.layers)
    x, y = data(1)[0]
    flags, losses = [], []
    for i in range(5):
        state, out = train.step(state, x, y, torch.tensor(math.inf if i == 2 else 1.0))
        flags.append(bool(out.finite))
        losses.append(float(out.loss))
    assert flags == [True, True, False, True, True] and losses[-1] < losses[0]
    for st in state.fp8.values():
        assert (st.input.amax_history > 0).sum() == 5 and (st.grad_output.amax_history > 0).sum() == 4
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert isinstance(loaded.fp8["0"], f8.Fp8LinearState)
    a, _ = train.step(state, x, y, torch.tensor(1.0))
    b, _ = train.step(loaded, x, y, torch.tensor(1.0))
    for u, v in zip(af.tree.tree_leaves(a), af.tree.tree_leaves(b)):
        assert torch.equal(u, v)
    with pytest.raises(TypeError, match="Fp8Policy"):
        af.make_train_step(model, lambda fwd, x: fwd(x).sum(), af.adamw(1e-2), fp8="fp8")


# -- one graph under torch.compile ------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_fp8_step_is_one_graph_with_eager_numbers():
    import torch._dynamo.testing

    torch._dynamo.reset()
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",))
    tx = af.mixed_precision(af.adamw(1e-2), loss_scale=af.DynamicLossScale(2.0**8))

    def loss_fn(params, state8, x, y, ls):
        p = af.cast_params(params, torch.bfloat16)
        return af.scale_loss(F.cross_entropy(pol.apply(model, p, state8, x.bfloat16()).float(), y), ls)

    def step(params, opt_state, state8, x, y):
        grads, new8 = grad(loss_fn, argnums=(0, 1))(params, state8, x, y, af.loss_scale_of(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return af.apply_updates(params, updates), opt_state, new8

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    params = {k: v.clone() for k, v in af.params_of(model).items()}
    eager = (params, tx.init(params), pol.init())
    comp = eager
    for x, y in data(3):
        eager = step(*eager, x, y)
        comp = compiled(*comp, x, y)
    assert counter.frame_count == 1
    for a, b in zip(af.tree.tree_leaves(eager), af.tree.tree_leaves(comp)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- training fidelity (short; benchmarks/bench_fp8.py --fidelity runs the full three seeds) -------


@pytest.mark.slow
def test_small_gpt_fp8_tracks_bf16():
    from bench_fp8 import train_lm

    kw = dict(seed=0, steps=30, batch=8, seq=32, d_model=64, layers=1, heads=2, eval_batches=2)
    bf16, fp8 = train_lm("bf16", **kw), train_lm("fp8", **kw)
    assert bf16 < 4.0  # it learned something (ln 256 = 5.5 at the start)
    assert abs(fp8 / bf16 - 1) < 0.03, (bf16, fp8)


# -- two processes over gloo: amaxes all-reduced, the same scales on every rank --------------------


def _dist_worker(outdir):
    """One rank (run as ``python tests/test_fp8.py OUTDIR`` with torchrun's environment)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.group.WORLD
    model = mlp()
    pol = f8.fp8_policy(model, exclude=("5",), group=group)
    tx = af.mixed_precision(af.adamw(1e-2), loss_scale=af.NoOpLossScale())
    params = {k: v.clone() for k, v in af.params_of(model).items()}
    opt_state, state8 = tx.init(params), pol.init()

    def loss_fn(params, state8, x, y):
        return F.cross_entropy(pol.apply(model, params, state8, x), y)

    first_amax = []
    for step, (x, y) in enumerate(data(4, batch=24)):
        # Rank 1's rows are scaled up: the ranks' local amaxes differ.
        x = x * torch.linspace(1, 4, x.shape[0])[:, None]
        if step == 0:
            first_amax = [x.abs().amax().item(), x[:12].abs().amax().item(), x[12:].abs().amax().item()]
        xs, ys = x[rank * 12:(rank + 1) * 12], y[rank * 12:(rank + 1) * 12]
        grads, state8 = grad(loss_fn, argnums=(0, 1))(params, state8, xs, ys)
        grads = af.dist.all_reduce_mean(grads, group)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = af.apply_updates(params, updates)
    torch.save({"params": params, "state8": state8, "first_amax": first_amax},
               os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_two_ranks_reduce_amaxes_and_stay_identical(tmp_path):
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{log[-3000:]}"
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for a, b in zip(af.tree.tree_leaves((out[0]["params"], out[0]["state8"])),
                    af.tree.tree_leaves((out[1]["params"], out[1]["state8"]))):
        assert torch.equal(a, b)
    # The first step's input amax of layer 0 is the global one, not either rank's local one.
    global_amax, amax0, amax1 = out[0]["first_amax"]
    assert amax0 != amax1
    recorded = out[0]["state8"]["0"].input.amax_history[3].item()  # four steps: slot 3 is step 0
    assert recorded == global_amax


# -- CUDA (run by benchmarks/gpu_check.sh on an sm89+/sm90 GPU) --------------------------------------

needs_cuda_fp8 = pytest.mark.skipif(not (torch.cuda.is_available() and f8.fp8_available("cuda")),
                                    reason="needs a CUDA GPU with fp8 matmuls (sm89+)")


@pytest.mark.cuda
@needs_cuda_fp8
@pytest.mark.parametrize("shape", [(4, 64, 128, 96), (3, 7, 40, 24)])  # the second needs padding to 16
def test_cuda_fp8_linear_matches_emulation(shape):
    b, t, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(b, t, k, generator=g) * 3).cuda().bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).cuda().bfloat16()
    gy = (torch.randn(b, t, n, generator=g) * 1e-3).cuda().bfloat16()
    state = f8.fp8_policy(torch.nn.Sequential(torch.nn.Linear(k, n))).init("cuda")["0"]
    outs = {}
    for backend in ("scaled_mm", "emulate"):
        y, (dx, dw, _, new) = _linear_vjp(x, w, torch.zeros_like(w[:, 0]), gy, state, f8.DelayedScaling(), backend)
        outs[backend] = (y, dx, dw, new)
    for a, e in zip(outs["scaled_mm"][:3], outs["emulate"][:3]):
        torch.testing.assert_close(a.float(), e.float(), rtol=2**-7, atol=1e-5)
    for a, e in zip(af.tree.tree_leaves(outs["scaled_mm"][3]), af.tree.tree_leaves(outs["emulate"][3])):
        torch.testing.assert_close(a, e)


@pytest.mark.cuda
@needs_cuda_fp8
def test_cuda_compiled_fp8_gpt_step_matches_eager():
    from bench_fp8 import GPT, make_step

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(d_model=128, layers=2, heads=4, seq=64).cuda()
    init, step, _ = make_step(model, "fp8", steps=10)
    compiled = torch.compile(step, fullgraph=True)
    eager = comp = init()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = (torch.randint(0, 256, (8, 64), generator=g).cuda() for _ in range(2))
        eager, comp = step(*eager, x, y), compiled(*comp, x, y)
    for a, b in zip(af.tree.tree_leaves(eager), af.tree.tree_leaves(comp)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


if __name__ == "__main__":
    _dist_worker(sys.argv[1])
