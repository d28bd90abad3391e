"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as ``optax.lion``
with decoupled weight decay: its spec (:mod:`ampfunc.ops._spec`) and its reference twin.

Per element, with ``g`` the gradient times ``grad_scale``::

    c = lerp(g, m, beta1)                     # beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)   # sign(0) = 0
    m = lerp(m, g, 1 - beta2)                 # beta2 * m + (1 - beta2) * g

The kernels: ``ext/optimizers/lion.h`` (its scalars and its per-element step, shared by the CPU
and CUDA kernels of ``ext/``, which run it generically).
"""

from __future__ import annotations

import torch

from ampfunc.ops._reference import _commit_where, fma_rounded
from ampfunc.ops._spec import Hyper, Optimizer, State, register_optimizer


def _direction(grads, exp_avgs, grad_scale, beta1, beta2):
    """``(sign(c), new m)`` in fp32, one foreach op each as the kernel's order."""
    g = torch._foreach_mul([x.to(torch.float32) for x in grads], grad_scale.reshape(()))
    u = torch._foreach_sign(torch._foreach_lerp(g, list(exp_avgs), beta1))
    m = torch._foreach_lerp(list(exp_avgs), g, 1 - beta2)
    return u, m


def _new_params(params, u, lr, lr_tensor, weight_decay, fp32_decay=False):
    """``p * (1 - lr * wd) - lr * sign(c)``: the decay in double from a float lr (or a tensor's,
    or in fp32 with ``fp32_decay``: the update's order), then one rounding (``lr * sign`` is exact)."""
    base = params
    if weight_decay != 0:
        if lr_tensor is None:
            decay = float(torch.tensor(1 - lr * weight_decay, dtype=torch.float64).to(torch.float32))
        elif fp32_decay:
            decay = 1 - lr_tensor.reshape(()).to(torch.float32) * weight_decay
        else:
            decay = (1 - lr_tensor.reshape(()).to(torch.float64) * weight_decay).to(torch.float32)
        base = torch._foreach_mul(params, decay)
    if lr_tensor is None:
        return torch._foreach_add(base, u, alpha=-lr)
    return fma_rounded(u, lr_tensor.reshape(()).to(torch.float32).neg(), base)


def _ref_lion_step_(params, grads, exp_avgs, model_params, step, grad_scale, finite, lr, beta1, beta2, weight_decay,
                    lr_tensor=None) -> None:
    if isinstance(lr, torch.Tensor):
        lr, lr_tensor = 0.0, lr
    params, exp_avgs = list(params), list(exp_avgs)
    finite = finite.reshape(()).to(torch.bool)
    if params:
        u, m = _direction(grads, exp_avgs, grad_scale, beta1, beta2)
        new_p = _new_params(params, u, lr, lr_tensor, weight_decay)
        _commit_where(finite, params, new_p)
        _commit_where(finite, exp_avgs, m)
        _commit_where(finite, list(model_params), new_p)
    step.copy_(torch.where(finite, step + 1, step))


def _ref_lion_update(params, grads, exp_avgs, step, grad_scale, lr, lr_tensor, beta1, beta2, weight_decay):
    params, grads = list(params), list(grads)
    if not grads:
        return [], [], step + 1
    u, m = _direction(grads, exp_avgs, grad_scale, beta1, beta2)
    if params:
        d = torch._foreach_sub(_new_params(params, u, lr, lr_tensor, weight_decay, fp32_decay=True), params)
    elif lr_tensor is None:
        d = torch._foreach_mul(u, -lr)
    else:
        d = torch._foreach_mul(u, lr_tensor.reshape(()).to(torch.float32).neg())
    return list(d), list(m), step + 1


LION = register_optimizer(Optimizer(
    name="lion",
    state=(State("exp_avgs"),),
    hypers=(Hyper("beta1", "float", 0.9), Hyper("beta2", "float", 0.99), Hyper("weight_decay", "float", 0.0)),
    reference_step_=_ref_lion_step_,
    reference_update=_ref_lion_update,
    title="Lion (Chen et al. 2023; ``optax.lion``)",
    math=("``c = lerp(g, m, beta1)``, ``p = p * (1 - lr * weight_decay) - lr * sign(c)`` (sign(0) = 0), "
          "``m = lerp(m, g, 1 - beta2)``"),
    traffic="reads g, p, m; writes p, m (+ model copy)",
    kinds=("lion",),
    tree_state=("mu",),
    hypers_of=lambda kind, h: {"beta1": h["b1"], "beta2": h["b2"], "weight_decay": h["weight_decay"]},
))
