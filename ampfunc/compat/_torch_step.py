"""A ``torch.optim`` optimizer's own step, fused: the apex facades' master weights
(:class:`~ampfunc.compat.apex.fp16_utils.FP16_Optimizer`, ``amp`` O2).

apex's FP16_Optimizer owns a torch optimizer and decides the skip on the host (its API prints
and returns early), so its step is not the engine's ``step_``: the facade checks the gradients
and updates its scale itself, then hands :func:`torch_step_` the lists below. It runs the torch
optimizer's update through the fused plan (:mod:`ampfunc.fused`) on the optimizer's OWN state
tensors (so its state_dict, LR schedulers and a later torch step keep working), or says it cannot.
Only the facades use this path; it lives beside them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch.optim import optimizer as _torch_optimizer

from ampfunc.fused import KERNEL_GRAD_DTYPES, FusedPlan, plan_for_torch_group

__all__ = ["torch_step_", "torch_step_supported"]

_MODEL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


class _Call(NamedTuple):
    plan: FusedPlan
    params: list
    grads: list
    model: Optional[list]
    slots: list
    step: float
    grad_scale: Any


def _plain_torch_step(optimizer, instead_of=None) -> bool:
    """Whether the step the caller replaces (``instead_of``, else ``optimizer.step``) is torch's
    own, with no hooks: besides torch's bound step, only an LR scheduler's counting wrapper of it."""
    if instead_of is None:
        own = optimizer.__dict__.get("step")
    else:  # a facade that patched optimizer.step names the step it wrapped
        bound = getattr(instead_of, "__self__", None) is optimizer and \
            getattr(instead_of, "__func__", None) is type(optimizer).step
        own = None if bound else instead_of
    if own is not None and not (getattr(own, "_wrapped_by_lr_sched", False)
                                and getattr(own, "__wrapped__", type(optimizer).step) is type(optimizer).step):
        return False  # a scheduler's wrapper counts only around torch's step, not around a patch
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        return False
    # torch's global hooks (register_optimizer_step_pre_hook / _post_hook) run for every optimizer.
    return not any(getattr(_torch_optimizer, name, None)
                   for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"))


def torch_step_supported(optimizer, *, instead_of=None) -> bool:
    """Whether :func:`torch_step_` may run ``optimizer``'s step (its class, flags and hooks; the
    state is judged when stepping; ``instead_of`` as there). Cost: a few dictionary reads per
    param group."""
    return _plain_torch_step(optimizer, instead_of) and all(
        plan_for_torch_group(optimizer, g) is not None for g in optimizer.param_groups)


def _fp32_like(t, p) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.layout == torch.strided and \
        t.device == p.device and t.shape == p.shape and not t.requires_grad


def _torch_slots(plan: FusedPlan, state, p):
    """``(slots, step, new_state)`` for param ``p`` with torch state ``state`` (None: none yet):
    the kernel's state tensors, the step count the kernel must see, and the state torch would
    create lazily (None when it exists); None when the state is not what the kernels take."""
    if plan.kind == "sgd":
        if plan.hparams["momentum"] == 0:
            return [], 0.0, None
        buf = state.get("momentum_buffer") if state else None
        if buf is None:  # torch's first step copies the gradient: the kernel does so at step 0
            buf = torch.empty_like(p, memory_format=torch.preserve_format)
            return [buf], 0.0, {"momentum_buffer": buf}
        return ([buf], 1.0, None) if _fp32_like(buf, p) else None
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if plan.hparams["amsgrad"] else ())
    if not state:  # torch's lazy init: zero moments, a CPU fp32 step count at 0
        if torch.get_default_dtype() != torch.float32:  # torch's step count would be float64
            return None
        new = {"step": torch.tensor(0.0, dtype=torch.float32)}
        new.update((n, torch.zeros_like(p, memory_format=torch.preserve_format)) for n in names)
        return [new[n] for n in names], new["step"], new
    step = state.get("step")
    if not (isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == torch.float32
            and step.device.type == "cpu" and not step.requires_grad):
        return None
    slots = [state.get(n) for n in names]
    return (slots, step, None) if all(_fp32_like(s, p) for s in slots) else None


def torch_step_(optimizer, lists: list, *, instead_of=None) -> bool:
    """One ``optimizer.step()`` of a ``torch.optim`` SGD/Adam/AdamW, fused, on its own state.

    ``lists[i]`` holds, for ``optimizer.param_groups[i]``, segments ``(params, grads,
    model_params, grad_scale)``: the fp32 params the optimizer owns (masters), their gradients
    (fp32/fp16/bf16, scaled: the kernel multiplies them by ``grad_scale(device)``, a 0-d fp32
    tensor; ``grad_scale`` None means 1), and the low-precision model copies that receive the
    new params (or None). The params of a group missing from its segments must have no
    gradient. Each (group, segment, device, step count) is one kernel pass that reads the
    gradient once and writes the param, its state and the model copy: torch's single-tensor
    update bit for bit on CPU, with torch's lazy state (zero moments, ``step`` tensors on the
    CPU, SGD's momentum buffer from the first gradient) and per-param ``step`` counts advanced.
    The caller decided the step is applied (the facade's overflow check), so nothing is skipped.
    ``instead_of`` is the step the caller would run otherwise, when not ``optimizer.step`` (a
    facade that patched ``optimizer.step`` passes the step it wrapped): it must be torch's own
    step of ``optimizer``, or an LR scheduler's wrapper of it (then ``_opt_called`` is recorded
    as that wrapper would).

    Returns False, having written nothing, when the kernels cannot reproduce the torch step
    (see :func:`plan_for_torch_group`; hooks; sparse or non-float gradients; state of other
    dtypes or devices; a param listed twice): the caller runs ``optimizer.step()`` instead.

    Example:
      >>> ok = torch_step_(opt, [[(masters, fp16_grads, fp16_params, lambda dev: inv_scale)]])

    Cost: the kernel passes plus one stack of the step counts per segment (a CPU read; no
    device sync), Python work per param.
    """
    if len(lists) != len(optimizer.param_groups) or not _plain_torch_step(optimizer, instead_of):
        return False
    calls, created, counts = [], [], []
    state_of = optimizer.state
    for group, segments in zip(optimizer.param_groups, lists):
        plan = plan_for_torch_group(optimizer, group)
        if plan is None:
            return False
        listed = set()
        for params, grads, model, grad_scale in segments:
            slots_of, fixed, counted = [], {}, []
            for i, p in enumerate(params):
                g, m = grads[i], (model[i] if model is not None else None)
                if id(p) in listed or not (
                        isinstance(g, torch.Tensor) and g.layout == torch.strided and g.dtype in KERNEL_GRAD_DTYPES
                        and p.dtype == torch.float32 and p.layout == torch.strided and g.device == p.device
                        and g.shape == p.shape):
                    return False
                listed.add(id(p))
                if m is not None and not (m.dtype in _MODEL_DTYPES and m.layout == torch.strided
                                          and m.device == p.device and m.shape == p.shape):
                    return False
                got = _torch_slots(plan, state_of.get(p), p)
                if got is None:
                    return False
                slots, step, new = got
                slots_of.append(slots)
                if new is not None:
                    created.append((p, new))
                if isinstance(step, torch.Tensor):
                    counted.append(i)
                    counts.append(step)
                else:
                    fixed.setdefault((p.device, step), []).append(i)
            if counted:  # Adam's per-param counts, read in one go; unequal counts: separate passes
                values = torch.stack(counts[len(counts) - len(counted):]).tolist()
                for i, v in zip(counted, values):
                    fixed.setdefault((params[i].device, v), []).append(i)
            for (_, v), idx in fixed.items():
                calls.append(_Call(plan, [params[i] for i in idx], [grads[i] for i in idx],
                                   None if model is None else [model[i] for i in idx],
                                   [list(k) for k in zip(*[slots_of[i] for i in idx])], float(v), grad_scale))
        if any(p.grad is not None and id(p) not in listed for p in group["params"]):
            return False  # torch would step a param the caller did not list
    return _run_torch_calls(optimizer, calls, created, counts, optimizer.step if instead_of is None else instead_of)


def _run_torch_calls(optimizer, calls: list, created: list, counts: list, replaced) -> bool:
    state_of = optimizer.state
    before = [(p, dict(state_of[p]) if p in state_of else None) for p, _ in created]
    for p, new in created:
        state_of[p].update(new)
    with torch.no_grad():
        for k, c in enumerate(calls):
            dev = c.params[0].device
            step = torch.full((), c.step, dtype=torch.float32, device=dev)
            finite = torch.ones((), dtype=torch.bool, device=dev)
            gs = c.grad_scale(dev) if c.grad_scale is not None else torch.ones((), dtype=torch.float32, device=dev)
            try:
                c.plan.kernel_step_(c.params, c.grads, c.model, c.slots, step, gs, finite)
            except (RuntimeError, ValueError, TypeError):
                if k:  # earlier passes wrote: the step cannot be handed back
                    raise
                for p, prev in before:  # the kernels validate before writing: nothing was written
                    if prev is None:
                        del state_of[p]
                    else:
                        state_of[p] = prev
                return False
        if counts:
            torch._foreach_add_(counts, 1.0)  # torch's `step_t += 1`, per param
    if hasattr(replaced, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True  # what the scheduler's wrapper of step() records
    return True
