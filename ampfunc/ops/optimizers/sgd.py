"""SGD, as ``torch.optim.SGD``: its spec (:mod:`ampfunc.ops._spec`) and its reference twin.

The kernels: ``ext/cpu/kernels.cpp`` (``sgd_step``, ``sgd_update``) and ``ext/cuda/optim.cu``
(``ampfunc_cuda_sgd_*``), their scalars in ``ext/optim_scalars.h``.
"""

from __future__ import annotations

import torch

from ampfunc.ops._reference import _commit_where, fma_rounded
from ampfunc.ops._spec import Hyper, Optimizer, State, register_optimizer


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
        else:  # a schedule's value, on the device; fused, as the kernels and torch's add(alpha=)
            new_p = fma_rounded(g, lr_tensor.reshape(()).to(torch.float32).neg(), params)
        _commit_where(finite, params, new_p)
        if momentum != 0:
            _commit_where(finite, momentum_buffers, bufs)
        _commit_where(finite, list(model_params), new_p)
    step.copy_(torch.where(finite, step + 1, step))

def _ref_sgd_update(params, grads, momentum_buffers, step, grad_scale, lr, lr_tensor, weight_decay, momentum,
                    dampening, nesterov, maximize):
    # The arithmetic of ampfunc.optim.sgd's generic update, op for op (so the numbers are today's).
    params, grads = list(params), list(grads)
    ps = params if params else None
    if not grads:
        return [], [], step + 1
    g = torch._foreach_mul([x.to(torch.float32) for x in grads], grad_scale.reshape(()))
    if maximize:
        g = torch._foreach_neg(g)
    if weight_decay != 0:
        g = torch._foreach_add(g, ps, alpha=weight_decay)
    new_bufs = []
    if momentum != 0:
        buf = torch._foreach_mul(list(momentum_buffers), momentum)
        torch._foreach_add_(buf, g, alpha=1 - dampening)
        if dampening != 0:
            first = step.reshape(()) == 0
            buf = [torch.where(first, gi, bi) for gi, bi in zip(g, buf)]
        new_bufs = buf
        g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
    if lr_tensor is None:
        if ps is None:
            d = torch._foreach_mul(g, -lr)
        else:
            d = torch._foreach_sub(torch._foreach_add(ps, g, alpha=-lr), ps)
    else:
        lr_t = lr_tensor.reshape(()).to(torch.float32)
        if ps is None:
            d = torch._foreach_neg(torch._foreach_mul(g, lr_t))
        else:
            d = torch._foreach_sub(fma_rounded(g, lr_t.neg(), ps), ps)
    return list(d), list(new_bufs), step + 1


SGD = register_optimizer(Optimizer(
    name="sgd",
    state=(State("momentum_buffers", when="momentum"),),
    hypers=(Hyper("weight_decay", "float", 0.0), Hyper("momentum", "float", 0.0), Hyper("dampening", "float", 0.0),
            Hyper("nesterov", "bool", False), Hyper("maximize", "bool", False)),
    reference_step_=_ref_sgd_step_,
    reference_update=_ref_sgd_update,
    title="``torch.optim.SGD``",
    math=("torch's update of the params and momentum buffers (the buffer starts as ``g`` on the first applied "
          "step, ``step == 0``)"),
    traffic="reads grad, param (+buffer), writes param (+buffer, +model copy)",
    kinds=("sgd",),
    tree_state=("momentum_buffer",),
    hypers_of=lambda kind, h: {k: h[k] for k in ("weight_decay", "momentum", "dampening", "nesterov", "maximize")},
))
