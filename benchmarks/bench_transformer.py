"""A small GPT-style model trained with a bf16 policy: ampfunc's make_train_step vs torch's loop.

One process, one run, the same model, data and optimizer settings for every row. Prints the
median time per iteration (forward + backward + optimizer step), the spread (min-max) and the
ratio to torch's eager autocast + GradScaler loop.

    python benchmarks/bench_transformer.py            # 2 layers, d=256, vocab 1024: 2.1M params, CPU (~2 min)
    python benchmarks/bench_transformer.py --quick    # a smoke run: tiny model, few iterations
    python benchmarks/bench_transformer.py --no-compile

Rows:
  torch eager      model fp32, torch.autocast(bf16), GradScaler, AdamW(fused=True), zero_grad
  ampfunc eager    make_train_step(model, loss, adamw, "p=f32,c=bf16,o=f32", DynamicLossScale)
  torch compiled   the same loop with torch.compile(model) (optimizer eager, as torch's docs show)
  ampfunc compiled torch.compile(train.step, fullgraph=True): forward, backward and the fused step
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ampfunc as af  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def batches(n, batch, ctx, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, ctx + 1), generator=gen) for _ in range(n)]


def lm_loss(logits, idx):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))


def time_loop(step, data, warmup, iters):
    for i in range(warmup):
        step(data[i % len(data)])
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        step(data[i % len(data)])
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def torch_loop(model, lr, compiled, backend):
    fwd = torch.compile(model, backend=backend) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    losses = []

    def step(idx):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(fwd(idx[:, :-1]), idx)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return step, losses


def ampfunc_loop(model, lr, compiled, backend):
    train = af.make_train_step(model, lambda fwd, idx: lm_loss(fwd(idx[:, :-1]), idx), af.adamw(lr),
                               "p=f32,c=bf16,o=f32", loss_scale=af.DynamicLossScale())
    state = [train.init()]
    fn = torch.compile(train.step, fullgraph=True, backend=backend) if compiled else train.step
    losses = []

    def step(idx):
        state[0], out = fn(state[0], idx)
        losses.append(out.loss)

    return step, losses, state


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few iterations: a smoke run")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    args = ap.parse_args(argv)
    if args.quick:
        vocab, d, layers, heads, ctx, batch = 64, 32, 1, 2, 16, 2
        iters, warmup = args.iters or 3, args.warmup or 1
    else:
        vocab, d, layers, heads, ctx, batch = 1024, 256, 2, 4, 64, 8
        iters, warmup = args.iters or 15, args.warmup or 3
    torch.manual_seed(0)
    reference = GPT(vocab, d, layers, heads, ctx)
    n_params = sum(p.numel() for p in reference.parameters())
    data = batches(max(iters, warmup), batch, ctx, vocab)
    print(f"bench_transformer: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"ampfunc ops backend {af.ops.backend()}")
    print(f"model: {layers} layers, d={d}, vocab={vocab}, ctx={ctx}, batch={batch}: {n_params / 1e6:.2f}M params; "
          f"{iters} timed iterations after {warmup} warm-up")

    def fresh():
        m = GPT(vocab, d, layers, heads, ctx)
        m.load_state_dict(reference.state_dict())
        return m

    rows = []
    modes = [False] if args.no_compile else [False, True]
    for compiled in modes:
        tag = f"compiled ({args.backend})" if compiled else "eager"
        step, losses = torch_loop(fresh(), 1e-3, compiled, args.backend)
        t0 = time.perf_counter()
        times = time_loop(step, data, warmup, iters)
        rows.append((f"torch autocast+GradScaler {tag}", times, float(losses[-1]), time.perf_counter() - t0))
        step, losses, _ = ampfunc_loop(fresh(), 1e-3, compiled, args.backend)
        t0 = time.perf_counter()
        times = time_loop(step, data, warmup, iters)
        rows.append((f"ampfunc make_train_step {tag}", times, float(losses[-1]), time.perf_counter() - t0))
    base = statistics.median(rows[0][1])
    print(f"{'path':<48} {'median ms':>10} {'min-max ms':>16} {'x torch eager':>14} {'last loss':>10}")
    for name, times, loss, _ in rows:
        med = statistics.median(times)
        spread = f"{min(times):.1f}-{max(times):.1f}"
        print(f"{name:<48} {med:>10.2f} {spread:>16} {med / base:>14.2f} {loss:>10.4f}")
        assert math.isfinite(loss), f"{name}: the loss is not finite"


if __name__ == "__main__":
    main()
