"""Distributed helpers on ``torch.distributed``: launching, reductions, sharded norms and state.

Three rules make a mixed-precision step correct across processes, and each has a helper here:

* every rank skips the same steps, so the loss scale stays identical everywhere:
  ``unscale_and_check(grads, ls, group=pg)`` all-reduces the overflow flag (the collective is
  :func:`agree_finite`: a MAX all-reduce of one float, on the device, no host sync);
* under sharding (FSDP2's ``fully_shard``, DTensor) each rank holds only its shards, so the
  global gradient norm for clipping is the all-reduced sum of the local sums of squares:
  :func:`sharded_global_norm`, used by ``ampfunc.optim.global_norm(tree, group)`` and
  ``ampfunc.clip_by_global_norm(max_norm, group=group)``;
* sharded optimizer state is saved and loaded per rank: :func:`save_sharded`, :func:`load_sharded`.

Plain tensors passed with a ``group`` are taken to be *local shards* of a tensor sharded over
that group (what :class:`ampfunc.ModuleTrainer` hands its transforms under FSDP2). Under DDP the
gradients are replicated: pass no ``group`` to the norm (it would count every rank's copy).
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ampfunc import ops
from ampfunc.tree import PyTree, leaves_with_paths, tree_flatten, tree_map, tree_structure, tree_unflatten

__all__ = [
    "DistEnv",
    "init_from_env",
    "agree_finite",
    "all_reduce_mean",
    "is_dtensor",
    "local_shards",
    "any_dtensor",
    "sharded_global_norm",
    "scale_tree",
    "save_sharded",
    "load_sharded",
]

# torch.distributed.tensor costs about a second to import: it is loaded on first use, so that
# the layers below the front-ends can import this module at their top for free.
_DTENSOR: list = []


def _dtensor_types():
    """``(DTensor, Partial, Replicate, Shard)``, imported on first use (empty tuples when torch is
    built without distributed: then no leaf is ever a DTensor)."""
    if not _DTENSOR:
        try:  # public since torch 2.5; torch 2.4 has it under _tensor
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
        except ImportError:  # pragma: no cover - depends on the torch version and build
            try:
                from torch.distributed._tensor import DTensor  # type: ignore
                from torch.distributed._tensor.placement_types import Partial, Replicate, Shard  # type: ignore
            except ImportError:
                DTensor = Partial = Replicate = Shard = ()  # type: ignore  # isinstance(x, ()) is False
        _DTENSOR.extend([DTensor, Partial, Replicate, Shard])
    return tuple(_DTENSOR)


def agree_finite(finite: torch.Tensor, group) -> torch.Tensor:
    """``finite`` and-reduced over the ranks of ``group``: ``True`` only where every rank's is.

    The flag is turned into an overflow float (1.0 when not finite), all-reduced with MAX and
    compared with 0. ``group=None`` means the default (world) group, which must be
    initialized: this always runs the collective, even with one rank (the front-ends call it
    only when given a group). With a world size of 1 it returns ``finite``'s value.

    Args:
      finite: 0-d bool tensor, this rank's flag.
      group: a ``torch.distributed`` process group (``None``: the default group).

    Returns:
      A new 0-d bool tensor, the same on every rank: every rank skips the same steps and its
      loss scale stays identical.

    Example:
      >>> import torch.distributed as dist
      >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
      >>> af.dist.agree_finite(torch.tensor(True), None), af.dist.agree_finite(torch.tensor(False), None)
      (tensor(True), tensor(False))
      >>> dist.destroy_process_group()

    Cost: one all-reduce of one float on the flag's device, plus three one-element kernels
    (not, cast, compare); no host sync.
    """
    if not torch.compiler.is_compiling():
        _member_world(group, "agree_finite")
    overflow = (~finite).to(torch.float32)
    dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)
    return overflow == 0


class DistEnv(NamedTuple):
    """Where this process stands: ``rank``, ``world_size``, ``local_rank``, its ``device`` and
    the ``group`` to pass to ampfunc (``None`` when running as a single process)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: Any


def init_from_env(backend: str | None = None, device_type: str | None = None) -> DistEnv:
    """Joins the process group that ``torchrun`` describes in the environment, if any.

    With ``WORLD_SIZE`` unset or 1 nothing is initialized and ``group`` is ``None``: the same
    script runs as a single process. Otherwise ``init_process_group`` is called (``nccl`` when
    CUDA is available, else ``gloo``, unless ``backend`` says), each process takes the GPU of its
    ``LOCAL_RANK``, and ``group`` is the world group. Reads ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` as torchrun sets them.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device(device_type)
    if world_size <= 1:
        return DistEnv(0, 1, 0, device, None)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device_type == "cuda" else "gloo"))
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.group.WORLD)


def _member_world(group, where: str) -> int:
    """The world size of ``group``, refusing a process outside it (torch's collectives return at
    once there and ``get_world_size`` gives -1: a division by it negated the gradients)."""
    world = dist.get_world_size(group)
    if world < 1 or dist.get_rank(group) < 0:
        raise ValueError(f"{where}: this process (global rank {dist.get_rank()}) is not a member of the group "
                         "it was given: call it only on the group's ranks, or pass a group that includes this one")
    return world


# (group, tree structure) pairs whose ranks were found to hold trees of one layout: checked on
# the first call, as DDP checks its params' shapes once, at construction
_AGREED: set = set()


def _layout(tree: PyTree) -> list:
    return [(path, tuple(x.shape), str(x.dtype)) for path, x in leaves_with_paths(tree)
            if isinstance(x, torch.Tensor) and torch.is_floating_point(x)]


def _check_same_layout(tree: PyTree, spec, group, device, where: str) -> None:
    """Refuses ranks whose floating leaves differ in paths, shapes or dtypes: averaged in one
    flat buffer, they would mix values of different leaves (or the collective would fail inside
    the backend with no word of why). One all-reduce of two integers and one host read per new
    tree structure (the first step), a set lookup after."""
    # the group object itself (the world group's too: a new one after destroy/init is checked anew)
    key = (group if group is not None else dist.group.WORLD, spec)
    if key in _AGREED:
        return
    layout = _layout(tree)
    digest = int.from_bytes(hashlib.blake2b(repr(layout).encode(), digest_size=7).digest(), "little")
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) == digest and -int(both[1]) == digest:
        _AGREED.add(key)
        return
    layouts = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, layout, group=group)
    rank = dist.get_rank(group)
    for r, other in enumerate(layouts):
        if other == layout:
            continue
        mine, theirs = dict((p, (s, d)) for p, s, d in layout), dict((p, (s, d)) for p, s, d in other)
        for path in list(mine) + [p for p in theirs if p not in mine]:
            if mine.get(path) != theirs.get(path):
                raise ValueError(f"{where}: the ranks' trees differ at leaf {path!r}: (shape, dtype) "
                                 f"{mine.get(path, 'missing')} on rank {rank}, {theirs.get(path, 'missing')} on rank "
                                 f"{r}; every rank must average the same tree (its values averaged in one buffer)")
        raise ValueError(f"{where}: the ranks' trees order their leaves differently (rank {rank} and rank {r})")


def all_reduce_mean(tree: PyTree, group=None) -> PyTree:
    """A new tree: each floating leaf averaged over the ranks of ``group``.

    Each value is divided by the world size before the sum, as DDP's Python allreduce hook does
    (in fp16, summing first can overflow values that each fit; DDP's own reducer may round the
    division differently in the last bit at world sizes that are not powers of two). Leaves are
    packed into one flat buffer per (device, dtype) so the cost is one all-reduce per group of
    leaves, not one per leaf. Integer leaves and ``None`` pass through. Inputs are not modified.

    The first call with a given tree layout checks that every rank holds the same floating
    leaves (paths, shapes, dtypes), refusing a mismatch naming the leaf and the ranks; a process
    outside ``group`` is refused. Cost: the all-reduces, enqueued like any kernel; no host sync,
    except one small read on the first call per layout (the check).
    """
    world = dist.get_world_size(group) if torch.compiler.is_compiling() else _member_world(group, "all_reduce_mean")
    leaves, spec = tree_flatten(tree)
    if not torch.compiler.is_compiling():
        first = next((x for x in leaves if isinstance(x, torch.Tensor) and torch.is_floating_point(x)), None)
        if first is not None:
            device = first.device if dist.get_backend(group) != "gloo" else torch.device("cpu")
            _check_same_layout(tree, spec, group, device, "all_reduce_mean")
    out = list(leaves)
    buckets: dict = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x):
            buckets.setdefault((x.device, x.dtype), []).append(i)
    for idx in buckets.values():
        flat = torch.cat([leaves[i].reshape(-1) for i in idx])
        # Divided before the sum, as DDP's default hook does: summed first, scaled fp16
        # gradients that each fit overflow (40000 + 40000), and every rank would skip the step.
        flat.div_(world)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for i in idx:
            n = leaves[i].numel()
            out[i] = flat[offset:offset + n].view_as(leaves[i])
            offset += n
    return tree_unflatten(spec, out)


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (False, without importing
    ``torch.distributed.tensor``, while nothing has imported it)."""
    return _dtensor_loaded() and isinstance(x, _dtensor_types()[0])


def _dtensor_loaded() -> bool:
    # Nobody can hold a DTensor before torch.distributed.tensor is imported: skip the import then.
    return "torch.distributed.tensor" in sys.modules or "torch.distributed._tensor" in sys.modules


def any_dtensor(leaves) -> bool:
    """Whether any of ``leaves`` is a DTensor (free when ``torch.distributed.tensor`` was never
    imported: nobody can hold one then)."""
    if not _dtensor_loaded():
        return False
    DTensor = _dtensor_types()[0]
    return any(isinstance(x, DTensor) for x in leaves)


def local_shards(tree: PyTree) -> PyTree:
    """``tree`` with every DTensor leaf replaced by its local shard (``to_local()``; no copy)."""
    if not _dtensor_loaded():
        return tree_map(lambda x: x, tree)
    DTensor = _dtensor_types()[0]
    return tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, tree)


def _sharded_mesh_dims(path: str, x) -> tuple[int, ...]:
    _, Partial, Replicate, Shard = _dtensor_types()
    dims = []
    for i, p in enumerate(x.placements):
        if isinstance(p, Shard):
            dims.append(i)
        elif isinstance(p, Partial):
            raise ValueError(f"global_norm: leaf {path!r} is a DTensor with a Partial placement on mesh dim {i}; "
                             "its local values are partial sums, not shards. Reduce it first "
                             "(x.redistribute(placements=[Replicate()]) or Shard)")
        elif not isinstance(p, Replicate):
            raise ValueError(f"global_norm: leaf {path!r} has an unsupported placement {p!r}")
    return tuple(dims)


def sharded_global_norm(tree: PyTree, group=None) -> torch.Tensor:
    """0-d fp32: the L2 norm over all leaves of ``tree`` as if every sharded leaf were whole.

    DTensor leaves (FSDP2 params and grads, ``distribute_tensor``) contribute the sum of squares
    of their local shard, all-reduced over the mesh dimensions they are sharded on (replicated
    dimensions count once). Plain tensor leaves are local: with ``group`` their sum of squares
    is all-reduced over it (local shards of a tensor sharded over ``group``); without, they
    count as they are. The result is the same on every rank and equals the single-process norm
    of the whole tensors (up to fp32 summation order). Cost: one read of the shards and one
    all-reduce of one float per sharding layout; no host sync.
    """
    DTensor = _dtensor_types()[0] if _dtensor_loaded() else ()
    plain: list[torch.Tensor] = []
    by_layout: dict = {}
    for path, x in leaves_with_paths(tree):
        if isinstance(x, DTensor):
            key = (id(x.device_mesh), _sharded_mesh_dims(path, x))
            by_layout.setdefault(key, (x.device_mesh, key[1], []))[2].append(x.to_local())
        elif isinstance(x, torch.Tensor):
            if not torch.is_floating_point(x):
                raise TypeError(f"global_norm: leaf {path!r} has dtype {x.dtype}, expected a floating dtype")
            plain.append(x)
    total = None
    if plain or not by_layout:
        total = ops.check(plain)[1]
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    for mesh, dims, locals_ in by_layout.values():
        sumsq = ops.check(locals_)[1]
        for d in dims:
            dist.all_reduce(sumsq, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        total = sumsq if total is None else total + sumsq.to(total.device)
    return total.sqrt()


def scale_tree(tree: PyTree, coef: torch.Tensor) -> PyTree:
    """A new tree: every tensor leaf times the 0-d ``coef``, kept in the leaf's dtype (the
    product taken as torch takes a 0-d factor: in fp32 for fp16/bf16 leaves, rounded once, as
    the clip without a group does); DTensor leaves are scaled shard by shard and stay DTensors
    with their placements. No host sync."""
    DTensor = _dtensor_types()[0] if _dtensor_loaded() else ()

    def scale(u):
        if isinstance(u, DTensor):
            local = u.to_local()
            return DTensor.from_local(local * coef.to(local.device), u.device_mesh, u.placements,
                                      run_check=False, shape=u.shape, stride=u.stride())
        if isinstance(u, torch.Tensor):
            return u * coef.to(u.device)  # a 0-d fp32 factor: u's dtype, one rounding
        return u

    return tree_map(scale, tree)


# ----------------------------------------------------------------------------------------------
# Sharded state on disk: one file per rank
# ----------------------------------------------------------------------------------------------


def _rank_and_world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        world = _member_world(group, "save_sharded/load_sharded")
        return dist.get_rank(group), world
    return 0, 1


def _shard_file(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, f"shard-{rank:05d}-of-{world:05d}.pt")


def save_sharded(tree: PyTree, directory: str, *, group=None) -> str:
    """Writes this rank's part of ``tree`` to ``directory/shard-RRRRR-of-WWWWW.pt``; returns the path.

    Every rank calls it with its own tree (optimizer state over local shards, ``params_of`` of
    an FSDP2 module, a loss scale...). DTensor leaves are stored as their local shards; the file
    holds the leaves in flattening order with their paths, so it loads with
    ``torch.load(weights_only=True)`` and needs no pickled classes. The write goes to a temporary
    file renamed into place; all ranks then meet at a barrier, so on return every shard exists.
    """
    rank, world = _rank_and_world(group)
    DTensor = _dtensor_types()[0] if _dtensor_loaded() else ()
    os.makedirs(directory, exist_ok=True)
    items = leaves_with_paths(tree)
    payload = {
        "format": "ampfunc.sharded/1",
        "rank": rank,
        "world_size": world,
        "paths": [p for p, _ in items],
        "leaves": [x.to_local().detach().clone() if isinstance(x, DTensor)
                   else x.detach() if isinstance(x, torch.Tensor) else x for _, x in items],
    }
    path = _shard_file(directory, rank, world)
    tmp = path + f".tmp{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    if world > 1:
        dist.barrier(group)
    return path


def load_sharded(directory: str, like: PyTree, *, group=None) -> PyTree:
    """This rank's tree saved by :func:`save_sharded`, rebuilt with the structure of ``like``.

    ``like`` is a tree of the same shape (a freshly initialized state, ``params_of(model)``):
    its structure, loss-scale settings and DTensor layouts are reused, the saved tensors fill it
    (moved to ``like``'s devices; DTensor leaves rewrapped around the loaded local shard). The
    world size and every leaf path and shape must match, else ``ValueError`` names what differs
    and nothing is returned.
    """
    rank, world = _rank_and_world(group)
    path = _shard_file(directory, rank, world)
    if not os.path.exists(path):
        found = sorted(f for f in os.listdir(directory) if f.startswith("shard-")) if os.path.isdir(directory) else []
        raise FileNotFoundError(f"load_sharded: no shard for rank {rank} of {world} in {directory!r} "
                                f"(found {found[:4]}); it must be loaded with the world size it was saved with")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    DTensor = _dtensor_types()[0] if _dtensor_loaded() else ()
    like_items = leaves_with_paths(like)
    like_paths = [p for p, _ in like_items]
    if payload["paths"] != like_paths:
        missing = sorted(set(like_paths) - set(payload["paths"]))[:5]
        extra = sorted(set(payload["paths"]) - set(like_paths))[:5]
        raise ValueError(f"load_sharded: {path} does not match `like`: leaves missing from the file {missing}, "
                         f"leaves only in the file {extra}")
    out = []
    for (p, ref), saved in zip(like_items, payload["leaves"]):
        if isinstance(ref, torch.Tensor):
            local_ref = ref.to_local() if isinstance(ref, DTensor) else ref
            if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(local_ref.shape):
                got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
                raise ValueError(f"load_sharded: leaf {p!r} was saved with shape {got}, `like` has local shape "
                                 f"{tuple(local_ref.shape)}")
            value = saved.to(device=local_ref.device, dtype=local_ref.dtype)
            if isinstance(ref, DTensor):
                value = DTensor.from_local(value, ref.device_mesh, ref.placements, run_check=False,
                                           shape=ref.shape, stride=ref.stride())
            out.append(value)
        else:
            out.append(saved)
    return tree_unflatten(tree_structure(like), out)
