"""Loading the compiled kernels, and the door every op call goes through.

:func:`load` builds (first time only) and loads the library of ``ext/``; :func:`_call` sends an
op's arguments through the library's direct door (eager calls on plain CPU tensors) or to
``torch.ops.ampfunc``.
"""

from __future__ import annotations

import contextlib
import gc

import torch

_BACKEND: list = [None, None]  # [backend name, why the compiled kernels are missing]

def load() -> str:
    """Builds (first time only, into a cache) and loads the compiled kernels; returns
    :func:`backend`. Called by the first op; call it yourself to pay the build up front."""
    if _BACKEND[0] is None:
        from ampfunc import _build

        direct = _build.env_flag("AMPFUNC_DIRECT", default=True)  # read first: a misspelling loads nothing
        _BACKEND[0], _BACKEND[1] = _build.load()
        if _BACKEND[0] != "reference" and direct:
            _DIRECT[0] = _build.direct_module()
    return _BACKEND[0]

def backend() -> str:
    """Which implementation serves the ops: ``"cpu+cuda"`` or ``"cpu"`` (compiled kernels; CUDA
    tensors use the reference under ``"cpu"``) or ``"reference"`` (plain torch everywhere)."""
    return load()

def backend_reason() -> str | None:
    """Why the compiled kernels are (partly) missing, or None."""
    load()
    return _BACKEND[1]

_DIRECT: list = [None]  # the direct door of the loaded library (ext/bindings.cpp, namespace direct)

def _call(name: str, *args):
    """Op ``name`` on ``args`` (the schema's arguments, lists as Python lists).

    Eager calls whose tensors are all plain dense CPU tensors go through the compiled library's
    direct door, which runs the same implementation without the dispatcher's per-tensor boxing
    (about 0.35 us per tensor per list); it hands back anything else (tensor subclasses, modes,
    autograd, other devices) as ``NotImplemented`` and the call goes to ``torch.ops.ampfunc``.
    Traced calls (``torch.compile``) always go to ``torch.ops.ampfunc``.
    """
    out = _through_door(name, args)
    if out is not NotImplemented:
        return out
    door = _DIRECT[0]
    if name in _PACKING_OPS and door is not None and not _is_compiling() and _plain_cuda(args[0] or args[1]):
        # An eager CUDA call: its new state lists may be views of one block each (packed
        # outputs); a compiled graph's calls never set this (its outputs may not alias).
        prev = door.pack_outputs(True)
        try:
            return getattr(torch.ops.ampfunc, name)(*args)
        finally:
            door.pack_outputs(prev)
    return getattr(torch.ops.ampfunc, name)(*args)

def _through_door(name: str, args: tuple):
    """The direct door's ``name`` on ``args`` for an eager call, else ``NotImplemented`` (no
    library loaded, a traced call, or tensors the door hands back)."""
    door = _DIRECT[0]
    if door is None or _is_compiling():
        return NotImplemented
    fn = getattr(door, name, None)  # None: no binding (update_scale_), the dispatcher serves it
    return NotImplemented if fn is None else fn(*args)

# The out-of-place optimizer ops whose new state lists and updates come back packed in eager mode.
_PACKING_OPS = frozenset({"adam_step", "sgd_step", "adam_update", "sgd_update"})

def _plain_cuda(tensors) -> bool:
    """Whether an op's first list holds plain CUDA tensors and no dispatch mode is active."""
    t = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else None
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda and not torch._is_functional_tensor(t)
            and torch._C._len_torch_dispatch_stack() == 0)

def _is_compiling() -> bool:
    fn = getattr(torch.compiler, "is_compiling", None)
    return bool(fn()) if fn is not None else False

def _ensure() -> None:
    # The build must never start inside a torch.compile trace: there the ops are traced through
    # their fake kernels, and whichever kernel is registered at run time serves the call.
    if _BACKEND[0] is None and not _is_compiling():
        load()

def _seq(xs):
    """A list or tuple as it is (the ops take either, and never keep it); anything else as a list."""
    return xs if type(xs) in (list, tuple) else list(xs)

def _as_list(xs):
    """:func:`_seq`, with None as the empty list (an optional list argument)."""
    return [] if xs is None else _seq(xs)

def _split_lr(lr):
    """``(float lr, None)`` for a number, ``(0.0, 0-d fp32 tensor)`` for a tensor."""
    if isinstance(lr, torch.Tensor):
        return 0.0, lr.reshape(()).to(torch.float32)
    return float(lr), None

@contextlib.contextmanager
def _gc_paused(n: int):
    """Pauses Python's cyclic garbage collector while an op hands back ``n`` new tensors.

    Wrapping tens of thousands of outputs as Python objects would otherwise trigger dozens of
    collections, some of them full ones that walk every live tensor: on a 10,000-leaf tree that
    costs more than the kernel. The outputs hold no reference cycles, so nothing is lost; the
    collector runs as usual afterwards. Not under torch.compile tracing (nothing is allocated)."""
    if n < 512 or not gc.isenabled() or _is_compiling():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()

def _transforms_active() -> bool:
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
