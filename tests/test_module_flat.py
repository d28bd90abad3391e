"""ModuleTrainer(flat=True): a module's params and grads packed into one buffer per (device, dtype).

The trainer steps the buffers instead of the params one by one, so a model of many small
tensors costs what one tensor costs; the numbers are those of the unpacked trainer, bit for bit
(the same elementwise kernels run over the same values).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampfunc as af


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    return model.to(dtype)


def _twins(dtype=torch.float32):
    a, b = _model(dtype=dtype), _model(dtype=dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def _tx():
    return af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2, weight_decay=0.1))


def _backward(model, trainer, step, overflow=False):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    x = x.to(next(model.parameters()).dtype)
    loss = F.mse_loss(model(x).float(), y)
    trainer.scale(loss).backward()
    if overflow:
        next(model.parameters()).grad.view(-1)[0] = float("inf")


def _params_equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flat_steps_give_the_unpacked_trainers_numbers_bit_for_bit(dtype):
    a, b = _twins(dtype)
    flat = af.ModuleTrainer(a, _tx(), loss_scale=af.DynamicLossScale(init_scale=2.0**8), flat=True)
    plain = af.ModuleTrainer(b, _tx(), loss_scale=af.DynamicLossScale(init_scale=2.0**8))
    for step in range(6):
        for model, trainer in ((a, flat), (b, plain)):
            _backward(model, trainer, step, overflow=step == 3)
            trainer.step()
        assert _params_equal(a, b), step
    assert int(flat.skipped) == int(plain.skipped) == 1
    assert float(flat.loss_scale.loss_scale) == float(plain.loss_scale.loss_scale)


def test_params_and_grads_are_views_of_one_buffer_each_and_grads_are_zeroed_not_dropped():
    model = _model()
    trainer = af.ModuleTrainer(model, af.adamw(1e-3), flat=True)
    params = list(model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    assert len({p.grad.untyped_storage().data_ptr() for p in params}) == 1
    assert list(trainer.state.opt_state.exp_avg) == ["float32@cpu"]  # the state is per buffer
    _backward(model, trainer, 0)
    grads = [p.grad for p in params]
    assert all(float(g.abs().sum()) > 0 for g in grads)  # backward added into the views
    trainer.step()
    assert all(p.grad is g and float(g.abs().sum()) == 0 for p, g in zip(params, grads))


def test_zero_grad_to_none_between_steps_and_unused_params_still_give_the_same_numbers():
    a, b = _twins()
    flat = af.ModuleTrainer(a, _tx(), flat=True)
    plain = af.ModuleTrainer(b, _tx())
    for step in range(4):
        for model, trainer in ((a, flat), (b, plain)):
            model.zero_grad(set_to_none=True)  # drops the views; backward makes new grads
            _backward(model, trainer, step)
            if step == 2:
                model[0].bias.grad = None  # an unused param: a zero gradient, in both trainers
            if trainer is flat and step == 0:
                with pytest.warns(UserWarning, match="drop the zero_grad"):  # said once
                    trainer.step()
            else:
                trainer.step()
        assert _params_equal(a, b), step
    assert all(p.grad.untyped_storage().data_ptr() == a[0].weight.grad.untyped_storage().data_ptr()
               for p in a.parameters())  # the views are back


def test_a_module_moved_after_the_trainer_is_refused_naming_the_param_and_nothing_is_written():
    model = _model()
    trainer = af.ModuleTrainer(model, af.adamw(1e-3), flat=True)
    _backward(model, trainer, 0)
    with torch.no_grad():
        model[2].weight.data = model[2].weight.data.clone()  # what .to()/.half() do to .data
    before = [p.detach().clone() for p in model.parameters()]
    state = [t.clone() for t in trainer.state.opt_state.exp_avg.values()]
    with pytest.raises(RuntimeError, match=r"'2\.weight' no longer lives in the trainer's flat buffer"):
        trainer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(torch.equal(s, t) for s, t in zip(trainer.state.opt_state.exp_avg.values(), state))


def test_what_flat_cannot_pack_is_refused_before_the_module_is_touched():
    model = _model()
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match="kernel-backed elementwise optimizer"):
        af.ModuleTrainer(model, af.from_torch(torch.optim.RMSprop, lr=1e-3), flat=True)
    model[0].weight.data = model[0].weight.data.t().contiguous().t()  # same values, transposed strides
    with pytest.raises(ValueError, match=r"'0\.weight' is not a contiguous dense tensor"):
        af.ModuleTrainer(model, af.adamw(1e-3), flat=True)
    assert [p.data_ptr() for p in model.parameters()][1:] == before[1:]


def test_a_flat_trainer_resumes_from_its_state_dict_bit_for_bit():
    a, b = _twins()
    ta = af.ModuleTrainer(a, _tx(), loss_scale=af.DynamicLossScale(), flat=True)
    tb = af.ModuleTrainer(b, _tx(), loss_scale=af.DynamicLossScale(), flat=True)
    for step in range(2):
        _backward(a, ta, step)
        ta.step()
    blob = io.BytesIO()
    torch.save({"model": a.state_dict(), "trainer": ta.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    b.load_state_dict(saved["model"])  # copies into b's views: b stays packed
    tb.load_state_dict(saved["trainer"])
    for step in range(2, 4):
        for model, trainer in ((a, ta), (b, tb)):
            _backward(model, trainer, step)
            trainer.step()
    assert _params_equal(a, b)


def test_many_small_params_are_one_tensor_to_the_engine():
    torch.manual_seed(0)
    a = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(500)])
    b = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in a])
    flat, plain = af.ModuleTrainer(a, af.adamw(1e-2), flat=True), af.ModuleTrainer(b, af.adamw(1e-2))
    assert [t.shape for t in flat.state.opt_state.exp_avg.values()] == [(1500,)]
    for _ in range(3):
        for model, trainer in ((a, flat), (b, plain)):
            sum((p * (i % 7)).sum() for i, p in enumerate(model)).backward()
            trainer.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_trainer_made_before_any_kernel_call_checks_its_params_in_c():
    # The per-step look at 10,000 params costs ~10 ms in Python and ~1 ms in C; the compiled
    # library must be loaded when the trainer records what it checks, not at its first step.
    import subprocess
    import sys
    code = ("import torch, ampfunc as af; from ampfunc import ops\n"
            "m = torch.nn.Linear(3, 2); t = af.ModuleTrainer(m, af.adamw(1e-3), flat=True)\n"
            "kind = type(t._packed.signature).__name__; ops.load()\n"
            "print(kind if ops._DIRECT[0] is not None else 'no-door')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] in ("Tensor", "no-door")


@pytest.mark.parametrize("flat", [False, True])
def test_a_step_bumps_the_params_versions_so_a_stale_graph_fails_as_with_torch_optim(flat):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))  # the graph saves model[1].weight
    trainer = af.ModuleTrainer(model, af.sgd(0.1), flat=flat)
    loss = model(torch.randn(4, 3)).square().sum()
    loss.backward(retain_graph=True)
    before = model[1].weight._version
    trainer.step()
    assert model[1].weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_changing_requires_grad_after_the_trainer_is_made_is_refused_by_name(flat, change):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    if change == "unfreeze":
        model[0].weight.requires_grad_(False)
    trainer = af.ModuleTrainer(model, af.adamw(1e-2, weight_decay=0.1), flat=flat)
    model[0].weight.requires_grad_(change == "unfreeze")
    model(torch.randn(4, 3)).square().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"'0\.weight' (requires grad|no longer requires grad)"):
        trainer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_flat_trainer_refuses_two_params_sharing_memory_as_the_unpacked_one_does():
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    model[1].weight = nn.Parameter(model[0].weight.data)  # two Parameters, one storage
    with pytest.raises(ValueError, match=r"'0\.weight' and parameter leaf '1\.weight' are the same tensor"):
        af.ModuleTrainer(model, af.sgd(0.1), flat=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_leaf_flags_hook_counts_overflows_per_param_as_with_the_unpacked_trainer(dtype):
    # The engine steps one tensor per buffer; a monitor built from the module's params counts
    # per param, with a flat trainer as with the unpacked one.
    counts = []
    for flat in (False, True):
        model = _model(dtype=dtype)
        trainer = af.ModuleTrainer(model, _tx(), loss_scale=af.DynamicLossScale(2.0**8), flat=flat)
        mon = af.TrainingMonitor(af.params_of(model), window=10)
        hook = trainer.engine.on_check = af.monitor.LeafFlagsHook(mon)
        for step in range(4):
            _backward(model, trainer, step, overflow=step in (1, 3))
            if step == 3:
                model[4].bias.grad[1] = float("nan")
            trainer.step()
            flags = hook.take()
            assert flags is not None and flags.shape == (len(mon.leaf_paths),)
            mon = mon.record_state(trainer.state, loss=torch.tensor(1.0), leaf_nonfinite=flags)
        counts.append(mon.overflows())
        assert trainer.engine.on_check is hook  # still set after the steps
    assert counts[0] == counts[1] == {"0.weight": 2, "4.bias": 1}


@pytest.mark.parametrize("flat", [False, True])
def test_an_on_check_hook_gets_the_leaf_paths_as_a_function_on_both_trainers(flat):
    # the Engine's contract: (finite, leaf_nonfinite, leaf_paths) with leaf_paths() -> the paths
    model = _model()
    trainer = af.ModuleTrainer(model, _tx(), loss_scale=af.DynamicLossScale(2.0**8), flat=flat)
    seen = []
    trainer.engine.on_check = lambda finite, flags, leaf_paths: seen.append((bool(finite), list(leaf_paths())))
    _backward(model, trainer, 0, overflow=False)
    trainer.step()
    assert seen == [(True, [k for k, p in model.named_parameters() if p.requires_grad])]


def test_a_leaf_flags_monitor_the_flat_trainer_does_not_step_is_refused_before_any_write():
    model = _model()
    model[0].bias.requires_grad_(False)  # not stepped, but in params_of(model)
    trainer = af.ModuleTrainer(model, _tx(), loss_scale=af.DynamicLossScale(2.0**8), flat=True)
    trainer.engine.on_check = af.monitor.LeafFlagsHook(af.TrainingMonitor(af.params_of(model)))
    _backward(model, trainer, 0)
    before = [p.detach().clone() for p in model.parameters()]
    state = [t.clone() for t in af.tree.tree_leaves(trainer.state)]
    with pytest.raises(ValueError, match=r"ModuleTrainer.step: LeafFlagsHook: .* no leaf '0\.bias'"):
        trainer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(state, af.tree.tree_leaves(trainer.state)))


def test_a_state_on_the_meta_device_is_refused_by_name_before_anything_changes():
    model = _model()
    trainer = af.ModuleTrainer(model, _tx(), loss_scale=af.DynamicLossScale(2.0**8))
    sd = trainer.state_dict()
    meta = af.tree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, sd)
    before = [t.clone() for t in af.tree.tree_leaves(trainer.state) if isinstance(t, torch.Tensor)]
    with pytest.raises(ValueError, match=r"is on the meta device .* map_location='meta'"):
        trainer.load_state_dict(meta)
    after = [t for t in af.tree.tree_leaves(trainer.state) if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
