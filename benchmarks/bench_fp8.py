"""FP8 against bf16 on a small GPT: held-out loss (fidelity, any machine) and tokens/s (GPU).

Two modes:

* ``--fidelity`` (CPU or GPU): trains the same byte-level GPT on this repository's own text
  (README.md and ampfunc/*.py; the last 10% held out) with bf16 compute and with every Linear
  except the output head in FP8 (delayed scaling), over three seeds, and prints the held-out
  loss of each and the FP8/bf16 ratio. The claim it checks: FP8's held-out loss is within 3%
  of bf16's for every seed.
* ``--speed`` (CUDA, sm89+/sm90): the same GPT scaled up (``--d-model 2048 --layers 8 --seq 1024``
  by default), one ``torch.compile`` d train step per config, tokens/s of fp8 against bf16.
  On CPU FP8 runs through ``torch._scaled_mm``'s emulation or oneDNN: it is for correctness,
  not speed, and ``--speed`` says so and runs a tiny size only.

Run::

    python benchmarks/bench_fp8.py --fidelity [--steps 200] [--seeds 0,1,2]
    python benchmarks/bench_fp8.py --speed [--d-model 2048 --layers 8 --seq 1024 --batch 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import ampfunc as af  # noqa: E402
from ampfunc import fp8 as af_fp8  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    """A byte-level GPT: token and position embeddings, pre-norm blocks, a Linear head."""

    def __init__(self, vocab=256, d_model=128, layers=2, heads=4, seq=64):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.blocks = torch.nn.Sequential(*[Block(d_model, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def corpus(device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)`` byte tensors: this repository's README and library sources."""
    paths = [os.path.join(ROOT, "README.md")]
    src = os.path.join(ROOT, "ampfunc")
    paths += sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".py"))
    data = b"".join(open(p, "rb").read() for p in paths if os.path.exists(p))
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long).to(device)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:]


def batches(ids, batch, seq, gen):
    starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
    x = torch.stack([ids[s: s + seq] for s in starts.tolist()])
    y = torch.stack([ids[s + 1: s + seq + 1] for s in starts.tolist()])
    return x, y


def make_step(model, config, lr=3e-3, steps=300, group=None, backend="auto"):
    """``(init, step, evaluate)`` for ``config`` in ``{"bf16", "fp8"}``: fp32 master weights,
    bf16 compute, AdamW with warmup-cosine, every Linear but the head in FP8 for ``"fp8"``."""
    if config not in ("bf16", "fp8"):
        raise ValueError(f"config must be 'bf16' or 'fp8', got {config!r}")
    fp8 = af_fp8.fp8_policy(model, exclude=("head",), backend=backend, group=group) if config == "fp8" else None
    sched = af.optim.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr / 10)
    # bf16 compute needs no loss scaling (the loss is not scaled below, so a dynamic scale's
    # unscaling would shrink every gradient 2**16-fold: clipping and Adam's eps would see that)
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(sched, weight_decay=0.01)),
                            af.NoOpLossScale())

    def forward(params, state8, x):
        p = af.cast_params(params, torch.bfloat16)
        if fp8 is None:
            return functional_call(model, p, (x,))
        return fp8.apply(model, p, state8, x)

    def loss_fn(params, state8, x, y):
        logits = forward(params, state8, x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    grad_fn = grad(loss_fn, argnums=(0, 1), has_aux=False)

    def init():
        params = {k: v.detach().clone() for k, v in af.params_of(model).items()}
        device = next(iter(params.values())).device
        state8 = fp8.init(device) if fp8 is not None else {}
        return params, tx.init(params), state8

    def step(params, opt_state, state8, x, y):
        grads, new8 = grad_fn(params, state8, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return af.apply_updates(params, updates), opt_state, new8

    @torch.no_grad()
    def evaluate(params, state8, ids, seq, batch=32, max_batches=8):
        # Eval runs the same FP8 forward (its state output is simply not kept).
        losses = []
        n = (len(ids) - 1) // seq
        for i in range(0, min(n, batch * max_batches), batch):
            starts = [j * seq for j in range(i, min(i + batch, n))]
            x = torch.stack([ids[s: s + seq] for s in starts])
            y = torch.stack([ids[s + 1: s + seq + 1] for s in starts])
            losses.append(loss_fn(params, state8, x, y))
        return torch.stack(losses).mean()

    return init, step, evaluate


def train_lm(config, seed=0, steps=200, batch=16, seq=64, d_model=64, layers=2, heads=4, device="cpu",
             compile=False, backend="auto", eval_batches=8):
    """Held-out loss (float, over ``eval_batches`` batches of 32 sequences) of a GPT trained
    ``steps`` steps under ``config``."""
    torch.manual_seed(seed)
    model = GPT(d_model=d_model, layers=layers, heads=heads, seq=seq).to(device)
    init, step, evaluate = make_step(model, config, steps=steps, backend=backend)
    if compile:
        step = torch.compile(step, fullgraph=True)
    params, opt_state, state8 = init()
    train_ids, held = corpus(device)
    gen = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        x, y = batches(train_ids, batch, seq, gen)
        params, opt_state, state8 = step(params, opt_state, state8, x, y)
    return float(evaluate(params, state8, held, seq, max_batches=eval_batches))


def fidelity(args):
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"GPT d={args.d_model} layers={args.layers} seq={args.seq} batch={args.batch} steps={args.steps} "
          f"device={args.device} torch {torch.__version__}")
    print(f"{'seed':>4}  {'bf16 held-out':>13}  {'fp8 held-out':>12}  {'fp8/bf16':>8}  {'time s':>7}")
    worst = 0.0
    for seed in seeds:
        t0 = time.perf_counter()
        kw = dict(seed=seed, steps=args.steps, batch=args.batch, seq=args.seq, d_model=args.d_model,
                  layers=args.layers, device=args.device)
        bf16, fp8 = train_lm("bf16", **kw), train_lm("fp8", **kw)
        ratio = fp8 / bf16
        worst = max(worst, abs(ratio - 1))
        print(f"{seed:>4}  {bf16:13.4f}  {fp8:12.4f}  {ratio:8.4f}  {time.perf_counter() - t0:7.1f}")
    print(f"worst |fp8/bf16 - 1| = {100 * worst:.2f}%  (claim: < 3%) -> {'PASS' if worst < 0.03 else 'FAIL'}")
    return worst


def speed(args):
    device = torch.device(args.device)
    if device.type != "cuda":
        print("fp8 on CPU is for correctness, not speed (_scaled_mm is emulated or oneDNN): tiny size only")
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}  "
          f"fp8 matmuls available: {af_fp8.fp8_available(device)}  torch {torch.__version__}")
    print(f"GPT d={args.d_model} layers={args.layers} heads={args.heads} seq={args.seq} batch={args.batch}, "
          f"compiled train step (fullgraph)")
    results = {}
    for config in args.configs.split(","):
        torch.manual_seed(0)
        model = GPT(d_model=args.d_model, layers=args.layers, heads=args.heads, seq=args.seq).to(device)
        init, step, _ = make_step(model, config, steps=1000)
        step = torch.compile(step, fullgraph=True)
        params, opt_state, state8 = init()
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)
        y = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            params, opt_state, state8 = step(params, opt_state, state8, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.iters):
            params, opt_state, state8 = step(params, opt_state, state8, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.iters
        tokens = args.batch * args.seq / dt
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        results[config] = tokens
        print(f"{config:>5}: {tokens:12.0f} tokens/s  {1e3 * dt:8.2f} ms/step  warmup+compile {compile_s:6.1f} s  "
              f"peak mem {mem:6.2f} GiB")
        del params, opt_state, state8, step, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    if "bf16" in results and "fp8" in results:
        print(f"fp8 / bf16 tokens/s = {results['fp8'] / results['bf16']:.3f}")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--fidelity", action="store_true")
    mode.add_argument("--speed", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--configs", default="bf16,fp8")
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    big = args.speed and args.device.startswith("cuda")
    for name, small, large in (("d_model", 64, 2048), ("layers", 2, 8), ("heads", 4, 16), ("seq", 64, 1024),
                               ("batch", 16, 8)):
        if getattr(args, name) is None:
            setattr(args, name, large if big else small)
    if args.fidelity:
        return fidelity(args)
    return speed(args)


if __name__ == "__main__":
    main()
