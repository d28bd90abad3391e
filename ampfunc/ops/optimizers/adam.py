"""Adam and AdamW, as ``torch.optim.Adam`` / ``AdamW``: the spec (:mod:`ampfunc.ops._spec`) and
the reference twin.

The kernels: ``ext/cpu/kernels.cpp`` (``adam_step``, ``adam_update``) and ``ext/cuda/optim.cu``
(``ampfunc_cuda_adam_*``), their scalars (bias corrections included) in ``ext/optim_scalars.h``.
"""

from __future__ import annotations

import torch

from ampfunc.ops._reference import _commit_where, sqrt_rounded
from ampfunc.ops._spec import Hyper, Optimizer, State, register_optimizer


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
        denom = sqrt_rounded(vmax if amsgrad else v)
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

def _ref_adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, grad_scale, lr, lr_tensor, beta1,
                     beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize):
    # The arithmetic of ampfunc.optim.adam's generic update, op for op (so the numbers are today's).
    params, grads = list(params), list(grads)
    ps = params if params else None
    new_step = step + 1
    if not grads:
        return [], [], [], [], new_step
    lr_t = lr if lr_tensor is None else lr_tensor.reshape(()).to(torch.float32)
    step64 = new_step.to(torch.float64)
    bc1 = 1 - torch.pow(beta1, step64)
    bc2 = 1 - torch.pow(beta2, step64)
    lr64 = lr_t if isinstance(lr_t, float) else lr_t.to(torch.float64)
    neg_step_size = (-(lr64 / bc1)).to(torch.float32)
    bc2_sqrt = bc2.sqrt().to(torch.float32)
    g = torch._foreach_mul([x.to(torch.float32) for x in grads], grad_scale.reshape(()))
    if maximize:
        g = torch._foreach_neg(g)
    new_p = ps
    if weight_decay != 0:
        if decoupled_weight_decay:
            new_p = torch._foreach_mul(ps, 1 - lr_t * weight_decay)
        else:
            g = torch._foreach_add(g, ps, alpha=weight_decay)
    m = torch._foreach_lerp(list(exp_avgs), g, 1 - beta1)
    v = torch._foreach_mul(list(exp_avg_sqs), beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    vmax = []
    if amsgrad:
        vmax = torch._foreach_maximum(list(max_exp_avg_sqs), v)
        denom = sqrt_rounded(vmax)
    else:
        denom = sqrt_rounded(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    step_term = torch._foreach_mul(m, neg_step_size)
    torch._foreach_div_(step_term, denom)
    d = step_term if new_p is None else torch._foreach_sub(torch._foreach_add(new_p, step_term), ps)
    return list(d), list(m), list(v), list(vmax), new_step


def _adam_hypers(kind: str, h: dict) -> dict:
    """The kernels' hyper-parameters of ``adam`` / ``adamw``'s registered settings."""
    b1, b2 = h["betas"] if "betas" in h else (h["b1"], h["b2"])
    return {"beta1": b1, "beta2": b2, "eps": h["eps"], "weight_decay": h["weight_decay"],
            "amsgrad": bool(h["amsgrad"]), "decoupled_weight_decay": kind == "adamw", "maximize": h["maximize"]}


ADAM = register_optimizer(Optimizer(
    name="adam",
    state=(State("exp_avgs"), State("exp_avg_sqs"), State("max_exp_avg_sqs", when="amsgrad")),
    hypers=(Hyper("beta1", "float", 0.9), Hyper("beta2", "float", 0.999), Hyper("eps", "float", 1e-8),
            Hyper("weight_decay", "float", 0.0), Hyper("amsgrad", "bool", False),
            Hyper("decoupled_weight_decay", "bool", False), Hyper("maximize", "bool", False)),
    reference_step_=_ref_adam_step_,
    reference_update=_ref_adam_update,
    title="``torch.optim.Adam`` (``decoupled_weight_decay=True``: ``AdamW``)",
    math=("torch's single-tensor order of operations in fp32; the bias corrections use ``step + 1``; "
          "``max_exp_avg_sqs`` is used (and updated) with ``amsgrad`` only"),
    traffic="reads g, p, m, v; writes p, m, v (+ model copy)",
    kinds=("adam", "adamw"),
    tree_state=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    hypers_of=_adam_hypers,
))
