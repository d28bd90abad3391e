"""DTensor params (FSDP2's ``fully_shard``, ``distribute_tensor``) on every step path: the
fused kernels run on each rank's local shards.

The ampfunc ops have no DTensor sharding strategies: every one of them is element-wise per
leaf, except the two reductions a step takes over *all* leaves, the finiteness flag and the
global norm for clipping. So the front doors (``mixed_precision``'s ``init``/``update``/
``step``/``step_``, ``make_train_step``, ``ModuleTrainer``) unwrap DTensor leaves to their local
shards (``to_local()``: an alias of the shard's storage, no copy), run the step on the shards,
and re-wrap the new params as DTensors with the same mesh, placements, shape and stride. While
the step runs on the shards, :func:`active` says how those shards lie on the mesh, and the two
reductions are completed across it (:meth:`Sharding.reduce`): the overflow flag over every mesh
dimension (every rank skips the same steps), the sum of squares over the dimensions each leaf is
sharded on (replicated dimensions count once). Both travel in one small all-reduce per mesh
dimension (one for FSDP2's 1-D mesh), on the device, with no host sync.

The optimizer state (master weights, moments) is made per rank on the local shards as plain
tensors: ``torch.save`` of a rank's state, or :func:`ampfunc.dist.save_sharded`, resumes bit for
bit on the same mesh.
"""

from __future__ import annotations

import contextvars
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from ampfunc import ops
from ampfunc.dist import _dtensor_loaded, _dtensor_types
from ampfunc.tree import PyTree, leaves_with_paths, tree_flatten, tree_leaves, tree_unflatten

__all__ = ["Sharding", "LocalView", "sharding_of", "local_view", "active", "grads_to_local"]

# The sharding of the step now running on local shards (None outside such a step).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ampfunc_active_sharding", default=None)


def active() -> Optional["Sharding"]:
    """The :class:`Sharding` of the step running now on local shards, or None. Read by the
    reductions across leaves (the fused check, ``clip_by_global_norm``, ``global_norm``) so
    that they count the whole tensors, not this rank's shards. None inside a ``torch.compile``
    trace (the unwrap runs eagerly, at the front door)."""
    if torch.compiler.is_compiling():
        return None
    return _ACTIVE.get()


class Sharding:
    """How the DTensor leaves of a params tree lie on one device mesh.

    ``mesh``: the mesh; ``layouts[i]``: the mesh dimensions leaf ``i`` is sharded on (empty:
    replicated); ``specs[i]``: its ``(placements, shape, stride)`` to re-wrap a local shard.
    Use as a context manager around a step on the local shards (see :func:`active`).
    """

    __slots__ = ("mesh", "layouts", "specs", "_token", "_by_id")

    def __init__(self, mesh, layouts: list, specs: list):
        self.mesh = mesh
        self.layouts = layouts
        self.specs = specs
        self._token = None
        # id(local gradient shard) -> its layout, for this step's gradients (set by
        # grads_to_local): the fused check lines leaves up in its own order
        self._by_id: dict = {}

    def __enter__(self) -> "Sharding":
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)
        self._token = None

    def wrap(self, leaves: list) -> list:
        """Local shards back into DTensors with each leaf's mesh, placements, shape and stride."""
        DTensor = _dtensor_types()[0]
        return [DTensor.from_local(t, self.mesh, placements, run_check=False, shape=shape, stride=stride)
                for t, (placements, shape, stride) in zip(leaves, self.specs)]

    def reduce(self, finite: Optional[torch.Tensor], leaves: Optional[list] = None,
               inv_scale: Optional[torch.Tensor] = None, local_norm: Optional[torch.Tensor] = None):
        """``(finite, norm)`` agreed across the mesh.

        Args:
          finite: this rank's 0-d bool flag, or None (then None comes back).
          leaves: this rank's shards of the tensors whose global norm is wanted (in the order
            of the params tree), or None for no norm.
          inv_scale: the norm is that of ``leaf * inv_scale`` (the unscaled gradients).
          local_norm: the norm of all of ``leaves`` on this rank, when already taken (the fused
            check takes it in its pass): used as is when every leaf has one layout.

        Returns:
          The flag, True only where every rank of the mesh saw finite values, and the fp32
          norm of the whole tensors (their shards' squares summed over the mesh dimensions
          each is sharded on), the same on every rank. Cost: one all-reduce of a few float64
          numbers per mesh dimension (one for a 1-D mesh), plus one read of the shards when the
          norm is wanted and not given; no host sync.
        """
        parts: list = []  # (sharded mesh dims, float64 sum of squares of this rank's shards)
        if leaves is not None:
            if len(set(self.layouts)) <= 1 and local_norm is not None:
                parts.append((self.layouts[0] if self.layouts else (), local_norm.double().square()))
            else:
                dims_of = [self._by_id.get(id(t)) for t in leaves]
                if len(set(self.layouts)) <= 1:
                    dims_of = [self.layouts[0] if self.layouts else ()] * len(leaves)
                elif any(d is None for d in dims_of):
                    if len(leaves) != len(self.layouts):
                        raise ValueError(f"global norm on local shards: {len(leaves)} leaves given, the params have "
                                         f"{len(self.layouts)} with different shardings; take the norm of a tree "
                                         "laid out like the params")
                    dims_of = self.layouts  # a tree of the params' structure, in its flattening order
                by_layout: dict = {}
                for t, dims in zip(leaves, dims_of):
                    by_layout.setdefault(dims, []).append(t)
                for dims, ts in by_layout.items():
                    parts.append((dims, ops.check_norm(ts, inv_scale)[1].double().square()))
        if finite is None and not parts:
            return None, None
        device = (parts[0][1] if parts else finite).device
        overflow = (~finite).to(device, torch.float64) if finite is not None else None
        for d in range(self.mesh.ndim):
            # The flag over every dimension, a sum of squares over the ones its leaves are
            # sharded on: one all-reduce of the entries this dimension takes.
            idx = [i for i, (dims, _) in enumerate(parts) if d in dims]
            entries = ([overflow] if overflow is not None else []) + [parts[i][1] for i in idx]
            if not entries:
                continue
            buf = torch.stack([e.reshape(()) for e in entries])
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.mesh.get_group(d))
            k = 0
            if overflow is not None:
                overflow, k = buf[0], 1
            for j, i in enumerate(idx):
                parts[i] = (parts[i][0], buf[k + j])
        agreed = (overflow == 0) if overflow is not None else None
        if finite is not None and agreed is not None:
            agreed = agreed.to(finite.device)
        norm = None
        if parts:
            norm = torch.stack([s for _, s in parts]).sum().sqrt().to(torch.float32)
        return agreed, norm


def _placement_dims(where: str, path: str, x) -> tuple:
    _, Partial, Replicate, Shard = _dtensor_types()
    dims = []
    for i, p in enumerate(x.placements):
        if isinstance(p, Shard):
            dims.append(i)
        elif not isinstance(p, Replicate):
            raise ValueError(f"{where}: params leaf {path!r} is a DTensor with placement {p!r} on mesh dimension "
                             f"{i}; the step takes Shard and Replicate placements (a Partial param holds partial "
                             "sums: redistribute it to Shard or Replicate first)")
    return tuple(dims)


def _same_mesh(a, b) -> bool:
    return a is b or a == b


def sharding_of(paths: list, leaves: list, where: str) -> Optional[Sharding]:
    """The :class:`Sharding` of params ``leaves`` (named by ``paths``), or None when none is a
    DTensor. Refused, naming the leaf, before anything is written: a mix of DTensor and plain
    floating params, DTensors on different meshes, a placement other than Shard/Replicate.
    Cost: a look at each leaf's type and placements; no kernel, no host sync."""
    if not _dtensor_loaded():
        return None
    DTensor = _dtensor_types()[0]
    first = next((i for i, x in enumerate(leaves) if isinstance(x, DTensor)), None)
    if first is None:
        return None
    mesh = leaves[first].device_mesh
    layouts, specs = [], []
    for path, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            continue
        if not isinstance(x, DTensor):
            raise ValueError(f"{where}: params leaf {path!r} is a plain tensor but leaf {paths[first]!r} is a "
                             "DTensor: the step takes every param sharded (FSDP2's fully_shard or "
                             "distribute_tensor, on one mesh) or none (pass the local shards, to_local(), with "
                             "group=)")
        if not _same_mesh(x.device_mesh, mesh):
            raise ValueError(f"{where}: params leaf {path!r} is a DTensor on mesh {x.device_mesh} but leaf "
                             f"{paths[first]!r} is on mesh {mesh}: one step takes the params of one mesh (step "
                             "each mesh's params with its own transform)")
        layouts.append(_placement_dims(where, path, x))
        specs.append((tuple(x.placements), x.shape, x.stride()))
    return Sharding(mesh, layouts, specs)


def _local(x):
    with torch.no_grad():
        return x.to_local()


def grads_to_local(sharding: Sharding, paths: list, params: list, grads: list, where: str) -> list:
    """This rank's shards of ``grads``, laid out as the params' shards.

    A gradient whose placements differ from its param's (``distribute_tensor`` params
    differentiated through DTensor ops give e.g. ``Shard(1)`` or ``Partial`` gradients) is
    redistributed to the param's placements first (a collective; FSDP2's gradients already
    match: no communication). Refused, naming the leaf: a plain gradient for a DTensor param,
    a gradient on another mesh. Cost: one ``to_local()`` per leaf; no host sync."""
    DTensor = _dtensor_types()[0]
    out = []
    sharding._by_id = {}
    layouts = iter(sharding.layouts)
    for path, p, g in zip(paths, params, grads):
        dims = next(layouts) if isinstance(p, torch.Tensor) else None
        if not isinstance(g, torch.Tensor):
            out.append(g)
            continue
        if not isinstance(g, DTensor):
            raise ValueError(f"{where}: grads leaf {path!r} is a plain tensor but its param is a DTensor: pass the "
                             "DTensor gradients (param.grad under FSDP2), or the local shards of both params and "
                             "grads with group=")
        if not _same_mesh(g.device_mesh, sharding.mesh):
            raise ValueError(f"{where}: grads leaf {path!r} is on mesh {g.device_mesh}, its param on mesh "
                             f"{sharding.mesh}")
        if isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            with torch.no_grad():
                g = g.redistribute(sharding.mesh, p.placements)
        local = _local(g)
        sharding._by_id[id(local)] = dims
        out.append(local)
    return out


class LocalView:
    """A step's params (and gradients) seen as local shards, with the way back to DTensors."""

    __slots__ = ("sharding", "params", "grads", "_spec")

    def __init__(self, sharding: Sharding, params: PyTree, grads: PyTree, spec):
        self.sharding = sharding
        self.params = params
        self.grads = grads
        self._spec = spec

    def wrap(self, local_params: PyTree) -> PyTree:
        """New local params (the tree of :attr:`params`' structure) as DTensors laid out as the
        given params: the same mesh, placements, global shape and stride."""
        leaves, spec = tree_flatten(local_params)
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        wrapped = self.sharding.wrap([leaves[i] for i in tensors])
        for i, w in zip(tensors, wrapped):
            leaves[i] = w
        return tree_unflatten(spec, leaves)


def local_view(params: PyTree, grads: PyTree = None, *, where: str) -> Optional[LocalView]:
    """The params (and ``grads``) as local shards, or None when no leaf of either is a DTensor.

    Refused with ``ValueError`` naming the leaf (nothing is written): a mix of DTensor and plain
    params, DTensors on different meshes, a Partial param, DTensor gradients for plain params
    or plain gradients for DTensor params. Cost: one ``to_local()`` per leaf (no copy; a
    gradient laid out unlike its param is redistributed first); no host sync.
    """
    if torch.compiler.is_compiling() or not _dtensor_loaded():
        return None
    DTensor = _dtensor_types()[0]
    # the common case, no DTensor: the set of the leaves' types, no paths built
    if not _holds(params, DTensor):
        if grads is not None and _holds(grads, DTensor):
            path = next(p for p, g in leaves_with_paths(grads) if isinstance(g, DTensor))
            raise ValueError(f"{where}: grads leaf {path!r} is a DTensor but the params are plain tensors: "
                             "pass the DTensor params (dict(model.named_parameters()) under FSDP2), or the "
                             "local shards of both with group=")
        return None
    p_flat, p_spec = tree_flatten(params)
    items = leaves_with_paths(params)
    paths, leaves = [p for p, _ in items], [x for _, x in items]
    sharding = sharding_of(paths, leaves, where)
    local_params = tree_unflatten(p_spec, [_local(x) if isinstance(x, torch.Tensor) else x for x in p_flat])
    local_grads = None
    if grads is not None:
        g_flat, g_spec = tree_flatten(grads)
        if g_spec != p_spec:
            # the engine names the first differing leaf on the local trees
            local_grads = tree_unflatten(g_spec, [_local(g) if _is_dtensor(g) else g for g in g_flat])
        else:
            local_grads = tree_unflatten(g_spec, grads_to_local(sharding, paths, p_flat, g_flat, where))
    return LocalView(sharding, local_params, local_grads, p_spec)


def _holds(tree: PyTree, cls) -> bool:
    """Whether a leaf of ``tree`` is a ``cls``: a flat dict's values are read directly (0.4 ms
    for 10,000 leaves, a twentieth of flattening it), any other tree is flattened."""
    values = tree.values() if type(tree) is dict else None
    types = set(map(type, values)) if values is not None else ()
    if values is None or not all(issubclass(t, torch.Tensor) for t in types):
        types = set(map(type, tree_leaves(tree)))
    return any(issubclass(t, cls) for t in types)


def _is_dtensor(x: Any) -> bool:
    return _dtensor_loaded() and isinstance(x, _dtensor_types()[0])


def fully_sharded_module(model: torch.nn.Module) -> str | None:
    """The path of the first submodule of ``model`` managed by FSDP2's ``fully_shard`` (``""``
    for the model itself), or None. Free when FSDP2 was never imported."""
    if "torch.distributed.fsdp" not in sys.modules and "torch.distributed._composable.fsdp" not in sys.modules:
        return None
    try:  # public since torch 2.6
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - depends on the torch version
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore
        except ImportError:
            return None
    return next((name for name, m in model.named_modules() if isinstance(m, FSDPModule)), None)
