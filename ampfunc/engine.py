"""ONE mixed-precision step, behind every front-end.

``mixed_precision(...).update/.step/.step_``, ``make_train_step`` (eager and compiled),
``ModuleTrainer.step()`` and the facades' master weights all run :class:`Engine`:

1. check: one read-only pass over the gradients of the scaled loss gives the 0-d ``finite``
   flag (all ranks agree with ``group``);
2. inner update: the optimizer transform on fp32 gradients, against the fp32 master params
   (kept in the state when a param is fp16/bf16) or the params themselves;
3. apply: params + updates, the low-precision params re-cast from the master;
4. skip on the device: when ``finite`` is False nothing changes (no host sync);
5. scale update: the loss scale for the next loss, and the step's ``finite`` flag and the
   running count of skipped steps, both 0-d tensors in the state.

Two plans give the same numbers through the same API. The *fused* plan
(:class:`ampfunc.fused.FusedPlan`) serves an inner transform registered with the kernels
(``sgd``/``adam``/``adamw``, optionally after ``clip_by_global_norm``) when the trees allow it
(fp32 master or params, one device, kernel dtypes): one check pass and one optimizer pass,
in place for ``step_`` or into new tensors for ``step``. The *generic* plan runs any transform
through the pure primitives. Validation happens in :func:`validate_step` (and
:func:`check_no_overlap` for the in-place paths), always before the first write.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable, NamedTuple, Optional

import torch

from ampfunc import ops
from ampfunc.dist import agree_finite, any_dtensor
from ampfunc.flat import copy_packed
from ampfunc.fused import KERNEL_GRAD_DTYPES, FusedPlan, fp32_twin, plan_for
from ampfunc.loss_scale import DynamicLossScale, LossScale
from ampfunc.lowmem import (
    MOMENT_FIELDS,
    Q8Moment,
    SplitMaster,
    check_master,
    check_moment,
    init_split_master,
    join_master,
    lowmem_step,
)
from ampfunc.shards import active as active_sharding
from ampfunc.shards import local_view
from ampfunc.transform import GradientTransformation, apply_updates
from ampfunc.tree import (
    PyTree,
    aligned_leaves,
    arithmetic_dtype,
    check_dense,
    check_same_structure,
    dict_values_aligned,
    float_leaves_with_paths,
    leaves_with_paths,
    plain_tensors,
    register_state_classes,
    same_objects,
    select_tree,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

__all__ = ["MixedPrecisionState", "Engine", "validate_step", "check_no_overlap", "skip_stats"]

# Whether the ops validate every call before writing (shapes across lists, overlapping or
# aliased written tensors, meta/foreign devices, dtypes) and name the list and index at fault
# (``ops.error_items`` parses their messages). Then the fused path leaves those checks to them
# and names the leaf paths on the error path only.
KERNELS_VALIDATE = hasattr(ops, "error_items")
_MODEL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")
_shape_of = operator.attrgetter("shape")


class MixedPrecisionState(NamedTuple):
    """The state of a mixed-precision step (a pytree of tensors; ``torch.save``-able).

    Made by ``mixed_precision(...).init(params)``. Read ``finite`` and ``skipped`` without a
    host sync as tensors (``af.monitor.record``), or with ``bool(state.finite)`` /
    ``int(state.skipped)`` when a sync is fine (logging every N steps).

    Attributes:
      master: a copy of the params in the master dtype when some param is narrower (fp16 /
        bf16 params with fp32 masters), else ``None``.
      inner: the inner optimizer's state.
      loss_scale: the loss scale for the next loss (:func:`ampfunc.loss_scale_of`).
      finite: 0-d bool tensor, whether the last step's gradients were finite (so the step was
        applied); ``True`` before the first step.
      skipped: 0-d int64 tensor, how many steps were skipped so far.

    Example:
      >>> tx = af.mixed_precision(af.sgd(0.1), af.StaticLossScale(8.0))
      >>> state = tx.init({"w": torch.ones(2)})
      >>> state.master is None  # fp32 params need no master copy
      True
      >>> bool(state.finite), int(state.skipped)
      (True, 0)
    """

    master: Any
    inner: Any
    loss_scale: LossScale
    finite: Optional[torch.Tensor] = None
    skipped: Optional[torch.Tensor] = None


register_state_classes(MixedPrecisionState)


def skip_stats(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The initial ``(finite, skipped)`` pair: 0-d ``True`` and 0-d int64 ``0`` on ``device``."""
    return torch.ones((), dtype=torch.bool, device=device), torch.zeros((), dtype=torch.int64, device=device)


def _next_stats(finite: torch.Tensor, prev_finite, prev_skipped, device):
    """``(finite, skipped + (not finite))`` as new tensors on ``device``."""
    f = finite.to(device)
    skipped = prev_skipped if prev_skipped is not None else torch.zeros((), dtype=torch.int64, device=device)
    return f, skipped + (~f).to(torch.int64)


# ----------------------------------------------------------------------------------------------
# Validation: one place, before the first write
# ----------------------------------------------------------------------------------------------


def _compiling() -> bool:
    return ops._is_compiling()


def _refuse_vmap(where: str) -> None:
    """``ValueError`` when the step is called under ``torch.vmap``, before any write. The fused
    ops have no batching rule (vmap would fail deep inside with "Batching rule not implemented
    for ampfunc::check"), and a step's skip decision, clipping norm and q8 blocks are per tree,
    not per vmapped member. Cost: nothing unless a torch.func transform is active; not looked at
    inside a torch.compile trace (dynamo does not trace the interpreter stack)."""
    if _compiling() or not ops._transforms_active():
        return
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    if any(i.key() == torch._C._functorch.TransformType.Vmap for i in retrieve_all_functorch_interpreters()):
        raise ValueError(f"{where}: called under torch.vmap, which a mixed-precision step does not compose with: "
                         "its fused ops have no batching rule, and its skip decision, clipping norm and q8 moment "
                         "blocks are one per tree, not one per vmapped member. vmap the gradients "
                         "(af.value_and_grad composes with it) and step outside it: per member in a loop, or "
                         "the stacked params as one tree (one skip flag for all members)")


_GETTERS = {"dtype": _dtype_of, "device": _device_of, "shape": _shape_of, "floating": torch.is_floating_point,
            "layout": operator.attrgetter("layout")}


def _attrs(name: str, leaves: list) -> list:
    # map(attrgetter) runs at C speed on 10,000 leaves; dynamo cannot trace attrgetter, so a
    # torch.compile trace takes plain attribute reads.
    if _compiling():
        if name == "floating":
            return [t.dtype.is_floating_point for t in leaves]
        return [getattr(t, name) for t in leaves]
    return list(map(_GETTERS[name], leaves))


def _path(tree: PyTree, index: int) -> str:
    """The path of leaf ``index`` of ``tree`` (in the order the engine lined the leaves up)."""
    if type(tree) is dict and aligned_leaves([tree]) is not None:
        return str(list(tree)[index])
    return leaves_with_paths(tree)[index][0]


def validate_step(where: str, named: list, *, shapes: bool = True, param_shapes: Optional[list] = None,
                  dtypes: Optional[list] = None) -> list:
    """Raises a clear error when the leaf lists of one step cannot go together.

    ``named`` is ``[(tree_name, tree, leaves), ...]`` with the params first; every list must
    have the params' length (the structures were compared when they were flattened). Checks:
    every leaf is a floating tensor not on the ``meta`` device, and (``shapes``) every leaf has
    its param's shape. ``param_shapes`` / ``dtypes`` (one set per list) may be passed when the
    caller already has them. Errors name the tree and the leaf path. Returns the params' shapes.
    Cost: a dtype/device/shape look per leaf at C speed (``map``); no host sync.
    """
    p_name, p_tree, p_leaves = named[0]
    p_shapes = param_shapes if param_shapes is not None or not shapes else _attrs("shape", p_leaves)
    for k, (name, tree, leaves) in enumerate(named):
        kinds = dtypes[k] if dtypes is not None and dtypes[k] is not None else None
        if kinds is None:
            if not all(issubclass(t, torch.Tensor) for t in (set(map(type, leaves)) if not _compiling() else ())):
                float_leaves_with_paths(tree, f"{where}: {name}")  # raises, naming the leaf
            kinds = set(_attrs("dtype", leaves))
        if not all(d.is_floating_point for d in kinds):
            float_leaves_with_paths(tree, f"{where}: {name}")  # raises, naming the leaf and its dtype
        if set(_attrs("layout", leaves)) - {torch.strided}:
            float_leaves_with_paths(tree, f"{where}: {name}")  # raises on the sparse leaf, naming it
        devices = set(_attrs("device", leaves))
        if any(d.type == "meta" for d in devices):
            i = next(i for i, t in enumerate(leaves) if t.device.type == "meta")
            raise ValueError(f"{where}: {name} leaf {_path(tree, i)!r} is on the meta device (no data); "
                             "materialize it first (e.g. module.to_empty(device=...) and initialize)")
        if shapes and leaves is not p_leaves:
            s = _attrs("shape", leaves)
            if s != p_shapes:
                i = next(i for i, (a, b) in enumerate(zip(s, p_shapes)) if a != b)
                raise ValueError(f"{where}: leaf {_path(p_tree, i)!r} has shape {tuple(s[i])} in {name} but "
                                 f"{tuple(p_shapes[i])} in {p_name}")
    return p_shapes


def check_no_overlap(where: str, named: list) -> None:
    """Refuses written tensors that share memory, before anything is written.

    ``named`` is ``[(tree_name, tree, leaves), ...]``: every tensor an in-place step writes.
    A leaf that overlaps itself (``expand()``, stride 0) or two leaves whose memory overlaps
    (the same tensor twice, overlapping views) raise ``ValueError`` naming the leaf path(s):
    the kernels would write that memory twice. So does an inference tensor outside inference
    mode (torch refuses to update one in place, after the leaves before it were written).
    Cost: a few attribute reads per leaf and one sort; the engine runs it once per set of
    tensors (cached by identity), not per step.
    """
    written = []
    inference_ok = torch.is_inference_mode_enabled()
    for name, tree, leaves in named:
        for i, t in enumerate(leaves):
            if t.is_inference() and not inference_ok:
                raise ValueError(f"{where}: {name} leaf {_path(tree, i)!r} is an inference tensor (made under "
                                 "torch.inference_mode()), which cannot be updated in place outside inference mode "
                                 "-- pass a copy made outside it (.clone())")
            if t.numel() == 0:
                continue
            if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())) or (
                    not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1):
                raise ValueError(f"{where}: {name} leaf {_path(tree, i)!r} overlaps itself (an expand()ed or "
                                 "stride-0 view); an in-place step would write its memory more than once -- "
                                 "pass a contiguous copy (.contiguous() / .clone())")
            written.append((name, tree, i, t))
    pair = ops.overlapping_pair([t for *_, t in written])
    if pair is not None:
        (a_name, a_tree, a_i, a), (b_name, b_tree, b_i, b) = written[pair[0]], written[pair[1]]
        same = a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        what = "are the same tensor" if same else "share memory (overlapping views)"
        raise ValueError(f"{where}: {a_name} leaf {_path(a_tree, a_i)!r} and {b_name} leaf {_path(b_tree, b_i)!r} "
                         f"{what}; an in-place step would update that memory twice -- pass separate tensors")


_KERNEL_ITEM = re.compile(r"\b([a-z_]+)\[(\d+)\]")


def _blame(err: Exception, where: str, lists: dict) -> Exception:
    """A kernel's error ("ampfunc: grads[2] has shape ...") as the same exception type with the
    leaf paths and tree names ("grads leaf 'enc.w' has shape ..."); runs on the error path only.
    A sparse leaf is named first: a compressed layout (CSR, ...) fails in torch naming none."""
    try:
        for tree_name, tree in lists.values():
            check_dense(tree, f"{where}: {tree_name}")
    except TypeError as sparse:
        return sparse
    msg = str(err)
    if msg.startswith("ampfunc: "):
        msg = msg[len("ampfunc: "):]

    def name(m):
        entry = lists.get(m.group(1))
        if entry is None:
            return m.group(0)
        tree_name, tree = entry
        try:
            return f"{tree_name} leaf {_path(tree, int(m.group(2)))!r}"
        except (IndexError, ValueError, TypeError):
            return m.group(0)

    return type(err)(f"{where}: " + _KERNEL_ITEM.sub(name, msg))


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------


class _Lined(NamedTuple):
    """One step's leaves, lined up across the trees, and how to rebuild trees from new leaves."""

    p: list
    g: list
    m: Optional[list]
    slots: list
    rebuild: Callable  # (tree index: 0 params, 1 master, 2 + k slot tree k, new leaves) -> tree
    keys: Optional[list] = None  # the params' keys when the leaves are in dict order, else optree's order


class _Seen(NamedTuple):
    """What :meth:`Engine._prepare` checked last, for the lists it checked (held strongly, compared
    by identity): the params/master/state leaf lists, the other tensors an in-place step writes
    (None: not checked for overlaps), whether the kernels can run them, the params' shapes
    (None: not read), whether the inner state had the kernels' layout, and its step's device."""

    lists: list
    extra: Optional[list]
    state_ok: bool
    p_shapes: Optional[list]
    had_opt: bool
    dev: Any


class _Prep(NamedTuple):
    lined: _Lined
    opt: Any  # the optimizer's state when the fused plan runs this step, else None
    named: list
    deferred: bool  # the gradients' dtypes are left to the kernels (see Engine._refused_for_dtype)


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def _cloned(tree):
    return None if tree is None else tree_map(_clone, tree)


class Engine:
    """The mixed-precision step, written once: ``init``, ``step`` (pure), ``step_`` (in place).

    Args:
      inner: the optimizer transform (any ``GradientTransformation``).
      master_dtype: the dtype of the master copy kept for params narrower than it (fp16/bf16
        params get fp32 masters; a wider param, e.g. fp64, keeps its own dtype: a master is
        never narrower than its param). ``None``: never keep a master; the inner transform runs
        on the params as they are (``make_train_step`` stores params in the policy's dtype).
      group: a ``torch.distributed`` process group whose ranks must agree on skipping.
      where: the name errors start with.

    The fused plan is chosen once from the kernel registry (:func:`ampfunc.fused.plan_for`)
    and used on every step whose trees allow it; the generic plan otherwise. Both take the same
    arithmetic; they part by an ulp where the generic plan's ``p + (new - p)`` rounds (it
    applies the inner transform's updates, the kernels write the new value), and, with clipping
    and a loss scale that is not a power of two, where the kernels' single
    ``inv_scale * clip_coef`` product differs from the generic path's two.

    ``engine.on_check``, when set, is called on every eager step after the check pass with
    ``(finite, leaf_nonfinite, leaf_paths)``: this rank's 0-d bool flag, a 1-d bool tensor with
    one entry per gradient leaf (True where it holds an inf/NaN), and a function returning the
    leaf paths in that order. The tensors stay on the device (no host sync); on the fused path
    the per-leaf flags come from the same read-only pass, on the generic path from one extra
    read of the gradients. Not called inside a ``torch.compile`` trace.

    Example::

        engine = Engine(af.adamw(1e-3))
        state = engine.init(params, af.DynamicLossScale())
        params, state = engine.step_(params, grads, state)
    """

    def __init__(self, inner: GradientTransformation, *, master_dtype: Optional[torch.dtype] = torch.float32,
                 group=None, where: str = "mixed_precision", master: str = "fp32"):
        if not isinstance(inner, GradientTransformation):
            raise TypeError(f"{where}: inner must be a GradientTransformation, got {type(inner).__name__}")
        if master_dtype is not None and not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
            raise ValueError(f"{where}: master_dtype must be a floating dtype, got {master_dtype!r}")
        check_master(master, where)
        if master == "split" and master_dtype not in (torch.float32, None):
            raise ValueError(f"{where}: master='split' keeps float32 masters (their low halves), got "
                             f"master_dtype={master_dtype}: use master_dtype=torch.float32 or master='fp32'")
        self.inner = inner
        self.master_dtype = master_dtype
        self.master = master
        self.group = group
        self.where = where
        self.plan: Optional[FusedPlan] = plan_for(inner)
        # The low-memory settings (ampfunc.lowmem): a split master, or a fused optimizer's moments
        # in bf16/q8. Their step rebuilds the fp32 numbers, runs them through `_core` (an engine
        # over the fp32 layout and the optimizer's fp32 twin: the fused kernels or the generic
        # path, as for master="fp32") and stores them back.
        self.moments = self.plan.hparams.get("moments", "fp32") if self.plan is not None else "fp32"
        self.lowmem = master == "split" or self.moments != "fp32"
        self._core: Optional[Engine] = None
        if self.lowmem:
            core_inner = fp32_twin(self.plan) if self.moments != "fp32" else inner
            self._core = Engine(core_inner, master_dtype=None if master == "split" else master_dtype, group=group,
                                where=where)
        # Monitoring hook: on_check(finite, leaf_nonfinite, leaf_paths), see the class docstring.
        self.on_check: Optional[Callable] = None
        # What was validated last (the lists themselves, compared by identity), so the tensors
        # that come back every step (in place: the same ones; pure: the last outputs) are
        # looked at once.
        self._seen: Optional[_Seen] = None
        # The low-memory settings' counterpart: every tensor of the params and the state of the
        # last in-place step that passed the checks and ran the kernel pass.
        self._lowmem_seen: Optional[list] = None
        # (the _Seen they belong to, ops.held_lists of its lists): what the in-place fused step
        # lets the kernels' door keep described between calls.
        self._held: Optional[tuple] = None

    # -- init --------------------------------------------------------------------------------

    def master_dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        """The master dtype of a param of ``dtype``: never narrower than the param."""
        if self.master_dtype is None or dtype.itemsize > self.master_dtype.itemsize:
            return dtype
        return self.master_dtype

    def init(self, params: PyTree, loss_scale: LossScale) -> MixedPrecisionState:
        """The initial :class:`MixedPrecisionState` for ``params`` (any float dtypes).

        Cost: one copy of the params when a master is needed, plus the inner state.
        """
        view = local_view(params, where=f"{self.where}.init")
        if view is not None:
            # DTensor params: the state is made per rank on the local shards, as plain tensors
            # (ampfunc.shards); the steps unwrap the params the same way.
            params = view.params
        paths, leaves = float_leaves_with_paths(params, f"{self.where}.init: params")
        for path, leaf in zip(paths, leaves):
            if leaf.device.type == "meta":
                raise ValueError(f"{self.where}.init: params leaf {path!r} is on the meta device (no data)")
        master = None
        if self.master == "split":
            # bf16 params are their masters' high halves; the state keeps the low halves.
            master = init_split_master(params, f"{self.where}.init")
            ref = join_master(params, master)
        elif any(t.dtype != self.master_dtype_for(t.dtype) for t in leaves):
            # One buffer per (device, dtype): the step reads and writes the masters as one stream.
            master = ref = copy_packed(params, self.master_dtype_for)
        else:
            ref = params
        device = leaves[0].device if leaves else torch.device("cpu")
        inner_state = self.inner.init(ref)
        # The state's own copy of the scale's tensors (`.to` hands back the given ones on the
        # same device): step_ writes them, and neither the caller's scale object nor a second
        # state from init may change with it.
        return MixedPrecisionState(master, inner_state, _cloned(loss_scale.to(device)), *skip_stats(device))

    # -- lining the leaves up ----------------------------------------------------------------

    def _check_state(self, state, where):
        if not isinstance(state, MixedPrecisionState):
            raise TypeError(f"{where}: state must be the MixedPrecisionState from init, got {type(state).__name__}")
        if not isinstance(state.loss_scale, LossScale):
            raise TypeError(f"{where}: state.loss_scale must be a loss scale, got {type(state.loss_scale).__name__}")
        if isinstance(state.master, SplitMaster) and self.master != "split":
            raise ValueError(f"{where}: the state's master is a SplitMaster (made with master='split') but this step "
                             f"keeps master={self.master!r}: a state from another setting -- call init again")

    def _line_up(self, params, grads, master, slot_trees, slot_names, where, known=None) -> tuple:
        """``(lined, hit)``: the leaves of every tree in one order -- the cheap dict-values order
        when every tree is a plain dict with the params' keys and tensor values, else optree's;
        structures compared on the way -- and whether the params/master/state lists are the very
        lists of ``known`` (then their leaves were checked before and are not looked at again;
        the gradients always are)."""
        masters = [master] if master is not None else []
        trees = [params, grads] + masters + slot_trees
        # The lists of the last check come back as themselves where the dicts still hold those
        # tensors (pointers compared, no reference taken on each): the identity test below is then
        # instant, and a 10,000-leaf step makes no new lists but the gradients'.
        aligned = [known[0], None, *known[1:]] if known is not None and len(known) == len(trees) - 1 else None
        leaves = dict_values_aligned(trees, aligned)
        if leaves is not None:
            stable = [leaves[0]] + leaves[2:]
            hit = known is not None and len(known) == len(stable) and all(map(same_objects, stable, known))
            if plain_tensors(leaves[1]) and (hit or all(map(plain_tensors, stable))):
                keys = list(params)

                def rebuild(_i, new):  # every tree has the keys of params, in that order
                    return dict(zip(keys, new))

                m = leaves[2] if masters else None
                return _Lined(leaves[0], leaves[1], m, leaves[2 + len(masters):], rebuild, keys), hit
        names = ["grads"] + (["state.master"] if masters else []) + list(slot_names)
        p, p_spec = tree_flatten(params)
        flat = []
        for name, tree in zip(names, trees[1:]):
            leaves_t, spec = tree_flatten(tree)
            if spec != p_spec:
                if isinstance(tree, Q8Moment):
                    check_moment(tree, params, "fp32", name, where)  # names the moments setting
                try:
                    check_same_structure(tree, params, name, "params")
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
            flat.append(leaves_t)
        m = flat[1] if masters else None
        slots = flat[1 + len(masters):]
        stable = [p] + flat[1:]
        hit = known is not None and len(known) == len(stable) and all(map(same_objects, stable, known))

        def rebuild(_i, new):  # every tree has the params' structure (compared above)
            return tree_unflatten(p_spec, new)

        return _Lined(p, flat[0], m, slots, rebuild), hit

    def _state_fusable(self, lined: _Lined, opt) -> bool:
        """Whether the kernels can run the params/master/state leaves: an fp32 reference (the
        master, or the params without one), model dtypes, one device, no DTensor. Looks at
        dtypes and devices, never at values. (The gradients must also be in the kernels'
        dtypes -- fp64 takes the generic path, so both paths give it the same numbers -- and
        on the optimizer's device: first leaf; the kernels refuse a stray one, naming it.)"""
        ref = lined.m if lined.m is not None else lined.p
        if not ref:
            return False
        dev = opt.step.device
        if set(_attrs("dtype", ref)) != {torch.float32}:
            return False
        if lined.m is not None and not set(_attrs("dtype", lined.p)) <= _MODEL_DTYPES:
            return False
        lists = [ref] + lined.slots + ([lined.p] if lined.m is not None else [])
        if any(set(_attrs("device", lst)) != {dev} for lst in lists):
            return False
        return _compiling() or not any_dtensor(ref)

    def _prepare(self, params, grads, state, where, *, trust_grads=False, inplace=False) -> "_Prep":
        """The leaves lined up, the fused plan's optimizer state (None: take the generic plan),
        the named leaf lists (for validation and blame), and whether the gradients' dtypes were
        left to the kernels (:meth:`_refused_for_dtype`).

        What depends only on the params/master/state tensors (their shapes, dtypes, devices, and
        for in-place steps that no two of them share memory) is checked once per set of tensors:
        by identity (:attr:`_seen`; an in-place step gets the same tensors back every step, a pure
        fused step records its outputs, which come back as the next step's inputs). The kernels
        validate every call themselves (:data:`KERNELS_VALIDATE`), so the gradients, new every
        step, are looked at only for their types and first device on the fused path: their
        dtypes (fp64 takes the generic path) are read only if a kernel refuses them, before
        anything is written. Without the kernels' validation, or on the generic path, the
        gradients are checked here every step (shapes unless ``trust_grads``: autograd
        guarantees them).
        """
        self._check_state(state, where)
        if inplace and not _compiling():  # (a trace's inputs are guarded; validate() is host code)
            state.loss_scale.check_writable(where)  # written after the params: checked before them
        opt = self.plan.opt_state(state.inner) if self.plan is not None else None
        slot_trees = self.plan.slot_trees(opt) if opt is not None else []
        slot_names = [f"state.inner.{n}" for n in self.plan.slot_names()] if opt is not None else []
        compiling = _compiling()
        seen = None if compiling else self._seen
        lined, hit = self._line_up(params, grads, state.master, slot_trees, slot_names, where,
                                   seen.lists if seen is not None else None)
        stable = [("params", params, lined.p)]
        if lined.m is not None:
            stable.append(("state.master", state.master, lined.m))
        stable += [(n, t, lst) for n, t, lst in zip(slot_names, slot_trees, lined.slots)]
        named = stable[:1] + [("grads", grads, lined.g)] + stable[1:]
        extra = None
        if inplace and not compiling:
            extra = [state.finite, state.skipped, opt.step if opt is not None else None, state.loss_scale]
            if opt is None:  # the generic in-place step writes every tensor of the inner state
                extra += tree_leaves(state.inner)
        dev = opt.step.device if opt is not None else None
        # Only the fused plan trusts the cache: its kernels validate every call (a `.data` swap
        # that aliases two params or changes a dtype is caught there), while the generic plan's
        # checks run here, every step.
        hit = hit and seen.state_ok and KERNELS_VALIDATE and seen.had_opt == (opt is not None) and seen.dev == dev and (
            extra is None or (seen.extra is not None and same_objects(extra, seen.extra)))
        if hit:
            state_ok, p_shapes = seen.state_ok, seen.p_shapes
        else:
            self._check_master(params, state, lined, where)
            if opt is not None:
                self._check_moments_setting(params, state, lined, opt, where)
            state_ok = opt is not None and self._state_fusable(lined, opt)
            p_shapes = None
            if not (state_ok and KERNELS_VALIDATE):
                p_shapes = validate_step(where, stable)
            elif lined.m is not None:
                # The kernels compare every list with the master (their reference list): a master
                # from another model would be reported against the gradients. Blame it here.
                p_shapes = validate_step(where, stable[:2])
            if extra is not None:
                self._check_written(state, opt, stable, where)
            if not compiling:
                # Strong references keep the identities meaningful (an object's id is reused only
                # after it is gone); the caller holds these tensors anyway.
                self._seen = _Seen([lst for _, _, lst in stable], extra, state_ok, p_shapes, opt is not None, dev)
        if lined.keys is None and not compiling and not plain_tensors(lined.g) and \
                not all(issubclass(t, torch.Tensor) for t in set(map(type, lined.g))):
            float_leaves_with_paths(grads, f"{where}: grads")  # raises, naming the leaf
        on_dev = state_ok and (not lined.g or lined.g[0].device == dev)
        # The first gradient's dtype routes the step; the others are left to the kernels when a
        # refusal can be retried on the generic path with nothing done twice (no hook has seen
        # this step's check, no collective ran): reading 10,000 dtypes costs ~1 ms a step.
        deferred = on_dev and KERNELS_VALIDATE and not compiling and self.group is None and \
            active_sharding() is None and self.on_check is None and \
            (not lined.g or lined.g[0].dtype in KERNEL_GRAD_DTYPES)
        fused = on_dev and (deferred or set(_attrs("dtype", lined.g)) <= KERNEL_GRAD_DTYPES)
        if not (fused and KERNELS_VALIDATE):
            p_shapes = self._validate_grads(where, named, trust_grads, p_shapes)
            if not compiling and self._seen is not None and self._seen.p_shapes is None:
                self._seen = self._seen._replace(p_shapes=p_shapes)
        return _Prep(lined, (opt if fused else None), named, deferred and fused)

    def _hold(self) -> None:
        """Holds the lists of :attr:`_seen` (params, master, state: the ones the in-place step
        passes every call) for the kernels' door, so that each call finds their tensors
        unchanged instead of describing them anew (:func:`ampfunc.ops.held_lists`); taken again
        when they change. Cost: a describe pass when the lists change, else nothing."""
        seen = self._seen
        if seen is None or _compiling() or (self._held is not None and self._held[0] is seen):
            return
        self._held = None  # lets the lists go first: the new object holds them
        self._held = (seen, ops.held_lists(seen.lists))

    def _check_master(self, params, state, lined, where) -> None:
        """The state's master weights must be the ones :meth:`init` makes for these params: a
        state made for other dtypes would train fp16 params with no master, or overwrite fp32
        params with a master rounded from fp16. ``ValueError`` naming a param at fault."""
        dtypes = _attrs("dtype", lined.p)
        needs = [i for i, d in enumerate(dtypes) if d != self.master_dtype_for(d)]
        if state.master is None and needs:
            i = needs[0]
            raise ValueError(f"{where}: params leaf {_path(params, i)!r} is {dtypes[i]} but the state holds no "
                             f"master weights (init makes a {self.master_dtype_for(dtypes[i])} master for it): the "
                             "state was made for other params -- call init with these params")
        if state.master is not None:
            if not needs:
                raise ValueError(f"{where}: the state holds master weights but no param needs one (params are "
                                 f"{sorted({str(d) for d in dtypes})}): the state was made for other params -- "
                                 "call init with these params")
            for i, (d, m) in enumerate(zip(dtypes, _attrs("dtype", lined.m))):
                if m != self.master_dtype_for(d):
                    raise ValueError(f"{where}: params leaf {_path(params, i)!r} is {d} but its master in the "
                                     f"state is {m} (init makes {self.master_dtype_for(d)}): the state was made for "
                                     "other params -- call init with these params")

    def _check_moments_setting(self, params, state, lined, opt, where) -> None:
        """A moment stored in 8 or 16 bits where its param computes wider is a state made with
        ``moments="bf16"`` or ``"q8"``: refused naming that setting (the kernels would name only
        a dtype). Looked at when the step's tensors change, not every step."""
        ref = lined.m if lined.m is not None else lined.p
        for name, slot in zip(self.plan.slot_names(), self.plan.slot_trees(opt)):
            if name not in MOMENT_FIELDS:
                continue
            leaves = tree_leaves(slot)
            if any(isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.uint8) and x.dtype != r.dtype
                   for x, r in zip(leaves, ref)):
                check_moment(slot, state.master if state.master is not None else params, "fp32",
                             f"state.inner.{name}", where)

    def _validate_grads(self, where, named, trust_grads, p_shapes) -> list:
        """The gradients against the params (types, dtypes, layout, device, shapes unless
        ``trust_grads``), naming the leaf: the generic path's check, every step. Returns the
        params' shapes."""
        return validate_step(where, [named[0], named[1]], shapes=not trust_grads, param_shapes=p_shapes,
                             dtypes=[set(), None])

    def _refused_for_dtype(self, prep: "_Prep") -> bool:
        """On a kernel's refusal: whether the gradients' dtypes (left to the kernels) send this
        step to the generic path, which then runs instead (nothing was written)."""
        return prep.deferred and not set(_attrs("dtype", prep.lined.g)) <= KERNEL_GRAD_DTYPES

    # -- the steps ---------------------------------------------------------------------------

    def step(self, params: PyTree, grads: PyTree, state: MixedPrecisionState, *, where: Optional[str] = None,
             trust_grads: bool = False):
        """One pure step: ``(new_params, new_state)``; nothing given is written.

        ``grads`` are the gradients of the scaled loss. Fused: one check pass and one
        out-of-place optimizer pass (new tensors; the tensors the kernel does not write are
        cloned: 0-d or empty in practice). Generic: the pure primitives. No host sync.
        """
        where = where or f"{self.where}.step"
        _refuse_vmap(where)
        view = local_view(params, grads, where=where)
        if view is not None:  # DTensor params: the step on the local shards, the ranks agreeing
            with view.sharding:
                new_params, new_state = self.step(view.params, view.grads, state, where=where, trust_grads=trust_grads)
            return view.wrap(new_params), new_state
        if self.lowmem:
            return self._lowmem(params, grads, state, where, trust_grads, inplace=False)
        prep = self._prepare(params, grads, state, where, trust_grads=trust_grads)
        if prep.opt is not None:
            out = self._fused(params, grads, state, prep, where, trust_grads)
            if out is not None:
                return out
        self._generic_hook(params, grads, prep.lined)
        return self._generic(params, grads, state, where)

    def _hook(self, params, lined):
        """``on_check`` bound to this step's leaf order, or None."""
        if self.on_check is None or _compiling():
            return None
        on_check = self.on_check

        def leaf_paths():
            if lined.keys is not None:
                return [str(k) for k in lined.keys]
            return [p for p, _ in leaves_with_paths(params)]

        return lambda finite, leaf_nonfinite: on_check(finite, leaf_nonfinite, leaf_paths)

    def _generic_hook(self, params, grads, lined):
        hook = self._hook(params, lined)
        if hook is not None and lined.g:
            finite, _, leaf_nonfinite = ops.check(lined.g, per_leaf=True)
            hook(finite, leaf_nonfinite)

    def _fused(self, params, grads, state, prep, where, trust_grads):
        """The pure fused step, or None when the kernels refused the gradients' dtypes (nothing
        was written; the caller runs the generic path)."""
        lined, opt = prep.lined, prep.opt
        ref, model = (lined.m, lined.p) if lined.m is not None else (lined.p, None)
        try:
            new_ref, new_model, new_slots, new_step, finite = self.plan.run(
                ref, lined.g, model, lined.slots, opt, state.loss_scale, group=self.group,
                on_check=self._hook(params, lined))
        except (RuntimeError, ValueError, TypeError) as e:
            if self._refused_for_dtype(prep):
                self._validate_grads(where, prep.named, trust_grads, None)
                return None
            raise _blame(e, where, self._kernel_lists(params, grads, state, prep.named)) from None
        if not _compiling():
            # The outputs come back as the next step's inputs: the kernels made them (fp32 on the
            # optimizer's device, the params' shapes and model dtypes), so they need no look then.
            seen = self._seen
            lists = ([new_model, new_ref] if lined.m is not None else [new_ref]) + list(new_slots)
            self._seen = _Seen(lists, None, True, seen.p_shapes if seen is not None else None, True, opt.step.device)
        if lined.m is not None:
            new_params, new_master = lined.rebuild(0, new_model), lined.rebuild(1, new_ref)
        else:
            new_params, new_master = lined.rebuild(0, new_ref), None
        written = dict(zip(self.plan.slot_names(), [lined.rebuild(2 + k, s) for k, s in enumerate(new_slots)]),
                       step=new_step)
        new_opt = opt._replace(**{f: written[f] if f in written else _cloned(getattr(opt, f)) for f in opt._fields})
        new_inner = self.plan.replace_opt_state(state.inner, new_opt, _cloned)
        ls = state.loss_scale
        new_ls = ls._adjust(finite.to(ls.loss_scale.device))
        if new_ls is ls:  # static and no-op scales return themselves; the result owns its tensors
            new_ls = _cloned(ls)
        dev = opt.step.device
        f, skipped = _next_stats(finite, state.finite, state.skipped, dev)
        return new_params, MixedPrecisionState(new_master, new_inner, new_ls, f, skipped)

    def _generic(self, params, grads, state, where):
        ls = state.loss_scale
        grads32, finite = ls.unscale_and_check(grads, f"{where}: grads")
        if self.group is not None:
            finite = agree_finite(finite, self.group)
        sharding = active_sharding()
        if sharding is not None:  # local shards of DTensor params: every rank of the mesh agrees
            finite = sharding.reduce(finite)[0]
        ref = state.master if state.master is not None else params
        updates, new_inner = self.inner.update(grads32, state.inner, ref)
        new_ref = apply_updates(ref, updates)
        new_ref, new_inner = select_tree(finite, (new_ref, new_inner), (ref, state.inner))
        new_ls = ls._adjust(finite.to(ls.loss_scale.device))
        device = state.finite.device if state.finite is not None else finite.device
        f, skipped = _next_stats(finite, state.finite, state.skipped, device)
        if state.master is None:
            return new_ref, MixedPrecisionState(None, new_inner, new_ls, f, skipped)
        # a copy where the dtypes match: the new params must not be the masters themselves (an
        # in-place step refuses a state whose params alias its masters; init() copies too)
        new_params = tree_map(lambda m, p: m.to(p.dtype) if m.dtype != p.dtype else m.clone(), new_ref, params)
        return new_params, MixedPrecisionState(new_ref, new_inner, new_ls, f, skipped)

    def _kernel_lists(self, params, grads, state, named) -> dict:
        """Kernel argument names -> (tree name, tree), to name leaves in kernel errors."""
        by_name = {n: t for n, t, _ in named}
        has_master = state.master is not None
        out = {"grads": ("grads", grads), "tensors": ("grads", grads),
               "params": ("state.master", state.master) if has_master else ("params", params)}
        if has_master:
            out["model_params"] = ("params", params)
        for kernel_name, slot in (("exp_avgs", "exp_avg"), ("exp_avg_sqs", "exp_avg_sq"),
                                  ("max_exp_avg_sqs", "max_exp_avg_sq"), ("momentum_buffers", "momentum_buffer")):
            key = f"state.inner.{slot}"
            if key in by_name:
                out[kernel_name] = (key, by_name[key])
        return out

    def step_(self, params: PyTree, grads: PyTree, state: MixedPrecisionState, *, where: Optional[str] = None,
              trust_grads: bool = False):
        """One in-place step: ``params`` and ``state`` are donated (their tensors overwritten);
        returns ``(params, state)`` (the same objects, or a new state object when the given one
        lacked the ``finite``/``skipped`` tensors). Same numbers as :meth:`step`.

        Everything is validated before the first write: shapes, dtypes, the meta device, and
        that no two written tensors share memory (checked once per set of tensors). Fused: one
        check pass and one in-place optimizer pass. Generic: the pure step, then one copy into
        the given tensors. ``trust_grads``: the caller guarantees each gradient has its
        param's shape (``ModuleTrainer``: autograd enforces it on ``.grad``).
        """
        where = where or f"{self.where}.step_"
        _refuse_vmap(where)
        view = local_view(params, grads, where=where)
        if view is not None:  # DTensor params: their local shards alias them, written in place
            with view.sharding:
                _, state = self.step_(view.params, view.grads, state, where=where, trust_grads=trust_grads)
            return params, state
        if self.lowmem:
            return self._lowmem(params, grads, state, where, trust_grads, inplace=True)
        prep = self._prepare(params, grads, state, where, trust_grads=trust_grads, inplace=True)
        lined, opt = prep.lined, prep.opt
        if opt is not None:
            ref, model = (lined.m, lined.p) if lined.m is not None else (lined.p, None)
            self._hold()
            try:
                finite = self.plan.run_(ref, lined.g, model, lined.slots, opt, state.loss_scale, group=self.group,
                                        on_check=self._hook(params, lined))
            except (RuntimeError, ValueError, TypeError) as e:
                if not self._refused_for_dtype(prep):
                    raise _blame(e, where, self._kernel_lists(params, grads, state, prep.named)) from None
                self._validate_grads(where, prep.named, trust_grads, None)
                opt = None  # the generic path below (nothing was written)
            else:
                ls = state.loss_scale
                with torch.no_grad():
                    if isinstance(ls, DynamicLossScale):
                        ls._adjust_(finite.to(ls.loss_scale.device))
                return params, self._commit_stats(state, finite)
        if opt is None:
            self._generic_hook(params, grads, lined)
            new_params, new_state = self._generic(params, grads, state, where)
            with torch.no_grad():
                _copy_into(params, new_params)
                _copy_into((state.master, state.inner, state.loss_scale),
                           (new_state.master, new_state.inner, new_state.loss_scale))
            return params, self._commit_stats(state, new_state.finite)

    def _lowmem(self, params, grads, state, where, trust_grads, inplace):
        """The step of the low-memory settings: :func:`ampfunc.lowmem.lowmem_step` around the
        fp32 engine ``_core``, which gets this engine's monitoring hook."""
        self._check_state(state, where)
        checked, every = False, None
        if inplace and not _compiling():
            state.loss_scale.check_writable(where)
            # The very tensors of the last step that passed the checks below and ran the kernel
            # pass are not looked at again (the kernel validates each call, as on the fp32 road).
            every = tree_leaves((params, state))
            checked = KERNELS_VALIDATE and self._lowmem_seen is not None and same_objects(every, self._lowmem_seen)
            if not checked:
                # It writes the params, the split remainders (or masters) and the whole inner state:
                # with a split master, two aliased bf16 params would each pair their remainder with
                # the other's high half. Checked naming the leaves: the plain road joins copies and
                # would not see it (the fused kernel refuses it only by list index).
                written = [("params", params, tree_leaves(params))]
                if state.master is not None:
                    written.append(("state.master", state.master, tree_leaves(state.master)))
                self._check_written(state, None, written, where)
        self._core.on_check = self.on_check
        new_params, new_state, fused = lowmem_step(
            self._core, self.plan, self.master == "split", params, grads, state, inplace=inplace, where=where,
            trust_grads=trust_grads, moments=self.moments, checked=checked)
        if every is not None:
            self._lowmem_seen = every if fused else None
        return new_params, new_state

    def _check_written(self, state, opt, written, where):
        """No two tensors an in-place step writes may share memory (nor one overlap itself)."""
        extra = [t for t in (state.finite, state.skipped) if isinstance(t, torch.Tensor)]
        extra += [t for t in tree_leaves(state.loss_scale) if isinstance(t, torch.Tensor)]
        named = list(written)
        if opt is None:  # generic or low-memory: every tensor of the inner state is written
            inner_leaves = [t for t in tree_leaves(state.inner) if isinstance(t, torch.Tensor)]
            named.append(("state.inner", state.inner, inner_leaves))
        else:
            named.append(("state.inner.step", [opt.step], [opt.step]))
        named.append(("state.loss_scale/finite/skipped", extra, extra))
        check_no_overlap(where, named)

    def _commit_stats(self, state, finite):
        if state.finite is None or state.skipped is None:
            dev = finite.device
            f, skipped = _next_stats(finite, None, None, dev)
            return state._replace(finite=f, skipped=skipped)
        with torch.no_grad():
            f = finite.to(state.finite.device)
            state.skipped.add_((~f).to(torch.int64))
            state.finite.copy_(f)
        return state

    def update(self, grads: PyTree, state: MixedPrecisionState, params: PyTree):
        """optax's ``update``: ``(updates, new_state)`` with ``apply_updates(params, updates)``
        the new params (deltas in fp32, fp64 for fp64 params: added and rounded once per param)."""
        if params is None:
            raise ValueError(f"{self.where}.update needs params (the master copy and the skip depend on them)")
        new_params, new_state = self.step(params, grads, state, where=f"{self.where}.update")
        updates = tree_map(lambda n, p: n.to(arithmetic_dtype(p.dtype)) - p.to(arithmetic_dtype(p.dtype)),
                           new_params, params)
        return updates, new_state


def _copy_into(dst: PyTree, src: PyTree) -> None:
    for d, s in zip(tree_leaves(dst), tree_leaves(src)):
        if isinstance(d, torch.Tensor) and d is not s:
            d.copy_(s)
