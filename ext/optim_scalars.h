// The per-step scalars of the fused optimizers, derived once from the hyper-parameters, for the
// CPU kernels (ext/cpu/kernels.cpp) and the CUDA kernels (ext/cuda/optim.cu) alike: the same
// struct, the same set-up (bias corrections included), on the host or in a CUDA thread.
//
// Every scalar is computed in double from the hyper-parameters and rounded to fp32 once, as
// torch's Python floats are when they reach a kernel; the bias corrections use the step being
// taken (already incremented, from the fp32 step count), as torch's _get_value(step_t).
// Torch-free and plain C++17 / CUDA: compiled by g++ and by nvcc.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define AMPFUNC_HD __host__ __device__
#else
#define AMPFUNC_HD
#endif

namespace ampfunc {

// ---- elementwise helpers of the generic optimizers (ext/optimizers/) ----
// An optimizer's element function is a template over its value type V: float in the CUDA
// kernel (one element per thread), the CPU kernel's vector of floats in the CPU pass
// (ext/cpu/kernels.cpp, which defines the vector overloads of these helpers beside its vector
// type, where argument-dependent lookup finds them). So the element function does its
// arithmetic through these helpers only (no operators, no branch on a value; a branch on a
// per-step scalar is fine), and one definition runs vectorized on the CPU, branch-free.
// Rounded as written: nvcc would contract a product into a following add (one fma, one
// rounding), and the kernels are to round as their reference twins' separate ops do. (The CPU
// kernels' translation unit turns contraction off: ext/cpu/kernels.cpp.)

AMPFUNC_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

AMPFUNC_HD inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

AMPFUNC_HD inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// a * b + c, rounded once.
AMPFUNC_HD inline float fma_rn(float a, float b, float c) { return fmaf(a, b, c); }

// torch.sign: (x > 0) - (x < 0), so 1 or -1 by the sign, +0 at +-0 and at NaN.
AMPFUNC_HD inline float sign_of(float x) { return static_cast<float>(x > 0.f) - static_cast<float>(x < 0.f); }

// torch.lerp(start, end, w) as torch computes it: start + w * (end - start) for |w| < 0.5, else
// end + (w - 1) * (end - start), each a fused multiply-add (exact at both ends of the range).
// w is a per-step scalar, so the choice is one branch per call, not per element.
template <class V>
AMPFUNC_HD inline V lerp(V start, V end, float w) {
  const V diff = sub_rn(end, start);
  return fabsf(w) < 0.5f ? fma_rn(w, diff, start) : fma_rn(sub_rn(w, 1.f), diff, end);
}

// ---- Adam / AdamW ----

struct AdamScalars {
  float grad_scale;       // every gradient is first multiplied by it
  float decay;            // 1 - lr * wd (AdamW: param.mul_)
  float weight_decay;     // wd (Adam: grad.add(param, alpha=wd))
  float lerp_weight;      // 1 - beta1 (exp_avg.lerp_)
  float beta2;
  float one_minus_beta2;  // (exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2))
  float bc2_sqrt;         // sqrt(1 - beta2^t): the CPU kernels divide by it, as torch's CPU path
  float inv_bc2_sqrt;     // 1 / bc2_sqrt: the CUDA kernels multiply by it, as torch's CUDA division
  float eps;
  float neg_step_size;    // -lr / (1 - beta1^t)
  bool l2;                // weight decay added to the gradient (Adam)
  bool decoupled;         // weight decay applied to the param (AdamW)
  bool amsgrad;
  bool maximize;
  bool lerp_small;        // |lerp_weight| < 0.5: torch.lerp's branch
};

// `step`: the step being taken (t = count + 1). `fp32_decay`: 1 - lr * wd taken in fp32 (the
// generic update's arithmetic with a schedule's lr tensor), else in double.
AMPFUNC_HD inline AdamScalars adam_scalars(float grad_scale, double lr, double beta1, double beta2, double eps,
                                           double weight_decay, double step, bool amsgrad, bool decoupled,
                                           bool maximize, bool fp32_decay = false) {
  AdamScalars s;
  const double bc1 = 1.0 - pow(beta1, step);
  const double bc2 = 1.0 - pow(beta2, step);
  s.grad_scale = grad_scale;
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay = fp32_decay ? 1.f - static_cast<float>(lr) * static_cast<float>(weight_decay)
                       : static_cast<float>(1.0 - lr * weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.lerp_small = fabsf(s.lerp_weight) < 0.5f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(sqrt(bc2));
  s.inv_bc2_sqrt = 1.0f / s.bc2_sqrt;
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  s.l2 = weight_decay != 0.0 && !decoupled;
  s.decoupled = weight_decay != 0.0 && decoupled;
  s.amsgrad = amsgrad;
  s.maximize = maximize;
  return s;
}

// ---- SGD ----

struct SgdScalars {
  float grad_scale;
  float lr;
  float neg_lr;               // -lr (param.add_(grad, alpha=-lr))
  float weight_decay;
  float momentum;
  float one_minus_dampening;  // fp32(1 - dampening), the difference taken in double as torch does
  bool nesterov;
  bool maximize;
  bool first_step;            // the momentum buffer is set to the gradient (torch's `buf is None`)
};

// torch's fp32 kernels take SGD's scalar arguments in fp32.
AMPFUNC_HD inline SgdScalars sgd_scalars(float grad_scale, double lr, double weight_decay, double momentum,
                                         double dampening, bool nesterov, bool maximize, bool first_step) {
  SgdScalars s;
  s.grad_scale = grad_scale;
  s.lr = static_cast<float>(lr);
  s.neg_lr = static_cast<float>(-lr);
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - dampening);
  s.nesterov = nesterov;
  s.maximize = maximize;
  s.first_step = first_step;
  return s;
}

}  // namespace ampfunc
