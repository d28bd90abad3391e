"""A reusable fault-injection harness for ampfunc's training steps.

It trains a tiny MLP through one of several *paths* (the composed ``mixed_precision`` step in
its pure, in-place and ``update`` forms over fused and generic inner optimizers, with clipping
and with ``accumulate``; the five primitives by hand, pure and in place; the torch.amp-style
``GradScaler`` facade) and injects faults from a *plan*: NaN, +inf or -inf written at random
leaves and positions of the gradients, or multiplied into the loss, in bursts of consecutive
steps. After every step it asserts these invariants:

* no non-finite value in any state (params, master, optimizer state, loss scale);
* a step is skipped exactly when the gradients it was given are not all finite, and a skipped
  step leaves params and optimizer state bit-identical (an applied one changes them);
* the loss scale stays within ``[max(min_scale, 2**-126), max_scale]``, never 0 or inf.

:func:`run` returns the skip and scale sequences, so that a caller compares the compiled kernels
with the plain-torch reference (:func:`reference_kernels` switches this process's ``ampfunc``
ops to the reference for the duration of a ``with`` block) and asserts they are equal.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from typing import Any, Callable, NamedTuple

import torch

import ampfunc as af
from ampfunc import ops
from ampfunc.tree import tree_leaves, tree_map

FAULT_VALUES = (float("nan"), float("inf"), float("-inf"))
SCALE_FLOOR = af.loss_scale.SCALE_RANGE[0]


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------

REFERENCE_CALLS = [0]


@contextlib.contextmanager
def reference_kernels():
    """Within the block, every ``torch.ops.ampfunc`` op on CPU runs its plain-torch reference
    (what ``AMPFUNC_DISABLE_EXT=1`` gives a whole process); the compiled kernels serve again
    after it. Counts reference calls in ``REFERENCE_CALLS[0]`` so a test can see it worked."""
    ops.load()
    if ops.backend() == "reference":
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        with torch.library._scoped_library("ampfunc", "IMPL") as lib:
            for name, fn in ops._REFERENCE.items():
                def counted(*args, _fn=fn, **kwargs):
                    REFERENCE_CALLS[0] += 1
                    return _fn(*args, **kwargs)

                lib.impl(name, counted, "CPU")
            yield


@contextlib.contextmanager
def backend(name: str):
    """``"ext"``: the kernels this process loaded (compiled when available); ``"reference"``."""
    if name == "reference":
        with reference_kernels():
            yield
    else:
        yield


# ----------------------------------------------------------------------------------------------
# Fault plans
# ----------------------------------------------------------------------------------------------


class Fault(NamedTuple):
    kind: str                  # "grad" or "loss"
    value: float               # nan, inf or -inf
    leaves: tuple = ()         # indices into the gradient leaves (kind "grad")
    positions: tuple = ()      # one fraction in [0, 1) per leaf: where in the leaf to write


def make_plan(steps: int, seed: int, *, rate: float = 0.15, max_burst: int = 4, long_burst: int = 0,
              n_leaves: int = 3) -> list[Fault | None]:
    """A fault (or None) per step: bursts start with probability ``rate`` and last 1 to
    ``max_burst`` steps; ``long_burst`` > 0 adds one burst of that length in the middle.
    Step 0 always carries a fault (the freshly initialised state must survive one too)."""
    rng = random.Random(seed)

    def one() -> Fault:
        value = rng.choice(FAULT_VALUES)
        if rng.random() < 0.2:
            return Fault("loss", value)
        k = rng.randint(1, n_leaves)
        leaves = tuple(sorted(rng.sample(range(n_leaves), k)))
        return Fault("grad", value, leaves, tuple(rng.random() for _ in leaves))

    plan: list[Fault | None] = [None] * steps
    i = 0
    while i < steps:
        if i == 0 or rng.random() < rate:
            n = rng.randint(1, max_burst)
            for j in range(i, min(steps, i + n)):
                plan[j] = one()
            i += n
        i += 1
    if long_burst:
        start = max(1, steps // 2 - long_burst // 2)
        for j in range(start, min(steps, start + long_burst)):
            plan[j] = one()
    return plan


def burst(n: int, seed: int) -> list[Fault]:
    """``n`` consecutive faulty steps."""
    rng_plan = make_plan(4 * n + 8, seed, rate=1.0, max_burst=1)
    faults = [f for f in rng_plan if f is not None]
    return (faults * (n // max(1, len(faults)) + 1))[:n]


def inject(grads: list[torch.Tensor], fault: Fault) -> None:
    """Writes ``fault.value`` into the chosen gradient leaves, in place."""
    for leaf, pos in zip(fault.leaves, fault.positions):
        g = grads[leaf % len(grads)]
        flat = g.view(-1)
        with torch.no_grad():
            flat[int(pos * flat.numel())] = fault.value


# ----------------------------------------------------------------------------------------------
# The model and the paths
# ----------------------------------------------------------------------------------------------


def init_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"l1": {"w": torch.randn(4, 6, generator=g) * 0.3, "b": torch.zeros(6)},
            "l2": {"w": torch.randn(6, 2, generator=g) * 0.3}}


def loss_of(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    return ((h @ params["l2"]["w"] - y) ** 2).mean().float()


def batch(step: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randn(8, 4, generator=g).to(dtype), (torch.randn(8, 2, generator=g) * 0.1).to(dtype)


class Config(NamedTuple):
    init_scale: float = 2.0**10
    growth_interval: int = 4
    min_scale: float = 1.0
    max_scale: float = 2.0**14
    hysteresis: int = 1

    def loss_scale(self) -> af.DynamicLossScale:
        return af.DynamicLossScale(self.init_scale, growth_interval=self.growth_interval,
                                   min_scale=self.min_scale, max_scale=self.max_scale,
                                   hysteresis=self.hysteresis)


class Path:
    """One way of training: ``loss_scale()``, ``grads(x, y, fault)``, ``apply(grads)``,
    ``state()`` (every tensor of the training state except the loss scale)."""

    def __init__(self, dtype: torch.dtype, config: Config):
        self.dtype = dtype
        self.config = config

    # Gradients of the scaled loss w.r.t. the compute-dtype leaves in ``self.compute_params()``.
    def grads(self, x, y, fault: Fault | None):
        params = tree_map(lambda t: t.detach().requires_grad_(True), self.compute_params())
        loss = loss_of(params, x, y)
        if fault is not None and fault.kind == "loss":
            loss = loss * fault.value
        leaves = tree_leaves(params)
        gs = torch.autograd.grad(af.scale_loss(loss, self.loss_scale()), leaves)
        gs = [g.detach().clone() for g in gs]
        if fault is not None and fault.kind == "grad":
            inject(gs, fault)
        return af.tree.tree_unflatten(af.tree.tree_structure(params), gs)


class MixedPrecisionPath(Path):
    def __init__(self, dtype, config, inner: Callable[[], Any], mode: str):
        super().__init__(dtype, config)
        self.tx = af.mixed_precision(inner(), loss_scale=config.loss_scale())
        self.params = af.tree.tree_cast(init_params(), dtype)
        self.opt_state = self.tx.init(self.params)
        self.mode = mode

    def compute_params(self):
        return self.params

    def loss_scale(self):
        return af.loss_scale_of(self.opt_state)

    def apply(self, grads):
        if self.mode == "step":
            self.params, self.opt_state = self.tx.step(self.params, grads, self.opt_state)
        elif self.mode == "step_":
            self.params, self.opt_state = self.tx.step_(self.params, grads, self.opt_state)
        else:
            updates, self.opt_state = self.tx.update(grads, self.opt_state, self.params)
            self.params = af.apply_updates(self.params, updates)

    def state(self):
        s = self.opt_state
        return [self.params, s.master, s.inner]


class PrimitivesPath(Path):
    """The user's loop of DESIGN.md: fp32 params, compute in ``dtype``, the five primitives."""

    def __init__(self, dtype, config, inplace: bool):
        super().__init__(dtype, config)
        self.opt = af.adam(1e-2)
        self.params = init_params()
        self.opt_state = self.opt.init(self.params)
        self.ls = config.loss_scale()
        self.inplace = inplace

    def compute_params(self):
        return af.cast_params(self.params, self.dtype)

    def grads(self, x, y, fault):
        # Gradients w.r.t. the fp32 params through the cast (what grad(loss_fn) gives).
        params = tree_map(lambda t: t.detach().requires_grad_(True), self.params)
        loss = loss_of(af.cast_params(params, self.dtype), x, y)
        if fault is not None and fault.kind == "loss":
            loss = loss * fault.value
        gs = [g.detach().clone() for g in torch.autograd.grad(af.scale_loss(loss, self.ls), tree_leaves(params))]
        if fault is not None and fault.kind == "grad":
            inject(gs, fault)
        return af.tree.tree_unflatten(af.tree.tree_structure(params), gs)

    def loss_scale(self):
        return self.ls

    def apply(self, grads):
        if self.inplace:
            grads, finite = af.mixed.unscale_and_check_(grads, self.ls)
        else:
            grads, finite = af.unscale_and_check(grads, self.ls)
        updates, new_opt = self.opt.update(grads, self.opt_state, self.params)
        new_params = af.apply_updates(self.params, updates)
        if self.inplace:
            af.mixed.skip_or_apply_(finite, (new_params, new_opt), (self.params, self.opt_state))
            af.mixed.update_scale_(self.ls, finite)
        else:
            self.params, self.opt_state = af.skip_or_apply(finite, (new_params, new_opt),
                                                           (self.params, self.opt_state))
            self.ls = af.update_scale(self.ls, finite)

    def state(self):
        return [self.params, self.opt_state]


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        p = init_params()
        self.l1 = torch.nn.Module()
        self.l1.w = torch.nn.Parameter(p["l1"]["w"])
        self.l1.b = torch.nn.Parameter(p["l1"]["b"])
        self.l2 = torch.nn.Module()
        self.l2.w = torch.nn.Parameter(p["l2"]["w"])

    def forward(self, params, x, y):
        return loss_of(params, x, y)


class GradScalerPath(Path):
    """The torch.amp-style facade: fp32 module, compute in ``dtype``, torch.optim.AdamW."""

    def __init__(self, dtype, config):
        super().__init__(dtype, config)
        self.model = _MLP()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scaler = af.compat.GradScaler("cpu", init_scale=config.init_scale,
                                           growth_interval=config.growth_interval)

    def loss_scale(self):
        return self.scaler.loss_scale if self.scaler.loss_scale is not None else af.StaticLossScale(
            self.config.init_scale)

    def grads(self, x, y, fault):
        self.opt.zero_grad(set_to_none=True)
        params = {"l1": {"w": self.model.l1.w.to(self.dtype), "b": self.model.l1.b.to(self.dtype)},
                  "l2": {"w": self.model.l2.w.to(self.dtype)}}
        loss = loss_of(params, x, y)
        if fault is not None and fault.kind == "loss":
            loss = loss * fault.value
        self.scaler.scale(loss).backward()
        gs = [self.model.l1.w.grad, self.model.l1.b.grad, self.model.l2.w.grad]
        if fault is not None and fault.kind == "grad":
            inject(gs, fault)
        return {"l1": {"w": gs[0], "b": gs[1]}, "l2": {"w": gs[2]}}

    def apply(self, grads):
        self.scaler.step(self.opt)
        self.scaler.update()

    def state(self):
        return [[p.detach() for p in self.model.parameters()], list(self.opt.state.values())]


class ModuleTrainerPath(Path):
    """``af.ModuleTrainer`` on a module held in ``dtype`` (an fp32 master when fp16/bf16)."""

    def __init__(self, dtype, config):
        super().__init__(dtype, config)
        self.model = _MLP().to(dtype)
        self.trainer = af.ModuleTrainer(self.model, af.adamw(1e-2), loss_scale=config.loss_scale())

    def loss_scale(self):
        return self.trainer.loss_scale

    def grads(self, x, y, fault):
        m = self.model
        loss = loss_of({"l1": {"w": m.l1.w, "b": m.l1.b}, "l2": {"w": m.l2.w}}, x, y)
        if fault is not None and fault.kind == "loss":
            loss = loss * fault.value
        self.trainer.scale(loss).backward()
        gs = [m.l1.w.grad, m.l1.b.grad, m.l2.w.grad]
        if fault is not None and fault.kind == "grad":
            inject(gs, fault)
        return {"l1": {"w": gs[0], "b": gs[1]}, "l2": {"w": gs[2]}}

    def apply(self, grads):
        self.trainer.step()

    def state(self):
        s = self.trainer.state
        return [[p.detach() for p in self.model.parameters()], s.master, s.opt_state]


PATHS: dict[str, Callable[[torch.dtype, Config], Path]] = {
    "mp-adamw.step": lambda d, c: MixedPrecisionPath(d, c, lambda: af.adamw(1e-2), "step"),
    "mp-adamw.step_": lambda d, c: MixedPrecisionPath(d, c, lambda: af.adamw(1e-2), "step_"),
    "mp-adamw.update": lambda d, c: MixedPrecisionPath(d, c, lambda: af.adamw(1e-2), "update"),
    "mp-sgd.step_": lambda d, c: MixedPrecisionPath(d, c, lambda: af.sgd(0.05, momentum=0.9), "step_"),
    "mp-clip-adam.step": lambda d, c: MixedPrecisionPath(
        d, c, lambda: af.chain(af.clip_by_global_norm(0.5), af.adam(1e-2)), "step"),
    "mp-rmsprop.step_": lambda d, c: MixedPrecisionPath(
        d, c, lambda: af.from_torch(torch.optim.RMSprop, lr=1e-2), "step_"),
    "mp-accumulate.step": lambda d, c: MixedPrecisionPath(d, c, lambda: af.accumulate(af.adam(1e-2), 3), "step"),
    "mp-accumulate.step_": lambda d, c: MixedPrecisionPath(d, c, lambda: af.accumulate(af.sgd(0.05), 2), "step_"),
    "primitives": lambda d, c: PrimitivesPath(d, c, inplace=False),
    "primitives_": lambda d, c: PrimitivesPath(d, c, inplace=True),
    "GradScaler": lambda d, c: GradScalerPath(d, c),
    "ModuleTrainer": lambda d, c: ModuleTrainerPath(d, c),
}


# ----------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _float_tensors(tree) -> list[torch.Tensor]:
    out = []
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            out.append(t)
        elif isinstance(t, dict):  # torch.optim per-param state
            out.extend(_float_tensors(list(t.values())))
    return out


def _snapshot(tensors) -> list[torch.Tensor]:
    return [t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()]).clone() for t in tensors]


class Record(NamedTuple):
    skips: list
    scales: list


def run(path: str, dtype: torch.dtype, plan: list, *, config: Config = Config(), seed: int = 0,
        check_every: int = 1) -> Record:
    """Trains ``len(plan)`` steps along ``path`` with the faults of ``plan``; asserts the
    invariants after every ``check_every``-th step (and the skip and scale rules after every
    step); returns the skip and scale sequences. Runs on one intra-op thread: the tensors are
    tiny, and thread wake-ups on a busy machine would cost more than the arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(path, dtype, plan, config, seed, check_every)
    finally:
        torch.set_num_threads(threads)


def _run(path, dtype, plan, config, seed, check_every) -> Record:
    p = PATHS[path](dtype, config)
    # The GradScaler facade has torch's limits (min 0, max inf) whatever the config says.
    lo = max(config.min_scale, SCALE_FLOOR) if path != "GradScaler" else SCALE_FLOOR
    hi = config.max_scale if path != "GradScaler" else math.inf
    skips, scales = [], []
    for step, fault in enumerate(plan):
        x, y = batch(step, dtype, seed)
        grads = p.grads(x, y, fault)
        expect_skip = not all(bool(torch.isfinite(g).all()) for g in tree_leaves(grads))
        assert fault is None or expect_skip, f"{path} step {step}: the injected {fault} left finite gradients"
        before = _snapshot(_float_tensors(p.state()))
        p.apply(grads)
        state = _float_tensors(p.state())
        after = _snapshot(state)
        unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        where = f"{path} {dtype} step {step} fault {fault}"
        if expect_skip:
            assert unchanged, f"{where}: a skipped step changed the params or optimizer state"
        else:
            assert not unchanged, f"{where}: finite gradients but the step was not applied"
        scale = float(p.loss_scale().loss_scale)
        assert lo <= scale <= hi and 0.0 < scale < math.inf, f"{where}: loss scale {scale} outside [{lo}, {hi}]"
        if step % check_every == 0 or step == len(plan) - 1:
            bad = [i for i, t in enumerate(state) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            assert not bad, f"{where}: non-finite values in state tensors {bad}"
        skips.append(expect_skip)
        scales.append(scale)
    return Record(skips, scales)
