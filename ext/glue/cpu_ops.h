// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// The CPU implementations of the ops (ext/cpu/kernels.h does the arithmetic).
#pragma once

#include "common.h"
#include "validation.h"
#include "cpu_pool.h"
#include "spec.h"

namespace {

// The list an unused state argument stands for (`Work w(c ? list : kNoList)` borrows either).
const Tensors kNoList;

// ---------------------------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------------------------

// The read-only pass of check / check_norm: (finite, sum of squares in double, per-leaf flags).
// With inv_scale the squares are of fp32(x * inv_scale), x judged for finiteness.
std::tuple<bool, double, Tensor> check_pass(const char* op, const Tensors& tensors, bool per_leaf,
                                            const Tensor* inv_scale) {
  const at::Device dev(at::kCPU);
  if (inv_scale) check_scalar(op, "inv_scale", *inv_scale, at::kFloat, dev);
  validate(op, dev, {{"tensors", tensors, Dt::kAnyOr64, false}});
  const float s = inv_scale ? inv_scale->item<float>() : 1.f;
  const int64_t n = static_cast<int64_t>(tensors.size());
  Tensor leaf = at::zeros({per_leaf ? n : 0}, at::TensorOptions().dtype(at::kBool));
  Tensors fast;
  std::deque<Tensor> copies;
  std::vector<int64_t> fast_idx;
  fast.reserve(n);
  if (per_leaf) fast_idx.reserve(n);
  bool finite = true;
  double sumsq = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& t = tensors[i];
    if (kernel_dtype(tensors.dtype(i))) {  // the descriptors: no read of the (cold) tensor itself
      if (tensors.contiguous(i)) {
        fast.push_back(&t, tensors.desc(i));
      } else {
        copies.push_back(t.contiguous());
        fast.push_back(&copies.back());
      }
      if (per_leaf) fast_idx.push_back(i);
    } else {  // float64: rare; plain ATen in double
      const bool ok = at::isfinite(t).all().item<bool>();
      finite = finite && ok;
      if (per_leaf && !ok) leaf[i].fill_(true);
      sumsq += (inv_scale ? t * static_cast<double>(s) : t).square().sum().item<double>();
    }
  }
  std::vector<uint8_t> flags(per_leaf ? fast.size() : 0, 0);
  const auto r = ampfunc::cpu::check(fast, per_leaf ? flags.data() : nullptr, inv_scale != nullptr, s);
  finite = finite && r.finite;
  sumsq += r.sumsq;
  if (per_leaf) {
    bool* lp = leaf.data_ptr<bool>();
    for (size_t k = 0; k < fast.size(); ++k) lp[fast_idx[k]] = flags[k] != 0;
  }
  return {finite, sumsq, leaf};
}

std::tuple<Tensor, Tensor, Tensor> check_cpu(const Tensors& tensors, bool per_leaf) {
  auto [finite, sumsq, leaf] = check_pass("check", tensors, per_leaf, nullptr);
  return {at::scalar_tensor(finite, at::kBool), at::scalar_tensor(static_cast<float>(sumsq), at::kFloat), leaf};
}

// The norm from the double sum: finite whenever every (unscaled) element is finite and the
// norm itself fits in fp32 -- the sum of squares may exceed fp32's range without harm.
std::tuple<Tensor, Tensor, Tensor> check_norm_cpu(const Tensors& tensors, const std::optional<Tensor>& inv_scale,
                                                  bool per_leaf) {
  const Tensor* inv = inv_scale.has_value() && inv_scale->defined() ? &*inv_scale : nullptr;
  auto [finite, sumsq, leaf] = check_pass("check_norm", tensors, per_leaf, inv);
  return {at::scalar_tensor(finite, at::kBool), at::scalar_tensor(static_cast<float>(std::sqrt(sumsq)), at::kFloat),
          leaf};
}

// float64 tensors (rare) take plain ATen here, with the reference's arithmetic: in place the
// product is taken in double; out of place the value is cast to fp32 first, then multiplied.
Tensor unscale__cpu(const Tensors& tensors, const Tensor& inv_scale) {
  const at::Device dev(at::kCPU);
  check_scalar("unscale_", "inv_scale", inv_scale, at::kFloat, dev);
  validate("unscale_", dev, {{"tensors", tensors, Dt::kAnyOr64, true}});
  Tensors fast;
  bool finite = true;
  for (const Tensor& t : tensors) {
    if (kernel_dtype(t.scalar_type())) {
      fast.push_back(&t);
    } else {
      finite = at::isfinite(t).all().item<bool>() && finite;
      t.mul_(static_cast<double>(inv_scale.item<float>()));
    }
  }
  Work w(fast);
  finite = ampfunc::cpu::unscale(w.tensors, w.tensors, inv_scale.item<float>()) && finite;
  w.write_back();
  return at::scalar_tensor(finite, at::kBool);
}

std::tuple<std::vector<Tensor>, Tensor> unscale_cpu(const Tensors& tensors, const Tensor& inv_scale) {
  const at::Device dev(at::kCPU);
  check_scalar("unscale", "inv_scale", inv_scale, at::kFloat, dev);
  validate("unscale", dev, {{"tensors", tensors, Dt::kAnyOr64, false}});
  std::vector<Tensor> outs;
  outs.reserve(tensors.size());  // never reallocates: fast_out points into it
  Tensors fast_in, fast_out;
  std::deque<Tensor> copies;
  bool finite = true;
  for (const Tensor& t : tensors) {
    if (kernel_dtype(t.scalar_type())) {
      outs.push_back(pooled_empty(t.sizes(), at::kFloat));
      if (t.is_contiguous()) {
        fast_in.push_back(&t);
      } else {
        copies.push_back(t.contiguous());
        fast_in.push_back(&copies.back());
      }
      fast_out.push_back(&outs.back());
    } else {
      Tensor o = t.to(at::kFloat);
      finite = at::isfinite(o).all().item<bool>() && finite;
      outs.push_back(o.mul_(inv_scale));
    }
  }
  finite = ampfunc::cpu::unscale(fast_in, fast_out, inv_scale.item<float>()) && finite;
  return {outs, at::scalar_tensor(finite, at::kBool)};
}

// The learning rate: the float, or the value of the 0-d fp32 tensor a schedule produced
// (read in place on the CPU; on CUDA the launchers read it on the device).
double lr_value(const char* op, double lr, const std::optional<Tensor>& lr_tensor, const at::Device& dev) {
  if (!lr_tensor.has_value() || !lr_tensor->defined()) return lr;
  check_scalar(op, "lr_tensor", *lr_tensor, at::kFloat, dev);
  return dev.is_cpu() ? static_cast<double>(lr_tensor->item<float>()) : lr;
}

// The validation of an optimizer's step, its lists read off the spec (spec.h): `state` in the
// spec's order, `hyper` its hyper-parameters in schema order. `inplace`: the op writes params, the
// state lists, model_params and step (else it only reads).
void check_step_args(const char* op, const OptimizerSpec& spec, const Tensors& params, const Tensors& grads,
                     const std::vector<const Tensors*>& state, const std::vector<double>& hyper,
                     const Tensors& model_params, const Tensor& step, const Tensor& grad_scale, const Tensor& finite,
                     const at::Device& dev, bool inplace) {
  check_scalar(op, "step", step, at::kFloat, dev);
  check_scalar(op, "grad_scale", grad_scale, at::kFloat, dev);
  check_scalar(op, "finite", finite, at::kBool, dev);
  std::vector<ListSpec> lists{{"params", params, Dt::kFp32, inplace}, {"grads", grads, Dt::kAny, false}};
  size_t k = 0;
  for (const Tensors* ts : state) {
    if (spec.uses(k, hyper)) lists.push_back({spec.state[k].name, *ts, Dt::kFp32, inplace});
    ++k;
  }
  if (!model_params.empty()) lists.push_back({"model_params", model_params, Dt::kAny, inplace});
  if (inplace) {
    validate(op, dev, lists, {{"step", &step}});
  } else {
    validate(op, dev, lists);
  }
}

void check_sgd_args(const char* op, const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                    const Tensors& model_params, const Tensor& step, const Tensor& grad_scale, const Tensor& finite,
                    double momentum, const at::Device& dev, bool inplace) {
  check_step_args(op, kSgd, params, grads, {&momentum_buffers}, {0.0, momentum, 0.0, 0.0, 0.0}, model_params, step,
                  grad_scale, finite, dev, inplace);
}

void check_adam_args(const char* op, const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                     const Tensors& exp_avg_sqs, const Tensors& max_exp_avg_sqs, const Tensors& model_params, const Tensor& step,
                     const Tensor& grad_scale, const Tensor& finite, bool amsgrad, const at::Device& dev,
                     bool inplace) {
  check_step_args(op, kAdam, params, grads, {&exp_avgs, &exp_avg_sqs, &max_exp_avg_sqs},
                  {0.0, 0.0, 0.0, 0.0, amsgrad ? 1.0 : 0.0, 0.0, 0.0}, model_params, step, grad_scale, finite, dev,
                  inplace);
}

// New contiguous tensors shaped like `ts`, in `dtype` (else each one's), one pooled allocation each
// (the outputs of the out-of-place steps).
std::vector<Tensor> empty_like_list(const Tensors& ts, std::optional<at::ScalarType> dtype = std::nullopt) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(pooled_empty(t.sizes(), dtype.value_or(t.scalar_type())));
  return out;
}

// Whether the running call may hand back new state lists whose tensors share one block (the
// packed outputs below). Only eager calls set it (the direct door; ops._call around an eager
// torch.ops call on CUDA): a custom op that a compiled graph calls must return outputs that
// alias nothing, each other included (torch checks this at run time and will refuse it), so
// there every output is its own allocation.
thread_local bool t_pack_outputs = false;

struct PackOutputs {
  explicit PackOutputs(bool on) : prev(t_pack_outputs) { t_pack_outputs = on; }
  ~PackOutputs() { t_pack_outputs = prev; }
  PackOutputs(const PackOutputs&) = delete;
  PackOutputs& operator=(const PackOutputs&) = delete;
  bool prev;
};

// Contiguous tensors shaped like `ts`, of `meta`'s dtype and with `keys`, as views of `storage`,
// laid out in list order, each view starting at a multiple of `align` bytes (1: tiling exactly).
// Returns the bytes the layout needs when `storage` is null (the first of the two calls).
int64_t views_of(const c10::Storage* storage, const Tensors& ts, caffe2::TypeMeta meta, c10::DispatchKeySet keys,
                 int64_t align, std::vector<Tensor>* out) {
  const int64_t item = static_cast<int64_t>(meta.itemsize());
  int64_t at = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    at = (at + align - 1) / align * align;
    if (storage) {
      Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(*storage), keys, meta);
      c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      impl->set_sizes_contiguous(ts[i].sizes());
      impl->set_storage_offset(at / item);
      out->push_back(std::move(t));
    }
    at += ts.numel(i) * item;
  }
  return at;
}

// New contiguous tensors shaped like `ts`, in `dtype`, as views of ONE new storage (each view
// starting on a 64-byte line): the new optimizer state and the updates of the out-of-place
// steps. One allocation instead of one per leaf, and the next step reads each list as one run
// of memory rather than 10,000 runs scattered over the heap (what ampfunc.flat.zeros_packed
// does for the initial state). Each view is an ordinary tensor with its own version counter.
std::vector<Tensor> packed_empty_like(const Tensors& ts, at::ScalarType dtype) {
  std::vector<Tensor> out;
  if (ts.empty()) return out;
  if (!t_pack_outputs) return empty_like_list(ts, dtype);  // a compiled graph's call: one allocation each
  OutputPool& pool = OutputPool::get();
  const auto meta = caffe2::TypeMeta::fromScalarType(dtype);
  const c10::DispatchKeySet keys(c10::DispatchKey::CPU);
  const int64_t bytes = views_of(nullptr, ts, meta, keys, 64, nullptr);
  c10::Allocator* alloc = pool.enabled() ? static_cast<c10::Allocator*>(&pool) : c10::GetCPUAllocator();
  const c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, alloc, /*resizable=*/true);
  out.reserve(ts.size());
  views_of(&storage, ts, meta, keys, 64, &out);
  return out;
}

void sgd_step__cpu(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers, const Tensors& model_params,
                   const Tensor& step, const Tensor& grad_scale, const Tensor& finite, double lr,
                   const std::optional<Tensor>& lr_tensor, double weight_decay, double momentum, double dampening,
                   bool nesterov, bool maximize) {
  const at::Device dev(at::kCPU);
  check_sgd_args("sgd_step_", params, grads, momentum_buffers, model_params, step, grad_scale, finite, momentum, dev,
                 true);
  lr = lr_value("sgd_step_", lr, lr_tensor, dev);
  if (!finite.item<bool>()) return;  // the skipped step: nothing is written
  Work p(params), g(grads), b(momentum != 0.0 ? momentum_buffers : kNoList), m(model_params);
  float* step_ptr = step.data_ptr<float>();
  const ampfunc::cpu::SgdHyper h =
      ampfunc::sgd_scalars(grad_scale.item<float>(), lr, weight_decay, momentum, dampening, nesterov, maximize, *step_ptr == 0.f);
  ampfunc::cpu::sgd_step(p.tensors, g.tensors, b.tensors, p.tensors, b.tensors, m.tensors, h);
  p.write_back();
  b.write_back();
  m.write_back();
  *step_ptr += 1.f;
}

void adam_step__cpu(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                    const Tensors& max_exp_avg_sqs, const Tensors& model_params, const Tensor& step,
                    const Tensor& grad_scale, const Tensor& finite, double lr,
                    const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                    double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev(at::kCPU);
  check_adam_args("adam_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                  grad_scale, finite, amsgrad, dev, true);
  lr = lr_value("adam_step_", lr, lr_tensor, dev);
  if (!finite.item<bool>()) return;  // the skipped step: nothing is written
  Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : kNoList),
      m(model_params);
  float* step_ptr = step.data_ptr<float>();
  const float next_step = *step_ptr + 1.f;  // torch: step_t += 1 (fp32), then _get_value(step_t)
  ampfunc::cpu::AdamHyper h{grad_scale.item<float>(), lr, beta1, beta2, eps, weight_decay,
                            static_cast<double>(next_step), amsgrad, decoupled_weight_decay, maximize};
  const ampfunc::cpu::AdamLists state{p.tensors, m1.tensors, m2.tensors, vmax.tensors};
  ampfunc::cpu::adam_step(state, g.tensors, state, m.tensors, h);
  p.write_back();
  m1.write_back();
  m2.write_back();
  vmax.write_back();
  m.write_back();
  *step_ptr = next_step;
}

// The out-of-place steps: the same kernels with other destinations. Inputs are only read
// (non-contiguous ones through a contiguous copy); every output is a new contiguous tensor.
// A skipped step (finite false) copies the inputs to the outputs and returns the old step.

using SgdOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, Tensor>;

// The out-of-place SGD step, given `finite` (sgd_step) or checking the gradients in its pass
// (sgd_step_checked), as adam_step_out below.
std::pair<SgdOut, bool> sgd_step_out(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                                     const Tensors& model_params, const Tensor& step, const Tensor& grad_scale,
                                     const Tensor* finite, double lr, const std::optional<Tensor>& lr_tensor,
                                     double weight_decay, double momentum, double dampening, bool nesterov,
                                     bool maximize) {
  const at::Device dev(at::kCPU);
  const Tensor go = finite != nullptr ? Tensor() : at::scalar_tensor(true, at::kBool);
  check_sgd_args("sgd_step", params, grads, momentum_buffers, model_params, step, grad_scale,
                 finite != nullptr ? *finite : go, momentum, dev, false);
  lr = lr_value("sgd_step", lr, lr_tensor, dev);
  const Work p(params), g(grads), b(momentum != 0.0 ? momentum_buffers : kNoList), m(model_params);
  std::vector<Tensor> p_out = empty_like_list(p.tensors), b_out = packed_empty_like(b.tensors, at::kFloat),
                      m_out = empty_like_list(m.tensors);
  const float old_step = step.item<float>(), gs = grad_scale.item<float>();
  bool applied = finite == nullptr || finite->item<bool>();
  if (applied) {
    const ampfunc::cpu::SgdHyper h =
        ampfunc::sgd_scalars(gs, lr, weight_decay, momentum, dampening, nesterov, maximize, old_step == 0.f);
    bool nonfinite = false;
    ampfunc::cpu::sgd_step(p.tensors, g.tensors, b.tensors, p_out, b_out, m_out, h,
                           finite == nullptr ? &nonfinite : nullptr);
    applied = finite != nullptr || (!nonfinite && !std::isnan(gs));
  }
  if (!applied) {  // the skipped step
    ampfunc::cpu::copy(p.tensors, p_out);
    ampfunc::cpu::copy(b.tensors, b_out);
    ampfunc::cpu::copy(m.tensors, m_out);
  }
  return {{p_out, b_out, m_out, at::scalar_tensor(applied ? old_step + 1.f : old_step, at::kFloat)}, applied};
}

SgdOut sgd_step_cpu(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers, const Tensors& model_params,
                    const Tensor& step, const Tensor& grad_scale, const Tensor& finite, double lr,
                    const std::optional<Tensor>& lr_tensor, double weight_decay, double momentum, double dampening,
                    bool nesterov, bool maximize) {
  return sgd_step_out(params, grads, momentum_buffers, model_params, step, grad_scale, &finite, lr, lr_tensor,
                      weight_decay, momentum, dampening, nesterov, maximize)
      .first;
}

using SgdCheckedOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, Tensor, Tensor>;

SgdCheckedOut sgd_step_checked_cpu(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                                   const Tensors& model_params, const Tensor& step, const Tensor& grad_scale,
                                   double lr, const std::optional<Tensor>& lr_tensor, double weight_decay,
                                   double momentum, double dampening, bool nesterov, bool maximize) {
  auto [out, applied] = sgd_step_out(params, grads, momentum_buffers, model_params, step, grad_scale, nullptr, lr,
                                     lr_tensor, weight_decay, momentum, dampening, nesterov, maximize);
  return std::tuple_cat(std::move(out), std::make_tuple(at::scalar_tensor(applied, at::kBool)));
}

using AdamOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                           std::vector<Tensor>, Tensor>;

// The out-of-place Adam step. Given `finite` (adam_step): the kernel runs when it is true; on a
// skipped step the outputs are copies of the inputs and the step count stays. Without it
// (adam_step_checked): the finiteness check of the gradients (check()'s flag) runs in the
// optimizer's pass instead of a pass of its own, since the inputs survive an out-of-place step
// (the pure steps without clipping need no norm first); the step is applied when every
// gradient element is finite and grad_scale is not NaN, else the outputs are overwritten with
// copies of the inputs -- the outputs and flag of check() followed by adam_step(), bit for bit.
// Only the direct door serves the checked form; elsewhere ops.adam_step_checked composes the ops.
std::pair<AdamOut, bool> adam_step_out(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                                       const Tensors& exp_avg_sqs, const Tensors& max_exp_avg_sqs,
                                       const Tensors& model_params, const Tensor& step, const Tensor& grad_scale,
                                       const Tensor* finite, double lr, const std::optional<Tensor>& lr_tensor,
                                       double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
                                       bool decoupled_weight_decay, bool maximize) {
  const at::Device dev(at::kCPU);
  const Tensor go = finite != nullptr ? Tensor() : at::scalar_tensor(true, at::kBool);
  check_adam_args("adam_step", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                  grad_scale, finite != nullptr ? *finite : go, amsgrad, dev, false);
  lr = lr_value("adam_step", lr, lr_tensor, dev);
  const Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : kNoList),
      m(model_params);
  std::vector<Tensor> p_out = empty_like_list(p.tensors), m1_out = packed_empty_like(m1.tensors, at::kFloat),
                      m2_out = packed_empty_like(m2.tensors, at::kFloat),
                      vmax_out = packed_empty_like(vmax.tensors, at::kFloat), m_out = empty_like_list(m.tensors);
  const float old_step = step.item<float>(), gs = grad_scale.item<float>();
  const float next_step = old_step + 1.f;  // torch: step_t += 1 (fp32), then _get_value(step_t)
  bool applied = finite == nullptr || finite->item<bool>();
  if (applied) {
    ampfunc::cpu::AdamHyper h{gs, lr, beta1, beta2, eps, weight_decay, static_cast<double>(next_step), amsgrad,
                              decoupled_weight_decay, maximize};
    bool nonfinite = false;
    ampfunc::cpu::adam_step({p.tensors, m1.tensors, m2.tensors, vmax.tensors}, g.tensors,
                            {p_out, m1_out, m2_out, vmax_out}, m_out, h, finite == nullptr ? &nonfinite : nullptr);
    applied = finite != nullptr || (!nonfinite && !std::isnan(gs));
  }
  if (!applied) {  // the skipped step
    for (auto [src, dst] : {std::pair{&p.tensors, &p_out}, {&m1.tensors, &m1_out}, {&m2.tensors, &m2_out},
                            {&vmax.tensors, &vmax_out}, {&m.tensors, &m_out}}) {
      ampfunc::cpu::copy(*src, *dst);
    }
  }
  return {{p_out, m1_out, m2_out, vmax_out, m_out, at::scalar_tensor(applied ? next_step : old_step, at::kFloat)},
          applied};
}

AdamOut adam_step_cpu(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                      const Tensors& max_exp_avg_sqs, const Tensors& model_params, const Tensor& step,
                      const Tensor& grad_scale, const Tensor& finite, double lr,
                      const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                      double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  return adam_step_out(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, &finite,
                       lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize)
      .first;
}

using AdamCheckedOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                                  std::vector<Tensor>, Tensor, Tensor>;

AdamCheckedOut adam_step_checked_cpu(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                                     const Tensors& exp_avg_sqs, const Tensors& max_exp_avg_sqs,
                                     const Tensors& model_params, const Tensor& step, const Tensor& grad_scale,
                                     double lr, const std::optional<Tensor>& lr_tensor, double beta1, double beta2,
                                     double eps, double weight_decay, bool amsgrad, bool decoupled_weight_decay,
                                     bool maximize) {
  auto [out, applied] = adam_step_out(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                                      grad_scale, nullptr, lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad,
                                      decoupled_weight_decay, maximize);
  return std::tuple_cat(std::move(out), std::make_tuple(at::scalar_tensor(applied, at::kBool)));
}

// The pure optimizers' updates (optax form): new tensors `updates` (fp32) and new state; the
// inputs are only read. `params` may be empty when weight_decay == 0 (the update does not need
// them); then grads give the shapes.

// The validation of an optimizer's pure update, its lists read off the spec (as check_step_args).
void check_update_args(const char* op, const OptimizerSpec& spec, const Tensors& params, const Tensors& grads,
                       const std::vector<const Tensors*>& state, const std::vector<double>& hyper,
                       const Tensor& step, const Tensor& grad_scale, const at::Device& dev) {
  check_scalar(op, "step", step, at::kFloat, dev);
  check_scalar(op, "grad_scale", grad_scale, at::kFloat, dev);
  double weight_decay = 0.0;
  for (size_t i = 0; i < spec.hypers.size(); ++i) {
    if (std::string(spec.hypers[i].name) == "weight_decay") weight_decay = hyper[i];
  }
  TORCH_CHECK_VALUE(!params.empty() || grads.empty() || weight_decay == 0.0, "ampfunc: weight_decay != 0 needs ",
                    "params (", op, ")");
  std::vector<ListSpec> lists;
  if (!params.empty()) lists.push_back({"params", params, Dt::kFp32, false});
  lists.push_back({"grads", grads, Dt::kAny, false});
  size_t k = 0;
  for (const Tensors* ts : state) {
    if (spec.uses(k, hyper)) lists.push_back({spec.state[k].name, *ts, Dt::kFp32, false});
    ++k;
  }
  validate(op, dev, lists);
}

using SgdUpdateOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, Tensor>;

SgdUpdateOut sgd_update_cpu(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers, const Tensor& step,
                            const Tensor& grad_scale, double lr, const std::optional<Tensor>& lr_tensor,
                            double weight_decay, double momentum, double dampening, bool nesterov, bool maximize) {
  const at::Device dev(at::kCPU);
  const bool has_buf = momentum != 0.0;
  check_update_args("sgd_update", kSgd, params, grads, {&momentum_buffers},
                    {weight_decay, momentum, dampening, nesterov ? 1.0 : 0.0, maximize ? 1.0 : 0.0}, step, grad_scale,
                    dev);
  lr = lr_value("sgd_update", lr, lr_tensor, dev);
  const Work p(params), g(grads), b(has_buf ? momentum_buffers : kNoList);
  std::vector<Tensor> d_out = packed_empty_like(g.tensors, at::kFloat);
  std::vector<Tensor> b_out = packed_empty_like(b.tensors, at::kFloat);
  const float old_step = step.item<float>();
  // as the generic update: the formula from the zero buffer unless dampening
  const ampfunc::cpu::SgdHyper h = ampfunc::sgd_scalars(grad_scale.item<float>(), lr, weight_decay, momentum, dampening,
                                                        nesterov, maximize, dampening != 0.0 && old_step == 0.f);
  ampfunc::cpu::sgd_update(p.tensors, g.tensors, b.tensors, b_out, d_out, h);
  return {d_out, b_out, at::scalar_tensor(old_step + 1.f, at::kFloat)};
}

using AdamUpdateOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                                 Tensor>;

AdamUpdateOut adam_update_cpu(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                              const Tensors& max_exp_avg_sqs, const Tensor& step, const Tensor& grad_scale, double lr,
                              const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                              double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev(at::kCPU);
  check_update_args("adam_update", kAdam, params, grads, {&exp_avgs, &exp_avg_sqs, &max_exp_avg_sqs},
                    {beta1, beta2, eps, weight_decay, amsgrad ? 1.0 : 0.0, decoupled_weight_decay ? 1.0 : 0.0,
                     maximize ? 1.0 : 0.0},
                    step, grad_scale, dev);
  const bool lr_is_tensor = lr_tensor.has_value() && lr_tensor->defined();
  lr = lr_value("adam_update", lr, lr_tensor, dev);
  const Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : kNoList);
  std::vector<Tensor> d_out = packed_empty_like(g.tensors, at::kFloat);
  std::vector<Tensor> m1_out = packed_empty_like(m1.tensors, at::kFloat),
                      m2_out = packed_empty_like(m2.tensors, at::kFloat),
                      vmax_out = packed_empty_like(vmax.tensors, at::kFloat);
  const float next_step = step.item<float>() + 1.f;
  ampfunc::cpu::AdamHyper h{grad_scale.item<float>(), lr, beta1, beta2, eps, weight_decay,
                            static_cast<double>(next_step), amsgrad, decoupled_weight_decay, maximize, lr_is_tensor};
  const std::vector<Tensor> none;
  ampfunc::cpu::adam_update({p.tensors, m1.tensors, m2.tensors, vmax.tensors}, g.tensors,
                            {none, m1_out, m2_out, vmax_out}, d_out, h);
  return {d_out, m1_out, m2_out, vmax_out, at::scalar_tensor(next_step, at::kFloat)};
}

// params + updates, one pass, each result in its param's dtype (the sum in fp32, rounded once).
std::vector<Tensor> apply_updates_cpu(const Tensors& params, const Tensors& updates) {
  const at::Device dev(at::kCPU);
  validate("apply_updates", dev, {{"params", params, Dt::kAny, false}, {"updates", updates, Dt::kAny, false}});
  const Work p(params), u(updates);
  std::vector<Tensor> outs = empty_like_list(p.tensors);
  ampfunc::cpu::apply_updates(p.tensors, u.tensors, outs);
  return outs;
}

void check_scale_args(const Tensor& scale, const Tensor& growth_tracker, const Tensor& hysteresis_tracker,
                      const Tensor& finite, int64_t growth_interval, int64_t hysteresis) {
  const at::Device dev = scale.device();
  check_scalar("update_scale_", "scale", scale, at::kFloat, dev);
  check_scalar("update_scale_", "growth_tracker", growth_tracker, at::kInt, dev);
  check_scalar("update_scale_", "hysteresis_tracker", hysteresis_tracker, at::kInt, dev);
  check_scalar("update_scale_", "finite", finite, at::kBool, dev);
  TORCH_CHECK(growth_interval >= 1, "ampfunc.update_scale_: growth_interval must be >= 1, got ", growth_interval);
  TORCH_CHECK(hysteresis >= 1, "ampfunc.update_scale_: hysteresis must be >= 1, got ", hysteresis);
}

void update_scale__cpu(const Tensor& scale, const Tensor& growth_tracker, const Tensor& hysteresis_tracker,
                       const Tensor& finite, double growth_factor, double backoff_factor, int64_t growth_interval,
                       double min_scale, double max_scale, int64_t hysteresis) {
  check_scale_args(scale, growth_tracker, hysteresis_tracker, finite, growth_interval, hysteresis);
  ampfunc::cpu::update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                             hysteresis_tracker.data_ptr<int32_t>(), finite.item<bool>(),
                             {growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis});
}

}  // namespace
