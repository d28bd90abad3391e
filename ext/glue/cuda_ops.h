// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// The CUDA implementations of the ops (the launchers of ext/cuda/ampfunc_cuda.h do the
// arithmetic); empty without AMPFUNC_WITH_CUDA.
#pragma once

#include "common.h"
#include "validation.h"
#include "cpu_ops.h"

namespace {

// ---------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------

#ifdef AMPFUNC_WITH_CUDA

// The launchers' signatures and meanings this glue was written for (ext/cuda/ampfunc_cuda.h).
static_assert(AMPFUNC_CUDA_ABI_VERSION == 5, "ext/cuda/ampfunc_cuda.h changed its ABI: update the CUDA glue");

int cuda_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return AMPFUNC_FP32;
    case at::kHalf: return AMPFUNC_FP16;
    case at::kBFloat16: return AMPFUNC_BF16;
    default: TORCH_CHECK(false, "ampfunc: unsupported dtype ", t);
  }
}

void cuda_ok(const char* op, int status) {
  TORCH_CHECK(status == 0, "ampfunc.", op, " (CUDA): ", ampfunc_cuda_error_string(status));
}

// Leaves grouped by (dtype of list A, dtype of list B); indices in call order.
template <typename Key>
std::vector<std::pair<Key, std::vector<int64_t>>> group_by(int64_t n, const std::function<Key(int64_t)>& key) {
  std::vector<std::pair<Key, std::vector<int64_t>>> groups;
  for (int64_t i = 0; i < n; ++i) {
    const Key k = key(i);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
    if (it == groups.end()) groups.push_back({k, {i}}); else it->second.push_back(i);
  }
  return groups;
}

// Pointer arrays of a group of leaves across several lists, with runs of leaves that are
// adjacent in memory in every list (views tiling one flat buffer) merged into one entry, so a
// flat buffer is one leaf for the launcher whatever the number of views.
struct Packed {
  std::vector<std::vector<void*>> ptrs;  // per list
  std::vector<int64_t> numels;
};

Packed pack(const std::vector<const Tensors*>& lists, const std::vector<int64_t>& idx, bool merge) {
  Packed pk;
  pk.ptrs.resize(lists.size());
  for (int64_t i : idx) {
    const int64_t numel = (*lists[0])[i].numel();
    if (numel == 0) continue;
    bool adjacent = merge && !pk.numels.empty();
    for (size_t l = 0; adjacent && l < lists.size(); ++l) {
      const Tensor& t = (*lists[l])[i];
      char* end = static_cast<char*>(pk.ptrs[l].back()) + pk.numels.back() * t.element_size();
      adjacent = static_cast<char*>(t.data_ptr()) == end;
    }
    if (adjacent) {
      pk.numels.back() += numel;
    } else {
      for (size_t l = 0; l < lists.size(); ++l) pk.ptrs[l].push_back((*lists[l])[i].data_ptr());
      pk.numels.push_back(numel);
    }
  }
  return pk;
}

// The groups packed over `lists`, leaving out the groups whose leaves are all empty (they
// launch nothing, and their pointer arrays would be null).
template <typename Key>
std::vector<std::pair<Key, Packed>> packed_groups(const std::vector<const Tensors*>& lists,
                                                  const std::vector<std::pair<Key, std::vector<int64_t>>>& groups) {
  std::vector<std::pair<Key, Packed>> packs;
  for (const auto& [key, idx] : groups) {
    Packed pk = pack(lists, idx, true);
    if (!pk.numels.empty()) packs.emplace_back(key, std::move(pk));
  }
  return packs;
}

// The read-only pass of check / check_norm on CUDA: (finite, fp32 sum of squares or, with
// `norm`, the fp32 norm, per-leaf flags). The launcher sums without overflow while every value
// is finite and combines the dtype groups in double (a running sum at the front of the one
// workspace, shared by the groups' calls in stream order); its last call rounds the result.
std::tuple<Tensor, Tensor, Tensor> check_pass_cuda(const char* op, TensorList tensors, bool per_leaf,
                                                   const Tensor* inv_scale, bool norm) {
  TORCH_CHECK(!tensors.empty(), "ampfunc.check: empty list on CUDA");  // empty lists never reach here
  const at::Device dev = tensors[0].device();
  if (inv_scale) check_scalar(op, "inv_scale", *inv_scale, at::kFloat, dev);
  validate(op, dev, {{"tensors", tensors, Dt::kAnyOr64, false}});
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = static_cast<int64_t>(tensors.size());
  Work w(tensors);
  auto opts = at::TensorOptions().device(dev);
  Tensor finite = at::empty({}, opts.dtype(at::kBool));
  Tensor result = at::empty({}, opts.dtype(at::kFloat));
  Tensor leaf = at::zeros({per_leaf ? n : 0}, opts.dtype(at::kBool));
  auto groups = group_by<at::ScalarType>(n, [&](int64_t i) { return w.tensors[i].scalar_type(); });
  // float64 tensors (rare) take plain ATen on the device, in double, as on the CPU: their flag and
  // sum of squares start the accumulators the launchers then add to.
  std::optional<Tensor> ok64, sumsq64;
  for (const auto& [dtype, idx] : groups) {
    if (dtype != at::kDouble) continue;
    for (int64_t i : idx) {
      const Tensor& t = tensors[i];
      const Tensor ok = at::isfinite(t).all();
      if (per_leaf) leaf.narrow(0, i, 1).copy_(ok.logical_not().reshape({1}));
      const Tensor sq = (inv_scale ? t * inv_scale->to(at::kDouble) : t).square().sum();
      ok64 = ok64 ? ok64->logical_and(ok) : ok;
      sumsq64 = sumsq64 ? *sumsq64 + sq : sq;
    }
  }
  std::vector<std::pair<size_t, Packed>> packs;  // (index in groups, its pointers)
  int64_t ws_bytes = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (groups[gi].first == at::kDouble) continue;
    Packed pk = pack({&w.tensors}, groups[gi].second, /*merge=*/!per_leaf);
    if (pk.numels.empty()) continue;
    ws_bytes = std::max(ws_bytes, ampfunc_cuda_check_workspace_bytes(static_cast<int>(pk.numels.size()),
                                                                      pk.numels.data()));
    packs.emplace_back(gi, std::move(pk));
  }
  if (packs.empty()) {  // every tensor was empty or float64
    if (ok64) {
      finite.copy_(*ok64);
      result.copy_(norm ? sumsq64->sqrt() : *sumsq64);
    } else {
      finite.fill_(true);
      result.zero_();
    }
    return {finite, result, leaf};
  }
  // [double running sum][the partials of one group's call]: at::empty's blocks are 8-byte aligned.
  Tensor ws = at::empty({static_cast<int64_t>(sizeof(double)) + ws_bytes}, opts.dtype(at::kByte));
  double* sumsq = reinterpret_cast<double*>(ws.data_ptr());
  if (ok64) {  // the launchers accumulate onto the float64 part (device copies: no host sync)
    finite.copy_(*ok64);
    ws.narrow(0, 0, sizeof(double)).view(at::kDouble).copy_(sumsq64->reshape({1}));
  }
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [gi, pk] = packs[k];
    const auto& [dtype, idx] = groups[gi];
    const bool last = k + 1 == packs.size();
    const int m = static_cast<int>(pk.numels.size());
    Tensor group_leaf = per_leaf ? at::empty({m}, opts.dtype(at::kBool)) : Tensor();
    cuda_ok(op, ampfunc_cuda_check(m, pk.ptrs[0].data(), pk.numels.data(), cuda_dtype(dtype),
                                   inv_scale ? inv_scale->data_ptr<float>() : nullptr,
                                   reinterpret_cast<uint8_t*>(finite.data_ptr<bool>()), sumsq,
                                   last && !norm ? result.data_ptr<float>() : nullptr,
                                   last && norm ? result.data_ptr<float>() : nullptr,
                                   per_leaf ? reinterpret_cast<uint8_t*>(group_leaf.data_ptr<bool>()) : nullptr,
                                   sumsq + 1, ws_bytes, k == 0 && !ok64 ? 0 : 1, stream.stream()));
    if (per_leaf) {
      // group_leaf holds the group's non-empty tensors in order: copied into `leaf` one run of
      // consecutive indices at a time (device-to-device slices: nothing from host memory, so the
      // op stays capturable in a CUDA graph; one run when the list has one dtype)
      int64_t j = 0;
      const int64_t count = static_cast<int64_t>(idx.size());
      for (int64_t a = 0; a < count;) {
        if (w.tensors[idx[a]].numel() == 0) {
          ++a;
          continue;
        }
        int64_t b = a + 1;
        while (b < count && idx[b] == idx[b - 1] + 1 && w.tensors[idx[b]].numel() > 0) ++b;
        leaf.narrow(0, idx[a], b - a).copy_(group_leaf.narrow(0, j, b - a));
        j += b - a;
        a = b;
      }
    }
  }
  return {finite, result, leaf};
}

std::tuple<Tensor, Tensor, Tensor> check_cuda(TensorList tensors, bool per_leaf) {
  return check_pass_cuda("check", tensors, per_leaf, nullptr, /*norm=*/false);
}

// The norm from the launcher's double sum: finite whenever every (unscaled) element is finite
// and the norm itself fits in fp32, as on the CPU.
std::tuple<Tensor, Tensor, Tensor> check_norm_cuda(TensorList tensors, const std::optional<Tensor>& inv_scale,
                                                   bool per_leaf) {
  const Tensor* inv = inv_scale.has_value() && inv_scale->defined() ? &*inv_scale : nullptr;
  return check_pass_cuda("check_norm", tensors, per_leaf, inv, /*norm=*/true);
}

Tensor unscale__cuda(TensorList tensors, const Tensor& inv_scale) {
  const at::Device dev = device_of(tensors, inv_scale);
  check_scalar("unscale_", "inv_scale", inv_scale, at::kFloat, dev);
  validate("unscale_", dev, {{"tensors", tensors, Dt::kAnyOr64, true}});
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Work w(tensors);
  Tensor finite = at::ones({}, at::TensorOptions().device(dev).dtype(at::kBool));
  auto groups = group_by<at::ScalarType>(w.tensors.size(), [&](int64_t i) { return w.tensors[i].scalar_type(); });
  for (auto& [dtype, idx] : groups) {
    if (dtype == at::kDouble) {  // rare: plain ATen on the device, the product in double (as on the CPU)
      for (int64_t i : idx) {
        const Tensor& t = w.tensors[i];  // the working copy of a strided one: write_back() below copies it back
        finite.logical_and_(at::isfinite(t).all());
        t.mul_(inv_scale.to(at::kDouble));
      }
      continue;
    }
    Packed pk = pack({&w.tensors}, idx, true);
    if (pk.numels.empty()) continue;
    cuda_ok("unscale_", ampfunc_cuda_unscale_(static_cast<int>(pk.numels.size()), pk.ptrs[0].data(),
                                              pk.numels.data(), cuda_dtype(dtype), inv_scale.data_ptr<float>(),
                                              reinterpret_cast<uint8_t*>(finite.data_ptr<bool>()), 1,
                                              stream.stream()));
  }
  w.write_back();
  return finite;
}

std::tuple<std::vector<Tensor>, Tensor> unscale_cuda(TensorList tensors, const Tensor& inv_scale) {
  const at::Device dev = device_of(tensors, inv_scale);
  check_scalar("unscale", "inv_scale", inv_scale, at::kFloat, dev);
  validate("unscale", dev, {{"tensors", tensors, Dt::kAnyOr64, false}});
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Work w(tensors);
  std::vector<Tensor> outs;
  for (const Tensor& t : tensors) outs.push_back(at::empty(t.sizes(), t.options().dtype(at::kFloat)));
  Tensor finite = at::ones({}, at::TensorOptions().device(dev).dtype(at::kBool));
  auto groups = group_by<at::ScalarType>(w.tensors.size(), [&](int64_t i) { return w.tensors[i].scalar_type(); });
  for (auto& [dtype, idx] : groups) {
    if (dtype == at::kDouble) {  // rare: plain ATen, cast to fp32 first, then multiplied (as on the CPU)
      for (int64_t i : idx) {
        outs[i].copy_(tensors[i]);
        finite.logical_and_(at::isfinite(outs[i]).all());
        outs[i].mul_(inv_scale);
      }
      continue;
    }
    const Tensors outs_v(outs);
    Packed pk = pack({&w.tensors, &outs_v}, idx, false);
    if (pk.numels.empty()) continue;
    cuda_ok("unscale", ampfunc_cuda_unscale(static_cast<int>(pk.numels.size()), pk.ptrs[0].data(), pk.ptrs[1].data(),
                                            pk.numels.data(), cuda_dtype(dtype), inv_scale.data_ptr<float>(),
                                            reinterpret_cast<uint8_t*>(finite.data_ptr<bool>()), 1, stream.stream()));
  }
  return {outs, finite};
}

void sgd_step__cuda(TensorList params, TensorList grads, TensorList momentum_buffers, TensorList model_params,
                    const Tensor& step, const Tensor& grad_scale, const Tensor& finite, double lr,
                    const std::optional<Tensor>& lr_tensor, double weight_decay, double momentum,
                    double dampening, bool nesterov, bool maximize) {
  const at::Device dev = device_of(params, step);
  lr_value("sgd_step_", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  check_sgd_args("sgd_step_", params, grads, momentum_buffers, model_params, step, grad_scale, finite, momentum,
                 dev, true);
  const bool has_buf = momentum != 0.0;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Work p(params), g(grads), b(has_buf ? momentum_buffers : TensorList()), m(model_params);
  const bool has_model = !m.tensors.empty();
  AmpfuncSgdHyper h{lr, momentum, dampening, weight_decay, nesterov ? 1 : 0, maximize ? 1 : 0};
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(p.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  std::vector<const Tensors*> lists{&p.tensors, &g.tensors};
  if (has_buf) lists.push_back(&b.tensors);
  if (has_model) lists.push_back(&m.tensors);
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    const int nn = static_cast<int>(pk.numels.size());
    cuda_ok("sgd_step_", ampfunc_cuda_sgd_step(
                             nn, pk.ptrs[1].data(), key.first, pk.ptrs[0].data(),
                             has_buf ? pk.ptrs[2].data() : nullptr, has_model ? pk.ptrs.back().data() : nullptr,
                             key.second, pk.numels.data(), grad_scale.data_ptr<float>(),
                             reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()), lr_ptr,
                             step.data_ptr<float>(), k + 1 == packs.size() ? 1 : 0, &h, stream.stream()));
  }
  if (packs.empty()) {  // no elements: only the step counter moves (when finite)
    step.add_(finite.to(at::kFloat).reshape(step.sizes()));
  }
  p.write_back();
  b.write_back();
  m.write_back();
}

void adam_step__cuda(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                     TensorList max_exp_avg_sqs, TensorList model_params, const Tensor& step,
                     const Tensor& grad_scale, const Tensor& finite, double lr,
                     const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                     double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev = device_of(params, step);
  lr_value("adam_step_", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  check_adam_args("adam_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                  grad_scale, finite, amsgrad, dev, true);
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : TensorList()),
      m(model_params);
  const bool has_model = !m.tensors.empty();
  AmpfuncAdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay ? 1 : 0, amsgrad ? 1 : 0,
                     maximize ? 1 : 0};
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(p.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  std::vector<const Tensors*> lists{&p.tensors, &g.tensors, &m1.tensors, &m2.tensors};
  if (amsgrad) lists.push_back(&vmax.tensors);
  if (has_model) lists.push_back(&m.tensors);
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    const int nn = static_cast<int>(pk.numels.size());
    cuda_ok("adam_step_", ampfunc_cuda_adam_step(
                              nn, pk.ptrs[1].data(), key.first, pk.ptrs[0].data(), pk.ptrs[2].data(),
                              pk.ptrs[3].data(), amsgrad ? pk.ptrs[4].data() : nullptr,
                              has_model ? pk.ptrs.back().data() : nullptr, key.second,
                              pk.numels.data(), grad_scale.data_ptr<float>(),
                              reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()), lr_ptr,
                              step.data_ptr<float>(), k + 1 == packs.size() ? 1 : 0, &h, stream.stream()));
  }
  if (packs.empty()) step.add_(finite.to(at::kFloat).reshape(step.sizes()));
  p.write_back();
  m1.write_back();
  m2.write_back();
  vmax.write_back();
  m.write_back();
}

// The pure steps and updates on CUDA: one pass each, the launchers' out-of-place and delta
// modes (ext/cuda/optim.cu), which run the in-place kernels' per-element code with other
// destinations. Inputs are only read (non-contiguous ones through a contiguous copy); every
// output is new and contiguous, never a copy of an input: new params one at::empty each, each
// new state list and the updates views of one block per list (packed_empty_like_cuda). A
// skipped step (finite false, decided on the device) writes the inputs to the outputs and the
// old step.

// New contiguous tensors on the tensors' device, shaped like `ts`, in `dtype` (else each one's).
std::vector<Tensor> empty_outputs(const Tensors& ts, std::optional<at::ScalarType> dtype = std::nullopt) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(at::empty(t.sizes(), t.options().dtype(dtype.value_or(t.scalar_type()))));
  return out;
}

// New contiguous tensors shaped like `ts`, in `dtype`, on their device, as views that tile ONE
// new block of the CUDA caching allocator exactly, in list order (no padding): the new optimizer
// state and the updates of the pure steps (new params stay separate tensors). One allocation per
// list instead of one per leaf, and since the views tile their block like ampfunc.flat's CUDA
// views, pack() merges a list of them back into one range wherever the other lists of the call
// are adjacent too (the next step reading this state, a flat buffer of gradients): 10,000
// leaves become a few launch entries, each starting at the block's (256-byte aligned) base,
// so the kernels' 16-byte vector loads hold for every chunk. A view not merged (gradients
// allocated one by one) that starts off a 16-byte boundary takes the kernels' scalar path for
// that leaf; padding each view to 16 bytes instead would split the ranges at every leaf whose
// size is not a multiple of 4 and break the merge with state laid out by ampfunc.flat. Each
// view is its own TensorImpl (its own version counter) sharing the block's storage.
std::vector<Tensor> packed_empty_like_cuda(const Tensors& ts, at::ScalarType dtype) {
  std::vector<Tensor> out;
  if (ts.empty()) return out;
  if (!t_pack_outputs) return empty_outputs(ts, dtype);  // not an eager call (see t_pack_outputs)
  const auto meta = caffe2::TypeMeta::fromScalarType(dtype);
  const c10::DispatchKeySet keys(c10::DispatchKey::CUDA);
  const int64_t bytes = views_of(nullptr, ts, meta, keys, 1, nullptr);
  const Tensor block = at::empty({bytes / static_cast<int64_t>(meta.itemsize())},
                                 at::TensorOptions().device(ts[0].device()).dtype(dtype));
  out.reserve(ts.size());
  views_of(&block.storage(), ts, meta, keys, 1, &out);
  return out;
}

SgdOut sgd_step_cuda(TensorList params, TensorList grads, TensorList momentum_buffers, TensorList model_params,
                     const Tensor& step, const Tensor& grad_scale, const Tensor& finite, double lr,
                     const std::optional<Tensor>& lr_tensor, double weight_decay, double momentum,
                     double dampening, bool nesterov, bool maximize) {
  const at::Device dev = device_of(params, step);
  check_sgd_args("sgd_step", params, grads, momentum_buffers, model_params, step, grad_scale, finite, momentum, dev,
                 false);
  lr_value("sgd_step", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  const bool has_buf = momentum != 0.0;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Work p(params), g(grads), b(has_buf ? momentum_buffers : TensorList()), m(model_params);
  std::vector<Tensor> p_out = empty_outputs(p.tensors), b_out = packed_empty_like_cuda(b.tensors, at::kFloat),
                      m_out = empty_outputs(m.tensors);
  Tensor step_out = at::empty(step.sizes(), step.options());
  const Tensors p_o(p_out), b_o(b_out), m_o(m_out);
  const bool has_model = !m.tensors.empty();
  AmpfuncSgdHyper h{lr, momentum, dampening, weight_decay, nesterov ? 1 : 0, maximize ? 1 : 0};
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(p.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  std::vector<const Tensors*> lists{&p.tensors, &g.tensors, &p_o};
  const size_t ib = lists.size();
  if (has_buf) lists.insert(lists.end(), {&b.tensors, &b_o});
  const size_t im = lists.size();
  if (has_model) lists.insert(lists.end(), {&m.tensors, &m_o});
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    cuda_ok("sgd_step", ampfunc_cuda_sgd_step_out(
                            static_cast<int>(pk.numels.size()), pk.ptrs[1].data(), key.first, pk.ptrs[0].data(),
                            has_buf ? pk.ptrs[ib].data() : nullptr, has_model ? pk.ptrs[im].data() : nullptr,
                            pk.ptrs[2].data(), has_buf ? pk.ptrs[ib + 1].data() : nullptr,
                            has_model ? pk.ptrs[im + 1].data() : nullptr, key.second, pk.numels.data(),
                            grad_scale.data_ptr<float>(), reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()),
                            lr_ptr, step.data_ptr<float>(), k + 1 == packs.size() ? step_out.data_ptr<float>() : nullptr,
                            &h, stream.stream()));
  }
  if (packs.empty()) {  // no elements: only the step counter moves (when finite)
    step_out.copy_(step).add_(finite.to(at::kFloat).reshape(step.sizes()));
  }
  return {p_out, b_out, m_out, step_out};
}

AdamOut adam_step_cuda(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                       TensorList max_exp_avg_sqs, TensorList model_params, const Tensor& step,
                       const Tensor& grad_scale, const Tensor& finite, double lr,
                       const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                       double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev = device_of(params, step);
  check_adam_args("adam_step", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                  grad_scale, finite, amsgrad, dev, false);
  lr_value("adam_step", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : TensorList()),
      m(model_params);
  std::vector<Tensor> p_out = empty_outputs(p.tensors), m1_out = packed_empty_like_cuda(m1.tensors, at::kFloat),
                      m2_out = packed_empty_like_cuda(m2.tensors, at::kFloat),
                      vmax_out = packed_empty_like_cuda(vmax.tensors, at::kFloat), m_out = empty_outputs(m.tensors);
  Tensor step_out = at::empty(step.sizes(), step.options());
  const Tensors p_o(p_out), m1_o(m1_out), m2_o(m2_out), vmax_o(vmax_out), m_o(m_out);
  const bool has_model = !m.tensors.empty();
  AmpfuncAdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay ? 1 : 0, amsgrad ? 1 : 0,
                     maximize ? 1 : 0};
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(p.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  // 0 p, 1 g, 2 m1, 3 m2, 4 p_out, 5 m1_out, 6 m2_out, then (vmax, vmax_out), (model, model_out)
  std::vector<const Tensors*> lists{&p.tensors, &g.tensors, &m1.tensors, &m2.tensors, &p_o, &m1_o, &m2_o};
  const size_t iv = lists.size();
  if (amsgrad) lists.insert(lists.end(), {&vmax.tensors, &vmax_o});
  const size_t im = lists.size();
  if (has_model) lists.insert(lists.end(), {&m.tensors, &m_o});
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    cuda_ok("adam_step", ampfunc_cuda_adam_step_out(
                             static_cast<int>(pk.numels.size()), pk.ptrs[1].data(), key.first, pk.ptrs[0].data(),
                             pk.ptrs[2].data(), pk.ptrs[3].data(), amsgrad ? pk.ptrs[iv].data() : nullptr,
                             has_model ? pk.ptrs[im].data() : nullptr, pk.ptrs[4].data(), pk.ptrs[5].data(),
                             pk.ptrs[6].data(), amsgrad ? pk.ptrs[iv + 1].data() : nullptr,
                             has_model ? pk.ptrs[im + 1].data() : nullptr, key.second, pk.numels.data(),
                             grad_scale.data_ptr<float>(), reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()),
                             lr_ptr, step.data_ptr<float>(),
                             k + 1 == packs.size() ? step_out.data_ptr<float>() : nullptr, &h, stream.stream()));
  }
  if (packs.empty()) step_out.copy_(step).add_(finite.to(at::kFloat).reshape(step.sizes()));
  return {p_out, m1_out, m2_out, vmax_out, m_out, step_out};
}

// The pure updates on CUDA: one pass writing updates = new_p - p (new_p as the in-place kernel
// computes it, then one fp32 subtraction) and the new state; without params, p is taken as 0,
// so the update is the step term (a -0.0 term comes out as +0.0). The numbers agree with the
// CPU kernels within fp32 rounding (the CUDA kernels' own order of operations), not bit for bit.

SgdUpdateOut sgd_update_cuda(TensorList params, TensorList grads, TensorList momentum_buffers, const Tensor& step,
                             const Tensor& grad_scale, double lr, const std::optional<Tensor>& lr_tensor,
                             double weight_decay, double momentum, double dampening, bool nesterov, bool maximize) {
  const at::Device dev = device_of(grads, step);
  const bool has_buf = momentum != 0.0;
  const Tensors bufs(momentum_buffers);
  check_update_args("sgd_update", kSgd, params, grads, {&bufs},
                    {weight_decay, momentum, dampening, nesterov ? 1.0 : 0.0, maximize ? 1.0 : 0.0}, step, grad_scale,
                    dev);
  lr_value("sgd_update", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Work p(params), g(grads), b(has_buf ? momentum_buffers : TensorList());
  const bool has_p = !p.tensors.empty();
  std::vector<Tensor> d_out = packed_empty_like_cuda(g.tensors, at::kFloat),
                      b_out = packed_empty_like_cuda(b.tensors, at::kFloat);
  Tensor step_out = at::empty(step.sizes(), step.options());
  const Tensors d_o(d_out), b_o(b_out);
  AmpfuncSgdHyper h{lr, momentum, dampening, weight_decay, nesterov ? 1 : 0, maximize ? 1 : 0};
  auto groups = group_by<int>(g.tensors.size(), [&](int64_t i) { return cuda_dtype(g.tensors[i].scalar_type()); });
  std::vector<const Tensors*> lists{&g.tensors, &d_o};
  const size_t ip = lists.size();
  if (has_p) lists.push_back(&p.tensors);
  const size_t ib = lists.size();
  if (has_buf) lists.insert(lists.end(), {&b.tensors, &b_o});
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [grad_dtype, pk] = packs[k];
    cuda_ok("sgd_update", ampfunc_cuda_sgd_update(
                              static_cast<int>(pk.numels.size()), pk.ptrs[0].data(), grad_dtype,
                              has_p ? pk.ptrs[ip].data() : nullptr, has_buf ? pk.ptrs[ib].data() : nullptr,
                              pk.ptrs[1].data(), has_buf ? pk.ptrs[ib + 1].data() : nullptr, pk.numels.data(),
                              grad_scale.data_ptr<float>(), nullptr, lr_ptr, step.data_ptr<float>(),
                              k + 1 == packs.size() ? step_out.data_ptr<float>() : nullptr, &h, stream.stream()));
  }
  if (packs.empty()) step_out.copy_(step).add_(1.0);
  return {d_out, b_out, step_out};
}

AdamUpdateOut adam_update_cuda(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                               TensorList max_exp_avg_sqs, const Tensor& step, const Tensor& grad_scale, double lr,
                               const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                               double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev = device_of(grads, step);
  const Tensors m1s(exp_avgs), m2s(exp_avg_sqs), vmaxs(max_exp_avg_sqs);
  check_update_args("adam_update", kAdam, params, grads, {&m1s, &m2s, &vmaxs},
                    {beta1, beta2, eps, weight_decay, amsgrad ? 1.0 : 0.0, decoupled_weight_decay ? 1.0 : 0.0,
                     maximize ? 1.0 : 0.0},
                    step, grad_scale, dev);
  lr_value("adam_update", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : TensorList());
  const bool has_p = !p.tensors.empty();
  std::vector<Tensor> d_out = packed_empty_like_cuda(g.tensors, at::kFloat),
                      m1_out = packed_empty_like_cuda(m1.tensors, at::kFloat),
                      m2_out = packed_empty_like_cuda(m2.tensors, at::kFloat),
                      vmax_out = packed_empty_like_cuda(vmax.tensors, at::kFloat);
  Tensor step_out = at::empty(step.sizes(), step.options());
  const Tensors d_o(d_out), m1_o(m1_out), m2_o(m2_out), vmax_o(vmax_out);
  AmpfuncAdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay ? 1 : 0, amsgrad ? 1 : 0,
                     maximize ? 1 : 0};
  auto groups = group_by<int>(g.tensors.size(), [&](int64_t i) { return cuda_dtype(g.tensors[i].scalar_type()); });
  // 0 g, 1 updates, 2 m1, 3 m2, 4 m1_out, 5 m2_out, then params, (vmax, vmax_out)
  std::vector<const Tensors*> lists{&g.tensors, &d_o, &m1.tensors, &m2.tensors, &m1_o, &m2_o};
  const size_t ip = lists.size();
  if (has_p) lists.push_back(&p.tensors);
  const size_t iv = lists.size();
  if (amsgrad) lists.insert(lists.end(), {&vmax.tensors, &vmax_o});
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [grad_dtype, pk] = packs[k];
    cuda_ok("adam_update", ampfunc_cuda_adam_update(
                               static_cast<int>(pk.numels.size()), pk.ptrs[0].data(), grad_dtype,
                               has_p ? pk.ptrs[ip].data() : nullptr, pk.ptrs[2].data(), pk.ptrs[3].data(),
                               amsgrad ? pk.ptrs[iv].data() : nullptr, pk.ptrs[1].data(), pk.ptrs[4].data(),
                               pk.ptrs[5].data(), amsgrad ? pk.ptrs[iv + 1].data() : nullptr, pk.numels.data(),
                               grad_scale.data_ptr<float>(), nullptr, lr_ptr, step.data_ptr<float>(),
                               k + 1 == packs.size() ? step_out.data_ptr<float>() : nullptr, &h, stream.stream()));
  }
  if (packs.empty()) step_out.copy_(step).add_(1.0);
  return {d_out, m1_out, m2_out, vmax_out, step_out};
}

// params + updates on CUDA with ATen: one multi-tensor launch (_foreach_add) for the fp32
// pairs, one fp32 add and rounding per leaf for the others.
std::vector<Tensor> apply_updates_cuda(TensorList params, TensorList updates) {
  if (params.empty()) return {};
  const at::Device dev = params[0].device();
  validate("apply_updates", dev, {{"params", params, Dt::kAny, false}, {"updates", updates, Dt::kAny, false}});
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Tensor> outs(params.size());
  std::vector<Tensor> p32, u32;
  std::vector<size_t> idx32;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].scalar_type() == at::kFloat && updates[i].scalar_type() == at::kFloat) {
      p32.push_back(params[i]);
      u32.push_back(updates[i]);
      idx32.push_back(i);
    } else {
      outs[i] = (params[i].to(at::kFloat) + updates[i].to(at::kFloat)).to(params[i].scalar_type());
    }
  }
  if (!p32.empty()) {
    auto sums = at::_foreach_add(p32, u32);
    for (size_t k = 0; k < idx32.size(); ++k) outs[idx32[k]] = sums[k];
  }
  return outs;
}

void update_scale__cuda(const Tensor& scale, const Tensor& growth_tracker, const Tensor& hysteresis_tracker,
                        const Tensor& finite, double growth_factor, double backoff_factor, int64_t growth_interval,
                        double min_scale, double max_scale, int64_t hysteresis) {
  check_scale_args(scale, growth_tracker, hysteresis_tracker, finite, growth_interval, hysteresis);
  c10::cuda::CUDAGuard guard(scale.device());
  cuda_ok("update_scale_", ampfunc_cuda_update_scale(
                               scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                               hysteresis_tracker.data_ptr<int32_t>(),
                               reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()), growth_factor,
                               backoff_factor, growth_interval, min_scale, max_scale, hysteresis,
                               c10::cuda::getCurrentCUDAStream().stream()));
}

#endif  // AMPFUNC_WITH_CUDA

}  // namespace
