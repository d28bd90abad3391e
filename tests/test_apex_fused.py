"""FP16_Optimizer's fused step: a torch SGD/Adam/AdamW update of the fp32 masters in one kernel pass.

When the wrapped optimizer is a ``torch.optim.SGD``/``Adam``/``AdamW`` with settings the kernels
follow, ``backward`` checks the model's fp16 grads read-only (overflow flag and scale update as
before) and ``step`` runs one pass per param group (and device, and segment: masters with fp16
model params, fp32 params) that reads the scaled fp16 grads and writes the masters, the
optimizer's own state tensors and the fp16 model params. These specs compare it with:

* the same facade forced onto its materializing path (``backward(loss, update_master_grads=False)``
  then ``update_master_grads()``: fp32 master grads, then the torch optimizer's own ``step``);
* a plain recipe: fp32 master copies driven by hand with the torch optimizer.

Same numbers means bit for bit where the same arithmetic runs: SGD with either backend. Adam,
compiled or reference, is held to a tight tolerance: it takes a correctly rounded square root
(ops.sqrt_rounded) and differs from torch's single-tensor Adam by one unit in the last place in
a small fraction of elements.
"""

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from _helpers import assert_same, assert_states_same, exact, fp16_optimizer_loop
from ampfunc import ops
from ampfunc.compat.apex.fp16_utils import FP16_Optimizer

INF = float("inf")


class Mixed(nn.Module):
    """fp16 layers plus one fp32 parameter (apex allows mixing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16).half()
        self.fc2 = nn.Linear(16, 4).half()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).float() * self.gain


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g).half(), torch.randn(16, 4, generator=g)) for _ in range(n)]


def two_groups(named, cls, first, second):
    fc1 = [p for k, p in named.items() if k.startswith("fc1")]
    rest = [p for k, p in named.items() if not k.startswith("fc1")]
    return cls([{"params": fc1, **first}, {"params": rest, **second}])


# (name, optimizer class, hyper-parameters of group 0, of group 1): every setting the kernels follow.
OPTIMIZERS = [
    ("adamw", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05), dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6)),
    ("adam-l2-amsgrad-maximize", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
     dict(lr=2e-3, amsgrad=True, maximize=True)),
    ("adam-decoupled-foreach", torch.optim.Adam, dict(lr=5e-3, weight_decay=0.02, decoupled_weight_decay=True,
                                                      foreach=True), dict(lr=1e-3, foreach=True)),
    ("sgd-nesterov-wd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     dict(lr=0.02, momentum=0.5)),
    ("sgd-dampening-maximize", torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.25, maximize=True),
     dict(lr=0.1)),
]
IDS = [o[0] for o in OPTIMIZERS]


def train(model, opt, data, *, fused=True, overflow_at=(), scheduler=None):
    """apex's loop; ``fused=False`` forces the materializing path (master grads, torch's step)."""
    scales = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * (INF if i in overflow_at else 1.0)
        if fused:
            opt.backward(loss)
        else:
            opt.backward(loss, update_master_grads=False)
            opt.update_master_grads()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        scales.append(opt.loss_scale)
    return scales


def facade(cls, first, second, **kw):
    model = Mixed()
    inner = two_groups(dict(model.named_parameters()), cls, first, second)
    kw = kw or dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**12, "scale_window": 3})
    return model, FP16_Optimizer(inner, verbose=False, **kw)


def recipe(cls, first, second, data, init_scale=2.0**12, window=3, overflow_at=()):
    """By hand: fp32 masters own the torch optimizer; grads / scale in fp32; skip on overflow."""
    model = Mixed()
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    opt = two_groups(masters, cls, first, second)
    scale, clean = init_scale, 0
    for i, (x, y) in enumerate(data):
        model.zero_grad()
        (F.mse_loss(model(x), y) * (INF if i in overflow_at else 1.0) * scale).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if not all(bool(g.isfinite().all()) for g in grads.values()):
            scale, clean = scale / 2, 0
            continue
        for n, m in masters.items():
            m.grad = grads[n].float() * torch.tensor(1.0 / scale)
        opt.step()
        clean += 1
        if clean == window:
            scale, clean = scale * 2, 0
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(masters[n])
    return model, masters, opt


# ---------------------------------------------------------------------------------------------
# Same numbers as the materializing path and as the fp32-master recipe
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,cls,first,second", OPTIMIZERS, ids=IDS)
def test_fused_step_equals_the_materializing_path_and_the_fp32_master_recipe(kernels, name, cls, first, second):
    data, overflow_at = batches(7), (3,)
    model, opt = facade(cls, first, second)
    scales = train(model, opt, data, overflow_at=overflow_at)
    kind = "sgd" if cls is torch.optim.SGD else "adam"
    # One pass per group and segment (group 0: fc1's masters; group 1: fc2's masters, then the
    # fp32 gain), per applied step; the overflowed step runs none.
    assert kernels[kind] == 3 * (len(data) - len(overflow_at))
    calls = dict(kernels)
    old_model, old = facade(cls, first, second)
    assert train(old_model, old, data, fused=False, overflow_at=overflow_at) == scales
    assert kernels == calls  # the forced path never reaches the kernels
    is_exact = exact(kernels, cls)
    for (n, p), q in zip(model.named_parameters(), old_model.parameters()):
        assert p.dtype == q.dtype
        assert_same(p, q, is_exact, n)
    for a, b in zip(opt.all_fp32_from_fp16_params, old.all_fp32_from_fp16_params):
        assert_same(a, b, is_exact)
    assert_states_same(opt.optimizer.state_dict(), old.optimizer.state_dict(), is_exact)
    for m, p in zip(opt.all_fp32_from_fp16_params, opt.all_fp16_params):
        assert torch.equal(p, m.half())  # the model copy is the new master, rounded once

    ref_model, ref_masters, ref_opt = recipe(cls, first, second, data, overflow_at=overflow_at)
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_same(p, q, is_exact, n)
    assert_states_same(opt.optimizer.state_dict(), ref_opt.state_dict(), is_exact)


def test_a_skipped_step_changes_nothing(kernels, capsys):
    model, opt = facade(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-3, amsgrad=True))
    train(model, opt, batches(2))
    before = (copy.deepcopy(opt.optimizer.state_dict()), [p.detach().clone() for p in model.parameters()],
              [m.detach().clone() for m in opt.all_fp32_from_fp16_params], opt.loss_scale)
    calls = dict(kernels)
    x, y = batches(1, seed=5)[0]
    opt.zero_grad()
    opt.backward(F.mse_loss(model(x), y) * INF)
    assert opt.overflow and opt.step() is None
    assert "Gradient overflow.  Skipping step, reducing loss scale to 2048.0" in capsys.readouterr().out
    assert kernels == calls and opt.loss_scale == before[3] / 2
    assert_states_same(opt.optimizer.state_dict(), before[0], True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before[1]))
    assert all(torch.equal(a, b) for a, b in zip(opt.all_fp32_from_fp16_params, before[2]))
    assert all(float(s["step"]) == 2.0 for s in opt.optimizer.state.values())


def test_the_first_step_creates_torchs_lazy_state():
    for cls, kw in [(torch.optim.Adam, dict(amsgrad=True)), (torch.optim.SGD, dict(momentum=0.9))]:
        model, opt = facade(cls, dict(lr=1e-3, **kw), dict(lr=1e-3, **kw))
        old_model, old = facade(cls, dict(lr=1e-3, **kw), dict(lr=1e-3, **kw))
        train(model, opt, batches(1))
        train(old_model, old, batches(1), fused=False)
        mine_all, theirs_all = opt.optimizer.state_dict()["state"], old.optimizer.state_dict()["state"]
        assert sorted(mine_all) == sorted(theirs_all) == list(range(5))
        for i in mine_all:
            mine, theirs = mine_all[i], theirs_all[i]
            assert mine.keys() == theirs.keys()
            for k in mine:
                assert (mine[k].dtype, mine[k].device, mine[k].shape, mine[k].stride()) == \
                    (theirs[k].dtype, theirs[k].device, theirs[k].shape, theirs[k].stride()), k
        if cls is torch.optim.Adam:
            assert all(s["step"].device.type == "cpu" and float(s["step"]) == 1.0 for s in opt.state.values())


def test_lr_scheduler_changing_lr_mid_run_is_followed_without_warnings(kernels):
    data = batches(6)
    results = []
    for fused in (True, False):
        model, opt = facade(torch.optim.AdamW, dict(lr=1e-2), dict(lr=5e-3, weight_decay=0.1))
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=2, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail
            train(model, opt, data, fused=fused, scheduler=sched)
        assert opt.param_groups[0]["lr"] == 1e-2 * 0.5**3
        results.append((model, opt))
    assert kernels["adam"] == 3 * len(data)
    is_exact = exact(kernels, torch.optim.AdamW)
    for p, q in zip(results[0][0].parameters(), results[1][0].parameters()):
        assert_same(p, q, is_exact)


def test_state_dict_round_trip_mid_run_then_continue_equals_uninterrupted():
    data = batches(8)
    cls, first, second = torch.optim.Adam, dict(lr=1e-2, amsgrad=True), dict(lr=3e-3, weight_decay=0.01)
    model, opt = facade(cls, first, second)
    train(model, opt, data[:4], overflow_at=(1,))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed_model, resumed = facade(cls, first, second)
    resumed_model.load_state_dict(ckpt["model"])
    resumed.load_state_dict(ckpt["opt"])
    train(model, opt, data[4:])
    train(resumed_model, resumed, data[4:])
    assert resumed.loss_scale == opt.loss_scale
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    assert_states_same(opt.optimizer.state_dict(), resumed.optimizer.state_dict(), True)
    # A checkpoint of the materializing path resumes on the fused one, and the other way round.
    buf.seek(0)
    ckpt = torch.load(buf)  # a fresh copy: a loaded facade holds the checkpoint's scaler object
    old_model, old = facade(cls, first, second)
    old_model.load_state_dict(ckpt["model"])
    old.load_state_dict(ckpt["opt"])
    train(old_model, old, data[4:], fused=False)
    assert old.loss_scale == opt.loss_scale
    assert_states_same(old.optimizer.state_dict(), opt.optimizer.state_dict(), ops.backend() == "reference")
    for a, b in zip(model.parameters(), old_model.parameters()):
        assert_same(a, b, ops.backend() == "reference")


# ---------------------------------------------------------------------------------------------
# What falls back to the materializing path, with unchanged numbers
# ---------------------------------------------------------------------------------------------


def _fallback_equal(build, kernels, steps=3, between=None):
    """Runs ``build()`` through the facade's default loop and through the forced materializing
    path: no kernel call, same numbers bit for bit (the same torch step runs in both)."""
    results = []
    for fused in (True, False):
        model, opt = build()
        for x, y in batches(steps):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            if fused:
                opt.backward(loss)
            else:
                opt.backward(loss, update_master_grads=False)
                opt.update_master_grads()
            if between is not None:
                between(opt)
            opt.step()
        results.append(model)
    assert kernels["adam"] == kernels["sgd"] == 0
    for p, q in zip(*[m.parameters() for m in results]):
        assert torch.equal(p, q)


@pytest.mark.parametrize("case", ["rmsprop", "adam-fused", "adam-tensor-lr", "sgd-tensor-lr", "hooked",
                                  "patched-step", "adamw-subclass"])
def test_settings_the_kernels_do_not_follow_run_torchs_step(kernels, case):
    def build():
        model = Mixed()
        params = list(model.parameters())
        inner = {
            "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3),
            "adam-fused": lambda: torch.optim.Adam(params, lr=1e-3, fused=True),
            "adam-tensor-lr": lambda: torch.optim.Adam(params, lr=torch.tensor(1e-3)),
            "sgd-tensor-lr": lambda: torch.optim.SGD(params, lr=torch.tensor(0.1), momentum=0.5),
            "hooked": lambda: torch.optim.SGD(params, lr=0.1),
            "patched-step": lambda: torch.optim.SGD(params, lr=0.1),
            "adamw-subclass": lambda: type("MyAdamW", (torch.optim.AdamW,), {})(params, lr=1e-3),
        }[case]()
        if case == "hooked":
            inner.register_step_post_hook(lambda *a: None)
        if case == "patched-step":
            inner.step = inner.step  # an instance attribute torch's step might not be behind
        return model, FP16_Optimizer(inner, static_loss_scale=128.0, verbose=False)

    _fallback_equal(build, kernels)


def test_a_global_optimizer_hook_runs_torchs_step(kernels):
    seen = []
    handle = register_optimizer_step_post_hook(lambda opt, *a: seen.append(opt))
    try:
        _fallback_equal(lambda: facade(torch.optim.AdamW, dict(lr=1e-2), dict(lr=1e-3)), kernels)
    finally:
        handle.remove()
    assert len(seen) == 6  # the hook saw every step of both runs


def test_asking_for_master_grads_materializes_them_and_runs_torchs_step(kernels):
    build = lambda: facade(torch.optim.AdamW, dict(lr=1e-2), dict(lr=1e-3))  # noqa: E731
    _fallback_equal(build, kernels, between=lambda opt: opt.clip_master_grads(0.05))
    _fallback_equal(build, kernels, between=lambda opt: opt.inspect_master_grad_data())


def test_inspect_master_grad_data_after_a_checked_backward_gives_the_unscaled_grads(kernels):
    grads = []
    for fused in (True, False):
        model, opt = facade(torch.optim.SGD, dict(lr=0.1, momentum=0.9), dict(lr=0.1))
        x, y = batches(1)[0]
        loss = F.mse_loss(model(x), y)
        if fused:
            opt.backward(loss)
            assert all(m.grad is None for m in opt.all_fp32_from_fp16_params)  # not written by the check
        else:
            opt.backward(loss, update_master_grads=False)
            opt.update_master_grads()
        grads.append([g for group in opt.inspect_master_grad_data() for g in group])
    assert len(grads[0]) == len(grads[1]) == 5
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_more_backward_passes_after_a_checked_one_keep_apexs_master_grads(kernels):
    """apex: ``backward(l1)`` writes the master grads; ``backward(l2, update_master_grads=False)``
    only accumulates on the model, so the step uses l1's grads alone."""
    params = []
    for fused in (True, False):
        model, opt = facade(torch.optim.Adam, dict(lr=1e-2), dict(lr=1e-2), static_loss_scale=64.0)
        x, y = batches(1)[0]
        out = model(x)
        if fused:
            opt.backward(F.mse_loss(out, y), retain_graph=True)
        else:
            opt.backward(F.mse_loss(out, y), update_master_grads=False, retain_graph=True)
            opt.update_master_grads()
        opt.backward(out.abs().mean(), update_master_grads=False)
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*params):
        assert torch.equal(a, b)


def test_a_group_added_to_the_inner_optimizer_runs_torchs_step(kernels):
    def build():
        model = Mixed()
        opt = FP16_Optimizer(torch.optim.SGD([model.fc1.weight, model.fc1.bias], lr=0.1), verbose=False)
        opt.optimizer.add_param_group({"params": [model.gain], "lr": 0.05})  # not ingested by the facade
        return model, opt

    _fallback_equal(build, kernels)


def test_closure_with_static_scale_still_works(kernels):
    data = batches(3)
    results = []
    for use_closure in (True, False):
        model, opt = facade(torch.optim.SGD, dict(lr=0.1, momentum=0.9), dict(lr=0.1), static_loss_scale=32.0)
        fp16_optimizer_loop(opt, model, data, use_closure)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)



def test_closure_with_dynamic_scale_matches_the_fused_loop_with_the_overflow_skipped(kernels, capsys):
    # apex's last version re-runs a closure whose grads overflowed at the reduced scale. The
    # backward inside the closure takes the fused check (master grads deferred), and the clean
    # evaluation's grads are what torch's step(closure) uses: the same numbers as the fused loop
    # that skips the overflowing iteration and repeats it.
    data = batches(3)
    results = []
    for use_closure in (True, False):
        model, opt = facade(torch.optim.SGD, dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.5))
        def fused_check():
            assert opt._deferred is not None  # the fused check, not the master-grad write

        calls = fp16_optimizer_loop(opt, model, data, use_closure, lambda call: INF if call == 2 else 1.0, fused_check)
        assert calls == 4 and opt.loss_scale == 2.0**11
        results.append([p.detach().clone() for p in model.parameters()]
                       + [opt.state[p]["momentum_buffer"].clone() for g in opt.param_groups for p in g["params"]])
    assert "OVERFLOW within closure! Skipping step, reducing loss scale to 2048.0" in capsys.readouterr().out
    assert kernels["sgd"] > 0  # the loop without a closure stepped fused
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bad_gradients_are_refused_as_before():
    emb = nn.Embedding(10, 4, sparse=True).half()
    opt = FP16_Optimizer(torch.optim.SGD(emb.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    with pytest.raises(TypeError, match="layout torch.sparse_coo"):
        opt.backward(emb(torch.tensor([1, 2])).float().sum())


# ---------------------------------------------------------------------------------------------
# On a GPU (benchmarks/gpu_check.sh runs `pytest tests -k cuda`)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name,cls,first,second", OPTIMIZERS, ids=IDS)
def test_fused_step_on_cuda_equals_the_materializing_path(monkeypatch, name, cls, first, second):
    # The CUDA kernels take the fused pass (torch's step counts stay CPU tensors; the pass gets
    # its count as a device scalar) and give the materializing path's numbers, within the
    # tolerance of another kernel (torch's CUDA Adam is not the single-tensor CPU arithmetic).
    calls = []
    for op in ("adam_step_", "sgd_step_"):
        real = getattr(ops, op)
        monkeypatch.setattr(ops, op, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    data, overflow_at = [(x.cuda(), y.cuda()) for x, y in batches(7)], (3,)
    runs = []
    for fused in (True, False):
        model = Mixed().cuda()
        inner = two_groups(dict(model.named_parameters()), cls, first, second)
        opt = FP16_Optimizer(inner, verbose=False, dynamic_loss_scale=True,
                             dynamic_loss_args={"init_scale": 2.0**12, "scale_window": 3})
        scales = train(model, opt, data, fused=fused, overflow_at=overflow_at)
        runs.append((model, opt, scales))
        if fused:
            assert len(calls) == 3 * (len(data) - len(overflow_at))
    (model, opt, scales), (old_model, old, old_scales) = runs
    assert len(calls) == 3 * (len(data) - len(overflow_at))  # the materializing path ran none
    assert scales == old_scales
    for (n, p), q in zip(model.named_parameters(), old_model.parameters()):
        assert p.device.type == "cuda" and p.dtype == q.dtype
        assert_same(p, q, False, n)
    assert_states_same(opt.optimizer.state_dict(), old.optimizer.state_dict(), False)
    for m, p in zip(opt.all_fp32_from_fp16_params, opt.all_fp16_params):
        assert torch.equal(p, m.half())  # the model copy is the new master, rounded once
