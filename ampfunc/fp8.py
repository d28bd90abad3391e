"""FP8 linear layers as a policy: scaled e4m3/e5m2 matmuls whose scaling state is a pytree.

An :class:`Fp8Policy` names the ``nn.Linear`` layers of a model that run as scaled FP8
matmuls (by default every Linear except those excluded, e.g. the output head). Inputs and
weights are quantised to ``float8_e4m3fn``, output gradients to ``float8_e5m2``, each with a
per-tensor scale; the products accumulate in fp32 and come out in the input's dtype (the
policy's compute dtype: bf16 or fp32). Everything else runs as before.

The scaling state -- per layer and per operand (input, weight, output gradient) an amax history
and the current scale -- is a pytree of tensors (:class:`Fp8LinearState` of :class:`Fp8Meta`)
that goes in and out of the step like the loss scale does. The new state comes back as the
*gradient* of the state (flax's "overwrite with gradient"): the backward of each FP8 matmul
returns the advanced input, weight and output-gradient metadata as the gradient of the state it
was given. So the loop differentiates one more argument and keeps what comes back::

    fp8 = af.fp8.fp8_policy(model, exclude=("head",))              # DelayedScaling(history_len=16)
    state8 = fp8.init()

    def loss_fn(params, state8, x, y):
        p = af.cast_params(params, torch.bfloat16, keep=af.norm_layers(model))
        return F.cross_entropy(fp8.apply(model, p, state8, x).float(), y)

    (grads, state8), loss = grad_and_value(loss_fn, argnums=(0, 1))(params, state8, x, y)

The gradient of the state is never scaled by the loss scale nor summed with anything, so
unscale/check/clip must see only the parameter gradients (pass the state as its own argument).
A layer that did not run gets a zero "gradient", which the next step treats as an empty history
(it falls back to the current amax, see :class:`DelayedScaling`). A layer used several times
before one backward -- shared or looped over, or in several forwards inside one
:meth:`Fp8Policy.apply` / :meth:`Fp8Policy.autocast` (``make_train_step`` opens one around its
``loss_fn``) -- records the max of its uses' amaxes, as flax's ``fp32_max_grad`` does: its uses
are chained so that only the first returns a state "gradient" (autograd would add two). Over a
:meth:`Fp8Policy.track` ed state the contexts and backwards combine by max too (gradient
accumulation). Two separate contexts over one untracked state in one backward are refused by
name in eager mode (``RuntimeError``), since autograd would add their advanced states.

How layers are found: :meth:`Fp8Policy.apply` runs ``torch.func.functional_call`` under a
``TorchFunctionMode`` that intercepts ``F.linear`` calls whose weight *is* (by identity) the
weight of a named layer (a weight tied to another parameter is found under that parameter's
path); the model is never modified. :meth:`Fp8Policy.autocast` does the same around a stateful
forward. Both trace as one graph under ``torch.compile(fullgraph=True)``. Linears sharing one
weight are refused by :func:`fp8_policy`; a named layer inside ``torch.utils.checkpoint`` within
the context is refused when it runs (the recomputation would run outside the context).

Matmuls: ``torch._scaled_mm`` (CUDA sm89+/sm90 and CPU in recent torch) with the dequant scales
``1/scale``; its second operand is made column-major and dims padded to multiples of 16 where
needed; ``backend="emulate"`` quantises with the same scales, dequantises and multiplies in
fp32: the plain-torch reference, the fallback where ``_scaled_mm`` is unavailable, and
``backend="auto"``'s choice on CPU, where it is far faster than torch's CPU ``_scaled_mm``. On
CPU FP8 is for correctness, not speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import warnings
from typing import Any, Iterable, NamedTuple, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from ampfunc.tree import register_state_classes

__all__ = [
    "E4M3",
    "E5M2",
    "DelayedScaling",
    "CurrentScaling",
    "Fp8Meta",
    "Fp8LinearState",
    "Fp8Policy",
    "fp8_policy",
    "fp8_linear",
    "quantize",
    "scaled_matmul",
    "advance_meta",
    "fp8_available",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_FP8_MAX = {E4M3: float(torch.finfo(E4M3).max), E5M2: float(torch.finfo(E5M2).max)}  # 448, 57344
_F32_MAX = float(torch.finfo(torch.float32).max)
_BACKENDS = ("auto", "scaled_mm", "emulate")
# The margins for which the scales' numerator fp8_max * 2**-margin works in both formats: below
# -112, 57344 * 2**-margin overflows fp32 (57344 * 2**112 ~ 2.98e38 is the last finite one);
# above 18, 448 * 2**-margin rounds to 0 in e4m3 (smallest subnormal 2**-9), so every value
# would quantise to 0 -- and from ~135 the scale itself underflows fp32 and the step is NaN.
_MARGIN_RANGE = (-112, 18)


def _check_recipe(recipe) -> None:
    """Refuses a recipe's bad settings at construction, naming the class and the setting."""
    cls = type(recipe).__name__
    for field in ("history_len", "margin"):
        value = getattr(recipe, field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{cls}: {field} must be an int, got {type(value).__name__} {value!r}")
    if recipe.history_len < 1:
        raise ValueError(f"{cls}: history_len must be an int >= 1, got {recipe.history_len!r}")
    lo, hi = _MARGIN_RANGE
    if not lo <= recipe.margin <= hi:
        raise ValueError(f"{cls}: margin must be an int in [{lo}, {hi}], got {recipe.margin!r}: the scale is "
                         f"fp8_max * 2**-margin / amax, and 448 * 2**-{hi + 1} rounds to 0 in e4m3 (every value "
                         f"would quantise to 0; from margin ~135 the scale underflows fp32 and every step is NaN), "
                         f"while 57344 * 2**{-lo + 1} overflows fp32")
    if not isinstance(recipe.power_of_2, bool):
        raise TypeError(f"{cls}: power_of_2 must be a bool, got {type(recipe.power_of_2).__name__}")


# ----------------------------------------------------------------------------------------------
# Recipes (static configuration) and state (tensors)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling (Transformer Engine's recipe): the scale comes from past amaxes.

    Step ``t`` quantises a tensor with the scale computed after step ``t-1``: ``fp8_max /
    amax * 2**-margin``, where ``amax`` is the max of the last ``history_len`` recorded amaxes
    (``amax_compute="max"``) or the latest one (``"most_recent"``). Then the tensor's own amax
    is pushed into the history (slot 0 newest) and the next scale computed. An amax that is 0,
    inf or NaN is not recorded and leaves the scale as it was (the layer did not run, or the
    step overflowed and will be skipped). Departure from TE, on purpose: while the history is
    still empty (the first step) the tensor is quantised with its *current* amax instead of
    scale 1, so the first step neither saturates activations nor flushes gradients to zero.
    ``power_of_2`` rounds scales down to a power of two (exact rescaling).

    Settings are checked at construction: ``history_len`` an int ``>= 1`` and ``margin`` an int
    in ``[-112, 18]`` (not a bool: ``TypeError``); ``margin > 18`` would quantise every value
    to 0 in e4m3 (``448 * 2**-19`` rounds to 0) and ``margin < -112`` overflows fp32
    (``ValueError`` naming the setting and the bound).
    """

    history_len: int = 16
    margin: int = 0
    amax_compute: str = "max"
    power_of_2: bool = False

    def __post_init__(self):
        _check_recipe(self)
        if not isinstance(self.amax_compute, str) or self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling: amax_compute must be 'max' or 'most_recent', got {self.amax_compute!r}")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Current (dynamic) scaling, torchao's default: each tensor is quantised with
    ``fp8_max / amax(tensor) * 2**-margin`` of its own amax (all-reduced under a group); an amax
    of 0, inf or NaN gives scale 1. The state still records an amax history (``history_len``)
    and the scale used, for monitoring. Settings are checked as :class:`DelayedScaling`'s
    (``margin`` an int in ``[-112, 18]``)."""

    history_len: int = 1
    margin: int = 0
    power_of_2: bool = False

    def __post_init__(self):
        _check_recipe(self)


Recipe = Union[DelayedScaling, CurrentScaling]


class Fp8Meta(NamedTuple):
    """Scaling state of one operand: ``amax_history`` (fp32, ``(history_len,)``, slot 0 the
    newest) and ``scale`` (0-d fp32; quantised = ``x * scale``, dequantised = ``q / scale``)."""

    amax_history: torch.Tensor
    scale: torch.Tensor


class Fp8LinearState(NamedTuple):
    """Scaling state of one FP8 linear layer: one :class:`Fp8Meta` per operand."""

    input: Fp8Meta
    weight: Fp8Meta
    grad_output: Fp8Meta


register_state_classes(Fp8Meta, Fp8LinearState, DelayedScaling, CurrentScaling)


def _check_history(state: Fp8LinearState | Fp8Meta, recipe: Recipe, where: str) -> None:
    """Refuses a state whose amax histories are not ``recipe.history_len`` long, or whose scales
    are not 0-d (one per tensor: a shaped scale would broadcast into the operand), naming ``where``.

    Transformer Engine resizes a module's histories when the recipe's length changes
    (``adjust_amax_history_length``: the newest entries kept, zeros appended). Here the state is
    the caller's pytree and comes back as a gradient of the same shape, so it cannot be resized
    inside the step: a state of another length is refused and :meth:`Fp8Policy.resize_history`
    does TE's resize explicitly."""
    metas = [(None, state)] if isinstance(state, Fp8Meta) else list(zip(("input", "weight", "grad_output"), state))
    for operand, meta in metas:
        if meta.scale.dim() != 0:
            which = "" if operand is None else f".{operand}"
            raise ValueError(f"{where}{which}.scale has shape {tuple(meta.scale.shape)}, expected a 0-d tensor "
                             "(one scale per tensor, as Fp8Policy.init makes it)")
        h = meta.amax_history
        if h.dim() != 1 or h.shape[0] != recipe.history_len:
            which = "" if operand is None else f".{operand}"
            raise ValueError(
                f"{where}{which}.amax_history has shape {tuple(h.shape)} but the recipe's history_len is "
                f"{recipe.history_len}: the state was made under another recipe. Resize it to the recipe with "
                "Fp8Policy.resize_history(state) (the newest entries kept, zeros appended, as Transformer "
                "Engine's adjust_amax_history_length), or run the recipe it was saved with")


# The operand dtypes an FP8 layer takes (the compute dtypes it quantises from and returns in).
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, where: str) -> None:
    """Refuses an input or weight outside float32/bfloat16/float16, naming ``where``: quantising an
    integer tensor would return a product in that integer dtype, its values truncated (plain
    F.linear refuses it too), and a float64 one would be computed from 8-bit operands and
    returned as float64, a precision it no longer has."""
    for role, t in (("input", x), ("weight", weight)):
        if t.dtype not in _HIGH_PRECISION:
            raise TypeError(f"{where}: the {role} must be a floating tensor (float32, bfloat16 or float16), got "
                            f"{t.dtype}: cast it first (policy.cast_to_compute), as a plain nn.Linear needs too")


def _new_meta(history_len: int, device) -> Fp8Meta:
    return Fp8Meta(torch.zeros(history_len, dtype=torch.float32, device=device),
                   torch.ones((), dtype=torch.float32, device=device))


# ----------------------------------------------------------------------------------------------
# Scales, quantisation and the scaled matmul
# ----------------------------------------------------------------------------------------------


def _amax(t: torch.Tensor, group) -> torch.Tensor:
    amax = t.abs().amax().to(torch.float32) if t.numel() else torch.zeros((), dtype=torch.float32, device=t.device)
    if group is not None:
        import torch.distributed as dist

        # MAX over the ranks, so every rank quantises with the same scale. A NaN goes in as +inf:
        # a backend's MAX may drop a NaN depending on the rank order (gloo's MAX(3, nan) is 3),
        # and a non-finite amax must reach every rank (neither is recorded; both keep the scale).
        amax = torch.nan_to_num(amax, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _scale_from_amax(amax: torch.Tensor, fallback: torch.Tensor, fp8_max: float, recipe: Recipe) -> torch.Tensor:
    """``fp8_max * 2**-margin / amax``, or ``fallback`` where amax is 0, inf or NaN."""
    valid = torch.isfinite(amax) & (amax > 0)
    scale = (fp8_max * 2.0 ** -recipe.margin) / torch.where(valid, amax, torch.ones_like(amax))
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, _F32_MAX))  # amax subnormal
    if recipe.power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return torch.where(valid, scale, fallback)


def _used_scale(meta: Fp8Meta, amax: torch.Tensor, fp8_max: float, recipe: Recipe) -> torch.Tensor:
    """The scale that quantises a tensor of amax ``amax`` now (the first half of :func:`advance_meta`)."""
    current = _scale_from_amax(amax, torch.ones_like(meta.scale, dtype=torch.float32), fp8_max, recipe)
    if isinstance(recipe, DelayedScaling):
        return torch.where(meta.amax_history.to(torch.float32).amax() > 0, meta.scale.to(torch.float32), current)
    return current


def _next_meta(meta: Fp8Meta, amax: torch.Tensor, fp8_max: float, recipe: Recipe) -> Fp8Meta:
    """The advanced :class:`Fp8Meta` once ``amax`` is recorded (the second half of :func:`advance_meta`)."""
    history, old_scale = meta.amax_history.to(torch.float32), meta.scale.to(torch.float32)
    recorded = torch.isfinite(amax) & (amax > 0)
    new_history = torch.where(recorded, torch.cat([amax.reshape(1), history[:-1]]), history)
    if isinstance(recipe, DelayedScaling):
        basis = new_history.amax() if recipe.amax_compute == "max" else new_history[0]
        return Fp8Meta(new_history, _scale_from_amax(basis, old_scale, fp8_max, recipe))
    return Fp8Meta(new_history, _scale_from_amax(amax, torch.ones_like(old_scale), fp8_max, recipe))


def advance_meta(meta: Fp8Meta, amax: torch.Tensor, fp8_max: float, recipe: Recipe) -> tuple[torch.Tensor, Fp8Meta]:
    """``(scale to quantise with now, next meta)`` for a tensor whose amax is ``amax``.

    Implements :class:`DelayedScaling` / :class:`CurrentScaling` (see there). Pure; a few
    0-d and ``(history_len,)`` ops on the device; no host sync.

    Args:
      meta: the operand's :class:`Fp8Meta`.
      amax: 0-d fp32, the tensor's max absolute value (already reduced across ranks).
      fp8_max: the format's largest finite value (448 for e4m3, 57344 for e5m2).
      recipe: a :class:`DelayedScaling` or :class:`CurrentScaling`.

    Returns:
      The 0-d fp32 scale for this use and the advanced :class:`Fp8Meta`.

    Example:
      >>> recipe = af.fp8.DelayedScaling()
      >>> scale, meta = af.fp8.advance_meta(meta, x.abs().amax().float(), 448.0, recipe)  # doctest: +SKIP
    """
    _check_history(meta, recipe, "advance_meta: meta")
    return _used_scale(meta, amax, fp8_max, recipe), _next_meta(meta, amax, fp8_max, recipe)


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` cast to the fp8 ``dtype``, saturating finite values at the format's max.

    e4m3 (forward operands): everything, inf included, saturates at +-448. e5m2 (output
    gradients): finite values saturate at +-57344 but inf and NaN pass through, so an overflowed
    backward (a loss scale too high) still reaches the gradients and the finite check sees it.
    Cost: one read of ``t`` and one fp8 write (plus an fp32 temporary).

    Args:
      t: a floating tensor.
      scale: 0-d fp32 scale (quantised = ``t * scale``).
      dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
      The quantised tensor in ``dtype``.

    Example:
      >>> q = af.fp8.quantize(torch.tensor([1000.0]), torch.tensor(1.0), af.fp8.E4M3)   # 448
    """
    if dtype not in _FP8_MAX:
        raise ValueError(f"quantize: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    fp8_max = _FP8_MAX[dtype]
    y = t.to(torch.float32) * scale
    clamped = y.clamp(-fp8_max, fp8_max)
    if dtype == E5M2:
        clamped = torch.where(torch.isinf(y), y, clamped)
    return clamped.to(dtype)


def fp8_available(device: torch.device | str | None = None) -> bool:
    """Whether ``torch._scaled_mm`` takes fp8 operands on ``device``: CUDA compute capability
    8.9+ (Ada, Hopper, Blackwell), or a ROCm GPU or a CPU where a probe call of the kernel
    succeeds."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    device = torch.device("cpu" if device is None else device)
    key = device.type  # one answer per device type (machines mixing GPU generations are rare)
    if key not in _CAPABLE:
        _CAPABLE[key] = _probe(device)
    return _CAPABLE[key]


_CAPABLE: dict[str, bool] = {}


def _probe(device: torch.device) -> bool:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        if torch.version.hip is None:
            return torch.cuda.get_device_capability(device) >= (8, 9)
        # ROCm: only some generations (MI300) have fp8 matmuls; ask the kernel, as on the CPU.
    try:
        one = torch.ones((), device=device)
        a = torch.zeros(16, 16, dtype=E4M3, device=device)
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] += extra
    out = t.new_zeros(shape)  # fp8 zeros, then a copy: no fp8 arithmetic or cat kernel needed
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
                  out_dtype: torch.dtype, backend: str = "scaled_mm", fast_accum: bool = False) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` for fp8 ``a`` ``(M, K)`` and ``b`` ``(K, N)``, in ``out_dtype``.

    ``backend="scaled_mm"`` calls ``torch._scaled_mm`` with ``a`` row-major, ``b``
    column-major and K, N padded with zeros to multiples of 16 (cuBLAS's rule; the padding
    contributes nothing); ``"emulate"`` dequantises both operands to fp32 and multiplies in
    fp32 (the reference). Cost: one GEMM (plus a transposed copy of ``b`` when it is row-major).

    Args:
      a, b: fp8 operands (not both e5m2).
      a_inv, b_inv: 0-d fp32 dequant factors (``1 / scale``).
      out_dtype: ``torch.float32`` or ``torch.bfloat16`` (or ``float16``).
      backend: ``"scaled_mm"`` or ``"emulate"``.
      fast_accum: cuBLAS fast accumulation (the forward GEMM only, as TE and torchao do).

    Returns:
      The ``(M, N)`` product in ``out_dtype``.

    Example:
      >>> y = af.fp8.scaled_matmul(xq, wq.t(), 1 / sx, 1 / sw, torch.bfloat16)  # doctest: +SKIP
    """
    if backend == "emulate":
        return ((a.to(torch.float32) * a_inv) @ (b.to(torch.float32) * b_inv)).to(out_dtype)
    m, n = a.shape[0], b.shape[1]
    a = _pad_to(a.contiguous(), 1, 16)
    b = _pad_to(_pad_to(b, 0, 16), 1, 16)
    b = b.t().contiguous().t()  # column-major (a no-op copy when it already is)
    out = torch._scaled_mm(a, b, a_inv, b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return out[:m, :n] if out.shape[1] != n else out


# ----------------------------------------------------------------------------------------------
# The FP8 linear: an autograd.Function whose state gradient is the new state
# ----------------------------------------------------------------------------------------------


class _Config(NamedTuple):
    recipe: Any
    backend: str
    group: Any
    name: str | None = None  # the layer's path, for errors


# The heads (_Fp8Linear) that ran in the current backward, by the id of their state: two heads of
# one state in one backward would have autograd add their advanced states.
_HEADS: dict[str, Any] = {"task": None, "states": set()}


def _note_head(state_id: int, name: str | None) -> None:
    task = torch._C._current_graph_task_id()
    if task != _HEADS["task"]:
        _HEADS["task"], _HEADS["states"] = task, set()
    if state_id in _HEADS["states"]:
        layer = "an fp8_linear state" if name is None else f"layer {name!r}"
        raise RuntimeError(
            f"Fp8Policy: the scaling state of {layer} was used by two separate FP8 contexts (two fp8.apply or "
            "fp8.autocast calls, or fp8_linear calls) that one backward covers: autograd would add their "
            "advanced states (amax1 + amax2). Run the forwards inside one fp8.autocast(model, state8, params) "
            "(its uses combine by max), or pass fp8.track(state8) to each context and read fp8.from_grads")
    _HEADS["states"].add(state_id)


class _Fp8Linear(torch.autograd.Function):
    """``x @ w.T`` in fp8; one use of a layer's state in a chain of uses that combine by max.

    The uses of one layer's state that one backward covers (a layer run twice, or in several
    forwards before one backward) are chained: each use after the first takes the previous
    use's ``link`` output as its ``link`` input. In the backward, each use sends down the chain
    the max of its own amaxes (input, weight, output gradient) and those that came up from the
    later uses; the first use (``link=None``, the head) then advances the six state tensors once
    with those maxima and returns them as their "gradient". Only the head returns a state
    gradient, so autograd has nothing to sum (a sum would record amax1 + amax2). A head given a
    ``link`` tensor (a tracked state, :meth:`Fp8Policy.track`) returns the maxima there instead.
    """

    @staticmethod
    def forward(x, w, xh, xs, wh, ws, gh, gs, link, cfg: _Config):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        amax_x, amax_w = _amax(x2, cfg.group), _amax(w, cfg.group)
        x_scale = _used_scale(Fp8Meta(xh, xs), amax_x, _FP8_MAX[E4M3], cfg.recipe)
        w_scale = _used_scale(Fp8Meta(wh, ws), amax_w, _FP8_MAX[E4M3], cfg.recipe)
        xq, wq = quantize(x2, x_scale, E4M3), quantize(w, w_scale, E4M3)
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        y = scaled_matmul(xq, wq.t(), x_inv, w_inv, x.dtype, cfg.backend, fast_accum=True)
        # The link's value is never read: it only carries the later uses' amaxes back as its gradient.
        link_out = torch.zeros(3, dtype=torch.float32, device=x.device)
        return y.reshape(*x.shape[:-1], w.shape[0]), xq, wq, x_inv, w_inv, torch.stack([amax_x, amax_w]), link_out

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, xh, xs, wh, ws, gh, gs, link, cfg = inputs
        _, xq, wq, x_inv, w_inv, amax_xw, _ = output
        ctx.save_for_backward(xq, wq, x_inv, w_inv, amax_xw, xh, xs, wh, ws, gh, gs)
        ctx.mark_non_differentiable(xq, wq, x_inv, w_inv, amax_xw)
        ctx.cfg, ctx.head, ctx.state_id = cfg, link is None, id(xh)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, w.dtype

    @staticmethod
    def backward(ctx, gy, _xq, _wq, _x_inv, _w_inv, _amax_xw, later):
        xq, wq, x_inv, w_inv, amax_xw, xh, xs, wh, ws, gh, gs = ctx.saved_tensors
        cfg = ctx.cfg
        g2 = gy.reshape(-1, wq.shape[0])
        amax_g = _amax(g2, cfg.group)
        g_scale = _used_scale(Fp8Meta(gh, gs), amax_g, _FP8_MAX[E5M2], cfg.recipe)
        gq = quantize(g2, g_scale, E5M2)
        g_inv = g_scale.reciprocal()
        dx = scaled_matmul(gq, wq, g_inv, w_inv, ctx.x_dtype, cfg.backend).reshape(ctx.x_shape)
        dw = scaled_matmul(gq.t(), xq, g_inv, x_inv, ctx.w_dtype, cfg.backend)
        # max, not sum, over the uses: NaN and inf propagate (an overflow is then not recorded).
        amaxes = torch.cat([amax_xw, amax_g.reshape(1)])
        amaxes = amaxes if later is None else torch.maximum(amaxes, later)
        if not ctx.head:
            return dx, dw, None, None, None, None, None, None, amaxes, None
        if not torch.compiler.is_compiling():
            _note_head(ctx.state_id, cfg.name)
        (xh1, xs1), (wh1, ws1), (gh1, gs1) = (
            _next_meta(Fp8Meta(h, s), a, _FP8_MAX[fmt], cfg.recipe)
            for (h, s), a, fmt in zip(((xh, xs), (wh, ws), (gh, gs)), amaxes.unbind(), (E4M3, E4M3, E5M2)))
        return dx, dw, xh1, xs1, wh1, ws1, gh1, gs1, None, None


def _alias(t: torch.Tensor) -> torch.Tensor:
    # dynamo (torch 2.13) takes a tensor that torch.func.grad differentiates directly for one
    # that needs no grad: when every input of an autograd.Function looks so (a first layer's
    # input, a weight not cast inside the differentiated function, the state), it inlines the
    # forward and differentiates through its ops instead of calling backward -- no state
    # gradient, no e5m2 backward. A view is exact and free, and dynamo sees that it needs grad.
    return t.view_as(t) if torch.compiler.is_compiling() else t


def _fp8_linear(x, weight, bias, state: Fp8LinearState, recipe: Recipe, backend: str, group,
                link: torch.Tensor | None, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, link)``: one use of ``state`` chained after the use whose ``link`` is given."""
    (xh, xs), (wh, ws), (gh, gs) = state
    x, weight, xh, xs, wh, ws, gh, gs = (_alias(t) for t in (x, weight, xh, xs, wh, ws, gh, gs))
    cfg = _Config(recipe, backend, group, name)
    y, *_, link_out = _Fp8Linear.apply(x, weight, xh, xs, wh, ws, gh, gs, link, cfg)
    return (y if bias is None else y + bias.to(y.dtype)), link_out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: Fp8LinearState,
               recipe: Recipe | None = None, *, backend: str = "auto", group=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as a scaled FP8 matmul; differentiable in ``x``, ``weight``,
    ``bias`` and -- overwrite-with-gradient -- ``state``.

    Forward: ``x`` and ``weight`` quantised to e4m3 with the scales :func:`advance_meta` gives
    (from ``state`` and their amaxes), multiplied with fp32 accumulation, output in ``x.dtype``,
    ``bias`` added in that dtype. Backward: the output gradient quantised to e5m2, ``dx`` and
    ``dweight`` as fp8 GEMMs against the saved fp8 operands (in ``x``'s and ``weight``'s dtypes),
    ``dbias`` the sum of the unquantised gradient, and as the "gradient" of ``state`` the advanced
    :class:`Fp8LinearState` (input and weight metadata from the forward, output-gradient metadata
    from this backward). One call is one use of ``state``: calls that share a state and one
    backward would each return an advanced state and autograd would add them, so use
    :meth:`Fp8Policy.apply` / :meth:`Fp8Policy.autocast`, which combine repeated uses by max.
    Cost: amax and cast of ``x`` and ``weight`` (2 reads each), one fp8 GEMM forward and two
    backward; with ``group`` one 4-byte all-reduce per operand; no host sync.

    Args:
      x: ``(..., in_features)`` input in the compute dtype.
      weight: ``(out_features, in_features)``.
      bias: ``(out_features,)`` or ``None``.
      state: this layer's :class:`Fp8LinearState`.
      recipe: :class:`DelayedScaling` (default) or :class:`CurrentScaling`.
      backend: ``"auto"`` (``_scaled_mm`` on a GPU where :func:`fp8_available`, else the
        emulation: on CPU it is the faster of the two), ``"scaled_mm"`` or ``"emulate"``.
      group: a process group: amaxes are MAX all-reduced so every rank uses the same scales.

    Returns:
      ``(..., out_features)`` in ``x.dtype``.

    Example:
      >>> y = af.fp8.fp8_linear(x, w, b, state8["fc1"])  # doctest: +SKIP
    """
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(state, Fp8LinearState):
        raise TypeError(f"fp8_linear: state must be an Fp8LinearState, got {type(state).__name__}")
    _check_operands(x, weight, "fp8_linear")
    _check_history(state, recipe, "fp8_linear: state")
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"fp8_linear: input of shape {tuple(x.shape)} does not fit weight of shape "
                         f"{tuple(weight.shape)}")
    return _fp8_linear(x, weight, bias, state, recipe, _resolve_backend(backend, x.device), group, None)[0]


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"fp8: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        # On CPU the emulation, even where torch._scaled_mm takes fp8: torch 2.13's CPU kernel
        # (oneDNN, AMX) takes 15-66 ms for a 64x64x256 .. 64x256x256 product that the
        # emulation's fp32 GEMM does in 0.1-0.3 ms, and the products of fp8 values are exact in
        # fp32 either way (only the order of the fp32 sums may differ).
        return "scaled_mm" if device.type != "cpu" and fp8_available(device) else "emulate"
    return backend


# ----------------------------------------------------------------------------------------------
# The policy: which layers, which recipe; running a model with it
# ----------------------------------------------------------------------------------------------


class _Collector:
    """A tracked layer's amaxes (input, weight, output gradient), max-combined over every use and
    every backward since :meth:`Fp8Policy.track` (a ``.backward()`` per micro-batch adds nothing)."""

    def __init__(self, device):
        self.device, self.amaxes, self.recipe = device, None, None

    def link(self, recipe: Recipe) -> torch.Tensor:
        """A fresh leaf to chain a context's first use of the layer to: its gradient is the max of
        that context's amaxes, which the hook folds in (a leaf per context: nothing to sum)."""
        self.recipe = recipe
        leaf = torch.zeros(3, dtype=torch.float32, device=self.device, requires_grad=True)
        leaf.register_hook(self._absorb)
        return leaf

    def _absorb(self, g: torch.Tensor) -> None:
        g = g.detach()
        self.amaxes = g if self.amaxes is None else torch.maximum(self.amaxes, g)


# Tracked states (Fp8Policy.track), by their input amax history leaf: the layer's collector.
_TRACKED = WeakTensorKeyDictionary()
# torch.utils.checkpoint's own code (under its dynamo-disabling wrapper), to find it on the stack.
_CHECKPOINT_CODE = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__


def _checkpoint_depth() -> int:
    """How many torch.utils.checkpoint calls the current Python stack is inside."""
    depth, frame = 0, sys._getframe(1)
    while frame is not None:
        depth += frame.f_code is _CHECKPOINT_CODE
        frame = frame.f_back
    return depth


class _Fp8Mode(TorchFunctionMode):
    """Routes ``F.linear`` calls whose weight is one of ``weights`` to the FP8 linear, chaining
    the uses of each layer's state so that they combine by max (see :class:`_Fp8Linear`)."""

    def __init__(self, weights: list[torch.Tensor], states: list[Fp8LinearState], collectors: list,
                 policy: "Fp8Policy"):
        super().__init__()
        self.weights, self.states, self.policy, self.collectors = weights, states, policy, collectors
        # per layer: what its next use chains to (None: that use advances the state)
        self.links = [self._chain_start(i) for i in range(len(weights))]
        # per layer: a backward has run through its chain since it was started (a new one starts)
        self.spent = [False] * len(weights)
        self.checkpoints = None

    def _chain_start(self, i: int):
        collector = self.collectors[i]
        return None if collector is None else collector.link(self.policy.recipe)

    def _spend(self, i: int) -> None:
        self.spent[i] = True

    def __enter__(self):
        if not torch.compiler.is_compiling():
            self.checkpoints = _checkpoint_depth()
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            for i, weight in enumerate(self.weights):
                if w is weight:
                    p, name = self.policy, self.policy.layers[i]
                    if self.checkpoints is not None and not torch.compiler.is_compiling() \
                            and _checkpoint_depth() > self.checkpoints:
                        raise RuntimeError(
                            f"Fp8Policy: layer {name!r} runs inside torch.utils.checkpoint, within the FP8 context: "
                            "the checkpoint recomputes it in the backward, outside that context, as a plain "
                            "F.linear (use_reentrant=False then fails on a different number of saved tensors; "
                            "use_reentrant=True takes its weight gradient from the plain matmul and never "
                            "advances its scaling state). Checkpoint a region that enters FP8 itself (call "
                            "fp8.apply inside the checkpointed function), or keep the layer out of FP8 "
                            f"(fp8_policy(model, exclude=({name!r},)))")
                    _check_operands(x, w, f"Fp8Policy: layer {name!r}")
                    if x.shape[-1] != w.shape[-1] or w.dim() != 2:
                        raise ValueError(f"Fp8Policy: layer {name!r}: input of shape {tuple(x.shape)} does not fit "
                                         f"weight of shape {tuple(w.shape)}")
                    if self.spent[i]:
                        # a backward ran through the chain (a micro-batch's .backward() inside this
                        # context): its graph is freed, so the next use starts a new chain (a
                        # tracked state's collector still takes the max over both)
                        self.links[i], self.spent[i] = self._chain_start(i), False
                    y, link = _fp8_linear(x, w, b, self.states[i], p.recipe, _resolve_backend(p.backend, x.device),
                                          p.group, self.links[i], name)
                    if link.requires_grad:  # a use that a backward will reach: the next one chains to it
                        self.links[i] = link
                        if y.requires_grad and not torch.compiler.is_compiling():
                            y.register_hook(lambda _g, i=i: self._spend(i))
                    return y
        return func(*args, **kwargs)


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8Policy:
    """Which ``nn.Linear`` layers run in FP8 (``layers``: module paths) and how they are scaled.

    Immutable configuration; the scaling state is separate (:meth:`init`). Build one with
    :func:`fp8_policy`. ``recipe``: :class:`DelayedScaling` or :class:`CurrentScaling`;
    ``backend``: ``"auto"``, ``"scaled_mm"`` or ``"emulate"``; ``group``: a process group for
    the amax all-reduce (``None``: single process).
    """

    layers: tuple[str, ...]
    recipe: Recipe = DelayedScaling()
    backend: str = "auto"
    group: Any = None

    def __post_init__(self):
        if not isinstance(self.recipe, (DelayedScaling, CurrentScaling)):
            raise TypeError(f"Fp8Policy: recipe must be DelayedScaling or CurrentScaling, got {self.recipe!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"Fp8Policy: backend must be one of {_BACKENDS}, got {self.backend!r}")
        object.__setattr__(self, "layers", tuple(self.layers))

    def init(self, device: torch.device | str | None = None) -> dict[str, Fp8LinearState]:
        """``{layer path: Fp8LinearState}`` with empty histories and scales of 1, on ``device``.

        Cost: three small allocations per layer. The result is the state the loop carries
        (``torch.save``-able; ``torch.load(weights_only=True)`` rebuilds it).
        """
        n = self.recipe.history_len
        fp8_available(device)  # probe now, outside any compiled region
        return {name: Fp8LinearState(_new_meta(n, device), _new_meta(n, device), _new_meta(n, device))
                for name in self.layers}

    def _mode(self, model: torch.nn.Module, params, state) -> _Fp8Mode:
        if not isinstance(state, dict) or set(state) != set(self.layers):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"Fp8Policy: state must hold one Fp8LinearState per layer {list(self.layers)}, got {got}")
        for name in self.layers:
            if not isinstance(state[name], Fp8LinearState):
                raise TypeError(f"Fp8Policy: state[{name!r}] must be an Fp8LinearState, "
                                f"got {type(state[name]).__name__}")
            _check_history(state[name], self.recipe, f"Fp8Policy: state[{name!r}]")
        weights, collectors = [], []
        for name in self.layers:
            weights.append(_weight_in(model, name, params))
            collectors.append(None if torch.compiler.is_compiling() else _TRACKED.get(state[name].input.amax_history))
        return _Fp8Mode(weights, [state[name] for name in self.layers], collectors, self)

    def apply(self, model: torch.nn.Module, params, state: dict[str, Fp8LinearState], *args, **kwargs):
        """``functional_call(model, params, args, kwargs)`` with the policy's layers in FP8.

        ``params`` is what ``functional_call`` takes (a dict path -> tensor, or a tuple of
        dicts, e.g. ``(params, buffers)``); the weight of each named layer is looked up in it by
        ``"<layer>.weight"``, or by the path of the parameter it is tied to (else the module's
        own). Differentiate with respect to ``state`` to get the next state (see the module
        docstring). A layer used several times in the call (shared, looped) records the max of
        its uses' amaxes. Pure; no host sync.
        """
        lookup = params
        if isinstance(params, (tuple, list)):
            lookup = {k: v for d in params for k, v in d.items()}
        with self._mode(model, lookup, state):
            return functional_call(model, params, args, kwargs)

    @contextlib.contextmanager
    def autocast(self, model: torch.nn.Module, state: dict[str, Fp8LinearState], params=None):
        """Context in which ``model``'s named layers run in FP8 (stateful forwards, ``.backward()``).

        For a loop that calls ``model(x)`` and ``loss.backward()`` (e.g. with
        :class:`ampfunc.ModuleTrainer`): pass ``track(state)`` as ``state`` and read the next
        state after the backward with :meth:`from_grads`. Every use of a layer inside one context
        (several forwards, a shared layer) records the max of their amaxes, as do the contexts
        and backwards over one tracked state (gradient accumulation).
        """
        with self._mode(model, params, state):
            yield

    def resize_history(self, state: dict[str, Fp8LinearState]) -> dict[str, Fp8LinearState]:
        """``state`` with every amax history resized to the recipe's ``history_len``.

        Transformer Engine's ``adjust_amax_history_length``: a longer history keeps its newest
        ``history_len`` entries (slot 0 is the newest), a shorter one gets zeros appended (an
        empty slot, which the max ignores); the scales are kept. Use it to resume a state saved
        under another ``history_len``, which the step refuses. Pure; a few small copies; no host
        sync.

        Args:
          state: ``{layer path: Fp8LinearState}``, e.g. loaded from a checkpoint, holding
            exactly the policy's layers (extra or missing ones raise ``ValueError`` naming them).

        Returns:
          The same layers' states with histories of ``recipe.history_len``.

        Example:
          >>> model = nn.Sequential(nn.Linear(16, 16))
          >>> saved = af.fp8.fp8_policy(model, recipe=af.fp8.DelayedScaling(history_len=8)).init()
          >>> fp8 = af.fp8.fp8_policy(model, recipe=af.fp8.DelayedScaling(history_len=2))
          >>> [m.amax_history.shape[0] for m in fp8.resize_history(saved)["0"]]
          [2, 2, 2]
        """
        n = self.recipe.history_len
        if not isinstance(state, dict) or set(state) != set(self.layers):
            if not isinstance(state, dict):
                raise TypeError(f"Fp8Policy.resize_history: state must be a dict of Fp8LinearState per layer "
                                f"{list(self.layers)}, got {type(state).__name__}")
            extra, missing = sorted(set(state) - set(self.layers)), [k for k in self.layers if k not in state]
            raise ValueError(f"Fp8Policy.resize_history: state must hold one Fp8LinearState per layer "
                             f"{list(self.layers)}; layers not in the policy: {extra}, missing: {missing} (a state "
                             "of another model or another fp8_policy)")

        def resize(h: torch.Tensor) -> torch.Tensor:
            if h.dim() != 1:
                raise ValueError(f"Fp8Policy.resize_history: an amax history must be 1-d, got shape {tuple(h.shape)}")
            return h[:n].clone() if h.shape[0] >= n else F.pad(h, (0, n - h.shape[0]))

        out = {}
        for name, st in state.items():
            if not isinstance(st, Fp8LinearState):
                raise TypeError(f"Fp8Policy.resize_history: state[{name!r}] must be an Fp8LinearState, "
                                f"got {type(st).__name__}")
            out[name] = Fp8LinearState(*(Fp8Meta(resize(m.amax_history), m.scale) for m in st))
        return out

    @staticmethod
    def track(state: dict[str, Fp8LinearState]) -> dict[str, Fp8LinearState]:
        """Detached copies of ``state``'s tensors with ``requires_grad=True``, to run in
        :meth:`autocast` (any number of times, with a ``backward()`` after each or one after all:
        the amaxes combine by max); :meth:`from_grads` then gives the next state."""
        tracked = {k: _map_meta(v, lambda t: t.detach().clone().requires_grad_(True)) for k, v in state.items()}
        for v in tracked.values():
            _TRACKED[v.input.amax_history] = _Collector(v.input.amax_history.device)
        return tracked

    @staticmethod
    def from_grads(tracked: dict[str, Fp8LinearState]) -> dict[str, Fp8LinearState]:
        """The next state from a :meth:`track` ed state after the backward(s): each layer's state
        advanced once with the max of the amaxes its uses recorded (the tracked state itself
        where no backward reached the layer). Cost: a few small ops per layer; no host sync."""
        out = {}
        for k, v in tracked.items():
            collector = _TRACKED.get(v.input.amax_history)
            if collector is not None and collector.amaxes is not None:
                out[k] = Fp8LinearState(*(
                    _next_meta(_map_tensors(m, torch.Tensor.detach), a, _FP8_MAX[fmt], collector.recipe)
                    for m, a, fmt in zip(v, collector.amaxes.unbind(), (E4M3, E4M3, E5M2))))
            else:  # a state not from track(), or one no backward reached: .grad as before
                out[k] = _map_meta(v, lambda t: (t.grad if t.grad is not None else t).detach())
        return out


def _weight_in(model: torch.nn.Module, name: str, params) -> torch.Tensor:
    """The tensor ``functional_call(model, params, ...)`` hands to layer ``name``'s ``F.linear``."""
    key = f"{name}.weight" if name else "weight"
    own = model.get_submodule(name).weight
    if params is None:
        return own
    if key in params:
        return params[key]
    # A tied weight (head.weight = emb.weight) is listed once, under the other path (params_of,
    # named_parameters), and functional_call (tie_weights=True) hands that entry to this layer.
    for path, p in model.named_parameters(remove_duplicate=False):
        if p is own and path in params:
            return params[path]
    return own


def _map_tensors(meta: Fp8Meta, fn) -> Fp8Meta:
    return Fp8Meta(fn(meta.amax_history), fn(meta.scale))


def _map_meta(state: Fp8LinearState, fn) -> Fp8LinearState:
    return Fp8LinearState(*(Fp8Meta(fn(m.amax_history), fn(m.scale)) for m in state))


def fp8_policy(model: torch.nn.Module, *, exclude: Iterable[str] | str = (), include: Iterable[str] | None = None,
               recipe: Recipe | None = None, backend: str = "auto", group=None) -> Fp8Policy:
    """An :class:`Fp8Policy` for ``model``: every ``nn.Linear`` (or those ``include`` names),
    minus those ``exclude`` names.

    A layer is taken when it is an ``nn.Linear`` whose forward is ``nn.Linear``'s (subclasses
    included, as torchao selects by ``isinstance``). Two kinds stay in high precision, with one
    warning naming them: a subclass that overrides ``forward`` (FP8 replaces the ``F.linear`` call
    of ``nn.Linear``'s forward; another forward may not make it), and a
    ``MultiheadAttention``'s ``out_proj``, whose weight the attention passes to
    ``F.multi_head_attention_forward`` directly. Excluding them silences the warning.

    A name selects the module at that path and every module below it (``"head"``,
    ``"blocks.0.attn"``). Names that match no module raise ``ValueError``. A model with no
    ``nn.Linear`` left (none, or all excluded) gives a policy of no layers, with a warning: it
    runs the model unchanged, as Transformer Engine and torchao do. Walks the module tree once;
    no tensor work.

    Args:
      model: the module.
      exclude: paths to keep in high precision (typically the output head).
      include: paths to consider (default: the whole model).
      recipe: :class:`DelayedScaling` (default, ``history_len=16``) or :class:`CurrentScaling`.
      backend: ``"auto"``, ``"scaled_mm"`` or ``"emulate"``.
      group: process group for the amax all-reduce.

    Returns:
      The :class:`Fp8Policy`.

    Example:
      >>> fp8 = af.fp8.fp8_policy(model, exclude=("head",))  # doctest: +SKIP
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fp8_policy: model must be a torch.nn.Module, got {type(model).__name__}")
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    include = None if include is None else ((include,) if isinstance(include, str) else tuple(include))
    modules = dict(model.named_modules())
    for name in exclude + (include or ()):
        if not any(m == name or m.startswith(name + ".") for m in modules):
            raise ValueError(f"fp8_policy: {name!r} names no module of the model")

    def under(path, names):
        return any(path == n or path.startswith(n + ".") or n == "" for n in names)

    # A MultiheadAttention hands its out_proj's weight to F.multi_head_attention_forward (a torch
    # function of its own, inside which F.linear is not seen by a TorchFunctionMode): it never runs
    # through the FP8 linear, whatever its type.
    mha_out_proj = {id(m.out_proj) for m in modules.values() if isinstance(m, torch.nn.MultiheadAttention)}
    layers, skipped = [], []
    for path, m in modules.items():
        if not isinstance(m, torch.nn.Linear) or (include is not None and not under(path, include)) \
                or under(path, exclude):
            continue
        if id(m) in mha_out_proj:
            skipped.append(f"{path!r} (a MultiheadAttention's out_proj: MultiheadAttention passes its weight to "
                           "F.multi_head_attention_forward, not to F.linear)")
        elif type(m).forward is not torch.nn.Linear.forward:
            skipped.append(f"{path!r} ({type(m).__name__} overrides nn.Linear.forward: FP8 runs the F.linear "
                           "call of nn.Linear's own forward)")
        else:  # nn.Linear, or a subclass that runs nn.Linear's forward
            layers.append(path)
    layers = tuple(layers)
    if skipped:
        warnings.warn(f"fp8_policy: these nn.Linear layers stay in high precision: {'; '.join(skipped)}. Exclude "
                      "them (exclude=...) to say so", UserWarning, stacklevel=2)
    if not layers:
        # As Transformer Engine's and torchao's FP8 paths do, a model with nothing to convert runs
        # unchanged (in its compute dtype); said once, since FP8 was asked for and none will run.
        warnings.warn(f"fp8_policy: no nn.Linear layer to run in FP8 (exclude={list(exclude)}, include="
                      f"{None if include is None else list(include)}): the model runs unchanged, without FP8",
                      UserWarning, stacklevel=2)
    # FP8 finds a layer by its weight tensor (identity): Linears sharing one weight would all run
    # on the state of the first one named, an excluded one included.
    sharing: dict[int, list[str]] = {}
    for path, m in modules.items():
        if isinstance(m, torch.nn.Linear):
            sharing.setdefault(id(m.weight), []).append(path)
    for path in layers:
        tied = sharing[id(modules[path].weight)]
        if len(tied) > 1:
            raise ValueError(f"fp8_policy: the Linear layers {tied} share one weight tensor: FP8 finds a layer by "
                             "its weight, so all of them would run in FP8 on one scaling state. Keep them out "
                             f"of FP8 (exclude={tuple(tied)!r}) or give each its own weight")
    return Fp8Policy(layers, DelayedScaling() if recipe is None else recipe, backend, group)
