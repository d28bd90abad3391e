"""The whole mixed-precision step compiles as one graph and computes what eager computes.

``torch.compile(fullgraph=True)`` raises on any graph break (a host sync such as ``.item()``
or a Python branch on a tensor), so compiling :func:`ampfunc.make_train_step`'s step -- forward,
``torch.func`` backward, unscale and check, clipping, AdamW, the skip and the loss-scale update --
is the check that no part of the step reads the device back. The in-place twin ``train.step_``
must compile to a graph that writes the state it is given (no copies swapped in) with the
eager numbers. Compiling is slow on small CPUs: this file keeps to two CPU compiles (about
15 s each); the CUDA tests run where a GPU is present (``benchmarks/gpu_check.sh``).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import ampfunc as af

SKIPPED_STEP = 2  # its loss is multiplied by inf: every grad is non-finite, the step is skipped


def net():
    torch.manual_seed(0)
    # No bias before the BatchNorm: its gradient would be rounding noise, which Adam amplifies to
    # lr-sized steps whose sign depends on the summation order (eager vs fused kernels).
    return torch.nn.Sequential(torch.nn.Linear(6, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def loss_fn(forward, x, y, w):
    return F.cross_entropy(forward(x), y) * w


def data(n, device):
    g = torch.Generator().manual_seed(3)
    out = []
    for step in range(n):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        w = torch.tensor(math.inf if step == SKIPPED_STEP else 1.0)
        out.append((x.to(device), y.to(device), w.to(device)))
    return out


def build(device, policy="p=f32,c=f32,o=f32"):
    model = net().to(device)
    tx = af.chain(af.clip_by_global_norm(0.5), af.adamw(1e-2, weight_decay=0.01))
    ls = af.DynamicLossScale(2.0**10, growth_interval=2, device=device)
    return af.make_train_step(model, loss_fn, tx, af.get_policy(policy), loss_scale=ls)


def run(step, state, batches):
    trace = []
    for batch in batches:
        state, out = step(state, *batch)
        trace.append((bool(out.finite), float(out.loss_scale), float(state.loss_scale.loss_scale)))
    return state, trace


def assert_states_close(a, b, rtol, atol):
    for (path, x), (_, y) in zip(af.tree.leaves_with_paths(a), af.tree.leaves_with_paths(b)):
        if torch.is_floating_point(x):
            assert torch.allclose(x, y, rtol=rtol, atol=atol), path
        else:
            assert torch.equal(x, y), path


@pytest.mark.slow
def test_compiled_full_step_has_no_graph_break_and_matches_eager_including_a_skipped_step():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    train = build("cpu")
    batches = data(5, "cpu")
    eager_state, eager_trace = run(train.step, train.init(), batches)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(train.step, fullgraph=True, backend=counter)  # a graph break raises
    compiled_state, compiled_trace = run(compiled, train.init(), batches)

    assert counter.frame_count == 1  # one graph, and the changing scale/step count never recompiles
    assert compiled_trace == eager_trace
    assert [finite for finite, _, _ in eager_trace] == [s != SKIPPED_STEP for s in range(5)]
    assert_states_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# CUDA: compiled and CUDA-graph-captured steps (run by benchmarks/gpu_check.sh on a GPU machine)
# ----------------------------------------------------------------------------------------------

def cuda(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@cuda
@pytest.mark.parametrize("policy", ["p=f32,c=f32,o=f32", "p=f32,c=f16,o=f32"])
def test_cuda_compiled_step_matches_eager(policy):
    torch._dynamo.reset()
    train = build("cuda", policy)
    batches = data(5, "cuda")
    eager_state, eager_trace = run(train.step, train.init(), batches)
    compiled_state, compiled_trace = run(torch.compile(train.step, fullgraph=True), train.init(), batches)
    assert compiled_trace == eager_trace
    tol = 1e-5 if policy.endswith("c=f32,o=f32") else 2e-2
    assert_states_close(compiled_state, eager_state, rtol=tol, atol=tol * 0.1)


@cuda
def test_cuda_graph_captured_step_matches_eager():
    train = build("cuda")
    batches = data(5, "cuda")
    eager_state, eager_trace = run(train.step, train.init(), batches)

    # Static buffers the graph reads and writes; each replay is one whole step on the device.
    state = train.init()
    static_batch = tuple(t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (lazy inits, autotuning)
        for _ in range(2):
            train.step(state, *static_batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new_state, out = train.step(state, *static_batch)

    trace = []
    for batch in batches:
        for dst, src in zip(static_batch, batch):
            dst.copy_(src)
        graph.replay()
        trace.append((bool(out.finite), float(out.loss_scale), float(new_state.loss_scale.loss_scale)))
        for dst, src in zip(af.tree.tree_leaves(state), af.tree.tree_leaves(new_state)):
            dst.copy_(src)  # the next replay starts from this step's result
    assert trace == eager_trace
    assert_states_close(state, eager_state, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# The in-place twin (train.step_) and the gradients in the compute dtype
# ----------------------------------------------------------------------------------------------

def _ptrs(state):
    return [t.data_ptr() for t in af.tree.tree_leaves(state) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("policy", ["p=f32,c=f32,o=f32", "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"])
def test_inplace_step_gives_the_pure_steps_numbers_bit_for_bit_and_writes_the_given_state(policy):
    train = build("cpu", policy)
    batches = data(5, "cpu")
    pure_init = train.init()
    pure_state, pure_trace = run(train.step, pure_init, batches)

    state = train.init()
    ptrs = _ptrs(state)
    trace, flags = [], []
    for batch in batches:
        new_state, out = train.step_(state, *batch)
        assert new_state is state  # donated: the same state, its tensors overwritten
        flags.append(out.finite)
        trace.append((bool(out.finite), float(out.loss_scale), float(state.loss_scale.loss_scale)))
    assert _ptrs(state) == ptrs  # nothing reallocated
    assert trace == pure_trace
    # The step's outputs are its own tensors: the next step does not overwrite them.
    assert [bool(f) for f in flags] == [s != SKIPPED_STEP for s in range(5)]
    assert int(state.skipped) == 1
    assert_states_close(state, pure_state, rtol=0, atol=0)
    # The writes stayed in this state: a new one starts from the model and the configured scale.
    assert_states_close(train.init(), pure_init, rtol=0, atol=0)


def test_gradients_in_the_compute_dtype_are_the_param_dtype_gradients():
    # p=f32,c=bf16: the step differentiates the bf16 compute copy; SGD with lr=1 and no loss scale
    # subtracts exactly the gradient, which must be the fp32 gradient of the fp32 params (the
    # cast inside the differentiated function) bit for bit. p=f16,c=f32: the fp32 gradient is
    # rounded to the fp16 param's dtype, as the cast's backward does.
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def loss(forward, x, y):
        return F.cross_entropy(forward(x), y)

    for policy, narrow in (("p=f32,c=bf16,o=f32", torch.bfloat16), ("p=f16,c=f32,o=f32", torch.float32)):
        pol = af.get_policy(policy)
        train = af.make_train_step(model, loss, af.sgd(1.0), pol)
        state = train.init()
        params = {k: v.clone() for k, v in state.params.items()}

        def reference_loss(p):
            out = torch.func.functional_call(model, af.cast_params(p, narrow), (x.to(narrow),))
            return F.cross_entropy(out.float(), y)

        expected_grads = torch.func.grad(reference_loss)(params)
        state, out = train.step(state, x, y)
        for k, p in params.items():
            g = expected_grads[k]
            assert g.dtype == p.dtype
            expected = (p.float() - g.float()).to(p.dtype)
            assert torch.equal(state.params[k], expected), (policy, k)


@pytest.mark.slow
def test_compiled_inplace_step_is_one_graph_writes_the_state_and_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    train = build("cpu", "p=f32,c=bf16,o=f32")
    batches = data(5, "cpu")
    eager_state, eager_trace = run(train.step_, train.init(), batches)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(train.step_, fullgraph=True, backend=counter)
    state = train.init()
    ptrs = _ptrs(state)
    compiled_state, compiled_trace = run(compiled, state, batches)
    assert counter.frame_count == 1  # no recompile as the scale, the step count and the flags change
    assert compiled_state is state and _ptrs(state) == ptrs  # written in place, no copies swapped in
    assert compiled_trace == eager_trace
    assert int(state.skipped) == 1
    assert_states_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_init_loads_the_compiled_kernels_before_a_compiled_step_can_call_the_ops():
    # A compiled step calls torch.ops.ampfunc.* directly: if nothing eager ran first, the
    # reference kernels would serve them for good. init() loads the kernels.
    import os
    import subprocess
    import sys

    code = ("import torch, ampfunc as af\n"
            "from ampfunc import ops\n"
            "train = af.make_train_step(torch.nn.Linear(2, 2), lambda f, x: f(x).sum(), af.adamw(1e-3))\n"
            "assert ops._BACKEND[0] is None, ops._BACKEND\n"
            "train.init()\n"
            "assert ops._BACKEND[0] is not None\n"
            "print('loaded', ops._BACKEND[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded" in out.stdout
