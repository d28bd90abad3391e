"""Probe worker (one rank). Launch with probe/p_dist_launch.py. Prints findings per rank."""
import os, sys, traceback
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import torch.distributed as dist
import ampfunc as af
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

env = af.dist.init_from_env()
R, W = env.rank, env.world_size
mesh = init_device_mesh("cpu", (W,))

def say(*a):
    print(f"[rank {R}]", *a, flush=True)

def attempt(label, fn):
    try:
        say(label, "->", fn())
    except Exception as e:
        say(label, "-> RAISED", type(e).__name__, str(e)[:200])

def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t

torch.manual_seed(0)
A, B = torch.randn(5, 2), torch.randn(3)            # uneven Shard(0) and a Replicate leaf
GA, GB = torch.randn(5, 2) * 10, torch.randn(3) * 10  # big: the clip is active
CLIP, LR = 1.0, 0.5

def reference():
    p = {"a": A.clone(), "b": B.clone()}
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(CLIP), af.sgd(LR)), af.NoOpLossScale())
    s = tx.init(p)
    p, s = tx.step(p, {"a": GA.clone(), "b": GB.clone()}, s)
    return p

def dparams():
    return {"a": distribute_tensor(A.clone(), mesh, [Shard(0)]), "b": distribute_tensor(B.clone(), mesh, [Replicate()])}

def dgrads():
    return {"a": distribute_tensor(GA.clone(), mesh, [Shard(0)]), "b": distribute_tensor(GB.clone(), mesh, [Replicate()])}

ref = reference()
# 1. clip(group=WORLD) with DTensor params (a user who did DDP passes group= everywhere)
for clip_group in (None, env.group):
    for mp_group in (None, env.group):
        for path in ("step", "step_", "update"):
            p = dparams()
            tx = af.mixed_precision(af.chain(af.clip_by_global_norm(CLIP, group=clip_group), af.sgd(LR)),
                                    af.NoOpLossScale(), group=mp_group)
            s = tx.init(p)
            try:
                if path == "update":
                    u, s = tx.update(dgrads(), s, p)
                    newp = af.apply_updates(p, u)
                else:
                    newp, s = getattr(tx, path)(p, dgrads(), s)
                    if path == "step_":
                        newp = p
                err = max((full(newp[k]) - ref[k]).abs().max().item() for k in ref)
                say(f"DTensor Shard+Replicate, clip group={'W' if clip_group else None} mp group={'W' if mp_group else None} {path}: max err vs 1-process {err:.3g}",
                    "WRONG" if err > 1e-5 else "ok")
            except Exception as e:
                say(f"clip group={clip_group is not None} mp group={mp_group is not None} {path}: RAISED {type(e).__name__}: {str(e)[:160]}")

# 2. optimizer state made on one placement, stepped with params resharded (Replicate instead of Shard)
p = dparams(); tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale()); s = tx.init(p)
p2 = {"a": distribute_tensor(A.clone(), mesh, [Replicate()]), "b": p["b"]}
g2 = {"a": distribute_tensor(GA.clone(), mesh, [Replicate()]), "b": dgrads()["b"]}
attempt("state from Shard(0) stepped with Replicate params (step_)", lambda: (tx.step_(p2, g2, s), "NOT REFUSED")[1])
# 2b. state from DTensor params used with plain params
p = dparams(); s = tx.init(p)
attempt("state from DTensor params stepped with plain full params", lambda: (tx.step({"a": A.clone(), "b": B.clone()}, {"a": GA.clone(), "b": GB.clone()}, s), "NOT REFUSED")[1])

# 3. mix of DTensor and plain params / grads
attempt("mix plain+DTensor params", lambda: tx.init({"a": dparams()["a"], "b": B.clone()}))
p = dparams(); s = tx.init(p)
attempt("plain grad for a DTensor param (step_)", lambda: tx.step_(p, {"a": dgrads()["a"], "b": GB.clone()}, s))
mesh2 = init_device_mesh("cpu", (W, 1), mesh_dim_names=("x", "y"))
attempt("params on two meshes", lambda: tx.init({"a": dparams()["a"], "b": distribute_tensor(B.clone(), mesh2, [Replicate(), Replicate()])}))
# 4. an inf only on rank 1, only in the REPLICATE leaf's local shard (ranks disagree on a replicated grad)
p = dparams(); s = tx.init(p)
g = dgrads()
if R == 1:
    g["b"].to_local()[0] = float("inf")
before = {k: full(v).clone() for k, v in p.items()}
p_new, s_new = tx.step(p, g, s)
say("inf on rank 1 in a Replicate grad: finite", bool(s_new.finite), "params unchanged", all(torch.equal(full(p_new[k]), before[k]) for k in before))
# 5. NaN in rank 0's Shard leaf, step_ with ModuleTrainer-like clip chain
p = dparams(); tx5 = af.mixed_precision(af.chain(af.clip_by_global_norm(CLIP), af.adamw(1e-3)), af.DynamicLossScale(4.0)); s = tx5.init(p)
g = dgrads()
if R == 0:
    g["a"].to_local()[0, 0] = float("nan")
before = {k: full(v).clone() for k, v in p.items()}
tx5.step_(p, g, s)
say("NaN on rank 0 in Shard grad, step_: params unchanged", all(torch.equal(full(p[k]), before[k]) for k in before), "scale", float(s.loss_scale.loss_scale) if hasattr(s.loss_scale, 'loss_scale') else s.loss_scale)

# 6. global_norm with group= AND DTensor leaves
attempt("af.optim.global_norm(dtensor grads) vs true", lambda: (af.optim.global_norm(dgrads()).item(), torch.cat([GA.flatten(), GB]).norm().item()))
attempt("af.optim.global_norm(dtensor grads, group=W) vs true", lambda: (af.optim.global_norm(dgrads(), group=env.group).item(), torch.cat([GA.flatten(), GB]).norm().item()))
attempt("af.optim.global_norm(local shards, group=W) (Replicate leaf summed twice?)", lambda: (af.optim.global_norm(af.dist.local_shards(dgrads()), group=env.group).item(), torch.cat([GA.flatten(), GB]).norm().item()))

# 7. sharded checkpoint: resume, then load on a directory made with another world? load with like of other placements
import tempfile
d = os.path.join(os.environ["PROBE_OUT"], "ck")
p = dparams(); s = tx.init(p); p, s = tx.step(p, dgrads(), s)
af.dist.save_sharded(s, d, group=env.group)
dist.barrier()
s2 = af.dist.load_sharded(d, tx.init(dparams()), group=env.group)
same = all(torch.equal(a, b) for a, b in zip(af.tree.tree_leaves(s), af.tree.tree_leaves(s2)) if isinstance(a, torch.Tensor))
say("save/load_sharded bit exact:", same)
p_rep = {"a": distribute_tensor(A.clone(), mesh, [Replicate()]), "b": dparams()["b"]}
attempt("load_sharded into state of other placement (Replicate a)", lambda: (af.dist.load_sharded(d, tx.init(p_rep), group=env.group), "NOT REFUSED")[1])
# saved by a sub-group world of 1? load with group=None in a 2-rank world
attempt("load_sharded group=None in 2-rank world", lambda: (af.dist.load_sharded(d, tx.init(dparams())), "loaded")[1])
dist.barrier()
dist.destroy_process_group()
