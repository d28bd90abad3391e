"""Every op of ampfunc.ops, on every backend, against a plain per-leaf torch oracle.

Backends: "compiled" calls the public functions, which dispatch to the compiled kernels of
ext/ when they are built (CI sets AMPFUNC_REQUIRE_EXT=1, so there they are); "reference" calls
the plain-torch ``_ref_*`` implementations directly. The oracle below is neither: it computes
each quantity leaf by leaf in the most obvious way.
"""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _helpers import bits
from ampfunc import ops

BACKENDS = ["reference"] + (["compiled"] if ops.backend() != "reference" else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# 0, 1, odd, a multiple of the vector width, and more than one CPU task (32K) / CUDA chunk (64K).
SIZES = [0, 1, 2, 7, 16, 31, 33, 1000, 65537]
BAD = [float("nan"), float("inf"), -float("inf")]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(backend, tensors, per_leaf=False):
    if backend == "reference":
        out = ops._ref_check(tensors, per_leaf)
        return tuple(out) if per_leaf else (out[0], out[1])
    return ops.check(tensors, per_leaf=per_leaf)


def _unscale(backend, tensors, inv_scale):
    return ops._ref_unscale(tensors, inv_scale) if backend == "reference" else ops.unscale(tensors, inv_scale)


def _unscale_(backend, tensors, inv_scale):
    return ops._ref_unscale_(tensors, inv_scale) if backend == "reference" else ops.unscale_(tensors, inv_scale)


@st.composite
def leaf_lists(draw, max_leaves=8):
    """A list of 1-D tensors of mixed sizes and dtypes, some holding NaN/+inf/-inf at random
    positions (the last element included)."""
    n = draw(st.integers(1, max_leaves))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    leaves = []
    for _ in range(n):
        size = draw(st.sampled_from(SIZES))
        dtype = draw(st.sampled_from(DTYPES))
        t = (torch.randn(size, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 100.0]))).to(dtype)
        if size and draw(st.booleans()) and draw(st.booleans()):
            pos = draw(st.sampled_from([0, size - 1, draw(st.integers(0, size - 1))]))
            t[pos] = draw(st.sampled_from(BAD))
        leaves.append(t)
    return leaves


def oracle_check(tensors):
    leaf_nonfinite = [not bool(torch.isfinite(t).all()) for t in tensors]
    sumsq = sum(float(t.double().square().sum()) for t in tensors)
    return not any(leaf_nonfinite), sumsq, leaf_nonfinite


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(tensors=leaf_lists())
def test_check_reports_finiteness_sum_of_squares_and_the_leaves_at_fault(backend, tensors):
    before = [t.clone() for t in tensors]
    finite, sumsq, leaf = _check(backend, tensors, per_leaf=True)
    want_finite, want_sumsq, want_leaf = oracle_check(tensors)
    assert finite.dtype == torch.bool and finite.shape == ()
    assert sumsq.dtype == torch.float32 and sumsq.shape == ()
    assert bool(finite) == want_finite
    assert leaf.tolist() == want_leaf
    if want_finite:
        assert math.isclose(float(sumsq), want_sumsq, rel_tol=2e-5, abs_tol=1e-30)
    # read-only: the inputs are untouched, bit for bit (NaN included)
    for a, b in zip(tensors, before):
        assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_of_many_small_leaves_with_one_bad_element_names_that_leaf(backend):
    tensors = [torch.randn(i % 13 + 1) for i in range(3000)]
    tensors[2718][-1] = float("inf")
    finite, sumsq, leaf = _check(backend, tensors, per_leaf=True)
    assert not bool(finite)
    assert leaf.nonzero().flatten().tolist() == [2718]


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_handles_non_contiguous_and_float64_inputs(backend):
    base = torch.randn(40, 30)
    t = base.t()[::2]  # transposed and strided
    d = torch.randn(9, dtype=torch.float64)
    finite, sumsq = _check(backend, [t, d])
    assert bool(finite)
    assert math.isclose(float(sumsq), float(t.double().square().sum() + d.square().sum()), rel_tol=1e-5)
    t[3, 4] = float("nan")
    assert not bool(_check(backend, [d, t])[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_is_not_fooled_by_finite_values_whose_squares_overflow_fp32(backend):
    big = torch.full((5000,), 3e19)  # finite, but x*x overflows fp32
    finite, sumsq, leaf = _check(backend, [torch.ones(3), big], per_leaf=True)
    assert bool(finite) and leaf.tolist() == [False, False]
    big[-1] = float("inf")
    finite, _, leaf = _check(backend, [torch.ones(3), big], per_leaf=True)
    assert not bool(finite) and leaf.tolist() == [False, True]


def test_check_of_an_empty_list_is_finite_with_zero_sum():
    finite, sumsq = ops.check([])
    assert bool(finite) and float(sumsq) == 0.0


@pytest.mark.skipif("compiled" not in BACKENDS, reason="compiled kernels not built")
def test_compiled_check_refuses_an_integer_tensor_naming_its_index():
    with pytest.raises(TypeError, match=r"^ampfunc: tensors\[1\] has dtype torch.int32; .* \(check\)$"):
        ops.check([torch.randn(3), torch.arange(4, dtype=torch.int32)])


def test_all_finite_is_the_flag_of_check():
    assert bool(ops.all_finite([torch.ones(3), torch.ones(2, dtype=torch.float16)]))
    assert not bool(ops.all_finite([torch.ones(3), torch.tensor([1.0, -float("inf")])]))


# ---------------------------------------------------------------------------------------------
# unscale
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(tensors=leaf_lists(), inv_scale=st.sampled_from([1.0, 2.0**-16, 0.37, 3.0]))
def test_unscale_returns_fp32_products_and_judges_finiteness_on_the_inputs(backend, tensors, inv_scale):
    inv = torch.tensor(inv_scale)
    before = [t.clone() for t in tensors]
    outs, finite = _unscale(backend, tensors, inv)
    assert bool(finite) == oracle_check(tensors)[0]
    for o, t in zip(outs, before):
        assert o.dtype == torch.float32 and o.shape == t.shape
        torch.testing.assert_close(o, t.float() * inv, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(tensors, before):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(tensors=leaf_lists(), inv_scale=st.sampled_from([1.0, 2.0**-16, 0.37, 3.0]))
def test_unscale_in_place_rounds_the_fp32_product_to_each_leafs_dtype(backend, tensors, inv_scale):
    inv = torch.tensor(inv_scale)
    want = [(t.float() * inv).to(t.dtype) for t in tensors]
    want_finite = oracle_check(tensors)[0]
    finite = _unscale_(backend, tensors, inv)
    assert bool(finite) == want_finite
    for t, w in zip(tensors, want):
        torch.testing.assert_close(t, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stride", [8, 16, 32])  # one AVX2 or AVX-512 vector apart, or two
def test_unscale_is_not_fooled_by_finite_values_whose_sum_overflows_fp32(backend, stride):
    g = torch.zeros(4 * stride)
    g[::stride] = 2e38  # finite; any two of them add up to inf
    outs, finite = _unscale(backend, [g], torch.tensor(1.0))
    assert bool(finite) and torch.equal(outs[0], g)
    inplace = g.clone()
    assert bool(_unscale_(backend, [inplace], torch.tensor(1.0))) and torch.equal(inplace, g)
    g[-1] = float("inf")
    assert not bool(_unscale(backend, [g], torch.tensor(1.0))[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscale_in_place_writes_through_non_contiguous_views(backend):
    base = torch.randn(20, 10)
    want = base.clone()
    want[:, ::3] *= 0.5
    view = base[:, ::3]
    assert bool(_unscale_(backend, [view, torch.ones(4)], torch.tensor(0.5)))
    assert torch.equal(base, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscale_of_float64_leaves_follows_the_reference_arithmetic(backend):
    inv = torch.tensor(0.3)
    x = torch.tensor([1.0, 1e300, 3.0], dtype=torch.float64)  # 1e300 is finite in double, inf in fp32
    y = x.clone()
    assert bool(_unscale_(backend, [y, torch.ones(2)], inv))
    assert torch.equal(y, x * float(inv))
    outs, finite = _unscale(backend, [x], inv)
    assert not bool(finite)  # the fp32 copy overflowed
    assert outs[0].dtype == torch.float32 and torch.equal(outs[0], x.float() * inv)


@pytest.mark.skipif("compiled" not in BACKENDS, reason="compiled kernels not built")
def test_compiled_unscale_refuses_a_float64_scale_naming_the_argument():
    with pytest.raises(TypeError, match=r"^ampfunc: inv_scale has dtype torch.float64; expected torch.float32"):
        ops.unscale_([torch.ones(3)], torch.tensor(0.5, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# fused optimizer steps
# ---------------------------------------------------------------------------------------------

SHAPES = [(7,), (1000,), (33, 17), (0,), (1,)]


def _sgd(backend, params, grads, bufs, model, step, grad_scale, finite, **h):
    h = {"weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "maximize": False, **h}
    if backend == "reference":
        ops._ref_sgd_step_(params, grads, bufs, model or [], step, grad_scale, finite, h["lr"], h["weight_decay"],
                           h["momentum"], h["dampening"], h["nesterov"], h["maximize"])
    else:
        ops.sgd_step_(params, grads, bufs, model, step, grad_scale, finite, **h)


def _adam(backend, params, grads, m, v, vmax, model, step, grad_scale, finite, **h):
    h = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
         "decoupled_weight_decay": False, "maximize": False, **h}
    if backend == "reference":
        ops._ref_adam_step_(params, grads, m, v, vmax if h["amsgrad"] else [], model or [], step, grad_scale,
                            finite, h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["amsgrad"],
                            h["decoupled_weight_decay"], h["maximize"])
    else:
        ops.adam_step_(params, grads, m, v, vmax, model, step, grad_scale, finite, **h)


OPTIMIZERS = [
    ("sgd", dict(lr=0.05)),
    ("sgd", dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.3)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd", dict(lr=0.05, momentum=0.5, maximize=True)),
    ("adam", dict(lr=1e-2)),
    ("adam", dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)),
    ("adam", dict(lr=1e-2, amsgrad=True, maximize=True)),
    ("adamw", dict(lr=1e-2, weight_decay=0.01)),
    ("adamw", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
]


def _torch_opt(kind, params, h):
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return cls(params, foreach=False, **h)


def _ours(kind, backend, params, grads, state, step, h, grad_scale, finite, model=None):
    if kind == "sgd":
        _sgd(backend, params, grads, state[0], model, step, grad_scale, finite, **h)
    else:
        h = dict(h)
        b1, b2 = h.pop("betas", (0.9, 0.999))
        _adam(backend, params, grads, state[0], state[1], state[2], model, step, grad_scale, finite, beta1=b1,
              beta2=b2, decoupled_weight_decay=kind == "adamw", **h)


def _fresh_state(kind, params):
    return [[torch.zeros_like(p) for p in params] for _ in range(1 if kind == "sgd" else 3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,h", OPTIMIZERS)
def test_fused_step_matches_torch_optim_over_50_steps(backend, kind, h):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    theirs = [p.clone().requires_grad_(True) for p in params]
    opt = _torch_opt(kind, theirs, h)
    state, step = _fresh_state(kind, params), torch.zeros(())
    one, yes = torch.ones(()), torch.ones((), dtype=torch.bool)
    for _ in range(50):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for t, g in zip(theirs, grads):
            t.grad = g.clone()
        opt.step()
        _ours(kind, backend, params, grads, state, step, h, one, yes)
    assert float(step) == 50.0
    for ours, t in zip(params, theirs):
        torch.testing.assert_close(ours, t.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dampening", [0.9, 0.7, 0.55])
def test_sgd_dampening_is_rounded_as_torch_rounds_it_bit_for_bit(backend, dampening):
    # torch multiplies the gradient by fp32(1 - dampening), the difference taken in double;
    # fp32(1) - fp32(0.9) is 0.100000024, not fp32(0.1), and that moved half the buffers
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(1000, generator=gen)]
    theirs = [params[0].clone().requires_grad_(True)]
    h = dict(lr=0.05, momentum=0.9, dampening=dampening)
    opt = torch.optim.SGD(theirs, foreach=False, **h)
    state, step = _fresh_state("sgd", params), torch.zeros(())
    for _ in range(3):
        grads = [torch.randn(1000, generator=gen)]
        theirs[0].grad = grads[0].clone()
        opt.step()
        _ours("sgd", backend, params, grads, state, step, h, torch.ones(()), torch.ones((), dtype=torch.bool))
    assert torch.equal(state[0][0], opt.state[theirs[0]]["momentum_buffer"])
    assert torch.equal(params[0], theirs[0].detach())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,h", [OPTIMIZERS[1], OPTIMIZERS[6], OPTIMIZERS[9]])
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16])
def test_fused_step_folds_the_grad_scale_and_writes_the_rounded_model_copy(backend, kind, h, grad_dtype,
                                                                           model_dtype):
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    scaled = [(torch.randn(s, generator=gen) * 512).to(grad_dtype) for s in SHAPES]
    grad_scale = torch.tensor(1 / 512)
    unscaled = [g.float() * grad_scale for g in scaled]
    want_p = [p.clone() for p in params]
    want_state, want_step = _fresh_state(kind, params), torch.zeros(())
    _ours(kind, "reference", want_p, unscaled, want_state, want_step, h, torch.ones(()),
          torch.ones((), dtype=torch.bool))
    state, step = _fresh_state(kind, params), torch.zeros(())
    model = [p.to(model_dtype) for p in params]
    _ours(kind, backend, params, scaled, state, step, h, grad_scale, torch.ones((), dtype=torch.bool), model)
    assert float(step) == 1.0
    for p, w, m in zip(params, want_p, model):
        torch.testing.assert_close(p, w, rtol=1e-6, atol=1e-7)
        assert m.dtype == model_dtype
        assert torch.equal(m, p.to(model_dtype))  # the copy is the new master param, rounded once


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,h", [OPTIMIZERS[3], OPTIMIZERS[7], OPTIMIZERS[9]])
def test_skipped_fused_step_leaves_params_moments_model_copy_and_step_bit_identical(backend, kind, h):
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    state, step = _fresh_state(kind, params), torch.zeros(())
    model = [p.to(torch.float16) for p in params]
    one, yes, no = torch.ones(()), torch.ones((), dtype=torch.bool), torch.zeros((), dtype=torch.bool)
    for _ in range(3):  # some history, so that the moments are not zeros
        _ours(kind, backend, params, [torch.randn(s, generator=gen) for s in SHAPES], state, step, h, one, yes, model)
    snapshot = [t.clone() for t in params + model + [x for lst in state for x in lst] + [step]]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    grads[1][-1] = float("nan")
    _ours(kind, backend, params, grads, state, step, h, one, no, model)
    after = params + model + [x for lst in state for x in lst] + [step]
    for a, b in zip(after, snapshot):
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                           b.view(-1).view(torch.uint8) if b.numel() else b)
    assert float(step) == 3.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,h", [OPTIMIZERS[2], OPTIMIZERS[6], OPTIMIZERS[9]])
def test_a_learning_rate_tensor_gives_the_float_learning_rates_result(backend, kind, h):
    # A schedule's value arrives as a 0-d fp32 tensor; the kernels read it on the device.
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    twin = [p.clone() for p in params]
    state, twin_state = _fresh_state(kind, params), _fresh_state(kind, params)
    step, twin_step = torch.zeros(()), torch.zeros(())
    one, yes = torch.ones(()), torch.ones((), dtype=torch.bool)
    lr = float(torch.tensor(h["lr"]))  # representable in fp32, so both forms mean the same number
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        _ours(kind, backend, params, grads, state, step, {**h, "lr": torch.tensor(lr)}, one, yes)
        _ours(kind, backend, twin, grads, twin_state, twin_step, {**h, "lr": lr}, one, yes)
    for a, b in zip(params, twin):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the reference rounds p - g*lr twice


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_sgd_step_after_a_skipped_one_still_starts_the_buffer_from_the_gradient(backend):
    # torch.optim.SGD starts the buffer as a copy of the gradient (no dampening) on the first
    # step it actually takes; a step skipped for overflow does not count.
    p, buf, step = [torch.zeros(4)], [torch.zeros(4)], torch.zeros(())
    g = [torch.full((4,), 2.0)]
    _sgd(backend, p, g, buf, None, step, torch.ones(()), torch.zeros((), dtype=torch.bool), lr=1.0, momentum=0.9,
         dampening=0.5)
    _sgd(backend, p, g, buf, None, step, torch.ones(()), torch.ones((), dtype=torch.bool), lr=1.0, momentum=0.9,
         dampening=0.5)
    assert torch.equal(buf[0], g[0]) and torch.equal(p[0], -g[0]) and float(step) == 1.0


@pytest.mark.skipif("compiled" not in BACKENDS, reason="compiled kernels not built")
def test_compiled_step_refuses_mismatched_lists_naming_the_index_and_writes_nothing():
    params = [torch.ones(3), torch.ones(4)]
    m, v = [torch.zeros(3), torch.zeros(4)], [torch.zeros(3), torch.zeros(5)]
    with pytest.raises(ValueError, match=r"^ampfunc: exp_avg_sqs\[1\] has shape \(5,\) but params\[1\] "
                                         r"has shape \(4,\) \(adam_step_\)$"):
        ops.adam_step_(params, [torch.ones(3), torch.ones(4)], m, v, None, None, torch.zeros(()), torch.ones(()),
                       torch.ones((), dtype=torch.bool), lr=0.1)
    assert all(bool((p == 1).all()) for p in params) and all(bool((x == 0).all()) for x in m)
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.float16"):
        ops.sgd_step_([torch.ones(3, dtype=torch.float16)], [torch.ones(3)], None, None, torch.zeros(()),
                      torch.ones(()), torch.ones((), dtype=torch.bool), lr=0.1)


# ---------------------------------------------------------------------------------------------
# out-of-place optimizer steps
# ---------------------------------------------------------------------------------------------


def _ours_out(kind, backend, params, grads, state, step, h, grad_scale, finite, model=None):
    """The out-of-place step: ``(new_params, new_state, new_model, new_step)``, the in-place
    helpers' layout (``state``: ``[buffers]`` for SGD, ``[m, v, vmax]`` for Adam)."""
    model = model or []
    if kind == "sgd":
        h = {"weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "maximize": False, **h}
        if backend == "reference":
            p, b, m, s = ops._ref_sgd_step(params, grads, state[0], model, step, grad_scale, finite, h["lr"],
                                           h["weight_decay"], h["momentum"], h["dampening"], h["nesterov"],
                                           h["maximize"])
        else:
            p, b, m, s = ops.sgd_step(params, grads, state[0], model, step, grad_scale, finite, **h)
        return p, [b], m, s
    h = dict(h)
    b1, b2 = h.pop("betas", (0.9, 0.999))
    h = {"eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False, **h, "beta1": b1, "beta2": b2,
         "decoupled_weight_decay": kind == "adamw"}
    if backend == "reference":
        p, m1, m2, vmax, m, s = ops._ref_adam_step(
            params, grads, state[0], state[1], state[2] if h["amsgrad"] else [], model, step, grad_scale, finite,
            h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["amsgrad"], h["decoupled_weight_decay"],
            h["maximize"])
    else:
        p, m1, m2, vmax, m, s = ops.adam_step(params, grads, state[0], state[1], state[2], model, step, grad_scale,
                                              finite, **h)
    return p, [m1, m2, vmax if h["amsgrad"] else state[2]], m, s


def _assert_bits_equal(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}[{i}]"
        assert torch.equal(bits(a), bits(e)), f"{what}[{i}]"


def _written_slots(kind, h, state):
    """The state lists a step writes: SGD's buffers with momentum, Adam's m, v (+ vmax)."""
    if kind == "sgd":
        return state[:1] if h.get("momentum", 0) else []
    return state if h.get("amsgrad") else state[:2]


OUT_OF_PLACE = [OPTIMIZERS[1], OPTIMIZERS[3], OPTIMIZERS[7], OPTIMIZERS[8], OPTIMIZERS[9]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,h", OUT_OF_PLACE)
@pytest.mark.parametrize("model_dtype", [None, torch.float16, torch.bfloat16])
def test_out_of_place_step_gives_the_in_place_bits_and_leaves_its_inputs_alone(backend, kind, h, model_dtype):
    # Five steps, the third skipped (an inf in the grads and finite false); grads alternate fp32 and bf16.
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    state, step = _fresh_state(kind, params), torch.zeros(())
    model = [p.to(model_dtype) for p in params] if model_dtype else None
    twin = ([p.clone() for p in params], [[x.clone() for x in lst] for lst in state], step.clone(),
            [m.clone() for m in model] if model else None)
    grad_scale = torch.tensor(0.5)
    for k in range(5):
        grads = [(torch.randn(s, generator=gen) * 2).to(torch.bfloat16 if k % 2 else torch.float32) for s in SHAPES]
        finite = torch.tensor(k != 2)
        if k == 2:
            grads[2][0, 0] = float("inf")
        inputs = params + [x for lst in state for x in lst] + [step] + (model or [])
        saved = [t.clone() for t in inputs]
        new_p, new_state, new_model, new_step = _ours_out(kind, backend, params, grads, state, step, h, grad_scale,
                                                          finite, model)
        _assert_bits_equal(inputs, saved, "inputs")  # nothing given was written
        tp, ts, tstep, tm = twin
        _ours(kind, backend, tp, grads, ts, tstep, h, grad_scale, finite, tm)
        _assert_bits_equal(new_p, tp, "params")
        for a, e in zip(_written_slots(kind, h, new_state), _written_slots(kind, h, ts)):
            _assert_bits_equal(a, e, "state")
        _assert_bits_equal(new_model, tm or [], "model_params")
        assert torch.equal(new_step, tstep) and new_step is not step
        if k == 2:  # skipped: new tensors equal to the inputs, the step count unchanged
            _assert_bits_equal(new_p, params, "skipped params")
            _assert_bits_equal(new_model, model or [], "skipped model_params")
            assert float(new_step) == float(step) == 2.0
            assert all(a is not b for a, b in zip(new_p, params))
        params, step, model = new_p, new_step, (new_model or None)
        state = [lst if i < len(_written_slots(kind, h, state)) else state[i] for i, lst in enumerate(new_state)]
    assert float(step) == 4.0


@pytest.mark.skipif("compiled" not in BACKENDS, reason="compiled kernels not built")
@pytest.mark.parametrize("kind,h,model_dtype", [(*OPTIMIZERS[9], torch.bfloat16), (*OPTIMIZERS[3], torch.float16),
                                                (*OPTIMIZERS[8], None)])
def test_out_of_place_step_of_over_a_million_elements_gives_the_in_place_bits(kind, h, model_dtype):
    # Past 2**20 elements the kernels store new outputs with streaming stores; the thread split
    # puts some segments at unaligned offsets (normal stores there). Same bits either way. One
    # param is a transposed (non-contiguous) view, read through a contiguous copy.
    gen = torch.Generator().manual_seed(5)
    shapes = [(2**20 + 3,), (4097,), (1,), (257, 129)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    params[3] = params[3].t()
    state, step = _fresh_state(kind, params), torch.zeros(())
    model = [p.to(model_dtype) for p in params] if model_dtype else None
    yes = torch.ones((), dtype=torch.bool)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        saved = [t.clone() for t in params + (model or [])]
        new_p, new_state, new_model, new_step = _ours_out(kind, "compiled", params, grads, state, step, h,
                                                          torch.ones(()), yes, model)
        _assert_bits_equal(params + (model or []), saved, "inputs")
        _ours(kind, "compiled", params, grads, state, step, h, torch.ones(()), yes, model)
        _assert_bits_equal(new_p, params, "params")
        for a, e in zip(_written_slots(kind, h, new_state), _written_slots(kind, h, state)):
            _assert_bits_equal(a, e, "state")
        _assert_bits_equal(new_model, model or [], "model_params")
        assert torch.equal(new_step, step)


@pytest.mark.skipif("compiled" not in BACKENDS, reason="compiled kernels not built")
def test_compiled_out_of_place_step_names_the_mismatched_list_and_index():
    params, grads = [torch.ones(3), torch.ones(4)], [torch.ones(3), torch.ones(4)]
    with pytest.raises(ValueError,
                       match=r"ampfunc: exp_avg_sqs\[1\] has shape \(5,\) but params\[1\] .*\(adam_step\)$"):
        ops.adam_step(params, grads, [torch.zeros(3), torch.zeros(4)], [torch.zeros(3), torch.zeros(5)], None, None,
                      torch.zeros(()), torch.ones(()), torch.ones((), dtype=torch.bool), lr=0.1)
    with pytest.raises(TypeError, match=r"ampfunc: momentum_buffers\[0\] has dtype torch.float16.*\(sgd_step\)$"):
        ops.sgd_step(params, grads, [torch.zeros(3, dtype=torch.float16), torch.zeros(4)], None, torch.zeros(()),
                     torch.ones(()), torch.ones((), dtype=torch.bool), lr=0.1, momentum=0.9)


# ---------------------------------------------------------------------------------------------
# loss-scale update
# ---------------------------------------------------------------------------------------------

SCALE_CONFIGS = [
    dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, min_scale=1.0, max_scale=2.0**24, hysteresis=1),
    dict(growth_factor=2.0, backoff_factor=0.25, growth_interval=2, min_scale=0.0, max_scale=float("inf"),
         hysteresis=1),
    dict(growth_factor=3.0, backoff_factor=0.5, growth_interval=1, min_scale=4.0, max_scale=100.0, hysteresis=3),
    dict(growth_factor=1.5, backoff_factor=0.1, growth_interval=5, min_scale=1.0, max_scale=float("inf"),
         hysteresis=2),
]


@pytest.mark.parametrize("config", SCALE_CONFIGS)
@settings(max_examples=20, deadline=None)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=40),
       init=st.sampled_from([1.0, 2.0**16, 3.0e38, 1e-30]))
def test_update_scale_follows_the_reference_rule_step_for_step(config, flags, init):
    scale, tracker, hyst = torch.tensor(init), torch.tensor(0, dtype=torch.int32), torch.tensor(
        config["hysteresis"], dtype=torch.int32)
    ref = (scale.clone(), tracker.clone(), hyst.clone())
    for f in flags:
        finite = torch.tensor(f)
        before = scale.clone()
        new = ops.update_scale(scale, tracker, hyst, finite, **config)
        assert torch.equal(scale, before)  # the pure form leaves its inputs alone
        ops.update_scale_(scale, tracker, hyst, finite, **config)
        ref = ops._ref_update_scale(*ref, finite, **config)
        for a, b, c in zip((scale, tracker, hyst), ref, new):
            assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(c, b)


def test_update_scale_never_grows_past_fp32():
    scale, tracker, hyst = torch.tensor(3.0e38), torch.tensor(0, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
    ops.update_scale_(scale, tracker, hyst, torch.tensor(True), growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=1, min_scale=1.0, max_scale=float("inf"), hysteresis=1)
    assert torch.equal(scale, torch.tensor(3.0e38))
    assert int(tracker) == 0


# ---------------------------------------------------------------------------------------------
# the build's fallback contract
# ---------------------------------------------------------------------------------------------


def test_a_failed_build_falls_back_with_one_warning_or_raises_when_required(monkeypatch):
    from ampfunc import _build

    monkeypatch.setattr(_build, "source_dir", lambda: None)  # as if the sources were not shipped
    monkeypatch.setenv("AMPFUNC_EXT_PREBUILT", "0")  # ... and no library was built into the wheel
    monkeypatch.setattr(_build, "_want_cuda", lambda: False)
    monkeypatch.delenv("AMPFUNC_DISABLE_EXT", raising=False)
    monkeypatch.delenv("AMPFUNC_REQUIRE_EXT", raising=False)
    with pytest.warns(UserWarning, match="plain-torch reference") as record:
        backend, why = _build.load()
    assert backend == "reference" and "not shipped" in why and len(record) == 1
    monkeypatch.setenv("AMPFUNC_REQUIRE_EXT", "1")
    with pytest.raises(RuntimeError, match="AMPFUNC_REQUIRE_EXT=1"):
        _build.load()
    monkeypatch.setenv("AMPFUNC_DISABLE_EXT", "1")
    assert _build.load() == ("reference", "AMPFUNC_DISABLE_EXT is set")


# ---------------------------------------------------------------------------------------------
# check_norm: the robust global norm
# ---------------------------------------------------------------------------------------------


def _same_bits(a, b):
    """Bit for bit, except that any NaN equals any NaN (payloads and signs of NaN are not
    specified by the ops)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point() or a.numel() == 0:
        return torch.equal(a, b)
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    same = a.reshape(-1).view(as_int) == b.reshape(-1).view(as_int)
    return bool((same | (a.reshape(-1).isnan() & b.reshape(-1).isnan())).all())


def _check_norm(backend, tensors, inv=None):
    if backend == "reference":
        return ops._ref_check_norm(tensors, inv)[:2]
    return ops.check_norm(tensors, inv)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(tensors=leaf_lists(), inv_scale=st.sampled_from([None, 1.0, 2.0**-16, 0.37]))
def test_check_norm_is_the_norm_of_the_unscaled_values(backend, tensors, inv_scale):
    inv = None if inv_scale is None else torch.tensor(inv_scale)
    before = [t.clone() for t in tensors]
    finite, norm = _check_norm(backend, tensors, inv)
    want_finite = oracle_check(tensors)[0]
    assert bool(finite) == want_finite and norm.dtype == torch.float32 and norm.shape == ()
    if want_finite:
        us = [t.float() * (inv if inv is not None else 1.0) for t in tensors]
        want = math.sqrt(sum(float(u.double().square().sum()) for u in us))
        assert math.isclose(float(norm), want, rel_tol=2e-6, abs_tol=1e-30)
    assert all(_same_bits(a, b) for a, b in zip(tensors, before))


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_norm_does_not_overflow_while_every_element_is_finite(backend):
    # fp32 gradients of 1e20 under a loss scale of 2**16: the sum of squares leaves fp32's range
    scaled = [torch.full((20,), 1e20) * 2.0**16, torch.full((1 << 20,), 3e19)]
    finite, norm = _check_norm(backend, scaled, torch.tensor(2.0**-16))
    want = math.sqrt(20 * 1e40 + (1 << 20) * (3e19 * 2.0**-16) ** 2)
    assert bool(finite) and math.isclose(float(norm), want, rel_tol=1e-6)
    finite, norm = _check_norm(backend, scaled)  # the sum of squares (~1e50) is far beyond fp32
    assert bool(finite) and math.isfinite(float(norm))
    assert math.isclose(float(norm), math.sqrt(20 * (1e20 * 2.0**16) ** 2 + (1 << 20) * 9e38), rel_tol=1e-6)
    scaled[1][-1] = float("nan")
    assert not bool(_check_norm(backend, scaled, torch.tensor(2.0**-16))[0])


@pytest.mark.skipif("compiled" not in BACKENDS, reason="compiled kernels not built")
@pytest.mark.parametrize("dtype", DTYPES)
def test_check_norm_of_scaled_grads_equals_that_of_the_unscaled_ones_bit_for_bit(dtype):
    # the fused clip (norm of the scaled grads with inv_scale) and the generic one (norm of
    # unscale's output) must agree exactly
    g = torch.Generator().manual_seed(3)
    grads = [(torch.randn(n, generator=g) * 1000).to(dtype) for n in (5, 4096, 70001, 0, 33)]
    for inv in (2.0**-16, 2.0**-3, 1.0):
        inv = torch.tensor(inv)
        unscaled, _ = ops.unscale(grads, inv)
        assert _same_bits(ops.check_norm(grads, inv)[1], ops.check_norm(unscaled)[1])


def test_check_norm_per_leaf_and_empty():
    finite, norm, leaf = ops.check_norm([torch.ones(3), torch.tensor([float("inf")])], per_leaf=True)
    assert not bool(finite) and leaf.tolist() == [False, True]
    finite, norm = ops.check_norm([])
    assert bool(finite) and float(norm) == 0.0


# ---------------------------------------------------------------------------------------------
# pure optimizer updates and apply_updates
# ---------------------------------------------------------------------------------------------

UPDATE_SIZES = [(0,), (1,), (7,), (33, 5), 70001]  # the last crosses CPU tasks (32K) and CUDA chunks (64K)
BIG = (1 << 20) + 3  # the "non_finite" variant: over a million elements, a bad value at the very end


def _update_case(seed, grad_dtype, with_params=True, non_contiguous=False, bad=False, amsgrad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [s if isinstance(s, tuple) else (s,) for s in UPDATE_SIZES[:-1] + [BIG if bad else UPDATE_SIZES[-1]]]
    mk = lambda s, scale=1.0: torch.randn(s, generator=g) * scale  # noqa: E731
    params = [mk(s) for s in shapes]
    grads = [mk(s, 0.1).to(grad_dtype) for s in shapes]
    m = [mk(s, 0.01) for s in shapes]
    v = [mk(s, 0.01).abs() for s in shapes]
    vmax = [x * 1.5 for x in v] if amsgrad else None
    if non_contiguous:  # transposed / strided views with the same shapes
        params[3] = torch.randn(5, 33, generator=g).t()
        grads[3] = (torch.randn(5, 33, generator=g) * 0.1).to(grad_dtype).t()
        m[3] = torch.randn(33, 10, generator=g)[:, ::2] * 0.01
    if bad:
        grads[2][3] = float("nan")
        grads[4][-1] = float("inf")
    return (params if with_params else None), grads, m, v, vmax


def _snapshot(*lists):
    return [[t.clone() for t in (lst or [])] for lst in lists]


def _assert_unchanged(snap, *lists):
    for before, lst in zip(snap, lists):
        assert all(_same_bits(a, b) for a, b in zip(before, lst or []))


SGD_UPDATE_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01),
    dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True),
    dict(lr=torch.tensor(0.05), momentum=0.5, weight_decay=0.1),
]


VARIANTS = ["plain", "no_params", "non_contiguous", "non_finite"]


@pytest.mark.parametrize("k", range(len(SGD_UPDATE_CONFIGS)))
@pytest.mark.parametrize("j", range(len(VARIANTS)))
@pytest.mark.parametrize("first", [True, False])
def test_sgd_update_equals_the_reference_bit_for_bit(k, j, first):
    # every config meets every variant; the gradient dtype cycles through fp32/fp16/bf16
    kw, variant, grad_dtype = SGD_UPDATE_CONFIGS[k], VARIANTS[j], DTYPES[(j + k) % 3]
    if (variant == "no_params" and kw.get("weight_decay")) or (first and not kw.get("momentum")):
        return
    params, grads, bufs, _, _ = _update_case(1, grad_dtype, with_params=variant != "no_params",
                                             non_contiguous=variant == "non_contiguous", bad=variant == "non_finite")
    step = torch.tensor(0.0 if first else 4.0)
    gs = torch.tensor(0.5)
    snap = _snapshot(params, grads, bufs)
    hp = {k: v for k, v in kw.items() if k != "lr"}
    lr, lr_t = ops._split_lr(kw["lr"])
    d, b, s = ops.sgd_update(params, grads, bufs, step, gs, lr=kw["lr"], **hp)
    rd, rb, rs = ops._ref_sgd_update(params or [], grads, bufs, step, gs, lr, lr_t, hp.get("weight_decay", 0.0),
                                     hp.get("momentum", 0.0), hp.get("dampening", 0.0), hp.get("nesterov", False),
                                     hp.get("maximize", False))
    assert len(d) == len(rd) and all(_same_bits(a, c) for a, c in zip(d, rd))
    assert len(b) == len(rb) and all(_same_bits(a, c) for a, c in zip(b, rb))
    assert _same_bits(s, rs) and float(s) == float(step) + 1
    _assert_unchanged(snap, params, grads, bufs)


ADAM_UPDATE_CONFIGS = [
    dict(lr=1e-3),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    dict(lr=1e-2, amsgrad=True, maximize=True, beta1=0.8, beta2=0.99, eps=1e-6),
    dict(lr=torch.tensor(3e-3), weight_decay=0.05, decoupled_weight_decay=True),
]


@pytest.mark.parametrize("k", range(len(ADAM_UPDATE_CONFIGS)))
@pytest.mark.parametrize("j", range(len(VARIANTS)))
def test_adam_update_equals_the_reference(k, j):
    kw, variant, grad_dtype = ADAM_UPDATE_CONFIGS[k], VARIANTS[j], DTYPES[(j + k) % 3]
    if variant == "no_params" and kw.get("weight_decay"):
        return
    amsgrad = kw.get("amsgrad", False)
    params, grads, m, v, vmax = _update_case(2, grad_dtype, with_params=variant != "no_params",
                                             non_contiguous=variant == "non_contiguous", bad=variant == "non_finite",
                                             amsgrad=amsgrad)
    step = torch.tensor(6.0)
    gs = torch.tensor(0.25)
    snap = _snapshot(params, grads, m, v, vmax)
    hp = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
          "decoupled_weight_decay": False, "maximize": False, **{k: x for k, x in kw.items() if k != "lr"}}
    lr, lr_t = ops._split_lr(kw["lr"])
    d, m1, m2, vm, s = ops.adam_update(params, grads, m, v, vmax, step, gs, lr=kw["lr"], **hp)
    rd, rm1, rm2, rvm, rs = ops._ref_adam_update(params or [], grads, m, v, vmax, step, gs, lr, lr_t, hp["beta1"],
                                                 hp["beta2"], hp["eps"], hp["weight_decay"], hp["amsgrad"],
                                                 hp["decoupled_weight_decay"], hp["maximize"])
    # Bit for bit, the updates included: the reference takes the kernel's correctly rounded
    # square root (ops.sqrt_rounded), not torch's CPU sqrt, which is an ulp off for some inputs.
    for got, want in ((d, rd), (m1, rm1), (m2, rm2), (vm, rvm)):
        assert len(got) == len(want) and all(_same_bits(a, c) for a, c in zip(got, want))
    assert _same_bits(s, rs) and float(s) == 7.0
    _assert_unchanged(snap, params, grads, m, v, vmax)


@pytest.mark.parametrize("p_dtype", DTYPES)
@pytest.mark.parametrize("u_dtype", DTYPES)
def test_apply_updates_equals_the_reference_bit_for_bit(p_dtype, u_dtype):
    g = torch.Generator().manual_seed(5)
    shapes = [(0,), (1,), (7,), (33, 5), ((1 << 20) + 3,)]
    params = [torch.randn(s, generator=g).to(p_dtype) for s in shapes]
    updates = [(torch.randn(s, generator=g) * 1e-3).to(u_dtype) for s in shapes]
    params[3] = torch.randn(5, 33, generator=g).to(p_dtype).t()  # non-contiguous
    updates[2][1] = float("nan")
    snap = _snapshot(params, updates)
    out = ops.apply_updates(params, updates)
    want = ops._ref_apply_updates(params, updates)
    assert all(_same_bits(a, c) for a, c in zip(out, want))
    assert all(_same_bits(a, (p.float() + u.float()).to(p_dtype)) for a, p, u in zip(out, params, updates))
    _assert_unchanged(snap, params, updates)


# ---------------------------------------------------------------------------------------------
# validation: both backends refuse the same calls with the same error, before any write
# ---------------------------------------------------------------------------------------------


def _adam_inplace_args(params, grads, m, v):
    return dict(params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v, max_exp_avg_sqs=[], model_params=[],
                step=torch.zeros(()), grad_scale=torch.ones(()), finite=torch.ones((), dtype=torch.bool), lr=0.1,
                lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False,
                decoupled_weight_decay=False, maximize=False)


def _fresh():
    return [torch.ones(3, 4), torch.ones(5)], [torch.ones(3, 4), torch.ones(5)], \
        [torch.zeros(3, 4), torch.zeros(5)], [torch.zeros(3, 4), torch.zeros(5)]


def _bad_adam_cases():
    cases = {}
    p, g, m, v = _fresh()
    cases["shape"] = ("adam_step_", _adam_inplace_args(p, [torch.ones(4, 3), g[1]], m, v), ValueError,
                      r"^ampfunc: grads\[0\] has shape \(4, 3\) but params\[0\] has shape \(3, 4\) \(adam_step_\)$")
    p, g, m, v = _fresh()
    cases["count"] = ("adam_step_", _adam_inplace_args(p, g, m[:1], v), ValueError,
                      r"^ampfunc: exp_avgs has 1 tensors but params has 2 \(adam_step_\)$")
    p, g, m, v = _fresh()
    cases["alias"] = ("adam_step_", _adam_inplace_args([p[0], p[1]], g, [m[0], m[1]], [v[0], m[1]]), ValueError,
                      r"^ampfunc: exp_avgs\[1\] and exp_avg_sqs\[1\] overlap in memory")
    p, g, m, v = _fresh()
    flat = torch.zeros(20)
    cases["overlap"] = ("adam_step_", _adam_inplace_args(p, g, [flat[:12].view(3, 4), flat[8:13]], v), ValueError,
                        r"^ampfunc: exp_avgs\[0\] and exp_avgs\[1\] overlap in memory")
    p, g, m, v = _fresh()
    cases["expanded"] = ("adam_step_", _adam_inplace_args([torch.ones(1, 4).expand(3, 4), p[1]], g, m, v),
                         ValueError, r"^ampfunc: params\[0\] has elements that share memory")
    p, g, m, v = _fresh()
    cases["meta"] = ("adam_step_", _adam_inplace_args(p, [g[0], torch.ones(5, device="meta")], m, v), ValueError,
                     r"^ampfunc: grads\[1\] is on the meta device")
    p, g, m, v = _fresh()
    cases["dtype"] = ("adam_step_", _adam_inplace_args(p, [g[0], torch.ones(5, dtype=torch.float64)], m, v),
                      TypeError, r"^ampfunc: grads\[1\] has dtype torch.float64; grads take float32, float16 or "
                                 r"bfloat16 \(adam_step_\)$")
    p, g, m, v = _fresh()
    cases["sparse"] = ("adam_step_", _adam_inplace_args(p, [g[0], torch.ones(5).to_sparse()], m, v), TypeError,
                       r"^ampfunc: grads\[1\] has layout torch.sparse_coo")
    p, g, m, v = _fresh()
    cases["step_alias"] = ("adam_step_", {**_adam_inplace_args(p, g, m, v), "step": p[1][2]}, ValueError,
                           r"^ampfunc: params\[1\] and step overlap in memory")
    p, g, m, v = _fresh()
    cases["unscale_alias"] = ("unscale_", dict(tensors=[p[0], p[0]], inv_scale=torch.tensor(0.5)), ValueError,
                              r"^ampfunc: tensors\[0\] and tensors\[1\] overlap in memory; .* \(unscale_\)$")
    p, g, m, v = _fresh()
    cols = torch.zeros(6, 2)
    cases["column_twice"] = ("unscale_",
                             dict(tensors=[cols[:, 0], cols[:, 1], cols.t()[0]], inv_scale=torch.tensor(0.5)),
                             ValueError, r"^ampfunc: tensors\[0\] and tensors\[2\] overlap in memory; .* \(unscale_\)$")
    p, g, m, v = _fresh()
    halves = torch.zeros(8)
    cases["strided_bytes"] = ("unscale_", dict(tensors=[halves[1::2], halves.view(torch.float16)[2::4]],
                                               inv_scale=torch.tensor(0.5)), ValueError,
                              r"^ampfunc: tensors\[0\] and tensors\[1\] overlap in memory; .* \(unscale_\)$")
    p, g, m, v = _fresh()
    cases["update_shape"] = ("adam_update", dict(
        params=p, grads=g, exp_avgs=m, exp_avg_sqs=[v[0], torch.zeros(6)], max_exp_avg_sqs=[], step=torch.zeros(()),
        grad_scale=torch.ones(()), lr=0.1, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        amsgrad=False, decoupled_weight_decay=False, maximize=False), ValueError,
        r"^ampfunc: exp_avg_sqs\[1\] has shape \(6,\) but params\[1\] has shape \(5,\) \(adam_update\)$")
    p, g, m, v = _fresh()
    cases["apply_dtype"] = ("apply_updates", dict(params=p, updates=[g[0], torch.ones(5, dtype=torch.int64)]),
                            TypeError, r"^ampfunc: updates\[1\] has dtype torch.int64")
    return cases


@pytest.mark.parametrize("case", sorted(_bad_adam_cases()))
def test_bad_calls_raise_the_same_error_on_both_backends_and_write_nothing(case):
    messages = []
    for backend in BACKENDS:
        name, kwargs, exc, pattern = _bad_adam_cases()[case]
        tensors = [t for v in kwargs.values() for t in (v if isinstance(v, list) else [v])
                   if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.layout == torch.strided]
        snap = [t.clone() for t in tensors]
        fn = getattr(torch.ops.ampfunc, name) if backend == "compiled" else ops._REFERENCE[name]
        with pytest.raises(exc, match=pattern) as info:
            fn(*kwargs.values())
        messages.append(str(info.value))
        assert all(_same_bits(a, b) for a, b in zip(tensors, snap)), "a refused call wrote something"
    assert len(set(messages)) == 1, messages
    assert ops.error_items(messages[0]) or case == "count"


def _validated_unscale_(backend, tensors, inv_scale):
    """unscale_ through the op's validation on either backend (the _ref_ kernel skips it)."""
    fn = ops._REFERENCE["unscale_"] if backend == "reference" else torch.ops.ampfunc.unscale_
    return fn(tensors, inv_scale)


def test_interleaved_views_that_share_no_element_are_written_on_both_backends():
    # torch's in-place ops take the columns of one matrix (and even/odd elements) as separate
    # tensors: their byte spans intersect, their elements do not.
    for backend in BACKENDS:
        cols = torch.arange(1.0, 13.0).view(6, 2)
        evens_odds = torch.arange(1.0, 9.0)
        views = [cols[:, 0], cols[:, 1], evens_odds[0::2], evens_odds[1::2]]
        finite = _validated_unscale_(backend, views, torch.tensor(0.5))
        assert bool(finite)
        assert torch.equal(cols, torch.arange(1.0, 13.0).view(6, 2) * 0.5), backend
        assert torch.equal(evens_odds, torch.arange(1.0, 9.0) * 0.5), backend
        p = torch.ones(4, 2)
        m, v = torch.zeros(4, 2), torch.zeros(4, 2)
        args = _adam_inplace_args([p[:, 0], p[:, 1]], [torch.ones(4), torch.ones(4)], [m[:, 0], m[:, 1]],
                                  [v[:, 0], v[:, 1]])
        fn = torch.ops.ampfunc.adam_step_ if backend == "compiled" else ops._REFERENCE["adam_step_"]
        fn(*args.values())
        assert torch.all(p < 1) and torch.all(m != 0) and torch.all(v != 0), backend


def test_large_interleaved_views_are_decided_from_their_layout_on_both_backends():
    # past 2**22 elements the addresses are not sorted (that took 0.5 s and 0.5 GB for these):
    # views of one shape and strides are compared from their offsets
    for backend in BACKENDS:
        big = torch.ones(2048, 2050)
        left, right = big[:, :1025], big[:, 1025:]
        assert bool(_validated_unscale_(backend, [left, right], torch.tensor(0.5)))
        assert torch.equal(big, torch.full((2048, 2050), 0.5)), backend
        with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] overlap in memory"):
            _validated_unscale_(backend, [big[:, :1025], big[:, 1000:2025]], torch.tensor(0.5))
        assert torch.equal(big, torch.full((2048, 2050), 0.5)), backend  # refused before any write


def test_overlapping_pair_compares_elements_where_spans_interleave():
    x = torch.zeros(8)
    cols = torch.zeros(6, 2)
    assert ops.overlapping_pair([cols[:, 0], cols[:, 1]]) is None
    assert ops.overlapping_pair([x[0::2], x[1::2], x[3:4]]) == (1, 2)
    assert ops.overlapping_pair([x[0::2], x[1:2]]) is None  # a contiguous tensor in the gaps
    assert ops.overlapping_pair([x[:4], x[4:], torch.zeros(0)]) is None
    assert ops.overlapping_pair([x[2:6], x[:3]]) == (0, 1)
    assert ops.overlapping_pair([x.view(torch.float16)[1::4], x[0::2]]) == (0, 1)  # bytes 2-3 of x[0]
    assert ops.overlapping_pair([x.view(torch.float16)[2::4], x[0::2]]) is None


def test_error_items_parses_the_list_names_and_indices():
    msg = "ampfunc: grads[2] has shape (3, 4) but params[2] has shape (4, 3) (adam_step_)"
    assert ops.error_items(msg) == [("grads", 2), ("params", 2)]
    assert ops.error_items("ampfunc: exp_avgs[1] and exp_avg_sqs[7] overlap in memory; ... (adam_step_)") == [
        ("exp_avgs", 1), ("exp_avg_sqs", 7)]
    assert ops.error_items("something else [3]") == []


def test_interleaved_but_disjoint_views_are_accepted_in_place():
    base = torch.ones(20, 10)
    ok = ops.unscale_([base[:, ::3], base[:, 1::3].clone()], torch.tensor(0.5))  # strided, not overlapping
    assert bool(ok) and float(base[0, 0]) == 0.5 and float(base[0, 1]) == 1.0


def test_new_ops_trace_under_torch_compile_fullgraph():
    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(params, grads, m, v, t):
        finite, norm = ops.check_norm(grads, torch.tensor(0.5))
        coef = (1.0 / (norm + 1e-6)).clamp(max=1.0)
        d, m2, v2, _, t2 = ops.adam_update(params, grads, m, v, None, t, coef, lr=1e-3, weight_decay=0.01,
                                           decoupled_weight_decay=True)
        return ops.apply_updates(params, d), m2, v2, t2

    params, grads = [torch.randn(3, 4), torch.randn(5)], [torch.randn(3, 4), torch.randn(5)]
    m, v = [torch.zeros(3, 4), torch.zeros(5)], [torch.zeros(3, 4), torch.zeros(5)]
    new_p, m2, v2, t2 = step(params, grads, m, v, torch.zeros(()))
    _, norm = ops.check_norm(grads, torch.tensor(0.5))
    coef = (1.0 / (norm + 1e-6)).clamp(max=1.0)
    d, wm, wv, _, _ = ops.adam_update(params, grads, m, v, None, torch.zeros(()), coef, lr=1e-3, weight_decay=0.01,
                                      decoupled_weight_decay=True)
    assert all(_same_bits(a, b) for a, b in zip(new_p, ops.apply_updates(params, d)))
    assert float(t2) == 1.0


# ---------------------------------------------------------------------------------------------
# fma_rounded: the fused multiply-add of the SGD update with a tensor learning rate
# ---------------------------------------------------------------------------------------------


def _round_to_fp32(x: Fraction) -> float:
    """``x`` correctly rounded to fp32 (ties to even), by exact comparison with the neighbours."""
    fmax = torch.finfo(torch.float32).max
    r = torch.tensor(max(min(float(x), fmax), -fmax), dtype=torch.float32)  # a finite start
    best = None
    for cand in (torch.nextafter(r, torch.tensor(-math.inf)), r, torch.nextafter(r, torch.tensor(math.inf))):
        c = float(cand)
        # inf stands where 2**128 would be, and counts as even (ties at the boundary go to it)
        dist = abs((Fraction(2 ** 128) * (1 if c > 0 else -1) if math.isinf(c) else Fraction(c)) - x)
        even = math.isinf(c) or (cand.view(torch.int32).item() & 1) == 0
        if best is None or dist < best[0] or (dist == best[0] and even):
            best = (dist, c)
    return best[1]


def test_fma_rounded_is_the_correctly_rounded_a_times_b_plus_c():
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(3000, generator=gen) * torch.exp2(torch.randint(-20, 20, (3000,), generator=gen).float())
    c = torch.randn(3000, generator=gen)
    b = torch.tensor(-0.0371)
    # fp64 lands exactly halfway between two fp32 numbers, the exact value just below (above):
    # rounding the fp64 sum again would go the wrong way (ties to even).
    e = 2.0 ** -23
    a = torch.cat([a, torch.tensor([2.0 ** -12 * (1 + e)] * 2)])
    c = torch.cat([c, torch.tensor([1 + e, -(1 + e)])])
    bs = [b] * 3000 + [torch.tensor(2.0 ** -12 * (1 - e)), torch.tensor(-(2.0 ** -12) * (1 - e))]
    got = torch.cat([ops.fma_rounded([a[i:i + 1]], bs[i], [c[i:i + 1]])[0] for i in range(len(bs))])
    want = [_round_to_fp32(Fraction(float(a[i])) * Fraction(float(bs[i])) + Fraction(float(c[i])))
            for i in range(len(bs))]
    assert got.tolist() == want
    assert want[-2] == 1 + e and want[-1] == -(1 + e)  # the crafted ties
    # the tie at the overflow boundary: just below the midpoint of fp32's max and 2**128
    fmax = torch.finfo(torch.float32).max
    a2, c2 = torch.tensor([(2.0 ** 24 - 2) * 2.0 ** 75]), torch.tensor([fmax])
    b2 = torch.tensor((2.0 ** 24 + 2) * 2.0 ** -20)
    want2 = _round_to_fp32(Fraction(float(a2)) * Fraction(float(b2)) + Fraction(fmax))
    for sign in (1.0, -1.0):
        assert ops.fma_rounded([a2 * sign], b2, [c2 * sign])[0].item() == want2 * sign
    twice = (c + a * b)[:3000]
    assert not torch.equal(twice, got[:3000])  # two roundings differ somewhere: the test can fail


@pytest.mark.skipif("compiled" not in BACKENDS, reason="compiled kernels not built")
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_with_a_tensor_lr_equals_the_reference_bit_for_bit(momentum):
    gen = torch.Generator().manual_seed(7)
    p0, lr = torch.randn(4096, generator=gen), torch.tensor(0.1)
    runs = {}
    for backend in BACKENDS:
        p, buf, step = p0.clone(), torch.zeros(4096), torch.tensor(0.0)
        g2 = torch.Generator().manual_seed(8)
        for _ in range(3):
            g = torch.randn(4096, generator=g2)
            _sgd(backend, [p], [g], [buf] if momentum else [], None, step, torch.tensor(1.0), torch.tensor(True),
                 lr=lr, momentum=momentum)
        runs[backend] = p
    assert _same_bits(runs["compiled"], runs["reference"])


@pytest.mark.parametrize("arg", ["step", "grad_scale", "finite", "lr"])
def test_a_meta_scalar_argument_is_refused_not_a_silent_no_op(arg):
    # One meta argument routes the call to the fake kernel: it must refuse, naming it, instead
    # of returning without a write (in place) or with uninitialized memory (out of place).
    p, g, m, v = [torch.ones(64)], [torch.ones(64)], [torch.zeros(64)], [torch.zeros(64)]
    args = {"step": torch.zeros(()), "grad_scale": torch.ones(()), "finite": torch.ones((), dtype=torch.bool),
            "lr": torch.tensor(0.1)}
    args[arg] = args[arg].to("meta")
    with pytest.raises(ValueError, match=rf"{arg} is on the meta device"):
        ops.adam_step_(p, g, m, v, None, None, args["step"], args["grad_scale"], args["finite"], lr=args["lr"])
    assert torch.equal(p[0], torch.ones(64)) and torch.equal(m[0], torch.zeros(64))
    with pytest.raises(ValueError, match=rf"{arg} is on the meta device"):
        ops.sgd_step(p, g, None, None, args["step"], args["grad_scale"], args["finite"], lr=args["lr"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_finite_fp64_value_beyond_fp32s_range_is_finite_on_both_backends(backend):
    # Judged in the tensor's own dtype: the reference cast its max to fp32 first (inf), so the
    # two backends took different skip decisions.
    t = [torch.tensor([1e300, 1.0], dtype=torch.float64), torch.ones(3)]
    finite, _, leaf = _check(backend, t, per_leaf=True)
    assert bool(finite) and leaf.tolist() == [False, False]
    t[0][1] = float("nan")
    finite, _, leaf = _check(backend, t, per_leaf=True)
    assert not bool(finite) and leaf.tolist() == [True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inference_tensor_to_write_is_refused_before_anything_is_written(backend):
    # torch refuses to update one in place, but only after the tensors before it were written.
    with torch.inference_mode():
        buf = torch.zeros(8)
    p, g = [torch.ones(8), torch.ones(8)], [torch.ones(8), torch.ones(8)]
    step = torch.zeros(())
    with pytest.raises(ValueError, match=r"momentum_buffers\[1\] is an inference tensor"):
        if backend == "reference":  # the validated reference op (what the reference backend registers)
            ops._ref_sgd_step_op(p, g, [torch.zeros(8), buf], [], step, torch.ones(()), torch.tensor(True), 0.1, None,
                                 0.0, 0.9, 0.0, False, False)
        else:
            ops.sgd_step_(p, g, [torch.zeros(8), buf], None, step, torch.ones(()), torch.tensor(True), lr=0.1,
                          momentum=0.9)
    assert all(torch.equal(t, torch.ones(8)) for t in p) and float(step) == 0.0
    with torch.inference_mode():  # inside inference mode, as torch allows it
        q = [torch.ones(8)]
        _sgd(backend, q, [torch.ones(8)], [], None, torch.zeros(()), torch.ones(()), torch.tensor(True), lr=0.5)
    assert torch.equal(q[0], torch.full((8,), 0.5))
