"""Probe (lowmem branch): master='split' bit exactness, skip writes nothing, q8/bf16 moments, bad inputs.
Run with PYTHONPATH pointing at a checkout of branch lowmem."""
import warnings
import torch
import ampfunc as af
warnings.simplefilter("ignore")

def tryit(label, fn):
    try:
        r = fn()
        print(f"[ACCEPTED] {label}: {r!r}"[:260])
    except Exception as e:
        print(f"[RAISED]   {label}: {type(e).__name__}: {e}"[:260])

def leaves(t):
    return [x for x in af.tree.tree_leaves(t) if isinstance(x, torch.Tensor)]

torch.manual_seed(0)
shapes = {"w": (37, 5), "b": (5,), "big": (3000,)}
p32 = {k: torch.randn(*s) for k, s in shapes.items()}
grads = [{k: torch.randn(*s) * (10 ** (i % 3 - 1)) for k, s in shapes.items()} for i in range(6)]
# 1. split master: the joined fp32 masters equal a fp32-master run bit for bit (bf16 params)
for path in ("step", "step_", "update"):
    res = {}
    for master in ("fp32", "split"):
        tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale(), master=master)
        p = {k: v.to(torch.bfloat16) for k, v in p32.items()}
        s = tx.init(p)
        for g in grads:
            gb = {k: v.to(torch.bfloat16) for k, v in g.items()}
            if path == "step":
                p, s = tx.step(p, gb, s)
            elif path == "step_":
                tx.step_(p, gb, s)
            else:
                u, s = tx.update(gb, s, p)
                p = af.apply_updates(p, u)
        res[master] = (af.master_params(p, s), p)
    m_ok = all(torch.equal(res["fp32"][0][k], res["split"][0][k]) for k in shapes)
    p_ok = all(torch.equal(res["fp32"][1][k], res["split"][1][k]) for k in shapes)
    print(f"split vs fp32 master, {path}: masters bit-equal {m_ok}, bf16 params bit-equal {p_ok}")

# 2. a skipped step writes nothing: every state tensor bit-identical, for split/q8/bf16
for master, moments in (("split", "fp32"), ("fp32", "q8"), ("split", "q8"), ("fp32", "bf16")):
    tx = af.mixed_precision(af.adamw(1e-2, moments=moments), af.DynamicLossScale(2.0 ** 4), master=master)
    p = {k: v.to(torch.bfloat16) for k, v in p32.items()}
    s = tx.init(p)
    tx.step_(p, {k: v.to(torch.bfloat16) for k, v in grads[0].items()}, s)  # one applied step: nonzero moments
    bad = {k: v.to(torch.bfloat16) for k, v in grads[1].items()}
    bad["big"][7] = float("inf")
    before = [x.clone() for x in leaves((p, s.master, s.inner))]
    tx.step_(p, bad, s)
    same = all(torch.equal(a, b) for a, b in zip(leaves((p, s.master, s.inner)), before))
    p2 = {k: v.to(torch.bfloat16) for k, v in p32.items()}; s2 = tx.init(p2)
    p2, s2 = tx.step(p2, {k: v.to(torch.bfloat16) for k, v in grads[0].items()}, s2)
    before2 = [x.clone() for x in leaves((p2, s2.master, s2.inner))]
    p3, s3 = tx.step(p2, bad, s2)
    same2 = all(torch.equal(a, b) for a, b in zip(leaves((p3, s3.master, s3.inner)), before2))
    print(f"skip master={master} moments={moments}: step_ untouched {same}, step returns same bits {same2}, finite={bool(s.finite)}")

# 3. bad inputs
tryit("master='split' with fp16 params (init)", lambda: af.mixed_precision(af.adamw(), af.NoOpLossScale(), master="split").init({"w": torch.ones(3, dtype=torch.float16)}))
tryit("master='split' with fp32 params (nothing to split)", lambda: type(af.mixed_precision(af.adamw(), af.NoOpLossScale(), master="split").init({"w": torch.ones(3)}).master).__name__)
tryit("master='split', master_dtype=float64", lambda: af.mixed_precision(af.adamw(), af.NoOpLossScale(), torch.float64, master="split"))
tryit("master='Split'", lambda: af.mixed_precision(af.adamw(), af.NoOpLossScale(), master="Split"))
tryit("master='bf16'", lambda: af.mixed_precision(af.adamw(), af.NoOpLossScale(), master="bf16"))
tryit("moments='int8'", lambda: af.adamw(moments="int8"))
tryit("sgd(moments='q8')", lambda: af.sgd(0.1, momentum=0.9, moments="q8"))
tryit("adamw(moments='q8').init int leaf", lambda: af.adamw(moments="q8").init({"w": torch.ones(3000), "i": torch.ones(3000, dtype=torch.int64)}))
tryit("adamw(moments='q8').update int grad", lambda: (lambda tx: tx.update({"w": torch.ones(3000, dtype=torch.int32)}, tx.init({"w": torch.ones(3000)}), {"w": torch.ones(3000)}))(af.adamw(moments="q8")))
tryit("adamw(moments='q8') init on fp64 leaf", lambda: af.adamw(moments="q8").init({"w": torch.ones(3000, dtype=torch.float64)}).exp_avg["w"].dtype if hasattr(af.adamw(moments="q8").init({"w": torch.ones(3000, dtype=torch.float64)}).exp_avg, "__getitem__") else "?")
tryit("adamw(moments='q8') empty leaf + 1-element leaf", lambda: (lambda tx, p: tx.update({"e": torch.ones(0), "o": torch.ones(1)}, tx.init(p), p))(af.adamw(moments="q8"), {"e": torch.ones(0), "o": torch.ones(1)})[0])
# state from another setting
p = {k: v.to(torch.bfloat16) for k, v in p32.items()}
g0 = {k: v.to(torch.bfloat16) for k, v in grads[0].items()}
mk = lambda master="fp32", moments="fp32": af.mixed_precision(af.adamw(1e-2, moments=moments), af.NoOpLossScale(), master=master)
for (ma, mo), (mb, mob) in [(("split", "fp32"), ("fp32", "fp32")), (("fp32", "fp32"), ("split", "fp32")),
                            (("fp32", "q8"), ("fp32", "fp32")), (("fp32", "fp32"), ("fp32", "q8")),
                            (("fp32", "q8"), ("fp32", "bf16")), (("fp32", "bf16"), ("fp32", "fp32")),
                            (("fp32", "fp32"), ("fp32", "bf16"))]:
    s = mk(ma, mo).init(p)
    for path in ("step_", "update"):
        pp = {k: v.clone() for k, v in p.items()}
        before = [x.clone() for x in leaves((pp, s))]
        def call():
            if path == "step_":
                mk(mb, mob).step_(pp, g0, s)
            else:
                mk(mb, mob).update(g0, s, pp)
            return "NOT REFUSED"
        tryit(f"state of master={ma},moments={mo} into master={mb},moments={mob} ({path})", call)
        if not all(torch.equal(a, b) for a, b in zip(leaves((pp, s)), before)):
            print("    !!! state or params were WRITTEN before the refusal")
# plain adamw(moments=q8) state into adamw(moments=fp32).update
sq = af.adamw(moments="q8").init(p32)
tryit("plain adamw q8 state into adamw fp32 update", lambda: (af.adamw().update(grads[0], sq, p32), "NOT REFUSED")[1])
tryit("plain adamw fp32 state into adamw q8 update", lambda: (af.adamw(moments="q8").update(grads[0], af.adamw().init(p32), p32), "NOT REFUSED")[1])
# moment overflow with q8/bf16 moments: still reported?
for moments in ("bf16", "q8"):
    tx = af.adamw(1e-3, moments=moments)
    pp = {"w": torch.ones(3000)}
    gg = {"w": torch.ones(3000)}; gg["w"][0] = 1e21
    _, st = tx.update(gg, tx.init(pp), pp)
    tryit(f"moment_overflows with moments={moments} after a 1e21 gradient", lambda: af.monitor.moment_overflows(st))
# ModuleTrainer master='split' with an fp32 model / fp16 model
tryit("ModuleTrainer(master='split') fp16 model", lambda: af.ModuleTrainer(torch.nn.Linear(4, 4).half(), af.adamw(), loss_scale=af.NoOpLossScale(), master="split"))
tryit("ModuleTrainer(master='split', flat=True) bf16 model", lambda: af.ModuleTrainer(torch.nn.Linear(4, 4).bfloat16(), af.adamw(), loss_scale=af.NoOpLossScale(), master="split", flat=True))
