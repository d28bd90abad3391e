// Shared machinery of the ampfunc CUDA kernels: dtype traits, 4-wide loads and stores,
// the multi-tensor-apply argument block and its host-side packer, block reductions.
// Torch-free: only the CUDA runtime and cuda_fp16/cuda_bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "ampfunc_cuda.h"

namespace ampfunc {
namespace cuda {

constexpr int kBlock = 512;                 // threads per block
constexpr int kChunk = AMPFUNC_CUDA_CHUNK;  // elements per block
constexpr int kVec = 4;                     // elements per thread per access
static_assert(kChunk % kVec == 0, "chunks must keep vector alignment");

// Kernel-argument budget. CUDA 12.1+ allows 32764 bytes of kernel parameters on sm_70+ (both
// our targets), which lets one launch cover hundreds of small leaves instead of ~30; older
// toolkits keep the classic 4 KB. Define AMPFUNC_CUDA_SMALL_PARAMS to force the 4 KB layout.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010 && !defined(AMPFUNC_CUDA_SMALL_PARAMS)
constexpr int kParamBytes = 32764;  // the hardware/toolkit limit on one launch's arguments
constexpr int kMetaBytes = 30000;   // leaves ~2.7 KB for the other kernel arguments
constexpr int kMaxBlocks = 2048;
#else
constexpr int kParamBytes = 4096;
constexpr int kMetaBytes = 3600;
constexpr int kMaxBlocks = 256;
#endif

// How many leaves fit in one argument block next to kMaxBlocks block descriptors:
// per leaf, DEPTH pointers + an int64 element count + an int32 leaf index.
template <int DEPTH>
struct MetaLimits {
  static constexpr int kMaxTensors =
      (kMetaBytes - 8 - kMaxBlocks * (int)(sizeof(int32_t) + sizeof(uint16_t))) / (DEPTH * 8 + 8 + 4);
  static_assert(kMaxTensors >= 8 && kMaxTensors < 65535, "argument block too small");
};

// One launch's worth of work: leaves (pointer per list, size, index in the caller's list)
// and, per thread block, which leaf and which chunk of it the block handles.
template <int DEPTH>
struct TensorListMeta {
  static constexpr int kMaxTensors = MetaLimits<DEPTH>::kMaxTensors;
  void* ptr[DEPTH][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t block_base;  // index of this launch's block 0 among all blocks of the call
  int32_t leaf[kMaxTensors];
  int32_t block_chunk[kMaxBlocks];
  uint16_t block_tensor[kMaxBlocks];
};

// Whether a kernel taking (TensorListMeta<DEPTH>, Args) by value stays under the argument
// limit: kMetaBytes bounds the packed fields, alignment padding and Args take the rest.
template <int DEPTH, class Args>
constexpr bool fits_kernel_params() {
  return sizeof(TensorListMeta<DEPTH>) + sizeof(Args) <= static_cast<size_t>(kParamBytes);
}

inline int64_t num_chunks(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// Packs the lists into as few argument blocks as possible and calls
// launch(meta, num_blocks) -> cudaError_t for each (stopping at the first error); blocks are enumerated leaf by leaf, chunk by chunk, so
// meta.block_base + blockIdx.x is a stable global block index (used for reduction partials).
// `lists[d]` may be NULL for an unused list (its pointers are then NULL in the kernel).
template <int DEPTH, class Launch>
cudaError_t multi_tensor_apply(int n, const int64_t* numels, void* const* const* lists, Launch&& launch) {
  constexpr int kMaxT = TensorListMeta<DEPTH>::kMaxTensors;
  TensorListMeta<DEPTH> meta;
  meta.block_base = 0;
  int nt = 0, nb = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t numel = numels[i];
    if (numel <= 0) continue;
    for (int d = 0; d < DEPTH; ++d) meta.ptr[d][nt] = lists[d] ? lists[d][i] : nullptr;
    meta.numel[nt] = numel;
    meta.leaf[nt] = i;
    ++nt;
    const int64_t chunks = num_chunks(numel);
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_tensor[nb] = static_cast<uint16_t>(nt - 1);
      meta.block_chunk[nb] = static_cast<int32_t>(c);
      ++nb;
      const bool last_chunk = c == chunks - 1;
      if (nb == kMaxBlocks || (nt == kMaxT && last_chunk)) {
        const cudaError_t err = launch(meta, nb);
        if (err != cudaSuccess) return err;
        meta.block_base += nb;
        nb = 0;
        if (last_chunk) {
          nt = 0;
        } else {  // the leaf goes on in the next launch: it becomes slot 0
          for (int d = 0; d < DEPTH; ++d) meta.ptr[d][0] = meta.ptr[d][nt - 1];
          meta.numel[0] = meta.numel[nt - 1];
          meta.leaf[0] = meta.leaf[nt - 1];
          nt = 1;
        }
      }
    }
  }
  return nb > 0 ? launch(meta, nb) : cudaSuccess;
}

// ------------------------------------------------------------------------------------------
// Element access: every dtype is read into fp32 and written back rounded to nearest even.
// ------------------------------------------------------------------------------------------

struct alignas(8) half4 {
  __half2 a, b;
};
struct alignas(8) bf164 {
  __nv_bfloat162 a, b;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ void load4(const float* p, float (&o)[kVec]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void load4(const __half* p, float (&o)[kVec]) {
  const half4 v = *reinterpret_cast<const half4*>(p);
  const float2 a = __half22float2(v.a), b = __half22float2(v.b);
  o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&o)[kVec]) {
  const bf164 v = *reinterpret_cast<const bf164*>(p);
  const float2 a = __bfloat1622float2(v.a), b = __bfloat1622float2(v.b);
  o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}

__device__ __forceinline__ void store4(float* p, const float (&v)[kVec]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(__half* p, const float (&v)[kVec]) {
  half4 h;
  h.a = __floats2half2_rn(v[0], v[1]);
  h.b = __floats2half2_rn(v[2], v[3]);
  *reinterpret_cast<half4*>(p) = h;
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float (&v)[kVec]) {
  bf164 h;
  h.a = __floats2bfloat162_rn(v[0], v[1]);
  h.b = __floats2bfloat162_rn(v[2], v[3]);
  *reinterpret_cast<bf164*>(p) = h;
}

// A pointer can take 4-wide accesses when the 4 elements are one naturally aligned vector.
template <typename T>
__device__ __forceinline__ bool vec_aligned(const void* p) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) % (kVec * sizeof(T))) == 0;
}

// Finite test on the bits: immune to fast-math assumptions.
__device__ __forceinline__ bool is_finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The chunk a block works on: leaf slot, element offset into it and element count.
template <int DEPTH>
struct BlockWork {
  int slot;
  int64_t start;
  int len;
};

template <int DEPTH>
__device__ __forceinline__ BlockWork<DEPTH> block_work(const TensorListMeta<DEPTH>& meta) {
  BlockWork<DEPTH> w;
  w.slot = meta.block_tensor[blockIdx.x];
  w.start = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kChunk;
  const int64_t left = meta.numel[w.slot] - w.start;
  w.len = static_cast<int>(left < kChunk ? left : kChunk);
  return w;
}

// Sum over the block in a fixed order (warp shuffles, then warp 0 over the warp sums): the
// same inputs give the same bits on every run. Result valid in thread 0.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* smem /* >= kBlock/32 */) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = (threadIdx.x < (blockDim.x >> 5)) ? smem[lane] : T(0);
  if (warp == 0) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;
}

inline bool valid_dtype(int dtype) {
  return dtype == AMPFUNC_FP32 || dtype == AMPFUNC_FP16 || dtype == AMPFUNC_BF16;
}

// Calls f(T{}) with T the C++ type of a dtype code.
template <class F>
cudaError_t dispatch_dtype(int dtype, F&& f) {
  switch (dtype) {
    case AMPFUNC_FP32: return f(float{});
    case AMPFUNC_FP16: return f(__half{});
    case AMPFUNC_BF16: return f(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace ampfunc
