"""A small GPT-style model trained with a bf16 policy: ampfunc's make_train_step vs torch's loop.

One process, one run, the same model, data and optimizer settings for every row, the timed steps
interleaved round by round. Prints the median time per iteration (forward + backward +
optimizer step), the spread (min-max), the ratio to torch's eager autocast + GradScaler loop and
the ratio to torch's loop in the same mode (eager or compiled).

    python benchmarks/bench_transformer.py            # 2 layers, d=256, vocab 1024: 2.1M params, CPU (~2 min)
    python benchmarks/bench_transformer.py --quick    # a smoke run: tiny model, few iterations
    python benchmarks/bench_transformer.py --no-compile
    python benchmarks/bench_transformer.py --threads 1   # steadier where other jobs share the cores
    python benchmarks/bench_transformer.py --model hf-gpt2   # transformers' GPT2LMHeadModel from a
                                                      # config: 8 layers, d=128, vocab 1024, 1.7M params

Rows:
  torch eager      model fp32, torch.autocast(bf16), GradScaler, AdamW(fused=True), zero_grad
  ampfunc eager    make_train_step(model, loss, adamw, "p=f32,c=bf16,o=f32", DynamicLossScale):
                   train.step (pure: new params and moments every step) and train.step_ (the
                   state donated: the fused AdamW pass writes it in place, as torch's loop does);
                   and torch's loop with ModuleTrainer(model, adamw, DynamicLossScale) in place of
                   GradScaler + AdamW (trainer.scale(loss).backward(); trainer.step())
  torch compiled   the same loop with torch.compile(model): forward and backward compiled,
                   GradScaler and the fused AdamW eager (the recipe torch's docs show)
  ampfunc compiled torch.compile(train.step / train.step_, fullgraph=True): forward, backward,
                   check, the fused AdamW pass and the scale update in one graph
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


class HFLogits(nn.Module):
    """transformers' GPT2LMHeadModel built from a config (no download, no dropout, so every row
    computes the same losses), returning the logits alone: what the loss takes."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=vocab, n_positions=ctx, n_embd=d, n_layer=layers, n_head=heads,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.lm = GPT2LMHeadModel(config)

    def forward(self, idx):
        return self.lm(idx, use_cache=False).logits


MODELS = {
    # name: (class, vocab, d, layers, heads, ctx, batch)
    "gpt": (GPT, 1024, 256, 2, 4, 64, 8),
    "hf-gpt2": (HFLogits, 1024, 128, 8, 4, 64, 8),
}


def batches(n, batch, ctx, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, ctx + 1), generator=gen) for _ in range(n)]


def lm_loss(logits, idx):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))


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


def ampfunc_loop(model, lr, compiled, backend, inplace=False):
    train = af.make_train_step(model, lambda fwd, idx: lm_loss(fwd(idx[:, :-1]), idx), af.adamw(lr),
                               "p=f32,c=bf16,o=f32", loss_scale=af.DynamicLossScale())
    state = [train.init()]
    fn = train.step_ if inplace else train.step
    fn = torch.compile(fn, fullgraph=True, backend=backend) if compiled else fn
    losses = []

    def step(idx):
        state[0], out = fn(state[0], idx)
        losses.append(out.loss)

    return step, losses, state


def trainer_loop(model, lr):
    """torch's eager loop with ampfunc's ModuleTrainer in place of GradScaler + AdamW."""
    trainer = af.ModuleTrainer(model, af.adamw(lr), loss_scale=af.DynamicLossScale())
    losses = []

    def step(idx):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(idx[:, :-1]), idx)
        trainer.scale(loss).backward()
        trainer.step()
        losses.append(loss.detach())

    return step, losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few iterations: a smoke run")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt",
                    help="gpt: the 2-layer GPT here; hf-gpt2: transformers' GPT2LMHeadModel (needs transformers)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's); 1 is steadier on a shared machine")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_cls, vocab, d, layers, heads, ctx, batch = MODELS[args.model]
    if args.quick:
        vocab, d, layers, heads, ctx, batch = 64, 32, 1, 2, 16, 2
        iters, warmup = args.iters or 3, args.warmup or 1
    else:
        iters, warmup = args.iters or 15, args.warmup or 3
    torch.manual_seed(0)
    reference = model_cls(vocab, d, layers, heads, ctx)
    n_params = sum(p.numel() for p in reference.parameters())
    data = batches(warmup + iters, batch, ctx, vocab)
    print(f"bench_transformer: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, "
          f"ampfunc ops backend {af.ops.backend()}")
    print(f"model: {args.model}, {layers} layers, d={d}, vocab={vocab}, ctx={ctx}, batch={batch}: "
          f"{n_params / 1e6:.2f}M params; "
          f"{iters} timed iterations after {warmup} warm-up")

    def fresh():
        m = model_cls(vocab, d, layers, heads, ctx)
        m.load_state_dict(reference.state_dict())
        return m

    # Every configuration is built and warmed up (compiled) first; then the timed steps are taken
    # round by round, one step of each configuration per round, so that a change in the load of
    # a shared machine hits every row alike. Each row sees the same batches in the same order.
    rows = []
    modes = [False] if args.no_compile else [False, True]
    for compiled in modes:
        tag = f"compiled ({args.backend})" if compiled else "eager"
        step, losses = torch_loop(fresh(), 1e-3, compiled, args.backend)
        rows.append((f"torch autocast+GradScaler {tag}", step, losses, compiled))
        for inplace in (False, True):
            step, losses, _ = ampfunc_loop(fresh(), 1e-3, compiled, args.backend, inplace)
            rows.append((f"ampfunc make_train_step{'.step_' if inplace else ''} {tag}", step, losses, compiled))
        if not compiled:
            step, losses = trainer_loop(fresh(), 1e-3)
            rows.append(("ampfunc ModuleTrainer (autocast loop) eager", step, losses, compiled))
    for _, step, _, _ in rows:
        for i in range(warmup):
            step(data[i % len(data)])
    times = {name: [] for name, *_ in rows}
    for i in range(iters):
        for name, step, _, _ in rows:
            t0 = time.perf_counter()
            step(data[(warmup + i) % len(data)])
            times[name].append((time.perf_counter() - t0) * 1e3)
    base = {compiled: statistics.median(times[name]) for name, _, _, compiled in rows if name.startswith("torch")}
    print(f"{'path':<48} {'median ms':>10} {'min-max ms':>16} {'x torch eager':>14} {'x torch same':>13} "
          f"{'last loss':>10}")
    for name, _, losses, compiled in rows:
        med = statistics.median(times[name])
        spread = f"{min(times[name]):.1f}-{max(times[name]):.1f}"
        loss = float(losses[-1])
        print(f"{name:<48} {med:>10.2f} {spread:>16} {med / base[False]:>14.2f} {med / base[compiled]:>13.2f} "
              f"{loss:>10.4f}")
        assert math.isfinite(loss), f"{name}: the loss is not finite"

if __name__ == "__main__":
    main()
