"""The fused plan: how the kernels run ``[clip_by_global_norm] -> optimizer`` in two passes.

:func:`plan_for` reads the kernel registry of :mod:`ampfunc.transform`: an inner transform
registered as a kind a fused optimizer serves (``sgd``, ``adam``, ``adamw``, ``lion``...: the
``kinds`` of the specs in :mod:`ampfunc.ops.optimizers`; a float learning rate or a schedule,
evaluated on the device), alone or after ``clip_by_global_norm`` in a ``chain`` /
``named_chain``, gets a :class:`FusedPlan`; anything else gets ``None`` and the engine
(:mod:`ampfunc.engine`) runs its generic path. A plan works on leaf lists that the engine has
flattened, lined up and validated; it does, on the device and without a host sync:

1. one read-only pass over the gradients (:func:`ampfunc.ops.check`): the finite flag and the
   sum of squares (the global norm) together;
2. a few 0-d ops: ``grad_scale = inv_scale * clip_coef`` with torch's ``clip_grad_norm_``
   coefficient ``min(1, max_norm / (norm + 1e-6))`` of the unscaled gradients;
3. one fused optimizer pass (``ampfunc.ops.<optimizer>_step_``, e.g.
   :func:`ampfunc.ops.adam_step_`, or the out-of-place ``<optimizer>_step`` for the pure step)
   that reads each gradient, multiplies it by ``grad_scale``, updates the fp32
   params (the master when there is one) and the moments, and writes the fp16/bf16 model
   params; it writes nothing (step counter included) when the flag says the gradients were
   not finite.

Traffic per fp32 element for AdamW without master weights: read g (check), read g, p, m, v and
write p, m, v -- 32 bytes, against 28 for the optimizer alone and about 60 for
``GradScaler.unscale_`` + ``clip_grad_norm_`` + ``AdamW(fused=True)``.
"""

from __future__ import annotations

from typing import Any

import torch

from ampfunc import ops
from ampfunc.dist import agree_finite
from ampfunc.optim import adam, adamw, clip_by_global_norm, sgd
from ampfunc.optim.base import lr_at
from ampfunc.shards import active as active_sharding
from ampfunc.transform import ChainSpec, FusedSpec, chain, kernel_spec, named_chain

__all__ = ["FusedPlan", "plan_for", "plan_for_torch_group", "KERNEL_GRAD_DTYPES"]


def _optimizer_of(kind: str):
    """The fused optimizer's spec (:mod:`ampfunc.ops._spec`) serving transforms of ``kind``, or None."""
    return next((o for o in ops._spec.OPTIMIZERS.values() if kind in o.kinds), None)


# What the optimizer kernels read as gradients. float64 gradients take the generic path (the
# kernels refuse them), so both paths give them the same numbers.
KERNEL_GRAD_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


class FusedPlan:
    """How to run one mixed-precision step of ``[clip_by_global_norm] -> optimizer`` fused.

    ``kind``: the registered kind (``"sgd"``, ``"adam"``, ``"adamw"``, ``"lion"``...), served by
    the fused optimizer ``optimizer`` (its spec, :mod:`ampfunc.ops._spec`); ``hparams``: the
    optimizer's registered settings (complete: the plan keeps no defaults of its own); ``max_norm``: the clipping
    threshold or None; ``chained``: the inner state is a chain's (a tuple, or a dict keyed by
    ``names`` for ``named_chain``) whose last entry is the optimizer's.
    """

    __slots__ = ("kind", "hparams", "max_norm", "chained", "names", "optimizer", "_hypers")

    def __init__(self, kind: str, hparams: dict, max_norm: float | None = None, *, chained: bool = False,
                 names: tuple | None = None):
        self.kind = kind
        self.optimizer = _optimizer_of(kind)
        if self.optimizer is None:
            raise ValueError(f"FusedPlan: no fused optimizer serves {kind!r}")
        self._hypers = self.optimizer.hypers_of(kind, hparams)
        self.hparams = dict(hparams)
        self.max_norm = max_norm
        self.chained = chained or names is not None
        self.names = names

    def __repr__(self) -> str:
        clip = f"clip_by_global_norm({self.max_norm}) -> " if self.max_norm is not None else ""
        return f"FusedPlan({clip}{self.kind}, {self.hparams})"

    # -- the optimizer's state inside the inner state -----------------------------------------

    def opt_state(self, inner_state: Any):
        """The optimizer's state inside ``inner_state`` (the inner transform's state), or None
        when it does not have the layout the kernels expect."""
        opt = inner_state
        if self.chained:
            if self.names is not None:
                opt = inner_state.get(self.names[-1]) if isinstance(inner_state, dict) else None
            else:
                opt = inner_state[-1] if type(inner_state) is tuple and inner_state else None
        opt_spec = self.optimizer
        if tuple(getattr(opt, "_fields", ())) != ("step",) + opt_spec.tree_state:
            return None
        if not isinstance(opt.step, torch.Tensor) or opt.step.dtype != torch.float32 or opt.step.dim() != 0:
            return None
        for field, state in zip(opt_spec.tree_state, opt_spec.state):
            if self._uses(state) and getattr(opt, field) is None:
                return None
        return opt

    def _uses(self, state) -> bool:
        return state.when is None or bool(self._hypers[state.when])

    def slot_trees(self, opt: Any) -> list:
        """The per-parameter state trees of ``opt`` (from :meth:`opt_state`) that the kernel reads
        and writes, in kernel order: the optimizer's state lists that its settings use (SGD
        ``[momentum_buffer]``, none without momentum; Adam ``[exp_avg, exp_avg_sq]`` plus
        ``max_exp_avg_sq`` with amsgrad; Lion ``[mu]``)."""
        return [getattr(opt, f) for f in self.slot_names()]

    def slot_names(self) -> tuple:
        o = self.optimizer
        return tuple(f for f, s in zip(o.tree_state, o.state) if self._uses(s))

    def _slot_args(self, slots: list) -> list:
        """The kernel's state arguments: each state list, None for the ones the settings leave unused."""
        it = iter(slots)
        return [next(it) if self._uses(s) else None for s in self.optimizer.state]

    def _new_slots(self, new_state: tuple) -> list:
        return [x for x, s in zip(new_state, self.optimizer.state) if self._uses(s)]

    def replace_opt_state(self, inner_state: Any, new_opt: Any, copy_others) -> Any:
        """``inner_state`` with the optimizer's state replaced by ``new_opt``; the other entries
        of a chain's state (the clip's empty state) pass through ``copy_others``."""
        if not self.chained:
            return new_opt
        if self.names is not None:
            last = self.names[-1]
            return {k: (new_opt if k == last else copy_others(v)) for k, v in inner_state.items()}
        return tuple(copy_others(s) for s in inner_state[:-1]) + (new_opt,)

    # -- the passes -----------------------------------------------------------------------------

    def _prologue(self, grads: list, opt: Any, loss_scale: Any, group, on_check=None):
        """``(finite, grad_scale, lr)``: one read-only pass over ``grads`` and a few 0-d ops.
        ``on_check(finite, leaf_nonfinite)`` gets this rank's flag and the per-leaf flags of the
        same pass (device tensors). Call under ``torch.no_grad()``."""
        dev = opt.step.device
        inv_scale = loss_scale.inv_scale_on(dev)
        # With clipping, the robust norm of the unscaled products (the generic clip's number:
        # no fp32 overflow while every element is finite); else the plain check pass.
        checked = ops.check_norm(grads, inv_scale, per_leaf=on_check is not None) if self.max_norm is not None \
            else ops.check(grads, per_leaf=on_check is not None)
        finite, norm_or_sumsq = checked[0], checked[1]
        if on_check is not None:
            on_check(finite, checked[2])
        if group is not None:
            finite = agree_finite(finite, group)
        sharding = active_sharding()
        if sharding is not None:
            # Local shards of DTensor params: the flag over the mesh, the norm of the whole
            # tensors, in one small all-reduce (ampfunc.shards).
            finite, norm = sharding.reduce(finite, grads if self.max_norm is not None else None, inv_scale,
                                           norm_or_sumsq if self.max_norm is not None else None)
            if self.max_norm is not None:
                norm_or_sumsq = norm
        # NaN when the scale is outside SCALE_RANGE (set by hand): skip rather than write NaN.
        finite = finite & ~inv_scale.isnan()
        grad_scale = inv_scale
        if self.max_norm is not None:
            # clip_grad_norm_'s coefficient, of the unscaled gradients' norm.
            norm = norm_or_sumsq
            grad_scale = inv_scale * (self.max_norm / (norm + 1e-6)).clamp(max=1.0)
        return finite, grad_scale, self._lr(opt)

    def _lr(self, opt: Any):
        """The learning rate of this step: the number, or a schedule of the applied-step count
        evaluated on the device (a 0-d tensor)."""
        lr = self.hparams["lr"]
        if callable(lr):
            lr = lr_at(lr, opt.step)
            lr = lr.to(opt.step.device, torch.float32) if isinstance(lr, torch.Tensor) else lr
        return lr

    def _kwargs(self, lr) -> dict:
        return dict(lr=lr, **self._hypers)

    def _check_in_step(self, group, on_check) -> bool:
        """Whether the step's op can take its own skip decision (``*_step_checked*``): nothing
        runs between the check and the step (no norm to take, no flag to agree on across
        ranks or a mesh, no hook to hand the flags to)."""
        return self.max_norm is None and group is None and on_check is None and active_sharding() is None

    def _op(self, suffix: str):
        return getattr(ops, self.optimizer.name + suffix)

    def run_(self, ref: list, grads: list, model: list | None, slots: list, opt: Any, loss_scale: Any, *,
             group=None, on_check=None) -> torch.Tensor:
        """The in-place step on validated leaf lists: ``ref`` (fp32 params, or the master),
        ``grads``, ``model`` (the low-precision params with a master, else None) and ``slots``
        (:meth:`slot_trees`' leaves) are written, ``opt.step`` advanced; returns ``finite``.
        The loss scale is not touched (the engine updates it)."""
        with torch.no_grad():
            if self._check_in_step(group, on_check):
                # The check and the step in one call (ops.*_step_checked_): the same two passes,
                # the lists described once.
                inv_scale, lr = loss_scale.inv_scale_on(opt.step.device), self._lr(opt)
                return self._op("_step_checked_")(ref, grads, *self._slot_args(slots), model, opt.step, inv_scale,
                                                  **self._kwargs(lr))
            finite, grad_scale, lr = self._prologue(grads, opt, loss_scale, group, on_check)
            self._op("_step_")(ref, grads, *self._slot_args(slots), model, opt.step, grad_scale, finite,
                               **self._kwargs(lr))
        return finite

    def run(self, ref: list, grads: list, model: list | None, slots: list, opt: Any, loss_scale: Any, *,
            group=None, on_check=None):
        """The pure :meth:`run_`: nothing given is written. Returns ``(new_ref, new_model,
        new_slots, new_step, finite)`` (``new_model`` None without ``model``); on a skipped
        step the outputs are copies of the inputs. Same numbers as :meth:`run_` bit for bit."""
        with torch.no_grad():
            if self._check_in_step(group, on_check):
                # Without a norm to take first, the check folds into the out-of-place pass (its
                # inputs survive it): ops.*_step_checked, the same numbers as check + step.
                inv_scale, lr = loss_scale.inv_scale_on(opt.step.device), self._lr(opt)
                new_ref, *new_state, new_model, new_step, finite = self._op("_step_checked")(
                    ref, grads, *self._slot_args(slots), model, opt.step, inv_scale, **self._kwargs(lr))
                return new_ref, (new_model if model is not None else None), self._new_slots(new_state), new_step, \
                    finite
            finite, grad_scale, lr = self._prologue(grads, opt, loss_scale, group, on_check)
            new_ref, *new_state, new_model, new_step = self._op("_step")(
                ref, grads, *self._slot_args(slots), model, opt.step, grad_scale, finite, **self._kwargs(lr))
            new_slots = self._new_slots(new_state)
        return new_ref, (new_model if model is not None else None), new_slots, new_step, finite

    def kernel_step_(self, ref: list, grads: list, model: list | None, slots: list, step: torch.Tensor,
                     grad_scale: torch.Tensor, finite: torch.Tensor) -> None:
        """The optimizer pass alone, in place, for a caller that did its own check: ``ref``,
        ``slots``, ``model`` and ``step`` are written (nothing when ``finite`` is false); the
        plan's ``lr`` must be a number. Serves :func:`ampfunc.compat._torch_step.torch_step_` (a torch
        optimizer's param group, whose overflow the apex facade decides on the host).
        Cost: one kernel pass; no host sync."""
        lr = self.hparams["lr"]
        with torch.no_grad():
            self._op("_step_")(ref, grads, *self._slot_args(slots), model, step, grad_scale, finite,
                               **self._kwargs(lr))


def fp32_twin(plan: FusedPlan):
    """The transform ``plan`` runs, with its moments kept in fp32: the kind, settings, clipping
    and chain layout of the ``moments="bf16"``/``"q8"`` optimizer the plan was made for, so that
    optimizer's state, decoded (:func:`ampfunc.lowmem.decode_state`), is the twin's state. The
    engine of the low-memory settings steps the twin on the decoded numbers (fused, or on its
    generic path). Cost: builds a transform; called once per engine."""
    hparams = {k: v for k, v in plan.hparams.items() if k != "moments"}
    if "betas" in hparams:  # the registered pair; the constructors take b1, b2
        hparams["b1"], hparams["b2"] = hparams.pop("betas")
    opt = {"adam": adam, "adamw": adamw, "sgd": sgd}[plan.kind](**hparams)  # the optimizers that take moments=
    if not plan.chained:
        return opt
    parts = ([clip_by_global_norm(plan.max_norm)] if plan.max_norm is not None else []) + [opt]
    if plan.names is not None:
        return named_chain(*zip(plan.names, parts))
    return chain(*parts)


def plan_for(inner) -> FusedPlan | None:
    """The :class:`FusedPlan` for ``inner`` (a ``GradientTransformation``), or None when the
    kernels cannot run it: only a registered kind of a fused optimizer (float ``lr`` or schedule),
    alone or as ``chain(clip_by_global_norm(max_norm), opt)`` (or its ``named_chain``), are fused.
    Cost: a dictionary lookup; call once per transform."""
    spec = kernel_spec(inner)
    if spec is None:
        return None
    chained = isinstance(spec, ChainSpec)
    specs = spec.specs if chained else (spec,)
    names = spec.names if chained else None
    if not 1 <= len(specs) <= 2 or not all(isinstance(s, FusedSpec) for s in specs):
        return None
    kind, hparams = specs[-1]
    if _optimizer_of(kind) is None:
        return None
    lr = hparams.get("lr")
    if not callable(lr) and (isinstance(lr, bool) or not isinstance(lr, (int, float))):
        return None
    max_norm = None
    if len(specs) == 2:
        if specs[0].kind != "clip_by_global_norm":
            return None
        max_norm = float(specs[0].hparams["max_norm"])
    return FusedPlan(kind, hparams, max_norm, chained=chained, names=names)


# -- torch.optim param groups (the apex facades' master weights) -----------------------------------

_TORCH_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def plan_for_torch_group(optimizer, group: dict) -> FusedPlan | None:
    """The :class:`FusedPlan` that runs one param group of ``optimizer`` with the numbers of
    torch's own single-tensor step, or None when the kernels cannot.

    Served: an optimizer whose class is exactly ``torch.optim.SGD``, ``Adam`` or ``AdamW``, with
    number hyper-parameters (``lr``, ``weight_decay``, ``momentum``, ``dampening``, ``betas``,
    ``eps``; a tensor ``lr`` or ``betas`` rounds differently in torch), any ``nesterov``,
    ``amsgrad``, ``maximize``, ``foreach`` and ``decoupled_weight_decay``, and none of
    ``fused``, ``capturable``, ``differentiable`` (torch's fused kernels round differently;
    capturable keeps the step counts on the device; differentiable steps are autograd
    graphs). The group is read when called: call it every step (an LR scheduler changes
    ``group['lr']``). Cost: a few dictionary reads; no host sync.
    """
    kind = _TORCH_KINDS.get(type(optimizer))
    if kind is None or group.get("fused") or group.get("capturable") or group.get("differentiable"):
        return None
    lr, wd, maximize = group.get("lr"), group.get("weight_decay", 0), group.get("maximize", False)
    if not (_number(lr) and _number(wd) and isinstance(maximize, bool)):
        return None
    if kind == "sgd":
        momentum, dampening, nesterov = group.get("momentum", 0), group.get("dampening", 0), group.get("nesterov")
        if not (_number(momentum) and _number(dampening) and isinstance(nesterov, bool)):
            return None
        return FusedPlan("sgd", dict(lr=float(lr), weight_decay=float(wd), momentum=float(momentum),
                                     dampening=float(dampening), nesterov=nesterov, maximize=maximize))
    betas, eps, amsgrad = group.get("betas"), group.get("eps"), group.get("amsgrad", False)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(map(_number, betas)) and _number(eps)
            and isinstance(amsgrad, bool)):
        return None
    decoupled = group.get("decoupled_weight_decay", kind == "adamw")
    if not isinstance(decoupled, bool):
        return None
    return FusedPlan("adamw" if decoupled else "adam",
                     dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                          weight_decay=float(wd), amsgrad=amsgrad, maximize=maximize))
