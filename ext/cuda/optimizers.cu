// The generic optimizers' CUDA kernels (ext/optimizers.h): one multi-tensor-apply kernel per
// optimizer, dtype pair and destination, running the optimizer's element function (shared with
// the CPU kernel) on each element of its chunk; one launcher per optimizer,
// ampfunc_cuda_optim_<name> (ext/cuda/ampfunc_cuda.h).
#include <math.h>

#include "../optimizers.h"
#include "mta.cuh"

namespace ampfunc {
namespace cuda {
namespace {

struct OptimArgs {
  const float* grad_scale;
  const uint8_t* finite;
  const float* lr_tensor;
  const float* step;
  double lr;
  double hyper[AMPFUNC_OPTIM_MAX_HYPERS];
};

template <class Op>
struct OptimLayout {
  static constexpr int S = Op::kState;
  static constexpr int kDepth = 5 + 2 * S;
  static constexpr int g = 0, p = 1, s = 2, model_in = 2 + S, p_out = 3 + S, s_out = 4 + S, model_out = 4 + 2 * S;
};

template <typename T>
__device__ __forceinline__ T* at_chunk(void* base, int64_t start) {
  return base ? static_cast<T*>(base) + start : nullptr;
}

// kDest: 0 in place, 1 out of place, 2 delta (ampfunc_cuda.h).
template <class Op, typename TG, typename TM, int kDest>
__global__ void __launch_bounds__(kBlock)
optim_kernel(const __grid_constant__ TensorListMeta<OptimLayout<Op>::kDepth> meta, const OptimArgs args) {
  using L = OptimLayout<Op>;
  constexpr int S = Op::kState;
  const BlockWork<L::kDepth> w = block_work(meta);
  const int slot = w.slot;
  const TG* gp = at_chunk<const TG>(meta.ptr[L::g][slot], w.start);
  const float* pp = at_chunk<const float>(meta.ptr[L::p][slot], w.start);
  float* po = at_chunk<float>(meta.ptr[L::p_out][slot], w.start);
  const float* sp[S > 0 ? S : 1];
  float* so[S > 0 ? S : 1];
#pragma unroll
  for (int k = 0; k < S; ++k) {
    sp[k] = at_chunk<const float>(meta.ptr[L::s + k][slot], w.start);
    so[k] = at_chunk<float>(meta.ptr[L::s_out + k][slot], w.start);
  }
  const TM* mi = at_chunk<const TM>(meta.ptr[L::model_in][slot], w.start);
  TM* mo = at_chunk<TM>(meta.ptr[L::model_out][slot], w.start);
  if (args.finite != nullptr && *args.finite == 0) {  // the skipped step, before any other write
    if constexpr (kDest != 0) {  // in place, nothing is written; out of place, the inputs are copied
      for (int j = threadIdx.x; j < w.len; j += kBlock) {
        if (po) po[j] = kDest == 2 ? 0.0f : pp[j];
#pragma unroll
        for (int k = 0; k < S; ++k) {
          if (so[k]) so[k][j] = sp[k][j];
        }
        if (kDest == 1 && mo) mo[j] = mi[j];
      }
    }
    return;
  }
  __shared__ typename Op::Scalars shared_scalars;
  if (threadIdx.x == 0) {
    const double lr = args.lr_tensor ? static_cast<double>(*args.lr_tensor) : args.lr;
    shared_scalars = Op::scalars(args.hyper, args.grad_scale ? *args.grad_scale : 1.0f, lr,
                                 static_cast<double>(*args.step) + 1.0, false);
  }
  __syncthreads();
  const typename Op::Scalars c = shared_scalars;
  for (int j = threadIdx.x; j < w.len; j += kBlock) {
    const float p0 = pp ? pp[j] : 0.0f;
    float p = p0;
    float s[S > 0 ? S : 1];
#pragma unroll
    for (int k = 0; k < S; ++k) s[k] = sp[k] ? sp[k][j] : 0.0f;
    Op::element(to_float(gp[j]), p, s, c);
#pragma unroll
    for (int k = 0; k < S; ++k) {
      if (so[k]) so[k][j] = s[k];
    }
    if (kDest == 2) {
      po[j] = __fsub_rn(p, p0);  // new_p - p, one rounding (torch's sub)
    } else {
      po[j] = p;
      if (mo) mo[j] = from_float<TM>(p);
    }
  }
}

__global__ void optim_finish_step(const float* step, float* step_out, const uint8_t* finite) {
  const bool taken = finite == nullptr || *finite != 0;
  if (step_out == step) {
    if (taken) *step_out += 1.0f;
  } else {
    *step_out = taken ? *step + 1.0f : *step;
  }
}

template <class Op, int kDest>
cudaError_t run_optim(const AmpfuncOptimLaunch& a, const OptimArgs& args, cudaStream_t stream) {
  constexpr int kDepth = OptimLayout<Op>::kDepth;
  const bool has_copy = a.lists[OptimLayout<Op>::model_out] != nullptr;
  return dispatch_dtype(a.grad_dtype, [&](auto g) {
    return dispatch_dtype(has_copy ? a.model_dtype : AMPFUNC_FP32, [&](auto m) {
      using TG = decltype(g);
      using TM = decltype(m);
      return multi_tensor_apply<kDepth>(a.n, a.numels, a.lists, [&](const TensorListMeta<kDepth>& meta, int nb) {
        optim_kernel<Op, TG, TM, kDest><<<nb, kBlock, 0, stream>>>(meta, args);
        return cudaGetLastError();
      });
    });
  });
}

template <class Op>
int launch_optim(const AmpfuncOptimLaunch* a, cudaStream_t stream) {
  static_assert(OptimLayout<Op>::kDepth <= AMPFUNC_OPTIM_MAX_LISTS, "too many lists for AmpfuncOptimLaunch");
  static_assert(Op::kHypers <= AMPFUNC_OPTIM_MAX_HYPERS, "too many hyper-parameters for AmpfuncOptimLaunch");
  static_assert(fits_kernel_params<OptimLayout<Op>::kDepth, OptimArgs>(), "optimizer arguments too large");
  if (a == nullptr || a->step == nullptr || a->n < 0 || !valid_dtype(a->grad_dtype)) return cudaErrorInvalidValue;
  if (a->lists[OptimLayout<Op>::model_out] && !valid_dtype(a->model_dtype)) return cudaErrorInvalidValue;
  if (a->n > 0 && (a->numels == nullptr || a->lists[0] == nullptr || a->lists[OptimLayout<Op>::p_out] == nullptr))
    return cudaErrorInvalidValue;
  OptimArgs args;
  args.grad_scale = a->grad_scale;
  args.finite = a->finite;
  args.lr_tensor = a->lr_tensor;
  args.step = a->step;
  args.lr = a->lr;
  for (int k = 0; k < AMPFUNC_OPTIM_MAX_HYPERS; ++k) args.hyper[k] = a->hyper[k];
  cudaError_t err = cudaSuccess;
  if (a->n > 0) {
    switch (a->dest) {
      case 0: err = run_optim<Op, 0>(*a, args, stream); break;
      case 1: err = run_optim<Op, 1>(*a, args, stream); break;
      case 2: err = run_optim<Op, 2>(*a, args, stream); break;
      default: return cudaErrorInvalidValue;
    }
  }
  if (err != cudaSuccess || a->step_out == nullptr) return err;
  optim_finish_step<<<1, 1, 0, stream>>>(a->step, a->step_out, a->finite);
  return cudaGetLastError();
}

}  // namespace
}  // namespace cuda
}  // namespace ampfunc

#define AMPFUNC_CUDA_LAUNCHER(name, Op)                                                                 \
  extern "C" int ampfunc_cuda_optim_##name(const AmpfuncOptimLaunch* launch, cudaStream_t stream) { \
    return ampfunc::cuda::launch_optim<Op>(launch, stream);                                             \
  }
AMPFUNC_OPTIMIZERS(AMPFUNC_CUDA_LAUNCHER)
#undef AMPFUNC_CUDA_LAUNCHER
