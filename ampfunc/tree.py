"""Pytree helpers over optree.

Every tree function in ampfunc goes through this module so that one registry namespace
(``"ampfunc"``) is used everywhere: loss scales and other ampfunc containers are registered
there, while dicts, lists, tuples and NamedTuples work as in plain optree. ``None`` is an
empty node (never a leaf), so ``None`` entries survive every map untouched.

Leaf paths are printable strings such as ``"encoder.layers.0.weight"`` so that errors and
diagnostics can name the leaf at fault.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import optree
import torch

from ampfunc.ops import _loading

NAMESPACE = "ampfunc"

PyTree = Any

# The public helpers. The rest of this module (check_flag, select_tree, arithmetic_dtype, ...)
# serves the other modules and is not part of the API.
__all__ = ["tree_map", "tree_leaves", "tree_flatten", "tree_unflatten", "tree_structure", "leaves_with_paths",
           "all_finite", "tree_cast"]


def register_state_classes(*classes: type) -> None:
    """Lets ``torch.load(weights_only=True)`` (torch's default) rebuild these state classes."""
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(list(classes))


def tree_map(fn: Callable, tree: PyTree, *rest: PyTree) -> PyTree:
    """``fn`` applied leaf by leaf over ``tree`` (and ``rest``), in ampfunc's pytree namespace.

    ``optree.tree_map`` with ``namespace="ampfunc"``: ampfunc's containers (loss scales, states)
    are traversed, and ``None`` is an empty node, so ``None`` entries pass through untouched.

    Args:
      fn: called as ``fn(leaf, *rest_leaves)`` for each leaf of ``tree``.
      tree: the pytree whose structure the result takes.
      *rest: more pytrees with the structure of ``tree``; their leaves are ``fn``'s further
        arguments.

    Returns:
      A new pytree of ``tree``'s structure holding ``fn``'s results.

    Example:
      >>> af.tree.tree_map(lambda x: x * 2, {"w": torch.ones(2), "b": None})
      {'w': tensor([2., 2.]), 'b': None}

    Cost: one flatten of each tree and one unflatten, plus whatever ``fn`` costs per leaf;
    no tensor work and no host sync of its own.
    """
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: PyTree) -> list:
    """The leaves of ``tree`` in flattening order (dict keys sorted; ``None`` is an empty node).

    Args:
      tree: a pytree (ampfunc's containers, such as loss scales and states, are traversed).

    Returns:
      A list of the leaves.

    Example:
      >>> af.tree.tree_leaves({"w": torch.ones(2), "b": None, "n": 3})
      [3, tensor([1., 1.])]

    Cost: one ``optree`` flatten; no tensor work, no host sync.
    """
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten(tree: PyTree):
    """The leaves of ``tree`` and its structure, ``(leaves, treespec)``.

    Args:
      tree: a pytree.

    Returns:
      ``(leaves, treespec)``; :func:`tree_unflatten` rebuilds the tree from them.

    Example:
      >>> leaves, spec = af.tree.tree_flatten({"w": torch.ones(2), "b": torch.zeros(1)})
      >>> len(leaves), spec.num_leaves
      (2, 2)

    Cost: one ``optree`` flatten; no tensor work, no host sync.
    """
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(treespec, leaves):
    """The pytree of structure ``treespec`` holding ``leaves`` (the inverse of :func:`tree_flatten`).

    Args:
      treespec: a structure from :func:`tree_flatten` or :func:`tree_structure`.
      leaves: as many leaves as ``treespec`` has, in flattening order.

    Returns:
      The rebuilt pytree.

    Example:
      >>> leaves, spec = af.tree.tree_flatten({"w": torch.ones(2), "b": torch.zeros(1)})
      >>> af.tree.tree_unflatten(spec, [x * 2 for x in leaves])
      {'w': tensor([2., 2.]), 'b': tensor([0.])}

    Cost: one ``optree`` unflatten; no tensor work, no host sync.
    """
    return optree.tree_unflatten(treespec, leaves)


def tree_structure(tree: PyTree):
    """The structure of ``tree`` without its leaves (an ``optree`` treespec).

    Args:
      tree: a pytree.

    Returns:
      The treespec; two trees are compatible when their structures compare equal.

    Example:
      >>> a = af.tree.tree_structure({"w": torch.ones(2)})
      >>> a == af.tree.tree_structure({"w": torch.zeros(5)}), a.num_leaves
      (True, 1)

    Cost: one ``optree`` flatten; no tensor work, no host sync.
    """
    return optree.tree_structure(tree, namespace=NAMESPACE)


def _entry_to_str(entry) -> str:
    if isinstance(entry, optree.NamedTupleEntry) or isinstance(entry, optree.StructSequenceEntry):
        return str(entry.field)
    if isinstance(entry, optree.DataclassEntry):
        return str(entry.field)
    return str(entry.entry)


def path_to_str(accessor) -> str:
    """``"layers.0.weight"`` for the accessor of a leaf; ``"<root>"`` for a bare leaf."""
    parts = [_entry_to_str(e) for e in accessor]
    return ".".join(parts) if parts else "<root>"


def leaves_with_paths(tree: PyTree) -> list[tuple[str, Any]]:
    """The leaves of ``tree`` with their paths, as ``[(path, leaf), ...]``.

    Leaves come in optree's flattening order (dict keys sorted); each path is a dotted string
    (``"encoder.layers.0.weight"``), ``"<root>"`` for a bare leaf. ``None`` entries are empty
    nodes and are not listed.

    Args:
      tree: a pytree.

    Returns:
      A list of ``(path, leaf)`` pairs.

    Example:
      >>> tree = {"enc": [torch.zeros(1), torch.ones(1)], "b": torch.zeros(2)}
      >>> [path for path, _ in af.tree.leaves_with_paths(tree)]
      ['b', 'enc.0', 'enc.1']

    Cost: one flatten with accessors; reads no tensor data, no host sync.
    """
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [(path_to_str(a), leaf) for a, leaf in zip(accessors, leaves)]


def check_same_structure(a: PyTree, b: PyTree, a_name: str = "a", b_name: str = "b") -> None:
    """Raise ``ValueError`` naming the first leaf path at which ``a`` and ``b`` disagree.

    Costs one flatten of each tree; never touches tensor data.
    """
    sa, sb = tree_structure(a), tree_structure(b)
    if sa == sb:
        return
    pa = {p for p, _ in leaves_with_paths(a)}
    pb = {p for p, _ in leaves_with_paths(b)}
    only_a = sorted(pa - pb)
    only_b = sorted(pb - pa)
    detail = []
    if only_a:
        detail.append(f"leaves only in {a_name}: {only_a[:5]}")
    if only_b:
        detail.append(f"leaves only in {b_name}: {only_b[:5]}")
    if not detail:
        detail.append(f"{a_name} is {sa}, {b_name} is {sb}")
    raise ValueError(f"{a_name} and {b_name} have different tree structures; " + "; ".join(detail))


def _select_leaf(pred: torch.Tensor, path: str):
    def select(x, y):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            for tree_name, t in (("new", x), ("old", y)):
                if t.layout != torch.strided:  # torch.where takes no sparse tensor
                    raise _sparse_error(f"select_tree: the {tree_name} tree's", path, t.layout)
            if x.shape != y.shape:
                raise ValueError(
                    f"select_tree: leaf {path!r} has shape {tuple(x.shape)} in the new tree "
                    f"and {tuple(y.shape)} in the old one"
                )
            if x.dtype != y.dtype:
                # torch.where would promote: a skipped step would hand back the old value in
                # the new dtype (and an in-place one would cast the new value into the old).
                raise TypeError(
                    f"select_tree: leaf {path!r} has dtype {x.dtype} in the new tree and {y.dtype} in the "
                    "old one; cast the new tree to the old one's dtypes first"
                )
            # Non-blocking only towards an accelerator: a non-blocking copy to the host may
            # still be in flight when torch.where reads it.
            p = pred if pred.device == x.device else pred.to(x.device, non_blocking=x.device.type != "cpu")
            return torch.where(p, x, y)
        if x is y or x == y:
            return x
        raise ValueError(
            f"select_tree: leaf {path!r} is not a tensor and differs between the trees "
            f"({x!r} vs {y!r}); it cannot be selected without reading `pred` on the host"
        )

    return select


def check_flag(flag: Any, where: str) -> torch.Tensor:
    """``flag`` as a 0-d bool tensor, or ``TypeError``/``ValueError`` naming ``where``.

    A step's ``finite`` flag must be a bool tensor with no dimensions (under ``torch.vmap`` that
    is one flag per example); a Python ``bool`` is turned into one. Integer and float flags are
    refused: ``torch.tensor(nan)`` would otherwise read as True. Reads no value (no host sync).
    """
    if isinstance(flag, bool):
        return torch.tensor(flag)
    if not isinstance(flag, torch.Tensor):
        raise TypeError(f"{where} must be a 0-d bool tensor (the finite flag), got {type(flag).__name__}")
    if flag.dtype != torch.bool:
        raise TypeError(f"{where} must be a 0-d bool tensor (the finite flag), got dtype {flag.dtype}; "
                        "compare explicitly (e.g. `flag != 0`) if that is what you mean")
    if flag.dim() != 0:
        raise ValueError(f"{where} must be a 0-d bool tensor (the finite flag), got shape {tuple(flag.shape)}; "
                         "reduce it (e.g. `.all()`) first")
    if flag.device.type == "meta":
        raise ValueError(f"{where} is on the meta device (it has no value)")
    return flag


def check_tensor_leaves(tree: PyTree, what: str, *, floating: bool = True, allow_sparse: bool = False,
                        allow_meta: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``[(path, leaf), ...]`` of ``tree``, every leaf checked to be a dense tensor on a real device.

    Refuses, naming the leaf path: a leaf that is not a tensor (a numpy array, a Python number),
    a non-floating tensor when ``floating``, a sparse tensor (unless ``allow_sparse``), a tensor
    on the ``meta`` device (unless ``allow_meta``: it has no values). One flatten; no tensor data
    is read.
    """
    out = []
    for path, leaf in leaves_with_paths(tree):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what} leaf {path!r} is a {type(leaf).__module__}.{type(leaf).__name__}, "
                            "expected a torch.Tensor" + (" (convert it with torch.as_tensor)"
                                                         if hasattr(leaf, "__array__") else ""))
        if leaf.layout != torch.strided and not allow_sparse:
            raise _sparse_error(what, path, leaf.layout)
        if floating and not torch.is_floating_point(leaf):
            raise TypeError(f"{what} leaf {path!r} has dtype {leaf.dtype}, expected a floating dtype")
        if leaf.device.type == "meta" and not allow_meta:
            raise ValueError(f"{what} leaf {path!r} is on the meta device (it has no values)")
        out.append((path, leaf))
    return out


def _sparse_error(what: str, path: str, layout: torch.layout) -> TypeError:
    return TypeError(f"{what} leaf {path!r} has layout {layout}; only dense (strided) tensors are supported "
                     "(densify it with .to_dense())")


def check_dense(tree: PyTree, what: str) -> None:
    """Refuses a sparse tensor leaf of ``tree`` (COO, CSR, CSC, BSR or BSC), naming its path.

    The kernels, their flat buffers and ``torch.where`` take dense (strided) tensors; the
    compressed layouts otherwise fail inside torch with a message that names no leaf ("Sparse CSR
    tensors do not have is_contiguous"). The fused steps call it on their error path only (a
    layout read per leaf would cost a step ~1 ms per 10,000 leaves), which comes before anything
    is written. One flatten; no tensor data is read; raises ``TypeError``.
    """
    for path, leaf in leaves_with_paths(tree):
        if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
            raise _sparse_error(what, path, leaf.layout)


def select_tree(pred: torch.Tensor, a: PyTree, b: PyTree) -> PyTree:
    """Per leaf ``a if pred else b``, decided on the device (``torch.where``; no host sync).

    ``pred`` is a 0-d bool tensor (:func:`check_flag`; int, float and shaped flags are
    refused). Costs one read of each tree and one write of the result. Tensor leaves must have
    the same shape and dtype in both trees, non-tensor leaves must be equal (errors name the
    leaf).
    """
    pred = check_flag(pred, "skip_or_apply: finite")
    check_same_structure(a, b, "new", "old")
    accessors, leaves_a, spec = optree.tree_flatten_with_accessor(a, namespace=NAMESPACE)
    leaves_b = tree_leaves(b)
    out = [_select_leaf(pred, path_to_str(acc))(x, y) for acc, x, y in zip(accessors, leaves_a, leaves_b)]
    return tree_unflatten(spec, out)


def arithmetic_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ampfunc computes in, and keeps optimizer state in, for a floating ``dtype``:
    float32, and float64 for float64 (torch.optim's arithmetic for fp64 params: in fp32 an
    fp64 param would only move in steps of fp32's resolution at its value)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and torch.is_floating_point(x)


def all_finite(tree: PyTree) -> torch.Tensor:
    """Whether every element of every floating leaf of ``tree`` is finite, as a 0-d bool tensor.

    Integer and bool leaves are finite by definition (they are not read); a tree with no
    floating leaf gives ``True``. The flag lives on the device of the first floating leaf (CPU
    when there is none).

    Args:
      tree: a pytree; its floating tensor leaves are checked.

    Returns:
      A 0-d bool tensor, ``True`` when no floating leaf holds an inf or a NaN.

    Example:
      >>> af.tree.all_finite({"w": torch.ones(2), "g": torch.tensor([1.0, float("inf")])})
      tensor(False)

    Cost: one read-only pass over the floating leaves (:func:`ampfunc.ops.all_finite`, the
    fused check kernel); no host sync: the flag stays on the device until you read it.
    """
    from ampfunc import ops

    floats = [x for x in tree_leaves(tree) if is_float_tensor(x)]
    try:
        return ops.all_finite(floats)
    except (RuntimeError, TypeError):
        check_dense(tree, "all_finite: tree")  # a sparse leaf is named (the kernel's message names none)
        raise


def tree_cast(tree: PyTree, dtype: torch.dtype | None, predicate: Callable[[Any], bool] = is_float_tensor) -> PyTree:
    """``tree`` with the leaves ``predicate`` selects (floating tensors) cast to ``dtype``.

    Each selected leaf becomes ``leaf.to(dtype)``: a leaf already in ``dtype`` is returned as
    is (no copy). Other leaves and ``None`` pass through. ``dtype=None`` returns ``tree`` itself.
    Unlike :func:`ampfunc.policy.cast_floating`, no dtype names and no special case for loss scales.

    Args:
      tree: a pytree.
      dtype: the target ``torch.dtype``, or ``None`` for no cast.
      predicate: which leaves to cast; by default floating tensors (``is_float_tensor``).

    Returns:
      A new pytree of ``tree``'s structure (``tree`` itself when ``dtype`` is ``None``).

    Example:
      >>> t = af.tree.tree_cast({"w": torch.ones(2), "step": torch.tensor(3)}, torch.bfloat16)
      >>> t["w"].dtype, t["step"].dtype
      (torch.bfloat16, torch.int64)

    Cost: one flatten and unflatten; one cast kernel (a read and a new tensor written) per
    selected leaf whose dtype changes, nothing for the others; no host sync.
    """
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if predicate(x) else x, tree)


def tree_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    return tree_map(lambda x: torch.zeros_like(x, dtype=dtype) if isinstance(x, torch.Tensor) else x, tree)


def tree_clone(tree: PyTree) -> PyTree:
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def float_leaves_with_paths(tree: PyTree, what: str = "tree") -> tuple[list[str], list[torch.Tensor]]:
    """Paths and leaves of ``tree``; raises ``TypeError`` naming the first non-floating tensor leaf."""
    pairs = check_tensor_leaves(tree, what)
    return [p for p, _ in pairs], [t for _, t in pairs]


def aligned_leaves(trees: Sequence[PyTree]) -> list[list[torch.Tensor]] | None:
    """Leaves of every tree in one cheap pass, or None to say "flatten them with optree".

    A fast path for the layout nearly every model has (``params_of(model)``: one flat dict of
    tensors) when all ``trees`` are plain dicts with the same keys in the same order and only
    tensor values: then ``list(d.values())`` lines the leaves up across the trees. Flattening a
    10,000-key dict with optree sorts its keys and costs ~3 ms; this costs ~0.1 ms. The order
    differs from optree's (insertion rather than sorted), so a caller must take the leaves of
    all trees of one computation from the same call.
    """
    out = dict_values_aligned(trees)
    if out is None or not all(map(plain_tensors, out)):  # subclasses take optree's path
        return None
    return out


_PLAIN_TENSOR_TYPES = {torch.Tensor, torch.nn.Parameter}
_PLAIN_TENSOR_TYPE_TUPLE = tuple(_PLAIN_TENSOR_TYPES)


def dict_values_aligned(trees: Sequence[PyTree], known: list | None = None) -> list[list] | None:
    """``[list(t.values()) for t in trees]`` when every tree is a plain dict with the first
    one's keys in the same order, else None. Looks at no value: pair it with
    :func:`plain_tensors` (or an identity check against lists already checked) before taking
    the values as leaves. Keys are compared with ``==`` (C speed, instant for the same key
    objects, e.g. a grads dict built from the params' keys).

    ``known``: lists aligned with ``trees`` (None where there is none). Where a tree's values are
    the very objects of its known list, in order, that list itself comes back in place of a new
    one: a caller that keeps the lists of an earlier call gets them back having compared
    pointers only, without taking a reference on each value (on a 10,000-leaf tree whose
    tensors are cold in cache, that is most of this function's cost)."""
    door = _door()
    if door is not None and type(trees) is list and (known is None or type(known) is list):
        return door.dict_values_aligned(trees, known)
    first = trees[0] if trees else None
    if type(first) is not dict:
        return None
    keys = None
    out = []
    for i, t in enumerate(trees):
        if t is not first:
            if type(t) is not dict or len(t) != len(first):
                return None
            if keys is None:
                keys = list(first)
            if list(t) != keys:
                return None
        prev = known[i] if known is not None and i < len(known) else None
        if type(prev) is list and len(prev) == len(t) and all(map(operator.is_, t.values(), prev)):
            out.append(prev)
        else:
            out.append(list(t.values()))
    return out


def flatten_together(trees: Sequence[PyTree], keys_of: int = 0):
    """``(leaf_lists, rebuild)`` for trees of one structure, or None when the structures differ.

    ``rebuild(new_leaves)`` is a tree of that structure. Plain dicts with the same keys in the
    same order take the cheap path (:func:`dict_values_aligned`: their values, in insertion
    order, no optree flatten, which sorts 10,000 keys in ~5 ms) when the first tree's values are
    plain tensors; anything else is flattened by optree. The dict path looks at the values of
    the first tree only: the caller must hand the others only to code that refuses a value that
    is not a tensor (the list ops do, before writing anything) and fall back to a path that
    flattens with optree, as the optimizers' fused updates and :func:`ampfunc.apply_updates`
    do. Use the lists of one call together (the two paths order leaves differently).
    ``keys_of``: the tree whose key objects the rebuilt dicts take (pass the params').
    """
    values = dict_values_aligned(trees)
    if values is not None and plain_tensors(values[0]):  # else nested: optree's leaves
        keys = list(trees[keys_of])  # equal in every tree; these key objects make later compares instant
        return values, lambda new: dict(zip(keys, new))
    first, spec = tree_flatten(trees[0])
    out = [first]
    for t in trees[1:]:
        leaves, s = tree_flatten(t)
        if s != spec:
            return None
        out.append(leaves)
    return out, lambda new: tree_unflatten(spec, new)


def plain_tensors(values: list) -> bool:
    """Whether every item of ``values`` is a plain ``torch.Tensor`` / ``nn.Parameter`` (no
    subclass, no container, no None): the values of a dict are then its leaves in optree's
    sense. One C-speed pass (about 30 ns an item; a few ns in the compiled library's loop)."""
    door = _door()
    if door is not None and type(values) is list:
        return door.exact_types(values, _PLAIN_TENSOR_TYPE_TUPLE)
    return set(map(type, values)) <= _PLAIN_TENSOR_TYPES


def same_objects(a: list, b: list) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects in the same order: compared by
    identity, never with ``==`` (a tensor's ``==`` compares values). About 30 ns an item (two
    lists: one memory compare in the compiled library)."""
    door = _door()
    if door is not None and type(a) is list and type(b) is list:
        return door.same_objects(a, b)
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _door():
    """The compiled library's module, which runs the loops of :func:`dict_values_aligned`,
    :func:`plain_tensors` and :func:`same_objects` in C (each a few milliseconds a step in
    Python on a 10,000-leaf tree), or None: not loaded (yet, or the reference backend), or inside
    a ``torch.compile`` trace, which traces the Python code below the check instead."""
    door = _loading._DIRECT[0]
    return None if door is None or _loading._is_compiling() else door


def group_by_device_dtype(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), in first-seen order."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups
