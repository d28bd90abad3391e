"""The plain-torch reference twins of the ops (``_ref_*``): the definition of every op's
numbers, built from ``torch._foreach_*`` and ``torch._amp_foreach_non_finite_check_and_unscale_``
so that even the reference is one launch per (device, dtype) group rather than one per leaf. They
serve whatever the compiled kernels do not (every op under ``AMPFUNC_DISABLE_EXT=1`` or without a
compiler), and the tests compare the kernels with them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ampfunc.ops._validation import _list_device


def _flag_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")

def _groups_idx(tensors: Sequence[torch.Tensor]) -> dict:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups

def _groups(tensors: Sequence[torch.Tensor]) -> dict:
    return {k: [tensors[i] for i in idx] for k, idx in _groups_idx(tensors).items()}

def _ref_all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return _ref_check(tensors)[0]

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
                # finiteness in the tensor's own dtype: a finite fp64 1e300 is inf in fp32
                maxabs[i] = m.isfinite().to(dev)
                norms[i] = n.to(dev)
        leaf_finite = torch.stack([maxabs[i] for i in nonempty])
        finite = leaf_finite.all()
        sumsq = torch.stack([norms[i].to(torch.float64) for i in nonempty]).square().sum().to(torch.float32)
        if per_leaf:
            leaf_nonfinite = leaf_nonfinite.index_put((torch.tensor(nonempty, device=dev),), ~leaf_finite)
    return finite, sumsq, leaf_nonfinite

def _ref_unscale(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor):
    tensors = list(tensors)
    outs = [t.to(torch.float32, copy=True) for t in tensors]
    return outs, _ref_unscale_(outs, inv_scale)

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

def _commit_where(finite, dsts, news) -> None:
    # The reference's device-side skip: every destination keeps its old value unless finite.
    for d, n in zip(dsts, news):
        d.copy_(torch.where(finite, n.to(d.dtype), d))


def sqrt_rounded(tensors: Sequence[torch.Tensor]) -> list:
    """The square root of each fp32 tensor, correctly rounded: the Adam kernels' (and torch's
    fused AdamW's) denominator root, for the plain-torch paths that must give their numbers.

    torch's CPU ``sqrt`` is MKL's vector sqrt, which is not correctly rounded: on the AVX-512
    Xeon of the 2026-12-01 benchmarks it was an ulp off for about 0.7% of fp32 inputs, tensors
    of one element included. On CPU the root is therefore taken in fp64 and rounded once to
    fp32, which is exact (53 >= 2 * 24 + 2 bits); CUDA's fp32 sqrt is correctly rounded as it is.

    Args:
      tensors: fp32 tensors on one device.

    Returns:
      A list of new fp32 tensors.

    Example:
      >>> x = torch.rand(1000) * 1e-6
      >>> torch.equal(sqrt_rounded([x])[0], x.double().sqrt().float())
      True

    Cost: on CPU a widening copy, an fp64 sqrt and a narrowing copy per tensor (the plain-torch
    paths only; the kernels take the root in registers); on CUDA one sqrt. No host sync.
    """
    tensors = list(tensors)
    if not tensors or tensors[0].device.type != "cpu":
        return list(torch._foreach_sqrt(tensors))
    return [r.to(torch.float32) for r in torch._foreach_sqrt([t.to(torch.float64) for t in tensors])]

def fma_rounded(a: Sequence[torch.Tensor], b: torch.Tensor, c: Sequence[torch.Tensor]) -> list:
    """``a * b + c`` per fp32 tensor with one rounding, as a fused multiply-add: the SGD kernels'
    (and torch's ``add(alpha=)``) parameter update with a learning rate held in a tensor, for
    the plain-torch paths that must give their numbers.

    torch has no elementwise fma; ``c + a * b`` rounds twice (the product, then the sum) and
    differs in the last bit for a few percent of elements. Here the product is taken in fp64,
    where it is exact (24 + 24 bits), and added with its rounding error kept (TwoSum). The fp64
    sum rounded to fp32 is the correctly rounded result unless it falls exactly halfway between
    two fp32 numbers: then the error's sign picks the side.

    Args:
      a: fp32 tensors on one device.
      b: a 0-d fp32 tensor on that device (the negated learning rate).
      c: fp32 tensors shaped like ``a``.

    Returns:
      A list of new fp32 tensors.

    Example:
      >>> a, c = [torch.tensor([1.0 + 2.0 ** -23])], [torch.tensor([-1.0])]
      >>> b = torch.tensor(1.0 - 2.0 ** -23)
      >>> fma_rounded(a, b, c)[0].item() == -(2.0 ** -46), (c[0] + a[0] * b).item()   # two roundings: 0
      (True, 0.0)

    Cost: per tensor about ten fp64 elementwise ops (the plain-torch paths only; the kernels
    fuse it in registers). No host sync.
    """
    out = []
    b64 = b.reshape(()).to(torch.float64)
    for x, y in zip(a, c):
        prod = x.to(torch.float64) * b64  # exact
        y64 = y.to(torch.float64)
        s = prod + y64
        bv = s - prod
        err = (prod - (s - bv)) + (y64 - bv)  # s + err == prod + y exactly (TwoSum)
        r = s.to(torch.float32)
        # Past fp32's largest number the rounding went to inf: its midpoint with the largest
        # number is taken against 2**128, where the next exponent would put it.
        r64 = torch.where(r.isinf() & s.isfinite(), torch.copysign(s.new_tensor(2.0 ** 128), s), r.to(torch.float64))
        up, down = torch.nextafter(r, r.new_tensor(math.inf)), torch.nextafter(r, r.new_tensor(-math.inf))
        # s halfway between r and a neighbour: round towards the exact value's side.
        r = torch.where((s > r64) & (s == (r64 + up.to(torch.float64)) / 2) & (err > 0), up, r)
        r = torch.where((s < r64) & (s == (r64 + down.to(torch.float64)) / 2) & (err < 0), down, r)
        out.append(r)
    return out


def _fresh(tensors) -> list:
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors]



def _ref_check_norm(tensors, inv_scale=None, per_leaf: bool = False):
    tensors = list(tensors)
    dev = _list_device(tensors, inv_scale)
    finite = torch.ones((), dtype=torch.bool, device=dev)
    norm = torch.zeros((), dtype=torch.float32, device=dev)
    leaf = torch.zeros(len(tensors) if per_leaf else 0, dtype=torch.bool, device=dev)
    nonempty = [t for t in tensors if t.numel() > 0]
    if nonempty:
        # the squares of fp32(x * inv_scale), summed in float64: no overflow for finite values
        us = [t.to(torch.float32) if t.dtype != torch.float64 else t for t in nonempty]
        if inv_scale is not None:
            inv = inv_scale.reshape(()).to(dev, torch.float32)
            us = [u * inv if u.dtype == torch.float32 else u * inv.to(torch.float64) for u in us]
        sq = torch.stack([u.to(torch.float64).square().sum() for u in us]).sum()
        norm = sq.sqrt().to(torch.float32)
        finite, _, leaf = _ref_check(tensors, per_leaf)
    return finite, norm, leaf

def _ones_like_step(step: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=step.device)



def _ref_apply_updates(params, updates) -> list:
    params, updates = list(params), list(updates)
    out: list = [None] * len(params)
    f32 = [i for i, (p, u) in enumerate(zip(params, updates)) if p.dtype == torch.float32]
    if f32:
        for i, r in zip(f32, torch._foreach_add([params[i] for i in f32],
                                                [updates[i].to(torch.float32) for i in f32])):
            out[i] = r
    for i, (p, u) in enumerate(zip(params, updates)):
        if out[i] is None:  # low precision: add in fp32, round once
            out[i] = (p.to(torch.float32) + u.to(torch.float32)).to(p.dtype)
    return out

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
