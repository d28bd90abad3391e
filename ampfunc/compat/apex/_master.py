"""fp32 master weights for a torch optimizer: the one helper ``FP16_Optimizer`` and amp O2 share.

apex wrote this twice (``FP16_Optimizer.__init__`` and amp's ``lazy_init_with_master_weights``);
here both facades hold a :class:`MasterWeights`. It swaps each trainable fp16/bf16 param of the
optimizer's groups for an fp32 copy (moving any per-param state to it and recasting that state
to fp32), turns the model's scaled low-precision gradients into unscaled fp32 master gradients
in one pass per device (:func:`ampfunc.ops.unscale`, which also yields the finiteness flag), and
copies the updated masters back into the model (one ``_foreach_copy_`` per call). For a fused
step it checks the model grads without writing master grads (:meth:`MasterWeights.check_model_grads`)
and lists what :func:`ampfunc.compat._torch_step.torch_step_` updates in one pass (:meth:`MasterWeights.step_lists`
from the model grads, ``FP16_Optimizer``; :meth:`MasterWeights.master_grad_step_lists` from the
master grads, amp O2).
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
    def grads_to_masters(self, scaler: LossScaler, accumulate: bool, inv_scales: dict | None = None
                         ) -> torch.Tensor | None:
        """Master grads = model grads / scale in fp32; returns their finiteness (``None``: no grads).

        ``accumulate=True`` adds to master grads already there (amp's gradient accumulation
        across backward passes); ``False`` overwrites them (``FP16_Optimizer``). ``inv_scales``
        (device -> 0-d fp32 ``1 / scale``) overrides the scaler's current scale: the one a
        deferred check saw (:meth:`check_model_grads`). One read of the model grads and one
        fp32 write per device; no host sync.
        """
        pairs = [(p.grad, m) for p, m in zip(self.all_fp16_params, self.all_fp32_from_fp16_params)
                 if p.grad is not None]
        if not pairs:
            return None
        dev = pairs[0][0].device
        inv = inv_scales[dev] if inv_scales is not None else scaler.inv_scale(dev)
        outs, finite = ops.unscale([g for g, _ in pairs], inv)
        for (_, master), out in zip(pairs, outs):
            master.grad = out if (master.grad is None or not accumulate) else master.grad.add_(out)
        return finite

    @torch.no_grad()
    def check_model_grads(self, scaler: LossScaler, check: bool) -> tuple[torch.Tensor | None, dict]:
        """``(finite, inv_scales)`` of the model's low-precision grads, leaving the master grads
        unwritten (the fused step reads the model grads itself): ``finite`` from one read-only
        pass per device (:func:`ampfunc.ops.check`; ``None`` without grads or with
        ``check=False``, a static scale that never skips), ``inv_scales`` the scaler's current
        ``1 / scale`` per device, for the step that follows. No host sync."""
        by_dev: dict = {}
        for p in self.all_fp16_params:
            if p.grad is not None:
                by_dev.setdefault(p.grad.device, []).append(p.grad)
        inv_scales = {dev: scaler.inv_scale(dev) for dev in by_dev}
        flags = [ops.check(grads)[0] for grads in by_dev.values()] if check else []
        return all_finite_flags(flags), inv_scales

    def step_lists(self, inv_scales: dict) -> list | None:
        """Per param group, the segments :func:`ampfunc.compat._torch_step.torch_step_` takes: the masters
        whose model param has a grad (the model grads, scaled by ``inv_scales``, and the model
        params to write) and the fp32 params with a grad (already unscaled). None when the
        optimizer's groups are not the ones ingested, or when a master holds a grad while its
        model param has none (torch's step would use that stale grad)."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.fp16_groups):
            return None
        grad_scale = inv_scales.__getitem__
        out = []
        for fp16, masters, fp32 in zip(self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups):
            m_list, g_list, p_list = [], [], []
            for p, m in zip(fp16, masters):
                g = p.grad
                if g is None:
                    if m.grad is not None:
                        return None
                    continue
                if g.device not in inv_scales:
                    return None
                m_list.append(m)
                g_list.append(g)
                p_list.append(p)
            with_grad = [p for p in fp32 if p.grad is not None]
            out.append([(m_list, g_list, p_list, grad_scale), (with_grad, [p.grad for p in with_grad], None, None)])
        return out

    def master_grad_step_lists(self) -> list | None:
        """Per param group, the segments :func:`ampfunc.compat._torch_step.torch_step_` takes to step on the
        master grads as they are now (amp O2: unscaled, maybe clipped): the masters with a grad
        (their grads, and their model params to write) and the fp32 params with a grad. None
        when the optimizer's groups are not the ones ingested or a grad is not fp32 (what
        ``torch``'s own step would then compute is left to it)."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.fp16_groups):
            return None
        out = []
        for fp16, masters, fp32 in zip(self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups):
            pairs = [(m, p) for p, m in zip(fp16, masters) if m.grad is not None]
            with_grad = [p for p in fp32 if p.grad is not None]
            grads = [m.grad for m, _ in pairs] + [p.grad for p in with_grad]
            if any(g.dtype != torch.float32 for g in grads):
                return None
            out.append([([m for m, _ in pairs], grads[:len(pairs)], [p for _, p in pairs], None),
                        (with_grad, grads[len(pairs):], None, None)])
        return out

    @torch.no_grad()
    def masters_to_model(self, without_grad: bool = False) -> None:
        """Copies the masters into the model's params, rounding to their dtype (one ``_foreach_copy_``);
        ``without_grad=True``: only the masters holding no grad (a fused step wrote the others)."""
        pairs = [(p, m) for p, m in zip(self.all_fp16_params, self.all_fp32_from_fp16_params)
                 if not (without_grad and m.grad is not None)]
        if pairs:
            torch._foreach_copy_([p.data for p, _ in pairs], [m.detach() for _, m in pairs])

    def clear_master_grads(self) -> None:
        """Drops the master grads (``model.zero_grad()`` cannot reach them)."""
        for m in self.all_fp32_from_fp16_params:
            m.grad = None

    @staticmethod
    def finite_of(flags: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The AND of the given finiteness flags (``None`` entries ignored)."""
        return all_finite_flags([f for f in flags if f is not None])
