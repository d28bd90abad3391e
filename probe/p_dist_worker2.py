"""Probe worker (one rank): the README's FSDP2 recipe (clip_by_global_norm(group=env.group) + ModuleTrainer)
on an HSDP mesh (fully_shard(mesh=(replicate=2, shard=1))): params are DTensors (Replicate, Shard(0)).
Launch: python probe/p_dist_launch.py p_dist_worker2.py"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import torch.nn.functional as F
import ampfunc as af
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

env = af.dist.init_from_env()
R = env.rank
def say(*a):
    print(f"[rank {R}]", *a, flush=True)

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
g = torch.Generator().manual_seed(7)
x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
CLIP = 0.05

# single-process reference on the whole batch (torch: clip_grad_norm_ + SGD)
ref = net()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
F.cross_entropy(ref(x), y).backward()
ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
ref_opt.step()

for clip_group in ("group", None):
    model = net()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))  # HSDP: replicate over 2 ranks
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    say("placements", [tuple(p.placements) for p in model.parameters()][:1])
    tx = af.chain(af.clip_by_global_norm(CLIP, group=env.group if clip_group else None), af.sgd(0.1))
    trainer = af.ModuleTrainer(model, tx, loss_scale=af.NoOpLossScale(), group=env.group)
    rows = slice(4 * R, 4 * R + 4)
    trainer.scale(F.cross_entropy(model(x[rows]), y[rows])).backward()
    trainer.step()
    err = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    say(f"HSDP (2,1) mesh, README recipe clip group={clip_group}: max param err vs torch single process {err:.3g}",
        "WRONG" if err > 1e-5 else "ok")
import torch.distributed as dist
dist.barrier(); dist.destroy_process_group()
