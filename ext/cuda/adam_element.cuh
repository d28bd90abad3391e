// The per-element Adam/AdamW step of the fp32 CUDA kernel (optim.cu) and of the low-memory
// kernel (lowmem.cu): one definition, so the low-memory step's fp32 numbers are the fp32
// kernel's bit for bit (ampfunc.lowmem's fused and plain roads agree on CUDA as on the CPU).
//
// Rounding follows torch.optim's single-tensor CUDA path op by op: where torch rounds between
// two ops this rounds too (__fmul_rn / __fadd_rn, which nvcc never contracts), where torch's
// kernel computes a + alpha*b it is one fma.
#pragma once

#include <math.h>

#include "../optim_scalars.h"

namespace ampfunc {
namespace cuda {

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

}  // namespace cuda
}  // namespace ampfunc
