"""Stateful interop: the pure transforms driving a plain ``nn.Module`` trained with ``.backward()``.

For users with no functional code. The gradients are read from ``param.grad``, the step is the
pure mixed-precision step of :mod:`ampfunc.mixed`, and the new values are written back in place
into the module's parameters -- one call per step::

    trainer = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=af.DynamicLossScale())
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        trainer.scale(loss).backward()
        finite = trainer.step()            # 0-d bool tensor; no host sync

Works with DDP (gradients already averaged; pass ``group`` so ranks agree on skipping even if
their gradients differ) and FSDP2 (``fully_shard``: DTensor params and grads; the trainer works
on the local shards, so its optimizer state is sharded too, and the skip flag and
``af.clip_by_global_norm``'s norm are completed over the mesh: see :mod:`ampfunc.shards`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import operator
import sys
import warnings
from itertools import repeat
from typing import Any, NamedTuple, Optional

import torch

from ampfunc import ops
from ampfunc._build import env_flag
from ampfunc.engine import Engine, MixedPrecisionState, check_no_overlap, skip_stats
from ampfunc.flat import flatten
from ampfunc.loss_scale import LossScale, NoOpLossScale
from ampfunc.lowmem import MOMENT_FIELDS, Q8Moment
from ampfunc.mixed import check_optimizer_transform, scale_loss
from ampfunc.optim.base import check_bool
from ampfunc.shards import grads_to_local, sharding_of
from ampfunc.transform import GradientTransformation
from ampfunc.tree import check_same_structure, leaves_with_paths, tree_leaves, tree_structure, tree_unflatten

__all__ = ["TrainerState", "ModuleTrainer"]


class TrainerState(NamedTuple):
    """The state of a :class:`ModuleTrainer` (``trainer.state``), as one pytree of tensors.

    ``torch.save``-able; assign a loaded one to ``trainer.state`` (its structure is checked; one
    built with only the first three fields gets a fresh ``finite``/``skipped``).
    With ``flat=True`` the trees are keyed per buffer (``"float32@cpu"``), not per parameter.

    Attributes:
      master: when any param is narrower than the trainer's ``master_dtype`` (fp16/bf16 against
        fp32), a copy of every (local shard of a) param in ``master_dtype`` (wider params keep
        their dtype); else ``None``.
      opt_state: the optimizer transform's state.
      loss_scale: the :class:`~ampfunc.loss_scale.LossScale` for the next loss.
      finite: 0-d bool: the last step was applied (``True`` before the first).
      skipped: 0-d int64: the steps skipped so far.

    Example:
      >>> trainer = af.ModuleTrainer(nn.Linear(4, 2).half(), af.sgd(0.1))
      >>> state = trainer.state
      >>> state.master["weight"].dtype, bool(state.finite), int(state.skipped)
      (torch.float32, True, 0)
      >>> trainer.state = state          # e.g. one loaded with torch.load
    """

    master: Any
    opt_state: Any
    loss_scale: LossScale
    finite: Optional[torch.Tensor] = None
    skipped: Optional[torch.Tensor] = None




# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for its own dynamic mmap threshold (64-bit)
_heap_kept = [0]  # the trim threshold set so far (bytes); 0: none


def _keep_freed_grad_memory(nbytes: int) -> None:
    """Keeps glibc from handing freed heap memory back to the system below ``nbytes``.

    ``step()`` frees the step's gradients (``set_grads_to_none``). When they lie at the top of
    the heap -- the trainer made its state before the first backward, so the gradients are the
    newest memory -- glibc trims the heap at that ``free`` (its default trim threshold is twice
    its mmap threshold, at most 64 MB), and the next backward faults every page of its new
    gradients in again: 4 KB a fault, about as much time as the whole fused step. Raising the
    trim threshold to twice the gradients' bytes keeps that memory for the next backward.
    Setting it freezes glibc's dynamic mmap threshold, so that one is set to the ceiling the
    dynamic one would reach (32 MB). Process-wide (glibc has one policy), only ever raised;
    ``AMPFUNC_KEEP_HEAP=0`` leaves glibc alone. Not on other C libraries or platforms."""
    if nbytes <= 0 or not sys.platform.startswith("linux") or not env_flag("AMPFUNC_KEEP_HEAP", default=True):
        return
    want = 2 * nbytes
    if want <= _heap_kept[0]:
        return
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return
        if _heap_kept[0] == 0 and not libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX):
            return
        if libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(want, 2**31 - 1))):
            _heap_kept[0] = want
    except (OSError, AttributeError):
        pass


class _Packed:
    """A module's trainable params packed into one buffer per (device, dtype), each param's
    ``.data`` a view of it, and a zero-filled gradient buffer of the same layout whose views are
    the params' ``.grad`` (autograd adds into an existing ``.grad`` in place, so backward writes
    straight into it). The engine then steps one tensor per buffer instead of one per param."""

    def __init__(self, named: list, where: str, sparse_grads: frozenset = frozenset()):
        # sparse_grads: the names of params whose backward makes a sparse gradient (an embedding
        # with sparse=True); autograd would add it into the dense view in place, unnoticed.
        for name, p in named:
            if type(p) not in (torch.nn.Parameter, torch.Tensor):
                raise TypeError(f"{where}: parameter {name!r} is a {type(p).__name__}; flat=True packs plain "
                                "tensors (not DTensor/FSDP2 shards or other subclasses): leave flat off")
            if p.layout != torch.strided or not p.is_contiguous():
                raise ValueError(f"{where}: parameter {name!r} is not a contiguous dense tensor (strides "
                                 f"{tuple(p.stride())}); flat=True packs contiguous params only: make it "
                                 "contiguous first, or leave flat off")
            if p.grad is not None and p.grad.layout != torch.strided:
                raise TypeError(_sparse_grad_message(where, name, p.grad.layout))
            if name in sparse_grads:
                raise TypeError(f"{where}: parameter {name!r} belongs to an nn.Embedding/nn.EmbeddingBag made "
                                "with sparse=True, whose backward gives sparse COO gradients; the kernels take "
                                "dense (strided) gradients only: make it with sparse=False")
        # Two params sharing memory would be copied into two slots of the buffer and trained
        # apart (untied): refused, as the unpacked trainer refuses them.
        check_no_overlap(where, [("parameter", collections.OrderedDict(named), [p for _, p in named])])
        self.names = tuple(name for name, _ in named)
        self.params = [p for _, p in named]
        flat = flatten(self.params)  # one buffer per (device, dtype), the params copied in
        keys = [f"{str(dtype).removeprefix('torch.')}@{device}" for device, dtype in flat.keys]
        grad_buffers = flat.zeros_like()
        # what each param's .grad must stay (held: the signature names them)
        self.grad_views: list = flat.leaves(grad_buffers)
        self.buffers = dict(zip(keys, flat.buffers))  # what the engine steps
        self.grad_buffers = dict(zip(keys, grad_buffers))
        with torch.no_grad():
            for p, view, gview in zip(self.params, flat.leaves(), self.grad_views):
                if p.grad is not None:
                    gview.copy_(p.grad)
                p.data = view
                p.grad = gview
        self.signature = ops.bound_signature(self.params)
        self._warned = False  # the one warning about grads replaced on every step

    def rebind(self, where: str) -> None:
        """Before a step: raises (nothing written) if a param's data left its buffer; a ``.grad``
        that is not its view (set to None by ``zero_grad()``, then made anew by backward, or
        assigned) is copied into the view (zeros for None) and the view put back."""
        moved, unbound = ops.check_bound(self.params, self.signature)
        if moved:
            raise RuntimeError(
                f"{where}: parameter {self.names[moved[0]]!r} no longer lives in the trainer's flat buffer (the "
                "module was moved or converted, or its .data replaced, after the trainer was made); make the "
                "trainer after model.to(...)/.half(), or leave flat off")
        if unbound:
            params = [self.params[i] for i in unbound]
            grads = ops.grads_of(params)
            for i, g in zip(unbound, grads):
                if g is not None and g.layout != torch.strided:  # refused before any write
                    raise TypeError(_sparse_grad_message(where, self.names[i], g.layout))
            if len(unbound) == len(self.params) and not self._warned:
                self._warned = True
                warnings.warn(f"{where}: every .grad was replaced since the last step (model.zero_grad() sets "
                              "them to None, and backward then makes new ones), so each step copies them into "
                              "the trainer's gradient views: drop the zero_grad() call, the flat trainer zeroes "
                              "the gradients itself after each step", stacklevel=3)
            views = [self.grad_views[i] for i in unbound]
            pairs = [(v, g) for v, g in zip(views, grads) if g is not None]
            empty = [v for v, g in zip(views, grads) if g is None]
            with torch.no_grad():
                if pairs:
                    torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])
                if empty:
                    torch._foreach_zero_(empty)
            ops.set_grads(params, views)

    def check_per_param(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(finite, flags)``: 0-d bool, and per param (in ``names``' order) True where its
        gradient holds an inf/NaN, on the first param's device. One read-only pass (per device)."""
        views = self.grad_views
        devices = list(dict.fromkeys(v.device for v in views))
        if len(devices) == 1:
            finite, _, flags = ops.check(views, per_leaf=True)
            return finite, flags
        # the kernels take one device per call: one check per device, the flags gathered
        flags = torch.empty(len(views), dtype=torch.bool, device=devices[0])
        for device in devices:
            index = [i for i, v in enumerate(views) if v.device == device]
            _, _, part = ops.check([views[i] for i in index], per_leaf=True)
            flags[torch.tensor(index, device=devices[0])] = part.to(devices[0])
        return ~flags.any(), flags

    def zero_grads(self) -> None:
        """The gradients zeroed in place (one fill per buffer); the views stay the ``.grad``."""
        with torch.no_grad():
            for gbuf in self.grad_buffers.values():
                gbuf.zero_()


def _sparse_grad_message(where: str, name: str, layout) -> str:
    return (f"{where}: the .grad of parameter {name!r} has layout {layout}; only dense (strided) gradients are "
            "supported (densify it with .to_dense())")


def _sparse_grad_params(model: torch.nn.Module) -> frozenset:
    """The names (as ``named_parameters`` gives them) of the params of the embeddings made with
    ``sparse=True``, whose backward gives sparse COO gradients."""
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.sparse:
            names.update(f"{mod_name}.{n}" if mod_name else n for n, _ in mod.named_parameters(recurse=False))
    return frozenset(names)


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor (FSDP2): the local shard, which aliases the parameter's storage, so an in-place
    # write into it updates the sharded parameter.
    return t.to_local() if hasattr(t, "to_local") else t


class ModuleTrainer:
    """Runs ``tx`` (an optimizer transform) on ``model``'s parameters, one ``step()`` per step.

    ``step()`` reads every trainable parameter's ``.grad`` (gradients of the *scaled* loss:
    use :meth:`scale`) and runs the mixed-precision step of :class:`ampfunc.engine.Engine` in
    place on the parameters: check (``group``: all ranks agree), ``tx`` in fp32 against the
    parameters -- or an fp32 master copy the trainer keeps when the module is fp16/bf16 (apex
    O2) --, the skip on the device if any gradient was not finite, the loss-scale update; then
    it clears the grads (``set_grads_to_none``). With a kernel-backed ``tx`` (``sgd``/``adam``/``adamw``, optionally
    after ``clip_by_global_norm``) that is one check pass and one fused optimizer pass over the
    parameters.

    A parameter without ``.grad`` (unused this step) gets a zero gradient, so the optimizer
    state keeps a fixed structure (``torch.optim`` would skip it instead; with weight decay or
    momentum the two differ for that parameter). ``state`` (a :class:`TrainerState` pytree) can
    be saved and loaded with ``torch.save`` or, sharded, with ``af.dist.save_sharded``.

    Args:
      model: the module; its parameters with ``requires_grad`` are trained.
      tx: the optimizer transform (not a ``mixed_precision`` wrapper).
      loss_scale: default :class:`NoOpLossScale`.
      group: a ``torch.distributed`` process group whose ranks agree on skipping.
      master_dtype: the master dtype for parameters narrower than it.
      master: ``"fp32"`` (a master copy per narrow parameter) or ``"split"`` (bf16 parameters
        are the high halves of exact fp32 masters, the state keeps the int16 low halves: 2
        bytes instead of 4 per element; see :func:`ampfunc.mixed_precision`).
      set_grads_to_none: clear ``.grad`` after each step (as ``zero_grad(set_to_none=True)``;
        with ``flat=True`` the gradients are zeroed in place instead).
      flat: pack the trainable params into one buffer per (device, dtype) (each param's
        ``.data`` becomes a view of it) and keep their ``.grad`` as views of one zeroed
        gradient buffer, and step the buffers: a model of 10,000 small tensors then costs what
        one tensor of the same size costs. Needs a kernel-backed elementwise ``tx`` (``sgd``/
        ``adam``/``adamw``, optionally after ``clip_by_global_norm``) and contiguous plain-tensor
        params (not FSDP2); the state is kept per buffer (keys like ``"float32@cpu"``), and
        ``.grad`` is zeroed rather than set to None. Make the trainer after ``model.to(...)``:
        a param moved afterwards is refused, naming it.

    Example:
      >>> model = nn.Linear(4, 2)
      >>> trainer = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=af.DynamicLossScale())
      >>> loss = model(torch.randn(8, 4)).square().mean()
      >>> trainer.scale(loss).backward()
      >>> finite = trainer.step()          # 0-d bool; no host sync
      >>> bool(finite), int(trainer.skipped), model.weight.grad is None
      (True, 0, True)

    Cost: see :meth:`step`. Never syncs with the host.
    """

    def __init__(self, model: torch.nn.Module, tx: GradientTransformation, *, loss_scale: LossScale | None = None,
                 group=None, master_dtype: torch.dtype = torch.float32, set_grads_to_none: bool = True,
                 flat: bool = False, master: str = "fp32"):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ModuleTrainer: model must be a torch.nn.Module, got {type(model).__name__}")
        check_optimizer_transform(tx, "ModuleTrainer")
        check_bool(set_grads_to_none, "set_grads_to_none", "ModuleTrainer")
        check_bool(flat, "flat", "ModuleTrainer")
        loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
        if not isinstance(loss_scale, LossScale):
            raise TypeError(f"ModuleTrainer: loss_scale must be a loss scale, got {type(loss_scale).__name__}")
        self.model = model
        self.tx = tx
        self.group = group
        self.set_grads_to_none = set_grads_to_none
        self._all = list(model.named_parameters())
        # Which params were trainable when the trainer was made: the set it steps (checked
        # every step: a param frozen or unfrozen later would be fed zeros, or never trained).
        self._all_params = [p for _, p in self._all]
        self._trainable = bytes(p.requires_grad for p in self._all_params)
        self._named = [(n, p) for n, p in self._all if p.requires_grad]
        if not self._named:
            raise ValueError("ModuleTrainer: the model has no parameter with requires_grad=True")
        for name, p in self._named:
            if not torch.is_floating_point(p):
                raise TypeError(f"ModuleTrainer: parameter {name!r} has dtype {p.dtype}, expected a floating dtype")
        self._names = [n for n, _ in self._named]
        self._plist = [p for _, p in self._named]
        # DTensor params (FSDP2) hand over their local shards, fetched every step; plain ones are
        # handed over themselves, in one dict kept from step to step (the engine re-reads its
        # values every step and checks them by identity).
        # Their layout on the mesh (refused here, naming the param: a mix of DTensor and plain
        # params, two meshes), in the flattening order of the params dict, which the reductions
        # across leaves (the skip flag, the clipping norm) complete over the mesh every step.
        order = sorted(range(len(self._names)), key=lambda i: self._names[i])
        self._shard_order = order
        self._sharding = sharding_of([self._names[i] for i in order], [self._plist[i] for i in order],
                                     "ModuleTrainer")
        self._sharded = self._sharding is not None
        self._param_dict = None if self._sharded else dict(self._named)
        self._engine = Engine(tx, master_dtype=master_dtype, master=master, group=group, where="ModuleTrainer.step")
        self._packed = None
        if flat and self._engine.lowmem:
            raise ValueError("ModuleTrainer(flat=True): the low-memory settings (master='split', bf16/q8 moments) "
                             "keep their state per parameter; leave flat off")
        if flat:
            if self._engine.plan is None:
                raise ValueError("ModuleTrainer(flat=True): tx must be a kernel-backed elementwise optimizer "
                                 "(sgd/adam/adamw, optionally after clip_by_global_norm): its state is kept per "
                                 "flat buffer, not per parameter; leave flat off for other transforms")
            if self._sharded:
                raise TypeError("ModuleTrainer(flat=True): the params are DTensors (FSDP2); leave flat off")
            self._packed = _Packed(self._named, "ModuleTrainer(flat=True)", _sparse_grad_params(model))
            self._param_dict = self._packed.buffers
        st = self._engine.init(self._params(), loss_scale)
        self._state = TrainerState(st.master, st.inner, st.loss_scale, st.finite, st.skipped)
        if set_grads_to_none and self._packed is None:
            # step() frees each step's gradients: keep that memory for the next backward.
            _keep_freed_grad_memory(sum(p.numel() * p.element_size() for p in self._plist if p.device.type == "cpu"))

    # -- state --------------------------------------------------------------------------------

    @property
    def state(self) -> TrainerState:
        return self._state

    @state.setter
    def state(self, new: TrainerState) -> None:
        if not isinstance(new, TrainerState):
            raise TypeError(f"ModuleTrainer.state must be a TrainerState, got {type(new).__name__}")
        if new.finite is None or new.skipped is None:
            # A state built with the three fields of old (or saved before finite/skipped
            # existed): they start as a fresh trainer's do, on the current state's device.
            finite, skipped = skip_stats(self._state.finite.device)
            new = new._replace(finite=finite if new.finite is None else new.finite,
                               skipped=skipped if new.skipped is None else new.skipped)
        self._check_moments_layout(new)
        check_same_structure(new, self._state, "new state", "current state")
        # Every tensor as the current one is (a state from another model would only fail at the
        # next step, after replacing the good one); on another device it is moved, as
        # torch.optim's load_state_dict moves optimizer state to its params' device.
        pairs = leaves_with_paths(self._state)
        paths, current = [p for p, _ in pairs], [t for _, t in pairs]
        given = tree_leaves(new)
        for path, cur, giv in zip(paths, current, given):
            if isinstance(cur, torch.Tensor) and (not isinstance(giv, torch.Tensor) or giv.shape != cur.shape
                                                  or giv.dtype != cur.dtype):
                got = f"{giv.dtype} {tuple(giv.shape)}" if isinstance(giv, torch.Tensor) else type(giv).__name__
                raise ValueError(f"ModuleTrainer.state: leaf {path!r} is {got} in the new state but "
                                 f"{cur.dtype} {tuple(cur.shape)} in this trainer's: the state was made for another "
                                 "model or configuration")
            if isinstance(cur, torch.Tensor) and giv.is_meta and not cur.is_meta:
                raise ValueError(f"ModuleTrainer.state: leaf {path!r} is on the meta device (it holds no data; "
                                 "a checkpoint loaded with map_location='meta'?): load it onto a real device")
        if any(isinstance(c, torch.Tensor) and g.device != c.device for c, g in zip(current, given)):
            spec = tree_structure(new)
            new = tree_unflatten(spec, [g.to(c.device) if isinstance(c, torch.Tensor) else g
                                        for c, g in zip(current, given)])
        self._state = new

    def _check_moments_layout(self, new: TrainerState) -> None:
        """A new state whose moments are kept in another layout (q8 against bf16/fp32) is refused
        naming the setting, not as a tree mismatch."""
        plan = self._engine.plan
        if plan is None:
            return
        try:
            given, current = plan.opt_state(new.opt_state), plan.opt_state(self._state.opt_state)
        except Exception:  # noqa: BLE001 - not this optimizer's state at all: the structure check names it
            return
        if given is None or current is None:
            return
        for field in MOMENT_FIELDS:
            a, b = getattr(given, field, None), getattr(current, field, None)
            if a is not None and b is not None and isinstance(a, Q8Moment) != isinstance(b, Q8Moment):
                def kind(x):
                    return "a Q8Moment (moments='q8')" if isinstance(x, Q8Moment) else "per-param tensors"
                raise ValueError(f"ModuleTrainer.state: the new state's opt_state.{field} is {kind(a)} but this "
                                 f"trainer's is {kind(b)}: the state was made with another moments setting -- "
                                 "build the trainer with the optimizer that made it")

    @property
    def loss_scale(self) -> LossScale:
        """The loss scale for the next backward pass."""
        return self._state.loss_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (fp32): call ``.backward()`` on this."""
        return scale_loss(loss, self._state.loss_scale)

    # -- the step ------------------------------------------------------------------------------

    def _params(self) -> dict[str, torch.Tensor]:
        # The Parameters themselves (written under no_grad), so the engine sees the same tensors
        # every step and validates their memory once; DTensors (FSDP2) give their local shard.
        if self._param_dict is not None:
            return self._param_dict
        return {n: _local(p) for n, p in self._named}

    def _grads(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # map() reads 10,000 .grad attributes at C speed; the rare missing one is filled after.
        grads = ops.grads_of(self._plist)
        if any(map(operator.is_, grads, repeat(None))):
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self._plist, grads)]
        if self._sharded:  # FSDP2's DTensor gradients: their local shards, laid out as the params'
            order = self._shard_order
            local = grads_to_local(self._sharding, [self._names[i] for i in order], [self._plist[i] for i in order],
                                   [grads[i] for i in order], "ModuleTrainer.step")
            grads = list(grads)
            for i, g in zip(order, local):
                grads[i] = g
        return dict(zip(self._names, grads))  # the params' key objects: compared in no time

    @property
    def engine(self) -> Engine:
        """The :class:`ampfunc.engine.Engine` that runs :meth:`step` (set ``engine.on_check`` to
        record which leaves overflowed, without a host sync: one flag per parameter, named as
        in ``model.named_parameters()``, also with ``flat=True``, where the engine steps buffers
        and the trainer reads the gradients once more for the per-parameter flags)."""
        return self._engine

    @property
    def finite(self) -> torch.Tensor:
        """0-d bool: whether the last step was applied (True before the first). No host sync."""
        return self._state.finite

    @property
    def skipped(self) -> torch.Tensor:
        """0-d int64: the number of steps skipped so far. ``int(trainer.skipped)`` syncs."""
        return self._state.skipped

    def step(self) -> torch.Tensor:
        """One optimizer step from the current ``.grad`` s, in place on the module's parameters.

        Returns:
          The 0-d bool ``finite`` flag (also in ``trainer.state.finite``; the running count of
          skipped steps is ``trainer.state.skipped``).

        Cost: with a kernel-backed ``tx`` and fp32 params (or fp16/bf16 params with fp32
        masters) one read-only check pass and one in-place optimizer pass over the parameters
        (:class:`ampfunc.engine.Engine`); otherwise the generic pure step and one copy back.
        No host sync.
        """
        st = self._state
        changed = ops.requires_grad_changed(self._all_params, self._trainable)
        if changed >= 0:
            name, p = self._all[changed]
            now = "requires grad" if p.requires_grad else "no longer requires grad"
            raise RuntimeError(f"ModuleTrainer.step: parameter {name!r} {now} since the trainer was made; it steps "
                               "the set of trainable parameters it was made with (a frozen one would still move "
                               "with momentum and weight decay, an unfrozen one would never train): make a new "
                               "ModuleTrainer after changing requires_grad")
        params = self._params()
        hook = None
        if self._packed is not None:
            self._packed.rebind("ModuleTrainer.step")
            grads = self._packed.grad_buffers
            hook = self._engine.on_check
            if hook is not None and not torch.compiler.is_compiling():
                # The engine's leaves are the buffers, one flag each; a monitor counts per
                # param: one more read-only check over the params' gradient views gives those,
                # before anything is written (a hook that raises leaves the step undone).
                finite, flags = self._packed.check_per_param()
                names = list(self._packed.names)
                try:  # the engine's contract: the paths come as a function returning them
                    hook(finite, flags, lambda: names)
                except (RuntimeError, ValueError, TypeError) as e:
                    if type(e) not in (RuntimeError, ValueError, TypeError):
                        raise  # a subclass may not take a bare message: keep it as raised
                    raise type(e)(f"ModuleTrainer.step: {e}") from None
        else:
            grads = self._grads(params)
        mp = MixedPrecisionState(st.master, st.opt_state, st.loss_scale, st.finite, st.skipped)
        # autograd gives every .grad its param's shape: no per-leaf shape check needed.
        # DTensor params: the step runs on the local shards, the ranks of the mesh agreeing.
        with self._sharding if self._sharding is not None else contextlib.nullcontext():
            if hook is not None:
                self._engine.on_check = None  # called above, per param
                try:
                    _, mp = self._engine.step_(params, grads, mp, where="ModuleTrainer.step", trust_grads=True)
                finally:
                    self._engine.on_check = hook
            else:
                _, mp = self._engine.step_(params, grads, mp, where="ModuleTrainer.step", trust_grads=True)
        self._state = TrainerState(mp.master, mp.inner, mp.loss_scale, mp.finite, mp.skipped)
        if self._packed is not None and not torch.compiler.is_compiling():
            # The kernels wrote the buffers, whose views are the params' .data: the params' own
            # version counters must move, as after torch.optim's step, so that a backward through
            # a graph that saved them before the step fails instead of using the new values.
            ops.bump_versions(self._packed.params)
        if self.set_grads_to_none:
            if self._packed is not None:
                self._packed.zero_grads()
            else:
                ops.clear_grads(self._plist)
        return mp.finite.clone()  # the state's flag is overwritten by the next step

    def state_dict(self) -> dict:
        """``{"trainer": state}``: pass to :meth:`load_state_dict` (``torch.save``-able)."""
        return {"trainer": self._state}

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd["trainer"]


# torch.load(weights_only=True) (the default) accepts trainer states.
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([TrainerState])
