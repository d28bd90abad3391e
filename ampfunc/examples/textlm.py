"""ampfunc textlm: a small GPT-style byte-level language model trained on Python's own sources.

The training text ships with every Python installation: the standard library's ``.py`` files
(top-level modules, sorted by name; the last tenth of the files is held out). The model is a
pre-norm transformer (tied byte embeddings, causal self-attention, GELU MLP, LayerNorms kept
in fp32), trained through ``torch.func`` and ``mixed_precision(chain(clip_by_global_norm(1.0),
adamw(...)))`` in each configuration of ``ampfunc.examples.common.CONFIGS``.

Matmuls take their inputs in the compute dtype, accumulate in fp32 and round their outputs back
to the compute dtype, as GPU tensor cores do; everything stored between layers -- activations,
their gradients, the params' gradients -- is in the compute dtype. That is where fp16 flushes:
the loss is a mean over ``batch x context`` tokens, so the gradient reaching each activation is
of order ``1 / tokens``, and in fp16 anything below ~6e-8 becomes zero (and below ~6e-5 keeps
only a few bits) unless the loss is scaled up first. ``--accumulate K`` divides each of K
micro-batches' losses by K, as a gradient-accumulation loop does: every gradient is K times
smaller, as in a real pretraining step of many thousand tokens. The default step (16 x 32 x 64 =
32,768 tokens, 200 steps) is one where fp16 without a loss scale flushes several percent of its
gradient elements and ends measurably worse than fp16 with a dynamic scale. The table counts,
every ``--log-every`` steps, the gradient elements that are zero in a configuration's gradients
but not in fp32's.

    python -m ampfunc.examples.textlm [--steps 200] [--accumulate 16] [--seed 0]
        [--configs fp32,fp16+dynamic] [--metrics m.jsonl] [--plot p.png]
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
    count_flushed,
    format_table,
    make_transform,
    plot_runs,
    state_bytes,
    summary_record,
)
from ampfunc.monitor import LeafFlagsHook

ABOUT = __doc__.split("\n\n")[0].replace("\n", " ")


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
          data=None, metrics=None, log_every=25, progress=None, eval_batches=8, accumulate=1):
    """Trains one configuration; returns a row of the results table and its history.

    ``accumulate``: micro-batches of ``batch`` sequences per optimizer step; each micro-batch's
    loss is divided by ``accumulate`` before its backward and the gradients are summed in fp32,
    then stored in the params' dtype (the step sees the mean over all its tokens, as one large
    batch). Flushes are counted on the first micro-batch's gradients.
    """
    cfg = CONFIGS[name]
    policy = af.get_policy(cfg.policy)
    train_bytes, heldout_bytes, _ = data if data is not None else stdlib_text()
    torch.manual_seed(seed)
    model = ByteGPT(d=d, layers=layers, context=context)
    model = (cfg.setup(model) if cfg.setup else model).to(device)
    keep = af.norm_layers(model)  # LayerNorm params stay fp32
    params = af.cast_params(af.params_of(model), policy.param_dtype, keep=keep)
    opt = af.adamw(lr, weight_decay=0.01, moments=cfg.moments)
    tx = make_transform(cfg, af.chain(af.clip_by_global_norm(1.0), opt))
    state = tx.init(params)
    fp8 = cfg.fp8(model) if cfg.fp8 else None
    state8 = fp8.init(device) if fp8 else {}  # FP8 scaling state: its "gradient" is its next value

    def loss_fn(p, x, y, state8):
        p = af.cast_params(p, policy.compute_dtype, keep=keep)
        logits = policy.cast_to_output(fp8.apply(model, p, state8, x) if fp8 else functional_call(model, p, (x,)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def scaled_loss(p, state8, x, y, ls):
        loss = loss_fn(p, x, y, state8) / accumulate  # each micro-batch's share of the step's mean
        return af.scale_loss(loss, ls), loss.detach()

    def reference_loss(p, x, y):  # fp32 params and compute: the gradients the maths gives
        logits = functional_call(model, af.tree.tree_cast(p, torch.float32), (x,)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    grad_fn = grad(scaled_loss, argnums=(0, 1), has_aux=True)
    reference_grad = grad(reference_loss)
    log = LiveLog(name, steps, params=params, metrics=metrics, log_every=log_every, progress=progress, device=device)
    hook = LeafFlagsHook(log.monitor)  # the step's own check pass reports which leaves overflowed
    tx.engine.on_check = hook
    stream = batches(train_bytes, batch, context, torch.Generator().manual_seed(seed + 1))
    flushed = torch.zeros((), dtype=torch.int64, device=device)  # zero in this config's gradients, not in fp32's
    counted = 0  # gradient elements compared (every log_every steps: one fp32 backward each)
    n_grad = sum(p.numel() for p in params.values())
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for step in range(steps):
        x, y = (t.to(device, non_blocking=True) for t in next(stream))
        ls = af.loss_scale_of(state)
        (grads, state8), loss = grad_fn(params, state8, x, y, ls)
        if step % log_every == 0:
            flushed = flushed + count_flushed(grads, reference_grad(params, x, y))
            counted += n_grad
        if accumulate > 1:
            total = af.tree.tree_cast(grads, torch.float32)
            for _ in range(accumulate - 1):
                xm, ym = (t.to(device, non_blocking=True) for t in next(stream))
                (more, state8), more_loss = grad_fn(params, state8, xm, ym, ls)
                total = {k: total[k] + v.float() for k, v in more.items()}
                loss = loss + more_loss
            grads = {k: v.to(grads[k].dtype) for k, v in total.items()}
        params, state = tx.step(params, grads, state)
        log.monitor = log.monitor.record_state(state, loss=loss, leaf_nonfinite=hook.take())
        log.step()
    elapsed = time.perf_counter() - start
    summary = log.close()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 2)
        held = batches(heldout_bytes, batch, context, gen)
        heldout = sum(float(loss_fn(params, *(t.to(device) for t in next(held)), state8))
                      for _ in range(eval_batches)) / eval_batches
    row = {
        "config": name,
        "held-out loss": heldout,
        "tokens/s": steps * accumulate * batch * context / elapsed,
        "skipped": summary["skipped"],
        "final scale": float(af.loss_scale_of(state).loss_scale),
        "flushed %": 100.0 * int(flushed) / max(counted, 1),
        "state B/param": state_bytes(params, state) / n_grad,
        "peak MiB": (f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f}" if str(device).startswith("cuda")
                     else "n/a"),
        "time s": elapsed,
        "status": summary["status"],
        "overflows": summary["overflows"],
    }
    if metrics is not None:
        metrics.write(summary_record(name, step=steps, seed=seed, heldout_loss=heldout, skipped=row["skipped"],
                                     flushed_frac=row["flushed %"] / 100, loss_scale=row["final scale"],
                                     state_bytes_per_param=row["state B/param"], accumulate=accumulate,
                                     time_s=round(elapsed, 3)))
    return row, log.history


COLUMNS = [("config", "config", "{}"), ("held-out loss", "held-out loss", "{:.4f}"), ("tokens/s", "tokens/s", "{:.0f}"),
           ("skipped", "skipped", "{}"), ("final scale", "final scale", "{:g}"),
           ("grads flushed %", "flushed %", "{:.3f}"), ("state B/param", "state B/param", "{:.1f}"),
           ("peak MiB", "peak MiB", "{}"), ("time s", "time s", "{:.1f}")]

EXPLAIN = """\
held-out loss: mean cross-entropy (nats per byte) on the held-out files; tokens/s: training
throughput; a step averages --accumulate micro-batches, each loss divided by K, so its
gradients are K times smaller (fp16 without scaling flushes more of them);
skipped: steps with inf/nan gradients (not applied, the loss scale halved);
grads flushed %: share of gradient elements that are zero in the configuration's gradients but
not in fp32 gradients of the same params and batch (flushed by the compute dtype's range;
compared every --log-every steps); state B/param: params + fp32 master + optimizer moments, in
bytes per parameter, counted from the tensors' storages; peak MiB: CUDA only."""


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ampfunc.examples.textlm", description=ABOUT,
                                 epilog="configs: " + "; ".join(f"{k}: {v.about}" for k, v in CONFIGS.items()))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--accumulate", type=int, default=16, metavar="K",
                    help="micro-batches of --batch sequences per optimizer step, each loss divided by K (as torch's "
                         "gradient-accumulation recipe does): every gradient K times smaller")
    add_run_args(ap)
    args = ap.parse_args(argv)
    names = configs_from_args(ap, args)
    if args.accumulate < 1:
        ap.error(f"--accumulate must be >= 1, got {args.accumulate}")
    af.ops.load()  # build the kernels (first run only) before any timing starts
    data = stdlib_text()
    print(f"ampfunc {af.__version__} on {args.device} (kernels: {af.ops.backend()}): byte-level GPT "
          f"(d={args.width}, {args.layers} layers, context {args.context}) on {len(data[0]) / 1e6:.1f} MB of "
          f"Python {sys.version.split()[0]}'s stdlib sources, "
          f"{args.steps} steps x {args.accumulate} x {args.batch * args.context} tokens",
          flush=True)
    rows, histories = [], {}
    with (open(args.metrics, "w") if args.metrics else contextlib.nullcontext()) as metrics:
        for name in names:
            row, histories[name] = train(name, steps=args.steps, batch=args.batch, context=args.context,
                                         d=args.width, layers=args.layers, lr=args.lr, device=args.device,
                                         seed=args.seed,
                                         accumulate=args.accumulate,
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
        plot_runs(histories, args.plot, title=f"textlm: {args.steps} steps, {args.accumulate} x batch {args.batch} x "
                                              f"{args.context} tokens")
        print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
