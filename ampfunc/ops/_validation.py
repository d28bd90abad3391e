"""Validation of an op's arguments: the reference path's mirror of ext/glue/validation.h, check
for check and word for word, so both backends refuse the same calls with the same error type and
message::

    "ampfunc: <list>[<index>] <what is wrong> (<op>)"

ValueError for counts, shapes, devices and overlapping memory, TypeError for dtypes and layouts.
Every check runs before the first write. :func:`error_items` parses a message. The memory-overlap
rule here (:func:`_overlapping_pair`) serves the reference twin; with the compiled library loaded,
:func:`ampfunc.ops.overlapping_pair` is the library's (one implementation, ext/glue/validation.h).
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch

_ANY = (torch.float32, torch.float16, torch.bfloat16)

_FP32 = (torch.float32,)

_ANY64 = _ANY + (torch.float64,)

_DT_WORDS = {_ANY: "float32, float16 or bfloat16", _FP32: "float32", _ANY64: "float32, float16, bfloat16 or float64",
             (torch.int16,): "int16", (torch.float32, torch.bfloat16): "float32 or bfloat16",
             (torch.float32, torch.bfloat16, torch.uint8): "float32, bfloat16 or uint8 (q8 codes)"}

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

def _overlapping_pair(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The Python twin of :func:`ampfunc.ops.overlapping_pair` (same rule, same answer), for the
    reference backend and for tensor subclasses without storage."""
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

def _validate(op: str, dev: torch.device, lists, written_scalars=(), shapes=None) -> None:
    """``lists``: ``[(name, tensors, dtypes, written), ...]``, the first the reference list.
    ``shapes``: list name -> ``f(i) -> (shape, why)`` for a list whose tensors are not shaped as
    the reference list's (ampfunc.ops._spec: the shape roles)."""
    shapes = shapes or {}
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
            if name in shapes:
                want, why = shapes[name](i)
                if t.shape != want:
                    raise ValueError(f"ampfunc: {name}[{i}] has shape {tuple(t.shape)} but {why} ({op})")
            elif k > 0 and t.shape != ref[i].shape:
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
    pair = _overlapping_pair([t for *_, t in written])
    if pair is not None:
        (a_name, a_i, _), (b_name, b_i, _) = written[pair[0]], written[pair[1]]
        raise ValueError(f"ampfunc: {_item(a_name, a_i)} and {_item(b_name, b_i)} overlap in memory; the tensors "
                         f"an in-place op writes must be distinct ({op})")

# The optimizers' hyper-parameter ranges, by the ops' names (adam's b1/b2 are beta1/beta2 here),
# as ampfunc.optim's front doors take them: name -> (low, high, whether high is excluded). The
# generated ops test them inline on the Python floats (hyper_condition: a few comparisons per call,
# no host sync, nothing per leaf; a tensor lr, read on the device, is not checked) and call
# check_hypers, which names the first one out of range, only when the test fails.
_F32_MAX = float(torch.finfo(torch.float32).max)

HYPER_RANGES = {
    "lr": (0.0, _F32_MAX, False),  # beyond fp32's max the fp32 update is inf
    "beta1": (0.0, 1.0, True),
    "beta2": (0.0, 1.0, True),
    "eps": (0.0, math.inf, False),
    "weight_decay": (0.0, math.inf, False),
    "momentum": (0.0, math.inf, False),
    "dampening": (0.0, math.inf, False),
}

def _in_range(value: float, low: float, high: float, open_high: bool) -> bool:
    return low <= value < high if open_high else low <= value <= high  # NaN fails both

def hyper_condition(names: Sequence[str]) -> str:
    """Python source that is true when every one of ``names`` with a range is in it."""
    parts = []
    for name in names:
        if name in HYPER_RANGES:
            low, high, open_high = HYPER_RANGES[name]
            parts.append(f"{low!r} <= {name}" + ("" if high == math.inf else f" {'<' if open_high else '<='} {high!r}"))
    return " and ".join(parts) or "True"

def check_hypers(op: str, **values) -> None:
    """``ValueError`` naming the first of ``values`` outside its range (a NaN included)."""
    for name, value in values.items():
        if name in HYPER_RANGES and not _in_range(value, *HYPER_RANGES[name]):
            low, high, open_high = HYPER_RANGES[name]
            where = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:.8g}{')' if open_high else ']'}"
            raise ValueError(f"ampfunc: {name} must be {where}, got {value!r} ({op})")

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
