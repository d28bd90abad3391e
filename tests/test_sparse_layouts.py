"""Sparse layouts (COO, CSR, CSC, BSR, BSC) are refused naming the leaf on every path, before any write.

The kernels, the flat buffers and ``torch.where`` take dense tensors. The compressed layouts used
to fail inside torch naming no leaf ("Sparse CSR tensors do not have is_contiguous") on the fused
steps, ``all_finite`` and ``skip_or_apply``; the GradScaler facade keeps torch's support for
sparse COO gradients and refuses the compressed ones by name.
"""

import warnings

import pytest
import torch

import ampfunc as af
from ampfunc.compat.torch_amp import GradScaler

LAYOUTS = ["coo", "csr", "csc", "bsr", "bsc"]


def sparse(layout: str, dtype=torch.float32) -> torch.Tensor:
    dense = torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 3.0], [1.0, 0, 0]], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return {"coo": dense.to_sparse, "csr": dense.to_sparse_csr, "csc": dense.to_sparse_csc,
                "bsr": lambda: dense.to_sparse_bsr((1, 1)), "bsc": lambda: dense.to_sparse_bsc((1, 1))}[layout]()


def params(dtype=torch.float32):
    return {"enc": {"w": torch.full((4, 3), 0.5, dtype=dtype)}, "head": {"b": torch.full((3,), 0.25, dtype=dtype)}}


def grads_with_sparse(p, layout):
    return {"enc": {"w": sparse(layout, p["enc"]["w"].dtype)}, "head": {"b": torch.ones_like(p["head"]["b"])}}


def dls():
    return af.DynamicLossScale(2.0 ** 8)


def _mp(inner, dtype=torch.float32):
    def build():
        p = params(dtype)
        tx = af.mixed_precision(inner(), loss_scale=dls())
        return tx, p, tx.init(p)
    return build


def _plain(make):
    def build():
        p = params()
        tx = make()
        return tx, p, tx.init(p)
    return build


STEPPERS = {
    # name: (build() -> (tx, params, state), call(tx, params, grads, state))
    "mp-adamw.update": (_mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.update(g, s, p)),
    "mp-adamw.step": (_mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.step(p, g, s)),
    "mp-adamw.step_": (_mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-adamw-f16-master.step_": (_mp(lambda: af.adamw(1e-3), torch.float16), lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-sgd-momentum.step_": (_mp(lambda: af.sgd(0.1, momentum=0.9)), lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-clip-adam.step": (_mp(lambda: af.chain(af.clip_by_global_norm(1.0), af.adam(1e-3))),
                          lambda tx, p, g, s: tx.step(p, g, s)),
    "mp-rmsprop.step_": (_mp(lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3)),
                         lambda tx, p, g, s: tx.step_(p, g, s)),
    "adamw.update": (_plain(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.update(g, s, p)),
    "clip-adamw.update": (_plain(lambda: af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3))),
                          lambda tx, p, g, s: tx.update(g, s, p)),
    "unscale_and_check": (lambda: (None, params(), dls()), lambda tx, p, g, s: af.unscale_and_check(g, s)),
    "unscale_and_check_": (lambda: (None, params(), dls()), lambda tx, p, g, s: af.mixed.unscale_and_check_(g, s)),
    "all_finite": (lambda: (None, params(), None), lambda tx, p, g, s: af.tree.all_finite(g)),
    "global_norm": (lambda: (None, params(), None), lambda tx, p, g, s: af.optim.global_norm(g)),
}


def _tensors(tree):
    return [t for t in af.tree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", sorted(STEPPERS))
def test_a_sparse_gradient_is_refused_naming_the_leaf_before_any_write(path, layout):
    build, call = STEPPERS[path]
    tx, p, s = build()
    g = grads_with_sparse(p, layout)
    before = [t.clone() for t in _tensors((p, s))]
    versions = [t._version for t in _tensors((p, s))]
    with pytest.raises(TypeError, match=f"'enc.w' has layout torch.sparse_{layout}; only dense"):
        call(tx, p, g, s)
    assert all(torch.equal(a, b) for a, b in zip(_tensors((p, s)), before))
    assert [t._version for t in _tensors((p, s))] == versions


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])
def test_skip_or_apply_refuses_a_sparse_leaf_by_name(layout, inplace):
    new, old = params(), params()
    new["enc"]["w"] = sparse(layout)
    before = [t.clone() for t in _tensors(old)]
    with pytest.raises(TypeError, match=f"select_tree: the new tree's leaf 'enc.w' has layout torch.sparse_{layout}"):
        (af.mixed.skip_or_apply_ if inplace else af.skip_or_apply)(torch.tensor(True), new, old)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(old), before))
    with pytest.raises(TypeError, match=f"the old tree's leaf 'enc.w' has layout torch.sparse_{layout}"):
        af.skip_or_apply(torch.tensor(False), params(), {"enc": {"w": sparse(layout)}, "head": params()["head"]})


class _SparseParam(torch.nn.Module):
    def __init__(self, layout):
        super().__init__()
        self.w = torch.nn.Parameter(sparse(layout))

    def forward(self, x):
        return x.sum()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sparse_param_is_refused_by_name_by_every_front_end(layout):
    match = f"leaf 'w' has layout torch.sparse_{layout}"
    with pytest.raises(TypeError, match=match):
        af.ModuleTrainer(_SparseParam(layout), af.adamw(1e-3), loss_scale=dls())
    with pytest.raises(TypeError, match=match):
        af.make_train_step(_SparseParam(layout), lambda fwd, x: fwd(x), af.adamw(1e-3), "p=f32,c=f32,o=f32").init()
    with pytest.raises(TypeError, match=match):
        af.mixed_precision(af.adamw(1e-3), loss_scale=dls()).init({"w": sparse(layout)})


def _embedding_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 2))


def test_module_trainer_and_make_train_step_refuse_a_sparse_embedding_gradient_by_name():
    # nn.Embedding(sparse=True) is where a sparse gradient comes from in a real loop (COO)
    x = torch.tensor([[1, 2], [3, 4]])
    model = _embedding_model()
    trainer = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=dls())
    trainer.scale(model(x).sum()).backward()
    before = [t.detach().clone() for t in model.parameters()]
    with pytest.raises(TypeError, match="'0.weight' has layout torch.sparse_coo"):
        trainer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    train = af.make_train_step(_embedding_model(), lambda fwd, x: fwd(x).sum(), af.adamw(1e-3), "p=f32,c=f32,o=f32",
                               loss_scale=dls())
    with pytest.raises(TypeError, match="'0.weight' has layout torch.sparse_coo"):
        train.step(train.init(), x)


def test_the_flat_trainer_refuses_a_sparse_embedding_by_name_before_packing():
    # its backward would add the COO gradient into the dense gradient view in place, unnoticed
    model = _embedding_model()
    before = [(t.data_ptr(), t.detach().clone()) for t in model.parameters()]
    with pytest.raises(TypeError, match="'0.weight' belongs to an nn.Embedding.* sparse=True"):
        af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=dls(), flat=True)
    assert all(t.data_ptr() == ptr and torch.equal(t, old) for t, (ptr, old) in zip(model.parameters(), before))


@pytest.mark.parametrize("when", ["before_the_trainer", "before_a_step"])
def test_the_flat_trainer_refuses_a_hand_assigned_sparse_gradient_by_name(when):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(3, 4))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sparse_grad = torch.ones(4, 3).to_sparse()
    if when == "before_the_trainer":
        model[1].weight.grad = sparse_grad
        with pytest.raises(TypeError, match="'1.weight' has layout torch.sparse_coo"):
            af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=dls(), flat=True)
        return
    trainer = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=dls(), flat=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # fresh tensors, copied into the gradient views at the step
    model[1].weight.grad = sparse_grad
    before = [t.detach().clone() for t in model.parameters()]
    state = trainer.state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # every .grad replaced: the flat trainer's warning
        with pytest.raises(TypeError, match="'1.weight' has layout torch.sparse_coo"):
            trainer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert trainer.state is state and int(trainer.state.skipped) == 0


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
@pytest.mark.parametrize("call", ["step", "unscale_", "fused_optimizer"])
def test_the_grad_scaler_refuses_a_compressed_gradient_by_name(layout, call):
    dense = torch.nn.Parameter(torch.ones(3))
    sp = torch.nn.Parameter(sparse(layout))
    dense.grad, sp.grad = torch.full((3,), 256.0), sparse(layout) * 256.0
    opt = torch.optim.SGD([dense, sp], lr=0.1) if call != "fused_optimizer" else \
        torch.optim.Adam([dense, sp], lr=0.1, fused=True)
    scaler = GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones((), requires_grad=True))  # initialises the scale, as a loop's scale(loss) does
    grads = [dense.grad.clone(), sp.grad.clone()]
    match = (r"the gradient of optimizer.param_groups\[0\]\['params'\]\[1\] \(shape \(4, 3\)\) has layout "
             f"torch.sparse_{layout}")
    with pytest.raises(TypeError, match=match):
        scaler.unscale_(opt) if call == "unscale_" else scaler.step(opt)
    assert torch.equal(dense.grad, grads[0]) and torch.equal(dense, torch.ones(3))  # nothing unscaled or stepped
    assert torch.equal(sp.grad.to_dense(), grads[1].to_dense())


def test_the_grad_scaler_still_unscales_sparse_coo_gradients_as_torch():
    p = torch.nn.Parameter(sparse("coo"))
    p.grad = sparse("coo") * 256.0
    scaler = GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones((), requires_grad=True))
    scaler.unscale_(torch.optim.SGD([p], lr=0.1))
    assert torch.equal(p.grad.to_dense(), sparse("coo").to_dense())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_apply_updates_adds_coo_csr_csc_updates_and_refuses_blocked_ones_by_name(layout, dtype):
    p = params(dtype)
    updates = grads_with_sparse(p, layout)
    if layout in ("bsr", "bsc"):  # torch cannot add them to a dense tensor (an INTERNAL ASSERT)
        with pytest.raises(TypeError, match=rf"apply_updates: updates leaf 'enc.w' has layout torch.sparse_{layout}"):
            af.apply_updates(p, updates)
        return
    new = af.apply_updates(p, updates)
    expected = (p["enc"]["w"].to(torch.float32 if dtype == torch.bfloat16 else dtype)
                + updates["enc"]["w"].to_dense()).to(dtype)
    assert new["enc"]["w"].layout == torch.strided and torch.equal(new["enc"]["w"], expected)
    assert torch.equal(new["head"]["b"], p["head"]["b"] + 1)
