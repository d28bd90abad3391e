"""A main job on text: a small GPT-style byte-level language model trained on Python's own sources.

The training text ships with every Python installation: the standard library's ``.py`` files
(top-level modules, sorted by name; the last tenth of the files is held out). The model is a
pre-norm transformer (tied byte embeddings, causal self-attention, GELU MLP, LayerNorms kept
in fp32), trained through ``torch.func`` and ``mixed_precision(chain(clip_by_global_norm(1.0),
adamw(...)))`` in each configuration of ``ampfunc.examples.common.CONFIGS``.

Matmuls take their inputs in the compute dtype, accumulate in fp32 and round their outputs back
to the compute dtype, as GPU tensor cores do (and as fp16 on a CPU must be done to be fast);
everything stored between layers -- activations, their gradients, the params' gradients -- is
in the compute dtype. That is where fp16 flushes: the loss is a mean over ``batch x context``
tokens, so the gradient reaching each logit is of order ``1 / tokens`` times a probability, and
in fp16 anything below ~6e-8 becomes zero (and below ~6e-5 loses precision) unless the loss is
scaled up first.

    python -m ampfunc.examples.textlm [--steps 200] [--configs fp32,fp16+dynamic] [--metrics m.jsonl] [--plot p.png]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import sys
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
    count_zeros,
    format_table,
    plot_runs,
    state_bytes,
)
from ampfunc.monitor import LeafFlagsHook

# ---------------------------------------------------------------------------------------------
# data: the standard library's sources as bytes
# ---------------------------------------------------------------------------------------------

def stdlib_text(max_bytes: int = 4_000_000) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(train_bytes, heldout_bytes, n_files)``: uint8 tensors of the stdlib's top-level ``.py`` files.

    Files sorted by name; the last tenth of them is held out; at most ``max_bytes`` of training
    text (the first files), the held-out part capped at a tenth of that.
    """
    root = pathlib.Path(os.__file__).parent
    files = sorted(root.glob("*.py"))
    if len(files) < 10:
        raise RuntimeError(f"found only {len(files)} .py files under {root}; is this a full Python install?")
    split = len(files) - len(files) // 10

    def read(paths, cap):
        chunks, total = [], 0
        for p in paths:
            data = p.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= cap:
                break
        return torch.frombuffer(bytearray(b"".join(chunks)[:cap]), dtype=torch.uint8)

    return read(files[:split], max_bytes), read(files[split:], max_bytes // 10), len(files)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------

def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # low-precision inputs, fp32 accumulation, output rounded to the compute dtype (tensor cores)
    return (x.float() @ w.float()).to(x.dtype)


class Linear(torch.nn.Linear):
    def forward(self, x):
        out = _mm(x, self.weight.t())
        return out if self.bias is None else out + self.bias.to(out.dtype)


class LayerNorm(torch.nn.LayerNorm):
    """Normalises in fp32 (its params stay fp32) and returns the input's dtype."""

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = LayerNorm(d), Linear(d, 3 * d), Linear(d, d)
        self.ln2, self.fc, self.out = LayerNorm(d), Linear(d, 4 * d), Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = _mm(q, k.transpose(-1, -2)).float() / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1).to(x.dtype)  # softmax in fp32
        x = x + self.proj(_mm(attn, v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(torch.nn.Module):
    def __init__(self, d=64, layers=2, heads=4, context=64, vocab=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(context, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = LayerNorm(d)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        torch.nn.init.normal_(self.pos, std=0.01)

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return _mm(self.ln_f(x), self.embed.weight.t())  # logits through the tied embedding


# ---------------------------------------------------------------------------------------------
# training one configuration
# ---------------------------------------------------------------------------------------------

def batches(data: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    """An endless stream of ``(inputs, targets)`` windows at random offsets (int64, on the CPU)."""
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        window = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
        yield window[:, :-1], window[:, 1:]


def train(name, *, steps=200, batch=32, context=64, d=64, layers=2, lr=3e-3, device="cpu", seed=0,
          data=None, metrics=None, log_every=25, progress=None, eval_batches=8):
    """Trains one configuration; returns a row of the results table and its history."""
    cfg = CONFIGS[name]
    policy = af.get_policy(cfg.policy)
    train_bytes, heldout_bytes, _ = data if data is not None else stdlib_text()
    torch.manual_seed(seed)
    model = ByteGPT(d=d, layers=layers, context=context)
    model = (cfg.setup(model) if cfg.setup else model).to(device)
    keep = af.norm_layers(model)  # LayerNorm params stay fp32
    params = af.cast_params(af.params_of(model), policy.param_dtype, keep=keep)
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(lr, weight_decay=0.01, moments=cfg.moments)),
                            loss_scale=cfg.loss_scale(), master=cfg.master)
    state = tx.init(params)
    fp8 = cfg.fp8(model) if cfg.fp8 else None
    state8 = fp8.init(device) if fp8 else {}  # FP8 scaling state: its "gradient" is its next value

    def loss_fn(p, x, y, state8):
        p = af.cast_params(p, policy.compute_dtype, keep=keep)
        logits = policy.cast_to_output(fp8.apply(model, p, state8, x) if fp8 else functional_call(model, p, (x,)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def scaled_loss(p, state8, x, y, ls):
        loss = loss_fn(p, x, y, state8)
        return af.scale_loss(loss, ls), loss.detach()

    grad_fn = grad(scaled_loss, argnums=(0, 1), has_aux=True)
    log = LiveLog(name, steps, params=params, metrics=metrics, log_every=log_every, progress=progress, device=device)
    hook = LeafFlagsHook(log.monitor)  # the step's own check pass reports which leaves overflowed
    tx.engine.on_check = hook
    stream = batches(train_bytes, batch, context, torch.Generator().manual_seed(seed + 1))
    zeros = torch.zeros((), dtype=torch.int64, device=device)  # gradient elements flushed to exactly 0
    late_zeros = zeros.clone()  # the same over the last tenth of the run: flushing grows as the model sharpens
    late_from = steps - max(1, steps // 10)
    n_grad = sum(p.numel() for p in params.values())
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for step in range(steps):
        x, y = (t.to(device, non_blocking=True) for t in next(stream))
        ls = af.loss_scale_of(state)
        (grads, state8), loss = grad_fn(params, state8, x, y, ls)
        step_zeros = count_zeros(grads)
        zeros = zeros + step_zeros
        if step >= late_from:
            late_zeros = late_zeros + step_zeros
        params, state = tx.step(params, grads, state)
        log.monitor = log.monitor.record_state(state, loss=loss, leaf_nonfinite=hook.take())
        log.step()
    elapsed = time.perf_counter() - start
    summary = log.close()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 2)
        held = batches(heldout_bytes, batch, context, gen)
        heldout = sum(float(loss_fn(params, *(t.to(device) for t in next(held)), state8)) for _ in range(eval_batches))
    peak = (f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f}" if str(device).startswith("cuda") else "n/a")
    row = {
        "config": name,
        "held-out loss": heldout / eval_batches,
        "tokens/s": steps * batch * context / elapsed,
        "skipped": summary["skipped"],
        "final scale": float(af.loss_scale_of(state).loss_scale),
        "flushed %": 100.0 * int(zeros) / (n_grad * steps),
        "flushed late %": 100.0 * int(late_zeros) / (n_grad * (steps - late_from)),
        "state MiB": state_bytes(params, state) / 2**20,
        "state B/param": state_bytes(params, state) / sum(t.numel() for t in params.values()),
        "peak MiB": peak,
        "time s": elapsed,
        "status": summary["status"],
        "overflows": summary["overflows"],
    }
    return row, log.history


COLUMNS = [("config", "config", "{}"), ("held-out loss", "held-out loss", "{:.4f}"), ("tokens/s", "tokens/s", "{:.0f}"),
           ("skipped", "skipped", "{}"), ("final scale", "final scale", "{:g}"),
           ("grad elems flushed to 0 %", "flushed %", "{:.2f}"),
           ("... in the last 10% of steps", "flushed late %", "{:.2f}"), ("state MiB", "state MiB", "{:.1f}"),
           ("B/param", "state B/param", "{:.2f}"),
           ("peak MiB", "peak MiB", "{}"), ("time s", "time s", "{:.1f}")]

EXPLAIN = """\
held-out loss: mean cross-entropy (nats per byte) on the held-out files; tokens/s: training
throughput; skipped: steps with inf/nan gradients (not applied); grad elems flushed to 0 %: share
of gradient elements that came out exactly zero (with the tied embedding, only the attention key
bias has a gradient that is zero in exact arithmetic, so the fp32 row is the baseline and anything
above it was flushed by the compute dtype; the next column counts the last tenth of the run only,
as the share grows while the model's predictions sharpen); state MiB: params + fp32 master + optimizer moments;
peak MiB: CUDA only."""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="configs: " + "; ".join(f"{k}: {v.about}" for k, v in CONFIGS.items()))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    add_run_args(ap)
    args = ap.parse_args(argv)
    names = configs_from_args(ap, args)
    af.ops.load()  # build the kernels (first run only) before any timing starts
    data = stdlib_text()
    print(f"ampfunc {af.__version__} on {args.device} (kernels: {af.ops.backend()}): byte-level GPT "
          f"(d={args.width}, {args.layers} layers, context {args.context}) on {len(data[0]) / 1e6:.1f} MB of "
          f"Python {sys.version.split()[0]}'s stdlib sources, {args.steps} steps x {args.batch * args.context} tokens",
          flush=True)
    rows, histories = [], {}
    with (open(args.metrics, "w") if args.metrics else contextlib.nullcontext()) as metrics:
        for name in names:
            row, histories[name] = train(name, steps=args.steps, batch=args.batch, context=args.context,
                                         d=args.width, layers=args.layers, lr=args.lr, device=args.device,
                                         data=data, metrics=metrics, log_every=args.log_every,
                                         progress=args.progress)
            rows.append(row)
    print(format_table(rows, COLUMNS))
    print(EXPLAIN)
    for r in rows:
        if r["status"] != "healthy" or r["overflows"]:
            worst = ", ".join(f"{p} ({c})" for p, c in list(r["overflows"].items())[:3])
            print(f"{r['config']}: monitor says {r['status']}" + (f"; overflowing leaves: {worst}" if worst else ""))
    if args.plot:
        plot_runs(histories, args.plot, title=f"textlm: {args.steps} steps, batch {args.batch} x {args.context} tokens")
        print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
