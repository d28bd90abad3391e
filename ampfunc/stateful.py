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
on the local shards, so its optimizer state is sharded too; clip with
``af.dist.clip_by_global_norm(max_norm, group)``).
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any, NamedTuple, Optional

import torch

from ampfunc import ops
from ampfunc.engine import Engine, MixedPrecisionState
from ampfunc.loss_scale import LossScale, NoOpLossScale
from ampfunc.mixed import check_optimizer_transform, scale_loss
from ampfunc.transform import GradientTransformation
from ampfunc.tree import check_same_structure

__all__ = ["TrainerState", "ModuleTrainer"]


class TrainerState(NamedTuple):
    """``master``: fp32 copy of the (local shards of the) params when any is fp16/bf16, else
    ``None``; ``opt_state``: the optimizer's state; ``loss_scale``: the scale for the next loss;
    ``finite``: 0-d bool, the last step was applied (True before the first); ``skipped``: 0-d
    int64, the steps skipped so far."""

    master: Any
    opt_state: Any
    loss_scale: LossScale
    finite: Optional[torch.Tensor] = None
    skipped: Optional[torch.Tensor] = None




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
    it clears the grads. With a kernel-backed ``tx`` (``sgd``/``adam``/``adamw``, optionally
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
      set_grads_to_none: clear ``.grad`` after each step (as ``zero_grad(set_to_none=True)``).

    Example::

      trainer = af.ModuleTrainer(model, af.adamw(1e-3), loss_scale=af.DynamicLossScale())
      trainer.scale(loss).backward()
      finite = trainer.step()          # 0-d bool; trainer.skipped counts the skipped steps

    Cost: see :meth:`step`. Never syncs with the host.
    """

    def __init__(self, model: torch.nn.Module, tx: GradientTransformation, *, loss_scale: LossScale | None = None,
                 group=None, master_dtype: torch.dtype = torch.float32, set_grads_to_none: bool = True):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ModuleTrainer: model must be a torch.nn.Module, got {type(model).__name__}")
        check_optimizer_transform(tx, "ModuleTrainer")
        loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
        if not isinstance(loss_scale, LossScale):
            raise TypeError(f"ModuleTrainer: loss_scale must be a loss scale, got {type(loss_scale).__name__}")
        self.model = model
        self.tx = tx
        self.group = group
        self.set_grads_to_none = set_grads_to_none
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
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
        self._sharded = any(hasattr(p, "to_local") for p in self._plist)
        self._param_dict = None if self._sharded else dict(self._named)
        self._engine = Engine(tx, master_dtype=master_dtype, group=group, where="ModuleTrainer.step")
        st = self._engine.init(self._params(), loss_scale)
        self._state = TrainerState(st.master, st.inner, st.loss_scale, st.finite, st.skipped)

    # -- state --------------------------------------------------------------------------------

    @property
    def state(self) -> TrainerState:
        return self._state

    @state.setter
    def state(self, new: TrainerState) -> None:
        if not isinstance(new, TrainerState):
            raise TypeError(f"ModuleTrainer.state must be a TrainerState, got {type(new).__name__}")
        check_same_structure(new, self._state, "new state", "current state")
        self._state = new

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
            grads = [torch.zeros_like(params[n]) if g is None else g for n, g in zip(self._names, grads)]
        if self._sharded:
            grads = [_local(g) for g in grads]
        return dict(zip(self._names, grads))  # the params' key objects: compared in no time

    @property
    def engine(self) -> Engine:
        """The :class:`ampfunc.engine.Engine` that runs :meth:`step` (set ``engine.on_check`` to
        record which leaves overflowed, without a host sync)."""
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
        params = self._params()
        grads = self._grads(params)
        mp = MixedPrecisionState(st.master, st.opt_state, st.loss_scale, st.finite, st.skipped)
        # autograd gives every .grad its param's shape: no per-leaf shape check needed.
        _, mp = self._engine.step_(params, grads, mp, trust_grads=True)
        self._state = TrainerState(mp.master, mp.inner, mp.loss_scale, mp.finite, mp.skipped)
        if self.set_grads_to_none:
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
