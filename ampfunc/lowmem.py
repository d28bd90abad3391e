"""Low-memory state, tree by tree: split fp32 masters and bf16 / q8 optimizer moments.

The layouts the low-memory settings keep, and the conversions between them and fp32 trees
that the generic (plain torch) step runs. The numbers per element are
:mod:`ampfunc.lowbits`'s; this module decides which leaf gets which layout, names the leaf at
fault when a state does not fit its params, and counts the bytes.

* ``master="split"`` (:class:`SplitMaster`): a bf16 param is the high half of its fp32 master
  and the state keeps the int16 low half (2 bytes per element instead of 4). A param that is
  fp32 or fp64 is its own master (an empty remainder); an fp16 param is refused (its bits are
  not the high half of an fp32 number).
* ``moments="bf16"`` (on ``af.adam``, ``af.adamw`` and ``af.sgd``: Adam's two moments, SGD's
  momentum buffer): the moments are bf16 tensors (2 bytes), rounded to nearest even after
  each update. ``moments="q8"`` (:class:`Q8Moment`): 8-bit codes (1 byte) and an fp32 absmax
  per block of 256 elements; leaves under 4,096 elements or not a multiple of 256 stay fp32.
  fp64 leaves (fp64 params) keep fp64 moments in every setting.

Every layout is a pytree of plain tensors, so ``torch.save`` / ``torch.load(weights_only=True)``
round-trip it bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ampfunc import ops
from ampfunc.loss_scale import DynamicLossScale
from ampfunc.lowbits import (
    dequantize_q8,
    join_bf16,
    q8_absmax_numel,
    q8_eligible,
    q8_lookup,
    quantize_q8,
    split_bf16,
)
from ampfunc.ops import _loading
from ampfunc.tree import (
    PyTree,
    arithmetic_dtype,
    float_leaves_with_paths,
    leaves_with_paths,
    register_state_classes,
    tree_flatten,
    tree_structure,
    tree_unflatten,
)

# What users are told to use (docs/guides/low_memory.md): the settings, the layouts a state holds,
# and the byte count. The helpers below (init_*/check_*/decode_*/encode_*, lowmem_step, ...) serve
# the optimizers and the engine, which import them by name.
__all__ = ["MASTERS", "MOMENTS", "Q8Moment", "SplitMaster", "storage_bytes"]

MASTERS = ("fp32", "split")
MOMENTS = ("fp32", "bf16", "q8")

# Views start at 64-byte boundaries, so the kernels' vector loads of each leaf are aligned.
_ALIGN_BYTES = 64


class SplitMaster(NamedTuple):
    """The fp32 masters of ``master="split"``: each bf16 param is its master's high half.

    Attributes:
      remainder: a tree like the params: int16 of the param's shape for a bf16 param (the
        master's low half, see :func:`ampfunc.lowbits.split_bf16`), an empty int16 tensor for
        an fp32 or fp64 param (it is its own master).

    Example:
      >>> params = {"w": torch.ones(2, 3, dtype=torch.bfloat16), "ln": torch.ones(3)}
      >>> sm = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale(), master="split").init(params).master
      >>> sm.remainder["w"].dtype, sm.remainder["w"].shape, sm.remainder["ln"].numel()
      (torch.int16, torch.Size([2, 3]), 0)
    """

    remainder: PyTree


class Q8Moment(NamedTuple):
    """One optimizer moment of a whole tree in 8 bits (``moments="q8"``): an Adam moment or SGD's
    momentum buffer.

    Attributes:
      codes: a tree like the params: uint8 codes of the param's shape for a leaf stored in q8,
        the fp32 values (fp64 for an fp64 param) for a leaf kept at full precision.
      absmax: a tree like the params: fp32 of shape ``(numel // 256,)`` for a q8 leaf, the
        largest magnitude of each block of 256; an empty fp32 tensor for the others.

    Example:
      >>> m = af.adamw(1e-3, moments="q8").init({"w": torch.ones(64, 64), "b": torch.ones(64)}).exp_avg
      >>> m.codes["w"].dtype, m.absmax["w"].shape, m.codes["b"].dtype
      (torch.uint8, torch.Size([16]), torch.float32)
    """

    codes: PyTree
    absmax: PyTree


register_state_classes(SplitMaster, Q8Moment)


def check_master(master: Any, where: str) -> str:
    """``master`` if it is one of :data:`MASTERS`, else ``ValueError``."""
    if master not in MASTERS:
        raise ValueError(f"{where}: master must be one of {', '.join(map(repr, MASTERS))}, got {master!r}")
    return master


def check_moments(moments: Any, where: str) -> str:
    """``moments`` if it is one of :data:`MOMENTS`, else ``ValueError``."""
    if moments not in MOMENTS:
        raise ValueError(f"{where}: moments must be one of {', '.join(map(repr, MOMENTS))}, got {moments!r}")
    return moments


def _packed(specs: Sequence[tuple]) -> list:
    """Zero tensors for ``specs`` = ``[(device, dtype, shape), ...]``, as views of one buffer per
    (device, dtype) (one stream for a kernel; see :func:`ampfunc.flat.zeros_packed`). Inside a
    ``torch.compile`` trace or a dispatch/function mode every tensor is its own."""
    if torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack() > 0 or \
            torch.compiler.is_compiling():
        return [torch.zeros(shape, dtype=dt, device=dev) for dev, dt, shape in specs]
    totals: dict = {}
    offsets = []
    for dev, dt, shape in specs:
        key = (torch.device(dev), dt)
        align = max(1, _ALIGN_BYTES // dt.itemsize)
        at = -(-totals.get(key, 0) // align) * align
        offsets.append(at)
        totals[key] = at + int(torch.Size(shape).numel())
    buffers = {key: torch.zeros(n, dtype=key[1], device=key[0]) for key, n in totals.items()}
    return [buffers[(torch.device(dev), dt)].narrow(0, off, int(torch.Size(shape).numel())).view(shape)
            for (dev, dt, shape), off in zip(specs, offsets)]


# ----------------------------------------------------------------------------------------------
# Split masters
# ----------------------------------------------------------------------------------------------


def _own_master(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.float64)


def init_split_master(params: PyTree, where: str) -> SplitMaster:
    """The :class:`SplitMaster` of ``params`` (their bf16 leaves' fp32 masters are exact: the
    remainders start at zero, so each master is its bf16 param's value).

    Args:
      params: a pytree of floating tensors: bf16 (split), fp32 or fp64 (their own masters).
      where: the name errors start with.

    Returns:
      A :class:`SplitMaster` (one int16 buffer per device holds every remainder).

    Raises ``TypeError`` naming a non-floating leaf and ``ValueError`` naming an fp16 leaf.
    Cost: one allocation per device; no host sync.
    """
    paths, leaves = float_leaves_with_paths(params, f"{where}: params")
    for path, leaf in zip(paths, leaves):
        if leaf.dtype == torch.float16:
            raise ValueError(f"{where}: params leaf {path!r} is float16; master='split' keeps the low half of an "
                             "fp32 master whose high half is the bf16 param (fp16 is not a half of fp32): use "
                             "bf16 params, or master='fp32' for fp16 params")
    specs = [(t.device, torch.int16, t.shape if t.dtype == torch.bfloat16 else (0,)) for t in leaves]
    return SplitMaster(tree_unflatten(tree_structure(params), _packed(specs)))


def check_split_master(params: PyTree, split: Any, where: str) -> None:
    """``ValueError`` naming the leaf where ``split`` is not the :class:`SplitMaster` that
    :func:`init_split_master` makes for ``params`` (a state from another setting or model).
    Cost: a dtype/shape look per leaf; no host sync."""
    if not isinstance(split, SplitMaster):
        raise TypeError(f"{where}: the state's master is {type(split).__name__}, not the SplitMaster that "
                         "master='split' keeps: the state was made with another setting -- call init again")
    p_spec = tree_structure(params)
    r_leaves, r_spec = tree_flatten(split.remainder)
    if p_spec != r_spec:
        raise ValueError(f"{where}: the state's split master has another structure than the params: the state "
                         "was made for other params -- call init with these params")
    for (path, p), r in zip(leaves_with_paths(params), r_leaves):
        if p.dtype == torch.float16:
            raise ValueError(f"{where}: params leaf {path!r} is float16, which master='split' cannot keep "
                             "(use bf16 params or master='fp32')")
        want = p.shape if p.dtype == torch.bfloat16 else torch.Size([0])
        if not isinstance(r, torch.Tensor) or r.dtype != torch.int16 or r.shape != want or r.device != p.device:
            got = f"{r.dtype} {tuple(r.shape)} on {r.device}" if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(f"{where}: params leaf {path!r} ({p.dtype}, {tuple(p.shape)}) has a split-master "
                             f"remainder of {got} (init makes int16 {tuple(want)}): the state was made for other "
                             "params -- call init with these params")


def join_master(params: PyTree, split: SplitMaster) -> PyTree:
    """The fp32 masters: each bf16 leaf joined with its remainder, every other leaf itself.

    Example:
      >>> params = {"w": torch.tensor([1.0], dtype=torch.bfloat16)}
      >>> join_master(params, init_split_master(params, "example"))["w"]
      tensor([1.])

    Cost: one elementwise pass per bf16 leaf into a new fp32 tensor; no host sync.
    """
    p_leaves, spec = tree_flatten(params)
    r_leaves = tree_flatten(split.remainder)[0]
    out = [join_bf16(p, r) if p.dtype == torch.bfloat16 else p for p, r in zip(p_leaves, r_leaves)]
    return tree_unflatten(spec, out)


def split_master(masters: PyTree, params: PyTree) -> tuple[PyTree, SplitMaster]:
    """New ``(params, SplitMaster)`` from fp32 ``masters``: a leaf whose param is bf16 is split
    (its new param the high half), any other leaf is its own new param (in its param's dtype).

    Cost: one elementwise pass per bf16 leaf (two new tensors); no host sync.
    """
    m_leaves, spec = tree_flatten(masters)
    p_leaves = tree_flatten(params)[0]
    new_p, new_r = [], []
    for m, p in zip(m_leaves, p_leaves):
        if p.dtype == torch.bfloat16:
            hi, lo = split_bf16(m)
            new_p.append(hi)
            new_r.append(lo)
        else:
            new_p.append(m if m.dtype == p.dtype else m.to(p.dtype))
            new_r.append(torch.zeros(0, dtype=torch.int16, device=p.device))
    return tree_unflatten(spec, new_p), SplitMaster(tree_unflatten(spec, new_r))


# ----------------------------------------------------------------------------------------------
# Moments
# ----------------------------------------------------------------------------------------------


def _q8_leaf(t: torch.Tensor) -> bool:
    return arithmetic_dtype(t.dtype) == torch.float32 and q8_eligible(t.numel())


def _stored_dtype(t: torch.Tensor, moments: str) -> torch.dtype:
    full = arithmetic_dtype(t.dtype)
    if moments == "bf16" and full == torch.float32:
        return torch.bfloat16
    if moments == "q8" and _q8_leaf(t):
        return torch.uint8
    return full


def init_moment(params: PyTree, moments: str, where: str) -> Any:
    """Zeros for one optimizer moment of ``params`` in the layout of ``moments``.

    Args:
      params: a pytree of floating tensors (the optimizer's params).
      moments: ``"fp32"`` (a tree of fp32 zeros, fp64 for fp64 leaves), ``"bf16"`` (bf16
        zeros for those fp32 leaves) or ``"q8"`` (a :class:`Q8Moment`).
      where: the name errors start with.

    Returns:
      The tree of zeros, or a :class:`Q8Moment` of zero codes and zero absmaxes (code 0 is not
      the map's 0; the zero absmax makes every value 0).

    Cost: one allocation per (device, dtype); no host sync.
    """
    check_moments(moments, where)
    _, leaves = float_leaves_with_paths(params, f"{where}: params")
    spec = tree_structure(params)
    stored = _packed([(t.device, _stored_dtype(t, moments), t.shape) for t in leaves])
    if moments != "q8":
        return tree_unflatten(spec, stored)
    absmax = _packed([(t.device, torch.float32, (q8_absmax_numel(t.numel()) if _q8_leaf(t) else 0,)) for t in leaves])
    return Q8Moment(tree_unflatten(spec, stored), tree_unflatten(spec, absmax))


def check_moment(slot: Any, params: PyTree, moments: str, name: str, where: str) -> None:
    """``ValueError`` naming the leaf where ``slot`` is not the layout :func:`init_moment` makes
    for ``params`` in the setting ``moments`` (a state from another setting or model). Cost: a
    dtype/shape look per leaf; no host sync."""
    paths = [p for p, _ in leaves_with_paths(params)]
    p_leaves = tree_flatten(params)[0]
    if moments == "q8":
        if not isinstance(slot, Q8Moment):
            raise TypeError(f"{where}: {name} is {type(slot).__name__}, not the Q8Moment that moments='q8' keeps: "
                             "the state was made with another moments setting -- call init again")
        codes, absmax = tree_flatten(slot.codes)[0], tree_flatten(slot.absmax)[0]
    else:
        if isinstance(slot, Q8Moment):
            raise ValueError(f"{where}: {name} is a Q8Moment but moments={moments!r}: the state was made with "
                             "moments='q8' -- call init again")
        codes, absmax = tree_flatten(slot)[0], None
    if len(codes) != len(p_leaves) or (absmax is not None and len(absmax) != len(p_leaves)):
        raise ValueError(f"{where}: {name} has {len(codes)} leaves for {len(p_leaves)} params: the state was made "
                         "for other params -- call init with these params")
    for i, (path, p, c) in enumerate(zip(paths, p_leaves, codes)):
        want = _stored_dtype(p, moments)
        if not isinstance(c, torch.Tensor) or c.dtype != want or c.shape != p.shape:
            got = f"{c.dtype} {tuple(c.shape)}" if isinstance(c, torch.Tensor) else type(c).__name__
            raise ValueError(f"{where}: {name} leaf {path!r} is {got}, but moments={moments!r} keeps {want} "
                             f"{tuple(p.shape)} for this param: the state was made with another setting or for "
                             "other params -- call init again")
        if absmax is not None:
            a = absmax[i]
            n = q8_absmax_numel(p.numel()) if want == torch.uint8 else 0
            if not isinstance(a, torch.Tensor) or a.dtype != torch.float32 or a.shape != (n,):
                got = f"{a.dtype} {tuple(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                raise ValueError(f"{where}: {name}.absmax leaf {path!r} is {got}, expected float32 ({n},): the "
                                 "state was made for other params -- call init with these params")


def decode_moment(slot: Any, signed: bool) -> list:
    """The moment's leaves in their arithmetic dtype (fp32; fp64 for fp64 params), in the
    params' leaf order: q8 codes dequantized, bf16 widened, full-precision leaves as they are.

    Args:
      slot: a moment made by :func:`init_moment` (or :func:`encode_moment`).
      signed: which dynamic map q8 codes index (True for a first moment or momentum).

    Returns:
      A list of tensors (the stored ones where nothing was converted: not copies).

    Cost: one elementwise pass per converted leaf into a new tensor; no host sync.
    """
    if isinstance(slot, Q8Moment):
        codes, absmax = tree_flatten(slot.codes)[0], tree_flatten(slot.absmax)[0]
        return [dequantize_q8(c, a, signed) if c.dtype == torch.uint8 else c for c, a in zip(codes, absmax)]
    return [x.float() if x.dtype == torch.bfloat16 else x for x in tree_flatten(slot)[0]]


def encode_moment(values: Sequence[torch.Tensor], like: Any, signed: bool) -> Any:
    """New moment state in ``like``'s layout holding ``values`` (fp32/fp64 tensors in the
    params' leaf order): q8 leaves quantized, bf16 leaves rounded to nearest even, the others
    kept as given.

    Cost: one elementwise pass per converted leaf (q8: an absmax per block and a search of 255
    midpoints per element); no host sync.
    """
    if isinstance(like, Q8Moment):
        leaves, spec = tree_flatten(like.codes)
        codes, absmax = [], []
        for v, c, a in zip(values, leaves, tree_flatten(like.absmax)[0]):
            if c.dtype == torch.uint8:
                q, m = quantize_q8(v, signed)
                codes.append(q)
                absmax.append(m)
            else:
                codes.append(v)
                absmax.append(a.clone())
        return Q8Moment(tree_unflatten(spec, codes), tree_unflatten(spec, absmax))
    leaves, spec = tree_flatten(like)
    return tree_unflatten(spec, [v.to(torch.bfloat16) if old.dtype == torch.bfloat16 else v
                                 for v, old in zip(values, leaves)])


def update_stored(update32: Any, fields: Sequence[str], moments: str, grads: PyTree, state: Any, params: Any,
                  where: str) -> tuple:
    """An optimizer's ``update`` on a state whose moment ``fields`` are stored as ``moments``
    (bf16 or q8): each field checked against the gradients' layout (a state of another setting
    is refused, naming it), rebuilt in fp32, ``update32(grads, state32, params)`` (the
    optimizer's fp32 update) run on it, and the new moments stored again in the old layouts
    (the signed q8 map for the fields :data:`MOMENT_FIELDS` marks signed).

    Returns ``(updates, new_state)``. Cost: ``update32`` plus a decode and an encode pass per
    converted leaf (new tensors); no host sync.
    """
    for f in fields:
        check_moment(getattr(state, f), grads, moments, f"state.{f}", where)
    spec = tree_structure(grads)
    full = state._replace(**{f: tree_unflatten(spec, decode_moment(getattr(state, f), MOMENT_FIELDS[f]))
                             for f in fields})
    updates, new = update32(grads, full, params)
    return updates, new._replace(**{f: encode_moment(tree_flatten(getattr(new, f))[0], getattr(state, f),
                                                     MOMENT_FIELDS[f]) for f in fields})


def storage_bytes(*trees: PyTree) -> int:
    """Bytes of the storages behind the tensors of ``trees``, each storage counted once.

    Counted from the tensors' storages (``untyped_storage().nbytes()``), so views that share
    one packed buffer count it once, alignment padding included. Pass every tree that holds
    persistent state (params, the optimizer state).

    Example:
      >>> state = af.sgd(0.1, momentum=0.9, moments="q8").init({"w": torch.ones(64, 64)})
      >>> storage_bytes(state.momentum_buffer)  # 4096 codes + 16 fp32 absmaxes
      4160
      >>> storage_bytes(af.sgd(0.1, momentum=0.9).init({"w": torch.ones(64, 64)}).momentum_buffer)
      16384

    A sparse tensor counts the storages of its parts (indices and values); a layout without
    storages to count (mkldnn) is refused naming the leaf. Tensors on the meta device hold no
    memory and count 0.

    Cost: a walk over the leaves; no tensor is read.
    """
    seen: dict = {}
    for tree in trees:
        for path, leaf in leaves_with_paths(tree):
            if not isinstance(leaf, torch.Tensor) or leaf.is_meta:
                continue
            for part in _stored_parts(leaf, path):
                s = part.untyped_storage()
                seen[(part.device, s.data_ptr())] = max(seen.get((part.device, s.data_ptr()), 0), s.nbytes())
    return sum(seen.values())


def _stored_parts(t: torch.Tensor, path: str) -> list:
    if t.layout == torch.strided:
        return [t]
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    raise TypeError(f"storage_bytes: leaf {path!r} has layout {t.layout}, whose storage cannot be counted")


# ----------------------------------------------------------------------------------------------
# An optimizer state's moments as fp32, and back (the engine's view for the fused plan)
# ----------------------------------------------------------------------------------------------

# The moment fields of the optimizer states (Adam's and AMSGrad's, SGD's momentum buffer) and
# whether each holds values of both signs (the signed q8 map) or not.
MOMENT_FIELDS = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False, "momentum_buffer": True}


def _moment_tree(slot: Any) -> PyTree:
    return slot.codes if isinstance(slot, Q8Moment) else slot


def _is_low(slot: Any) -> bool:
    if isinstance(slot, Q8Moment):
        return True
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in tree_flatten(slot)[0])


def decode_state(opt: Any) -> Any:
    """``opt`` with every bf16/q8 moment replaced by its fp32 tree (new tensors for the
    converted leaves, the stored ones for leaves kept at full precision). Cost: one pass per
    converted leaf; no host sync."""
    new = {}
    for f, signed in MOMENT_FIELDS.items():
        slot = getattr(opt, f, None) if f in getattr(opt, "_fields", ()) else None
        if slot is not None and _is_low(slot):
            spec = tree_structure(_moment_tree(slot))
            new[f] = tree_unflatten(spec, decode_moment(slot, signed))
    return opt._replace(**new) if new else opt


def _select(finite: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(finite.to(old.device), new, old)


def encode_state(new32: Any, like: Any, finite: torch.Tensor) -> Any:
    """The pure inverse of :func:`decode_state`: ``new32``'s fp32 moments stored in ``like``'s
    layouts (new tensors), and where ``finite`` is false ``like``'s own values (re-encoding a
    decoded q8 block is not always the identity: a skipped step must change no bit). Cost: one
    encode pass and one select per converted leaf; no host sync."""
    new = {}
    for f, signed in MOMENT_FIELDS.items():
        slot = getattr(like, f, None) if f in getattr(like, "_fields", ()) else None
        if slot is None or not _is_low(slot):
            continue
        enc = encode_moment(tree_flatten(getattr(new32, f))[0], slot, signed)
        old_leaves, spec = tree_flatten(slot)
        kept = [_select(finite, n, o) for n, o in zip(tree_flatten(enc)[0], old_leaves)]
        new[f] = tree_unflatten(spec, kept)
    return new32._replace(**new) if new else new32


def encode_state_(new32: Any, stored: Any, finite: torch.Tensor) -> None:
    """In-place :func:`encode_state`: ``stored``'s bf16/q8 moment tensors are overwritten with
    ``new32``'s values stored in their layouts, where ``finite`` (kept otherwise). Cost: one
    encode pass, one select and one copy per converted leaf; no host sync."""
    chosen = encode_state(new32, stored, finite)
    with torch.no_grad():
        for f in MOMENT_FIELDS:
            slot = getattr(stored, f, None) if f in getattr(stored, "_fields", ()) else None
            if slot is None or not _is_low(slot):
                continue
            for dst, src in zip(tree_flatten(slot)[0], tree_flatten(getattr(chosen, f))[0]):
                if dst is not src:
                    dst.copy_(src)


def commit_split_(params: PyTree, split: SplitMaster, masters: PyTree) -> None:
    """Writes fp32 ``masters`` back as bf16 params (high halves) and ``split``'s remainders, in
    place, for the bf16 leaves (the others are their own masters: ``masters`` holds them).
    Joining and splitting again gives back the same bits, so a skipped step (masters as joined)
    changes nothing. Cost: one pass per bf16 leaf; no host sync."""
    with torch.no_grad():
        for p, r, m in zip(tree_flatten(params)[0], tree_flatten(split.remainder)[0], tree_flatten(masters)[0]):
            if p.dtype == torch.bfloat16:
                hi, lo = split_bf16(m)
                p.copy_(hi)
                r.copy_(lo)
            elif m is not p:
                p.copy_(m)


# ----------------------------------------------------------------------------------------------
# The step of the low-memory settings, around an engine that runs the fp32 numbers
# ----------------------------------------------------------------------------------------------


def lowmem_step(core: Any, plan: Any, split: bool, params: PyTree, grads: PyTree, state: Any, *, inplace: bool,
                where: str, trust_grads: bool = False, moments: str = "fp32", checked: bool = False) -> tuple:
    """One step of ``master="split"`` and/or bf16/q8 moments, as the fp32 step of ``core``.

    The state is checked first (a state from another setting or model is refused, naming the
    leaf, before anything is written). Then the fp32 numbers are rebuilt -- the masters of the
    bf16 params joined from their low halves, the fused optimizer's moments decoded (``plan``
    given and ``moments`` not ``"fp32"``) -- ``core`` (an :class:`ampfunc.engine.Engine` over
    the fp32 layout: no master copy with ``split``, fp32 moments) takes its step on them, fused
    or generic, and the results are stored back: masters split, moments re-encoded (a skipped
    step keeps the stored moments as they were). So the fp32 master is the one the
    ``master="fp32"`` step computes, bit for bit, and the moments are the reference's:
    decode, fp32 update, encode.

    With the compiled kernels loaded, an in-place Adam/AdamW step on CPU tensors (or CUDA tensors,
    with the CUDA kernels) runs all of this in one pass instead (:func:`_fused_step_`, the op
    ``adam_lowmem_step_``: the same bits as this road on the same device); the plain-torch rebuild
    above is the reference backend and serves every other call.

    ``checked``: the params and state are the very tensors of an earlier call whose checks passed
    and which the kernel pass took (the engine remembers them by identity), so the per-leaf checks
    of the state's layout are not run again: the kernel validates every call itself (dtypes,
    shapes, contiguity, overlaps); the gradients are still looked at here.

    Returns ``(params, state, fused)``: what the engine's ``step``/``step_`` return, and whether
    the kernel pass ran. Cost: the fp32 step plus a join and a split pass per bf16 leaf and a
    decode and an encode pass per converted moment (with transient fp32 copies of them); no host
    sync. Fused: one pass over params, remainders, grads and the stored moments, after the
    engine's read-only check of the gradients (and a few attribute reads per leaf unless
    ``checked``).
    """
    if split and not checked:
        check_split_master(params, state.master, where)
    opt = plan.opt_state(state.inner) if plan is not None and moments != "fp32" else None
    if plan is not None and moments != "fp32" and not checked:
        if opt is None:
            raise ValueError(f"{where}: the state's optimizer state is not the one this transform's init makes "
                             "(a state from another setting?) -- call init again")
        # The moments' layout follows each master's dtype and shape; a split master is fp32 where its
        # param is bf16, which is the param's arithmetic dtype: the params say it without a join.
        ref = params if split else (state.master if state.master is not None else params)
        for f in MOMENT_FIELDS:
            if f in opt._fields and getattr(opt, f) is not None:
                check_moment(getattr(opt, f), ref, moments, f"state.inner.{f}", where)
    fused_opt = opt if opt is not None or plan is None else plan.opt_state(state.inner)
    if fused_opt is not None and opt is None and not checked:
        # moments="fp32": a state made with bf16 or q8 moments is refused here, naming the setting
        # (the fused pass would read the stored moments in whatever layout they have).
        ref = params if split else (state.master if state.master is not None else params)
        for f in MOMENT_FIELDS:
            if f in fused_opt._fields and getattr(fused_opt, f) is not None:
                check_moment(getattr(fused_opt, f), ref, "fp32", f"state.inner.{f}", where)
    if inplace and fused_opt is not None:
        done = _fused_step_(core, plan, split, params, grads, state, fused_opt, checked)
        if done is not None:
            return (*done, True)
    elif fused_opt is not None and _kernel_serves(plan, split, state) and not _loading._is_compiling():
        # The pure step as the in-place pass over fresh copies: one copy pass and one kernel pass
        # instead of the plain road's join/decode/step/encode/split passes, and the same bits.
        # (A compiled step keeps the plain road, which inductor fuses.)
        leaves, spec = tree_flatten((params, state))
        where_tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        for i, copy in zip(where_tensors, ops.fresh_copies([leaves[i] for i in where_tensors])):
            leaves[i] = copy
        fresh_params, fresh_state = tree_unflatten(spec, leaves)
        done = _fused_step_(core, plan, split, fresh_params, grads, fresh_state, plan.opt_state(fresh_state.inner),
                            checked)
        if done is not None:
            return (*done, True)
    params32 = join_master(params, state.master) if split else params
    inner32 = plan.replace_opt_state(state.inner, decode_state(opt), lambda x: x) if opt is not None else state.inner
    state32 = state._replace(master=None if split else state.master, inner=inner32)
    if inplace:
        _, new32 = core.step_(params32, grads, state32, where=where, trust_grads=trust_grads)
        if split:
            commit_split_(params, state.master, params32)
        if opt is not None:
            encode_state_(plan.opt_state(new32.inner), opt, new32.finite)
        if new32.finite is state.finite and new32.skipped is state.skipped:
            return params, state, False
        return params, state._replace(finite=new32.finite, skipped=new32.skipped), False
    new_params32, new32 = core.step(params32, grads, state32, where=where, trust_grads=trust_grads)
    inner = new32.inner
    if opt is not None:
        inner = plan.replace_opt_state(inner, encode_state(plan.opt_state(inner), opt, new32.finite), lambda x: x)
    if split:
        new_params, new_split = split_master(new_params32, params)
        return new_params, new32._replace(master=new_split, inner=inner), False
    return new_params32, new32._replace(inner=inner), False


# ----------------------------------------------------------------------------------------------
# The fused step: one kernel pass over the stored layouts
# ----------------------------------------------------------------------------------------------

_KERNEL_GRADS = (torch.float32, torch.float16, torch.bfloat16)
_KERNEL_MOMENTS = (torch.float32, torch.bfloat16, torch.uint8)


def _kernels_loaded() -> bool:
    if _loading._is_compiling():
        return _loading._BACKEND[0] not in (None, "reference")
    return _loading.load() != "reference"


def _dense_on(ts: Sequence, dtypes: tuple, device: torch.device) -> bool:
    return all(isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) and t.device == device
               and t.dtype in dtypes and t.is_contiguous() for t in ts)


def _kernel_serves(plan: Any, split: bool, state: Any) -> bool:
    """What :func:`_fused_step_` asks before it looks at any tensor: Adam/AdamW without AMSGrad,
    the kernels loaded, and no fp32 master copy. The kernel is Adam's: SGD's momentum buffer (and
    any other optimizer) takes the plain road."""
    if plan.optimizer.name != "adam" or plan._hypers.get("amsgrad") or not _kernels_loaded():
        return False
    return split or state.master is None


def _kernel_device(leaves: Sequence) -> torch.device | None:
    """The device the kernels serve for these params: the CPU, or a CUDA device when the CUDA
    kernels are loaded (backend "cpu+cuda"); None otherwise (the plain path takes the call)."""
    first = leaves[0] if leaves and isinstance(leaves[0], torch.Tensor) else None
    if first is None or first.device.type == "cpu":
        return torch.device("cpu")
    if first.device.type == "cuda" and _loading._BACKEND[0] == "cpu+cuda":
        return first.device
    return None


_NO_TENSOR: dict = {}  # one empty tensor per (dtype, device): the kernel's "no such list entry"


def _no_tensor(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _NO_TENSOR:
        _NO_TENSOR[key] = torch.empty(0, dtype=dtype, device=device)
    return _NO_TENSOR[key]


_LOOKUP_ON: dict = {}  # q8_lookup's tables per CUDA device, copied once (a copy per step would sync)


def _lookup_on(device: torch.device) -> tuple:
    if device.type == "cpu":
        return q8_lookup()
    if device not in _LOOKUP_ON:
        _LOOKUP_ON[device] = q8_lookup(device)
    return _LOOKUP_ON[device]


def _fused_step_(core: Any, plan: Any, split: bool, params: PyTree, grads: PyTree, state: Any, opt: Any,
                 checked: bool = False):
    """The in-place step as one ``adam_lowmem_step_`` pass, or None (nothing written) when the
    call is not one the kernels serve: another optimizer or AMSGrad, tensors on a device without
    kernels (CUDA needs the CUDA kernels loaded) or not all on the params' device, of other
    dtypes or not contiguous (params, gradients, moments, remainders, the step), gradients that
    do not fit their params (the plain path then names the leaf), an fp32 master copy, or the
    compiled kernels not loaded. Cost: the gradients' check pass and one kernel pass; the CPU
    kernel reads ``finite`` on the host (CPU tensors: no device sync), the CUDA kernel reads
    ``finite``, the step, the gradient scale and the lr tensor on the device (no sync)."""
    if not _kernel_serves(plan, split, state):
        return None
    p_leaves, spec = tree_flatten(params)
    try:
        g_leaves, g_spec = tree_flatten(grads)
    except Exception:  # noqa: BLE001 - not a tree of tensors: the plain path names the fault
        return None
    allowed = (torch.bfloat16, torch.float32) if split else (torch.float32,)
    device = _kernel_device(p_leaves)
    if device is None or g_spec != spec or not (checked or _dense_on(p_leaves, allowed, device)) or \
            not _dense_on(g_leaves, _KERNEL_GRADS, device) or \
            any(g.shape != p.shape for g, p in zip(g_leaves, p_leaves)):
        return None
    if device.type != "cpu" and not _dense_on([opt.step], (torch.float32,), device):
        return None
    lists = []
    for field in ("exp_avg", "exp_avg_sq"):
        slot = getattr(opt, field)
        if isinstance(slot, Q8Moment):
            codes, absmax = tree_flatten(slot.codes)[0], tree_flatten(slot.absmax)[0]
        else:
            codes = tree_flatten(slot)[0]
            absmax = [_no_tensor(torch.float32, device)] * len(codes)
        if len(codes) != len(p_leaves):
            return None
        if not checked and (not _dense_on(codes, _KERNEL_MOMENTS, device) or
                            not _dense_on(absmax, (torch.float32,), device) or
                            any(c.shape != p.shape for c, p in zip(codes, p_leaves))):
            return None
        lists += [codes, absmax]
    if split:
        remainders = tree_flatten(state.master.remainder)[0]
        if not checked and not _dense_on(remainders, (torch.int16,), device):
            return None  # a strided remainder (a state edited by hand): the plain path takes it
    else:
        remainders = [_no_tensor(torch.int16, device)] * len(p_leaves)
    on_check = None
    if core.on_check is not None and not _loading._is_compiling():
        hook = core.on_check
        on_check = lambda finite, leaf_nonfinite: hook(  # noqa: E731
            finite, leaf_nonfinite, lambda: [p for p, _ in leaves_with_paths(params)])
    h = plan._hypers
    maps, bases = _lookup_on(device)
    with torch.no_grad():
        finite, grad_scale, lr = plan._prologue(g_leaves, opt, state.loss_scale, core.group, on_check)
        lr_value, lr_tensor = _loading._split_lr(lr) if isinstance(lr, torch.Tensor) else (float(lr), None)
        torch.ops.ampfunc.adam_lowmem_step_(
            p_leaves, remainders, g_leaves, *lists, opt.step, grad_scale, finite, maps, bases, lr_value, lr_tensor,
            h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["decoupled_weight_decay"], h["maximize"])
        ls = state.loss_scale
        if isinstance(ls, DynamicLossScale):
            ls._adjust_(finite.to(ls.loss_scale.device))
    return params, core._commit_stats(state, finite)
