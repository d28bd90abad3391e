"""One mixed-precision training step, ampfunc vs what PyTorch users write today.

One run, one process, the same tree for every row. Prints medians, the spread (min-max) and
ratios: to the memory-bandwidth floor measured in this run, and to the torch baseline.

    python benchmarks/bench_step.py                  # CPU, 200 tensors / 32M elements
    python benchmarks/bench_step.py --quick          # smoke run: 1M elements, fewer repeats
    python benchmarks/bench_step.py --device cuda    # the GPU run (benchmarks/gpu_check.sh)

Sections:
  floor   in-place mul_ (read+write) and sum (read) over one flat fp32 buffer -> bandwidths;
          the Adam floor is 28 bytes/element (read g, p, m, v; write p, m, v) at the read+write
          bandwidth, the check floor 4 bytes/element at the read bandwidth.
  (a)     fp32 full step: ampfunc (check + clip + AdamW + skip + scale update; fused, in place
          and pure) vs AdamW(fused=True) + GradScaler + clip_grad_norm_ vs AdamW(foreach=True) +
          GradScaler + clip_grad_norm_.
  (b)     fp16 model params and grads, fp32 master weights: ampfunc vs the apex FP16_Optimizer
          recipe written with torch (fp16 grads -> fp32 master grads, unscale, clip, fused AdamW on
          the master, copy back to fp16), and ampfunc.compat.apex's FP16_Optimizer(AdamW) itself
          (fused step; and forced to materialize its master grads), and its amp O2 (AdamW; fused
          step, and forced onto torch's step + the copy back). ``--only b``: this section.
  (c)     the bookkeeping alone: ampfunc's read-only check + scale update, ampfunc's out-of-place
          unscale_and_check, vs GradScaler.unscale_ + update.
  (d)     10,000 small tensors vs 200 large ones of the same total (ampfunc fused step; the
          same on one flat buffer; torch fused AdamW + GradScaler + clip for reference).
  (e)     every step path the library documents, on 200 tensors / 16M elements fp32, as a ratio
          to torch AdamW(fused=True).step() alone in the same run, with each path's target:
          af.adamw().update + af.apply_updates (<= 1.5x), mixed_precision(...).step (<= 1.3x),
          .step_ (<= 1.05x), ModuleTrainer.step() (<= 1.1x), ModuleTrainer with DynamicLossScale +
          clip against torch's AdamW(fused) + GradScaler + clip_grad_norm_ (>= 1.6x faster), and
          10,000 tensors against 200 (step_, update + apply_updates and ModuleTrainer(flat=True),
          <= 1.2x), and Lion's step_ beside AdamW's (one moment instead of two: <= 0.9x). The rows are
          timed round by round (each round times every row three times in a row), so drift in
          the machine's speed hits every row alike.

    python benchmarks/bench_step.py --only e       # section (e) alone

  (f)     the user's loop on the CPU: backward makes new gradient tensors every step (here a
          stand-in: each gradient allocated anew and written once; then, with ``--churn K``, K
          lists of gradient-sized temporaries made and dropped before it, as a forward's
          activations are). torch's recipe (zero_grad(set_to_none=True), AdamW(fused) +
          GradScaler + clip_grad_norm_) against ModuleTrainer(chain(clip, adamw),
          DynamicLossScale), timed alone and interleaved round by round with the pure paths,
          each iteration (backward stand-in + step, where fresh memory's page faults land) and
          the step alone; the minor page faults per iteration are printed (a count that does
          not depend on the machine's load).

    python benchmarks/bench_step.py --only f       # section (f) alone

  (g)     Lion beside AdamW, on section (e)'s tree (200 tensors / 16M elements fp32): the
          mixed_precision(...).step_ of each (target: Lion's <= 0.9x AdamW's; it moves one moment,
          20 bytes/element against 28) and each one's in-place kernel alone (ops.lion_step_,
          ops.adam_step_), the four rows interleaved round by round.

    python benchmarks/bench_step.py --only g       # section (g) alone

  (h)     many leaves alone: 200 against 10,000 tensors of the same total (16M fp32 elements),
          mixed_precision(adamw).step_ (target: 10,000 at <= 1.2x the 200-tensor time), the pure
          step and update + apply_updates, and ops.adam_step_ on the same lists (as they are,
          and with the params and moments held, ops.held_lists, as the step holds them); the
          rows timed round by round as in (e), and for each pair the ratio of every round (a round's
          10,000-tensor median over its 200-tensor median) as median and min-max, which drift
          in the machine's speed between rounds does not move. Beside them, the floor of any
          road that looks at every tensor of the step each call (as the kernels' validation
          does): one prefetched pass over the step's tensor objects, cold (ops.bump_versions
          over params, grads and both moments), against the 1.2x target's budget. And the held
          op under no_grad with the params and gradients copied into one buffer each, as views
          in address order and in a shuffled order, and the step_ likewise: where the tensors
          lie moves the data kernel's time on 10,000 short segments, with nothing else changed.

    python benchmarks/bench_step.py --only h       # section (h) alone

Outside section (f), gradients are fixed tensors (no backward pass is timed). The loss scale is 1 and max_norm is
huge so that repeated in-place unscaling and clipping by torch leave the values (and so the
speed: no denormals) unchanged from one repeat to the next; every kernel still does its work.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ampfunc as af  # noqa: E402
from ampfunc import ops  # noqa: E402
from ampfunc.compat import _torch_step  # noqa: E402
from ampfunc.compat.apex import amp  # noqa: E402
from ampfunc.compat.apex.fp16_utils import FP16_Optimizer  # noqa: E402
from ampfunc.flat import flatten  # noqa: E402

MAX_NORM = 1e9  # clipping computed and applied, coefficient 1: values stay put between repeats
LR = 1e-3


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn) -> list[float]:
        for _ in range(self.warmup):
            fn()
        self.sync()
        out = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def interleaved(self, fns: dict, block: int = 3) -> dict:
        """Times every function of ``fns`` ``block`` times in a row per round, round after round
        (``reps`` rounds): a change in the machine's speed during the run (other jobs on shared
        cores) hits every row alike, so the ratios between rows hold even when the absolute times
        drift, while each row still runs a few steps back to back as a training loop does."""
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        self.sync()
        out = {name: [] for name in fns}
        for _ in range(self.reps):
            for name, fn in fns.items():
                # A full collection before each timed call (untimed): a row pays for the cyclic
                # GC that its own allocations trigger, not for the garbage of the row before.
                gc.collect()
                for _ in range(block):
                    t0 = time.perf_counter()
                    fn()
                    self.sync()
                    out[name].append((time.perf_counter() - t0) * 1e3)
        return out


# ---------------------------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------------------------


def tree_sizes(total: int, n: int) -> list[int]:
    """``n`` sizes summing to ``total``, transformer-like: a few big matrices and many small
    vectors (every 4th leaf is 8x smaller)."""
    weights = [1.0 if i % 4 else 0.125 for i in range(n)]
    scale = total / sum(weights)
    sizes = [max(1, int(w * scale)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def make_tree(sizes, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {f"layer{i:05d}": (torch.randn(s, generator=gen) * 0.02).to(device=device, dtype=dtype)
            for i, s in enumerate(sizes)}


def torch_grad_scaler(device):
    return torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=10**9)


# ---------------------------------------------------------------------------------------------
# the contenders
# ---------------------------------------------------------------------------------------------


def ampfunc_step(params, grads, inplace=True):
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(MAX_NORM), af.adamw(LR)),
                            af.DynamicLossScale(1.0, growth_interval=10**9))
    state = tx.init(params)
    box = {"p": params, "s": state}
    if inplace:
        def run():
            box["p"], box["s"] = tx.step_(box["p"], grads, box["s"])
    else:
        def run():
            box["p"], box["s"] = tx.step(box["p"], grads, box["s"])
    return run


def torch_step(params, grads, device, *, fused: bool, clip: bool = True, scaler: bool = True):
    ps = [p.clone().requires_grad_(True) for p in params.values()]
    for p, g in zip(ps, grads.values()):
        p.grad = g.clone()
    kw = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(ps, lr=LR, **kw)
    sc = torch_grad_scaler(device) if scaler else None
    dummy = torch.zeros((), device=device)

    def run():
        if sc is not None:
            sc.scale(dummy)  # the scaler's lazy init; the grads stand in for backward()
            sc.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True)
        if sc is not None:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
    return run


def apex_style_step(params16, grads16, device):
    """apex FP16_Optimizer / amp O2 written with torch: fp32 master params own the optimizer."""
    model = list(params16.values())
    model_grads = list(grads16.values())
    master = [p.detach().float().requires_grad_(True) for p in model]
    for m in master:
        m.grad = torch.zeros_like(m)
    master_grads = [m.grad for m in master]
    opt = torch.optim.AdamW(master, lr=LR, fused=True)
    sc = torch_grad_scaler(device)
    dummy = torch.zeros((), device=device)

    def run():
        sc.scale(dummy)
        torch._foreach_copy_(master_grads, model_grads)  # fp16 grads -> fp32 master grads
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(master, MAX_NORM, foreach=True)
        sc.step(opt)
        sc.update()
        with torch.no_grad():
            torch._foreach_copy_(model, master)  # master -> fp16 model params
    return run


def fp16_optimizer_step(params16, grads16, fused: bool = True):
    """ampfunc.compat.apex FP16_Optimizer(AdamW) with a dynamic scale: what runs after backward.

    ``fused``: the facade's default loop (a read-only check of the fp16 grads, then one fused
    pass per group); else its materializing path (fp32 master grads, then torch's own AdamW
    step, single-tensor on CPU, and the copy back). A 1-element param stands in for the
    network: its backward is what makes the facade check the fixed fp16 grads."""
    model = [p.clone().requires_grad_(True) for p in params16.values()]
    for p, g in zip(model, grads16.values()):
        p.grad = g
    tiny = torch.zeros(1, dtype=model[0].dtype, device=model[0].device, requires_grad=True)
    opt = FP16_Optimizer(torch.optim.AdamW(model + [tiny], lr=LR), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 1.0, "scale_window": 10**9}, verbose=False)

    def run():
        loss = tiny.float().sum() * 0.0
        if fused:
            opt.backward(loss)
        else:
            opt.backward(loss, update_master_grads=False)
            opt.update_master_grads()
        opt.step()
    return run


def amp_o2_step(params16, grads16, fused: bool = True):
    """ampfunc.compat.apex ``amp.initialize(..., opt_level="O2")`` with torch AdamW and its dynamic
    scale: what runs after backward. Inside ``scale_loss`` the fixed fp16 grads stand in for the
    backward's; leaving it unscales them into the fp32 master grads (one pass, overflow flag and
    the scale update); ``step`` is then one fused pass per segment (``fused``), else, forced as
    before this path existed, torch's own single-tensor AdamW step on the masters and the copy
    back to fp16."""
    net = torch.nn.Module()
    net.params = torch.nn.ParameterList([torch.nn.Parameter(p.float()) for p in params16.values()])
    net, opt = amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=LR), opt_level="O2", verbosity=0)
    model, grads = list(net.parameters()), list(grads16.values())
    dummy = torch.zeros((), device=model[0].device)

    def run():
        with amp.scale_loss(dummy, opt):
            for p, g in zip(model, grads):
                p.grad = g  # what the backward would leave: this step's fp16 grads
        opt.step()

    def run_forced():
        supported = _torch_step.torch_step_supported
        _torch_step.torch_step_supported = lambda *a, **k: False  # the path before the fused step
        try:
            run()
        finally:
            _torch_step.torch_step_supported = supported
    return run if fused else run_forced


def master_section(table, timer, device, sizes, total, bw_rw):
    """(b): fp16 params and grads, fp32 master weights."""
    master_floor = (2 + 28 + 2) * total / (bw_rw * 1e9) * 1e3  # + read fp16 g (check), write fp16 p
    table.section(f"(b) fp16 params and grads, fp32 master weights (x floor: {master_floor:.1f} ms = 32 B/elem)")
    p16, g16 = make_tree(sizes, torch.float16, device), make_tree(sizes, torch.float16, device, seed=1)
    t_apex = table.add("apex FP16_Optimizer recipe with torch (fused AdamW on master)",
                       timer(apex_style_step(p16, g16, device)), master_floor)
    table.add("ampfunc mixed_precision(clip+adamw).step_ (master in state)",
              timer(ampfunc_step({k: v.clone() for k, v in p16.items()}, g16)), master_floor, t_apex)
    table.add("ampfunc.compat.apex FP16_Optimizer(AdamW), fused step (no clip)",
              timer(fp16_optimizer_step(p16, g16)), master_floor, t_apex, "check pass + 1 fused pass")
    table.add("  same facade, master grads materialized (torch's AdamW step)",
              timer(fp16_optimizer_step(p16, g16, fused=False)), master_floor, t_apex,
              "unscale pass + single-tensor AdamW")
    table.add("ampfunc.compat.apex amp O2 (AdamW), fused step (no clip)",
              timer(amp_o2_step(p16, g16)), master_floor, t_apex, "unscale pass + 1 fused pass")
    table.add("  same, old path forced (torch's AdamW step + copy back)",
              timer(amp_o2_step(p16, g16, fused=False)), master_floor, t_apex,
              "unscale pass + single-tensor AdamW + copy")
    if amp._amp_state.handle is not None:
        amp._amp_state.handle._deactivate()
    del p16, g16


def pure_update_step(params, grads, tx=None):
    """The README's first optimizer loop: ``updates, state = tx.update(...)``; ``apply_updates``."""
    tx = tx or af.adamw(LR)
    box = {"p": params, "s": tx.init(params)}

    def run():
        updates, box["s"] = tx.update(grads, box["s"], box["p"])
        box["p"] = af.apply_updates(box["p"], updates)
    return run


def mixed_step(params, grads, inplace, tx=None, loss_scale=None):
    tx = af.mixed_precision(tx or af.adamw(LR), loss_scale or af.NoOpLossScale())
    box = {"p": params, "s": tx.init(params)}
    step = tx.step_ if inplace else tx.step

    def run():
        box["p"], box["s"] = step(box["p"], grads, box["s"])
    return run


class _Leaves(torch.nn.Module):
    def __init__(self, params):
        super().__init__()
        self.leaves = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in params.values()])


def trainer_step(params, grads, tx=None, loss_scale=None):
    """``ModuleTrainer(model, tx).step()`` on a module holding the tree's tensors; the grads are
    put back on ``.grad`` before each step (a backward pass would)."""
    model = _Leaves(params)
    trainer = af.ModuleTrainer(model, tx or af.adamw(LR), loss_scale=loss_scale)
    pairs = list(zip(model.leaves, grads.values()))

    def run():
        for p, g in pairs:
            p.grad = g
        trainer.step()
    return run


def flat_trainer_step(params, grads, tx=None):
    """``ModuleTrainer(model, tx, flat=True).step()``: the grads are copied once into the
    trainer's gradient views and kept (``set_grads_to_none=False``: backward would write them)."""
    model = _Leaves(params)
    trainer = af.ModuleTrainer(model, tx or af.adamw(LR), flat=True, set_grads_to_none=False)
    with torch.no_grad():
        for p, g in zip(model.leaves, grads.values()):
            p.grad.copy_(g)
    return trainer.step


def ampfunc_bookkeeping(grads, device, out_of_place=False):
    ls = af.DynamicLossScale(1.0, growth_interval=10**9, device=device)
    leaves = list(grads.values())
    if out_of_place:
        box = {"ls": ls}

        def run():
            _, finite = af.unscale_and_check(grads, box["ls"])
            box["ls"] = af.update_scale(box["ls"], finite)
        return run

    def run():
        finite, _ = ops.check(leaves)
        ls._adjust_(finite)
    return run


def grad_scaler_bookkeeping(params, grads, device):
    ps = [p.clone().requires_grad_(True) for p in params.values()]
    for p, g in zip(ps, grads.values()):
        p.grad = g.clone()
    opt = torch.optim.SGD(ps, lr=LR)
    sc = torch_grad_scaler(device)
    dummy = torch.zeros((), device=device)

    def run():
        sc.scale(dummy)
        sc.unscale_(opt)
        sc.update()
    return run


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


class Table:
    def __init__(self):
        self.rows = []

    def section(self, title):
        self.rows.append(("section", title))

    def note(self, text):
        """A line of text under the rows printed so far."""
        self.rows.append(("note", text))

    def add(self, name, times, floor_ms=None, baseline=None, note=""):
        med = statistics.median(times)
        self.rows.append(("row", name, med, min(times), max(times),
                          med / floor_ms if floor_ms else None, baseline / med if baseline else None, note))
        return med

    def print(self):
        head = f"{'':68s} {'median ms':>10s} {'min-max ms':>17s} {'x floor':>8s} {'speedup':>8s}"
        print(head)
        print("-" * len(head))
        for r in self.rows:
            if r[0] == "section":
                print(f"\n{r[1]}")
                continue
            if r[0] == "note":
                print(f"  {r[1]}")
                continue
            _, name, med, lo, hi, xf, sp, note = r
            xf_s = f"{xf:8.2f}" if xf is not None else " " * 8
            sp_s = f"{sp:7.2f}x" if sp is not None else " " * 8
            print(f"  {name:66s} {med:10.2f} {f'{lo:.2f}-{hi:.2f}':>17s} {xf_s} {sp_s}  {note}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="1M elements, 3 repeats: a smoke run")
    ap.add_argument("--elements", type=int, default=None, help="total elements (default 32M; 1M with --quick)")
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--many", type=int, default=10_000, help="tensor count of section (d)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--paths-elements", type=int, default=None,
                    help="total elements of section (e) (default 16M; 1M with --quick)")
    ap.add_argument("--only", default="abcdefgh",
                    help="'b', 'e', 'f', 'g' or 'h': that section alone (after the floor); else every section")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--churn", type=int, default=2,
                    help="section (f): lists of gradient-sized temporaries made and dropped before each backward")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    total = args.elements or (2**20 if args.quick else 32 * 2**20)
    reps = args.reps or (3 if args.quick else 7)
    timer = Timer(device, reps=reps, warmup=1 if args.quick else 2)
    backend = ops.load()

    print(f"# bench_step  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"# machine: {platform.node()} | {platform.processor() or platform.machine()} | "
          f"{os.cpu_count()} CPUs (torch threads {torch.get_num_threads()})"
          + (f" | {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    print(f"# torch {torch.__version__} | python {platform.python_version()} | ampfunc backend: {backend}")
    print(f"# command: python {' '.join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))}")
    print(f"# tree: {args.tensors} tensors, {total / 2**20:.1f}M elements; median of {reps} (min-max); "
          f"'x floor' = time / floor, 'speedup' = torch baseline time / this time\n")

    table = Table()

    # floor ---------------------------------------------------------------------------------
    table.section("floor: one flat fp32 buffer")
    buf = torch.randn(total, device=device)
    t_mul = table.add("x.mul_(1.0)  (read + write, 8 B/elem)", timer(lambda: buf.mul_(1.0)))
    t_sum = table.add("x.sum()      (read, 4 B/elem)", timer(lambda: buf.sum()))
    buf = None  # frees the buffer before the next section (the lambdas above ran)
    bw_rw = 8 * total / (t_mul * 1e-3) / 1e9
    bw_r = 4 * total / (t_sum * 1e-3) / 1e9
    adam_floor = 28 * total / (bw_rw * 1e9) * 1e3
    check_floor = 4 * total / (bw_r * 1e9) * 1e3
    print(f"# bandwidth: read+write {bw_rw:.1f} GB/s, read {bw_r:.1f} GB/s; Adam floor {adam_floor:.2f} ms, "
          f"check floor {check_floor:.2f} ms")

    sizes = tree_sizes(total, args.tensors)

    if "f" in args.only:
        print(f"# load average {os.getloadavg()[0]:.1f} (1 min) before section (f)")
        fresh_section(table, device, args.paths_elements or (2**20 if args.quick else 16 * 2**20), args.tensors,
                      max(3, reps // 2 + 1), args.churn)
    if args.only == "f":
        print()
        table.print()
        return
    if args.only == "b":
        master_section(table, timer, device, sizes, total, bw_rw)
        print()
        table.print()
        return
    if "h" in args.only:
        leaves_section(table, timer, device, args.paths_elements or (2**20 if args.quick else 16 * 2**20),
                       args.tensors, args.many)
    if args.only == "h":
        print()
        table.print()
        return
    if "e" in args.only:
        paths_total = args.paths_elements or (2**20 if args.quick else 16 * 2**20)
        paths_section(table, timer, device, paths_total, args.tensors, args.many,
                      28 * paths_total / (bw_rw * 1e9) * 1e3)
    if args.only == "e":
        print()
        table.print()
        return
    if "g" in args.only:
        lion_section(table, timer, device, args.paths_elements or (2**20 if args.quick else 16 * 2**20),
                     args.tensors, bw_rw)
    if args.only == "g":
        print()
        table.print()
        return

    # (a) fp32 ------------------------------------------------------------------------------
    table.section(f"(a) fp32 params and grads, full step (x floor: Adam floor {adam_floor:.1f} ms)")
    params, grads = make_tree(sizes, torch.float32, device), make_tree(sizes, torch.float32, device, seed=1)
    t_fused = table.add("torch AdamW(fused) + GradScaler + clip_grad_norm_",
                        timer(torch_step(params, grads, device, fused=True)), adam_floor)
    table.add("torch AdamW(foreach) + GradScaler + clip_grad_norm_",
              timer(torch_step(params, grads, device, fused=False)), adam_floor, t_fused)
    table.add("torch AdamW(fused) alone (no scaler, no clip)",
              timer(torch_step(params, grads, device, fused=True, clip=False, scaler=False)), adam_floor, t_fused)
    table.add("ampfunc mixed_precision(clip+adamw).step_ (in place)",
              timer(ampfunc_step({k: v.clone() for k, v in params.items()}, grads)), adam_floor, t_fused)
    table.add("ampfunc mixed_precision(clip+adamw).step (pure)",
              timer(ampfunc_step({k: v.clone() for k, v in params.items()}, grads, inplace=False)), adam_floor,
              t_fused, "fused out-of-place kernel")

    # (c) bookkeeping -----------------------------------------------------------------------
    table.section(f"(c) bookkeeping alone, fp32 grads (x floor: check floor {check_floor:.1f} ms)")
    t_gs = table.add("GradScaler.unscale_ + update", timer(grad_scaler_bookkeeping(params, grads, device)),
                     check_floor)
    leaves = list(grads.values())
    table.add("ampfunc ops.check alone (read-only: finite + sum of squares)", timer(lambda: ops.check(leaves)),
              check_floor, t_gs)
    table.add("ampfunc ops.check + update_scale_ (read-only)",
              timer(ampfunc_bookkeeping(grads, device)), check_floor, t_gs)
    table.add("ampfunc unscale_and_check + update_scale (pure, fp32 out)",
              timer(ampfunc_bookkeeping(grads, device, out_of_place=True)), check_floor, t_gs)
    del params, grads

    # (b) fp16 + fp32 master ----------------------------------------------------------------
    master_section(table, timer, device, sizes, total, bw_rw)

    # (d) many small tensors ----------------------------------------------------------------
    table.section(f"(d) {args.many} small tensors vs {args.tensors} large, same {total / 2**20:.1f}M elements")
    t_few = None
    for n in (args.tensors, args.many):
        s = tree_sizes(total, n)
        params, grads = make_tree(s, torch.float32, device), make_tree(s, torch.float32, device, seed=1)
        times = timer(ampfunc_step(params, grads))
        note = "" if t_few is None else f"{statistics.median(times) / t_few:.2f}x the {args.tensors}-tensor time"
        med = table.add(f"ampfunc step_, {n} tensors", times, adam_floor, None, note)
        t_few = med if t_few is None else t_few
        if n == args.many:
            flat_p, flat_g = flatten(params), flatten(grads)
            table.add(f"ampfunc step_, {n} tensors flattened to 1 buffer (af.flat.flatten)",
                      timer(ampfunc_step(flat_p.buffers, flat_g.buffers)), adam_floor)
            table.add(f"torch AdamW(fused) + GradScaler + clip, {n} tensors",
                      timer(torch_step(params, grads, device, fused=True)), adam_floor)
        del params, grads

    print()
    table.print()


def lion_section(table, timer, device, total, n, bw_rw):
    """(g): Lion's step_ and kernel beside AdamW's, interleaved round by round."""
    sizes = tree_sizes(total, n)
    params, grads = make_tree(sizes, torch.float32, device), make_tree(sizes, torch.float32, device, seed=1)
    fresh = lambda: {k: v.clone() for k, v in params.items()}  # noqa: E731
    gs = list(grads.values())
    one, yes = torch.ones((), device=device), torch.tensor(True, device=device)
    adam_p, lion_p = list(fresh().values()), list(fresh().values())
    m, v, mu = ([torch.zeros_like(x) for x in adam_p] for _ in range(3))
    adam_t, lion_t = torch.zeros((), device=device), torch.zeros((), device=device)
    fns = {
        "step_": mixed_step(fresh(), grads, True),
        "lion_step_": mixed_step(fresh(), grads, True, tx=af.lion(LR / 10)),
        "adam_kernel": lambda: ops.adam_step_(adam_p, gs, m, v, None, None, adam_t, one, yes, lr=LR,
                                              decoupled_weight_decay=True),
        "lion_kernel": lambda: ops.lion_step_(lion_p, gs, mu, None, lion_t, one, yes, lr=LR / 10),
    }
    times = timer.interleaved(fns)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = {b: b * total / (bw_rw * 1e9) * 1e3 for b in (20, 28)}
    table.section(f"(g) Lion beside AdamW, {n} tensors / {total / 2**20:.1f}M elements fp32, rows interleaved "
                  f"round by round (x floor: 28 B/elem for AdamW, 20 for Lion)")
    table.add("mixed_precision(adamw, NoOpLossScale()).step_ (in place)", times["step_"], floor[28])
    table.add("mixed_precision(lion, NoOpLossScale()).step_ (in place)", times["lion_step_"], floor[20], None,
              f"{med['lion_step_'] / med['step_']:5.2f}x AdamW's step_ (target <= 0.9x)")
    table.add("ops.adam_step_ alone (AdamW)", times["adam_kernel"], floor[28])
    table.add("ops.lion_step_ alone", times["lion_kernel"], floor[20], None,
              f"{med['lion_kernel'] / med['adam_kernel']:5.2f}x AdamW's kernel")


def paths_section(table, timer, device, total, n_few, n_many, floor_ms):
    """(e): every step path against torch AdamW(fused=True).step() alone, same run."""
    sizes = tree_sizes(total, n_few)
    params, grads = make_tree(sizes, torch.float32, device), make_tree(sizes, torch.float32, device, seed=1)
    fresh = lambda: {k: v.clone() for k, v in params.items()}  # noqa: E731
    many_sizes = tree_sizes(total, n_many)
    mparams = make_tree(many_sizes, torch.float32, device)
    mgrads = make_tree(many_sizes, torch.float32, device, seed=1)
    # Every row in one round-robin: each round times each row once (see Timer.interleaved).
    names = {
        "torch": "torch AdamW(fused=True).step() alone",
        "update": "af.adamw(1e-3).update + af.apply_updates (pure)",
        "step": "mixed_precision(adamw, NoOpLossScale()).step (pure)",
        "step_": "mixed_precision(adamw, NoOpLossScale()).step_ (in place)",
        "trainer": "ModuleTrainer(model, af.adamw(1e-3)).step()",
        "recipe": "torch AdamW(fused) + GradScaler + clip_grad_norm_",
        "trainer_dls": "ModuleTrainer(chain(clip, adamw), loss_scale=DynamicLossScale)",
        "many_step_": f".step_, {n_many} tensors",
        "many_update": f"update + apply_updates, {n_many} tensors",
        "flat_trainer": f"ModuleTrainer(model, af.adamw(1e-3), flat=True).step(), {n_few} tensors",
        "many_flat_trainer": f"ModuleTrainer(..., flat=True).step(), {n_many} tensors",
        "lion_step_": "mixed_precision(lion, NoOpLossScale()).step_ (in place)",
    }
    fns = {
        "torch": torch_step(fresh(), grads, device, fused=True, clip=False, scaler=False),
        "update": pure_update_step(fresh(), grads),
        "step": mixed_step(fresh(), grads, False),
        "step_": mixed_step(fresh(), grads, True),
        "trainer": trainer_step(params, grads),
        "recipe": torch_step(fresh(), grads, device, fused=True),
        "trainer_dls": trainer_step(params, grads, af.chain(af.clip_by_global_norm(MAX_NORM), af.adamw(LR)),
                                    af.DynamicLossScale(1.0, growth_interval=10**9)),
        "many_step_": mixed_step(mparams, mgrads, True),
        "many_update": pure_update_step({k: v.clone() for k, v in mparams.items()}, mgrads),
        "flat_trainer": flat_trainer_step(params, grads),
        "many_flat_trainer": flat_trainer_step(mparams, mgrads),
        "lion_step_": mixed_step(fresh(), grads, True, tx=af.lion(LR / 10)),
    }
    times = timer.interleaved(fns)
    med = {k: statistics.median(v) for k, v in times.items()}
    t0 = med["torch"]
    table.section(f"(e) every path, {n_few} tensors / {total / 2**20:.1f}M elements fp32, rows interleaved round by "
                  f"round; ratio = time / torch AdamW(fused) alone")
    table.add(names["torch"], times["torch"], floor_ms)
    for key, target in (("update", 1.5), ("step", 1.3), ("step_", 1.05), ("trainer", 1.1)):
        table.add(names[key], times[key], floor_ms, None,
                  f"{med[key] / t0:5.2f}x torch alone (target <= {target}x)")
    table.add(names["lion_step_"], times["lion_step_"], floor_ms, None,
              f"{med['lion_step_'] / med['step_']:5.2f}x AdamW's step_ (one moment: target <= 0.9x)")
    table.add(names["recipe"], times["recipe"], floor_ms, None, "the next row's baseline")
    table.add(names["trainer_dls"], times["trainer_dls"], floor_ms, None,
              f"{med['recipe'] / med['trainer_dls']:5.2f}x faster than torch's recipe (target >= 1.6x)")
    for key, base in (("many_step_", "step_"), ("many_update", "update")):
        table.add(names[key], times[key], floor_ms, None,
                  f"{med[key] / med[base]:5.2f}x the {n_few}-tensor time (target <= 1.2x)")
    table.add(names["flat_trainer"], times["flat_trainer"], floor_ms, None,
              f"{med['flat_trainer'] / t0:5.2f}x torch alone (grads kept on the views)")
    table.add(names["many_flat_trainer"], times["many_flat_trainer"], floor_ms, None,
              f"{med['many_flat_trainer'] / med['flat_trainer']:5.2f}x the {n_few}-tensor time (target <= 1.2x)")
    params = grads = mparams = mgrads = fns = None  # frees the trees (the closures above ran)


def ops_adam_step_(params, grads):
    """``ops.adam_step_`` alone on the tree's lists (AdamW, in place, moments packed as init
    packs them): the door and the kernel without the engine's Python."""
    p, g = list(params.values()), list(grads.values())
    state = af.adamw(LR).init(params)
    m, v = list(state.exp_avg.values()), list(state.exp_avg_sq.values())
    step, scale, finite = torch.zeros(()), torch.ones(()), torch.ones((), dtype=torch.bool)

    def run():
        ops.adam_step_(p, g, m, v, None, None, step, scale, finite, lr=LR, weight_decay=0.01,
                       decoupled_weight_decay=True)
    return run


def ops_adam_step_held(params, grads):
    """``ops_adam_step_`` with the params and moments held for the door (``ops.held_lists``, as
    the engine's in-place step holds them): each call checks them instead of describing them."""
    p, g = list(params.values()), list(grads.values())
    state = af.adamw(LR).init(params)
    m, v = list(state.exp_avg.values()), list(state.exp_avg_sq.values())
    step, scale, finite = torch.zeros(()), torch.ones(()), torch.ones((), dtype=torch.bool)
    held = ops.held_lists([p, m, v])

    def run():
        ops.adam_step_(p, g, m, v, None, None, step, scale, finite, lr=LR, weight_decay=0.01,
                       decoupled_weight_decay=True)
    run.held = held  # lives as long as the row
    return run


def laid_out(tensors: list, order: str) -> list:
    """Copies of ``tensors`` as views of one buffer, a 64-byte gap after each (as an allocator
    leaves one), placed in list order ("address order") or in a fixed shuffled order."""
    where = list(range(len(tensors)))
    if order == "shuffled":
        random.Random(0).shuffle(where)
    gap = 64 // tensors[0].element_size()
    buf = torch.empty(sum(t.numel() + gap for t in tensors), dtype=tensors[0].dtype)
    starts, at = [0] * len(tensors), 0
    for i in where:
        starts[i], at = at, at + tensors[i].numel() + gap
    return [buf[s:s + t.numel()].view_as(t).copy_(t) for s, t in zip(starts, tensors)]


def _laid_out_trees(params, grads, order):
    """The tree's params and gradients as :func:`laid_out` places them, under their keys."""
    return (dict(zip(params, laid_out(list(params.values()), order))),
            dict(zip(grads, laid_out(list(grads.values()), order))))


def held_step_laid_out(order):
    """``ops_adam_step_held`` under no_grad (as the engine calls it), its params and gradients
    laid out by :func:`laid_out`: the same tensors and the same kernel, in other places. The
    data kernel's passes over many short segments depend on where the segments lie."""
    def make(params, grads):
        held_step = ops_adam_step_held(*_laid_out_trees(params, grads, order))

        def run():
            with torch.no_grad():
                held_step()
        run.held = held_step.held  # lives as long as the row
        return run
    return make


def step_laid_out(order):
    """``mixed_step(..., inplace=True)`` (the engine's ``step_``) on the tree with its params and
    gradients laid out by :func:`laid_out`."""
    def make(params, grads):
        return mixed_step(*_laid_out_trees(params, grads, order), True)
    return make


def object_pass(params, grads):
    """One look at each tensor object of ``ops_adam_step_``'s call (its Python object,
    TensorImpl and version counter; the moments packed as init packs them, so their views
    share one counter): ``ops.bump_versions`` over the four lists, a prefetched pass with no
    kernel. Timed among the other rows, whose kernels evict the objects, it is what a road that
    validates every tensor on every call pays per tensor at least."""
    state = af.adamw(LR).init(params)
    tensors = [*params.values(), *grads.values(), *state.exp_avg.values(), *state.exp_avg_sq.values()]
    return lambda: ops.bump_versions(tensors)


def leaves_section(table, timer, device, total, n_few, n_many):
    """(g): the same paths on ``n_few`` and ``n_many`` tensors of one total size, interleaved."""
    trees = {}
    for n in (n_few, n_many):
        sizes = tree_sizes(total, n)
        trees[n] = make_tree(sizes, torch.float32, device), make_tree(sizes, torch.float32, device, seed=1)
    paths = {
        "step_": ("mixed_precision(adamw, NoOpLossScale()).step_", lambda p, g: mixed_step(p, g, True), 1.2),
        "step": ("mixed_precision(adamw, NoOpLossScale()).step (pure)", lambda p, g: mixed_step(p, g, False), None),
        "update": ("af.adamw(1e-3).update + af.apply_updates (pure)", pure_update_step, 1.2),
        "ops": ("ops.adam_step_ (the op alone, in place)", ops_adam_step_, None),
        "held": ("ops.adam_step_, params and moments held (ops.held_lists)", ops_adam_step_held, None),
        "ordered": ("the held op, no_grad, params and grads views in address order", held_step_laid_out("address"),
                    None),
        "shuffled": ("the held op, no_grad, params and grads views in shuffled order",
                     held_step_laid_out("shuffled"), None),
        "step_ordered": ("step_, params and grads views in address order", step_laid_out("address"), 1.2),
        "step_shuffled": ("step_, params and grads views in shuffled order", step_laid_out("shuffled"), None),
        "objects": ("one look at each of the step's tensors (ops.bump_versions)", object_pass, None),
    }
    fns = {}
    for key, (_, make, _) in paths.items():
        for n, (params, grads) in trees.items():
            fns[(key, n)] = make({k: v.clone() for k, v in params.items()}, grads)
    block = 3
    times = timer.interleaved(fns, block=block)
    table.section(f"(h) {n_few} against {n_many} tensors, {total / 2**20:.1f}M elements fp32, rows interleaved round "
                  f"by round ({timer.reps} rounds of {block}); ratio = {n_many}-tensor time / {n_few}-tensor time")
    for key, (name, _, target) in paths.items():
        few, many = times[(key, n_few)], times[(key, n_many)]
        rounds = [statistics.median(many[i:i + block]) / statistics.median(few[i:i + block])
                  for i in range(0, len(few), block)]
        med_few = table.add(f"{name}, {n_few} tensors", few)
        goal = f" (target <= {target}x)" if target else ""
        table.add(f"{name}, {n_many} tensors", many, None, None,
                  f"{statistics.median(many) / med_few:5.2f}x; per round {statistics.median(rounds):.2f}x "
                  f"({min(rounds):.2f}-{max(rounds):.2f}){goal}")
    # What the 1.2x target leaves for the extra tensors, against what one look at each costs.
    budget = 0.2 * statistics.median(times[("step_", n_few)])
    looks = statistics.median(times[("objects", n_many)]) - statistics.median(times[("objects", n_few)])
    table.note(f"1.2x budget for the {n_many - n_few} extra leaves: {budget:.2f} ms; one look at their "
               f"{4 * (n_many - n_few)} tensors costs {looks:.2f} ms ({looks / budget:.0%} of it)")
    trees = fns = None  # frees the trees (the closures above ran)


# ---------------------------------------------------------------------------------------------
# (f) fresh gradients: the user's loop, where backward makes new gradient tensors every step
# ---------------------------------------------------------------------------------------------


def _minflt() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class FreshLoop:
    """One row of section (f): ``backward()`` then ``step()``, with the backward a stand-in that
    allocates each gradient anew and writes it once (autograd hands the op's new output to
    ``.grad``), optionally after a churn of temporaries (``churn`` lists of tensors the size
    of the gradients, made, written and dropped: the forward's activations). ``times`` are of
    the whole iteration (where the page faults of fresh memory land), ``step_times`` of the
    step alone, ``faults`` the minor page faults per iteration."""

    def __init__(self, params_list, sources, step, churn: int = 0):
        self.params, self.sources, self.step, self.churn = params_list, sources, step, churn
        self.times, self.step_times, self.faults = [], [], []

    def backward(self):
        for _ in range(self.churn):
            tmp = [torch.empty_like(s).copy_(s) for s in self.sources]
            del tmp
        for p, s in zip(self.params, self.sources):
            p.grad = torch.empty_like(s).copy_(s)

    def __call__(self, record: bool = True):
        f0 = _minflt()
        t0 = time.perf_counter()
        self.backward()
        t1 = time.perf_counter()
        self.step()
        t2 = time.perf_counter()
        if record:
            self.times.append((t2 - t0) * 1e3)
            self.step_times.append((t2 - t1) * 1e3)
            self.faults.append(_minflt() - f0)


def fresh_recipe(params, sources, churn):
    """torch's recipe on fresh gradients: zero_grad(set_to_none=True), backward, GradScaler's
    unscale_, clip_grad_norm_, AdamW(fused=True) through the scaler, update."""
    ps = [p.clone().requires_grad_(True) for p in params.values()]
    opt = torch.optim.AdamW(ps, lr=LR, fused=True)
    sc = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
    dummy = torch.zeros(())

    def step():
        sc.scale(dummy)
        sc.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True)
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)
    return FreshLoop(ps, sources, step, churn)


def fresh_trainer(params, sources, churn):
    """ModuleTrainer(chain(clip_by_global_norm, adamw), DynamicLossScale) on fresh gradients
    (step() sets them to None, as zero_grad does)."""
    model = _Leaves(params)
    trainer = af.ModuleTrainer(model, af.chain(af.clip_by_global_norm(MAX_NORM), af.adamw(LR)),
                               loss_scale=af.DynamicLossScale(1.0, growth_interval=10**9))
    return FreshLoop(list(model.leaves), sources, trainer.step, churn)


def fresh_other(params, sources, churn, kind):
    """An other path in the interleaved run, on fresh gradients: the pure ``update`` +
    ``apply_updates`` (new params and state every step), or ``mixed_precision(...).step``."""
    keys = list(params)
    box = {"p": {k: v.clone() for k, v in params.items()}}
    tx = af.adamw(LR) if kind == "update" else af.mixed_precision(af.adamw(LR), af.NoOpLossScale())
    box["s"] = tx.init(box["p"])
    holders = [s.new_empty(()).expand_as(s) for s in sources]  # what backward writes .grad on (no memory)

    def step():
        grads = dict(zip(keys, [h.grad for h in holders]))
        if kind == "update":
            updates, box["s"] = tx.update(grads, box["s"], box["p"])
            box["p"] = af.apply_updates(box["p"], updates)
        else:
            box["p"], box["s"] = tx.step(box["p"], grads, box["s"])
        for h in holders:
            h.grad = None
    return FreshLoop(holders, sources, step, churn)


def fresh_section(table, device, total, n, reps, churn):
    """(f): torch's recipe vs ModuleTrainer + clip + DynamicLossScale with gradients made anew
    every step, timed alone (each row's steps back to back) and interleaved with the pure paths
    (round by round, 3 iterations a row), in this run."""
    if device.type != "cpu":
        return  # the CUDA caching allocator keeps freed blocks: this regime is the CPU heap's
    sizes = tree_sizes(total, n)
    params = make_tree(sizes, torch.float32, device)
    sources = list(make_tree(sizes, torch.float32, device, seed=1).values())
    for label, c in (("", 0), (f", {churn} lists of temporaries churned before each backward", churn)):
        if label and churn <= 0:
            continue
        table.section(f"(f) fresh gradients each step{label}: {n} tensors / {total / 2**20:.1f}M fp32; "
                      "iteration = backward stand-in (new grads, written once) + step; "
                      "speedup = torch's recipe / this, same mode")
        for mode in ("alone", "interleaved"):
            rows = {"recipe": fresh_recipe(params, sources, c), "trainer": fresh_trainer(params, sources, c)}
            if mode == "interleaved":
                rows["update"] = fresh_other(params, sources, c, "update")
                rows["step"] = fresh_other(params, sources, c, "step")
            for row in rows.values():
                row(False)
                row(False)
            if mode == "alone":
                for row in rows.values():
                    gc.collect()
                    for _ in range(3 * reps):
                        row()
            else:
                for _ in range(reps):
                    for row in rows.values():
                        gc.collect()
                        for _ in range(3):
                            row()
            t_recipe = statistics.median(rows["recipe"].times)
            s_recipe = statistics.median(rows["recipe"].step_times)
            names = {"recipe": "torch AdamW(fused) + GradScaler + clip_grad_norm_",
                     "trainer": "ModuleTrainer(chain(clip, adamw), DynamicLossScale)",
                     "update": "af.adamw().update + apply_updates (pure)",
                     "step": "mixed_precision(adamw).step (pure)"}
            for key, row in rows.items():
                faults = statistics.median(row.faults)
                step_med = statistics.median(row.step_times)
                note = f"step alone {step_med:.1f} ms ({s_recipe / step_med:.2f}x), {faults:.0f} faults/iter"
                table.add(f"{mode}: {names[key]}", row.times, None, t_recipe if key != "recipe" else None, note)
            rows = None
    params = sources = None


if __name__ == "__main__":
    main()
