"""A pytree flattened into one contiguous buffer per (device, dtype) group, with views back.

::

    flat = af.flat.flatten(params)                 # copies every float leaf into its group's buffer
    flat.buffers                              # tuple of 1-D tensors, one per (device, dtype)
    flat.tree                                 # the pytree again, each float leaf a view of a buffer
    flat.unflatten(other_buffers)             # the same views over other buffers (e.g. gradients)

Why: per-tensor overhead (a kernel launch, a Python loop step, an argument slot) is paid once
per buffer instead of once per leaf, and elementwise work over a buffer is one pass. Every
kernel of :mod:`ampfunc.ops` accepts both a buffer and the list of its views; the CUDA glue
merges views that tile one buffer back into a single range, so a tree of 10,000 leaves is as
cheap as one of 10.

With ``torch.func``, differentiate with respect to the buffers and get flat gradients::

    def loss_fn(buffers, x, y):
        out = functional_call(model, flat.unflatten(buffers), (x,))
        return F.cross_entropy(out, y)

    grads = torch.func.grad(loss_fn)(flat.buffers, x, y)    # tuple of flat gradient buffers
    grad_tree = flat.unflatten(grads)                       # views, no copy

Leaves that are not floating-point tensors (integer buffers, ``None``, Python scalars) are
kept as they are and appear unchanged in :attr:`FlatTree.tree`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from ampfunc import ops
from ampfunc.tree import PyTree, leaves_with_paths, tree_flatten, tree_unflatten

__all__ = ["FlatTree", "flatten", "unflatten", "zeros_packed", "copy_packed", "unpacked"]


class _Slot(NamedTuple):
    group: int  # index into FlatTree.keys / buffers
    offset: int
    shape: torch.Size


class FlatTree:
    """Float leaves of a pytree packed into one contiguous 1-D buffer per (device, dtype).

    Made by :func:`flatten`, which copies every float leaf once; :attr:`tree` and
    :meth:`unflatten` only make views (free). The buffers own the memory: writing a buffer in
    place changes the leaves of :attr:`tree` and vice versa. :meth:`unflatten` views other
    buffers of the same layout (e.g. gradients); :meth:`zeros_like` and :meth:`flatten_like`
    make new ones.

    Attributes:
      treespec: the structure of the flattened tree.
      keys: the ``(device, dtype)`` of each buffer (``keys[i]`` of ``buffers[i]``), numbered in
        the order their first leaf appears.
      buffers: the 1-D buffers, one per key.
      tree: (property) the pytree, float leaves as views of ``buffers``, other leaves as given.

    Example:
      >>> flat = af.flat.flatten({"w": torch.ones(2, 3), "b": torch.zeros(3), "step": torch.tensor(0)})
      >>> flat
      FlatTree(2 leaves in 1 buffers: cpu/float32: 9)
      >>> _ = flat.buffers[0].fill_(2.0)                  # writes the leaves of flat.tree
      >>> flat.tree["w"].tolist(), int(flat.tree["step"])  # the int leaf is kept as it is
      ([[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]], 0)
      >>> flat.unflatten(flat.zeros_like())["w"].shape     # the same views over new buffers
      torch.Size([2, 3])
    """

    __slots__ = ("treespec", "keys", "buffers", "_slots", "_static", "_paths")

    def __init__(self, treespec, keys, buffers, slots, static, paths):
        self.treespec = treespec
        self.keys: tuple = tuple(keys)
        self.buffers: tuple = tuple(buffers)
        self._slots: list = slots  # per leaf: _Slot, or None for a leaf kept as it is
        self._static: list = static  # per leaf: the kept value (None where slotted)
        self._paths: list = paths

    # -- views -------------------------------------------------------------------------------

    @property
    def tree(self) -> PyTree:
        """The pytree, float leaves as views of :attr:`buffers`."""
        return self.unflatten(self.buffers)

    def unflatten(self, buffers: Sequence[torch.Tensor]) -> PyTree:
        """The pytree with float leaves viewed from ``buffers`` (same groups, same sizes as
        :attr:`buffers`, e.g. the gradients ``torch.func.grad`` returns for them). Views only;
        traceable by ``torch.func`` and ``torch.compile``."""
        buffers = tuple(buffers)
        if len(buffers) != len(self.buffers):
            raise ValueError(f"FlatTree.unflatten: expected {len(self.buffers)} buffers (groups "
                             f"{self._key_names()}), got {len(buffers)}")
        for i, (b, ref) in enumerate(zip(buffers, self.buffers)):
            if b.dim() != 1 or b.numel() != ref.numel():
                raise ValueError(f"FlatTree.unflatten: buffer {i} ({self._key_names()[i]}) has shape "
                                 f"{tuple(b.shape)}, expected ({ref.numel()},)")
        leaves = [
            buffers[s.group].narrow(0, s.offset, _numel(s.shape)).view(s.shape) if s is not None else v
            for s, v in zip(self._slots, self._static)
        ]
        return tree_unflatten(self.treespec, leaves)

    def leaves(self, buffers: Sequence[torch.Tensor] | None = None) -> list:
        """The float leaves (views) in tree order, of :attr:`buffers` or of ``buffers``."""
        buffers = self.buffers if buffers is None else tuple(buffers)
        return [buffers[s.group].narrow(0, s.offset, _numel(s.shape)).view(s.shape)
                for s in self._slots if s is not None]

    # -- new buffers of the same layout ------------------------------------------------------

    def zeros_like(self, dtype: torch.dtype | None = None) -> tuple:
        """New zero buffers of the same sizes and devices (``dtype`` overrides each group's)."""
        return tuple(torch.zeros_like(b, dtype=dtype) for b in self.buffers)

    def flatten_like(self, tree: PyTree) -> tuple:
        """Copies ``tree`` (same structure, same float-leaf shapes; e.g. the gradients of the
        unflattened params) into new buffers of this layout. One copy per leaf."""
        leaves, spec = tree_flatten(tree)
        if spec != self.treespec:
            raise ValueError(f"FlatTree.flatten_like: the tree's structure differs from the flattened one "
                             f"({spec} vs {self.treespec})")
        out = [torch.empty_like(b) for b in self.buffers]
        for leaf, s, path in zip(leaves, self._slots, self._paths):
            if s is None:
                continue
            if not isinstance(leaf, torch.Tensor) or leaf.shape != s.shape:
                raise ValueError(f"FlatTree.flatten_like: leaf {path!r} is "
                                 f"{getattr(leaf, 'shape', type(leaf).__name__)}, expected shape {tuple(s.shape)}")
            out[s.group].narrow(0, s.offset, _numel(s.shape)).view(s.shape).copy_(leaf)
        return tuple(out)

    def __repr__(self) -> str:
        groups = ", ".join(f"{k}: {b.numel()}" for k, b in zip(self._key_names(), self.buffers))
        n = sum(s is not None for s in self._slots)
        return f"FlatTree({n} leaves in {len(self.buffers)} buffers: {groups})"

    def _key_names(self) -> list[str]:
        return [f"{d}/{str(t).replace('torch.', '')}" for d, t in self.keys]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def flatten(tree: PyTree) -> FlatTree:
    """Packs the floating-point tensor leaves of ``tree`` into one contiguous buffer per (device, dtype).

    The leaves are copied in tree order; leaves that are not floating tensors are kept as they
    are. ``tree`` is not modified. Gradient tracking is not carried over (the buffers are new
    tensors that do not require grad).

    Args:
      tree: a pytree (e.g. ``af.params_of(model)``).

    Returns:
      The :class:`FlatTree`: its ``buffers`` hold the copies, its ``tree`` views them.

    Example:
      >>> flat = af.flat.flatten(af.params_of(nn.Linear(4, 2)))
      >>> flat
      FlatTree(2 leaves in 1 buffers: cpu/float32: 10)
      >>> flat.buffers[0].shape, flat.tree["weight"].shape
      (torch.Size([10]), torch.Size([2, 4]))

    Raises:
      ValueError: two float leaves share memory (a tied weight listed twice, overlapping
        views): each would get its own copy, untying them.

    Cost: one allocation per (device, dtype) and one copy of every float leaf; no host sync.
    """
    leaves, spec = tree_flatten(tree)
    paths = [p for p, _ in leaves_with_paths(tree)]
    if len(paths) != len(leaves):  # leaves_with_paths skips nothing the flatten keeps; be safe
        paths = [str(i) for i in range(len(leaves))]
    floats = [(path, leaf) for path, leaf in zip(paths, leaves)
              if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
    # (a trace's fake tensors have no addresses to compare)
    pair = None if torch.compiler.is_compiling() else ops.overlapping_pair([leaf for _, leaf in floats])
    if pair is not None:
        # each leaf gets its own slot: writing one would no longer move the other (untied)
        (a, _), (b, _) = floats[pair[0]], floats[pair[1]]
        raise ValueError(f"flatten: leaves {a!r} and {b!r} share memory (a tied weight, or overlapping views); "
                         "flattened, they would be copied apart and trained apart: pass each tensor once "
                         "(af.params_of(model) lists a tied weight once)")
    keys: list = []
    sizes: list = []
    slots: list = []
    static: list = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            key = (leaf.device, leaf.dtype)
            if key not in keys:
                keys.append(key)
                sizes.append(0)
            g = keys.index(key)
            slots.append(_Slot(g, sizes[g], leaf.shape))
            static.append(None)
            sizes[g] += leaf.numel()
        else:
            slots.append(None)
            static.append(leaf)
    buffers = [torch.empty(n, dtype=dt, device=dev) for (dev, dt), n in zip(keys, sizes)]
    with torch.no_grad():
        for leaf, s in zip(leaves, slots):
            if s is not None:
                buffers[s.group].narrow(0, s.offset, leaf.numel()).view(leaf.shape).copy_(leaf)
    return FlatTree(spec, keys, buffers, slots, static, paths)


def unflatten(flat: FlatTree, buffers: Sequence[torch.Tensor] | None = None) -> PyTree:
    """The pytree of views into ``buffers`` laid out as ``flat`` (``flat.tree`` when None).

    Args:
      flat: a :class:`FlatTree` (from :func:`flatten`).
      buffers: one buffer per group of ``flat``, of its buffers' sizes and dtypes (default: the
        buffers ``flat`` holds).

    Returns:
      A pytree of ``flat``'s structure whose leaves are views into ``buffers``.

    Example:
      >>> flat = af.flat.flatten({"w": torch.ones(2, 3), "b": torch.zeros(3)})
      >>> tree = af.flat.unflatten(flat, [buf * 2 for buf in flat.buffers])
      >>> tree["w"].shape, float(tree["w"].sum())
      (torch.Size([2, 3]), 12.0)

    Cost: one view per leaf; no copy, no host sync.
    """
    return flat.tree if buffers is None else flat.unflatten(buffers)


# CPU views start on a 64-byte line: aligned vector loads and stores, and no line shared by two
# leaves (two threads writing neighbouring leaves would contend for it). CUDA views tile their
# buffer exactly, so that the CUDA glue can merge them back into one range.
_CPU_ALIGN_ELEMS = 16


def _packable(t) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() and t.layout == torch.strided
            and t.is_contiguous() and t.device.type in ("cpu", "cuda")
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def _pack(leaves: list, dtypes: list, zeros: bool) -> list:
    """Per leaf: a view of one new buffer per (device, dtype) (zero-filled, or uninitialized),
    or None for a leaf that cannot be one (see :func:`zeros_packed`)."""
    modes = torch._C._is_torch_function_mode_enabled() or \
        torch._C._len_torch_dispatch_stack() > 0 or torch.compiler.is_compiling()
    if modes:
        return [None] * len(leaves)
    totals: dict = {}
    offsets: list = []
    for t, dt in zip(leaves, dtypes):
        if not (isinstance(t, torch.Tensor) and _packable(t)):
            offsets.append(None)
            continue
        key = (t.device, dt)
        align = _CPU_ALIGN_ELEMS if t.device.type == "cpu" else 1
        at = -(-totals.get(key, 0) // align) * align
        offsets.append(at)
        totals[key] = at + t.numel()
    new = torch.zeros if zeros else torch.empty
    buffers = {key: new(n, dtype=key[1], device=key[0]) for key, n in totals.items()}
    return [buffers[(t.device, dt)].narrow(0, off, t.numel()).view(t.shape) if off is not None else None
            for t, dt, off in zip(leaves, dtypes, offsets)]


def zeros_packed(tree: PyTree, dtype: torch.dtype | Callable[[torch.dtype], torch.dtype] = torch.float32) -> PyTree:
    """Zeros shaped like each float leaf of ``tree`` (in ``dtype``), as views of one new buffer
    per (device, dtype): an optimizer's moments laid out as one stream.

    A kernel step over 10,000 separately allocated leaves reads each list as 10,000 short runs
    scattered over the heap; over views of one buffer it reads one run. The views are ordinary
    views of that buffer: they share its storage (``torch.save`` of the whole state stores it
    once, of a single leaf stores the whole buffer) and, as torch's views do, its version counter
    (an in-place write to one leaf moves every leaf's ``_version``). Leaves that cannot be views
    of a plain buffer (tensor subclasses such as ``DTensor``, ``torch.func`` wrappers,
    non-contiguous or sparse tensors) and any leaf while a ``torch.compile`` trace or a
    dispatch/function mode is active get their own ``torch.zeros_like``. Every leaf must be a
    floating tensor (the optimizers validate their params first).

    Args:
      tree: a pytree of floating tensors (an optimizer's params).
      dtype: the dtype of the zeros, or a rule giving it from a leaf's dtype (the optimizers'
        :func:`ampfunc.tree.arithmetic_dtype`: float32, float64 for float64 leaves).

    Returns:
      The tree of zeros (same structure).

    Example:
      >>> state = zeros_packed({"w": torch.ones(2, 3), "b": torch.ones(3)})
      >>> state["w"].untyped_storage().data_ptr() == state["b"].untyped_storage().data_ptr()
      True

    Cost: one allocation and one zero fill per device; no host sync.
    """
    leaves, spec = tree_flatten(tree)
    dtypes = [dtype(t.dtype) for t in leaves] if callable(dtype) else [dtype] * len(leaves)
    views = _pack(leaves, dtypes, zeros=True)
    return tree_unflatten(spec, [v if v is not None else torch.zeros_like(t, dtype=dt)
                                 for t, dt, v in zip(leaves, dtypes, views)])


def copy_packed(tree: PyTree, dtype_of: Callable[[torch.dtype], torch.dtype]) -> PyTree:
    """A detached copy of every float leaf of ``tree`` in ``dtype_of(leaf.dtype)``, as views of
    one new buffer per (device, dtype): fp32 master weights of fp16/bf16 params laid out as one
    stream (see :func:`zeros_packed` for why and for the leaves that get their own copy).

    Args:
      tree: a pytree of floating tensors (the params).
      dtype_of: the copy's dtype for a leaf of a given dtype (the engine's master dtype rule).

    Returns:
      The tree of copies (same structure).

    Example:
      >>> half = {"w": torch.ones(2, 3, dtype=torch.float16), "b": torch.ones(3, dtype=torch.float16)}
      >>> masters = copy_packed(half, lambda dt: torch.float32)
      >>> masters["w"].dtype, masters["w"].untyped_storage().data_ptr() == masters["b"].untyped_storage().data_ptr()
      (torch.float32, True)

    Cost: one allocation per (device, dtype) and one copy of every leaf; no host sync.
    """
    leaves, spec = tree_flatten(tree)
    dtypes = [dtype_of(t.dtype) for t in leaves]
    views = _pack(leaves, dtypes, zeros=False)
    out = []
    with torch.no_grad():
        for t, dt, v in zip(leaves, dtypes, views):
            out.append(v.copy_(t) if v is not None else t.detach().to(dt, copy=True))
    return tree_unflatten(spec, out)


def unpacked(tree: PyTree) -> PyTree:
    """``tree`` with every tensor leaf that shares its storage with another leaf replaced by a
    copy in a storage of its own: the state to hand to a compiled in-place step.

    ``torch.compile`` treats graph inputs that share a storage and are written in place as
    views of one base it rebuilds every call: for a packed optimizer state (the moments of
    :func:`zeros_packed`, the masters of :func:`copy_packed`) donated to a compiled
    ``mixed_precision(...).step_``, the graph copies the packed buffer once per leaf, every
    step. Measured on ``benchmarks/bench_transformer.py``'s 2-layer GPT (29 param tensors, CPU,
    torch 2.13): 62 ms per compiled ``step_`` against 16 ms with this function's state.
    ``make_train_step``'s ``init`` applies it; call it yourself on ``tx.init(params)`` before
    compiling ``tx.step_``. Eager steps and pure steps (which write nothing they are given)
    do not need it: they read packed state at full speed.

    Args:
      tree: a pytree (an optimizer or mixed-precision state).

    Returns:
      The same structure; leaves with a storage of their own are returned as they are (no
      copy), the others as contiguous copies.

    Example:
      >>> moments = zeros_packed({"w": torch.ones(2, 3), "b": torch.ones(3)})   # one buffer
      >>> own = unpacked(moments)
      >>> own["w"].untyped_storage().data_ptr() != own["b"].untyped_storage().data_ptr()
      True

    Cost: one copy of each shared leaf (none inside a ``torch.compile`` trace, where the
    inputs' storages are the compiler's); no host sync.
    """
    if torch.compiler.is_compiling():
        return tree
    leaves, spec = tree_flatten(tree)
    keys = [_storage_key(t) for t in leaves]
    seen: dict = {}
    for key in keys:
        if key is not None:
            seen[key] = seen.get(key, 0) + 1
    with torch.no_grad():
        out = [t.clone(memory_format=torch.contiguous_format) if key is not None and seen[key] > 1 else t
               for t, key in zip(leaves, keys)]
    return tree_unflatten(spec, out)


def _storage_key(t):
    """Where ``t``'s storage lives, for a plain tensor with a non-empty one; else None."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr()) if storage.nbytes() > 0 else None
