"""The public Python functions of an optimizer's ops, written from its spec.

For an :class:`~ampfunc.ops._spec.Optimizer` named ``x`` this defines ``x_step_``, ``x_step``,
``x_step_checked``, ``x_step_checked_`` and ``x_update`` in :mod:`ampfunc.ops`, with the spec's hyper-parameters as
keyword arguments (their defaults the spec's). Each is generated as source text and compiled, as
:func:`collections.namedtuple` does, so a call costs what a hand-written function costs (no
argument binding at run time) and ``inspect.signature`` shows the real signature.
"""

from __future__ import annotations

from ampfunc.ops._spec import GIVEN, Optimizer
from ampfunc.ops._validation import HYPER_RANGES, check_hypers, hyper_condition

_STEP_ = '''
def {name}_step_(params, grads, {state}, model_params, step, grad_scale, finite, *, lr, {hyper_sig}) -> None:
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    {hyper_conv}
    _call("{name}_step_", _seq(params), _seq(grads), {state_args}, _as_list(model_params), step, grad_scale,
          finite, lr, lr_tensor, {hyper_args})
'''

_STEP = '''
def {name}_step(params, grads, {state}, model_params, step, grad_scale, finite, *, lr, {hyper_sig}):
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    {hyper_conv}
    params = _seq(params)
    with _gc_paused(len(params)):
        out = _call("{name}_step", params, _seq(grads), {state_args}, _as_list(model_params), step, grad_scale,
                    finite, lr, lr_tensor, {hyper_args})
        return tuple(list(x) for x in out[:-1]) + (out[-1],)
'''

_STEP_CHECKED = '''
def {name}_step_checked(params, grads, {state}, model_params, step, grad_scale, *, lr, {hyper_sig}):
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    {hyper_conv}
    params, grads = _seq(params), _seq(grads)
    args = (params, grads, {state_args}, _as_list(model_params), step, grad_scale, lr, lr_tensor, {hyper_args})
    with _gc_paused(len(params)):
        out = _through_door("{name}_step_checked", args)
        if out is not NotImplemented:
            return tuple(list(x) for x in out[:-2]) + (out[-2], out[-1])
    finite = _finite_for(grads, grad_scale)
    return {name}_step(*args[:{n_lists}], args[{n_lists}], args[{n_lists} + 1], finite,
                       lr=args[{n_lists} + 2] if lr_tensor is None else lr_tensor, {hyper_kw}) + (finite,)
'''

_STEP_CHECKED_ = '''
def {name}_step_checked_(params, grads, {state}, model_params, step, grad_scale, *, lr, {hyper_sig}):
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    {hyper_conv}
    params, grads = _seq(params), _seq(grads)
    args = (params, grads, {state_args}, _as_list(model_params), step, grad_scale, lr, lr_tensor, {hyper_args})
    finite = _through_door("{name}_step_checked_", args)
    if finite is NotImplemented:
        finite = _finite_for(grads, grad_scale)
        {name}_step_(*args[:{n_lists}], args[{n_lists}], args[{n_lists} + 1], finite,
                     lr=args[{n_lists} + 2] if lr_tensor is None else lr_tensor, {hyper_kw})
    return finite
'''

_UPDATE = '''
def {name}_update(params, grads, {state}, step, grad_scale=None, *, lr, {hyper_sig}):
    _ensure()
    lr, lr_tensor = _split_lr(lr)
    {hyper_conv}
    grad_scale = _ones_like_step(step) if grad_scale is None else grad_scale
    grads = list(grads)
    with _gc_paused(len(grads)):
        out = _call("{name}_update", _as_list(params), grads, {state_args}, step, grad_scale, lr, lr_tensor,
                    {hyper_args})
        return tuple(list(x) for x in out[:-1]) + (out[-1],)
'''

_DOC_STEP_ = """One {title} step over fp32 ``params``, in place, in one pass.

``g = grad * grad_scale`` (``grad`` of any float dtype, ``grad_scale`` a 0-d fp32 device tensor:
pass ``inv_scale * clip_coef``), then {math}. The state lists ({state_names}) are fp32, one per
param, updated in place; ``step`` is the 0-d fp32 count of applied steps. When ``model_params``
(one per param, fp16/bf16/fp32) is given it receives the new params rounded to its dtype in the
same pass. When the 0-d bool ``finite`` is false nothing is written: params, state, model copy and
``step`` (incremented otherwise) stay bit-identical. ``lr`` is a float or a 0-d tensor on the
params' device (a schedule's value: read by the kernel on the device, so no host sync and no
recompilation when it changes). Hyper-parameters: {hyper_names}.
Cost: {traffic}; one pass; no host sync.
"""

_DOC_STEP = """Out-of-place :func:`{name}_step_`: ``(new_params, {new_state}, new_model_params, new_step)``,
new tensors with the in-place op's numbers bit for bit; the inputs are only read.

A state list the hyper-parameters leave unused comes back empty, and ``new_model_params`` when no
``model_params`` are given (they supply the dtypes of the model copy, and its values when the step
is skipped). When ``finite`` is false the outputs are copies of the inputs and ``new_step`` equals
``step``. Cost: the in-place op's traffic ({traffic}), one pass, with the writes going to new
(contiguous) tensors; a skipped step costs one copy instead. No host sync; on CUDA the same one
pass (the in-place kernel's arithmetic, written to the new tensors).
"""

_DOC_STEP_CHECKED = """:func:`{name}_step` that takes its own skip decision: ``(new_params, {new_state},
new_model_params, new_step, finite)``.

``finite`` is :func:`check`'s flag of ``grads`` and-ed with ``grad_scale`` not being NaN, and the
outputs are :func:`{name}_step`'s for that flag (copies of the inputs on a skipped step), bit for
bit: this is ``check`` followed by ``{name}_step``, which is what runs on CUDA and under
``torch.compile``. Eager CPU calls run it as one pass: an out-of-place step leaves its inputs
intact, so the finiteness of the gradients can be read in the optimizer's pass and the decision
taken after it. Cost (eager CPU): one pass instead of two; a skipped step adds a copy. No host sync.
"""

_DOC_STEP_CHECKED_ = """:func:`{name}_step_` that takes its own skip decision: writes as
:func:`{name}_step_` does and returns ``finite``.

``finite`` (a new 0-d bool tensor) is :func:`check`'s flag of ``grads`` and-ed with
``grad_scale`` not being NaN, and the step is :func:`{name}_step_`'s for that flag (nothing
written when it is false): this is ``check`` followed by ``{name}_step_``, which is what runs on
CUDA and under ``torch.compile``. An in-place step must decide before it writes, so the check
stays a read pass of its own; eager CPU calls run both passes in one call, which reads each
tensor's metadata once instead of twice. Cost: one read pass of ``grads``, then
:func:`{name}_step_`'s ({traffic}). No host sync.
"""

_DOC_UPDATE = """The pure {title} update in one pass: ``(updates, {new_state}, new_step)``.

``updates`` are new fp32 tensors ``new_p - p``, with ``new_p`` as :func:`{name}_step_` computes it
(the step term alone when ``params`` is empty or None, allowed when ``weight_decay == 0``): the
numbers of the optimizer's generic update bit for bit (CPU). ``grads`` (any float dtype) are
multiplied by ``grad_scale`` (0-d fp32, e.g. a clip coefficient; None: 1) first; ``new_step`` is
``step + 1``. The inputs are only read; a state list the hyper-parameters leave unused comes back
empty. ``lr`` is a float or a 0-d fp32 tensor on the device (a schedule's value).
Cost: {traffic}, the updates and the new state written to new tensors, one pass on CPU and CUDA;
no host sync.
"""


def _state_arg(name: str, when, converted: set) -> str:
    if when is None:
        return f"_seq({name})"
    test = when if when in converted else f"bool({when})"
    return f"(_as_list({name}) if {test} else [])"


def _hyper_check(opt: Optimizer) -> str:
    """The source line, after the conversions, that refuses hyper-parameters out of range (the
    public optimizers' ranges, :data:`~ampfunc.ops._validation.HYPER_RANGES`): one inline test of
    the Python floats, :func:`~ampfunc.ops._validation.check_hypers` only when it fails."""
    names = ["lr"] + [h.name for h in opt.hypers]
    given = ", ".join(f"{n}={n}" for n in names if n in HYPER_RANGES)
    return (f"\n    if not ({hyper_condition(names)}):\n"
            f"        _check_hypers(_op_name(), {given})")


def define(opt: Optimizer, namespace: dict) -> list:
    """Defines ``opt``'s five functions in ``namespace`` (the :mod:`ampfunc.ops` package, whose
    helpers they call); returns their names."""
    hypers = opt.hypers
    conv = {"float": "float", "bool": "bool", "int": "int"}
    fields = dict(
        name=opt.name,
        state=", ".join(s.name for s in opt.state),
        state_args=", ".join(_state_arg(s.name, s.when, {h.name for h in hypers}) for s in opt.state),
        hyper_sig=", ".join(f"{h.name}: {h.kind} = {h.default!r}" for h in hypers),
        hyper_conv="; ".join(f"{h.name} = {conv[h.kind]}({h.name})" for h in hypers) + _hyper_check(opt),
        hyper_args=", ".join(h.name for h in hypers),
        hyper_kw=", ".join(f"{h.name}={h.name}" for h in hypers),
        n_lists=3 + len(opt.state),
    )
    docs = dict(name=opt.name, title=opt.title, math=opt.math, traffic=opt.traffic,
                state_names=", ".join(f"``{s.name}``" + (f" with ``{s.when}``" if s.when not in (None, GIVEN) else "")
                                      for s in opt.state),
                new_state=", ".join(f"new_{s.name}" for s in opt.state),
                hyper_names=", ".join(f"``{h.name}={h.default!r}``" for h in hypers))
    namespace["_check_hypers"] = check_hypers
    names = []
    for template, doc, suffix in ((_STEP_, _DOC_STEP_, "_step_"), (_STEP, _DOC_STEP, "_step"),
                                  (_STEP_CHECKED, _DOC_STEP_CHECKED, "_step_checked"),
                                  (_STEP_CHECKED_, _DOC_STEP_CHECKED_, "_step_checked_"),
                                  (_UPDATE, _DOC_UPDATE, "_update")):
        op_fields = dict(fields, hyper_conv=fields["hyper_conv"].replace("_op_name()", repr(opt.name + suffix)))
        source = template.format(**op_fields)
        exec(compile(source, f"<ampfunc.ops: {opt.name}{suffix}>", "exec"), namespace)
        fn = namespace[f"{opt.name}{suffix}"]
        fn.__doc__ = doc.format(**docs)
        fn.__module__ = namespace["__name__"]
        names.append(fn.__name__)
    return names
