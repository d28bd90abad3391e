"""One mixed-precision step behind every front-end (ampfunc.engine): the same numbers on every
path, the skip flag and counter, and validation before the first write."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ampfunc as af
from _helpers import OVERFLOW_STEPS, assert_trees_equal, clone_tree, grads_at, make_params, unregistered
from ampfunc import ops

INNERS = {
    "adamw": lambda: af.adamw(1e-2, weight_decay=0.05),
    "clip+adam": lambda: af.chain(af.clip_by_global_norm(0.5), af.adam(1e-2, amsgrad=True)),
    "sgd": lambda: af.sgd(0.05, momentum=0.9, nesterov=True),
    "named clip+adamw": lambda: af.transform.named_chain(("clip", af.clip_by_global_norm(0.5)),
                                                         ("opt", af.adamw(1e-2))),
}


def test_a_gradient_transformation_is_exactly_the_pair_init_update(params):
    init, update = af.adamw(1e-3)
    state = init(params)
    updates, state = update(grads_at(0), state, params)
    assert set(updates) == set(params)
    assert len(af.sgd(0.1)) == 2 and len(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3))) == 2
    # the kernel spec lives in the registry, keyed by the update function
    assert af.GradientTransformation(init, update).fused.kind == "adamw"
    assert af.from_torch(torch.optim.RMSprop, lr=1e-3).fused is None
    init_mp, update_mp = af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale())  # the mixed-precision wrapper too
    assert callable(init_mp) and callable(update_mp)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(INNERS))
def test_update_step_and_step_in_place_give_the_in_place_fused_numbers_and_count_skips(name, param_dtype):
    tx = af.mixed_precision(INNERS[name](), af.DynamicLossScale(2.0**8, growth_interval=3))
    assert tx.engine.plan is not None
    p_inplace = make_params(param_dtype)
    s_inplace = tx.init(p_inplace)
    p_pure, s_pure = clone_tree(p_inplace), clone_tree(s_inplace)
    generic = af.mixed_precision(unregistered(INNERS[name]()), af.DynamicLossScale(2.0**8, growth_interval=3))
    assert generic.engine.plan is None
    p_gen, s_gen = clone_tree(p_inplace), generic.init(p_inplace)
    for step in range(14):
        grads = grads_at(step, s_inplace.loss_scale.loss_scale, param_dtype)
        updates, s_upd = tx.update(grads, s_inplace, p_inplace)  # from the same inputs as step_
        p_upd = af.apply_updates(p_inplace, updates)
        p_inplace, s_inplace = tx.step_(p_inplace, grads, s_inplace)
        p_pure, s_pure = tx.step(p_pure, grads, s_pure)
        p_gen, s_gen = generic.step(p_gen, grads, s_gen)
        assert_trees_equal((p_pure, s_pure), (p_inplace, s_inplace))
        assert_trees_equal(s_upd, s_inplace)
        for k in p_upd:  # fp32 deltas added in fp32 and rounded once: new - p + p is new to an ulp
            torch.testing.assert_close(p_upd[k], p_inplace[k], rtol=2e-7 if param_dtype == torch.float32 else 8e-3,
                                       atol=1e-7)
        # the generic path: the same skips and scale; parameters to fp32 rounding
        assert bool(s_gen.finite) == bool(s_inplace.finite) == (step not in OVERFLOW_STEPS)
        assert int(s_gen.skipped) == int(s_inplace.skipped) == sum(s <= step for s in OVERFLOW_STEPS)
        assert torch.equal(s_gen.loss_scale.loss_scale, s_inplace.loss_scale.loss_scale)
        for k in p_gen:
            torch.testing.assert_close(p_gen[k], p_inplace[k], rtol=1e-5, atol=1e-6)
    assert s_inplace.finite.dtype == torch.bool and s_inplace.skipped.dtype == torch.int64
    assert s_inplace.finite.dim() == 0 and s_inplace.skipped.dim() == 0


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(12, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 12, generator=gen)
    if step in OVERFLOW_STEPS:
        x[0, 0] = float("inf")
    return x, torch.randint(0, 3, (8,), generator=gen)


def _loss(forward, x, y):
    return F.cross_entropy(forward(x), y)


@pytest.mark.parametrize("name", ["clip+adam", "sgd"])
def test_module_trainer_and_make_train_step_give_the_in_place_fused_numbers(name, monkeypatch):
    ls = af.DynamicLossScale(2.0**6, growth_interval=2)
    model = _Net()
    trainer = af.ModuleTrainer(model, INNERS[name](), loss_scale=ls)
    train = af.make_train_step(_Net(), _loss, INNERS[name](), loss_scale=ls)
    tstate = train.init()
    tx = af.mixed_precision(INNERS[name](), ls)
    params = af.tree.tree_map(lambda p: p.detach().clone(), af.params_of(_Net()))
    state = tx.init(params)
    kernel = "adam" if "adam" in name else "sgd"
    calls = {f"{kernel}_step_": 0, f"{kernel}_step": 0, f"{kernel}_step_checked": 0, f"{kernel}_step_checked_": 0}
    for fn in calls:
        real = getattr(ops, fn)
        monkeypatch.setattr(ops, fn,
                            lambda *a, _r=real, _n=fn, **k: (calls.__setitem__(_n, calls[_n] + 1), _r(*a, **k))[1])
    for step in range(6):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x), y)
        trainer.scale(loss).backward()
        finite = trainer.step()
        tstate, out = train.step(tstate, x, y)
        grads = torch.func.grad(lambda p: state.loss_scale.scale(_loss(
            lambda inp: torch.func.functional_call(model, p, (inp,)), x, y)))(params)
        params, state = tx.step_(params, grads, state)
        assert bool(finite) == bool(out.finite) == bool(state.finite) == (step not in OVERFLOW_STEPS)
        assert int(trainer.state.skipped) == int(tstate.skipped) == int(state.skipped)
        for k, p in model.named_parameters():
            assert torch.equal(p.detach(), params[k]), k
            assert torch.equal(tstate.params[k], params[k]), k
        assert_trees_equal(trainer.state.opt_state, state.inner)
        assert_trees_equal(tstate.opt_state, state.inner)
    # every path ran the kernels: ModuleTrainer and step_ in place (without clipping, the check and
    # the step in one call: *_step_checked_, which the reference backend composes of check and
    # *_step_), make_train_step out of place (without clipping, the check folded into its pass:
    # *_step_checked)
    in_place = calls[f"{kernel}_step_checked_" if "clip" not in name else f"{kernel}_step_"]
    assert in_place == 12
    assert calls[f"{kernel}_step_checked" if name == "sgd" else f"{kernel}_step"] == 6


@pytest.mark.slow
def test_make_train_step_compiled_fullgraph_runs_the_fused_op_and_matches_eager():
    ls = af.DynamicLossScale(2.0**6, growth_interval=2)
    train = af.make_train_step(_Net(), _loss, af.chain(af.clip_by_global_norm(0.5), af.adamw(1e-2)), loss_scale=ls)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(train.step, fullgraph=True, backend=backend)
    eager_state, comp_state = train.init(), train.init()
    for step in range(5):
        x, y = _batch(step)
        eager_state, eager_out = train.step(eager_state, x, y)
        comp_state, comp_out = compiled(comp_state, x, y)
        assert bool(eager_out.finite) == bool(comp_out.finite)
        assert_trees_equal(comp_state, eager_state)  # the same kernels: bit for bit
    assert any("ampfunc.adam_step" in t for t in seen) and any("ampfunc.check" in t for t in seen)
    assert int(comp_state.skipped) == sum(s < 5 for s in OVERFLOW_STEPS)


# ----------------------------------------------------------------------------------------------
# Validation before the first write
# ----------------------------------------------------------------------------------------------


def _snapshot(*trees):
    return [t.clone() for t in af.tree.tree_leaves(trees) if isinstance(t, torch.Tensor)]


def _unchanged(snapshot, *trees):
    now = [t for t in af.tree.tree_leaves(trees) if isinstance(t, torch.Tensor)]
    return len(now) == len(snapshot) and all(torch.equal(a, b) for a, b in zip(now, snapshot))


@pytest.mark.parametrize("generic", [False, True])
def test_in_place_step_refuses_the_same_tensor_twice_naming_both_leaves(generic):
    inner = unregistered(af.adamw(1e-3)) if generic else af.adamw(1e-3)
    tx = af.mixed_precision(inner, af.NoOpLossScale())
    t = torch.randn(4)
    params = {"a": t, "b": t, "c": torch.randn(3)}
    state = tx.init({"a": t.clone(), "b": t.clone(), "c": params["c"].clone()})
    snap = _snapshot(params, state)
    with pytest.raises(ValueError, match=r"'a'.*'b'.*same tensor"):
        tx.step_(params, {k: torch.ones_like(v) for k, v in params.items()}, state)
    assert _unchanged(snap, params, state)
    # overlapping views
    base = torch.randn(10)
    params = {"x": base[:6], "y": base[4:]}
    state = tx.init(clone_tree(params))
    with pytest.raises(ValueError, match=r"'x'.*'y'.*share memory"):
        tx.step_(params, {k: torch.ones_like(v) for k, v in params.items()}, state)


@pytest.mark.parametrize("generic", [False, True])
def test_in_place_step_takes_params_that_are_columns_of_one_matrix(generic):
    # their byte spans interleave, their elements do not: torch.optim steps them, so do we
    inner = unregistered(af.adamw(1e-3)) if generic else af.adamw(1e-3)
    tx = af.mixed_precision(inner, af.NoOpLossScale())
    qk = torch.randn(5, 2)
    params = {"q": qk[:, 0], "k": qk[:, 1]}
    grads = {"q": torch.ones(5), "k": -torch.ones(5)}
    want, _ = tx.step(clone_tree(params), grads, tx.init(clone_tree(params)))
    params, _ = tx.step_(params, grads, tx.init(clone_tree(params)))
    assert torch.equal(qk[:, 0], want["q"]) and torch.equal(qk[:, 1], want["k"])
    # two views of one column are still refused
    params = {"q": qk[:, 0], "q_again": qk.t()[0]}
    state = tx.init(clone_tree(params))
    snap = _snapshot(params, state)
    with pytest.raises(ValueError, match=r"'q'.*'q_again'"):
        tx.step_(params, {k: torch.ones(5) for k in params}, state)
    assert _unchanged(snap, params, state)


def test_in_place_step_refuses_an_expanded_param_before_writing_anything():
    tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale())
    params = {"a": torch.randn(3), "e": torch.randn(1).expand(4)}
    state = tx.init(clone_tree(params))
    snap = _snapshot(params, state)
    with pytest.raises(ValueError, match=r"'e'.*overlaps itself"):
        tx.step_(params, {k: torch.ones(v.shape) for k, v in params.items()}, state)
    assert _unchanged(snap, params, state)


@pytest.mark.parametrize("method", ["step", "step_"])
def test_fused_path_checks_shapes_and_names_the_leaf_and_the_tree(method):
    tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale())
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    state = tx.init(params)
    snap = _snapshot(params, state)
    # the engine's own check, or the kernels' (when they validate every call), mapped to paths
    with pytest.raises(ValueError, match=r"(?s)\A(?=.*\bgrads\b)(?=.*leaf 'w' has shape \(4, 3\))"):
        getattr(tx, method)(params, {"w": torch.randn(4, 3), "b": torch.randn(4)}, state)
    other = tx.init({"w": torch.randn(4, 3), "b": torch.randn(4)})  # state from another model
    with pytest.raises(ValueError, match=r"(?s)\A(?=.*state\.inner\.exp_avg)(?=.*leaf 'w' has shape)(?=.*\(4, 3\))"):
        getattr(tx, method)(params, {"w": torch.randn(3, 4), "b": torch.randn(4)}, other)
    assert _unchanged(snap, params, state)


def test_a_master_from_another_model_is_blamed_not_the_gradients():
    tx = af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale())
    params = {"w": torch.randn(3, 4).half()}
    other = tx.init({"w": torch.randn(2, 6).half()})
    with pytest.raises(ValueError, match=r"(?s)\A(?=.*state\.master leaf 'w'|.*'w' has shape \(2, 6\) in state\.master)"
                                         r"(?=.*\(2, 6\))(?!.*grads)"):
        tx.step_(params, {"w": torch.randn(3, 4).half()}, other)


def test_meta_leaves_are_refused_naming_the_leaf():
    tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale())
    params = {"a": torch.randn(3)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"grads leaf 'a' is on the meta device"):
        tx.step_(params, {"a": torch.empty(3, device="meta")}, state)
    with pytest.raises(ValueError, match=r"'m' is on the meta device"):
        tx.init({"m": torch.empty(3, device="meta")})


def test_fp64_params_keep_an_fp64_master_never_a_narrower_one():
    tx = af.mixed_precision(af.sgd(0.0), af.DynamicLossScale())
    params = {"d": torch.tensor([1.0 + 1e-12], dtype=torch.float64), "h": torch.ones(2, dtype=torch.float16)}
    state = tx.init(params)
    assert state.master["d"].dtype == torch.float64 and state.master["h"].dtype == torch.float32
    grads = {"d": torch.ones(1, dtype=torch.float64), "h": torch.zeros(2, dtype=torch.float16)}
    for method in (tx.step, tx.step_):
        new, _ = method(params, grads, state)
        assert new["d"].item() == 1.0 + 1e-12  # an fp32 master rounds this to 1 even with lr 0


def test_skip_or_apply_in_place_writes_parameters_and_refuses_aliases_before_writing():
    old = {"a": torch.zeros(3), "b": torch.nn.Parameter(torch.zeros(3))}
    af.mixed.skip_or_apply_(torch.tensor(True), {"a": torch.ones(3), "b": torch.ones(3)}, old)
    assert torch.equal(old["b"].detach(), torch.ones(3)) and torch.equal(old["a"], torch.ones(3))
    t = torch.zeros(3)
    aliased = {"a": torch.zeros(3), "x": t, "y": t}
    with pytest.raises(ValueError, match=r"'x'.*'y'"):
        af.mixed.skip_or_apply_(torch.tensor(True), {k: torch.ones(3) for k in aliased}, aliased)
    assert torch.equal(aliased["a"], torch.zeros(3))


def test_module_trainer_exposes_the_skip_flag_and_counter_without_a_sync():
    model = _Net()
    trainer = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=af.DynamicLossScale(2.0**4))
    assert bool(trainer.finite) and int(trainer.skipped) == 0
    for step in range(5):
        x, y = _batch(step)
        trainer.scale(F.cross_entropy(model(x), y)).backward()
        flag = trainer.step()
        assert flag is not trainer.finite  # a snapshot: the state's flag is reused next step
    assert int(trainer.skipped) == 1 and bool(trainer.finite)


@pytest.mark.parametrize("generic", [False, True])
def test_the_monitoring_hook_gets_per_leaf_flags_from_the_check_pass_and_their_paths(generic):
    inner = unregistered(af.adamw(1e-3)) if generic else af.adamw(1e-3)
    tx = af.mixed_precision(inner, af.DynamicLossScale(2.0**4))
    seen = []
    tx.engine.on_check = lambda finite, leaf_nonfinite, paths: seen.append((finite, leaf_nonfinite, paths()))
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    state = tx.init(params)
    grads = {"b": torch.ones(2), "w": torch.ones(3, 2)}  # another key order: optree's order is used
    grads["w"][1, 1] = float("nan")
    params, state = tx.step_(params, grads, state)
    (finite, flags, paths), = seen
    assert not bool(finite) and flags.dtype == torch.bool
    assert dict(zip(paths, flags.tolist())) == {"w": True, "b": False}
    assert int(state.skipped) == 1


class _Overwrite(torch.autograd.Function):
    """Forward: x unchanged; backward: the gradient of ``state`` is its new value (state + 1)."""

    @staticmethod
    def forward(x, state):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (state,) = ctx.saved_tensors
        return g, state + 1


def test_make_train_step_overwrites_chosen_params_with_their_gradient_around_the_optimizer():
    class Net(_Net):
        def __init__(self):
            super().__init__()
            self.amax = torch.nn.Parameter(torch.zeros(2))

        def forward(self, x):
            return super().forward(_Overwrite.apply(x, self.amax))

    train = af.make_train_step(Net(), _loss, af.adamw(1e-2), loss_scale=af.DynamicLossScale(2.0**6),
                               overwrite_with_gradient=lambda path: path == "amax")
    state = train.init()
    assert "amax" not in state.opt_state.exp_avg and "fc1.weight" in state.opt_state.exp_avg
    for step in range(5):  # step 3 overflows: amax keeps its value then
        state, out = train.step(state, *_batch(step))
    assert int(state.skipped) == 1
    assert torch.equal(state.params["amax"], torch.full((2,), 4.0))
    assert list(state.params) == list(af.params_of(Net()))


def test_generic_in_place_step_writes_parameter_leaves_like_the_pure_step():
    tx = af.mixed_precision(af.from_torch(torch.optim.AdamW, lr=1e-2), af.StaticLossScale(4.0))
    params = {"w": torch.nn.Parameter(torch.randn(3, 2)), "b": torch.randn(2)}
    state = tx.init(params)
    grads = {"w": torch.randn(3, 2) * 4, "b": torch.randn(2) * 4}
    new, new_state = tx.step(params, grads, state)
    p2, s2 = tx.step_(params, grads, state)
    assert p2 is params and isinstance(params["w"], torch.nn.Parameter)
    assert torch.equal(params["w"].detach(), new["w"]) and torch.equal(params["b"], new["b"])
    assert_trees_equal(s2.inner, new_state.inner)


def test_make_train_step_never_writes_the_state_it_is_given():
    train = af.make_train_step(_Net(), _loss, af.chain(af.clip_by_global_norm(0.5), af.adamw(1e-2)),
                               loss_scale=af.DynamicLossScale(2.0**6))
    state = train.init()
    for step in (0, 3):  # an applied step and a skipped one
        snap = _snapshot(state)
        new_state, _ = train.step(state, *_batch(step))
        assert _unchanged(snap, state)
        ids = {id(t) for t in af.tree.tree_leaves(state) if isinstance(t, torch.Tensor)}
        assert not ids & {id(t) for t in af.tree.tree_leaves(new_state.params)}
        state = new_state


def test_each_init_owns_its_loss_scale_tensors():
    # step_ writes the scale in place: it must write the state's own copy, never the scale object
    # the caller passed nor another state's.
    ls = af.DynamicLossScale(2.0 ** 10)
    tx = af.mixed_precision(af.adamw(1e-3), ls)
    params = {"w": torch.zeros(3, dtype=torch.float16)}
    a, b = tx.init(params), tx.init(params)
    params, a = tx.step_(params, {"w": torch.full((3,), float("inf"), dtype=torch.float16)}, a)
    assert float(a.loss_scale.loss_scale) == 2.0 ** 9
    fresh = tx.init(params).loss_scale
    assert float(b.loss_scale.loss_scale) == float(ls.loss_scale) == float(fresh.loss_scale) == 2.0 ** 10
    t1 = af.ModuleTrainer(torch.nn.Linear(2, 2), af.adamw(1e-3), loss_scale=ls)
    t2 = af.ModuleTrainer(torch.nn.Linear(2, 2), af.adamw(1e-3), loss_scale=ls)
    assert t1.loss_scale.loss_scale.data_ptr() not in (t2.loss_scale.loss_scale.data_ptr(), ls.loss_scale.data_ptr())


@pytest.mark.parametrize("generic", [False, True])
def test_a_pure_steps_params_never_alias_its_masters_so_step_takes_its_state(generic):
    # fp16 params with an fp32 leaf kept (a norm layer): the pure step's new fp32 param was the
    # master itself on the generic path, and step_ then refused the state as aliased
    inner = unregistered(af.adamw(1e-3)) if generic else af.adamw(1e-3)
    tx = af.mixed_precision(inner, af.DynamicLossScale(2.0**4))
    params = {"w": torch.randn(4, dtype=torch.float16), "norm": torch.randn(4),
              "x": torch.randn(2, dtype=torch.float64)}
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    params, state = tx.step(params, grads, tx.init(params))
    master = af.tree.tree_leaves(state.master)
    assert not any(p is m or p.data_ptr() == m.data_ptr() for p in params.values() for m in master)
    tx.step_(params, grads, state)  # accepted
