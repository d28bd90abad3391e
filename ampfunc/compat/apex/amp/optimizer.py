"""What ``initialize`` does to optimizers: master weights (O2), gradient stashes, skipping a step.

Under master weights the fp32 masters are made lazily, as apex makes them: at the first
``zero_grad``, ``scale_loss`` or ``step`` after ``initialize``, from the model's weights at that
moment. So the restore order apex documents (``initialize``, then ``model.load_state_dict``,
``optimizer.load_state_dict``) trains from the loaded weights, and optimizer state loaded before
the masters exist is cast to the fp16 params' dtype first, then to fp32 (apex's rounding). The
masters themselves are :class:`ampfunc.compat.apex._master.MasterWeights`, the helper
``FP16_Optimizer`` uses too.

The O2 step: the master grads are written after every backward as apex writes them (unscaled,
accumulated; ``amp.master_params`` clipping reads and changes them). When the optimizer is a
``torch.optim.SGD``, ``Adam`` or ``AdamW`` the kernels follow (:func:`ampfunc.compat._torch_step.torch_step_`),
``step`` runs one fused pass per param group, segment and device that reads the master grads
and writes the masters, the optimizer's own state and the fp16 model params, instead of the
optimizer's own ``step`` and the copy back; otherwise that step, as before.
"""

from __future__ import annotations

import types

import torch

from ampfunc import ops
from ampfunc.compat import _torch_step
from ampfunc.compat.apex._master import LOW_PRECISION, MasterWeights
from ampfunc.compat.apex._scaler import LossScaler, all_finite_flags
from ampfunc.compat.apex.amp._state import maybe_print

__all__ = ["AmpStash", "patch_optimizer"]


class AmpStash:
    """What amp keeps on each optimizer (``optimizer._amp_stash``): masters, stashed grads, the pending skip."""

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool):
        self.optimizer = optimizer
        self.master_weights = master_weights
        self.params_have_scaled_gradients = False
        self.skip: tuple[int, LossScaler] | None = None
        self.masters: MasterWeights | None = None
        self.lazy_init_called = False
        # Without master weights: the params by dtype, and their grads set aside during a backward.
        self.all_fp16_params: list[torch.Tensor] = []
        self.all_fp32_params: list[torch.Tensor] = []
        self.fp16_grad_stash: list = []
        self.fp32_grad_stash: list = []
        if not master_weights:
            for group in optimizer.param_groups:
                self._sort_group(group)
            self.lazy_init_called = True

    def _sort_group(self, group: dict) -> None:
        for p in group["params"]:
            if p.dtype in LOW_PRECISION:
                self.all_fp16_params.append(p)
                self.fp16_grad_stash.append(None)
            else:
                self.all_fp32_params.append(p)
                self.fp32_grad_stash.append(None)

    def lazy_init(self) -> None:
        """Makes the fp32 masters from the model's current weights (once; master weights only)."""
        if self.lazy_init_called:
            return
        self.lazy_init_called = True
        self.masters = MasterWeights(self.optimizer)
        self.masters.clear_master_grads()
        for p in self.masters.all_fp32_from_fp32_params:
            p.grad = None  # apex's lazy init drops them too: the first backward starts clean
        self.fp32_grad_stash = [None] * len(self.masters.all_fp32_from_fp32_params)

    def add_group(self, group: dict) -> None:
        if not self.master_weights:
            self._sort_group(group)
        elif self.masters is not None:
            self.masters.ingest_group(group)  # new fp16 params get masters too
            self.fp32_grad_stash = [None] * len(self.masters.all_fp32_from_fp32_params)

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        return self.masters.all_fp32_from_fp16_params if self.masters is not None else []

    # Before a backward: set the current grads aside so that the new ones can be unscaled alone.
    def prepare_backward(self) -> None:
        self.lazy_init()
        if self.masters is not None:
            for p in self.masters.all_fp16_params:
                p.grad = None  # the masters hold the accumulated (unscaled) grads
            fp32 = self.masters.all_fp32_from_fp32_params
        else:
            for i, p in enumerate(self.all_fp16_params):
                self.fp16_grad_stash[i], p.grad = p.grad, None
            fp32 = self.all_fp32_params
        for i, p in enumerate(fp32):
            self.fp32_grad_stash[i], p.grad = p.grad, None

    # After a backward: new grads / scale (+ the stashed ones); returns the finiteness of the new grads.
    @torch.no_grad()
    def post_backward(self, scaler: LossScaler) -> torch.Tensor | None:
        self.lazy_init()
        inv = scaler.loss_state.inv_scale
        if self.masters is not None:
            flags = [self.masters.grads_to_masters(scaler, accumulate=True),
                     _models_are_masters(self.masters.all_fp32_from_fp32_params, self.fp32_grad_stash, inv)]
        else:
            flags = [_models_are_masters(self.all_fp16_params, self.fp16_grad_stash, inv),
                     _models_are_masters(self.all_fp32_params, self.fp32_grad_stash, inv)]
        return all_finite_flags([f for f in flags if f is not None])


def _models_are_masters(params, stash, inv) -> torch.Tensor | None:
    fresh, combined, stashed = [], [], []
    for i, p in enumerate(params):
        if p.grad is None:
            if stash[i] is not None:
                p.grad = stash[i]
        elif stash[i] is None:
            fresh.append(p.grad)
        else:
            combined.append(p.grad)
            stashed.append(stash[i])
        stash[i] = None
    flags = []
    if fresh:
        flags.append(ops.unscale_(fresh, inv.to(fresh[0].device)))
    if combined:
        outs, finite = ops.unscale(combined, inv.to(combined[0].device))
        # One rounding to the grad's dtype: new/scale + stashed computed in fp32.
        torch._foreach_copy_(combined, [o + s.float() for o, s in zip(outs, stashed)])
        flags.append(finite)
    return all_finite_flags(flags)


def _fused_master_step(masters: MasterWeights, optimizer, original_step) -> bool:
    """torch's step of the masters on their grads as they are, and the copy into the model, in
    one pass per group/segment/device; False (nothing written) when the engine cannot."""
    if not _torch_step.torch_step_supported(optimizer, instead_of=original_step):
        return False
    lists = masters.master_grad_step_lists()
    if lists is None or not _torch_step.torch_step_(optimizer, lists, instead_of=original_step):
        return False
    masters.masters_to_model(without_grad=True)  # as the copy back would: usually none
    return True


def patch_optimizer(optimizer: torch.optim.Optimizer, master_weights: bool) -> None:
    """Attaches an :class:`AmpStash` and wraps ``step``, ``zero_grad`` and ``add_param_group``."""
    stash = optimizer._amp_stash = AmpStash(optimizer, master_weights)
    original_step = optimizer.step
    original_zero_grad = optimizer.zero_grad
    original_add_param_group = optimizer.add_param_group

    def step(self, closure=None):
        stash.lazy_init()
        if stash.skip is not None:
            if closure is not None:
                raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
            loss_id, scaler = stash.skip
            stash.skip = None
            maybe_print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
                        f"{scaler.loss_scale()}")
            if stash.masters is not None:
                stash.masters.clear_master_grads()  # not cleared by model.zero_grad()
            return None
        if stash.masters is not None and stash.masters.all_fp16_params and closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        if stash.masters is not None and closure is None and _fused_master_step(stash.masters, self, original_step):
            stash.masters.clear_master_grads()
            return None
        if stash.masters is not None and stash.masters.all_fp16_params:
            retval = original_step()
            stash.masters.masters_to_model()
            stash.masters.clear_master_grads()
            return retval
        return original_step() if closure is None else original_step(closure)

    def zero_grad(self, set_to_none: bool = True):
        stash.lazy_init()
        original_zero_grad(set_to_none=set_to_none)
        if stash.masters is not None:
            for p in stash.masters.all_fp16_params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()
            stash.masters.clear_master_grads()

    def add_param_group(self, param_group):
        original_add_param_group(param_group)
        stash.add_group(self.param_groups[-1])

    # Bound methods (not plain functions) so that torch's LR schedulers can wrap them.
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    optimizer.add_param_group = types.MethodType(add_param_group, optimizer)
