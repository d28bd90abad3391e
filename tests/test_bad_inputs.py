"""Bad inputs across the public API: a clear error, naming what is at fault, and nothing touched.

Each row of the table builds fresh inputs and returns ``(call, given)``: ``call()`` must raise
the row's exception type with a message containing every one of the row's ``names`` (the leaf
path, setting or argument at fault), and every tensor in ``given`` (params, gradients, states,
loss scales, flags) must be bit-identical afterwards -- nothing is written before validation.

Leaf paths are distinctive (``"enc.w"``, ``"head.b"``) so that a message naming the leaf cannot
pass by accident. Each row costs microseconds to milliseconds: the whole table runs in seconds.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import numpy as np
import pytest
import torch

import ampfunc as af
from _helpers import bits
from ampfunc.tree import tree_leaves

INF = float("inf")
NAN = float("nan")


class Case(NamedTuple):
    id: str
    build: Callable[[], tuple[Callable[[], Any], Any]]
    exc: type | tuple
    names: tuple[str, ...]


CASES: list[Case] = []


def case(id: str, exc, *names: str):
    def register(build):
        CASES.append(Case(id, build, exc, names))
        return build

    return register


def add(id: str, exc, names, build) -> None:
    CASES.append(Case(id, build, exc, tuple(names)))


# ----------------------------------------------------------------------------------------------
# Snapshots: bit patterns of every tensor (and numpy array) given to a call
# ----------------------------------------------------------------------------------------------



def _given_leaves(given) -> list:
    out = []

    def walk(x):
        if isinstance(x, torch.nn.Module):
            out.extend(x.state_dict(keep_vars=True).values())
        elif isinstance(x, (torch.Tensor, np.ndarray)):
            out.append(x)
        elif isinstance(x, torch.optim.Optimizer):
            for g in x.param_groups:
                out.extend(g["params"])
            for s in x.state.values():
                walk(s)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            for v in x:
                walk(v)
        else:
            leaves = tree_leaves(x)
            if len(leaves) == 1 and leaves[0] is x:
                return
            for v in leaves:
                walk(v)

    walk(given)
    return out


def _leaf_record(x):
    """What a refused call must leave as it was: a leaf's dtype, shape, strides and bits."""
    if isinstance(x, np.ndarray):
        return ("numpy", x.copy())
    t = x.detach()
    if t.device.type == "meta":
        return ("meta", t.dtype, tuple(t.shape))
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1) if t.dim() == 0 else t
    return (t.dtype, tuple(t.shape), tuple(t.stride()), bits(flat).clone())


def _same(a, b) -> bool:
    if a[0] == "numpy":
        return b[0] == "numpy" and a[1].tobytes() == b[1].tobytes()
    if a[0] == "meta":
        return a == b
    return a[:3] == b[:3] and torch.equal(a[3], b[3])


# ----------------------------------------------------------------------------------------------
# Fixtures built fresh for every row
# ----------------------------------------------------------------------------------------------


def params_f32():
    g = torch.Generator().manual_seed(0)
    return {"enc": {"w": torch.randn(4, 3, generator=g)}, "head": {"b": torch.randn(3, generator=g)}}


def params_f16():
    return af.tree.tree_cast(params_f32(), torch.float16)


def grads_like(params):
    return {k: {n: torch.full_like(t, 0.5) for n, t in v.items()} for k, v in params.items()}


def with_leaf(tree, path: str, value):
    a, b = path.split(".")
    out = {k: dict(v) for k, v in tree.items()}
    out[a][b] = value
    return out


def without_leaf(tree, path: str):
    a, b = path.split(".")
    out = {k: dict(v) for k, v in tree.items()}
    del out[a][b]
    return out


def dls():
    return af.DynamicLossScale(2.0**8)


# Bad gradient leaves, each put at "head.b" (shape (3,)).
BAD_LEAVES = {
    "numpy": (lambda dt: np.ones(3, dtype=np.float32), TypeError),
    "pyfloat": (lambda dt: 0.5, TypeError),
    "sparse": (lambda dt: torch.ones(3, dtype=dt).to_sparse(), TypeError),
    "int64": (lambda dt: torch.ones(3, dtype=torch.int64), TypeError),
    "bool": (lambda dt: torch.ones(3, dtype=torch.bool), TypeError),
    "meta": (lambda dt: torch.empty(3, dtype=dt, device="meta"), ValueError),
}


# ----------------------------------------------------------------------------------------------
# 1. Loss-scale construction
# ----------------------------------------------------------------------------------------------

_BAD_SCALE_VALUES = {
    "zero": (0.0, ValueError), "negative": (-2.0, ValueError), "nan": (NAN, ValueError), "inf": (INF, ValueError),
    "1e-50": (1e-50, ValueError), "2**-130": (2.0**-130, ValueError), "1e39": (1e39, ValueError),
    "t_nan": (lambda: torch.tensor(NAN), ValueError), "t_zero": (lambda: torch.tensor(0.0), ValueError),
    "t_neg": (lambda: torch.tensor(-2.0), ValueError), "t_inf": (lambda: torch.tensor(INF), ValueError),
    "t_shape2": (lambda: torch.tensor([1.0, 2.0]), ValueError), "t_bool": (lambda: torch.tensor(True), TypeError),
    "t_meta": (lambda: torch.empty((), device="meta"), ValueError), "str": ("128", TypeError),
    "bool": (True, TypeError), "none": (None, TypeError),
}

for _name, (_value, _exc) in _BAD_SCALE_VALUES.items():
    def _static(value=_value):
        v = value() if callable(value) else value
        return (lambda: af.StaticLossScale(v)), v

    def _dynamic(value=_value):
        v = value() if callable(value) else value
        return (lambda: af.DynamicLossScale(v, min_scale=0.0, max_scale=INF)), v

    add(f"StaticLossScale-{_name}", _exc, ["loss_scale"], _static)
    add(f"DynamicLossScale-init-{_name}", _exc, ["init_scale"], _dynamic)

add("DynamicLossScale-init-above-default-max", ValueError, ["init_scale", "max_scale"],
    lambda: ((lambda: af.DynamicLossScale(2.0**32)), None))
add("DynamicLossScale-init-below-min", ValueError, ["init_scale", "min_scale"],
    lambda: ((lambda: af.DynamicLossScale(0.25, min_scale=1.0)), None))

_BAD_SETTINGS = [
    ("growth_factor", 1.0, ValueError), ("growth_factor", 0.5, ValueError), ("growth_factor", INF, ValueError),
    ("growth_factor", NAN, ValueError), ("growth_factor", "2", TypeError),
    ("backoff_factor", 0.0, ValueError), ("backoff_factor", 1.0, ValueError), ("backoff_factor", 1.5, ValueError),
    ("backoff_factor", NAN, ValueError),
    ("growth_interval", 0, ValueError), ("growth_interval", 1.5, ValueError), ("growth_interval", -1, ValueError),
    ("growth_interval", INF, ValueError), ("growth_interval", NAN, ValueError),
    ("min_scale", -1.0, ValueError), ("min_scale", NAN, ValueError), ("min_scale", INF, ValueError),
    ("max_scale", 0.0, ValueError), ("max_scale", NAN, ValueError),
    ("hysteresis", 0, ValueError), ("hysteresis", 2.5, ValueError), ("hysteresis", INF, ValueError),
    ("hysteresis", NAN, ValueError),
    ("growth_factor", "tensor", TypeError), ("min_scale", None, TypeError),
]
for _setting, _value, _exc in _BAD_SETTINGS:
    def _build(setting=_setting, value=_value):
        v = torch.tensor(2.0) if value == "tensor" else value
        kwargs = {"min_scale": 0.0, "max_scale": INF, setting: v}
        return (lambda: af.DynamicLossScale(1.0, **kwargs)), v

    add(f"DynamicLossScale-{_setting}-{_value}", _exc, [_setting], _build)

add("DynamicLossScale-max-below-min", ValueError, ["max_scale"],
    lambda: ((lambda: af.DynamicLossScale(4.0, min_scale=8.0, max_scale=2.0)), None))


@case("DynamicLossScale.replace-growth_interval-0", ValueError, "growth_interval")
def _():
    ls = dls()
    return (lambda: ls.replace(growth_interval=0)), ls


# ----------------------------------------------------------------------------------------------
# 2. Flags (item 7, 13): update_scale(_), skip_or_apply(_)
# ----------------------------------------------------------------------------------------------

_BAD_FLAGS = {
    "float-nan": (lambda: torch.tensor(NAN), TypeError),
    "float-one": (lambda: torch.tensor(1.0), TypeError),
    "int-one": (lambda: torch.tensor(1), TypeError),
    "py-int": (lambda: 1, TypeError),
    "py-float": (lambda: 1.0, TypeError),
    "shape-2": (lambda: torch.tensor([True, False]), ValueError),
    "shape-1x1": (lambda: torch.tensor([[True]]), ValueError),
    "none": (lambda: None, TypeError),
}

for _fname, (_flag, _exc) in _BAD_FLAGS.items():
    def _upd(flag=_flag):
        ls, f = dls(), flag()
        return (lambda: af.update_scale(ls, f)), (ls, f)

    def _upd_(flag=_flag):
        ls, f = dls(), flag()
        return (lambda: af.mixed.update_scale_(ls, f)), (ls, f)

    def _upd_static_(flag=_flag):
        ls, f = af.StaticLossScale(4.0), flag()
        return (lambda: af.mixed.update_scale_(ls, f)), (ls, f)

    def _skip(flag=_flag):
        new, old, f = params_f32(), params_f32(), flag()
        return (lambda: af.skip_or_apply(f, new, old)), (new, old, f)

    def _skip_(flag=_flag):
        new, old, f = params_f32(), af.tree.tree_map(torch.zeros_like, params_f32()), flag()
        return (lambda: af.mixed.skip_or_apply_(f, new, old)), (new, old, f)

    add(f"update_scale-flag-{_fname}", _exc, ["finite"], _upd)
    add(f"update_scale_-flag-{_fname}", _exc, ["finite"], _upd_)
    add(f"update_scale_-static-flag-{_fname}", _exc, ["finite"], _upd_static_)
    add(f"skip_or_apply-flag-{_fname}", _exc, ["finite"], _skip)
    add(f"skip_or_apply_-flag-{_fname}", _exc, ["finite"], _skip_)


@case("update_scale-list-one-flag-for-two-scales", ValueError, "1 flags for 2")
def _():
    scales, f = [dls(), dls()], [torch.tensor(False)]
    return (lambda: af.update_scale(scales, f)), (scales, f)


@case("update_scale-dict-flag-keys-differ", ValueError, "'b'", "'typo'")
def _():
    scales, f = {"a": dls(), "b": dls()}, {"a": torch.tensor(False), "typo": torch.tensor(True)}
    return (lambda: af.update_scale(scales, f)), (scales, f)


@case("update_scale_-dict-bad-second-flag", TypeError, "finite['b']")
def _():
    # "a" comes first: it must not be halved before "b"'s float flag is refused.
    scales, f = {"a": dls(), "b": dls()}, {"a": torch.tensor(False), "b": torch.tensor(0.0)}
    return (lambda: af.mixed.update_scale_(scales, f)), (scales, f)


@case("skip_or_apply-structure", ValueError, "head.b")
def _():
    new, old = params_f32(), without_leaf(params_f32(), "head.b")
    f = torch.tensor(True)
    return (lambda: af.skip_or_apply(f, new, old)), (new, old, f)


@case("skip_or_apply-shape", ValueError, "head.b")
def _():
    new, old = params_f32(), with_leaf(params_f32(), "head.b", torch.zeros(4))
    f = torch.tensor(True)
    return (lambda: af.skip_or_apply(f, new, old)), (new, old, f)


@case("skip_or_apply_-structure", ValueError, "head.b")
def _():
    new, old = params_f32(), without_leaf(params_f32(), "head.b")
    f = torch.tensor(True)
    return (lambda: af.mixed.skip_or_apply_(f, new, old)), (new, old, f)


@case("skip_or_apply_-shape-second-leaf", ValueError, "head.b")
def _():
    # "enc.w" comes first in the flattening; it must not be written before "head.b" is refused.
    new = params_f32()
    old = with_leaf(af.tree.tree_map(torch.zeros_like, params_f32()), "head.b", torch.zeros(4))
    f = torch.tensor(True)
    return (lambda: af.mixed.skip_or_apply_(f, new, old)), (new, old, f)


@case("skip_or_apply-dtype", TypeError, "head.b", "float64", "float32")
def _():
    new = with_leaf(params_f32(), "head.b", torch.ones(3, dtype=torch.float64))
    old, f = params_f32(), torch.tensor(False)
    return (lambda: af.skip_or_apply(f, new, old)), (new, old, f)


@case("skip_or_apply_-complex-into-fp32", TypeError, "head.b", "complex64")
def _():
    new = with_leaf(params_f32(), "head.b", torch.full((3,), 1 + 2j, dtype=torch.complex64))
    old, f = af.tree.tree_map(torch.zeros_like, params_f32()), torch.tensor(True)
    return (lambda: af.mixed.skip_or_apply_(f, new, old)), (new, old, f)


@case("skip_or_apply_-inference-tensor-old", ValueError, "head.b", "inference")
def _():
    with torch.inference_mode():
        b = torch.zeros(3)
    new, f = params_f32(), torch.tensor(True)
    old = with_leaf(af.tree.tree_map(torch.zeros_like, params_f32()), "head.b", b)
    return (lambda: af.mixed.skip_or_apply_(f, new, old)), (new, old, f)


@case("skip_or_apply_-aliased-old", ValueError, "enc.w", "head.b")
def _():
    t = torch.zeros(3)
    new, old = {"enc": {"w": torch.ones(3)}, "head": {"b": torch.full((3,), 2.0)}}, {"enc": {"w": t}, "head": {"b": t}}
    f = torch.tensor(True)
    return (lambda: af.mixed.skip_or_apply_(f, new, old)), (new, old, f)


# ----------------------------------------------------------------------------------------------
# 3. Gradient leaves (items 6, 12, 13) across every consumer of gradients
# ----------------------------------------------------------------------------------------------


def _mp(inner, params_fn=params_f16):
    def build(grads_fn):
        params = params_fn()
        tx = af.mixed_precision(inner(), loss_scale=dls())
        state = tx.init(params)
        return tx, params, grads_fn(params), state

    return build


def _plain(make):
    def build(grads_fn):
        params = params_f32()
        tx = make()
        return tx, params, grads_fn(params), tx.init(params)

    return build


_CONSUMERS = {
    # name: (build(grads_fn) -> (tx, params, grads, state), call(tx, params, grads, state))
    "unscale_and_check": (lambda gf: (None, params_f32(), gf(params_f32()), dls()),
                          lambda tx, p, g, s: af.unscale_and_check(g, s)),
    "unscale_and_check_": (lambda gf: (None, params_f32(), gf(params_f32()), dls()),
                           lambda tx, p, g, s: af.mixed.unscale_and_check_(g, s)),
    "unscale": (lambda gf: (None, params_f32(), gf(params_f32()), dls()), lambda tx, p, g, s: af.mixed.unscale(g, s)),
    "global_norm": (lambda gf: (None, params_f32(), gf(params_f32()), None),
                    lambda tx, p, g, s: af.optim.global_norm(g)),
    "mp-adamw.step": (_mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.step(p, g, s)),
    "mp-adamw.step_": (_mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-adamw.update": (_mp(lambda: af.adamw(1e-3)), lambda tx, p, g, s: tx.update(g, s, p)),
    "mp-sgd-f32.step_": (_mp(lambda: af.sgd(0.1, momentum=0.9), params_f32), lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-clip-adam.step": (_mp(lambda: af.chain(af.clip_by_global_norm(1.0), af.adam(1e-3))),
                          lambda tx, p, g, s: tx.step(p, g, s)),
    "mp-rmsprop.step": (_mp(lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3)),
                        lambda tx, p, g, s: tx.step(p, g, s)),
    "mp-rmsprop.step_": (_mp(lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3)),
                         lambda tx, p, g, s: tx.step_(p, g, s)),
    "mp-accumulate.step": (_mp(lambda: af.accumulate(af.adam(1e-3), 2)), lambda tx, p, g, s: tx.step(p, g, s)),
    "mp-accumulate.step_": (_mp(lambda: af.accumulate(af.sgd(0.1), 2)), lambda tx, p, g, s: tx.step_(p, g, s)),
    "adam.update": (_plain(lambda: af.adam(1e-3)), lambda tx, p, g, s: tx.update(g, s, p)),
    "sgd-momentum.update": (_plain(lambda: af.sgd(0.1, momentum=0.9)), lambda tx, p, g, s: tx.update(g, s, p)),
    "clip.update": (_plain(lambda: af.clip_by_global_norm(1.0)), lambda tx, p, g, s: tx.update(g, s, p)),
    "clip-adamw.update": (_plain(lambda: af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3))),
                          lambda tx, p, g, s: tx.update(g, s, p)),
    "accumulate.update": (_plain(lambda: af.accumulate(af.sgd(0.1), 2)), lambda tx, p, g, s: tx.update(g, s, p)),
}

# Which consumers take params too (so that shape and structure against params can be checked).
_STEPPERS = [n for n in _CONSUMERS if n.startswith("mp-") or n.endswith(".update") and n != "clip.update"]

for _cname, (_cbuild, _ccall) in _CONSUMERS.items():
    for _lname, (_leaf, _lexc) in BAD_LEAVES.items():
        def _build(cbuild=_cbuild, ccall=_ccall, leaf=_leaf):
            tx, p, g, s = cbuild(lambda params: with_leaf(grads_like(params), "head.b",
                                                          leaf(params["head"]["b"].dtype)))
            return (lambda: ccall(tx, p, g, s)), (p, g, s)

        add(f"{_cname}-grad-{_lname}", _lexc, ["head.b"], _build)

for _cname in _STEPPERS:
    _cbuild, _ccall = _CONSUMERS[_cname]

    def _shape(cbuild=_cbuild, ccall=_ccall):
        # A (3, 4) gradient for a (4, 3) param: the same element count (item 4).
        tx, p, g, s = cbuild(lambda params: with_leaf(grads_like(params), "enc.w",
                                                      params["enc"]["w"].new_full((3, 4), 0.5)))
        return (lambda: ccall(tx, p, g, s)), (p, g, s)

    def _missing(cbuild=_cbuild, ccall=_ccall):
        tx, p, g, s = cbuild(lambda params: without_leaf(grads_like(params), "head.b"))
        return (lambda: ccall(tx, p, g, s)), (p, g, s)

    add(f"{_cname}-grad-transposed-shape", ValueError, ["enc.w"], _shape)
    add(f"{_cname}-grad-missing-leaf", ValueError, ["head.b"], _missing)


# ----------------------------------------------------------------------------------------------
# 4. Params and states against each other (items 3, 4, 8, 10, 12)
# ----------------------------------------------------------------------------------------------

_FUSED_AND_GENERIC = {
    "adamw": lambda: af.adamw(1e-3),
    "sgd": lambda: af.sgd(0.1, momentum=0.9),
    "rmsprop": lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3),
}

for _iname, _inner in _FUSED_AND_GENERIC.items():
    for _method in ("step", "step_"):
        def _other_model(inner=_inner, method=_method):
            # State from another model with the same element counts: enc.w is (3, 4) there.
            params = params_f16()
            other = with_leaf(params_f16(), "enc.w", torch.zeros(3, 4, dtype=torch.float16))
            tx = af.mixed_precision(inner(), loss_scale=dls())
            state = tx.init(other)
            grads = grads_like(params)
            return (lambda: getattr(tx, method)(params, grads, state)), (params, grads, state)

        def _other_structure(inner=_inner, method=_method):
            params = params_f16()
            other = without_leaf(params_f16(), "head.b")
            tx = af.mixed_precision(inner(), loss_scale=dls())
            state = tx.init(other)
            grads = grads_like(params)
            return (lambda: getattr(tx, method)(params, grads, state)), (params, grads, state)

        def _not_a_state(inner=_inner, method=_method):
            params = params_f16()
            tx = af.mixed_precision(inner(), loss_scale=dls())
            state = tx.init(params)._asdict()
            grads = grads_like(params)
            return (lambda: getattr(tx, method)(params, grads, state)), (params, grads, state)

        add(f"mp-{_iname}.{_method}-state-from-other-model", ValueError, ["enc.w"], _other_model)
        add(f"mp-{_iname}.{_method}-state-other-structure", ValueError, ["head.b"], _other_structure)
        add(f"mp-{_iname}.{_method}-state-not-a-state", TypeError, ["state"], _not_a_state)

    def _aliased(inner=_inner):
        t = torch.zeros(3)
        params = {"enc": {"w": t}, "head": {"b": t}}
        tx = af.mixed_precision(inner(), loss_scale=af.StaticLossScale(1.0))
        state = tx.init(params)
        grads = {"enc": {"w": torch.ones(3)}, "head": {"b": torch.ones(3)}}
        return (lambda: tx.step_(params, grads, state)), (params, grads, state)

    def _overlap(inner=_inner):
        base = torch.zeros(10)
        params = {"enc": {"w": base[0:6]}, "head": {"b": base[4:10]}}
        tx = af.mixed_precision(inner(), loss_scale=af.StaticLossScale(1.0))
        state = tx.init(params)
        grads = {"enc": {"w": torch.ones(6)}, "head": {"b": torch.ones(6)}}
        return (lambda: tx.step_(params, grads, state)), (params, grads, state, base)

    def _expanded(inner=_inner):
        params = {"enc": {"w": torch.zeros(4, 3)}, "head": {"b": torch.zeros(3).expand(4, 3)}}
        tx = af.mixed_precision(inner(), loss_scale=af.StaticLossScale(1.0))
        state = tx.init(params)
        grads = {"enc": {"w": torch.ones(4, 3)}, "head": {"b": torch.ones(4, 3)}}
        return (lambda: tx.step_(params, grads, state)), (params, grads, state)

    def _swapped_after_a_step(inner=_inner):
        # Aliased by a `.data` swap after the first step: the step must look again, not trust
        # what it checked on the first one.
        params = params_f32()
        tx = af.mixed_precision(inner(), loss_scale=af.StaticLossScale(1.0))
        state = tx.init(params)
        grads = grads_like(params)
        params, state = tx.step_(params, grads, state)
        params["head"]["b"].data = params["enc"]["w"].data[0]
        return (lambda: tx.step_(params, grads, state)), (params, grads, state)

    def _inference_param(inner=_inner):
        with torch.inference_mode():
            b = torch.zeros(3)
        params = with_leaf(params_f32(), "head.b", b)
        tx = af.mixed_precision(inner(), loss_scale=af.StaticLossScale(1.0))
        state = tx.init(params)
        grads = grads_like(params)
        return (lambda: tx.step_(params, grads, state)), (params, grads, state)

    add(f"mp-{_iname}.step_-aliased-by-a-data-swap-after-a-step", ValueError, ["enc.w", "head.b"],
        _swapped_after_a_step)
    add(f"mp-{_iname}.step_-inference-tensor-param", ValueError, ["head.b", "inference"], _inference_param)

    for _method in ("step", "step_"):
        def _state_for_other_dtypes(inner=_inner, method=_method, given=params_f32, made_for=params_f16):
            # A state made by init for params of other dtypes: with masters for fp32 params, or
            # without for fp16 ones.
            params = given()
            tx = af.mixed_precision(inner(), loss_scale=dls())
            state = tx.init(made_for())
            grads = grads_like(params)
            return (lambda: getattr(tx, method)(params, grads, state)), (params, grads, state)

        add(f"mp-{_iname}.{_method}-state-with-masters-fp32-params", ValueError, ["master", "init"],
            _state_for_other_dtypes)
        add(f"mp-{_iname}.{_method}-state-without-masters-fp16-params", ValueError, ["enc.w", "master", "init"],
            lambda f=_state_for_other_dtypes: f(given=params_f16, made_for=params_f32))

    def _scale_cast_to_fp64(inner=_inner):
        params = params_f16()
        tx = af.mixed_precision(inner(), loss_scale=dls())
        state = tx.init(params)
        state = state._replace(loss_scale=af.tree.tree_cast(state.loss_scale, torch.float64))
        grads = grads_like(params)
        return (lambda: tx.step_(params, grads, state)), (params, grads, state)

    def _scale_bad_setting(inner=_inner):
        from ampfunc.loss_scale import DynamicLossScale
        params = params_f16()
        tx = af.mixed_precision(inner(), loss_scale=dls())
        state = tx.init(params)
        ls = state.loss_scale
        bad = DynamicLossScale.from_tensors(ls.loss_scale, ls.growth_tracker, ls.hysteresis_tracker,
                                            ls.config._replace(growth_interval=0))
        state = state._replace(loss_scale=bad)
        grads = grads_like(params)
        return (lambda: tx.step_(params, grads, state)), (params, grads, state)

    add(f"mp-{_iname}.step_-loss-scale-cast-to-fp64", TypeError, ["loss_scale", "float32"], _scale_cast_to_fp64)
    add(f"mp-{_iname}.step_-loss-scale-growth_interval-0", ValueError, ["loss_scale", "growth_interval"],
        _scale_bad_setting)

    add(f"mp-{_iname}.step_-aliased-params", ValueError, ["enc.w", "head.b"], _aliased)
    add(f"mp-{_iname}.step_-overlapping-params", ValueError, ["enc.w", "head.b"], _overlap)
    add(f"mp-{_iname}.step_-expanded-param", ValueError, ["head.b"], _expanded)


@case("unscale_and_check_-aliased-grads", ValueError, "enc.w", "head.b")
def _():
    t = torch.ones(3)
    grads = {"enc": {"w": t}, "head": {"b": t}}
    ls = dls()
    return (lambda: af.mixed.unscale_and_check_(grads, ls)), (grads, ls)


@case("unscale_and_check_-fp16-grad", TypeError, "head.b")
def _():
    grads = with_leaf(grads_like(params_f32()), "head.b", torch.ones(3, dtype=torch.float16))
    ls = dls()
    return (lambda: af.mixed.unscale_and_check_(grads, ls)), (grads, ls)


@case("mixed_precision-master-int", ValueError, "master_dtype")
def _():
    return (lambda: af.mixed_precision(af.adam(1e-3), af.DynamicLossScale(), master_dtype=torch.int32)), None


@case("mixed_precision-inner-not-transform", TypeError, "inner")
def _():
    return (lambda: af.mixed_precision(torch.optim.Adam, af.DynamicLossScale())), None


@case("mixed_precision-loss_scale-float", TypeError, "loss scale")
def _():
    return (lambda: af.mixed_precision(af.adam(1e-3), loss_scale=128.0)), None


@case("mixed_precision.update-no-params", (TypeError, ValueError), "params")
def _():
    params = params_f16()
    tx = af.mixed_precision(af.adam(1e-3), af.DynamicLossScale())
    state = tx.init(params)
    grads = grads_like(params)
    return (lambda: tx.update(grads, state)), (params, grads, state)


@case("mixed_precision.init-int-param", TypeError, "head.b")
def _():
    params = with_leaf(params_f32(), "head.b", torch.zeros(3, dtype=torch.int64))
    return (lambda: af.mixed_precision(af.adam(1e-3), af.DynamicLossScale()).init(params)), params


@case("mixed_precision.init-numpy-param", TypeError, "head.b")
def _():
    params = with_leaf(params_f32(), "head.b", np.zeros(3, dtype=np.float32))
    return (lambda: af.mixed_precision(af.adam(1e-3), af.DynamicLossScale()).init(params)), params


@case("adam.init-meta-param", ValueError, "head.b")
def _():
    params = with_leaf(params_f32(), "head.b", torch.empty(3, device="meta"))
    return (lambda: af.adam(1e-3).init(params)), params


@case("apply_updates-structure", ValueError, "head.b")
def _():
    params = params_f32()
    updates = without_leaf(grads_like(params), "head.b")
    return (lambda: af.apply_updates(params, updates)), (params, updates)


@case("apply_updates-shape", ValueError, "enc.w")
def _():
    params = params_f32()
    updates = with_leaf(grads_like(params), "enc.w", torch.zeros(3, 4))
    return (lambda: af.apply_updates(params, updates)), (params, updates)


@case("apply_updates-numpy", TypeError, "head.b")
def _():
    params = params_f32()
    updates = with_leaf(grads_like(params), "head.b", np.zeros(3, dtype=np.float32))
    return (lambda: af.apply_updates(params, updates)), (params, updates)


# ----------------------------------------------------------------------------------------------
# 5. Losses
# ----------------------------------------------------------------------------------------------

add("scale_loss-vector", ValueError, ["loss"], lambda: ((lambda l=torch.ones(3): af.scale_loss(l, dls())), None))
add("scale_loss-int", TypeError, ["loss"],
    lambda: ((lambda l=torch.tensor(3): af.scale_loss(l, dls())), None))
add("scale_loss-pyfloat", TypeError, ["loss"], lambda: ((lambda: af.scale_loss(1.5, dls())), None))
add("scale_loss-numpy", TypeError, ["loss"], lambda: ((lambda: af.scale_loss(np.float32(1.5), dls())), None))
add("scale_loss-ls-float", TypeError, ["loss scale"],
    lambda: ((lambda l=torch.tensor(1.0): af.scale_loss(l, 128.0)), None))
add("unscale_and_check-ls-float", TypeError, ["loss scale"],
    lambda: ((lambda g=grads_like(params_f32()): af.unscale_and_check(g, 128.0)), None))
add("update_scale-ls-float", TypeError, ["loss scale"],
    lambda: ((lambda: af.update_scale(128.0, torch.tensor(True))), None))


# ----------------------------------------------------------------------------------------------
# 6. Optimizer and transform settings
# ----------------------------------------------------------------------------------------------

_BAD_HPARAMS = [
    ("sgd-lr-negative", ValueError, ["learning rate"], lambda: af.sgd(-0.1)),
    ("sgd-lr-nan", ValueError, ["learning rate"], lambda: af.sgd(NAN)),
    ("sgd-lr-str", TypeError, ["lr"], lambda: af.sgd("0.1")),
    ("adamw-lr-inf", ValueError, ["learning rate"], lambda: af.adamw(INF)),
    ("adamw-lr-beyond-fp32", ValueError, ["learning rate", "fp32"], lambda: af.adamw(1e39)),
    ("sgd-lr-tensor", TypeError, ["lr"], lambda: af.sgd(torch.tensor(0.1))),
    ("sgd-momentum-negative", ValueError, ["momentum"], lambda: af.sgd(0.1, momentum=-0.5)),
    ("sgd-dampening-nan", ValueError, ["dampening"], lambda: af.sgd(0.1, momentum=0.9, dampening=NAN)),
    ("sgd-weight_decay-negative", ValueError, ["weight_decay"], lambda: af.sgd(0.1, weight_decay=-1.0)),
    ("sgd-nesterov-without-momentum", ValueError, ["Nesterov"], lambda: af.sgd(0.1, nesterov=True)),
    ("adam-beta1-one", ValueError, ["b1"], lambda: af.adam(1e-3, b1=1.0)),
    ("adam-beta2-negative", ValueError, ["b2"], lambda: af.adam(1e-3, b2=-0.1)),
    ("adam-beta1-pair", TypeError, ["b1", "betas"], lambda: af.adam(1e-3, b1=(0.9, 0.99))),
    ("adam-eps-negative", ValueError, ["eps"], lambda: af.adam(1e-3, eps=-1e-8)),
    ("adamw-weight_decay-nan", ValueError, ["weight_decay"], lambda: af.adamw(1e-3, weight_decay=NAN)),
    ("clip-max_norm-negative", ValueError, ["max_norm"], lambda: af.clip_by_global_norm(-1.0)),
    ("clip-max_norm-nan", ValueError, ["max_norm"], lambda: af.clip_by_global_norm(NAN)),
    ("clip-max_norm-str", (TypeError, ValueError), ["max_norm"], lambda: af.clip_by_global_norm("1")),
    ("accumulate-every_k-0", ValueError, ["every_k"], lambda: af.accumulate(af.sgd(0.1), 0)),
    ("accumulate-every_k-float", ValueError, ["every_k"], lambda: af.accumulate(af.sgd(0.1), 1.5)),
    ("accumulate-inner-not-transform", TypeError, ["inner"], lambda: af.accumulate(torch.optim.SGD, 2)),
    ("from_torch-not-an-optimizer", TypeError, ["from_torch"], lambda: af.from_torch(int, lr=0.1)),
    ("from_torch-lbfgs", TypeError, ["LBFGS"], lambda: af.from_torch(torch.optim.LBFGS, lr=0.1)),
    ("from_torch-lr-negative", ValueError, ["learning rate"], lambda: af.from_torch(torch.optim.SGD, lr=-1.0)),
    ("from_torch-unknown-hparam", TypeError, ["bogus"], lambda: af.from_torch(torch.optim.SGD, lr=0.1, bogus=1)),
    ("scale-nan", ValueError, ["step_size"], lambda: af.optim.scale(NAN)),
    ("chain-not-a-transform", TypeError, ["chain"], lambda: af.chain(af.sgd(0.1), "adam")),
    # A state made by another configuration: refused by name, not silently dropped or a bare error.
    ("sgd-state-with-momentum-buffer-momentum-0", ValueError, ["momentum_buffer", "momentum == 0"],
     lambda: af.sgd(0.1).update(params_f32(), af.sgd(0.1, momentum=0.9).init(params_f32()), params_f32())),
    ("adam-state-with-max_exp_avg_sq-amsgrad-off", ValueError, ["max_exp_avg_sq", "amsgrad"],
     lambda: af.adam(1e-3).update(params_f32(), af.adam(1e-3, amsgrad=True).init(params_f32()), params_f32())),
    ("scale_by_schedule-foreign-state", TypeError, ["scale_by_schedule", "AdamState"],
     lambda: af.optim.scale_by_schedule(af.optim.constant_schedule(0.1)).update(params_f32(),
                                                                                 af.adam(1e-3).init(params_f32()))),
    ("partition-foreign-state", ValueError, ["partition", "'n'"],
     lambda: af.partition({"d": af.sgd(0.1), "x": af.identity()}, {"enc": {"w": "d"}, "head": {"b": "x"}}).update(
         params_f32(), {"d": af.sgd(0.1).init(params_f32()), "n": ()}, params_f32())),
    # mixed_precision must be the outermost transform: inside, it would see clipped, masked or
    # dropped scaled gradients, and under accumulate its scale would never back off.
    ("accumulate-of-mixed_precision", TypeError, ["accumulate", "outermost"],
     lambda: af.accumulate(af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale()), 2)),
    ("chain-with-mixed_precision-inside", TypeError, ["chain: argument 1", "outermost"],
     lambda: af.chain(af.clip_by_global_norm(1.0), af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale()))),
    ("masked-of-mixed_precision", TypeError, ["masked", "outermost"],
     lambda: af.masked(af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale()), {"w": True})),
    ("partition-with-mixed_precision", TypeError, ["partition", "'a'", "outermost"],
     lambda: af.partition({"a": af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale())}, {"w": "a"})),
    ("get_policy-bad-dtype", ValueError, ["float33"], lambda: af.get_policy("params=float33")),
    ("get_policy-int-compute", ValueError, ["int8"], lambda: af.get_policy("p=f32,c=int8,o=f32")),
    ("get_policy-unknown-key", ValueError, ["weights"], lambda: af.get_policy("weights=f32")),
    ("get_policy-not-a-string", TypeError, ["get_policy"], lambda: af.get_policy(16)),
    ("cosine_decay_schedule-steps-negative", ValueError, ["decay_steps"],
     lambda: af.optim.cosine_decay_schedule(1.0, -5)),
    ("warmup_cosine_decay_schedule-init-nan", ValueError, ["warmup_cosine_decay_schedule", "init_value"],
     lambda: af.optim.warmup_cosine_decay_schedule(NAN, 1.0, 2, 10)),
    # A float flag would count a NaN as a finite step.
    ("record-float-flag", ValueError, ["record", "finite"],
     lambda: af.monitor.record(af.monitor.init_stats(), torch.tensor(NAN))),
    ("TrainingMonitor.record-float-flag", ValueError, ["TrainingMonitor.record", "finite"],
     lambda: af.TrainingMonitor({"w": torch.zeros(2)}).record(torch.tensor(1.0))),
    ("copy_to_module-non-tensor", TypeError, ["copy_to_module", "'weight'", "int"],
     lambda: af.functional.copy_to_module(torch.nn.Linear(2, 2), {"weight": 3})),
]
for _hid, _exc, _names, _make in _BAD_HPARAMS:
    add(_hid, _exc, _names, lambda make=_make: (make, None))


@case("cast_params-int-dtype", ValueError, "int32")
def _():
    params = params_f32()
    return (lambda: af.cast_params(params, torch.int32)), params


@case("cast_params-keep-not-strings", TypeError, "keep")
def _():
    params = params_f32()
    return (lambda: af.cast_params(params, torch.float16, keep=[1, 2])), params


# ----------------------------------------------------------------------------------------------
# 7. Whole-step front-ends and facades
# ----------------------------------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _trainer_for(out_features, flat):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, out_features)
    return model, af.ModuleTrainer(model, af.adamw(1e-3), flat=flat)


for _flat in (False, True):
    def _other_models_state(flat=_flat):
        # A Linear(4, 3) trainer's state into a Linear(4, 2) trainer: refused at the load, not
        # at the next step after the good state was replaced.
        _, other = _trainer_for(3, flat)
        model, trainer = _trainer_for(2, flat)
        sd = other.state_dict()
        return (lambda: trainer.load_state_dict(sd)), (model, trainer.state)

    add(f"ModuleTrainer{'-flat' if _flat else ''}.load_state_dict-other-model", ValueError,
        ["ModuleTrainer.state", "opt_state.exp_avg", "another model"], _other_models_state)


@case("GradScaler-init_scale-zero", ValueError, "init_scale")
def _():
    return (lambda: af.compat.GradScaler("cpu", init_scale=0.0)), None


@case("GradScaler-init_scale-inf", ValueError, "init_scale")
def _():
    return (lambda: af.compat.GradScaler("cpu", init_scale=INF)), None


@case("GradScaler-init_scale-1e39", ValueError, "init_scale")
def _():
    return (lambda: af.compat.GradScaler("cpu", init_scale=1e39)), None


# The facade raises torch's own exception type here (drop-in parity): AssertionError.
@case("GradScaler-growth_factor-half", AssertionError, "growth factor")
def _():
    return (lambda: af.compat.GradScaler("cpu", growth_factor=0.5)), None


@case("GradScaler-update-new_scale-zero", ValueError, "new_scale")
def _():
    model = _mlp()
    scaler = af.compat.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    return (lambda: scaler.update(new_scale=0.0)), (model, scaler.loss_scale)


@case("GradScaler-update-new_scale-nan-tensor", ValueError, "new_scale")
def _():
    model = _mlp()
    scaler = af.compat.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    bad = torch.tensor(NAN)
    return (lambda: scaler.update(new_scale=bad)), (model, scaler.loss_scale, bad)


@case("ModuleTrainer-loss_scale-float", TypeError, "loss_scale")
def _():
    model = _mlp()
    return (lambda: af.ModuleTrainer(model, af.sgd(0.1), loss_scale=2.0)), model


@case("make_train_step-tx-not-transform", TypeError, "tx")
def _():
    model = _mlp()
    return (lambda: af.make_train_step(model, lambda out, y: out.sum(), torch.optim.SGD)), model


@case("checkpoint.load-plain-torch-file", af.checkpoint.CheckpointError, "torch.load")
def _():
    import io

    buf = io.BytesIO()
    torch.save({"t": torch.ones(3)}, buf)
    buf.seek(0)
    buf.name = "plain.pt"
    return (lambda: af.checkpoint.load(buf)), None


# ----------------------------------------------------------------------------------------------
# The test
# ----------------------------------------------------------------------------------------------

# Rows expected to fail, each with the reason; empty while every row passes (a row that starts
# failing must be fixed or listed here, visibly).
KNOWN_FAILING: dict[str, str] = {}


def test_table_is_large_and_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    assert len(CASES) >= 130


@pytest.mark.parametrize("row", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_FAILING[c.id]))
                                 if c.id in KNOWN_FAILING else c for c in CASES], ids=[c.id for c in CASES])
def test_bad_input_is_refused_clearly_and_touches_nothing(row: Case):
    call, given = row.build()
    leaves = _given_leaves(given)
    before = [_leaf_record(x) for x in leaves]
    with pytest.raises(row.exc) as err:
        call()
    message = str(err.value)
    missing = [n for n in row.names if n not in message]
    assert not missing, f"{row.id}: message does not name {missing}: {type(err.value).__name__}: {message}"
    after = [_leaf_record(x) for x in leaves]
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if not _same(a, b)]
    assert not changed, f"{row.id}: given tensors {changed} were modified before the error"


# ----------------------------------------------------------------------------------------------
# Item 14: low-precision params with a plain optimizer (no master) warn, once
# ----------------------------------------------------------------------------------------------

_PLAIN_OPTIMIZERS = {
    "sgd": lambda: af.sgd(0.1),
    "adam": lambda: af.adam(1e-3),
    "adamw": lambda: af.adamw(1e-3),
    "from_torch": lambda: af.from_torch(torch.optim.RMSprop, lr=1e-3),
}


@pytest.fixture
def fresh_warnings(monkeypatch):
    from ampfunc.optim import base

    monkeypatch.setattr(base, "_WARNED_LOW_PRECISION", set())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(_PLAIN_OPTIMIZERS))
def test_low_precision_params_without_master_warn_once(name, dtype, fresh_warnings):
    params = {"enc": {"w": torch.zeros(3, dtype=torch.float32)}, "head": {"b": torch.zeros(3, dtype=dtype)}}
    with pytest.warns(UserWarning, match=r"head\.b.*" + str(dtype).split(".")[-1] + r".*mixed_precision"):
        _PLAIN_OPTIMIZERS[name]().init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _PLAIN_OPTIMIZERS[name]().init(params)  # once per process and optimizer kind


@pytest.mark.parametrize("name", list(_PLAIN_OPTIMIZERS))
def test_no_warning_with_a_master_or_fp32_params(name, fresh_warnings):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        af.mixed_precision(_PLAIN_OPTIMIZERS[name](), af.DynamicLossScale()).init(params_f16())
        _PLAIN_OPTIMIZERS[name]().init(params_f32())


# ----------------------------------------------------------------------------------------------
# Item 11: in-place paths with an nn.Parameter among the leaves are all-or-nothing
# ----------------------------------------------------------------------------------------------


def _all_or_nothing(call, written, expected):
    before = [_leaf_record(t) for t in written]
    try:
        call()
    except (TypeError, ValueError, RuntimeError):
        assert all(_same(a, _leaf_record(t)) for a, t in zip(before, written)), "partly written, then raised"
        return
    assert all(torch.equal(t.detach(), e) for t, e in zip(written, expected)), "not fully written"


def test_skip_or_apply_inplace_with_a_parameter_leaf_is_all_or_nothing():
    old = {"a": torch.zeros(3), "b": torch.nn.Parameter(torch.zeros(3))}
    new = {"a": torch.ones(3), "b": torch.full((3,), 2.0)}
    _all_or_nothing(lambda: af.mixed.skip_or_apply_(torch.tensor(True), new, old), [old["a"], old["b"]],
                    [new["a"], new["b"]])


@pytest.mark.parametrize("inner", [lambda: af.adamw(1e-2), lambda: af.from_torch(torch.optim.SGD, lr=0.1)],
                         ids=["fused", "from_torch"])
def test_step_inplace_with_a_parameter_leaf_is_all_or_nothing(inner):
    params = {"a": torch.zeros(3), "b": torch.nn.Parameter(torch.zeros(3))}
    tx = af.mixed_precision(inner(), loss_scale=af.StaticLossScale(1.0))
    state = tx.init(params)
    grads = {"a": torch.ones(3), "b": torch.ones(3)}
    expected, _ = tx.step(params, grads, state)
    _all_or_nothing(lambda: tx.step_(params, grads, state), [params["a"], params["b"]],
                    [expected["a"].detach(), expected["b"].detach()])
