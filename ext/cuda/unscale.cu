// Unscale with a non-finite check, as torch._amp_foreach_non_finite_check_and_unscale_ but for
// bf16 too and with an fp32 out-of-place variant: out = x * inv_scale in fp32, finiteness
// judged on the input. The flag is cleared (never set) by the kernels, one store per block
// that saw a non-finite value, so calls compose and no atomics are needed.
#include "mta.cuh"

namespace ampfunc {
namespace cuda {
namespace {

constexpr int kDepthUnscale = 2;  // list 0: input, list 1: output (NULL slot = in place)

struct UnscaleArgs {
  const float* inv_scale;
  uint8_t* finite;
};

__device__ __forceinline__ float unscale_value(float x, float inv) {
  // torch leaves values untouched when the factor is exactly 1.
  return inv == 1.0f ? x : x * inv;
}

template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kBlock)
unscale_kernel(const __grid_constant__ TensorListMeta<kDepthUnscale> meta, const UnscaleArgs args) {
  const BlockWork<kDepthUnscale> w = block_work(meta);
  const TIn* x = static_cast<const TIn*>(meta.ptr[0][w.slot]) + w.start;
  void* out_base = meta.ptr[1][w.slot] ? meta.ptr[1][w.slot] : meta.ptr[0][w.slot];
  TOut* y = static_cast<TOut*>(out_base) + w.start;
  const float inv = *args.inv_scale;

  bool bad = false;
  if (vec_aligned<TIn>(x) && vec_aligned<TOut>(y)) {
    const int nvec = w.len / kVec;
    for (int i = threadIdx.x; i < nvec; i += kBlock) {
      float v[kVec];
      load4(x + (int64_t)i * kVec, v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        bad |= !is_finite(v[k]);
        v[k] = unscale_value(v[k], inv);
      }
      store4(y + (int64_t)i * kVec, v);
    }
    for (int j = nvec * kVec + threadIdx.x; j < w.len; j += kBlock) {
      const float v = to_float(x[j]);
      bad |= !is_finite(v);
      y[j] = from_float<TOut>(unscale_value(v, inv));
    }
  } else {
    for (int j = threadIdx.x; j < w.len; j += kBlock) {
      const float v = to_float(x[j]);
      bad |= !is_finite(v);
      y[j] = from_float<TOut>(unscale_value(v, inv));
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0 && args.finite) *args.finite = 0;
}

template <bool kInPlace>
int launch_unscale(int n, const void* const* tensors, void* const* outs, const int64_t* numels, int dtype,
                   const float* inv_scale, uint8_t* finite, int accumulate, cudaStream_t stream) {
  if (n < 0 || !valid_dtype(dtype) || inv_scale == nullptr ||
      (n > 0 && (tensors == nullptr || numels == nullptr || (!kInPlace && outs == nullptr))))
    return cudaErrorInvalidValue;
  if (finite && !accumulate) {
    cudaError_t err = cudaMemsetAsync(finite, 1, 1, stream);
    if (err != cudaSuccess) return err;
  }
  UnscaleArgs args{inv_scale, finite};
  void* const* lists[kDepthUnscale] = {const_cast<void* const*>(tensors), kInPlace ? nullptr : outs};
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using TOut = typename std::conditional<kInPlace, T, float>::type;
    return multi_tensor_apply<kDepthUnscale>(n, numels, lists, [&](const TensorListMeta<kDepthUnscale>& meta, int nb) {
      unscale_kernel<T, TOut><<<nb, kBlock, 0, stream>>>(meta, args);
      return cudaGetLastError();
    });
  });
}

}  // namespace
}  // namespace cuda
}  // namespace ampfunc

using namespace ampfunc::cuda;

extern "C" int ampfunc_cuda_unscale_(int n, void* const* tensors, const int64_t* numels, int dtype,
                                     const float* inv_scale, uint8_t* finite, int accumulate, cudaStream_t stream) {
  return launch_unscale<true>(n, tensors, nullptr, numels, dtype, inv_scale, finite, accumulate, stream);
}

extern "C" int ampfunc_cuda_unscale(int n, const void* const* tensors, void* const* outs, const int64_t* numels,
                                    int dtype, const float* inv_scale, uint8_t* finite, int accumulate,
                                    cudaStream_t stream) {
  return launch_unscale<false>(n, tensors, outs, numels, dtype, inv_scale, finite, accumulate, stream);
}
