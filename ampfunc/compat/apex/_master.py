"""fp32 master weights for a torch optimizer: the one helper ``FP16_Optimizer`` and amp O2 share.

apex wrote this twice (``FP16_Optimizer.__init__`` and amp's ``lazy_init_with_master_weights``);
here both facades hold a :class:`MasterWeights`. It swaps each trainable fp16/bf16 param of the
optimizer's groups for an fp32 copy (moving any per-param state to it and recasting that state
to fp32), turns the model's scaled low-precision gradients into unscaled fp32 master gradients
in one pass per device (:func:`ampfunc.ops.unscale`, which also yields the finiteness flag), and
copies the updated masters back into the model (one ``_foreach_copy_`` per call).
"""

from __future__ import annotations

from typing import Callable

import torch

from ampfunc import ops
from ampfunc.compat.apex._scaler import LossScaler, all_finite_flags

__all__ = ["MasterWeights", "LOW_PRECISION"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


class MasterWeights:
    """fp32 masters of ``optimizer``'s trainable fp16/bf16 params, swapped into its param groups.

    Args:
      optimizer: a ``torch.optim.Optimizer``; its groups are changed in place.
      on_param: called as ``on_param(param)`` for each trainable param ingested (apex's verbose print).
      on_group: called as ``on_group(index)`` before each param group is ingested.

    Attributes (apex's names): ``fp16_groups``, ``fp32_from_fp16_groups``,
    ``fp32_from_fp32_groups`` (per param group) and the flat ``all_*`` lists.

    Cost: construction copies the low-precision params once (fp32) and recasts the optimizer
    state (``load_state_dict(state_dict())``, as apex does); no host sync.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, on_param: Callable | None = None,
                 on_group: Callable | None = None):
        self.optimizer = optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for i, group in enumerate(optimizer.param_groups):
            if on_group is not None:
                on_group(i)
            self.ingest_group(group, on_param)
        # Recasts the per-param state that moved to the masters to their dtype (apex's trick).
        optimizer.load_state_dict(optimizer.state_dict())

    def ingest_group(self, group: dict, on_param: Callable | None = None) -> None:
        """Swaps one param group's trainable fp16/bf16 params for fp32 masters (also for groups added later)."""
        fp16, masters, fp32 = [], [], []
        state = self.optimizer.state
        for j, param in enumerate(group["params"]):
            if not param.requires_grad:
                continue
            if on_param is not None:
                on_param(param)
            if param.dtype in LOW_PRECISION:
                master = param.detach().clone().float()
                master.requires_grad = True
                group["params"][j] = master
                if param in state:
                    state[master] = state.pop(param)
                fp16.append(param)
                masters.append(master)
            else:
                fp32.append(param)
        self.fp16_groups.append(fp16)
        self.fp32_from_fp16_groups.append(masters)
        self.fp32_from_fp32_groups.append(fp32)

    @property
    def all_fp16_params(self) -> list[torch.Tensor]:
        return [p for g in self.fp16_groups for p in g]

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        return [p for g in self.fp32_from_fp16_groups for p in g]

    @property
    def all_fp32_from_fp32_params(self) -> list[torch.Tensor]:
        return [p for g in self.fp32_from_fp32_groups for p in g]

    @torch.no_grad()
    def grads_to_masters(self, scaler: LossScaler, accumulate: bool) -> torch.Tensor | None:
        """Master grads = model grads / scale in fp32; returns their finiteness (``None``: no grads).

        ``accumulate=True`` adds to master grads already there (amp's gradient accumulation
        across backward passes); ``False`` overwrites them (``FP16_Optimizer``). One read of the
        model grads and one fp32 write per device; no host sync.
        """
        pairs = [(p.grad, m) for p, m in zip(self.all_fp16_params, self.all_fp32_from_fp16_params)
                 if p.grad is not None]
        if not pairs:
            return None
        outs, finite = ops.unscale([g for g, _ in pairs], scaler.inv_scale(pairs[0][0].device))
        for (_, master), out in zip(pairs, outs):
            master.grad = out if (master.grad is None or not accumulate) else master.grad.add_(out)
        return finite

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Copies the masters into the model's params, rounding to their dtype (one ``_foreach_copy_``)."""
        model, masters = self.all_fp16_params, self.all_fp32_from_fp16_params
        if model:
            torch._foreach_copy_([p.data for p in model], [m.detach() for m in masters])

    def clear_master_grads(self) -> None:
        """Drops the master grads (``model.zero_grad()`` cannot reach them)."""
        for m in self.all_fp32_from_fp16_params:
            m.grad = None

    @staticmethod
    def finite_of(flags: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The AND of the given finiteness flags (``None`` entries ignored)."""
        return all_finite_flags([f for f in flags if f is not None])
