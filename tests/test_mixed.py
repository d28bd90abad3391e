"""The five primitives and mixed_precision(), checked against torch.amp.GradScaler + torch.optim."""

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import ampfunc as af

INF_STEPS = {4, 17, 18, 33}


# ---------------------------------------------------------------------------------------------
# primitives
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_and_check_returns_fp32_grads_divided_by_the_scale(dtype):
    ls = af.StaticLossScale(1024.0)
    grads = {"w": (torch.randn(5, 3) * 1024).to(dtype), "skip": None}
    out, finite = af.unscale_and_check(grads, ls)
    assert out["w"].dtype == torch.float32 and out["skip"] is None
    assert torch.equal(out["w"], grads["w"].float() * ls.inv_scale)
    assert finite.dtype == torch.bool and finite.shape == () and bool(finite)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_and_check_flags_any_non_finite_element(bad, dtype):
    g = torch.ones(7, dtype=dtype)
    g[-1] = bad
    _, finite = af.unscale_and_check({"a": torch.ones(3), "b": g}, af.DynamicLossScale())
    assert not bool(finite)


def test_unscale_and_check_leaves_its_input_untouched():
    g = {"w": torch.full((4,), 8.0)}
    af.unscale_and_check(g, af.StaticLossScale(8.0))
    assert torch.equal(g["w"], torch.full((4,), 8.0))


def test_unscale_and_check_names_a_non_floating_leaf():
    with pytest.raises(TypeError, match=r"'layer\.idx'.*torch\.int64"):
        af.unscale_and_check({"layer": {"idx": torch.tensor([1])}}, af.DynamicLossScale())


def test_unscale_and_check_of_an_empty_tree_is_finite():
    out, finite = af.unscale_and_check({}, af.DynamicLossScale())
    assert out == {} and bool(finite)


def test_scale_loss_multiplies_in_fp32_and_refuses_non_scalars():
    ls = af.DynamicLossScale(2.0**16)
    scaled = af.scale_loss(torch.tensor(0.5, dtype=torch.float16), ls)
    assert scaled.dtype == torch.float32 and scaled.item() == 2.0**15
    with pytest.raises(ValueError, match=r"scalar.*\(4,\)"):
        af.scale_loss(torch.ones(4), ls)
    with pytest.raises(TypeError, match="loss scale"):
        af.scale_loss(torch.ones(()), 128.0)


def test_skip_or_apply_restores_every_leaf_bit_for_bit():
    old = ({"w": torch.randn(3)}, af.DynamicLossScale(), (torch.zeros(()), None))
    new = ({"w": torch.randn(3)}, af.DynamicLossScale(4.0), (torch.ones(()), None))
    kept = af.skip_or_apply(torch.tensor(False), new, old)
    for a, b in zip(af.tree.tree_leaves(kept), af.tree.tree_leaves(old)):
        assert torch.equal(a, b)
    taken = af.skip_or_apply(torch.tensor(True), new, old)
    assert taken[1].loss_scale.item() == 4.0


@pytest.mark.parametrize("ls", [af.StaticLossScale(64.0), af.DynamicLossScale(2.0**10), af.NoOpLossScale()],
                         ids=["static", "dynamic", "noop"])
def test_unscale_serves_gradient_penalties_and_the_penalty_backpropagates(ls):
    # loss = sum(x^2): g = 2x, penalty = sum(g^2) = 4 sum(x^2), d penalty / dx = 8x.
    x = torch.randn(4, requires_grad=True)
    scaled = af.scale_loss((x ** 2).sum(), ls)
    (g,) = torch.autograd.grad(scaled, x, create_graph=True)
    unscaled = af.mixed.unscale({"x": g}, ls)["x"]
    torch.testing.assert_close(unscaled, 2 * x)
    assert unscaled.requires_grad  # the kernels have no backward: plain ops serve this case
    unscaled.square().sum().backward()
    torch.testing.assert_close(x.grad, 8 * x.detach())
    with torch.no_grad():  # the same numbers as the kernel's unscale, bit for bit
        kernel = af.mixed.unscale({"x": g.detach()}, ls)["x"]
    assert torch.equal(unscaled.detach(), kernel)


def test_fp16_without_scaling_flushes_small_gradients_that_scaling_keeps():
    # d loss / d w = x * 1e-4 = 1e-8: below fp16's smallest subnormal (6e-8).
    w = torch.ones(8, dtype=torch.float16, requires_grad=True)
    x = torch.full((8,), 1e-4, dtype=torch.float16)

    def loss_fn():
        return (w * x).sum() * 1e-4

    (g_plain,) = torch.autograd.grad(loss_fn(), w)
    assert torch.count_nonzero(g_plain) == 0  # all lost

    ls = af.StaticLossScale(2.0**14)  # 2**16 itself would overflow fp16 on the way back
    (g_scaled,) = torch.autograd.grad(af.scale_loss(loss_fn(), ls), w)
    grads, finite = af.unscale_and_check({"w": g_scaled}, ls)
    assert bool(finite)
    assert torch.allclose(grads["w"], torch.full((8,), 1e-8), rtol=1e-2)


def test_per_loss_scales_like_apex_num_losses():
    w = torch.ones(3, requires_grad=True)
    scales = {"ce": af.DynamicLossScale(2.0**10), "aux": af.DynamicLossScale(2.0**4)}
    losses = {"ce": (w * 2).sum(), "aux": (w * 3).sum()}
    total, flags = 0, {}
    for k, loss in losses.items():
        (g,) = torch.autograd.grad(af.scale_loss(loss, scales[k]), w)
        gk, flags[k] = af.unscale_and_check({"w": g}, scales[k])
        total = total + gk["w"]
    assert torch.equal(total, torch.full((3,), 5.0))
    scales = af.update_scale(scales, flags)
    assert scales["ce"].growth_tracker.item() == 1


# ---------------------------------------------------------------------------------------------
# differential against torch.amp.GradScaler + torch.optim (fp32 math)
# ---------------------------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _data(n=60):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _reference_run(torch_opt_cls, hp, steps):
    model = _model()
    opt = torch_opt_cls(model.parameters(), **hp)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=5)
    scales, trajectory = [], []
    for i, (x, y) in enumerate(_data(steps)):
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if i in INF_STEPS:
            model[2].bias.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        trajectory.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return scales, trajectory


def _ampfunc_run(opt, steps):
    model = _model()
    params = af.params_of(model)
    state = opt.init(params)
    ls = af.DynamicLossScale(2.0**16, growth_interval=5, min_scale=0.0, max_scale=float("inf"))
    scales, trajectory, flags = [], [], []
    for i, (x, y) in enumerate(_data(steps)):
        grads = torch.func.grad(
            lambda p: af.scale_loss(F.cross_entropy(functional_call(model, p, (x,)), y), ls))(params)
        if i in INF_STEPS:
            grads["2.bias"] = grads["2.bias"].clone()
            grads["2.bias"][1] = float("inf")
        grads, finite = af.unscale_and_check(grads, ls)
        updates, new_state = opt.update(grads, state, params)
        new_params = af.apply_updates(params, updates)
        params, state = af.skip_or_apply(finite, (new_params, new_state), (params, state))
        ls = af.update_scale(ls, finite)
        scales.append(ls.loss_scale.item())
        flags.append(bool(finite))
        trajectory.append({k: v.detach().clone() for k, v in params.items()})
    return scales, trajectory, flags


OPTIMIZERS = [
    ("sgd_momentum", torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
     lambda: af.sgd(0.05, momentum=0.9, weight_decay=1e-3)),
    ("adam", torch.optim.Adam, dict(lr=3e-3), lambda: af.adam(3e-3)),
    ("adamw", torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.05), lambda: af.adamw(3e-3, weight_decay=0.05)),
]


@pytest.mark.parametrize("name, torch_cls, hp, make", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_primitives_with_native_optimizer_match_grad_scaler_and_torch_optim(name, torch_cls, hp, make):
    steps = 50
    ref_scales, ref_traj = _reference_run(torch_cls, hp, steps)
    scales, traj, flags = _ampfunc_run(make(), steps)
    assert scales == ref_scales
    assert [i for i, f in enumerate(flags) if not f] == sorted(INF_STEPS)
    for step, (ours, theirs) in enumerate(zip(traj, ref_traj)):
        for k in theirs:
            torch.testing.assert_close(ours[k], theirs[k], rtol=1e-6, atol=1e-7, msg=f"{k} at step {step}")
    for i in INF_STEPS:  # skipped steps changed nothing on either side
        for k in ref_traj[i]:
            assert torch.equal(ref_traj[i][k], ref_traj[i - 1][k]) and torch.equal(traj[i][k], traj[i - 1][k])


# ---------------------------------------------------------------------------------------------
# mixed_precision(): master weights, skipping, pure vs in place, checkpoints
# ---------------------------------------------------------------------------------------------


def _half_setup(ls=None):
    torch.manual_seed(3)
    params = {"w": torch.randn(6, 5).half(), "b": torch.randn(5).half(), "norm": torch.ones(5)}
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2)),
                            loss_scale=ls or af.DynamicLossScale(2.0**10, growth_interval=3))
    return params, tx


def _half_grads(params, ls, i, inject=False):
    g = torch.Generator().manual_seed(100 + i)
    grads = {k: (torch.randn(v.shape, generator=g) * 1e-2 * ls.loss_scale).to(v.dtype) for k, v in params.items()}
    if inject:
        grads["w"][2, 3] = float("inf")
    return grads


def test_master_weights_are_fp32_and_params_are_their_cast():
    params, tx = _half_setup()
    state = tx.init(params)
    assert all(m.dtype == torch.float32 for m in state.master.values())
    for i in range(5):
        params, state = tx.step(params, _half_grads(params, af.loss_scale_of(state), i), state)
    assert params["w"].dtype == torch.float16 and params["norm"].dtype == torch.float32
    for k in params:
        assert torch.equal(params[k], state.master[k].to(params[k].dtype))


def test_skipped_step_leaves_params_optimizer_state_and_master_bit_identical():
    params, tx = _half_setup()
    state = tx.init(params)
    params, state = tx.step(params, _half_grads(params, af.loss_scale_of(state), 0), state)
    new_params, new_state = tx.step(params, _half_grads(params, af.loss_scale_of(state), 1, inject=True), state)
    for a, b in zip(af.tree.tree_leaves((new_params, new_state.master, new_state.inner)),
                    af.tree.tree_leaves((params, state.master, state.inner))):
        assert torch.equal(a, b)
    assert af.loss_scale_of(new_state).loss_scale.item() == af.loss_scale_of(state).loss_scale.item() / 2


def test_update_then_apply_updates_equals_step_and_step_in_place_equals_both():
    params, tx = _half_setup()
    state_a = state_b = state_c = tx.init(params)
    pa = pb = params
    pc = af.tree.tree_clone(params)
    state_c = af.tree.tree_clone(state_c)
    for i in range(8):
        ls = af.loss_scale_of(state_a)
        grads = _half_grads(pa, ls, i, inject=(i == 4))
        pa, state_a = tx.step(pa, grads, state_a)
        updates, state_b = tx.update(grads, state_b, pb)
        pb = af.apply_updates(pb, updates)
        out_c, state_c_out = tx.step_(pc, grads, state_c)
        assert out_c["w"] is pc["w"]  # donated: the same tensors, overwritten
        for a, b, c in zip(af.tree.tree_leaves((pa, state_a)), af.tree.tree_leaves((pb, state_b)),
                           af.tree.tree_leaves((pc, state_c_out))):
            assert torch.equal(a, b) and torch.equal(a, c)
        state_c = state_c_out


def test_mixed_precision_names_a_grads_params_mismatch():
    params, tx = _half_setup()
    state = tx.init(params)
    with pytest.raises(ValueError, match="'norm'"):
        tx.step(params, {"w": params["w"], "b": params["b"]}, state)


def test_checkpoint_resume_is_bit_exact_including_the_loss_scale():
    params, tx = _half_setup()
    state = tx.init(params)
    for i in range(6):
        params, state = tx.step(params, _half_grads(params, af.loss_scale_of(state), i, inject=(i == 2)), state)
    buf = io.BytesIO()
    torch.save({"params": params, "state": state}, buf)

    def run(p, s):
        for i in range(6, 14):
            p, s = tx.step(p, _half_grads(p, af.loss_scale_of(s), i, inject=(i == 9)), s)
        return p, s

    straight = run(params, state)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    resumed = run(ck["params"], ck["state"])
    for a, b in zip(af.tree.tree_leaves(straight), af.tree.tree_leaves(resumed)):
        assert torch.equal(a, b)
    assert isinstance(af.loss_scale_of(resumed[1]), af.DynamicLossScale)


def test_fp32_params_need_no_master_copy():
    params = {"w": torch.randn(3)}
    tx = af.mixed_precision(af.sgd(0.1), loss_scale=af.StaticLossScale(8.0))
    state = tx.init(params)
    assert state.master is None
    new, state = tx.step(params, {"w": torch.full((3,), 8.0)}, state)
    torch.testing.assert_close(new["w"], params["w"] - 0.1)


# ---------------------------------------------------------------------------------------------
# in-place twins
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ls", [af.DynamicLossScale(2.0**12), af.StaticLossScale(3.0), af.NoOpLossScale()],
                         ids=["dynamic", "static", "noop"])
def test_unscale_and_check_in_place_gives_the_pure_numbers_in_the_grads_own_dtype(dtype, ls):
    grads = {"w": (torch.randn(9, 4) * 4096).to(dtype), "b": (torch.randn(4) * 4096).to(dtype)}
    pure, finite = af.unscale_and_check(grads, ls)
    w = grads["w"]
    out, finite_ = af.mixed.unscale_and_check_(grads, ls)
    assert out is grads and out["w"] is w and out["w"].dtype == dtype
    for k in grads:
        assert torch.equal(out[k], pure[k].to(dtype))
    assert bool(finite) == bool(finite_)


def test_unscale_and_check_in_place_refuses_fp16_naming_the_leaf():
    with pytest.raises(TypeError, match=r"'enc\.w'.*float16"):
        af.mixed.unscale_and_check_({"enc": {"w": torch.ones(2, dtype=torch.float16)}}, af.DynamicLossScale())


def test_unscale_and_check_in_place_flags_non_finite():
    g = {"w": torch.tensor([1.0, float("nan")])}
    _, finite = af.mixed.unscale_and_check_(g, af.DynamicLossScale())
    assert not bool(finite)


@pytest.mark.parametrize("flag", [True, False])
def test_skip_or_apply_in_place_writes_the_pure_choice_into_old(flag):
    old = {"w": torch.zeros(3), "s": af.DynamicLossScale(8.0)}
    new = {"w": torch.ones(3), "s": af.DynamicLossScale(16.0)}
    expected = af.skip_or_apply(torch.tensor(flag), new, old)
    w = old["w"]
    out = af.mixed.skip_or_apply_(torch.tensor(flag), new, old)
    assert out is old and out["w"] is w
    for a, b in zip(af.tree.tree_leaves(out), af.tree.tree_leaves(expected)):
        assert torch.equal(a, b)


def test_update_scale_in_place_follows_the_pure_sequence():
    pure = af.DynamicLossScale(64.0, growth_interval=2, hysteresis=2)
    donated = af.DynamicLossScale(64.0, growth_interval=2, hysteresis=2)
    for finite in [True, True, False, False, True]:
        f = torch.tensor(finite)
        pure = af.update_scale(pure, f)
        assert af.mixed.update_scale_(donated, f) is donated
        assert torch.equal(pure.loss_scale, donated.loss_scale)
    static = af.StaticLossScale(4.0)
    assert af.mixed.update_scale_(static, torch.tensor(False)).loss_scale.item() == 4.0


def test_mixed_precision_runs_any_torch_optimizer_through_the_generic_path():
    params = {"w": torch.randn(5, 3).half(), "b": torch.zeros(3).half()}
    tx = af.mixed_precision(af.from_torch(torch.optim.RMSprop, lr=1e-2, momentum=0.9),
                            loss_scale=af.DynamicLossScale(2.0**8))
    state = tx.init(params)
    grads = {k: torch.ones_like(v) * 256 for k, v in params.items()}
    stepped, state1 = tx.step(params, grads, state)
    # the same update as from_torch on the unscaled fp32 grads of the fp32 master
    ref_tx = af.from_torch(torch.optim.RMSprop, lr=1e-2, momentum=0.9)
    master = af.tree.tree_map(lambda p: p.float(), params)
    upd, _ = ref_tx.update(af.tree.tree_map(lambda g: g.float() / 256, grads), ref_tx.init(master), master)
    for k in params:
        assert torch.equal(state1.master[k], master[k] + upd[k])
        assert torch.equal(stepped[k], state1.master[k].half())
    bad = dict(grads, w=torch.full_like(grads["w"], float("inf")))
    skipped, state2 = tx.step(stepped, bad, state1)
    for a, b in zip(af.tree.tree_leaves((skipped, state2.master, state2.inner)),
                    af.tree.tree_leaves((stepped, state1.master, state1.inner))):
        assert torch.equal(a, b)


def test_fused_step_lines_leaves_up_whatever_order_the_grads_dict_was_built_in():
    params = {f"l{i}": torch.randn(7 + i) for i in range(6)}
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adam(1e-2)), af.StaticLossScale(4.0))
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    shuffled = {k: grads[k] for k in reversed(list(grads))}  # same leaves, other insertion order
    a, sa = tx.step(params, grads, tx.init(params))
    b, sb = tx.step(params, shuffled, tx.init(params))
    for k in params:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sa.inner[1].exp_avg[k], sb.inner[1].exp_avg[k], rtol=1e-6, atol=1e-7)
    # and each leaf moved by its own gradient: Adam's first step is -lr * sign(g) (clipped or not)
    for k in params:
        torch.testing.assert_close(a[k], params[k] - 1e-2 * torch.sign(grads[k]), rtol=1e-4, atol=1e-5)


def test_a_mixed_precision_rebuilt_from_its_fields_says_it_lost_its_engine():
    tx = af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale())
    rebuilt = tx._replace(init=tx.init)  # a NamedTuple's fields are (init, update) only
    for name in ("step", "step_", "engine"):
        with pytest.raises(AttributeError, match="rebuilt from its .init, update. fields.*af.mixed_precision"):
            getattr(rebuilt, name)
    assert callable(tx.step) and tx.engine is not None


def test_leaving_out_the_loss_scale_warns_what_the_default_does_and_what_to_pass():
    # mixed_precision's default scales (DynamicLossScale, 2**16) where ModuleTrainer's and
    # make_train_step's do not: a bf16/fp32 user who does not scale the loss would get updates
    # 65536x too small, silently. Until the default becomes NoOpLossScale, it says so.
    params = {"w": torch.zeros(2)}
    grads = {"w": torch.ones(2)}
    with pytest.warns(FutureWarning) as caught:
        tx = af.mixed_precision(af.sgd(0.1))
    message = str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller's line
    for said in ("DynamicLossScale()", "2**16", "af.scale_loss(loss, af.loss_scale_of(state))",
                 "loss_scale=", "af.NoOpLossScale() for bf16/fp32", "NoOpLossScale() in the next release"):
        assert said in message, said
    # what it warns about: the default unscales an unscaled loss's gradients by 2**16
    new, state = tx.step(params, grads, tx.init(params))
    assert float(af.loss_scale_of(state).loss_scale) == 2.0**16
    assert torch.allclose(new["w"], torch.full((2,), -0.1 / 2**16))
    # given explicitly, nothing is said; NoOpLossScale steps as torch.optim.SGD does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tx = af.mixed_precision(af.sgd(0.1), loss_scale=af.NoOpLossScale())
        af.mixed_precision(af.sgd(0.1), af.DynamicLossScale())
    new, _ = tx.step(params, grads, tx.init(params))
    assert torch.allclose(new["w"], torch.full((2,), -0.1))
