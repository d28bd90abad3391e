"""torch.compile(fullgraph=True) traces a whole fused step built from the ops and gives the
eager numbers. The ops are opaque custom ops with fake kernels; their in-place list arguments
are functionalized by torch.compile. Slow (compiles): one test.

Inductor compiles the glue between the ops (the scale's reciprocal, the clip coefficient) with
its own code and flags, which on some CPUs rounds one ulp away from eager: float results are
compared with tests/_tolerance.py's few-ulp tolerance; the skip decision, the integer trackers,
the power-of-two loss scale and "a skipped step changes nothing" are compared bit for bit."""

import subprocess
import sys

import pytest
import torch

from _tolerance import assert_compiled_close
from ampfunc import ops

pytestmark = pytest.mark.slow

SCALE_CONFIG = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, min_scale=1.0, max_scale=2.0**24,
                    hysteresis=1)


def mixed_precision_adamw_step(master, model, grads, exp_avg, exp_avg_sq, step, scale, growth, hyst):
    """check -> clip coefficient -> fused AdamW (writes the fp16 model copy) -> scale update."""
    finite, sumsq = ops.check(grads)
    inv_scale = scale.double().reciprocal().float()
    grad_scale = inv_scale * (1.0 / (sumsq.sqrt() * inv_scale + 1e-6)).clamp(max=1.0)
    outs, _ = ops.unscale(grads, inv_scale)  # an out-of-place op in the same graph
    ops.adam_step_(master, grads, exp_avg, exp_avg_sq, None, model, step, grad_scale, finite, lr=1e-2,
                   weight_decay=0.01, decoupled_weight_decay=True)
    # Last: with torch 2.13's inductor, a value derived from `scale` and consumed by an op placed
    # after this in-place update was seen to be recomputed from the updated scale (aot_eager
    # keeps program order), so the step reads everything it needs from the scale first.
    ops.update_scale_(scale, growth, hyst, finite, **SCALE_CONFIG)
    return finite, outs


def _state():
    gen = torch.Generator().manual_seed(0)
    shapes = [(31,), (7, 5), (1,)]
    master = [torch.randn(s, generator=gen) for s in shapes]
    return dict(master=master, model=[p.half() for p in master], exp_avg=[torch.zeros(s) for s in shapes],
                exp_avg_sq=[torch.zeros(s) for s in shapes], step=torch.zeros(()), scale=torch.tensor(256.0),
                growth=torch.zeros((), dtype=torch.int32), hyst=torch.ones((), dtype=torch.int32)), shapes


def _leaves(v):
    return v if isinstance(v, list) else [v]


def test_compiled_fullgraph_step_equals_eager_step_including_a_skipped_one():
    eager, shapes = _state()
    compiled, _ = _state()
    fn = torch.compile(mixed_precision_adamw_step, fullgraph=True, backend="inductor")
    for i in range(4):
        gen = torch.Generator().manual_seed(100 + i)
        grads = [(torch.randn(s, generator=gen) * 256).half() for s in shapes]
        if i == 2:
            grads[1][0, 0] = float("inf")
        before = {k: [t.clone() for t in _leaves(v)] for k, v in compiled.items()}
        f_e, outs_e = mixed_precision_adamw_step(grads=grads, **eager)
        f_c, outs_c = fn(grads=grads, **compiled)
        assert bool(f_e) == bool(f_c) == (i != 2)
        for a, b in zip(outs_e, outs_c):
            assert_compiled_close(b, a, "unscaled grads")
        for k in eager:
            for a, b in zip(_leaves(eager[k]), _leaves(compiled[k])):
                assert_compiled_close(b, a, k)
        assert torch.equal(compiled["scale"], eager["scale"])  # powers of two: no rounding to differ in
        if i == 2:  # skipped: the compiled step wrote nothing but the scale and its trackers
            for k in ("master", "model", "exp_avg", "exp_avg_sq", "step"):
                assert all(torch.equal(a, b) for a, b in zip(_leaves(compiled[k]), before[k])), k
    assert float(compiled["step"]) == 3.0


@pytest.mark.skipif(ops.backend() == "reference", reason="compiled kernels not built")
def test_a_graph_compiled_before_any_eager_call_runs_the_compiled_kernels():
    # torch.compile traces through the fake kernels and never loads the library; the graph's
    # first run must load it and use the compiled kernels, not the reference, from then on.
    code = """if True:
        import torch, ampfunc as af
        from ampfunc import ops
        params = {"w": torch.randn(100, 10)}
        tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale())
        state = tx.init(params)
        assert ops._BACKEND[0] is None
        step = torch.compile(tx.step, backend="aot_eager", fullgraph=True)
        g = {"w": torch.randn(100, 10)}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            p2, s2 = step(params, g, state)
            p2, s2 = step(p2, g, s2)
        keys = {e.key for e in prof.key_averages()}
        assert ops._BACKEND[0] != "reference", ops._BACKEND
        assert "ampfunc::adam_step" in keys and not any("lerp" in k for k in keys), sorted(keys)
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_compiled_pure_step_returns_new_state_that_aliases_nothing():
    # Eager, the pure steps hand back each new state list as views of one block; a custom op
    # that a compiled graph calls must return outputs aliasing nothing (torch checks at run time,
    # warns now and will refuse), so there each output is its own allocation, with the same values.
    import warnings

    gen = torch.Generator().manual_seed(0)
    p, g = [torch.randn(n, generator=gen) for n in (3, 5, 7)], [torch.randn(n, generator=gen) for n in (3, 5, 7)]
    m, v = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
    one = torch.ones(())

    def update(p, g, m, v, step):
        return ops.adam_update(p, g, m, v, None, step, one, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)

    ops.load()
    eager = update(p, g, m, v, torch.zeros(()))
    compiled = torch.compile(update, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*alias.*")
        out = compiled(p, g, m, v, torch.zeros(()))
    for lst in out[:3]:
        assert len({t.untyped_storage().data_ptr() for t in lst}) == len(lst)
    for a, b in zip(eager[:3], out[:3]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    if ops._DIRECT[0] is not None:  # eager through the direct door: packed
        assert len({t.untyped_storage().data_ptr() for t in eager[1]}) == 1
