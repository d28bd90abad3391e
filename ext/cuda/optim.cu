// Fused optimizer steps over fp32 master parameters: unscale (and clip) factor, the update,
// the skip on a non-finite step and the low-precision model copy, in one pass.
//
// Rounding follows torch.optim's single-tensor CUDA path op by op (that path runs one kernel
// per torch op, each of which nvcc contracts a*b+c into one fma): where torch rounds between
// two ops we round too (__fmul_rn / __fadd_rn, which nvcc never contracts), where torch's
// kernel computes a + alpha*b we use one fma. Scalars derived from the hyper-parameters are
// computed in double and rounded to fp32 once, as Python floats are when they reach a kernel.
//
// Each kernel is written once and instantiated for three destinations (Dest): in place (the
// state lists are read and written), out of place (the pure step: separate output lists, a
// skipped step copies the inputs over) and delta (the pure update: updates = new_p - p, the
// new moments in separate lists). The per-element arithmetic is one function shared by all
// three, so the out-of-place results are the in-place ones bit for bit.
#include <math.h>

#include "mta.cuh"
#include "adam_element.cuh"
#include "../optim_scalars.h"

namespace ampfunc {
namespace cuda {
namespace {

// ------------------------------------------------------------------------------------------
// shared pieces
// ------------------------------------------------------------------------------------------

enum class Dest {
  kInPlace,  // outputs are the inputs; a skipped step writes nothing
  kOut,      // outputs are other tensors; a skipped step copies every input to its output
  kDelta,    // the params' output receives new_p - p (p = 0 without params); no model copy;
             // a skipped step writes zero updates and copies the moments
};

// Reads the device scalars once per block; tells whether the block must leave (skipped step).
__device__ __forceinline__ bool step_is_skipped(const uint8_t* finite) {
  return finite != nullptr && *finite == 0;
}

// Once the update kernels have read *step (stream order): in place (step_out == step) adds 1
// when the step was taken; out of place writes step_out = step (+ 1 when taken).
__global__ void finish_step_kernel(const float* step, float* step_out, const uint8_t* finite) {
  const bool taken = finite == nullptr || *finite != 0;
  if (step_out == step) {
    if (taken) *step_out += 1.0f;
  } else {
    *step_out = taken ? *step + 1.0f : *step;
  }
}

// The pointer of list `list` (a compile-time index, -1 for a list the layout lacks) for the
// block's leaf, offset to its chunk; null when the list is absent.
template <typename T, int DEPTH>
__device__ __forceinline__ T* list_at(const TensorListMeta<DEPTH>& meta, int list, const BlockWork<DEPTH>& w) {
  if (list < 0) return nullptr;
  void* base = meta.ptr[list][w.slot];
  return base ? static_cast<T*>(base) + w.start : nullptr;
}

// The skipped out-of-place step: out = in bit for bit (element copies of the storage type, no
// conversion), or out = +0 when `in` is null (the delta of a skipped update).
template <typename T>
__device__ __forceinline__ void copy_chunk(const T* in, T* out, int len) {
  if (out == nullptr) return;
  for (int j = threadIdx.x; j < len; j += kBlock) out[j] = in ? in[j] : from_float<T>(0.0f);
}

// ------------------------------------------------------------------------------------------
// Adam / AdamW
// ------------------------------------------------------------------------------------------

// Which of the launch's pointer lists holds what, per destination (-1: not in this layout).
template <Dest D>
struct AdamLayout;
template <>
struct AdamLayout<Dest::kInPlace> {  // grad, param, exp_avg, exp_avg_sq, max_exp_avg_sq, model copy
  static constexpr int kDepth = 6;
  static constexpr int g = 0, p = 1, m = 2, v = 3, vmax = 4, model_in = -1;
  static constexpr int p_out = 1, m_out = 2, v_out = 3, vmax_out = 4, model_out = 5;
};
template <>
struct AdamLayout<Dest::kOut> {  // the five inputs (model copy included: its skip value), then the outputs
  static constexpr int kDepth = 11;
  static constexpr int g = 0, p = 1, m = 2, v = 3, vmax = 4, model_in = 5;
  static constexpr int p_out = 6, m_out = 7, v_out = 8, vmax_out = 9, model_out = 10;
};
template <>
struct AdamLayout<Dest::kDelta> {  // grad, param (may be null), moments in; updates, moments out
  static constexpr int kDepth = 9;
  static constexpr int g = 0, p = 1, m = 2, v = 3, vmax = 4, model_in = -1;
  static constexpr int p_out = 5, m_out = 6, v_out = 7, vmax_out = 8, model_out = -1;
};

struct AdamArgs {
  const float* grad_scale;
  const uint8_t* finite;
  const float* lr_tensor;
  const float* step;
  double lr, beta1, beta2, eps, weight_decay;
  int adamw, amsgrad, maximize;
};

static_assert(fits_kernel_params<AdamLayout<Dest::kOut>::kDepth, AdamArgs>(), "Adam arguments too large");
static_assert(fits_kernel_params<AdamLayout<Dest::kDelta>::kDepth, AdamArgs>(), "Adam arguments too large");
static_assert(fits_kernel_params<AdamLayout<Dest::kInPlace>::kDepth, AdamArgs>(), "Adam arguments too large");

__device__ AdamScalars adam_scalars(const AdamArgs& a) {
  const double lr = a.lr_tensor ? static_cast<double>(*a.lr_tensor) : a.lr;
  return ampfunc::adam_scalars(a.grad_scale ? *a.grad_scale : 1.0f, lr, a.beta1, a.beta2, a.eps, a.weight_decay,
                               static_cast<double>(*a.step) + 1.0, a.amsgrad != 0, a.adamw != 0, a.maximize != 0);
}

// lerp, nan_max and adam_element (the per-element step): adam_element.cuh, shared with lowmem.cu.

template <typename TG, typename TM, bool kDecoupled, bool kAmsgrad, Dest kDest>
__global__ void __launch_bounds__(kBlock)
adam_kernel(const __grid_constant__ TensorListMeta<AdamLayout<kDest>::kDepth> meta, const AdamArgs args) {
  using L = AdamLayout<kDest>;
  constexpr bool kDelta = kDest == Dest::kDelta;
  __shared__ AdamScalars shared_scalars;
  if (step_is_skipped(args.finite)) {  // whole block, before any other write
    if (kDest != Dest::kInPlace) {
      const BlockWork<L::kDepth> w = block_work(meta);
      copy_chunk(kDelta ? nullptr : list_at<const float>(meta, L::p, w), list_at<float>(meta, L::p_out, w), w.len);
      copy_chunk(list_at<const float>(meta, L::m, w), list_at<float>(meta, L::m_out, w), w.len);
      copy_chunk(list_at<const float>(meta, L::v, w), list_at<float>(meta, L::v_out, w), w.len);
      if (kAmsgrad) copy_chunk(list_at<const float>(meta, L::vmax, w), list_at<float>(meta, L::vmax_out, w), w.len);
      copy_chunk(list_at<const TM>(meta, L::model_in, w), list_at<TM>(meta, L::model_out, w), w.len);
    }
    return;
  }
  if (threadIdx.x == 0) shared_scalars = adam_scalars(args);
  __syncthreads();
  const AdamScalars s = shared_scalars;

  const BlockWork<L::kDepth> w = block_work(meta);
  const TG* gp = list_at<const TG>(meta, L::g, w);
  const float* pp = list_at<const float>(meta, L::p, w);  // null only for a delta without params
  const float* mp = list_at<const float>(meta, L::m, w);
  const float* vp = list_at<const float>(meta, L::v, w);
  const float* vmaxp = kAmsgrad ? list_at<const float>(meta, L::vmax, w) : nullptr;
  float* po = list_at<float>(meta, L::p_out, w);  // the updates in delta mode
  float* mo = list_at<float>(meta, L::m_out, w);
  float* vo = list_at<float>(meta, L::v_out, w);
  float* vmaxo = kAmsgrad ? list_at<float>(meta, L::vmax_out, w) : nullptr;
  TM* cp = list_at<TM>(meta, L::model_out, w);
  const bool has_wd = args.weight_decay != 0.0;
  const int maximize = args.maximize;

  int j0 = 0;
  if (vec_aligned<TG>(gp) && vec_aligned<float>(pp) && vec_aligned<float>(mp) && vec_aligned<float>(vp) &&
      vec_aligned<float>(vmaxp) && vec_aligned<float>(po) && vec_aligned<float>(mo) && vec_aligned<float>(vo) &&
      vec_aligned<float>(vmaxo) && vec_aligned<TM>(cp)) {
    const int nvec = w.len / kVec;
    for (int i = threadIdx.x; i < nvec; i += kBlock) {
      const int64_t o = (int64_t)i * kVec;
      float g[kVec], p[kVec] = {0.f, 0.f, 0.f, 0.f}, m[kVec], v[kVec], vm[kVec] = {0.f, 0.f, 0.f, 0.f};
      load4(gp + o, g);
      if (!kDelta || pp) load4(pp + o, p);
      load4(mp + o, m);
      load4(vp + o, v);
      if (kAmsgrad) load4(vmaxp + o, vm);
      float p0[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        p0[k] = p[k];
        adam_element<kDecoupled, kAmsgrad>(g[k], p[k], m[k], v[k], vm[k], maximize, has_wd, s);
        if (kDelta) p[k] = __fsub_rn(p[k], p0[k]);  // new_p - p, one rounding (torch's sub)
      }
      store4(po + o, p);
      store4(mo + o, m);
      store4(vo + o, v);
      if (kAmsgrad) store4(vmaxo + o, vm);
      if (!kDelta && cp) store4(cp + o, p);
    }
    j0 = nvec * kVec;
  }
  for (int j = j0 + threadIdx.x; j < w.len; j += kBlock) {
    const float p0 = (!kDelta || pp) ? pp[j] : 0.f;
    float p = p0, m = mp[j], v = vp[j], vm = kAmsgrad ? vmaxp[j] : 0.f;
    adam_element<kDecoupled, kAmsgrad>(to_float(gp[j]), p, m, v, vm, maximize, has_wd, s);
    po[j] = kDelta ? __fsub_rn(p, p0) : p;
    mo[j] = m;
    vo[j] = v;
    if (kAmsgrad) vmaxo[j] = vm;
    if (!kDelta && cp) cp[j] = from_float<TM>(p);
  }
}

// ------------------------------------------------------------------------------------------
// SGD
// ------------------------------------------------------------------------------------------

template <Dest D>
struct SgdLayout;
template <>
struct SgdLayout<Dest::kInPlace> {  // grad, param, momentum buffer, model copy
  static constexpr int kDepth = 4;
  static constexpr int g = 0, p = 1, b = 2, model_in = -1;
  static constexpr int p_out = 1, b_out = 2, model_out = 3;
};
template <>
struct SgdLayout<Dest::kOut> {
  static constexpr int kDepth = 7;
  static constexpr int g = 0, p = 1, b = 2, model_in = 3;
  static constexpr int p_out = 4, b_out = 5, model_out = 6;
};
template <>
struct SgdLayout<Dest::kDelta> {
  static constexpr int kDepth = 5;
  static constexpr int g = 0, p = 1, b = 2, model_in = -1;
  static constexpr int p_out = 3, b_out = 4, model_out = -1;
};

struct SgdArgs {
  const float* grad_scale;
  const uint8_t* finite;
  const float* lr_tensor;
  const float* step;
  double lr, momentum, dampening, weight_decay;
  int nesterov, maximize;
};

static_assert(fits_kernel_params<SgdLayout<Dest::kOut>::kDepth, SgdArgs>(), "SGD arguments too large");

template <bool kMomentum>
__device__ __forceinline__ void sgd_element(float g, float& p, float& b, int maximize, int nesterov, bool has_wd,
                                            const SgdScalars& s) {
  g = __fmul_rn(g, s.grad_scale);
  if (maximize) g = -g;
  if (has_wd) g = __fmaf_rn(s.weight_decay, p, g);               // grad.add(param, alpha=wd)
  if (kMomentum) {
    b = s.first_step ? g : __fmaf_rn(s.one_minus_dampening, g, __fmul_rn(b, s.momentum));
    g = nesterov ? __fmaf_rn(s.momentum, b, g) : b;              // grad.add(buf, alpha=mom)
  }
  p = __fmaf_rn(s.neg_lr, g, p);                                  // param.add_(grad, alpha=-lr)
}

template <typename TG, typename TM, bool kMomentum, Dest kDest>
__global__ void __launch_bounds__(kBlock)
sgd_kernel(const __grid_constant__ TensorListMeta<SgdLayout<kDest>::kDepth> meta, const SgdArgs args) {
  using L = SgdLayout<kDest>;
  constexpr bool kDelta = kDest == Dest::kDelta;
  __shared__ SgdScalars shared_scalars;
  if (step_is_skipped(args.finite)) {
    if (kDest != Dest::kInPlace) {
      const BlockWork<L::kDepth> w = block_work(meta);
      copy_chunk(kDelta ? nullptr : list_at<const float>(meta, L::p, w), list_at<float>(meta, L::p_out, w), w.len);
      if (kMomentum) copy_chunk(list_at<const float>(meta, L::b, w), list_at<float>(meta, L::b_out, w), w.len);
      copy_chunk(list_at<const TM>(meta, L::model_in, w), list_at<TM>(meta, L::model_out, w), w.len);
    }
    return;
  }
  if (threadIdx.x == 0) {
    const double lr = args.lr_tensor ? static_cast<double>(*args.lr_tensor) : args.lr;
    shared_scalars = ampfunc::sgd_scalars(args.grad_scale ? *args.grad_scale : 1.0f, lr, args.weight_decay,
                                          args.momentum, args.dampening, args.nesterov != 0, args.maximize != 0,
                                          args.step != nullptr && *args.step == 0.0f);
  }
  __syncthreads();
  const SgdScalars s = shared_scalars;
  const bool has_wd = args.weight_decay != 0.0;
  const int nesterov = args.nesterov, maximize = args.maximize;

  const BlockWork<L::kDepth> w = block_work(meta);
  const TG* gp = list_at<const TG>(meta, L::g, w);
  const float* pp = list_at<const float>(meta, L::p, w);  // null only for a delta without params
  const float* bp = kMomentum ? list_at<const float>(meta, L::b, w) : nullptr;
  float* po = list_at<float>(meta, L::p_out, w);  // the updates in delta mode
  float* bo = kMomentum ? list_at<float>(meta, L::b_out, w) : nullptr;
  TM* cp = list_at<TM>(meta, L::model_out, w);

  int j0 = 0;
  if (vec_aligned<TG>(gp) && vec_aligned<float>(pp) && vec_aligned<float>(bp) && vec_aligned<float>(po) &&
      vec_aligned<float>(bo) && vec_aligned<TM>(cp)) {
    const int nvec = w.len / kVec;
    for (int i = threadIdx.x; i < nvec; i += kBlock) {
      const int64_t o = (int64_t)i * kVec;
      float g[kVec], p[kVec] = {0.f, 0.f, 0.f, 0.f}, b[kVec] = {0.f, 0.f, 0.f, 0.f};
      load4(gp + o, g);
      if (!kDelta || pp) load4(pp + o, p);
      if (kMomentum && !s.first_step) load4(bp + o, b);  // a first step never reads the buffer
      float p0[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        p0[k] = p[k];
        sgd_element<kMomentum>(g[k], p[k], b[k], maximize, nesterov, has_wd, s);
        if (kDelta) p[k] = __fsub_rn(p[k], p0[k]);  // new_p - p, one rounding (torch's sub)
      }
      store4(po + o, p);
      if (kMomentum) store4(bo + o, b);
      if (!kDelta && cp) store4(cp + o, p);
    }
    j0 = nvec * kVec;
  }
  for (int j = j0 + threadIdx.x; j < w.len; j += kBlock) {
    const float p0 = (!kDelta || pp) ? pp[j] : 0.f;
    float p = p0, b = (kMomentum && !s.first_step) ? bp[j] : 0.f;
    sgd_element<kMomentum>(to_float(gp[j]), p, b, maximize, nesterov, has_wd, s);
    po[j] = kDelta ? __fsub_rn(p, p0) : p;
    if (kMomentum) bo[j] = b;
    if (!kDelta && cp) cp[j] = from_float<TM>(p);
  }
}

// ------------------------------------------------------------------------------------------
// host side
// ------------------------------------------------------------------------------------------

// Calls f(TG{}, TM{}) for the grad and model-copy types (no copy: TM = float, unused).
template <class F>
cudaError_t dispatch_grad_model(int grad_dtype, int model_dtype, bool has_copy, F&& f) {
  return dispatch_dtype(grad_dtype, [&](auto g) {
    return dispatch_dtype(has_copy ? model_dtype : AMPFUNC_FP32, [&](auto m) { return f(g, m); });
  });
}

cudaError_t finish_step(const float* step, float* step_out, const uint8_t* finite, cudaStream_t stream) {
  if (step == nullptr || step_out == nullptr) return cudaSuccess;
  finish_step_kernel<<<1, 1, 0, stream>>>(step, step_out, finite);
  return cudaGetLastError();
}

AdamArgs adam_args(const AmpfuncAdamHyper* hyper, const float* grad_scale, const uint8_t* finite,
                   const float* lr_tensor, const float* step) {
  AdamArgs args;
  args.grad_scale = grad_scale;
  args.finite = finite;
  args.lr_tensor = lr_tensor;
  args.step = step;
  args.lr = hyper->lr;
  args.beta1 = hyper->beta1;
  args.beta2 = hyper->beta2;
  args.eps = hyper->eps;
  args.weight_decay = hyper->weight_decay;
  args.adamw = hyper->adamw != 0;
  args.amsgrad = hyper->amsgrad != 0;
  args.maximize = hyper->maximize != 0;
  return args;
}

// Runs the Adam kernel of destination D over `lists` (laid out as AdamLayout<D>).
template <Dest D>
cudaError_t run_adam(int n, const int64_t* numels, void* const* const* lists, int grad_dtype, int model_dtype,
                     bool has_copy, const AdamArgs& args, cudaStream_t stream) {
  constexpr int kDepth = AdamLayout<D>::kDepth;
  return dispatch_grad_model(grad_dtype, model_dtype, has_copy, [&](auto g, auto m) {
    using TG = decltype(g);
    using TM = decltype(m);
    return multi_tensor_apply<kDepth>(n, numels, lists, [&](const TensorListMeta<kDepth>& meta, int nb) {
      if (args.adamw) {
        if (args.amsgrad) adam_kernel<TG, TM, true, true, D><<<nb, kBlock, 0, stream>>>(meta, args);
        else adam_kernel<TG, TM, true, false, D><<<nb, kBlock, 0, stream>>>(meta, args);
      } else {
        if (args.amsgrad) adam_kernel<TG, TM, false, true, D><<<nb, kBlock, 0, stream>>>(meta, args);
        else adam_kernel<TG, TM, false, false, D><<<nb, kBlock, 0, stream>>>(meta, args);
      }
      return cudaGetLastError();
    });
  });
}

SgdArgs sgd_args(const AmpfuncSgdHyper* hyper, const float* grad_scale, const uint8_t* finite,
                 const float* lr_tensor, const float* step) {
  SgdArgs args;
  args.grad_scale = grad_scale;
  args.finite = finite;
  args.lr_tensor = lr_tensor;
  args.step = step;
  args.lr = hyper->lr;
  args.momentum = hyper->momentum;
  args.dampening = hyper->dampening;
  args.weight_decay = hyper->weight_decay;
  args.nesterov = hyper->nesterov != 0;
  args.maximize = hyper->maximize != 0;
  return args;
}

template <Dest D>
cudaError_t run_sgd(int n, const int64_t* numels, void* const* const* lists, int grad_dtype, int model_dtype,
                    bool has_copy, bool has_momentum, const SgdArgs& args, cudaStream_t stream) {
  constexpr int kDepth = SgdLayout<D>::kDepth;
  return dispatch_grad_model(grad_dtype, model_dtype, has_copy, [&](auto g, auto m) {
    using TG = decltype(g);
    using TM = decltype(m);
    return multi_tensor_apply<kDepth>(n, numels, lists, [&](const TensorListMeta<kDepth>& meta, int nb) {
      if (has_momentum) sgd_kernel<TG, TM, true, D><<<nb, kBlock, 0, stream>>>(meta, args);
      else sgd_kernel<TG, TM, false, D><<<nb, kBlock, 0, stream>>>(meta, args);
      return cudaGetLastError();
    });
  });
}

// A read-only list as an entry of the launch's pointer lists (the kernels never write it).
inline void* const* in_list(const void* const* l) { return const_cast<void* const*>(l); }

}  // namespace
}  // namespace cuda
}  // namespace ampfunc

using namespace ampfunc::cuda;

extern "C" int ampfunc_cuda_adam_step(int n, const void* const* grads, int grad_dtype, void* const* params,
                                      void* const* exp_avgs, void* const* exp_avg_sqs,
                                      void* const* max_exp_avg_sqs, void* const* model_copies, int model_dtype,
                                      const int64_t* numels, const float* grad_scale, const uint8_t* finite,
                                      const float* lr_tensor, float* step, int increment_step,
                                      const AmpfuncAdamHyper* hyper, cudaStream_t stream) {
  if (hyper == nullptr || step == nullptr || n < 0 || !valid_dtype(grad_dtype)) return cudaErrorInvalidValue;
  if (model_copies && !valid_dtype(model_dtype)) return cudaErrorInvalidValue;
  if (hyper->amsgrad && max_exp_avg_sqs == nullptr) return cudaErrorInvalidValue;
  if (n > 0 && (grads == nullptr || params == nullptr || exp_avgs == nullptr || exp_avg_sqs == nullptr ||
                numels == nullptr))
    return cudaErrorInvalidValue;

  const AdamArgs args = adam_args(hyper, grad_scale, finite, lr_tensor, step);
  void* const* lists[AdamLayout<Dest::kInPlace>::kDepth] = {
      in_list(grads), params, exp_avgs, exp_avg_sqs, args.amsgrad ? max_exp_avg_sqs : nullptr, model_copies};
  cudaError_t err = run_adam<Dest::kInPlace>(n, numels, lists, grad_dtype, model_dtype, model_copies != nullptr,
                                             args, stream);
  if (err != cudaSuccess) return err;
  return finish_step(step, increment_step ? step : nullptr, finite, stream);
}

extern "C" int ampfunc_cuda_adam_step_out(int n, const void* const* grads, int grad_dtype, const void* const* params,
                                          const void* const* exp_avgs, const void* const* exp_avg_sqs,
                                          const void* const* max_exp_avg_sqs, const void* const* model_copies,
                                          void* const* params_out, void* const* exp_avgs_out,
                                          void* const* exp_avg_sqs_out, void* const* max_exp_avg_sqs_out,
                                          void* const* model_copies_out, int model_dtype, const int64_t* numels,
                                          const float* grad_scale, const uint8_t* finite, const float* lr_tensor,
                                          const float* step, float* step_out, const AmpfuncAdamHyper* hyper,
                                          cudaStream_t stream) {
  if (hyper == nullptr || step == nullptr || n < 0 || !valid_dtype(grad_dtype)) return cudaErrorInvalidValue;
  if ((model_copies == nullptr) != (model_copies_out == nullptr)) return cudaErrorInvalidValue;
  if (model_copies && !valid_dtype(model_dtype)) return cudaErrorInvalidValue;
  if (hyper->amsgrad && (max_exp_avg_sqs == nullptr || max_exp_avg_sqs_out == nullptr)) return cudaErrorInvalidValue;
  if (n > 0 && (grads == nullptr || params == nullptr || exp_avgs == nullptr || exp_avg_sqs == nullptr ||
                params_out == nullptr || exp_avgs_out == nullptr || exp_avg_sqs_out == nullptr || numels == nullptr))
    return cudaErrorInvalidValue;

  const AdamArgs args = adam_args(hyper, grad_scale, finite, lr_tensor, step);
  void* const* lists[AdamLayout<Dest::kOut>::kDepth] = {
      in_list(grads),        in_list(params),
      in_list(exp_avgs),     in_list(exp_avg_sqs),
      args.amsgrad ? in_list(max_exp_avg_sqs) : nullptr,
      in_list(model_copies), params_out,
      exp_avgs_out,          exp_avg_sqs_out,
      args.amsgrad ? max_exp_avg_sqs_out : nullptr,
      model_copies_out};
  cudaError_t err = run_adam<Dest::kOut>(n, numels, lists, grad_dtype, model_dtype, model_copies != nullptr, args,
                                         stream);
  if (err != cudaSuccess) return err;
  return finish_step(step, step_out, finite, stream);
}

extern "C" int ampfunc_cuda_adam_update(int n, const void* const* grads, int grad_dtype, const void* const* params,
                                        const void* const* exp_avgs, const void* const* exp_avg_sqs,
                                        const void* const* max_exp_avg_sqs, void* const* updates,
                                        void* const* exp_avgs_out, void* const* exp_avg_sqs_out,
                                        void* const* max_exp_avg_sqs_out, const int64_t* numels,
                                        const float* grad_scale, const uint8_t* finite, const float* lr_tensor,
                                        const float* step, float* step_out, const AmpfuncAdamHyper* hyper,
                                        cudaStream_t stream) {
  if (hyper == nullptr || step == nullptr || n < 0 || !valid_dtype(grad_dtype)) return cudaErrorInvalidValue;
  if (hyper->amsgrad && (max_exp_avg_sqs == nullptr || max_exp_avg_sqs_out == nullptr)) return cudaErrorInvalidValue;
  if (n > 0 && (grads == nullptr || exp_avgs == nullptr || exp_avg_sqs == nullptr || updates == nullptr ||
                exp_avgs_out == nullptr || exp_avg_sqs_out == nullptr || numels == nullptr))
    return cudaErrorInvalidValue;

  const AdamArgs args = adam_args(hyper, grad_scale, finite, lr_tensor, step);
  void* const* lists[AdamLayout<Dest::kDelta>::kDepth] = {
      in_list(grads),    in_list(params),  in_list(exp_avgs), in_list(exp_avg_sqs),
      args.amsgrad ? in_list(max_exp_avg_sqs) : nullptr,    updates,
      exp_avgs_out,      exp_avg_sqs_out,  args.amsgrad ? max_exp_avg_sqs_out : nullptr};
  cudaError_t err = run_adam<Dest::kDelta>(n, numels, lists, grad_dtype, AMPFUNC_FP32, false, args, stream);
  if (err != cudaSuccess) return err;
  return finish_step(step, step_out, finite, stream);
}

extern "C" int ampfunc_cuda_sgd_step(int n, const void* const* grads, int grad_dtype, void* const* params,
                                     void* const* momentum_bufs, void* const* model_copies, int model_dtype,
                                     const int64_t* numels, const float* grad_scale, const uint8_t* finite,
                                     const float* lr_tensor, float* step, int increment_step,
                                     const AmpfuncSgdHyper* hyper, cudaStream_t stream) {
  if (hyper == nullptr || n < 0 || !valid_dtype(grad_dtype)) return cudaErrorInvalidValue;
  if (model_copies && !valid_dtype(model_dtype)) return cudaErrorInvalidValue;
  const bool has_momentum = hyper->momentum != 0.0;
  if (has_momentum && (momentum_bufs == nullptr || step == nullptr)) return cudaErrorInvalidValue;
  if (n > 0 && (grads == nullptr || params == nullptr || numels == nullptr)) return cudaErrorInvalidValue;

  const SgdArgs args = sgd_args(hyper, grad_scale, finite, lr_tensor, step);
  void* const* lists[SgdLayout<Dest::kInPlace>::kDepth] = {in_list(grads), params,
                                                          has_momentum ? momentum_bufs : nullptr, model_copies};
  cudaError_t err = run_sgd<Dest::kInPlace>(n, numels, lists, grad_dtype, model_dtype, model_copies != nullptr,
                                            has_momentum, args, stream);
  if (err != cudaSuccess) return err;
  return finish_step(step, increment_step ? step : nullptr, finite, stream);
}

extern "C" int ampfunc_cuda_sgd_step_out(int n, const void* const* grads, int grad_dtype, const void* const* params,
                                         const void* const* momentum_bufs, const void* const* model_copies,
                                         void* const* params_out, void* const* momentum_bufs_out,
                                         void* const* model_copies_out, int model_dtype, const int64_t* numels,
                                         const float* grad_scale, const uint8_t* finite, const float* lr_tensor,
                                         const float* step, float* step_out, const AmpfuncSgdHyper* hyper,
                                         cudaStream_t stream) {
  if (hyper == nullptr || n < 0 || !valid_dtype(grad_dtype)) return cudaErrorInvalidValue;
  if ((model_copies == nullptr) != (model_copies_out == nullptr)) return cudaErrorInvalidValue;
  if (model_copies && !valid_dtype(model_dtype)) return cudaErrorInvalidValue;
  const bool has_momentum = hyper->momentum != 0.0;
  if (has_momentum && (momentum_bufs == nullptr || momentum_bufs_out == nullptr || step == nullptr))
    return cudaErrorInvalidValue;
  if (step_out != nullptr && step == nullptr) return cudaErrorInvalidValue;
  if (n > 0 && (grads == nullptr || params == nullptr || params_out == nullptr || numels == nullptr))
    return cudaErrorInvalidValue;

  const SgdArgs args = sgd_args(hyper, grad_scale, finite, lr_tensor, step);
  void* const* lists[SgdLayout<Dest::kOut>::kDepth] = {
      in_list(grads),         in_list(params), has_momentum ? in_list(momentum_bufs) : nullptr,
      in_list(model_copies),  params_out,      has_momentum ? momentum_bufs_out : nullptr,
      model_copies_out};
  cudaError_t err = run_sgd<Dest::kOut>(n, numels, lists, grad_dtype, model_dtype, model_copies != nullptr,
                                        has_momentum, args, stream);
  if (err != cudaSuccess) return err;
  return finish_step(step, step_out, finite, stream);
}

extern "C" int ampfunc_cuda_sgd_update(int n, const void* const* grads, int grad_dtype, const void* const* params,
                                       const void* const* momentum_bufs, void* const* updates,
                                       void* const* momentum_bufs_out, const int64_t* numels,
                                       const float* grad_scale, const uint8_t* finite, const float* lr_tensor,
                                       const float* step, float* step_out, const AmpfuncSgdHyper* hyper,
                                       cudaStream_t stream) {
  if (hyper == nullptr || n < 0 || !valid_dtype(grad_dtype)) return cudaErrorInvalidValue;
  const bool has_momentum = hyper->momentum != 0.0;
  if (has_momentum && (momentum_bufs == nullptr || momentum_bufs_out == nullptr || step == nullptr))
    return cudaErrorInvalidValue;
  if (step_out != nullptr && step == nullptr) return cudaErrorInvalidValue;
  if (n > 0 && (grads == nullptr || updates == nullptr || numels == nullptr)) return cudaErrorInvalidValue;

  const SgdArgs args = sgd_args(hyper, grad_scale, finite, lr_tensor, step);
  void* const* lists[SgdLayout<Dest::kDelta>::kDepth] = {
      in_list(grads), in_list(params), has_momentum ? in_list(momentum_bufs) : nullptr, updates,
      has_momentum ? momentum_bufs_out : nullptr};
  cudaError_t err = run_sgd<Dest::kDelta>(n, numels, lists, grad_dtype, AMPFUNC_FP32, false, has_momentum, args,
                                          stream);
  if (err != cudaSuccess) return err;
  return finish_step(step, step_out, finite, stream);
}
