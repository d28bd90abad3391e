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
        results.append(({d: t.clone() for d, t in out.items()}, [p.grad.clone() for p in opt.param_groups[0]["params"]]))
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
