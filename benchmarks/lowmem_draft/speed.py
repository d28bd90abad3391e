import time, torch, ampfunc as af
from torch.utils.cpp_extension import load
from ampfunc.lowbits import q8_lookup
from ampfunc.lowmem import init_moment, init_split_master
ext = load("lowmem_scratch", ["/tmp/lowmem_scratch/lowmem_cpu.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
maps, bases = q8_lookup()
import sys
torch.set_num_threads(int(sys.argv[1]))
N = 1 << 24
params = {"w": torch.randn(N).bfloat16()}
grads_pool = [{"w": torch.randn(N).bfloat16()} for _ in range(3)]
tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale())
st = tx.init(params)
P = {"w": params["w"].clone()}
def fp32_step(i):
    global P, st
    P, st = tx.step_(P, grads_pool[i % 3], st)
Q = {"w": params["w"].clone()}
sm = init_split_master(Q, "t"); mq = init_moment(Q, "q8", "t"); vq = init_moment(Q, "q8", "t")
m32 = init_moment(Q, "fp32", "t"); v32 = init_moment(Q, "fp32", "t")
e = [torch.empty(0)]
def q8_step(i):
    ext.adam_lowmem_step_([Q["w"]], [sm.remainder["w"]], [grads_pool[i % 3]["w"]], [mq.codes["w"]], [mq.absmax["w"]], [vq.codes["w"]], [vq.absmax["w"]], maps, bases, 1e-3, .9, .999, 1e-8, 1e-2, True, False, float(i + 1), 1.0)
def split_step(i):
    ext.adam_lowmem_step_([Q["w"]], [sm.remainder["w"]], [grads_pool[i % 3]["w"]], [m32["w"]], e, [v32["w"]], e, maps, bases, 1e-3, .9, .999, 1e-8, 1e-2, True, False, float(i + 1), 1.0)
fns = {"fp32": fp32_step, "split+q8": q8_step, "split": split_step}
for f in fns.values():
    f(0); f(1)
res = {k: [] for k in fns}
cpu = {k: [] for k in fns}
for r in range(7):
    for k, f in fns.items():
        t = time.perf_counter(); c0 = time.process_time(); f(r); res[k].append(time.perf_counter() - t); cpu[k].append(time.process_time() - c0)
med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
print({k: round(v * 1e3, 1) for k, v in med.items()}, "ratios fp32/x:", {k: round(med["fp32"] / v, 2) for k, v in med.items()})
mc = {k: sorted(v)[len(v) // 2] for k, v in cpu.items()}; print("cpu ms", {k: round(v * 1e3, 1) for k, v in mc.items()})
