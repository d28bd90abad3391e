"""amp's front door: ``initialize``, ``scale_loss``, ``master_params``, ``state_dict``, ``load_state_dict``."""

from __future__ import annotations

import contextlib
import numbers
import warnings

import torch

from ampfunc.compat.apex._scaler import INT32_MAX, LossScaler, all_finite_flags, checked_scale
from ampfunc.compat.apex.amp._state import _amp_state, _Handle, maybe_print
from ampfunc.compat.apex.amp.functions import _USER_REGISTRY, _cast_wrapper
from ampfunc.compat.apex.amp.model import check_models, patch_forward, register_fp32_state_dict
from ampfunc.compat.apex.amp.optimizer import patch_optimizer
from ampfunc.compat.apex.amp.properties import Properties, _properties
from ampfunc.compat.apex.fp16_utils.fp16util import convert_network

__all__ = ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict", "init"]


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
    check_models(model_list)
    for i, opt in enumerate(opt_list):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"amp.initialize: optimizers[{i}] is a {type(opt).__name__}, "
                            "expected a torch.optim.Optimizer")
        if hasattr(opt, "_amp_stash"):
            raise RuntimeError(f"amp.initialize: optimizers[{i}] was already processed by amp.initialize")
        if any(opt is other for other in opt_list[:i]):  # apex: "should only be passed through once"
            raise RuntimeError(f"amp.initialize: optimizers[{i}] is the same optimizer as an earlier entry; a given "
                               "optimizer should only be passed through amp.initialize once")

    # The scalers first: a bad loss_scale / min_loss_scale / max_loss_scale is refused before a
    # model is cast or an optimizer patched (a retry would otherwise find fp16 params).
    try:
        scalers = [LossScaler(props.loss_scale, min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)
                   for _ in range(int(num_losses))]
    except (TypeError, ValueError) as e:
        raise type(e)(f"amp.initialize(loss_scale={loss_scale!r}, min_loss_scale={min_loss_scale!r}, "
                      f"max_loss_scale={max_loss_scale!r}): {e}") from None
    if _amp_state.handle is not None:
        if _amp_state.handle._patched:
            warnings.warn("amp.initialize was called before in this process: the functions registered for that "
                          "call (register_half_function, ...) are put back to torch's own, for its models too; apex "
                          "expects one call with every model and optimizer", UserWarning, stacklevel=2)
        _amp_state.handle._deactivate()
    for model in model_list:
        if props.cast_model_type:
            if props.keep_batchnorm_fp32:
                convert_network(model, props.cast_model_type)
            else:
                model.to(props.cast_model_type)
        if props.cast_model_type or props.patch_torch_functions or props.cast_model_outputs:
            patch_forward(model, props)
        if props.cast_model_type in (torch.float16, torch.bfloat16):
            register_fp32_state_dict(model)
    for opt in opt_list:
        if props.cast_model_type:
            opt.load_state_dict(opt.state_dict())  # state follows the cast params' dtype (apex)
        patch_optimizer(opt, bool(props.master_weights))
    _amp_state.loss_scalers = scalers
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
    # No gradient reached these optimizers (finite None): a clean step for the scale (apex's count).
    if scaler.update_scale(all_finite_flags([f for f in flags if f is not None])):
        for opt in opts:
            if opt._amp_stash.skip is None:
                opt._amp_stash.skip = (loss_id, scaler)


def master_params(optimizer: torch.optim.Optimizer):
    """The params the optimizer updates (fp32 masters under O2): what to clip."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination=None) -> dict:
    """``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}`` (apex's format).

    ``unskipped`` counts clean steps since the last change for a dynamic scale, and every
    step for a static one (as apex counts; O0/O3 with scale 1 skip the bookkeeping entirely,
    as in apex, so their count stays 0).
    """
    destination = {} if destination is None else destination
    for i, s in enumerate(_amp_state.loss_scalers):
        destination[f"loss_scaler{i}"] = {"loss_scale": s.loss_scale(), "unskipped": s._unskipped}
    return destination


def load_state_dict(state_dict: dict) -> None:
    """Restores :func:`state_dict`; extra scalers are skipped with a message, unknown keys raise ``RuntimeError``.

    Every entry is checked before any is loaded: a ``loss_scale`` outside
    :data:`ampfunc.loss_scale.SCALE_RANGE` once stored in fp32 (0, negative, NaN, inf) or an ``unskipped``
    that is not an int ``>= 0`` (``<= 2**31 - 1`` for a dynamic scaler, whose counter is int32)
    raises ``ValueError`` naming the entry, and no scaler changes.

    Args:
      state_dict: what :func:`state_dict` returned (``{"loss_scaler0": {"loss_scale": ...,
        "unskipped": ...}, ...}``).

    Returns:
      None.

    Example:
      >>> amp.load_state_dict(checkpoint["amp"])  # doctest: +SKIP

    Cost: host-side checks, then one 0-d tensor write per scaler.
    """
    if len(state_dict) != len(_amp_state.loss_scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(_amp_state.loss_scalers)} "
              "loss_scalers are used")
    unexpected = [k for k in state_dict if "loss_scaler" not in k]
    if unexpected:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    # Check every entry before loading any, so that a bad one leaves all scalers as they were.
    for idx, key in enumerate(list(state_dict)[:len(_amp_state.loss_scalers)]):
        entry = state_dict[key]
        if not isinstance(entry, dict) or not {"loss_scale", "unskipped"} <= set(entry):
            raise ValueError(f"amp.load_state_dict: state_dict[{key!r}] must be a dict with 'loss_scale' and "
                             f"'unskipped', got {entry!r}")
        checked_scale(entry["loss_scale"], f"amp.load_state_dict: state_dict[{key!r}]['loss_scale']")
        unskipped = entry["unskipped"]
        if isinstance(unskipped, bool) or not isinstance(unskipped, numbers.Integral) or unskipped < 0:
            raise ValueError(f"amp.load_state_dict: state_dict[{key!r}]['unskipped'] must be an int >= 0, "
                             f"got {unskipped!r}")
        # A dynamic scaler counts in an int32 tensor: a larger count would fail halfway through the load.
        if _amp_state.loss_scalers[idx].dynamic and unskipped > INT32_MAX:
            raise ValueError(f"amp.load_state_dict: state_dict[{key!r}]['unskipped'] must be an int in "
                             f"[0, 2**31 - 1] (loss_scaler{idx} is dynamic and counts in int32), got {unskipped!r}")
    for idx, key in enumerate(state_dict):
        if idx >= len(_amp_state.loss_scalers):
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {len(_amp_state.loss_scalers)}")
            break
        _amp_state.loss_scalers[idx]._loss_scale = state_dict[key]["loss_scale"]
        _amp_state.loss_scalers[idx]._unskipped = state_dict[key]["unskipped"]


def init(*args, **kwargs):
    """apex's pre-``initialize`` handle API (``handle = amp.init(...)``): refused, naming what replaces it.

    apex deprecated it in favour of :func:`initialize`; ampfunc does not patch torch functions
    globally (O1 runs the model's forward under ``torch.autocast``), so there is no handle to return.

    Raises:
      RuntimeError: always, saying what to call instead.
    """
    raise RuntimeError(
        "amp.init() (apex's deprecated handle API) is not supported by ampfunc.compat.apex.amp. Use "
        "`model, optimizer = amp.initialize(model, optimizer, opt_level='O1')` and "
        "`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`; register custom "
        "functions with amp.register_half_function/register_float_function/register_promote_function "
        "before initialize(). For O1-style casting of a region without a model, use "
        "`with ampfunc.compat.torch_amp.autocast(device_type, dtype=torch.float16):`.")
