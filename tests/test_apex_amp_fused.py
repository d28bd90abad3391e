"""amp O2's fused step: torch's SGD/Adam/AdamW update of the fp32 masters in one kernel pass.

Under O2 the master grads are written after every backward as before (unscaled, accumulated,
clippable through ``amp.master_params``). When the optimizer is one the kernels follow, the
patched ``step`` hands :func:`ampfunc.compat._torch_step.torch_step_` one pass per param group, segment
(masters with their fp16 model params; the fp32 params of the kept-fp32 batchnorm) and device,
reading the master grads and writing the masters, torch's own state and the fp16 params,
instead of ``optimizer.step()`` + the copy back. These specs compare it with the same facade
forced onto that old path (``_torch_step.torch_step_`` answering False).

Same numbers means bit for bit where the same arithmetic runs: SGD with either backend. Adam,
compiled or reference, takes a correctly rounded square root (ops.sqrt_rounded) where torch's
CPU sqrt may be an ulp off, so it is held to a tight tolerance (one ulp in a small fraction of
elements).
"""

import copy
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _helpers import assert_same, assert_states_same, exact

from ampfunc.compat import _torch_step
from ampfunc.compat.apex import amp
from ampfunc.compat.apex.amp import _amp_state

INF = float("inf")


# apex amp keeps process-wide state: every test here starts from a fresh one.
pytestmark = pytest.mark.usefixtures("fresh_amp_state")


@pytest.fixture
def old_path(monkeypatch):
    """Call ``old_path(True)`` to force the patched step onto ``optimizer.step()`` + the copy back."""
    real = _torch_step.torch_step_

    def force(on: bool):
        monkeypatch.setattr(_torch_step, "torch_step_", (lambda *a, **k: False) if on else real)
    return force


class Net(nn.Module):
    """Linear layers (fp16 under O2) around a batchnorm (kept fp32: params that are their own masters).
    With ``skip_side``, ``side`` is used on odd calls only: on even ones its params get no gradient."""

    def __init__(self, skip_side=False):
        super().__init__()
        self.skip_side = skip_side
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)
        self.side = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.fc2(torch.relu(self.bn(self.fc1(x))))
        return out + self.side(x) if self.calls % 2 or not self.skip_side else out


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def two_groups(model, cls, first, second):
    fc1 = list(model.fc1.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("fc1")]
    return cls([{"params": fc1, **first}, {"params": rest, **second}])


def build(cls, first, second, *, cast=None, scheduler_before=False, skip_side=False):
    model = Net(skip_side)
    opt = two_groups(model, cls, first, second)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler_before else None
    kw = {} if cast is None else {"cast_model_type": cast}
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, **kw)
    return model, opt, sched


def train(model, opt, data, *, overflow_at=(), clip=None, backwards=1, scheduler=None):
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        for k in range(backwards):
            loss = F.mse_loss(model(x).float(), y) * (INF if i in overflow_at and k == 0 else 1.0 + k)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def assert_runs_same(a, b, is_exact):
    (model_a, opt_a), (model_b, opt_b) = a, b
    for (n, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert_same(p, q, is_exact, n)
    for m, n in zip(amp.master_params(opt_a), amp.master_params(opt_b)):
        assert_same(m, n, is_exact)
    assert_states_same(opt_a.state_dict(), opt_b.state_dict(), is_exact)
    # The model copy is the master rounded once.
    for p, m in zip(opt_a._amp_stash.masters.all_fp16_params, opt_a._amp_stash.all_fp32_from_fp16_params):
        assert torch.equal(p, m.to(p.dtype))


# (name, class, group 0, group 1): settings the kernels follow.
OPTIMIZERS = [
    ("sgd-momentum-nesterov-wd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     dict(lr=0.02, momentum=0.5, weight_decay=1e-2)),
    ("sgd-plain-dampening", torch.optim.SGD, dict(lr=0.05), dict(lr=0.1, momentum=0.9, dampening=0.25)),
    ("adamw", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05), dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6)),
    ("adam-l2-amsgrad-foreach", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=True),
     dict(lr=2e-3, maximize=True)),
]
IDS = [o[0] for o in OPTIMIZERS]


def fused_and_old(old_path, run, **build_kw):
    """``run(model, opt)`` on a fused facade, then on one forced onto the old path."""
    results = []
    for force in (False, True):
        old_path(force)
        model, opt, sched = build(**build_kw)
        run(model, opt, sched)
        results.append((model, opt))
    old_path(False)
    return results


# ---------------------------------------------------------------------------------------------
# Same numbers as the old path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,cls,first,second", OPTIMIZERS, ids=IDS)
def test_fused_o2_step_equals_the_old_path_with_clipping_an_overflow_and_missing_grads(
        kernels, old_path, name, cls, first, second):
    data, overflow_at = batches(6), (3,)
    kind = "sgd" if cls is torch.optim.SGD else "adam"
    counted = []

    def run(model, opt, _):
        train(model, opt, data, overflow_at=overflow_at, clip=0.5)
        counted.append(kernels[kind])

    fused, old = fused_and_old(old_path, run, cls=cls, first=first, second=second, skip_side=True)
    # Per applied step: group 0 (fc1's masters) one pass; group 1 the masters of fc2 (and side,
    # on steps 0, 2, 4) one pass and the fp32 batchnorm params another; the overflow runs none.
    # Adam: side's step count lags fc2's on steps 2 and 4, a pass of its own.
    assert counted[0] == 3 * (len(data) - len(overflow_at)) + (0 if kind == "sgd" else 2)
    assert counted[1] == counted[0]  # the forced path never reaches the kernels
    assert_runs_same(fused, old, exact(kernels, cls))
    assert all(m.grad is None for m in fused[1]._amp_stash.all_fp32_from_fp16_params)  # cleared as before


@pytest.mark.parametrize("cls,kw", [(torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                                    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))])
def test_gradient_accumulation_over_two_backwards(kernels, old_path, cls, kw):
    fused, old = fused_and_old(old_path, lambda m, o, _: train(m, o, batches(3), backwards=2, clip=1.0),
                               cls=cls, first=kw, second=kw)
    assert kernels["sgd" if cls is torch.optim.SGD else "adam"] == 3 * 3
    assert_runs_same(fused, old, exact(kernels, cls))


def test_bf16_o2(kernels, old_path):
    kw = dict(lr=1e-2, weight_decay=0.05)
    fused, old = fused_and_old(old_path, lambda m, o, _: train(m, o, batches(3), overflow_at=(1,)),
                               cls=torch.optim.AdamW, first=kw, second=kw, cast=torch.bfloat16)
    assert fused[0].fc1.weight.dtype == torch.bfloat16 and kernels["adam"] == 3 * 2
    assert_runs_same(fused, old, exact(kernels, torch.optim.AdamW))


def test_a_model_param_without_grad_gets_its_master_copied_back_as_before(kernels, old_path):
    def run(model, opt, _):
        train(model, opt, batches(1))  # the masters exist; side has its first step
        with torch.no_grad():
            model.side.weight.fill_(7.0)  # written behind amp's back: the copy back undoes it
        train(model, opt, batches(1, seed=3))  # the second call skips side: no grad

    kw = dict(lr=0.05, momentum=0.9)
    fused, old = fused_and_old(old_path, run, cls=torch.optim.SGD, first=kw, second=kw, skip_side=True)
    assert kernels["sgd"] == 2 * 3
    assert not (fused[0].side.weight == 7.0).any()
    assert_runs_same(fused, old, True)


def test_a_skipped_step_changes_nothing(kernels):
    model, opt, _ = build(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-3, amsgrad=True))
    train(model, opt, batches(2))
    before = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()],
              [m.detach().clone() for m in amp.master_params(opt)])
    calls, scale = dict(kernels), _amp_state.loss_scalers[0].loss_scale()
    train(model, opt, batches(1, seed=5), overflow_at=(0,))
    assert _amp_state.loss_scalers[0].loss_scale() == scale / 2  # the overflow was seen
    assert kernels == calls
    assert_states_same(opt.state_dict(), before[0], True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before[1]))
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(opt), before[2]))
    assert all(m.grad is None for m in opt._amp_stash.all_fp32_from_fp16_params)


# ---------------------------------------------------------------------------------------------
# torch's own state: created lazily as torch would, usable by a plain torch optimizer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls,kw", [(torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
                                    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True))])
def test_state_dict_after_fused_steps_continues_identically_in_a_plain_torch_optimizer(kernels, cls, kw):
    model, opt, _ = build(cls, kw, kw, skip_side=True)
    data = batches(4)
    train(model, opt, data[:3])  # side's params (no grad on step 2) have one step fewer
    masters = [list(g["params"]) for g in opt.param_groups]
    plain = cls([{"params": [m.detach().clone().requires_grad_() for m in g], **kw} for g in masters])
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load keeps same-dtype tensors shared
    if cls is torch.optim.Adam:  # torch's lazy step counts: fp32 on the CPU, side's one behind
        assert {i: float(s["step"]) for i, s in opt.state_dict()["state"].items()} == \
            {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0, 4: 3.0, 5: 3.0, 6: 2.0, 7: 2.0}
        assert all(s["step"].device.type == "cpu" and s["step"].dtype == torch.float32
                   for s in opt.state_dict()["state"].values())
    # One more backward; the plain optimizer steps on the same master grads with torch's own step.
    x, y = data[3]
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    for group, plain_group in zip(masters, plain.param_groups):
        for m, q in zip(group, plain_group["params"]):
            q.grad = None if m.grad is None else m.grad.clone()
    calls = kernels["sgd"] + kernels["adam"]
    opt.step()
    plain.step()
    assert kernels["sgd"] + kernels["adam"] > calls  # the amp step ran fused
    is_exact = exact(kernels, cls)
    for group, plain_group in zip(masters, plain.param_groups):
        for m, q in zip(group, plain_group["params"]):
            assert_same(m.detach(), q.detach(), is_exact)
    assert_states_same(opt.state_dict(), plain.state_dict(), is_exact)


def test_a_new_param_group_is_stepped_fused_too(kernels, old_path):
    def run(model, opt, _):
        data = batches(4)
        train(model, opt, data[:2])
        extra = nn.Linear(4, 4).half()
        opt.add_param_group({"params": list(extra.parameters()), "lr": 0.05})
        model.extra = extra
        for x, y in data[2:]:
            opt.zero_grad()
            with amp.scale_loss(F.mse_loss(extra(model(x).half()).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()

    kw = dict(lr=0.05, momentum=0.9)
    fused, old = fused_and_old(old_path, run, cls=torch.optim.SGD, first=kw, second=kw)
    assert kernels["sgd"] == 2 * 3 + 2 * 4
    assert_runs_same(fused, old, True)


# ---------------------------------------------------------------------------------------------
# LR schedulers wrapping step, several optimizers and losses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("before", [False, True], ids=["scheduler-after-initialize", "scheduler-before"])
def test_lr_scheduler_is_followed_without_warnings(kernels, old_path, before):
    data = batches(5)

    def run(model, opt, sched):
        sched = sched or torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail
            # A scheduler made before initialize sees amp's patch as an override (old path too).
            warnings.filterwarnings("ignore", r"Seems like `optimizer.step\(\)` has been overridden")
            train(model, opt, data, scheduler=sched)
        assert opt.param_groups[0]["lr"] == 1e-2 * 0.5**2

    fused, old = fused_and_old(old_path, run, cls=torch.optim.AdamW, first=dict(lr=1e-2),
                               second=dict(lr=5e-3, weight_decay=0.1), scheduler_before=before)
    assert kernels["adam"] == 3 * len(data)
    assert_runs_same(fused, old, exact(kernels, torch.optim.AdamW))


def test_two_optimizers_and_two_losses(kernels, old_path):
    data = batches(4)
    results = []
    for force in (False, True):
        old_path(force)
        nets = [Net(), Net()]
        opts = [torch.optim.SGD(nets[0].parameters(), lr=0.05, momentum=0.9),
                torch.optim.AdamW(nets[1].parameters(), lr=1e-2)]
        nets, opts = amp.initialize(nets, opts, opt_level="O2", num_losses=2, verbosity=0)
        for i, (x, y) in enumerate(data):
            for o in opts:
                o.zero_grad()
            with amp.scale_loss(F.mse_loss(nets[0](x).float(), y) * (INF if i == 1 else 1.0), opts[0],
                                loss_id=0) as scaled:
                scaled.backward()
            with amp.scale_loss(F.mse_loss((nets[0](x) + nets[1](x)).float(), y), opts, loss_id=1) as scaled:
                scaled.backward()
            for o in opts:
                o.step()
        results.append((nets, opts))
    old_path(False)
    # One group each: a pass for the masters, one for the fp32 batchnorm params. opts[0] skips
    # step 1 (loss 0 overflowed); opts[1] steps every time.
    assert kernels["sgd"] == 2 * 3 and kernels["adam"] == 2 * 4
    (nets_a, opts_a), (nets_b, opts_b) = results
    assert_runs_same((nets_a[0], opts_a[0]), (nets_b[0], opts_b[0]), True)
    assert_runs_same((nets_a[1], opts_a[1]), (nets_b[1], opts_b[1]), exact(kernels, torch.optim.AdamW))


# ---------------------------------------------------------------------------------------------
# What falls back to the old path, with unchanged numbers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["rmsprop", "adam-fused", "adam-tensor-lr", "hooked", "patched-before-initialize",
                                  "adamw-subclass", "scheduler-around-a-patch"])
def test_what_the_engine_refuses_runs_torchs_step(kernels, old_path, case):
    def make(params):
        if case == "rmsprop":
            return torch.optim.RMSprop(params, lr=1e-3)
        if case == "adam-fused":
            return torch.optim.Adam(params, lr=1e-3, fused=True)
        if case == "adam-tensor-lr":
            return torch.optim.Adam(params, lr=torch.tensor(1e-3))
        if case == "adamw-subclass":
            return type("MyAdamW", (torch.optim.AdamW,), {})(params, lr=1e-3)
        return torch.optim.SGD(params, lr=0.1, momentum=0.5)

    results = []
    for force in (False, True):
        old_path(force)
        model = Net()
        opt = make(model.parameters())
        seen = []
        if case == "hooked":
            opt.register_step_post_hook(lambda *a: seen.append(1))
        if case in ("patched-before-initialize", "scheduler-around-a-patch"):
            step = opt.step

            def counting_step(self, *a, **k):
                seen.append(1)
                return step(*a, **k)
            opt.step = types.MethodType(counting_step, opt)  # a patch between amp and torch's step
            if case == "scheduler-around-a-patch":
                torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)  # wraps the patch
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        train(model, opt, batches(3), overflow_at=(1,))
        if case in ("hooked", "patched-before-initialize", "scheduler-around-a-patch"):
            assert len(seen) == 2  # what the user put around torch's step still runs
        results.append((model, opt))
    old_path(False)
    assert kernels["adam"] == kernels["sgd"] == 0
    assert_runs_same(*results, True)


def test_a_master_grad_of_another_dtype_runs_torchs_step(kernels):
    model, opt, _ = build(torch.optim.SGD, dict(lr=0.1), dict(lr=0.1))
    x, y = batches(1)[0]
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    masters = opt._amp_stash.all_fp32_from_fp16_params
    if hasattr(masters[0], "grad_dtype"):
        masters[0].grad_dtype = None  # torch >= 2.10 refuses a grad of another dtype unless asked
    masters[0].grad = masters[0].grad.double()  # what torch's own step then does is torch's business
    expected = masters[0].detach().clone().add_(masters[0].grad, alpha=-0.1)  # torch's SGD, by hand
    opt.step()
    assert kernels["sgd"] == 0
    assert torch.equal(masters[0].detach(), expected)


# ---------------------------------------------------------------------------------------------
# On a GPU (benchmarks/gpu_check.sh runs `pytest tests -k cuda`)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name,cls,first,second", OPTIMIZERS, ids=IDS)
def test_fused_o2_step_on_cuda_matches_the_old_path(old_path, monkeypatch, name, cls, first, second):
    # The CUDA kernels take amp O2's fused pass (master grads in, masters, torch's state and the
    # fp16 model out) and give the old path's numbers within the tolerance of another kernel.
    taken = []
    results = []
    for force in (False, True):
        old_path(force)
        if not force:
            real = _torch_step.torch_step_
            monkeypatch.setattr(_torch_step, "torch_step_", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
        model = Net().cuda()
        opt = two_groups(model, cls, first, second)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        data = [(x.cuda(), y.cuda()) for x, y in batches(6)]
        train(model, opt, data, overflow_at=(3,), clip=1.0)
        results.append((model, opt))
    old_path(False)
    assert taken == [True] * 5  # every applied step fused; the overflowed one ran none
    assert all(p.device.type == "cuda" for p in results[0][0].parameters())
    assert_runs_same(results[0], results[1], False)
