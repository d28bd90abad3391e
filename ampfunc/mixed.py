"""The five mixed-precision primitives and the composed :func:`mixed_precision` transform.

The primitives, in the order a step uses them::

    p = af.cast_params(params, torch.float16, keep=af.norm_layers(model))   # (policy.py)
    loss = af.scale_loss(loss, ls)                  # loss.float() * scale
    grads, finite = af.unscale_and_check(grads, ls) # fp32 grads / scale, 0-d bool flag
    new = af.skip_or_apply(finite, new, old)        # per leaf new if finite else old
    ls = af.update_scale(ls, finite)                # the next loss scale

All are pure (inputs untouched, new tensors out) and none reads a tensor back to the host,
so a step built from them can be captured in a CUDA graph or compiled with
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

import torch

from ampfunc import ops
from ampfunc.dist import agree_finite as _agree_finite
from ampfunc.engine import Engine, check_no_overlap
from ampfunc.engine import MixedPrecisionState as _MixedPrecisionState
from ampfunc.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from ampfunc.lowmem import SplitMaster, check_split_master, join_master
from ampfunc.transform import GradientTransformation
from ampfunc.tree import PyTree, check_flag, float_leaves_with_paths, leaves_with_paths, select_tree, tree_leaves

__all__ = [
    "scale_loss",
    "unscale",
    "unscale_and_check",
    "skip_or_apply",
    "update_scale",
    "unscale_and_check_",
    "skip_or_apply_",
    "update_scale_",
    "MixedPrecision",
    "mixed_precision",
    "loss_scale_of",
    "master_params",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_loss_scale(ls, where: str):
    if not isinstance(ls, LossScale):
        raise TypeError(f"{where}: expected a loss scale (NoOpLossScale, StaticLossScale or DynamicLossScale), "
                        f"got {type(ls).__name__}")


def scale_loss(loss: torch.Tensor, ls: LossScale) -> torch.Tensor:
    """The loss times the loss scale, in fp32: what to call ``.backward()`` on.

    Args:
      loss: a floating tensor with one element (a larger loss raises ``ValueError``: reduce it
        first; a non-floating one raises ``TypeError``).
      ls: the loss scale (:class:`NoOpLossScale` returns the loss itself, not cast).

    Returns:
      ``loss.float() * ls.loss_scale``, an fp32 tensor of the loss's shape.

    Example:
      >>> w = torch.ones(3, requires_grad=True)
      >>> af.scale_loss((2.0 * w).sum(), af.StaticLossScale(1024.0)).backward()
      >>> w.grad
      tensor([2048., 2048., 2048.])

    Cost: one scalar multiply, plus a cast when the loss is not fp32 (nothing with
    :class:`NoOpLossScale`); no host sync.
    """
    _check_loss_scale(ls, "scale_loss")
    return ls.scale(loss)


def unscale(tree: PyTree, ls: LossScale) -> PyTree:
    """Every floating leaf of ``tree`` in fp32 times ``1 / loss_scale``, with no flag returned.

    For quantities computed from the scaled loss outside the optimizer step: per-loss
    gradients, gradients for a penalty (``torch.autograd.grad`` of the scaled loss with
    ``create_graph=True``). Leaves that require grad (with grad mode on) are unscaled by plain
    torch ops, so a penalty built from the result backpropagates; the others go through the
    fused kernel. The values are the same either way.

    Args:
      tree: a pytree of floating tensors (a non-floating leaf raises ``TypeError``).
      ls: the loss scale they were scaled by.

    Returns:
      A new tree of fp32 tensors (fp64 leaves stay fp64; with :class:`NoOpLossScale` fp32 and
      fp64 leaves are returned as they are). Use :func:`unscale_and_check` for the finite flag.

    Example:
      >>> ls = af.StaticLossScale(1024.0)
      >>> af.mixed.unscale({"w": torch.tensor([1024.0, 2048.0], dtype=torch.float16)}, ls)
      {'w': tensor([1., 2.])}

    Cost: one read and one fp32 write per leaf (the finite flag is computed too, and dropped;
    with :class:`NoOpLossScale`: casts of the non-fp32 leaves plus one read-only check pass;
    leaves that require grad: a cast and a multiply each, recorded by autograd); no host sync.
    """
    _check_loss_scale(ls, "unscale")
    return ls.unscale(tree)


def unscale_and_check(grads: PyTree, ls: LossScale, *, group=None) -> tuple[PyTree, torch.Tensor]:
    """The gradients of the scaled loss, unscaled to fp32, and whether they were all finite.

    Args:
      grads: a pytree of fp32, fp16 or bf16 gradients of the scaled loss (``None`` entries stay
        ``None``; a non-floating leaf raises ``TypeError`` naming its path).
      ls: the loss scale.
      group: a ``torch.distributed`` process group: every rank gets the same flag.

    Returns:
      ``(grads32, finite)``: new fp32 tensors ``grad / scale`` (fp64 gradients stay fp64; with
      :class:`NoOpLossScale`, fp32 and fp64 leaves pass through as they are) and a 0-d bool
      tensor on the first leaf's device, ``True`` when every element was finite.

    Example:
      >>> ls = af.StaticLossScale(1024.0)
      >>> g16 = {"w": torch.full((2,), 2048.0, dtype=torch.float16)}
      >>> grads, finite = af.unscale_and_check(g16, ls)
      >>> grads["w"], bool(finite)
      (tensor([2., 2.]), True)
      >>> bool(af.unscale_and_check({"w": torch.tensor([float("inf")])}, ls)[1])
      False

    Cost: one read of the gradients and one fp32 write (with :class:`NoOpLossScale`: casts of
    the non-fp32 leaves and one read-only check pass); with ``group``, one all-reduce of one
    float. No host sync.
    """
    _check_loss_scale(ls, "unscale_and_check")
    out, finite = ls.unscale_and_check(grads, "unscale_and_check: grads")
    if group is not None:
        finite = _agree_finite(finite, group)
    return out, finite


def skip_or_apply(finite: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """Per leaf ``new if finite else old``, chosen on the device (``torch.where``).

    Args:
      finite: 0-d bool tensor (from :func:`unscale_and_check`).
      new: the candidate trees (params, optimizer states, loss scales, or a tuple of them).
      old: trees of the same structure, shapes and dtypes.

    Returns:
      A new tree: bit-identical to ``old`` on a skipped step (``finite`` False), else ``new``.

    Non-tensor leaves must be equal in both trees (``ValueError`` otherwise); structures and
    shapes must match (``ValueError``), and dtypes (``TypeError``, naming the leaf: a skipped
    step must not hand the old value back in another dtype).

    Example:
      >>> old, new = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
      >>> af.skip_or_apply(torch.tensor(False), new, old)["w"]
      tensor([0., 0.])
      >>> af.skip_or_apply(torch.tensor(True), new, old)["w"]
      tensor([1., 1.])

    Cost: one ``torch.where`` per tensor leaf: one read of both trees and one write of a new
    tree; no host sync.
    """
    return select_tree(finite, new, old)


def update_scale(ls, finite):
    """The loss scale for the next step.

    Also takes several scales at once (apex's ``num_losses``).

    Args:
      ls: a loss scale, or a dict, list or tuple of loss scales, one per loss (apex's
        ``num_losses``).
      finite: the step's 0-d bool flag (a Python ``bool`` is accepted), or a matching
        dict/list/tuple of flags.

    Returns:
      The next loss scale(s) in the same container: new :class:`DynamicLossScale` objects
      (static and no-op scales return themselves).

    Example:
      >>> ls = af.DynamicLossScale(2.0**15)
      >>> float(af.update_scale(ls, torch.tensor(False)).loss_scale)
      16384.0
      >>> scales = {"a": af.DynamicLossScale(2.0**15), "b": af.StaticLossScale(8.0)}
      >>> new = af.update_scale(scales, {"a": torch.tensor(False), "b": torch.tensor(False)})
      >>> float(new["a"].loss_scale), new["b"] is scales["b"]
      (16384.0, True)

    Cost: per dynamic scale, three 0-d copies and one 0-d kernel on its device (nothing for
    static and no-op scales); no host sync.
    """
    if isinstance(ls, (Mapping, list, tuple)):
        pairs = _scales_and_flags(ls, finite, "update_scale")
        new = [update_scale(v, f) for _, v, f in pairs]
        return dict(zip((k for k, _, _ in pairs), new)) if isinstance(ls, Mapping) else type(ls)(new)
    _check_loss_scale(ls, "update_scale")
    return ls._adjust(finite)


def _scales_and_flags(ls, finite, where: str) -> list:
    """``[(key, scale, flag), ...]`` for a dict/list/tuple of scales and one flag or a matching
    container of flags; every scale and flag checked before any is used (an in-place update
    must not write the first scale and then refuse the second's flag)."""
    if isinstance(ls, Mapping):
        keys = list(ls)
        if isinstance(finite, Mapping):
            if set(finite) != set(keys):
                raise ValueError(f"{where}: the flags' keys {sorted(map(str, finite))} are not the scales' "
                                 f"{sorted(map(str, keys))}")
            flags = [finite[k] for k in keys]
        else:
            flags = [finite] * len(keys)
        scales = list(ls.values())
    else:
        keys = list(range(len(ls)))
        scales = list(ls)
        if isinstance(finite, (list, tuple)):
            if len(finite) != len(scales):
                raise ValueError(f"{where}: {len(finite)} flags for {len(scales)} loss scales")
            flags = list(finite)
        else:
            flags = [finite] * len(scales)
    for k, v, f in zip(keys, scales, flags):
        _check_loss_scale(v, f"{where}[{k!r}]")
        check_flag(f, f"{where}: finite[{k!r}]")
    return list(zip(keys, scales, flags))


# ----------------------------------------------------------------------------------------------
# In-place twins: the same numbers, written into the given tensors (the donating fast path)
# ----------------------------------------------------------------------------------------------


def unscale_and_check_(grads: PyTree, ls: LossScale, *, group=None) -> tuple[PyTree, torch.Tensor]:
    """In-place :func:`unscale_and_check`: each gradient is multiplied by ``1/scale`` where it is.

    The product is taken in fp32 and stored in the gradient's own dtype, so fp32 gradients get
    exactly the values of the pure version; bf16 gradients are rounded back to bf16. fp16
    gradients are refused (``TypeError`` naming the leaf), as ``GradScaler.unscale_`` refuses
    them: dividing in place in fp16 loses the small values loss scaling exists to keep. Leaves
    that share memory are refused too (``ValueError``), before any write.

    Args:
      grads: a pytree of fp32 or bf16 gradients of the scaled loss, overwritten.
      ls: the loss scale.
      group: a ``torch.distributed`` process group: every rank gets the same flag.

    Returns:
      ``(grads, finite)``: the same tree (its tensors now unscaled) and a 0-d bool tensor,
      ``True`` when every element was finite (and the scale valid).

    Example:
      >>> grads = {"w": torch.tensor([1024.0, 2048.0])}
      >>> out, finite = af.mixed.unscale_and_check_(grads, af.StaticLossScale(1024.0))
      >>> out is grads, grads["w"], bool(finite)
      (True, tensor([1., 2.]), True)

    Cost: one read and one write of the gradients in one pass, no gradient-sized allocation
    (with :class:`NoOpLossScale`: one read-only check pass, nothing written); with ``group``,
    one all-reduce of one float. No host sync.
    """
    _check_loss_scale(ls, "unscale_and_check_")
    paths, leaves = float_leaves_with_paths(grads, "unscale_and_check_: grads")
    check_no_overlap("unscale_and_check_", [("grads", dict(zip(paths, leaves)), leaves)])
    for path, leaf in zip(paths, leaves):
        if leaf.dtype == torch.float16:
            raise TypeError(f"unscale_and_check_: grads leaf {path!r} is float16; unscaling fp16 in place "
                            "loses precision -- use the pure unscale_and_check (fp32 out)")
    if isinstance(ls, NoOpLossScale):
        finite = ops.all_finite(leaves)
    else:
        device = leaves[0].device if leaves else ls.loss_scale.device
        inv_scale = ls.inv_scale_on(device)
        # NaN when the scale is outside SCALE_RANGE: not a clean step, even with no elements.
        finite = ops.unscale_(leaves, inv_scale) & ~inv_scale.isnan()
    if group is not None:
        finite = _agree_finite(finite, group)
    return grads, finite


def skip_or_apply_(finite: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """In-place :func:`skip_or_apply`: ``old`` is overwritten with ``new`` when ``finite``.

    Args:
      finite: 0-d bool tensor.
      new: the candidate values.
      old: the tensors to update (``nn.Parameter`` leaves included), same structure and shapes.

    Returns:
      ``old`` (the same tensors).

    Everything is checked before the first write: structures and shapes (by
    :func:`skip_or_apply`'s selection, computed first) and that no two leaves of ``old`` share
    memory (``ValueError`` naming both paths).

    Example:
      >>> p = nn.Parameter(torch.zeros(2))
      >>> out = af.mixed.skip_or_apply_(torch.tensor(True), {"w": torch.ones(2)}, {"w": p})
      >>> out["w"] is p, p.detach()
      (True, tensor([1., 1.]))

    Cost: the pure selection (a read of both trees into a new tree the size of ``old``), then
    one copy of it into ``old``; no host sync.
    """
    chosen = skip_or_apply(finite, new, old)
    paths_old = leaves_with_paths(old)
    tensors = [x for _, x in paths_old if isinstance(x, torch.Tensor)]
    tensor_tree = {p: x for p, x in paths_old if isinstance(x, torch.Tensor)}
    check_no_overlap("skip_or_apply_", [("old", tensor_tree, tensors)])
    with torch.no_grad():  # nn.Parameter leaves are written like any tensor
        for dst, src in zip(tree_leaves(old), tree_leaves(chosen)):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
    return old


def update_scale_(ls, finite):
    """In-place :func:`update_scale`: a :class:`DynamicLossScale`'s tensors are overwritten.

    Static and no-op scales have nothing to update (their flag is still checked).

    Args:
      ls: a loss scale or a dict of loss scales (a list is refused with ``TypeError``).
      finite: the step's 0-d bool flag (a Python ``bool`` is accepted), or a dict of flags.

    Returns:
      ``ls`` itself.

    Example:
      >>> ls = af.DynamicLossScale(2.0**15)
      >>> af.mixed.update_scale_(ls, torch.tensor(False)) is ls
      True
      >>> float(ls.loss_scale)
      16384.0

    Cost: one 0-d kernel per dynamic scale, writing its three tensors; no host sync.
    """
    if isinstance(ls, Mapping):
        for _, v, f in _scales_and_flags(ls, finite, "update_scale_"):
            update_scale_(v, f)
        return ls
    _check_loss_scale(ls, "update_scale_")
    ls._adjust_(finite)  # static and no-op scales only check the flag
    return ls


# ----------------------------------------------------------------------------------------------
# The composed transform (the front-end of ampfunc.engine)
# ----------------------------------------------------------------------------------------------


class MixedPrecision(GradientTransformation):
    """A mixed-precision transform: optax's pair ``(init, update)`` plus whole-step helpers.

    It *is* a :class:`~ampfunc.GradientTransformation` (``init, update = tx`` works) with:

    * ``step(params, grads, state) -> (params, state)``: pure; the new params directly (for
      fp16/bf16 params, exactly the cast of the fp32 master);
    * ``step_(params, grads, state) -> (params, state)``: the same numbers, computed in place:
      ``params`` and ``state`` are donated (their tensors are overwritten and returned);
    * ``inner``: the wrapped optimizer transform; ``engine``: the :class:`ampfunc.engine.Engine`
      all three run.

    ``grads`` are the gradients of the *scaled* loss (``scale_loss(loss, loss_scale_of(state))``).
    Made by :func:`mixed_precision`.

    Attributes:
      init: ``init(params) -> MixedPrecisionState``.
      update: ``update(grads, state, params) -> (updates, state)``, optax's contract.
      step: ``step(params, grads, state) -> (params, state)``, pure.
      step_: ``step_(params, grads, state) -> (params, state)``, in place.
      inner: the wrapped optimizer transform.
      engine: the :class:`ampfunc.engine.Engine` that runs them.

    Example:
      >>> tx = af.mixed_precision(af.sgd(0.5), af.StaticLossScale(4.0))
      >>> init, update = tx
      >>> params = {"w": torch.ones(2)}
      >>> state = tx.init(params)
      >>> params, state = tx.step(params, {"w": torch.full((2,), 4.0)}, state)  # scaled grads
      >>> params["w"]
      tensor([0.5000, 0.5000])
    """

    # It unscales, checks and skips the whole step: combinators refuse it as an inner transform
    # (ampfunc.transform.refuse_outermost_only).
    OUTERMOST_ONLY = True

    def __getattr__(self, name: str):
        # Only reached when `engine` (or `inner`) was never set: the pair was rebuilt from its
        # two fields (`_replace`, a tree map over the transform), which carry no engine.
        if name in ("engine", "inner", "step", "step_"):
            raise AttributeError(f"this MixedPrecision has no {name}: it was rebuilt from its (init, update) fields "
                                 "(`_replace`, a tree map over the transform); build it with af.mixed_precision(...)")
        raise AttributeError(f"'MixedPrecision' object has no attribute {name!r}")

    @property
    def step(self) -> Callable:
        return self.engine.step

    @property
    def step_(self) -> Callable:
        return self.engine.step_

    @property
    def inner(self) -> GradientTransformation:
        return self.engine.inner


def mixed_precision(inner: GradientTransformation, loss_scale: LossScale | None = None,
                    master_dtype: torch.dtype = torch.float32, *, master: str = "fp32", group=None) -> MixedPrecision:
    """Wraps ``inner`` (any optimizer transform) into a whole mixed-precision step.

    One step (:class:`ampfunc.engine.Engine`): unscale the gradients of the scaled loss and check
    them (one pass), run ``inner`` on fp32 gradients against the fp32 master params, keep the
    old params/state on the device if any gradient was not finite, and advance the loss scale.
    When a param is fp16/bf16 an fp32 master copy lives in the state (apex ``FP16_Optimizer`` /
    amp O2) and the params handed back are the master cast to each param's dtype. When
    ``inner`` is registered with the kernels (``sgd``/``adam``/``adamw``, optionally after
    ``clip_by_global_norm``) every entry point runs the fused kernels, with the numbers of the
    generic path.

    Args:
      inner: the optimizer transform.
      loss_scale: ``NoOpLossScale()`` (bf16/fp32: the loss is not scaled),
        ``StaticLossScale(s)`` or ``DynamicLossScale(...)`` (fp16). Pass it: left out, it is
        ``DynamicLossScale()`` (2**16, so the loss must be scaled with
        ``af.scale_loss(loss, af.loss_scale_of(state))``) with a ``FutureWarning``; the next
        release makes it ``NoOpLossScale()``, as ``ModuleTrainer``'s and ``make_train_step``'s.
      master_dtype: the master dtype for params narrower than it (never narrows a param: fp64
        params keep fp64).
      master: how the fp32 master of a bf16 param is kept: ``"fp32"`` (a copy, 4 bytes per
        element) or ``"split"`` (the bf16 param is the master's high half, rounded to nearest,
        and the state keeps the int16 low half: 2 bytes, the same fp32 master bit for bit;
        see :mod:`ampfunc.lowmem`). ``"split"`` needs ``master_dtype=torch.float32`` and
        refuses fp16 params; fp32/fp64 params are their own masters.
      group: a ``torch.distributed`` process group whose ranks agree on skipping. DTensor
        params (FSDP2's ``dict(model.named_parameters())``) need none: every entry point runs
        the kernels on their local shards, completes the skip flag and the clipping norm over
        their mesh, and hands back DTensors laid out as the given ones; ``init`` makes the state
        per rank on the local shards (:mod:`ampfunc.shards`).

    Returns:
      A :class:`MixedPrecision`: ``init(params)``, ``update(grads, state, params)``,
      ``step(params, grads, state)``, ``step_(params, grads, state)``. The state
      (:class:`~ampfunc.engine.MixedPrecisionState`) carries the loss scale for the next loss
      (:func:`loss_scale_of`), the last step's ``finite`` flag and the count of ``skipped``
      steps as 0-d tensors.

    Example:
      >>> tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3)),
      ...                         loss_scale=af.DynamicLossScale())
      >>> params = {"w": torch.ones(3, dtype=torch.float16)}
      >>> state = tx.init(params)
      >>> state.master["w"].dtype
      torch.float32
      >>> grads = {"w": torch.tensor([1.0, float("inf"), 1.0], dtype=torch.float16)}
      >>> params, state = tx.step_(params, grads, state)  # grads of the scaled loss
      >>> bool(state.finite), int(state.skipped)          # a host sync: do it when you log
      (False, 1)
      >>> float(af.loss_scale_of(state).loss_scale)
      32768.0

    Cost: fused: one read-only pass over the gradients and one optimizer pass (in place for
    ``step_``, into new tensors for ``step``); generic: the primitives' passes. No host sync.
    """
    if loss_scale is None:
        # The one front-end whose default scales: a bf16/fp32 user who does not scale the loss
        # would get every update 65536x too small, silently. Loud until the default changes.
        warnings.warn(
            "mixed_precision: no loss_scale given; the default, DynamicLossScale() (2**16), unscales the "
            "gradients by 2**16, so the loss must be scaled with af.scale_loss(loss, af.loss_scale_of(state)) "
            "(state.loss_scale.scale(loss)) before backward, or every update is 65536x too small. Pass "
            "loss_scale= explicitly: af.NoOpLossScale() for bf16/fp32, af.DynamicLossScale() for fp16. The "
            "default becomes NoOpLossScale() in the next release (as ModuleTrainer's and make_train_step's)",
            FutureWarning, stacklevel=2)
        loss_scale = DynamicLossScale()
    _check_loss_scale(loss_scale, "mixed_precision")
    engine = Engine(inner, master_dtype=master_dtype, master=master, group=group, where="mixed_precision")

    def init(params):
        return engine.init(params, loss_scale)

    tx = MixedPrecision(init, engine.update)
    tx.engine = engine
    return tx


def check_optimizer_transform(tx, where: str) -> None:
    """Raises unless ``tx`` is a plain optimizer transform (front-ends that run the
    mixed-precision step themselves refuse a :class:`MixedPrecision` wrapper)."""
    if isinstance(tx, MixedPrecision):
        raise TypeError(
            f"{where} runs the mixed-precision step itself (unscale, check, skip, scale update): pass the "
            "optimizer transform and the loss scale separately, e.g. tx=tx.inner, loss_scale=af.DynamicLossScale()")
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"{where}: tx must be a GradientTransformation, got {type(tx).__name__}")


def loss_scale_of(state: Any) -> LossScale:
    """The loss scale held in a (possibly nested) state: the scale to use for the next loss.

    Args:
      state: a :class:`~ampfunc.engine.MixedPrecisionState`, a loss scale, or a tuple/list/dict
        holding one.

    Returns:
      The loss scale object (use ``.loss_scale`` for its 0-d tensor); the first one found,
      depth first. ``ValueError`` when there is none.

    Example:
      >>> tx = af.mixed_precision(af.sgd(0.1), af.StaticLossScale(8.0))
      >>> state = tx.init({"w": torch.ones(2)})
      >>> float(af.loss_scale_of(state).loss_scale)
      8.0
      >>> af.loss_scale_of({"opt": state, "epoch": 3}) is state.loss_scale
      True

    Cost: a walk over the containers in Python; no tensor is read, no kernel.
    """
    if isinstance(state, _MixedPrecisionState):
        return state.loss_scale
    if isinstance(state, LossScale):
        return state
    children = state.values() if isinstance(state, Mapping) else state if isinstance(state, (tuple, list)) else ()
    for child in children:
        try:
            return loss_scale_of(child)
        except ValueError:
            continue
    raise ValueError(f"loss_scale_of: no MixedPrecisionState or loss scale found in {type(state).__name__}")


def master_params(params: PyTree, state: Any) -> PyTree:
    """The fp32 (or wider) master params of a mixed-precision state, for either ``master`` setting.

    Args:
      params: the params the state was stepped with (bf16 ones are the high halves of their
        masters with ``master="split"``).
      state: a :class:`~ampfunc.engine.MixedPrecisionState`, ``make_train_step``'s
        ``TrainState`` or ``ModuleTrainer``'s ``TrainerState`` (anything with a ``master``
        field).

    Returns:
      A tree like ``params``: ``master="fp32"``: the state's master copies; ``master="split"``:
      each bf16 param joined with its low half (new fp32 tensors, exact); params that need no
      master (fp32, fp64): the params themselves. With no master at all, ``params``.

    Example:
      >>> tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale(), master="split")
      >>> params = {"w": torch.ones(3, dtype=torch.bfloat16)}
      >>> state = tx.init(params)
      >>> af.master_params(params, state)["w"]
      tensor([1., 1., 1.])

    Raises:
      TypeError: ``state`` is not such a state (``None``, an optimizer's own state, a
        ``SplitMaster`` alone).
      ValueError: the state's master does not fit ``params`` (another model, a flat
        ``ModuleTrainer``'s per-dtype buffers), naming the leaf.

    Cost: ``"split"``: one elementwise pass per bf16 leaf into a new fp32 tensor; otherwise
    nothing (the stored tensors are returned). A shape look per leaf; no host sync.
    """
    where = "master_params"
    fields = getattr(type(state), "_fields", ())
    if "master" not in fields:
        hint = (" (pass the whole state, not its .master)" if isinstance(state, SplitMaster) else
                " (an optimizer's own state keeps no master: the params are the masters)" if fields else "")
        raise TypeError(f"{where}: state must be a mixed-precision state with a master field (mixed_precision's "
                        f"MixedPrecisionState, make_train_step's TrainState, ModuleTrainer's TrainerState), got "
                        f"{type(state).__name__}{hint}")
    master = state.master
    if master is None:
        return params
    if isinstance(master, SplitMaster):
        check_split_master(params, master, where)
        return join_master(params, master)
    _check_dense_master(params, master, where)
    return master


def _check_dense_master(params: PyTree, master: PyTree, where: str) -> None:
    """``ValueError`` naming the leaf where an fp32-master tree does not fit ``params``."""
    p_leaves, m_leaves = leaves_with_paths(params), leaves_with_paths(master)
    if [p for p, _ in p_leaves] != [p for p, _ in m_leaves]:
        shown = ", ".join(repr(p) for p, _ in m_leaves[:3]) + (", ..." if len(m_leaves) > 3 else "")
        if m_leaves and all("@" in p for p, _ in m_leaves):
            raise ValueError(f"{where}: the state's master holds flat buffers ({shown}), one per dtype and device "
                             "(ModuleTrainer(flat=True)), not a master per param: read per-param masters from a "
                             "ModuleTrainer with flat=False")
        raise ValueError(f"{where}: the state's master holds the leaves {shown}, not the params': the state was "
                         "made for other params -- pass the params it was made for")
    for (path, p), (_, m) in zip(p_leaves, m_leaves):
        local = p.to_local() if callable(getattr(p, "to_local", None)) and not hasattr(m, "to_local") else p
        if not isinstance(m, torch.Tensor) or not m.is_floating_point() or m.shape != local.shape:
            got = f"{m.dtype} {tuple(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"{where}: params leaf {path!r} has shape {tuple(local.shape)} but its master is {got}: "
                             "the state was made for other params")

