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

:meth:`FusedPlan.step_` updates the tensors of ``params`` and ``state`` in place and returns
them (donated, as JAX's ``donate_argnums``). :meth:`FusedPlan.step`, behind the pure
``mixed_precision(...).step`` and ``.update``, makes the same passes with the out-of-place
optimizer ops (:func:`ampfunc.ops.adam_step` / :func:`~ampfunc.ops.sgd_step`): the kernel reads
the old params and moments and writes new tensors, so the pure step moves the same bytes as the
in-place one (plus the allocation of its outputs) instead of cloning everything first, and
both give the same numbers bit for bit.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ampfunc import ops
from ampfunc.tree import (
    PyTree,
    aligned_leaves,
    check_same_structure,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

__all__ = ["FusedPlan", "plan_for"]

_OPTIMIZERS = ("sgd", "adam", "adamw")
_dtype_of = operator.attrgetter("dtype")
_MODEL_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


def _dtypes(leaves: list) -> set:
    # map(attrgetter) runs at C speed on 10,000 leaves; dynamo cannot trace attrgetter, so a
    # torch.compile trace takes the comprehension.
    if ops._is_compiling():
        return {t.dtype for t in leaves}
    return set(map(_dtype_of, leaves))


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def _cloned(tree):
    """A copy of ``tree`` with every tensor cloned (None stays None)."""
    return None if tree is None else tree_map(_clone, tree)


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
        if ref and (ref[0].device != dev or _dtypes(ref) != {torch.float32}):
            return False
        if master is not None:
            model = params
            if model and (model[0].device != dev or not _dtypes(model) <= _MODEL_DTYPES):
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

    def _prologue(self, grads: list, ref: list, state: Any, group):
        """What both steps compute before the optimizer pass: ``(opt, finite, grad_scale, lr)``.
        One read-only pass over ``grads`` and a few 0-d ops; call under ``torch.no_grad()``."""
        opt = self._opt_state(state.inner)
        if len(grads) != len(ref):
            raise ValueError(f"fused step: grads has {len(grads)} leaves but the params have {len(ref)}")
        dev = opt.step.device
        finite, sumsq = ops.check(grads)
        if group is not None:
            from ampfunc.mixed import agree_finite

            finite = agree_finite(finite, group)
        inv_scale = state.loss_scale.inv_scale_on(dev)
        grad_scale = inv_scale
        if self.max_norm is not None:
            # clip_grad_norm_'s coefficient, of the unscaled gradients' norm.
            norm = sumsq.sqrt() * inv_scale
            grad_scale = inv_scale * (self.max_norm / (norm + 1e-6)).clamp(max=1.0)
        lr = self.hparams["lr"]
        if callable(lr):  # a schedule of the applied-step count, evaluated on the device
            from ampfunc.optim.base import lr_at

            lr = lr_at(lr, opt.step)
            lr = lr.to(dev, torch.float32) if isinstance(lr, torch.Tensor) else lr
        return opt, finite, grad_scale, lr

    def _sgd_kwargs(self, lr) -> dict:
        h = self.hparams
        return dict(lr=lr, weight_decay=h.get("weight_decay", 0.0), momentum=h.get("momentum", 0.0),
                    dampening=h.get("dampening", 0.0), nesterov=h.get("nesterov", False),
                    maximize=h.get("maximize", False))

    def _adam_kwargs(self, lr) -> dict:
        h = self.hparams
        beta1, beta2 = h.get("betas", (0.9, 0.999))
        return dict(lr=lr, beta1=beta1, beta2=beta2, eps=h.get("eps", 1e-8), weight_decay=h.get("weight_decay", 0.0),
                    amsgrad=bool(h.get("amsgrad", False)), decoupled_weight_decay=self.kind == "adamw",
                    maximize=h.get("maximize", False))

    def step_leaves_(self, params: list, grads: list, master: list | None, slots: list, state: Any, *,
                     group=None) -> None:
        """:meth:`step_` on already-flattened leaves: ``params``, ``grads``, ``master`` (or None)
        and ``slots`` (the leaves of :meth:`slot_trees`), all in one consistent order."""
        ref = master if master is not None else params
        model = params if master is not None else None
        ls = state.loss_scale
        with torch.no_grad():
            opt, finite, grad_scale, lr = self._prologue(grads, ref, state, group)
            if self.kind == "sgd":
                ops.sgd_step_(ref, grads, slots[0] if slots else None, model, opt.step, grad_scale, finite,
                              **self._sgd_kwargs(lr))
            else:
                kw = self._adam_kwargs(lr)
                ops.adam_step_(ref, grads, slots[0], slots[1], slots[2] if kw["amsgrad"] else None, model, opt.step,
                               grad_scale, finite, **kw)
            adjust_ = getattr(ls, "adjust_", None)
            if adjust_ is not None:
                adjust_(finite.to(ls.loss_scale.device))

    def step_leaves(self, params: list, grads: list, master: list | None, slots: list, state: Any, *,
                    group=None):
        """The pure :meth:`step_leaves_`: nothing given is written. Returns ``(new_ref,
        new_model, new_slots, new_step, finite)``: the new fp32 params (the new master when
        ``master`` is given), the new params in each param's dtype (None without a master), the
        new slot leaves (in :meth:`slot_trees` order), the new 0-d step count and the 0-d finite
        flag. One read-only check pass, then one out-of-place optimizer pass into new tensors;
        on a skipped step the outputs are copies of the inputs."""
        ref = master if master is not None else params
        model = params if master is not None else None
        with torch.no_grad():
            opt, finite, grad_scale, lr = self._prologue(grads, ref, state, group)
            if self.kind == "sgd":
                new_ref, new_buf, new_model, new_step = ops.sgd_step(
                    ref, grads, slots[0] if slots else None, model, opt.step, grad_scale, finite,
                    **self._sgd_kwargs(lr))
                new_slots = [new_buf] if slots else []
            else:
                kw = self._adam_kwargs(lr)
                new_ref, m1, m2, vmax, new_model, new_step = ops.adam_step(
                    ref, grads, slots[0], slots[1], slots[2] if kw["amsgrad"] else None, model, opt.step, grad_scale,
                    finite, **kw)
                new_slots = [m1, m2, vmax] if kw["amsgrad"] else [m1, m2]
        return new_ref, (new_model if master is not None else None), new_slots, new_step, finite

    def step(self, params: PyTree, grads: PyTree, state: Any, *, group=None):
        """The pure :meth:`step_`: ``(new_params, new_state)``, new tensors throughout, the
        inputs untouched; the numbers are those of :meth:`step_` bit for bit. Returns None when
        the fused kernels cannot run these trees (:meth:`supports` is false), so the caller can
        take the generic path.

        Costs one read-only check pass and one out-of-place optimizer pass (reads g, p, m, v;
        writes new p, m, v and the new model copy) plus the allocation of the outputs; the
        tensors the kernel does not write (the loss scale's, a chain's other states) are cloned
        (0-d or empty in practice). Leaves are lined up as :meth:`step_`'s caller does it: plain
        dicts sharing one key order by their values, anything else by optree's flatten, and
        the output trees are rebuilt in the inputs' structures.
        """
        slot_trees = self.slot_trees(state)
        if slot_trees is None:
            return None
        master = state.master
        masters = [master] if master is not None else []
        leaves = aligned_leaves([params, grads] + masters + slot_trees)
        if leaves is not None:
            keys = list(params)

            def rebuild(_i, new):  # every tree has the keys of params, in that order
                return dict(zip(keys, new))

            p, g, m, slots = leaves[0], leaves[1], (leaves[2] if masters else None), leaves[2 + len(masters):]
        else:
            p, p_spec = tree_flatten(params)
            g, g_spec = tree_flatten(grads)
            if g_spec != p_spec:
                check_same_structure(grads, params, "grads", "params")
            m, m_spec = tree_flatten(master) if master is not None else (None, None)
            slot_flat = [tree_flatten(t) for t in slot_trees]
            slots = [leaves for leaves, _ in slot_flat]
            specs = [p_spec, m_spec] + [spec for _, spec in slot_flat]

            def rebuild(i, new):  # i: 0 params, 1 master, 2 + k slot tree k
                return tree_unflatten(specs[i], new)

        if not self.supports_leaves(p, m, state):
            return None
        new_ref, new_model, new_slots, new_step, finite = self.step_leaves(p, g, m, slots, state, group=group)
        if master is not None:
            new_params, new_master = rebuild(0, new_model), rebuild(1, new_ref)
        else:
            new_params, new_master = rebuild(0, new_ref), None
        new_slot_trees = [rebuild(2 + k, leaves) for k, leaves in enumerate(new_slots)]

        opt = self._opt_state(state.inner)
        names = ["momentum_buffer"] if self.kind == "sgd" else ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        written = dict(zip(names, new_slot_trees), step=new_step)
        new_opt = opt._replace(**{f: written[f] if f in written else _cloned(getattr(opt, f)) for f in opt._fields})
        inner = state.inner
        new_inner = new_opt if inner is opt else tuple(_cloned(s) for s in inner[:-1]) + (new_opt,)
        ls = state.loss_scale
        new_ls = ls.adjust(finite.to(ls.loss_scale.device))
        if new_ls is ls:  # static and no-op scales return themselves; the result owns its tensors
            new_ls = _cloned(ls)
        return new_params, state._replace(master=new_master, inner=new_inner, loss_scale=new_ls)


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
