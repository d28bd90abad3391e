// The fused optimizers run by the generic drivers: each one header in ext/optimizers/ (its
// spec, its per-step scalars and its per-element step, shared by the CPU and CUDA kernels), and
// one line in AMPFUNC_OPTIMIZERS below. From that line the CPU kernel (ext/cpu/kernels.cpp), the
// CUDA kernel and launcher (ext/cuda/optimizers.cu), the glue and its registration
// (ext/glue/optimizers.h) and the spec table the tests compare with Python's
// (ext/glue/spec.h) are instantiated; the Python side is ampfunc/ops/optimizers/<name>.py.
// Torch-free: included by g++ and by nvcc.
//
// An optimizer's header defines a struct with:
//   kName; kState, kStateNames[], kStateWhen[] (nullptr, or the hyper-parameter that turns the
//   list on); kHypers, kHyperNames[], kHyperKinds[] ("float" or "bool"), in schema order;
//   struct Scalars and AMPFUNC_HD static Scalars scalars(const double* hyper, float grad_scale,
//   double lr, double step, bool fp32_decay): the per-step scalars (step: the one being taken);
//   template <class V> AMPFUNC_HD static void element(V g, V& p, V* state, const Scalars&): one
//   element (V = float: the CUDA kernel) or one vector of them (the CPU pass), g the raw gradient
//   in fp32, p and the state values updated in place; its arithmetic through the helpers of
//   optim_scalars.h only (mul_rn, add_rn, sub_rn, fma_rn, lerp, sign_of), so that the CPU pass
//   runs it on at::vec vectors without a branch on a value.
// Adam and SGD predate the generic drivers and keep their own kernels (ext/cpu/kernels.cpp,
// ext/cuda/optim.cu) and glue.
#pragma once

#include "optim_scalars.h"
#include "optimizers/lion.h"

// X(name, type) for every generic optimizer.
#define AMPFUNC_OPTIMIZERS(X) X(lion, ::ampfunc::optimizers::Lion)
