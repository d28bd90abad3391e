"""Probe: FP8, monitor and advisor surfaces of issue 24 (report-only)."""
import warnings, math, traceback
import torch, torch.nn as nn
import ampfunc as af
from ampfunc import fp8 as F8

def tryit(label, fn):
    try:
        r = fn()
        print(f"[OK-RETURNED] {label}: {r!r}"[:400])
    except Exception as e:
        print(f"[RAISED] {label}: {type(e).__name__}: {e}"[:400])

torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
fp8 = F8.fp8_policy(m)
st = fp8.init()
p = dict(m.named_parameters())
# integer, bool, complex, float64, fp8 inputs
for dt in (torch.int64, torch.int32, torch.bool, torch.complex64, torch.float64, torch.float8_e4m3fn):
    x = torch.ones(2, 16).to(dt) if dt is not torch.complex64 else torch.ones(2, 16, dtype=dt)
    tryit(f"apply input {dt}", lambda: fp8.apply(m, p, st, x).dtype)
tryit("fp8_linear int input", lambda: F8.fp8_linear(torch.ones(2, 16, dtype=torch.int64), p["0.weight"], None, st["0"]).dtype)
tryit("fp8_linear float64 input f32 weight", lambda: F8.fp8_linear(torch.ones(2, 16, dtype=torch.float64), p["0.weight"], None, st["0"]).dtype)
# int weight through params dict
p_int = dict(p); p_int["0.weight"] = p["0.weight"].to(torch.int32)
tryit("apply int weight", lambda: fp8.apply(m, p_int, st, torch.ones(2, 16)).dtype)
# autocast path, int input
def ac():
    with fp8.autocast(m, st):
        return m(torch.ones(2, 16, dtype=torch.int64)).dtype
tryit("autocast int input", ac)
# history length mismatch
saved = F8.fp8_policy(m, recipe=F8.DelayedScaling(history_len=8)).init()
fp8b = F8.fp8_policy(m, recipe=F8.DelayedScaling(history_len=2))
tryit("apply hist8 under hist2", lambda: fp8b.apply(m, p, saved, torch.ones(2, 16)).shape)
tryit("fp8_linear hist8 under default(16)", lambda: F8.fp8_linear(torch.ones(2, 16), p["0.weight"], None, saved["0"]).shape)
tryit("advance_meta hist8 under hist2", lambda: F8.advance_meta(saved["0"].input, torch.tensor(1.0), 448.0, F8.DelayedScaling(history_len=2)))
r = fp8b.resize_history(saved)
tryit("apply resized", lambda: fp8b.apply(m, p, r, torch.ones(2, 16)).shape)
# resize semantics: newest kept. history [8,1,1,1,0..] -> len 2 -> [8,1]
h = torch.tensor([8., 1, 1, 1, 0, 0, 0, 0])
st8 = {k: F8.Fp8LinearState(*(F8.Fp8Meta(h.clone(), torch.tensor(56.0)) for _ in range(3))) for k in saved}
print("resized history", fp8b.resize_history(st8)["0"].input.amax_history.tolist())
# resize with a state for layers the policy does not have / missing a layer
tryit("resize_history extra layer", lambda: sorted(fp8b.resize_history({**st8, "bogus": st8["0"]})))
tryit("resize_history missing layer", lambda: sorted(fp8b.resize_history({"0": st8["0"]})))
# 2-d history
bad = {k: F8.Fp8LinearState(*(F8.Fp8Meta(torch.zeros(2, 2), torch.tensor(1.0)) for _ in range(3))) for k in saved}
tryit("apply 2-d history", lambda: fp8b.apply(m, p, bad, torch.ones(2, 16)).shape)
tryit("resize 2-d history", lambda: fp8b.resize_history(bad))
# history of right length but int dtype / scale non-0d
bad2 = {k: F8.Fp8LinearState(*(F8.Fp8Meta(torch.zeros(2, dtype=torch.int64), torch.ones(3)) for _ in range(3))) for k in saved}
tryit("apply int history, 1-d scale", lambda: fp8b.apply(m, p, bad2, torch.ones(2, 16)).shape)
# no Linear / all excluded
conv = nn.Sequential(nn.Conv1d(2, 2, 1))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    pol = F8.fp8_policy(conv)
    print("no-linear warnings:", [str(x.message)[:80] for x in w])
    s0 = pol.init()
    x = torch.randn(1, 2, 3)
    out = pol.apply(conv, dict(conv.named_parameters()), s0, x)
    print("no-linear unchanged:", torch.equal(out, conv(x)), "state", s0)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    pol = F8.fp8_policy(m, exclude=("0", "2"))
    print("all-excluded warnings:", len(w), pol.layers)
    with pol.autocast(m, pol.init()):
        print("all-excluded autocast ok", m(torch.ones(1, 16)).shape)
tryit("include=[] (empty list)", lambda: F8.fp8_policy(m, include=[]).layers)
tryit("exclude='' (root)", lambda: F8.fp8_policy(m, exclude="").layers)
# subclass of Linear silently not FP8
class MyLin(nn.Linear):
    pass
tryit("subclass of nn.Linear layers", lambda: F8.fp8_policy(nn.Sequential(MyLin(4, 4), nn.Linear(4, 4))).layers)
mha = nn.MultiheadAttention(16, 2)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    tryit("MultiheadAttention layers", lambda: F8.fp8_policy(mha).layers)
    print("  warnings", [str(x.message)[:60] for x in w])

print("==== monitor")
M = af.monitor
def stats_of(skipped, steps):
    s = M.init_stats()
    for i in range(steps):
        s = M.record(s, torch.tensor(i >= skipped), 1024.0)
    return s
for skipped, steps, thr in [(3, 10, 0.3), (1, 3, 1 / 3), (2, 3, 2 / 3), (1, 10, 0.1), (1, 20, 0.05), (7, 10, 0.7), (1, 7, 1/7)]:
    print(f"health {skipped}/{steps} thr={thr!r}:", M.health(stats_of(skipped, steps), max_skip_rate=thr, max_consecutive_skips=99))
tryit("health max_skip_rate=nan", lambda: M.health(stats_of(5, 10), max_skip_rate=float("nan"), max_consecutive_skips=99))
tryit("health max_skip_rate=-1", lambda: M.health(stats_of(0, 10), max_skip_rate=-1, max_consecutive_skips=99))
tryit("health max_skip_rate=5 (percent?)", lambda: M.health(stats_of(5, 10), max_skip_rate=5, max_consecutive_skips=99))
# TrainingMonitor thresholds
for thr, skipped, window in [(0.3, 3, 10), (1 / 3, 1, 3), (1 / 3, 3, 9)]:
    mon = af.TrainingMonitor(window=window, max_skip_rate=thr, min_steps=1)
    for i in range(window):
        mon = mon.record(torch.tensor(i >= skipped), 1024.0)
    print(f"TrainingMonitor {skipped}/{window} thr={thr!r}:", mon.check_health()["alerts"])
# scale drop exactly at factor
mon = af.TrainingMonitor(window=10, scale_drop_factor=2.0)
for s in (1024.0, 512.0):
    mon = mon.record(torch.tensor(True), s)
print("scale drop exactly 2x with factor 2:", mon.check_health()["checks"]["scale_falling"])
mon = af.TrainingMonitor(window=10, explode_factor=2.0)
for l in (1.0, 1.0, 1.0, 1.0, 2.0):
    mon = mon.record(torch.tensor(True), 1.0, loss=l)
print("loss exactly 2x median with factor 2:", mon.check_health()["checks"]["loss_exploding"])
# moment overflows
tx = af.adamw(1e-3)
params = {"w": torch.ones(2), "b": torch.ones(2)}
g = {"w": torch.tensor([1e21, 1.0]), "b": torch.ones(2)}
u, s = tx.update(g, tx.init(params), params)
print("moment_overflows adamw:", M.moment_overflows(s))
print("health(state=) :", [a[:60] for a in M.health(M.init_stats(), state=s)])
mon = af.TrainingMonitor()
print("check_health(state) no steps:", mon.check_health(s)["status"], mon.check_health(s)["moment_overflows"])
# NaN moment (not inf)
s_nan = tx.update({"w": torch.tensor([float('nan'), 1.0]), "b": torch.ones(2)}, tx.init(params), params)[1]
print("moment_overflows NaN grad (plain adamw applies nan):", M.moment_overflows(s_nan))
# bf16 moments? adam with mu_dtype?
for name in ("sgd",):
    pass
# mixed_precision step_ path with 1e21 gradient
mp = af.mixed_precision(af.adamw(1e-3), loss_scale=af.NoOpLossScale())
ps = {"w": torch.ones(2)}
ms = mp.init(ps)
ps2, ms2 = mp.step(ps, {"w": torch.tensor([1e21, 1.0])}, ms)
ps3, ms3 = mp.step_({"w": torch.ones(2)}, {"w": torch.tensor([1e21, 1.0])}, mp.init(ps))
print("mixed_precision.step_ moment_overflows:", M.moment_overflows(ms3))
print("mixed_precision.step moment_overflows:", M.moment_overflows(ms2))
tryit("moment_overflows(None)", lambda: M.moment_overflows(None))
tryit("moment_overflows(a tensor)", lambda: M.moment_overflows(torch.tensor([float('inf')])))
tryit("moment_overflows(dict exp_avg_sq int)", lambda: M.moment_overflows({"exp_avg_sq": {"w": torch.tensor([2**31-1])}}))
# from_torch state
w = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.Adam([w])
w.grad = torch.tensor([1e21, 1.0]); opt.step()
tryit("moment_overflows(torch optimizer state_dict)", lambda: M.moment_overflows(opt.state_dict()))

print("==== advisor")
for cap in [(5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (99, 9), (1, 0)]:
    try:
        r = af.recommend_policy("cuda", capability=cap)
        print(cap, r.precision, "|", r.reason[:90])
    except Exception as e:
        print(cap, "RAISED", type(e).__name__, str(e)[:100])
import numpy as np
for cap in [(0, 0), (-1, 0), (8, 10), (8.0, 0), (True, 0), "8.0", (8,), (8, 0, 0), np.array([8, 0]), (np.int64(8), np.int64(0)), torch.tensor([8, 0])]:
    tryit(f"capability={cap!r}", lambda: af.recommend_policy("cuda", capability=cap).precision)
tryit("capability with device cpu", lambda: af.recommend_policy("cpu", capability=(8, 0)))
tryit("capability with device 'cuda:0'", lambda: af.recommend_policy("cuda:0", capability=(8, 0)).precision)
tryit("capability with device 'mps'", lambda: af.recommend_policy("mps", capability=(8, 0)))
tryit("n_params=-1", lambda: af.recommend_policy("cuda", capability=(8, 0), n_params=-1))
tryit("n_params=1.5e9 float", lambda: af.recommend_policy("cuda", capability=(8, 0), n_params=1.5e9))
tryit("stability='HIGH'", lambda: af.recommend_policy("cuda", capability=(8, 0), stability="HIGH"))
tryit("positional capability", lambda: af.recommend_policy("cuda", (8, 0)))
tryit("old kw compute_capability", lambda: af.recommend_policy("cuda", compute_capability=(8, 0)))
