"""torch.amp.GradScaler's private surface that frameworks reach into, side by side with torch.

Frameworks (Lightning's precision plugins, FSDP's ShardedGradScaler, accelerate's skip
detection, timm) call ``_unscale_grads_``, ``_lazy_init_scale_growth_tracker``,
``_check_inf_per_device`` / ``_found_inf_per_device`` and read ``_per_optimizer_states``. Every
test runs the same calls on ``torch.amp.GradScaler("cpu")`` and on the facade and compares.

Ported from PyTorch's own CPU GradScaler tests (``test/test_torch.py``), rewritten here:
``test_grad_scaling_unscale_sparse`` (``_unscale_grads_`` on sparse, coalesced-overflow and
fp16 grads), and the per-optimizer-state checks those tests and ``test_grad_scaling_*`` rely on.
The clipping / separate-unscale / accumulation / penalty / multiple-optimizer workflows are in
``tests/test_compat_torch_amp.py``.
"""

import collections

import pytest
import torch
from torch.amp.grad_scaler import OptState as TorchOptState
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from ampfunc.compat.torch_amp import GradScaler, OptState

CPU = torch.device("cpu")


def _pair(**kw):
    return torch.amp.GradScaler("cpu", **kw), GradScaler("cpu", **kw)


def _opt_with_grads(grads, lr=0.1):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return torch.optim.SGD(params, lr=lr)


def _same_state(a: dict, b: dict):
    assert set(a) == set(b) == {"stage", "found_inf_per_device"}
    assert a["stage"] is b["stage"]
    assert set(a["found_inf_per_device"]) == set(b["found_inf_per_device"])
    for dev, t in a["found_inf_per_device"].items():
        u = b["found_inf_per_device"][dev]
        assert (u.dtype, u.shape, u.device) == (t.dtype, t.shape, t.device) and torch.equal(u, t)


def test_opt_state_and_fresh_entries_are_torchs_own():
    theirs, ours = _pair()
    assert OptState is TorchOptState
    assert ours._per_optimizer_states.default_factory is _refresh_per_optimizer_state
    _same_state(theirs._per_optimizer_states[0], ours._per_optimizer_states[0])
    assert ours._per_optimizer_states[1] == _refresh_per_optimizer_state() == {"stage": TorchOptState.READY,
                                                                              "found_inf_per_device": {}}


@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_per_optimizer_states_through_an_iteration(poison):
    grads = [torch.full((3, 4), 2.0), torch.arange(5.0)]
    if poison is not None:
        grads[1][2] = poison
    theirs, ours = _pair(init_scale=4.0)
    states = []
    for scaler in (theirs, ours):
        opt = _opt_with_grads(grads)
        scaler.scale(torch.tensor(1.0))
        scaler.unscale_(opt)
        after_unscale = dict(scaler._per_optimizer_states[id(opt)])
        assert after_unscale["stage"] is TorchOptState.UNSCALED
        seen = {d: t.clone() for d, t in scaler._found_inf_per_device(opt).items()}
        scaler.step(opt)
        after_step = scaler._per_optimizer_states[id(opt)]
        assert after_step["stage"] is TorchOptState.STEPPED
        # accelerate-style skip detection: sum of the per-device flags after step().
        skipped = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        scaler.update()
        states.append((after_unscale, seen, skipped, [p.detach().clone() for p in opt.param_groups[0]["params"]],
                       scaler.get_scale(), len(scaler._per_optimizer_states)))
    (a_un, a_seen, a_skip, a_p, a_scale, a_n), (b_un, b_seen, b_skip, b_p, b_scale, b_n) = states
    _same_state(a_un, b_un)
    assert a_seen.keys() == b_seen.keys() == {CPU} and all(torch.equal(a_seen[d], b_seen[d]) for d in a_seen)
    assert a_skip == b_skip == (0.0 if poison is None else 1.0)
    assert a_scale == b_scale and a_n == b_n == 0
    for x, y in zip(a_p, b_p):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_unscale_grads_dense_like_torch_including_fp16_rules():
    for grads, allow_fp16 in [([torch.full((4,), 8.0), torch.full((2, 2), -4.0)], False),
                              ([torch.tensor([1.0, float("inf")])], False),
                              ([torch.full((3,), 8.0, dtype=torch.bfloat16)], False),
                              ([torch.full((3,), 8.0, dtype=torch.float16)], True),
                              ([torch.tensor([float("nan")], dtype=torch.float16)], True)]:
        results = []
        for scaler in _pair():
            opt = _opt_with_grads(grads)
            inv_scale = torch.full((), 0.25)
            found_inf = torch.full((), 0.0)
            out = scaler._unscale_grads_(opt, inv_scale, found_inf, allow_fp16)
            assert found_inf.item() == 0.0  # the caller's tensor is copied per device, not written
            results.append((out, [p.grad.clone() for p in opt.param_groups[0]["params"]]))
        (a, ga), (b, gb) = results
        assert a.keys() == b.keys() == {CPU}
        assert a[CPU].dtype == b[CPU].dtype and a[CPU].shape == b[CPU].shape and torch.equal(a[CPU], b[CPU])
        for x, y in zip(ga, gb):
            assert x.dtype == y.dtype
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    for scaler in _pair():
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            scaler._unscale_grads_(_opt_with_grads([torch.ones(2, dtype=torch.float16)]), torch.ones(()),
                                   torch.zeros(()), False)
        assert scaler._unscale_grads_(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0), torch.ones(()),
                                      torch.zeros(()), False) == {}


def test_unscale_grads_sparse_port_of_torch_test_grad_scaling_unscale_sparse():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    cases = [  # (values, dtype, allow_fp16, expected found_inf)
        (torch.tensor([16.0, 32.0, 64.0]), torch.float32, False, 0.0),
        (torch.tensor([16.0, 32.0, float("inf")]), torch.float32, False, 1.0),
        (torch.tensor([16.0, 32.0, float("nan")]), torch.float32, False, 1.0),
        (torch.tensor([16.0, 32.0, 64.0]), torch.float16, True, 0.0),
    ]
    uncoalesced = (torch.tensor([[0, 1, 0], [2, 0, 2]]), torch.tensor([64000.0, 32.0, 64000.0]))
    for scaler in _pair():
        # torch's test shapes inv_scale and found_inf as 1-element tensors.
        inv_scale, found_inf = torch.full((1,), 0.25), torch.empty((1,))
        for values, dtype, allow_fp16, expected in cases:
            s = torch.sparse_coo_tensor(i, values, (2, 3), dtype=dtype)
            p = torch.nn.Parameter(s.clone())
            p.grad = s.clone()
            opt = torch.optim.SGD([p], lr=1.0)
            found_inf.zero_()
            got = scaler._unscale_grads_(opt, inv_scale, found_inf, allow_fp16)[CPU]
            assert got.item() == expected, (type(scaler), values, dtype)
            if expected == 0.0:
                assert torch.equal(p.grad.to_dense(), (s / 4).to_dense())
        # Coalescing adds 64000 + 64000, which overflows fp16: the coalesced values are checked.
        p = torch.nn.Parameter(torch.sparse_coo_tensor(i, torch.ones(3), (2, 3), dtype=torch.float16))
        p.grad = torch.sparse_coo_tensor(*uncoalesced, (2, 3), dtype=torch.float16)
        found_inf.zero_()
        got = scaler._unscale_grads_(torch.optim.SGD([p], lr=1.0), inv_scale, found_inf, True)[CPU]
        assert got.item() == 1.0 and p.grad.is_coalesced()


def test_lazy_init_scale_growth_tracker_like_torch():
    for scaler in _pair(init_scale=128.0):
        assert scaler._scale is None and scaler._growth_tracker is None
        with pytest.raises(AssertionError, match="Attempted update but _scale is None"):
            scaler._check_scale_growth_tracker("update")
        scaler._lazy_init_scale_growth_tracker(CPU)
        scale, tracker = scaler._check_scale_growth_tracker("step")
        assert scale is scaler._scale and tracker is scaler._growth_tracker
        assert (scale.dtype, scale.shape, scale.item()) == (torch.float32, torch.Size([]), 128.0)
        assert (tracker.dtype, tracker.shape, tracker.item()) == (torch.int32, torch.Size([]), 0)
        with pytest.raises(AssertionError, match="_growth_tracker initialized before _scale"):
            scaler._lazy_init_scale_growth_tracker(CPU)
        assert scaler.scale(torch.tensor(2.0)).item() == 256.0  # scale() uses the initialized tensors


def test_check_inf_per_device_leaves_grads_and_feeds_update():
    grads = [torch.tensor([3.0, float("inf")]), torch.ones(2)]
    results = []
    for scaler in _pair(init_scale=8.0):
        opt = _opt_with_grads(grads)
        scaler.scale(torch.tensor(1.0))
        out = scaler._check_inf_per_device(opt)
        assert out is scaler._found_inf_per_device(opt)
        assert scaler._per_optimizer_states[id(opt)]["stage"] is TorchOptState.READY
        grads = [p.grad.clone() for p in opt.param_groups[0]["params"]]
        results.append(({d: t.clone() for d, t in out.items()}, grads))
        scaler.update()  # the recorded check is what update() backs off on
        results[-1] += (scaler.get_scale(),)
    (a, ga, sa), (b, gb, sb) = results
    assert a.keys() == b.keys() and all(torch.equal(a[d], b[d]) for d in a)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb)) and torch.equal(ga[1], grads[1])
    assert sa == sb == 4.0


def test_a_subclass_overriding_unscale_grads_is_used_by_unscale_():
    # FSDP's ShardedGradScaler pattern: subclasses hook _unscale_grads_; the facade routes through it.
    calls = collections.Counter()

    class Counting(GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            calls[allow_fp16] += 1
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    scaler = Counting("cpu", init_scale=2.0)
    opt = _opt_with_grads([torch.full((2,), 4.0)])
    scaler.scale(torch.tensor(1.0))
    scaler.step(opt)
    scaler.update()
    assert calls == {False: 1} and torch.equal(opt.param_groups[0]["params"][0], torch.full((2,), -0.2))


# ---------------------------------------------------------------------------------------------
# _maybe_opt_step: the hook step() routes a plain optimizer through
# ---------------------------------------------------------------------------------------------


class _TaggedSGD(torch.optim.SGD):
    """SGD whose step takes extra arguments, to see step()'s *args/**kwargs reach it."""

    def step(self, closure=None, *, tag=None):
        self.tags = getattr(self, "tags", []) + [tag]
        return super().step(closure)


@pytest.mark.parametrize("poison", [False, True], ids=["finite", "inf"])
def test_step_goes_through_maybe_opt_step_with_torchs_arguments(poison):
    grads = [torch.tensor([4.0, float("inf") if poison else 8.0])]
    seen = []
    for base in (torch.amp.GradScaler, GradScaler):
        class Recording(base):
            def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
                calls.append((optimizer is opt, optimizer_state is self._per_optimizer_states[id(opt)],
                              optimizer_state["stage"], args, kwargs))
                return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

        calls = []
        scaler = Recording("cpu", init_scale=4.0)
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt = _TaggedSGD(params, lr=1.0)
        scaler.scale(torch.tensor(1.0))
        retval = scaler.step(opt, None, tag="x")
        seen.append((calls, retval, getattr(opt, "tags", []), params[0].detach().clone()))
        scaler.update()
    (c_theirs, r_theirs, t_theirs, p_theirs), (c_ours, r_ours, t_ours, p_ours) = seen
    assert c_ours == c_theirs == [(True, True, TorchOptState.UNSCALED, (None,), {"tag": "x"})]
    assert r_ours is r_theirs is None and t_ours == t_theirs == ([] if poison else ["x"])
    assert torch.equal(p_ours, p_theirs)


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, GradScaler], ids=["torch", "ampfunc"])
def test_a_maybe_opt_step_override_decides_the_step(cls):
    # NeMo / torch_xla pattern: the override combines found_inf across ranks (here: another rank
    # overflowed) and decides; the step must be skipped and update() must back off.
    class OtherRankOverflowed(cls):
        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
            for found_inf in optimizer_state["found_inf_per_device"].values():
                found_inf.fill_(1.0)  # all_reduce(found_inf, MAX) in the real thing
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    scaler = OtherRankOverflowed("cpu", init_scale=4.0)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    assert p.detach().tolist() == [1.0, 1.0, 1.0]
    scaler.update()
    assert scaler.get_scale() == 2.0
    if cls is GradScaler:  # return_found_inf reports the flags as the override left them
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        assert scaler.step(opt, return_found_inf=True) == (None, torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------
# torch's private attributes: readable and assignable with torch's meaning
# ---------------------------------------------------------------------------------------------


def _iterations(scaler, n, overflow_at=(), lr=0.1):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=lr)
    out = []
    for i in range(n):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if i in overflow_at:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return out, p.detach().clone()


def test_settings_attributes_are_torchs_readable_and_assignable_with_effect():
    # A subclass configuring itself through torch's attributes (the "constant scaler" and FSDP's
    # ShardedGradScaler read/write them); update() must use what was assigned.
    results = []
    for base in (torch.amp.GradScaler, GradScaler):
        class Configured(base):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                assert (self._init_scale, self._growth_factor, self._backoff_factor, self._growth_interval,
                        self._enabled) == (2.0**16, 2.0, 0.5, 2000, True)
                self._init_scale = 8.0
                self._growth_factor = 4.0
                self._backoff_factor = 0.25
                self._growth_interval = 1

        scaler = Configured("cpu")
        results.append((_iterations(scaler, 5, overflow_at={2, 3}), scaler.state_dict(),
                        (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())))
    (traj_theirs, sd_theirs, g_theirs), (traj_ours, sd_ours, g_ours) = results
    assert traj_ours[0] == traj_theirs[0] and torch.equal(traj_ours[1], traj_theirs[1])
    assert [s for s, _ in traj_ours[0]] == [32.0, 128.0, 32.0, 8.0, 32.0]
    assert sd_ours == sd_theirs and g_ours == g_theirs == (4.0, 0.25, 1)


@pytest.mark.parametrize("name, value, rule", [
    ("_growth_factor", 1.0, "growth_factor must be a finite number > 1"),
    ("_backoff_factor", 1.0, r"backoff_factor must be in \(0, 1\)"),
    ("_growth_interval", 0, "growth_interval must be an integer >= 1"),
    ("_init_scale", 0.0, "must be a finite number in"),
    ("_init_scale", 2.0**30, r"lies outside \[min_scale, max_scale\] = \[1.0, 1024.0\]"),
])
def test_settings_attributes_refuse_what_the_setters_refuse_naming_the_attribute(name, value, rule):
    scaler = GradScaler("cpu", init_scale=8.0, min_scale=1.0, max_scale=1024.0)
    scaler.scale(torch.tensor(1.0))
    before = (scaler._settings(), scaler._init_scale, scaler.state_dict())
    with pytest.raises(ValueError, match=rf"GradScaler\.{name}\b.*{rule}"):
        setattr(scaler, name, value)
    assert (scaler._settings(), scaler._init_scale, scaler.state_dict()) == before


def test_a_unit_factor_is_refused_with_the_constant_scale_recipe_that_works():
    scaler = GradScaler("cpu")
    with pytest.raises(ValueError, match=r"constant scale .*min_scale=s, max_scale=s"):
        scaler._backoff_factor = 1.0
    with pytest.raises(ValueError, match=r"set_growth_factor: .*constant scale"):
        scaler.set_growth_factor(1.0)
    traj, _ = _iterations(GradScaler("cpu", init_scale=8.0, min_scale=8.0, max_scale=8.0, growth_interval=1), 4,
                          overflow_at={1, 3})
    assert [s for s, _ in traj] == [8.0] * 4


def _torch_and_ours_after(actions, **kw):
    out = []
    for cls in (torch.amp.GradScaler, GradScaler):
        scaler = cls("cpu", init_scale=8.0, growth_interval=2, **kw)
        trace = []
        for act in actions:
            try:
                trace.append(("ok", act(scaler)))
            except AssertionError as e:  # torch's state-machine errors
                trace.append(("AssertionError", str(e)))
        out.append(trace)
    return out


def _one_iteration(scaler):
    return _iterations(scaler, 1)[0][0]


@pytest.mark.parametrize("scenario", ["reset_both", "reset_scale_only", "reset_tracker_only", "assign_scale",
                                      "assign_tracker", "scale_times_half", "scale_before_first_scale_call",
                                      "copy_from_another_scaler"])
def test_scale_and_growth_tracker_assignments_mean_what_they_mean_in_torch(scenario):
    def assign(**attrs):
        def act(scaler):
            for name, value in attrs.items():
                setattr(scaler, name, value() if callable(value) else value)
        return act

    def scale_one(scaler):
        return scaler.scale(torch.tensor(1.0)).item()

    def copy_from_another(scaler):
        other = type(scaler)("cpu", init_scale=256.0)
        other.scale(torch.tensor(1.0))
        scaler._scale, scaler._growth_tracker = other._scale.clone(), other._growth_tracker.clone()

    def times_half(scaler):
        scaler._scale *= 0.5  # FSDP's ShardedGradScaler._amp_update_scale_cpu_ backoff
        return scaler.get_scale()

    actions = {
        "reset_both": [_one_iteration, _one_iteration, assign(_scale=None, _growth_tracker=None), _one_iteration],
        "reset_scale_only": [_one_iteration, assign(_scale=None), scale_one, _one_iteration],
        "reset_tracker_only": [_one_iteration, assign(_growth_tracker=None), scale_one, _one_iteration],
        "assign_scale": [_one_iteration, assign(_scale=lambda: torch.tensor(64.0)), _one_iteration, _one_iteration],
        "assign_tracker": [_one_iteration, assign(_growth_tracker=lambda: torch.tensor(1, dtype=torch.int32)),
                           _one_iteration, _one_iteration],
        "scale_times_half": [_one_iteration, times_half, _one_iteration],
        "scale_before_first_scale_call": [assign(_scale=lambda: torch.tensor(32.0)), scale_one, _one_iteration],
        "copy_from_another_scaler": [_one_iteration, copy_from_another, _one_iteration, _one_iteration],
    }[scenario]
    theirs, ours = _torch_and_ours_after(actions)
    assert ours == theirs


def test_an_assigned_scale_tensor_is_held_as_torch_holds_it():
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.tensor(1.0))
    mine = torch.tensor(64.0)
    scaler._scale = mine
    assert scaler._scale is mine and scaler._get_scale_async() is mine
    mine.fill_(16.0)  # later in-place writes reach the scaler, as in torch
    assert scaler.get_scale() == 16.0 and scaler.scale(torch.tensor(1.0)).item() == 16.0
    scaler._scale = torch.tensor([2.0], dtype=torch.float64)  # one element, another float dtype: held as 0-d fp32
    assert (scaler._scale.dtype, scaler._scale.shape, scaler.get_scale()) == (torch.float32, torch.Size([]), 2.0)
    scaler._growth_tracker = 3  # a number goes on the scale's device
    assert (scaler._growth_tracker.dtype, scaler._get_growth_tracker()) == (torch.int32, 3)


_BAD_ASSIGNMENTS = [
    ("_scale", lambda: torch.tensor([1.0, 2.0]), TypeError, "one-element floating tensor"),
    ("_scale", lambda: torch.tensor(4), TypeError, "one-element floating tensor"),
    ("_scale", lambda: torch.tensor(4.0, requires_grad=True), TypeError, "requires grad"),
    ("_scale", lambda: torch.tensor(0.0), ValueError, "finite number"),
    ("_scale", lambda: torch.tensor(float("nan")), ValueError, "finite number"),
    ("_scale", float("inf"), ValueError, "finite number"),
    ("_scale", lambda: torch.tensor(2.0), ValueError, r"outside \[min_scale, max_scale\] = \[4.0, 1024.0\]"),
    ("_scale", 4096.0, ValueError, r"outside \[min_scale, max_scale\]"),
    ("_scale", "8", TypeError, "real number"),
    ("_growth_tracker", -1, ValueError, r"\[0, 2\*\*31 - 1\]"),
    ("_growth_tracker", 2**31, ValueError, r"\[0, 2\*\*31 - 1\]"),
    ("_growth_tracker", lambda: torch.tensor(1.0), TypeError, "integer tensor"),
    ("_growth_tracker", lambda: torch.tensor([1, 2]), TypeError, "integer tensor"),
    ("_growth_tracker", True, TypeError, "integer"),
    ("_growth_tracker", 1.0, TypeError, "integer"),
]


@pytest.mark.parametrize("name, value, error, match", _BAD_ASSIGNMENTS,
                         ids=[f"{n}-{i}" for i, (n, _, _, _) in enumerate(_BAD_ASSIGNMENTS)])
def test_bad_scale_or_growth_tracker_assignments_are_refused_before_anything_changes(name, value, error, match):
    scaler = GradScaler("cpu", init_scale=16.0, min_scale=4.0, max_scale=1024.0)
    _iterations(scaler, 1)
    held = (scaler._scale, scaler._growth_tracker, scaler.state_dict())
    with pytest.raises(error, match=rf"GradScaler\.{name} .*{match}"):
        setattr(scaler, name, value() if callable(value) else value)
    assert scaler._scale is held[0] and scaler._growth_tracker is held[1] and scaler.state_dict() == held[2]


def test_a_number_cannot_be_assigned_before_there_is_a_device():
    scaler = GradScaler("cpu")
    with pytest.raises(TypeError, match=r"GradScaler\._scale must be a tensor while _growth_tracker is None"):
        scaler._scale = 8.0
    with pytest.raises(TypeError, match=r"GradScaler\._growth_tracker must be a tensor while _scale is None"):
        scaler._growth_tracker = 0
    assert scaler._scale is None and scaler._growth_tracker is None
