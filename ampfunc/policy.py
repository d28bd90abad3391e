"""Mixed-precision policies: which dtype params are stored in, computed in, and returned in.

A :class:`Policy` is three dtypes, as in jmp::

    policy = af.get_policy("p=f32,c=bf16,o=f32")
    x = policy.cast_to_compute(x)                          # activations in bf16
    p = af.cast_params(params, policy.compute_dtype,       # weights in bf16, norms stay fp32
                       keep=af.norm_layers(model))
    out = policy.cast_to_output(functional_call(model, p, (x,)))

Casting is a pure tree map over floating tensors: integer and bool tensors, numpy arrays,
strings, Python numbers and ``None`` pass through; containers (dict, list, tuple, NamedTuple)
recurse; other objects with a ``.to(dtype)`` method are cast by calling it. A leaf already in
the target dtype is returned as is (no copy), so casting costs one read and one write per leaf
whose dtype changes, and nothing for the others.

``Policy.autocast(device_type)`` bridges to ``torch.autocast``: the same policy can drive
torch's op-level autocasting instead of (or on top of) explicit casts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Iterable, Union

import optree
import torch

from ampfunc.loss_scale import LossScale
from ampfunc.tree import NAMESPACE, path_to_str, tree_unflatten

__all__ = [
    "Policy",
    "get_policy",
    "parse_dtype",
    "cast_floating",
    "params_of",
    "buffers_of",
    "cast_params",
    "norm_layers",
    "NORM_LAYER_TYPES",
    "BATCH_NORM_TYPES",
]

PyTree = Any
DTypeLike = Union[torch.dtype, str]
Keep = Union[None, str, Collection[str], Callable[[str, torch.Tensor], bool]]

# ----------------------------------------------------------------------------------------------
# dtype names
# ----------------------------------------------------------------------------------------------

# The first name of each dtype is the short one used by str(Policy).
_DTYPE_NAMES: dict[torch.dtype, tuple[str, ...]] = {
    torch.float16: ("f16", "float16", "half", "fp16"),
    torch.bfloat16: ("bf16", "bfloat16"),
    torch.float32: ("f32", "float32", "full", "fp32", "float", "single"),
    torch.float64: ("f64", "float64", "double", "fp64"),
}
_NAME_TO_DTYPE: dict[str, torch.dtype] = {n: dt for dt, names in _DTYPE_NAMES.items() for n in names}

_KEYS = {
    "p": "param_dtype", "param": "param_dtype", "params": "param_dtype",
    "c": "compute_dtype", "compute": "compute_dtype",
    "o": "output_dtype", "output": "output_dtype",
}

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


def _short_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype][0]


def parse_dtype(value: DTypeLike, what: str = "dtype") -> torch.dtype:
    """``torch.dtype`` named by ``value``: a floating ``torch.dtype`` or one of its names.

    Names (case-insensitive, an optional ``"torch."`` prefix is allowed): ``f16 float16 half
    fp16``, ``bf16 bfloat16``, ``f32 float32 full fp32 float single``, ``f64 float64 double
    fp64``. Anything else raises ``ValueError`` naming ``what`` and the bad value.

    Args:
      value: a floating ``torch.dtype`` or one of the names above.
      what: how errors name the value (the setting it came from).

    Returns:
      The ``torch.dtype``.

    Example:
      >>> af.policy.parse_dtype("bf16"), af.policy.parse_dtype("torch.float32")
      (torch.bfloat16, torch.float32)

    Cost: a dictionary lookup; no tensor work.
    """
    if isinstance(value, torch.dtype):
        if value not in _DTYPE_NAMES:
            raise ValueError(f"{what} must be a floating dtype (one of {_dtype_list()}), got {value}")
        return value
    if isinstance(value, str):
        name = value.strip().lower()
        if name.startswith("torch."):
            name = name[len("torch."):]
        if name in _NAME_TO_DTYPE:
            return _NAME_TO_DTYPE[name]
        raise ValueError(
            f"unknown {what} {value!r}; expected one of {sorted(_NAME_TO_DTYPE)} or a floating torch.dtype"
        )
    raise TypeError(f"{what} must be a torch.dtype or a dtype name, got {type(value).__name__} {value!r}")


def _dtype_list() -> str:
    return ", ".join(str(d) for d in _DTYPE_NAMES)


# ----------------------------------------------------------------------------------------------
# casting trees
# ----------------------------------------------------------------------------------------------


def _cast_leaf(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if torch.is_floating_point(x) else x
    if isinstance(x, torch.nn.Module):
        # Module.to(dtype) casts the module in place and returns it: a pure cast cannot call it.
        # Cast a module's weights with cast_params(params_of(module), dtype) instead.
        return x
    to = getattr(x, "to", None)
    if callable(to) and not isinstance(x, type):
        return to(dtype)
    return x


def _is_loss_scale(x: Any) -> bool:
    # A loss scale is optimizer state, not data: casting its fp32 scale to fp16 would turn the
    # default 2**16 into inf. Policies leave loss scales alone (jmp's cast would not).
    return isinstance(x, LossScale)


def cast_floating(tree: PyTree, dtype: DTypeLike) -> PyTree:
    """``tree`` with every floating tensor leaf cast to ``dtype``; everything else passes through.

    Integer/bool tensors, numpy arrays, strings, numbers and ``None`` are returned unchanged;
    dict, list, tuple and NamedTuple containers (and pytrees registered in the ``"ampfunc"``
    optree namespace) recurse; other objects with a ``.to`` method are cast by ``obj.to(dtype)``.
    ``torch.nn.Module`` objects and loss scales pass through (``Module.to`` is in place; a loss
    scale's fp32 state must stay fp32). A leaf already in ``dtype`` is returned as is (no
    copy). Differentiable: gradients flow back through the casts.

    Args:
      tree: a pytree.
      dtype: a floating ``torch.dtype`` or a dtype name (``"bf16"``, ``"half"``, ...; see
        :func:`parse_dtype`).

    Returns:
      A new pytree of ``tree``'s structure.

    Example:
      >>> out = af.policy.cast_floating({"x": torch.ones(2), "ids": torch.arange(2), "n": 3}, "bf16")
      >>> out["x"].dtype, out["ids"].dtype, out["n"]
      (torch.bfloat16, torch.int64, 3)

    Cost: one tree map; one cast kernel (a read and a new tensor written) per floating leaf
    whose dtype changes, none for the others; no host sync.
    """
    dtype = parse_dtype(dtype)
    return optree.tree_map(
        lambda x: x if _is_loss_scale(x) else _cast_leaf(x, dtype),
        tree,
        is_leaf=_is_loss_scale,
        namespace=NAMESPACE,
    )


# ----------------------------------------------------------------------------------------------
# Policy
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of a mixed-precision run: params stored, compute done, outputs returned.

    Immutable (a frozen dataclass; hashable, comparable). Fields accept a ``torch.dtype`` or a
    dtype name (``"bf16"``) and are stored as ``torch.dtype``. ``str(policy)`` is the jmp
    shorthand (``"p=f32,c=bf16,o=f32"``), which :func:`get_policy` parses back.
    ``cast_to_param`` / ``cast_to_compute`` / ``cast_to_output`` cast a tree's floating leaves
    (:func:`cast_floating`); ``autocast(device_type)`` is a ``torch.autocast`` context in
    ``compute_dtype``.

    Attributes:
      param_dtype: the dtype params are stored in (default ``torch.float32``).
      compute_dtype: the dtype the forward and backward compute in (default ``torch.float32``).
      output_dtype: the dtype outputs are returned in (default ``torch.float32``).

    Example:
      >>> policy = af.Policy(compute_dtype="bf16")
      >>> str(policy), policy.compute_dtype
      ('p=f32,c=bf16,o=f32', torch.bfloat16)
      >>> policy.cast_to_compute({"x": torch.ones(2)})["x"].dtype
      torch.bfloat16
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, parse_dtype(getattr(self, field), field))

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Floating tensor leaves of ``tree`` cast to ``param_dtype`` (see :func:`cast_floating`)."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Floating tensor leaves of ``tree`` cast to ``compute_dtype`` (see :func:`cast_floating`)."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Floating tensor leaves of ``tree`` cast to ``output_dtype`` (see :func:`cast_floating`)."""
        return cast_floating(tree, self.output_dtype)

    def with_param_dtype(self, dtype: DTypeLike) -> "Policy":
        return dataclasses.replace(self, param_dtype=dtype)

    def with_compute_dtype(self, dtype: DTypeLike) -> "Policy":
        return dataclasses.replace(self, compute_dtype=dtype)

    def with_output_dtype(self, dtype: DTypeLike) -> "Policy":
        return dataclasses.replace(self, output_dtype=dtype)

    @property
    def autocast_enabled(self) -> bool:
        """Whether :meth:`autocast` turns torch's autocast on (compute dtype fp16 or bf16)."""
        return self.compute_dtype in _AUTOCAST_DTYPES

    def autocast(self, device_type: str = "cuda", **kwargs) -> torch.autocast:
        """A ``torch.autocast(device_type, dtype=compute_dtype)`` context driven by this policy.

        Enabled only when ``compute_dtype`` is fp16 or bf16 (the dtypes autocast runs in); for
        fp32/fp64 compute it is a disabled autocast region, so the same code path serves every
        policy. ``kwargs`` (e.g. ``cache_enabled``) go to ``torch.autocast``.
        """
        if self.autocast_enabled:
            return torch.autocast(device_type, dtype=self.compute_dtype, enabled=True, **kwargs)
        # No dtype when disabled: some torch versions warn about a dtype the device cannot
        # autocast to even when the region is off.
        return torch.autocast(device_type, enabled=False, **kwargs)

    def __str__(self) -> str:
        return (f"p={_short_name(self.param_dtype)},c={_short_name(self.compute_dtype)},"
                f"o={_short_name(self.output_dtype)}")


def get_policy(spec: Union[str, torch.dtype, Policy]) -> Policy:
    """The :class:`Policy` described by ``spec`` (jmp's grammar).

    - ``"p=f32,c=bf16,o=f32"`` or ``"params=float32,compute=float16,output=float32"``: keys
      ``p``/``param``/``params``, ``c``/``compute``, ``o``/``output``, any order. Missing
      keys default: params to fp32, compute to params, output to compute
      (``"c=f16"`` is ``p=f32,c=f16,o=f16``; ``"p=bf16"`` is all bf16).
    - a dtype name alone (``"bf16"``, ``"float16"``, ``"half"`` = all fp16, ``"full"`` = all
      fp32), or a ``torch.dtype``: every field that dtype.
    - a :class:`Policy` is returned as is.

    Names are case-insensitive; spaces are ignored. A bad spec raises ``ValueError`` naming
    the part at fault.

    Args:
      spec: a policy string, a dtype name, a floating ``torch.dtype`` or a :class:`Policy`.

    Returns:
      A :class:`Policy` (``spec`` itself when it is one).

    Example:
      >>> str(af.get_policy("c=f16")), str(af.get_policy("params=float32,compute=bfloat16"))
      ('p=f32,c=f16,o=f16', 'p=f32,c=bf16,o=bf16')
      >>> af.get_policy("half") == af.get_policy(torch.float16)
      True

    Cost: string parsing only; no tensor work, no host sync.
    """
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, torch.dtype):
        d = parse_dtype(spec, "policy dtype")
        return Policy(d, d, d)
    if not isinstance(spec, str):
        raise TypeError(f"get_policy expects a string such as 'p=f32,c=bf16,o=f32', got {type(spec).__name__}")
    text = spec.replace(" ", "")
    if not text:
        raise ValueError("get_policy: empty policy string; expected e.g. 'p=f32,c=bf16,o=f32' or 'half'")
    if "=" not in text:
        d = _policy_dtype(text, spec, None)
        return Policy(d, d, d)
    fields: dict[str, torch.dtype] = {}
    for part in text.split(","):
        if not part:
            raise ValueError(f"get_policy: empty entry in policy {spec!r}")
        key, sep, value = part.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"get_policy: entry {part!r} of policy {spec!r} is not of the form key=dtype")
        field = _KEYS.get(key.lower())
        if field is None:
            raise ValueError(
                f"get_policy: unknown key {key!r} in {part!r} of policy {spec!r}; "
                "expected 'params' (p), 'compute' (c) or 'output' (o)"
            )
        if field in fields:
            raise ValueError(f"get_policy: {field.split('_')[0]} given twice in policy {spec!r}")
        fields[field] = _policy_dtype(value, spec, part)
    param = fields.get("param_dtype", torch.float32)
    compute = fields.get("compute_dtype", param)
    output = fields.get("output_dtype", compute)
    return Policy(param, compute, output)


def _policy_dtype(name: str, spec: str, part: str | None) -> torch.dtype:
    dtype = _NAME_TO_DTYPE.get(name.lower().removeprefix("torch."))
    if dtype is None:
        if part is not None:
            where, hint = f"in {part!r} of policy {spec!r}", ""
        else:
            where, hint = f"(policy {spec!r})", ", or key=dtype entries as in 'p=f32,c=bf16,o=f32'"
        raise ValueError(f"get_policy: unknown dtype {name!r} {where}; expected one of {sorted(_NAME_TO_DTYPE)}{hint}")
    return dtype


# ----------------------------------------------------------------------------------------------
# Parameters of a module as a pytree
# ----------------------------------------------------------------------------------------------


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{"layer.0.weight": tensor, ...}``: the module's parameters as a plain-tensor pytree.

    Each value is ``param.detach()``: a plain tensor (``requires_grad=False``) sharing storage
    with the parameter, no copy. That is what ``torch.func.functional_call`` and
    ``torch.func.grad`` take. Pure updates (``apply_updates``) make new tensors and leave the
    module untouched; in-place ones (``step_``) write through to it. Tied parameters appear
    once, under their first name (as ``named_parameters`` lists them). For an independent
    copy use ``ampfunc.tree.tree_clone``.

    Args:
      model: a ``torch.nn.Module``.

    Returns:
      A dict from dotted parameter name to detached tensor, in ``named_parameters`` order.

    Example:
      >>> model = nn.Sequential(nn.Linear(3, 2))
      >>> params = af.params_of(model)
      >>> list(params), params["0.weight"].requires_grad
      (['0.weight', '0.bias'], False)

    Cost: one ``detach`` per parameter (a view: no copy, no kernel); no host sync.
    """
    _check_module(model, "params_of")
    return {name: p.detach() for name, p in model.named_parameters()}


def buffers_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{"bn.running_mean": tensor, ...}``: the module's buffers, detached (no copy).

    As :func:`params_of`, for ``named_buffers``. Pass ``{**params, **buffers}`` to
    ``functional_call`` to run with both.

    BatchNorm in training mode updates its running statistics in place, and those updates
    write through to the module's buffers. Under ``torch.func.grad`` pass the buffers as an
    argument of the transformed function, not through a closure: torch.func refuses in-place
    updates of captured tensors.

    Args:
      model: a ``torch.nn.Module``.

    Returns:
      A dict from dotted buffer name to detached tensor, in ``named_buffers`` order.

    Example:
      >>> model = nn.Sequential(nn.BatchNorm1d(2))
      >>> list(af.policy.buffers_of(model))
      ['0.running_mean', '0.running_var', '0.num_batches_tracked']

    Cost: one ``detach`` per buffer (a view: no copy, no kernel); no host sync.
    """
    _check_module(model, "buffers_of")
    return {name: b.detach() for name, b in model.named_buffers()}


def _check_module(model, fn: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn} expects a torch.nn.Module, got {type(model).__name__}")


# ----------------------------------------------------------------------------------------------
# Norm layers and cast_params
# ----------------------------------------------------------------------------------------------


def _norm_layer_types() -> tuple[type, ...]:
    nn = torch.nn
    names = (
        "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
        "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d",
        "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
        "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d",
        "LayerNorm", "GroupNorm", "LocalResponseNorm", "CrossMapLRN2d",
        "RMSNorm",  # torch >= 2.4
    )
    return tuple(getattr(nn, n) for n in names if isinstance(getattr(nn, n, None), type))


#: Module types whose params and buffers :func:`norm_layers` names (subclasses included).
#: apex keeps BatchNorm fp32 (``keep_batchnorm_fp32``, ``BN_convert_float``); the others are
#: the modern normalizations, whose statistics need fp32 range and precision just as much.
NORM_LAYER_TYPES: tuple[type, ...] = _norm_layer_types()

#: Only the batch norms: exactly what apex O2 keeps fp32. cuDNN's batch norm takes fp16/bf16
#: activations with fp32 weights, so this set works on CUDA without autocast.
BATCH_NORM_TYPES: tuple[type, ...] = tuple(
    t for t in NORM_LAYER_TYPES if issubclass(t, torch.nn.modules.batchnorm._BatchNorm)
)


class NormLayerPaths(frozenset):
    """A frozenset of leaf paths (what :func:`norm_layers` returns); usable as ``keep=``."""

    def __repr__(self) -> str:
        return f"NormLayerPaths({sorted(self)!r})"


def norm_layers(model: torch.nn.Module, types: Iterable[type] | None = None) -> NormLayerPaths:
    """Paths of the params and buffers of the normalization modules of ``model``.

    ``types`` defaults to :data:`NORM_LAYER_TYPES` (BatchNorm1/2/3d, SyncBatchNorm, the lazy
    variants, InstanceNorm*, LayerNorm, GroupNorm, LocalResponseNorm, RMSNorm); pass your own
    tuple to replace it, e.g. ``NORM_LAYER_TYPES + (MyNorm,)``. Paths are spelled as
    :func:`params_of` / :func:`buffers_of` spell them, so the result can be passed as
    ``cast_params(..., keep=norm_layers(model))``. Walks the module tree once; no tensor work.

    Running such a model means feeding fp16/bf16 activations to fp32 norm weights. CPU kernels
    and CUDA batch norm accept that; CUDA ``layer_norm`` does not without autocast (it raises
    "expected scalar type Half but found Float", pytorch/pytorch#135969). On CUDA either run
    the forward under ``policy.autocast("cuda")`` (which computes layer/group norm in fp32) or
    keep only the batch norms: ``norm_layers(model, types=BATCH_NORM_TYPES)`` (apex O2's rule).

    Args:
      model: a ``torch.nn.Module``.
      types: the normalization module types (subclasses included); ``None`` for
        :data:`NORM_LAYER_TYPES`.

    Returns:
      A ``NormLayerPaths`` (a frozenset of the dotted param and buffer paths), usable as
      ``keep=`` of :func:`cast_params`.

    Example:
      >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
      >>> sorted(af.norm_layers(model))
      ['1.bias', '1.weight']

    Cost: one walk of the module tree; no tensor work, no host sync.
    """
    _check_module(model, "norm_layers")
    types = NORM_LAYER_TYPES if types is None else tuple(types)
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, torch.nn.Module))]
    if bad:
        raise TypeError(f"norm_layers: types must be torch.nn.Module subclasses, got {bad!r}")
    # Names as the whole model lists them (tied params under their first name), restricted to
    # tensors owned directly by a norm module.
    owned = set()
    for _, module in model.named_modules():
        if isinstance(module, types):
            owned.update(id(t) for t in module.parameters(recurse=False))
            owned.update(id(t) for t in module.buffers(recurse=False))
    paths = [n for n, p in model.named_parameters() if id(p) in owned]
    paths += [n for n, b in model.named_buffers() if id(b) in owned]
    return NormLayerPaths(paths)


def _keep_predicate(keep: Keep) -> Callable[[str, torch.Tensor], bool]:
    if keep is None:
        return lambda path, leaf: False
    if isinstance(keep, str):
        keep = (keep,)
    if callable(keep) and not isinstance(keep, (set, frozenset, list, tuple, dict)):
        return keep
    try:
        names = frozenset(keep)
    except TypeError:
        raise TypeError(
            f"cast_params: keep must be None, a path, a collection of paths or a predicate "
            f"(path, leaf) -> bool; got {type(keep).__name__}"
        ) from None
    not_str = [n for n in names if not isinstance(n, str)]
    if not_str:
        raise TypeError(f"cast_params: keep paths must be strings, got {not_str[:3]!r}")

    def named(path: str, leaf) -> bool:
        if path in names:
            return True
        # "encoder.norm" keeps "encoder.norm.weight", "encoder.norm.bias", ...
        head = path
        while "." in head:
            head = head.rsplit(".", 1)[0]
            if head in names:
                return True
        return False

    return named


def cast_params(params: PyTree, dtype: DTypeLike, keep: Keep = None) -> PyTree:
    """``params`` with its floating tensor leaves cast to ``dtype``, except those ``keep`` names.

    ``keep`` is ``None``, a path or collection of paths (a path also keeps every leaf below it:
    ``"encoder.norm"`` keeps ``"encoder.norm.weight"``), the result of :func:`norm_layers`, or
    a predicate ``(path, leaf) -> bool`` called for each floating leaf not yet in ``dtype``.
    Kept leaves, leaves already in ``dtype``, integer and bool leaves, loss scales and
    non-tensors are returned as they are. A tuple or list of dicts at the top (``(params,
    buffers)``, as ``functional_call`` takes them) is cast dict by dict, each with its own paths. Pure and
    differentiable (usable inside ``torch.func.grad``: the grads of fp32 params come back fp32).

    A cast leaf is a new tensor, so in-place updates a forward makes to it (BatchNorm's
    running statistics) never reach the original; kept leaves are the originals, which is one
    more reason to keep norm buffers (``norm_layers`` names them).

    Args:
      params: a pytree of tensors, e.g. :func:`params_of` of a module.
      dtype: a floating ``torch.dtype`` or a dtype name (see :func:`parse_dtype`).
      keep: the leaves to leave as they are: ``None``, a path, a collection of paths, or a
        predicate ``(path, leaf) -> bool``.

    Returns:
      A new pytree of ``params``' structure.

    Example:
      >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
      >>> p = af.cast_params(af.params_of(model), torch.bfloat16, keep=af.norm_layers(model))
      >>> p["0.weight"].dtype, p["1.weight"].dtype
      (torch.bfloat16, torch.float32)

    Cost: one flatten with paths; one cast kernel (a read and a new tensor written) per leaf
    whose dtype changes, nothing for the others; no host sync.
    """
    dtype = parse_dtype(dtype, "cast_params dtype")
    if type(params) in (tuple, list) and params and all(isinstance(part, dict) for part in params):
        # (params, buffers), as functional_call takes them: each part keeps its own paths, so
        # norm_layers(model)'s "1.weight" still names the norm weight (not "0.1.weight").
        return type(params)(cast_params(part, dtype, keep) for part in params)
    kept = None if keep is None else _keep_predicate(keep)
    # Loss scales are leaves here and pass through: their fp32 state is not a param.
    accessors, leaves, spec = optree.tree_flatten_with_accessor(params, is_leaf=_is_loss_scale, namespace=NAMESPACE)
    out = []
    for accessor, leaf in zip(accessors, leaves):
        if isinstance(leaf, torch.Tensor) and torch.is_floating_point(leaf) and leaf.dtype != dtype \
                and (kept is None or not kept(path_to_str(accessor), leaf)):
            leaf = leaf.to(dtype)
        out.append(leaf)
    return tree_unflatten(spec, out)
