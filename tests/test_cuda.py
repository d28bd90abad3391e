"""The CUDA kernels (ext/cuda) against their plain-torch references, on the GPU.

Everything here but the launch-layout test needs a CUDA device and the compiled CUDA backend
(``benchmarks/gpu_check.sh`` runs this file on one with ``AMPFUNC_REQUIRE_EXT=1``); the kernels
are reached through the public door, :mod:`ampfunc.ops`. The launch-layout test needs only
``nvcc``: it runs the host half of the multi-tensor apply (how leaves and chunks are packed
into launches) without a GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampfunc as af
from ampfunc import ops

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 65536  # AMPFUNC_CUDA_CHUNK in ext/cuda/ampfunc_cuda.h

_skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def needs_cuda(test):
    """Marks a test `cuda` (select with -m cuda) and skips it where torch sees no GPU."""
    return pytest.mark.cuda(_skip_without_cuda(test))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 4099, CHUNK, 3 * CHUNK + 17]


# ----------------------------------------------------------------------------------------------
# Launch layout (host code only; needs nvcc, not a GPU)
# ----------------------------------------------------------------------------------------------

_HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "mta.cuh"
using namespace ampfunc::cuda;
template <int D>
int run(const std::vector<int64_t>& numels) {
  const int n = (int)numels.size();
  std::vector<std::vector<void*>> store(D, std::vector<void*>(n));
  for (int d = 0; d < D; ++d)
    for (int i = 0; i < n; ++i) store[d][i] = reinterpret_cast<void*>((uintptr_t)(1000000 * (d + 1) + i) * 16);
  void* const* lists[D];
  for (int d = 0; d < D; ++d) lists[d] = store[d].data();
  cudaError_t err = multi_tensor_apply<D>(n, numels.data(), lists, [&](const TensorListMeta<D>& meta, int nb) {
    printf("L %d %lld\n", nb, (long long)meta.block_base);
    for (int b = 0; b < nb; ++b) {
      const int slot = meta.block_tensor[b];
      const int leaf = meta.leaf[slot];
      int ptrs_ok = 1;
      for (int d = 0; d < D; ++d) ptrs_ok &= meta.ptr[d][slot] == store[d][leaf];
      printf("B %d %d %lld %lld %d\n", slot, leaf, (long long)meta.block_chunk[b], (long long)meta.numel[slot], ptrs_ok);
    }
    return cudaSuccess;
  });
  printf("E %d %d %d\n", (int)err, TensorListMeta<D>::kMaxTensors, kMaxBlocks);
  return 0;
}
int main(int argc, char** argv) {
  const int depth = atoi(argv[1]);
  std::vector<int64_t> numels;
  long long x;
  while (scanf("%lld", &x) == 1) numels.push_back(x);
  if (depth == 1) return run<1>(numels);
  if (depth == 2) return run<2>(numels);
  if (depth == 4) return run<4>(numels);
  return run<6>(numels);
}
"""


@pytest.fixture(scope="module")
def layout_harness(tmp_path_factory):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("needs nvcc")
    d = tmp_path_factory.mktemp("mta")
    (d / "harness.cu").write_text(_HARNESS)
    subprocess.run([nvcc, "-std=c++17", "-I", str(ROOT / "ext" / "cuda"), str(d / "harness.cu"), "-o", str(d / "h")],
                   check=True, capture_output=True, timeout=600)
    return d / "h"


def _layout(harness, depth, numels):
    out = subprocess.run([str(harness), str(depth)], input=" ".join(map(str, numels)), capture_output=True,
                         text=True, check=True, timeout=120).stdout.split("\n")
    launches, end = [], None
    for line in out:
        f = line.split()
        if not f:
            continue
        if f[0] == "L":
            launches.append({"nb": int(f[1]), "base": int(f[2]), "blocks": []})
        elif f[0] == "B":
            launches[-1]["blocks"].append(tuple(int(v) for v in f[1:]))
        elif f[0] == "E":
            end = tuple(int(v) for v in f[1:])
    return launches, end


BIG = 2048 * CHUNK + 5  # more chunks than one launch holds: the leaf must carry over


@pytest.mark.parametrize("depth", [1, 2, 4, 6])
@pytest.mark.parametrize("numels", [
    [],
    [0, 0],
    [1],
    [CHUNK],
    [CHUNK + 1, 0, 3],
    [1] * 1000,                        # more leaves than one launch holds
    [5, BIG, 7, 0, 2 * CHUNK],         # a leaf spanning launches, with neighbours
    [(i * 7919) % (3 * CHUNK) for i in range(700)],
], ids=["none", "empty", "one", "chunk", "chunk+1", "many", "big", "mixed"])
def test_multi_tensor_apply_visits_every_chunk_once_in_order(layout_harness, depth, numels):
    launches, (err, max_tensors, max_blocks) = _layout(layout_harness, depth, numels)
    assert err == 0
    expected = [(i, c) for i, n in enumerate(numels) for c in range(-(-n // CHUNK))]
    seen, base = [], 0
    for launch in launches:
        assert launch["base"] == base, "block_base must count the blocks of earlier launches"
        assert 0 < launch["nb"] <= max_blocks
        slots = {slot for slot, *_ in launch["blocks"]}
        assert max(slots) < max_tensors
        for slot, leaf, chunk, numel, ptrs_ok in launch["blocks"]:
            assert ptrs_ok and numel == numels[leaf]
            seen.append((leaf, chunk))
        base += launch["nb"]
    assert seen == expected
    # No launch is cut short while there was room: only a full launch is followed by another.
    for launch in launches[:-1]:
        assert launch["nb"] == max_blocks or len({s for s, *_ in launch["blocks"]}) == max_tensors


# ----------------------------------------------------------------------------------------------
# GPU: helpers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    backend = ops.load()
    assert backend == "cpu+cuda", f"compiled CUDA kernels not loaded ({backend}): {ops.backend_reason()}"
    return backend


def _rand(numel, dtype, gen, scale=1.0):
    x = torch.randn(numel, generator=gen, device="cuda", dtype=torch.float32) * scale
    return x.to(dtype)


def _poison(x, gen, count):
    """Puts NaN/+inf/-inf at `count` random positions and always at the last element."""
    if x.numel() == 0:
        return x
    values = torch.tensor([float("nan"), float("inf"), float("-inf")], device=x.device, dtype=x.dtype)
    pos = torch.randint(0, x.numel(), (count,), generator=gen, device="cuda")
    pos = torch.cat([pos, torch.tensor([x.numel() - 1], device="cuda")])
    which = torch.randint(0, 3, (pos.numel(),), generator=gen, device="cuda")
    x.view(-1)[pos] = values[which]
    return x


def _gen(seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# check
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("poisoned", [False, True])
def test_check_matches_reference(cuda_backend, dtype, size, poisoned):
    gen = _gen(size + 7)
    tensors = [_rand(size, dtype, gen), _rand(3, dtype, gen), _rand(size // 2 + 1, dtype, gen)]
    if poisoned:
        _poison(tensors[0], gen, 3)
    before = [t.clone() for t in tensors]
    finite, sumsq, leaf = ops.check(tensors, per_leaf=True)
    rfinite, rsumsq, rleaf = ops._ref_check(tensors, per_leaf=True)
    assert finite.dtype == torch.bool and finite.device.type == "cuda"
    assert bool(finite) == bool(rfinite)
    assert torch.equal(leaf, rleaf)
    if bool(rfinite):
        torch.testing.assert_close(sumsq, rsumsq, rtol=1e-5, atol=0)
    else:
        assert not torch.isfinite(sumsq)
    for t, b in zip(tensors, before):
        _same_bits(t, b)  # read-only


@needs_cuda
def test_check_many_leaves_of_mixed_dtypes(cuda_backend):
    gen = _gen(3)
    tensors = [_rand(1 + (i * 37) % 300, DTYPES[i % 3], gen) for i in range(2000)]
    _poison(tensors[1234], gen, 1)
    finite, sumsq, leaf = ops.check(tensors, per_leaf=True)
    rfinite, _, rleaf = ops._ref_check(tensors, per_leaf=True)
    assert not bool(finite) and not bool(rfinite)
    assert torch.equal(leaf, rleaf) and leaf.nonzero().flatten().tolist() == [1234]
    tensors[1234].zero_()
    finite, sumsq = ops.check(tensors)
    rfinite, rsumsq, _ = ops._ref_check(tensors)
    assert bool(finite)
    torch.testing.assert_close(sumsq, rsumsq, rtol=1e-5, atol=0)


@needs_cuda
def test_check_sum_is_deterministic(cuda_backend):
    gen = _gen(11)
    tensors = [_rand(5 * CHUNK + 3, torch.float32, gen) for _ in range(7)]
    first = ops.check(tensors)[1]
    for _ in range(5):
        _same_bits(ops.check(tensors)[1], first)


@needs_cuda
@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 2 * CHUNK + 3), min_size=1, max_size=5),
       dtypes=st.lists(st.sampled_from(DTYPES), min_size=5, max_size=5),
       bad=st.lists(st.tuples(st.integers(0, 4), st.floats(0, 1), st.sampled_from(["nan", "inf", "-inf"])),
                    max_size=3))
def test_check_and_unscale_agree_with_reference_on_random_trees(cuda_backend, sizes, dtypes, bad):
    gen = _gen(len(sizes) * 1000 + sum(sizes) % 997)
    tensors = [_rand(n, dtypes[i], gen, 8.0) for i, n in enumerate(sizes)]
    for leaf, where, value in bad:
        t = tensors[leaf % len(tensors)]
        if t.numel():
            t.view(-1)[min(int(where * t.numel()), t.numel() - 1)] = float(value)
    finite, sumsq, leaf_bad = ops.check(tensors, per_leaf=True)
    rfinite, rsumsq, rleaf_bad = ops._ref_check(tensors, per_leaf=True)
    assert bool(finite) == bool(rfinite) and torch.equal(leaf_bad, rleaf_bad)
    if bool(rfinite):
        torch.testing.assert_close(sumsq, rsumsq, rtol=1e-5, atol=0)
    inv = torch.tensor(0.25, device="cuda")
    expected = [_expected_unscale(t, inv) for t in tensors]
    assert bool(ops.unscale_(tensors, inv)) == bool(rfinite)
    for t, e in zip(tensors, expected):
        _same_bits(t, e)


# ----------------------------------------------------------------------------------------------
# unscale
# ----------------------------------------------------------------------------------------------


def _expected_unscale(x, inv):
    # torch's kernel: the product in fp32, stored in the tensor's dtype; factor 1 leaves x alone.
    return x if float(inv) == 1.0 else (x.float() * inv).to(x.dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("poisoned", [False, True])
def test_unscale_in_place_matches_torch_rule(cuda_backend, dtype, size, poisoned):
    gen = _gen(size + 1)
    tensors = [_rand(size, dtype, gen, 1000.0), _rand(5, dtype, gen, 1000.0)]
    if poisoned:
        _poison(tensors[0], gen, 2)
    inv = torch.tensor(1.0 / 1024.0 / 3.0, device="cuda")
    expected = [_expected_unscale(t, inv) for t in tensors]
    expected_finite = all(bool(torch.isfinite(t).all()) for t in tensors)
    finite = ops.unscale_(tensors, inv)
    assert bool(finite) == expected_finite
    for t, e in zip(tensors, expected):
        _same_bits(t, e)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poisoned", [False, True])
def test_unscale_out_of_place_gives_fp32_and_leaves_inputs(cuda_backend, dtype, poisoned):
    gen = _gen(5)
    tensors = [_rand(n, dtype, gen, 100.0) for n in (0, 1, 3 * CHUNK + 17, 4099)]
    if poisoned:
        _poison(tensors[3], gen, 1)
    before = [t.clone() for t in tensors]
    inv = torch.tensor(0.125, device="cuda")
    outs, finite = ops.unscale(tensors, inv)
    assert bool(finite) == (not poisoned)
    for o, t, b in zip(outs, tensors, before):
        assert o.dtype == torch.float32 and o.shape == t.shape
        _same_bits(o, t.float() * inv)
        _same_bits(t, b)


@needs_cuda
def test_unscale_non_contiguous_view_is_written_through(cuda_backend):
    gen = _gen(9)
    base = _rand(64 * 33, torch.float16, gen).view(64, 33)
    view = base.t()
    assert not view.is_contiguous()
    inv = torch.tensor(0.5, device="cuda")
    expected = (base.float() * inv).half()
    finite = ops.unscale_([view], inv)
    assert bool(finite)
    _same_bits(base, expected)


@needs_cuda
def test_unscale_factor_one_keeps_bits(cuda_backend):
    gen = _gen(13)
    x = _poison(_rand(CHUNK + 9, torch.bfloat16, gen), gen, 4)
    before = x.clone()
    assert not bool(ops.unscale_([x], torch.ones((), device="cuda")))
    _same_bits(x, before)


# ----------------------------------------------------------------------------------------------
# fused optimizer steps
# ----------------------------------------------------------------------------------------------

STEP_SIZES = [0, 1, 7, CHUNK + 5, 96 * 1000]


def _state(sizes, gen):
    params = [_rand(n, torch.float32, gen) for n in sizes]
    return params


def _flags(finite=True):
    return torch.ones((), device="cuda"), torch.tensor(bool(finite), device="cuda")


ADAM_CASES = [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, adamw=False),
    dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-2, amsgrad=False, maximize=False, adamw=False),
    dict(lr=3e-3, betas=(0.8, 0.999), eps=1e-8, weight_decay=5e-2, amsgrad=False, maximize=False, adamw=True),
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=True, maximize=True, adamw=True),
    dict(lr=1e-2, betas=(0.3, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=True, maximize=False, adamw=False),
]


@needs_cuda
@pytest.mark.parametrize("case", ADAM_CASES, ids=["adam", "adam-l2", "adamw", "adamw-ams-max", "adam-ams-b1low"])
def test_fused_adam_matches_torch_optim_over_50_steps(cuda_backend, case):
    gen = _gen(21)
    p0 = _state(STEP_SIZES, gen)
    ref = [p.clone().requires_grad_(True) for p in p0]
    cls = torch.optim.AdamW if case["adamw"] else torch.optim.Adam
    opt = cls(ref, lr=case["lr"], betas=case["betas"], eps=case["eps"], weight_decay=case["weight_decay"],
              amsgrad=case["amsgrad"], maximize=case["maximize"], foreach=False)
    params = [p.clone() for p in p0]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    vmax = [torch.zeros_like(p) for p in params]
    step = torch.zeros((), device="cuda")
    grad_scale, finite = _flags()
    for _ in range(50):
        grads = [_rand(p.numel(), torch.float32, gen) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        ops.adam_step_(params, grads, m, v, vmax, None, step, grad_scale, finite, lr=case["lr"],
                       beta1=case["betas"][0], beta2=case["betas"][1], eps=case["eps"],
                       weight_decay=case["weight_decay"], amsgrad=case["amsgrad"],
                       decoupled_weight_decay=case["adamw"], maximize=case["maximize"])
    assert float(step) == 50.0
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)
    for mi, vi, r in zip(m, v, ref):
        st = opt.state[r]
        if r.numel():
            torch.testing.assert_close(mi, st["exp_avg"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(vi, st["exp_avg_sq"], rtol=1e-6, atol=1e-9)


@needs_cuda
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16])
def test_fused_adam_low_precision_grads_and_model_copy(cuda_backend, grad_dtype, model_dtype):
    gen = _gen(22)
    p0 = _state(STEP_SIZES, gen)
    ref = [p.clone().requires_grad_(True) for p in p0]
    opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=1e-2, foreach=False)
    params = [p.clone() for p in p0]
    model = [p.to(model_dtype) for p in p0]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    step = torch.zeros((), device="cuda")
    scale = 1024.0
    grad_scale = torch.tensor(1.0 / scale, device="cuda")
    finite = torch.tensor(True, device="cuda")
    for _ in range(10):
        grads = [_rand(p.numel(), grad_dtype, gen, scale) for p in params]  # grads of a scaled loss
        for r, g in zip(ref, grads):
            r.grad = g.float() * grad_scale
        opt.step()
        ops.adam_step_(params, grads, m, v, None, model, step, grad_scale, finite, lr=1e-3, weight_decay=1e-2,
                       decoupled_weight_decay=True)
    for p, r, mp in zip(params, ref, model):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)
        _same_bits(mp, p.to(model_dtype))  # the copy is the master rounded once


@needs_cuda
def test_fused_adam_matches_reference_op_on_many_leaves_with_scale(cuda_backend):
    gen = _gen(23)
    sizes = [1 + (i * 53) % 900 for i in range(1500)] + [3 * CHUNK + 1]
    grads = [_rand(n, DTYPES[i % 3], gen, 512.0) for i, n in enumerate(sizes)]
    states = []
    for _ in range(2):
        g2 = _gen(24)
        p = [_rand(n, torch.float32, g2) for n in sizes]
        states.append((p, [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p],
                       [torch.zeros_like(x) for x in p], [x.half() for x in p], torch.full((), 4.0, device="cuda")))
    grad_scale = torch.tensor(0.7 / 512.0, device="cuda")  # inv_scale * clip_coef
    finite = torch.tensor(True, device="cuda")
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True,
              decoupled_weight_decay=True, maximize=False)
    (p, m, v, vm, model, step), (rp, rm, rv, rvm, rmodel, rstep) = states
    for _ in range(3):
        ops.adam_step_(p, grads, m, v, vm, model, step, grad_scale, finite, **kw)
        ops._ref_adam_step_(rp, grads, rm, rv, rvm, rmodel, rstep, grad_scale, finite, **kw)
    assert float(step) == float(rstep) == 7.0
    for a, b in zip(p + m + v + vm, rp + rm + rv + rvm):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(model, p):
        _same_bits(a, b.half())


SGD_CASES = [
    dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=False, maximize=False),
    dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True, maximize=False),
    dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=1e-2, nesterov=False, maximize=True),
]


@needs_cuda
@pytest.mark.parametrize("case", SGD_CASES, ids=["momentum-damp-wd", "nesterov", "plain-max"])
def test_fused_sgd_matches_torch_optim_over_50_steps(cuda_backend, case):
    gen = _gen(31)
    p0 = _state(STEP_SIZES, gen)
    ref = [p.clone().requires_grad_(True) for p in p0]
    opt = torch.optim.SGD(ref, foreach=False, **case)
    params = [p.clone() for p in p0]
    bufs = [torch.full_like(p, 123.0) for p in params]  # never read on the first step
    step = torch.zeros((), device="cuda")
    grad_scale, finite = _flags()
    for _ in range(50):
        grads = [_rand(p.numel(), torch.float32, gen) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        ops.sgd_step_(params, grads, bufs if case["momentum"] else None, None, step, grad_scale, finite, **case)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)
    if case["momentum"]:
        for b, r in zip(bufs, ref):
            if r.numel():
                torch.testing.assert_close(b, opt.state[r]["momentum_buffer"], rtol=1e-6, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_skipped_step_leaves_state_bit_identical(cuda_backend, grad_dtype):
    gen = _gen(41)
    sizes = [1, 7, CHUNK + 5, 4099]
    params = _state(sizes, gen)
    grads = [_rand(n, grad_dtype, gen) for n in sizes]
    _poison(grads[2], gen, 1)
    m = [_rand(n, torch.float32, gen) for n in sizes]
    v = [_rand(n, torch.float32, gen).abs() for n in sizes]
    vm = [x + 1 for x in v]
    bufs = [_rand(n, torch.float32, gen) for n in sizes]
    model = [p.to(torch.bfloat16) for p in params]
    step = torch.full((), 5.0, device="cuda")
    finite, _ = ops.check(grads)
    assert not bool(finite)
    grad_scale = torch.tensor(0.5, device="cuda")
    everything = params + m + v + vm + bufs + model + [step]
    before = [t.clone() for t in everything]
    ops.adam_step_(params, grads, m, v, vm, model, step, grad_scale, finite, lr=1e-2, weight_decay=0.1,
                   amsgrad=True, decoupled_weight_decay=True)
    ops.sgd_step_(params, grads, bufs, model, step, grad_scale, finite, lr=0.1, momentum=0.9, weight_decay=0.1)
    for t, b in zip(everything, before):
        _same_bits(t, b)


@needs_cuda
def test_sgd_first_step_fills_buffers_with_the_gradient(cuda_backend):
    gen = _gen(43)
    params = _state([CHUNK + 3], gen)
    grads = [_rand(CHUNK + 3, torch.float16, gen)]
    bufs = [torch.full_like(params[0], float("nan"))]  # garbage must not leak in
    step = torch.zeros((), device="cuda")
    grad_scale, finite = torch.tensor(2.0, device="cuda"), torch.tensor(True, device="cuda")
    ops.sgd_step_(params, grads, bufs, None, step, grad_scale, finite, lr=0.1, momentum=0.9, dampening=0.5)
    _same_bits(bufs[0], grads[0].float() * 2.0)
    assert float(step) == 1.0


# ----------------------------------------------------------------------------------------------
# loss-scale update
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("hysteresis", [1, 3])
def test_update_scale_follows_the_reference_rule(cuda_backend, hysteresis):
    cfg = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, min_scale=1.0, max_scale=2.0 ** 20,
               hysteresis=hysteresis)
    scale = torch.full((), 2.0 ** 18, device="cuda")
    gt = torch.zeros((), dtype=torch.int32, device="cuda")
    ht = torch.full((), hysteresis, dtype=torch.int32, device="cuda")
    rs, rg, rh = scale.clone(), gt.clone(), ht.clone()
    pattern = [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0] + [0] * 30 + [1] * 7
    for f in pattern:
        finite = torch.tensor(bool(f), device="cuda")
        ops.update_scale_(scale, gt, ht, finite, **cfg)
        rs, rg, rh = ops._ref_update_scale(rs, rg, rh, finite, **cfg)
        _same_bits(scale, rs)
        _same_bits(gt, rg)
        _same_bits(ht, rh)
    assert float(scale) >= 1.0  # floored at min_scale by the long run of overflows


@needs_cuda
def test_update_scale_overflowing_growth_is_not_applied(cuda_backend):
    scale = torch.full((), 3.0e38, device="cuda")
    gt = torch.zeros((), dtype=torch.int32, device="cuda")
    ht = torch.ones((), dtype=torch.int32, device="cuda")
    ops.update_scale_(scale, gt, ht, torch.tensor(True, device="cuda"), growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=1, min_scale=0.0, max_scale=float("inf"), hysteresis=1)
    assert float(scale) == pytest.approx(3.0e38) and int(gt) == 0


# ----------------------------------------------------------------------------------------------
# whole steps: CUDA graphs and no host syncs
# ----------------------------------------------------------------------------------------------


def _full_step(params, grads, m, v, model, step, scale, gt, ht, max_norm=1.0):
    """check + clip + AdamW + skip + scale update, all through ampfunc.ops, all on the device."""
    inv = scale.double().reciprocal().float()
    finite, sumsq = ops.check(grads)
    norm = sumsq.sqrt() * inv
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    ops.adam_step_(params, grads, m, v, None, model, step, inv * coef, finite, lr=1e-3, weight_decay=1e-2,
                   decoupled_weight_decay=True)
    ops.update_scale_(scale, gt, ht, finite, growth_factor=2.0, backoff_factor=0.5, growth_interval=2,
                      min_scale=1.0, max_scale=2.0 ** 24, hysteresis=1)


def _fresh_step_state(seed):
    gen = _gen(seed)
    sizes = [1, 7, CHUNK + 5, 96 * 1000]
    params = _state(sizes, gen)
    return dict(params=params, grads=[torch.zeros(n, device="cuda", dtype=torch.float16) for n in sizes],
                m=[torch.zeros_like(p) for p in params], v=[torch.zeros_like(p) for p in params],
                model=[p.half() for p in params], step=torch.zeros((), device="cuda"),
                scale=torch.full((), 2.0 ** 10, device="cuda"), gt=torch.zeros((), dtype=torch.int32, device="cuda"),
                ht=torch.ones((), dtype=torch.int32, device="cuda"))


def _grad_sequence(sizes, seed, n=4, bad_at=1):
    gen = _gen(seed)
    seq = []
    for k in range(n):
        gs = [_rand(s, torch.float16, gen, 100.0) for s in sizes]
        if k == bad_at:
            _poison(gs[2], gen, 1)
        seq.append(gs)
    return seq


@needs_cuda
def test_step_captured_in_cuda_graph_replays_like_eager(cuda_backend):
    graphed, eager = _fresh_step_state(51), _fresh_step_state(51)
    sizes = [g.numel() for g in graphed["grads"]]
    seq = _grad_sequence(sizes, 52)
    initial = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in graphed.items()}

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs documents
        _full_step(**graphed)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _full_step(**graphed)
    for k, v in initial.items():  # undo the warm-up: replays start from the initial state
        for dst, src in (zip(graphed[k], v) if isinstance(v, list) else [(graphed[k], v)]):
            dst.copy_(src)

    for grads in seq:
        for dst, src in zip(graphed["grads"], grads):
            dst.copy_(src)
        graph.replay()
        for dst, src in zip(eager["grads"], grads):
            dst.copy_(src)
        _full_step(**eager)
    torch.cuda.synchronize()
    assert float(eager["step"]) == len(seq) - 1  # the poisoned step was skipped
    for k in graphed:
        a, b = graphed[k], eager[k]
        for x, y in (zip(a, b) if isinstance(a, list) else [(a, b)]):
            _same_bits(x, y)


@needs_cuda
@pytest.mark.parametrize("pure", [False, True], ids=["step_", "step"])
def test_mixed_precision_step_never_syncs_with_the_host(cuda_backend, pure):
    gen = _gen(61)
    params = {"w": _rand(4096 * 64, torch.float16, gen).view(4096, 64), "b": _rand(64, torch.float16, gen),
              "norm": _rand(64, torch.float32, gen)}
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3)),
                            loss_scale=af.DynamicLossScale(init_scale=2.0 ** 12))
    state = tx.init(params)
    seq = [{k: _rand(p.numel(), p.dtype, gen, 10.0).view(p.shape) for k, p in params.items()} for _ in range(4)]
    _poison(seq[2]["w"], gen, 1)
    run = tx.step if pure else tx.step_
    params, state = run(params, seq[0], state)  # first call: kernels load, caches fill
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for grads in seq[1:]:
            params, state = run(params, grads, state)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert all(bool(torch.isfinite(p).all()) for p in params.values())
