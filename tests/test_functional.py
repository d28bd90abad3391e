"""torch.func interop and stateful interop, specified against torch.func and torch.amp.GradScaler.

* ``value_and_grad``: the loss as computed, fp32 grads of the unscaled loss, a ``finite`` flag;
* under ``vmap``: per-example grads in fp16 equal the loop over examples (DP-SGD clipping);
* a ``torch.func.grad`` loop with BatchNorm and dropout follows the stateful GradScaler loop;
* ``make_train_step`` is that loop, packaged; ``ModuleTrainer`` drives a plain module.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import ampfunc as af
from _helpers import clone_tree


def mlp(seed=0, dropout=0.0, batchnorm=True):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 16)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(16))
    layers += [torch.nn.ReLU()]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers.append(torch.nn.Linear(16, 3))
    return torch.nn.Sequential(*layers)


clone = clone_tree


def batches(n, size=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# apply_module and value_and_grad
# ----------------------------------------------------------------------------------------------


def test_apply_module_returns_the_output_and_new_buffers_and_leaves_its_inputs_untouched():
    model = mlp()
    params, buffers = clone(af.params_of(model)), clone(af.policy.buffers_of(model))
    x, _ = batches(1)[0]
    out, new_buffers = af.functional.apply_module(model, params, buffers, x)
    model.train()
    assert torch.allclose(out, model(x))
    for k, b in model.named_buffers():
        assert torch.equal(new_buffers[k], b), k
    assert torch.equal(buffers["1.running_var"], torch.ones(16)) and int(buffers["1.num_batches_tracked"]) == 0


def test_value_and_grad_returns_exact_loss_and_fp32_grads_of_the_unscaled_loss():
    model = mlp(batchnorm=False)
    params = clone(af.params_of(model))
    x, y = batches(1)[0]

    def loss_fn(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    expected_grads = torch.func.grad(loss_fn)(params, x, y)
    loss, grads, finite = af.value_and_grad(loss_fn)(af.StaticLossScale(2.0**12), params, x, y)

    assert torch.equal(loss, loss_fn(params, x, y))
    assert bool(finite)
    for k in params:
        assert grads[k].dtype == torch.float32
        # A power-of-two scale multiplies and divides exactly.
        assert torch.equal(grads[k], expected_grads[k]), k


def test_value_and_grad_leaves_its_inputs_untouched():
    model = mlp(batchnorm=False)
    params = clone(af.params_of(model))
    before = clone(params)
    ls = af.DynamicLossScale(2.0**8)
    x, y = batches(1)[0]
    af.value_and_grad(lambda p: F.cross_entropy(functional_call(model, p, (x,)), y))(ls, params)
    assert all(torch.equal(params[k], before[k]) for k in params)
    assert float(ls.loss_scale) == 2.0**8


def test_fp16_grads_that_overflow_under_a_large_scale_are_flagged_and_fine_under_a_small_one():
    w = {"w": torch.full((4,), 3.0, dtype=torch.float16)}

    def loss_fn(p):
        return (p["w"] * 1000.0).sum()  # d/dw = 1000 per element, in fp16

    _, grads, finite = af.value_and_grad(loss_fn)(af.StaticLossScale(2.0**5), w)  # 32000 fits fp16
    assert bool(finite) and torch.equal(grads["w"], torch.full((4,), 1000.0))
    _, _, finite = af.value_and_grad(loss_fn)(af.StaticLossScale(2.0**7), w)  # 128000 > fp16 max
    assert not bool(finite)


def test_value_and_grad_has_aux_hands_back_functionally_updated_batchnorm_buffers():
    model = mlp()
    params, buffers = clone(af.params_of(model)), clone(af.policy.buffers_of(model))
    x, y = batches(1)[0]

    def loss_fn(p, b, x, y):
        out, new_b = af.functional.apply_module(model, p, b, x)
        return F.cross_entropy(out, y), new_b

    (loss, new_buffers), grads, finite = af.value_and_grad(loss_fn, has_aux=True)(
        af.DynamicLossScale(), params, buffers, x, y)
    model.train()
    reference_loss = F.cross_entropy(model(x), y)  # updates the module's own running stats
    assert torch.allclose(loss, reference_loss)
    assert torch.allclose(new_buffers["1.running_mean"], model[1].running_mean)
    assert torch.equal(new_buffers["1.num_batches_tracked"], torch.tensor(1))
    assert torch.equal(buffers["1.running_mean"], torch.zeros(16))  # the input buffers are untouched
    assert set(grads) == set(params)


def test_argnums_selects_which_arguments_are_differentiated():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    _, grads, _ = af.value_and_grad(lambda a, b: (a * b).sum(), argnums=(0, 1))(af.StaticLossScale(4.0), a, b)
    assert torch.equal(grads[0], torch.tensor([3.0, 3.0])) and torch.equal(grads[1], torch.tensor([3.0]))
    _, grads, _ = af.value_and_grad(lambda a, b: (a * b).sum(), argnums=1)(af.StaticLossScale(4.0), a, b)
    assert torch.equal(grads, torch.tensor([3.0]))


def test_value_and_grad_errors_name_what_is_wrong():
    with pytest.raises(TypeError, match="loss scale"):
        af.value_and_grad(lambda p: p.sum())(torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match=r"\(loss, aux\)"):
        af.value_and_grad(lambda p: p.sum(), has_aux=True)(af.NoOpLossScale(), torch.ones(2))
    with pytest.raises(ValueError, match="scalar"):
        af.value_and_grad(lambda p: p * 2)(af.NoOpLossScale(), torch.ones(2))


# ----------------------------------------------------------------------------------------------
# vmap: per-example gradients under fp16 and loss scaling
# ----------------------------------------------------------------------------------------------


def fp16_per_example_setup():
    model = mlp(batchnorm=False)
    params = af.cast_params(clone(af.params_of(model)), torch.float16)
    x, y = batches(1, size=6)[0]
    x = x.half()

    def loss_fn(p, xi, yi):  # one example
        out = functional_call(model, p, (xi.unsqueeze(0),)).float()
        return F.cross_entropy(out, yi.unsqueeze(0))

    return params, x, y, loss_fn


@pytest.mark.parametrize("overflowing_example", [None, 4])
def test_vmap_per_example_grads_in_fp16_equal_the_loop_over_examples(overflowing_example):
    params, x, y, loss_fn = fp16_per_example_setup()
    if overflowing_example is not None:
        x[overflowing_example] = 6.0e4  # its fp16 activations and grads overflow; the others do not
    ls = af.DynamicLossScale(2.0**10)
    vg = af.value_and_grad(loss_fn)

    losses, grads, finite = torch.vmap(vg, in_dims=(None, None, 0, 0))(ls, params, x, y)

    assert finite.shape == (6,) and finite.dtype == torch.bool
    for i in range(6):
        loss_i, grads_i, finite_i = vg(ls, params, x[i], y[i])
        assert bool(finite[i]) == bool(finite_i) == (i != overflowing_example), i
        if i == overflowing_example:
            continue
        assert torch.allclose(losses[i], loss_i, rtol=1e-3, atol=1e-4)
        for k in params:
            assert grads[k].dtype == torch.float32
            # vmap runs one batched fp16 matmul where the loop runs six: rounding may differ.
            assert torch.allclose(grads[k][i], grads_i[k], rtol=1e-2, atol=1e-3), (i, k)


def test_vmap_value_and_grad_flags_an_invalid_scale_and_keeps_fp64_grads_as_unbatched():
    params, x, y, loss_fn = fp16_per_example_setup()
    vg = af.value_and_grad(loss_fn)
    bad = af.DynamicLossScale.from_tensors(torch.tensor(0.0), torch.tensor(0, dtype=torch.int32),
                                           torch.tensor(1, dtype=torch.int32), af.DynamicLossScale().config)
    _, _, finite = torch.vmap(vg, in_dims=(None, None, 0, 0))(bad, params, x, y)
    assert not bool(finite.any()) and not bool(vg(bad, params, x[0], y[0])[2])  # scale 0 set by hand: skip
    wide = af.tree.tree_map(lambda p: p.double(), params)
    vg64 = af.value_and_grad(lambda p, xi, yi: loss_fn(af.cast_params(p, torch.float16), xi, yi))
    _, grads, _ = torch.vmap(vg64, in_dims=(None, None, 0, 0))(af.DynamicLossScale(2.0 ** 10), wide, x, y)
    assert all(g.dtype == torch.float64 for g in grads.values())


def test_clip_per_example_equals_clip_grad_norm_per_example_then_the_mean():
    params, x, y, loss_fn = fp16_per_example_setup()
    ls = af.DynamicLossScale(2.0**10)
    _, grads, finite = torch.vmap(af.value_and_grad(loss_fn), in_dims=(None, None, 0, 0))(ls, params, x, y)
    assert bool(finite.all())
    max_norm = 0.05

    clipped, norms = af.functional.clip_per_example(grads, max_norm)

    per_example = []
    for i in range(6):
        holders = {k: torch.zeros_like(grads[k][i], requires_grad=True) for k in grads}
        for k, h in holders.items():
            h.grad = grads[k][i].clone()
        total = torch.nn.utils.clip_grad_norm_(list(holders.values()), max_norm)
        assert torch.allclose(norms[i], total, rtol=1e-5)
        per_example.append({k: h.grad for k, h in holders.items()})
    assert bool((norms > max_norm).any()) and bool((norms > 0).all())  # clipping is active
    for k in grads:
        expected = torch.stack([g[k] for g in per_example]).mean(0)
        assert torch.allclose(clipped[k], expected, rtol=1e-5, atol=1e-7), k
    summed, _ = af.functional.clip_per_example(grads, max_norm, reduce="sum")
    assert all(torch.allclose(summed[k], clipped[k] * 6, rtol=1e-5, atol=1e-7) for k in grads)


def test_clip_per_example_needs_the_example_index_on_every_leaf():
    with pytest.raises(ValueError, match="'b'"):
        af.functional.clip_per_example({"a": torch.ones(4, 2), "b": torch.ones(3, 2)}, 1.0)
    with pytest.raises(ValueError, match="reduce"):
        af.functional.clip_per_example({"a": torch.ones(4, 2)}, 1.0, reduce="max")


# ----------------------------------------------------------------------------------------------
# torch.func.grad + ampfunc against the stateful GradScaler loop
# ----------------------------------------------------------------------------------------------

OVERFLOW_STEPS = (2, 5)  # the loss is multiplied by inf at these steps


def loss_weight(step):
    return torch.tensor(math.inf if step in OVERFLOW_STEPS else 1.0)


def test_func_grad_with_batchnorm_and_dropout_matches_the_gradscaler_loop():
    ref_model = mlp(dropout=0.25)
    model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    params, buffers = clone(af.params_of(model)), clone(af.policy.buffers_of(model))
    tx = af.sgd(0.1, momentum=0.9)
    opt_state = tx.init(params)
    ls = af.DynamicLossScale(2.0**10, growth_interval=2, min_scale=0.0, max_scale=math.inf)

    def loss_fn(p, b, x, y, w):
        out, new_b = af.functional.apply_module(model, p, b, x)
        return F.cross_entropy(out, y) * w, new_b

    vg = af.value_and_grad(loss_fn, has_aux=True)
    ref_model.train()
    for step, (x, y) in enumerate(batches(8)):
        w = loss_weight(step)
        before = clone(dict(ref_model.named_parameters()))
        torch.manual_seed(1000 + step)  # both forwards draw the same dropout mask
        scaler.scale(F.cross_entropy(ref_model(x), y) * w).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        ref_skipped = all(torch.equal(before[k], p) for k, p in ref_model.named_parameters())

        torch.manual_seed(1000 + step)
        (_, buffers), grads, finite = vg(ls, params, buffers, x, y, w)
        updates, new_state = tx.update(grads, opt_state, params)
        params, opt_state = af.skip_or_apply(finite, (af.apply_updates(params, updates), new_state),
                                             (params, opt_state))
        ls = af.update_scale(ls, finite)

        assert bool(finite) == (not ref_skipped) == (step not in OVERFLOW_STEPS), step
        assert float(ls.loss_scale) == scaler.get_scale(), step
        for k, p in ref_model.named_parameters():
            assert torch.allclose(params[k], p, rtol=1e-5, atol=1e-6), (step, k)
        for k, b in ref_model.named_buffers():
            assert torch.allclose(buffers[k].to(b.dtype), b, rtol=1e-5, atol=1e-6), (step, k)
    assert scaler.get_scale() != 2.0**10  # the run grew and backed off


# ----------------------------------------------------------------------------------------------
# make_train_step (eager here; compiled in test_compile_step.py)
# ----------------------------------------------------------------------------------------------


def test_make_train_step_is_the_primitive_loop_packaged():
    model = mlp()
    tx = af.chain(af.clip_by_global_norm(1.0), af.adam(1e-2))
    ls = af.DynamicLossScale(2.0**10, growth_interval=2)

    def loss_fn(forward, x, y, w):
        return F.cross_entropy(forward(x), y) * w

    train = af.make_train_step(model, loss_fn, tx, loss_scale=ls)
    state = train.init()
    params, buffers = clone(af.params_of(model)), clone(af.policy.buffers_of(model))
    opt_state = tx.init(params)

    def manual_loss(p, b, x, y, w):
        b = af.tree.tree_map(torch.clone, b)
        return F.cross_entropy(functional_call(model, (p, b), (x,)), y) * w, b

    for step, (x, y) in enumerate(batches(6)):
        w = loss_weight(step)
        state, out = train.step(state, x, y, w)
        (_, new_buffers), grads, finite = af.value_and_grad(manual_loss, has_aux=True)(ls, params, buffers, x, y, w)
        updates, new_opt = tx.update(grads, opt_state, params)
        # A skipped step keeps everything, the forward's buffers included.
        params, opt_state, buffers = af.skip_or_apply(
            finite, (af.apply_updates(params, updates), new_opt, new_buffers), (params, opt_state, buffers))
        assert torch.equal(out.loss_scale, ls.loss_scale)
        ls = af.update_scale(ls, finite)
        assert torch.equal(out.finite, finite)
        assert all(torch.equal(state.params[k], params[k]) for k in params)
        assert all(torch.equal(state.buffers[k], buffers[k]) for k in buffers)
    assert torch.equal(state.loss_scale.loss_scale, ls.loss_scale)
    # The module itself is untouched until copied back.
    assert not torch.equal(model[0].weight, state.params["0.weight"])
    af.functional.copy_to_module(model, state.params, state.buffers)
    assert torch.equal(model[0].weight, state.params["0.weight"])
    assert torch.equal(model[1].running_var, state.buffers["1.running_var"])


def test_make_train_step_with_a_bf16_compute_policy_keeps_fp32_params_and_norms():
    model = mlp()

    def loss_fn(forward, x, y):
        out = forward(x)
        return F.cross_entropy(out, y), out

    policy = af.get_policy("p=f32,c=bf16,o=f32")
    train = af.make_train_step(model, loss_fn, af.sgd(0.1), policy, loss_scale=af.DynamicLossScale(2.0**8),
                               has_aux=True)
    state = train.init()
    x, y = batches(1)[0]
    state, out = train.step(state, x, y)
    assert out.aux.dtype == torch.float32  # output cast to the policy's output dtype
    assert all(p.dtype == torch.float32 for p in state.params.values())
    assert bool(out.finite) and torch.isfinite(out.loss)
    assert state.buffers["1.running_mean"].dtype == torch.float32


@pytest.mark.parametrize("inplace", [False, True], ids=["step", "step_"])
def test_a_skipped_make_train_step_keeps_the_batchnorm_statistics(inplace):
    # An fp16 forward that overflows is skipped; its NaN batch statistics must not become the
    # running ones (the eval model would output NaN for good). An applied step updates them.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    train = af.make_train_step(model, lambda fwd, x: fwd(x).float().square().mean(), af.adamw(1e-3),
                               "p=f32,c=f16,o=f32", loss_scale=af.DynamicLossScale())
    state = train.init()
    before = {k: v.clone() for k, v in state.buffers.items()}
    run = train.step_ if inplace else train.step
    state, out = run(state, torch.randn(8, 3) * 1e5)
    assert not bool(out.finite) and int(state.skipped) == 1
    assert all(torch.equal(state.buffers[k], v) for k, v in before.items())
    state, out = run(state, torch.randn(8, 3))
    assert bool(out.finite) and int(state.buffers["1.num_batches_tracked"]) == 1
    assert not torch.equal(state.buffers["1.running_mean"], before["1.running_mean"])
    assert all(bool(torch.isfinite(v).all()) for v in state.buffers.values())


@pytest.mark.parametrize("policy", ["bf16", "half", "p=bf16,c=f32"])
@pytest.mark.parametrize("norm", [torch.nn.BatchNorm1d, torch.nn.LayerNorm])
def test_low_precision_param_policies_store_the_norm_layers_in_fp32(policy, norm):
    # Norm weights beside fp32 buffers (or an fp32 input): stored in the param dtype they made
    # torch refuse the forward ("expected scalar type BFloat16 but found Float").
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), norm(16), torch.nn.Linear(16, 4))
    train = af.make_train_step(model, lambda fwd, x: fwd(x).float().square().mean(), af.sgd(1e-3), policy)
    state = train.init()
    low = af.get_policy(policy).param_dtype
    assert state.params["0.weight"].dtype == low and state.params["1.weight"].dtype == torch.float32
    state, out = train.step(state, torch.randn(8, 8))
    assert bool(out.finite) and state.params["1.weight"].dtype == torch.float32


def test_eager_make_train_step_differentiates_by_autograd_with_torch_funcs_numbers(monkeypatch):
    # Eager, the step differentiates with plain autograd (no torch.func transform layer per op);
    # torch.func.grad stays for compiled graphs and other transforms. Both give the same bits,
    # through a bf16 policy, a kept-fp32 norm, an aux that is handed back with no graph, and an
    # unused param (a zero gradient, as torch.func.grad gives).
    from ampfunc import functional

    def loss_fn(forward, x, y):
        out = forward(x)
        return F.cross_entropy(out, y), out

    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.unused = mlp(), torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.net(x)

    def run(force_func):
        if force_func:
            monkeypatch.setattr(functional, "_plain_autograd_ok", lambda: False)
        model = WithUnused()
        train = af.make_train_step(model, loss_fn, af.adamw(1e-2), "p=f32,c=bf16,o=f32",
                                   loss_scale=af.DynamicLossScale(2.0**8), has_aux=True)
        state, outs = train.init(), []
        for x, y in batches(3):
            state, out = train.step(state, x, y)
            outs.append(out)
        monkeypatch.undo()
        return state, outs

    (a, outs_a), (b, outs_b) = run(False), run(True)
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k
    assert not any(p.requires_grad for p in a.params.values())
    for x, y in zip(outs_a, outs_b):
        assert torch.equal(x.loss, y.loss) and torch.equal(x.aux, y.aux)
        assert not x.aux.requires_grad and x.aux.grad_fn is None and not x.loss.requires_grad


def test_value_and_grad_refuses_a_bool_argnums_the_slip_of_passing_has_aux_positionally():
    def loss_fn(w, x):
        return (w * x).sum()
    with pytest.raises(TypeError, match=r"argnums must be an int.*has_aux=True by keyword"):
        af.value_and_grad(loss_fn, True)
    with pytest.raises(TypeError, match=r"argnums"):
        af.value_and_grad(loss_fn, (0, False))
    loss, grads, _ = af.value_and_grad(loss_fn, 1)(af.NoOpLossScale(), torch.ones(3), torch.full((3,), 2.0))
    assert torch.equal(grads, torch.ones(3))  # d/dx, as asked


@pytest.mark.parametrize("inplace", [False, True])
def test_make_train_step_takes_a_train_state_built_with_the_old_four_fields(inplace):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    train = af.make_train_step(model, lambda f, x: f(x).sum(), af.adamw(1e-3), loss_scale=af.DynamicLossScale())
    x = torch.randn(2, 3)
    want, want_out = train.step(train.init(), x)
    old = af.TrainState(*train.init()[:4])
    assert old.finite is None and old.skipped is None
    new, out = (train.step_ if inplace else train.step)(old, x)
    assert bool(new.finite) and int(new.skipped) == 0
    assert all(torch.equal(new.params[k], want.params[k]) for k in want.params)
    assert float(out.loss_scale) == float(want_out.loss_scale)


def test_make_train_step_names_a_loss_that_is_not_a_scalar():
    train = af.make_train_step(mlp(), lambda f, x: f(x), af.sgd(0.1))
    with pytest.raises(ValueError, match=r"scalar \(0-d\) loss, got shape \(8, 3\)"):
        train.step(train.init(), batches(1)[0][0])


def test_make_train_step_refuses_a_mixed_precision_wrapper_and_says_what_to_pass():
    with pytest.raises(TypeError, match="tx.inner"):
        af.make_train_step(mlp(), lambda f, x: f(x).sum(), af.mixed_precision(af.sgd(0.1), af.DynamicLossScale()))


def test_copy_to_module_names_unknown_paths_and_writes_nothing():
    model = mlp()
    before = model[0].weight.detach().clone()
    with pytest.raises(KeyError, match="encoder.weight"):
        af.functional.copy_to_module(model, {"0.weight": torch.zeros(16, 6), "encoder.weight": torch.zeros(1)})
    assert torch.equal(model[0].weight, before)


# ----------------------------------------------------------------------------------------------
# ModuleTrainer: the transforms driving a plain module
# ----------------------------------------------------------------------------------------------


def test_module_trainer_matches_gradscaler_with_torch_adamw():
    # No BatchNorm here: it makes the first bias's gradient rounding noise, which Adam's
    # normalization turns into lr-sized steps of either sign.
    ref_model = mlp(batchnorm=False)
    model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trainer = af.ModuleTrainer(model, af.adamw(1e-2, weight_decay=0.1),
                               loss_scale=af.DynamicLossScale(2.0**10, growth_interval=2, min_scale=0.0,
                                                              max_scale=math.inf))
    for step, (x, y) in enumerate(batches(7)):
        w = loss_weight(step)
        scaler.scale(F.cross_entropy(ref_model(x), y) * w).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()

        trainer.scale(F.cross_entropy(model(x), y) * w).backward()
        finite = trainer.step()

        assert bool(finite) == (step not in OVERFLOW_STEPS)
        assert float(trainer.loss_scale.loss_scale) == scaler.get_scale()
        assert all(p.grad is None for p in model.parameters())
        for (k, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), (step, k)


def test_module_trainer_keeps_an_fp32_master_for_an_fp16_module_and_a_skipped_step_changes_nothing():
    model = mlp(batchnorm=False).half()
    trainer = af.ModuleTrainer(model, af.sgd(0.05, momentum=0.9), loss_scale=af.DynamicLossScale(2.0**8))
    assert all(m.dtype == torch.float32 for m in trainer.state.master.values())
    for x, y in batches(3):
        trainer.scale(F.cross_entropy(model(x.half()).float(), y)).backward()
        assert bool(trainer.step())
    for k, p in model.named_parameters():
        assert p.dtype == torch.float16
        assert torch.equal(p, trainer.state.master[k].half()), k  # params are the master, rounded once

    params_before = clone(dict(model.named_parameters()))
    state_before = clone(trainer.state)
    x, y = batches(1, seed=9)[0]
    trainer.scale(F.cross_entropy(model(x.half()).float(), y) * math.inf).backward()
    assert not bool(trainer.step())
    assert all(torch.equal(p, params_before[k]) for k, p in model.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(af.tree.tree_leaves(trainer.state.master),
                                                 af.tree.tree_leaves(state_before.master)))
    assert all(torch.equal(a, b) for a, b in zip(af.tree.tree_leaves(trainer.state.opt_state),
                                                 af.tree.tree_leaves(state_before.opt_state)))
    assert float(trainer.loss_scale.loss_scale) == 2.0**7


def test_module_trainer_gives_unused_parameters_a_zero_gradient():
    model = mlp(batchnorm=False)
    trainer = af.ModuleTrainer(model, af.sgd(0.1))
    last = model[2].weight.detach().clone()
    x, _ = batches(1)[0]
    model[0](x).sum().backward()  # the last layer takes no part
    assert bool(trainer.step())
    assert torch.equal(model[2].weight, last)


def test_module_trainer_state_round_trips_through_torch_save(tmp_path):
    model = mlp()
    trainer = af.ModuleTrainer(model, af.adam(1e-2), loss_scale=af.DynamicLossScale(2.0**8, growth_interval=1))
    x, y = batches(1)[0]
    trainer.scale(F.cross_entropy(model(x), y)).backward()
    trainer.step()
    torch.save(trainer.state_dict(), tmp_path / "trainer.pt")
    fresh = af.ModuleTrainer(copy.deepcopy(model), af.adam(1e-2),
                             loss_scale=af.DynamicLossScale(2.0**8, growth_interval=1))
    fresh.load_state_dict(torch.load(tmp_path / "trainer.pt"))
    assert float(fresh.loss_scale.loss_scale) == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(af.tree.tree_leaves(fresh.state), af.tree.tree_leaves(trainer.state)))
    other_config = af.ModuleTrainer(mlp(), af.adam(1e-2), loss_scale=af.DynamicLossScale(2.0**8))
    with pytest.raises(ValueError, match="different tree structures"):
        other_config.load_state_dict(torch.load(tmp_path / "trainer.pt"))


def test_module_trainer_refuses_bad_input_clearly():
    with pytest.raises(TypeError, match="tx.inner"):
        af.ModuleTrainer(mlp(), af.mixed_precision(af.sgd(0.1), af.DynamicLossScale()))
    frozen = mlp()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        af.ModuleTrainer(frozen, af.sgd(0.1))
    trainer = af.ModuleTrainer(mlp(), af.sgd(0.1, momentum=0.9))
    with pytest.raises(TypeError, match="TrainerState"):
        trainer.state = {"opt_state": None}


@pytest.mark.parametrize("inplace", [False, True])
def test_make_train_step_refuses_a_state_of_another_model_or_policy_naming_the_leaf(inplace):
    def train_step(hidden, policy="full"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
        return af.make_train_step(model, lambda f, x: f(x).sum(), af.sgd(0.1), policy)

    x = torch.randn(2, 8)
    small = train_step(16)
    for other, pattern in ((train_step(32), r"leaf '0\.weight' is \(16, 8\) torch.float32, but this model and "
                                            r"policy give \(32, 8\)"),
                           (train_step(16, "p=bf16"), r"leaf '0\.weight' is \(16, 8\) torch.float32, but .* "
                                                      r"torch.bfloat16")):
        state = small.init()
        before = [t.clone() for t in af.tree.tree_leaves(state) if isinstance(t, torch.Tensor)]
        with pytest.raises(ValueError, match=pattern):
            (other.step_ if inplace else other.step)(state, x)
        after = [t for t in af.tree.tree_leaves(state) if isinstance(t, torch.Tensor)]
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    # its own state still steps, many times (the check is paid once per state)
    state = small.init()
    for _ in range(3):
        state, _ = (small.step_ if inplace else small.step)(state, x)
    assert int(state.skipped) == 0


def test_value_and_grad_takes_negative_argnums_as_torch_func_does():
    def loss_fn(w, b, x):
        return ((w * x).sum() + b.square().sum()) ** 2
    w, b, x = torch.randn(3), torch.randn(3), torch.randn(3)
    for argnums in (-1, -2, (0, -1)):
        _, grads, finite = af.value_and_grad(loss_fn, argnums)(af.StaticLossScale(1024.0), w, b, x)
        want = torch.func.grad(loss_fn, argnums)(w, b, x)
        assert bool(finite)
        several = isinstance(argnums, tuple)
        for g, t in zip(grads if several else (grads,), want if several else (want,)):
            assert isinstance(g, torch.Tensor)  # never the loss scale's gradient
            torch.testing.assert_close(g, t)
