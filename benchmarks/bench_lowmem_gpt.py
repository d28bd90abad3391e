"""The low-memory states training a GPT-style model: tokens/s, bytes of state and peak memory.

bench_transformer's GPT (pre-norm blocks, causal SDPA, untied head) trained with AdamW
(lr 1e-3, weight decay 0.01), fresh gradients every iteration (forward + backward + step), the
same weights, data and order for every row. Rows:

  fp32-master     bf16 model, ModuleTrainer(model, adamw(lr), master="fp32"): an fp32 master copy
                  and fp32 moments (14 B/param)
  split           the same, master="split" (bf16 params + int16 low halves; 12 B/param)
  split+bf16      master="split", adamw(..., moments="bf16") (8 B/param)
  split+q8        master="split", adamw(..., moments="q8") (about 6 B/param)
  compat split+q8 the torch.optim-style facade ampfunc.compat.torch_optim.AdamW(master="split",
                  moments="q8") in a plain loop: loss.backward(); opt.step(); opt.zero_grad()
  torch           fp32 model, torch.autocast(bf16), torch.optim.AdamW(fused=True) (12 B/param)
  torchao / bnb   torchao.optim.AdamW8bit and bitsandbytes.optim.AdamW8bit, when they import:
                  fp32 model + autocast(bf16) by default (exact fp32 weights, 8-bit moments: the
                  same promise as split+q8), or a bf16 model with --peer-params bf16 (no master)

The ampfunc rows run the bf16 model as stored (bf16 compute, the loss in fp32) with no loss
scaling (bf16 needs none), as torch's row does. Every row is built and warmed up alone (its peak
memory measured there, on CUDA), then the timed iterations are interleaved round by round, one
iteration of each row per round, so a change in the load of the machine hits every row alike.

Columns: tokens/s (batch x context / the median time), the median time per iteration and its
min-max, bytes of persistent state per parameter (params + master + optimizer state, counted from
the tensors' storages with ampfunc.lowmem.storage_bytes, each storage once; gradients are not
state), on CUDA the row's peak allocated memory over its warm-up (torch.cuda.max_memory_allocated,
less what was allocated before the row was built: its params, state, gradients, activations and
temporaries) and what stays allocated after it (params + state); on the CPU "n/a". Then the loss
of the first iteration and of the last timed one: the data is learnable (each sequence counts up
from a random start with a random stride, modulo the vocabulary), so a row that trains shows it.

    python benchmarks/bench_lowmem_gpt.py --quick            # a smoke run: tiny model, CPU (< 1 min)
    python benchmarks/bench_lowmem_gpt.py                     # 2 layers, d=256, vocab 1024: 2.1M params, CPU
    python benchmarks/bench_lowmem_gpt.py --device cuda       # 12 layers, d=1536, vocab 32768, ctx 1024,
                                                              # batch 16: 440M params (benchmarks/gpu_check.sh)
    python benchmarks/bench_lowmem_gpt.py --no-peers --threads 1 --layers 4 --width 512

A row that fails to build or to train is printed as FAILED with the reason and the others still
run; the exit status is 1 when an ampfunc or torch row failed (a peer that does not import, or
fails, is printed as skipped or failed and does not change it).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_transformer import GPT, lm_loss  # noqa: E402

import ampfunc as af  # noqa: E402
from ampfunc.lowmem import storage_bytes  # noqa: E402

# (layers, width, heads, vocab, context, batch, warm-up, timed iterations)
PRESETS = {
    "quick": (1, 64, 2, 128, 16, 2, 1, 3),
    "cpu": (2, 256, 4, 1024, 64, 8, 2, 10),
    "cuda": (12, 1536, 12, 32768, 1024, 16, 2, 10),
}
AMPFUNC_ROWS = (("fp32-master", "fp32", "fp32"), ("split", "split", "fp32"), ("split+bf16", "split", "bf16"),
                ("split+q8", "split", "q8"))
WEIGHT_DECAY = 0.01


def batches(n, batch, ctx, vocab, device, seed=0):
    """Learnable sequences: token t is (start + stride * t) % vocab, start and stride random per row."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(ctx + 1)
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 9, (batch, 1), generator=gen)
        out.append(((start + stride * t) % vocab).to(device))
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensors(x):
    """The plain tensors behind x (a tensor, a subclass such as torchao's OptimState8bit, a
    container of them), for storage_bytes: a wrapper subclass is counted by its inner tensors."""
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter) and hasattr(x, "__tensor_flatten__"):
            names, _ = x.__tensor_flatten__()
            return [t for n in names for t in _tensors(getattr(x, n))]
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _optim_bytes(model, opt) -> int:
    return storage_bytes(_tensors(list(model.parameters())), _tensors(list(opt.state.values())))


class Row:
    """One configuration: build() makes the model and optimizer, step(idx) takes one iteration."""

    def __init__(self, name, build, peer=False):
        self.name, self.build, self.peer = name, build, peer
        self.step = self.state_bytes = None
        self.losses, self.times = [], []
        self.peak = self.resident = None
        self.status = None  # None: ran; else "skipped: ..." / "FAILED: ..."


def ampfunc_row(make_model, lr, master, moments, device):
    def build():
        model = make_model(torch.bfloat16)
        trainer = af.ModuleTrainer(model, af.adamw(lr, weight_decay=WEIGHT_DECAY, moments=moments), master=master)

        def step(idx):
            loss = lm_loss(model(idx[:, :-1]), idx)
            loss.backward()
            trainer.step()
            return loss.detach()

        return step, lambda: storage_bytes(dict(model.named_parameters()), trainer.state.master,
                                           trainer.state.opt_state)
    return build


def compat_row(make_model, lr, device):
    """``ampfunc.compat.torch_optim.AdamW(master="split", moments="q8")`` in torch's loop, bf16 params."""
    from ampfunc.compat.torch_optim import AdamW
    return torch_style_row(make_model, lambda ps: AdamW(ps, lr=lr, weight_decay=WEIGHT_DECAY, master="split",
                                                        moments="q8"), torch.bfloat16, device)


def torch_style_row(make_model, make_opt, param_dtype, device):
    """A torch.optim-style optimizer in torch's loop: fp32 params under autocast(bf16), or bf16
    params run as stored."""

    def build():
        model = make_model(param_dtype)
        opt = make_opt(model.parameters())
        autocast = param_dtype == torch.float32

        def step(idx):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = lm_loss(model(idx[:, :-1]), idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step, lambda: _optim_bytes(model, opt)
    return build


def peer_rows(make_model, lr, param_dtype, device):
    rows = []
    what = "fp32 params, autocast bf16" if param_dtype == torch.float32 else "bf16 params, no master"
    try:
        from torchao.optim import AdamW8bit as AoAdamW8bit
        build = torch_style_row(make_model, lambda ps: AoAdamW8bit(ps, lr=lr, weight_decay=WEIGHT_DECAY),
                                param_dtype, device)
        rows.append(Row(f"torchao AdamW8bit ({what})", build, peer=True))
    except Exception as e:  # noqa: BLE001 -- any import failure: printed as skipped
        row = Row("torchao AdamW8bit", None, peer=True)
        row.status = f"skipped: {type(e).__name__}: {str(e)[:90]}"
        rows.append(row)
    try:
        import bitsandbytes as bnb
        build = torch_style_row(make_model, lambda ps: bnb.optim.AdamW8bit(ps, lr=lr, weight_decay=WEIGHT_DECAY),
                                param_dtype, device)
        rows.append(Row(f"bitsandbytes AdamW8bit ({what})", build, peer=True))
    except Exception as e:  # noqa: BLE001
        row = Row("bitsandbytes AdamW8bit", None, peer=True)
        row.status = f"skipped: {type(e).__name__}: {str(e)[:90]}"
        rows.append(row)
    return rows


def _mib(n):
    return "n/a" if n is None else f"{n / 2**20:,.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="tiny model, few iterations: a smoke run")
    for flag in ("layers", "width", "heads", "vocab", "context", "batch", "warmup", "iters"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-peers", action="store_true", help="leave out torchao / bitsandbytes")
    ap.add_argument("--peer-params", choices=("fp32", "bf16"), default="fp32",
                    help="the peers' params: fp32 under autocast (default) or bf16 as stored (no master)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    preset = PRESETS["quick" if args.quick else ("cuda" if device.type == "cuda" else "cpu")]
    layers, width, heads, vocab, ctx, batch, warmup, iters = (
        v if v is not None else p for v, p in zip(
            (args.layers, args.width, args.heads, args.vocab, args.context, args.batch, args.warmup, args.iters),
            preset))
    if args.heads is None and args.width is not None:
        heads = max(1, width // 128 if device.type == "cuda" else width // 64)
    cuda = device.type == "cuda"
    where = torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine())
    print(f"bench_lowmem_gpt: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {where}, "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"ampfunc ops backend {af.ops.backend()}, device {device}")
    print("command: python " + " ".join([sys.argv[0]] + (sys.argv[1:] if argv is None else list(argv))))

    torch.manual_seed(0)
    with torch.device(device):
        reference = GPT(vocab, width, layers, heads, ctx)
    n_params = sum(p.numel() for p in reference.parameters())
    data = batches(warmup + iters, batch, ctx, vocab, device)
    print(f"model: {layers} layers, d={width}, {heads} heads, vocab={vocab}, ctx={ctx}, batch={batch}: "
          f"{n_params / 1e6:.2f}M params, {batch * ctx:,} tokens per iteration; AdamW lr={args.lr:g}, "
          f"weight decay {WEIGHT_DECAY}; {iters} timed iterations after {warmup} warm-up, per row")

    held = [reference]  # emptied once every row has its copy

    def make_model(dtype):
        return copy.deepcopy(held[0]).to(dtype)

    rows = [Row(name, ampfunc_row(make_model, args.lr, master, moments, device))
            for name, master, moments in AMPFUNC_ROWS]
    rows.append(Row("compat torch_optim.AdamW split+q8", compat_row(make_model, args.lr, device)))
    rows.append(Row("torch AdamW(fused) fp32 + autocast", torch_style_row(
        make_model, lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=WEIGHT_DECAY, fused=True),
        torch.float32, device)))
    if not args.no_peers:
        rows += peer_rows(make_model, args.lr, torch.float32 if args.peer_params == "fp32" else torch.bfloat16,
                          device)

    # Build and warm up one row at a time: its peak is its own (the other rows' params and state
    # are allocated before it and subtracted). Every row keeps its model and state for the rounds.
    for row in rows:
        if row.status:
            continue
        try:
            _sync(device)
            before = torch.cuda.memory_allocated(device) if cuda else None
            row.step, count = row.build()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            for i in range(warmup):
                row.losses.append(row.step(data[i]))
            _sync(device)
            if cuda:
                row.peak = torch.cuda.max_memory_allocated(device) - before
                row.resident = torch.cuda.memory_allocated(device) - before
            row.state_bytes = count()
        except Exception as e:  # noqa: BLE001 -- reported in the table; the other rows still run
            row.status = f"{'failed' if row.peer else 'FAILED'}: {type(e).__name__}: {str(e)[:90]}"
            row.step = None
    held.clear()
    del reference
    live = [row for row in rows if row.step is not None]
    for i in range(iters):
        idx = data[warmup + i]
        for row in live:
            if row.status:
                continue
            try:
                _sync(device)
                t0 = time.perf_counter()
                row.losses.append(row.step(idx))
                _sync(device)
                row.times.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001
                row.status = f"{'failed' if row.peer else 'FAILED'}: {type(e).__name__}: {str(e)[:90]}"

    print(f"\n{'row':<52}{'tokens/s':>11}{'median ms':>11}{'min-max ms':>18}{'B/param':>9}"
          f"{'peak MiB':>10}{'resident MiB':>14}{'first loss':>12}{'last loss':>11}")
    failed = False
    tokens = batch * ctx
    for row in rows:
        if row.status:
            print(f"{row.name:<52}  {row.status}")
            failed |= row.status.startswith("FAILED")
            continue
        med = statistics.median(row.times)
        first, last = float(row.losses[0]), float(row.losses[-1])
        spread = f"{min(row.times) * 1e3:.1f}-{max(row.times) * 1e3:.1f}"
        print(f"{row.name:<52}{tokens / med:>11,.0f}{med * 1e3:>11.1f}{spread:>18}"
              f"{row.state_bytes / n_params:>9.2f}{_mib(row.peak):>10}{_mib(row.resident):>14}"
              f"{first:>12.4f}{last:>11.4f}")
        if not math.isfinite(last):
            print(f"  {row.name}: the loss is not finite")
            failed |= not row.peer
    if not cuda:
        print("peak / resident memory: n/a on the CPU (measured on CUDA only)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
