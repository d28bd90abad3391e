"""torch.func interop: loss-scaled ``value_and_grad`` and a whole train step users can compile.

``value_and_grad`` is flax's ``DynamicScale.value_and_grad`` for PyTorch: it differentiates the
*scaled* loss with ``torch.func.grad`` and hands back the loss as ``loss_fn`` computed it, the
fp32 gradients divided by the scale, and a 0-d bool ``finite`` flag. Nothing reads a tensor back
to the host, so it composes with ``torch.vmap`` (per-example gradients) and
``torch.compile(fullgraph=True)``.

``make_train_step`` builds the whole step -- cast to the compute dtype, forward through
``functional_call`` (buffers such as BatchNorm running statistics updated functionally),
backward, unscale and check, the optimizer transform (clipping included), the skip and the
loss-scale update -- as one pure function of a :class:`TrainState`::

    train = af.make_train_step(model, loss_fn, af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3)),
                               af.get_policy("p=f32,c=f16,o=f32"), loss_scale=af.DynamicLossScale())
    state = train.init()
    step = torch.compile(train.step, fullgraph=True)
    for x, y in loader:
        state, out = step(state, x, y)        # out.loss, out.finite, out.loss_scale
    af.functional.copy_to_module(model, state.params, state.buffers)

``train.step_`` is the same step with the state donated (written in place, as
``mixed_precision(...).step_``): no new params or moments each step, and compiled, a graph that
writes its inputs with no copy-back.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.func import functional_call

from ampfunc import ops
from ampfunc.dist import all_reduce_mean
from ampfunc.engine import Engine, MixedPrecisionState, skip_stats
from ampfunc.flat import unpacked
from ampfunc.fp8 import Fp8Policy
from ampfunc.loss_scale import LossScale, NoOpLossScale
from ampfunc.lowmem import init_split_master, join_master
from ampfunc.mixed import check_optimizer_transform, unscale_and_check
from ampfunc.policy import Policy, buffers_of, cast_params, get_policy, norm_layers, params_of
from ampfunc.shards import fully_sharded_module, local_view
from ampfunc.transform import GradientTransformation
from ampfunc.tree import (
    PyTree,
    arithmetic_dtype,
    float_leaves_with_paths,
    leaves_with_paths,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

__all__ = [
    "apply_module",
    "ValueAndGrad",
    "value_and_grad",
    "clip_per_example",
    "TrainState",
    "StepOutput",
    "TrainStep",
    "make_train_step",
    "copy_to_module",
]


def apply_module(model: torch.nn.Module, params: PyTree, buffers: PyTree, *args, **kwargs) -> tuple[Any, PyTree]:
    """Runs ``model(*args, **kwargs)`` with ``params`` and ``buffers``: ``(output, new_buffers)``.

    A pure forward through ``torch.func.functional_call``: the buffers are copied first, so
    what the forward writes into them (BatchNorm's running statistics, ``num_batches_tracked``)
    lands in ``new_buffers`` and the given ``buffers`` stay untouched. Differentiable in
    ``params``; usable under ``torch.func.grad``, ``vmap`` (without BatchNorm in training mode)
    and ``torch.compile``.

    Args:
      model: the ``nn.Module`` to run (its own tensors stand in for any path ``params`` and
        ``buffers`` lack, as ``functional_call`` does).
      params: a dict of parameters by path (``{"0.weight": tensor, ...}``, as
        :func:`ampfunc.params_of` gives).
      buffers: a dict of buffers by path (as :func:`ampfunc.policy.buffers_of` gives); ``{}`` for none.
      *args: the forward's positional arguments.
      **kwargs: the forward's keyword arguments.

    Returns:
      ``(output, new_buffers)``: what the forward returned, and the copies of ``buffers``
      holding what the forward wrote into them.

    Example:
      >>> model = nn.BatchNorm1d(3)
      >>> params, buffers = af.params_of(model), af.policy.buffers_of(model)
      >>> out, new_buffers = af.functional.apply_module(model, params, buffers, torch.randn(8, 3))
      >>> int(new_buffers["num_batches_tracked"]), int(buffers["num_batches_tracked"])
      (1, 0)

    Cost: the forward and one copy of each tensor buffer (small next to the params); no host
    sync of its own.
    """
    new_buffers = tree_map(lambda b: b.clone() if isinstance(b, torch.Tensor) else b, buffers)
    return functional_call(model, (params, new_buffers), args, kwargs), new_buffers


class ValueAndGrad(NamedTuple):
    """What the function built by :func:`value_and_grad` returns: ``(value, grads, finite)``.

    Attributes:
      value: the loss as ``loss_fn`` computed it (detached, never scaled); ``(loss, aux)`` with
        ``has_aux``.
      grads: fp32 gradients of the unscaled loss, in the structure of the differentiated
        argument (a tuple of them when ``argnums`` is a tuple).
      finite: 0-d bool tensor, ``True`` when every element of the scaled loss's gradients was
        finite (under ``vmap``: one flag per example).

    Example:
      >>> vg = af.value_and_grad(lambda w, x: (w * x).sum())
      >>> out = vg(af.StaticLossScale(1024.0), torch.ones(3), torch.tensor([0.0, 1.0, 2.0]))
      >>> float(out.value), out.grads.tolist(), bool(out.finite)
      (3.0, [0.0, 1.0, 2.0], True)
    """

    value: Any
    grads: PyTree
    finite: torch.Tensor


def _is_batched(x) -> bool:
    return isinstance(x, torch.Tensor) and torch._C._functorch.is_batchedtensor(x)


def _unscale_and_check_batched(grads: PyTree, ls: LossScale) -> tuple[PyTree, torch.Tensor]:
    """Under ``vmap``: the same numbers as :func:`unscale_and_check` from batchable ops.

    The fused unscale op mutates a shared overflow flag in place, which ``vmap`` cannot
    batch; here each example gets its own flag. ``g.float() * inv_scale`` is the product the
    fused op takes (fp32), so results agree bit for bit with the unbatched path.
    """
    float_leaves_with_paths(grads, "value_and_grad: grads")
    inv = ls.inv_scale
    leaves, spec = tree_flatten(grads)
    # fp32, or fp64 for fp64 gradients, as the unbatched unscale gives them.
    outs = [g.to(arithmetic_dtype(g.dtype)) * inv.to(g.device, arithmetic_dtype(g.dtype)) for g in leaves]
    valid = ls.is_valid()  # a scale set by hand out of range: skip, as unbatched
    if not leaves:
        return grads, valid
    finite = torch.stack([g.isfinite().all() for g in leaves]).all() & valid.to(leaves[0].device)
    return tree_unflatten(spec, outs), finite


def _check_has_aux(has_aux: Any, where: str) -> None:
    # a truthy string would unpack the loss as (loss, aux); "False" reads as True
    if not isinstance(has_aux, bool):
        raise TypeError(f"{where}: has_aux must be a bool (True or False), got {type(has_aux).__name__} {has_aux!r}")


def value_and_grad(loss_fn: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False, *,
                   group=None) -> Callable[..., ValueAndGrad]:
    """Differentiates ``loss_fn`` under a loss scale: ``vg(loss_scale, *args, **kwargs) -> ValueAndGrad``.

    ``vg`` computes ``loss_fn(*args, **kwargs)``, differentiates the scaled loss
    (``loss_scale.scale(loss)``) with respect to ``args[argnums]`` (``torch.func.grad``), and
    unscales the gradients to fp32 while checking them (one pass:
    :func:`ampfunc.unscale_and_check`). The loss is returned as computed, never divided back,
    so it is exact.

    Composes with ``torch.vmap``: ``vmap(vg, in_dims=(None, None, 0, 0))(ls, params, x, y)``
    gives per-example fp32 grads and one ``finite`` flag per example (see
    :func:`clip_per_example`).

    Args:
      loss_fn: ``loss_fn(*args, **kwargs)`` returns a scalar loss tensor, or ``(loss, aux)``
        with ``has_aux``.
      argnums: the positional argument(s) of ``loss_fn`` to differentiate: an int, or a tuple
        of ints (then ``grads`` is a tuple), as ``torch.func.grad``.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back untouched (use it for
        updated BatchNorm buffers, metrics, ...).
      group: a ``torch.distributed`` process group: the fp32 gradients are averaged over its
        ranks (data parallelism without DDP; flax's ``axis_name``) and every rank gets the
        same ``finite`` flag. Not under ``vmap`` (``ValueError``).

    Returns:
      ``vg(loss_scale, *args, **kwargs) -> ValueAndGrad``: the loss scale (a
      :class:`~ampfunc.loss_scale.LossScale`) first, then ``loss_fn``'s arguments.

    Example:
      >>> model = nn.Linear(4, 2)
      >>> def loss_fn(params, x):
      ...     out, _ = af.functional.apply_module(model, params, {}, x)
      ...     return out.square().mean()
      >>> vg = af.value_and_grad(loss_fn)
      >>> loss, grads, finite = vg(af.DynamicLossScale(), af.params_of(model), torch.randn(8, 4))
      >>> grads["weight"].dtype, grads["weight"].shape, bool(finite)
      (torch.float32, torch.Size([2, 4]), True)

    Cost: per call of ``vg``, one forward and one backward of ``loss_fn``, then one read of
    the gradients and one fp32 write (fp32 gradients under :class:`~ampfunc.NoOpLossScale`
    pass through uncopied; under ``vmap``, batchable ops that read them twice); with
    ``group``, one all-reduce of the flag and one of the fp32 gradients (packed into one
    buffer per device). No host sync.
    """
    if not callable(loss_fn):
        raise TypeError(f"value_and_grad: loss_fn must be callable, got {type(loss_fn).__name__}")
    _check_has_aux(has_aux, "value_and_grad")
    if isinstance(argnums, bool) or (isinstance(argnums, tuple) and any(isinstance(a, bool) for a in argnums)):
        # a bool is an int to torch.func (True is argument 1): the usual slip is
        # value_and_grad(loss_fn, True) meant as has_aux, which would differentiate the wrong argument
        raise TypeError(f"value_and_grad: argnums must be an int or a tuple of ints, got {argnums!r} (the "
                        "signature is value_and_grad(loss_fn, argnums=0, has_aux=False), as torch.func's: pass "
                        "has_aux=True by keyword)")

    def scaled(loss_scale, *args, **kwargs):
        out = loss_fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("value_and_grad(has_aux=True): loss_fn must return (loss, aux), "
                                f"got {type(out).__name__}")
            loss, aux = out
        else:
            loss, aux = out, None
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"value_and_grad: loss_fn must return a tensor loss, got {type(loss).__name__}")
        # torch.func.grad hands aux back only if it is a pytree of tensors: no None in it.
        return loss_scale.scale(loss), ((loss.detach(), aux) if has_aux else (loss.detach(),))

    def vg(loss_scale, *args, **kwargs) -> ValueAndGrad:
        if not isinstance(loss_scale, LossScale):
            raise TypeError("value_and_grad: the first argument of the returned function is the loss scale "
                            f"(e.g. af.DynamicLossScale()), got {type(loss_scale).__name__}")
        # argnums counts loss_fn's arguments; loss_scale sits in front of them here.
        # loss_scale goes in front: non-negative indices move up by one; negative ones count from
        # the end and stay (-1 is still loss_fn's last argument, never the scale)
        def shift(a):
            return a + 1 if a >= 0 else a

        shifted = tuple(map(shift, argnums)) if isinstance(argnums, tuple) else shift(argnums)
        grads, value = torch.func.grad(scaled, shifted, has_aux=True)(loss_scale, *args, **kwargs)
        if any(_is_batched(g) for g in tree_leaves(grads)):
            if group is not None:
                raise ValueError("value_and_grad: group= cannot be used under vmap (one collective per example)")
            grads32, finite = _unscale_and_check_batched(grads, loss_scale)
        else:
            grads32, finite = unscale_and_check(grads, loss_scale, group=group)
            if group is not None:
                grads32 = all_reduce_mean(grads32, group)
        return ValueAndGrad(value if has_aux else value[0], grads32, finite)

    return vg


def clip_per_example(grads: PyTree, max_norm: float, reduce: str = "mean") -> tuple[PyTree, torch.Tensor]:
    """DP-SGD's per-example clipping: each example's gradient clipped to ``max_norm``, then reduced.

    Each example's gradient is scaled by ``min(1, max_norm / (norm_i + 1e-6))`` where
    ``norm_i`` is its L2 norm over all leaves (accumulated in fp32;
    ``torch.nn.utils.clip_grad_norm_`` per example), then the examples are averaged, summed or
    kept, as ``reduce`` says.

    Args:
      grads: a pytree of per-example gradients (floating tensors), the example index on dim 0
        of every leaf (what ``vmap`` over :func:`value_and_grad` returns).
      max_norm: the largest L2 norm an example's gradient keeps (> 0).
      reduce: ``"mean"`` (average the clipped examples), ``"sum"`` (where DP-SGD adds its
        noise) or ``"none"`` (keep the example dim).

    Returns:
      ``(clipped, norms)``: the clipped gradients in fp32 (the structure of ``grads``; dim 0
      reduced away unless ``reduce="none"``) and a 1-d fp32 tensor of each example's norm
      before clipping.

    Example:
      >>> grads = {"w": torch.tensor([[3.0, 4.0], [0.0, 0.5]])}   # two examples
      >>> clipped, norms = af.functional.clip_per_example(grads, max_norm=1.0)
      >>> norms.tolist()
      [5.0, 0.5]
      >>> [round(v, 4) for v in clipped["w"].tolist()]   # the mean of [0.6, 0.8] and [0.0, 0.5]
      [0.3, 0.65]

    Cost: two reads of the grads (the norms, then the scaled reduction), each through a
    full-size fp32 temporary per leaf (plus a cast of each non-fp32 leaf); no host sync.
    """
    if reduce not in ("mean", "sum", "none"):
        raise ValueError(f"clip_per_example: reduce must be 'mean', 'sum' or 'none', got {reduce!r}")
    if not max_norm > 0:
        raise ValueError(f"clip_per_example: max_norm must be > 0, got {max_norm!r}")
    paths, leaves = float_leaves_with_paths(grads, "clip_per_example: grads")
    if not leaves:
        raise ValueError("clip_per_example: grads has no leaves")
    n = leaves[0].shape[0] if leaves[0].dim() else None
    for path, g in zip(paths, leaves):
        if g.dim() == 0 or g.shape[0] != n:
            raise ValueError(f"clip_per_example: leaf {path!r} has shape {tuple(g.shape)}; every leaf needs the "
                             f"example index on dim 0 (batch of {n})")
    sumsq = sum(g.to(torch.float32).reshape(n, -1).square().sum(1) for g in leaves)
    norms = sumsq.sqrt()
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)

    def clip(g):
        c = (g.to(torch.float32) * coef.reshape((n,) + (1,) * (g.dim() - 1)))
        if reduce == "mean":
            return c.mean(0)
        if reduce == "sum":
            return c.sum(0)
        return c

    _, spec = tree_flatten(grads)
    return tree_unflatten(spec, [clip(g) for g in leaves]), norms


# ----------------------------------------------------------------------------------------------
# The whole step
# ----------------------------------------------------------------------------------------------


class TrainState(NamedTuple):
    """Everything a train step changes, as one pytree of tensors (``torch.save``-able, compilable).

    Made by ``train.init()`` of :func:`make_train_step`. Read ``finite`` and ``skipped`` as
    tensors (no host sync) or with ``bool(...)``/``int(...)`` when you log.

    Attributes:
      params: the params by path, in the policy's param dtype.
      buffers: the buffers by path (BatchNorm statistics, ...), as the last forward left them;
        a skipped step keeps the old ones (an fp16 forward that overflowed would otherwise
        leave NaN running statistics for good).
      opt_state: the state of the optimizer transform.
      loss_scale: the :class:`~ampfunc.loss_scale.LossScale` for the next step's loss.
      finite: 0-d bool: the last step was applied (``True`` before the first).
      skipped: 0-d int64: the steps skipped so far.
      fp8: the FP8 scaling state (``make_train_step(fp8=...)``), else ``None``.
      master: with ``make_train_step(master="split")``, the
        :class:`~ampfunc.lowmem.SplitMaster` whose int16 low halves complete the bf16 params
        into exact fp32 masters (:func:`ampfunc.master_params`); else ``None``.

    Example:
      >>> train = af.make_train_step(nn.Linear(4, 2), lambda fwd, x: fwd(x).square().mean(), af.sgd(0.1))
      >>> state = train.init()
      >>> sorted(state.params), bool(state.finite), int(state.skipped)
      (['bias', 'weight'], True, 0)
    """

    params: PyTree
    buffers: PyTree
    opt_state: PyTree
    loss_scale: LossScale
    finite: Optional[torch.Tensor] = None
    skipped: Optional[torch.Tensor] = None
    fp8: Optional[PyTree] = None  # FP8 scaling state (make_train_step(fp8=...)), else None
    master: Optional[PyTree] = None  # the split masters' low halves (make_train_step(master="split")), else None


class StepOutput(NamedTuple):
    """What one train step reports, next to the new :class:`TrainState`.

    Attributes:
      loss: the loss as ``loss_fn`` computed it (detached, not scaled).
      finite: 0-d bool: the step was applied (every gradient was finite).
      loss_scale: the 0-d fp32 scale this step's loss was multiplied by (with
        :class:`~ampfunc.NoOpLossScale`, a new tensor ``1.0`` on the params' device).
      aux: the ``aux`` that ``loss_fn`` returned with ``has_aux``, else ``None``.

    Example:
      >>> train = af.make_train_step(nn.Linear(4, 2), lambda fwd, x: fwd(x).square().mean(), af.sgd(0.1))
      >>> state, out = train.step(train.init(), torch.randn(8, 4))
      >>> out.loss.shape, bool(out.finite), float(out.loss_scale), out.aux
      (torch.Size([]), True, 1.0, None)
    """

    loss: torch.Tensor
    finite: torch.Tensor
    loss_scale: torch.Tensor
    aux: Any


class TrainStep(NamedTuple):
    """What :func:`make_train_step` returns: ``init``, the pure ``step`` and its in-place twin.

    Attributes:
      init: ``init() -> TrainState``: a new state from the module's current weights (copies).
      step: ``step(state, *batch) -> (state, StepOutput)``: pure (``state`` is not written)
        and with no host sync, so ``torch.compile(step, fullgraph=True)`` compiles it whole.
      step_: (property) the same step computed in place: ``state`` is donated, written and
        returned.

    Example:
      >>> train = af.make_train_step(nn.Linear(4, 2), lambda fwd, x: fwd(x).square().mean(), af.sgd(0.1))
      >>> x = torch.randn(8, 4)
      >>> new, out = train.step(train.init(), x)       # pure: a new state
      >>> state = train.init()
      >>> same, out = train.step_(state, x)            # in place: the state it was given
      >>> same is state, torch.equal(new.params["weight"], state.params["weight"])
      (True, True)
    """

    init: Callable[[], TrainState]
    step: Callable[..., tuple[TrainState, StepOutput]]

    @property
    def step_(self) -> Callable[..., tuple[TrainState, StepOutput]]:
        """The in-place twin of ``step``: ``step_(state, *batch) -> (state, StepOutput)``.

        The same numbers as ``step`` (bit for bit in eager mode), but ``state`` is donated (as
        JAX's ``donate_argnums``): its params, optimizer state, loss scale, buffers and
        ``finite``/``skipped`` tensors are overwritten with the new step's and the same state
        comes back. No new params or moments are allocated, so the fused optimizer pass runs
        in place (``torch.compile(step_, fullgraph=True)`` keeps it in place: the graph writes
        its inputs, with no copy-back). The ``StepOutput`` tensors are fresh (not aliases of the
        state). Everything is validated before the first write.
        """
        inplace = getattr(self.step, "_inplace", None)
        if inplace is None:
            raise AttributeError("TrainStep.step_: this step has no in-place twin (make_train_step builds both)")
        return inplace


def _plain_autograd_ok() -> bool:
    """Whether a train step may differentiate with plain autograd: eager and no torch.func
    transform active. Inside torch.compile, torch.func.grad is what dynamo traces as one graph;
    under vmap (a batch of train steps) only torch.func composes."""
    return not (ops._is_compiling() or ops._transforms_active())


def make_train_step(model: torch.nn.Module, loss_fn: Callable, tx: GradientTransformation, policy=None, *,
                    loss_scale: LossScale | None = None, has_aux: bool = False, keep=None,
                    group=None, overwrite_with_gradient: Callable[[str], bool] | None = None,
                    fp8: Fp8Policy | None = None, master: str = "fp32") -> TrainStep:
    """A pure, compilable train step for ``model``: ``train.init()`` and ``train.step(state, *batch)``.

    One step: forward and backward of the scaled loss (``torch.func.grad`` when compiled or
    under another torch.func transform; eager, plain autograd, the same numbers without the
    transform's per-op cost), then the
    mixed-precision step of :class:`ampfunc.engine.Engine` -- check, ``tx`` (clipping, the
    optimizer), apply, skip on the device, loss-scale update -- which runs the fused kernels
    when ``tx`` is registered with them (``sgd``/``adam``/``adamw``, optionally after
    ``clip_by_global_norm``) and the params are fp32, and the generic path otherwise, with the
    same numbers. Params live in the policy's param dtype (fp32 by default; the compute copy is
    a cast inside the step, as jmp does), except those ``keep`` names (the norm layers by
    default), which stay in the module's dtype beside their fp32 buffers.

    Args:
      model: the ``nn.Module`` (its weights seed ``init``; the step never writes it).
      loss_fn: ``loss_fn(forward, *batch)`` returns the loss (or ``(loss, aux)`` with
        ``has_aux``); ``forward(*inputs, **kwargs)`` runs ``model`` through ``functional_call``
        with the params cast to ``policy.compute_dtype`` (leaves named by ``keep`` -- by default
        the norm layers, :func:`ampfunc.norm_layers` -- stay as stored), floating inputs cast to
        the compute dtype and the output cast to ``policy.output_dtype``. Buffers are passed on
        fresh copies, so BatchNorm's running statistics come back updated in the new state.
      tx: the optimizer transform (not a :func:`ampfunc.mixed_precision` wrapper: this function
        is that wrapper).
      policy: a :class:`~ampfunc.Policy` or its string form; default full fp32.
      loss_scale: the initial :class:`~ampfunc.loss_scale.LossScale`; default :class:`NoOpLossScale`.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back as ``StepOutput.aux``.
        Under ``torch.compile`` (and ``vmap``) ``aux`` must hold tensors only, as
        ``torch.func.grad``'s aux must; eagerly it may hold anything.
      keep: the params the forward uses as stored, not cast to the compute dtype: paths, a
        predicate or :func:`ampfunc.norm_layers`'s result, as :func:`ampfunc.cast_params`
        takes; default ``norm_layers(model)``.
      group: a ``torch.distributed`` process group: gradients are averaged over it (data
        parallelism without DDP) and every rank takes the same skip decision. A module whose
        params are DTensors (``distribute_tensor``; a batch sharded on its rows) needs none:
        the step runs on their local shards, reduced over their mesh (:mod:`ampfunc.shards`);
        a module under FSDP2's ``fully_shard`` is refused (its hooks bypass functional_call).
      overwrite_with_gradient: a predicate on param paths (flax's "overwrite with gradient"):
        those params are not given to ``tx``; their "gradient" (what a custom autograd
        function's backward returned for them, e.g. new FP8 scaling state) becomes their new
        value, kept on a skipped step like every param.
      fp8: an :class:`ampfunc.fp8.Fp8Policy`: its Linear layers run as scaled FP8 matmuls and
        ``state.fp8`` carries their scaling state, the "gradient" of itself (never unscaled,
        averaged or clipped); with ``group`` the amaxes are MAX-reduced over it.
      master: ``"fp32"``: the params (in the policy's param dtype) are what ``tx`` updates, no
        separate master (jmp's model). ``"split"``: bf16 params are the high halves of exact
        fp32 masters whose low halves ``state.master`` keeps (2 bytes per element; a policy
        with bf16 params, e.g. ``"p=bf16,c=bf16,o=f32"``; fp32 leaves such as the norm layers
        are their own masters); ``tx`` updates the fp32 masters. See :mod:`ampfunc.lowmem`.

    Returns:
      A :class:`TrainStep` ``(init, step)``; ``step(state, *batch) -> (state, StepOutput)``.
      ``state.finite`` and ``state.skipped`` say whether the last step was applied and how many
      were skipped. ``train.step_`` is the same step in place (the state is donated): the fast
      path, the one to compile when the old state is not needed after the step.

    Example:
      >>> model = nn.Linear(4, 2)
      >>> train = af.make_train_step(model, lambda fwd, x: fwd(x).square().mean(), af.adamw(1e-3),
      ...                            "p=f32,c=bf16,o=f32", loss_scale=af.DynamicLossScale())
      >>> state = train.init()
      >>> step = train.step_       # torch.compile(train.step_, fullgraph=True) compiles it whole
      >>> state, out = step(state, torch.randn(8, 4))
      >>> bool(out.finite), int(state.skipped)
      (True, 0)
      >>> af.functional.copy_to_module(model, state.params, state.buffers)

    Cost: ``init`` copies the params and buffers. Each step: the forward and backward, one
    read-only check pass and one optimizer pass (fused), and the cast of the params to the
    compute dtype (with ``group``, one all-reduce of the gradients per (device, dtype)); no
    host sync. The gradients of cast params
    are taken in the compute dtype (the same values; the kernels widen them as they read).
    ``step`` writes new params and moments every step (on CPU, fresh memory: page faults);
    ``step_`` writes them in place.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"make_train_step: model must be a torch.nn.Module, got {type(model).__name__}")
    check_optimizer_transform(tx, "make_train_step")
    _check_has_aux(has_aux, "make_train_step")
    fsdp = fully_sharded_module(model)
    if fsdp is not None:
        which = "the model" if fsdp == "" else f"submodule {fsdp!r}"
        raise TypeError(f"make_train_step: {which} is managed by FSDP2's fully_shard, whose hooks gather "
                        "its own parameters and bypass the functional ones (the gradients would be zero): step the "
                        "module with ampfunc.ModuleTrainer or mixed_precision(...).step_ on "
                        "dict(model.named_parameters()), or give make_train_step a module whose parameters are "
                        "DTensors (distribute_tensor) and a batch sharded on its rows")
    policy = Policy() if policy is None else policy
    if isinstance(policy, str):
        policy = get_policy(policy)
    loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
    if not isinstance(loss_scale, LossScale):
        raise TypeError(f"make_train_step: loss_scale must be a loss scale, got {type(loss_scale).__name__}")
    keep = norm_layers(model) if keep is None else keep
    compute_dtype = policy.compute_dtype
    # The params are stored in the policy's param dtype and are the optimizer's reference:
    # no separate master copy (jmp's model).
    engine = Engine(tx, master_dtype=None, master=master, where="make_train_step")
    if fp8 is not None and not isinstance(fp8, Fp8Policy):
        raise TypeError(f"make_train_step: fp8 must be an ampfunc.fp8.Fp8Policy, got {type(fp8).__name__}")
    if fp8 is not None and group is not None and fp8.group is None:
        fp8 = dataclasses.replace(fp8, group=group)
    overwritten = overwrite_with_gradient if overwrite_with_gradient is not None else (lambda path: False)

    def optimized(tree: dict) -> dict:
        """The entries ``tx`` trains (all but the overwrite-with-gradient ones)."""
        return {k: v for k, v in tree.items() if not overwritten(k)} if overwrite_with_gradient else tree

    def init() -> TrainState:
        if not ops._is_compiling():
            # Load (build on first use) the compiled kernels now, so the build is paid here and
            # not inside the first run of a compiled step (whose first op call would otherwise
            # load them: ops._loading_first).
            ops.load()
        # Stored in the policy's param dtype, except the leaves `keep` names (the norm layers by
        # default): they stay as the module holds them (fp32), as their buffers do.
        params = cast_params(tree_map(lambda p: p.detach().clone(), params_of(model)), policy.param_dtype, keep=keep)
        buffers = tree_map(lambda b: b.detach().clone(), buffers_of(model))
        device = next((p.device for p in params.values()), torch.device("cpu"))
        # Its own copy of the scale's tensors (``.to`` returns the given ones when the device
        # matches): ``step_`` writes them, and two states from ``init`` must not share them.
        ls = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, loss_scale.to(device))
        # Each state leaf in its own storage (the optimizers pack their moments): the state is
        # donated to step_, and a compiled step_ over packed moments would copy the packed
        # buffer once per leaf every step (see ampfunc.flat.unpacked).
        # DTensor params: the optimizer state is made per rank on the local shards, as the engine
        # steps them (ampfunc.shards); the params stay DTensors. With master="split" the bf16
        # params' low halves are kept (of the local shards too: the step joins them with the
        # shards), and the optimizer's state is made for the fp32 masters.
        view = local_view(optimized(params), where="make_train_step.init")
        local = view.params if view is not None else optimized(params)
        split = init_split_master(local, "make_train_step.init") if master == "split" else None
        ref = join_master(local, split) if split is not None else local
        opt_state = tx.init(ref)
        return TrainState(params, buffers, unpacked(opt_state), ls, *skip_stats(device),
                          fp8=fp8.init(device) if fp8 is not None else None,
                          master=unpacked(split) if split is not None else None)

    def scaled_loss(compute_params, state8, buffers, ls, *batch):
        new_buffers = [buffers]

        def forward(*inputs, **kwargs):
            inputs, kwargs = policy.cast_to_compute((inputs, kwargs))
            # Each forward works on copies of the buffers it is given, so a pure step never
            # touches the state it was handed; the last forward's buffers are the new ones.
            out, new_buffers[0] = apply_module(model, compute_params, new_buffers[0], *inputs, **kwargs)
            return policy.cast_to_output(out)

        # One FP8 context for all the forwards loss_fn makes: their uses of a layer combine by max.
        with fp8.autocast(model, state8, compute_params) if fp8 is not None else contextlib.nullcontext():
            out = loss_fn(forward, *batch)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("make_train_step(has_aux=True): loss_fn must return (loss, aux), "
                                f"got {type(out).__name__}")
            loss, aux = out
        else:
            loss, aux = out, ()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"make_train_step: loss_fn must return a tensor loss, got {type(loss).__name__}")
        if loss.dim() != 0:
            raise ValueError(f"make_train_step: loss_fn must return a scalar (0-d) loss, got shape {tuple(loss.shape)}")
        return ls.scale(loss), (loss.detach(), new_buffers[0], aux)

    # The FP8 state is differentiated too: its "gradient" is its next value (ampfunc.fp8).
    traced_grad_fn = torch.func.grad(scaled_loss, argnums=(0, 1), has_aux=True)

    def eager_grad_fn(compute_params, state8, buffers, ls, *batch):
        """``traced_grad_fn``'s result, bit for bit, by plain autograd: the same backward kernels
        without torch.func's per-op transform layer (about 4% of a small GPT's eager step on
        CPU). Inputs are detached copies that require grad; what comes back is detached, as
        torch.func.grad hands back its aux, so no graph outlives the call."""
        p_leaves, p_spec = tree_flatten(compute_params)
        s_leaves, s_spec = tree_flatten(state8)
        wrt = [t.detach().requires_grad_() for t in p_leaves + s_leaves]
        with torch.enable_grad():
            scaled, aux_out = scaled_loss(tree_unflatten(p_spec, wrt[:len(p_leaves)]),
                                          tree_unflatten(s_spec, wrt[len(p_leaves):]), buffers, ls, *batch)
            grads = torch.autograd.grad(scaled, wrt, allow_unused=True, materialize_grads=True) if wrt else ()
        aux_out = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux_out)
        return ((tree_unflatten(p_spec, list(grads[:len(p_leaves)])),
                 tree_unflatten(s_spec, list(grads[len(p_leaves):]))), aux_out)

    def grad_fn(*args):
        return eager_grad_fn(*args) if _plain_autograd_ok() else traced_grad_fn(*args)

    narrowing = compute_dtype.itemsize > policy.param_dtype.itemsize

    def gradients(state: TrainState, batch: tuple):
        """``(grads, new8, loss, new_buffers, aux)``: one forward and backward of the scaled loss."""
        # Differentiated with respect to the compute copy, so a cast param's gradient comes back
        # in the compute dtype: the same values as the param-dtype gradient (the cast's backward
        # is an exact widening), without writing a wide copy of every gradient that the
        # kernels, which read fp16/bf16 gradients and widen them as they go, would read again.
        compute_params = cast_params(state.params, compute_dtype, keep=keep)
        (grads, new8), (loss, new_buffers, aux) = grad_fn(compute_params, state.fp8 or {}, state.buffers,
                                                          state.loss_scale, *batch)
        if narrowing:  # a compute dtype wider than a param's: its gradient rounded as before
            grads = tree_map(lambda g, p: g.to(p.dtype) if g.dtype.itemsize > p.dtype.itemsize else g,
                             grads, state.params)
        if group is not None:
            # Averaged in the params' dtype while still scaled: with the power-of-two scales this
            # equals averaging the unscaled gradients, and every rank then sees the same values
            # and the same flag.
            grads = all_reduce_mean(tree_map(lambda g, p: g.to(p.dtype), grads, state.params), group)
        return grads, new8, loss, new_buffers, aux

    # The layout init() gives, {path: (shape, dtype)} for params and buffers, built on first use
    # (meta tensors: nothing allocated); and the params dicts already found to match it (the
    # in-place step gets its own back, the pure step's outputs are ours), held strongly.
    layout: dict = {}
    matched: list = []

    def check_layout(state: TrainState, where: str) -> None:
        """A state from another model or another policy is refused, naming the leaf: the step
        would train it through functional_call, silently, with the model's own tensors for the
        paths it lacks."""
        if ops._is_compiling() or not isinstance(state, TrainState) or any(state.params is m for m in matched):
            return
        if not layout:
            meta = tree_map(lambda p: torch.empty_like(p, device="meta"), params_of(model))
            layout["params"] = {k: (tuple(v.shape), v.dtype)
                                for k, v in cast_params(meta, policy.param_dtype, keep=keep).items()}
            layout["buffers"] = {k: (tuple(v.shape), v.dtype) for k, v in buffers_of(model).items()}
        for name in ("params", "buffers"):
            tree, want = getattr(state, name), layout[name]
            if not isinstance(tree, dict) or set(tree) != set(want):
                got = set(tree) if isinstance(tree, dict) else set()
                raise ValueError(f"{where}: state.{name} is not this model's: leaves only in the state "
                                 f"{sorted(got - set(want))[:5]}, only in the model {sorted(set(want) - got)[:5]} "
                                 "(a state from another model? build it with this step's init())")
            for k, (shape, dtype) in want.items():
                t = tree[k]
                if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype) != (shape, dtype):
                    got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"{where}: state.{name} leaf {k!r} is {got}, but this model and policy "
                                     f"give {shape} {dtype} (a state from another model or another policy?)")
        remember(state.params)

    def remember(params) -> None:
        matched[:] = matched[-1:] + [params]  # the last two: a pure step's input and output

    def step(state: TrainState, *batch) -> tuple[TrainState, StepOutput]:
        check_layout(state, "make_train_step")
        ls = state.loss_scale
        grads, new8, loss, new_buffers, aux = gradients(state, batch)
        mp = MixedPrecisionState(state.master, state.opt_state, ls, state.finite, state.skipped)
        # torch.func.grad gives every gradient its param's shape: no per-leaf shape check.
        params, mp = engine.step(optimized(state.params), optimized(grads), mp, where="make_train_step",
                                 trust_grads=True)
        if overwrite_with_gradient is not None:
            params = {k: params[k] if k in params else torch.where(mp.finite.to(v.device), grads[k].to(v.dtype), v)
                      for k, v in state.params.items()}
        new_buffers = _kept_on_skip(mp.finite, new_buffers, state.buffers)
        new_state = TrainState(params, new_buffers, mp.inner, mp.loss_scale, mp.finite, mp.skipped,
                               new8 if fp8 is not None else None, mp.master)
        if not ops._is_compiling():
            remember(new_state.params)  # built by us from a matching state
        return new_state, StepOutput(loss, mp.finite, _scale_on(ls, mp.finite.device), aux if has_aux else None)

    def step_(state: TrainState, *batch) -> tuple[TrainState, StepOutput]:
        check_layout(state, "make_train_step.step_")
        ls = state.loss_scale
        # The scale this step's loss used, kept apart: the in-place scale update overwrites it.
        # Not `.clone()`: inductor (torch 2.13) drops a clone of a graph input as a no-op and then
        # lets a custom op that mutates the input (the scale update) write it in place, so the
        # "copy" would read the updated scale (the remove_noop_ops bugs pytorch/pytorch#198131 and
        # #198031); a stack is a real copy.
        # (A state built with the old four fields has no `finite` yet: the params' device.)
        device = state.finite.device if state.finite is not None else _first_device(state.params)
        used_scale = torch.stack([_scale_on(ls, device)])[0]
        grads, new8, loss, new_buffers, aux = gradients(state, batch)
        mp = MixedPrecisionState(state.master, state.opt_state, ls, state.finite, state.skipped)
        # Validates everything before its first write; the writes below come after it.
        _, mp = engine.step_(optimized(state.params), optimized(grads), mp, where="make_train_step.step_",
                             trust_grads=True)
        with torch.no_grad():
            if overwrite_with_gradient is not None:
                for k, v in state.params.items():
                    if overwritten(k):
                        v.copy_(torch.where(mp.finite.to(v.device), grads[k].to(v.dtype), v))
            _copy_leaves(state.buffers, _kept_on_skip(mp.finite, new_buffers, state.buffers))
            if fp8 is not None:
                _copy_leaves(state.fp8, new8)
        new_state = state if (mp.finite is state.finite and mp.skipped is state.skipped) else \
            state._replace(finite=mp.finite, skipped=mp.skipped)
        # A copy of the flag: the state's tensor is overwritten by the next step.
        return new_state, StepOutput(loss, mp.finite.clone(), used_scale, aux if has_aux else None)

    step._inplace = step_
    return TrainStep(init, step)


def _first_device(params: PyTree) -> torch.device:
    """The device of the first tensor leaf of ``params`` (the CPU when there is none)."""
    leaf = next((t for t in tree_leaves(params) if isinstance(t, torch.Tensor)), None)
    return leaf.device if leaf is not None else torch.device("cpu")


def _scale_on(ls: LossScale, device) -> torch.Tensor:
    """The 0-d scale a step's loss was multiplied by, on the step's device: a no-op scale's 1.0
    is made there (its ``loss_scale`` is a CPU tensor), so every ``StepOutput`` field sits
    beside the params."""
    return torch.ones((), dtype=torch.float32, device=device) if isinstance(ls, NoOpLossScale) else ls.loss_scale


def _kept_on_skip(finite: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where the step was applied, ``old`` where it was skipped, per tensor leaf (decided
    on the device; the buffers' dtypes are the forward's, so no promotion). Not
    :func:`ampfunc.tree.select_tree`: its path-naming checks do not trace under
    ``torch.compile(fullgraph=True)``, which compiles this step whole."""
    return tree_map(lambda n, o: torch.where(finite.to(n.device), n, o) if isinstance(n, torch.Tensor) else n,
                    new, old)


def _copy_leaves(dst: PyTree, src: PyTree) -> None:
    for d, s in zip(tree_leaves(dst), tree_leaves(src)):
        if isinstance(d, torch.Tensor) and d is not s:
            d.copy_(s)


def copy_to_module(model: torch.nn.Module, params: PyTree, buffers: PyTree | None = None) -> None:
    """Writes ``params`` (and ``buffers``) into ``model``'s tensors in place, by path.

    For evaluating or saving a model trained functionally. Each value is cast to the module
    tensor's dtype. Unknown paths raise ``KeyError`` and mismatched shapes ``ValueError``,
    naming them, before anything is written.

    Args:
      model: the ``nn.Module`` to write.
      params: tensors by dotted path (``{"0.weight": tensor, ...}``; e.g. ``state.params`` of
        a :class:`TrainState`).
      buffers: buffers by dotted path (``state.buffers``), or ``None``.

    Returns:
      ``None``; ``model``'s parameters and buffers now hold the values.

    Example:
      >>> model = nn.Linear(4, 2)
      >>> af.functional.copy_to_module(model, af.tree.tree_map(torch.zeros_like, af.params_of(model)))
      >>> bool((model.weight == 0).all())
      True

    Cost: one copy per tensor (with a cast where the dtypes differ); no host sync when the
    values are on the model's device.
    """
    targets = dict(model.named_parameters())
    targets.update(model.named_buffers())
    items = list(leaves_with_paths(params)) + (list(leaves_with_paths(buffers)) if buffers is not None else [])
    unknown = [p for p, _ in items if p not in targets]
    if unknown:
        raise KeyError(f"copy_to_module: the model has no parameter or buffer named {unknown[:5]}")
    for path, value in items:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"copy_to_module: {path!r} is a {type(value).__name__}, not a tensor")
        if tuple(value.shape) != tuple(targets[path].shape):
            raise ValueError(f"copy_to_module: {path!r} has shape {tuple(value.shape)}, the model's is "
                             f"{tuple(targets[path].shape)}")
    with torch.no_grad():
        for path, value in items:
            targets[path].copy_(value)


# torch.load(weights_only=True) (the default) accepts train states.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([TrainState])
