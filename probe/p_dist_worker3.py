"""Probe worker (one rank): make_train_step on a fully_shard'ed model (FSDP2's own module), vs torch.
Launch: python probe/p_dist_launch.py p_dist_worker3.py"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import torch.nn.functional as F
import ampfunc as af
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
ref = net(); opt = torch.optim.SGD(ref.parameters(), lr=0.1)
F.cross_entropy(ref(x), y).backward(); opt.step()
rows = slice(4 * R, 4 * R + 4)
for group in (None, env.group):
    model = net()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    try:
        train = af.make_train_step(model, lambda fwd, xb, yb: F.cross_entropy(fwd(xb), yb), af.sgd(0.1),
                                   loss_scale=af.NoOpLossScale(), group=group)
        st = train.init()
        out = train.step(st, x[rows], y[rows])
        st = out[0] if isinstance(out, tuple) else out.state
        params = st.params
        err = max((params[k].full_tensor() if hasattr(params[k], "full_tensor") else params[k] - 0 - q).sub(q).abs().max().item()
                  if hasattr(params[k], "full_tensor") else (params[k] - q).abs().max().item()
                  for k, q in ref.named_parameters())
        say(f"make_train_step on fully_shard model group={'W' if group else None}: err vs torch {err:.3g}", "WRONG" if err > 1e-5 else "ok")
    except Exception as e:
        say(f"make_train_step on fully_shard model group={'W' if group else None}: RAISED {type(e).__name__}: {str(e)[:300]}")
import torch.distributed as dist
dist.barrier(); dist.destroy_process_group()
