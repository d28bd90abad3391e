"""``torch.optim``-style ``Adam`` and ``AdamW`` with ampfunc's low-memory states.

A drop-in for ``torch.optim.AdamW`` / ``Adam`` (and for bitsandbytes' ``AdamW8bit``, which is a
``torch.optim.Optimizer`` too) that keeps the states of :doc:`the low-memory guide
</guides/low_memory>` and rides the GradScaler facade's fused road::

    from ampfunc.compat.torch_optim import AdamW          # was: from torch.optim import AdamW
    from ampfunc.compat.torch_amp import GradScaler       # or torch.amp.GradScaler

    model = model.bfloat16()
    optimizer = AdamW(model.parameters(), lr=1e-3, moments="q8", master="split")
    scaler = GradScaler("cuda")
    ...
    scaler.scale(loss).backward()
    scaler.step(optimizer)      # grad_scale / found_inf handed over: unscaled and skipped on the device
    scaler.update()

The classes are ``torch.optim.Optimizer`` subclasses: param groups, ``zero_grad``, hooks, LR
schedulers (``group["lr"]`` is read at every step), ``state_dict`` / ``load_state_dict`` in
torch's form. Each param group is one state of :class:`ampfunc.engine.Engine` (the step behind
``af.mixed_precision(...).step_`` and ``af.ModuleTrainer``): the numbers are
``af.mixed_precision(af.adamw(..., moments=...), ..., master=...)``'s, bit for bit, and the
fused kernels (``ampfunc.ops.adam_step_``, ``adam_lowmem_step_``) run them.
"""

from __future__ import annotations

import math
from collections import abc
from typing import Any, Callable, Optional

import torch

from ampfunc import ops
from ampfunc.engine import Engine, MixedPrecisionState, skip_stats
from ampfunc.loss_scale import StaticLossScale
from ampfunc.lowmem import Q8Moment, SplitMaster, check_master, check_moments
from ampfunc.optim import adam as _adam
from ampfunc.optim import adamw as _adamw
from ampfunc.optim.adam import AdamState

__all__ = ["Adam", "AdamW"]

_SLOTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_NARROW = (torch.float16, torch.bfloat16)  # params that get an fp32 master with master="fp32"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _GroupLR:
    """The learning rate of a param group, read from ``group["lr"]`` at every step (so torch's LR
    schedulers, which write it, drive the step). A schedule in ampfunc's sense: called with the
    step count, which it ignores; returns a Python float, so the kernels take the same scalar a
    constant ``lr`` gives them."""

    __slots__ = ("group",)

    def __init__(self, group: dict):
        self.group = group

    def __call__(self, _count) -> float:
        return float(self.group["lr"])


class _Slot:
    """What one param group steps with: built from the group and ``optimizer.state``, so it can
    be rebuilt at any time (after unpickling, a changed setting). Holds no optimizer state of its
    own: the loss scale it hands the engine carries this step's ``grad_scale`` / ``found_inf``,
    ``finite`` / ``skipped`` are the engine's step statistics."""

    __slots__ = ("group", "settings", "engine", "keys", "loss_scale", "scaled", "finite", "skipped", "where")

    def __init__(self, group: dict, settings: tuple, engine: Engine, keys: list, device, where: str):
        self.group = group
        self.settings = settings
        self.engine = engine
        self.keys = keys
        # Made on the CPU (its value is read once there: no device sync) and moved.
        self.loss_scale = StaticLossScale(1.0).to(device)
        self.scaled = False
        self.finite, self.skipped = skip_stats(device)
        self.where = where


class Adam(torch.optim.Optimizer):
    """``torch.optim.Adam`` on ampfunc's engine, with low-memory states and the GradScaler fused road.

    Takes torch's arguments and adds two settings per param group (see the low-memory guide):
    ``moments`` (how ``exp_avg`` / ``exp_avg_sq`` are stored) and ``master`` (how fp32 masters of
    low-precision params are kept). Every param group is one state of the engine
    (:class:`ampfunc.engine.Engine`): the step equals
    ``af.mixed_precision(af.adam(..., moments=m), af.NoOpLossScale(), master=s).step_`` on the
    params that have a gradient, bit for bit, and runs the fused kernels.

    ``_step_supports_amp_scaling`` is True: :class:`ampfunc.compat.torch_amp.GradScaler` (and
    ``torch.amp.GradScaler``) set ``optimizer.grad_scale`` and ``optimizer.found_inf`` before
    ``step()``; the gradients are then unscaled by ``grad_scale`` inside the step (they are read,
    not written) and, when ``found_inf`` is nonzero, nothing is written: params, masters or their
    low halves, moments (q8 codes and absmaxes), step counts. Neither is read back to the host.

    Differences from torch, on purpose:

    - a group's step count is one 0-d tensor shared by its params (torch keeps one per param): a
      param without ``.grad`` is skipped, as in torch (not written, no decay), but the group's
      count advances, so when it has a gradient again its bias correction uses the group's count;
    - a non-finite gradient skips the group's step even without a scaler (torch would write NaN
      into the params);
    - ``grad_scale`` divides as a multiplication by its inverse (exact for the powers of two a
      GradScaler uses);
    - ``capturable=True`` and ``differentiable=True`` are refused; ``foreach`` and ``fused`` are
      accepted and kept in the groups, but the step is always ampfunc's fused pass; a tensor
      ``lr`` or ``betas`` is refused (pass floats).

    Args:
      params: an iterable of tensors, of ``(name, tensor)`` pairs, or of param group dicts
        (torch's forms); each group may set any of the options below.
      lr: the learning rate (read from ``group["lr"]`` at every step: LR schedulers work).
      betas: ``(beta1, beta2)``.
      eps: added to the denominator.
      weight_decay: L2 penalty (added to the gradient), or with ``decoupled_weight_decay``
        AdamW's decay.
      amsgrad: keep the running maximum of the second moment (the plain-torch road runs it).
      maximize: maximize the objective.
      foreach, fused: accepted as torch's (``None`` or a bool) and ignored.
      capturable, differentiable: must be False.
      decoupled_weight_decay: AdamW's decoupled decay (torch's ``Adam`` argument).
      moments: ``"fp32"`` (torch's), ``"bf16"`` or ``"q8"`` (8-bit codes with an fp32 absmax per
        block of 256 for leaves of at least 4,096 elements and a multiple of 256).
      master: ``"fp32"`` (bf16/fp16 params get an fp32 master copy, as apex's FP16_Optimizer;
        fp32 params are their own masters) or ``"split"`` (bf16 params are the high halves of
        exact fp32 masters and the state keeps the int16 low halves; fp16 params are refused).

    Returns:
      A ``torch.optim.Optimizer``. ``optimizer.state[p]`` holds, per param, ``step`` (the
      group's 0-d fp32 count), ``exp_avg`` and ``exp_avg_sq`` (fp32, bf16, or with ``q8`` uint8
      codes beside ``exp_avg_absmax`` / ``exp_avg_sq_absmax``), ``max_exp_avg_sq`` with
      ``amsgrad``, and ``master`` (an fp32 copy, ``master="fp32"`` in a group with bf16/fp16
      params) or ``master_remainder`` (int16 low halves, empty for an fp32 param,
      ``master="split"``). They are the optimizer's buffers: write into them in place.

    Example:
      >>> from ampfunc.compat.torch_optim import Adam
      >>> w = nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
      >>> opt = Adam([w], lr=1e-3, moments="q8", master="split")
      >>> w.grad = torch.ones_like(w)
      >>> opt.step()
      >>> sorted(opt.state[w])
      ['exp_avg', 'exp_avg_absmax', 'exp_avg_sq', 'exp_avg_sq_absmax', 'master_remainder', 'step']
      >>> opt.state[w]["exp_avg"].dtype, float(opt.state[w]["step"])
      (torch.uint8, 1.0)

    Cost: construction allocates the state at once (torch allocates it at the first step); per
    bf16 param with ``master="split"``, ``moments="q8"``: 2 bytes of low half, 2 bytes of codes
    and 8 bytes of absmax per 256 elements. ``step()`` is, per group, one read-only check of the
    gradients and one fused optimizer pass over the params that have a gradient (the plain-torch
    road for AMSGrad, for ``master="fp32"`` with low-precision params and low-memory moments, and
    for tensors the kernels do not take). No host sync, with or without a GradScaler.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False, moments: str = "fp32",
                 master: str = "fp32") -> None:
        self._slots: list = []
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay, moments=moments, master=master)
        self._check_options(defaults, type(self).__name__)
        super().__init__(params, defaults)

    # -- groups --------------------------------------------------------------------------------

    @staticmethod
    def _check_options(group: dict, where: str) -> tuple:
        """The engine's settings of ``group`` (a tuple, compared to find a changed group), after
        checking every option, naming it (torch's messages for torch's ranges)."""
        lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if isinstance(lr, torch.Tensor):
            raise TypeError(f"{where}: lr as a Tensor is not supported (torch's tensor-lr mode, for capturable "
                            "steps); pass a float")
        if not _number(lr):
            raise TypeError(f"{where}: lr must be a number, got {type(lr).__name__}")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        if any(isinstance(b, torch.Tensor) for b in betas):
            raise TypeError(f"{where}: betas as Tensors are not supported; pass floats")
        if not all(_number(b) for b in betas):
            raise TypeError(f"{where}: betas must be numbers, got {betas!r}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not _number(wd):
            raise TypeError(f"{where}: weight_decay must be a number, got {type(wd).__name__}")
        if not 0.0 <= wd:
            raise ValueError(f"Invalid weight_decay value: {wd}")
        for name in ("amsgrad", "maximize", "decoupled_weight_decay", "capturable", "differentiable"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{where}: {name} must be a bool, got {group[name]!r}")
        for name in ("foreach", "fused"):
            if group[name] is not None and not isinstance(group[name], bool):
                raise TypeError(f"{where}: {name} must be None or a bool, got {group[name]!r}")
        if group["capturable"]:
            raise ValueError(f"{where}: capturable=True is not supported (the step count is a device tensor "
                             "and the step never syncs with the host, but CUDA graph capture of this step is "
                             "untested); leave it False")
        if group["differentiable"]:
            raise ValueError(f"{where}: differentiable=True is not supported (the fused step is no autograd "
                             "graph); leave it False")
        check_moments(group["moments"], where)
        check_master(group["master"], where)
        return (bool(group["decoupled_weight_decay"]), float(betas[0]), float(betas[1]), float(eps), float(wd),
                group["amsgrad"], group["maximize"], group["moments"], group["master"])

    def _engine(self, group: dict, settings: tuple, where: str) -> Engine:
        decoupled, b1, b2, eps, wd, amsgrad, maximize, moments, master = settings
        make = _adamw if decoupled else _adam
        tx = make(_GroupLR(group), b1, b2, eps, wd, amsgrad, maximize, moments=moments)
        return Engine(tx, master_dtype=torch.float32, master=master, where=where)

    @staticmethod
    def _keys(group: dict) -> list:
        """The group's params as the engine's tree keys: their names when torch has them (and
        they are distinct), else ``"params[i]"``. Errors of the step name the leaf by them."""
        names = group.get("param_names")
        if names is not None and len(set(names)) == len(names) and all(isinstance(n, str) for n in names):
            return list(names)
        return [f"params[{i}]" for i in range(len(group["params"]))]

    def add_param_group(self, param_group: dict) -> None:
        """Adds a param group, as torch's ``add_param_group``, and makes its state at once.

        Args:
          param_group: a dict with ``"params"`` and any option of the constructor.

        Returns:
          None. The group's options are checked and its state made before it counts: a refused
          group (an unknown ``moments``, fp16 params with ``master="split"``, ...) leaves the
          optimizer as it was.

        Example:
          >>> from ampfunc.compat.torch_optim import AdamW
          >>> opt = AdamW([nn.Parameter(torch.ones(3))], lr=1e-3)
          >>> opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], "moments": "bf16"})
          >>> [g["moments"] for g in opt.param_groups]
          ['fp32', 'bf16']

        Cost: the group's state is allocated (one buffer per device and dtype); no host sync.
        """
        super().add_param_group(param_group)
        g = len(self.param_groups) - 1
        group = self.param_groups[g]
        try:
            self._init_group(g, group)
        except BaseException:
            self.param_groups.pop()
            raise

    def _init_group(self, g: int, group: dict) -> None:
        cls = type(self).__name__
        where = f"{cls}(param_groups[{g}])"
        settings = self._check_options(group, where)
        params = group["params"]
        if len(set(map(id, params))) != len(params):
            raise ValueError(f"{where}: a parameter appears twice in the group; the fused step would update it "
                             "twice -- list each parameter once")
        keys = self._keys(group)
        engine = self._engine(group, settings, where)  # init's errors name the group and the leaf
        mp = engine.init(dict(zip(keys, params)), StaticLossScale(1.0))
        for key, p in zip(keys, params):
            self.state[p] = self._entry(mp, key)
        while len(self._slots) < len(self.param_groups):
            self._slots.append(None)
        device = params[0].device if params else torch.device("cpu")
        self._slots[g] = _Slot(group, settings, engine, keys, device, f"{cls}.step (param_groups[{g}])")

    @staticmethod
    def _entry(mp: MixedPrecisionState, key) -> dict:
        """One param's entry of ``optimizer.state``: views of the engine state's tensors."""
        opt = mp.inner
        entry = {"step": opt.step}
        for f in _SLOTS:
            slot = getattr(opt, f)
            if slot is None:
                continue
            if isinstance(slot, Q8Moment):
                entry[f], entry[f + "_absmax"] = slot.codes[key], slot.absmax[key]
            else:
                entry[f] = slot[key]
        if isinstance(mp.master, SplitMaster):
            entry["master_remainder"] = mp.master.remainder[key]
        elif mp.master is not None:
            entry["master"] = mp.master[key]
        return entry

    def _slot(self, g: int, group: dict) -> _Slot:
        """The group's :class:`_Slot`, rebuilt when missing (after unpickling) or when the group's
        settings changed since (betas, eps, weight decay, maximize: the engine is remade; moments,
        master, amsgrad: refused, the state's layout depends on them)."""
        cls = type(self).__name__
        where = f"{cls}.step (param_groups[{g}])"
        while len(self._slots) < len(self.param_groups):
            self._slots.append(None)
        slot = self._slots[g]
        settings = self._check_options(group, where)
        if slot is not None and slot.group is group and slot.settings == settings and \
                len(slot.keys) == len(group["params"]):
            return slot
        if slot is not None and slot.group is group:
            for k, name in ((-2, "moments"), (-1, "master"), (5, "amsgrad")):
                if slot.settings[k] != settings[k]:
                    raise ValueError(f"{where}: param_groups[{g}][{name!r}] changed from {slot.settings[k]!r} to "
                                     f"{settings[k]!r} after its state was made; the state's layout depends on it "
                                     f"-- make a new optimizer with {name}={settings[k]!r}")
        params = group["params"]
        for i, p in enumerate(params):
            if "step" not in self.state.get(p, {}):
                raise ValueError(f"{where}: param_groups[{g}]['params'][{i}] has no state (added to the list by "
                                 "hand?); add parameters with add_param_group")
        first = self.state[params[0]] if params else None
        engine = self._engine(group, settings, f"{cls}(param_groups[{g}])")
        device = first["step"].device if first is not None else torch.device("cpu")
        slot = _Slot(group, settings, engine, self._keys(group), device, where)
        if self._slots[g] is not None and self._slots[g].group is group:
            old = self._slots[g]
            slot.finite, slot.skipped = old.finite, old.skipped
        self._slots[g] = slot
        return slot

    # -- the step ------------------------------------------------------------------------------

    @staticmethod
    def _amp_tensor(value, name: str, cls: str) -> Optional[torch.Tensor]:
        if value is None:
            return None
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_complex():
            what = f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
                else type(value).__name__
            raise TypeError(f"{cls}.step: optimizer.{name} must be a one-element real tensor (set by a GradScaler), "
                            f"got {what}")
        if name == "grad_scale" and not value.is_floating_point():
            raise TypeError(f"{cls}.step: optimizer.grad_scale must be a floating tensor, got {value.dtype}")
        return value

    def _prepare(self, g: int, group: dict, slot: _Slot) -> Optional[tuple]:
        """``(params, grads, state, after)`` for the group's params that have a gradient (None when
        none has): the engine's trees built from ``optimizer.state``'s tensors, so the engine
        writes them in place. ``after`` (or None) runs after the step."""
        params = group["params"]
        grads = ops.grads_of(params if type(params) is list else list(params))
        idx = [i for i, gr in enumerate(grads) if gr is not None]
        if not idx:
            return None
        for i in idx:
            if grads[i].layout != torch.strided:
                raise TypeError(f"{slot.where}: the .grad of param_groups[{g}]['params'][{i}] has layout "
                                f"{grads[i].layout}; only dense (strided) gradients are supported (densify it "
                                "with .to_dense())")
        if len(idx) == len(params):
            keys, ps, gs = slot.keys, list(params), grads
        else:
            keys = [slot.keys[i] for i in idx]
            ps = [params[i] for i in idx]
            gs = [grads[i] for i in idx]
        entries = [self.state[p] for p in ps]
        moments, master = slot.settings[-2], slot.settings[-1]

        def tree(field):
            if moments == "q8":
                return Q8Moment(dict(zip(keys, [e[field] for e in entries])),
                                dict(zip(keys, [e[field + "_absmax"] for e in entries])))
            return dict(zip(keys, [e[field] for e in entries]))

        inner = AdamState(entries[0]["step"], tree("exp_avg"), tree("exp_avg_sq"),
                          tree("max_exp_avg_sq") if slot.settings[5] else None)
        after = None
        if master == "split":
            mtree = SplitMaster(dict(zip(keys, [e["master_remainder"] for e in entries])))
        elif "master" not in entries[0]:
            mtree = None
        elif any(p.dtype in _NARROW for p in ps):
            mtree = dict(zip(keys, [e["master"] for e in entries]))
        else:
            # Only the group's fp32 (fp64) params have gradients: they step as their own masters
            # (the engine keeps masters only when some param needs one), and their master copies,
            # equal to them before, are set equal again after (a skipped step copies the same bits).
            mtree = None
            masters = [e["master"] for e in entries]

            def after():
                torch._foreach_copy_(masters, ps)

        state = MixedPrecisionState(mtree, inner, slot.loss_scale, slot.finite, slot.skipped)
        return dict(zip(keys, ps)), dict(zip(keys, gs)), state, after

    @staticmethod
    def _set_scale(slot: _Slot, grad_scale, found_inf) -> None:
        """Writes this step's scale into the group's loss scale, on the device: ``grad_scale``
        (1 without one), NaN when ``found_inf`` is nonzero (a NaN scale is not valid, so the
        engine skips the step and writes nothing). No host sync."""
        ls = slot.loss_scale.loss_scale
        if grad_scale is None and found_inf is None:
            if slot.scaled:
                ls.fill_(1.0)
                slot.scaled = False
            return
        value = torch.ones((), dtype=torch.float32, device=ls.device) if grad_scale is None else \
            grad_scale.detach().reshape(()).to(device=ls.device, dtype=torch.float32, non_blocking=True)
        if found_inf is not None:
            skip = found_inf.detach().reshape(()).to(device=ls.device, non_blocking=True) != 0
            value = torch.where(skip, torch.full_like(value, math.nan), value)
        ls.copy_(value)
        slot.scaled = True

    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One Adam/AdamW step of every param group, from the params' ``.grad``.

        With a GradScaler, ``optimizer.grad_scale`` (the scale the gradients carry; None after
        ``scaler.unscale_``) and ``optimizer.found_inf`` (nonzero: skip) are honoured: the
        gradients are unscaled inside the fused pass and a skipped step writes nothing. Params
        without ``.grad`` are skipped.

        Args:
          closure: reevaluates the model and returns the loss (torch's contract; run with grad
            enabled). A GradScaler refuses closures.

        Returns:
          The closure's loss, or None.

        Example:
          >>> from ampfunc.compat.torch_optim import AdamW
          >>> w = nn.Parameter(torch.ones(3))
          >>> opt = AdamW([w], lr=0.1, weight_decay=0.0)
          >>> w.grad = torch.tensor([1.0, -1.0, 0.0])
          >>> opt.step()
          >>> w.detach()
          tensor([0.9000, 1.1000, 1.0000])

        Cost: per group, one read-only check pass over the gradients and one fused optimizer
        pass (see the class); a few 0-d ops to take the scaler's tensors. No host sync.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        cls = type(self).__name__
        grad_scale = self._amp_tensor(getattr(self, "grad_scale", None), "grad_scale", cls)
        found_inf = self._amp_tensor(getattr(self, "found_inf", None), "found_inf", cls)
        # Every group is looked at before any is written.
        runs = []
        for g, group in enumerate(self.param_groups):
            slot = self._slot(g, group)
            prepared = self._prepare(g, group, slot)
            if prepared is not None:
                runs.append((slot, prepared))
        with torch.no_grad():
            for slot, (params, grads, state, after) in runs:
                self._set_scale(slot, grad_scale, found_inf)
                _, state = slot.engine.step_(params, grads, state, where=slot.where, trust_grads=True)
                slot.finite, slot.skipped = state.finite, state.skipped
                if after is not None:
                    after()
        return loss

    # -- checkpoints ---------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a :meth:`state_dict` of an optimizer with the same settings, in torch's form.

        Every entry is checked before anything is written: the groups and their sizes (torch's
        messages), each group's ``moments``, ``master`` and ``amsgrad`` (a state dict made with
        another setting is refused naming both), the hyper-parameters, and each param's entry:
        its keys, and each tensor's dtype and shape against this optimizer's. Then the tensors are
        copied into the optimizer's own (moved to their devices), and the groups' options taken
        from the state dict, as torch does. A state dict of ``torch.optim.Adam`` / ``AdamW``
        loads where the keys agree (``moments="fp32"``, fp32 params, no fp32 master copy) and its
        params of a group share one step count; a group without any state (saved before its first
        step) loads as a fresh state.

        Args:
          state_dict: a mapping with ``"state"`` and ``"param_groups"`` (from :meth:`state_dict`,
            possibly through ``torch.save`` / ``torch.load(weights_only=True)``).

        Returns:
          None.

        Example:
          >>> from ampfunc.compat.torch_optim import AdamW
          >>> w = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
          >>> a = AdamW([w], moments="bf16", master="split")
          >>> b = AdamW([nn.Parameter(torch.ones(8, dtype=torch.bfloat16))], moments="q8", master="split")
          >>> b.load_state_dict(a.state_dict())
          Traceback (most recent call last):
          ValueError: AdamW.load_state_dict: param_groups[0] was saved with moments='bf16' but ... moments='q8'...

        Cost: one host read of each group's step count (to check the params agree) and one copy
        per state tensor.
        """
        cls = type(self).__name__
        where = f"{cls}.load_state_dict"
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"{where}: state_dict must be a mapping (from state_dict()), got "
                            f"{type(state_dict).__name__}")
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise KeyError(f"{where}: state_dict has no {key!r} entry")
        groups, saved_groups, saved_state = self.param_groups, state_dict["param_groups"], state_dict["state"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        copies: list = []
        fresh: list = []
        new_options: list = []
        for g, (group, saved) in enumerate(zip(groups, saved_groups)):
            for name, default in (("moments", "fp32"), ("master", "fp32"), ("amsgrad", False)):
                theirs = saved.get(name, default)
                if theirs != group[name]:
                    note = " (a torch.optim state dict has no such entry)" if name not in saved else ""
                    raise ValueError(f"{where}: param_groups[{g}] was saved with {name}={theirs!r}{note} but this "
                                     f"optimizer's has {name}={group[name]!r}: the state dict was made with another "
                                     f"setting -- build the optimizer with {name}={theirs!r} to load it")
            options = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            self._check_options({**group, **options}, f"{where}: param_groups[{g}]")
            new_options.append((group, options))
            entries = [saved_state.get(sid) for sid in saved["params"]]
            if all(e is None for e in entries):
                fresh.append(g)
                continue
            steps = []
            for i, (p, e) in enumerate(zip(group["params"], entries)):
                at = f"{where}: the state of param_groups[{g}]['params'][{i}]"
                if e is None:
                    raise ValueError(f"{at} is missing while other params of its group have one; the group keeps "
                                     "one step count for all its params -- save and load the whole group")
                if not isinstance(e, abc.Mapping):
                    raise TypeError(f"{at} must be a dict, got {type(e).__name__}")
                ours = self.state[p]
                if set(e) != set(ours):
                    raise ValueError(f"{at} has the entries {sorted(map(str, e))} but this optimizer (moments="
                                     f"{group['moments']!r}, master={group['master']!r}, amsgrad={group['amsgrad']}) "
                                     f"keeps {sorted(ours)} for it: the state dict was made with another setting or "
                                     "for params of other dtypes")
                for key, cur in ours.items():
                    value = e[key]
                    if key == "step":
                        if isinstance(value, torch.Tensor):
                            if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
                                raise TypeError(f"{at}['step'] must be a number or a one-element tensor, got a "
                                                f"{value.dtype} tensor of shape {tuple(value.shape)}")
                            steps.append(float(value.reshape(()).item()))
                        elif _number(value):
                            steps.append(float(value))
                        else:
                            raise TypeError(f"{at}['step'] must be a number or a tensor, got {type(value).__name__}")
                        continue
                    if not isinstance(value, torch.Tensor) or value.dtype != cur.dtype or value.shape != cur.shape:
                        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
                            else type(value).__name__
                        raise ValueError(f"{at}[{key!r}] is {got} but this optimizer (moments={group['moments']!r}, "
                                         f"master={group['master']!r}) keeps {cur.dtype} {tuple(cur.shape)}: the "
                                         "state dict was made with another setting or for other params")
                    if value.is_meta:
                        raise ValueError(f"{at}[{key!r}] is on the meta device (it holds no data)")
                    copies.append((cur, value))
            if len(set(steps)) > 1:
                raise ValueError(f"{where}: the params of param_groups[{g}] have different step counts "
                                 f"({sorted(set(steps))}); this optimizer keeps one count per group")
            copies.append((self.state[group["params"][0]]["step"], torch.tensor(steps[0], dtype=torch.float32)))
        # Everything checked: write.
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src)
            for g in fresh:
                self._reset_group(g, groups[g])
        for group, options in new_options:
            group.update(options)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _reset_group(self, g: int, group: dict) -> None:
        """The group's state as a fresh optimizer has it, written into its tensors."""
        slot = self._slot(g, group)
        params = group["params"]
        mp = slot.engine.init(dict(zip(slot.keys, params)), StaticLossScale(1.0))
        for key, p in zip(slot.keys, params):
            new = self._entry(mp, key)
            for name, dst in self.state[p].items():
                if name != "step":
                    dst.copy_(new[name])
        if params:
            self.state[params[0]]["step"].zero_()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._slots = []


class AdamW(Adam):
    """``torch.optim.AdamW`` on ampfunc's engine, with low-memory states and the GradScaler fused road.

    :class:`Adam` with decoupled weight decay (``p *= 1 - lr * weight_decay`` before the Adam
    step) and torch's AdamW default ``weight_decay=1e-2``; everything else, the differences from
    torch included, is :class:`Adam`'s. The step equals
    ``af.mixed_precision(af.adamw(..., moments=m), af.NoOpLossScale(), master=s).step_`` bit for
    bit.

    Args:
      params: an iterable of tensors, of ``(name, tensor)`` pairs, or of param group dicts.
      lr: the learning rate (read from ``group["lr"]`` at every step).
      betas: ``(beta1, beta2)``.
      eps: added to the denominator.
      weight_decay: the decoupled decay coefficient.
      amsgrad: keep the running maximum of the second moment.
      maximize: maximize the objective.
      foreach, fused: accepted as torch's and ignored.
      capturable, differentiable: must be False.
      moments: ``"fp32"``, ``"bf16"`` or ``"q8"``.
      master: ``"fp32"`` or ``"split"``.

    Returns:
      A ``torch.optim.Optimizer`` whose ``state`` entries are :class:`Adam`'s.

    Example:
      >>> from ampfunc.compat.torch_optim import AdamW
      >>> from ampfunc.compat.torch_amp import GradScaler
      >>> model = nn.Linear(64, 64).bfloat16()
      >>> opt = AdamW(model.parameters(), lr=1e-3, moments="q8", master="split")
      >>> scaler = GradScaler("cpu", init_scale=1024.0)
      >>> scaler.scale(model(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum()).backward()
      >>> next(model.parameters()).grad[0, 0] = float("inf")      # an overflow: the step is skipped
      >>> scaler.step(opt)
      >>> scaler.update()
      >>> scaler.get_scale(), float(opt.state[model.weight]["step"])
      (512.0, 0.0)

    Cost: as :class:`Adam`'s: per group one check pass and one fused pass; no host sync.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, moments: str = "fp32", master: str = "fp32") -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, moments=moments, master=master)
