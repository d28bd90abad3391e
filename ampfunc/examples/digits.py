"""ampfunc digits: a real mixed-precision training run on scikit-learn's digits.

Trains the same MLP (with LayerNorm, kept in fp32) in each configuration of
``ampfunc.examples.common.CONFIGS`` and prints one table:

* ``fp32``            -- params and compute in fp32, no loss scaling;
* ``bf16``            -- params stored in bf16 with an fp32 master copy, no loss scaling;
* ``fp16+dynamic``    -- params in fp16, fp32 master, dynamic loss scaling;
* ``fp16 unscaled``   -- params in fp16, fp32 master, no loss scaling (small grads flush to 0).

The table reports, per configuration, the test loss and accuracy, the steps skipped for
non-finite gradients, the share of gradient elements that came out zero where fp32's are not
(the fp16 underflow that loss scaling exists to prevent; counted every ``--log-every`` steps),
the final loss scale, the params and optimizer state in bytes per param, and the wall time.

The loop is the functional one ampfunc is built for: ``torch.func.functional_call`` over a
params pytree, ``scale_loss``, autograd, and ``mixed_precision(chain(clip, adamw))`` whose state
holds the master weights, the optimizer moments and the loss scale. Run::

    python -m ampfunc.examples.digits [--epochs 40] [--seed 0] [--configs fp32,fp16+dynamic]
        [--metrics m.jsonl] [--plot p.png]

A progress bar per configuration shows the step, loss, loss scale, skipped steps and steps/s;
it is fed every ``--log-every`` steps from a device-side ``TrainingMonitor`` (no sync per step).

Under ``torchrun --nproc_per_node=N`` each rank trains on its shard of every batch; gradients
are averaged with an all-reduce and all ranks agree on skipping through ``group=``.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

import ampfunc as af
from ampfunc.examples.common import (
    CONFIGS,
    LiveLog,
    add_run_args,
    configs_from_args,
    count_flushed,
    format_table,
    make_transform,
    plot_runs,
    state_bytes,
    summary_record,
)
from ampfunc.monitor import LeafFlagsHook

ABOUT = __doc__.split("\n\n")[0].replace("\n", " ")


class MLP(torch.nn.Module):
    fp8_exclude = ("net.6",)  # the output head stays in the compute dtype under the fp8 config

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


def train(name, epochs=40, batch=64, lr=2e-3, device="cpu", seed=0, metrics=None, log_every=25, progress=None):
    """Trains one configuration; returns a row of the results table and its history."""
    cfg = CONFIGS[name]
    policy = af.get_policy(cfg.policy)
    env = af.dist.init_from_env()  # torchrun's environment; one process when WORLD_SIZE is unset
    group, rank, world = env.group, env.rank, env.world_size
    device = env.device if group is not None else device
    (x_tr, y_tr), (x_te, y_te) = load_digits(device)
    torch.manual_seed(seed)
    model = MLP()
    model = (cfg.setup(model) if cfg.setup else model).to(device)
    keep = af.norm_layers(model)
    params = af.cast_params(af.params_of(model), policy.param_dtype, keep=keep)
    opt = af.adamw(lr, weight_decay=1e-4, moments=cfg.moments)
    tx = make_transform(cfg, af.chain(af.clip_by_global_norm(1.0), opt), group=group)
    state = tx.init(params)
    fp8 = cfg.fp8(model, group=group) if cfg.fp8 else None
    state8 = fp8.init(device) if fp8 else {}  # FP8 scaling state: its "gradient" is its next value

    def loss_fn(p, x, y, state8):
        p = af.cast_params(p, policy.compute_dtype, keep=keep)
        x = policy.cast_to_compute(x)
        logits = policy.cast_to_output(fp8.apply(model, p, state8, x) if fp8 else functional_call(model, p, (x,)))
        return F.cross_entropy(logits, y)

    def scaled_loss(p, state8, x, y, ls):
        loss = loss_fn(p, x, y, state8)
        return af.scale_loss(loss, ls), loss.detach()

    def reference_loss(p, x, y):  # fp32 params and compute: the gradients the maths gives
        return F.cross_entropy(functional_call(model, af.tree.tree_cast(p, torch.float32), (x,)).float(), y)

    grad_fn = grad(scaled_loss, argnums=(0, 1), has_aux=True)
    reference_grad = grad(reference_loss)
    per_epoch = len(range(0, len(x_tr) - batch + 1, batch))
    log = LiveLog(name, epochs * per_epoch, params=params, metrics=metrics if rank == 0 else None,
                  log_every=log_every, progress=progress if rank == 0 else False, device=device)
    hook = LeafFlagsHook(log.monitor)  # the step's own check pass reports which leaves overflowed
    tx.engine.on_check = hook
    steps = 0
    flushed = torch.zeros((), dtype=torch.int64, device=device)  # zero in this config's gradients, not in fp32's
    counted = 0  # gradient elements compared (every log_every steps: one fp32 backward each)
    n_grad = sum(p.numel() for p in params.values())
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(epochs):
        order = torch.randperm(len(x_tr), generator=gen).to(device)
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch][rank::world]
            ls = af.loss_scale_of(state)
            (grads, state8), loss = grad_fn(params, state8, x_tr[idx], y_tr[idx], ls)
            if steps % log_every == 0:  # this rank's own gradients, before the all-reduce
                flushed = flushed + count_flushed(grads, reference_grad(params, x_tr[idx], y_tr[idx]))
                counted += n_grad
            if group is not None:  # average in fp32: a sum of scaled fp16 grads could overflow
                grads = af.dist.all_reduce_mean(af.tree.tree_cast(grads, torch.float32), group)
            params, state = tx.step(params, grads, state)
            log.monitor = log.monitor.record_state(state, loss=loss, leaf_nonfinite=hook.take())
            log.step()
            steps += 1
    elapsed = time.perf_counter() - start
    summary = log.close()
    with torch.no_grad():
        test_loss = float(loss_fn(params, x_te, y_te, state8))
        acc = (functional_call(model, af.cast_params(params, torch.float32), (x_te,)).argmax(1) == y_te)
    row = {
        "config": name,
        "test loss": test_loss,
        "test acc": float(acc.float().mean()),
        "skipped": summary["skipped"],
        "steps": steps,
        "flushed %": 100.0 * int(flushed) / max(counted, 1),
        "final scale": float(af.loss_scale_of(state).loss_scale),
        "state B/param": state_bytes(params, state) / n_grad,
        "time s": elapsed,
        "status": summary["status"],
        "overflows": summary["overflows"],
    }
    if log.metrics is not None:
        log.metrics.write(summary_record(name, step=steps, seed=seed, heldout_loss=test_loss,
                                         heldout_acc=row["test acc"], skipped=row["skipped"],
                                         flushed_frac=row["flushed %"] / 100, loss_scale=row["final scale"],
                                         state_bytes_per_param=row["state B/param"], time_s=round(elapsed, 3)))
    return row, log.history


COLUMNS = [("config", "config", "{}"), ("test loss", "test loss", "{:.4f}"), ("test acc", "test acc", "{:.3f}"),
           ("skipped", "skipped", "{}"), ("steps", "steps", "{}"), ("grads flushed %", "flushed %", "{:.2f}"),
           ("final scale", "final scale", "{:g}"), ("state B/param", "state B/param", "{:.1f}"),
           ("time s", "time s", "{:.1f}")]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ampfunc.examples.digits", description=ABOUT,
                                 epilog="configs: " + "; ".join(f"{k}: {v.about}" for k, v in CONFIGS.items()))
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    add_run_args(ap)
    args = ap.parse_args(argv)
    names = configs_from_args(ap, args)
    af.ops.load()  # build the kernels (first run only) before any timing starts
    env = af.dist.init_from_env()
    rank, world = env.rank, env.world_size
    rows, histories = [], {}
    with (open(args.metrics, "w") if args.metrics and rank == 0 else contextlib.nullcontext()) as metrics:
        for name in names:
            row, histories[name] = train(name, args.epochs, args.batch, args.lr, args.device, seed=args.seed,
                                         metrics=metrics,
                                         log_every=args.log_every, progress=args.progress)
            rows.append(row)
    if rank == 0:
        print(f"ampfunc {af.__version__} on {args.device} (kernels: {af.ops.backend()}, world size {world}), "
              f"digits: {args.epochs} epochs, batch {args.batch}")
        print(format_table(rows, COLUMNS))
        for r in rows:
            if r["status"] != "healthy" or r["overflows"]:
                worst = ", ".join(f"{p} ({c})" for p, c in list(r["overflows"].items())[:3])
                print(f"{r['config']}: monitor says {r['status']}"
                      + (f"; overflowing leaves: {worst}" if worst else ""))
        if args.plot:
            plot_runs(histories, args.plot, title=f"digits: {args.epochs} epochs, batch {args.batch}")
            print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
