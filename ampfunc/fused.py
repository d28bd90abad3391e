"""The fused mixed-precision step: the whole of ``mixed_precision(inner).step_`` in two passes.

:func:`plan_for` recognises an inner transform the kernels can run -- one of ``sgd``, ``adam``,
``adamw`` (a float learning rate or a schedule, evaluated on the device), optionally preceded by
``clip_by_global_norm`` in a ``chain`` -- and returns a :class:`FusedPlan`; anything else
(``from_torch`` optimizers, schedules, other chains) gets ``None`` and runs through the generic
pure path. :meth:`FusedPlan.step_` then does, on the device and without a host sync:

1. one read-only pass over the gradients (:func:`ampfunc.ops.check`): the finite flag and the
   sum of squares (the global norm) together;
2. a few 0-d ops: ``grad_scale = inv_scale * clip_coef`` with torch's ``clip_grad_norm_``
   coefficient ``min(1, max_norm / (norm + 1e-6))`` of the unscaled gradients;
3. one fused optimizer pass (:func:`ampfunc.ops.adam_step_` / :func:`~ampfunc.ops.sgd_step_`)
   that reads each gradient, multiplies it by ``grad_scale``, updates the fp32 master params and
   the moments, and writes the fp16/bf16 model params; it writes nothing (step counter
   included) when the flag says the gradients were not finite;
4. the loss-scale update in place (``DynamicLossScale.adjust_``).

Traffic per fp32 element for AdamW without master weights: read g (check), read g, p, m, v and
write p, m, v -- 32 bytes, against 28 for the optimizer alone and about 60 for
``GradScaler.unscale_`` + ``clip_grad_norm_`` + ``AdamW(fused=True)``.

The tensors of ``params`` and ``state`` are updated in place and returned (donated, as JAX's
``donate_argnums``); the pure ``mixed_precision(...).step`` clones them first, so both give
the same numbers bit for bit.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ampfunc import ops
from ampfunc.tree import PyTree, tree_leaves

__all__ = ["FusedPlan", "plan_for"]

_OPTIMIZERS = ("sgd", "adam", "adamw")
_dtype_of = operator.attrgetter("dtype")
_MODEL_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


def _spec_parts(spec: Any):
    """``(kind, hparams)`` of a FusedSpec-like value, or None."""
    kind = getattr(spec, "kind", None)
    hparams = getattr(spec, "hparams", None)
    if isinstance(kind, str) and isinstance(hparams, dict):
        return kind, hparams
    return None


class FusedPlan:
    """How to run one mixed-precision step of ``[clip_by_global_norm] -> sgd|adam|adamw`` fused.

    ``kind``: ``"sgd"``, ``"adam"`` or ``"adamw"``; ``hparams``: the optimizer's constructor
    arguments; ``max_norm``: the clipping threshold or None.
    """

    __slots__ = ("kind", "hparams", "max_norm")

    def __init__(self, kind: str, hparams: dict, max_norm: float | None = None):
        self.kind = kind
        self.hparams = dict(hparams)
        self.max_norm = max_norm

    def __repr__(self) -> str:
        clip = f"clip_by_global_norm({self.max_norm}) -> " if self.max_norm is not None else ""
        return f"FusedPlan({clip}{self.kind}, {self.hparams})"

    # -- state access ------------------------------------------------------------------------

    def _opt_state(self, inner_state):
        """The optimizer's state: ``inner_state`` itself, or the last element of a chain's
        state tuple (``chain(opt)`` and ``chain(clip, opt)``); None if neither has its layout."""
        want = ("step", "momentum_buffer") if self.kind == "sgd" else (
            "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        if tuple(getattr(inner_state, "_fields", ())) == want:
            return inner_state
        if type(inner_state) is tuple and inner_state:
            last = inner_state[-1]
            if tuple(getattr(last, "_fields", ())) == want:
                return last
        return None

    def supports(self, params: PyTree, state: Any) -> bool:
        """Whether :meth:`step_` can run on these ``params`` and ``state`` (the
        ``MixedPrecisionState`` from ``mixed_precision(inner).init``): the optimizer state has
        the expected layout, the master params (or the params, without a master) are fp32, and
        everything lives on one device. Looks at dtypes and devices only; never at values."""
        master = getattr(state, "master", None)
        return self.supports_leaves(tree_leaves(params), None if master is None else tree_leaves(master), state)

    def supports_leaves(self, params: list, master: list | None, state: Any) -> bool:
        """:meth:`supports` on already-flattened ``params`` and ``master`` leaves (for callers
        that flatten once per step: a 10,000-leaf dict costs milliseconds to flatten)."""
        opt = self._opt_state(getattr(state, "inner", None))
        if opt is None or not isinstance(opt.step, torch.Tensor) or opt.step.dtype != torch.float32:
            return False
        if self.kind == "sgd" and self.hparams.get("momentum", 0) != 0 and opt.momentum_buffer is None:
            return False
        if self.kind != "sgd" and self.hparams.get("amsgrad") and opt.max_exp_avg_sq is None:
            return False
        # mixed_precision.init guarantees float tensor leaves; dtypes decide here. Devices are
        # checked on the first leaf only: the kernels refuse a stray device with an error that
        # names the leaf's index, before writing anything.
        ref = master if master is not None else params
        dev = opt.step.device
        if ref and (ref[0].device != dev or set(map(_dtype_of, ref)) != {torch.float32}):
            return False
        if master is not None:
            model = params
            if model and (model[0].device != dev or not set(map(_dtype_of, model)) <= _MODEL_DTYPES):
                return False
        return True

    # -- the step ----------------------------------------------------------------------------

    def step_(self, params: PyTree, grads: PyTree, state: Any, *, group=None):
        """One whole mixed-precision step, in place; returns ``(params, state)`` (the same
        objects, their tensors updated). ``grads`` are the gradients of the scaled loss (any
        float dtype per leaf) and are only read. ``group``: a ``torch.distributed`` process
        group whose ranks must agree on skipping. See the module docstring for the passes."""
        master = state.master
        self.step_leaves_(tree_leaves(params), tree_leaves(grads),
                          None if master is None else tree_leaves(master),
                          [tree_leaves(t) for t in self.slot_trees(state) or []], state, group=group)
        return params, state

    def slot_trees(self, state: Any) -> list:
        """The optimizer's per-parameter state trees the kernel reads and writes, in the order
        :meth:`step_leaves_` takes their leaves: SGD ``[momentum_buffer]`` (none without
        momentum); Adam ``[exp_avg, exp_avg_sq]`` plus ``max_exp_avg_sq`` with amsgrad. None
        when ``state.inner`` does not have the optimizer's layout."""
        opt = self._opt_state(getattr(state, "inner", None))
        if opt is None:
            return None
        if self.kind == "sgd":
            return [opt.momentum_buffer] if self.hparams.get("momentum", 0) else []
        slots = [opt.exp_avg, opt.exp_avg_sq]
        return slots + [opt.max_exp_avg_sq] if self.hparams.get("amsgrad", False) else slots

    def step_leaves_(self, params: list, grads: list, master: list | None, slots: list, state: Any, *,
                     group=None) -> None:
        """:meth:`step_` on already-flattened leaves: ``params``, ``grads``, ``master`` (or None)
        and ``slots`` (the leaves of :meth:`slot_trees`), all in one consistent order."""
        opt = self._opt_state(state.inner)
        ref = master if master is not None else params
        model = params if master is not None else None
        g = grads
        if len(g) != len(ref):
            raise ValueError(f"fused step: grads has {len(g)} leaves but the params have {len(ref)}")
        dev = opt.step.device
        ls = state.loss_scale
        with torch.no_grad():
            finite, sumsq = ops.check(g)
            if group is not None:
                from ampfunc.mixed import agree_finite

                finite = agree_finite(finite, group)
            inv_scale = ls.inv_scale_on(dev)
            grad_scale = inv_scale
            if self.max_norm is not None:
                # clip_grad_norm_'s coefficient, of the unscaled gradients' norm.
                norm = sumsq.sqrt() * inv_scale
                grad_scale = inv_scale * (self.max_norm / (norm + 1e-6)).clamp(max=1.0)
            h = self.hparams
            lr = h["lr"]
            if callable(lr):  # a schedule of the applied-step count, evaluated on the device
                from ampfunc.optim.base import lr_at

                lr = lr_at(lr, opt.step)
                lr = lr.to(dev, torch.float32) if isinstance(lr, torch.Tensor) else lr
            if self.kind == "sgd":
                ops.sgd_step_(ref, g, slots[0] if slots else None, model,
                              opt.step, grad_scale, finite, lr=lr, weight_decay=h.get("weight_decay", 0.0),
                              momentum=h.get("momentum", 0.0), dampening=h.get("dampening", 0.0),
                              nesterov=h.get("nesterov", False), maximize=h.get("maximize", False))
            else:
                beta1, beta2 = h.get("betas", (0.9, 0.999))
                amsgrad = bool(h.get("amsgrad", False))
                ops.adam_step_(ref, g, slots[0], slots[1], slots[2] if amsgrad else None, model, opt.step, grad_scale,
                               finite, lr=lr, beta1=beta1, beta2=beta2, eps=h.get("eps", 1e-8),
                               weight_decay=h.get("weight_decay", 0.0), amsgrad=amsgrad,
                               decoupled_weight_decay=self.kind == "adamw", maximize=h.get("maximize", False))
            adjust_ = getattr(ls, "adjust_", None)
            if adjust_ is not None:
                adjust_(finite.to(ls.loss_scale.device))


def plan_for(inner) -> FusedPlan | None:
    """The :class:`FusedPlan` for ``inner`` (a ``GradientTransformation``), or None when the
    kernels cannot run it: only ``sgd``/``adam``/``adamw`` (float ``lr`` or schedule), alone or
    as ``chain(clip_by_global_norm(max_norm), opt)``, are fused."""
    fused = getattr(inner, "fused", None)
    if fused is None:
        return None
    chained = isinstance(fused, tuple) and len(fused) == 2 and fused[0] == "chain"
    specs = tuple(fused[1]) if chained else (fused,)
    parts = [_spec_parts(s) for s in specs]
    if any(p is None for p in parts) or not 1 <= len(parts) <= 2:
        return None
    kind, hparams = parts[-1]
    if kind not in _OPTIMIZERS:
        return None
    lr = hparams.get("lr")
    if not callable(lr) and (isinstance(lr, bool) or not isinstance(lr, (int, float))):
        return None
    max_norm = None
    if len(parts) == 2:
        if parts[0][0] != "clip_by_global_norm":
            return None
        max_norm = float(parts[0][1]["max_norm"])
    return FusedPlan(kind, hparams, max_norm)
