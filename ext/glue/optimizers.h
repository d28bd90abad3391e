// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// The glue of the generic optimizers (ext/optimizers.h), written once for all of them: each
// one's ops <name>_step_, <name>_step and <name>_update read their arguments off the
// dispatcher's stack in the order of the schema ampfunc/ops derives from the same spec,
// validate them (check_step_args / check_update_args: the lists from the spec), and run the CPU
// pass (ext/cpu/kernels.h: optim_pass) or the CUDA launcher (ext/cuda/optimizers.cu). Their eager
// CPU calls take the direct door (direct.h) through one generic binding per form (the end of this
// file), which reads the same arguments off Python's and runs the same validation and pass.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <array>
#include <memory>

#include "common.h"
#include "cpu_ops.h"
#include "direct.h"
#include "spec.h"
#include "validation.h"

#ifdef AMPFUNC_WITH_CUDA
#include "cuda_ops.h"

#define AMPFUNC_DECLARE_LAUNCHER(name, Op) \
  extern "C" int ampfunc_cuda_optim_##name(const AmpfuncOptimLaunch* launch, cudaStream_t stream);
AMPFUNC_OPTIMIZERS(AMPFUNC_DECLARE_LAUNCHER)
#undef AMPFUNC_DECLARE_LAUNCHER
#endif

namespace {

enum class OptimForm { kInPlace, kOutOfPlace, kUpdate };

// The spec table's entry of Op (spec.h), from its header's constants.
template <class Op>
const OptimizerSpec& spec_of() {
  static const OptimizerSpec spec = [] {
    OptimizerSpec s{Op::kName, {}, {}};
    for (int k = 0; k < Op::kState; ++k) s.state.push_back({Op::kStateNames[k], Op::kStateWhen[k]});
    for (int k = 0; k < Op::kHypers; ++k) s.hypers.push_back({Op::kHyperNames[k], Op::kHyperKinds[k]});
    return s;
  }();
  return spec;
}

// The name of an op of Op, for the errors and the profiler.
template <class Op, OptimForm F>
const std::string& op_name() {
  static const std::string name = std::string(Op::kName) + (F == OptimForm::kInPlace      ? "_step_"
                                                            : F == OptimForm::kOutOfPlace ? "_step"
                                                                                          : "_update");
  return name;
}

// One call's arguments, in schema order (ampfunc/ops/_spec.py: step_spec, update_spec).
template <class Op>
struct OptimCall {
  std::string name;  // the op's name, for the errors
  // The lists as the dispatcher hands them (owned); a direct call borrows its tensors from Python
  // and leaves these empty.
  std::vector<Tensor> params, grads, model_params;
  std::array<std::vector<Tensor>, Op::kState> state;
  Tensor step, grad_scale, finite;
  double lr = 0.0;
  std::optional<Tensor> lr_tensor;
  std::vector<double> hyper;

  // Views of the lists (valid while the call lives), and the state lists the hyper-parameters use.
  Tensors P, G, M;
  std::array<Tensors, Op::kState> S;
  std::vector<const Tensors*> state_ptrs() const {
    std::vector<const Tensors*> out;
    for (const Tensors& s : S) out.push_back(&s);
    return out;
  }
  bool uses(int k) const { return spec_of<Op>().uses(static_cast<size_t>(k), hyper); }
};

template <class Op, OptimForm F>
OptimCall<Op> read_call(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  OptimCall<Op> c;
  c.name = op_name<Op, F>();
  size_t i = 0;
  c.params = args[i++].toTensorVector();
  c.grads = args[i++].toTensorVector();
  for (int k = 0; k < Op::kState; ++k) c.state[k] = args[i++].toTensorVector();
  if (F != OptimForm::kUpdate) c.model_params = args[i++].toTensorVector();
  c.step = args[i++].toTensor();
  c.grad_scale = args[i++].toTensor();
  if (F != OptimForm::kUpdate) c.finite = args[i++].toTensor();
  c.lr = args[i++].toDouble();
  if (!args[i].isNone()) c.lr_tensor = args[i].toTensor();
  ++i;
  for (int k = 0; k < Op::kHypers; ++k, ++i) {
    c.hyper.push_back(args[i].isBool() ? (args[i].toBool() ? 1.0 : 0.0) : args[i].toDouble());
  }
  torch::jit::drop(*stack, n);
  c.P = Tensors(c.params);
  c.G = Tensors(c.grads);
  c.M = Tensors(c.model_params);
  for (int k = 0; k < Op::kState; ++k) c.S[k] = Tensors(c.state[k]);
  return c;
}

template <class Op, OptimForm F>
at::Device validate_call(const OptimCall<Op>& c) {
  const char* name = c.name.c_str();
  const Tensors& first = F == OptimForm::kUpdate ? c.G : c.P;  // device_of's rule, on the views
  const at::Device dev = first.empty() ? c.step.device() : first[0].device();
  if (c.lr_tensor.has_value()) check_scalar(name, "lr_tensor", *c.lr_tensor, at::kFloat, dev);
  if (F == OptimForm::kUpdate) {
    check_update_args(name, spec_of<Op>(), c.P, c.G, c.state_ptrs(), c.hyper, c.step, c.grad_scale, dev);
  } else {
    check_step_args(name, spec_of<Op>(), c.P, c.G, c.state_ptrs(), c.hyper, c.M, c.step, c.grad_scale, c.finite, dev,
                    F == OptimForm::kInPlace);
  }
  return dev;
}

const std::vector<const OptimizerSpec*>& optimizer_specs() {
#define AMPFUNC_SPEC_OF(name, Op) &spec_of<Op>(),
  static const std::vector<const OptimizerSpec*> specs{&kSgd, &kAdam, AMPFUNC_OPTIMIZERS(AMPFUNC_SPEC_OF)};
#undef AMPFUNC_SPEC_OF
  return specs;
}

// ---- CPU ----

// Where run_cpu puts an out-of-place call's results, in schema order: the dispatcher's stack, or
// (the direct door) held until the GIL is taken again and handed to Python as a tuple.
struct StackOut {
  torch::jit::Stack* stack;
  void list(std::vector<Tensor>&& ts) { torch::jit::push(*stack, c10::IValue(std::move(ts))); }
  void tensor(Tensor t) { torch::jit::push(*stack, std::move(t)); }
};

struct HeldOut {
  std::vector<std::vector<Tensor>> lists;
  std::vector<Tensor> tensors;  // after the lists
  void list(std::vector<Tensor>&& ts) { lists.push_back(std::move(ts)); }
  void tensor(Tensor t) { tensors.push_back(std::move(t)); }
  pybind11::tuple to_python() {  // with the GIL
    pybind11::tuple out(lists.size() + tensors.size());
    size_t i = 0;
    for (auto& l : lists) out[i++] = pybind11::cast(std::move(l));
    for (auto& t : tensors) out[i++] = pybind11::cast(std::move(t));
    return out;
  }
};

template <class Op, OptimForm F, class Out>
void run_cpu(OptimCall<Op>& c, Out& sink) {
  const at::Device dev(at::kCPU);
  const double lr = lr_value(c.name.c_str(), c.lr, c.lr_tensor, dev);
  const bool lr_is_tensor = c.lr_tensor.has_value();
  // Contiguous working copies (written back in place); the lists a setting leaves unused are empty.
  std::vector<std::unique_ptr<Work>> s_work;
  for (int k = 0; k < Op::kState; ++k) s_work.push_back(std::make_unique<Work>(c.uses(k) ? c.S[k] : kNoList));
  Work p(c.P), g(c.G), m(c.M);
  ampfunc::cpu::OptimLists in{&p.tensors, {}};
  for (auto& w : s_work) in.state.push_back(&w->tensors);
  const float old_step = c.step.template item<float>();
  const float next_step = old_step + 1.f;
  const auto scalars = Op::scalars(c.hyper.data(), c.grad_scale.template item<float>(), lr,
                                   static_cast<double>(next_step), F == OptimForm::kUpdate && lr_is_tensor);
  if constexpr (F == OptimForm::kInPlace) {
    if (!c.finite.template item<bool>()) return;  // the skipped step: nothing is written
    ampfunc::cpu::optim_pass<Op>(in, g.tensors, in, m.tensors, nullptr, scalars);
    p.write_back();
    for (auto& w : s_work) w->write_back();
    m.write_back();
    *c.step.template data_ptr<float>() = next_step;
  } else if constexpr (F == OptimForm::kOutOfPlace) {
    std::vector<Tensor> p_out = empty_like_list(p.tensors), m_out = empty_like_list(m.tensors);
    std::vector<std::vector<Tensor>> s_out;
    for (auto& w : s_work) s_out.push_back(packed_empty_like(w->tensors, at::kFloat));
    const Tensors po(p_out), mo(m_out);
    std::vector<Tensors> so(s_out.begin(), s_out.end());
    ampfunc::cpu::OptimLists out{&po, {}};
    for (const Tensors& t : so) out.state.push_back(&t);
    const bool applied = c.finite.template item<bool>();
    if (applied) {
      ampfunc::cpu::optim_pass<Op>(in, g.tensors, out, mo, nullptr, scalars);
    } else {  // the skipped step: copies of the inputs
      ampfunc::cpu::copy(p.tensors, po);
      for (int k = 0; k < Op::kState; ++k) ampfunc::cpu::copy(s_work[k]->tensors, so[k]);
      ampfunc::cpu::copy(m.tensors, mo);
    }
    sink.list(std::move(p_out));
    for (auto& s : s_out) sink.list(std::move(s));
    sink.list(std::move(m_out));
    sink.tensor(at::scalar_tensor(applied ? next_step : old_step, at::kFloat));
  } else {
    std::vector<Tensor> d_out = packed_empty_like(g.tensors, at::kFloat);
    std::vector<std::vector<Tensor>> s_out;
    for (auto& w : s_work) s_out.push_back(packed_empty_like(w->tensors, at::kFloat));
    const Tensors d(d_out), none;
    std::vector<Tensors> so(s_out.begin(), s_out.end());
    ampfunc::cpu::OptimLists out{&none, {}};
    for (const Tensors& t : so) out.state.push_back(&t);
    ampfunc::cpu::optim_pass<Op>(in, g.tensors, out, none, &d, scalars);
    sink.list(std::move(d_out));
    for (auto& s : s_out) sink.list(std::move(s));
    sink.tensor(at::scalar_tensor(next_step, at::kFloat));
  }
}

// ---- CUDA ----

#ifdef AMPFUNC_WITH_CUDA
template <class Op>
struct Launcher;
#define AMPFUNC_LAUNCHER_OF(name, OpType)                                                        \
  template <>                                                                                    \
  struct Launcher<OpType> {                                                                      \
    static int call(const AmpfuncOptimLaunch* l, cudaStream_t s) { return ampfunc_cuda_optim_##name(l, s); } \
  };
AMPFUNC_OPTIMIZERS(AMPFUNC_LAUNCHER_OF)
#undef AMPFUNC_LAUNCHER_OF

template <class Op, OptimForm F>
void run_cuda(OptimCall<Op>& c, const at::Device& dev, torch::jit::Stack* stack) {
  constexpr int S = Op::kState;
  const char* name = c.name.c_str();
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  std::vector<std::unique_ptr<Work>> s_work;
  for (int k = 0; k < S; ++k) s_work.push_back(std::make_unique<Work>(c.uses(k) ? c.S[k] : kNoList));
  Work p(c.P), g(c.G), m(c.M);
  const bool has_p = !p.tensors.empty(), has_model = F != OptimForm::kUpdate && !m.tensors.empty();
  std::vector<Tensor> p_out, m_out;
  std::vector<std::vector<Tensor>> s_out(S);
  if constexpr (F == OptimForm::kOutOfPlace) {
    p_out = empty_outputs(p.tensors);
    m_out = empty_outputs(m.tensors);
  } else if constexpr (F == OptimForm::kUpdate) {
    p_out = packed_empty_like_cuda(g.tensors, at::kFloat);
  }
  if constexpr (F != OptimForm::kInPlace) {
    for (int k = 0; k < S; ++k) s_out[k] = packed_empty_like_cuda(s_work[k]->tensors, at::kFloat);
  }
  Tensor step_out = F == OptimForm::kInPlace ? c.step : at::empty(c.step.sizes(), c.step.options());
  const Tensors po(p_out), mo(m_out);
  std::vector<Tensors> so(s_out.begin(), s_out.end());
  // The launch's lists (ampfunc_cuda.h: AmpfuncOptimLaunch), the ones present packed together.
  std::array<const Tensors*, AMPFUNC_OPTIM_MAX_LISTS> layout{};
  layout[0] = &g.tensors;
  if (has_p) layout[1] = &p.tensors;
  for (int k = 0; k < S; ++k) {
    if (!s_work[k]->tensors.empty()) layout[2 + k] = &s_work[k]->tensors;
  }
  if constexpr (F == OptimForm::kInPlace) {
    layout[3 + S] = &p.tensors;
    for (int k = 0; k < S; ++k) layout[4 + S + k] = layout[2 + k];
    if (has_model) layout[4 + 2 * S] = &m.tensors;
  } else {
    if (has_model) layout[2 + S] = &m.tensors;
    layout[3 + S] = &po;
    for (int k = 0; k < S; ++k) {
      if (!so[k].empty()) layout[4 + S + k] = &so[k];
    }
    if (has_model) layout[4 + 2 * S] = &mo;
  }
  std::vector<const Tensors*> lists;
  std::array<int, AMPFUNC_OPTIM_MAX_LISTS> at_list;
  at_list.fill(-1);
  for (int d = 0; d < 5 + 2 * S; ++d) {
    if (layout[d] == nullptr) continue;
    auto it = std::find(lists.begin(), lists.end(), layout[d]);
    at_list[d] = static_cast<int>(it - lists.begin());
    if (it == lists.end()) lists.push_back(layout[d]);
  }
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(g.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  auto packs = packed_groups(lists, groups);
  const float* lr_ptr = c.lr_tensor.has_value() ? c.lr_tensor->template data_ptr<float>() : nullptr;
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    AmpfuncOptimLaunch l{};
    l.dest = F == OptimForm::kInPlace ? 0 : F == OptimForm::kOutOfPlace ? 1 : 2;
    l.n = static_cast<int>(pk.numels.size());
    l.numels = pk.numels.data();
    for (int d = 0; d < 5 + 2 * S; ++d) l.lists[d] = at_list[d] < 0 ? nullptr : pk.ptrs[at_list[d]].data();
    l.grad_dtype = key.first;
    l.model_dtype = key.second;
    l.grad_scale = c.grad_scale.template data_ptr<float>();
    l.finite = F == OptimForm::kUpdate ? nullptr : reinterpret_cast<const uint8_t*>(c.finite.template data_ptr<bool>());
    l.lr_tensor = lr_ptr;
    l.lr = c.lr;
    for (int h = 0; h < Op::kHypers; ++h) l.hyper[h] = c.hyper[h];
    l.step = c.step.template data_ptr<float>();
    l.step_out = k + 1 == packs.size() ? step_out.template data_ptr<float>() : nullptr;
    cuda_ok(name, Launcher<Op>::call(&l, stream.stream()));
  }
  if (packs.empty()) {  // no elements: only the step counter moves (when taken)
    const Tensor taken = F == OptimForm::kUpdate ? at::ones_like(c.step) : c.finite.to(at::kFloat).reshape(c.step.sizes());
    if (F == OptimForm::kInPlace) c.step.add_(taken);
    else step_out.copy_(c.step).add_(taken);
  }
  if constexpr (F == OptimForm::kInPlace) {
    p.write_back();
    for (auto& w : s_work) w->write_back();
    m.write_back();
  } else {
    torch::jit::push(*stack, c10::IValue(std::move(p_out)));
    for (auto& s : s_out) torch::jit::push(*stack, c10::IValue(std::move(s)));
    if (F == OptimForm::kOutOfPlace) torch::jit::push(*stack, c10::IValue(std::move(m_out)));
    torch::jit::push(*stack, step_out);
  }
}
#endif

// The dispatcher's kernel of one op (registered for the CPU and CUDA keys: ext/bindings.cpp).
template <class Op, OptimForm F>
void optim_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  OptimCall<Op> c = read_call<Op, F>(op, stack);
  const at::Device dev = validate_call<Op, F>(c);
  if (dev.is_cpu()) {
    StackOut out{stack};
    run_cpu<Op, F>(c, out);
    return;
  }
#ifdef AMPFUNC_WITH_CUDA
  run_cuda<Op, F>(c, dev, stack);
#else
  TORCH_CHECK(false, "ampfunc: ", c.name, " on ", dev.str(), " needs a build with CUDA");
#endif
}

// ---- The direct door ----

namespace direct {

// An eager CPU call of one of Op's ops (direct.h): the arguments read off Python's in schema
// order, NotImplemented for anything the door does not take (then ampfunc.ops calls the op), else
// the dispatcher kernel's validation, pass and results, the written tensors' versions bumped.
// kChecked: <name>_step_checked / <name>_step_checked_, the step without `finite`, run as the
// composition it stands for (ampfunc/ops/_forms.py): checked_flag() of the grads, then
// <name>_step / <name>_step_ with that flag, which is handed back (last, out of place).
template <class Op, OptimForm F, bool kChecked = false>
py::object optim(const py::args& a) {
  static_assert(!kChecked || F != OptimForm::kUpdate, "checked: a step");
  HANDLE_TH_ERRORS
  Args x(a);
  OptimCall<Op> c;
  c.P = x.list();
  c.G = x.read_list();
  for (int k = 0; k < Op::kState; ++k) c.S[k] = x.list();
  if (F != OptimForm::kUpdate) c.M = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const Tensor* fin = F == OptimForm::kUpdate || kChecked ? nullptr : x.tensor();
  c.lr = x.real();
  c.lr_tensor = x.optional_tensor();
  for (int k = 0; k < Op::kHypers; ++k) {
    const std::string kind = Op::kHyperKinds[k];
    c.hyper.push_back(kind == "bool" ? (x.flag() ? 1.0 : 0.0)
                      : kind == "int" ? static_cast<double>(x.integer())
                                      : x.real());
  }
  if (!x.usable()) return not_handled();
  c.name = op_name<Op, F>();
  c.step = *step;
  c.grad_scale = *gs;
  if (fin != nullptr) c.finite = *fin;
  static const std::string label =
      "ampfunc::" + (kChecked ? std::string(Op::kName) + (F == OptimForm::kInPlace ? "_step_checked_" : "_step_checked")
                              : op_name<Op, F>());
  if constexpr (F == OptimForm::kInPlace) {
    auto step_ = [&] {
      validate_call<Op, F>(c);
      HeldOut none;
      run_cpu<Op, F>(c, none);
      bump(c.P);
      for (const Tensors& s : c.S) bump(s);
      bump(c.M);
      bump(c.step);
    };
    if constexpr (kChecked) {
      return run(label.c_str(), [&] {
        c.finite = checked_flag(c.G, c.grad_scale);
        step_();
        return c.finite;
      });
    } else {
      return run(label.c_str(), step_);
    }
  } else {
    HeldOut out;
    {
      py::gil_scoped_release no_gil;
      RECORD_FUNCTION(label.c_str(), std::vector<c10::IValue>());
      PackOutputs pack(true);  // an eager call
      if constexpr (kChecked) c.finite = checked_flag(c.G, c.grad_scale);
      validate_call<Op, F>(c);
      run_cpu<Op, F>(c, out);
      if constexpr (kChecked) out.tensor(c.finite);
    }
    return out.to_python();
  }
  END_HANDLE_TH_ERRORS_PYBIND
}

}  // namespace direct

}  // namespace
