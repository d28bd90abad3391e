"""The one door to the tensor work of mixed precision.

Every primitive in ampfunc calls these functions for its arithmetic over lists of tensors. Each
is a ``torch.library`` custom op in the ``ampfunc`` namespace (``torch.ops.ampfunc.*``) whose
schema names what it mutates, with a fake kernel, so ``torch.compile(fullgraph=True)`` traces it
and CUDA graphs capture it. Each op has up to three implementations:

* the compiled CPU kernels of ``ext/`` (one parallel pass over the concatenation of the list,
  whatever the number of tensors), built on first use (:mod:`ampfunc._build`);
* the compiled CUDA kernels (multi-tensor apply over raw pointers) when built with CUDA;
* a plain-torch reference (``_ref_*`` here), built from ``torch._foreach_*`` and
  ``torch._amp_foreach_non_finite_check_and_unscale_`` so that even the reference is one
  launch per (device, dtype) group rather than one per leaf. It serves whatever the compiled
  kernels do not (every op under ``AMPFUNC_DISABLE_EXT=1`` or without a compiler).

:func:`backend` says which is active. Lists may mix float dtypes; the compiled kernels take one
device per call. Non-contiguous tensors are handled (through a contiguous copy, written back for
the in-place ops). No function here reads a tensor value back to the host.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "backend",
    "load",
    "all_finite",
    "check",
    "unscale",
    "unscale_",
    "sgd_step_",
    "adam_step_",
    "sgd_step",
    "adam_step",
    "update_scale",
    "update_scale_",
]


def _flag_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Loading the compiled kernels
# ----------------------------------------------------------------------------------------------

_BACKEND: list = [None, None]  # [backend name, why the compiled kernels are missing]


def load() -> str:
    """Builds (first time only, into a cache) and loads the compiled kernels; returns
    :func:`backend`. Called by the first op; call it yourself to pay the build up front."""
    if _BACKEND[0] is None:
        from ampfunc import _build

        _BACKEND[0], _BACKEND[1] = _build.load()
    return _BACKEND[0]


def backend() -> str:
    """Which implementation serves the ops: ``"cpu+cuda"`` or ``"cpu"`` (compiled kernels; CUDA
    tensors use the reference under ``"cpu"``) or ``"reference"`` (plain torch everywhere)."""
    return load()


def backend_reason() -> str | None:
    """Why the compiled kernels are (partly) missing, or None."""
    load()
    return _BACKEND[1]


def _is_compiling() -> bool:
    fn = getattr(torch.compiler, "is_compiling", None)
    return bool(fn()) if fn is not None else False


def _ensure() -> None:
    # The build must never start inside a torch.compile trace: there the ops are traced through
    # their fake kernels, and whichever kernel is registered at run time serves the call.
    if _BACKEND[0] is None and not _is_compiling():
        load()


def _as_list(xs) -> list:
    return [] if xs is None else list(xs)


def _split_lr(lr):
    """``(float lr, None)`` for a number, ``(0.0, 0-d fp32 tensor)`` for a tensor."""
    if isinstance(lr, torch.Tensor):
        return 0.0, lr.reshape(()).to(torch.float32)
    return float(lr), None


# ----------------------------------------------------------------------------------------------
# Read-only checks
# ----------------------------------------------------------------------------------------------


def _ref_all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return _ref_check(tensors)[0]


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-d bool: every element of every tensor is finite. One read pass, no writes."""
    return check(tensors)[0]


def _ref_check(tensors: Sequence[torch.Tensor], per_leaf: bool = False):
    tensors = list(tensors)
    dev = _flag_device(tensors)
    finite = torch.ones((), dtype=torch.bool, device=dev)
    sumsq = torch.zeros((), dtype=torch.float32, device=dev)
    leaf_nonfinite = torch.zeros(len(tensors) if per_leaf else 0, dtype=torch.bool, device=dev)
    nonempty = [i for i, t in enumerate(tensors) if t.numel() > 0]
    if nonempty:
        maxabs = [None] * len(tensors)
        norms = [None] * len(tensors)
        for idx in _groups_idx([tensors[i] for i in nonempty]).values():
            idx = [nonempty[k] for k in idx]
            group = [tensors[i] for i in idx]
            acc = torch.float32 if group[0].dtype.itemsize <= 4 else None  # float64 stays float64
            for i, m, n in zip(idx, torch._foreach_norm(group, float("inf")),
                               torch._foreach_norm(group, 2, dtype=acc)):
                maxabs[i] = m.to(torch.float32).to(dev)
                norms[i] = n.to(dev)
        leaf_finite = torch.stack([maxabs[i] for i in nonempty]).isfinite()
        finite = leaf_finite.all()
        sumsq = torch.stack([norms[i].to(torch.float64) for i in nonempty]).square().sum().to(torch.float32)
        if per_leaf:
            leaf_nonfinite = leaf_nonfinite.index_put((torch.tensor(nonempty, device=dev),), ~leaf_finite)
    return finite, sumsq, leaf_nonfinite


def check(tensors: Sequence[torch.Tensor], per_leaf: bool = False):
    """``(finite, sumsq)``: 0-d bool (all elements finite) and 0-d fp32 sum of squares.

    One read-only pass over the tensors (the reference makes two). With ``per_leaf=True`` a
    third result is a bool vector, ``True`` where that tensor holds a non-finite value.
    ``sumsq`` is accumulated in fp32 blocks whatever the input dtype (combined in double by the
    compiled kernels). Tensors may mix dtypes; the compiled kernels take one device per call.
    """
    tensors = list(tensors)
    if not tensors:
        out = _ref_check(tensors, per_leaf)
    else:
        _ensure()
        out = torch.ops.ampfunc.check(tensors, per_leaf)
    return tuple(out) if per_leaf else (out[0], out[1])


# ----------------------------------------------------------------------------------------------
# Unscale
# ----------------------------------------------------------------------------------------------


def _ref_unscale(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor):
    tensors = list(tensors)
    outs = [t.to(torch.float32, copy=True) for t in tensors]
    return outs, _ref_unscale_(outs, inv_scale)


def unscale(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor):
    """``(outs, finite)``: new fp32 tensors ``t * inv_scale`` and a 0-d bool flag.

    The product is taken in fp32 (as ``torch.amp.GradScaler`` does); finiteness is judged on
    the inputs. One read of the inputs and one fp32 write.
    """
    tensors = list(tensors)
    if not tensors:
        return [], torch.ones((), dtype=torch.bool, device=inv_scale.device)
    _ensure()
    outs, finite = torch.ops.ampfunc.unscale(tensors, inv_scale)
    return list(outs), finite


def _ref_unscale_(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    tensors = list(tensors)
    dev = _flag_device(tensors)
    found_inf = torch.zeros((), dtype=torch.float32, device=dev)
    for idx in _groups_idx(tensors).values():
        group = [tensors[i] for i in idx]
        d = group[0].device
        fi = found_inf if d == dev else torch.zeros((), dtype=torch.float32, device=d)
        torch._amp_foreach_non_finite_check_and_unscale_(group, fi, inv_scale.to(d, torch.float32))
        if fi is not found_inf:
            found_inf = found_inf + fi.to(dev)
    return found_inf == 0


def unscale_(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """In place ``t *= inv_scale`` (product in fp32, stored in ``t``'s dtype); returns ``finite``.
    One read and one write of every element."""
    tensors = list(tensors)
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=inv_scale.device)
    _ensure()
    return torch.ops.ampfunc.unscale_(tensors, inv_scale)


# ----------------------------------------------------------------------------------------------
# Fused optimizer steps
# ----------------------------------------------------------------------------------------------


def _commit_where(finite, dsts, news) -> None:
    # The reference's device-side skip: every destination keeps its old value unless finite.
    for d, n in zip(dsts, news):
        d.copy_(torch.where(finite, n.to(d.dtype), d))


def _ref_sgd_step_(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, weight_decay,
                   momentum, dampening, nesterov, maximize, lr_tensor=None) -> None:
    if isinstance(lr, torch.Tensor):
        lr, lr_tensor = 0.0, lr
    params, grads = list(params), list(grads)
    finite = finite.reshape(()).to(torch.bool)
    if params:
        g = torch._foreach_mul([x.to(torch.float32) for x in grads], grad_scale)
        if maximize:
            g = torch._foreach_neg(g)
        if weight_decay != 0:
            g = torch._foreach_add(g, params, alpha=weight_decay)
        bufs = []
        if momentum != 0:
            momentum_buffers = list(momentum_buffers)
            first = step.reshape(()) == 0  # torch's `buf is None`: the first applied step
            bufs = torch._foreach_mul(momentum_buffers, momentum)
            torch._foreach_add_(bufs, g, alpha=1 - dampening)
            bufs = [torch.where(first, gi, bi) for gi, bi in zip(g, bufs)]
            g = torch._foreach_add(g, bufs, alpha=momentum) if nesterov else bufs
        if lr_tensor is None:
            new_p = torch._foreach_add(params, g, alpha=-lr)
        else:  # a schedule's value, on the device
            new_p = torch._foreach_add(params, torch._foreach_mul(g, lr_tensor.reshape(()).to(torch.float32).neg()))
        _commit_where(finite, params, new_p)
        if momentum != 0:
            _commit_where(finite, momentum_buffers, bufs)
        _commit_where(finite, list(model_params), new_p)
    step.copy_(torch.where(finite, step + 1, step))


def sgd_step_(params, grads, momentum_buffers, model_params, step, grad_scale, finite, *, lr,
              weight_decay: float = 0.0, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
              maximize: bool = False) -> None:
    """One ``torch.optim.SGD`` step over fp32 ``params``, in place, in one pass.

    ``g = grad * grad_scale`` (``grad`` of any float dtype, ``grad_scale`` a 0-d fp32 device
    tensor: pass ``inv_scale * clip_coef``), then torch's update of the params and momentum
    buffers (the buffer starts as ``g`` on the first applied step, ``step == 0``). When
    ``model_params`` (one per param, fp16/bf16/fp32) is given it receives the new params rounded
    to its dtype in the same pass. When the 0-d bool ``finite`` is false nothing is written:
    params, buffers, model copy and ``step`` (0-d fp32, incremented otherwise) stay bit-identical.
    ``lr`` is a float or a 0-d tensor on the params' device (a schedule's value: read by the
    kernel on the device, so no host sync and no recompilation when it changes).
    Cost: reads grad, param (+buffer), writes param (+buffer, +model copy); no host sync.
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    torch.ops.ampfunc.sgd_step_(list(params), list(grads), _as_list(momentum_buffers), _as_list(model_params),
                                step, grad_scale, finite, lr, lr_tensor, float(weight_decay), float(momentum),
                                float(dampening), bool(nesterov), bool(maximize))


def _ref_adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite,
                    lr, beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize,
                    lr_tensor=None) -> None:
    if isinstance(lr, torch.Tensor):
        lr, lr_tensor = 0.0, lr
    params, grads, exp_avgs, exp_avg_sqs = list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)
    finite = finite.reshape(()).to(torch.bool)
    t = step + 1  # fp32, as torch's `step_t += 1`
    if params:
        g = torch._foreach_mul([x.to(torch.float32) for x in grads], grad_scale)
        if maximize:
            g = torch._foreach_neg(g)
        base = params
        lr64 = lr if lr_tensor is None else lr_tensor.reshape(()).to(torch.float64)
        if weight_decay != 0:
            if decoupled_weight_decay:
                decay = 1 - lr64 * weight_decay
                base = torch._foreach_mul(params, decay if lr_tensor is None else decay.to(torch.float32))
            else:
                g = torch._foreach_add(g, params, alpha=weight_decay)
        m = torch._foreach_lerp(exp_avgs, g, 1 - beta1)
        v = torch._foreach_mul(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        # Bias corrections in double from the fp32 step, as torch's `beta ** _get_value(step)`,
        # but on the device.
        t64 = t.to(torch.float64)
        neg_step_size = (-(lr64 / (1 - torch.pow(beta1, t64)))).to(torch.float32)
        bc2_sqrt = (1 - torch.pow(beta2, t64)).sqrt().to(torch.float32)
        vmax = torch._foreach_maximum(list(max_exp_avg_sqs), v) if amsgrad else None
        denom = torch._foreach_sqrt(vmax if amsgrad else v)
        denom = torch._foreach_div(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        upd = torch._foreach_mul(m, neg_step_size)  # addcdiv's order: (value * m) / denom
        upd = torch._foreach_div(upd, denom)
        new_p = torch._foreach_add(base, upd)
        _commit_where(finite, params, new_p)
        _commit_where(finite, exp_avgs, m)
        _commit_where(finite, exp_avg_sqs, v)
        if amsgrad:
            _commit_where(finite, list(max_exp_avg_sqs), vmax)
        _commit_where(finite, list(model_params), new_p)
    step.copy_(torch.where(finite, t, step))


def adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite, *,
               lr, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
               amsgrad: bool = False, decoupled_weight_decay: bool = False, maximize: bool = False) -> None:
    """One ``torch.optim.Adam`` (``decoupled_weight_decay=True``: ``AdamW``) step, in place, in
    one pass, with torch's single-tensor order of operations in fp32.

    ``g = grad * grad_scale`` (any float dtype grad; ``grad_scale`` 0-d fp32 on the device);
    ``params``, ``exp_avgs``, ``exp_avg_sqs`` (and ``max_exp_avg_sqs`` with ``amsgrad``) are
    fp32 lists updated in place; ``step`` is the 0-d fp32 count of applied steps, the bias
    corrections use ``step + 1``. ``model_params`` (optional, one per param) receives the new
    params rounded to its dtype. When ``finite`` is false nothing is written (step included).
    ``lr``: a float or a 0-d tensor on the params' device (a schedule's value, read on the device).
    Cost: reads g, p, m, v; writes p, m, v (+ model copy); no host sync.
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    torch.ops.ampfunc.adam_step_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                                 _as_list(max_exp_avg_sqs) if amsgrad else [], _as_list(model_params), step,
                                 grad_scale, finite, lr, lr_tensor, float(beta1), float(beta2), float(eps),
                                 float(weight_decay), bool(amsgrad), bool(decoupled_weight_decay), bool(maximize))


# Out of place: the same kernels writing new tensors. The reference is the definition: clone,
# then the in-place reference.


def _fresh(tensors) -> list:
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors]


def _ref_sgd_step(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, weight_decay,
                  momentum, dampening, nesterov, maximize, lr_tensor=None):
    p, b, m, s = _fresh(params), _fresh(momentum_buffers) if momentum != 0 else [], _fresh(model_params), step.clone()
    _ref_sgd_step_(p, grads, b, m, s, grad_scale, finite, lr, weight_decay, momentum, dampening, nesterov, maximize,
                   lr_tensor=lr_tensor)
    return p, b, m, s


def sgd_step(params, grads, momentum_buffers, model_params, step, grad_scale, finite, *, lr,
             weight_decay: float = 0.0, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
             maximize: bool = False):
    """Out-of-place :func:`sgd_step_`: ``(new_params, new_momentum_buffers, new_model_params,
    new_step)``, new tensors with the in-place op's numbers bit for bit; the inputs are only read.

    ``new_momentum_buffers`` is empty when ``momentum == 0`` and ``new_model_params`` when no
    ``model_params`` are given (they supply the dtypes of the model copy, and its values when the
    step is skipped). When ``finite`` is false the outputs are copies of the inputs and
    ``new_step`` equals ``step``. Cost: the in-place op's traffic, one pass, with the writes going
    to new (contiguous) tensors; a skipped step costs one copy instead. No host sync (on CUDA the
    state is copied first and the in-place kernel runs on the copy: one more read and write).
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    p, b, m, s = torch.ops.ampfunc.sgd_step(list(params), list(grads),
                                            _as_list(momentum_buffers) if momentum != 0 else [],
                                            _as_list(model_params), step, grad_scale, finite, lr, lr_tensor,
                                            float(weight_decay), float(momentum), float(dampening), bool(nesterov),
                                            bool(maximize))
    return list(p), list(b), list(m), s


def _ref_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite, lr,
                   beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize, lr_tensor=None):
    p, m1, m2 = _fresh(params), _fresh(exp_avgs), _fresh(exp_avg_sqs)
    vmax, m, s = _fresh(max_exp_avg_sqs) if amsgrad else [], _fresh(model_params), step.clone()
    _ref_adam_step_(p, grads, m1, m2, vmax, m, s, grad_scale, finite, lr, beta1, beta2, eps, weight_decay, amsgrad,
                    decoupled_weight_decay, maximize, lr_tensor=lr_tensor)
    return p, m1, m2, vmax, m, s


def adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite, *,
              lr, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
              amsgrad: bool = False, decoupled_weight_decay: bool = False, maximize: bool = False):
    """Out-of-place :func:`adam_step_`: ``(new_params, new_exp_avgs, new_exp_avg_sqs,
    new_max_exp_avg_sqs, new_model_params, new_step)``, new tensors with the in-place op's numbers
    bit for bit; the inputs are only read.

    ``new_max_exp_avg_sqs`` is empty without ``amsgrad`` and ``new_model_params`` when no
    ``model_params`` are given. When ``finite`` is false the outputs are copies of the inputs and
    ``new_step`` equals ``step``. Cost: reads g, p, m, v, writes new p, m, v (+ model copy) in one
    pass -- the in-place op's traffic; a skipped step costs one copy instead. No host sync (on
    CUDA the state is copied first and the in-place kernel runs on the copy).
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    out = torch.ops.ampfunc.adam_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                                      _as_list(max_exp_avg_sqs) if amsgrad else [], _as_list(model_params), step,
                                      grad_scale, finite, lr, lr_tensor, float(beta1), float(beta2), float(eps),
                                      float(weight_decay), bool(amsgrad), bool(decoupled_weight_decay),
                                      bool(maximize))
    return tuple(list(x) for x in out[:5]) + (out[5],)


# ----------------------------------------------------------------------------------------------
# Loss-scale update
# ----------------------------------------------------------------------------------------------


def _ref_update_scale(scale, growth_tracker, hysteresis_tracker, finite, *, growth_factor, backoff_factor,
                      growth_interval, min_scale, max_scale, hysteresis):
    finite = finite.to(device=scale.device, dtype=torch.bool).reshape(())
    s64 = scale.to(torch.float64)
    # torch.amp rounding: products in double, stored in fp32; a growth that overflows fp32
    # is not applied (the tracker still resets).
    grown = (s64 * growth_factor).to(torch.float32)
    grown = torch.where(grown.isfinite(), grown.clamp(max=max_scale), scale)
    backed = (s64 * backoff_factor).to(torch.float32).clamp(min=min_scale)
    next_tracker = growth_tracker + 1
    grow = finite & (next_tracker >= growth_interval)
    backoff = (~finite) & (hysteresis_tracker <= 1)
    new_scale = torch.where(grow, grown, torch.where(backoff, backed, scale))
    zero = torch.zeros_like(growth_tracker)
    new_tracker = torch.where(finite & ~grow, next_tracker, zero)
    new_hyst = torch.where(finite, torch.full_like(hysteresis_tracker, hysteresis),
                           (hysteresis_tracker - 1).clamp(min=1))
    return new_scale, new_tracker, new_hyst


def _ref_update_scale_(scale, growth_tracker, hysteresis_tracker, finite, growth_factor, backoff_factor,
                       growth_interval, min_scale, max_scale, hysteresis) -> None:
    s, g, h = _ref_update_scale(scale, growth_tracker, hysteresis_tracker, finite, growth_factor=growth_factor,
                                backoff_factor=backoff_factor, growth_interval=growth_interval,
                                min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis)
    scale.copy_(s)
    growth_tracker.copy_(g)
    hysteresis_tracker.copy_(h)


def update_scale(scale, growth_tracker, hysteresis_tracker, finite, *, growth_factor, backoff_factor,
                 growth_interval, min_scale, max_scale, hysteresis):
    """The next ``(scale, growth_tracker, hysteresis_tracker)`` of a dynamic loss scale.

    On a finite step the hysteresis counter refills and the tracker counts up; when it
    reaches ``growth_interval`` the scale is multiplied by ``growth_factor`` (capped at
    ``max_scale``, not applied when it would overflow fp32) and the tracker resets. On a
    non-finite step the tracker resets and the counter counts down; when it is exhausted the
    scale is multiplied by ``backoff_factor`` (floored at ``min_scale``). All on the device:
    new 0-d tensors (the inputs are not modified), no host sync.
    """
    s, g, h = scale.clone(), growth_tracker.clone(), hysteresis_tracker.clone()
    update_scale_(s, g, h, finite, growth_factor=growth_factor, backoff_factor=backoff_factor,
                  growth_interval=growth_interval, min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis)
    return s, g, h


def update_scale_(scale, growth_tracker, hysteresis_tracker, finite, *, growth_factor, backoff_factor,
                  growth_interval, min_scale, max_scale, hysteresis) -> None:
    """In-place :func:`update_scale` (the three state tensors are overwritten): one tiny kernel
    (scale fp32, trackers int32, all 0-d on the same device)."""
    _ensure()
    finite = finite.to(device=scale.device, dtype=torch.bool).reshape(())
    torch.ops.ampfunc.update_scale_(scale, growth_tracker, hysteresis_tracker, finite, float(growth_factor),
                                    float(backoff_factor), int(growth_interval), float(min_scale),
                                    float(max_scale), int(hysteresis))


# ----------------------------------------------------------------------------------------------
# Op registration: schemas, reference kernels (CompositeExplicitAutograd: any device the
# compiled kernels do not claim), fake kernels for torch.compile / meta tensors.
# ----------------------------------------------------------------------------------------------

_SCHEMAS = {
    "check": "check(Tensor[] tensors, bool per_leaf) -> (Tensor finite, Tensor sumsq, Tensor leaf_nonfinite)",
    "unscale_": "unscale_(Tensor(a!)[] tensors, Tensor inv_scale) -> Tensor finite",
    "unscale": "unscale(Tensor[] tensors, Tensor inv_scale) -> (Tensor[] outs, Tensor finite)",
    "sgd_step_": (
        "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] model_params, "
        "Tensor(d!) step, Tensor grad_scale, Tensor finite, float lr, Tensor? lr_tensor, float weight_decay, "
        "float momentum, "
        "float dampening, bool nesterov, bool maximize) -> ()"),
    "adam_step_": (
        "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] model_params, Tensor(f!) step, Tensor grad_scale, "
        "Tensor finite, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
        "bool amsgrad, "
        "bool decoupled_weight_decay, bool maximize) -> ()"),
    "sgd_step": (
        "sgd_step(Tensor[] params, Tensor[] grads, Tensor[] momentum_buffers, Tensor[] model_params, Tensor step, "
        "Tensor grad_scale, Tensor finite, float lr, Tensor? lr_tensor, float weight_decay, float momentum, "
        "float dampening, bool nesterov, bool maximize) -> (Tensor[] new_params, Tensor[] new_momentum_buffers, "
        "Tensor[] new_model_params, Tensor new_step)"),
    "adam_step": (
        "adam_step(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
        "Tensor[] max_exp_avg_sqs, Tensor[] model_params, Tensor step, Tensor grad_scale, Tensor finite, float lr, "
        "Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, bool amsgrad, "
        "bool decoupled_weight_decay, bool maximize) -> (Tensor[] new_params, Tensor[] new_exp_avgs, "
        "Tensor[] new_exp_avg_sqs, Tensor[] new_max_exp_avg_sqs, Tensor[] new_model_params, Tensor new_step)"),
    "update_scale_": (
        "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, Tensor finite, "
        "float growth_factor, float backoff_factor, int growth_interval, float min_scale, float max_scale, "
        "int hysteresis) -> ()"),
}


def _ref_check_op(tensors, per_leaf):
    return _ref_check(tensors, per_leaf)


def _ref_sgd_step_op(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, lr_tensor,
                     *rest):
    _ref_sgd_step_(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, *rest,
                   lr_tensor=lr_tensor)


def _ref_adam_step_op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite,
                      lr, lr_tensor, *rest):
    _ref_adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite, lr,
                    *rest, lr_tensor=lr_tensor)


def _ref_sgd_step_out_op(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, lr_tensor,
                         *rest):
    return _ref_sgd_step(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, *rest,
                         lr_tensor=lr_tensor)


def _ref_adam_step_out_op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale,
                          finite, lr, lr_tensor, *rest):
    return _ref_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale,
                          finite, lr, *rest, lr_tensor=lr_tensor)


def _ref_unscale_op(tensors, inv_scale):
    outs, finite = _ref_unscale(tensors, inv_scale)
    return outs, finite


_REFERENCE = {
    "check": _ref_check_op,
    "unscale_": _ref_unscale_,
    "unscale": _ref_unscale_op,
    "sgd_step_": _ref_sgd_step_op,
    "adam_step_": _ref_adam_step_op,
    "sgd_step": _ref_sgd_step_out_op,
    "adam_step": _ref_adam_step_out_op,
    "update_scale_": _ref_update_scale_,
}


def _fake_check(tensors, per_leaf):
    dev = _flag_device(tensors)
    return (torch.empty((), dtype=torch.bool, device=dev), torch.empty((), dtype=torch.float32, device=dev),
            torch.empty(len(tensors) if per_leaf else 0, dtype=torch.bool, device=dev))


def _fake_unscale_(tensors, inv_scale):
    return torch.empty((), dtype=torch.bool, device=tensors[0].device if tensors else inv_scale.device)


def _fake_unscale(tensors, inv_scale):
    return ([torch.empty_like(t, dtype=torch.float32, memory_format=torch.contiguous_format) for t in tensors],
            _fake_unscale_(tensors, inv_scale))


def _fake_none(*args):
    return None


def _empties(tensors) -> list:
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]


def _fake_sgd_step(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, lr_tensor,
                   weight_decay, momentum, *rest):
    return (_empties(params), _empties(momentum_buffers) if momentum != 0 else [], _empties(model_params),
            torch.empty_like(step))


def _fake_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite,
                    lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, *rest):
    return (_empties(params), _empties(exp_avgs), _empties(exp_avg_sqs), _empties(max_exp_avg_sqs) if amsgrad else [],
            _empties(model_params), torch.empty_like(step))


_FAKE = {
    "check": _fake_check,
    "unscale_": _fake_unscale_,
    "unscale": _fake_unscale,
    "sgd_step_": _fake_none,
    "adam_step_": _fake_none,
    "sgd_step": _fake_sgd_step,
    "adam_step": _fake_adam_step,
    "update_scale_": _fake_none,
}


def _register() -> None:
    try:
        torch.ops.ampfunc.check  # noqa: B018 - already defined (module reloaded)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("ampfunc", "DEF")  # noqa: TOR901 - the schemas live here, kernels in ext/
    for name, schema in _SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, _REFERENCE[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"ampfunc::{name}", _FAKE[name], lib=lib)
    _register.lib = lib  # keep the registrations alive


_register()


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _groups_idx(tensors: Sequence[torch.Tensor]) -> dict:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _groups(tensors: Sequence[torch.Tensor]) -> dict:
    return {k: [tensors[i] for i in idx] for k, idx in _groups_idx(tensors).items()}
