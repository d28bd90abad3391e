"""apex's ``amp`` API (``initialize``, ``scale_loss``, ``master_params``, function registration) on ampfunc.

Migration is an import change::

    from ampfunc.compat.apex import amp                     # was: from apex import amp

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
    optimizer.step()

Opt levels, as apex defines them:

* ``O0``: fp32 model, static loss scale 1 (a no-op baseline).
* ``O1``: fp32 model whose forward runs under ``torch.autocast`` in fp16 (apex patched torch
  functions instead; autocast's op lists are its successor); outputs returned in fp32 (or
  ``cast_model_outputs``); dynamic loss scale.
* ``O2``: model cast to fp16 except affine BatchNorm, fp32 master weights owned by the
  optimizer (made at the first ``zero_grad``/``scale_loss``/``step``, as apex makes them, so a
  checkpoint loaded after ``initialize`` is what trains), dynamic loss scale;
  ``model.state_dict()`` returns fp32 tensors (apex's hook). The master grads are written after
  each backward as apex writes them; ``step`` of a ``torch.optim.SGD``/``Adam``/``AdamW`` runs
  torch's update, its state and the copy into the model as one fused pass per param group
  (:func:`ampfunc.compat._torch_step.torch_step_`; other optimizers: their own ``step``).
* ``O3``: model cast to fp16, no master weights, static loss scale 1.

The numbers are ampfunc's: each loss has an apex-semantics :class:`LossScaler` holding an
:class:`ampfunc.DynamicLossScale` (or :class:`ampfunc.StaticLossScale`) replaced by
:func:`ampfunc.update_scale`; the scaled loss is :func:`ampfunc.scale_loss`; gradients are
unscaled by :func:`ampfunc.ops.unscale` / :func:`ampfunc.ops.unscale_` with the finiteness flag
computed on the way; models are cast by :func:`ampfunc.cast_params` (through
``convert_network``). Like apex, leaving a ``scale_loss`` block reads the overflow flag back once
to decide whether the next ``optimizer.step()`` is skipped. Unlike apex, CPU models work.

Files, one concern each: ``_state`` (process-wide state), ``properties`` (opt levels and
settings), ``model`` (casts, patched forward, fp32 ``state_dict``), ``optimizer`` (master
weights, stashes, skipping), ``functions`` (O1 function registration), ``frontend`` (the API).
"""

from ampfunc.compat.apex._scaler import LossScaler
from ampfunc.compat.apex.amp._state import _amp_state, maybe_print  # noqa: F401
from ampfunc.compat.apex.amp.frontend import init, initialize, load_state_dict, master_params, scale_loss, state_dict
from ampfunc.compat.apex.amp.functions import (  # noqa: F401
    _USER_REGISTRY,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ampfunc.compat.apex.amp.properties import Properties  # noqa: F401

__all__ = [
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "init",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "LossScaler",
]
