"""Native optimizers (af.sgd, af.adam, af.adamw) against torch.optim on the same trajectory."""

import io
import re

import pytest
import torch

import ampfunc as af
from _trajectory import Trajectory, assert_rel_close
from ampfunc.tree import select_tree, tree_leaves, tree_structure

STEPS = 50


def make_params():
    g = torch.Generator().manual_seed(0)
    return {"layer": {"weight": torch.randn(6, 4, generator=g), "bias": torch.randn(6, generator=g)},
            "head": [torch.randn(3, 6, generator=g)]}


_TRAJECTORY = Trajectory(seed=1000, pull=0.5, steps=STEPS)
grads_at, run_native, run_torch = _TRAJECTORY.grads_at, _TRAJECTORY.run_pure, _TRAJECTORY.run_torch


SGD_CONFIGS = [
    dict(lr=0.05),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.8, weight_decay=0.1),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True),
]
ADAM_CONFIGS = [
    dict(),
    dict(lr=0.01, b1=0.8, b2=0.99, eps=1e-6),
    dict(lr=0.01, weight_decay=0.1),
    dict(lr=0.01, amsgrad=True),
    dict(lr=0.01, weight_decay=0.05, amsgrad=True, maximize=True),
]


def torch_kw(kw):
    """ampfunc's optax-style ``b1, b2`` as torch.optim's ``betas`` pair."""
    kw = dict(kw)
    if "b1" in kw or "b2" in kw:
        kw["betas"] = (kw.pop("b1", 0.9), kw.pop("b2", 0.999))
    return kw


@pytest.mark.parametrize("kw", SGD_CONFIGS, ids=str)
def test_sgd_matches_torch_sgd_over_50_steps(kw):
    params = make_params()
    ours, state = run_native(af.sgd(**kw), params)
    theirs, opt = run_torch(torch.optim.SGD, params, **kw)
    assert_rel_close(ours, theirs, initial=params)
    if kw.get("momentum", 0):
        bufs = [opt.state[p]["momentum_buffer"] for p in tree_leaves(theirs)]
        assert_rel_close(tree_leaves(state.momentum_buffer), bufs)
    assert state.step.item() == STEPS


@pytest.mark.parametrize("kw", ADAM_CONFIGS, ids=str)
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_and_adamw_match_torch_over_50_steps(name, kw):
    params = make_params()
    tx = getattr(af, name)(**kw)
    ours, state = run_native(tx, params)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    theirs, opt = run_torch(cls, params, **torch_kw(kw))
    assert_rel_close(ours, theirs, initial=params)
    leaves = tree_leaves(theirs)
    assert_rel_close(tree_leaves(state.exp_avg), [opt.state[p]["exp_avg"] for p in leaves])
    assert_rel_close(tree_leaves(state.exp_avg_sq), [opt.state[p]["exp_avg_sq"] for p in leaves])
    if kw.get("amsgrad"):
        assert_rel_close(tree_leaves(state.max_exp_avg_sq), [opt.state[p]["max_exp_avg_sq"] for p in leaves])


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(tree_leaves(a), tree_leaves(b)))


@pytest.mark.parametrize("name, kw", [("sgd", kw) for kw in SGD_CONFIGS] + [("adam", kw) for kw in ADAM_CONFIGS]
                         + [("adamw", dict(lr=0.01, weight_decay=0.1))], ids=str)
def test_fp64_params_are_trained_in_fp64_like_torch(name, kw):
    params = af.tree.tree_map(lambda p: p.double(), make_params())
    tx = getattr(af, name)(**kw)
    ours, state = run_native(tx, params, steps=10)
    theirs, _ = run_torch({"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name],
                          params, steps=10, **torch_kw(kw))
    assert all(t.dtype == torch.float64 for t in tree_leaves((ours, state.exp_avg if name != "sgd" else ())))
    # fp32 arithmetic was ~1e-7 off here; fp64's is at the last bits of the fp64 values
    assert _max_diff(ours, theirs) < 1e-13


@pytest.mark.parametrize("loss_scale", [af.NoOpLossScale(), af.DynamicLossScale()], ids=["noop", "dynamic"])
def test_mixed_precision_keeps_fp64_grads_and_params_in_fp64(loss_scale):
    params = af.tree.tree_map(lambda p: p.double(), make_params())
    tx = af.mixed_precision(af.adam(1e-2), loss_scale)
    state, ours = tx.init(params), params
    for k in range(5):
        scale = state.loss_scale.loss_scale.double()
        ours, state = tx.step(ours, af.tree.tree_map(lambda g: g * scale, _TRAJECTORY.grads_at(ours, k)), state)
    theirs, _ = run_torch(torch.optim.Adam, params, steps=5, lr=1e-2)
    assert state.master is None and _max_diff(ours, theirs) < 1e-13
    grads, finite = af.unscale_and_check({"w": torch.ones(3, dtype=torch.float64) * 2.0 ** 16},
                                         af.DynamicLossScale())
    assert grads["w"].dtype == torch.float64 and bool(finite)


def test_fp64_params_keep_fp64_through_mixed_precision_update_and_accumulate():
    params = af.tree.tree_map(lambda p: p.double(), make_params())
    grads = _TRAJECTORY.grads_at(params, 0)
    mp = af.mixed_precision(af.sgd(1e-2, momentum=0.9), af.DynamicLossScale())
    new, _ = mp.step(params, grads, mp.init(params))
    updates, _ = mp.update(grads, mp.init(params), params)
    assert all(u.dtype == torch.float64 for u in tree_leaves(updates))
    assert _max_diff(af.apply_updates(params, updates), new) < 1e-15  # fp32 deltas were ~1e-7 off
    acc = af.accumulate(af.sgd(1.0), 1)
    state = acc.init(params)
    assert all(t.dtype == torch.float64 for t in tree_leaves(state.grad_sum))
    u_acc, _ = acc.update(grads, state, params)
    u_sgd, _ = af.sgd(1.0).update(grads, af.sgd(1.0).init(params), params)
    assert _max_diff(u_acc, u_sgd) == 0.0


def test_adamw_defaults_are_torchs():
    params = make_params()
    assert_rel_close(run_native(af.adamw(), params)[0], run_torch(torch.optim.AdamW, params)[0], initial=params)
    assert af.adamw().fused.hparams["weight_decay"] == 1e-2
    assert af.adam().fused.hparams["weight_decay"] == 0.0


def test_sgd_first_step_starts_the_buffer_at_the_gradient_like_torch():
    params = make_params()
    tx = af.sgd(lr=0.1, momentum=0.9, dampening=0.5)
    grads = grads_at(params, 0)
    _, state = tx.update(grads, tx.init(params), params)
    for buf, g in zip(tree_leaves(state.momentum_buffer), tree_leaves(grads)):
        assert torch.equal(buf, g)  # not (1 - dampening) * g


def test_schedule_lr_matches_torch_with_the_lr_set_each_step():
    params = make_params()
    sched = af.optim.linear_schedule(0.1, 0.01, transition_steps=30)
    for name, cls, kw in [("sgd", torch.optim.SGD, dict(momentum=0.9)), ("adamw", torch.optim.AdamW, dict())]:
        ours, _ = run_native(getattr(af, name)(lr=sched, **kw), params)
        theirs, _ = run_torch(cls, params, lr=0.1, lr_at=lambda k: float(sched(torch.tensor(float(k)))), **kw)
        assert_rel_close(ours, theirs, initial=params)


def test_state_layouts_are_the_documented_named_tuples():
    params = make_params()
    s = af.sgd(0.1).init(params)
    assert isinstance(s, af.optim.SgdState) and s.momentum_buffer is None
    assert s.step.dtype == torch.float32 and s.step.shape == ()
    s = af.sgd(0.1, momentum=0.9).init(params)
    assert tree_structure(s.momentum_buffer) == tree_structure(params)
    a = af.adam(amsgrad=True).init(params)
    assert isinstance(a, af.optim.AdamState) and a._fields == ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert all(x.dtype == torch.float32 for x in tree_leaves(a))
    assert af.adam().init(params).max_exp_avg_sq is None


def test_fused_spec_names_the_kind_and_the_constructor_arguments():
    assert af.sgd(0.1, momentum=0.9).fused == af.transform.FusedSpec("sgd", dict(lr=0.1, momentum=0.9, dampening=0.0,
                                                                        weight_decay=0.0, nesterov=False,
                                                                        maximize=False))
    spec = af.adamw(2e-3, amsgrad=True).fused
    assert spec.kind == "adamw" and spec.hparams["lr"] == 2e-3 and spec.hparams["amsgrad"] is True
    assert spec.hparams["betas"] == (0.9, 0.999) and spec.hparams["eps"] == 1e-8
    assert af.adam().fused.kind == "adam"


def test_update_never_mutates_its_inputs():
    params = make_params()
    for tx in [af.sgd(0.1, momentum=0.9, weight_decay=0.1), af.adamw(amsgrad=True)]:
        state = tx.update(grads_at(params, 0), tx.init(params), params)[1]
        grads = grads_at(params, 1)
        before = [x.clone() for x in tree_leaves((params, grads, state))]
        tx.update(grads, state, params)
        assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves((params, grads, state))))


def test_low_precision_grads_and_params_are_updated_in_fp32():
    params = make_params()
    tx = af.adam(lr=0.01)
    half = af.tree.tree_cast(params, torch.bfloat16)
    grads = grads_at(params, 0)
    updates, state = tx.update(af.tree.tree_cast(grads, torch.float16), tx.init(half), half)
    assert all(u.dtype == torch.float32 for u in tree_leaves(updates))
    assert all(m.dtype == torch.float32 for m in tree_leaves(state.exp_avg))
    new = af.apply_updates(half, updates)
    assert all(p.dtype == torch.bfloat16 for p in tree_leaves(new))


def test_skipped_step_leaves_state_bit_identical():
    params = make_params()
    tx = af.adam(lr=af.optim.cosine_decay_schedule(0.01, 100))
    state = tx.update(grads_at(params, 0), tx.init(params), params)[1]
    _, new = tx.update(grads_at(params, 1), state, params)
    kept = select_tree(torch.tensor(False), new, state)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(kept), tree_leaves(state)))


def test_state_survives_torch_save_and_resumes_bit_identically():
    params = make_params()
    tx = af.adamw(lr=0.01, amsgrad=True)
    p, state = run_native(tx, params, steps=5)
    buf = io.BytesIO()
    torch.save((p, state), buf)
    buf.seek(0)
    p2, state2 = torch.load(buf)
    for k in range(5, 10):
        u, state = tx.update(grads_at(p, k), state, p)
        p = af.apply_updates(p, u)
        u2, state2 = tx.update(grads_at(p2, k), state2, p2)
        p2 = af.apply_updates(p2, u2)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p, state)), tree_leaves((p2, state2))))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, setting", [
    (lambda: af.sgd(lr=-0.1), "learning rate"),
    (lambda: af.sgd(lr=0.1, momentum=-0.5), "momentum"),
    (lambda: af.sgd(lr=0.1, weight_decay=-1.0), "weight_decay"),
    (lambda: af.sgd(lr=0.1, nesterov=True), "Nesterov"),
    (lambda: af.sgd(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
    (lambda: af.adam(lr=-1e-3), "learning rate"),
    (lambda: af.adam(b1=1.0), r"adam: b1 must be in \[0, 1\) \(torch's betas\[0\]\), got 1.0"),
    (lambda: af.adamw(b2=-0.1), r"adamw: b2 must be in \[0, 1\) \(torch's betas\[1\]\), got -0.1"),
    (lambda: af.adamw(b2=float("nan")), "adamw: b2 must be in"),
    (lambda: af.adam(eps=-1e-8), "epsilon"),
    (lambda: af.adamw(weight_decay=-0.1), "weight_decay"),
])
def test_invalid_hyper_parameters_raise_value_error_naming_the_setting(make, setting):
    with pytest.raises(ValueError, match=setting):
        make()


def test_mismatched_trees_name_the_leaf_path():
    params = make_params()
    for tx in [af.sgd(0.1, momentum=0.9), af.adam()]:
        state = tx.init(params)
        grads = grads_at(params, 0)
        del grads["layer"]["bias"]
        with pytest.raises(ValueError, match="layer.bias"):
            tx.update(grads, state, params)
        other = {"layer": params["layer"], "head": [params["head"][0], params["head"][0]]}
        with pytest.raises(ValueError, match="head.1"):
            tx.update(grads_at(other, 0), state, other)


def test_shape_mismatch_names_the_leaf_path():
    params = make_params()
    tx = af.adam()
    grads = grads_at(params, 0)
    grads["head"][0] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="head.0"):
        tx.update(grads, tx.init(params), params)


def test_non_float_leaf_names_path_and_dtype():
    params = make_params()
    tx = af.sgd(0.1, momentum=0.9)
    state = tx.init(params)
    grads = grads_at(params, 0)
    grads["layer"]["weight"] = grads["layer"]["weight"].to(torch.int64)
    with pytest.raises(TypeError, match=r"layer\.weight.*int64"):
        tx.update(grads, state, params)
    bad = dict(params, step=torch.tensor(3))
    with pytest.raises(TypeError, match=r"step.*int64"):
        af.adam().init(bad)


def test_weight_decay_without_params_is_refused_and_state_kind_is_checked():
    params = make_params()
    tx = af.adamw()
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads_at(params, 0), tx.init(params))
    with pytest.raises(TypeError, match="AdamState"):
        tx.update(grads_at(params, 0), af.sgd(0.1).init(params), params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, cls, kw", [
    ("sgd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("adam", torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    ("adamw", torch.optim.AdamW, dict(lr=0.01)),
])
def test_native_optimizers_match_torchs_default_cuda_path(name, cls, kw):
    """On CUDA torch defaults to its foreach kernels; the contract (1e-6 relative) still holds."""
    params = af.tree.tree_map(lambda p: p.cuda(), make_params())
    tx = getattr(af, name)(**kw)
    state = tx.init(params)
    assert state.step.device.type == "cuda"
    ours, theirs = _TRAJECTORY.run_both_on("cuda", tx, cls, params, state=state, **kw)
    assert_rel_close(ours, theirs, initial=params)


# ---------------------------------------------------------------------------------------------
# the pure update on the fused kernel (ops.sgd_update / adam_update, ops.apply_updates) against
# the generic path (the same transform with the kernels switched off)
# ---------------------------------------------------------------------------------------------

from ampfunc import ops  # noqa: E402


def _trajectory(tx, params, steps=6, fused=True, monkeypatch=None):
    if not fused:
        monkeypatch.setattr(ops, "kernel_ready", lambda *a, **k: False)
    state = tx.init(params)
    for i in range(steps):
        updates, state = tx.update(grads_at(params, i), state, params)
        params = af.apply_updates(params, updates)
    if not fused:
        monkeypatch.undo()
    return params, state, updates


def _leaves(tree):
    return [x for x in tree_leaves(tree) if x is not None]


def _bitwise(a, b):
    return all(x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.int32), y.view(-1).view(torch.int32))
               for x, y in zip(_leaves(a), _leaves(b)))


@pytest.mark.parametrize("kw", SGD_CONFIGS + [dict(lr=lambda c: 0.1 / (c + 1), momentum=0.9, dampening=0.1)], ids=str)
def test_pure_sgd_update_on_the_kernel_equals_the_generic_path_bit_for_bit(kw, monkeypatch):
    params = make_params()
    fused = _trajectory(af.sgd(**kw), params)
    generic = _trajectory(af.sgd(**kw), params, fused=False, monkeypatch=monkeypatch)
    assert _bitwise(fused, generic)


@pytest.mark.parametrize("kw", ADAM_CONFIGS + [dict(lr=lambda c: 1e-3 * (c + 1), weight_decay=0.1)], ids=str)
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_pure_adam_update_on_the_kernel_equals_the_generic_path(name, kw, monkeypatch):
    # Bit for bit: both take a correctly rounded square root (see the test below).
    params = make_params()
    fused = _trajectory(getattr(af, name)(**kw), params)
    generic = _trajectory(getattr(af, name)(**kw), params, fused=False, monkeypatch=monkeypatch)
    assert _bitwise(fused, generic)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_generic_adam_update_takes_the_kernels_correctly_rounded_sqrt(amsgrad, monkeypatch):
    # torch's CPU sqrt (MKL's vector sqrt) is an ulp off for some fp32 inputs (0.7% of them on
    # an AVX-512 CPU); the kernel's is correctly rounded. The generic update (what a compiled
    # graph or an unusual tree runs) must give the kernel's numbers on every element, so that
    # the path taken never shows in the results.
    # The updates are compared, not only the params: p + update absorbs an ulp of an update
    # that is a thousandth of p.
    gen = torch.Generator().manual_seed(7)
    params = {"w": torch.randn(64, 64, generator=gen) * 1e-3, "b": torch.zeros(96)}
    tx = af.adamw(1e-3, amsgrad=amsgrad)

    def run(fused):
        if not fused:
            monkeypatch.setattr(ops, "kernel_ready", lambda *a, **k: False)
        p, state, trace = params, tx.init(params), []
        for i in range(3):
            grads = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) * 1e-3 for k, v in p.items()}
            updates, state = tx.update(grads, state, p)
            p = af.apply_updates(p, updates)
            trace.append(updates)
        monkeypatch.undo()
        return p, state, trace

    assert _bitwise(run(True), run(False))


def test_pure_update_reads_its_inputs_only_and_runs_the_kernel(monkeypatch):
    params = make_params()
    tx = af.adamw(1e-2)
    state = tx.init(params)
    grads = grads_at(params, 0)
    snapshot = [x.clone() for x in _leaves((params, state, grads))]
    calls = []
    real = ops.adam_update
    monkeypatch.setattr(ops, "adam_update", lambda *a, **k: calls.append(1) or real(*a, **k))
    updates, new_state = tx.update(grads, state, params)
    new_params = af.apply_updates(params, updates)
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(_leaves((params, state, grads)), snapshot))
    assert not any(x.data_ptr() == y.data_ptr() for x in _leaves(new_params) for y in _leaves(params))
    assert float(new_state.step) == 1.0


def test_unsupported_trees_keep_the_generic_path():
    # fp16 params, fp64 grads, and a 0-d python scalar leaf all still work (generic path)
    params = {"a": torch.randn(4, dtype=torch.float16), "b": torch.randn(3)}
    tx = af.sgd(0.1, momentum=0.9)
    updates, state = tx.update({"a": torch.ones(4, dtype=torch.float16), "b": torch.ones(3, dtype=torch.float64)},
                               tx.init(params), params)
    new = af.apply_updates(params, updates)
    assert new["a"].dtype == torch.float16 and new["b"].dtype == torch.float32
    assert torch.allclose(new["b"], params["b"] - 0.1)


def test_pure_update_shape_errors_name_the_leaf_path():
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    tx = af.adamw(1e-3)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"'w'"):
        tx.update({"w": torch.randn(4, 3), "b": torch.randn(4)}, state, params)


def test_apply_updates_broadcasting_and_mixed_dtypes_keep_todays_results():
    params = {"a": torch.randn(3), "b": torch.randn(2, dtype=torch.bfloat16), "c": torch.randn(2, dtype=torch.float64)}
    updates = {"a": torch.tensor(0.5), "b": torch.ones(2), "c": torch.ones(2, dtype=torch.float64)}
    new = af.apply_updates(params, updates)
    assert torch.equal(new["a"], params["a"] + 0.5)
    assert torch.equal(new["b"], (params["b"].float() + 1).to(torch.bfloat16))
    assert torch.equal(new["c"], params["c"] + 1)


# ---------------------------------------------------------------------------------------------
# flags and betas refused naming the argument (a truthy string is not taken for True)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, name", [
    (lambda v: af.adamw(amsgrad=v), "amsgrad"),
    (lambda v: af.adamw(maximize=v), "maximize"),
    (lambda v: af.adam(amsgrad=v), "amsgrad"),
    (lambda v: af.adam(maximize=v), "maximize"),
    (lambda v: af.sgd(0.1, momentum=0.9, nesterov=v), "nesterov"),
    (lambda v: af.sgd(0.1, maximize=v), "maximize"),
])
@pytest.mark.parametrize("value", ["yes", "False", 1, 0, None])
def test_optimizer_flags_must_be_bools(make, name, value):
    with pytest.raises(TypeError, match=rf"{name} must be a bool \(True or False\), got {type(value).__name__}"):
        make(value)


def test_has_aux_must_be_a_bool():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="make_train_step: has_aux must be a bool"):
        af.make_train_step(model, lambda out, y: ((out - y) ** 2).mean(), af.adamw(), has_aux="yes")
    with pytest.raises(TypeError, match="value_and_grad: has_aux must be a bool"):
        af.value_and_grad(lambda p: p.sum(), has_aux=1)


@pytest.mark.parametrize("name", ["flat", "set_grads_to_none"])
@pytest.mark.parametrize("value", ["False", 0, None])
def test_module_trainer_flags_must_be_bools(name, value):
    # flat="False" would pack the params into flat buffers; set_grads_to_none=0 would keep grads
    with pytest.raises(TypeError, match=rf"ModuleTrainer: {name} must be a bool \(True or False\)"):
        af.ModuleTrainer(torch.nn.Linear(2, 1), af.adamw(), **{name: value})


@pytest.mark.parametrize("make, message", [
    (lambda: af.adamw(1e-3, (0.9, 0.999)), r"adamw: b1 must be a float in \[0, 1\), got the tuple \(0.9, 0.999\); "
                                            r"torch's betas=\(beta1, beta2\) is two arguments here, b1 and b2"),
    (lambda: af.adam(b1=[0.9, 0.999]), r"adam: b1 must be a float in \[0, 1\), got the list .*b1 and b2"),
    (lambda: af.adamw(b2=(0.9, 0.999)), r"adamw: b2 must be a float .*b1 and b2"),
    (lambda: af.adamw(b1="0.9"), r"adamw: b1 must be a float in \[0, 1\), got str '0.9'"),
    (lambda: af.adamw(b1=torch.tensor(0.9)), r"adamw: b1 must be a Python float, not a tensor"),
    (lambda: af.adam(b2=True), r"adam: b2 must be a float in \[0, 1\), got bool"),
    (lambda: af.optim.scale_by_adam(b1="0.9"), r"scale_by_adam: b1 must be a float"),
])
def test_betas_are_refused_naming_b1_or_b2(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_apply_updates_refuses_an_update_of_another_shape_naming_the_leaf_and_both_shapes():
    params = {"b": torch.zeros(2), "w": torch.zeros(3)}
    for bad in (torch.ones(1), torch.ones(1, 3), torch.ones(3, 1)):
        with pytest.raises(ValueError, match=rf"apply_updates: leaf 'w' has shape \(3,\) in params and "
                                             rf"{re.escape(str(tuple(bad.shape)))} in updates"):
            af.apply_updates(params, {"b": torch.ones(2), "w": bad})
    # the same on the leaf-by-leaf path (float64 params do not take the fused pass)
    params64 = {k: v.double() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"leaf 'w' has shape \(3,\) in params and \(1,\) in updates"):
        af.apply_updates(params64, {"b": torch.ones(2, dtype=torch.float64), "w": torch.ones(1, dtype=torch.float64)})
    # a 0-d update is one number for its leaf
    new = af.apply_updates(params, {"b": torch.ones(2), "w": torch.tensor(2.0)})
    assert torch.equal(new["w"], torch.full((3,), 2.0))
