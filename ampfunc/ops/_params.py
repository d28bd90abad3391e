"""Per-parameter bookkeeping in C: ``.grad`` reads and writes, version counters, the bound
signature of ``ModuleTrainer(flat=True)``, the tensor checks of :func:`kernel_ready`, and the CPU
output pool's controls. Each one loops in the compiled library when it is loaded, in Python
otherwise.
"""

from __future__ import annotations

import operator

import torch

from ampfunc.ops import _loading
from ampfunc.ops._loading import _ensure, _transforms_active, load
from ampfunc.ops._validation import _ANY

_GRAD = operator.attrgetter("grad")

def grads_of(params: list) -> list:
    """``[p.grad for p in params]`` (None where a param has none), read in C by the compiled
    library when it is loaded. Cost: about 20 ns a param (0.2 us in Python); no host sync."""
    door = _loading._DIRECT[0]
    return door.grads_of(params) if door is not None and type(params) is list else list(map(_GRAD, params))

def clear_grads(params: list) -> None:
    """``p.grad = None`` for every param, in C when the compiled library is loaded. Cost: as
    :func:`grads_of`; no host sync."""
    door = _loading._DIRECT[0]
    if door is not None and type(params) is list:
        door.clear_grads(params)
        return
    for p in params:
        p.grad = None

def set_grads(params: list, grads: list) -> None:
    """``p.grad = g`` for every pair (same shapes, dtypes and devices), in C when the compiled
    library is loaded. Cost: about 20 ns a param; no host sync."""
    door = _loading._DIRECT[0]
    if door is not None and type(params) is list and type(grads) is list:
        door.set_grads(params, grads)
        return
    for p, g in zip(params, grads, strict=True):
        p.grad = g

def bound_signature(params: list):
    """What ``ModuleTrainer(flat=True)`` checks its params against every step
    (:func:`check_bound`): per param its data pointer, element count, dtype and ``.grad``,
    recorded now. Cost: one C loop over the params (Python: ~1 us a param); no host sync."""
    _ensure()  # the signature's form follows the door: load it now, not at the first step
    door = _loading._DIRECT[0]
    if door is not None and type(params) is list:
        return door.bound_signature(params)
    return [(p.data_ptr(), p.numel(), p.dtype, p.grad) for p in params]

def check_bound(params: list, signature) -> tuple[list, list]:
    """``(moved, unbound)``: the indices of the params whose data (pointer, element count,
    dtype) and whose ``.grad`` (the very tensor) differ from ``signature``
    (:func:`bound_signature`). One C loop touching only the params when the compiled library
    is loaded. Cost: about 0.1 us a param on a cold 10,000-param model; no host sync."""
    door = _loading._DIRECT[0]
    if door is not None and type(params) is list and isinstance(signature, torch.Tensor):
        moved, unbound = door.check_bound(params, signature)
        return list(moved), list(unbound)
    moved, unbound = [], []
    for i, (p, (ptr, numel, dtype, grad)) in enumerate(zip(params, signature)):
        if p.data_ptr() != ptr or p.numel() != numel or p.dtype != dtype:
            moved.append(i)
        if p.grad is not grad:
            unbound.append(i)
    return moved, unbound

def bump_versions(tensors: list) -> None:
    """Bumps the autograd version counter of every tensor, as an in-place torch op would
    (:func:`torch.autograd.graph.increment_version`; inference tensors have none): for writes
    autograd cannot see, e.g. through views that do not share a tensor's counter.
    Cost: about 25 ns a tensor in the compiled library's C loop (about 65 through torch's); no
    device work, no host sync."""
    door = _loading._DIRECT[0]
    if door is not None and type(tensors) is list:
        door.bump_versions(tensors)
        return
    torch.autograd.graph.increment_version(list(tensors))

def requires_grad_changed(tensors: list, expected: bytes) -> int:
    """The first index whose ``requires_grad`` differs from ``expected`` (one byte per tensor,
    0 or 1), or -1. Cost: one C loop in the compiled library (about 20 ns a tensor, a third of
    Python's attribute reads); no host sync."""
    door = _loading._DIRECT[0]
    if door is not None and type(tensors) is list:
        return int(door.requires_grad_changed(tensors, expected))
    return next((i for i, (t, e) in enumerate(zip(tensors, expected)) if t.requires_grad != bool(e)), -1)

def empty_cache() -> int:
    """Gives the CPU output pool's cached blocks back to the system.

    The out-of-place CPU kernels (``step``, ``update``, ``apply_updates``, ``unscale``) take their
    outputs from a pool of blocks that earlier outputs held, so a training loop's steady state
    faults in no fresh pages; the pool holds at most ``AMPFUNC_CPU_POOL_MB`` (default 2048, 0
    turns it off). Call this after a run on the pure path to hand that memory back.

    Returns:
      The number of bytes freed (0 without the compiled kernels).

    Example:
      >>> ampfunc.ops.empty_cache()  # doctest: +SKIP
      201326592

    Cost: frees each cached block; no device work, no host sync.
    """
    load()
    return int(_loading._DIRECT[0].empty_cache()) if _loading._DIRECT[0] is not None else 0

def pool_stats() -> dict:
    """The CPU output pool's counters: ``cached_bytes``, ``limit_bytes``, ``hits`` (outputs served
    from the pool), ``misses`` (outputs that took fresh memory). Empty without the compiled
    kernels. Cost: a lock and four reads."""
    load()
    return dict(_loading._DIRECT[0].pool_stats()) if _loading._DIRECT[0] is not None else {}

_PLAIN = (torch.Tensor, torch.nn.Parameter)

def kernel_ready(device: torch.device, fp32_lists=(), float_lists=()) -> bool:
    """Whether the list ops can serve these tensors as they are: every tensor a plain tensor on
    ``device`` (CPU or CUDA; no subclass, no torch.func transform active, none requiring grad
    while grad mode is on), those of ``fp32_lists`` float32 and those of ``float_lists``
    float32/float16/bfloat16. A few attribute reads per tensor (no host sync, no allocation);
    shapes, layouts and overlaps are left to the ops' own validation. Callers take their
    generic path when it is False, so unusual trees keep today's behaviour."""
    if device is None or device.type not in ("cpu", "cuda") or _transforms_active():
        return False
    where = -1 if device.type == "cpu" else (device.index if device.index is not None else torch.cuda.current_device())
    grad_on = torch.is_grad_enabled()
    door = _loading._DIRECT[0]
    if door is not None:  # the same loop in C: ~20 ns a tensor instead of ~300
        return door.kernel_ready(_PLAIN, where, grad_on, list(fp32_lists), list(float_lists))
    plain, f32, anyf = _PLAIN, torch.float32, _ANY
    for ts in fp32_lists:
        for t in ts:
            if type(t) not in plain or t.dtype is not f32 or t.get_device() != where or (grad_on and t.requires_grad):
                return False
    for ts in float_lists:
        for t in ts:
            if type(t) not in plain or t.dtype not in anyf or t.get_device() != where or (grad_on and t.requires_grad):
                return False
    return True

def held_lists(lists: list):
    """Holds lists that an in-place step passes on every call (the params, the master, the
    moments), described, for the compiled library's direct door.

    While the returned object lives, a call that passes one of these very list objects, still
    holding the same tensor objects, reuses their descriptions once each tensor is found
    unchanged: same TensorImpl, key set, storage, allocation, deleter, size in bytes, offset,
    sizes, dtype and version counter. No reference is taken on each tensor and nothing is
    described anew. A list whose tensors changed (a ``.data`` assignment, ``set_``, ``resize_``,
    a resized storage) is described anew and held as it is now. Validation still runs on every
    call, so results and errors are those of the same call without it. The engine's in-place
    fused step holds its lists itself.

    Args:
      lists: Python lists of tensors. A list held by another living object, or holding anything
        but tensors or a copy-on-write storage, is left out.

    Returns:
      The holder (``len()`` says how many lists it holds; drop it to let the lists and their
      tensors go), or None where no direct door is loaded (the reference backend).

    Example:
      >>> import torch
      >>> from ampfunc import ops
      >>> p, g = [torch.ones(3)], [torch.ones(3)]
      >>> m, v = [torch.zeros(3)], [torch.zeros(3)]
      >>> held = ops.held_lists([p, m, v])
      >>> finite = ops.adam_step_checked_(p, g, m, v, None, None, torch.zeros(()), torch.ones(()), lr=0.1)
      >>> bool(finite), round(p[0][0].item(), 4)
      (True, 0.9)

    Cost: one describe pass over the tensors when made; each call then checks each held tensor
    (its Python object, TensorImpl and storage, prefetched) instead of describing it. No device
    work, no host sync."""
    _loading._ensure()
    door = _loading._DIRECT[0]
    return None if door is None else door.HeldLists(list(lists))
