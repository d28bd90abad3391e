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

import contextlib
import gc
import math
import operator
import re
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
    "check_norm",
    "sgd_update",
    "adam_update",
    "apply_updates",
    "error_items",
    "kernel_ready",
    "empty_cache",
    "pool_stats",
    "grads_of",
    "clear_grads",
    "bound_signature",
    "check_bound",
    "set_grads",
    "bump_versions",
    "requires_grad_changed",
    "sqrt_rounded",
    "fma_rounded",
    "overlapping_pair",
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

        direct = _build.env_flag("AMPFUNC_DIRECT", default=True)  # read first: a misspelling loads nothing
        _BACKEND[0], _BACKEND[1] = _build.load()
        if _BACKEND[0] != "reference" and direct:
            _DIRECT[0] = _build.direct_module()
    return _BACKEND[0]


def backend() -> str:
    """Which implementation serves the ops: ``"cpu+cuda"`` or ``"cpu"`` (compiled kernels; CUDA
    tensors use the reference under ``"cpu"``) or ``"reference"`` (plain torch everywhere)."""
    return load()


def backend_reason() -> str | None:
    """Why the compiled kernels are (partly) missing, or None."""
    load()
    return _BACKEND[1]


_DIRECT: list = [None]  # the direct door of the loaded library (ext/bindings.cpp, namespace direct)


def _call(name: str, *args):
    """Op ``name`` on ``args`` (the schema's arguments, lists as Python lists).

    Eager calls whose tensors are all plain dense CPU tensors go through the compiled library's
    direct door, which runs the same implementation without the dispatcher's per-tensor boxing
    (about 0.35 us per tensor per list); it hands back anything else (tensor subclasses, modes,
    autograd, other devices) as ``NotImplemented`` and the call goes to ``torch.ops.ampfunc``.
    Traced calls (``torch.compile``) always go to ``torch.ops.ampfunc``.
    """
    out = _through_door(name, args)
    if out is not NotImplemented:
        return out
    door = _DIRECT[0]
    if name in _PACKING_OPS and door is not None and not _is_compiling() and _plain_cuda(args[0] or args[1]):
        # An eager CUDA call: its new state lists may be views of one block each (packed
        # outputs); a compiled graph's calls never set this (its outputs may not alias).
        prev = door.pack_outputs(True)
        try:
            return getattr(torch.ops.ampfunc, name)(*args)
        finally:
            door.pack_outputs(prev)
    return getattr(torch.ops.ampfunc, name)(*args)


def _through_door(name: str, args: tuple):
    """The direct door's ``name`` on ``args`` for an eager call, else ``NotImplemented`` (no
    library loaded, a traced call, or tensors the door hands back)."""
    door = _DIRECT[0]
    if door is None or _is_compiling():
        return NotImplemented
    return getattr(door, name)(*args)


def _finite_for(grads: list, grad_scale: torch.Tensor) -> torch.Tensor:
    """The checked steps' flag where the door does not serve them: :func:`check`'s of
    ``grads`` and-ed with ``grad_scale`` not being NaN (one read pass)."""
    return check(grads)[0] & ~grad_scale.isnan() if grads else ~grad_scale.isnan()


# The out-of-place optimizer ops whose new state lists and updates come back packed in eager mode.
_PACKING_OPS = frozenset({"adam_step", "sgd_step", "adam_update", "sgd_update"})


def _plain_cuda(tensors) -> bool:
    """Whether an op's first list holds plain CUDA tensors and no dispatch mode is active."""
    t = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else None
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda and not torch._is_functional_tensor(t)
            and torch._C._len_torch_dispatch_stack() == 0)


_GRAD = operator.attrgetter("grad")


def grads_of(params: list) -> list:
    """``[p.grad for p in params]`` (None where a param has none), read in C by the compiled
    library when it is loaded. Cost: about 20 ns a param (0.2 us in Python); no host sync."""
    door = _DIRECT[0]
    return door.grads_of(params) if door is not None and type(params) is list else list(map(_GRAD, params))


def clear_grads(params: list) -> None:
    """``p.grad = None`` for every param, in C when the compiled library is loaded. Cost: as
    :func:`grads_of`; no host sync."""
    door = _DIRECT[0]
    if door is not None and type(params) is list:
        door.clear_grads(params)
        return
    for p in params:
        p.grad = None


def set_grads(params: list, grads: list) -> None:
    """``p.grad = g`` for every pair (same shapes, dtypes and devices), in C when the compiled
    library is loaded. Cost: about 20 ns a param; no host sync."""
    door = _DIRECT[0]
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
    door = _DIRECT[0]
    if door is not None and type(params) is list:
        return door.bound_signature(params)
    return [(p.data_ptr(), p.numel(), p.dtype, p.grad) for p in params]


def check_bound(params: list, signature) -> tuple[list, list]:
    """``(moved, unbound)``: the indices of the params whose data (pointer, element count,
    dtype) and whose ``.grad`` (the very tensor) differ from ``signature``
    (:func:`bound_signature`). One C loop touching only the params when the compiled library
    is loaded. Cost: about 0.1 us a param on a cold 10,000-param model; no host sync."""
    door = _DIRECT[0]
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
    door = _DIRECT[0]
    if door is not None and type(tensors) is list:
        door.bump_versions(tensors)
        return
    torch.autograd.graph.increment_version(list(tensors))


def requires_grad_changed(tensors: list, expected: bytes) -> int:
    """The first index whose ``requires_grad`` differs from ``expected`` (one byte per tensor,
    0 or 1), or -1. Cost: one C loop in the compiled library (about 20 ns a tensor, a third of
    Python's attribute reads); no host sync."""
    door = _DIRECT[0]
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
    return int(_DIRECT[0].empty_cache()) if _DIRECT[0] is not None else 0


def pool_stats() -> dict:
    """The CPU output pool's counters: ``cached_bytes``, ``limit_bytes``, ``hits`` (outputs served
    from the pool), ``misses`` (outputs that took fresh memory). Empty without the compiled
    kernels. Cost: a lock and four reads."""
    load()
    return dict(_DIRECT[0].pool_stats()) if _DIRECT[0] is not None else {}


def _is_compiling() -> bool:
    fn = getattr(torch.compiler, "is_compiling", None)
    return bool(fn()) if fn is not None else False


def _ensure() -> None:
    # The build must never start inside a torch.compile trace: there the ops are traced through
    # their fake kernels, and whichever kernel is registered at run time serves the call.
    if _BACKEND[0] is None and not _is_compiling():
        load()


def _seq(xs):
    """A list or tuple as it is (the ops take either, and never keep it); anything else as a list."""
    return xs if type(xs) in (list, tuple) else list(xs)


def _as_list(xs):
    """:func:`_seq`, with None as the empty list (an optional list argument)."""
    return [] if xs is None else _seq(xs)


def _split_lr(lr):
    """``(float lr, None)`` for a number, ``(0.0, 0-d fp32 tensor)`` for a tensor."""
    if isinstance(lr, torch.Tensor):
        return 0.0, lr.reshape(()).to(torch.float32)
    return float(lr), None


# ----------------------------------------------------------------------------------------------
# Validation: the reference path's mirror of ext/bindings.cpp's `validate`, check for check and
# word for word, so both backends refuse the same calls with the same error type and message:
#     "ampfunc: <list>[<index>] <what is wrong> (<op>)"
# ValueError for counts, shapes, devices and overlapping memory, TypeError for dtypes and
# layouts. Every check runs before the first write. :func:`error_items` parses a message.
# ----------------------------------------------------------------------------------------------

_ANY = (torch.float32, torch.float16, torch.bfloat16)
_FP32 = (torch.float32,)
_ANY64 = _ANY + (torch.float64,)
_DT_WORDS = {_ANY: "float32, float16 or bfloat16", _FP32: "float32", _ANY64: "float32, float16, bfloat16 or float64"}
_ERROR_ITEM = re.compile(r"\b([a-z_]+)\[(\d+)\]")


def error_items(message: str) -> list:
    """``[(list_name, index), ...]`` named by an ampfunc op's validation error, in order (e.g.
    ``[("grads", 2), ("params", 2)]`` for a shape mismatch): how a caller maps the error back to
    its leaf paths, on the error path only."""
    text = str(message)
    if not text.startswith("ampfunc: "):
        return []
    return [(name, int(i)) for name, i in _ERROR_ITEM.findall(text.rsplit(" (", 1)[0])]


def _item(name: str, i: int) -> str:
    return name if i < 0 else f"{name}[{i}]"


def _check_tensor(op, name, i, t, dts, dev) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ampfunc: {_item(name, i)} is {type(t).__name__}, not a tensor ({op})")
    if t.layout != torch.strided:
        raise TypeError(f"ampfunc: {_item(name, i)} has layout {t.layout}; ampfunc takes dense (strided) tensors "
                        f"({op})")
    if t.device.type == "meta" and dev.type != "meta":
        raise ValueError(f"ampfunc: {_item(name, i)} is on the meta device (it holds no data) ({op})")
    if t.device != dev:
        raise ValueError(f"ampfunc: {_item(name, i)} is on {t.device} but the call's tensors are on {dev}; "
                         f"one device per call ({op})")
    if t.dtype not in dts:
        raise TypeError(f"ampfunc: {_item(name, i)} has dtype {t.dtype}; {name} take {_DT_WORDS[dts]} ({op})")


def _self_overlaps(t: torch.Tensor) -> bool:
    if t.numel() <= 1 or t.is_contiguous():
        return False
    dims = sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, end)`` a non-empty strided tensor's elements lie in (strides >= 0)."""
    last = t.numel() - 1 if t.is_contiguous() else sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    return lo, lo + (last + 1) * t.element_size()


def _element_addresses(t: torch.Tensor, lo: int, unit: int) -> torch.Tensor:
    """The addresses of ``t``'s elements in units of ``unit`` bytes (every byte of each element
    when ``unit`` is 1 and the elements are wider), as a 1-d int64 CPU tensor."""
    off = torch.zeros((), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    size = t.element_size()
    addr = lo + off.flatten() * size
    if unit == size:
        return addr // unit
    return (addr.unsqueeze(-1) + torch.arange(size, dtype=torch.int64)).flatten()


# Element addresses are sorted (about 100 bytes of host memory per element, all told) only for
# runs of up to this many elements; larger runs are decided from their layouts (_by_layout).
_EXACT_ELEMENTS = 1 << 22


def _lattice_shares(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether ``a`` and ``b``, of one element size, shape and strides (neither overlapping
    itself), share an element: whether their offset is a difference of two of ``a``'s element
    offsets, found dim by dim from the largest stride (each stride passes what the dims below
    reach, so at most two candidates a dim). None when the offset is not whole elements."""
    size = a.element_size()
    gap = b.data_ptr() - a.data_ptr()
    if gap % size:
        return None
    dims = sorted((st, n) for n, st in zip(a.shape, a.stride()) if n > 1)

    def reachable(delta: int, k: int) -> bool:  # delta from the first k dims
        if k == 0:
            return delta == 0
        stride, n = dims[k - 1]
        below = sum(st * (m - 1) for st, m in dims[:k - 1])
        first, last = -((below - delta) // stride), (delta + below) // stride
        return any(reachable(delta - c * stride, k - 1) for c in range(max(first, 1 - n), min(last, n - 1) + 1))

    return reachable(gap // size, len(dims))


def _pair(a: tuple, b: tuple) -> tuple[int, int]:
    """The tensor indices of two ``(lo, hi, index, tensor)`` spans, in ascending order."""
    return tuple(sorted((a[2], b[2])))


def _by_layout(group: list) -> tuple[int, int] | None:
    """:func:`_shared_in` for a run too large to sort: members of one layout (the columns of a
    large matrix) are compared pair by pair from their offsets; any other run is taken as
    overlapping (as the byte-range check took it), its first two members named."""
    first = group[0][3]
    layout = (first.element_size(), tuple(first.shape), first.stride())
    if all((t.element_size(), tuple(t.shape), t.stride()) == layout and not _self_overlaps(t) for *_, t in group):
        for i in range(len(group)):
            for j in range(i + 1, len(group)):
                shares = _lattice_shares(group[i][3], group[j][3])
                if shares is None or shares:
                    return _pair(group[i], group[j])
        return None
    return _pair(group[0], group[1])


def _shared_in(group: list) -> tuple[int, int] | None:
    """The first two members of ``group`` (``(lo, hi, index, tensor)`` items whose spans chain
    into one run of memory) that share a byte, element by element, or None."""
    if sum(t.numel() for *_, t in group) > _EXACT_ELEMENTS:
        return _by_layout(group)
    size = group[0][3].element_size()
    unit = size if all(t.element_size() == size and lo % size == group[0][0] % size for lo, _, _, t in group) else 1
    addrs = torch.cat([_element_addresses(t, lo, unit) for lo, _, _, t in group])
    owners = torch.cat([torch.full((t.numel() * (t.element_size() // unit),), k, dtype=torch.int64)
                        for k, (_, _, _, t) in enumerate(group)])
    addrs, order = addrs.sort(stable=True)
    same = (addrs[1:] == addrs[:-1]).nonzero()
    if same.numel() == 0:
        return None
    j = int(same[0, 0])
    return _pair(group[int(owners[order[j]])], group[int(owners[order[j + 1]])])


def overlapping_pair(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The indices ``(i, j)``, ``i < j``, of two tensors of ``tensors`` that share memory, or None.

    Exact for strided tensors: the columns of one matrix, or its even and odd elements, share
    no element and are not reported (as torch allows them), while two views of one column are.
    Empty tensors and tensors on the meta device (no memory) share nothing; a tensor
    overlapping itself is not looked for here.

    Args:
      tensors: strided tensors, any devices (only addresses are compared, never values).

    Returns:
      The first pair found (by address), or None when every element lies in memory of its own.

    Cost: a sort of the tensors' byte spans; where spans intersect and a tensor among them is
    not contiguous, one sort of those tensors' element addresses (host memory, about 100 bytes
    per element) when they hold at most 2**22 elements, else a test from their strides and
    offsets (tensors of one shape and strides, e.g. the columns of one matrix; others of that
    size whose spans interleave are reported as sharing). No host sync.
    """
    spans = sorted(((*_extent(t), i, t) for i, t in enumerate(tensors) if t.numel() > 0 and not t.is_meta),
                   key=lambda s: (s[0], s[2]))
    group, hi = [], 0
    for span in spans + [None]:
        if span is not None and group and span[0] < hi:
            group.append(span)
            hi = max(hi, span[1])
            continue
        if len(group) > 1:
            if all(t.is_contiguous() for *_, t in group):
                # contiguous spans that intersect share bytes: the first two are a pair
                return _pair(group[0], group[1])
            found = _shared_in(group)
            if found is not None:
                return found
        if span is not None:
            group, hi = [span], span[1]
    return None


def _validate(op: str, dev: torch.device, lists, written_scalars=()) -> None:
    """``lists``: ``[(name, tensors, dtypes, written), ...]``, the first the reference list."""
    ref_name, ref = lists[0][0], lists[0][1]
    for name, ts, _, _ in lists:
        if len(ts) != len(ref):
            raise ValueError(f"ampfunc: {name} has {len(ts)} tensors but {ref_name} has {len(ref)} ({op})")
    for i in range(len(ref)):
        for k, (name, ts, dts, written) in enumerate(lists):
            t = ts[i]
            if t is None:
                raise ValueError(f"ampfunc: {name}[{i}] is undefined (None) ({op})")
            _check_tensor(op, name, i, t, dts, dev)
            if k > 0 and t.shape != ref[i].shape:
                raise ValueError(f"ampfunc: {name}[{i}] has shape {tuple(t.shape)} but {ref_name}[{i}] has shape "
                                 f"{tuple(ref[i].shape)} ({op})")
            if written and t.is_inference() and not torch.is_inference_mode_enabled():
                raise ValueError(f"ampfunc: {name}[{i}] is an inference tensor (made under torch.inference_mode()); "
                                 f"an in-place op cannot update it outside inference mode: pass a copy made "
                                 f"outside it ({op})")
            if written and _self_overlaps(t):
                raise ValueError(f"ampfunc: {name}[{i}] has elements that share memory (an expand()ed or stride-0 "
                                 f"view); an in-place op needs distinct elements: clone it ({op})")
    if dev.type == "meta" or (not written_scalars and not any(w for *_, w in lists)):
        return
    written = [(name, i, t) for name, ts, _, w in lists if w for i, t in enumerate(ts)]
    written += [(name, -1, t) for name, t in written_scalars]
    pair = overlapping_pair([t for *_, t in written])
    if pair is not None:
        (a_name, a_i, _), (b_name, b_i, _) = written[pair[0]], written[pair[1]]
        raise ValueError(f"ampfunc: {_item(a_name, a_i)} and {_item(b_name, b_i)} overlap in memory; the tensors "
                         f"an in-place op writes must be distinct ({op})")


def _check_scalar(op, what, t, dtype, dev) -> None:
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise ValueError(f"ampfunc: {what} must be a one-element tensor ({op})")
    if t.layout != torch.strided:
        raise TypeError(f"ampfunc: {what} has layout {t.layout}; ampfunc takes dense (strided) tensors ({op})")
    if t.dtype != dtype:
        raise TypeError(f"ampfunc: {what} has dtype {t.dtype}; expected {dtype} ({op})")
    if t.device != dev:
        raise ValueError(f"ampfunc: {what} is on {t.device} but the call's tensors are on {dev}; one device per "
                         f"call ({op})")


def _list_device(*candidates) -> torch.device:
    """The device of a call: its first list tensor's (not counting meta tensors, which are
    refused among real ones), else the first given 0-d tensor's."""
    meta = None
    for c in candidates:
        for t in (c if isinstance(c, (list, tuple)) else [c]):
            if isinstance(t, torch.Tensor):
                if t.device.type != "meta":
                    return t.device
                meta = t.device
    return meta if meta is not None else torch.device("cpu")


def _fake_devices(op: str, lists, scalars=()) -> None:
    """The fake kernels' share of validation (they also serve real meta tensors): one device per
    call, so a meta tensor among real ones is refused rather than answered with empty memory.
    ``scalars`` are the call's 0-d arguments ``[(name, tensor or None)]``: one of them on the
    meta device routes the whole call here, and would make a step a silent no-op."""
    dev = _list_device(*[ts for _, ts in lists], *[t for _, t in scalars if t is not None])
    for name, ts in lists:
        for i, t in enumerate(ts):
            if isinstance(t, torch.Tensor) and t.device != dev:
                _check_tensor(op, name, i, t, (t.dtype,), dev)
    for name, t in scalars:
        if isinstance(t, torch.Tensor) and t.device != dev:
            _check_tensor(op, name, -1, t, (t.dtype,), dev)


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
                # finiteness in the tensor's own dtype: a finite fp64 1e300 is inf in fp32
                maxabs[i] = m.isfinite().to(dev)
                norms[i] = n.to(dev)
        leaf_finite = torch.stack([maxabs[i] for i in nonempty])
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
        out = _call("check", tensors, per_leaf)
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
    with _gc_paused(len(tensors)):
        outs, finite = _call("unscale", tensors, inv_scale)
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
    return _call("unscale_", tensors, inv_scale)


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
        else:  # a schedule's value, on the device; fused, as the kernels and torch's add(alpha=)
            new_p = fma_rounded(g, lr_tensor.reshape(()).to(torch.float32).neg(), params)
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
    _call("sgd_step_", _seq(params), _seq(grads), _as_list(momentum_buffers), _as_list(model_params),
                                step, grad_scale, finite, lr, lr_tensor, float(weight_decay), float(momentum),
                                float(dampening), bool(nesterov), bool(maximize))


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
    _call("adam_step_", _seq(params), _seq(grads), _seq(exp_avgs), _seq(exp_avg_sqs),
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
    to new (contiguous) tensors; a skipped step costs one copy instead. No host sync; on CUDA the
    same one pass (the in-place kernel's arithmetic, written to the new tensors).
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    params = _seq(params)
    with _gc_paused(len(params)):
        p, b, m, s = _call("sgd_step", params, _seq(grads), _as_list(momentum_buffers) if momentum != 0 else [],
                           _as_list(model_params), step, grad_scale, finite, lr, lr_tensor, float(weight_decay),
                           float(momentum), float(dampening), bool(nesterov), bool(maximize))
        return list(p), list(b), list(m), s


def sgd_step_checked(params, grads, momentum_buffers, model_params, step, grad_scale, *, lr,
                     weight_decay: float = 0.0, momentum: float = 0.0, dampening: float = 0.0,
                     nesterov: bool = False, maximize: bool = False):
    """:func:`sgd_step` that takes its own skip decision: ``(new_params, new_momentum_buffers,
    new_model_params, new_step, finite)``, bit for bit :func:`check` (and-ed with ``grad_scale``
    not being NaN) followed by :func:`sgd_step`, as :func:`adam_step_checked` is for Adam.
    Cost (eager CPU): one pass instead of two; a skipped step adds a copy. No host sync.
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    params, grads = _seq(params), _seq(grads)
    args = (params, grads, _as_list(momentum_buffers) if momentum != 0 else [], _as_list(model_params), step,
            grad_scale, lr, lr_tensor, float(weight_decay), float(momentum), float(dampening), bool(nesterov),
            bool(maximize))
    with _gc_paused(len(params)):
        out = _through_door("sgd_step_checked", args)
        if out is not NotImplemented:
            return list(out[0]), list(out[1]), list(out[2]), out[3], out[4]
    finite = _finite_for(grads, grad_scale)
    return sgd_step(*args[:6], finite, lr=args[6] if lr_tensor is None else lr_tensor, weight_decay=weight_decay,
                    momentum=momentum, dampening=dampening, nesterov=nesterov, maximize=maximize) + (finite,)


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
    pass -- the in-place op's traffic; a skipped step costs one copy instead. No host sync; on
    CUDA the same one pass (the in-place kernel's arithmetic, written to the new tensors).
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    params = _seq(params)
    with _gc_paused(len(params)):
        out = _call("adam_step", params, _seq(grads), _seq(exp_avgs), _seq(exp_avg_sqs),
                    _as_list(max_exp_avg_sqs) if amsgrad else [], _as_list(model_params), step, grad_scale, finite,
                    lr, lr_tensor, float(beta1), float(beta2), float(eps), float(weight_decay), bool(amsgrad),
                    bool(decoupled_weight_decay), bool(maximize))
        return tuple(list(x) for x in out[:5]) + (out[5],)


def adam_step_checked(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, *,
                      lr, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                      amsgrad: bool = False, decoupled_weight_decay: bool = False, maximize: bool = False):
    """:func:`adam_step` that takes its own skip decision: ``(new_params, new_exp_avgs,
    new_exp_avg_sqs, new_max_exp_avg_sqs, new_model_params, new_step, finite)``.

    ``finite`` is :func:`check`'s flag of ``grads`` and-ed with ``grad_scale`` not being NaN,
    and the outputs are :func:`adam_step`'s for that flag (copies of the inputs on a skipped
    step), bit for bit: this is ``check`` followed by ``adam_step``, which is what runs on CUDA
    and under ``torch.compile``. Eager CPU calls run it as one pass: an out-of-place step leaves
    its inputs intact, so the finiteness of the gradients can be read in the optimizer's pass
    and the decision taken after it. Cost (CPU): one pass reading g, p, m, v and writing the new
    p, m, v, instead of a read of g and then that pass; a skipped step adds a copy. No host sync.
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    params, grads, vmax = _seq(params), _seq(grads), _as_list(max_exp_avg_sqs) if amsgrad else []
    args = (params, grads, _seq(exp_avgs), _seq(exp_avg_sqs), vmax, _as_list(model_params), step, grad_scale, lr,
            lr_tensor, float(beta1), float(beta2), float(eps), float(weight_decay), bool(amsgrad),
            bool(decoupled_weight_decay), bool(maximize))
    with _gc_paused(len(params)):
        out = _through_door("adam_step_checked", args)
        if out is not NotImplemented:
            return tuple(list(x) for x in out[:5]) + (out[5], out[6])
    finite = _finite_for(grads, grad_scale)
    return adam_step(*args[:8], finite, lr=args[8] if lr_tensor is None else lr_tensor, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                     decoupled_weight_decay=decoupled_weight_decay, maximize=maximize) + (finite,)


# ----------------------------------------------------------------------------------------------
# Robust norm
# ----------------------------------------------------------------------------------------------


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


def check_norm(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor | None = None, per_leaf: bool = False):
    """``(finite, norm)``: 0-d bool (every element finite) and the 0-d fp32 global L2 norm of
    ``t * inv_scale`` over all tensors (of ``t`` when ``inv_scale`` is None).

    The robust twin of :func:`check` for clipping: each product is taken in fp32 as
    :func:`unscale` takes it, and the squares are summed so that the sum cannot overflow while
    every value is finite (fp32 blocks, a block that overflows recomputed in float64, combined
    in float64), so the norm is finite whenever it fits in fp32 -- e.g. fp32 gradients of
    1e20 under a loss scale of 2**16. ``check_norm(scaled, inv_scale)`` and
    ``check_norm(unscale(scaled, inv_scale)[0])`` are the same number (the same products, the
    same sums), so a fused clip and the generic one agree. The fp32 squares of values below
    about 1e-19 lose precision and below about 1e-23 vanish (the compiled kernels recompute a
    block in float64 when it overflows, not when it underflows): a norm under about 1e-19 reads
    low or 0, which leaves a clipping coefficient at 1 either way. ``finite`` is judged on the
    inputs. With ``per_leaf=True`` a third result flags the tensors holding a non-finite value.
    Cost: one read pass, no writes, no host sync (CUDA: the same sums on the device, fp32
    blocks, an overflowing block re-read once and summed in double, combined in double).
    """
    tensors = list(tensors)
    if not tensors:
        out = _ref_check_norm(tensors, inv_scale, per_leaf)
    else:
        _ensure()
        out = _call("check_norm", tensors, inv_scale, per_leaf)
    return tuple(out) if per_leaf else (out[0], out[1])


# ----------------------------------------------------------------------------------------------
# Pure optimizer updates (optax form) and apply_updates
# ----------------------------------------------------------------------------------------------


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _transforms_active() -> bool:
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


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
    door = _DIRECT[0]
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


@contextlib.contextmanager
def _gc_paused(n: int):
    """Pauses Python's cyclic garbage collector while an op hands back ``n`` new tensors.

    Wrapping tens of thousands of outputs as Python objects would otherwise trigger dozens of
    collections, some of them full ones that walk every live tensor: on a 10,000-leaf tree that
    costs more than the kernel. The outputs hold no reference cycles, so nothing is lost; the
    collector runs as usual afterwards. Not under torch.compile tracing (nothing is allocated)."""
    if n < 512 or not gc.isenabled() or _is_compiling():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _ones_like_step(step: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=step.device)


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


def sgd_update(params, grads, momentum_buffers, step, grad_scale=None, *, lr, weight_decay: float = 0.0,
               momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False):
    """The pure SGD update in one pass: ``(updates, new_momentum_buffers, new_step)``.

    ``updates`` are new fp32 tensors ``new_p - p``, with ``new_p`` as ``torch.optim.SGD`` computes
    it (or ``-lr * g`` when ``params`` is empty or None, allowed when ``weight_decay == 0``), so
    that :func:`apply_updates` lands on torch's result; the numbers are those of
    :func:`ampfunc.sgd`'s generic update bit for bit (CPU). ``grads`` of any float dtype are
    multiplied by ``grad_scale`` (0-d fp32; a clip coefficient; None: 1) first. fp32 ``params``
    and buffers are only read; ``new_step`` is ``step + 1``. ``lr`` is a float or a 0-d fp32
    tensor on the device (a schedule's value). Cost: reads g, p (+ buffer), writes the updates
    (+ new buffer), one pass on CPU and CUDA; no host sync.
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    grad_scale = _ones_like_step(step) if grad_scale is None else grad_scale
    grads = list(grads)
    with _gc_paused(len(grads)):
        d, b, s = _call("sgd_update", _as_list(params), grads,
                                               _as_list(momentum_buffers) if momentum != 0 else [], step, grad_scale,
                                               lr, lr_tensor, float(weight_decay), float(momentum), float(dampening),
                                               bool(nesterov), bool(maximize))
        d, b = list(d), list(b)
    return d, b, s


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


def adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, grad_scale=None, *, lr,
                beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                amsgrad: bool = False, decoupled_weight_decay: bool = False, maximize: bool = False):
    """The pure Adam / AdamW update in one pass: ``(updates, new_exp_avgs, new_exp_avg_sqs,
    new_max_exp_avg_sqs, new_step)``.

    ``updates`` are new fp32 tensors ``new_p - p`` with ``new_p`` as ``torch.optim.Adam`` /
    ``AdamW`` computes it (the step term alone when ``params`` is empty or None, allowed when
    ``weight_decay == 0``): the numbers of :func:`ampfunc.adam` / :func:`ampfunc.adamw`'s
    generic update bit for bit (CPU). ``grads`` (any float dtype) are multiplied by
    ``grad_scale`` (0-d fp32, e.g. a clip coefficient; None: 1) first; the bias corrections use
    ``step + 1``, returned as ``new_step``. The inputs are only read. ``new_max_exp_avg_sqs`` is
    empty without ``amsgrad``. Cost: reads g, p, m, v; writes the updates and new m, v in one pass
    (new tensors), on CPU and CUDA; no host sync.
    """
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    grad_scale = _ones_like_step(step) if grad_scale is None else grad_scale
    grads = list(grads)
    with _gc_paused(len(grads)):
        out = _call("adam_update", _as_list(params), grads, _seq(exp_avgs), _seq(exp_avg_sqs),
                                            _as_list(max_exp_avg_sqs) if amsgrad else [], step, grad_scale, lr,
                                            lr_tensor, float(beta1), float(beta2), float(eps), float(weight_decay),
                                            bool(amsgrad), bool(decoupled_weight_decay), bool(maximize))
        return tuple(list(x) for x in out[:4]) + (out[4],)


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


def apply_updates(params, updates) -> list:
    """``[p + u ...]``: new tensors, each in its param's dtype (fp32, fp16, bf16), the sum taken
    in fp32 and rounded once -- :func:`ampfunc.apply_updates`'s arithmetic -- over the whole list
    in one parallel pass. Shapes must match (no broadcasting). Cost: one read of each list, one
    write; no host sync (CUDA: one multi-tensor add for the fp32 pairs)."""
    params = list(params)
    if not params:
        return []
    _ensure()
    with _gc_paused(len(params)):
        return list(_call("apply_updates", params, _seq(updates)))


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
    "check_norm": ("check_norm(Tensor[] tensors, Tensor? inv_scale, bool per_leaf) -> (Tensor finite, Tensor norm, "
                   "Tensor leaf_nonfinite)"),
    "sgd_update": (
        "sgd_update(Tensor[] params, Tensor[] grads, Tensor[] momentum_buffers, Tensor step, Tensor grad_scale, "
        "float lr, Tensor? lr_tensor, float weight_decay, float momentum, float dampening, bool nesterov, "
        "bool maximize) -> (Tensor[] updates, Tensor[] new_momentum_buffers, Tensor new_step)"),
    "adam_update": (
        "adam_update(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
        "Tensor[] max_exp_avg_sqs, Tensor step, Tensor grad_scale, float lr, Tensor? lr_tensor, float beta1, "
        "float beta2, float eps, float weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) -> "
        "(Tensor[] updates, Tensor[] new_exp_avgs, Tensor[] new_exp_avg_sqs, Tensor[] new_max_exp_avg_sqs, "
        "Tensor new_step)"),
    "apply_updates": "apply_updates(Tensor[] params, Tensor[] updates) -> Tensor[]",
    "update_scale_": (
        "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, Tensor finite, "
        "float growth_factor, float backoff_factor, int growth_interval, float min_scale, float max_scale, "
        "int hysteresis) -> ()"),
}


def _step_lists(op, params, grads, model_params, state, inplace):
    lists = [("params", list(params), _FP32, inplace), ("grads", list(grads), _ANY, False)]
    lists += [(name, list(ts), _FP32, inplace) for name, ts in state]
    if model_params:
        lists.append(("model_params", list(model_params), _ANY, inplace))
    return lists


def _validate_step(op, params, grads, model_params, state, step, grad_scale, finite, inplace):
    dev = _list_device(params, step)
    _check_scalar(op, "step", step, torch.float32, dev)
    _check_scalar(op, "grad_scale", grad_scale, torch.float32, dev)
    _check_scalar(op, "finite", finite, torch.bool, dev)
    _validate(op, dev, _step_lists(op, params, grads, model_params, state, inplace),
              [("step", step)] if inplace else ())


def _validate_lr(op, lr_tensor, dev):
    if lr_tensor is not None:
        _check_scalar(op, "lr_tensor", lr_tensor, torch.float32, dev)


def _ref_check_op(tensors, per_leaf):
    _validate("check", _list_device(tensors), [("tensors", list(tensors), _ANY64, False)])
    return _ref_check(tensors, per_leaf)


def _ref_check_norm_op(tensors, inv_scale, per_leaf):
    dev = _list_device(tensors, inv_scale)
    if inv_scale is not None:
        _check_scalar("check_norm", "inv_scale", inv_scale, torch.float32, dev)
    _validate("check_norm", dev, [("tensors", list(tensors), _ANY64, False)])
    return _ref_check_norm(tensors, inv_scale, per_leaf)


def _ref_sgd_step_op(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, lr_tensor,
                     weight_decay, momentum, *rest):
    state = [("momentum_buffers", momentum_buffers)] if momentum != 0 else []
    _validate_step("sgd_step_", params, grads, model_params, state, step, grad_scale, finite, True)
    _validate_lr("sgd_step_", lr_tensor, step.device)
    _ref_sgd_step_(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, weight_decay, momentum,
                   *rest, lr_tensor=lr_tensor)


def _adam_state(exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad):
    state = [("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)]
    return state + [("max_exp_avg_sqs", max_exp_avg_sqs)] if amsgrad else state


def _ref_adam_step_op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite,
                      lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, *rest):
    _validate_step("adam_step_", params, grads, model_params, _adam_state(exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                                                          amsgrad), step, grad_scale, finite, True)
    _validate_lr("adam_step_", lr_tensor, step.device)
    _ref_adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite, lr,
                    beta1, beta2, eps, weight_decay, amsgrad, *rest, lr_tensor=lr_tensor)


def _ref_sgd_step_out_op(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, lr_tensor,
                         weight_decay, momentum, *rest):
    state = [("momentum_buffers", momentum_buffers)] if momentum != 0 else []
    _validate_step("sgd_step", params, grads, model_params, state, step, grad_scale, finite, False)
    _validate_lr("sgd_step", lr_tensor, step.device)
    return _ref_sgd_step(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, weight_decay,
                         momentum, *rest, lr_tensor=lr_tensor)


def _ref_adam_step_out_op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale,
                          finite, lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, *rest):
    _validate_step("adam_step", params, grads, model_params, _adam_state(exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                                                         amsgrad), step, grad_scale, finite, False)
    _validate_lr("adam_step", lr_tensor, step.device)
    return _ref_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale,
                          finite, lr, beta1, beta2, eps, weight_decay, amsgrad, *rest, lr_tensor=lr_tensor)


def _validate_update(op, params, grads, state, step, grad_scale, weight_decay):
    dev = _list_device(grads, step)
    _check_scalar(op, "step", step, torch.float32, dev)
    _check_scalar(op, "grad_scale", grad_scale, torch.float32, dev)
    if not params and grads and weight_decay != 0:
        raise ValueError(f"ampfunc: weight_decay != 0 needs params ({op})")
    lists = [("params", list(params), _FP32, False)] if params else []
    lists.append(("grads", list(grads), _ANY, False))
    lists += [(name, list(ts), _FP32, False) for name, ts in state]
    _validate(op, dev, lists)
    return dev


def _ref_sgd_update_op(params, grads, momentum_buffers, step, grad_scale, lr, lr_tensor, weight_decay, momentum,
                       dampening, nesterov, maximize):
    state = [("momentum_buffers", momentum_buffers)] if momentum != 0 else []
    dev = _validate_update("sgd_update", params, grads, state, step, grad_scale, weight_decay)
    _validate_lr("sgd_update", lr_tensor, dev)
    return _ref_sgd_update(params, grads, momentum_buffers, step, grad_scale, lr, lr_tensor, weight_decay, momentum,
                           dampening, nesterov, maximize)


def _ref_adam_update_op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, grad_scale, lr, lr_tensor,
                        beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize):
    dev = _validate_update("adam_update", params, grads, _adam_state(exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad),
                           step, grad_scale, weight_decay)
    _validate_lr("adam_update", lr_tensor, dev)
    return _ref_adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, grad_scale, lr, lr_tensor,
                            beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize)


def _ref_apply_updates_op(params, updates):
    _validate("apply_updates", _list_device(params),
              [("params", list(params), _ANY, False), ("updates", list(updates), _ANY, False)])
    return _ref_apply_updates(params, updates)


def _ref_unscale_op(tensors, inv_scale):
    dev = _list_device(tensors, inv_scale)
    _check_scalar("unscale", "inv_scale", inv_scale, torch.float32, dev)
    _validate("unscale", dev, [("tensors", list(tensors), _ANY64, False)])
    outs, finite = _ref_unscale(tensors, inv_scale)
    return outs, finite


def _ref_unscale__op(tensors, inv_scale):
    dev = _list_device(tensors, inv_scale)
    _check_scalar("unscale_", "inv_scale", inv_scale, torch.float32, dev)
    _validate("unscale_", dev, [("tensors", list(tensors), _ANY64, True)])
    return _ref_unscale_(tensors, inv_scale)


_REFERENCE = {
    "check": _ref_check_op,
    "check_norm": _ref_check_norm_op,
    "sgd_update": _ref_sgd_update_op,
    "adam_update": _ref_adam_update_op,
    "apply_updates": _ref_apply_updates_op,
    "unscale_": _ref_unscale__op,
    "unscale": _ref_unscale_op,
    "sgd_step_": _ref_sgd_step_op,
    "adam_step_": _ref_adam_step_op,
    "sgd_step": _ref_sgd_step_out_op,
    "adam_step": _ref_adam_step_out_op,
    "update_scale_": _ref_update_scale_,
}


def _fake_check(tensors, per_leaf):
    _fake_devices("check", [("tensors", tensors)])
    dev = _flag_device(tensors)
    return (torch.empty((), dtype=torch.bool, device=dev), torch.empty((), dtype=torch.float32, device=dev),
            torch.empty(len(tensors) if per_leaf else 0, dtype=torch.bool, device=dev))


def _fake_check_norm(tensors, inv_scale, per_leaf):
    _fake_devices("check_norm", [("tensors", tensors)], [("inv_scale", inv_scale)])
    return _fake_check(tensors, per_leaf)


def _fake_unscale_(tensors, inv_scale):
    _fake_devices("unscale_", [("tensors", tensors)], [("inv_scale", inv_scale)])
    return torch.empty((), dtype=torch.bool, device=tensors[0].device if tensors else inv_scale.device)


def _fake_unscale(tensors, inv_scale):
    _fake_devices("unscale", [("tensors", tensors)], [("inv_scale", inv_scale)])
    return ([torch.empty_like(t, dtype=torch.float32, memory_format=torch.contiguous_format) for t in tensors],
            _fake_unscale_(tensors, inv_scale))


def _fake_sgd_step_(params, grads, momentum_buffers, model_params, step=None, grad_scale=None, finite=None,
                    lr=None, lr_tensor=None, *rest):
    _fake_devices("sgd_step_", [("params", params), ("grads", grads), ("momentum_buffers", momentum_buffers),
                                ("model_params", model_params)],
                  [("step", step), ("grad_scale", grad_scale), ("finite", finite), ("lr", lr_tensor)])


def _fake_adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step=None,
                     grad_scale=None, finite=None, lr=None, lr_tensor=None, *rest):
    _fake_devices("adam_step_", [("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                                 ("exp_avg_sqs", exp_avg_sqs), ("max_exp_avg_sqs", max_exp_avg_sqs),
                                 ("model_params", model_params)],
                  [("step", step), ("grad_scale", grad_scale), ("finite", finite), ("lr", lr_tensor)])


def _fake_update_scale_(scale, growth_tracker, hysteresis_tracker, finite, *rest):
    _fake_devices("update_scale_", [], [("scale", scale), ("growth_tracker", growth_tracker),
                                        ("hysteresis_tracker", hysteresis_tracker), ("finite", finite)])


def _empties(tensors) -> list:
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]


def _fp32_empties(tensors) -> list:
    return [torch.empty_like(t, dtype=torch.float32, memory_format=torch.contiguous_format) for t in tensors]


def _fake_sgd_step(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, lr_tensor,
                   weight_decay, momentum, *rest):
    _fake_sgd_step_(params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr, lr_tensor)
    return (_empties(params), _empties(momentum_buffers) if momentum != 0 else [], _empties(model_params),
            torch.empty_like(step))


def _fake_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite,
                    lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, *rest):
    _fake_adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite,
                     lr, lr_tensor)
    return (_empties(params), _empties(exp_avgs), _empties(exp_avg_sqs), _empties(max_exp_avg_sqs) if amsgrad else [],
            _empties(model_params), torch.empty_like(step))


def _fake_sgd_update(params, grads, momentum_buffers, step, grad_scale, lr, lr_tensor, weight_decay, momentum,
                     *rest):
    _fake_devices("sgd_update", [("params", params), ("grads", grads), ("momentum_buffers", momentum_buffers)],
                  [("step", step), ("grad_scale", grad_scale), ("lr", lr_tensor)])
    return _fp32_empties(grads), _empties(momentum_buffers) if momentum != 0 else [], torch.empty_like(step)


def _fake_adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, grad_scale, lr, lr_tensor,
                      beta1, beta2, eps, weight_decay, amsgrad, *rest):
    _fake_devices("adam_update", [("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                                  ("exp_avg_sqs", exp_avg_sqs), ("max_exp_avg_sqs", max_exp_avg_sqs)],
                  [("step", step), ("grad_scale", grad_scale), ("lr", lr_tensor)])
    return (_fp32_empties(grads), _empties(exp_avgs), _empties(exp_avg_sqs),
            _empties(max_exp_avg_sqs) if amsgrad else [], torch.empty_like(step))


def _fake_apply_updates(params, updates):
    _fake_devices("apply_updates", [("params", params), ("updates", updates)])
    return _empties(params)


_FAKE = {
    "check": _fake_check,
    "check_norm": _fake_check_norm,
    "unscale_": _fake_unscale_,
    "unscale": _fake_unscale,
    "sgd_step_": _fake_sgd_step_,
    "adam_step_": _fake_adam_step_,
    "sgd_step": _fake_sgd_step,
    "adam_step": _fake_adam_step,
    "sgd_update": _fake_sgd_update,
    "adam_update": _fake_adam_update,
    "apply_updates": _fake_apply_updates,
    "update_scale_": _fake_update_scale_,
}


def _refuse_layout(name: str, schema: str):
    """The kernel for the sparse dispatch keys: a clear error naming the argument, where torch
    would answer ``NotImplementedError`` (a dense kernel cannot read a sparse tensor)."""
    arg_names = [a.name for a in torch._C.parse_schema(f"ampfunc::{schema}").arguments]

    def kernel(*args, **kwargs):
        for arg, val in zip(arg_names, args):
            items = list(enumerate(val)) if isinstance(val, (list, tuple)) else [(-1, val)]
            for i, t in items:
                if isinstance(t, torch.Tensor) and t.layout != torch.strided:
                    raise TypeError(f"ampfunc: {_item(arg, i)} has layout {t.layout}; ampfunc takes dense (strided) "
                                    f"tensors ({name})")
        raise TypeError(f"ampfunc: a sparse tensor was passed ({name})")

    return kernel


def _loading_first(name: str, reference):
    """``reference``, behind a first call that loads the compiled kernels.

    A graph compiled before any eager ampfunc call (``torch.compile`` traces through the fake
    kernels and never loads the library) calls the ops directly; without this its first run
    would land on the reference forever. The first eager call loads the library (building it if
    needed, as any first op does) and dispatches again, now to the compiled kernel."""

    def kernel(*args):
        if _BACKEND[0] is None and not _is_compiling():
            if load() != "reference":
                return getattr(torch.ops.ampfunc, name)(*args)
        return reference(*args)

    kernel.__name__ = f"{getattr(reference, '__name__', name)}_loading_first"
    return kernel


def _register() -> None:
    try:
        torch.ops.ampfunc.check  # noqa: B018 - already defined (module reloaded)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("ampfunc", "DEF")  # noqa: TOR901 - the schemas live here, kernels in ext/
    for name, schema in _SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, _loading_first(name, _REFERENCE[name]), "CompositeExplicitAutograd")
        torch.library.register_fake(f"ampfunc::{name}", _FAKE[name], lib=lib)
        for key in ("SparseCPU", "SparseCUDA", "SparseCsrCPU", "SparseCsrCUDA"):
            lib.impl(name, _refuse_layout(name, schema), key)
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
