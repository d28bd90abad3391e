"""The main job: a real mixed-precision training run on scikit-learn's digits.

Trains the same MLP (with LayerNorm, kept in fp32) four ways and prints one table:

* ``fp32``            -- params and compute in fp32, no loss scaling;
* ``bf16``            -- params stored in bf16 with an fp32 master copy, no loss scaling;
* ``fp16+dynamic``    -- params in fp16, fp32 master, dynamic loss scaling;
* ``fp16 unscaled``   -- params in fp16, fp32 master, no loss scaling (small grads flush to 0).

The table reports, per configuration, the test loss and accuracy, the steps skipped for
non-finite gradients, the share of gradient elements that came out exactly zero (the fp16
underflow that loss scaling exists to prevent), the final loss scale and the wall time.

The loop is the functional one ampfunc is built for: ``torch.func.functional_call`` over a
params pytree, ``scale_loss``, autograd, and ``mixed_precision(chain(clip, adamw))`` whose state
holds the master weights, the optimizer moments and the loss scale. Run::

    python -m ampfunc.examples.digits [--epochs 40] [--configs fp32,fp16+dynamic]

Under ``torchrun --nproc_per_node=N`` each rank trains on its shard of every batch; gradients
are averaged with an all-reduce and all ranks agree on skipping through ``group=``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

import ampfunc as af

CONFIGS = {
    #                 storage dtype     loss scale factory
    "fp32": (torch.float32, af.NoOpLossScale),
    "bf16": (torch.bfloat16, af.NoOpLossScale),
    "fp16+dynamic": (torch.float16, lambda: af.DynamicLossScale(init_scale=2.0**16, growth_interval=200)),
    "fp16 unscaled": (torch.float16, af.NoOpLossScale),
}


class MLP(torch.nn.Module):
    def __init__(self, d_in=64, width=256, classes=10):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d_in, width), torch.nn.LayerNorm(width), torch.nn.GELU(),
            torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU(),
            torch.nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


def load_digits(device):
    from sklearn.datasets import load_digits as sk_load_digits

    ds = sk_load_digits()
    x = torch.tensor(ds.data, dtype=torch.float32) / 16.0
    x = (x - x.mean(0)) / (x.std(0) + 1e-3)
    y = torch.tensor(ds.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_train = int(0.8 * len(x))
    return (x[:n_train].to(device), y[:n_train].to(device)), (x[n_train:].to(device), y[n_train:].to(device))


def train(name, epochs=40, batch=64, lr=2e-3, device="cpu", seed=0):
    """Trains one configuration; returns a row of the results table."""
    storage_dtype, make_scale = CONFIGS[name]
    env = af.dist.init_from_env()  # torchrun's environment; one process when WORLD_SIZE is unset
    group, rank, world = env.group, env.rank, env.world_size
    device = env.device if group is not None else device
    (x_tr, y_tr), (x_te, y_te) = load_digits(device)
    torch.manual_seed(seed)
    model = MLP().to(device)
    keep = af.norm_layers(model)
    params = af.cast_params(af.params_of(model), storage_dtype, keep=keep)
    compute = af.get_policy(f"p={str(storage_dtype)[6:]},c={str(storage_dtype)[6:]},o=f32")
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(lr, weight_decay=1e-4)),
                            loss_scale=make_scale(), group=group)
    state = tx.init(params)

    def loss_fn(p, x, y):
        logits = compute.cast_to_output(functional_call(model, p, (compute.cast_to_compute(x),)))
        return F.cross_entropy(logits, y)

    steps = 0
    zero_grads = torch.zeros((), dtype=torch.int64, device=device)  # flushed-to-zero gradient elements
    grad_elems = 0
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(epochs):
        order = torch.randperm(len(x_tr), generator=gen).to(device)
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch][rank::world]
            ls = af.loss_scale_of(state)
            xb, yb = x_tr[idx], y_tr[idx]
            grads = grad(lambda p: af.scale_loss(loss_fn(p, xb, yb), ls))(params)
            if group is not None:  # average in fp32: a sum of scaled fp16 grads could overflow
                grads = af.dist.all_reduce_mean(af.tree_cast(grads, torch.float32), group)
            zero_grads += sum((g == 0).sum() for g in grads.values())
            grad_elems += sum(g.numel() for g in grads.values())
            params, state = tx.step(params, grads, state)
            steps += 1
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        test_loss = loss_fn(params, x_te, y_te)
        acc = (functional_call(model, af.cast_params(params, torch.float32), (x_te,)).argmax(1) == y_te)
    ls = af.loss_scale_of(state)
    applied = int(state.inner[1].step)  # AdamW's step counter only advances on applied steps
    return {
        "config": name,
        "test loss": float(test_loss),
        "test acc": float(acc.float().mean()),
        "skipped": steps - applied,
        "steps": steps,
        "zero grads %": 100.0 * int(zero_grads) / max(grad_elems, 1),
        "final scale": float(ls.loss_scale),
        "time s": elapsed,
    }


def format_table(rows) -> str:
    head = ["config", "test loss", "test acc", "skipped", "steps", "zero grads %", "final scale", "time s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['config']} | {r['test loss']:.4f} | {r['test acc']:.3f} | {r['skipped']} | "
                     f"{r['steps']} | {r['zero grads %']:.2f} | {r['final scale']:g} | {r['time s']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    af.ops.load()  # build the kernels (first run only) before any timing starts
    rows = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"unknown config {name!r}; choose from {list(CONFIGS)}")
        rows.append(train(name, args.epochs, args.batch, args.lr, args.device))
    env = af.dist.init_from_env()
    rank, world = env.rank, env.world_size
    if rank == 0:
        print(f"ampfunc {af.__version__} on {args.device} (kernels: {af.ops.backend()}, world size {world}), "
              f"digits: {args.epochs} epochs, batch {args.batch}")
        print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
