"""One definition per fused op: the spec table.

Every op of the ``ampfunc`` library is an :class:`OpSpec` here: its name, its arguments in
schema order (tensor lists and 0-d tensors with their roles -- read, written, present only when a
hyper-parameter turns them on -- and accepted dtypes; floats, ints and bools), and its results.
From the spec derive the ``torch.library`` schema (:meth:`OpSpec.schema`), the reference path's
validation and the fake kernel (:mod:`ampfunc.ops._library`), and the public Python function
(:mod:`ampfunc.ops._forms`). The C++ side keeps the same table (``ext/glue/spec.h``: list names,
dtypes, roles and hyper-parameters, which its validation and direct door read); a test compares
the two (``tests/test_ops_spec.py``), and the dispatcher checks every C++ kernel's signature
against the schema derived here when the library loads.

An optimizer is one :class:`Optimizer`: its state lists and its hyper-parameters. It yields four
ops in one shape -- ``<name>_step_`` (in place), ``<name>_step`` (out of place),
``<name>_update`` (optax form: the updates) -- and the direct door's ``<name>_step_checked``.
Adding one is its spec here, its kernels in ``ext/`` and its tests
(docs/contributing/fused_ops.md).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

ANY = (torch.float32, torch.float16, torch.bfloat16)
FP32 = (torch.float32,)
ANY64 = ANY + (torch.float64,)
BOOL = (torch.bool,)
INT32 = (torch.int32,)
INT16 = (torch.int16,)
UINT8 = (torch.uint8,)
SPLIT = (torch.float32, torch.bfloat16)  # a split master's param: bf16 (with a remainder) or fp32
MOMENT = (torch.float32, torch.bfloat16, torch.uint8)  # a moment stored fp32, bf16 or as q8 codes

# The shape roles of a list (Arg.shape): the reference list's shape (None), ...
REMAINDER = "remainder"  # ... the reference tensor's shape where it is bf16, else (0,)
BLOCKS = "blocks"  # ... (numel // 256,) of the reference tensor where `of`'s tensor is uint8, else (0,)

GIVEN = "given"  # `when` of an optional list: present when the caller passes a non-empty one


class Arg(NamedTuple):
    """One argument in schema order.

    ``type`` is the schema's: ``Tensor[]``, ``Tensor``, ``Tensor?``, ``float``, ``int``, ``bool``.
    ``dtypes``: what a tensor (every tensor of a list) may be. ``writes``: the op updates it in
    place. ``when``: a list the op uses only when the hyper-parameter of that name is nonzero
    (or :data:`GIVEN`: when non-empty). ``default``: a hyper-parameter's default in the Python
    function. ``shape``: a list's shape role, each tensor shaped as the reference list's (None),
    :data:`REMAINDER` or :data:`BLOCKS` (then ``of`` names the list of codes whose uint8 tensors
    have the blocks); a tensor's fixed shape (a tuple) for a table that is not a 0-d tensor."""

    name: str
    type: str
    dtypes: tuple = ()
    writes: bool = False
    when: Optional[str] = None
    default: object = None
    shape: object = None
    of: Optional[str] = None


class Ret(NamedTuple):
    """One result: ``like`` names the argument whose tensors it is shaped like (a new tensor each),
    ``dtype`` None keeps each one's dtype; ``when`` as :class:`Arg` (an absent list's result is
    empty)."""

    name: str
    type: str
    like: str
    dtype: Optional[torch.dtype] = None
    when: Optional[str] = None


class OpSpec(NamedTuple):
    name: str
    args: tuple
    returns: tuple = ()
    ref: str = ""  # the reference list: its shapes are the ones the others must have

    def schema(self) -> str:
        """The ``torch.library`` schema: written arguments carry alias sets ``(a!)``, ``(b!)``..."""
        parts, alias = [], iter("abcdefghijklmnop")
        for a in self.args:
            t = a.type
            if a.writes:
                t = f"Tensor({next(alias)}!)" + ("[]" if t == "Tensor[]" else "")
            parts.append(f"{t} {a.name}")
        rets = ", ".join(f"{r.type} {r.name}" for r in self.returns)
        if len(self.returns) == 1 and self.returns[0].name == "":
            rets = self.returns[0].type
        elif len(self.returns) != 1:
            rets = f"({rets})"
        return f"{self.name}({', '.join(parts)}) -> {rets}"

    def arg(self, name: str) -> Arg:
        return next(a for a in self.args if a.name == name)

    @property
    def lists(self) -> tuple:
        return tuple(a for a in self.args if a.type == "Tensor[]")

    @property
    def tensors(self) -> tuple:
        return tuple(a for a in self.args if a.type in ("Tensor", "Tensor?"))

    @property
    def writes(self) -> bool:
        return any(a.writes for a in self.args)


class State(NamedTuple):
    """One fp32 state list of an optimizer, shaped like the params; ``when`` as :class:`Arg`."""

    name: str
    when: Optional[str] = None


class Hyper(NamedTuple):
    """One hyper-parameter: ``kind`` ``float`` or ``bool`` (the schema's type), its default."""

    name: str
    kind: str
    default: object


class Optimizer(NamedTuple):
    """A fused optimizer: the ops ``<name>_step_``, ``<name>_step``, ``<name>_update`` and the
    direct door's ``<name>_step_checked`` derive from it.

    ``reference_step_``: the in-place plain-torch step, called as
    ``(params, grads, *state, model_params, step, grad_scale, finite, lr, *hypers, lr_tensor=)``;
    ``reference_update``: the pure update, ``(params, grads, *state, step, grad_scale, lr,
    lr_tensor, *hypers) -> (updates, *new_state, new_step)``. ``title``: what it computes, for the
    docstrings (e.g. "``torch.optim.Adam`` (``decoupled_weight_decay=True``: ``AdamW``)");
    ``math``: the update, and ``traffic``: what a step reads and writes, for the docstrings."""

    name: str
    state: tuple
    hypers: tuple
    reference_step_: Callable
    reference_update: Callable
    title: str
    math: str
    traffic: str
    # How the fused step (ampfunc.fused) runs a transform registered as FusedSpec(kind, hparams)
    # with this optimizer's kernels: the kinds it serves, the fields of the transform's state
    # NamedTuple (``step``, then one per state list, in order), and the kernels' hyper-parameters
    # from the transform's (``hypers_of(kind, hparams) -> dict``, lr excluded).
    kinds: tuple = ()
    tree_state: tuple = ()
    hypers_of: Optional[Callable] = None

    def present(self, when: Optional[str], hyper: dict, value=None) -> bool:
        if when is None:
            return True
        if when == GIVEN:
            return bool(value)
        return bool(hyper[when])


STEP_TENSORS = (Arg("step", "Tensor", FP32), Arg("grad_scale", "Tensor", FP32))


def _hyper_args(opt: Optimizer) -> tuple:
    return tuple(Arg(h.name, h.kind, default=h.default) for h in opt.hypers)


def step_spec(opt: Optimizer, inplace: bool, checked: bool = False) -> OpSpec:
    """``<name>_step_`` (in place), ``<name>_step`` (out of place), or the direct door's
    ``<name>_step_checked`` (out of place, no ``finite``: it checks the gradients itself)."""
    w = inplace
    args = (Arg("params", "Tensor[]", FP32, w), Arg("grads", "Tensor[]", ANY))
    args += tuple(Arg(s.name, "Tensor[]", FP32, w, s.when) for s in opt.state)
    args += (Arg("model_params", "Tensor[]", ANY, w, GIVEN), Arg("step", "Tensor", FP32, w),
             Arg("grad_scale", "Tensor", FP32))
    if not checked:
        args += (Arg("finite", "Tensor", BOOL),)
    args += (Arg("lr", "float"), Arg("lr_tensor", "Tensor?", FP32)) + _hyper_args(opt)
    rets = ()
    if not inplace:
        rets = (Ret("new_params", "Tensor[]", "params"),)
        rets += tuple(Ret(f"new_{s.name}", "Tensor[]", s.name, when=s.when) for s in opt.state)
        rets += (Ret("new_model_params", "Tensor[]", "model_params"), Ret("new_step", "Tensor", "step"))
        if checked:
            rets += (Ret("finite", "Tensor", "step", torch.bool),)
    suffix = "_" if inplace else ("_checked" if checked else "")
    return OpSpec(f"{opt.name}_step{suffix}", args, rets, ref="params")


def update_spec(opt: Optimizer) -> OpSpec:
    """``<name>_update``: the pure update (optax form); ``params`` may be empty when no
    hyper-parameter needs them (``weight_decay == 0``)."""
    args = (Arg("params", "Tensor[]", FP32, when=GIVEN), Arg("grads", "Tensor[]", ANY))
    args += tuple(Arg(s.name, "Tensor[]", FP32, when=s.when) for s in opt.state)
    args += STEP_TENSORS + (Arg("lr", "float"), Arg("lr_tensor", "Tensor?", FP32)) + _hyper_args(opt)
    rets = (Ret("updates", "Tensor[]", "grads", torch.float32),)
    rets += tuple(Ret(f"new_{s.name}", "Tensor[]", s.name, when=s.when) for s in opt.state)
    rets += (Ret("new_step", "Tensor", "step"),)
    return OpSpec(f"{opt.name}_update", args, rets, ref="grads")


# ----------------------------------------------------------------------------------------------
# The ops that are not optimizers
# ----------------------------------------------------------------------------------------------

_FLAGS = (Ret("finite", "Tensor", "tensors", torch.bool),)

CHECK = OpSpec("check", (Arg("tensors", "Tensor[]", ANY64), Arg("per_leaf", "bool")),
               _FLAGS + (Ret("sumsq", "Tensor", "tensors", torch.float32),
                         Ret("leaf_nonfinite", "Tensor", "tensors", torch.bool)), ref="tensors")
CHECK_NORM = OpSpec("check_norm", (Arg("tensors", "Tensor[]", ANY64), Arg("inv_scale", "Tensor?", FP32),
                                   Arg("per_leaf", "bool")),
                    _FLAGS + (Ret("norm", "Tensor", "tensors", torch.float32),
                              Ret("leaf_nonfinite", "Tensor", "tensors", torch.bool)), ref="tensors")
UNSCALE_ = OpSpec("unscale_", (Arg("tensors", "Tensor[]", ANY64, True), Arg("inv_scale", "Tensor", FP32)),
                  _FLAGS, ref="tensors")
UNSCALE = OpSpec("unscale", (Arg("tensors", "Tensor[]", ANY64), Arg("inv_scale", "Tensor", FP32)),
                 (Ret("outs", "Tensor[]", "tensors", torch.float32),) + _FLAGS, ref="tensors")
APPLY_UPDATES = OpSpec("apply_updates", (Arg("params", "Tensor[]", ANY), Arg("updates", "Tensor[]", ANY)),
                       (Ret("", "Tensor[]", "params"),), ref="params")
UPDATE_SCALE_ = OpSpec("update_scale_", (
    Arg("scale", "Tensor", FP32, True), Arg("growth_tracker", "Tensor", INT32, True),
    Arg("hysteresis_tracker", "Tensor", INT32, True), Arg("finite", "Tensor", BOOL), Arg("growth_factor", "float"),
    Arg("backoff_factor", "float"), Arg("growth_interval", "int"), Arg("min_scale", "float"),
    Arg("max_scale", "float"), Arg("hysteresis", "int")))

# Adam / AdamW over the low-memory layouts (ampfunc.lowmem): a split master (bf16 params and
# their int16 remainders, or fp32 params with empty ones) and moments stored per param as fp32,
# bf16 or q8 codes (uint8, with an fp32 absmax per block of 256). ``qmaps``/``qbases`` are
# ampfunc.lowbits.q8_lookup()'s tables. In place; nothing written when ``finite`` is false.
LOWMEM_ADAM_STEP_ = OpSpec("adam_lowmem_step_", (
    Arg("params", "Tensor[]", SPLIT, True), Arg("remainders", "Tensor[]", INT16, True, shape=REMAINDER),
    Arg("grads", "Tensor[]", ANY), Arg("exp_avgs", "Tensor[]", MOMENT, True),
    Arg("exp_avg_absmax", "Tensor[]", FP32, True, shape=BLOCKS, of="exp_avgs"),
    Arg("exp_avg_sqs", "Tensor[]", MOMENT, True),
    Arg("exp_avg_sq_absmax", "Tensor[]", FP32, True, shape=BLOCKS, of="exp_avg_sqs"),
    Arg("step", "Tensor", FP32, True), Arg("grad_scale", "Tensor", FP32), Arg("finite", "Tensor", BOOL),
    Arg("qmaps", "Tensor", FP32, shape=(1024,)), Arg("qbases", "Tensor", UINT8, shape=(2, 65552)), Arg("lr", "float"),
    Arg("lr_tensor", "Tensor?", FP32), Arg("beta1", "float", default=0.9), Arg("beta2", "float", default=0.999),
    Arg("eps", "float", default=1e-8), Arg("weight_decay", "float", default=0.0),
    Arg("decoupled_weight_decay", "bool", default=False), Arg("maximize", "bool", default=False)),
    ref="params")

OPS: dict = {s.name: s for s in (CHECK, UNSCALE_, UNSCALE, CHECK_NORM, APPLY_UPDATES, UPDATE_SCALE_,
                                 LOWMEM_ADAM_STEP_)}
OPTIMIZERS: dict = {}
DIRECT_ONLY: dict = {}  # the checked steps: served by the direct door only, never a library op


def register_optimizer(opt: Optimizer) -> Optimizer:
    """Adds ``opt``'s ops to the table (before :mod:`ampfunc.ops._library` registers them)."""
    OPTIMIZERS[opt.name] = opt
    for spec in (step_spec(opt, True), step_spec(opt, False), update_spec(opt)):
        OPS[spec.name] = spec
    checked = step_spec(opt, False, checked=True)
    DIRECT_ONLY[checked.name] = checked
    return opt
