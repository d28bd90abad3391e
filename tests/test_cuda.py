"""The CUDA kernels (ext/cuda) against their plain-torch references, on the GPU.

Everything here but the launch-layout test needs a CUDA device and the compiled CUDA backend
(``benchmarks/gpu_check.sh`` runs this file on one with ``AMPFUNC_REQUIRE_EXT=1``); the kernels
are reached through the public door, :mod:`ampfunc.ops`. The launch-layout test needs only
``nvcc``: it runs the host half of the multi-tensor apply (how leaves and chunks are packed
into launches) without a GPU.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampfunc as af
from _helpers import bits, clone_tree, same_tree_bits
from ampfunc import ops
from ampfunc.lowbits import dequantize_q8, q8_lookup, quantize_q8, split_bf16
from ampfunc.ops import _lowmem_reference as lowmem_twin

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 65536  # AMPFUNC_CUDA_CHUNK in ext/cuda/ampfunc_cuda.h

_skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def needs_cuda(test):
    """Marks a test `cuda` (select with -m cuda) and skips it where torch sees no GPU."""
    return pytest.mark.cuda(_skip_without_cuda(test))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 4099, CHUNK, 3 * CHUNK + 17]


# ----------------------------------------------------------------------------------------------
# helpers (any device)
# ----------------------------------------------------------------------------------------------


def _rand(numel, dtype, gen, scale=1.0):
    x = torch.randn(numel, generator=gen, device=gen.device, dtype=torch.float32) * scale
    return x.to(dtype)


def _poison(x, gen, count):
    """Puts NaN/+inf/-inf at `count` random positions and always at the last element."""
    if x.numel() == 0:
        return x
    values = torch.tensor([float("nan"), float("inf"), float("-inf")], device=x.device, dtype=x.dtype)
    pos = torch.randint(0, x.numel(), (count,), generator=gen, device=x.device)
    pos = torch.cat([pos, torch.tensor([x.numel() - 1], device=x.device)])
    which = torch.randint(0, 3, (pos.numel(),), generator=gen, device=x.device)
    x.view(-1)[pos] = values[which]
    return x


def _gen(seed, device="cuda"):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        assert torch.equal(a, b)


ADAM_CASES = [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, adamw=False),
    dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-2, amsgrad=False, maximize=False, adamw=False),
    dict(lr=3e-3, betas=(0.8, 0.999), eps=1e-8, weight_decay=5e-2, amsgrad=False, maximize=False, adamw=True),
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=True, maximize=True, adamw=True),
    dict(lr=1e-2, betas=(0.3, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=True, maximize=False, adamw=False),
]
SGD_CASES = [
    dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=False, maximize=False),
    dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True, maximize=False),
    dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=1e-2, nesterov=False, maximize=True),
]


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
      printf("B %d %d %lld %lld %d\n", slot, leaf, (long long)meta.block_chunk[b], (long long)meta.numel[slot],
             ptrs_ok);
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
  if (depth == 5) return run<5>(numels);
  if (depth == 7) return run<7>(numels);
  if (depth == 9) return run<9>(numels);
  if (depth == 11) return run<11>(numels);
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


@pytest.mark.parametrize("depth", [1, 2, 4, 5, 6, 7, 9, 11])  # 5..11: the SGD/Adam out-of-place and delta lists
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
        for _slot, leaf, chunk, numel, ptrs_ok in launch["blocks"]:
            assert ptrs_ok and numel == numels[leaf]
            seen.append((leaf, chunk))
        base += launch["nb"]
    assert seen == expected
    # No launch is cut short while there was room: only a full launch is followed by another.
    for launch in launches[:-1]:
        assert launch["nb"] == max_blocks or len({s for s, *_ in launch["blocks"]}) == max_tensors


# ----------------------------------------------------------------------------------------------
# Host emulation (needs g++ with C++20 and the CUDA headers, not a GPU)
#
# The real kernel sources, with each `kernel<<<grid, block, shmem, stream>>>(args)` rewritten
# into a call of an emulated launch, are compiled as host C++: every block runs with blockDim.x
# real threads, so barriers, warp shuffles and the block reductions behave as on a GPU, and
# "device" pointers are plain host memory. The kernels' indexing, vector/tail paths, launch
# packing, skips and arithmetic are then checked against torch on the CPU through the C ABI.
# ----------------------------------------------------------------------------------------------

_EMU_H = r"""// Host emulation of the CUDA features the ampfunc kernels use: each launch runs its blocks one
// after another, each block with blockDim.x real threads, so barriers, shuffles and
// block reductions behave as on a GPU; "device" memory is host memory.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <atomic>
#include <barrier>
#include <cmath>
#include <latch>
#include <pthread.h>
#include <type_traits>
#include <cstring>
#include <memory>
#include <vector>

#undef __global__
#undef __device__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#define __global__
#define __device__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

namespace emu {
inline thread_local uint3 tid;
inline thread_local uint3 bid;
inline dim3 bdim;
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline unsigned char warp_buf[32][32][8];
inline std::atomic<int> or_flags[3];
inline thread_local unsigned or_calls;

inline cudaError_t last_error = cudaSuccess;

template <class F>
struct Worker {
  F* fn;
  unsigned t, grid;
  std::barrier<>* bar;
  std::latch* gate;
  const bool* abort;
};

template <class F>
void* run_worker(void* arg) {
  auto* w = static_cast<Worker<F>*>(arg);
  w->gate->wait();
  if (*w->abort) return nullptr;
  tid = make_uint3(w->t, 0, 0);
  or_calls = 0;
  for (unsigned b = 0; b < w->grid; ++b) {
    bid = make_uint3(b, 0, 0);
    (*w->fn)();
    w->bar->arrive_and_wait();
  }
  return nullptr;
}

// Runs the grid block after block, each block on blockDim.x threads (1 MiB stacks). If the
// threads cannot be made, the launch fails like a real one: cudaGetLastError reports it.
template <class F>
void launch(unsigned grid, unsigned block, size_t, cudaStream_t, F&& fn) {
  bdim = dim3(block, 1, 1);
  std::barrier<> bar(block);
  block_barrier = &bar;
  warp_barriers.clear();
  for (unsigned w = 0; w < (block + 31) / 32; ++w)
    warp_barriers.emplace_back(std::make_unique<std::barrier<>>(block - w * 32 < 32 ? block - w * 32 : 32));
  for (auto& f : or_flags) f = 0;
  std::latch gate(1);
  bool abort = false;
  std::vector<Worker<std::remove_reference_t<F>>> workers(block);
  std::vector<pthread_t> threads;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 1 << 20);
  for (unsigned t = 0; t < block; ++t) {
    workers[t] = {&fn, t, grid, &bar, &gate, &abort};
    pthread_t th;
    if (pthread_create(&th, &attr, run_worker<std::remove_reference_t<F>>, &workers[t]) != 0) {
      abort = true;
      last_error = cudaErrorLaunchOutOfResources;
      break;
    }
    threads.push_back(th);
  }
  pthread_attr_destroy(&attr);
  gate.count_down();
  for (pthread_t th : threads) pthread_join(th, nullptr);
  block_barrier = nullptr;
}
}  // namespace emu

#define threadIdx (::emu::tid)
#define blockIdx (::emu::bid)
#define blockDim (::emu::bdim)

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
// One barrier per call: call k ORs into flag k%3; flag (k+1)%3, last read in call k-2 (before the
// barrier of call k-1), is cleared before this barrier for call k+1.
inline int __syncthreads_or(int p) {
  const unsigned k = emu::or_calls++;
  if (threadIdx.x == 0) emu::or_flags[(k + 1) % 3] = 0;
  if (p) emu::or_flags[k % 3] = 1;
  __syncthreads();
  return emu::or_flags[k % 3];
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, int off) {
  static_assert(sizeof(T) <= 8, "");
  const unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  std::memcpy(emu::warp_buf[w][lane], &v, sizeof(T));
  emu::warp_barriers[w]->arrive_and_wait();
  T r = v;
  if (lane + off < 32) std::memcpy(&r, emu::warp_buf[w][lane + off], sizeof(T));
  emu::warp_barriers[w]->arrive_and_wait();
  return r;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
using std::isnan;
using std::isfinite;

#ifdef EMU_RUNTIME
extern "C" cudaError_t cudaGetLastError(void) {
  const cudaError_t e = emu::last_error;
  emu::last_error = cudaSuccess;
  return e;
}
extern "C" cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
extern "C" const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess                     ? "no error"
         : e == cudaErrorLaunchOutOfResources ? "emulation: no threads"
                                              : "emulated error";
}
#endif
"""

_LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^<>;]*>)?)<<<([^;]*?)>>>\(([^;]*?)\);", re.S)
CUDA_INVALID_VALUE = 1  # cudaErrorInvalidValue


def _cuda_include():
    for cand in ("/usr/local/cuda/include", "/opt/cuda/include"):
        if (Path(cand) / "cuda_fp16.h").exists():
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        inc = Path(nvcc).resolve().parents[1] / "include"
        if (inc / "cuda_fp16.h").exists():
            return str(inc)
    return None


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cxx, inc = shutil.which("g++"), _cuda_include()
    if cxx is None or inc is None:
        pytest.skip("needs g++ and the CUDA headers")
    d = tmp_path_factory.mktemp("emu")
    (d / "emu.h").write_text(_EMU_H)
    objs, procs = [], []
    for src in sorted((ROOT / "ext" / "cuda").glob("*.cu")):
        text, n = _LAUNCH.subn(lambda m: f"::emu::launch({m.group(2)}, [&]() {{ {m.group(1)}({m.group(3)}); }});",
                               src.read_text())
        assert n > 0 or "<<<" not in src.read_text()
        cpp = d / (src.stem + ".cpp")
        cpp.write_text(text)
        objs.append(d / (src.stem + ".o"))
        flags = ["-DEMU_RUNTIME"] if not procs else []  # the runtime stubs go into one object
        procs.append(subprocess.Popen(
            [cxx, "-std=c++20", "-O1", "-fPIC", "-pthread", "-w", "-ffp-contract=off", "-include", str(d / "emu.h"),
             *flags, "-I", str(ROOT / "ext" / "cuda"), "-I", inc, "-c", str(cpp), "-o", str(objs[-1])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out = p.communicate(timeout=600)[0]
        if p.returncode:
            if "barrier" in out and "No such file" in out:
                pytest.skip("the C++ library lacks <barrier>")
            raise AssertionError("emulated build failed:\n" + out[-4000:])
    lib = d / "libampfunc_emu.so"
    subprocess.run([cxx, "-shared", "-pthread", *map(str, objs), "-o", str(lib)], check=True, timeout=120)
    return _Abi(lib)


class _AdamHyper(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double), ("adamw", ctypes.c_int),
                ("amsgrad", ctypes.c_int), ("maximize", ctypes.c_int)]


class _SgdHyper(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("momentum", ctypes.c_double), ("dampening", ctypes.c_double),
                ("weight_decay", ctypes.c_double), ("nesterov", ctypes.c_int), ("maximize", ctypes.c_int)]


_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _p(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _ptrs(ts):
    return None if ts is None else (ctypes.c_void_p * max(len(ts), 1))(*[t.data_ptr() for t in ts])


def _numels(ts):
    return (ctypes.c_int64 * max(len(ts), 1))(*[t.numel() for t in ts])


class _Abi:
    """The C ABI of ext/cuda/ampfunc_cuda.h through ctypes; arguments are torch tensors."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.ampfunc_cuda_check_workspace_bytes.restype = ctypes.c_int64
        self.lib.ampfunc_cuda_error_string.restype = ctypes.c_char_p

    def workspace_bytes(self, ts):
        return self.lib.ampfunc_cuda_check_workspace_bytes(len(ts), _numels(ts))

    def check(self, ts, *, finite=None, sumsq=None, sumsq_f32=None, norm=None, leaf=None, scale=None, accumulate=0,
              ws_bytes=None, dtype=None, ws=None):
        """`sumsq`: the double running sum; `ws`: a workspace to keep (to read its partials)."""
        ws_bytes = self.workspace_bytes(ts) if ws_bytes is None else ws_bytes
        ws = torch.empty(max(ws_bytes, 8), dtype=torch.uint8) if ws is None else ws  # torch: 64-byte aligned
        code = _CODE[ts[0].dtype] if dtype is None else dtype
        return self.lib.ampfunc_cuda_check(len(ts), _ptrs(ts), _numels(ts), code, _p(scale), _p(finite), _p(sumsq),
                                           _p(sumsq_f32), _p(norm), _p(leaf), _p(ws), ctypes.c_int64(ws_bytes),
                                           accumulate, None)

    def unscale_(self, ts, inv, finite, accumulate=0):
        return self.lib.ampfunc_cuda_unscale_(len(ts), _ptrs(ts), _numels(ts), _CODE[ts[0].dtype], _p(inv),
                                              _p(finite), accumulate, None)

    def unscale(self, ts, outs, inv, finite, accumulate=0):
        return self.lib.ampfunc_cuda_unscale(len(ts), _ptrs(ts), _ptrs(outs), _numels(ts), _CODE[ts[0].dtype],
                                             _p(inv), _p(finite), accumulate, None)

    def adam(self, grads, params, m, v, vmax, model, step, grad_scale, finite, *, lr_tensor=None, increment=1,
             lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False, amsgrad=False, maximize=False):
        h = _AdamHyper(lr, betas[0], betas[1], eps, weight_decay, int(adamw), int(amsgrad), int(maximize))
        return self.lib.ampfunc_cuda_adam_step(
            len(params), _ptrs(grads), _CODE[grads[0].dtype], _ptrs(params), _ptrs(m), _ptrs(v), _ptrs(vmax),
            _ptrs(model), _CODE[model[0].dtype] if model else 0, _numels(params), _p(grad_scale), _p(finite),
            _p(lr_tensor), _p(step), increment, ctypes.byref(h), None)

    def sgd(self, grads, params, bufs, model, step, grad_scale, finite, *, lr_tensor=None, increment=1, lr=0.1,
            momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
        h = _SgdHyper(lr, momentum, dampening, weight_decay, int(nesterov), int(maximize))
        return self.lib.ampfunc_cuda_sgd_step(
            len(params), _ptrs(grads), _CODE[grads[0].dtype], _ptrs(params), _ptrs(bufs), _ptrs(model),
            _CODE[model[0].dtype] if model else 0, _numels(params), _p(grad_scale), _p(finite), _p(lr_tensor),
            _p(step), increment, ctypes.byref(h), None)

    # The out-of-place ("pure step") and delta ("pure update") launchers. `outs` are the output
    # lists in the order of the inputs; None for a list the call does not have.
    def adam_out(self, grads, params, m, v, vmax, model, outs, step, step_out, grad_scale, finite, *,
                 lr_tensor=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False,
                 amsgrad=False, maximize=False):
        h = _AdamHyper(lr, betas[0], betas[1], eps, weight_decay, int(adamw), int(amsgrad), int(maximize))
        p_o, m_o, v_o, vmax_o, model_o = outs
        return self.lib.ampfunc_cuda_adam_step_out(
            len(grads), _ptrs(grads), _CODE[grads[0].dtype], _ptrs(params), _ptrs(m), _ptrs(v), _ptrs(vmax),
            _ptrs(model), _ptrs(p_o), _ptrs(m_o), _ptrs(v_o), _ptrs(vmax_o), _ptrs(model_o),
            _CODE[model[0].dtype] if model else 0, _numels(grads), _p(grad_scale), _p(finite), _p(lr_tensor),
            _p(step), _p(step_out), ctypes.byref(h), None)

    def adam_update(self, grads, params, m, v, vmax, outs, step, step_out, grad_scale, finite=None, *,
                    lr_tensor=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False,
                    amsgrad=False, maximize=False):
        h = _AdamHyper(lr, betas[0], betas[1], eps, weight_decay, int(adamw), int(amsgrad), int(maximize))
        upd, m_o, v_o, vmax_o = outs
        return self.lib.ampfunc_cuda_adam_update(
            len(grads), _ptrs(grads), _CODE[grads[0].dtype], _ptrs(params), _ptrs(m), _ptrs(v), _ptrs(vmax),
            _ptrs(upd), _ptrs(m_o), _ptrs(v_o), _ptrs(vmax_o), _numels(grads), _p(grad_scale), _p(finite),
            _p(lr_tensor), _p(step), _p(step_out), ctypes.byref(h), None)

    def sgd_out(self, grads, params, bufs, model, outs, step, step_out, grad_scale, finite, *, lr_tensor=None,
                lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
        h = _SgdHyper(lr, momentum, dampening, weight_decay, int(nesterov), int(maximize))
        p_o, b_o, model_o = outs
        return self.lib.ampfunc_cuda_sgd_step_out(
            len(grads), _ptrs(grads), _CODE[grads[0].dtype], _ptrs(params), _ptrs(bufs), _ptrs(model), _ptrs(p_o),
            _ptrs(b_o), _ptrs(model_o), _CODE[model[0].dtype] if model else 0, _numels(grads), _p(grad_scale),
            _p(finite), _p(lr_tensor), _p(step), _p(step_out), ctypes.byref(h), None)

    def sgd_update(self, grads, params, bufs, outs, step, step_out, grad_scale, finite=None, *, lr_tensor=None,
                   lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
        h = _SgdHyper(lr, momentum, dampening, weight_decay, int(nesterov), int(maximize))
        upd, b_o = outs
        return self.lib.ampfunc_cuda_sgd_update(
            len(grads), _ptrs(grads), _CODE[grads[0].dtype], _ptrs(params), _ptrs(bufs), _ptrs(upd), _ptrs(b_o),
            _numels(grads), _p(grad_scale), _p(finite), _p(lr_tensor), _p(step), _p(step_out), ctypes.byref(h),
            None)

    def adam_lowmem(self, params, remainders, grads, m, m_absmax, v, v_absmax, step, grad_scale, finite, qmaps,
                    qbases, *, lr_tensor=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False,
                    maximize=False, amsgrad=False):
        """ampfunc_cuda_adam_lowmem_step; the layouts are read off the tensors' dtypes."""
        h = _AdamHyper(lr, betas[0], betas[1], eps, weight_decay, int(adamw), int(amsgrad), int(maximize))
        codes = (lambda ts, f: (ctypes.c_int * max(len(ts), 1))(*[f(t) for t in ts]))
        moment = (lambda t: 3 if t.dtype == torch.uint8 else _CODE[t.dtype])
        return self.lib.ampfunc_cuda_adam_lowmem_step(
            len(params), _ptrs(grads), codes(grads, lambda t: _CODE[t.dtype]), _ptrs(params),
            codes(params, lambda t: _CODE[t.dtype]), _ptrs(remainders), _ptrs(m), _ptrs(m_absmax), _ptrs(v),
            _ptrs(v_absmax), codes(m, moment), _numels(params), _p(qmaps), _p(qbases), _p(grad_scale), _p(finite),
            _p(lr_tensor), _p(step), ctypes.byref(h), None)

    def update_scale(self, scale, gt, ht, finite, *, growth_factor, backoff_factor, growth_interval, min_scale,
                     max_scale, hysteresis):
        return self.lib.ampfunc_cuda_update_scale(
            _p(scale), _p(gt), _p(ht), _p(finite), ctypes.c_double(growth_factor), ctypes.c_double(backoff_factor),
            ctypes.c_int64(growth_interval), ctypes.c_double(min_scale), ctypes.c_double(max_scale),
            ctypes.c_int64(hysteresis), None)


def _cpu_gen(seed):
    return _gen(seed, "cpu")


FINAL_THREADS = 1024  # kFinalThreads in ext/cuda/check.cu
FP32_MAX = torch.finfo(torch.float32).max


def _check_outputs():
    """finite, the double running sum, the fp32 sum and the norm, each filled with junk."""
    return (torch.zeros((), dtype=torch.bool), torch.full((), -1.0, dtype=torch.float64), torch.full((), -1.0),
            torch.full((), -1.0))


def _partials(ws, blocks):
    """The check's workspace after a call: each block's partial (double) and non-finite flag."""
    return ws[:8 * blocks].view(torch.float64), ws[8 * blocks:12 * blocks].view(torch.float32)


def _final_order_sum(partials):
    """The partials added as check_finalize_kernel adds them (strided runs per thread, then a
    fixed tree), in Python floats (doubles): the launcher's double total, bit for bit."""
    runs = [0.0] * FINAL_THREADS
    for i, v in enumerate(partials.tolist()):
        runs[i % FINAL_THREADS] += v
    stride = FINAL_THREADS // 2
    while stride:
        for t in range(stride):
            runs[t] += runs[t + stride]
        stride //= 2
    return runs[0]


def _exact_sumsq(tensors, scale=None):
    """The squares of fp32(x * scale), as the kernels take them, summed exactly enough (float64)."""
    total = 0.0
    for t in tensors:
        y = t.float() if scale is None else t.float() * scale
        total += float(y.double().square().sum())
    return total


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poisoned", [False, True])
def test_emulated_check_flags_and_sum_of_squares(emu, dtype, poisoned):
    gen = _cpu_gen(1)
    base = [_rand(n + 1, dtype, gen, 3.0) for n in (0, 1, 7, 4099, 3 * CHUNK + 17)]
    tensors = [b[1:] if i % 2 else b[:-1] for i, b in enumerate(base)]  # odd ones misaligned for vectors
    if poisoned:
        _poison(tensors[3], gen, 2)
    before = [t.clone() for t in tensors]
    finite, sumsq, sumsq32, norm = _check_outputs()
    leaf = torch.full((len(tensors),), True)
    assert emu.check(tensors, finite=finite, sumsq=sumsq, sumsq_f32=sumsq32, norm=norm, leaf=leaf) == 0
    expected_leaf = torch.tensor([not bool(torch.isfinite(t).all()) for t in tensors])
    assert torch.equal(leaf, expected_leaf) and bool(finite) == (not poisoned)
    if poisoned:
        assert not torch.isfinite(sumsq) and not torch.isfinite(sumsq32) and not torch.isfinite(norm)
    else:
        exact = _exact_sumsq(tensors)
        assert float(sumsq) == pytest.approx(exact, rel=1e-6)
        _same_bits(sumsq32, sumsq.float())
        _same_bits(norm, sumsq.sqrt().float())
    for t, b in zip(tensors, before):
        _same_bits(t, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_check_normal_values_keep_the_fp32_block_sums(emu, dtype):
    # Without overflow every block partial is the fp32 block sum (the hot loop stays fp32; no
    # second read), and the total is those partials added in double in the final kernel's
    # order: exactly what the fp32-partial kernel before this one summed, so its fp32 result
    # (then fp32(double sum of fp32 partials)) is unchanged bit for bit.
    gen = _cpu_gen(5)
    tensors = [_rand(n, dtype, gen, 2.0) for n in (3, 2 * CHUNK + 5, 4099)]
    tensors[1] = tensors[1][1:]  # misaligned: the scalar path
    blocks = emu.workspace_bytes(tensors) // 12
    assert blocks == 1 + 3 + 1
    ws = torch.empty(emu.workspace_bytes(tensors), dtype=torch.uint8)
    finite, sumsq, sumsq32, norm = _check_outputs()
    scale = torch.tensor(0.75)
    assert emu.check(tensors, finite=finite, sumsq=sumsq, sumsq_f32=sumsq32, norm=norm, scale=scale, ws=ws) == 0
    partials, bad = _partials(ws, blocks)
    assert torch.equal(partials.float().double(), partials)  # fp32 values
    assert not bad.any() and bool(finite)
    assert float(sumsq) == _final_order_sum(partials)
    _same_bits(sumsq32, sumsq.float())
    _same_bits(norm, sumsq.sqrt().float())
    assert float(sumsq) == pytest.approx(_exact_sumsq(tensors, 0.75), rel=1e-6)


# name -> (dtype, values, scale): the README's example and its relatives. Every element is
# finite, the fp32 sum of squares overflows, the norm fits in fp32.
OVERFLOW_CASES = {
    "readme-20x1e20": (torch.float32, lambda g: torch.full((20,), 1e20), None),
    "scaled-by-2**16": (torch.float32, lambda g: torch.full((20,), 1e20) * 2.0**16, 2.0**-16),
    "misaligned-4-blocks": (torch.float32, lambda g: (torch.rand(3 * CHUNK + 18, generator=g) + 0.5)[1:] * 1e18,
                            None),
    "bf16": (torch.bfloat16, lambda g: (torch.rand(CHUNK + 9, generator=g) * 1e19).to(torch.bfloat16), None),
    "fp16-times-2**70": (torch.float16, lambda g: (torch.rand(5000, generator=g) * 6e4).to(torch.float16),
                         2.0**70),
}


@pytest.mark.parametrize("case", list(OVERFLOW_CASES))
def test_emulated_check_norm_survives_fp32_overflow_of_the_sum(emu, case):
    dtype, make, scale = OVERFLOW_CASES[case]
    x = make(_cpu_gen(6)).to(dtype)
    small = _rand(2 * CHUNK, torch.float32, _cpu_gen(7)).to(dtype)  # blocks that do not overflow
    tensors = [small, x] if dtype != torch.float16 else [x]
    s = None if scale is None else torch.tensor(scale)
    exact = _exact_sumsq(tensors, scale)
    assert exact > FP32_MAX and exact**0.5 < FP32_MAX
    blocks = emu.workspace_bytes(tensors) // 12
    ws = torch.empty(emu.workspace_bytes(tensors), dtype=torch.uint8)
    finite, sumsq, sumsq32, norm = _check_outputs()
    assert emu.check(tensors, finite=finite, sumsq=sumsq, sumsq_f32=sumsq32, norm=norm, scale=s, ws=ws) == 0
    assert bool(finite) and torch.isfinite(norm)
    assert abs(float(norm) / exact**0.5 - 1) < 1e-6
    assert float(sumsq) == pytest.approx(exact, rel=1e-6)
    assert float(sumsq32) == float("inf")  # fp32(total), as the CPU's check returns it
    partials, _ = _partials(ws, blocks)
    redone = (partials > FP32_MAX).tolist()
    assert any(redone)  # some block summed in double ...
    assert torch.equal(partials[~(partials > FP32_MAX)].float().double(), partials[~(partials > FP32_MAX)])
    if dtype != torch.float16:
        assert not any(redone[:2])  # ... and only those that overflowed (`small` did not)
    again = torch.full((), -1.0)
    assert emu.check(tensors, norm=again, scale=s) == 0
    _same_bits(again, norm)  # deterministic, the rare path included


def test_emulated_check_non_finite_element_is_not_summed_away(emu):
    # A block holding an inf next to huge finite values: not "an overflow of finite values",
    # so no double recompute hides it: finite is False and the sums are not finite.
    gen = _cpu_gen(8)
    x = torch.full((CHUNK + 100,), 1e20)
    x[CHUNK + 50] = float("inf")
    ys = [_rand(300, torch.float32, gen), x, torch.full((20,), 1e20)]
    ys[2][3] = float("nan")
    for tensors, bad in (([ys[0], x], [False, True]), ([ys[0], ys[2]], [False, True]), ([x, ys[0], ys[2]],
                                                                                       [True, False, True])):
        finite, sumsq, sumsq32, norm = _check_outputs()
        leaf = torch.zeros(len(tensors), dtype=torch.bool)
        assert emu.check(tensors, finite=finite, sumsq=sumsq, sumsq_f32=sumsq32, norm=norm, leaf=leaf) == 0
        assert not bool(finite) and leaf.tolist() == bad
        assert not torch.isfinite(sumsq) and not torch.isfinite(norm) and not torch.isfinite(sumsq32)


def test_emulated_check_norm_over_mixed_dtype_groups_with_accumulate(emu):
    # One call per dtype group, as the glue makes them: the running sum is a double, so the
    # groups combine without overflow; the last call rounds the norm (and the fp32 sum) once.
    gen = _cpu_gen(9)
    groups = [[_rand(n, torch.float16, gen, 100.0) for n in (5, CHUNK + 3)],
              [torch.full((20,), 1e20), _rand(9, torch.float32, gen)],
              [_rand(2 * CHUNK + 1, torch.bfloat16, gen, 1e18)]]
    scale = torch.tensor(0.5)
    finite, sumsq, sumsq32, norm = _check_outputs()
    for k, g in enumerate(groups):
        last = k == len(groups) - 1
        assert emu.check(g, finite=finite, sumsq=sumsq, sumsq_f32=sumsq32 if last else None,
                         norm=norm if last else None, scale=scale, accumulate=int(k > 0)) == 0
    exact = sum(_exact_sumsq(g, 0.5) for g in groups)
    assert bool(finite) and exact > FP32_MAX
    assert abs(float(norm) / exact**0.5 - 1) < 1e-6 and float(sumsq32) == float("inf")
    # normal values: the fp32 sum of every group, from the last call
    small = [groups[0], [_rand(9, torch.float32, gen)], [_rand(7, torch.bfloat16, gen)]]
    for k, g in enumerate(small):
        assert emu.check(g, finite=finite, sumsq=sumsq, sumsq_f32=sumsq32, norm=norm, accumulate=int(k > 0)) == 0
    exact = sum(_exact_sumsq(g) for g in small)
    assert float(sumsq32) == pytest.approx(exact, rel=1e-6) and float(norm) == pytest.approx(exact**0.5, rel=1e-6)
    _same_bits(sumsq32, sumsq.float())
    # a non-finite group anywhere keeps the flag false through the later groups
    _poison(small[1][0], gen, 0)
    for k, g in enumerate(small):
        assert emu.check(g, finite=finite, sumsq=sumsq, norm=norm, accumulate=int(k > 0)) == 0
    assert not bool(finite) and not torch.isfinite(norm)
    # combining needs the running double sum
    assert emu.check(small[0], norm=norm, accumulate=1) == CUDA_INVALID_VALUE


def test_emulated_check_accumulates_scales_and_is_deterministic(emu):
    gen = _cpu_gen(2)
    a = [_rand(n, torch.float16, gen) for n in (5, CHUNK + 3)]
    b = [_rand(n, torch.float32, gen) for n in (2 * CHUNK + 1, 9)]
    scale = torch.tensor(0.5)
    finite, sumsq = torch.zeros((), dtype=torch.bool), torch.full((), 123.0, dtype=torch.float64)
    assert emu.check(a, finite=finite, sumsq=sumsq, scale=scale) == 0  # overwrites
    first = sumsq.clone()
    assert emu.check(b, finite=finite, sumsq=sumsq, scale=scale, accumulate=1) == 0  # adds
    exact = sum(float((t.double() * 0.5).square().sum()) for t in a + b)
    assert bool(finite) and float(sumsq) == pytest.approx(exact, rel=1e-6)
    again = torch.full((), 7.0, dtype=torch.float64)
    assert emu.check(a, sumsq=again, scale=scale) == 0
    _same_bits(again, first)
    _poison(b[1], gen, 0)
    assert emu.check(b, finite=finite, sumsq=sumsq, accumulate=1) == 0 and not bool(finite)
    assert emu.check(a, finite=finite, accumulate=1) == 0 and not bool(finite)  # AND keeps it false
    assert emu.check(a, finite=finite) == 0 and bool(finite)                      # overwrite resets
    empty_finite, empty_sum, empty_norm = torch.zeros((), dtype=torch.bool), torch.full((), 5.0), torch.full((), 5.0)
    assert emu.check([torch.empty(0)], finite=empty_finite, sumsq_f32=empty_sum, norm=empty_norm) == 0
    assert bool(empty_finite) and float(empty_sum) == 0.0 and float(empty_norm) == 0.0


def test_emulated_check_refuses_bad_arguments(emu):
    ts = [torch.ones(CHUNK + 1)]
    assert emu.workspace_bytes(ts) == 2 * (8 + 4)  # two chunks: a double partial and a float flag each
    finite = torch.zeros((), dtype=torch.bool)
    assert emu.check(ts, finite=finite, ws_bytes=8) == CUDA_INVALID_VALUE
    assert emu.check(ts, finite=finite, dtype=7) == CUDA_INVALID_VALUE
    ws = torch.empty(64, dtype=torch.uint8)
    assert emu.check(ts, finite=finite, ws=ws[4:], ws_bytes=24) == CUDA_INVALID_VALUE  # partials need 8-byte alignment
    assert b"" != emu.lib.ampfunc_cuda_error_string(CUDA_INVALID_VALUE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_unscale_in_place_and_out_of_place(emu, dtype):
    gen = _cpu_gen(3)
    base = [_rand(n + 1, dtype, gen, 1000.0) for n in (1, 7, 4099, 2 * CHUNK + 5)]
    tensors = [b[1:] if i % 2 else b[:-1] for i, b in enumerate(base)]
    _poison(tensors[2], gen, 1)
    inv = torch.tensor(1.0 / 3072.0)
    expected = [(t.float() * inv).to(dtype) for t in tensors]
    outs = [torch.full(t.shape, -5.0) for t in tensors]
    finite = torch.ones((), dtype=torch.bool)
    before = [t.clone() for t in tensors]
    assert emu.unscale(tensors, outs, inv, finite) == 0 and not bool(finite)
    for o, t, b in zip(outs, tensors, before):
        _same_bits(o, b.float() * inv)
        _same_bits(t, b)
    finite = torch.zeros((), dtype=torch.bool)
    clean = tensors[:2] + tensors[3:]
    assert emu.unscale_(clean, torch.ones(()), finite) == 0 and bool(finite)  # overwrite: set, not AND
    for t, b in zip(clean, before[:2] + before[3:]):
        _same_bits(t, b)  # factor 1 keeps the bits
    assert emu.unscale_(tensors, inv, finite, accumulate=1) == 0 and not bool(finite)
    for t, e in zip(tensors, expected):
        _same_bits(t, e)
    assert emu.unscale_(clean, inv, finite, accumulate=1) == 0 and not bool(finite)  # only ever cleared


EMU_STEP_SIZES = [0, 1, 7, 4099, CHUNK + 5]


@pytest.mark.parametrize("case", ADAM_CASES, ids=["adam", "adam-l2", "adamw", "adamw-ams-max", "adam-ams-b1low"])
def test_emulated_adam_matches_torch_optim(emu, case):
    gen = _cpu_gen(4)
    p0 = [_rand(n, torch.float32, gen) for n in EMU_STEP_SIZES]
    ref = [p.clone().requires_grad_(True) for p in p0]
    cls = torch.optim.AdamW if case["adamw"] else torch.optim.Adam
    opt = cls(ref, lr=case["lr"], betas=case["betas"], eps=case["eps"], weight_decay=case["weight_decay"],
              amsgrad=case["amsgrad"], maximize=case["maximize"], foreach=False)
    params = [p.clone() for p in p0]
    m, v, vmax = ([torch.zeros_like(p) for p in params] for _ in range(3))
    step, one, yes = torch.zeros(()), torch.ones(()), torch.tensor(True)
    for _ in range(10):
        grads = [_rand(p.numel(), torch.float32, gen) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        assert emu.adam(grads, params, m, v, vmax if case["amsgrad"] else None, None, step, one, yes,
                        **{k: case[k] for k in ("lr", "betas", "eps", "weight_decay", "adamw", "amsgrad",
                                                "maximize")}) == 0
    assert float(step) == 10.0
    for p, mi, vi, r in zip(params, m, v, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)
        if r.numel():
            torch.testing.assert_close(mi, opt.state[r]["exp_avg"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(vi, opt.state[r]["exp_avg_sq"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_emulated_adam_low_precision_copy_skip_and_lr_tensor(emu, grad_dtype):
    gen = _cpu_gen(5)
    sizes = [1, 7, 4099, CHUNK + 5]
    p0 = [_rand(n, torch.float32, gen) for n in sizes]
    ref = [p.clone().requires_grad_(True) for p in p0]
    opt = torch.optim.AdamW(ref, lr=2e-3, weight_decay=1e-2, foreach=False)
    params = [p.clone() for p in p0]
    model = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    step, lr_tensor = torch.zeros(()), torch.tensor(2e-3)
    grad_scale = torch.tensor(1.0 / 256.0)
    for k in range(6):
        grads = [_rand(n, grad_dtype, gen, 256.0) for n in sizes]
        finite = torch.tensor(k != 3)
        if k == 3:  # a skipped step: nothing moves, not even the step counter
            _poison(grads[1], gen, 1)
            everything = params + m + v + model + [step]
            before = [t.clone() for t in everything]
        assert emu.adam(grads, params, m, v, None, model, step, grad_scale, finite, lr_tensor=lr_tensor, lr=99.0,
                        weight_decay=1e-2, adamw=True) == 0
        if k == 3:
            for t, b in zip(everything, before):
                _same_bits(t, b)
            continue
        for r, g in zip(ref, grads):
            r.grad = g.float() * grad_scale
        opt.step()
        for mp, p in zip(model, params):
            _same_bits(mp, p.to(torch.bfloat16))
    assert float(step) == 5.0
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)
    # increment=0 (not the last dtype group of a step): the counter waits for the last call
    assert emu.adam(grads, params, m, v, None, None, step, grad_scale, torch.tensor(True), increment=0) == 0
    assert float(step) == 5.0
    assert emu.adam(grads, params, m, v, None, None, step, grad_scale, torch.tensor(True), amsgrad=True) \
        == CUDA_INVALID_VALUE  # amsgrad needs its list


@pytest.mark.parametrize("case", SGD_CASES, ids=["momentum-damp-wd", "nesterov", "plain-max"])
def test_emulated_sgd_matches_torch_optim(emu, case):
    gen = _cpu_gen(6)
    p0 = [_rand(n, torch.float32, gen) for n in EMU_STEP_SIZES]
    ref = [p.clone().requires_grad_(True) for p in p0]
    opt = torch.optim.SGD(ref, foreach=False, **case)
    params = [p.clone() for p in p0]
    bufs = [torch.full_like(p, float("nan")) for p in params]  # never read on the first step
    model = [torch.empty(p.shape, dtype=torch.float16) for p in params]
    step, one, yes = torch.zeros(()), torch.ones(()), torch.tensor(True)
    for _ in range(10):
        grads = [_rand(p.numel(), torch.float32, gen) for p in params]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        assert emu.sgd(grads, params, bufs if case["momentum"] else None, model, step, one, yes, **case) == 0
    for p, r, mp in zip(params, ref, model):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-6)
        _same_bits(mp, p.half())
    if case["momentum"]:
        for b, r in zip(bufs, ref):
            if r.numel():
                torch.testing.assert_close(b, opt.state[r]["momentum_buffer"], rtol=1e-6, atol=1e-6)


def test_emulated_many_leaves_span_several_launches(emu):
    gen = _cpu_gen(7)
    sizes = [1 + (i * 53) % 300 for i in range(300)]  # > 295 leaves: the Adam lists need two launches
    grads = [_rand(n, torch.float16, gen, 64.0) for n in sizes]
    p0 = [_rand(n, torch.float32, gen) for n in sizes]
    params, rparams = [p.clone() for p in p0], [p.clone() for p in p0]
    m, v, rm, rv = ([torch.zeros_like(p) for p in p0] for _ in range(4))
    step, rstep = torch.zeros(()), torch.zeros(())
    grad_scale, finite = torch.tensor(1.0 / 64.0), torch.tensor(True)
    assert emu.adam(grads, params, m, v, None, None, step, grad_scale, finite, lr=1e-2, weight_decay=0.1,
                    adamw=True) == 0
    ops._ref_adam_step_(rparams, grads, rm, rv, [], [], rstep, grad_scale, finite, lr=1e-2, lr_tensor=None,
                        beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False,
                        decoupled_weight_decay=True, maximize=False)
    for a, b in zip(params + m + v, rparams + rm + rv):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    leaf = torch.ones(len(grads), dtype=torch.bool)
    _poison(grads[297], gen, 0)
    assert emu.check(grads, leaf=leaf) == 0
    assert leaf.nonzero().flatten().tolist() == [297]


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_emulated_update_scale_follows_the_reference_rule(emu, hysteresis):
    cfg = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, min_scale=1.0, max_scale=2.0 ** 20,
               hysteresis=hysteresis)
    scale, gt = torch.full((), 2.0 ** 18), torch.zeros((), dtype=torch.int32)
    ht = torch.full((), hysteresis, dtype=torch.int32)
    rs, rg, rh = scale.clone(), gt.clone(), ht.clone()
    for f in [1] * 9 + [0, 1, 0, 0, 0, 0] + [0] * 30 + [1] * 7:
        finite = torch.tensor(bool(f))
        assert emu.update_scale(scale, gt, ht, finite, **cfg) == 0
        rs, rg, rh = ops._ref_update_scale(rs, rg, rh, finite, **cfg)
        _same_bits(scale, rs)
        _same_bits(gt, rg)
        _same_bits(ht, rh)
    big, g1, h1 = torch.full((), 3.0e38), torch.zeros((), dtype=torch.int32), torch.ones((), dtype=torch.int32)
    assert emu.update_scale(big, g1, h1, torch.tensor(True), growth_factor=2.0, backoff_factor=0.5,
                            growth_interval=1, min_scale=0.0, max_scale=float("inf"), hysteresis=1) == 0
    assert float(big) == pytest.approx(3.0e38) and int(g1) == 0  # an overflowing growth is not applied


# The pure step (out of place) and the pure update (delta) launchers: the in-place kernel's
# per-element code with other destinations, so their numbers are checked bit for bit against the
# in-place launcher, and against the CPU kernels (ampfunc.ops on CPU tensors) within the
# tolerance of the emulated tests above.

PURE_SIZES = [0, 1, 7, 4099, CHUNK + 5]  # the last spans a chunk boundary


def _leaves(sizes, dtype, gen, scale=1.0, positive=False):
    """Tensors of `sizes`, every odd one a view one element into a buffer (no 4-wide vectors)."""
    out = []
    for i, n in enumerate(sizes):
        b = _rand(n + 1, torch.float32, gen, scale)
        b = (b.abs() if positive else b).to(dtype)
        out.append(b[1:] if i % 2 else b[:-1])
    return out


def _nan_like(ts, dtype=None):
    return [torch.full(t.shape, float("nan"), dtype=dtype or t.dtype) for t in ts]


def _same_storage_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def _clones(ts):
    return None if ts is None else [t.clone() for t in ts]


ADAM_HYPER = ("lr", "betas", "eps", "weight_decay", "adamw", "amsgrad", "maximize")


def _ops_adam_kw(case, **over):
    kw = dict(lr=case["lr"], beta1=case["betas"][0], beta2=case["betas"][1], eps=case["eps"],
              weight_decay=case["weight_decay"], amsgrad=case["amsgrad"], decoupled_weight_decay=case["adamw"],
              maximize=case["maximize"])
    kw.update(over)
    return kw


@pytest.mark.parametrize("case,grad_dtype", list(zip(ADAM_CASES, DTYPES + DTYPES[1:])),
                         ids=["adam-fp32", "adam-l2-fp16", "adamw-bf16", "adamw-ams-max-fp16", "adam-ams-b1low-bf16"])
def test_emulated_adam_pure_step_and_update_are_the_in_place_step(emu, case, grad_dtype):
    gen = _cpu_gen(11)
    hyper = {k: case[k] for k in ADAM_HYPER}
    ams = case["amsgrad"]
    model_dtype = torch.bfloat16 if grad_dtype == torch.bfloat16 else torch.float16
    p = _leaves(PURE_SIZES, torch.float32, gen)
    m = _leaves(PURE_SIZES, torch.float32, gen, 0.01)
    v = _leaves(PURE_SIZES, torch.float32, gen, 0.01, positive=True)
    vmax = _leaves(PURE_SIZES, torch.float32, gen, 0.02, positive=True) if ams else None
    model = _leaves(PURE_SIZES, model_dtype, gen)  # not round(p): a skip would have to return these
    step = torch.zeros(())
    for k in range(2):  # t = 1, 2: the first step and a later one
        grads = _leaves(PURE_SIZES, grad_dtype, gen, 4.0)
        gs = torch.tensor(0.25)
        inputs = [t for ts in (p, m, v, vmax or [], model, [step]) for t in ts]
        before = _clones(inputs)
        # the in-place launcher on copies: the numbers the pure launchers must give
        P, M, V, VMAX, MODEL, STEP = _clones(p), _clones(m), _clones(v), _clones(vmax), _clones(model), step.clone()
        assert emu.adam(grads, P, M, V, VMAX, MODEL, STEP, gs, torch.tensor(True), **hyper) == 0
        # pure step: every output written (NaN-filled before), equal to the in-place results
        outs = (_nan_like(p), _nan_like(m), _nan_like(v), _nan_like(vmax) if ams else None, _nan_like(model))
        step_out = torch.full((), -1.0)
        assert emu.adam_out(grads, p, m, v, vmax, model, outs, step, step_out, gs, torch.tensor(True), **hyper) == 0
        for got, want in zip([t for ts in outs if ts for t in ts] + [step_out],
                             [t for ts in (P, M, V, VMAX or [], MODEL) for t in ts] + [STEP]):
            _same_storage_bits(got, want)
        # pure update with params: updates = in-place new p - p (one fp32 subtraction), new moments
        upd = (_nan_like(p), _nan_like(m), _nan_like(v), _nan_like(vmax) if ams else None)
        step_upd = torch.full((), -1.0)
        assert emu.adam_update(grads, p, m, v, vmax, upd, step, step_upd, gs, **hyper) == 0
        for d, new_p, old_p in zip(upd[0], P, p):
            _same_storage_bits(d, new_p - old_p)
        for got, want in zip([t for ts in upd[1:] if ts for t in ts] + [step_upd],
                             [t for ts in (M, V, VMAX or []) for t in ts] + [STEP]):
            _same_storage_bits(got, want)
        for t, b in zip(inputs, before):
            _same_storage_bits(t, b)  # inputs only read
        # the CPU kernels: the same update within fp32 rounding (another order of operations)
        want = ops.adam_update(p, grads, m, v, vmax, step, gs, **_ops_adam_kw(case))
        for got, ref in zip(upd[0], want[0]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for got, ref in zip([t for ts in upd[1:] if ts for t in ts], want[1] + want[2] + want[3]):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
        cpu_step = ops.adam_step(p, grads, m, v, vmax, model, step, gs, torch.tensor(True),
                                 **_ops_adam_kw(case))
        for got, ref in zip(outs[0], cpu_step[0]):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        if k == 0:
            p, m, v, vmax, model, step = outs[0], outs[1], outs[2], outs[3], outs[4], step_out
            continue
        # pure update without params: the in-place step from zeros (weight decay has nothing to act on)
        nowd = dict(hyper, weight_decay=0.0)
        Z = [torch.zeros(t.shape) for t in p]
        MZ, VZ, VMZ, SZ = _clones(m), _clones(v), _clones(vmax), step.clone()
        assert emu.adam(grads, Z, MZ, VZ, VMZ, None, SZ, gs, torch.tensor(True), **nowd) == 0
        upd0 = (_nan_like(p), _nan_like(m), _nan_like(v), _nan_like(vmax) if ams else None)
        assert emu.adam_update(grads, None, m, v, vmax, upd0, step, None, gs, **nowd) == 0
        for got, want_ in zip([t for ts in upd0 if ts for t in ts], [t for ts in (Z, MZ, VZ, VMZ or []) for t in ts]):
            _same_storage_bits(got, want_)
        want0 = ops.adam_update(None, grads, m, v, vmax, step, gs, **_ops_adam_kw(case, weight_decay=0.0))
        for got, ref in zip(upd0[0], want0[0]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert float(step_out) == 2.0


@pytest.mark.parametrize("case,grad_dtype", list(zip(SGD_CASES, DTYPES)),
                         ids=["momentum-damp-wd-fp32", "nesterov-fp16", "plain-max-bf16"])
def test_emulated_sgd_pure_step_and_update_are_the_in_place_step(emu, case, grad_dtype):
    gen = _cpu_gen(12)
    mom = case["momentum"] != 0
    model_dtype = torch.bfloat16 if grad_dtype == torch.bfloat16 else torch.float16
    p = _leaves(PURE_SIZES, torch.float32, gen)
    bufs = [torch.zeros(t.shape) for t in p] if mom else None  # the state init makes
    model = _leaves(PURE_SIZES, model_dtype, gen)
    step = torch.zeros(())
    for k in range(2):  # the first step fills the buffers, the second blends
        grads = _leaves(PURE_SIZES, grad_dtype, gen, 4.0)
        gs = torch.tensor(0.5)
        inputs = [t for ts in (p, bufs or [], model, [step]) for t in ts]
        before = _clones(inputs)
        P, B, MODEL, STEP = _clones(p), _clones(bufs), _clones(model), step.clone()
        assert emu.sgd(grads, P, B, MODEL, STEP, gs, torch.tensor(True), **case) == 0
        outs = (_nan_like(p), _nan_like(bufs) if mom else None, _nan_like(model))
        step_out = torch.full((), -1.0)
        assert emu.sgd_out(grads, p, bufs, model, outs, step, step_out, gs, torch.tensor(True), **case) == 0
        for got, want in zip([t for ts in outs if ts for t in ts] + [step_out],
                             [t for ts in (P, B or [], MODEL) for t in ts] + [STEP]):
            _same_storage_bits(got, want)
        upd = (_nan_like(p), _nan_like(bufs) if mom else None)
        step_upd = torch.full((), -1.0)
        assert emu.sgd_update(grads, p, bufs, upd, step, step_upd, gs, **case) == 0
        for d, new_p, old_p in zip(upd[0], P, p):
            _same_storage_bits(d, new_p - old_p)
        for got, want in zip((upd[1] or []) + [step_upd], (B or []) + [STEP]):
            _same_storage_bits(got, want)
        for t, b in zip(inputs, before):
            _same_storage_bits(t, b)
        kw = {k: case[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")}
        want = ops.sgd_update(p, grads, bufs, step, gs, **kw)
        for got, ref in zip(upd[0], want[0]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for got, ref in zip(upd[1] or [], want[1]):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        cpu_step = ops.sgd_step(p, grads, bufs, model, step, gs, torch.tensor(True), **kw)
        for got, ref in zip(outs[0], cpu_step[0]):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        if k == 0:
            p, bufs, model, step = outs[0], outs[1], outs[2], step_out
            continue
        # without params: the in-place step from zeros
        nowd = dict(case, weight_decay=0.0)
        Z, BZ, SZ = [torch.zeros(t.shape) for t in p], _clones(bufs), step.clone()
        assert emu.sgd(grads, Z, BZ, None, SZ, gs, torch.tensor(True), **nowd) == 0
        upd0 = (_nan_like(p), _nan_like(bufs) if mom else None)
        assert emu.sgd_update(grads, None, bufs, upd0, step, None, gs, **nowd) == 0
        for got, want_ in zip(upd0[0] + (upd0[1] or []), Z + (BZ or [])):
            _same_storage_bits(got, want_)
    assert float(step_out) == 2.0


def test_emulated_pure_skipped_step_returns_the_inputs_bit_for_bit(emu):
    gen = _cpu_gen(13)
    sizes = [1, 7, CHUNK + 5]
    grads = _leaves(sizes, torch.float16, gen)
    _poison(grads[1], gen, 2)
    p, m = _leaves(sizes, torch.float32, gen), _leaves(sizes, torch.float32, gen)
    v, vmax = _leaves(sizes, torch.float32, gen, positive=True), _leaves(sizes, torch.float32, gen, positive=True)
    model = _leaves(sizes, torch.float16, gen)
    model[0].view(torch.int16)[0] = 0x7D01  # a signalling NaN with a payload: copied, not converted
    p[2][3] = -0.0
    step, no, gs = torch.tensor(7.0), torch.tensor(False), torch.tensor(1.0)
    inputs = p + m + v + vmax + model + [step]
    before = _clones(inputs)

    outs = (_nan_like(p), _nan_like(m), _nan_like(v), _nan_like(vmax), _nan_like(model))
    step_out = torch.full((), -1.0)
    assert emu.adam_out(grads, p, m, v, vmax, model, outs, step, step_out, gs, no, amsgrad=True, adamw=True,
                        weight_decay=0.1) == 0
    for got, want in zip([t for ts in outs for t in ts] + [step_out], p + m + v + vmax + model + [step]):
        _same_storage_bits(got, want)

    upd = (_nan_like(p), _nan_like(m), _nan_like(v), _nan_like(vmax))
    step_upd = torch.full((), -1.0)
    assert emu.adam_update(grads, p, m, v, vmax, upd, step, step_upd, gs, no, amsgrad=True) == 0
    for d in upd[0]:
        assert torch.equal(bits(d), torch.zeros_like(bits(d)))  # +0: apply_updates keeps the params
    for got, want in zip([t for ts in upd[1:] for t in ts] + [step_upd], m + v + vmax + [step]):
        _same_storage_bits(got, want)

    souts = (_nan_like(p), _nan_like(m), _nan_like(model))
    step_out = torch.full((), -1.0)
    assert emu.sgd_out(grads, p, m, model, souts, step, step_out, gs, no, momentum=0.9) == 0
    for got, want in zip([t for ts in souts for t in ts] + [step_out], p + m + model + [step]):
        _same_storage_bits(got, want)
    supd = (_nan_like(p), _nan_like(m))
    assert emu.sgd_update(grads, p, m, supd, step, step_out, gs, no, momentum=0.9) == 0
    for d in supd[0]:
        assert torch.equal(bits(d), torch.zeros_like(bits(d)))
    for got, want in zip(supd[1] + [step_out], m + [step]):
        _same_storage_bits(got, want)
    for t, b in zip(inputs, before):
        _same_storage_bits(t, b)


def test_emulated_pure_adam_step_with_every_list_spans_several_launches(emu):
    # Adam out of place with amsgrad and a model copy is the deepest launch (11 lists): about 177
    # leaves fit in one argument block, so 180 leaves take two launches.
    gen = _cpu_gen(14)
    sizes = [1 + (i * 53) % 300 for i in range(180)]
    grads = _leaves(sizes, torch.bfloat16, gen, 64.0)
    p, m = _leaves(sizes, torch.float32, gen), _leaves(sizes, torch.float32, gen, 0.01)
    v, vmax = (_leaves(sizes, torch.float32, gen, 0.01, positive=True) for _ in range(2))
    model = _leaves(sizes, torch.bfloat16, gen)
    step, gs, yes = torch.tensor(4.0), torch.tensor(1.0 / 64.0), torch.tensor(True)
    hyper = dict(lr=1e-2, weight_decay=0.1, adamw=True, amsgrad=True)
    P, M, V, VMAX, MODEL, STEP = _clones(p), _clones(m), _clones(v), _clones(vmax), _clones(model), step.clone()
    assert emu.adam(grads, P, M, V, VMAX, MODEL, STEP, gs, yes, **hyper) == 0
    outs = (_nan_like(p), _nan_like(m), _nan_like(v), _nan_like(vmax), _nan_like(model))
    step_out = torch.full((), -1.0)
    assert emu.adam_out(grads, p, m, v, vmax, model, outs, step, step_out, gs, yes, **hyper) == 0
    for got, want in zip([t for ts in outs for t in ts] + [step_out], P + M + V + VMAX + MODEL + [STEP]):
        _same_storage_bits(got, want)


def test_emulated_pure_launchers_refuse_bad_arguments(emu):
    assert emu.lib.ampfunc_cuda_abi_version() == 5
    x = [torch.ones(5)]
    g, step, one, yes = [torch.ones(5)], torch.zeros(()), torch.ones(()), torch.tensor(True)
    outs = ([torch.empty(5)], [torch.empty(5)], [torch.empty(5)], None, None)
    # a model copy needs both its input (the skip value) and its output
    assert emu.adam_out(g, x, x, x, None, [torch.ones(5, dtype=torch.float16)], outs, step, None, one, yes) \
        == CUDA_INVALID_VALUE
    assert emu.adam_out(g, x, x, x, None, None, outs[:4] + ([torch.empty(5, dtype=torch.float16)],), step, None,
                        one, yes) == CUDA_INVALID_VALUE
    assert emu.adam_out(g, x, x, x, x, None, outs, step, None, one, yes, amsgrad=True) == CUDA_INVALID_VALUE
    assert emu.adam_update(g, x, x, x, None, ([torch.empty(5)], None, [torch.empty(5)], None), step, None, one) \
        == CUDA_INVALID_VALUE  # no exp_avgs_out
    assert emu.sgd_update(g, x, x, ([torch.empty(5)], None), step, None, one, momentum=0.9) == CUDA_INVALID_VALUE
    assert emu.sgd_out(g, x, None, None, ([torch.empty(5)], None, None), None, torch.empty(()), one, yes) \
        == CUDA_INVALID_VALUE  # step_out without step
    before = [t.clone() for t in x + g + [step]]
    assert emu.sgd_out(g, x, None, None, (None, None, None), None, None, one, yes) == CUDA_INVALID_VALUE
    for t, b in zip(x + g + [step], before):
        _same_storage_bits(t, b)


# The low-memory step (ext/cuda/lowmem.cu, ampfunc::adam_lowmem_step_ on CUDA): its fp32 numbers
# are the fp32 CUDA kernel's (adam_element.cuh, shared with optim.cu), so the contract checked
# here is the reference twin (ampfunc.ops._lowmem_reference: join, decode, the fp32 step, encode,
# split, the device-side skip) whose fp32 step is that kernel -- the real optim.cu under the same
# emulation -- bit for bit: what ampfunc.lowmem's plain road computes on a GPU with the kernels.

def _emu_fp32_step(emu):
    """The twin's fp32 Adam step, served by the emulated fp32 CUDA kernel (a launch per grad
    dtype, the step counter moved by the last, as the glue does)."""
    def step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite, lr,
              beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize, lr_tensor=None):
        assert not amsgrad and not list(max_exp_avg_sqs) and not list(model_params) and bool(finite)
        groups = {}
        for i, g in enumerate(grads):
            groups.setdefault(g.dtype, []).append(i)
        items = list(groups.values()) or [[]]
        for k, idx in enumerate(items):
            pick = (lambda ts: [ts[i] for i in idx] or [torch.zeros(0)])
            assert emu.adam(pick(grads), pick(params), pick(exp_avgs), pick(exp_avg_sqs), None, None, step,
                            grad_scale, finite, lr_tensor=lr_tensor, increment=int(k == len(items) - 1), lr=lr,
                            betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, adamw=decoupled_weight_decay,
                            maximize=maximize) == 0
    return step_


# (numel, param dtype, moments, grad dtype): split and fp32 masters, q8 / bf16 / fp32 moments,
# fp32 / fp16 / bf16 grads, odd sizes for the non-q8 kinds, a q8 leaf across a chunk boundary.
LOWMEM_LEAVES = [
    (4096, torch.bfloat16, "q8", torch.float32),
    (CHUNK + 512, torch.bfloat16, "q8", torch.bfloat16),
    (768, torch.float32, "q8", torch.float16),
    (1001, torch.float32, "bf16", torch.float16),
    (7, torch.bfloat16, "fp32", torch.bfloat16),
    (4099, torch.float32, "fp32", torch.float32),
    (1, torch.bfloat16, "bf16", torch.float32),
    (0, torch.bfloat16, "fp32", torch.float32),
    (333, torch.bfloat16, "bf16", torch.bfloat16),
]


def _lowmem_state(leaves, gen):
    """(params, remainders, m, m_absmax, v, v_absmax) of `leaves`, moments after some history."""
    params, rems, m, ma, v, va = [], [], [], [], [], []
    for n, pd, kind, _ in leaves:
        master = _rand(n, torch.float32, gen)
        if pd == torch.bfloat16:
            hi, lo = split_bf16(master)
            params.append(hi), rems.append(lo)
        else:
            params.append(master), rems.append(torch.zeros(0, dtype=torch.int16))
        m32, v32 = _rand(n, torch.float32, gen, 1e-2), _rand(n, torch.float32, gen, 1e-2).square()
        if kind == "q8":
            (c1, a1), (c2, a2) = quantize_q8(m32, True), quantize_q8(v32, False)
            m.append(c1), ma.append(a1), v.append(c2), va.append(a2)
        else:
            dt = torch.bfloat16 if kind == "bf16" else torch.float32
            m.append(m32.to(dt)), v.append(v32.to(dt)), ma.append(torch.zeros(0)), va.append(torch.zeros(0))
    return [params, rems, m, ma, v, va]


def _lowmem_grads(leaves, gen, scale=1.0):
    return [_rand(n, gd, gen, scale) for n, _, _, gd in leaves]


def _emu_lowmem(emu, state, grads, step, gs, finite, maps, bases, lr, lr_tensor, hyper):
    b1, b2, eps, wd, adamw, maximize = hyper
    params, rems, m, ma, v, va = state
    return emu.adam_lowmem(params, rems, grads, m, ma, v, va, step, gs, finite, maps, bases, lr_tensor=lr_tensor,
                           lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adamw=adamw, maximize=maximize)


@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
def test_emulated_lowmem_step_is_the_twin_bit_for_bit_over_steps_with_a_skip(emu, monkeypatch, adamw):
    monkeypatch.setattr(lowmem_twin, "_ref_adam_step_", _emu_fp32_step(emu))
    gen = _cpu_gen(21)
    state = _lowmem_state(LOWMEM_LEAVES, gen)
    ref = clone_tree(state)
    step, ref_step = torch.zeros(()), torch.zeros(())
    maps, bases = q8_lookup()
    lr_tensor = torch.tensor(3e-3)
    for i in range(5):
        grads = _lowmem_grads(LOWMEM_LEAVES, gen, 4.0)
        finite, gs = torch.tensor(i != 2), torch.tensor(0.25)
        lr, lt = (0.0, lr_tensor) if i % 2 else (1e-2, None)
        hyper = (0.9, 0.999, 1e-8, 0.05, adamw, i == 3)
        before = clone_tree(state)
        assert _emu_lowmem(emu, state, grads, step, gs, finite, maps, bases, lr, lt, hyper) == 0
        lowmem_twin._ref_adam_lowmem_step_(ref[0], ref[1], grads, *ref[2:], ref_step, gs, finite, maps, bases, lr, lt,
                                    *hyper)
        assert same_tree_bits(state, ref), f"step {i}"
        assert same_tree_bits(step, ref_step)
        if i == 2:  # the skipped step: nothing written, the counter included
            assert same_tree_bits(state, before) and float(step) == 2.0
        else:
            assert not same_tree_bits(state[0], before[0])
    assert float(step) == 4.0  # once per taken step, whatever the number of launches


def test_emulated_lowmem_q8_second_moment_overflow_stays_in_its_element(emu, monkeypatch):
    monkeypatch.setattr(lowmem_twin, "_ref_adam_step_", _emu_fp32_step(emu))
    leaves = [(1024, torch.bfloat16, "q8", torch.float32), (512, torch.float32, "q8", torch.float32)]
    gen = _cpu_gen(22)
    state = _lowmem_state(leaves, gen)
    ref = clone_tree(state)
    step, ref_step = torch.zeros(()), torch.zeros(())
    maps, bases = q8_lookup()
    yes, gs = torch.tensor(True), torch.tensor(1.0)
    for i in range(3):
        grads = _lowmem_grads(leaves, gen)
        if i == 0:
            grads[0][300] = 1e30  # g * g overflows: v = inf in block 1 of leaf 0
        hyper = (0.9, 0.999, 1e-8, 0.0, True, False)
        assert _emu_lowmem(emu, state, grads, step, gs, yes, maps, bases, 1e-3, None, hyper) == 0
        lowmem_twin._ref_adam_lowmem_step_(ref[0], ref[1], grads, *ref[2:], ref_step, gs, yes, maps, bases, 1e-3, None,
                                    *hyper)
        assert same_tree_bits(state, ref), f"step {i}"
    v = dequantize_q8(state[4][0], state[5][0], False)
    assert torch.isinf(state[5][0][1]) and torch.isinf(v[300])
    assert torch.isfinite(v[:300]).all() and torch.isfinite(v[301:]).all()
    assert (v[256:300] == 0).all() and torch.isfinite(state[0][0].float()).all()


def test_emulated_lowmem_refuses_bad_arguments(emu):
    maps, bases = q8_lookup()
    gen = _cpu_gen(23)
    step, gs, yes = torch.zeros(()), torch.tensor(1.0), torch.tensor(True)
    q8 = _lowmem_state([(512, torch.float32, "q8", torch.float32)], gen)
    grads = _lowmem_grads([(512, torch.float32, "q8", torch.float32)], gen)
    before = [t.clone() for ts in q8 for t in ts]
    assert emu.adam_lowmem(q8[0], q8[1], grads, *q8[2:], step, gs, yes, maps, bases, amsgrad=True) \
        == CUDA_INVALID_VALUE  # no AMSGrad
    assert emu.adam_lowmem(q8[0], q8[1], grads, *q8[2:], step, gs, yes, None, None) == CUDA_INVALID_VALUE  # tables
    short = [t[:300] if t.numel() == 512 else t for t in [q8[0][0], grads[0], q8[2][0], q8[4][0]]]
    assert emu.adam_lowmem([short[0]], q8[1], [short[1]], [short[2]], q8[3], [short[3]], q8[5], step, gs, yes,
                           maps, bases) == CUDA_INVALID_VALUE  # a q8 leaf of 300 elements
    hi = [q8[0][0].to(torch.bfloat16)]
    assert emu.adam_lowmem(hi, [torch.zeros(0, dtype=torch.int16)], grads, *q8[2:], step, gs, yes, maps, bases) \
        == CUDA_INVALID_VALUE  # a bf16 param without its remainder
    assert all(torch.equal(a, b) for a, b in zip([t for ts in q8 for t in ts], before)) and float(step) == 0.0


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
@pytest.mark.parametrize("poisoned", [False, True])
def test_float64_leaves_are_checked_and_unscaled_on_cuda_as_on_the_cpu(cuda_backend, poisoned):
    # torch's GradScaler and clip_grad_norm_ take float64 on CUDA; so do the ops (plain ATen for
    # those leaves, the kernels for the rest), with the CPU kernels' numbers
    gen = _gen(17)
    base = _rand(40 * 3, torch.float64, gen, 100.0).view(40, 3)
    tensors = [_rand(CHUNK + 5, torch.float32, gen, 100.0), base.t(), _rand(0, torch.float64, gen),
               _rand(77, torch.float16, gen, 100.0), _rand(9, torch.float64, gen, 100.0)]
    if poisoned:
        _poison(tensors[4], gen, 1)
    cpu = [t.cpu() for t in tensors]
    for per_leaf in (False, True):
        got, want = ops.check(tensors, per_leaf=per_leaf), ops.check(cpu, per_leaf=per_leaf)
        assert bool(got[0]) == bool(want[0]) == (not poisoned)
        if per_leaf:
            assert got[2].tolist() == want[2].tolist() == [False, False, False, False, poisoned]
        if not poisoned:
            torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-6, atol=0)
    inv = torch.tensor(0.125, device="cuda")
    norm, want_norm = ops.check_norm(tensors, inv), ops.check_norm(cpu, inv.cpu())
    assert bool(norm[0]) == bool(want_norm[0])
    if not poisoned:
        torch.testing.assert_close(norm[1].cpu(), want_norm[1], rtol=1e-6, atol=0)
    outs, finite = ops.unscale(tensors, inv)
    want_outs, want_finite = ops.unscale(cpu, inv.cpu())
    assert bool(finite) == bool(want_finite)
    for o, w in zip(outs, want_outs):
        assert o.dtype == torch.float32
        _same_bits(o.cpu(), w)
    assert bool(ops.unscale_(tensors, inv)) == bool(ops.unscale_(cpu, inv.cpu()))
    for t, c in zip(tensors, cpu):
        _same_bits(t.cpu(), c)  # the strided float64 view written through, as on the CPU


@needs_cuda
def test_per_leaf_check_is_captured_in_a_cuda_graph(cuda_backend):
    # the per-leaf flags land in place by device copies: no host memory read during capture
    gen = _gen(19)
    tensors = [_rand(5, torch.float32, gen), _rand(0, torch.float16, gen), _rand(7, torch.float16, gen),
               _rand(3, torch.float32, gen)]
    ops.check(tensors, per_leaf=True)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        finite, _, leaf = ops.check(tensors, per_leaf=True)
    tensors[2][3] = float("inf")
    graph.replay()
    torch.cuda.synchronize()
    assert not bool(finite) and leaf.tolist() == [False, False, True, False]


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
        ops._ref_adam_step_(rp, grads, rm, rv, rvm, rmodel, rstep, grad_scale, finite, lr_tensor=None, **kw)
    assert float(step) == float(rstep) == 7.0
    for a, b in zip(p + m + v + vm, rp + rm + rv + rvm):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(model, p):
        _same_bits(a, b.half())





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


@needs_cuda
@pytest.mark.parametrize("loss_scale", [None, af.DynamicLossScale()], ids=["noop", "dynamic"])
def test_make_train_step_outputs_live_on_the_params_device(cuda_backend, loss_scale):
    model = torch.nn.Linear(8, 2).cuda()
    train = af.make_train_step(model, lambda fwd, x: fwd(x).square().mean(), af.adamw(1e-3), loss_scale=loss_scale)
    x = torch.randn(4, 8, device="cuda")
    for step in (train.step, train.step_):
        _, out = step(train.init(), x)
        assert {out.loss.device.type, out.finite.device.type, out.loss_scale.device.type} == {"cuda"}, out


@needs_cuda
def test_the_monitor_readers_sync_once_each():
    import warnings
    mon = af.TrainingMonitor({"a": torch.ones(3, device="cuda"), "b": torch.ones(2, device="cuda")}, window=8)
    stats = af.monitor.init_stats("cuda")
    for ok in (True, False, True):
        flag = torch.tensor(ok, device="cuda")
        mon = mon.record(flag, 1024.0, loss=torch.tensor(0.5, device="cuda"),
                         leaf_nonfinite=torch.tensor([not ok, False], device="cuda"))
        stats = af.monitor.record(stats, flag, 1024.0)
    torch.cuda.synchronize()
    readers = {"check_health": mon.check_health, "as_dict": mon.as_dict, "history": mon.history,
               "summary": lambda: af.monitor.summary(stats), "health": lambda: af.monitor.health(stats)}
    previous = torch.cuda.get_sync_debug_mode()
    try:
        for name, read in readers.items():
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                read()
            torch.cuda.set_sync_debug_mode(previous)
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            assert len(syncs) == 1, (name, [str(w.message) for w in syncs])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert mon.overflows() == {"a": 1} and af.monitor.summary(stats)["skipped"] == 1


# ----------------------------------------------------------------------------------------------
# The ops added for the pure optimizers and the robust norm, on CUDA, against the CPU kernels
# (the CUDA updates are one pass, the in-place kernels' arithmetic: within fp32 rounding of the CPU's)
# ----------------------------------------------------------------------------------------------


def _pair(shapes, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cpu = [(torch.randn(s, generator=g) * scale).to(dtype) for s in shapes]
    return cpu, [t.cuda() for t in cpu]


UPDATE_SHAPES = [(0,), (1,), (7,), (33, 5), (3 * CHUNK + 17,)]


@needs_cuda
def test_cuda_check_norm_matches_the_cpu_and_survives_fp32_overflow_of_the_sum():
    cpu, gpu = _pair(UPDATE_SHAPES, 1, 1e3, torch.float16)
    inv = torch.tensor(2.0**-10)
    want = ops.check_norm(cpu, inv)[1]
    got = ops.check_norm(gpu, inv.cuda())[1]
    assert torch.allclose(got.cpu(), want, rtol=1e-5)
    big = [torch.full((20,), 1e20, device="cuda") * 2.0**16]
    finite, norm = ops.check_norm(big, torch.tensor(2.0**-16, device="cuda"))
    assert bool(finite) and torch.isfinite(norm) and abs(float(norm) / (20**0.5 * 1e20) - 1) < 1e-5


@needs_cuda
def test_cuda_check_norm_readme_example():
    scaled = [torch.full((20,), 1e20, device="cuda") * 2.0**16]  # fp32 gradients of 1e20 under a scale of 2**16
    finite, norm = ops.check_norm(scaled, torch.tensor(2.0**-16, device="cuda"))
    assert bool(finite) and abs(float(norm) / (20**0.5 * 1e20) - 1) < 1e-6


@needs_cuda
@pytest.mark.parametrize("poisoned", [False, True])
def test_cuda_check_norm_over_dtype_groups_matches_the_cpu(cuda_backend, poisoned):
    # Three dtype groups (three launcher calls combined through the double running sum), one
    # of them far beyond fp32's range when squared, per-leaf flags: as the CPU kernel.
    g = torch.Generator().manual_seed(31)
    cpu = [torch.full((20,), 1e20), (torch.rand(CHUNK + 9, generator=g) * 1e19).to(torch.bfloat16),
           torch.randn(300, generator=g).to(torch.float16), torch.randn(2 * CHUNK + 3, generator=g)[1:],
           torch.empty(0)]
    if poisoned:
        cpu[2][17] = float("inf")
    gpu = [t.cuda() for t in cpu]
    inv = torch.tensor(0.5)
    want = ops.check_norm(cpu, inv, per_leaf=True)
    got = ops.check_norm(gpu, inv.cuda(), per_leaf=True)
    assert bool(got[0]) == bool(want[0]) == (not poisoned)
    assert torch.equal(got[2].cpu(), want[2])
    exact = sum(float((t.float() * 0.5).double().square().sum()) for t in cpu) ** 0.5
    if poisoned:
        assert not torch.isfinite(got[1]) and not torch.isfinite(want[1])
    else:
        assert abs(float(got[1]) / exact - 1) < 1e-6 and abs(float(want[1]) / exact - 1) < 1e-6
        assert float(ops.check(gpu)[1]) == float(ops.check(cpu)[1]) == float("inf")  # fp32(sum), as on the CPU
        _gpu_same_bits([ops.check_norm(gpu, inv.cuda())[1]], [got[1]])  # deterministic


@needs_cuda
@pytest.mark.parametrize("with_params", [True, False])
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_cuda_pure_updates_match_the_cpu_kernels(kind, with_params):
    p_cpu, p_gpu = _pair(UPDATE_SHAPES, 2)
    g_cpu, g_gpu = _pair(UPDATE_SHAPES, 3, 0.1, torch.bfloat16)
    m_cpu, m_gpu = _pair(UPDATE_SHAPES, 4, 0.01)
    v_cpu = [x.abs() for x in _pair(UPDATE_SHAPES, 5, 0.01)[0]]
    v_gpu = [x.cuda() for x in v_cpu]
    step, gs = torch.tensor(3.0), torch.tensor(0.5)
    if kind == "sgd":
        kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01 if with_params else 0.0, nesterov=True)
        want = ops.sgd_update(p_cpu if with_params else None, g_cpu, m_cpu, step, gs, **kw)
        got = ops.sgd_update(p_gpu if with_params else None, g_gpu, m_gpu, step.cuda(), gs.cuda(), **kw)
        pairs = list(zip(got[0] + got[1], want[0] + want[1]))
    else:
        kw = dict(lr=1e-2, weight_decay=0.1 if with_params else 0.0, decoupled_weight_decay=kind == "adamw")
        want = ops.adam_update(p_cpu if with_params else None, g_cpu, m_cpu, v_cpu, None, step, gs, **kw)
        got = ops.adam_update(p_gpu if with_params else None, g_gpu, m_gpu, v_gpu, None, step.cuda(), gs.cuda(), **kw)
        pairs = list(zip(got[0] + got[1] + got[2], want[0] + want[1] + want[2]))
    for a, b in pairs:
        assert torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6)
    assert float(got[-1]) == 4.0


# The pure step and the pure update on CUDA are one pass each (the launchers' out-of-place and
# delta modes), running the in-place kernel's per-element code: bit for bit the in-place step's
# numbers (updates: its new params minus the params, one fp32 subtraction), within fp32 rounding
# of the CPU kernels'.

def _gpu_leaves(shapes, gen, dtypes, scale=1.0, positive=False):
    out = []
    for i, s in enumerate(shapes):
        numel = 1
        for d in s:
            numel *= d
        x = _rand(numel, torch.float32, gen, scale)
        out.append((x.abs() if positive else x).to(dtypes[i % len(dtypes)]).reshape(s))
    return out


def _gpu_same_bits(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device.type == "cuda"
        assert torch.equal(bits(a), bits(b))


GRAD_MIXES = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "mixed": DTYPES}  # mixed: several dtype groups


@needs_cuda
@pytest.mark.parametrize("grads_kind", list(GRAD_MIXES))
@pytest.mark.parametrize("case", ADAM_CASES, ids=["adam", "adam-l2", "adamw", "adamw-ams-max", "adam-ams-b1low"])
def test_cuda_pure_adam_step_and_update_are_the_in_place_step_bit_for_bit(cuda_backend, case, grads_kind):
    gen = _gen(21)
    ams = case["amsgrad"]
    kw = _ops_adam_kw(case)
    p = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float32])
    m = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float32], 0.01)
    v = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float32], 0.01, positive=True)
    vmax = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float32], 0.02, positive=True) if ams else None
    model = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float16, torch.bfloat16])
    step = torch.zeros((), device="cuda")
    for k in range(2):
        grads = _gpu_leaves(UPDATE_SHAPES, gen, GRAD_MIXES[grads_kind], 8.0)
        gs, yes = torch.tensor(0.125, device="cuda"), torch.tensor(True, device="cuda")
        inputs = [t for ts in (p, m, v, vmax or [], model, [step]) for t in ts]
        before = [t.clone() for t in inputs]
        P, M, V = [t.clone() for t in p], [t.clone() for t in m], [t.clone() for t in v]
        VMAX, MODEL, STEP = [t.clone() for t in vmax] if ams else None, [t.clone() for t in model], step.clone()
        ops.adam_step_(P, grads, M, V, VMAX, MODEL, STEP, gs, yes, **kw)
        new = ops.adam_step(p, grads, m, v, vmax, model, step, gs, yes, **kw)
        _gpu_same_bits(new[0] + new[1] + new[2] + new[3] + new[4] + [new[5]],
                       P + M + V + (VMAX or []) + MODEL + [STEP])
        d, nm, nv, nvmax, nstep = ops.adam_update(p, grads, m, v, vmax, step, gs, **kw)
        _gpu_same_bits(d + nm + nv + nvmax + [nstep], [a - b for a, b in zip(P, p)] + M + V + (VMAX or []) + [STEP])
        _gpu_same_bits(inputs, before)  # only read
        # the CPU kernels, within fp32 rounding
        cpu = lambda ts: None if ts is None else [t.cpu() for t in ts]  # noqa: E731
        want = ops.adam_step(cpu(p), cpu(grads), cpu(m), cpu(v), cpu(vmax), cpu(model), step.cpu(), gs.cpu(),
                             yes.cpu(), **kw)
        for a, b in zip(new[0] + new[1] + new[2], want[0] + want[1] + want[2]):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
        want_d = ops.adam_update(cpu(p), cpu(grads), cpu(m), cpu(v), cpu(vmax), step.cpu(), gs.cpu(), **kw)[0]
        for a, b in zip(d, want_d):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
        if k == 1:  # without params: the in-place step from zeros
            nowd = dict(kw, weight_decay=0.0)
            Z, MZ, VZ = [torch.zeros_like(t) for t in p], [t.clone() for t in m], [t.clone() for t in v]
            VMZ, SZ = [t.clone() for t in vmax] if ams else None, step.clone()
            ops.adam_step_(Z, grads, MZ, VZ, VMZ, None, SZ, gs, yes, **nowd)
            d0, m0, v0, vmax0, _ = ops.adam_update(None, grads, m, v, vmax, step, gs, **nowd)
            _gpu_same_bits(d0 + m0 + v0 + vmax0, Z + MZ + VZ + (VMZ or []))
        p, m, v, vmax, model, step = new[0], new[1], new[2], new[3] if ams else None, new[4], new[5]
    assert float(step) == 2.0


@needs_cuda
@pytest.mark.parametrize("grads_kind", list(GRAD_MIXES))
@pytest.mark.parametrize("case", SGD_CASES, ids=["momentum-damp-wd", "nesterov", "plain-max"])
def test_cuda_pure_sgd_step_and_update_are_the_in_place_step_bit_for_bit(cuda_backend, case, grads_kind):
    gen = _gen(22)
    mom = case["momentum"] != 0
    p = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float32])
    bufs = [torch.zeros_like(t) for t in p] if mom else None
    model = _gpu_leaves(UPDATE_SHAPES, gen, [torch.bfloat16, torch.float16])
    step = torch.zeros((), device="cuda")
    for k in range(2):
        grads = _gpu_leaves(UPDATE_SHAPES, gen, GRAD_MIXES[grads_kind], 8.0)
        gs, yes = torch.tensor(0.125, device="cuda"), torch.tensor(True, device="cuda")
        inputs = [t for ts in (p, bufs or [], model, [step]) for t in ts]
        before = [t.clone() for t in inputs]
        P, B = [t.clone() for t in p], [t.clone() for t in bufs] if mom else None
        MODEL, STEP = [t.clone() for t in model], step.clone()
        ops.sgd_step_(P, grads, B, MODEL, STEP, gs, yes, **case)
        new = ops.sgd_step(p, grads, bufs, model, step, gs, yes, **case)
        _gpu_same_bits(new[0] + new[1] + new[2] + [new[3]], P + (B or []) + MODEL + [STEP])
        d, nb, nstep = ops.sgd_update(p, grads, bufs, step, gs, **case)
        _gpu_same_bits(d + nb + [nstep], [a - b for a, b in zip(P, p)] + (B or []) + [STEP])
        _gpu_same_bits(inputs, before)
        cpu = lambda ts: None if ts is None else [t.cpu() for t in ts]  # noqa: E731
        want = ops.sgd_step(cpu(p), cpu(grads), cpu(bufs), cpu(model), step.cpu(), gs.cpu(), yes.cpu(), **case)
        for a, b in zip(new[0] + new[1], want[0] + want[1]):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
        if k == 1:
            nowd = dict(case, weight_decay=0.0)
            Z, BZ, SZ = [torch.zeros_like(t) for t in p], [t.clone() for t in bufs] if mom else None, step.clone()
            ops.sgd_step_(Z, grads, BZ, None, SZ, gs, yes, **nowd)
            d0, b0, _ = ops.sgd_update(None, grads, bufs, step, gs, **nowd)
            _gpu_same_bits(d0 + b0, Z + (BZ or []))
        p, bufs, model, step = new[0], new[1] if mom else None, new[2], new[3]
    assert float(step) == 2.0


# The pure steps' new state lists and updates on CUDA: each list one block of the caching
# allocator, its views tiling it exactly in list order (no padding: the layout of
# ampfunc.flat's CUDA views, so the glue merges them back into one range next step); new
# params stay separate tensors; every view its own version counter.

PACK_SHAPES = [(0,), (1,), (7,), (33, 5), (3 * CHUNK + 17,), (2,), (4, 4)]


def _assert_packed(ts, dtype=torch.float32):
    base = ts[0].untyped_storage().data_ptr()
    offset = 0
    for t, shape in zip(ts, PACK_SHAPES, strict=True):
        assert t.device.type == "cuda" and t.dtype == dtype and t.shape == shape and t.is_contiguous()
        assert t.untyped_storage().data_ptr() == base and t.storage_offset() == offset
        offset += t.numel()
    assert ts[0].untyped_storage().nbytes() == offset * ts[0].element_size()  # tiles it exactly
    return base


def _assert_own_versions(ts):
    before = [t._version for t in ts]
    ts[2].add_(0.0)
    assert [t._version for t in ts] == [v + (i == 2) for i, v in enumerate(before)]


def _assert_separate(ts):
    ptrs = [t.untyped_storage().data_ptr() for t in ts]
    assert len(set(ptrs)) == len(ptrs)


@needs_cuda
@pytest.mark.parametrize("amsgrad", [False, True])
def test_cuda_pure_adam_state_and_updates_are_one_block_per_list(cuda_backend, amsgrad):
    g = torch.Generator().manual_seed(41)
    cpu = dict(p=[torch.randn(s, generator=g) for s in PACK_SHAPES],
               g=[torch.randn(s, generator=g).to(torch.bfloat16) for s in PACK_SHAPES],
               m=[torch.randn(s, generator=g) * 0.01 for s in PACK_SHAPES],
               v=[torch.rand(s, generator=g) * 0.01 for s in PACK_SHAPES],
               vmax=[torch.rand(s, generator=g) * 0.02 for s in PACK_SHAPES])
    gpu = {k: [t.cuda() for t in ts] for k, ts in cpu.items()}
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, decoupled_weight_decay=True)
    one = torch.tensor(True)
    step, gs = torch.tensor(3.0), torch.tensor(0.5)
    for dev, d in (("cpu", cpu), ("cuda", gpu)):
        d["step"] = ops.adam_step(d["p"], d["g"], d["m"], d["v"], d["vmax"] if amsgrad else None, None,
                                  step.to(dev), gs.to(dev), one.to(dev), **kw)
        d["update"] = ops.adam_update(d["p"], d["g"], d["m"], d["v"], d["vmax"] if amsgrad else None, step.to(dev),
                                      gs.to(dev), **kw)
    new_p, new_m, new_v, new_vmax, _, _ = gpu["step"]
    lists = [new_m, new_v] + ([new_vmax] if amsgrad else [])
    upd = gpu["update"]
    lists += [upd[0], upd[1], upd[2]] + ([upd[3]] if amsgrad else [])
    blocks = [_assert_packed(ts) for ts in lists]
    assert len(set(blocks)) == len(blocks)  # one block per list
    _assert_separate(new_p)                   # new params: separate tensors
    for ts in lists:
        _assert_own_versions(ts)
    # values against the CPU kernels (fp32 rounding apart), the second step reading the packed
    # state (its lists merge into one range) included
    for got, want in zip(gpu["step"][:3] + gpu["update"][:3], cpu["step"][:3] + cpu["update"][:3]):
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6)
    for dev, d in (("cpu", cpu), ("cuda", gpu)):
        p1, m1, v1, vm1 = d["step"][:4]
        d["again"] = ops.adam_step(p1, d["g"], m1, v1, vm1 if amsgrad else None, None, d["step"][5], gs.to(dev),
                                   one.to(dev), **kw)
    for got, want in zip(gpu["again"][:3], cpu["again"][:3]):
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6)
    _assert_packed(gpu["again"][1])


@needs_cuda
def test_cuda_pure_sgd_state_and_updates_are_one_block_per_list(cuda_backend):
    g = torch.Generator().manual_seed(42)
    cpu = dict(p=[torch.randn(s, generator=g) for s in PACK_SHAPES],
               g=[torch.randn(s, generator=g).to(torch.float16) for s in PACK_SHAPES],
               b=[torch.randn(s, generator=g) * 0.1 for s in PACK_SHAPES])
    gpu = {k: [t.cuda() for t in ts] for k, ts in cpu.items()}
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    one, step, gs = torch.tensor(True), torch.tensor(3.0), torch.tensor(0.5)
    for dev, d in (("cpu", cpu), ("cuda", gpu)):
        d["step"] = ops.sgd_step(d["p"], d["g"], d["b"], None, step.to(dev), gs.to(dev), one.to(dev), **kw)
        d["update"] = ops.sgd_update(d["p"], d["g"], d["b"], step.to(dev), gs.to(dev), **kw)
    new_p, new_b, _, _ = gpu["step"]
    upd, upd_b, _ = gpu["update"]
    blocks = [_assert_packed(ts) for ts in (new_b, upd, upd_b)]
    assert len(set(blocks)) == 3
    _assert_separate(new_p)
    for ts in (new_b, upd, upd_b):
        _assert_own_versions(ts)
    for got, want in zip(gpu["step"][:2] + gpu["update"][:2], cpu["step"][:2] + cpu["update"][:2]):
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6)


@needs_cuda
def test_cuda_pure_skipped_step_returns_the_inputs_bit_for_bit(cuda_backend):
    gen = _gen(23)
    p = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float32])
    m = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float32])
    v = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float32], positive=True)
    vmax = [x + 1 for x in v]
    model = _gpu_leaves(UPDATE_SHAPES, gen, [torch.float16, torch.bfloat16])
    model[2].view(torch.int16)[0] = 0x7D01  # fp16 signalling NaN with a payload: copied, not converted
    grads = _gpu_leaves(UPDATE_SHAPES, gen, DTYPES)
    _poison(grads[-1].view(-1), gen, 3)
    gs, no, step = torch.ones((), device="cuda"), torch.tensor(False, device="cuda"), torch.tensor(5.0, device="cuda")
    new = ops.adam_step(p, grads, m, v, vmax, model, step, gs, no, lr=1e-2, amsgrad=True, weight_decay=0.1,
                        decoupled_weight_decay=True)
    _gpu_same_bits(new[0] + new[1] + new[2] + new[3] + new[4] + [new[5]], p + m + v + vmax + model + [step])
    new = ops.sgd_step(p, grads, m, model, step, gs, no, lr=0.1, momentum=0.9, weight_decay=0.1)
    _gpu_same_bits(new[0] + new[1] + new[2] + [new[3]], p + m + model + [step])


@needs_cuda
def test_cuda_steps_over_empty_leaves_only_move_the_step(cuda_backend):
    # a dtype group whose leaves are all empty launches nothing (its pointer arrays are empty)
    e = [torch.empty(0, device="cuda"), torch.empty(0, 3, device="cuda")]
    ge = [torch.empty(0, device="cuda", dtype=torch.bfloat16), torch.empty(0, 3, device="cuda")]
    gs, yes, no = torch.ones((), device="cuda"), torch.tensor(True, device="cuda"), torch.tensor(False, device="cuda")
    for finite, moved in ((yes, 1.0), (no, 0.0)):
        step = torch.zeros((), device="cuda")
        ops.adam_step_(e, ge, e, e, e, e, step, gs, finite, lr=0.1, amsgrad=True)
        ops.sgd_step_(e, ge, e, e, step, gs, finite, lr=0.1, momentum=0.9)
        assert float(step) == 2 * moved
        assert float(ops.adam_step(e, ge, e, e, e, e, step, gs, finite, lr=0.1, amsgrad=True)[5]) == 3 * moved
        assert float(ops.sgd_step(e, ge, e, e, step, gs, finite, lr=0.1, momentum=0.9)[3]) == 3 * moved
    assert float(ops.adam_update(e, ge, e, e, e, step, gs, lr=0.1, amsgrad=True)[4]) == 1.0
    assert float(ops.sgd_update(e, ge, e, step, gs, lr=0.1, momentum=0.9)[2]) == 1.0


@needs_cuda
@pytest.mark.parametrize("p_dtype", DTYPES)
def test_cuda_apply_updates_matches_the_cpu_bit_for_bit(p_dtype):
    p_cpu, p_gpu = _pair(UPDATE_SHAPES, 6, 1.0, p_dtype)
    u_cpu, u_gpu = _pair(UPDATE_SHAPES, 7, 1e-3)
    for a, b in zip(ops.apply_updates(p_gpu, u_gpu), ops.apply_updates(p_cpu, u_cpu)):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b)


@needs_cuda
def test_cuda_validation_refuses_before_writing_with_the_cpu_message():
    p = [torch.ones(3, 4, device="cuda"), torch.ones(5, device="cuda")]
    m = [torch.zeros(3, 4, device="cuda"), torch.zeros(5, device="cuda")]
    v = [torch.zeros(3, 4, device="cuda"), m[1]]  # aliases exp_avgs[1]
    args = (p, [torch.ones(3, 4, device="cuda"), torch.ones(5, device="cuda")], m, v, None, None,
            torch.zeros((), device="cuda"), torch.ones((), device="cuda"),
            torch.ones((), dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match=r"^ampfunc: exp_avgs\[1\] and exp_avg_sqs\[1\] overlap in memory"):
        ops.adam_step_(*args, lr=0.1)
    assert all(bool((x == 1).all()) for x in p) and all(bool((x == 0).all()) for x in m)
    with pytest.raises(ValueError, match=r"^ampfunc: tensors\[1\] is on cpu but the call's tensors are on cuda:0"):
        ops.check_norm([p[0], torch.ones(5)])


# ----------------------------------------------------------------------------------------------
# Lion: the generic optimizers' CUDA kernel (ext/cuda/optimizers.cu), against the reference twin
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_on_cuda_is_the_reference_twin_in_place_out_of_place_and_as_an_update(grad_dtype, weight_decay):
    gen = torch.Generator().manual_seed(7)
    sizes = [1, 7, 4099, CHUNK, 3 * CHUNK + 17] + [1 + i % 50 for i in range(300)]
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
    mus = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
    model = [p.bfloat16() for p in params]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=weight_decay)
    cuda = lambda ts: [t.cuda() for t in ts]  # noqa: E731
    for finite in (True, False):
        rp, rm, rmodel, rstep = [p.clone() for p in params], [m.clone() for m in mus], [x.clone() for x in model], \
            torch.tensor(3.0)
        ops._REFERENCE["lion_step_"](rp, grads, rm, rmodel, rstep, torch.tensor(0.5), torch.tensor(finite), kw["lr"],
                                     None, 0.9, 0.99, weight_decay)
        cp, cm, cmodel, cstep = cuda(params), cuda(mus), cuda(model), torch.tensor(3.0, device="cuda")
        new = ops.lion_step(cp, cuda(grads), cm, cmodel, cstep, torch.tensor(0.5, device="cuda"),
                            torch.tensor(finite, device="cuda"), **kw)
        ops.lion_step_(cp, cuda(grads), cm, cmodel, cstep, torch.tensor(0.5, device="cuda"),
                       torch.tensor(finite, device="cuda"), **kw)
        for got, want in zip(cp + cm + new[0] + new[1], rp + rm + rp + rm):
            assert torch.allclose(got.cpu(), want, rtol=1e-6, atol=1e-7)
        for got in (cmodel, new[2]):
            assert all(torch.allclose(a.cpu().float(), b.float(), rtol=1e-2, atol=0) for a, b in zip(got, rmodel))
        assert cstep.item() == new[3].item() == rstep.item() == (4.0 if finite else 3.0)
    d, m, s = ops.lion_update(cuda(params), cuda(grads), cuda(mus), torch.tensor(3.0, device="cuda"), **kw)
    rd, rm2, rs = ops._REFERENCE["lion_update"](params, grads, mus, torch.tensor(3.0), torch.ones(()), kw["lr"], None,
                                                0.9, 0.99, weight_decay)
    for got, want in zip(d + m, rd + rm2):
        assert torch.allclose(got.cpu(), want, rtol=1e-6, atol=1e-7)
    assert s.item() == rs.item() == 4.0
