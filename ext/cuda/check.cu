// Read-only check pass: the non-finite flag and the sum of squares in one read of the
// gradients, with optional per-leaf non-finite flags.
//
// The sum cannot overflow while every element is finite (the CPU kernel's guarantee): each
// block sums its chunk in fp32 (the memory-bound hot loop), and a block whose fp32 sum
// overflows while all its elements are finite reads its chunk a second time and sums it in
// double (rare: it takes squares near fp32's limit). Block partials are doubles; one final
// block adds them in index order, in double, so the result is deterministic run to run (no
// atomics decide the rounding) and the norm is taken from the double sum.
#include <math.h>

#include "mta.cuh"

namespace ampfunc {
namespace cuda {
namespace {

constexpr int kDepthCheck = 1;
constexpr int kFinalThreads = 1024;

struct CheckArgs {
  const float* scale;        // optional multiplier before squaring
  double* partial_sum;       // [total blocks]
  float* partial_bad;        // [total blocks], 1.0f where the block saw a non-finite value
  uint8_t* leaf_nonfinite;   // optional [n]
};

// The square of x in fp32 as the hot loop takes it (y = fp32(x * s)), widened to double.
__device__ __forceinline__ double square_in_double(float v, float s) {
  const double y = static_cast<double>(v * s);
  return y * y;
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
check_kernel(const __grid_constant__ TensorListMeta<kDepthCheck> meta, const CheckArgs args) {
  __shared__ float smem[kBlock / 32];
  __shared__ double smem_d[kBlock / 32];
  const BlockWork<kDepthCheck> w = block_work(meta);
  const T* x = static_cast<const T*>(meta.ptr[0][w.slot]) + w.start;
  const float s = args.scale ? *args.scale : 1.0f;

  float acc = 0.0f;
  bool bad = false;
  if (vec_aligned<T>(x)) {
    const int nvec = w.len / kVec;
    // Two independent 4-wide loads in flight per thread per iteration.
    int i = threadIdx.x;
    for (; i + kBlock < nvec; i += 2 * kBlock) {
      float a[kVec], b[kVec];
      load4(x + (int64_t)i * kVec, a);
      load4(x + (int64_t)(i + kBlock) * kVec, b);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        bad |= !is_finite(a[k]) | !is_finite(b[k]);
        const float ya = a[k] * s, yb = b[k] * s;
        acc += ya * ya;
        acc += yb * yb;
      }
    }
    for (; i < nvec; i += kBlock) {
      float a[kVec];
      load4(x + (int64_t)i * kVec, a);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        bad |= !is_finite(a[k]);
        const float ya = a[k] * s;
        acc += ya * ya;
      }
    }
    for (int j = nvec * kVec + threadIdx.x; j < w.len; j += kBlock) {
      const float v = to_float(x[j]);
      bad |= !is_finite(v);
      const float y = v * s;
      acc += y * y;
    }
  } else {
    for (int j = threadIdx.x; j < w.len; j += kBlock) {
      const float v = to_float(x[j]);
      bad |= !is_finite(v);
      const float y = v * s;
      acc += y * y;
    }
  }

  const bool block_bad = __syncthreads_or(bad) != 0;
  const float total = block_sum(acc, smem);
  // Every element finite but the fp32 sum overflowed (squares are >= 0, so any overflow on
  // the way shows as an infinite total): the whole block sums its chunk again in double.
  // Thread 0 holds the total; the barrier hands its verdict to every thread.
  const bool redo = __syncthreads_or(threadIdx.x == 0 && !block_bad && !is_finite(total)) != 0;
  double partial = static_cast<double>(total);
  if (redo) {
    double acc_d = 0.0;
    for (int j = threadIdx.x; j < w.len; j += kBlock) acc_d += square_in_double(to_float(x[j]), s);
    partial = block_sum(acc_d, smem_d);
  }
  if (threadIdx.x == 0) {
    const int64_t g = meta.block_base + blockIdx.x;
    args.partial_sum[g] = partial;
    args.partial_bad[g] = block_bad ? 1.0f : 0.0f;
    if (block_bad && args.leaf_nonfinite) args.leaf_nonfinite[meta.leaf[w.slot]] = 1;
  }
}

// One block: adds the partials in index order (each thread a strided run, in double, then a
// fixed tree) and writes or combines the results; the fp32 sum and the norm are rounded once
// from the combined double.
__global__ void __launch_bounds__(kFinalThreads)
check_finalize_kernel(const double* partial_sum, const float* partial_bad, int64_t count, uint8_t* finite,
                      double* sumsq, float* sumsq_f32, float* norm, int accumulate) {
  __shared__ double ssum[kFinalThreads];
  __shared__ float sbad[kFinalThreads];
  double acc = 0.0;
  float bad = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += kFinalThreads) {
    acc += partial_sum[i];
    bad = fmaxf(bad, partial_bad[i]);
  }
  ssum[threadIdx.x] = acc;
  sbad[threadIdx.x] = bad;
  __syncthreads();
  for (int stride = kFinalThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      ssum[threadIdx.x] += ssum[threadIdx.x + stride];
      sbad[threadIdx.x] = fmaxf(sbad[threadIdx.x], sbad[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const bool all_finite = sbad[0] == 0.0f;
    const double total = accumulate && sumsq ? *sumsq + ssum[0] : ssum[0];
    if (finite) *finite = accumulate ? static_cast<uint8_t>(*finite != 0 && all_finite) : static_cast<uint8_t>(all_finite);
    if (sumsq) *sumsq = total;
    if (sumsq_f32) *sumsq_f32 = static_cast<float>(total);
    if (norm) *norm = static_cast<float>(sqrt(total));
  }
}

int64_t total_blocks(int n, const int64_t* numels) {
  int64_t blocks = 0;
  for (int i = 0; i < n; ++i)
    if (numels[i] > 0) blocks += num_chunks(numels[i]);
  return blocks;
}

// Workspace: the double partials, then the float flags (doubles first keeps both aligned).
constexpr int64_t kBytesPerBlock = static_cast<int64_t>(sizeof(double) + sizeof(float));

}  // namespace
}  // namespace cuda
}  // namespace ampfunc

using namespace ampfunc::cuda;

extern "C" int64_t ampfunc_cuda_check_workspace_bytes(int n, const int64_t* numels) {
  if (n < 0 || (n > 0 && numels == nullptr)) return 0;
  return total_blocks(n, numels) * kBytesPerBlock;
}

extern "C" int ampfunc_cuda_check(int n, const void* const* tensors, const int64_t* numels, int dtype,
                                  const float* scale, uint8_t* finite, double* sumsq, float* sumsq_f32, float* norm,
                                  uint8_t* leaf_nonfinite, void* workspace, int64_t workspace_bytes, int accumulate,
                                  cudaStream_t stream) {
  if (n < 0 || !valid_dtype(dtype) || (n > 0 && (tensors == nullptr || numels == nullptr))) return cudaErrorInvalidValue;
  // Combining needs the running double sum: the fp32 results alone cannot carry it.
  if (accumulate && (sumsq_f32 || norm) && !sumsq) return cudaErrorInvalidValue;
  const int64_t blocks = total_blocks(n, numels);
  if (blocks > 0 && (workspace == nullptr || workspace_bytes < blocks * kBytesPerBlock ||
                     reinterpret_cast<uintptr_t>(workspace) % alignof(double) != 0))
    return cudaErrorInvalidValue;

  if (leaf_nonfinite && n > 0) {
    cudaError_t err = cudaMemsetAsync(leaf_nonfinite, 0, static_cast<size_t>(n), stream);
    if (err != cudaSuccess) return err;
  }
  CheckArgs args;
  args.scale = scale;
  args.partial_sum = static_cast<double*>(workspace);
  args.partial_bad = blocks > 0 ? reinterpret_cast<float*>(static_cast<double*>(workspace) + blocks) : nullptr;
  args.leaf_nonfinite = leaf_nonfinite;

  if (blocks > 0) {
    void* const* lists[kDepthCheck] = {const_cast<void* const*>(tensors)};
    cudaError_t err = dispatch_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      return multi_tensor_apply<kDepthCheck>(n, numels, lists, [&](const TensorListMeta<kDepthCheck>& meta, int nb) {
        check_kernel<T><<<nb, kBlock, 0, stream>>>(meta, args);
        return cudaGetLastError();
      });
    });
    if (err != cudaSuccess) return err;
  }
  if (finite || sumsq || sumsq_f32 || norm) {
    check_finalize_kernel<<<1, kFinalThreads, 0, stream>>>(args.partial_sum, args.partial_bad, blocks, finite, sumsq,
                                                          sumsq_f32, norm, accumulate);
    return cudaGetLastError();
  }
  return cudaSuccess;
}
