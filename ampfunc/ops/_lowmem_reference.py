"""The reference twin of ``adam_lowmem_step_`` in plain torch (the op's numbers, on any device).

It is the definition the compiled kernel matches bit for bit: join each bf16 param with its
int16 remainder into the fp32 master, widen or dequantize the moments, take the fp32 Adam step
of :func:`ampfunc.ops.optimizers.adam._ref_adam_step_`, then store the moments back in their
layouts (q8: block-wise codes and absmax; bf16: rounded to nearest even) and split the masters.
Where ``finite`` is false every written tensor keeps its bits (selected on the device: no sync).
"""

from __future__ import annotations

import torch

from ampfunc.lowbits import dequantize_q8, join_bf16, quantize_q8, split_bf16
from ampfunc.ops._validation import check_hypers
from ampfunc.ops.optimizers.adam import _ref_adam_step_

_OP = "adam_lowmem_step_"


def _check_kernel_rules(lists: dict, qmaps, qbases, hypers: dict) -> None:
    """What the compiled kernel also refuses and the spec's roles do not say, in its words: every
    list's tensors and the tables contiguous (the kernel walks them as flat runs), the
    hyper-parameters in the optimizers' ranges (raised before any write)."""
    for name, ts in lists.items():
        for i, t in enumerate(ts):
            if not t.is_contiguous():
                raise ValueError(f"ampfunc: {name}[{i}] is not contiguous; the low-memory step takes contiguous "
                                 f"tensors ({_OP})")
    for name, t in (("qmaps", qmaps), ("qbases", qbases)):
        if not t.is_contiguous():
            raise ValueError(f"ampfunc: {name} is not contiguous; the low-memory step takes contiguous tensors ({_OP})")
    check_hypers(_OP, **hypers)


def _check_pairs(params, exp_avgs, exp_avg_sqs) -> None:
    """What the spec's roles do not say: both moments of a param stored alike, a q8 param a whole
    number of blocks (raised before any write, as the kernel does)."""
    for i, (p, m, v) in enumerate(zip(params, exp_avgs, exp_avg_sqs)):
        if v.dtype != m.dtype:
            raise TypeError(f"ampfunc: exp_avg_sqs[{i}] has dtype {v.dtype} but exp_avgs[{i}] has dtype {m.dtype}; "
                            f"both moments of a param are stored alike ({_OP})")
        if m.dtype == torch.uint8 and p.numel() % 256:
            raise ValueError(f"ampfunc: exp_avgs[{i}] is q8 but params[{i}] has {p.numel()} elements, not a multiple "
                             f"of the block (256) ({_OP})")


def _decode(x: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    if x.dtype == torch.uint8:
        return dequantize_q8(x, absmax, signed)
    return x.to(torch.float32, copy=True)


def _encode(new: torch.Tensor, like: torch.Tensor, signed: bool) -> tuple:
    if like.dtype == torch.uint8:
        return quantize_q8(new, signed)
    return new.to(like.dtype), None


def _ref_adam_lowmem_step_(params, remainders, grads, exp_avgs, exp_avg_absmax, exp_avg_sqs, exp_avg_sq_absmax,
                           step, grad_scale, finite, qmaps, qbases, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                           decoupled_weight_decay, maximize) -> None:
    params, remainders, grads = list(params), list(remainders), list(grads)
    exp_avgs, exp_avg_sqs = list(exp_avgs), list(exp_avg_sqs)
    # (qmaps/qbases are q8_lookup()'s tables of the maps that quantize_q8/dequantize_q8 use: checked only)
    _check_kernel_rules({"params": params, "remainders": remainders, "grads": grads, "exp_avgs": exp_avgs,
                         "exp_avg_absmax": exp_avg_absmax, "exp_avg_sqs": exp_avg_sqs,
                         "exp_avg_sq_absmax": exp_avg_sq_absmax}, qmaps, qbases,
                        {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay})
    _check_pairs(params, exp_avgs, exp_avg_sqs)
    # One-element scalars (the validation takes shape (1,) as the kernel does), as 0-d views.
    step, grad_scale = step.view(()), grad_scale.view(())
    lr_tensor = lr_tensor.view(()) if lr_tensor is not None else None
    finite = finite.reshape(()).to(torch.bool)
    with torch.no_grad():
        masters = [join_bf16(p, r) if p.dtype == torch.bfloat16 else p.clone() for p, r in zip(params, remainders)]
        m = [_decode(x, a, True) for x, a in zip(exp_avgs, exp_avg_absmax)]
        v = [_decode(x, a, False) for x, a in zip(exp_avg_sqs, exp_avg_sq_absmax)]
        new_step = step.clone()
        _ref_adam_step_(masters, grads, m, v, [], [], new_step, grad_scale, torch.ones((), dtype=torch.bool), lr,
                        beta1, beta2, eps, weight_decay, False, decoupled_weight_decay, maximize, lr_tensor=lr_tensor)

        def commit(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst.copy_(torch.where(finite.to(dst.device), src, dst))

        for p, r, x in zip(params, remainders, masters):
            if p.dtype == torch.bfloat16:
                hi, lo = split_bf16(x)
                commit(p, hi)
                commit(r, lo)
            else:
                commit(p, x)
        for slots, absmaxes, new, signed in ((exp_avgs, exp_avg_absmax, m, True),
                                             (exp_avg_sqs, exp_avg_sq_absmax, v, False)):
            for x, a, n in zip(slots, absmaxes, new):
                codes, amax = _encode(n, x, signed)
                commit(x, codes)
                if amax is not None:
                    commit(a, amax)
        commit(step, new_step)
