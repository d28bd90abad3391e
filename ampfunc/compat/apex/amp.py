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
  optimizer, dynamic loss scale.
* ``O3``: model cast to fp16, no master weights, static loss scale 1.

The numbers are ampfunc's: each loss has a :class:`ampfunc.DynamicLossScale` (or
:class:`ampfunc.StaticLossScale`) replaced by :func:`ampfunc.update_scale`; the scaled loss
is :func:`ampfunc.scale_loss`; gradients are unscaled by :func:`ampfunc.ops.unscale` /
:func:`ampfunc.ops.unscale_` with the finiteness flag computed on the way; models are cast by
:func:`ampfunc.cast_params` (through ``convert_network``) and inputs by
:func:`ampfunc.cast_floating`. Like apex, leaving a ``scale_loss`` block reads the overflow
flag back once to decide whether the next ``optimizer.step()`` is skipped. Unlike apex, CPU
models work.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable

import torch

from ampfunc import ops
from ampfunc.compat.apex.fp16_utils.fp16util import convert_network, master_params_to_model_params
from ampfunc.loss_scale import DynamicLossScale, StaticLossScale
from ampfunc.mixed import scale_loss as _scale_loss
from ampfunc.mixed import update_scale as _update_scale
from ampfunc.policy import cast_floating

__all__ = [
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "LossScaler",
]

_LOW = (torch.float16, torch.bfloat16)

_OPT_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
}


# ----------------------------------------------------------------------------------------------
# global state (apex keeps the same: one amp configuration per process)
# ----------------------------------------------------------------------------------------------


class _Handle:
    """The active amp configuration: the functions it patched, restorable by ``_deactivate``."""

    def __init__(self, patch_torch_functions: bool):
        self.patch_torch_functions = patch_torch_functions
        self._active = True
        self._patched: list[tuple[Any, str, Any]] = []

    def is_active(self) -> bool:
        return self._active

    def _deactivate(self) -> None:
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        self._active = False


class _AmpState:
    def __init__(self):
        self.opt_properties: Properties | None = None
        self.loss_scalers: list[LossScaler] = []
        self.handle: _Handle | None = None
        self.verbosity = 1
        # apex's escape hatch for models whose params are not all fp32 at initialize().
        self.allow_incoming_model_not_fp32 = False


_amp_state = _AmpState()


def maybe_print(msg: str) -> None:
    if _amp_state.verbosity > 0:
        print(msg)


def _active_handle() -> _Handle | None:
    h = _amp_state.handle
    return h if h is not None and h.is_active() else None


# ----------------------------------------------------------------------------------------------
# properties of an opt level
# ----------------------------------------------------------------------------------------------


class Properties:
    """The settings of one ``initialize`` call: the opt level's defaults with the user's overrides."""

    def __init__(self, enabled: bool = True, opt_level: str | None = None, **settings):
        self.enabled = enabled
        self.opt_level = opt_level
        self.cast_model_type = settings.get("cast_model_type")
        self.patch_torch_functions = settings.get("patch_torch_functions", False)
        self.keep_batchnorm_fp32 = settings.get("keep_batchnorm_fp32")
        self.master_weights = settings.get("master_weights")
        self.loss_scale = settings.get("loss_scale", 1.0)
        self.cast_model_outputs = settings.get("cast_model_outputs")

    def __repr__(self) -> str:
        return "Properties(" + ", ".join(f"{k}={v!r}" for k, v in vars(self).items()) + ")"


def _bool_setting(name: str, value):
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise ValueError(f"amp.initialize: {name} must be True, False, 'True', 'False' or None, got {value!r}")


def _properties(opt_level, overrides) -> Properties:
    if opt_level not in _OPT_LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  Note that in "
            "`O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
        )
    settings = dict(_OPT_LEVELS[opt_level])
    for key, value in overrides.items():
        if value is None:
            continue
        if key in ("keep_batchnorm_fp32", "master_weights", "patch_torch_functions"):
            value = _bool_setting(key, value)
        elif key == "cast_model_type":
            if value is not False and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"amp.initialize: cast_model_type must be a floating torch.dtype or False, got {value!r}")
        elif key == "loss_scale":
            if value != "dynamic":
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise ValueError(f"amp.initialize: loss_scale must be 'dynamic' or a number, got {value!r}") from None
                if not value > 0:
                    raise ValueError(f"amp.initialize: loss_scale must be > 0, got {value!r}")
        elif key == "cast_model_outputs":
            if not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"amp.initialize: cast_model_outputs must be a floating torch.dtype, got {value!r}")
        settings[key] = value
    if opt_level == "O1":
        if settings["cast_model_type"] not in (None, False):
            raise ValueError(
                "O1 inserts casts around Torch functions rather than model weights, so with O1, the model "
                "weights themselves should remain FP32. If you wish to cast the model to a different type, "
                "use opt_level='O2' or 'O3'. (got cast_model_type="
                f"{settings['cast_model_type']})")
        if settings["master_weights"]:
            raise ValueError("It doesn't make sense to use master_weights with O1. With O1, your model "
                             "weights themselves should be FP32.")
        if settings["keep_batchnorm_fp32"] is not None:
            raise ValueError("With opt_level O1, batchnorm functions are automatically patched to run in "
                             "FP32, so keep_batchnorm_fp32 should be None. (got keep_batchnorm_fp32="
                             f"{settings['keep_batchnorm_fp32']})")
    return Properties(True, opt_level, **settings)


# ----------------------------------------------------------------------------------------------
# loss scalers
# ----------------------------------------------------------------------------------------------


class LossScaler:
    """One loss's scale (apex's ``amp.scaler.LossScaler``), holding an ampfunc loss-scale pytree.

    ``"dynamic"``: :class:`ampfunc.DynamicLossScale` starting at ``min(max_loss_scale,
    init_scale)``, halving on overflow (floored at ``min_loss_scale`` when given), doubling
    after ``scale_window`` clean steps (capped at ``max_loss_scale``). A number: a
    :class:`ampfunc.StaticLossScale`, which never skips.
    """

    def __init__(self, loss_scale, init_scale: float = 2.0**16, scale_factor: float = 2.0,
                 scale_window: int = 2000, min_loss_scale: float | None = None, max_loss_scale: float = 2.0**24):
        self.dynamic = loss_scale == "dynamic"
        # A static scale is also kept as a Python float: scale_loss checks it on the host every
        # backward (the "scale 1, nothing to do" shortcut) and must not sync for that.
        self._static_value = None if self.dynamic else float(loss_scale)
        if self.dynamic:
            self._ls = DynamicLossScale(min(max_loss_scale, init_scale), growth_factor=2.0, backoff_factor=0.5,
                                        growth_interval=scale_window, min_scale=min_loss_scale or 0.0,
                                        max_scale=max_loss_scale)
        else:
            self._ls = StaticLossScale(float(loss_scale))

    @property
    def loss_state(self):
        """The held ampfunc loss scale."""
        return self._ls

    def loss_scale(self) -> float:
        """The current scale as a Python float (one host read)."""
        return float(self._ls.loss_scale.item())

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        ls = self._ls
        t = torch.full((), float(value), dtype=torch.float32, device=ls.loss_scale.device)
        if self.dynamic:
            self._ls = DynamicLossScale.from_tensors(t, ls.growth_tracker, ls.hysteresis_tracker, ls.config)
        else:
            self._static_value = float(value)
            self._ls = StaticLossScale(t)

    @property
    def _unskipped(self) -> int:
        return int(self._ls.growth_tracker.item()) if self.dynamic else 0

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        if self.dynamic:
            ls = self._ls
            t = torch.full((), int(value), dtype=torch.int32, device=ls.loss_scale.device)
            self._ls = DynamicLossScale.from_tensors(ls.loss_scale, t, ls.hysteresis_tracker, ls.config)

    def _follow(self, device: torch.device) -> None:
        if self._ls.loss_scale.device != device:
            self._ls = self._ls.to(device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self._follow(loss.device)
        return _scale_loss(loss, self._ls)

    def update_scale(self, finite: torch.Tensor) -> bool:
        """Advances the scale; returns whether the step must be skipped (reads the flag back once)."""
        overflow = not bool(finite)
        if self.dynamic:
            self._follow(finite.device)
            self._ls = _update_scale(self._ls, finite)
        return overflow and self.dynamic

    def __repr__(self) -> str:
        return f"LossScaler({'dynamic' if self.dynamic else 'static'}, loss_scale={self.loss_scale()})"


def _all_finite(flags: list[torch.Tensor]) -> torch.Tensor | None:
    if not flags:
        return None
    dev = flags[0].device
    return torch.stack([f.to(dev).reshape(()) for f in flags]).all()


# ----------------------------------------------------------------------------------------------
# optimizer processing
# ----------------------------------------------------------------------------------------------


class _AmpStash:
    """What amp keeps on each optimizer: param lists by dtype, stashed grads, the pending skip."""

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool):
        self.master_weights = master_weights
        self.params_have_scaled_gradients = False
        self.skip: tuple[int, LossScaler] | None = None
        self.all_fp16_params: list[torch.Tensor] = []  # low-precision model params (fp16/bf16)
        self.all_fp32_from_fp16_params: list[torch.Tensor] = []  # their fp32 masters (master_weights only)
        self.all_fp32_params: list[torch.Tensor] = []
        self.fp16_grad_stash: list = []
        self.fp32_grad_stash: list = []
        for group in optimizer.param_groups:
            self.ingest_group(optimizer, group)
        if master_weights and self.all_fp16_params:
            optimizer.load_state_dict(optimizer.state_dict())  # recast moved state to fp32

    def ingest_group(self, optimizer: torch.optim.Optimizer, group: dict) -> None:
        """Sorts a param group's params by dtype; with master weights, swaps fp16/bf16 params for fp32 masters."""
        for i, p in enumerate(group["params"]):
            if p.dtype in _LOW and self.master_weights:
                master = p.detach().clone().float()
                master.requires_grad = True
                group["params"][i] = master
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                self.all_fp16_params.append(p)
                self.all_fp32_from_fp16_params.append(master)
                self.fp16_grad_stash.append(None)
            elif p.dtype in _LOW:
                self.all_fp16_params.append(p)
                self.fp16_grad_stash.append(None)
            else:
                self.all_fp32_params.append(p)
                self.fp32_grad_stash.append(None)

    # Before a backward: set the current grads aside so that the new ones can be unscaled alone.
    def prepare_backward(self) -> None:
        if self.master_weights:
            for p in self.all_fp16_params:
                p.grad = None  # the masters hold the accumulated (unscaled) grads
        else:
            for i, p in enumerate(self.all_fp16_params):
                self.fp16_grad_stash[i], p.grad = p.grad, None
        for i, p in enumerate(self.all_fp32_params):
            self.fp32_grad_stash[i], p.grad = p.grad, None

    # After a backward: new grads / scale (+ the stashed ones); returns the finiteness of the new grads.
    @torch.no_grad()
    def post_backward(self, scaler: LossScaler) -> torch.Tensor | None:
        inv = scaler.loss_state.inv_scale
        flags = []
        if self.master_weights:
            pairs = [(p.grad, m) for p, m in zip(self.all_fp16_params, self.all_fp32_from_fp16_params)
                     if p.grad is not None]
            if pairs:
                outs, finite = ops.unscale([g for g, _ in pairs], inv.to(pairs[0][0].device))
                for (_, master), out in zip(pairs, outs):
                    master.grad = out if master.grad is None else master.grad.add_(out)
                flags.append(finite)
        else:
            flags.append(self._models_are_masters(self.all_fp16_params, self.fp16_grad_stash, inv))
        flags.append(self._models_are_masters(self.all_fp32_params, self.fp32_grad_stash, inv))
        return _all_finite([f for f in flags if f is not None])

    @staticmethod
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
        return _all_finite(flags)


def _patch_optimizer(optimizer: torch.optim.Optimizer, master_weights: bool) -> None:
    stash = optimizer._amp_stash = _AmpStash(optimizer, master_weights)
    original_step = optimizer.step
    original_zero_grad = optimizer.zero_grad

    def step(self, closure=None):
        if stash.skip is not None:
            if closure is not None:
                raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
            loss_id, scaler = stash.skip
            stash.skip = None
            maybe_print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
                        f"{scaler.loss_scale()}")
            for m in stash.all_fp32_from_fp16_params:
                m.grad = None  # not cleared by model.zero_grad()
            return None
        if stash.master_weights and stash.all_fp16_params:
            if closure is not None:
                raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
            retval = original_step()
            master_params_to_model_params(stash.all_fp16_params, stash.all_fp32_from_fp16_params)
            for m in stash.all_fp32_from_fp16_params:
                m.grad = None
            return retval
        return original_step() if closure is None else original_step(closure)

    def zero_grad(self, set_to_none: bool = True):
        original_zero_grad(set_to_none=set_to_none)
        for p in stash.all_fp16_params if stash.master_weights else ():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()
        for m in stash.all_fp32_from_fp16_params:
            m.grad = None

    original_add_param_group = optimizer.add_param_group

    def add_param_group(self, param_group):
        original_add_param_group(param_group)
        stash.ingest_group(self, self.param_groups[-1])  # new fp16 params get masters too

    # Bound methods (not plain functions) so that torch's LR schedulers can wrap them.
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    optimizer.add_param_group = types.MethodType(add_param_group, optimizer)


# ----------------------------------------------------------------------------------------------
# model processing
# ----------------------------------------------------------------------------------------------


def _device_type(args, kwargs, model) -> str:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _patch_forward(model: torch.nn.Module, props: Properties) -> None:
    original = model.forward
    input_dtype = props.cast_model_type if props.cast_model_type else None
    output_dtype = props.cast_model_outputs or torch.float32
    autocast = props.patch_torch_functions

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if input_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), input_dtype)
        if autocast:
            with torch.autocast(_device_type(args, kwargs, model), dtype=torch.float16):
                out = original(*args, **kwargs)
        else:
            out = original(*args, **kwargs)
        return cast_floating(out, output_dtype)

    model.forward = forward


def _check_models(models, what="models") -> list[torch.nn.Module]:
    for i, m in enumerate(models):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"amp.initialize: {what}[{i}] is a {type(m).__name__}, expected a torch.nn.Module")
        if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            raise RuntimeError(f"amp.initialize: {what}[{i}] is wrapped in {type(m).__name__}; call "
                               "amp.initialize on the bare model and wrap it afterwards")
        if not _amp_state.allow_incoming_model_not_fp32:
            for name, p in m.named_parameters():
                if p.is_floating_point() and p.dtype != torch.float32:
                    raise TypeError(
                        f"Found param {name} of {what}[{i}] with dtype {p.dtype}, expected torch.float32. "
                        "When using amp.initialize, you do not need to call .half() on your model before "
                        "passing it, no matter what optimization level you choose.")
    return list(models)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def initialize(models, optimizers=None, enabled: bool = True, opt_level: str = "O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None, loss_scale=None,
               cast_model_outputs=None, num_losses: int = 1, verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float = 2.0**24):
    """Prepares models and optimizers for the opt level; returns them in the shape they came in.

    ``models`` is a module or a list of modules; ``optimizers`` an optimizer, a list of them,
    or ``None`` (then only the models are returned). Models are cast in place and their
    ``forward`` patched (inputs cast to the model type: floating tensors, containers of
    them, objects with ``.to(dtype)``; numpy arrays, strings and integer tensors pass through;
    nothing is moved to another device). Optimizers are patched in place (master weights,
    skipping). Overrides: ``cast_model_type``, ``patch_torch_functions``,
    ``keep_batchnorm_fp32``, ``master_weights``, ``loss_scale`` (``"dynamic"`` or a number),
    ``cast_model_outputs``; ``num_losses`` creates one loss scaler per loss (``loss_id`` in
    :func:`scale_loss`). Inconsistent settings raise ``ValueError`` naming them.
    """
    _amp_state.verbosity = verbosity
    models_was_list = isinstance(models, (list, tuple))
    model_list = list(models) if models_was_list else [models]
    if optimizers is None:
        opt_list, optimizers_was_list = [], False
    elif isinstance(optimizers, torch.optim.Optimizer):
        opt_list, optimizers_was_list = [optimizers], False
    elif isinstance(optimizers, (list, tuple)):
        opt_list, optimizers_was_list = list(optimizers), True
    else:
        raise TypeError(f"amp.initialize: optimizers must be an Optimizer, a list of them or None, "
                        f"got {type(optimizers).__name__}")

    def result():
        out_models = model_list if models_was_list else model_list[0]
        if optimizers is None:
            return out_models
        return out_models, (opt_list if optimizers_was_list else opt_list[0])

    if not enabled:
        _amp_state.opt_properties = Properties(enabled=False)
        return result()

    props = _properties(opt_level, dict(cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
                                        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                                        loss_scale=loss_scale, cast_model_outputs=cast_model_outputs))
    if int(num_losses) != num_losses or num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be an integer >= 1, got {num_losses!r}")
    if min_loss_scale is not None and max_loss_scale is not None and min_loss_scale > max_loss_scale:
        raise ValueError(f"amp.initialize: min_loss_scale ({min_loss_scale}) > max_loss_scale ({max_loss_scale})")
    _check_models(model_list)
    for i, opt in enumerate(opt_list):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"amp.initialize: optimizers[{i}] is a {type(opt).__name__}, expected a torch.optim.Optimizer")
        if hasattr(opt, "_amp_stash"):
            raise RuntimeError(f"amp.initialize: optimizers[{i}] was already processed by amp.initialize")

    if _amp_state.handle is not None:
        _amp_state.handle._deactivate()
    for model in model_list:
        if props.cast_model_type:
            if props.keep_batchnorm_fp32:
                convert_network(model, props.cast_model_type)
            else:
                model.to(props.cast_model_type)
        if props.cast_model_type or props.patch_torch_functions or props.cast_model_outputs:
            _patch_forward(model, props)
    for opt in opt_list:
        _patch_optimizer(opt, bool(props.master_weights))
    _amp_state.loss_scalers = [LossScaler(props.loss_scale, min_loss_scale=min_loss_scale,
                                          max_loss_scale=max_loss_scale) for _ in range(int(num_losses))]
    _amp_state.opt_properties = props
    handle = _Handle(props.patch_torch_functions)
    if props.patch_torch_functions:
        for module, name, cast in _USER_REGISTRY:
            original = getattr(module, name)
            handle._patched.append((module, name, original))
            setattr(module, name, _cast_wrapper(original, cast))
        _USER_REGISTRY.clear()
    _amp_state.handle = handle
    maybe_print(f"Selected optimization level {opt_level}; {props}")
    return result()


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False,
               delay_overflow_check: bool = False):
    """Yields ``loss.float() * scale``; on exit unscales the grads of ``optimizers`` and checks them.

    Pass every optimizer owning params this backward reaches. On exit the new gradients are
    divided by the scale (added to gradients accumulated earlier, which were already
    unscaled), the scale advances, and if they overflowed the next ``step()`` of each of these
    optimizers is skipped (with a message). ``delay_unscale=True`` leaves the gradients scaled
    for a later ``scale_loss`` to unscale together (gradient accumulation).
    """
    props = _amp_state.opt_properties
    if props is None:
        raise RuntimeError("Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
                           "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
                           "before `with amp.scale_loss`.")
    if not props.enabled:
        yield loss
        return
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    for i, opt in enumerate(opts):
        if not hasattr(opt, "_amp_stash"):
            raise RuntimeError(f"amp.scale_loss: optimizer {i} ({type(opt).__name__}) was not returned by "
                               "amp.initialize")
    if not 0 <= loss_id < len(_amp_state.loss_scalers):
        raise ValueError(f"amp.scale_loss: loss_id={loss_id} but amp.initialize was called with "
                         f"num_losses={len(_amp_state.loss_scalers)}")
    scaler = _amp_state.loss_scalers[loss_id]
    if not props.master_weights and not scaler.dynamic and scaler._static_value == 1.0:
        yield loss.float()
        return
    if not delay_unscale:
        for opt in opts:
            if not opt._amp_stash.params_have_scaled_gradients:
                opt._amp_stash.prepare_backward()
    yield scaler.scale(loss)
    if delay_unscale:
        for opt in opts:
            opt._amp_stash.params_have_scaled_gradients = True
        return
    flags = []
    for opt in opts:
        flags.append(opt._amp_stash.post_backward(scaler))
        opt._amp_stash.params_have_scaled_gradients = False
    if delay_overflow_check:
        return
    finite = _all_finite([f for f in flags if f is not None])
    if finite is None:  # no gradient reached these optimizers: a clean step for the scale (apex's count)
        finite = torch.ones((), dtype=torch.bool, device=scaler.loss_state.loss_scale.device)
    if scaler.update_scale(finite):
        for opt in opts:
            if opt._amp_stash.skip is None:
                opt._amp_stash.skip = (loss_id, scaler)


def master_params(optimizer: torch.optim.Optimizer):
    """The params the optimizer updates (fp32 masters under O2): what to clip."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination=None) -> dict:
    """``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}`` (apex's format)."""
    destination = {} if destination is None else destination
    for i, s in enumerate(_amp_state.loss_scalers):
        destination[f"loss_scaler{i}"] = {"loss_scale": s.loss_scale(), "unskipped": s._unskipped}
    return destination


def load_state_dict(state_dict: dict) -> None:
    """Restores :func:`state_dict`; extra scalers are skipped with a message, unknown keys raise ``RuntimeError``."""
    if len(state_dict) != len(_amp_state.loss_scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(_amp_state.loss_scalers)} "
              "loss_scalers are used")
    unexpected = [k for k in state_dict if "loss_scaler" not in k]
    if unexpected:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    for idx, key in enumerate(state_dict):
        if idx >= len(_amp_state.loss_scalers):
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {len(_amp_state.loss_scalers)}")
            break
        _amp_state.loss_scalers[idx]._loss_scale = state_dict[key]["loss_scale"]
        _amp_state.loss_scalers[idx]._unskipped = state_dict[key]["unskipped"]


# ----------------------------------------------------------------------------------------------
# user functions: registration (before initialize) and decorators
# ----------------------------------------------------------------------------------------------

_USER_REGISTRY: list[tuple[Any, str, Any]] = []
_PROMOTE = "promote"


def _cast_args(args, kwargs, cast):
    if cast == _PROMOTE:
        floats = [t.dtype for t in list(args) + list(kwargs.values())
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats:
            return args, kwargs
        widest = functools.reduce(torch.promote_types, floats)
        return cast_floating((args, kwargs), widest)
    return cast_floating((args, kwargs), cast)


def _cast_wrapper(fn: Callable, cast) -> Callable:
    """``fn`` with its floating tensor args cast (to fp16, fp32, or the widest of them) and autocast off inside."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args, kwargs = _cast_args(args, kwargs, cast)
        device_type = next((t.device.type for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)),
                           "cpu")
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    wrapper._amp_original = fn
    return wrapper


def _register(module, name: str, cast, what: str) -> None:
    if _active_handle() is not None:
        raise RuntimeError(
            f"amp.{what}({getattr(module, '__name__', module)!r}, {name!r}) was called after amp.initialize(); "
            "registrations are applied when initialize patches functions, so register before calling it")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    _USER_REGISTRY.append((module, name, cast))


def register_half_function(module, name: str) -> None:
    """Under O1, ``module.name`` will run with its floating args cast to fp16. Call before :func:`initialize`."""
    _register(module, name, torch.float16, "register_half_function")


def register_float_function(module, name: str) -> None:
    """Under O1, ``module.name`` will run with its floating args cast to fp32. Call before :func:`initialize`."""
    _register(module, name, torch.float32, "register_float_function")


def register_promote_function(module, name: str) -> None:
    """Under O1, ``module.name`` will run with its floating args cast to the widest of their dtypes."""
    _register(module, name, _PROMOTE, "register_promote_function")


def _decorator(cast):
    def decorate(fn: Callable) -> Callable:
        wrapped = _cast_wrapper(fn, cast)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            handle = _active_handle()
            if handle is None or not handle.patch_torch_functions:
                return fn(*args, **kwargs)
            return wrapped(*args, **kwargs)

        return wrapper

    return decorate


half_function = _decorator(torch.float16)
half_function.__doc__ = "Decorator: under an active O1 amp, the function runs with floating args in fp16."
float_function = _decorator(torch.float32)
float_function.__doc__ = "Decorator: under an active O1 amp, the function runs with floating args in fp32."
promote_function = _decorator(_PROMOTE)
promote_function.__doc__ = "Decorator: under an active O1 amp, floating args are cast to the widest of their dtypes."
