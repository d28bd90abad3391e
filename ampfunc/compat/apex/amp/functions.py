"""User functions under O1: registration before ``initialize`` and the cast decorators."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ampfunc.compat.apex.amp._state import _active_handle
from ampfunc.policy import cast_floating

__all__ = [
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
]

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
