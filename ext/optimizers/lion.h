// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as optax.lion, with
// decoupled weight decay: per element, with g the gradient times grad_scale,
//   c = lerp(g, m, beta1)               = beta1 * m + (1 - beta1) * g   (torch.lerp's formula)
//   p = p * (1 - lr * weight_decay) - lr * sign(c)      (sign(0) = sign(NaN) = 0, as torch.sign)
//   m = lerp(m, g, 1 - beta2)           = beta2 * m + (1 - beta2) * g
// The spec of ampfunc/ops/optimizers/lion.py (its reference twin has these operations, in this
// order). One definition for the CPU and CUDA kernels (ext/optimizers.h).
#pragma once

#include "../optim_scalars.h"

namespace ampfunc {
namespace optimizers {

struct Lion {
  static constexpr const char* kName = "lion";
  static constexpr int kState = 1;
  static constexpr const char* kStateNames[kState] = {"exp_avgs"};
  static constexpr const char* kStateWhen[kState] = {nullptr};
  static constexpr int kHypers = 3;
  static constexpr const char* kHyperNames[kHypers] = {"beta1", "beta2", "weight_decay"};
  static constexpr const char* kHyperKinds[kHypers] = {"float", "float", "float"};

  struct Scalars {
    float grad_scale;
    float neg_lr;     // -lr: lr * sign(c) is exact, so p - lr * sign(c) rounds once
    float decay;      // 1 - lr * weight_decay
    float w_c, w_m;   // the lerp weights: beta1 (c from g towards m), 1 - beta2 (m towards g)
    bool decoupled;   // weight_decay != 0
  };

  AMPFUNC_HD static Scalars scalars(const double* hyper, float grad_scale, double lr, double /*step*/,
                                    bool fp32_decay) {
    Scalars s;
    const double beta1 = hyper[0], beta2 = hyper[1], weight_decay = hyper[2];
    s.grad_scale = grad_scale;
    s.neg_lr = static_cast<float>(-lr);
    s.decay = fp32_decay ? 1.f - static_cast<float>(lr) * static_cast<float>(weight_decay)
                         : static_cast<float>(1.0 - lr * weight_decay);
    s.w_c = static_cast<float>(beta1);
    s.w_m = static_cast<float>(1.0 - beta2);
    s.decoupled = weight_decay != 0.0;
    return s;
  }

  // V: float, or the CPU pass's vector of floats (ext/optim_scalars.h's helpers only).
  template <class V>
  AMPFUNC_HD static void element(V g, V& p, V* state, const Scalars& s) {
    V& m = state[0];
    g = mul_rn(g, s.grad_scale);
    const V u = sign_of(lerp(g, m, s.w_c));  // torch.sign: 0 at +-0 and at NaN
    if (s.decoupled) p = mul_rn(p, s.decay);
    p = fma_rn(s.neg_lr, u, p);
    m = lerp(m, g, s.w_m);
  }
};

}  // namespace optimizers
}  // namespace ampfunc
