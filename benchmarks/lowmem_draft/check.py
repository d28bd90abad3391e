import time, torch, ampfunc as af
from torch.utils.cpp_extension import load
from ampfunc.lowbits import q8_lookup, split_bf16, join_bf16
from ampfunc.lowmem import init_moment, decode_moment, encode_moment, init_split_master, join_master, split_master
ext = load("lowmem_scratch", ["/tmp/lowmem_scratch/lowmem_cpu.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
           extra_ldflags=["-fopenmp"], verbose=False)
maps, bases = q8_lookup()
torch.manual_seed(0)
params = {"a": torch.randn(64, 256).bfloat16(), "b": torch.randn(4100).bfloat16(), "c": torch.randn(8192).bfloat16(), "ln": torch.randn(64)}
keys = sorted(params)
sm = init_split_master(params, "t")
for k in ("a", "c"):  # nonzero remainders
    hi, lo = split_bf16(params[k].float() + 1e-4 * torch.randn(params[k].shape)); params[k].copy_(hi); sm.remainder[k].copy_(lo)
ok = True
for moments in ("fp32", "bf16", "q8"):
    P = {k: v.clone() for k, v in params.items()}; R = {k: v.clone() for k, v in sm.remainder.items()}
    m = init_moment(P, moments, "t"); v = init_moment(P, moments, "t")
    for step in range(1, 6):
        grads = {k: torch.randn(t.shape).to(t.dtype) for k, t in P.items()}
        # reference: fused fp32 kernel on the decoded numbers (af.adamw step through mixed_precision on fp32 params)
        master = join_master(P, type(sm)(R))
        M = {k: x.clone() for k, x in zip(keys, decode_moment(m, True))}
        V = {k: x.clone() for k, x in zip(keys, decode_moment(v, False))}
        tx = af.mixed_precision(af.adamw(1e-2, weight_decay=0.1), af.NoOpLossScale())
        st = tx.init({k: x.clone() for k, x in master.items()})
        inner = st.inner
        opt = inner  # AdamState
        opt = opt._replace(step=torch.tensor(float(step - 1)), exp_avg=M, exp_avg_sq=V)
        st = st._replace(inner=opt)
        newp, st = tx.step_({k: x.clone() for k, x in master.items()}, {k: g.float() for k, g in grads.items()}, st)
        ref_m = encode_moment([st.inner.exp_avg[k] for k in keys], m, True)
        ref_v = encode_moment([st.inner.exp_avg_sq[k] for k in keys], v, False)
        ref_p, ref_sm = split_master(newp, P)
        # kernel
        pl = [P[k] for k in keys]; rl = [R[k] for k in keys]; gl = [grads[k] for k in keys]
        if moments == "q8":
            ml = [m.codes[k] for k in keys]; mal = [m.absmax[k] for k in keys]; vl = [v.codes[k] for k in keys]; val = [v.absmax[k] for k in keys]
        else:
            ml = [m[k] for k in keys]; vl = [v[k] for k in keys]; mal = val = [torch.empty(0)] * len(keys)
        ext.adam_lowmem_step_(pl, rl, gl, ml, mal, vl, val, maps, bases, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, False, float(step), 1.0)
        def same(a, b):
            if a.dtype.is_floating_point: a = a.view({2: torch.int16, 4: torch.int32}[a.element_size()]); b = b.view(a.dtype)
            return bool((a == b).all())
        for k in keys:
            good = same(P[k], ref_p[k]) and same(R[k], ref_sm.remainder[k])
            if moments == "q8":
                good &= same(m.codes[k], ref_m.codes[k]) and same(m.absmax[k], ref_m.absmax[k]) and same(v.codes[k], ref_v.codes[k]) and same(v.absmax[k], ref_v.absmax[k])
            else:
                good &= same(m[k], ref_m[k]) and same(v[k], ref_v[k])
            if not good:
                ok = False; print("MISMATCH", moments, step, k)
print("all equal" if ok else "differences")
