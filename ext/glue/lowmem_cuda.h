// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once). The CUDA implementation of ampfunc::adam_lowmem_step_: the CPU
// kernel's checks (ext/cpu/lowmem_checks.h: every argument before any write, errors naming the
// list and the index, overlapping written tensors refused), then the launcher
// ampfunc_cuda_adam_lowmem_step (ext/cuda/lowmem.cu). Nothing is read back to the host: finite,
// step, grad_scale and lr_tensor reach the kernels as device pointers. Empty without
// AMPFUNC_WITH_CUDA.
#pragma once

#include "common.h"
#include "cuda_ops.h"
#include "../cpu/lowmem_checks.h"

namespace {

#ifdef AMPFUNC_WITH_CUDA

// The CUDA device of the call: the first CUDA tensor among the params and the 0-d arguments
// (the dispatcher sent the call here because one of its tensors is on CUDA).
at::Device lowmem_device(TensorList params, std::initializer_list<const Tensor*> others) {
  for (const Tensor& t : params) {
    if (t.defined() && t.is_cuda()) return t.device();
  }
  for (const Tensor* t : others) {
    if (t->defined() && t->is_cuda()) return t->device();
  }
  return params.empty() || !params[0].defined() ? others.begin()[0]->device() : params[0].device();
}

int lowmem_layout(const Tensor& moment) {
  switch (moment.scalar_type()) {
    case at::kFloat: return AMPFUNC_FP32;
    case at::kBFloat16: return AMPFUNC_BF16;
    default: return AMPFUNC_Q8;  // uint8 codes (the checks allow nothing else)
  }
}

void adam_lowmem_step__cuda(TensorList params, TensorList remainders, TensorList grads, TensorList exp_avgs,
                            TensorList exp_avg_absmax, TensorList exp_avg_sqs, TensorList exp_avg_sq_absmax,
                            const Tensor& step, const Tensor& grad_scale, const Tensor& finite, const Tensor& qmaps,
                            const Tensor& qbases, double lr, const std::optional<Tensor>& lr_tensor, double beta1,
                            double beta2, double eps, double weight_decay, bool decoupled_weight_decay,
                            bool maximize) {
  const at::Device dev = lowmem_device(params, {&step, &grad_scale, &finite, &qmaps, &qbases});
  ampfunc::lowmem::check_args(params, remainders, grads, exp_avgs, exp_avg_absmax, exp_avg_sqs, exp_avg_sq_absmax,
                              step, grad_scale, finite, qmaps, qbases, lr_tensor, dev);
  ampfunc::lowmem::check_hypers(lr, beta1, beta2, eps, weight_decay);
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const size_t n = params.size();
  std::vector<const void*> g(n);
  std::vector<void*> p(n), r(n), m(n), ma(n), v(n), va(n);
  std::vector<int> gk(n), pk(n), mk(n);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = grads[i].data_ptr();
    p[i] = params[i].data_ptr();
    r[i] = remainders[i].numel() ? remainders[i].data_ptr() : nullptr;
    m[i] = exp_avgs[i].data_ptr();
    v[i] = exp_avg_sqs[i].data_ptr();
    ma[i] = exp_avg_absmax[i].numel() ? exp_avg_absmax[i].data_ptr() : nullptr;
    va[i] = exp_avg_sq_absmax[i].numel() ? exp_avg_sq_absmax[i].data_ptr() : nullptr;
    gk[i] = cuda_dtype(grads[i].scalar_type());
    pk[i] = cuda_dtype(params[i].scalar_type());
    mk[i] = lowmem_layout(exp_avgs[i]);
    numels[i] = params[i].numel();
  }
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  AmpfuncAdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay ? 1 : 0, 0, maximize ? 1 : 0};
  cuda_ok("adam_lowmem_step_", ampfunc_cuda_adam_lowmem_step(
                                   static_cast<int>(n), g.data(), gk.data(), p.data(), pk.data(), r.data(), m.data(),
                                   ma.data(), v.data(), va.data(), mk.data(), numels.data(),
                                   qmaps.data_ptr<float>(), qbases.data_ptr<uint8_t>(), grad_scale.data_ptr<float>(),
                                   reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()), lr_ptr,
                                   step.data_ptr<float>(), &h, stream.stream()));
}

#endif  // AMPFUNC_WITH_CUDA

}  // namespace
