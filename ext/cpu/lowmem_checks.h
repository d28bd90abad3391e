// The argument checks of ampfunc::adam_lowmem_step_, shared by its CPU kernel (lowmem.cpp) and its
// CUDA glue (ext/glue/lowmem_cuda.h, in ext/bindings.cpp): every argument before anything is
// written, in the order of the list table (lowmem_spec.h), errors naming the list and the index
// (the reference twin's messages). `dev` is the device the call runs on: on the CPU every tensor
// must be a CPU tensor, on CUDA every tensor must be on that one CUDA device.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "lowmem_spec.h"

namespace ampfunc {
namespace lowmem {

using at::Tensor;
using Tensors = at::TensorList;

inline constexpr int64_t kCheckBlock = 256;       // elements per q8 block
inline constexpr int64_t kCheckMapsNumel = 1024;  // ampfunc.lowbits.q8_lookup: maps
inline constexpr int64_t kCheckBasesRow = 65552;  // ... and bases, (2, kCheckBasesRow)
inline constexpr const char* kOp = "adam_lowmem_step_";

inline std::string item(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

inline std::string shape_of(const Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + (t.dim() == 1 ? ",)" : ")");
}

// An argument's name for an error message: a list's leaf ("params[3]") or a lone tensor. Built
// only when a check fails: the checks run on every leaf of every call.
struct Arg {
  const char* list;
  size_t i = SIZE_MAX;
  std::string str() const { return i == SIZE_MAX ? std::string(list) : item(list, i); }
};

inline std::ostream& operator<<(std::ostream& os, const Arg& a) { return os << a.str(); }

inline void check_dense(const Tensor& t, const Arg& what, const at::Device& dev) {
  TORCH_CHECK_TYPE(t.defined(), "ampfunc: ", what, " is undefined (", kOp, ")");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, "ampfunc: ", what, " has layout ", t.layout(),
                   "; ampfunc takes dense (strided) tensors (", kOp, ")");
  if (dev.is_cpu()) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), "ampfunc: ", what, " is on ", t.device(), "; this kernel runs on the CPU (",
                      kOp, ")");
  } else {
    TORCH_CHECK_VALUE(t.device() == dev, "ampfunc: ", what, " is on ", t.device(), "; this call runs on ", dev,
                      " (every tensor of it on that device) (", kOp, ")");
  }
  TORCH_CHECK_VALUE(t.is_contiguous(), "ampfunc: ", what, " is not contiguous; the low-memory step takes "
                    "contiguous tensors (", kOp, ")");
}

inline void check_dtype(const Tensor& t, const Arg& what, std::initializer_list<at::ScalarType> ok,
                 const char* words) {
  for (auto d : ok) if (t.scalar_type() == d) return;
  TORCH_CHECK_TYPE(false, "ampfunc: ", what, " has dtype ", t.scalar_type(), "; it takes ", words, " (", kOp, ")");
}

// `why` (a callable giving the reason's words) runs only when the shapes differ.
template <class Why>
inline void check_shape(const Tensor& t, const Arg& what, at::IntArrayRef want, const Why& why) {
  TORCH_CHECK_VALUE(t.sizes() == want, "ampfunc: ", what, " has shape ", shape_of(t), " but ", why(), " (", kOp, ")");
}

inline std::string torch_dtype(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

// A one-element scalar argument, in the words of the ops' validation (ampfunc/ops/_validation.py).
inline void check_scalar(const Tensor& t, const char* name, at::ScalarType dt, const at::Device& dev) {
  TORCH_CHECK_VALUE(t.defined() && t.numel() == 1, "ampfunc: ", name, " must be a one-element tensor (", kOp, ")");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, "ampfunc: ", name, " has layout ", t.layout(),
                   "; ampfunc takes dense (strided) tensors (", kOp, ")");
  TORCH_CHECK_TYPE(t.scalar_type() == dt, "ampfunc: ", name, " has dtype ", torch_dtype(t.scalar_type()),
                   "; expected ", torch_dtype(dt), " (", kOp, ")");
  check_dense(t, Arg{name}, dev);
}

// Python's repr of a float, as ampfunc.ops._validation.check_hypers writes the value at fault.
inline std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  const auto end = std::to_chars(buf, buf + sizeof(buf), x).ptr;
  std::string s(buf, end);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

// The ranges the optimizers take (ampfunc.ops._validation.HYPER_RANGES), checked before any
// write: a NaN, negative or past-fp32 lr, a beta outside [0, 1), a negative eps or weight decay.
inline void check_hypers(double lr, double beta1, double beta2, double eps, double weight_decay) {
  constexpr double kF32Max = 3.4028234663852886e38;
  TORCH_CHECK_VALUE(lr >= 0.0 && lr <= kF32Max, "ampfunc: lr must be in [0, 3.4028235e+38], got ", float_repr(lr),
                    " (", kOp, ")");
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "ampfunc: beta1 must be in [0, 1), got ", float_repr(beta1), " (",
                    kOp, ")");
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "ampfunc: beta2 must be in [0, 1), got ", float_repr(beta2), " (",
                    kOp, ")");
  TORCH_CHECK_VALUE(eps >= 0.0, "ampfunc: eps must be >= 0, got ", float_repr(eps), " (", kOp, ")");
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "ampfunc: weight_decay must be >= 0, got ", float_repr(weight_decay), " (",
                    kOp, ")");
}

// Two written tensors that share memory, named as the reference twin names them (its
// ampfunc.ops validation): every written tensor is contiguous here, so a byte range each.
struct Written {
  Arg arg;  // the list and leaf; i == SIZE_MAX for a 0-d argument
  const Tensor* t;
};

inline void check_disjoint(const std::vector<Written>& written) {
  struct Span { uintptr_t lo, hi; size_t k; };
  std::vector<Span> spans;
  spans.reserve(written.size());
  for (size_t k = 0; k < written.size(); ++k) {
    const Tensor& t = *written[k].t;
    if (t.numel() == 0) continue;
    const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.push_back({lo, lo + uintptr_t(t.numel()) * t.element_size(), k});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.lo < b.lo || (a.lo == b.lo && a.k < b.k); });
  // Sorted by start: a span overlaps an earlier one exactly when it starts below the furthest
  // end so far, which is the first span of its run (ampfunc.ops.overlapping_pair's pair).
  const Span* reach = nullptr;
  for (const Span& b : spans) {
    if (reach != nullptr && b.lo < reach->hi) {
      const size_t i = std::min(reach->k, b.k), j = std::max(reach->k, b.k);
      TORCH_CHECK_VALUE(false, "ampfunc: ", written[i].arg, " and ", written[j].arg,
                        " overlap in memory; the tensors an in-place op writes must be distinct (", kOp, ")");
    }
    if (reach == nullptr || b.hi > reach->hi) reach = &b;
  }
}

// Every argument, before anything is written: the lists' lengths, then leaf by leaf each
// list's dtype and shape by its role (spec.h, kAdamLowmemLists).
inline void check_args(Tensors params, Tensors remainders, Tensors grads, Tensors exp_avgs, Tensors exp_avg_absmax,
                       Tensors exp_avg_sqs, Tensors exp_avg_sq_absmax, const Tensor& step, const Tensor& grad_scale,
                       const Tensor& finite, const Tensor& qmaps, const Tensor& qbases,
                       const std::optional<Tensor>& lr_tensor, const at::Device& dev) {
  // In the table's order (lowmem_spec.h): the lists' lengths against params'.
  const Tensors* lists[] = {&params, &remainders, &grads, &exp_avgs, &exp_avg_absmax, &exp_avg_sqs,
                            &exp_avg_sq_absmax};
  static_assert(sizeof(lists) / sizeof(lists[0]) == kAdamLowmemNumLists);
  for (int k = 1; k < kAdamLowmemNumLists; ++k) {
    TORCH_CHECK_VALUE(lists[k]->size() == params.size(), "ampfunc: ", kAdamLowmemLists[k].name,
                      " has ", lists[k]->size(), " tensors but params has ", params.size(), " (", kOp, ")");
  }
  check_scalar(step, "step", at::kFloat, dev);
  check_scalar(grad_scale, "grad_scale", at::kFloat, dev);
  check_scalar(finite, "finite", at::kBool, dev);
  if (lr_tensor.has_value() && lr_tensor->defined()) check_scalar(*lr_tensor, "lr_tensor", at::kFloat, dev);
  check_dense(qmaps, Arg{"qmaps"}, dev);
  check_dense(qbases, Arg{"qbases"}, dev);
  TORCH_CHECK_VALUE(qmaps.scalar_type() == at::kFloat && qmaps.dim() == 1 && qmaps.size(0) == kCheckMapsNumel,
                    "ampfunc: qmaps must be ampfunc.lowbits.q8_lookup()'s float32 (1024,) maps (", kOp, ")");
  TORCH_CHECK_VALUE(qbases.scalar_type() == at::kByte && qbases.dim() == 2 && qbases.size(0) == 2 &&
                        qbases.size(1) == kCheckBasesRow,
                    "ampfunc: qbases must be ampfunc.lowbits.q8_lookup()'s uint8 (2, 65552) bases (", kOp, ")");
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    check_dense(p, Arg{"params", i}, dev);
    check_dtype(p, Arg{"params", i}, {at::kFloat, at::kBFloat16}, "float32 or bfloat16");
    const bool split = p.scalar_type() == at::kBFloat16;
    check_dense(remainders[i], Arg{"remainders", i}, dev);
    check_dtype(remainders[i], Arg{"remainders", i}, {at::kShort}, "int16");
    if (split) {
      check_shape(remainders[i], Arg{"remainders", i}, p.sizes(), [&] {
        return item("params", i) + " is bfloat16 of shape " + shape_of(p) + " (its remainder has its shape)";
      });
    } else {
      check_shape(remainders[i], Arg{"remainders", i}, {0},
                  [&] { return item("params", i) + " is float32 (its own master: an empty remainder)"; });
    }
    check_dense(grads[i], Arg{"grads", i}, dev);
    check_dtype(grads[i], Arg{"grads", i}, {at::kFloat, at::kHalf, at::kBFloat16}, "float32, float16 or bfloat16");
    check_shape(grads[i], Arg{"grads", i}, p.sizes(),
                [&] { return item("params", i) + " has shape " + shape_of(p); });
    check_dense(exp_avgs[i], Arg{"exp_avgs", i}, dev);
    check_dtype(exp_avgs[i], Arg{"exp_avgs", i}, {at::kFloat, at::kBFloat16, at::kByte},
                "float32, bfloat16 or uint8 (q8 codes)");
    check_shape(exp_avgs[i], Arg{"exp_avgs", i}, p.sizes(),
                [&] { return item("params", i) + " has shape " + shape_of(p); });
    check_dense(exp_avg_sqs[i], Arg{"exp_avg_sqs", i}, dev);
    TORCH_CHECK_TYPE(exp_avg_sqs[i].scalar_type() == exp_avgs[i].scalar_type(), "ampfunc: ", item("exp_avg_sqs", i),
                     " has dtype ", exp_avg_sqs[i].scalar_type(), " but ", item("exp_avgs", i), " has dtype ",
                     exp_avgs[i].scalar_type(), "; both moments of a param are stored alike (", kOp, ")");
    check_shape(exp_avg_sqs[i], Arg{"exp_avg_sqs", i}, p.sizes(),
                [&] { return item("params", i) + " has shape " + shape_of(p); });
    const bool q8 = exp_avgs[i].scalar_type() == at::kByte;
    TORCH_CHECK_VALUE(!q8 || p.numel() % kCheckBlock == 0, "ampfunc: ", item("exp_avgs", i), " is q8 but ",
                      item("params", i), " has ", p.numel(), " elements, not a multiple of the block (256) (", kOp,
                      ")");
    const std::pair<const char*, const Tensors*> absmaxes[] = {{"exp_avg_absmax", &exp_avg_absmax},
                                                              {"exp_avg_sq_absmax", &exp_avg_sq_absmax}};
    for (const auto& [name, ts] : absmaxes) {
      const Tensor& a = (*ts)[i];
      check_dense(a, Arg{name, i}, dev);
      check_dtype(a, Arg{name, i}, {at::kFloat}, "float32");
      const int64_t blocks = q8 ? p.numel() / kCheckBlock : 0;
      check_shape(a, Arg{name, i}, {blocks}, [&] {
        return q8 ? "the q8 moments of " + item("params", i) + " have " + std::to_string(blocks) + " blocks of 256"
                  : item("exp_avgs", i) + " is not q8 (an empty absmax)";
      });
    }
  }
  // The written lists in the table's order, each leaf by leaf, then step (as the twin lists them).
  std::vector<Written> written;
  written.reserve(6 * params.size() + 1);
  const std::pair<const char*, const Tensors*> written_lists[] = {
      {"params", &params}, {"remainders", &remainders}, {"exp_avgs", &exp_avgs}, {"exp_avg_absmax", &exp_avg_absmax},
      {"exp_avg_sqs", &exp_avg_sqs}, {"exp_avg_sq_absmax", &exp_avg_sq_absmax}};
  for (const auto& [name, ts] : written_lists) {
    for (size_t i = 0; i < ts->size(); ++i) written.push_back({Arg{name, i}, &(*ts)[i]});
  }
  written.push_back({Arg{"step"}, &step});
  check_disjoint(written);
}

}  // namespace lowmem
}  // namespace ampfunc
