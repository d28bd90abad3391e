"""Gradient transformations and the combinators that compose them (optax's model).

A :class:`GradientTransformation` is a pair of pure functions:

* ``init(params) -> state``: a pytree of tensors;
* ``update(updates, state, params=None) -> (updates, new_state)``.

``updates`` enter as gradients and leave as the deltas that :func:`apply_updates` adds to the
parameters. Neither function mutates its inputs. Because every state is a pytree of tensors,
a whole step can be skipped on the device with :func:`ampfunc.skip_or_apply`, saved with
``torch.save`` and compiled by ``torch.compile``.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import optree
import torch

from ampfunc import ops
from ampfunc.tree import (
    NAMESPACE,
    PyTree,
    check_same_structure,
    flatten_together,
    leaves_with_paths,
    register_state_classes,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

__all__ = [
    "GradientTransformation",
    "FusedSpec",
    "ChainSpec",
    "EmptyState",
    "identity",
    "chain",
    "named_chain",
    "masked",
    "partition",
    "apply_updates",
]


class FusedSpec(NamedTuple):
    """What the fused kernels need to run one registered transform: its kind and settings.

    Native optimizers register one with :func:`register_kernel`; read it back with
    :func:`kernel_spec` or ``tx.fused``. The fused plan reads ``hparams`` as they are and keeps
    no defaults of its own.

    Attributes:
      kind: ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"clip_by_global_norm"``.
      hparams: every argument the transform was built with, defaults filled in, as a dict
        (``lr`` may be a schedule, a callable of the step count).

    Example:
      >>> spec = af.sgd(0.1).fused
      >>> spec.kind, spec.hparams["lr"], spec.hparams["momentum"]
      ('sgd', 0.1, 0.0)
    """

    kind: str
    hparams: dict


class ChainSpec(NamedTuple):
    """The registered spec of a :func:`chain` / :func:`named_chain` of registered transforms.

    Registered only when every chained transform has a :class:`FusedSpec`.

    Attributes:
      specs: the chained transforms' :class:`FusedSpec` s, in order.
      names: the state's keys for ``named_chain``; ``None`` for ``chain`` (its state is a
        tuple).

    Example:
      >>> spec = af.chain(af.clip_by_global_norm(1.0), af.sgd(0.1)).fused
      >>> [s.kind for s in spec.specs], spec.names
      (['clip_by_global_norm', 'sgd'], None)
    """

    specs: tuple
    names: Optional[tuple] = None


KernelSpec = Union[FusedSpec, ChainSpec]

# update function -> spec. Keyed by the function (not the pair) so that ``init, update = tx``
# followed by ``GradientTransformation(init, update)`` still finds it; weak, so transforms built
# in a loop do not pile up.
_KERNEL_SPECS: "weakref.WeakKeyDictionary[Callable, KernelSpec]" = weakref.WeakKeyDictionary()


class GradientTransformation(NamedTuple):
    """optax's pair of pure functions: ``init`` builds the state, ``update`` transforms updates.

    Exactly two fields, so ``init, update = af.adamw(1e-3)`` works. Whether the fused kernels
    can run a transform is not stored in the pair: native optimizers register their update
    function with :func:`register_kernel`, and :func:`kernel_spec` (or the ``fused`` property)
    reads the registry.

    Attributes:
      init: ``init(params) -> state``, the state a pytree of tensors.
      update: ``update(updates, state, params=None) -> (updates, new_state)``; gradients in,
        the deltas for :func:`apply_updates` out. Neither function mutates its inputs.

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> init, update = af.sgd(0.1)
      >>> state = init(params)
      >>> updates, state = update({"w": torch.ones(2)}, state, params)
      >>> af.apply_updates(params, updates)["w"]
      tensor([0.9000, 0.9000])
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[..., tuple[PyTree, PyTree]]

    @property
    def fused(self) -> Optional[KernelSpec]:
        """The registered :class:`FusedSpec` / :class:`ChainSpec` of this transform, or None."""
        return kernel_spec(self)


def register_kernel(tx: GradientTransformation, spec: KernelSpec) -> GradientTransformation:
    """Records that the fused kernels can run ``tx`` as ``spec``; returns ``tx``.

    Keyed by ``tx.update`` (the function), so any pair sharing that update function is
    recognised. Called by the native optimizers and by :func:`chain` / :func:`named_chain`.
    Cost: one dictionary insert at construction.
    """
    if not isinstance(spec, (FusedSpec, ChainSpec)):
        raise TypeError(f"register_kernel: spec must be a FusedSpec or ChainSpec, got {type(spec).__name__}")
    _KERNEL_SPECS[tx.update] = spec
    return tx


def kernel_spec(tx: Any) -> Optional[KernelSpec]:
    """The spec registered for ``tx`` (a ``GradientTransformation``), or None."""
    update = getattr(tx, "update", None)
    if update is None:
        return None
    try:
        return _KERNEL_SPECS.get(update)
    except TypeError:  # an unhashable or non-weakrefable callable: never registered
        return None


class EmptyState(NamedTuple):
    """The state of a stateless transform: an empty NamedTuple (a pytree with no leaves).

    Attributes:
      (none): it holds nothing; ``EmptyState()`` is its only value.

    Example:
      >>> af.identity().init({"w": torch.ones(2)})
      EmptyState()
    """


register_state_classes(EmptyState)


def identity() -> GradientTransformation:
    """A transform that passes updates through unchanged.

    Returns:
      A ``GradientTransformation`` whose state is :class:`EmptyState` and whose ``update``
      returns ``updates`` (the same objects) and the state.

    Example:
      >>> tx = af.identity()
      >>> g = {"w": torch.ones(2)}
      >>> updates, state = tx.update(g, tx.init(g))
      >>> updates is g
      True

    Cost: nothing: no tensor work, no allocation, no host sync.
    """

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        return updates, state

    return GradientTransformation(init, update)


def refuse_outermost_only(t: Any, where: str) -> None:
    """Raises ``TypeError`` when ``t`` is a transform that must be the outermost one (a
    ``mixed_precision`` wrapper: it unscales, checks and skips the whole step, so inside a
    chain, a mask or ``accumulate`` it would see scaled gradients clipped, masked or dropped
    before its check, and its loss scale would never back off)."""
    if getattr(t, "OUTERMOST_ONLY", False):
        raise TypeError(f"{where}: a mixed_precision(...) transform must be the outermost one (it unscales, "
                        "checks and skips the whole step): wrap the rest inside it, e.g. "
                        "af.mixed_precision(af.accumulate(af.chain(...), k), loss_scale)")


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in order; the state is the tuple of their states.

    Args:
      *transforms: ``GradientTransformation`` s, applied first to last.

    Returns:
      A ``GradientTransformation``. When every transform is registered with the kernels, the
      chain is registered too (as a :class:`ChainSpec`), so ``chain(clip_by_global_norm(c),
      adamw(lr))`` runs fused inside ``mixed_precision``, ``make_train_step`` and
      ``ModuleTrainer``.

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> tx = af.chain(af.clip_by_global_norm(1.0), af.sgd(0.1))
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": torch.full((2,), 3.0)}, state, params)
      >>> len(state), type(tx.fused).__name__
      (2, 'ChainSpec')

    Cost: the sum of the transforms' costs; the chain adds no tensor work and no host sync.
    """
    transforms = tuple(transforms)
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: argument {i} is {type(t).__name__}, not a GradientTransformation")
        refuse_outermost_only(t, f"chain: argument {i}")

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if len(state) != len(transforms):
            raise ValueError(f"chain: state has {len(state)} entries for {len(transforms)} transforms")
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    out = GradientTransformation(init, update)
    specs = tuple(kernel_spec(t) for t in transforms)
    if specs and all(isinstance(sp, FusedSpec) for sp in specs):
        register_kernel(out, ChainSpec(specs))
    return out


def named_chain(*named: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with a dict state keyed by the given names (handy for inspection).

    Args:
      *named: ``(name, transform)`` pairs, applied in order; names must be unique.

    Returns:
      A ``GradientTransformation`` whose state is ``{name: state}``; registered with the kernels
      (a :class:`ChainSpec` with the names) when every transform is.

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> tx = af.transform.named_chain(("clip", af.clip_by_global_norm(1.0)), ("opt", af.sgd(0.1)))
      >>> state = tx.init(params)
      >>> sorted(state)
      ['clip', 'opt']

    Cost: the sum of the transforms' costs; the chain adds no tensor work and no host sync.
    """
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    inner = chain(*(t for _, t in named))

    def init(params):
        return dict(zip(names, inner.init(params)))

    def update(updates, state, params=None):
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"named_chain: state lacks entries {missing}")
        updates, new = inner.update(updates, tuple(state[n] for n in names), params)
        return updates, dict(zip(names, new))

    out = GradientTransformation(init, update)
    spec = kernel_spec(inner)
    if spec is not None:
        register_kernel(out, ChainSpec(spec.specs, tuple(names)))
    return out


def _resolve(tree_or_fn, params):
    return tree_or_fn(params) if callable(tree_or_fn) else tree_or_fn


def _mask_tree(tree: PyTree, mask_leaves: list[bool]) -> PyTree:
    """``tree`` with the leaves whose mask is False replaced by ``None`` (an empty node)."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(spec, [x if m else None for x, m in zip(leaves, mask_leaves)])


def _parting(prefix: PyTree, tree: PyTree, what: str, path: str = "") -> Optional[str]:
    """Where ``prefix`` stops being a prefix of ``tree``: a sentence naming the path, or None."""
    if optree.tree_is_leaf(prefix, namespace=NAMESPACE):
        return None  # a leaf stands for the whole subtree below it
    at = repr(path) if path else "the root"
    if optree.tree_is_leaf(tree, namespace=NAMESPACE):
        return f"at {at} {what} has a {type(prefix).__name__} where params have a leaf"
    kids, _, entries, _ = optree.tree_flatten_one_level(prefix, namespace=NAMESPACE)
    tkids, _, tentries, _ = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
    if isinstance(prefix, Mapping) and isinstance(tree, Mapping):
        # mappings of any kinds (a dict over an OrderedDict) pair up by key
        if set(prefix) != set(tree):
            only_p = sorted(map(str, set(prefix) - set(tree)))
            only_t = sorted(map(str, set(tree) - set(prefix)))
            parts = ([f"has keys {only_p} that params lack"] if only_p else []) + (
                [f"lacks keys {only_t} that params have"] if only_t else [])
            return f"at {at} {what} " + " and ".join(parts)
        for key in tree:
            found = _parting(prefix[key], tree[key], what, f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    if type(prefix) is not type(tree) or tuple(entries) != tuple(tentries):
        return (f"at {at} {what} is a {type(prefix).__name__} of {len(kids)} where params are a "
                f"{type(tree).__name__} of {len(tkids)}")
    for entry, p, t in zip(entries, kids, tkids):
        name = str(getattr(entry, "entry", entry))
        found = _parting(p, t, what, f"{path}.{name}" if path else name)
        if found:
            return found
    return None


def _per_leaf(prefix: PyTree, params: PyTree, what: str, where: str) -> list[tuple[str, Any]]:
    """``(path, value)`` per leaf of ``params``: ``prefix`` has ``params``' structure, or is a
    prefix of it (a leaf standing for the whole subtree below it, as optax allows); else a
    ``ValueError`` naming the path where the two part."""
    if optree.tree_structure(prefix, namespace=NAMESPACE) != optree.tree_structure(params, namespace=NAMESPACE):
        parting = _parting(prefix, params, what)
        if parting is not None:
            raise ValueError(f"{where}: {what} and params have different tree structures, and {what} is not a "
                             f"prefix of params (a leaf standing for a whole subtree) either: {parting}")
        # params' leaf order, mappings paired by key (a dict's leaves are sorted, an OrderedDict's
        # are not: pairing by position gave one key's value to another)
        return [(path, v) for (path, _), v in zip(leaves_with_paths(params), _broadcast(prefix, params))]
    return leaves_with_paths(prefix)


def _broadcast(prefix: PyTree, tree: PyTree) -> list:
    """The value of ``prefix`` (a prefix of ``tree``, as :func:`_parting` checked) for each leaf of
    ``tree``, in ``tree``'s leaf order."""
    if optree.tree_is_leaf(prefix, namespace=NAMESPACE):
        return [prefix] * optree.tree_structure(tree, namespace=NAMESPACE).num_leaves
    kids, _, entries, _ = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
    if isinstance(prefix, Mapping):
        pkids = [prefix[e] for e in entries]
    else:
        pkids = optree.tree_flatten_one_level(prefix, namespace=NAMESPACE)[0]
    return [v for p, t in zip(pkids, kids) for v in _broadcast(p, t)]


def _mask_leaves(mask: PyTree, params: PyTree, where: str) -> list[bool]:
    out = []
    for path, m in _per_leaf(mask, params, "mask", where):
        if not isinstance(m, bool):
            # numpy's bool_: its dtype compares equal to (is not) the Python type
            if getattr(m, "shape", None) == () and getattr(m, "dtype", None) == bool:  # noqa: E721
                m = bool(m)
            else:
                raise TypeError(f"{where}: mask leaf {path!r} is {m!r}; masks hold Python (or numpy) bools")
        out.append(m)
    return out


def masked(inner: GradientTransformation, mask: PyTree | Callable[[PyTree], PyTree]) -> GradientTransformation:
    """Applies ``inner`` only to the leaves where ``mask`` is ``True``; the others pass through.

    ``inner`` sees (and keeps state for) only the selected leaves: the others are ``None`` (an
    empty node) in the trees it is given. Unselected updates come back as the same objects.
    Typical use: weight decay on weights only, ``masked(add_decayed_weights(1e-2), is_weight)``.

    Args:
      inner: the ``GradientTransformation`` to apply to the selected leaves.
      mask: a pytree of Python (or numpy) bools with the structure of the params, or a prefix
        of it (a bool for a whole subtree, as optax allows), or a function of the params
        returning one (called at every ``init`` and ``update``; with ``params=None``, on the
        updates).

    Returns:
      A ``GradientTransformation`` whose state is ``inner``'s state for the selected leaves.
      It is not registered with the fused kernels.

    Example:
      >>> params = {"w": torch.ones(2), "b": torch.ones(2)}
      >>> tx = af.masked(af.sgd(0.1), {"w": True, "b": False})
      >>> updates, _ = tx.update({"w": torch.ones(2), "b": torch.ones(2)}, tx.init(params), params)
      >>> updates["w"], updates["b"]
      (tensor([-0.1000, -0.1000]), tensor([1., 1.]))

    Cost: ``inner``'s cost on the selected leaves, plus per call a structure check and a few
    flattens of the mask, params and updates (no tensor data read); no host sync of its own.
    """
    refuse_outermost_only(inner, "masked: inner")

    def init(params):
        ml = _mask_leaves(_resolve(mask, params), params, "masked")
        return inner.init(_mask_tree(params, ml))

    def update(updates, state, params=None):
        ml = _mask_leaves(_resolve(mask, params if params is not None else updates), updates, "masked")
        sub_updates = _mask_tree(updates, ml)
        sub_params = None if params is None else _mask_tree(params, ml)
        new_sub, state = inner.update(sub_updates, state, sub_params)
        new_leaves = iter(tree_leaves(new_sub))
        leaves, spec = tree_flatten(updates)
        merged = [next(new_leaves) if m else u for u, m in zip(leaves, ml)]
        return tree_unflatten(spec, merged), state

    return GradientTransformation(init, update)


def partition(transforms: Mapping[str, GradientTransformation],
              labels: PyTree | Callable[[PyTree], PyTree]) -> GradientTransformation:
    """Parameter groups: each leaf is handled by the transform its label names.

    Each transform sees only the leaves with its label (the others are ``None``, an empty
    node). Typical use: no weight decay on norms and biases, ``partition({"decay":
    adamw(1e-3, weight_decay=.1), "no_decay": adamw(1e-3, weight_decay=0.)}, labels)``.

    Args:
      transforms: a mapping label -> ``GradientTransformation``.
      labels: a pytree of strings (keys of ``transforms``) with the structure of the params,
        or a prefix of it (a label for a whole subtree, as optax allows), or a function of the
        params returning one (called at every ``init`` and ``update``; with ``params=None``, on
        the updates). An unknown label, or labels that do not fit the params, raise
        ``ValueError`` naming the path.

    Returns:
      A ``GradientTransformation`` whose state is a dict label -> that transform's state. It
      is not registered with the fused kernels.

    Example:
      >>> params = {"w": torch.ones(2), "b": torch.ones(2)}
      >>> tx = af.partition({"train": af.sgd(0.1), "frozen": af.identity()},
      ...                   {"w": "train", "b": "frozen"})
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": torch.ones(2), "b": torch.ones(2)}, state, params)
      >>> sorted(state), updates["b"]
      (['frozen', 'train'], tensor([1., 1.]))

    Cost: the sum of the transforms' costs on their leaves, plus per call a structure check and
    a few flattens per label (no tensor data read); no host sync of its own.
    """
    transforms = dict(transforms)
    for label, t in transforms.items():
        refuse_outermost_only(t, f"partition: transform {label!r}")

    def _labels(tree, where):
        out = []
        for path, l in _per_leaf(_resolve(labels, tree), tree, "labels", "partition"):
            if l not in transforms:
                raise ValueError(f"partition: leaf {path!r} has label {l!r}, not one of {sorted(transforms)}")
            out.append(l)
        return out

    def init(params):
        ls = _labels(params, "init")
        return {k: t.init(_mask_tree(params, [l == k for l in ls])) for k, t in transforms.items()}

    def update(updates, state, params=None):
        if not isinstance(state, Mapping) or set(state) != set(transforms):
            got = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"partition: state must hold one entry per label {sorted(transforms)}, got {got} "
                             "(a state made by another partition?)")
        ls = _labels(params if params is not None else updates, "update")
        leaves, spec = tree_flatten(updates)
        merged = list(leaves)
        new_state = {}
        for k, t in transforms.items():
            m = [l == k for l in ls]
            sub_u, new_state[k] = t.update(_mask_tree(updates, m), state[k],
                                           None if params is None else _mask_tree(params, m))
            it = iter(tree_leaves(sub_u))
            for i, sel in enumerate(m):
                if sel:
                    merged[i] = next(it)
        return tree_unflatten(spec, merged), new_state

    return GradientTransformation(init, update)


def _apply_leaf(p, u):
    if u is None:
        return p
    if not isinstance(p, torch.Tensor):
        return p
    if p.dtype in (torch.float16, torch.bfloat16):
        # Add in fp32 and round once, so a low-precision param moves by what fp32 says.
        return (p.to(torch.float32) + u.to(torch.float32)).to(p.dtype)
    return p + u.to(p.dtype)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leaf by leaf, each result in its param's dtype. Pure.

    Low-precision (fp16/bf16) params are updated in fp32 and rounded once. Plain
    fp32/fp16/bf16 tensors of matching shapes on one device go through one fused pass over the
    whole list (:func:`ampfunc.ops.apply_updates`, the same arithmetic); anything else (other
    dtypes, a 0-d update, tensors that need autograd, torch.func transforms) leaf by leaf. An
    update has its param's shape, or is 0-d (one number for the whole leaf); any other shape
    (a ``(1,)`` update for a ``(3,)`` param included, which torch would broadcast) raises
    ``ValueError`` naming the leaf and both shapes, as the optimizers do. Sparse COO, CSR and
    CSC updates are added (the result is dense); BSR and BSC, which torch cannot add to a dense
    tensor, raise ``TypeError`` naming the leaf. Non-tensor param leaves are returned as they are.

    Args:
      params: a pytree of tensors.
      updates: a pytree of tensors with the structure of ``params`` (e.g. from a
        transform's ``update``).

    Returns:
      A new pytree of ``params``' structure; ``params`` is not modified.

    Example:
      >>> params = {"w": torch.ones(2, dtype=torch.bfloat16)}
      >>> new = af.apply_updates(params, {"w": torch.full((2,), -0.5)})
      >>> new["w"], params["w"]
      (tensor([0.5000, 0.5000], dtype=torch.bfloat16), tensor([1., 1.], dtype=torch.bfloat16))

    Cost: one read of each tree and one write of the result (one fused pass, or one add per
    leaf); no host sync.
    """
    compiling = ops._is_compiling()
    if not compiling:
        together = flatten_together([params, updates])
        if together is not None and together[0][0]:
            (p_leaves, u_leaves), rebuild = together
            if ops.kernel_ready(p_leaves[0].device if isinstance(p_leaves[0], torch.Tensor) else None,
                                (), (p_leaves, u_leaves)):
                try:
                    # The op checks every pair (tensors, equal shapes) before writing anything;
                    # what it refuses goes to the checked path below, which names the leaf or
                    # broadcasts leaf by leaf.
                    return rebuild(ops.apply_updates(p_leaves, u_leaves))
                except (ValueError, TypeError, RuntimeError):  # RuntimeError: the dispatcher's
                    pass
    # The checked path, on optree's leaves (the order leaf paths are named in).
    p_leaves, p_spec = tree_flatten(params)
    u_leaves, u_spec = tree_flatten(updates)
    if u_spec != p_spec:
        check_same_structure(params, updates, "params", "updates")
        return tree_map(_apply_leaf, params, updates)
    _check_update_shapes(params, p_leaves, u_leaves)
    if compiling and p_leaves and ops.kernel_ready(
            p_leaves[0].device if isinstance(p_leaves[0], torch.Tensor) else None, (), (p_leaves, u_leaves)):
        try:
            return tree_unflatten(p_spec, ops.apply_updates(p_leaves, u_leaves))
        except (ValueError, TypeError):
            pass  # shapes the kernel does not broadcast: the leaf-by-leaf path
    if compiling:
        return tree_unflatten(p_spec, [_apply_leaf(p, u) for p, u in zip(p_leaves, u_leaves)])
    try:
        new = [_apply_leaf(p, u) for p, u in zip(p_leaves, u_leaves)]
    except RuntimeError:
        _check_addable_layouts(params, u_leaves)  # torch's error names no leaf: find it
        raise
    return tree_unflatten(p_spec, new)


# Sparse layouts torch cannot add to a dense tensor (an INTERNAL ASSERT inside torch); COO, CSR and
# CSC add correctly. Looked for on the error path only: no per-leaf cost when the adds run.
_UNADDABLE_LAYOUTS = frozenset({torch.sparse_bsr, torch.sparse_bsc})


def _check_addable_layouts(params: PyTree, u_leaves: list) -> None:
    for i, u in enumerate(u_leaves):
        if isinstance(u, torch.Tensor) and u.layout in _UNADDABLE_LAYOUTS:
            path = leaves_with_paths(params)[i][0]
            raise TypeError(f"apply_updates: updates leaf {path!r} has layout {u.layout}, which torch cannot add "
                            "to a dense param (COO, CSR and CSC can); densify it with .to_dense()")


def _check_update_shapes(params: PyTree, p_leaves: list, u_leaves: list) -> None:
    """Refuses, naming the leaf, an update that is not a tensor or would change its param's
    shape. One C-speed comparison of the shape lists; the per-leaf look only on a mismatch."""
    try:
        if ops._is_compiling():  # dynamo cannot trace attrgetter; map() is for C speed eagerly
            if all(type(u) in _PLAIN_TENSORS for u in u_leaves) and \
                    [p.shape for p in p_leaves] == [u.shape for u in u_leaves]:
                return
        elif (set(map(type, u_leaves)) <= _PLAIN_TENSORS
              and list(map(_shape_of, p_leaves)) == list(map(_shape_of, u_leaves))):
            return
    except AttributeError:  # a param leaf that is not a tensor: the look below skips it
        pass
    for i, (p, u) in enumerate(zip(p_leaves, u_leaves)):
        if isinstance(p, torch.Tensor) and not (isinstance(u, torch.Tensor) and (u.shape == p.shape or u.dim() == 0)):
            # A 0-d update (one number for the leaf) is the one broadcast taken: a (1,) update
            # for a (3,) param is a mismatched tree, refused as the optimizers refuse it.
            path = leaves_with_paths(params)[i][0]
            if not isinstance(u, torch.Tensor):
                raise TypeError(f"apply_updates: updates leaf {path!r} is a {type(u).__name__}, expected a tensor")
            raise ValueError(f"apply_updates: leaf {path!r} has shape {tuple(p.shape)} in params and "
                             f"{tuple(u.shape)} in updates; an update must have its param's shape (or be 0-d)")


_shape_of = operator.attrgetter("shape")
_PLAIN_TENSORS = {torch.Tensor, torch.nn.Parameter}
