"""Probe worker (one rank): moment_overflows / check_health on a sharded state, the overflow in rank 1's
shard only. Rank 0 is where users log. Launch: python probe/p_dist_launch.py p_dist_worker4.py"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import torch.distributed as dist
import ampfunc as af
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

env = af.dist.init_from_env()
R = env.rank
mesh = init_device_mesh("cpu", (2,))
p = {"w": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])}
g_full = torch.ones(4, 2)
g_full[3, 0] = 1e21          # row 3 lives on rank 1
g = {"w": distribute_tensor(g_full, mesh, [Shard(0)])}
tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale())
s = tx.init(p)
p, s = tx.step(p, g, s)
mon = af.TrainingMonitor().record_state(s)
print(f"[rank {R}] finite={bool(s.finite)} moment_overflows={af.monitor.moment_overflows(s)} "
      f"check_health(state) status={mon.check_health(s)['status']}", flush=True)
dist.barrier(); dist.destroy_process_group()
