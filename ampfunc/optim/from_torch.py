"""Any ``torch.optim`` optimizer as a pure transform whose state is a pytree of tensors.

``from_torch(torch.optim.RMSprop, lr=1e-3, momentum=0.9)`` gives a
:class:`~ampfunc.transform.GradientTransformation`. Its ``update`` builds a throwaway optimizer
over detached clones of the params, loads the state into it, runs the optimizer's own ``step``
and hands back ``new - old`` deltas and the new state. So the arithmetic is torch's own, on the
params' device, with torch's default implementation (foreach on CUDA, single-tensor on CPU);
the inputs are never mutated.

Torch creates an optimizer's per-parameter state lazily. ``init`` discovers it by running the
optimizer's lazy initialization (``_init_group``) on throwaway copies, so the state has its
final structure from the start (what ``skip_or_apply`` and ``torch.save`` need). A few entries
only appear *inside* the first ``step`` (SGD's ``momentum_buffer``, which torch starts as a
copy of the first gradient). Those are kept apart in ``step_state``: every update then runs the
optimizer twice, once as a first step and once with them loaded, and picks the result on the
device from ``count`` -- exact, with no host sync, at twice the cost. Only SGD with momentum
(among the built-in optimizers) pays it; prefer the native :func:`ampfunc.sgd` there.

Cost: a clone of params, grads and state per update plus the torch step itself (torch's
non-capturable optimizers read their CPU ``step`` counters on the host, as they always do;
pass ``capturable=True`` where torch offers it to keep everything on the device).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from ampfunc.optim.base import checked_inputs, step_device, warn_low_precision_params
from ampfunc.transform import GradientTransformation
from ampfunc.tree import float_leaves_with_paths, leaves_with_paths, tree_structure, tree_unflatten

__all__ = ["TorchOptimizerState", "from_torch"]

# Optimizers whose step cannot be expressed as "gradients in, new params out".
_REFUSED = {
    "LBFGS": "it re-evaluates the loss through a closure inside step(); a pure transform only sees "
             "gradients. Run torch.optim.LBFGS directly on a module instead",
    "SparseAdam": "it requires sparse gradients; pytrees of dense gradients are what transforms see. "
                  "Use from_torch(torch.optim.Adam) or ampfunc.adam",
}


class TorchOptimizerState(NamedTuple):
    """The state of :func:`from_torch`: torch's per-parameter state as pytrees of tensors.

    Attributes:
      count: 0-d int32 tensor on the params' device, the number of applied steps.
      state: dict state-key -> pytree like the params (``None`` where a param has no such
        entry): torch's per-parameter state as its lazy initialization creates it (e.g. Adam's
        ``step``, ``exp_avg``, ``exp_avg_sq``).
      step_state: the same for the entries torch creates only inside its first step (SGD's
        ``momentum_buffer``); they are handed to torch only once ``count > 0``.

    Example:
      >>> state = af.from_torch(torch.optim.Adam, lr=1e-3).init({"w": torch.ones(2, 3)})
      >>> sorted(state.state), state.step_state, state.count.item()
      (['exp_avg', 'exp_avg_sq', 'step'], {}, 0)
      >>> sorted(af.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9).init({"w": torch.ones(3)}).step_state)
      ['momentum_buffer']
    """

    count: torch.Tensor
    state: dict
    step_state: dict


def _lazy_init(opt: torch.optim.Optimizer) -> bool:
    """Runs ``opt``'s lazy state initialization without stepping; False if it has none we can call.

    Every built-in ``_init_group(group, *lists)`` appends to the lists it is given and fills
    ``opt.state`` for the params that have a ``.grad``.
    """
    init_group = getattr(opt, "_init_group", None)
    if init_group is None:
        return False
    try:
        n_lists = len(inspect.signature(init_group).parameters) - 1  # after `group`
        for group in opt.param_groups:
            init_group(group, *[[] for _ in range(n_lists)])
    except (TypeError, ValueError, KeyError):
        return False
    return True


def _tensor_state(entry: dict, cls_name: str) -> dict:
    for k, v in entry.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"from_torch({cls_name}): state entry {k!r} is {type(v).__name__}, not a tensor; "
                            f"only optimizers whose state is all tensors can be made pure")
    return entry


def from_torch(optimizer_cls: type, **hparams: Any) -> GradientTransformation:
    """A pure transform running ``optimizer_cls(params, **hparams).step()``.

    Works for every ``torch.optim`` optimizer that steps from gradients alone (SGD, Adam, AdamW,
    RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop, Adafactor, ...) and for
    user subclasses of ``torch.optim.Optimizer`` that keep tensor state. ``LBFGS`` (closure
    based) and ``SparseAdam`` are refused. Hyper-parameters are checked by constructing the
    optimizer once, so a bad one gives torch's own error. ``update`` needs ``params``; it runs
    torch's own ``step`` on detached clones and returns the deltas ``new_p - p`` (in fp32, or
    fp64 for fp64 params), never mutating its inputs.

    The params form one parameter group; use :func:`ampfunc.partition` for several. ``lr``
    must be a number (a schedule is a native-optimizer feature: :func:`ampfunc.sgd`,
    :func:`ampfunc.adam`, :func:`ampfunc.adamw`).

    Args:
      optimizer_cls: a ``torch.optim.Optimizer`` subclass, e.g. ``torch.optim.RMSprop``.
      **hparams: the optimizer's keyword arguments (``lr`` a number), passed as they are.

    Returns:
      A ``GradientTransformation`` whose state is a :class:`TorchOptimizerState`. ``update``
      given a state made by another optimizer or configuration (RMSprop's state to Adagrad,
      Adam's to ``Adam(amsgrad=True)``) raises ``ValueError`` naming the missing state key and
      the param's path, before anything is written.

    Example:
      >>> params = {"w": torch.ones(2, 3)}
      >>> grads = {"w": torch.full((2, 3), 0.5)}
      >>> tx = af.from_torch(torch.optim.RMSprop, lr=1e-2)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = af.apply_updates(params, updates)
      >>> state.count.item(), sorted(state.state)
      (1, ['square_avg', 'step'])

    Cost: construction builds one probe optimizer on a small CPU tensor. ``init`` clones the
    params, runs torch's lazy initialization and one throwaway step on the clones, and allocates
    the state like torch's (plus zeros for ``step_state``). ``update`` clones the params, grads
    and state, runs torch's ``step`` (its default implementation: foreach on CUDA,
    single-tensor on CPU) and writes the deltas; with entries in ``step_state`` (SGD with
    momentum, or a subclass without ``_init_group``, whose whole state goes there) it runs the
    step twice and picks on the device, at twice the cost. No host sync of its own; torch's
    non-capturable optimizers read their CPU ``step`` counters on the host as they always do
    (pass ``capturable=True`` where torch offers it).
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"from_torch: expected a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
                        f"got {optimizer_cls!r}")
    name = optimizer_cls.__name__
    for refused, why in _REFUSED.items():
        cls = getattr(torch.optim, refused, None)
        if cls is not None and issubclass(optimizer_cls, cls):
            raise TypeError(f"from_torch cannot make torch.optim.{refused} pure: {why}")
    if callable(hparams.get("lr")) and not isinstance(hparams.get("lr"), torch.Tensor):
        raise TypeError(f"from_torch({name}): lr must be a number; schedules are supported by the native "
                        f"optimizers (ampfunc.sgd/adam/adamw) or via chain(from_torch(..., lr=1.0), "
                        f"scale_by_schedule(...)) for optimizers linear in lr")
    # Torch validates its own hyper-parameters (unknown names: TypeError; bad values: ValueError).
    # A RuntimeError here is about the CPU probe (e.g. fused=True for a CUDA-only kernel); the
    # real params meet the same check in init.
    try:
        optimizer_cls([torch.zeros(2, 3)], **hparams)
    except RuntimeError:
        pass

    def make(params_list):
        return optimizer_cls(params_list, **hparams)

    made_by = f"{name}({', '.join(f'{k}={v!r}' for k, v in hparams.items())})"
    foreign = (f"the state was made by a different optimizer or configuration than {made_by}; "
               f"build it with this transform's init (or convert it yourself)")

    def init(params):
        _, leaves = float_leaves_with_paths(params, "params")
        warn_low_precision_params(params, f"from_torch({name})")
        clones = [p.detach().clone() for p in leaves]
        for c in clones:
            c.grad = torch.zeros_like(c)
        opt = make(clones)
        lazy = {}
        if _lazy_init(opt):
            lazy = {i: {k: v.detach().clone() for k, v in _tensor_state(dict(opt.state[c]), name).items()}
                    for i, c in enumerate(clones)}
        # A throwaway step reveals the entries created inside step (their values are not kept).
        opt.step()
        after = [_tensor_state(dict(opt.state[c]), name) for c in clones]
        state_keys = sorted({k for entry in lazy.values() for k in entry})
        step_keys = sorted({k for entry in after for k in entry} - set(state_keys))
        spec = tree_structure(params)
        state = {k: tree_unflatten(spec, [lazy.get(i, {}).get(k) for i in range(len(clones))]) for k in state_keys}
        step_state = {k: tree_unflatten(spec, [torch.zeros_like(e[k]) if k in e else None for e in after])
                      for k in step_keys}
        count = torch.zeros((), dtype=torch.int32, device=step_device(params))
        return TorchOptimizerState(count, state, step_state)

    def _entries(slots: dict, spec, where: str) -> dict:
        out = {}
        for k, tree in slots.items():
            try:
                out[k] = spec.flatten_up_to(tree)
            except (ValueError, TypeError) as e:
                raise ValueError(f"from_torch({name}): {where}[{k!r}] does not have the structure of the "
                                 f"params: {e}") from None
        return out

    def _run(ps, gs, loaded: list[dict], path_of):
        clones = [p.detach().clone() for p in ps]
        opt = make(clones)
        for c, g, entry in zip(clones, gs, loaded):
            c.grad = g.detach().to(c.dtype, copy=True)
            opt.state[c] = {k: v.clone() for k, v in entry.items()}
        try:
            opt.step()
        except KeyError as e:
            # torch reads the entries it expects without a check: a bare KeyError('sum').
            key = e.args[0] if len(e.args) == 1 else None
            lacking = [i for i, entry in enumerate(loaded) if key not in entry]
            if not isinstance(key, str) or not lacking:
                raise
            raise ValueError(f"from_torch({name}): the state for {path_of(lacking[0])!r} has no {key!r} entry, "
                             f"which torch.optim's {name} step reads (it has {sorted(loaded[lacking[0]])}): "
                             f"{foreign}") from None
        return clones, [dict(opt.state[c]) for c in clones]

    def update(grads, state, params=None):
        if not isinstance(state, TorchOptimizerState):
            raise TypeError(f"from_torch({name}): state is {type(state).__name__}, expected TorchOptimizerState")
        if params is None:
            raise ValueError(f"from_torch({name}): update needs params; call update(grads, state, params)")
        gs, ps = checked_inputs(grads, params, None, "", f"from_torch({name})")
        spec = tree_structure(params)
        st = _entries(state.state, spec, "state.state")
        sst = _entries(state.step_state, spec, "state.step_state")
        n = len(ps)
        base = [{k: v[i] for k, v in st.items() if v[i] is not None} for i in range(n)]
        full = [{**base[i], **{k: v[i] for k, v in sst.items() if v[i] is not None}} for i in range(n)]
        path_of = lambda i: leaves_with_paths(params)[i][0]  # noqa: E731 - for error messages only
        new_ps, new_entries = _run(ps, gs, full, path_of)
        if sst:
            # The first step must run without the in-step entries (torch creates them there);
            # which run is right is decided on the device from the count.
            first_ps, first_entries = _run(ps, gs, base, path_of)
            started = state.count > 0
            pick = lambda a, b: torch.where(started.to(a.device), a, b)  # noqa: E731
            new_ps = [pick(a, b) for a, b in zip(new_ps, first_ps)]
            new_entries = [{k: pick(e[k], f[k]) if k in f else e[k] for k in e}
                           for e, f in zip(new_entries, first_entries)]
        for i, (old, e) in enumerate(zip(full, new_entries)):
            if set(e) != set(old):
                # e.g. RMSprop's state given to SGD(momentum=0.9): torch's step adds momentum_buffer.
                raise ValueError(f"from_torch({name}): torch's state for {path_of(i)!r} changed keys from "
                                 f"{sorted(old)} to {sorted(e)} in the step; the state structure must stay "
                                 f"fixed: {foreign}")
        deltas = []
        for p, new in zip(ps, new_ps):
            wide = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
            deltas.append(new.to(wide) - p.to(wide))
        gspec = tree_structure(grads)
        unflat = lambda keys: {k: tree_unflatten(spec, [e.get(k) for e in new_entries]) for k in keys}  # noqa: E731
        new_state = TorchOptimizerState(state.count + 1, unflat(state.state), unflat(state.step_state))
        return tree_unflatten(gspec, deltas), new_state

    return GradientTransformation(init, update)
