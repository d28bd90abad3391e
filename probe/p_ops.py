"""Probe: ampfunc.ops bad inputs (argument and leaf named?) and torch.compile(fullgraph=True)."""
import sys, time
import torch
import ampfunc as af
from ampfunc import ops

def tryit(label, fn):
    try:
        r = fn()
        print(f"[ACCEPTED] {label}: {r!r}"[:260])
    except Exception as e:
        print(f"[RAISED]   {label}: {type(e).__name__}: {e}"[:260])

print("backend", ops.backend())
def adam_args(n=2, **over):
    a = dict(params=[torch.ones(3) for _ in range(n)], grads=[torch.ones(3) for _ in range(n)],
             exp_avgs=[torch.zeros(3) for _ in range(n)], exp_avg_sqs=[torch.zeros(3) for _ in range(n)],
             max_exp_avg_sqs=[], model_params=[], step=torch.zeros((), dtype=torch.float32),
             grad_scale=torch.ones(()), finite=torch.tensor(True))
    a.update(over)
    return a
def run_adam(**over):
    a = adam_args(**over)
    ops.adam_step_(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["max_exp_avg_sqs"], a["model_params"],
                   a["step"], a["grad_scale"], a["finite"], lr=1e-3)
    return "ran", [p.tolist() for p in a["params"]]
tryit("adam_step_ ok", lambda: run_adam())
g_ = torch.ones(3)
tryit("adam_step_ grads[0] independent (reference for the alias case)", lambda: run_adam(grads=[g_.clone(), torch.ones(3)], exp_avgs=[g_.clone(), torch.zeros(3)]))
tryit("adam_step_ grads list shorter", lambda: run_adam(grads=[torch.ones(3)]))
tryit("adam_step_ grads[1] wrong shape", lambda: run_adam(grads=[torch.ones(3), torch.ones(4)]))
tryit("adam_step_ grads[1] int", lambda: run_adam(grads=[torch.ones(3), torch.ones(3, dtype=torch.int32)]))
tryit("adam_step_ exp_avg_sqs[1] fp16", lambda: run_adam(exp_avg_sqs=[torch.zeros(3), torch.zeros(3, dtype=torch.float16)]))
tryit("adam_step_ params[1] int", lambda: run_adam(params=[torch.ones(3), torch.ones(3, dtype=torch.int64)]))
tryit("adam_step_ step int64", lambda: run_adam(step=torch.zeros((), dtype=torch.int64)))
tryit("adam_step_ step shape (2,)", lambda: run_adam(step=torch.zeros(2)))
tryit("adam_step_ grad_scale shape (3,)", lambda: run_adam(grad_scale=torch.ones(3)))
tryit("adam_step_ finite float", lambda: run_adam(finite=torch.tensor(1.0)))
tryit("adam_step_ finite shape (2,)", lambda: run_adam(finite=torch.tensor([True, True])))
g = torch.ones(3)
tryit("adam_step_ grads[0] is exp_avgs[0] (alias)", lambda: run_adam(grads=[g, torch.ones(3)], exp_avgs=[g, torch.zeros(3)]))
p0 = torch.ones(3)
tryit("adam_step_ params[0] is params[1] (dup)", lambda: run_adam(params=[p0, p0]))
big = torch.zeros(6)
tryit("adam_step_ overlapping views params[0]=big[0:3], exp_avgs[0]=big[2:5]", lambda: run_adam(params=[big[0:3], torch.ones(3)], exp_avgs=[big[2:5], torch.zeros(3)]))
tryit("adam_step_ non-contiguous param", lambda: run_adam(params=[torch.ones(3, 2)[:, 0], torch.ones(3)]))
tryit("adam_step_ sparse grad", lambda: run_adam(grads=[torch.ones(3).to_sparse(), torch.ones(3)]))
tryit("adam_step_ meta tensor", lambda: run_adam(params=[torch.ones(3, device="meta"), torch.ones(3)]))
tryit("adam_step_ requires_grad leaf param", lambda: run_adam(params=[torch.ones(3, requires_grad=True), torch.ones(3)]))
tryit("adam_step_ lr=nan", lambda: ops.adam_step_([torch.ones(1)], [torch.ones(1)], [torch.zeros(1)], [torch.zeros(1)], [], [], torch.zeros(()), torch.ones(()), torch.tensor(True), lr=float("nan")))
tryit("adam_step_ beta1=1.0", lambda: ops.adam_step_([torch.ones(1)], [torch.ones(1)], [torch.zeros(1)], [torch.zeros(1)], [], [], torch.zeros(()), torch.ones(()), torch.tensor(True), lr=1e-3, beta1=1.0))
tryit("adam_step_ b1= (public name)", lambda: ops.adam_step_([torch.ones(1)], [torch.ones(1)], [torch.zeros(1)], [torch.zeros(1)], [], [], torch.zeros(()), torch.ones(()), torch.tensor(True), lr=1e-3, b1=0.9))
tryit("check([int tensor])", lambda: ops.check([torch.ones(2), torch.ones(2, dtype=torch.int32)]))
tryit("check([])", lambda: ops.check([]))
tryit("check(a tensor, not a list)", lambda: ops.check(torch.ones(3)))
tryit("unscale_ inv_scale shape (2,)", lambda: ops.unscale_([torch.ones(2)], torch.ones(2)))
tryit("unscale_ inv_scale int", lambda: ops.unscale_([torch.ones(2)], torch.ones((), dtype=torch.int64)))
tryit("unscale_ on int tensor", lambda: ops.unscale_([torch.ones(2, dtype=torch.int32)], torch.ones(())))
tryit("check_norm fp64 + fp16 mix", lambda: ops.check_norm([torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float16)]))
tryit("apply_updates length mismatch", lambda: ops.apply_updates([torch.ones(2)], [torch.ones(2), torch.ones(2)]))
tryit("apply_updates shape mismatch", lambda: ops.apply_updates([torch.ones(2)], [torch.ones(3)]))
tryit("apply_updates broadcastable (1,)", lambda: ops.apply_updates([torch.ones(2)], [torch.ones(1)]))
tryit("update_scale finite float", lambda: ops.update_scale(torch.tensor(2.0), torch.zeros((), dtype=torch.int32), torch.zeros((), dtype=torch.int32), torch.tensor(1.0), growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=1))
# via the public front end: an error in the kernel path names the leaf?
mp = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale())
p = {"a": torch.ones(3), "b": torch.ones(2)}
s = mp.init(p)
s_bad = s._replace(inner=s.inner._replace(exp_avg={"a": s.inner.exp_avg["a"], "b": torch.zeros(2, dtype=torch.float16)})) if hasattr(s.inner, "exp_avg") else None
tryit("mp.step_ with state exp_avg['b'] fp16 (edited)", lambda: mp.step_(p, {"a": torch.ones(3), "b": torch.ones(2)}, s_bad))
s_bad2 = s._replace(inner=s.inner._replace(exp_avg={"a": s.inner.exp_avg["a"], "b": torch.zeros(3)}))
tryit("mp.step_ with state exp_avg['b'] wrong shape (edited)", lambda: mp.step_(p, {"a": torch.ones(3), "b": torch.ones(2)}, s_bad2))
s_alias = s._replace(inner=s.inner._replace(exp_avg={"a": s.inner.exp_avg["a"], "b": s.inner.exp_avg_sq["b"]}))
tryit("mp.step_ with exp_avg['b'] aliasing exp_avg_sq['b']", lambda: mp.step_(p, {"a": torch.ones(3), "b": torch.ones(2)}, s_alias))

gb = {"a": torch.ones(3), "b": s.inner.exp_avg["b"]}
tryit("mp.step_ with grads['b'] being state exp_avg['b'] (read aliasing written)", lambda: mp.step_(p, gb, s))
if "--compile" in sys.argv:
    torch._dynamo.config.cache_size_limit = 64
    def f(gs, inv):
        fin, norm = ops.check_norm(gs, inv)
        return ops.unscale(gs, inv), fin, norm
    t = time.time()
    cf = torch.compile(f, fullgraph=True)
    gs = [torch.randn(5), torch.tensor([1.0, float("inf")])]
    out_c, out_e = cf(gs, torch.tensor(0.5)), f(gs, torch.tensor(0.5))
    print("compiled check_norm/unscale equal eager:", all(torch.equal(a, b) for a, b in zip(af.tree.tree_leaves(out_c), af.tree.tree_leaves(out_e))), f"{time.time()-t:.0f}s")
    def g(a):
        ops.adam_step_(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], [], [], a["step"], a["grad_scale"], a["finite"], lr=1e-3)
    a_c, a_e = adam_args(), adam_args()
    t = time.time()
    torch.compile(g, fullgraph=True)(a_c); g(a_e)
    print("compiled adam_step_ equals eager:", all(torch.equal(x, y) for x, y in zip(a_c["params"] + a_c["exp_avgs"] + [a_c["step"]], a_e["params"] + a_e["exp_avgs"] + [a_e["step"]])), f"{time.time()-t:.0f}s")
    # bad input under compile: does it still name the argument?
    bad = adam_args(grads=[torch.ones(3), torch.ones(4)])
    tryit("compiled adam_step_ grads[1] wrong shape", lambda: torch.compile(g, fullgraph=True)(bad))
    tryit("compiled check([int])", lambda: torch.compile(lambda x: ops.check(x), fullgraph=True)([torch.ones(2, dtype=torch.int32)]))
