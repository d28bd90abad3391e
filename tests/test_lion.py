"""af.lion (Chen et al. 2023, as optax.lion): against a reference written from the paper's update
(not the kernels' reference twin), on the compiled CPU kernels and the reference backend; the
CPU kernel against its twin bit for bit; every path (mixed_precision step/step_/update,
make_train_step, ModuleTrainer, torch.compile(fullgraph=True)); bad inputs; a skipped step."""

import math

import pytest
import torch
import torch.nn.functional as F

import ampfunc as af
from ampfunc import ops

BACKENDS = ["compiled", "reference"]


def paper(p, g, m, lr, b1, b2, wd):
    """The paper's update (Algorithm 2 with decoupled weight decay) in float64, per element."""
    p, g, m = p.double(), g.double(), m.double()
    c = b1 * m + (1 - b1) * g
    new_p = p - lr * (torch.sign(c) + wd * p)
    new_m = b2 * m + (1 - b2) * g
    return new_p, new_m


def _tree(seed=0, shapes=((31,), (4, 5), (1,), (0,))):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    mus = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    return params, grads, mus


REFERENCE_CALLS = []


def _backend(backend, monkeypatch):
    if backend == "compiled":
        if ops.backend() == "reference":
            pytest.skip("compiled kernels not built")
        return
    # the reference backend: every op call goes to its reference kernel (the generated op
    # functions look _call up in the ampfunc.ops package, so that is where it is replaced)
    REFERENCE_CALLS.clear()
    monkeypatch.setattr(ops._loading, "_DIRECT", [None])
    monkeypatch.setattr(ops, "_call", _reference_call)


def _reference_call(name, *args):
    REFERENCE_CALLS.append(name)
    return ops._REFERENCE[name](*args)


def _ran_on(backend):
    """The Lion ops of the test ran on ``backend`` (the reference's calls are counted)."""
    lion_calls = [n for n in REFERENCE_CALLS if n.startswith("lion_")]
    return bool(lion_calls) if backend == "reference" else True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_step_is_the_papers_update(backend, wd, monkeypatch):
    _backend(backend, monkeypatch)
    lr, b1, b2 = 1e-2, 0.9, 0.99
    params, grads, mus = _tree()
    want = [paper(p, g, m, lr, b1, b2, wd) for p, g, m in zip(params, grads, mus)]
    step = torch.zeros(())
    ops.lion_step_(params, grads, mus, None, step, torch.ones(()), torch.tensor(True), lr=lr, beta1=b1, beta2=b2,
                   weight_decay=wd)
    for p, m, (wp, wm) in zip(params, mus, want):
        assert torch.allclose(p.double(), wp, rtol=0, atol=1e-6)
        assert torch.allclose(m.double(), wm, rtol=0, atol=1e-6)
    assert step.item() == 1.0
    assert _ran_on(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sign_of_zero_is_zero_and_grad_scale_multiplies_first(backend, monkeypatch):
    _backend(backend, monkeypatch)
    p, m = [torch.tensor([1.0, 1.0, 1.0])], [torch.zeros(3)]
    g = [torch.tensor([0.0, 4.0, -4.0])]
    ops.lion_step_(p, g, m, None, torch.zeros(()), torch.tensor(0.25), torch.tensor(True), lr=0.5)
    assert p[0].tolist() == [1.0, 0.5, 1.5]  # sign(0) = 0: that element does not move
    assert torch.allclose(m[0], torch.tensor([0.0, 0.01, -0.01]))  # (1 - 0.99) * 0.25 * g


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_place_step_and_update_agree_with_the_in_place_step(backend, monkeypatch):
    _backend(backend, monkeypatch)
    params, grads, mus = _tree(1)
    model = [p.half() for p in params]
    kw = dict(lr=3e-3, beta1=0.8, beta2=0.95, weight_decay=0.05)
    step, gs, finite = torch.tensor(3.0), torch.tensor(0.5), torch.tensor(True)
    new_p, new_m, new_model, new_step = ops.lion_step(params, grads, mus, model, step, gs, finite, **kw)
    d, upd_m, upd_step = ops.lion_update(params, grads, mus, step, gs, **kw)
    ip, im, imodel = [p.clone() for p in params], [m.clone() for m in mus], [x.clone() for x in model]
    istep = step.clone()
    ops.lion_step_(ip, grads, im, imodel, istep, gs, finite, **kw)
    for a, b in zip(new_p, ip):
        assert torch.equal(a, b)
    for a, b in zip(new_m + upd_m, im + im):
        assert torch.equal(a, b)
    for a, b in zip(new_model, imodel):
        assert torch.equal(a, b) and a.dtype == torch.float16
    for p, delta, b in zip(params, d, ip):  # the update lands on the step's params within one rounding
        assert torch.allclose(p + delta, b, rtol=0, atol=1e-6)
    assert new_step.item() == upd_step.item() == istep.item() == 4.0


def test_the_cpu_kernel_is_its_reference_twin_bit_for_bit():
    if ops.backend() == "reference":
        pytest.skip("compiled kernels not built")
    for wd, lr in [(0.0, 1e-3), (0.1, 3e-2), (0.1, torch.tensor(2e-3))]:
        params, grads, mus = _tree(2, shapes=((1000,), (37, 3), (5,)))
        grads = [g.bfloat16() for g in grads]
        rp, rm = [p.clone() for p in params], [m.clone() for m in mus]
        step, rstep = torch.tensor(5.0), torch.tensor(5.0)
        ops.lion_step_(params, grads, mus, None, step, torch.tensor(0.75), torch.tensor(True), lr=lr, weight_decay=wd)
        ops._REFERENCE["lion_step_"](rp, grads, rm, [], rstep, torch.tensor(0.75), torch.tensor(True),
                                     0.0 if isinstance(lr, torch.Tensor) else lr,
                                     lr if isinstance(lr, torch.Tensor) else None, 0.9, 0.99, wd)
        assert all(torch.equal(a, b) for a, b in zip(params + mus, rp + rm))
        assert step.item() == rstep.item() == 6.0
        d, m, _ = ops.lion_update(rp, grads, rm, rstep, lr=lr, weight_decay=wd)
        rd, rm2, _ = ops._REFERENCE["lion_update"](rp, grads, rm, rstep, torch.ones(()),
                                                   0.0 if isinstance(lr, torch.Tensor) else lr,
                                                   lr if isinstance(lr, torch.Tensor) else None, 0.9, 0.99, wd)
        assert all(torch.equal(a, b) for a, b in zip(d + m, rd + rm2))


def test_the_cpu_kernel_is_its_twin_on_zeros_infinities_and_nans_too():
    # sign(c) at +-0, +-inf and NaN, every lane of a vector and the scalar tail alike
    if ops.backend() == "reference":
        pytest.skip("compiled kernels not built")
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 3.0, -3.0])
    n = 101  # not a multiple of the vector width: a partial tail
    g = specials.repeat(12)[:n].clone()
    m = specials.flip(0).repeat(12)[:n].clone()
    p = torch.linspace(-1, 1, n)
    for wd in (0.0, 0.1):
        kp, km, rp, rm = [p.clone()], [m.clone()], [p.clone()], [m.clone()]
        ops.lion_step_(kp, [g], km, None, torch.zeros(()), torch.ones(()), torch.tensor(True), lr=0.5,
                       weight_decay=wd)
        ops._REFERENCE["lion_step_"](rp, [g], rm, [], torch.zeros(()), torch.ones(()), torch.tensor(True), 0.5, None,
                                     0.9, 0.99, wd)
        for a, b in zip(kp + km, rp + rm):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(a.signbit(), b.signbit())  # the sign of a zero too
        d, dm, _ = ops.lion_update([p], [g], [m], torch.zeros(()), lr=0.5, weight_decay=wd)
        rd, rdm, _ = ops._REFERENCE["lion_update"]([p], [g], [m], torch.zeros(()), torch.ones(()), 0.5, None, 0.9,
                                                   0.99, wd)
        for a, b in zip(d + dm, rd + rdm):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_step_changes_nothing(backend, monkeypatch):
    _backend(backend, monkeypatch)
    params, grads, mus = _tree(3)
    before = [t.clone() for t in params + mus]
    step = torch.tensor(2.0)
    ops.lion_step_(params, grads, mus, None, step, torch.ones(()), torch.tensor(False), lr=0.1, weight_decay=0.1)
    assert all(torch.equal(a, b) for a, b in zip(params + mus, before)) and step.item() == 2.0
    new_p, new_m, _, new_step = ops.lion_step(params, grads, mus, None, step, torch.ones(()), torch.tensor(False),
                                              lr=0.1)
    assert all(torch.equal(a, b) for a, b in zip(new_p + new_m, before)) and new_step.item() == 2.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_are_refused_by_name_before_any_write(backend, monkeypatch):
    _backend(backend, monkeypatch)
    params, grads, mus = _tree(4)
    before = [t.clone() for t in params + mus]
    step, gs, ok = torch.zeros(()), torch.ones(()), torch.tensor(True)
    with pytest.raises(TypeError, match=r"exp_avgs\[1\] has dtype torch.float16; exp_avgs take float32 \(lion_step_\)"):
        ops.lion_step_(params, grads, [mus[0], mus[1].half(), mus[2], mus[3]], None, step, gs, ok, lr=0.1)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(30,\) but params\[0\] has shape \(31,\)"):
        ops.lion_step_(params, [grads[0][:30]] + grads[1:], mus, None, step, gs, ok, lr=0.1)
    with pytest.raises(ValueError, match=r"params\[0\] and exp_avgs\[0\] overlap in memory"):
        ops.lion_step_(params, grads, [params[0]] + mus[1:], None, step, gs, ok, lr=0.1)
    with pytest.raises(ValueError, match=r"weight_decay != 0 needs params \(lion_update\)"):
        ops.lion_update([], grads, mus, step, lr=0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"exp_avgs has 3 tensors but params has 4"):
        ops.lion_step_(params, grads, mus[:3], None, step, gs, ok, lr=0.1)
    assert all(torch.equal(a, b) for a, b in zip(params + mus, before)) and step.item() == 0.0


@pytest.mark.parametrize("bad, match", [
    (dict(lr=-1.0), r"learning rate"),
    (dict(lr=1e-3, b1=1.5), r"lion: b1 must be a number in \[0, 1\)"),
    (dict(lr=1e-3, b2=-0.1), r"lion: b2 must be a number in \[0, 1\)"),
    (dict(lr=1e-3, b2=1.0), r"lion: b2 must be a number in \[0, 1\)"),
    (dict(lr=1e-3, b1=True), r"lion: b1"),
    (dict(lr=1e-3, weight_decay=-0.1), r"weight_decay"),
])
def test_the_transform_refuses_bad_settings_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        af.lion(**bad)


def test_the_transform_refuses_a_foreign_state_and_a_decay_without_params():
    params = {"w": torch.ones(3)}
    with pytest.raises(TypeError, match=r"lion: state is AdamState, expected LionState"):
        af.lion(1e-3).update(params, af.adamw(1e-3).init(params), params)
    with pytest.raises(ValueError, match=r"lion: weight_decay != 0 needs params"):
        af.lion(1e-3, weight_decay=0.1).update(params, af.lion(1e-3).init(params))


def test_the_transform_matches_the_paper_fused_and_generic():
    params = {"a": torch.randn(50), "b": torch.randn(3, 4)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = af.lion(1e-2, b1=0.9, b2=0.99, weight_decay=0.1)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    new = af.apply_updates(params, updates)
    for k in params:
        want, want_m = paper(params[k], grads[k], torch.zeros_like(params[k]), 1e-2, 0.9, 0.99, 0.1)
        assert torch.allclose(new[k].double(), want, atol=1e-6) and torch.allclose(state.mu[k].double(), want_m)
    # the generic path (float64 params: the kernels take fp32 only) computes the same update
    p64 = {k: v.double() for k, v in params.items()}
    u64, s64 = tx.update({k: v.double() for k, v in grads.items()}, tx.init(p64), p64)
    for k in params:
        assert torch.allclose(u64[k], updates[k].double(), atol=1e-6)
    assert state.step.item() == s64.step.item() == 1.0


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _batches(n=4, skip=2):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        out.append((torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g),
                    torch.tensor(math.inf if i == skip else 1.0)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_path_takes_the_fused_kernel_and_gives_one_trajectory(backend, monkeypatch):
    _backend(backend, monkeypatch)
    calls = []
    for name in ("lion_step_", "lion_step_checked_", "lion_step", "lion_step_checked", "lion_update"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    batches = _batches()

    def loss_fn(forward, x, y, w):
        return F.cross_entropy(forward(x), y) * w

    # make_train_step (pure) and ModuleTrainer (in place)
    train = af.make_train_step(_net(), loss_fn, af.lion(1e-3, weight_decay=0.1), af.get_policy("full"),
                               loss_scale=af.NoOpLossScale())
    state = train.init()
    for b in batches:
        state, out = train.step(state, *b)
    model = _net()
    trainer = af.ModuleTrainer(model, af.lion(1e-3, weight_decay=0.1), loss_scale=af.NoOpLossScale())
    for x, y, w in batches:
        trainer.scale(F.cross_entropy(model(x), y) * w).backward()
        trainer.step()  # the inf-weighted batch: skipped
    assert "lion_step_checked_" in calls and any(c in calls for c in ("lion_step", "lion_step_checked"))
    assert int(state.skipped) == int(trainer.skipped) == 1
    for (name, a), b in zip(state.params.items(), model.parameters()):
        assert torch.allclose(a, b.detach(), atol=1e-6), name

    # mixed_precision: step, step_ and update give the same params
    params = dict(_net().named_parameters())
    params = {k: v.detach().clone() for k, v in params.items()}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = af.mixed_precision(af.lion(1e-3, weight_decay=0.1), loss_scale=af.NoOpLossScale())
    p1, s1 = tx.step(params, grads, tx.init(params))
    p2 = {k: v.clone() for k, v in params.items()}
    s2 = tx.init(p2)
    tx.step_(p2, grads, s2)
    upd, s3 = tx.update(grads, tx.init(params), params)
    p3 = af.apply_updates(params, upd)
    for k in params:
        assert torch.equal(p1[k], p2[k])
        assert torch.allclose(p1[k], p3[k], atol=1e-6)
        want, want_m = paper(params[k], grads[k], torch.zeros_like(params[k]), 1e-3, 0.9, 0.99, 0.1)
        assert torch.allclose(p1[k].double(), want, rtol=0, atol=1e-6)
        assert torch.allclose(s1.inner.mu[k].double(), want_m, rtol=0, atol=1e-6)
    assert s1.inner.step.item() == 1.0
    assert _ran_on(backend)


@pytest.mark.slow
def test_compiled_fullgraph_lion_step_equals_eager():
    if ops.backend() == "reference":
        pytest.skip("compiled kernels not built")

    def step_fn(params, grads, mus, step, scale):
        finite, _ = ops.check(grads)
        ops.lion_step_(params, grads, mus, None, step, scale.reciprocal(), finite, lr=1e-2, weight_decay=0.1)
        return finite

    def state():
        params, _, mus = _tree(5, shapes=((31,), (7, 5)))
        return params, mus, torch.zeros(())

    eager, compiled = state(), state()
    fn = torch.compile(step_fn, fullgraph=True)
    for i in range(3):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for s in ((31,), (7, 5))]
        if i == 1:
            grads[0][3] = math.inf
        fe = step_fn(eager[0], grads, eager[1], eager[2], torch.tensor(2.0))
        fc = fn(compiled[0], grads, compiled[1], compiled[2], torch.tensor(2.0))
        assert bool(fe) == bool(fc) == (i != 1)
    for a, b in zip(eager[0] + eager[1], compiled[0] + compiled[1]):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert eager[2].item() == compiled[2].item() == 2.0


@pytest.mark.slow
def test_compiled_fullgraph_train_step_with_clip_and_lion_equals_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    if ops.backend() == "reference":
        pytest.skip("compiled kernels not built")
    torch._dynamo.reset()

    def loss_fn(forward, x, y, w):
        return F.cross_entropy(forward(x), y) * w

    train = af.make_train_step(_net(), loss_fn, af.chain(af.clip_by_global_norm(0.5), af.lion(1e-3, weight_decay=0.1)),
                               af.get_policy("full"), loss_scale=af.DynamicLossScale(2.0**10, growth_interval=2))
    batches = _batches(5)
    eager, compiled_state = train.init(), train.init()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(train.step, fullgraph=True, backend=counter)  # a graph break raises
    for b in batches:
        eager, out_e = train.step(eager, *b)
        compiled_state, out_c = compiled(compiled_state, *b)
        assert bool(out_e.finite) == bool(out_c.finite)
    assert counter.frame_count == 1
    assert int(eager.skipped) == int(compiled_state.skipped) == 1
    for (path, a), (_, b) in zip(af.tree.leaves_with_paths(eager), af.tree.leaves_with_paths(compiled_state)):
        if torch.is_floating_point(a):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), path


def test_lion_state_round_trips_through_torch_load(tmp_path):
    state = af.lion(1e-3).init({"w": torch.ones(3)})
    torch.save(state, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt")  # weights_only by default: LionState is an allowed global
    assert type(back).__name__ == "LionState" and torch.equal(back.mu["w"], state.mu["w"])
