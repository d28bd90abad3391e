"""The one door to the tensor work of mixed precision.

Every primitive in ampfunc calls these functions for its arithmetic over lists of tensors. Each
is a ``torch.library`` custom op in the ``ampfunc`` namespace (``torch.ops.ampfunc.*``) whose
schema names what it mutates, with a fake kernel, so ``torch.compile(fullgraph=True)`` traces it
and CUDA graphs capture it. Each op has up to three implementations:

* the compiled CPU kernels of ``ext/`` (one parallel pass over the concatenation of the list,
  whatever the number of tensors), built on first use (:mod:`ampfunc._build`);
* the compiled CUDA kernels (multi-tensor apply over raw pointers) when built with CUDA;
* a plain-torch reference (``_ref_*``, :mod:`ampfunc.ops._reference`), built from ``torch._foreach_*`` and
  ``torch._amp_foreach_non_finite_check_and_unscale_`` so that even the reference is one
  launch per (device, dtype) group rather than one per leaf. It serves whatever the compiled
  kernels do not (every op under ``AMPFUNC_DISABLE_EXT=1`` or without a compiler).

:func:`backend` says which is active. Lists may mix float dtypes; the compiled kernels take one
device per call. Non-contiguous tensors are handled (through a contiguous copy, written back for
the in-place ops). No function here reads a tensor value back to the host.

The package is split by concern: :mod:`~ampfunc.ops._spec` (one spec per op: the single source of
the schemas, validation, fake kernels and these functions), :mod:`~ampfunc.ops._loading` (building
and loading the library, the call door), :mod:`~ampfunc.ops._validation`,
:mod:`~ampfunc.ops._reference` and :mod:`~ampfunc.ops.optimizers` (the reference twins),
:mod:`~ampfunc.ops._library` (the ``torch.library`` registration), :mod:`~ampfunc.ops._forms`
(an optimizer's functions, written from its spec) and :mod:`~ampfunc.ops._params` (per-parameter
bookkeeping in C).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ampfunc.ops import _forms, _loading, _spec, optimizers  # noqa: F401 - optimizers: registers their specs
from ampfunc.ops._library import _loading_first, reference_step, references, register  # noqa: F401
from ampfunc.ops._loading import (  # noqa: F401
    _BACKEND,
    _DIRECT,
    _PACKING_OPS,
    _as_list,
    _call,
    _ensure,
    _gc_paused,
    _is_compiling,
    _seq,
    _split_lr,
    _through_door,
    _transforms_active,
    backend,
    backend_reason,
    load,
)
from ampfunc.ops._params import (
    bound_signature,
    bump_versions,
    check_bound,
    clear_grads,
    empty_cache,
    grads_of,
    held_lists,
    kernel_ready,
    pool_stats,
    requires_grad_changed,
    set_grads,
)
from ampfunc.ops._reference import (  # noqa: F401
    _commit_where,
    _flag_device,
    _fresh,
    _groups,
    _groups_idx,
    _ones_like_step,
    _ref_all_finite,
    _ref_apply_updates,
    _ref_check,
    _ref_check_norm,
    _ref_unscale,
    _ref_unscale_,
    _ref_update_scale,
    _ref_update_scale_,
    fma_rounded,
    sqrt_rounded,
)
from ampfunc.ops._validation import _overlapping_pair, _validate, error_items  # noqa: F401
from ampfunc.ops.optimizers.adam import _ref_adam_step_, _ref_adam_update  # noqa: F401
from ampfunc.ops.optimizers.sgd import _ref_sgd_step_, _ref_sgd_update  # noqa: F401

__all__ = [
    "backend",
    "load",
    "all_finite",
    "check",
    "unscale",
    "unscale_",
    "update_scale",
    "update_scale_",
    "check_norm",
    "apply_updates",
    "error_items",
    "kernel_ready",
    "empty_cache",
    "pool_stats",
    "grads_of",
    "clear_grads",
    "bound_signature",
    "check_bound",
    "set_grads",
    "bump_versions",
    "held_lists",
    "requires_grad_changed",
    "sqrt_rounded",
    "fma_rounded",
    "overlapping_pair",
    "fresh_copies",
]

def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-d bool: every element of every tensor is finite. One read pass, no writes."""
    return check(tensors)[0]

def check(tensors: Sequence[torch.Tensor], per_leaf: bool = False):
    """``(finite, sumsq)``: 0-d bool (all elements finite) and 0-d fp32 sum of squares.

    One read-only pass over the tensors (the reference makes two). With ``per_leaf=True`` a
    third result is a bool vector, ``True`` where that tensor holds a non-finite value.
    ``sumsq`` is accumulated in fp32 blocks whatever the input dtype (combined in double by the
    compiled kernels). Tensors may mix dtypes; the compiled kernels take one device per call.
    """
    tensors = list(tensors)
    if not tensors:
        out = _ref_check(tensors, per_leaf)
    else:
        _ensure()
        out = _call("check", tensors, per_leaf)
    return tuple(out) if per_leaf else (out[0], out[1])

def unscale(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor):
    """``(outs, finite)``: new fp32 tensors ``t * inv_scale`` and a 0-d bool flag.

    The product is taken in fp32 (as ``torch.amp.GradScaler`` does); finiteness is judged on
    the inputs. One read of the inputs and one fp32 write.
    """
    tensors = list(tensors)
    if not tensors:
        return [], torch.ones((), dtype=torch.bool, device=inv_scale.device)
    _ensure()
    with _gc_paused(len(tensors)):
        outs, finite = _call("unscale", tensors, inv_scale)
        return list(outs), finite

def unscale_(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """In place ``t *= inv_scale`` (product in fp32, stored in ``t``'s dtype); returns ``finite``.
    One read and one write of every element."""
    tensors = list(tensors)
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=inv_scale.device)
    _ensure()
    return _call("unscale_", tensors, inv_scale)

def check_norm(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor | None = None, per_leaf: bool = False):
    """``(finite, norm)``: 0-d bool (every element finite) and the 0-d fp32 global L2 norm of
    ``t * inv_scale`` over all tensors (of ``t`` when ``inv_scale`` is None).

    The robust twin of :func:`check` for clipping: each product is taken in fp32 as
    :func:`unscale` takes it, and the squares are summed so that the sum cannot overflow while
    every value is finite (fp32 blocks, a block that overflows recomputed in float64, combined
    in float64), so the norm is finite whenever it fits in fp32 -- e.g. fp32 gradients of
    1e20 under a loss scale of 2**16. ``check_norm(scaled, inv_scale)`` and
    ``check_norm(unscale(scaled, inv_scale)[0])`` are the same number (the same products, the
    same sums), so a fused clip and the generic one agree. The fp32 squares of values below
    about 1e-19 lose precision and below about 1e-23 vanish (the compiled kernels recompute a
    block in float64 when it overflows, not when it underflows): a norm under about 1e-19 reads
    low or 0, which leaves a clipping coefficient at 1 either way. ``finite`` is judged on the
    inputs. With ``per_leaf=True`` a third result flags the tensors holding a non-finite value.
    Cost: one read pass, no writes, no host sync (CUDA: the same sums on the device, fp32
    blocks, an overflowing block re-read once and summed in double, combined in double).
    """
    tensors = list(tensors)
    if not tensors:
        out = _ref_check_norm(tensors, inv_scale, per_leaf)
    else:
        _ensure()
        out = _call("check_norm", tensors, inv_scale, per_leaf)
    return tuple(out) if per_leaf else (out[0], out[1])

def apply_updates(params, updates) -> list:
    """``[p + u ...]``: new tensors, each in its param's dtype (fp32, fp16, bf16), the sum taken
    in fp32 and rounded once -- :func:`ampfunc.apply_updates`'s arithmetic -- over the whole list
    in one parallel pass. Shapes must match (no broadcasting). Cost: one read of each list, one
    write; no host sync (CUDA: one multi-tensor add for the fp32 pairs)."""
    params = list(params)
    if not params:
        return []
    _ensure()
    with _gc_paused(len(params)):
        return list(_call("apply_updates", params, _seq(updates)))

def update_scale(scale, growth_tracker, hysteresis_tracker, finite, *, growth_factor, backoff_factor,
                 growth_interval, min_scale, max_scale, hysteresis):
    """The next ``(scale, growth_tracker, hysteresis_tracker)`` of a dynamic loss scale.

    On a finite step the hysteresis counter refills and the tracker counts up; when it
    reaches ``growth_interval`` the scale is multiplied by ``growth_factor`` (capped at
    ``max_scale``, not applied when it would overflow fp32) and the tracker resets. On a
    non-finite step the tracker resets and the counter counts down; when it is exhausted the
    scale is multiplied by ``backoff_factor`` (floored at ``min_scale``). All on the device:
    new 0-d tensors (the inputs are not modified), no host sync.
    """
    s, g, h = scale.clone(), growth_tracker.clone(), hysteresis_tracker.clone()
    update_scale_(s, g, h, finite, growth_factor=growth_factor, backoff_factor=backoff_factor,
                  growth_interval=growth_interval, min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis)
    return s, g, h

def update_scale_(scale, growth_tracker, hysteresis_tracker, finite, *, growth_factor, backoff_factor,
                  growth_interval, min_scale, max_scale, hysteresis) -> None:
    """In-place :func:`update_scale` (the three state tensors are overwritten): one tiny kernel
    (scale fp32, trackers int32, all 0-d on the same device)."""
    _ensure()
    finite = finite.to(device=scale.device, dtype=torch.bool).reshape(())
    torch.ops.ampfunc.update_scale_(scale, growth_tracker, hysteresis_tracker, finite, float(growth_factor),
                                    float(backoff_factor), int(growth_interval), float(min_scale),
                                    float(max_scale), int(hysteresis))

def _finite_for(grads: list, grad_scale: torch.Tensor) -> torch.Tensor:
    """The checked steps' flag where the door does not serve them: :func:`check`'s of
    ``grads`` and-ed with ``grad_scale`` not being NaN (one read pass)."""
    return check(grads)[0] & ~grad_scale.isnan() if grads else ~grad_scale.isnan()

def overlapping_pair(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The indices ``(i, j)``, ``i < j``, of two tensors of ``tensors`` that share memory, or None.

    Exact for strided tensors: the columns of one matrix, or its even and odd elements, share
    no element and are not reported (as torch allows them), while two views of one column are.
    Empty tensors and tensors on the meta device (no memory) share nothing; a tensor
    overlapping itself is not looked for here. The rule is the kernels' own (the compiled
    library's, which the ops' validation runs); the reference backend runs its Python twin.

    Args:
      tensors: strided tensors, any devices (only addresses are compared, never values).

    Returns:
      The first pair found (by address), or None when every element lies in memory of its own.

    Cost: a sort of the tensors' byte spans; where spans intersect and a tensor among them is
    not contiguous, one sort of those tensors' element addresses (host memory, about 100 bytes
    per element) when they hold at most 2**22 elements, else a test from their strides and
    offsets (tensors of one shape and strides, e.g. the columns of one matrix; others of that
    size whose spans interleave are reported as sharing). No host sync.
    """
    _ensure()
    door = _loading._DIRECT[0]
    if door is not None and type(tensors) is list:
        pair = door.overlapping_pair(tensors)
        if pair is not NotImplemented:
            return None if pair is None else tuple(pair)
    return _overlapping_pair(tensors)


def fresh_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A new contiguous copy of each tensor (detached, same dtype, shape and device).

    On the CPU, with the compiled kernels loaded, the copies come from the output pool of the
    out-of-place kernels: memory that dropped outputs (and copies) held, so a pure step that runs
    an in-place kernel over copies every step does not fault in fresh pages each time.
    Elsewhere (other devices, tensor subclasses, the reference backend) ``t.clone()``.

    Args:
      tensors: strided tensors.

    Returns:
      A list of new tensors, one per input, in order.

    Example:
      >>> x = torch.arange(6.0).reshape(2, 3).t()
      >>> (y,) = fresh_copies([x])
      >>> bool(torch.equal(x, y)), y.is_contiguous(), y.data_ptr() != x.data_ptr()
      (True, True, True)

    Cost: one read and one write pass; no host sync.
    """
    _ensure()
    door = _loading._DIRECT[0]
    if door is not None and type(tensors) is list and not torch.compiler.is_compiling():
        out = door.fresh_copies(tensors)
        if out is not NotImplemented:
            return out
    return [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]


# ----------------------------------------------------------------------------------------------
# The optimizers' functions (``adam_step_``, ``sgd_update``, ...), written from their specs
# ----------------------------------------------------------------------------------------------

for _opt in _spec.OPTIMIZERS.values():
    __all__ += _forms.define(_opt, globals())
    globals()[f"_ref_{_opt.name}_step"] = reference_step(_opt)
del _opt
# The out-of-place optimizer ops, whose new state comes back packed in eager mode (_loading._call).
_loading._PACKING_OPS = frozenset(f"{o}{form}" for o in _spec.OPTIMIZERS for form in ("_step", "_update"))

_REFERENCE = references()
# ops._ref_<op>_op: the reference kernel of each op by name, an optimizer's in-place step as
# _ref_<name>_step_op and its out-of-place one as _ref_<name>_step_out_op.
for _name, _kernel in _REFERENCE.items():
    _alias = _name[:-1] if _name.endswith("_step_") else f"{_name}_out" if _name.endswith("_step") else _name
    globals()[f"_ref_{_alias}_op"] = _kernel
del _name, _kernel, _alias
register(_REFERENCE)
