"""The ``torch.library`` registration of the ops: each spec's schema, its reference kernel
(``CompositeExplicitAutograd``: any device the compiled kernels do not claim) and its fake kernel
(``torch.compile``, meta tensors), all derived from the spec table (:mod:`ampfunc.ops._spec`).

The reference kernel of an op is its validation (:func:`validate_call`, read off the spec) and
then its reference twin (:mod:`ampfunc.ops._reference`, :mod:`ampfunc.ops.optimizers`). The fake
kernel checks that the call has one device and returns empty tensors shaped as the spec's results
say. The compiled kernels (ext/) register for the CPU and CUDA keys of the same schemas.
"""

from __future__ import annotations

import torch

from ampfunc.ops import _loading, _spec
from ampfunc.ops._loading import _is_compiling, load
from ampfunc.ops._lowmem_reference import _ref_adam_lowmem_step_
from ampfunc.ops._reference import (
    _flag_device,
    _fresh,
    _ref_apply_updates,
    _ref_check,
    _ref_check_norm,
    _ref_unscale,
    _ref_unscale_,
    _ref_update_scale_,
)
from ampfunc.ops._validation import (
    _check_scalar,
    _fake_devices,
    _item,
    _list_device,
    _validate,
)

# ----------------------------------------------------------------------------------------------
# Validation, read off the spec
# ----------------------------------------------------------------------------------------------


def _present(spec: _spec.OpSpec, arg: _spec.Arg, values: dict) -> bool:
    if arg.when is None:
        return True
    if arg.when == _spec.GIVEN:
        return bool(values[arg.name])
    return bool(values[arg.when])


def validate_call(spec: _spec.OpSpec, values: dict) -> torch.device:
    """Refuses a call of ``spec`` with ``values`` (argument name -> value) that the kernels would
    refuse, with the same error: the 0-d tensors (in schema order), a ``weight_decay`` that needs
    params, then every present list (the reference list first: its shapes are the ones the others
    must have) and the overlap of everything the op writes. Returns the call's device."""
    dev = _list_device(values[spec.ref] if spec.ref else [], *[values[a.name] for a in spec.tensors])
    for a in spec.tensors:
        t = values[a.name]
        if a.type == "Tensor?" and t is None:
            continue
        if isinstance(a.shape, tuple):  # a table of fixed shape
            if not isinstance(t, torch.Tensor) or t.dtype != a.dtypes[0] or tuple(t.shape) != a.shape or \
                    t.device != dev or t.layout != torch.strided:
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"ampfunc: {a.name} is {got}; it takes {a.dtypes[0]} {a.shape} on {dev} "
                                 f"({spec.name})")
            continue
        _check_scalar(spec.name, a.name, t, a.dtypes[0], dev)
    params = spec.args[0]
    if params.when == _spec.GIVEN and not values[params.name] and values["grads"] and values.get("weight_decay"):
        raise ValueError(f"ampfunc: weight_decay != 0 needs params ({spec.name})")
    # in schema order; the first present list is the reference (an update's params when given, else its grads)
    lists = [(a.name, list(values[a.name]), a.dtypes, a.writes) for a in spec.lists if _present(spec, a, values)]
    written_scalars = [(a.name, values[a.name]) for a in spec.tensors if a.writes]
    _validate(spec.name, dev, lists, written_scalars, _shape_roles(spec, values))
    return dev


def _shape_roles(spec: _spec.OpSpec, values: dict) -> dict:
    """The shape of each tensor of the lists with a shape role (``_validate``'s ``shapes``)."""
    ref = values[spec.ref] if spec.ref else []
    out = {}
    for a in spec.lists:
        if a.shape == _spec.REMAINDER:
            def want(i, ref=ref):
                if ref[i].dtype == torch.bfloat16:
                    return ref[i].shape, f"{spec.ref}[{i}] is bfloat16 of shape {tuple(ref[i].shape)}"
                return torch.Size([0]), f"{spec.ref}[{i}] is {ref[i].dtype} (its own master: an empty remainder)"
        elif a.shape == _spec.BLOCKS:
            def want(i, ref=ref, codes=values[a.of], of=a.of):
                if codes[i].dtype == torch.uint8:
                    n = ref[i].numel() // 256
                    return torch.Size([n]), f"the q8 {of}[{i}] has {n} blocks of 256"
                return torch.Size([0]), f"{of}[{i}] is not q8 (an empty absmax)"
        else:
            continue
        out[a.name] = want
    return out


# ----------------------------------------------------------------------------------------------
# Reference kernels: validation, then the twin
# ----------------------------------------------------------------------------------------------


def reference_step(opt: _spec.Optimizer):
    """The out-of-place reference step of ``opt``: the in-place one on fresh copies (the
    definition of the out-of-place numbers), ``(new_params, *new_state, new_model_params,
    new_step)``; called as the in-place reference is."""
    n_state = len(opt.state)

    def step(params, grads, *rest, lr_tensor=None):
        state, (model_params, step_t, grad_scale, finite, lr, *hypers) = rest[:n_state], rest[n_state:]
        hyper = dict(zip((h.name for h in opt.hypers), hypers))
        new_state = [_fresh(ts) if opt.present(s.when, hyper) else [] for s, ts in zip(opt.state, state)]
        p, m, s = _fresh(params), _fresh(model_params), step_t.clone()
        opt.reference_step_(p, grads, *new_state, m, s, grad_scale, finite, lr, *hypers, lr_tensor=lr_tensor)
        return (p, *new_state, m, s)

    step.__name__ = f"_ref_{opt.name}_step"
    return step


def _reference_op(spec: _spec.OpSpec, twin):
    names = [a.name for a in spec.args]

    def kernel(*args):
        validate_call(spec, dict(zip(names, args)))
        return twin(*args)

    kernel.__name__ = f"_ref_{spec.name}_op"
    return kernel


def _optimizer_twins(opt: _spec.Optimizer) -> dict:
    """The reference twins of ``opt``'s three ops, taking the schema's arguments."""
    n_lists = 3 + len(opt.state)  # params, grads, state..., model_params
    step_out = reference_step(opt)

    def step_(*args):  # (lists, step, grad_scale, finite, lr, lr_tensor, *hypers)
        lists, (step, grad_scale, finite, lr, lr_tensor, *hypers) = args[:n_lists], args[n_lists:]
        return opt.reference_step_(*lists, step, grad_scale, finite, lr, *hypers, lr_tensor=lr_tensor)

    def step(*args):
        lists, (step, grad_scale, finite, lr, lr_tensor, *hypers) = args[:n_lists], args[n_lists:]
        return step_out(*lists, step, grad_scale, finite, lr, *hypers, lr_tensor=lr_tensor)

    return {f"{opt.name}_step_": step_, f"{opt.name}_step": step, f"{opt.name}_update": opt.reference_update}


def _twins() -> dict:
    twins = {"check": _ref_check, "check_norm": _ref_check_norm, "unscale_": _ref_unscale_,
             "unscale": _ref_unscale,
             "apply_updates": _ref_apply_updates, "update_scale_": _ref_update_scale_,
             "adam_lowmem_step_": _ref_adam_lowmem_step_}
    for opt in _spec.OPTIMIZERS.values():
        twins.update(_optimizer_twins(opt))
    return twins


def references() -> dict:
    """Op name -> its reference kernel (validation, then the twin), for every op of the table.
    ``update_scale_``'s twin takes any 0-d tensors, as it always has: the kernels check them."""
    twins = _twins()
    out = {name: _reference_op(spec, twins[name]) for name, spec in _spec.OPS.items() if name != "update_scale_"}
    out["update_scale_"] = twins["update_scale_"]
    return out


# ----------------------------------------------------------------------------------------------
# Fake kernels, read off the spec
# ----------------------------------------------------------------------------------------------


def _empties(tensors, dtype=None) -> list:
    return [torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format) for t in tensors]


def _fake_flags(spec: _spec.OpSpec, values: dict) -> tuple:
    """check / check_norm / unscale_: the flag, the sum, the per-leaf flags (on the call's device)."""
    tensors = values["tensors"]
    dev = _flag_device(tensors) if spec.name.startswith("check") else \
        (tensors[0].device if tensors else values["inv_scale"].device)
    out = []
    for r in spec.returns:
        if r.type == "Tensor[]":
            out.append(_empties(tensors, r.dtype))
        elif r.name == "leaf_nonfinite":
            out.append(torch.empty(len(tensors) if values["per_leaf"] else 0, dtype=torch.bool, device=dev))
        else:
            out.append(torch.empty((), dtype=r.dtype, device=dev))
    return out


def fake_kernel(spec: _spec.OpSpec):
    """The fake kernel of ``spec``: one device per call (a meta tensor among real ones is refused,
    rather than answered with empty memory), then the results as empty tensors."""
    names = [a.name for a in spec.args]
    flags = spec.returns and spec.returns[-1].name in ("finite", "leaf_nonfinite") and "tensors" in names

    def fake(*args):
        values = dict(zip(names, args))
        # (the fake kernels have always named the learning-rate tensor "lr")
        _fake_devices(spec.name, [(a.name, values[a.name]) for a in spec.lists],
                      [("lr" if a.name == "lr_tensor" else a.name, values[a.name]) for a in spec.tensors])
        if not spec.returns:
            return None
        if flags:
            out = _fake_flags(spec, values)
            return tuple(out) if len(out) > 1 else out[0]
        out = []
        for r in spec.returns:
            like = values[r.like]
            if r.type == "Tensor":
                out.append(torch.empty_like(like))
            elif r.when is not None and r.when != _spec.GIVEN and not values[r.when]:
                out.append([])
            else:
                out.append(_empties(like, r.dtype))
        return tuple(out) if len(out) > 1 else out[0]

    fake.__name__ = f"_fake_{spec.name}"
    return fake


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


def _refuse_layout(name: str, schema: str):
    """The kernel for the sparse dispatch keys: a clear error naming the argument, where torch
    would answer ``NotImplementedError`` (a dense kernel cannot read a sparse tensor)."""
    arg_names = [a.name for a in torch._C.parse_schema(f"ampfunc::{schema}").arguments]

    def kernel(*args, **kwargs):
        for arg, val in zip(arg_names, args):
            items = list(enumerate(val)) if isinstance(val, (list, tuple)) else [(-1, val)]
            for i, t in items:
                if isinstance(t, torch.Tensor) and t.layout != torch.strided:
                    raise TypeError(f"ampfunc: {_item(arg, i)} has layout {t.layout}; ampfunc takes dense (strided) "
                                    f"tensors ({name})")
        raise TypeError(f"ampfunc: a sparse tensor was passed ({name})")

    return kernel


def _loading_first(name: str, reference):
    """``reference``, behind a first call that loads the compiled kernels.

    A graph compiled before any eager ampfunc call (``torch.compile`` traces through the fake
    kernels and never loads the library) calls the ops directly; without this its first run
    would land on the reference forever. The first eager call loads the library (building it if
    needed, as any first op does) and dispatches again, now to the compiled kernel."""

    def kernel(*args):
        if _loading._BACKEND[0] is None and not _is_compiling():
            if load() != "reference":
                return getattr(torch.ops.ampfunc, name)(*args)
        return reference(*args)

    kernel.__name__ = f"{getattr(reference, '__name__', name)}_loading_first"
    return kernel


def register(reference: dict) -> None:
    """Defines every op of the table in the ``ampfunc`` namespace (once per process)."""
    try:
        torch.ops.ampfunc.check  # noqa: B018 - the lookup raises when the ops are not defined yet
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("ampfunc", "DEF")  # noqa: TOR901 - the schemas live here, kernels in ext/
    for name, spec in _spec.OPS.items():
        schema = spec.schema()
        lib.define(schema)
        lib.impl(name, _loading_first(name, reference[name]), "CompositeExplicitAutograd")
        torch.library.register_fake(f"ampfunc::{name}", fake_kernel(spec), lib=lib)
        for key in ("SparseCPU", "SparseCUDA", "SparseCsrCPU", "SparseCsrCUDA"):
            lib.impl(name, _refuse_layout(name, schema), key)
    register.lib = lib  # keep the registrations alive
