"""apex's ``FP16_Optimizer``: fp32 master weights and loss scaling around any torch optimizer.

As in apex's last version, the scaler is apex's ``amp`` loss scaler
(:class:`ampfunc.compat.apex.amp.LossScaler`: dynamic from ``2**16``, growth every 2000 clean
steps, cap ``2**24``, no floor), and the masters are the helper amp O2 uses too
(:class:`ampfunc.compat.apex._master.MasterWeights`). The scaled loss is
:func:`ampfunc.scale_loss`; fp16 model grads become fp32 master grads through
:func:`ampfunc.ops.unscale` (one read, one fp32 write, with the finiteness flag computed on
the way); fp32 grads are unscaled in place. apex's control flow is host-side (``step`` prints
and returns early on overflow), so with dynamic scaling each ``update_master_grads`` reads the
one overflow flag back, as apex did. Checkpoints hold the scaler object with apex's attributes
and load apex's (see :meth:`FP16_Optimizer.load_state_dict`).

The fused step: when the wrapped optimizer is a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` whose
settings the kernels follow (:func:`ampfunc.fused.plan_for_torch_group`), ``backward`` checks
the fp16 grads read-only (:meth:`MasterWeights.check_model_grads`: same overflow flag, same
scale update; no pass at all with a static scale) and leaves the master grads unwritten, and
``step`` hands :func:`ampfunc.compat._torch_step.torch_step_` one pass per param group and
device that reads the scaled fp16 grads and writes the masters, the optimizer's own state and
the fp16 params. Asking for the master grads (``update_master_grads``, ``clip_master_grads``,
``inspect_master_grad_data``, a closure, another ``backward(..., update_master_grads=False)``)
writes them first, and the step is the wrapped optimizer's own, as before.
"""

from __future__ import annotations

import torch

from ampfunc.compat import _torch_step
from ampfunc.compat.apex._master import LOW_PRECISION, MasterWeights
from ampfunc.compat.apex._scaler import LossScaler as AmpLossScaler
from ampfunc.compat.apex._scaler import checked_scale
from ampfunc.compat.apex.fp16_utils.fp16util import clip_grad_norm

__all__ = ["FP16_Optimizer"]

_DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")

# torch.optim's per-element state (one value per param element, shaped like the param): checked
# against the param on load. Scalars (``step``, ASGD's ``eta``/``mu``, NAdam's ``mu_product``)
# and factored state (Adafactor's ``row_var``/``col_var``) are not param-shaped.
_PER_ELEMENT_STATE = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum",
    "ax", "grad_avg", "prev", "step_size", "exp_inf",
})


class FP16_Optimizer:  # noqa: N801 - apex's name
    """Wraps ``init_optimizer`` so that it updates fp32 master copies of its fp16 params.

    ``init_optimizer`` may hold fp16 (and bf16) params, fp32 params, or both, in any number of
    param groups with different hyper-parameters; its trainable fp16/bf16 params are replaced by
    fp32 masters (existing per-param state is moved to the masters and recast to fp32), and
    after each :meth:`step` the masters are copied back into the model's params. Other dtypes
    raise ``TypeError`` naming the group and index, and leave the optimizer untouched.

    Replace ``loss.backward()`` by ``optimizer.backward(loss)``. ``static_loss_scale`` is a
    fixed scale; ``dynamic_loss_scale=True`` uses apex amp's dynamic ``LossScaler`` with
    ``dynamic_loss_args`` (``init_scale=2**16``, ``scale_window=2000``,
    ``min_loss_scale=None``, ``max_loss_scale=2**24``; ``scale_factor`` accepted and ignored,
    as in apex; a ``min_loss_scale`` above ``init_scale`` is accepted as apex does: the scale
    starts below that floor and the first overflow raises it to the floor), skipping steps
    whose gradients overflowed. ``verbose`` prints the params
    found at construction. Unlike apex, CPU tensors work. Scales (``static_loss_scale``,
    ``dynamic_loss_args["init_scale"]``, and any value assigned to :attr:`loss_scale`) must
    lie in :data:`ampfunc.loss_scale.SCALE_RANGE` once stored in fp32: 0, negative, NaN, inf or ``1e39``
    raise ``ValueError`` naming the setting, before anything changes (apex accepts them and the
    next step writes NaN into model and masters).

    Example:
      >>> model = nn.Linear(4, 2).half()
      >>> opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
      >>> opt.loss_scale
      65536.0

    Cost: ``update_master_grads`` is one pass over the grads plus (dynamic scale) one host read.
    With an SGD/Adam/AdamW the kernels follow (see the module docstring), ``backward`` costs one
    read-only pass (dynamic scale; none for a static one) plus that host read, and ``step`` one
    fused pass (read the fp16 grad, read and write the master and the optimizer state, write
    the fp16 param) instead of a master-grad write, torch's step and a copy back.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None, verbose: bool = True):
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16_Optimizer wraps a torch.optim.Optimizer, got {type(init_optimizer).__name__}")
        # Validate everything before touching the optimizer.
        for i, group in enumerate(init_optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                if param.requires_grad and param.dtype not in LOW_PRECISION + (torch.float32,):
                    raise TypeError(
                        "Wrapped parameters must be fp16, bf16 or fp32 tensors; "
                        f"param_groups[{i}]['params'][{j}] has dtype {param.dtype}"
                    )
        if dynamic_loss_scale:
            unknown = sorted(set(dynamic_loss_args or {}) - set(_DYNAMIC_ARGS))
            if unknown:
                raise TypeError(f"FP16_Optimizer: dynamic_loss_args has unknown keys {unknown}; apex's amp "
                                f"LossScaler('dynamic', ...) takes {list(_DYNAMIC_ARGS)}")
            if "init_scale" in (dynamic_loss_args or {}):
                checked_scale(dynamic_loss_args["init_scale"], "FP16_Optimizer: dynamic_loss_args['init_scale']")
            loss_scaler = AmpLossScaler("dynamic", **(dynamic_loss_args or {}))
        else:
            loss_scaler = AmpLossScaler(static_loss_scale)

        self.verbose = verbose
        self.optimizer = init_optimizer
        self.masters = MasterWeights(
            init_optimizer,
            on_param=lambda p: self.maybe_print(f"FP16_Optimizer received {p.dtype} param with {tuple(p.size())}"),
            on_group=lambda i: self.maybe_print(f"FP16_Optimizer processing param group {i}:"))
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.loss_scaler = loss_scaler
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        # After a backward checked for the fused step: device -> the 1/scale the model grads carry
        # (the master grads are not written then); None once they are (or without a check).
        self._deferred: dict | None = None

    # apex's attribute names for the master lists.
    fp16_groups = property(lambda self: self.masters.fp16_groups)
    fp32_from_fp16_groups = property(lambda self: self.masters.fp32_from_fp16_groups)
    fp32_from_fp32_groups = property(lambda self: self.masters.fp32_from_fp32_groups)
    all_fp16_params = property(lambda self: self.masters.all_fp16_params)
    all_fp32_from_fp16_params = property(lambda self: self.masters.all_fp32_from_fp16_params)
    all_fp32_from_fp32_params = property(lambda self: self.masters.all_fp32_from_fp32_params)

    def maybe_print(self, msg: str) -> None:
        if self.verbose:
            print(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # -- gradients --------------------------------------------------------------------------

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803 - apex's name
        """Zeroes (or sets to ``None``) the grads of the masters, the fp32 params and the fp16 model params."""
        for p in [p for g in self.optimizer.param_groups for p in g["params"]] + self.all_fp16_params:
            if set_grads_to_None:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``, then (by default) :meth:`update_master_grads`.

        With several losses per iteration pass ``update_master_grads=False`` to each and call
        :meth:`update_master_grads` once. After this the model's ``.grad`` are scaled; only the
        master grads (:meth:`inspect_master_grad_data`) are meaningful.
        """
        if not update_master_grads:
            # The checked grads become master grads before more are accumulated on the model.
            self._materialize_master_grads()
        self.loss_scaler.scale(loss).backward(retain_graph=retain_graph)
        if update_master_grads:
            if _torch_step.torch_step_supported(self.optimizer):
                self._check_grads()
            else:
                self.update_master_grads()

    @torch.no_grad()
    def _check_grads(self) -> None:
        """:meth:`update_master_grads` for the fused step: the same overflow flag and scale
        update, from a read-only check of the model grads (none for a static scale, which never
        skips); the master grads are written later only if asked for (:meth:`inspect_master_grad_data`,
        :meth:`clip_master_grads`, or a step that cannot run fused)."""
        scaler = self.loss_scaler
        scaler.clear_overflow_state()
        finite16, inv_scales = self.masters.check_model_grads(scaler, check=scaler.dynamic)
        fp32_grads = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
        scaler.unscale(fp32_grads, fp32_grads)
        finite = self.masters.finite_of([finite16, scaler._finite])
        self.overflow = scaler.update_scale(finite)
        self._deferred = inv_scales

    def _materialize_master_grads(self) -> None:
        """Writes the master grads a deferred check left in the model grads (no scale update)."""
        if self._deferred is not None:
            inv_scales, self._deferred = self._deferred, None
            self.masters.grads_to_masters(self.loss_scaler, accumulate=False, inv_scales=inv_scales)

    @torch.no_grad()
    def update_master_grads(self) -> None:
        """Master grads = model grads / scale (fp32); fp32 params' grads are unscaled in place.

        With dynamic scaling the overflow flag is read back (``self.overflow``) and the scale
        advanced; with a static scale ``overflow`` stays ``False`` and the scaler counts the
        step (apex's rule).
        """
        self._deferred = None
        scaler = self.loss_scaler
        scaler.clear_overflow_state()
        flags = [self.masters.grads_to_masters(scaler, accumulate=False)]
        fp32_grads = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
        scaler.unscale(fp32_grads, fp32_grads)
        finite = self.masters.finite_of(flags + [scaler._finite])
        self.overflow = scaler.update_scale(finite)

    def inspect_master_grad_data(self):
        """Per param group, the fp32 master grads (``None`` for params without one); ``None`` after an overflow."""
        if self.overflow:
            print("Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.  "
                  "Gradients are currently invalid (may be inf, nan, or stale).  Returning None.")
            return None
        self._materialize_master_grads()
        return [[None if p.grad is None else p.grad.data for p in g["params"]] for g in self.optimizer.param_groups]

    def clip_master_grads(self, max_norm: float, norm_type: float = 2):
        """Clips the fp32 master grads (``torch.nn.utils.clip_grad_norm_``); returns their total
        norm, or -1 after an overflow."""
        if self.overflow:
            return -1
        self._materialize_master_grads()
        return self.clip_grad_norm([p for g in self.optimizer.param_groups for p in g["params"]],
                                   max_norm, norm_type)

    # -- step -------------------------------------------------------------------------------

    def step(self, closure=None):
        """Updates the masters with the wrapped optimizer and copies them into the model params.

        After a checked ``backward`` with an SGD/Adam/AdamW the kernels follow, one fused pass
        per param group and device does both (torch's update, torch's state; the master grads
        stay unwritten until asked for); otherwise the wrapped optimizer's own ``step``.

        After an overflow (dynamic scaling) prints ``Gradient overflow.  Skipping step,
        reducing loss scale to ...`` and returns ``None`` without touching params or optimizer
        state.

        A ``closure`` must call ``zero_grad`` and ``backward(loss)`` itself; the wrapped
        optimizer's ``step(closure)`` runs it. With dynamic scaling, as in apex's last version,
        an evaluation whose gradients overflowed is never handed to the optimizer: it prints
        ``OVERFLOW within closure! Skipping step, reducing loss scale to ...`` and runs the
        closure again at the reduced scale until the gradients are finite, so the overflow
        costs an evaluation and a smaller scale, nothing else. Unlike apex (which loops
        forever), an overflow again at a scale the backoff cannot lower (``min_loss_scale``,
        or ``2**-126``) raises ``RuntimeError``; the optimizer has then not stepped on that
        evaluation, and the masters, model params and optimizer state are as they were
        before it.

        Args:
          closure: ``None``, or a callable that calls :meth:`zero_grad` and :meth:`backward`
            and returns the loss.

        Returns:
          The wrapped optimizer's return value (the closure's loss), or ``None`` when skipped.

        Cost: the fused pass, or the wrapped optimizer's step plus one copy back; with a
        dynamic scale each closure evaluation reads the overflow flag once (in
        :meth:`backward`) and an overflowing one also reads the scale for the message.
        """
        if self.overflow:
            print(f"Gradient overflow.  Skipping step, reducing loss scale to {self.loss_scaler.loss_scale()}")
            return None
        if closure is None and self._deferred is not None:
            lists = self.masters.step_lists(self._deferred)
            if lists is not None and _torch_step.torch_step_(self.optimizer, lists):
                # One pass per group and device wrote the masters, the optimizer state and the
                # model params. The model grads stay the unmaterialized master grads.
                return None
        self._materialize_master_grads()
        retval = self._step_with_closure(closure) if closure is not None else self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure):
        def wrapped_closure():
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The optimizer may re-evaluate the closure after moving the masters: the model
                # must see the moved weights.
                self._master_params_to_model_params()
            loss = closure()
            tried = None  # the scale of the last overflowing evaluation (None: not read yet)
            while self.overflow:
                # apex's last version: the optimizer never sees overflowed grads; the closure
                # runs again at the scale backward just reduced. The master grads of the
                # overflowed evaluation stay unwritten (fused check) or are overwritten.
                scale = self.loss_scaler.loss_scale()
                if scale == tried:
                    # the next step starts clean (a set flag would skip it without running the closure)
                    self.overflow = False
                    raise RuntimeError(
                        "FP16_Optimizer.step(closure): the closure's gradients overflowed again at loss scale "
                        f"{scale}, which the dynamic scale cannot lower (min_loss_scale="
                        f"{self.loss_scaler._min_loss_scale!r}; the scale never goes below 2**-126), so "
                        "re-running the closure would loop forever (apex's does). The loss or the model is not "
                        "finite at any scale, or the closure does not call FP16_Optimizer.backward. The wrapped "
                        "optimizer has not stepped on these gradients: the masters, the model params and the "
                        "optimizer state are as they were before this evaluation")
                tried = scale
                print(f"OVERFLOW within closure! Skipping step, reducing loss scale to {scale}")
                loss = closure()
            self._materialize_master_grads()  # the wrapped optimizer reads the master grads
            return loss

        try:
            return self.optimizer.step(wrapped_closure)
        finally:
            # Also after an error in the closure: the next step's first evaluation must not
            # copy the masters over the model first.
            self.first_closure_call_this_step = True

    def _master_params_to_model_params(self) -> None:
        self.masters.masters_to_model()

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """apex's keys: ``loss_scaler`` (the scaler object), ``dynamic_loss_scale``, ``overflow``,
        ``first_closure_call_this_step``, ``optimizer_state_dict``, ``fp32_from_fp16`` (the masters)."""
        return {
            "loss_scaler": self.loss_scaler,
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores a :meth:`state_dict` of this class or of apex's ``FP16_Optimizer``.

        The stored ``loss_scaler`` may be this facade's, apex's ``amp`` ``LossScaler`` (its
        attributes ``dynamic``, ``_loss_scale``, ``_unskipped``, ``_min_loss_scale``,
        ``_max_loss_scale``, ``_scale_seq_len`` carry over exactly), or an older apex
        ``fp16_utils`` scaler (see :meth:`LossScaler.from_apex`). The fp32 masters are copied
        from the saved ones (no fp16 round trip).

        Everything is checked before anything changes (a refused checkpoint leaves the
        optimizer, its state, the masters and the scaler as they were): ``KeyError`` naming a
        missing entry; ``ValueError`` naming the shapes if the saved masters do not match this
        optimizer's; ``ValueError`` naming the param (``param_groups[g]['params'][i]``) and the
        state key if a per-element state tensor of the wrapped optimizer (``exp_avg``,
        ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``, ``square_avg``, ... and any
        key whose tensor this optimizer already holds) does not have the shape of the param it
        would belong to: a checkpoint of a model with other shapes, or with its fp16 and fp32
        params in another order (torch's ``Optimizer.load_state_dict`` checks only the counts,
        and the next step would fail after updating the first params). Scalar entries such as
        ``step`` are not checked.

        Args:
          state_dict: a :meth:`state_dict` (this class's or apex's).

        Returns:
          None.

        Example:
          >>> opt.load_state_dict(checkpoint["optimizer"])  # doctest: +SKIP

        Cost: one pass over the saved state's shapes (no tensor data read), then the load.
        """
        where = "FP16_Optimizer.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where}: state_dict must be a dict (from state_dict()), got {type(state_dict).__name__}")
        for key in ("loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                    "optimizer_state_dict", "fp32_from_fp16"):
            if key not in state_dict:
                raise KeyError(f"{where}: state_dict has no {key!r} entry (keys: {sorted(map(str, state_dict))})")
        saved = state_dict["fp32_from_fp16"]
        if len(saved) != len(self.fp32_from_fp16_groups) or any(
                len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b))
                for a, b in zip(saved, self.fp32_from_fp16_groups)):
            raise ValueError("FP16_Optimizer.load_state_dict: the saved fp32_from_fp16 masters "
                             f"({[[tuple(t.shape) for t in g] for g in saved]}) do not match this optimizer's "
                             f"({[[tuple(t.shape) for t in g] for g in self.fp32_from_fp16_groups]})")
        self._check_optimizer_state(state_dict["optimizer_state_dict"], where)
        loss_scaler = AmpLossScaler.from_apex(state_dict["loss_scaler"])
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler = loss_scaler
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups, saved):
                for current, value in zip(current_group, saved_group):
                    current.copy_(value)

    def _check_optimizer_state(self, opt_sd, where: str) -> None:
        """Refuses (``ValueError`` naming the param and key) a saved optimizer state whose
        per-element tensors do not fit the params they would be loaded into. Group and param
        counts that differ are left to torch's own ``load_state_dict`` (it refuses them before
        loading anything)."""
        if not isinstance(opt_sd, dict) or not isinstance(opt_sd.get("state"), dict) \
                or not isinstance(opt_sd.get("param_groups"), (list, tuple)):
            raise TypeError(f"{where}: state_dict['optimizer_state_dict'] must be a torch optimizer state_dict "
                            "(a dict with 'state' and 'param_groups')")
        groups = self.optimizer.param_groups
        saved_groups = opt_sd["param_groups"]
        if len(saved_groups) != len(groups) or any(
                len(sg.get("params", ())) != len(g["params"]) for sg, g in zip(saved_groups, groups)):
            return  # torch's load_state_dict raises its ValueError before changing anything
        state = opt_sd["state"]
        for gi, (sg, g) in enumerate(zip(saved_groups, groups)):
            for pi, (pid, param) in enumerate(zip(sg["params"], g["params"])):
                entry = state.get(pid)
                if not isinstance(entry, dict):
                    continue
                live = self.optimizer.state.get(param, {})
                for key, value in entry.items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    held = live.get(key)
                    if isinstance(held, torch.Tensor):
                        expected = held.shape
                    elif key in _PER_ELEMENT_STATE:
                        expected = param.shape
                    else:
                        continue
                    if value.shape != expected:
                        kind = ("the fp32 master of an fp16/bf16 param" if any(param is m for m in
                                self.all_fp32_from_fp16_params) else f"a {param.dtype} param")
                        raise ValueError(
                            f"{where}: optimizer_state_dict state of param_groups[{gi}]['params'][{pi}] ({kind} of "
                            f"shape {tuple(param.shape)}) has {key!r} of shape {tuple(value.shape)}, expected "
                            f"{tuple(expected)}: the checkpoint is from a model with other shapes or with its params "
                            "in another order; nothing was loaded")

    # -- promoted attributes ----------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current scale as a Python float (apex: ``loss_scaler.loss_scale()``)."""
        return self.loss_scaler.loss_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        # Refused (ValueError naming loss_scale, nothing changed) unless in ampfunc.loss_scale.SCALE_RANGE once
        # stored in fp32: a 0, negative, NaN or inf scale would write NaN into model and masters.
        self.loss_scaler.set_loss_scale(value, "FP16_Optimizer.loss_scale")

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value
