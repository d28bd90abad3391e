// Fused optimizer steps over fp32 master parameters: unscale (and clip) factor, the update,
// the skip on a non-finite step and the low-precision model copy, in one pass.
//
// Rounding follows torch.optim's single-tensor CUDA path op by op (that path runs one kernel
// per torch op, each of which nvcc contracts a*b+c into one fma): where torch rounds between
// two ops we round too (__fmul_rn / __fadd_rn, which nvcc never contracts), where torch's
// kernel computes a + alpha*b we use one fma. Scalars derived from the hyper-parameters are
// computed in double and rounded to fp32 once, as Python floats are when they reach a kernel.
#include <math.h>

#include "mta.cuh"

namespace ampfunc {
namespace cuda {
namespace {

// ------------------------------------------------------------------------------------------
// shared pieces
// ------------------------------------------------------------------------------------------

// Reads the device scalars once per block; tells whether the block must leave (skipped step).
__device__ __forceinline__ bool step_is_skipped(const uint8_t* finite) {
  return finite != nullptr && *finite == 0;
}

// Increments the step counter once the update kernels have read it (stream order).
__global__ void increment_step_kernel(float* step, const uint8_t* finite) {
  if (finite == nullptr || *finite != 0) *step += 1.0f;
}

// ------------------------------------------------------------------------------------------
// Adam / AdamW
// ------------------------------------------------------------------------------------------

constexpr int kDepthAdam = 6;  // grad, param, exp_avg, exp_avg_sq, max_exp_avg_sq, model copy

struct AdamArgs {
  const float* grad_scale;
  const uint8_t* finite;
  const float* lr_tensor;
  const float* step;
  double lr, beta1, beta2, eps, weight_decay;
  int adamw, amsgrad, maximize;
};

struct AdamScalars {
  float grad_scale;
  float decay;          // 1 - lr*wd (AdamW)
  float weight_decay;   // wd (Adam, L2)
  float lerp_weight;    // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^t), as torch's CUDA division by a scalar
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
};

__device__ AdamScalars adam_scalars(const AdamArgs& a) {
  AdamScalars s;
  const double lr = a.lr_tensor ? static_cast<double>(*a.lr_tensor) : a.lr;
  const double t = static_cast<double>(*a.step) + 1.0;
  const double bc1 = 1.0 - pow(a.beta1, t);
  const double bc2 = 1.0 - pow(a.beta2, t);
  s.grad_scale = a.grad_scale ? *a.grad_scale : 1.0f;
  s.decay = static_cast<float>(1.0 - lr * a.weight_decay);
  s.weight_decay = static_cast<float>(a.weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - a.beta1);
  s.beta2 = static_cast<float>(a.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  s.inv_bc2_sqrt = 1.0f / static_cast<float>(sqrt(bc2));
  s.eps = static_cast<float>(a.eps);
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  return s;
}

// torch.lerp's formula (ATen/native/Lerp.h): exact at both ends of the weight range.
__device__ __forceinline__ float lerp(float self, float end, float w) {
  const float diff = __fsub_rn(end, self);
  return fabsf(w) < 0.5f ? __fmaf_rn(w, diff, self) : __fmaf_rn(-diff, __fsub_rn(1.0f, w), end);
}

// torch.maximum: NaN wins.
__device__ __forceinline__ float nan_max(float a, float b) {
  return (isnan(a) || isnan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

template <bool kDecoupled, bool kAmsgrad>
__device__ __forceinline__ void adam_element(float g, float& p, float& m, float& v, float& vmax, int maximize,
                                             bool has_wd, const AdamScalars& s) {
  g = __fmul_rn(g, s.grad_scale);
  if (maximize) g = -g;
  if (has_wd) {
    if (kDecoupled) p = __fmul_rn(p, s.decay);      // param.mul_(1 - lr*wd)
    else g = __fmaf_rn(s.weight_decay, p, g);       // grad.add(param, alpha=wd)
  }
  m = lerp(m, g, s.lerp_weight);                                   // exp_avg.lerp_(grad, 1-b1)
  v = __fmaf_rn(s.one_minus_beta2, __fmul_rn(g, g), __fmul_rn(v, s.beta2));  // mul_(b2).addcmul_
  float src = v;
  if (kAmsgrad) {
    vmax = nan_max(vmax, v);
    src = vmax;
  }
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(src), s.inv_bc2_sqrt), s.eps);
  p = __fmaf_rn(s.neg_step_size, __fdiv_rn(m, denom), p);          // addcdiv_(m, denom, -ss)
}

template <typename TG, typename TM, bool kDecoupled, bool kAmsgrad>
__global__ void __launch_bounds__(kBlock)
adam_kernel(const __grid_constant__ TensorListMeta<kDepthAdam> meta, const AdamArgs args) {
  __shared__ AdamScalars shared_scalars;
  if (step_is_skipped(args.finite)) return;  // whole block, before any write
  if (threadIdx.x == 0) shared_scalars = adam_scalars(args);
  __syncthreads();
  const AdamScalars s = shared_scalars;

  const BlockWork<kDepthAdam> w = block_work(meta);
  const TG* gp = static_cast<const TG*>(meta.ptr[0][w.slot]) + w.start;
  float* pp = static_cast<float*>(meta.ptr[1][w.slot]) + w.start;
  float* mp = static_cast<float*>(meta.ptr[2][w.slot]) + w.start;
  float* vp = static_cast<float*>(meta.ptr[3][w.slot]) + w.start;
  float* vmaxp = kAmsgrad ? static_cast<float*>(meta.ptr[4][w.slot]) + w.start : nullptr;
  TM* cp = meta.ptr[5][w.slot] ? static_cast<TM*>(meta.ptr[5][w.slot]) + w.start : nullptr;
  const bool has_wd = args.weight_decay != 0.0;
  const int maximize = args.maximize;

  int j0 = 0;
  if (vec_aligned<TG>(gp) && vec_aligned<float>(pp) && vec_aligned<float>(mp) && vec_aligned<float>(vp) &&
      vec_aligned<float>(vmaxp) && vec_aligned<TM>(cp)) {
    const int nvec = w.len / kVec;
    for (int i = threadIdx.x; i < nvec; i += kBlock) {
      const int64_t o = (int64_t)i * kVec;
      float g[kVec], p[kVec], m[kVec], v[kVec], vm[kVec] = {0.f, 0.f, 0.f, 0.f};
      load4(gp + o, g);
      load4(pp + o, p);
      load4(mp + o, m);
      load4(vp + o, v);
      if (kAmsgrad) load4(vmaxp + o, vm);
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        adam_element<kDecoupled, kAmsgrad>(g[k], p[k], m[k], v[k], vm[k], maximize, has_wd, s);
      store4(pp + o, p);
      store4(mp + o, m);
      store4(vp + o, v);
      if (kAmsgrad) store4(vmaxp + o, vm);
      if (cp) store4(cp + o, p);
    }
    j0 = nvec * kVec;
  }
  for (int j = j0 + threadIdx.x; j < w.len; j += kBlock) {
    float p = pp[j], m = mp[j], v = vp[j], vm = kAmsgrad ? vmaxp[j] : 0.f;
    adam_element<kDecoupled, kAmsgrad>(to_float(gp[j]), p, m, v, vm, maximize, has_wd, s);
    pp[j] = p;
    mp[j] = m;
    vp[j] = v;
    if (kAmsgrad) vmaxp[j] = vm;
    if (cp) cp[j] = from_float<TM>(p);
  }
}

// ------------------------------------------------------------------------------------------
// SGD
// ------------------------------------------------------------------------------------------

constexpr int kDepthSgd = 4;  // grad, param, momentum buffer, model copy

struct SgdArgs {
  const float* grad_scale;
  const uint8_t* finite;
  const float* lr_tensor;
  const float* step;
  double lr, momentum, dampening, weight_decay;
  int nesterov, maximize;
};

struct SgdScalars {
  float grad_scale;
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
  int first;  // the momentum buffers are filled with the gradient, not blended
};

template <typename TG, typename TM, bool kMomentum>
__global__ void __launch_bounds__(kBlock)
sgd_kernel(const __grid_constant__ TensorListMeta<kDepthSgd> meta, const SgdArgs args) {
  __shared__ SgdScalars shared_scalars;
  if (step_is_skipped(args.finite)) return;
  if (threadIdx.x == 0) {
    SgdScalars s;
    const double lr = args.lr_tensor ? static_cast<double>(*args.lr_tensor) : args.lr;
    s.grad_scale = args.grad_scale ? *args.grad_scale : 1.0f;
    s.weight_decay = static_cast<float>(args.weight_decay);
    s.momentum = static_cast<float>(args.momentum);
    s.one_minus_dampening = static_cast<float>(1.0 - args.dampening);
    s.neg_lr = static_cast<float>(-lr);
    s.first = args.step != nullptr && *args.step == 0.0f;
    shared_scalars = s;
  }
  __syncthreads();
  const SgdScalars s = shared_scalars;
  const bool has_wd = args.weight_decay != 0.0;
  const int nesterov = args.nesterov, maximize = args.maximize;

  const BlockWork<kDepthSgd> w = block_work(meta);
  const TG* gp = static_cast<const TG*>(meta.ptr[0][w.slot]) + w.start;
  float* pp = static_cast<float*>(meta.ptr[1][w.slot]) + w.start;
  float* bp = kMomentum ? static_cast<float*>(meta.ptr[2][w.slot]) + w.start : nullptr;
  TM* cp = meta.ptr[3][w.slot] ? static_cast<TM*>(meta.ptr[3][w.slot]) + w.start : nullptr;

  auto element = [&](float g, float& p, float& b) {
    g = __fmul_rn(g, s.grad_scale);
    if (maximize) g = -g;
    if (has_wd) g = __fmaf_rn(s.weight_decay, p, g);               // grad.add(param, alpha=wd)
    if (kMomentum) {
      b = s.first ? g : __fmaf_rn(s.one_minus_dampening, g, __fmul_rn(b, s.momentum));
      g = nesterov ? __fmaf_rn(s.momentum, b, g) : b;              // grad.add(buf, alpha=mom)
    }
    p = __fmaf_rn(s.neg_lr, g, p);                                  // param.add_(grad, alpha=-lr)
  };

  int j0 = 0;
  if (vec_aligned<TG>(gp) && vec_aligned<float>(pp) && vec_aligned<float>(bp) && vec_aligned<TM>(cp)) {
    const int nvec = w.len / kVec;
    for (int i = threadIdx.x; i < nvec; i += kBlock) {
      const int64_t o = (int64_t)i * kVec;
      float g[kVec], p[kVec], b[kVec] = {0.f, 0.f, 0.f, 0.f};
      load4(gp + o, g);
      load4(pp + o, p);
      if (kMomentum && !s.first) load4(bp + o, b);  // a first step never reads the buffer
#pragma unroll
      for (int k = 0; k < kVec; ++k) element(g[k], p[k], b[k]);
      store4(pp + o, p);
      if (kMomentum) store4(bp + o, b);
      if (cp) store4(cp + o, p);
    }
    j0 = nvec * kVec;
  }
  for (int j = j0 + threadIdx.x; j < w.len; j += kBlock) {
    float p = pp[j], b = (kMomentum && !s.first) ? bp[j] : 0.f;
    element(to_float(gp[j]), p, b);
    pp[j] = p;
    if (kMomentum) bp[j] = b;
    if (cp) cp[j] = from_float<TM>(p);
  }
}

// Calls f(TG{}, TM{}) for the grad and model-copy types (no copy: TM = float, unused).
template <class F>
cudaError_t dispatch_grad_model(int grad_dtype, int model_dtype, bool has_copy, F&& f) {
  return dispatch_dtype(grad_dtype, [&](auto g) {
    return dispatch_dtype(has_copy ? model_dtype : AMPFUNC_FP32, [&](auto m) { return f(g, m); });
  });
}

cudaError_t finish_step(float* step, const uint8_t* finite, int increment_step, cudaStream_t stream) {
  if (!increment_step || step == nullptr) return cudaSuccess;
  increment_step_kernel<<<1, 1, 0, stream>>>(step, finite);
  return cudaGetLastError();
}

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

  void* const* lists[kDepthAdam] = {const_cast<void* const*>(grads), params, exp_avgs, exp_avg_sqs,
                                    args.amsgrad ? max_exp_avg_sqs : nullptr, model_copies};
  cudaError_t err = dispatch_grad_model(grad_dtype, model_dtype, model_copies != nullptr, [&](auto g, auto m) {
    using TG = decltype(g);
    using TM = decltype(m);
    return multi_tensor_apply<kDepthAdam>(n, numels, lists, [&](const TensorListMeta<kDepthAdam>& meta, int nb) {
      if (args.adamw) {
        if (args.amsgrad) adam_kernel<TG, TM, true, true><<<nb, kBlock, 0, stream>>>(meta, args);
        else adam_kernel<TG, TM, true, false><<<nb, kBlock, 0, stream>>>(meta, args);
      } else {
        if (args.amsgrad) adam_kernel<TG, TM, false, true><<<nb, kBlock, 0, stream>>>(meta, args);
        else adam_kernel<TG, TM, false, false><<<nb, kBlock, 0, stream>>>(meta, args);
      }
      return cudaGetLastError();
    });
  });
  if (err != cudaSuccess) return err;
  return finish_step(step, finite, increment_step, stream);
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

  void* const* lists[kDepthSgd] = {const_cast<void* const*>(grads), params, has_momentum ? momentum_bufs : nullptr,
                                   model_copies};
  cudaError_t err = dispatch_grad_model(grad_dtype, model_dtype, model_copies != nullptr, [&](auto g, auto m) {
    using TG = decltype(g);
    using TM = decltype(m);
    return multi_tensor_apply<kDepthSgd>(n, numels, lists, [&](const TensorListMeta<kDepthSgd>& meta, int nb) {
      if (has_momentum) sgd_kernel<TG, TM, true><<<nb, kBlock, 0, stream>>>(meta, args);
      else sgd_kernel<TG, TM, false><<<nb, kBlock, 0, stream>>>(meta, args);
      return cudaGetLastError();
    });
  });
  if (err != cudaSuccess) return err;
  return finish_step(step, finite, increment_step, stream);
}
