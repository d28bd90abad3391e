"""af.from_torch: any torch.optim optimizer as a pure transform, checked against the optimizer
run natively on the same trajectory."""

import io

import pytest
import torch

import ampfunc as af
from _trajectory import Trajectory, assert_rel_close
from ampfunc.tree import select_tree, tree_leaves, tree_structure

STEPS = 20

# (optimizer, a non-default configuration); each is also run with its defaults.
OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.01)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    (torch.optim.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.01)),
    (torch.optim.Adamax, dict(lr=0.01, betas=(0.8, 0.95))),
    (torch.optim.NAdam, dict(lr=0.01, momentum_decay=0.005, weight_decay=0.1, decoupled_weight_decay=True)),
    (torch.optim.RAdam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    (torch.optim.ASGD, dict(lr=0.05, t0=5, lambd=1e-3)),
    (torch.optim.Rprop, dict(lr=0.02, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0))),
]
# lr for the "default" run of optimizers whose lr has no default
REQUIRED = {torch.optim.SGD: dict(lr=0.05)}
if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
    OPTIMIZERS.append((torch.optim.Adafactor, dict(lr=0.02, beta2_decay=-0.7, weight_decay=0.01)))

CASES = [pytest.param(cls, REQUIRED.get(cls, {}), id=f"{cls.__name__}-default") for cls, _ in OPTIMIZERS] + \
        [pytest.param(cls, kw, id=f"{cls.__name__}-custom") for cls, kw in OPTIMIZERS]


def make_params():
    g = torch.Generator().manual_seed(0)
    return {"encoder": {"weight": torch.randn(5, 4, generator=g), "bias": torch.randn(5, generator=g)},
            "scale": torch.randn((), generator=g).abs() + 0.5}


_TRAJECTORY = Trajectory(seed=100, pull=0.3, steps=STEPS)
grads_at, run_pure, run_torch = _TRAJECTORY.grads_at, _TRAJECTORY.run_pure, _TRAJECTORY.run_torch


@pytest.mark.parametrize("cls, kw", CASES)
def test_from_torch_matches_the_optimizer_run_natively(cls, kw):
    params = make_params()
    tx = af.from_torch(cls, **kw)
    state0 = tx.init(params)
    ours, state = run_pure(tx, params, state=state0)
    theirs, opt = run_torch(cls, params, **kw)
    assert_rel_close(ours, theirs, initial=params)
    # The state is torch's state, and its structure was fixed at init.
    assert tree_structure(state) == tree_structure(state0)
    for path, p in af.tree.leaves_with_paths(theirs):
        for key, value in opt.state[p].items():
            slot = state.state.get(key, state.step_state.get(key))
            mine = slot if path == "<root>" else _get(slot, path)
            assert_rel_close([mine], [value])
    assert state.count.item() == STEPS


def _get(tree, path):
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree


def test_sgd_momentum_buffer_is_created_on_the_first_step_exactly_as_torch_does():
    params = make_params()
    tx = af.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.5)
    state = tx.init(params)
    assert list(state.step_state) == ["momentum_buffer"] and state.state == {}
    grads = grads_at(params, 0)
    _, state = tx.update(grads, state, params)
    for buf, g in zip(tree_leaves(state.step_state["momentum_buffer"]), tree_leaves(grads)):
        assert torch.equal(buf, g)  # torch: buf = clone(grad), not (1 - dampening) * grad


def test_skipped_first_step_restores_the_fresh_state_and_the_next_step_is_a_first_step():
    params = make_params()
    kw = dict(lr=0.1, momentum=0.9, dampening=0.5)
    tx = af.from_torch(torch.optim.SGD, **kw)
    state0 = tx.init(params)
    _, tried = tx.update(grads_at(params, 0), state0, params)
    state = select_tree(torch.tensor(False), tried, state0)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(state), tree_leaves(state0)))
    ours, _ = run_pure(tx, params, state=state)
    theirs, _ = run_torch(torch.optim.SGD, params, **kw)
    assert_rel_close(ours, theirs, initial=params)


def test_update_never_mutates_its_inputs():
    params = make_params()
    for cls, kw in [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)), (torch.optim.Adagrad, {}), (torch.optim.Adam, {})]:
        tx = af.from_torch(cls, **kw)
        _, state = tx.update(grads_at(params, 0), tx.init(params), params)
        grads = grads_at(params, 1)
        before = [x.clone() for x in tree_leaves((params, grads, state))]
        tx.update(grads, state, params)
        assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves((params, grads, state))))


def test_state_is_a_pytree_of_tensors_that_survives_torch_save():
    params = make_params()
    tx = af.from_torch(torch.optim.RMSprop, lr=0.01, momentum=0.9)
    p, state = run_pure(tx, params, steps=3)
    assert all(isinstance(x, torch.Tensor) for x in tree_leaves(state))
    buf = io.BytesIO()
    torch.save((p, state), buf)
    buf.seek(0)
    p2, state2 = torch.load(buf)
    a = run_pure(tx, p, steps=3, state=state, start=3)
    b = run_pure(tx, p2, steps=3, state=state2, start=3)
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)))


def test_works_as_the_inner_optimizer_of_mixed_precision_and_chain():
    params = make_params()
    tx = af.chain(af.clip_by_global_norm(1.0), af.from_torch(torch.optim.Adam, lr=0.01))
    ours, _ = run_pure(tx, params, steps=5)
    theirs = af.tree.tree_map(lambda p: p.clone(), params)
    leaves = tree_leaves(theirs)
    opt = torch.optim.Adam(leaves, lr=0.01)
    for k in range(5):
        for p, g in zip(leaves, tree_leaves(grads_at(theirs, k))):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(leaves, 1.0)
        opt.step()
    assert_rel_close(ours, theirs, rel=1e-5, initial=params)


def test_lbfgs_and_sparse_adam_are_refused_with_the_reason():
    with pytest.raises(TypeError, match="LBFGS.*closure"):
        af.from_torch(torch.optim.LBFGS, lr=1.0)
    with pytest.raises(TypeError, match="SparseAdam.*sparse"):
        af.from_torch(torch.optim.SparseAdam)


def test_unknown_or_invalid_hyper_parameters_give_torchs_own_error():
    with pytest.raises(TypeError, match="momentun"):
        af.from_torch(torch.optim.SGD, lr=0.1, momentun=0.9)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        af.from_torch(torch.optim.Adam, lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter"):
        af.from_torch(torch.optim.AdamW, betas=(1.5, 0.9))


def test_not_an_optimizer_class_and_schedule_lr_are_refused():
    with pytest.raises(TypeError, match="Optimizer subclass"):
        af.from_torch(torch.optim.Adam([torch.zeros(2)]))
    with pytest.raises(TypeError, match="lr must be a number"):
        af.from_torch(torch.optim.Adam, lr=af.optim.constant_schedule(1e-3))


def test_mismatched_trees_and_non_float_leaves_name_the_leaf():
    params = make_params()
    tx = af.from_torch(torch.optim.Adam)
    state = tx.init(params)
    grads = grads_at(params, 0)
    del grads["encoder"]["bias"]
    with pytest.raises(ValueError, match="encoder.bias"):
        tx.update(grads, state, params)
    grads = grads_at(params, 0)
    grads["scale"] = torch.tensor(1)
    with pytest.raises(TypeError, match=r"scale.*int64"):
        tx.update(grads, state, params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads_at(params, 0), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls, kw", [(torch.optim.SGD, dict(lr=0.05, momentum=0.9)), (torch.optim.Adam, dict(lr=0.01)),
                                     (torch.optim.Adam, dict(lr=0.01, capturable=True))])
def test_from_torch_on_cuda_matches_the_optimizer_run_natively(cls, kw):
    params = af.tree.tree_map(lambda p: p.cuda(), make_params())
    ours, theirs = _TRAJECTORY.run_both_on("cuda", af.from_torch(cls, **kw), cls, params, **kw)
    assert_rel_close(ours, theirs, initial=params)
