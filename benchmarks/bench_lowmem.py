"""The low-memory settings against today's bf16 step: bytes per parameter and step time.

One process, one tree of bf16 params (one leaf of ``--numel`` elements plus a small fp32 one),
fresh bf16 gradients every step (a pool of three, cycled, so no step reuses the last one's
cache lines), ``mixed_precision(adamw(1e-3), NoOpLossScale())``:

  fp32-master   master="fp32", moments="fp32"   (today: 14 B/param)
  split         master="split", moments="fp32"  (12 B/param)
  split+bf16    master="split", moments="bf16"  (8 B/param)
  split+q8      master="split", moments="q8"    (about 6 B/param)

For each row: bytes of persistent state per parameter (params + master + optimizer state,
counted from the tensors' storages) and the median time of ``step_`` and of ``step``, rows
timed round by round (each round times every row once), so drift in the machine's speed hits
every row alike. Ratios are to the fp32-master row of the same round. torchao's and
bitsandbytes' 8-bit AdamW are timed beside them when they import (``--peers``).

    python benchmarks/bench_lowmem.py                 # 16M elements, 7 rounds
    python benchmarks/bench_lowmem.py --quick         # 1M elements, 3 rounds
    python benchmarks/bench_lowmem.py --before --no-pure   # the fused step_ against the plain one

With the compiled kernels loaded, the low-memory ``step_`` of adamw on CPU tensors (and on CUDA
tensors with ``--device cuda`` and the CUDA kernels) is the fused ``adam_lowmem_step_`` pass;
``--before`` adds rows timing the same ``step_`` through the plain-torch path (the fused op
switched off for that call), in the same rounds.

    python benchmarks/bench_lowmem.py --device cuda --before   # on a GPU (benchmarks/gpu_check.sh)

``--floors`` adds, per row, estimates of the two floors of its ``step_`` on ``--numel`` elements: memory (the
bytes the step must move per element, at the read+write bandwidth of ``x.mul_(1.0)`` over a
256 MiB buffer, measured in the same run) and arithmetic (the same ``step_`` timed on a
``--floor-numel`` tree and on one a quarter of its size, both small enough to stay in the caches,
on one thread: the difference per element, which leaves out the step's fixed cost per call,
scaled to ``--numel`` elements over the run's threads: what the step costs with no memory
traffic to wait for). A row runs at about the larger of the two where the other overlaps with it.

    python benchmarks/bench_lowmem.py --no-pure --floors
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ampfunc as af  # noqa: E402
from ampfunc import lowmem  # noqa: E402
from ampfunc.lowmem import storage_bytes  # noqa: E402

ROWS = (("fp32-master", "fp32", "fp32"), ("split", "split", "fp32"), ("split+bf16", "split", "bf16"),
        ("split+q8", "split", "q8"))


def _tree(numel: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(numel, generator=g).to(device, torch.bfloat16),
            "ln": torch.randn(1024, generator=g).to(device)}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peers(params: dict, grads_pool: list, device) -> dict:
    """torch-optimizer steps of the 8-bit peers on fp32 copies of the params (they keep no
    split master): name -> (step function, bytes per param), where they import."""
    out = {}
    w = torch.nn.Parameter(params["w"].float())
    try:
        from torchao.optim import AdamW8bit
        opt = AdamW8bit([w], lr=1e-3)

        def ao_step(i):
            w.grad = grads_pool[i % len(grads_pool)]["w"].float()
            opt.step()
        out["torchao AdamW8bit (fp32 params)"] = ao_step
    except Exception as e:  # noqa: BLE001 -- any import or device failure: reported, not timed
        print(f"  torchao: not timed ({type(e).__name__}: {str(e)[:80]})")
    try:
        import bitsandbytes as bnb
        opt_b = bnb.optim.AdamW8bit([w], lr=1e-3)

        def bnb_step(i):
            w.grad = grads_pool[i % len(grads_pool)]["w"].float()
            opt_b.step()
        out["bitsandbytes AdamW8bit (fp32 params)"] = bnb_step
    except Exception as e:  # noqa: BLE001
        print(f"  bitsandbytes: not timed ({type(e).__name__}: {str(e)[:80]})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--peers", action="store_true", help="also time torchao / bitsandbytes 8-bit AdamW")
    ap.add_argument("--before", action="store_true", help="also time the low-memory step_ through the plain-torch path")
    ap.add_argument("--no-pure", action="store_true", help="time step_ only (not the pure step)")
    ap.add_argument("--floors", action="store_true", help="also print each row's memory and arithmetic floors")
    ap.add_argument("--floor-numel", type=int, default=1 << 16, help="elements of the in-cache tree of --floors")
    args = ap.parse_args()
    if args.quick:
        args.numel, args.rounds = 1 << 20, 3
    device = torch.device(args.device)
    print(f"bench_lowmem {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, device {device}, "
          f"{args.numel:,} bf16 elements + 1,024 fp32")
    params = _tree(args.numel, device)
    total = sum(t.numel() for t in params.values())
    g = torch.Generator().manual_seed(1)
    grads_pool = [{k: torch.randn(v.shape, generator=g).to(device, v.dtype) for k, v in params.items()}
                  for _ in range(3)]
    steps = {}
    print(f"{'row':<16}{'B/param':>9}")
    for name, master, moments in ROWS:
        tx = af.mixed_precision(af.adamw(1e-3, moments=moments), af.NoOpLossScale(), master=master)
        p_in = {k: v.clone() for k, v in params.items()}
        st_in = tx.init(p_in)
        print(f"{name:<16}{storage_bytes(p_in, st_in.master, st_in.inner) / total:>9.2f}")
        box = {"p": p_in, "s": st_in, "pp": {k: v.clone() for k, v in params.items()}}
        box["ps"] = tx.init(box["pp"])

        def inplace(i, tx=tx, box=box):
            box["p"], box["s"] = tx.step_(box["p"], grads_pool[i % 3], box["s"])

        def pure(i, tx=tx, box=box):
            box["pp"], box["ps"] = tx.step(box["pp"], grads_pool[i % 3], box["ps"])

        steps[f"{name} step_"] = inplace
        if not args.no_pure:
            steps[f"{name} step"] = pure
        if args.before and master == "split":
            box["bp"] = {k: v.clone() for k, v in params.items()}
            box["bs"] = tx.init(box["bp"])

            def plain(i, tx=tx, box=box):
                fused, lowmem._fused_step_ = lowmem._fused_step_, lambda *a: None
                try:
                    box["bp"], box["bs"] = tx.step_(box["bp"], grads_pool[i % 3], box["bs"])
                finally:
                    lowmem._fused_step_ = fused
            steps[f"{name} step_ (plain)"] = plain
    if args.peers:
        steps.update(_peers(params, grads_pool, device))
    times = {k: [] for k in steps}
    for f in steps.values():  # warm-up: first-touch pages, kernel builds
        f(0)
        f(1)
    for r in range(args.rounds):
        for k, f in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            f(r)
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    print(f"\n{'row':<40}{'median ms':>10}{'min-max ms':>16}{'vs fp32-master':>16}")
    for k, ts in times.items():
        base = times["fp32-master step" if k.endswith(" step") else "fp32-master step_"]
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        print(f"{k:<40}{statistics.median(ts) * 1e3:>10.1f}{min(ts) * 1e3:>8.1f}-{max(ts) * 1e3:<7.1f}"
              f"{ratio:>12.2f}x faster" if ratio >= 1 else
              f"{k:<40}{statistics.median(ts) * 1e3:>10.1f}{min(ts) * 1e3:>8.1f}-{max(ts) * 1e3:<7.1f}"
              f"{1 / ratio:>12.2f}x slower")
    if args.floors and device.type == "cpu":
        floors(args.numel, args.floor_numel, torch.get_num_threads())


# Bytes per element each row's in-place step moves on a bf16 leaf: the bf16 gradient read; the
# bf16 param read and written; the fp32 master or the int16 remainder read and written; each
# moment read and written (q8: a code, plus 4 bytes per 256 elements of absmax).
MOVED = {"fp32-master": 2 + 4 + 8 + 16, "split": 2 + 4 + 4 + 16, "split+bf16": 2 + 4 + 4 + 8,
         "split+q8": 2 + 4 + 4 + 2 * (2 + 8 / 256)}


def _bandwidth() -> float:
    """Read+write bytes per second of an in-place pass over a 256 MiB fp32 buffer (median of 7)."""
    x = torch.ones(1 << 26)
    ts = []
    for _ in range(8):
        t0 = time.perf_counter()
        x.mul_(1.0)
        ts.append(time.perf_counter() - t0)
    return 8 * x.numel() / statistics.median(ts[1:])


def _per_element(tx, numel: int, g) -> float:
    """Seconds per ``tx.step_`` on a bf16 tree of ``numel`` elements (median of 9 runs of 20)."""
    p = {"w": torch.randn(numel, generator=g).bfloat16()}
    grads = [{"w": torch.randn(numel, generator=g).bfloat16()} for _ in range(3)]
    st = tx.init(p)
    for i in range(20):
        p, st = tx.step_(p, grads[i % 3], st)
    ts = []
    for _ in range(9):
        t0 = time.perf_counter()
        for i in range(20):
            p, st = tx.step_(p, grads[i % 3], st)
        ts.append((time.perf_counter() - t0) / 20)
    return statistics.median(ts)


def floors(numel: int, floor_numel: int, threads: int) -> None:
    """Prints each row's memory floor and arithmetic floor for a ``numel`` step (module docstring):
    the arithmetic per element is the slope between in-cache trees of ``floor_numel`` and a
    quarter of it, which leaves out the step's fixed cost per call."""
    bw = _bandwidth()
    g = torch.Generator().manual_seed(2)
    print(f"\nfloors for {numel:,} elements: memory at {bw / 1e9:.1f} GB/s read+write; arithmetic from "
          f"{floor_numel // 4:,} and {floor_numel:,} in-cache elements on 1 thread, scaled to {threads} threads")
    print(f"{'row':<16}{'B/elem':>8}{'memory ms':>11}{'ns/elem':>9}{'arith. ms':>11}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, master, moments in ROWS:
            tx = af.mixed_precision(af.adamw(1e-3, moments=moments), af.NoOpLossScale(), master=master)
            big, small = _per_element(tx, floor_numel, g), _per_element(tx, floor_numel // 4, g)
            per = (big - small) / (floor_numel - floor_numel // 4)
            print(f"{name:<16}{MOVED[name]:>8.2f}{MOVED[name] * numel / bw * 1e3:>11.1f}{per * 1e9:>9.2f}"
                  f"{per * numel / threads * 1e3:>11.1f}")
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
