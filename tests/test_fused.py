"""The fused mixed-precision step (ampfunc.fused) through mixed_precision(...).step_ / .step."""

import pytest
import torch

import ampfunc as af
from _helpers import OVERFLOW_STEPS, grads_at, make_params, unregistered
from _tolerance import assert_compiled_close
from ampfunc import ops
from ampfunc.flat import flatten
from ampfunc.fused import FusedPlan, plan_for

_params = make_params
_scaled_grads = grads_at
_generic = unregistered


def test_plan_for_recognises_the_fusable_optimizers_and_nothing_else():
    assert plan_for(af.adamw(1e-3)).kind == "adamw"
    assert plan_for(af.adam(1e-3, amsgrad=True)).hparams["amsgrad"] is True
    assert plan_for(af.sgd(0.1, momentum=0.9)).kind == "sgd"
    p = plan_for(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3)))
    assert isinstance(p, FusedPlan) and p.max_norm == 1.0 and p.kind == "adamw"
    assert plan_for(af.chain(af.adam(1e-3))).kind == "adam"
    assert plan_for(af.from_torch(torch.optim.RMSprop, lr=1e-3)) is None
    assert plan_for(af.adamw(af.optim.linear_schedule(1e-3, 0.0, 100))).kind == "adamw"  # schedules too
    assert plan_for(af.chain(af.adamw(1e-3), af.clip_by_global_norm(1.0))) is None
    assert plan_for(af.chain(af.clip_by_global_norm(1.0), af.clip_by_global_norm(2.0), af.sgd(0.1))) is None
    assert plan_for(af.identity()) is None


@pytest.mark.parametrize("clip", [None, 0.5])
def test_fused_step_tracks_torch_adamw_with_grad_scaler_and_clip_grad_norm(clip):
    params = _params()
    theirs = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.AdamW(theirs.values(), lr=1e-2, weight_decay=0.05, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    inner = af.adamw(1e-2, weight_decay=0.05)
    if clip is not None:
        inner = af.chain(af.clip_by_global_norm(clip), inner)
    tx = af.mixed_precision(inner, af.DynamicLossScale(2.0**10, growth_interval=4, min_scale=0.0,
                                                       max_scale=float("inf")))
    state = tx.init(params)
    for step in range(20):
        scaler.scale(torch.zeros(()))  # the scaler's lazy init; our grads stand in for backward()
        grads = _scaled_grads(step, scaler.get_scale())
        for k, t in theirs.items():
            t.grad = grads[k].clone()
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(theirs.values(), clip)
        scaler.step(opt)
        scaler.update()
        params, state = tx.step_(params, grads, state)
        assert float(af.loss_scale_of(state).loss_scale) == scaler.get_scale()
    assert float(state.inner[-1].step if clip else state.inner.step) == 20 - len(OVERFLOW_STEPS)
    for k in params:
        torch.testing.assert_close(params[k], theirs[k].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inner", [
    lambda: af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2)),
    lambda: af.adam(1e-2, weight_decay=0.01, amsgrad=True),
    lambda: af.sgd(0.05, momentum=0.9, nesterov=True),
    lambda: af.chain(af.clip_by_global_norm(1.0), af.adamw(af.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 4, 12))),
    lambda: af.sgd(af.optim.linear_schedule(0.1, 0.01, 10), momentum=0.5),
])
def test_fused_step_with_master_weights_matches_the_generic_path(param_dtype, inner):
    inner = inner()
    params = _params(param_dtype)
    fused_tx = af.mixed_precision(inner, af.DynamicLossScale(2.0**8, growth_interval=3))
    generic_tx = af.mixed_precision(_generic(inner), af.DynamicLossScale(2.0**8, growth_interval=3))
    assert plan_for(inner) is not None
    fs, gs = fused_tx.init(params), generic_tx.init(params)
    fp, gp = {k: v.clone() for k, v in params.items()}, {k: v.clone() for k, v in params.items()}
    for step in range(12):
        grads = _scaled_grads(step, af.loss_scale_of(fs).loss_scale, param_dtype)
        fp, fs = fused_tx.step_(fp, grads, fs)
        gp, gs = generic_tx.step(gp, grads, gs)
        assert torch.equal(af.loss_scale_of(fs).loss_scale, af.loss_scale_of(gs).loss_scale)
    for k in params:
        assert fp[k].dtype == param_dtype
        assert torch.equal(fp[k], fs.master[k].to(param_dtype))  # the model copy is the master, rounded once
        torch.testing.assert_close(fs.master[k], gs.master[k], rtol=1e-5, atol=1e-6)


def test_skipped_fused_step_leaves_params_master_moments_and_step_bit_identical():
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2)), af.DynamicLossScale(2.0**8))
    params = _params(torch.float16)
    state = tx.init(params)
    for step in range(2):
        params, state = tx.step_(params, _scaled_grads(step, 2.0**8, torch.float16), state)
    before = [t.clone() for t in af.tree.tree_leaves((params, state.master, state.inner))]
    scale_before = af.loss_scale_of(state).loss_scale.clone()
    params, state = tx.step_(params, _scaled_grads(3, 2.0**8, torch.float16), state)  # holds an inf
    after = af.tree.tree_leaves((params, state.master, state.inner))
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert float(af.loss_scale_of(state).loss_scale) == float(scale_before) / 2


def test_pure_step_gives_the_in_place_numbers_bit_for_bit_and_leaves_its_inputs_alone():
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(0.3), af.adamw(1e-2)), af.DynamicLossScale(2.0**8))
    params = _params(torch.bfloat16)
    state = tx.init(params)
    grads = _scaled_grads(0, 2.0**8, torch.bfloat16)
    snapshot = [t.clone() for t in af.tree.tree_leaves((params, state))]
    new_params, new_state = tx.step(params, grads, state)
    assert all(torch.equal(a, b) for a, b in zip(af.tree.tree_leaves((params, state)), snapshot))
    p2, s2 = tx.step_(params, grads, state)
    assert p2 is params
    for a, b in zip(af.tree.tree_leaves((new_params, new_state)), af.tree.tree_leaves((p2, s2))):
        assert torch.equal(a, b)


def test_the_engine_takes_the_generic_path_for_states_and_dtypes_the_kernels_cannot_run(monkeypatch):
    calls = []
    for name in ("adam_step", "adam_step_checked"):  # the pure step's out-of-place kernel, checked or not
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, **k: (calls.append(1), _r(*a, **k))[1])
    params = _params()
    tx = af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale())
    tx.step(params, _scaled_grads(0, 2.0**16), tx.init(params))
    assert len(calls) >= 1  # adam_step_checked (the reference composes it of check and adam_step)
    # a state of another optimizer's layout is refused by the inner update, not run by the kernel
    with pytest.raises(TypeError, match="AdamState"):
        tx.step(params, _scaled_grads(0, 2.0**16), af.mixed_precision(af.sgd(0.1), af.DynamicLossScale()).init(params))
    # fp64 params keep fp64 (no narrower master) and take the generic path
    f64 = {k: v.double() for k, v in params.items()}
    state = tx.init(f64)
    assert state.master is None
    calls.clear()
    new, _ = tx.step(f64, _scaled_grads(0, 2.0**16), state)
    assert not calls and new["enc.w"].dtype == torch.float64
    # fp64 gradients of fp32 params: the generic path too, the same numbers as an unregistered adamw
    g64 = {k: v.double() for k, v in _scaled_grads(0, 2.0**16).items()}
    a, _ = tx.step(params, g64, tx.init(params))
    g = af.mixed_precision(_generic(af.adamw(1e-3)), af.DynamicLossScale())
    b, _ = g.step(params, g64, g.init(params))
    assert not calls and all(torch.equal(a[k], b[k]) for k in a)


def test_fused_path_on_flat_buffers_equals_the_per_leaf_path():
    params = _params()
    flat = flatten(params)
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2)), af.StaticLossScale(4.0))
    s_leaf, s_flat = tx.init(params), tx.init(flat.buffers)
    p_leaf, p_flat = params, flat.buffers
    for step in range(3):
        grads = _scaled_grads(step + 20, 4.0)
        p_leaf, s_leaf = tx.step_(p_leaf, grads, s_leaf)
        p_flat, s_flat = tx.step_(p_flat, flat.flatten_like(grads), s_flat)
    for k, v in flat.tree.items():
        torch.testing.assert_close(v, p_leaf[k], rtol=1e-6, atol=1e-7)


def test_mixed_precision_takes_the_fused_path_for_native_optimizers_only(monkeypatch):
    calls = []
    real = ops.adam_step_checked_  # the in-place step that takes its own skip decision
    monkeypatch.setattr(ops, "adam_step_checked_", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    params = _params(torch.float16)
    for inner, fused in [(af.adamw(1e-3), True), (af.from_torch(torch.optim.AdamW, lr=1e-3), False)]:
        calls.clear()
        tx = af.mixed_precision(inner, af.DynamicLossScale())
        state = tx.init(params)
        tx.step_({k: v.clone() for k, v in params.items()}, _scaled_grads(0, 1.0, torch.float16), state)
        assert len(calls) == (1 if fused else 0)


PURE_CASES = [
    lambda: af.sgd(0.05, momentum=0.9, weight_decay=0.01),
    lambda: af.sgd(0.05, momentum=0.9, nesterov=True),
    lambda: af.sgd(0.05),
    lambda: af.adam(1e-2, weight_decay=0.01, amsgrad=True),
    lambda: af.chain(af.clip_by_global_norm(0.5), af.adamw(1e-2, weight_decay=0.05)),
    lambda: af.adamw(af.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10), amsgrad=True),
]


def _nested(tree):
    """The same leaves in a tree that is not one flat dict (optree's order, not dict order)."""
    return {"enc": {"w": tree["enc.w"], "b": tree["enc.b"]}, "rest": [tree["head.w"], tree["tiny"]]}


@pytest.mark.parametrize("layout", ["dict", "nested"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inner", PURE_CASES)
def test_pure_step_equals_the_in_place_step_bit_for_bit_over_steps_with_a_skip(inner, param_dtype, layout):
    tx = af.mixed_precision(inner(), af.DynamicLossScale(2.0**8, growth_interval=2))
    shape = (lambda t: t) if layout == "dict" else _nested
    pure_p = shape(_params(param_dtype))
    pure_s = tx.init(pure_p)
    inplace_p, inplace_s = af.tree.tree_map(torch.clone, pure_p), af.tree.tree_map(torch.clone, pure_s)
    for step in range(5):  # OVERFLOW_STEPS holds 3: that step is skipped
        grads = shape(_scaled_grads(step, af.loss_scale_of(pure_s).loss_scale, param_dtype))
        inputs = af.tree.tree_leaves((pure_p, pure_s))
        snapshot = [t.clone() for t in inputs]
        new_p, new_s = tx.step(pure_p, grads, pure_s)
        assert all(torch.equal(a, b) for a, b in zip(inputs, snapshot))  # the inputs are untouched
        inplace_p, inplace_s = tx.step_(inplace_p, grads, inplace_s)
        assert af.tree.tree_structure((new_p, new_s)) == af.tree.tree_structure((inplace_p, inplace_s))
        # the caller's key order, not a sorted one
        assert list(new_p) == list(pure_p) and (layout == "dict" or list(new_p["enc"]) == ["w", "b"])
        for a, b in zip(af.tree.tree_leaves((new_p, new_s)), af.tree.tree_leaves((inplace_p, inplace_s))):
            assert a.dtype == b.dtype and torch.equal(a, b)
        new_leaves = af.tree.tree_leaves((new_p, new_s))
        assert not {id(t) for t in new_leaves} & {id(t) for t in inputs}  # new tensors throughout
        if step in OVERFLOW_STEPS:  # skipped: params, master and optimizer state equal the inputs
            for a, b in zip(af.tree.tree_leaves((new_p, new_s.master, new_s.inner)),
                            af.tree.tree_leaves((pure_p, pure_s.master, pure_s.inner))):
                assert torch.equal(a, b)
            assert float(af.loss_scale_of(new_s).loss_scale) == float(af.loss_scale_of(pure_s).loss_scale) / 2
        pure_p, pure_s = new_p, new_s
    opt = pure_s.inner[-1] if type(pure_s.inner) is tuple else pure_s.inner  # a chain: the last state
    assert float(opt.step) == 4.0


def test_pure_step_and_update_take_the_out_of_place_kernel_and_never_the_in_place_one(monkeypatch):
    calls = []
    for name in ("adam_step", "adam_step_", "adam_step_checked"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    tx = af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale())
    params = _params(torch.bfloat16)
    state = tx.init(params)
    tx.step(params, _scaled_grads(0, 2.0**16, torch.bfloat16), state)
    tx.update(_scaled_grads(0, 2.0**16, torch.bfloat16), state, params)
    # without clipping the pure step folds its check into the pass (adam_step_checked; the
    # reference backend composes it of check and adam_step)
    assert calls.count("adam_step_checked") == 2 and "adam_step_" not in calls


@pytest.mark.slow
def test_compiled_fullgraph_pure_step_equals_eager_including_a_skipped_one():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2, weight_decay=0.01)),
                            af.DynamicLossScale(2.0**8, growth_interval=2))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(tx.step, fullgraph=True, backend=counter)  # a graph break raises
    eager_p = compiled_p = _params(torch.float16)
    eager_s = compiled_s = tx.init(eager_p)
    for step in range(5):  # step 3 overflows
        grads = _scaled_grads(step, 2.0**8, torch.float16)
        eager_p, eager_s = tx.step(eager_p, grads, eager_s)
        compiled_p, compiled_s = compiled(compiled_p, grads, compiled_s)
        # Inductor's generated glue (clip coefficient, scale reciprocal) may round one ulp off
        # eager on another CPU: a tolerance, not bits (tests/_tolerance.py says why).
        for a, b in zip(af.tree.tree_leaves((eager_p, eager_s)), af.tree.tree_leaves((compiled_p, compiled_s))):
            assert_compiled_close(b, a)
    assert counter.frame_count == 1  # one graph; the changing scale and step count never recompile
    assert float(compiled_s.inner[-1].step) == 4.0
