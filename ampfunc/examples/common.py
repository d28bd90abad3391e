"""What the main jobs share: the configuration table, live progress, metrics files and plots.

A configuration is one row of a table (name -> :class:`ExampleConfig`): the precision policy,
a loss-scale factory and an optional setup that rewrites the model (how an fp8 run swaps its
layers). Adding a precision to both main jobs is one entry in :data:`CONFIGS`.

Progress is fed without a host sync per step: every step is recorded into an
``af.TrainingMonitor`` whose window is the logging interval, and every ``log_every`` steps the
window is read back once, written to the metrics file and shown on the progress bar.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import ampfunc as af
import ampfunc.fp8
from ampfunc.lowmem import storage_bytes
from ampfunc.monitor import TrainingMonitor

__all__ = [
    "CONFIGS",
    "ExampleConfig",
    "LiveLog",
    "add_run_args",
    "configs_from_args",
    "count_flushed",
    "format_table",
    "make_transform",
    "parse_configs",
    "plot_runs",
    "state_bytes",
    "summary_record",
]


class ExampleConfig(NamedTuple):
    """One configuration of a main job (one row of its table).

    ``policy``: jmp shorthand; ``p=`` is the dtype the params are stored and differentiated in
    (an fp32 master copy is kept by ``mixed_precision`` when it is not fp32), ``c=`` the
    compute dtype, ``o=`` the logits' dtype. ``loss_scale``: a factory of a fresh loss scale.
    ``setup``: ``model -> model`` run once before the params are taken (``None``: none).
    ``about``: one line for ``--help``. ``fp8``: ``(model, group=None) -> Fp8Policy`` (``None``:
    no fp8). ``master``: how ``mixed_precision`` keeps the fp32 master copy (``"fp32"``, the
    default, passes nothing; ``"split"`` is passed on as ``master=``). ``moments``: how the
    job's ``af.adamw`` stores its moments, passed to it as ``moments=`` (``"fp32"``, ``"bf16"``
    or ``"q8"``).
    """

    policy: str
    loss_scale: Callable[[], Any]
    setup: Callable[[torch.nn.Module], torch.nn.Module] | None = None
    about: str = ""
    fp8: Callable[..., Any] | None = None
    master: str = "fp32"
    moments: str = "fp32"


def _plain_linears(model: torch.nn.Module) -> torch.nn.Module:
    # FP8 routes F.linear calls: Linear subclasses with their own matmul run as torch's Linear.
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.__class__ = torch.nn.Linear
    return model


def _fp8_policy(model: torch.nn.Module, group=None):
    # Every Linear but the output head (a model names it in fp8_exclude) as scaled FP8 matmuls.
    return af.fp8.fp8_policy(model, exclude=getattr(model, "fp8_exclude", ()), group=group)


def _overflowing_start() -> af.DynamicLossScale:
    # Starts at the largest scale, so the first steps overflow and back off (skipped, the params
    # untouched) until the scale fits the gradients; then it grows every 50 clean steps and backs
    # off again when it overshoots: the plot shows what the dynamic scale does.
    return af.DynamicLossScale(init_scale=2.0**24, growth_interval=50)


CONFIGS = {
    "fp32": ExampleConfig("p=f32,c=f32,o=f32", af.NoOpLossScale, about="fp32 throughout"),
    "bf16": ExampleConfig("p=bf16,c=bf16,o=f32", af.NoOpLossScale,
                          about="bf16 params and compute, fp32 master, no scaling"),
    "fp16+dynamic": ExampleConfig("p=f16,c=f16,o=f32", _overflowing_start,
                                  about="fp16 params and compute, fp32 master, dynamic loss scaling from 2^24"),
    "fp16 unscaled": ExampleConfig("p=f16,c=f16,o=f32", af.NoOpLossScale,
                                   about="fp16 params and compute, fp32 master, no scaling: small gradients "
                                         "flush to zero"),
    "bf16-split": ExampleConfig("p=bf16,c=bf16,o=f32", af.NoOpLossScale, master="split",
                                about="bf16 params and compute, the fp32 master split (bf16 param + int16 low "
                                      "half: exact, 2 bytes), fp32 moments"),
    "bf16-lowmem": ExampleConfig("p=bf16,c=bf16,o=f32", af.NoOpLossScale, master="split", moments="q8",
                                 about="bf16-split with 8-bit block-wise Adam moments (about 6 bytes per param)"),
    "fp8": ExampleConfig("p=bf16,c=bf16,o=f32", af.NoOpLossScale, setup=_plain_linears, fp8=_fp8_policy,
                         about="bf16 with every Linear but the head as FP8 matmuls (e4m3/e5m2, delayed "
                               "scaling); on CPU for correctness, not speed"),
}


def make_transform(cfg: ExampleConfig, inner, group=None):
    """``af.mixed_precision(inner)`` as ``cfg`` asks: its loss scale and its master layout.

    ``cfg.moments`` belongs to the optimizer: build ``inner``'s ``af.adamw`` with
    ``moments=cfg.moments``.
    """
    layout = {"master": cfg.master} if cfg.master != "fp32" else {}
    return af.mixed_precision(inner, loss_scale=cfg.loss_scale(), group=group, **layout)


def _key(name: str) -> str:
    return name.strip().lower().replace("-", " ").replace("_", " ")


def parse_configs(text: str, table: dict = CONFIGS) -> list[str]:
    """Names of ``table`` from a comma-separated list; ``-``/``_`` stand for spaces ("fp16-unscaled").

    Raises ``ValueError`` naming the unknown entry and the choices.
    """
    by_key = {_key(name): name for name in table}
    names = []
    for part in text.split(","):
        if not part.strip():
            continue
        if _key(part) not in by_key:
            raise ValueError(f"unknown config {part.strip()!r}; choose from {list(table)}")
        names.append(by_key[_key(part)])
    if not names:
        raise ValueError(f"no config given; choose from {list(table)}")
    return names


def add_run_args(ap) -> None:
    """The flags both main jobs share: --configs, --seed, --device, --metrics, --plot, --log-every, --progress."""
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model's init, the batches and the held-out sample")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--metrics", metavar="PATH", help="write one JSON line per step per configuration, then one "
                                                      "summary line (heldout_loss, state_bytes_per_param, ...)")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG of the loss curves and the loss scale")
    ap.add_argument("--log-every", type=int, default=25,
                    help="steps between reads of the device (bar, metrics) and between flush counts")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bars (default: on a terminal)")


def configs_from_args(ap, args) -> list[str]:
    """The chosen configuration names; an unknown name exits through ``ap.error``."""
    try:
        return parse_configs(args.configs)
    except ValueError as e:
        ap.error(str(e))


def count_flushed(grads, reference) -> torch.Tensor:
    """0-d int64: elements of ``grads`` that are exactly zero where ``reference`` is not (no host sync).

    ``reference`` holds the fp32 gradients of the same params and batch: an element that is
    zero in a configuration's gradients but not in fp32's was flushed to zero by the compute
    dtype's range (fp16 below ~6e-8), not by the maths.
    """
    return sum(((g == 0) & (r != 0)).sum() for g, r in zip(af.tree.tree_leaves(grads), af.tree.tree_leaves(reference)))


def state_bytes(*trees) -> int:
    """Bytes of the storages behind the tensors of ``trees``, each storage counted once.

    Counted from ``untyped_storage().nbytes()``: a leaf that is a view into a packed buffer
    counts that buffer once, whatever its dtype. Pass the params and the optimizer state
    (which holds the fp32 master copy, the moments and the loss scale).
    """
    return storage_bytes(*trees)


def summary_record(config: str, **fields) -> str:
    """The last metrics line of a configuration: ``{"config", "summary": true, **fields}`` as JSON."""
    return json.dumps({"config": config, "summary": True, **{k: _num(v) if isinstance(v, float) else v
                                                            for k, v in fields.items()}}) + "\n"


class LiveLog:
    """A progress bar, a metrics file and a plot history for one configuration's run.

    Each step the caller records into :attr:`monitor` (pure, on the device) and calls
    :meth:`step`; every ``log_every`` steps :meth:`step` reads the window back (one sync), writes
    one JSON line per step, and updates the bar with loss, scale, skipped steps and steps/s.
    """

    def __init__(self, config: str, total: int, *, params=None, metrics=None, log_every: int = 25,
                 progress: bool | None = None, device=None):
        # tqdm is the examples' extra; the library itself does not need it
        from tqdm.auto import tqdm

        self.config, self.metrics, self.log_every = config, metrics, log_every
        self.monitor = TrainingMonitor(params, window=log_every, device=device)
        self.history = {"step": [], "loss": [], "loss_scale": [], "finite": []}
        self.skipped = 0
        self._pending = 0
        self._start = time.perf_counter()
        # progress=None: tqdm shows the bar on a terminal and stays quiet when piped
        self.bar = tqdm(total=total, desc=f"{config:>14}", unit="step", leave=True,
                        disable=None if progress is None else not progress, dynamic_ncols=True)

    def step(self) -> None:
        self._pending += 1
        if self._pending == self.log_every:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        h = self.monitor.history()
        n = self._pending
        self._pending = 0
        elapsed = time.perf_counter() - self._start
        for step, loss, scale, finite in zip(*(h[k][-n:] for k in ("step", "loss", "loss_scale", "finite"))):
            self.skipped += not finite
            for k, v in (("step", step), ("loss", loss), ("loss_scale", scale), ("finite", finite)):
                self.history[k].append(v)
            if self.metrics is not None:
                self.metrics.write(json.dumps({"config": self.config, "step": step, "loss": _num(loss),
                                               "loss_scale": _num(scale), "finite": bool(finite),
                                               "skipped": self.skipped, "time_s": round(elapsed, 3)}) + "\n")
        self.bar.set_postfix(loss=f"{h['loss'][-1]:.4g}", scale=f"{h['loss_scale'][-1]:g}", skipped=self.skipped,
                             refresh=False)
        self.bar.update(n)

    def close(self) -> dict:
        """Flushes the rest; returns the monitor's ``as_dict()`` (health, overflowing leaves)."""
        self.flush()
        self.bar.close()
        if self.metrics is not None:
            self.metrics.flush()
        return self.monitor.as_dict()


def _num(x: float):
    return x if math.isfinite(x) else str(x)  # JSON has no inf/nan: write them as strings


def plot_runs(histories: dict, path: str, title: str = "") -> None:
    """A PNG: the training loss by configuration, and the loss scale with skipped steps marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    for name, h in histories.items():
        ax_loss.plot(h["step"], h["loss"], label=name, lw=1)
        if any(s != 1.0 for s in h["loss_scale"]):
            ax_scale.plot(h["step"], h["loss_scale"], label=name, lw=1)
            skipped = [(s, sc) for s, sc, ok in zip(h["step"], h["loss_scale"], h["finite"]) if not ok]
            if skipped:
                ax_scale.scatter(*zip(*skipped), marker="x", color="red", zorder=3,
                                 label=f"{name}: skipped step ({len(skipped)})")
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss by precision")
    ax_loss.legend(fontsize=8)
    ax_scale.set(xlabel="step", ylabel="loss scale", yscale="log", title="loss scale (x: skipped step)")
    if ax_scale.lines:
        ax_scale.legend(fontsize=8)
    else:
        ax_scale.text(0.5, 0.5, "no configuration scales its loss", ha="center", transform=ax_scale.transAxes)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(rows: list, columns: list) -> str:
    """A Markdown table; ``columns`` are ``(header, key, format)`` triples."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[k]) if not isinstance(r[k], str) else r[k]
                                       for _, k, fmt in columns) + " |")
    return "\n".join(lines)
