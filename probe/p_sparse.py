"""Probe: sparse layouts refused naming the leaf before any write, sparse leaf LAST in flatten order."""
import warnings
import torch
import ampfunc as af
from ampfunc.compat.torch_amp import GradScaler
warnings.simplefilter("ignore")

def sparse(layout, dense=None):
    dense = torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 3.0], [1.0, 0, 0]]) if dense is None else dense
    return {"coo": dense.to_sparse, "csr": dense.to_sparse_csr, "csc": dense.to_sparse_csc,
            "bsr": lambda: dense.to_sparse_bsr((1, 1)), "bsc": lambda: dense.to_sparse_bsc((1, 1))}[layout]()

def leaves(t):
    return [x for x in af.tree.tree_leaves(t) if isinstance(x, torch.Tensor)]

def run(label, build, call, layout):
    p = {"a": torch.full((5,), 0.5), "m": torch.full((3,), 0.5), "z": torch.full((4, 3), 0.5)}
    g = {"a": torch.ones(5), "m": torch.ones(3), "z": sparse(layout)}
    tx, s = build(p)
    before = [x.clone() for x in leaves((p, s))]
    vers = [x._version for x in leaves((p, s))]
    try:
        call(tx, p, g, s)
        res = "NOT REFUSED"
    except Exception as e:
        res = f"{type(e).__name__}: {str(e)[:110]}"
    same = all(torch.equal(a, b) for a, b in zip(leaves((p, s)), before)) and vers == [x._version for x in leaves((p, s))]
    named = "'z'" in res
    print(f"{'OK ' if named and same else 'BAD'} {label:28s} {layout}: untouched={same} named={named} | {res}")

mp = lambda inner, **kw: (lambda p: (lambda tx: (tx, tx.init(p)))(af.mixed_precision(inner(), loss_scale=af.DynamicLossScale(256.0), **kw)))
pl = lambda inner: (lambda p: (lambda tx: (tx, tx.init(p)))(inner()))
CALLS = {
    "mp-adamw.update": (mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.update(g, s, p)),
    "mp-adamw.step": (mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.step(p, g, s)),
    "mp-adamw.step_": (mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-adamw.step_ trust_grads": (mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.step_(p, g, s, trust_grads=True)),
    "mp-clip-adamw.step_": (mp(lambda: af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3))), lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-sgd.step_": (mp(lambda: af.sgd(0.1)), lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-accumulate-adamw.step_": (mp(lambda: af.accumulate(af.adamw(1e-3), 2)), lambda tx, p, g, s: tx.step_(p, g, s)),
    "sgd.update": (pl(lambda: af.sgd(0.1)), lambda tx, p, g, s: tx.update(g, s, p)),
    "adam.update": (pl(lambda: af.adam(1e-3)), lambda tx, p, g, s: tx.update(g, s, p)),
    "add_decayed_weights.update": (pl(lambda: af.add_decayed_weights(0.1)), lambda tx, p, g, s: tx.update(g, s, p)),
    "accumulate(adamw).update": (pl(lambda: af.accumulate(af.adamw(1e-3), 2)), lambda tx, p, g, s: tx.update(g, s, p)),
    "from_torch(Adam).update": (pl(lambda: af.from_torch(torch.optim.Adam, lr=1e-3)), lambda tx, p, g, s: tx.update(g, s, p)),
    "unscale": (lambda p: (None, af.DynamicLossScale(256.0)), lambda tx, p, g, s: af.mixed.unscale(g, s)),
    "unscale_and_check_": (lambda p: (None, af.DynamicLossScale(256.0)), lambda tx, p, g, s: af.mixed.unscale_and_check_(g, s)),
    "apply_updates": (lambda p: (None, None), lambda tx, p, g, s: af.apply_updates(p, g)),
    "tree.all_finite": (lambda p: (None, None), lambda tx, p, g, s: af.tree.all_finite(g)),
}
for layout in ("coo", "csr", "bsc"):
    p0 = {"a": torch.full((5,), 0.5), "m": torch.full((3,), 0.5), "z": torch.full((4, 3), 0.5)}
    try:
        out = af.apply_updates(p0, {"a": torch.ones(5), "m": torch.ones(3), "z": sparse(layout)})
        print("apply_updates", layout, "result layout", out["z"].layout, "correct", torch.equal(out["z"].to_dense(), p0["z"] + sparse(layout).to_dense()))
    except Exception as e:
        print("apply_updates", layout, type(e).__name__, str(e)[:80])
    for k, (b, c) in CALLS.items():
        run(k, b, c, layout)

# ModuleTrainer with a hand-set compressed grad on the LAST param, flat and not
for flat in (False, True):
    for layout in ("coo",):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(3, 4))
        tr = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=af.DynamicLossScale(256.0), flat=flat)
        model(torch.ones(1, 3)).sum().backward() if False else None
        for prm in model.parameters():
            prm.grad = torch.ones_like(prm)
        model[1].weight.grad = sparse(layout, torch.ones(4, 3))
        before = [q.detach().clone() for q in model.parameters()]
        try:
            tr.step(); res = "NOT REFUSED"
        except Exception as e:
            res = f"{type(e).__name__}: {str(e)[:110]}"
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
        print(f"ModuleTrainer flat={flat} {layout}: untouched={same} | {res}")

# GradScaler facade: COO grad holding inf must be detected as torch does
for use_torch in (False, True):
    p = torch.nn.Parameter(torch.zeros(4, 3))
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([1e38, 1e38]), (4, 3))  # duplicates: coalesce sums to inf? no: fp32 sums to 2e38 finite
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([3e38, 3e38]), (4, 3))  # coalesced sum overflows to inf
    opt = torch.optim.SGD([p], lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=1.0) if use_torch else GradScaler("cpu", init_scale=1.0)
    sc.scale(torch.ones((), requires_grad=True))
    sc.step(opt); sc.update()
    print(("torch" if use_torch else "ampfunc"), "GradScaler: COO duplicate entries summing to inf -> scale after update", sc.get_scale(), "param finite", bool(torch.isfinite(p).all()))
