// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// The direct door: eager CPU calls without the dispatcher, and per-parameter bookkeeping in C.
#pragma once

#include "common.h"
#include "validation.h"
#include "cpu_pool.h"
#include "cpu_ops.h"
#include "spec.h"
#include "held.h"

namespace {

// ---------------------------------------------------------------------------------------------
// The direct door: eager CPU calls without the dispatcher
// ---------------------------------------------------------------------------------------------
//
// torch.ops.ampfunc.X(...) boxes every tensor of every list into an IValue, unboxes it into a
// std::vector<Tensor> and runs the autograd and ADInplaceOrView fallbacks over each: about
// 0.35 us per tensor per list, 1.7 ms per list of 10,000 leaves, several times the kernel's own
// time on small leaves. The functions of the module below take the same arguments as the ops
// (lists as Python lists) and run the same CPU implementations, with the same validation and the
// same errors, borrowing the tensors from the Python objects (no reference counts touched).
//
// A call takes this door only when the dispatcher would have sent every tensor straight to the
// CPU kernel: every tensor a plain dense CPU tensor (no subclass with __torch_dispatch__, no
// functionalization, functorch or conjugate/negative views), no dispatch or function mode
// active, no thread-local dispatch keys included, and no tensor requiring grad under grad mode.
// Otherwise the function returns NotImplemented and ampfunc.ops calls the op. Written tensors
// get their version counters bumped as the ADInplaceOrView fallback would, and the call is
// recorded under the op's name for the profiler. The GIL is released during the kernel: each list
// is first copied into a tuple, which keeps its tensors alive whatever other threads do.
namespace direct {

namespace py = pybind11;

// The positional arguments of one call, read in order; `ok` turns false at the first argument
// the direct door cannot take.
class Args {
 public:
  explicit Args(const py::args& a)
      : a_(a), items_(ampfunc::Recycled<PyObject*>::take()), held_check_(a, at::GradMode::is_enabled()) {}
  Args(const Args&) = delete;
  Args& operator=(const Args&) = delete;
  ~Args() {
    std::vector<PyObject*> items = std::move(items_);  // a DECREF may run Python code that calls in again
    // The objects are cold again after the kernel: ask kDecrefAhead on.
    constexpr size_t kDecrefAhead = 12;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i + kDecrefAhead < items.size()) __builtin_prefetch(items[i + kDecrefAhead], 1);
      Py_DECREF(items[i]);
    }
    ampfunc::Recycled<PyObject*>::give(items);
  }

  Tensors list() {
    PyObject* seq = next();
    if (!ok) return Tensors();
    return list_of(seq);
  }

  // A list the call only reads (the gradients): as list(), taking the description made for
  // reading in the held lists' parallel region when there was one (HeldCheck).
  Tensors read_list() {
    const size_t arg = i_;
    PyObject* seq = next();
    if (!ok) return Tensors();
    HeldCheck::ForReading* rd = held_check_.for_reading(arg, seq);
    if (rd == nullptr) return list_of(seq, /*for_reading=*/true);
    if (!rd->ok) {
      ok = false;
      return Tensors();
    }
    // One reference on each item, as list_of() takes (their objects were just read).
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    items_.reserve(items_.size() + static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      Py_INCREF(items[i]);
      items_.push_back(items[i]);
    }
    any_tensor_ = any_tensor_ || n > 0;
    return std::move(rd->tensors);
  }

  const Tensor* tensor() {
    PyObject* o = next();
    if (!ok) return nullptr;
    if (!THPVariable_Check(o) || !plain_cpu(THPVariable_Unpack(o))) {
      ok = false;
      return nullptr;
    }
    Py_INCREF(o);
    items_.push_back(o);
    any_tensor_ = true;
    return &THPVariable_Unpack(o);
  }

  std::optional<Tensor> optional_tensor() {
    PyObject* o = next();
    if (!ok || o == Py_None) return std::nullopt;
    if (!THPVariable_Check(o) || !plain_cpu(THPVariable_Unpack(o))) {
      ok = false;
      return std::nullopt;
    }
    return THPVariable_Unpack(o);
  }

  double real() {
    PyObject* o = next();
    if (!ok) return 0.0;
    const double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      ok = false;
    }
    return v;
  }

  int64_t integer() {
    PyObject* o = next();
    if (!ok) return 0;
    if (!PyLong_Check(o)) {
      ok = false;
      return 0;
    }
    const long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      ok = false;
    }
    return static_cast<int64_t>(v);
  }

  bool flag() {
    PyObject* o = next();
    if (!ok) return false;
    if (!PyBool_Check(o)) {
      ok = false;
      return false;
    }
    return o == Py_True;
  }

  // Whether the call can take the direct door: every argument read, at least one tensor, and no
  // mode or thread-local key that would have sent the op anywhere but the CPU kernel.
  bool usable() const {
    return ok && i_ == a_.size() && any_tensor_ && !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
           !at::impl::torch_function_mode_enabled() &&
           (c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty();
  }

  bool ok = true;

 private:
  // `for_reading`: the call only reads the list (a copy-on-write storage is read where it is).
  Tensors list_of(PyObject* seq, bool for_reading = false) {
    Tensors out;
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
      ok = false;
      return out;
    }
    // A held list (held.h) whose tensors are unchanged: its descriptors, and the held list's
    // references keep its tensors alive for the call.
    const bool grad_on = at::GradMode::is_enabled();
    std::shared_ptr<HeldList> held = held_check_.unchanged(seq);
    if (held != nullptr) {
      out.reserve(held->tensors.size());
      out = held->tensors;
      out.held_tag = held->tag;
      out.held_versions = held->versions->data();
      counters_.push_back(held->versions);
      any_tensor_ = any_tensor_ || !out.empty();
      held_.push_back(std::move(held));
      return out;
    }
    // The items are held (one reference each, dropped in ~Args with the GIL) so that they stay
    // valid while the GIL is released, whatever another thread does to the list. A C array of
    // references rather than a tuple copy: no Python allocation, nothing for the cyclic GC.
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    items_.reserve(items_.size() + static_cast<size_t>(n));
    // The Python objects, on this thread (they are the interpreter's): type, reference, tensor.
    thread_local std::vector<const Tensor*> tensors;
    tensors.clear();
    tensors.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i + 8 < n) __builtin_prefetch(items[i + 8]);  // cold on a large tree: ask ahead
      PyObject* o = items[i];
      if (!THPVariable_Check(o)) {
        ok = false;
        return out;
      }
      Py_INCREF(o);
      items_.push_back(o);
      tensors.push_back(&THPVariable_Unpack(o));
    }
    // The tensors themselves (TensorImpls, storages): checked and described in one prefetching
    // pass (Tensors::take_all). Grad mode is this thread's, read here once.
    if (!out.take_all(tensors.data(), tensors.size(), [grad_on](const Tensor& t) { return plain_cpu(t, grad_on); },
                      for_reading)) {
      ok = false;
      return out;
    }
    // A held list whose tensors changed (a `.data` assignment, say): described anew above, its
    // Marks are taken again. Its items are the same objects, so no reference changes hands.
    held = held_list(seq);
    if (held != nullptr && held->same_items(seq)) held->remark(out);
    any_tensor_ = any_tensor_ || n > 0;
    return out;
  }

  PyObject* next() {
    if (!ok || i_ >= a_.size()) {
      ok = false;
      return nullptr;
    }
    return a_[i_++].ptr();
  }

  const py::args& a_;
  size_t i_ = 0;
  bool any_tensor_ = false;
  std::vector<PyObject*> items_;  // the tensors held for the call (one reference each)
  std::vector<std::shared_ptr<HeldList>> held_;  // the held lists the call borrows
  std::vector<std::shared_ptr<std::vector<c10::VariableVersion>>> counters_;  // the held counters it bumps
  HeldCheck held_check_;                          // which of the arguments' held lists are unchanged
};

// After the kernel (whose data streamed through the cache) every TensorImpl and counter is
// cold: both addresses are in the list's descriptors, so they are asked for kBumpAhead tensors on.
void bump(const Tensors& ts) {
  constexpr size_t kBumpAhead = 12;
  const size_t n = ts.size();
  if (ts.held_versions != nullptr) {  // a held list's counters: the TensorImpls are not read again
    for (size_t i = 0; i < n; ++i) {
      if (i + kBumpAhead < n) __builtin_prefetch(ts.desc(i + kBumpAhead).counter, 1);
      if (!ts.desc(i).inference) ts.held_versions[i].bump();
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    if (i + kBumpAhead < n) {
      const Tensors::Desc& a = ts.desc(i + kBumpAhead);
      __builtin_prefetch(a.impl);
      __builtin_prefetch(a.counter, 1);
    }
    const Tensors::Desc& d = ts.desc(i);
    if (d.impl != nullptr && !d.inference) d.impl->bump_version();
  }
}

void bump(const Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

py::object not_handled() { return py::reinterpret_borrow<py::object>(Py_NotImplemented); }

// Runs fn() with the GIL released, the call recorded for the profiler under `op`, and returns
// its result converted to Python (None for void).
template <typename Fn>
py::object run(const char* op, Fn&& fn) {
  using R = decltype(fn());
  if constexpr (std::is_void_v<R>) {
    {
      py::gil_scoped_release no_gil;
      RECORD_FUNCTION(op, std::vector<c10::IValue>());
      PackOutputs pack(true);  // an eager call
      fn();
    }
    return py::none();
  } else {
    std::optional<R> out;
    {
      py::gil_scoped_release no_gil;
      RECORD_FUNCTION(op, std::vector<c10::IValue>());
      PackOutputs pack(true);  // an eager call
      out.emplace(fn());
    }
    return py::cast(std::move(*out));
  }
}

py::object check(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors ts = x.list();
  const bool per_leaf = x.flag();
  if (!x.usable()) return not_handled();
  return run("ampfunc::check", [&] { return check_cpu(ts, per_leaf); });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object check_norm(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors ts = x.list();
  std::optional<Tensor> inv = x.optional_tensor();
  const bool per_leaf = x.flag();
  if (!x.usable()) return not_handled();
  return run("ampfunc::check_norm", [&] { return check_norm_cpu(ts, inv, per_leaf); });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object unscale_(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors ts = x.list();
  const Tensor* inv = x.tensor();
  if (!x.usable()) return not_handled();
  return run("ampfunc::unscale_", [&] {
    Tensor finite = unscale__cpu(ts, *inv);
    bump(ts);
    return finite;
  });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object unscale(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors ts = x.list();
  const Tensor* inv = x.tensor();
  if (!x.usable()) return not_handled();
  return run("ampfunc::unscale", [&] { return unscale_cpu(ts, *inv); });
  END_HANDLE_TH_ERRORS_PYBIND
}

// The four forms of an optimizer step through the door: in place (`*_step_`), out of place
// (`*_step`), and each of them taking its own skip decision (no `finite` argument): out of place
// `*_step_checked` (the check read in the step's pass) and in place `*_step_checked_`.
enum class Form { kInPlace, kOutOfPlace, kChecked, kCheckedInPlace };

constexpr bool takes_finite(Form f) { return f == Form::kInPlace || f == Form::kOutOfPlace; }

// The in-place checked steps' skip decision, as ampfunc.ops._finite_for takes it: check()'s flag
// of `grads` and-ed with `grad_scale` not being NaN. An in-place step must decide before its pass,
// so this is check()'s own read pass, on the lists the call described once for both passes.
Tensor checked_flag(const Tensors& grads, const Tensor& grad_scale) {
  Tensor finite = grad_scale.isnan().bitwise_not();
  if (!grads.empty()) finite = std::get<0>(check_cpu(grads, false)).bitwise_and(finite);
  return finite;
}

// sgd_step_ / sgd_step: (params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr,
// lr_tensor, weight_decay, momentum, dampening, nesterov, maximize); the checked forms: without finite.
template <Form kForm>
py::object sgd_step(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), g = x.read_list(), b = x.list(), mp = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const Tensor* fin = takes_finite(kForm) ? x.tensor() : nullptr;
  const double lr = x.real();
  std::optional<Tensor> lr_t = x.optional_tensor();
  const double wd = x.real(), mom = x.real(), damp = x.real();
  const bool nesterov = x.flag(), maximize = x.flag();
  if (!x.usable()) return not_handled();
  auto step_ = [&](const Tensor& finite) {
    sgd_step__cpu(p, g, b, mp, *step, *gs, finite, lr, lr_t, wd, mom, damp, nesterov, maximize);
    bump(p);
    bump(b);
    bump(mp);
    bump(*step);
  };
  if constexpr (kForm == Form::kInPlace) {
    return run("ampfunc::sgd_step_", [&] { step_(*fin); });
  } else if constexpr (kForm == Form::kCheckedInPlace) {
    return run("ampfunc::sgd_step_checked_", [&] {
      Tensor finite = checked_flag(g, *gs);
      step_(finite);
      return finite;
    });
  } else if constexpr (kForm == Form::kOutOfPlace) {
    return run("ampfunc::sgd_step",
               [&] { return sgd_step_cpu(p, g, b, mp, *step, *gs, *fin, lr, lr_t, wd, mom, damp, nesterov, maximize); });
  } else {
    return run("ampfunc::sgd_step_checked", [&] {
      return sgd_step_checked_cpu(p, g, b, mp, *step, *gs, lr, lr_t, wd, mom, damp, nesterov, maximize);
    });
  }
  END_HANDLE_TH_ERRORS_PYBIND
}

// adam_step_ / adam_step: (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
// grad_scale, finite, lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize);
// the checked forms: without finite.
template <Form kForm>
py::object adam_step(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), g = x.read_list(), m1 = x.list(), m2 = x.list(), vmax = x.list(), mp = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const Tensor* fin = takes_finite(kForm) ? x.tensor() : nullptr;
  const double lr = x.real();
  std::optional<Tensor> lr_t = x.optional_tensor();
  const double b1 = x.real(), b2 = x.real(), eps = x.real(), wd = x.real();
  const bool amsgrad = x.flag(), decoupled = x.flag(), maximize = x.flag();
  if (!x.usable()) return not_handled();
  auto step_ = [&](const Tensor& finite) {
    adam_step__cpu(p, g, m1, m2, vmax, mp, *step, *gs, finite, lr, lr_t, b1, b2, eps, wd, amsgrad, decoupled,
                   maximize);
    bump(p);
    bump(m1);
    bump(m2);
    bump(vmax);
    bump(mp);
    bump(*step);
  };
  if constexpr (kForm == Form::kInPlace) {
    return run("ampfunc::adam_step_", [&] { step_(*fin); });
  } else if constexpr (kForm == Form::kCheckedInPlace) {
    return run("ampfunc::adam_step_checked_", [&] {
      Tensor finite = checked_flag(g, *gs);
      step_(finite);
      return finite;
    });
  } else if constexpr (kForm == Form::kOutOfPlace) {
    return run("ampfunc::adam_step", [&] {
      return adam_step_cpu(p, g, m1, m2, vmax, mp, *step, *gs, *fin, lr, lr_t, b1, b2, eps, wd, amsgrad, decoupled,
                           maximize);
    });
  } else {
    return run("ampfunc::adam_step_checked", [&] {
      return adam_step_checked_cpu(p, g, m1, m2, vmax, mp, *step, *gs, lr, lr_t, b1, b2, eps, wd, amsgrad, decoupled,
                                   maximize);
    });
  }
  END_HANDLE_TH_ERRORS_PYBIND
}

// (params, grads, momentum_buffers, step, grad_scale, lr, lr_tensor, weight_decay, momentum, dampening,
// nesterov, maximize)
py::object sgd_update(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), g = x.read_list(), b = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const double lr = x.real();
  std::optional<Tensor> lr_t = x.optional_tensor();
  const double wd = x.real(), mom = x.real(), damp = x.real();
  const bool nesterov = x.flag(), maximize = x.flag();
  if (!x.usable()) return not_handled();
  return run("ampfunc::sgd_update",
             [&] { return sgd_update_cpu(p, g, b, *step, *gs, lr, lr_t, wd, mom, damp, nesterov, maximize); });
  END_HANDLE_TH_ERRORS_PYBIND
}

// (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, grad_scale, lr, lr_tensor, beta1, beta2,
// eps, weight_decay, amsgrad, decoupled_weight_decay, maximize)
py::object adam_update(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), g = x.read_list(), m1 = x.list(), m2 = x.list(), vmax = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const double lr = x.real();
  std::optional<Tensor> lr_t = x.optional_tensor();
  const double b1 = x.real(), b2 = x.real(), eps = x.real(), wd = x.real();
  const bool amsgrad = x.flag(), decoupled = x.flag(), maximize = x.flag();
  if (!x.usable()) return not_handled();
  return run("ampfunc::adam_update", [&] {
    return adam_update_cpu(p, g, m1, m2, vmax, *step, *gs, lr, lr_t, b1, b2, eps, wd, amsgrad, decoupled, maximize);
  });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object apply_updates(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), u = x.list();
  if (!x.usable()) return not_handled();
  return run("ampfunc::apply_updates", [&] { return apply_updates_cpu(p, u); });
  END_HANDLE_TH_ERRORS_PYBIND
}

// ampfunc.ops.kernel_ready's per-tensor loop: every element of every list of `fp32_lists` (and
// of `float_lists`) an instance of exactly one of `plain_types`, on device `where` (-1: CPU,
// else the CUDA index), float32 (float32/float16/bfloat16), and not requiring grad when
// `grad_on`. Reads a few fields per tensor, in C rather than Python.
bool kernel_ready(const py::tuple& plain_types, int64_t where, bool grad_on, const py::list& fp32_lists,
                  const py::list& float_lists) {
  auto type_ok = [&](PyObject* o) {
    for (const auto& ty : plain_types) {
      if (reinterpret_cast<PyObject*>(Py_TYPE(o)) == ty.ptr()) return true;
    }
    return false;
  };
  auto all_ok = [&](const py::list& lists, bool fp32_only) {
    for (const auto& lst : lists) {
      py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(lst.ptr(), "ampfunc: a list of tensors"));
      if (!seq) throw py::error_already_set();
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
      PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (!type_ok(items[i])) return false;
        const Tensor& t = THPVariable_Unpack(items[i]);
        const at::ScalarType dt = t.scalar_type();
        if (fp32_only ? dt != at::kFloat : !kernel_dtype(dt)) return false;
        const at::Device dev = t.device();
        if (where < 0 ? !dev.is_cpu() : (!dev.is_cuda() || dev.index() != where)) return false;
        if (grad_on && t.requires_grad()) return false;
      }
    }
    return true;
  };
  return all_ok(fp32_lists, true) && all_ok(float_lists, false);
}

// ampfunc.tree's looks at a whole tree, every step of the engine, at C speed (each about 30 ns
// an item in Python, a few milliseconds a step on a 10,000-leaf tree). The engine uses them only
// eagerly; their Python twins in ampfunc/tree.py are the definition.

// tree.dict_values_aligned: [list(t.values()) for t in trees] when every tree is a plain dict
// with the first one's keys in the same order (compared with ==, identity first), else None.
// `known` (None, or lists aligned with trees, None where there is none): a tree whose values are
// the very objects of its known list gets that list back. Comparing the dict's value pointers
// reads its entry table only, where a new list takes a reference on every value: a cache miss
// per tensor object on a large tree, and another when the list dies.
//
// Each dict's entry table is read once, into the borrowed keys and values below; nothing runs
// Python code while they are in use: keys that are not the same objects are compared here only
// when both are exact str, whose == runs none (any other pair sends the call to the general loop,
// which compares as list(t) != list(first) does), and the cyclic collector, which an allocation
// may start and which may run finalizers, is off meanwhile.
bool same_values(PyObject* dict, PyObject* list) {
  if (list == nullptr || !PyList_CheckExact(list) || PyList_GET_SIZE(list) != PyDict_GET_SIZE(dict)) return false;
  PyObject** items = PySequence_Fast_ITEMS(list);
  Py_ssize_t pos = 0, i = 0;
  PyObject *key, *value;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    if (value != items[i++]) return false;
  }
  return true;
}

// The general loop: keys of any type (== may run Python code).
py::object dict_values_aligned_general(const py::list& trees, const py::object& known) {
  const Py_ssize_t n = PyList_GET_SIZE(trees.ptr());
  PyObject* first = PyList_GET_ITEM(trees.ptr(), 0);
  const Py_ssize_t len = PyDict_GET_SIZE(first);
  for (Py_ssize_t k = 1; k < n; ++k) {
    PyObject* t = PyList_GET_ITEM(trees.ptr(), k);
    if (t == first) continue;
    if (!PyDict_CheckExact(t) || PyDict_GET_SIZE(t) != len) return py::none();
    Py_ssize_t pa = 0, pb = 0;
    PyObject *ka, *kb, *va, *vb;
    while (PyDict_Next(first, &pa, &ka, &va)) {
      if (!PyDict_Next(t, &pb, &kb, &vb)) return py::none();
      if (ka == kb) continue;
      const int eq = PyObject_RichCompareBool(kb, ka, Py_EQ);  // as list(t) != list(first) compares
      if (eq < 0) throw py::error_already_set();
      if (eq == 0) return py::none();
    }
  }
  const bool has_known = PyList_CheckExact(known.ptr());
  py::list out(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* tree = PyList_GET_ITEM(trees.ptr(), k);
    PyObject* prev = has_known && k < PyList_GET_SIZE(known.ptr()) ? PyList_GET_ITEM(known.ptr(), k) : nullptr;
    if (same_values(tree, prev)) {
      Py_INCREF(prev);
      PyList_SET_ITEM(out.ptr(), k, prev);
      continue;
    }
    PyObject* values = PyDict_Values(tree);
    if (values == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), k, values);
  }
  return std::move(out);
}

// A dict's keys and values in order, borrowed (its entry table read once).
void dict_entries(PyObject* dict, std::vector<PyObject*>& keys, std::vector<PyObject*>& values) {
  keys.clear();
  values.clear();
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    keys.push_back(key);
    values.push_back(value);
  }
}

// 1: the same keys in order; 0: not; -1: a pair the general loop must compare.
int same_str_keys(const std::vector<PyObject*>& a, const std::vector<PyObject*>& b) {
  constexpr size_t kAhead = 8;  // a key that is another object is read (cold on a large tree)
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    if (!PyUnicode_CheckExact(a[i]) || !PyUnicode_CheckExact(b[i])) return -1;
    for (size_t j = i + 1; j < std::min(a.size(), i + 1 + kAhead); ++j) {
      __builtin_prefetch(a[j]);
      __builtin_prefetch(b[j]);
    }
    const int eq = PyUnicode_Compare(a[i], b[i]);
    if (eq == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (eq != 0) return 0;
  }
  return 1;
}

class NoCyclicGc {
 public:
  NoCyclicGc() : was_(PyGC_Disable()) {}
  ~NoCyclicGc() {
    if (was_) PyGC_Enable();
  }
  NoCyclicGc(const NoCyclicGc&) = delete;
  NoCyclicGc& operator=(const NoCyclicGc&) = delete;

 private:
  int was_;
};

py::object dict_values_aligned(const py::list& trees, const py::object& known) {
  const Py_ssize_t n = PyList_GET_SIZE(trees.ptr());
  PyObject* first = n > 0 ? PyList_GET_ITEM(trees.ptr(), 0) : nullptr;
  if (first == nullptr || !PyDict_CheckExact(first)) return py::none();
  const Py_ssize_t len = PyDict_GET_SIZE(first);
  for (Py_ssize_t k = 1; k < n; ++k) {
    PyObject* t = PyList_GET_ITEM(trees.ptr(), k);
    if (t != first && (!PyDict_CheckExact(t) || PyDict_GET_SIZE(t) != len)) return py::none();
  }
  NoCyclicGc no_gc;  // (the general loop below may run Python code: it holds nothing borrowed across it)
  // per tree: its keys and values (the first's kept for the comparisons)
  thread_local std::vector<std::vector<PyObject*>> keys, values;
  keys.resize(static_cast<size_t>(n));
  values.resize(static_cast<size_t>(n));
  dict_entries(first, keys[0], values[0]);
  for (Py_ssize_t k = 1; k < n; ++k) {
    PyObject* t = PyList_GET_ITEM(trees.ptr(), k);
    dict_entries(t, keys[k], values[k]);  // (as many entries as the first: its size was compared)
    const int same = t == first ? 1 : same_str_keys(keys[0], keys[k]);
    if (same == 0) return py::none();
    if (same < 0) return dict_values_aligned_general(trees, known);
  }
  const bool has_known = PyList_CheckExact(known.ptr());
  py::list out(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    const std::vector<PyObject*>& vs = values[k];
    PyObject* prev = has_known && k < PyList_GET_SIZE(known.ptr()) ? PyList_GET_ITEM(known.ptr(), k) : nullptr;
    if (prev != nullptr && PyList_CheckExact(prev) && PyList_GET_SIZE(prev) == static_cast<Py_ssize_t>(vs.size()) &&
        (vs.empty() || std::memcmp(PySequence_Fast_ITEMS(prev), vs.data(), vs.size() * sizeof(PyObject*)) == 0)) {
      Py_INCREF(prev);
      PyList_SET_ITEM(out.ptr(), k, prev);
      continue;
    }
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(vs.size()));
    if (list == nullptr) throw py::error_already_set();
    constexpr size_t kAhead = 12;  // each value object is cold on a large tree: its count is written
    for (size_t i = 0; i < vs.size(); ++i) {
      if (i + kAhead < vs.size()) __builtin_prefetch(vs[i + kAhead], 1);
      Py_INCREF(vs[i]);
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), vs[i]);
    }
    PyList_SET_ITEM(out.ptr(), k, list);
  }
  return std::move(out);
}

// tree.same_objects for two lists: the very same objects in the same order (identity).
bool same_objects(const py::list& a, const py::list& b) {
  const Py_ssize_t n = PyList_GET_SIZE(a.ptr());
  if (PyList_GET_SIZE(b.ptr()) != n) return false;
  return n == 0 || std::memcmp(PySequence_Fast_ITEMS(a.ptr()), PySequence_Fast_ITEMS(b.ptr()),
                               static_cast<size_t>(n) * sizeof(PyObject*)) == 0;
}

// tree.plain_tensors for a list: every item's type is exactly one of `types`.
bool exact_types(const py::list& values, const py::tuple& types) {
  const Py_ssize_t n = PyList_GET_SIZE(values.ptr()), nt = PyTuple_GET_SIZE(types.ptr());
  PyObject** items = PySequence_Fast_ITEMS(values.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* ty = reinterpret_cast<PyObject*>(Py_TYPE(items[i]));
    bool ok = false;
    for (Py_ssize_t k = 0; k < nt && !ok; ++k) ok = ty == PyTuple_GET_ITEM(types.ptr(), k);
    if (!ok) return false;
  }
  return true;
}

// [p.grad for p in params] and `for p in params: p.grad = None`, for ModuleTrainer: at C speed
// (a Python attribute access on a Parameter costs ~0.2 us; 10,000 of them twice a step add up).
py::list grads_of(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  py::list out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(params.ptr(), i);
    if (!THPVariable_Check(o)) throw py::type_error("ampfunc: grads_of takes a list of tensors");
    const Tensor& g = THPVariable_Unpack(o).grad();
    PyObject* w = g.defined() ? THPVariable_Wrap(g) : (Py_INCREF(Py_None), Py_None);
    if (!w) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), i, w);
  }
  return out;
}

void clear_grads(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(PyList_GET_ITEM(params.ptr(), i))) {
      throw py::type_error("ampfunc: clear_grads takes a list of tensors");
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) THPVariable_Unpack(PyList_GET_ITEM(params.ptr(), i)).mutable_grad().reset();
}

// For ModuleTrainer(flat=True). `bound_signature` records, per param, what its binding to the
// flat buffers looks like (data pointer, element count, dtype, the TensorImpl of its .grad);
// `check_bound`, every step, compares the params with it in one C loop that touches only the
// params (their TensorImpls and autograd meta), not the views: `moved` lists the params whose
// data is elsewhere (moved or converted behind the trainer's back), `unbound` those whose .grad
// is no longer the view (set to None by zero_grad(), then made anew by backward, or assigned).
namespace {
constexpr int64_t kSigCols = 4;

void signature_row(const Tensor& p, int64_t* row) {
  row[0] = p.has_storage() ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.const_data_ptr())) : 0;
  row[1] = p.numel();
  row[2] = static_cast<int64_t>(p.scalar_type());
  const Tensor& g = p.grad();
  row[3] = g.defined() ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(g.unsafeGetTensorImpl())) : 0;
}

const Tensor& param_at(const py::list& params, Py_ssize_t i, const char* fn) {
  PyObject* o = PyList_GET_ITEM(params.ptr(), i);
  if (!THPVariable_Check(o)) throw py::type_error(std::string("ampfunc: ") + fn + " takes a list of tensors");
  return THPVariable_Unpack(o);
}
}  // namespace

Tensor bound_signature(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  Tensor sig = at::empty({static_cast<int64_t>(n), kSigCols}, at::TensorOptions().dtype(at::kLong));
  int64_t* rows = sig.data_ptr<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) signature_row(param_at(params, i, "bound_signature"), rows + i * kSigCols);
  return sig;
}

py::tuple check_bound(const py::list& params, const Tensor& signature) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  if (signature.dim() != 2 || signature.size(0) != n || signature.size(1) != kSigCols ||
      signature.scalar_type() != at::kLong || !signature.is_cpu() || !signature.is_contiguous()) {
    throw py::value_error("ampfunc: check_bound takes the params and their bound_signature");
  }
  const int64_t* rows = signature.const_data_ptr<int64_t>();
  py::list moved, unbound;
  int64_t now[kSigCols];
  for (Py_ssize_t i = 0; i < n; ++i) {
    signature_row(param_at(params, i, "check_bound"), now);
    const int64_t* want = rows + i * kSigCols;
    if (now[0] != want[0] || now[1] != want[1] || now[2] != want[2]) moved.append(i);
    if (now[3] != want[3]) unbound.append(i);
  }
  return py::make_tuple(moved, unbound);
}

// A version-counter bump for every tensor of the list, as an in-place torch op makes
// (torch.autograd.graph.increment_version at C speed): ModuleTrainer(flat=True) writes its
// params through the flat buffer, whose views do not share the params' counters.
// Each tensor costs three cold objects (the Python object, its TensorImpl, its counter), each
// found through the one before: the loops ask for them kObjectAhead, kImplAhead and
// kCounterAhead tensors on, so that the misses of neighbouring tensors overlap.
void bump_versions(const py::list& tensors) {
  constexpr Py_ssize_t kObjectAhead = 16, kImplAhead = 8, kCounterAhead = 4;
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  PyObject** items = PySequence_Fast_ITEMS(tensors.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kObjectAhead < n) __builtin_prefetch(items[i + kObjectAhead]);
    if (!THPVariable_Check(items[i])) throw py::type_error("ampfunc: bump_versions takes a list of tensors");
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kImplAhead < n) ampfunc::prefetch_impl(THPVariable_Unpack(items[i + kImplAhead]));
    if (i + kCounterAhead < n) __builtin_prefetch(ampfunc::counter_of(THPVariable_Unpack(items[i + kCounterAhead])), 1);
    bump(THPVariable_Unpack(items[i]));
  }
}

// The first index whose requires_grad differs from expected[i] (a bytes object of 0/1), or -1.
int64_t requires_grad_changed(const py::list& tensors, const py::bytes& expected) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  char* want = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_AsStringAndSize(expected.ptr(), &want, &len) != 0 || len != n) {
    PyErr_Clear();
    throw py::value_error("ampfunc: requires_grad_changed takes a list and a bytes object of its length");
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(tensors.ptr(), i);
    if (!THPVariable_Check(o)) throw py::type_error("ampfunc: requires_grad_changed takes a list of tensors");
    if (THPVariable_Unpack(o).requires_grad() != (want[i] != 0)) return i;
  }
  return -1;
}

// `params[i].grad = grads[i]` for every i, at C speed (ModuleTrainer(flat=True) putting its
// gradient views back). Shapes, dtypes and devices must match, as Python's .grad setter demands.
void set_grads(const py::list& params, const py::list& grads) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  if (PyList_GET_SIZE(grads.ptr()) != n) throw py::value_error("ampfunc: set_grads takes two lists of one length");
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *o = PyList_GET_ITEM(params.ptr(), i), *g = PyList_GET_ITEM(grads.ptr(), i);
    if (!THPVariable_Check(o) || !THPVariable_Check(g)) throw py::type_error("ampfunc: set_grads takes lists of tensors");
    const Tensor& p = THPVariable_Unpack(o);
    const Tensor& gt = THPVariable_Unpack(g);
    if (gt.sizes() != p.sizes() || gt.scalar_type() != p.scalar_type() || gt.device() != p.device()) {
      throw py::value_error("ampfunc: set_grads: grads[" + std::to_string(i) + "] does not match its param's shape, " +
                            "dtype and device");
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    THPVariable_Unpack(PyList_GET_ITEM(params.ptr(), i)).mutable_grad() =
        THPVariable_Unpack(PyList_GET_ITEM(grads.ptr(), i));
  }
}

// ampfunc.ops.overlapping_pair: the indices (i, j), i < j, of two tensors of the list that
// share memory, or None; empty and meta tensors share nothing (find_overlap, the ops' own rule).
// NotImplemented for a tensor subclass (ampfunc.ops then runs the Python twin of the rule).
py::object overlapping_pair(const py::list& tensors) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  std::vector<Span> spans;
  spans.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(tensors.ptr(), i);
    if (!THPVariable_Check(o)) throw py::type_error("ampfunc: overlapping_pair takes a list of tensors");
    const Tensor& t = THPVariable_Unpack(o);
    // a tensor subclass without memory of its own: the caller's Python twin decides
    if (t.key_set().has(c10::DispatchKey::Python) || (!t.has_storage() && !t.is_meta())) return not_handled();
    if (t.numel() > 0 && !t.is_meta()) add_span(spans, t, 0, "", static_cast<int64_t>(i));
  }
  auto [a, b] = find_overlap(spans);
  if (a == nullptr) return py::none();
  return py::make_tuple(std::min(a->idx, b->idx), std::max(a->idx, b->idx));
}

// ampfunc.ops.fresh_copies: a contiguous copy of each CPU tensor, in the output pool (a pure step
// that runs an in-place kernel over copies reuses the memory of the copies it dropped, instead
// of faulting in fresh pages every step). NotImplemented for anything else (the caller clones).
py::object fresh_copies(const py::list& tensors) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  std::vector<const Tensor*> in;
  in.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(tensors.ptr(), i);
    if (!THPVariable_Check(o)) throw py::type_error("ampfunc: fresh_copies takes a list of tensors");
    const Tensor& t = THPVariable_Unpack(o);
    if (t.key_set().has(c10::DispatchKey::Python) || !t.device().is_cpu() || t.layout() != at::kStrided ||
        !t.has_storage() || t.is_conj() || t.is_neg()) {
      return not_handled();
    }
    in.push_back(&t);
  }
  py::list out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    Tensor copy = pooled_empty(in[i]->sizes(), in[i]->scalar_type());
    {
      const py::gil_scoped_release no_gil;
      const at::NoGradGuard no_grad;  // a copy of a param, not a node of its graph
      copy.copy_(*in[i]);
    }
    PyList_SET_ITEM(out.ptr(), i, THPVariable_Wrap(std::move(copy)));
  }
  return out;
}

// The optimizers' spec table (spec.h), for the test that compares it with ampfunc/ops/_spec.py:
// {name: {"state": [(list, when or None)], "hypers": [(name, kind)]}}.
py::dict spec() {
  py::dict out;
  for (const OptimizerSpec* s : optimizer_specs()) {
    py::list state, hypers;
    for (const StateSpec& st : s->state) {
      state.append(py::make_tuple(st.name, st.when ? py::object(py::str(st.when)) : py::object(py::none())));
    }
    for (const HyperSpec& h : s->hypers) hypers.append(py::make_tuple(h.name, h.kind));
    py::dict d;
    d["state"] = state;
    d["hypers"] = hypers;
    out[s->name] = d;
  }
  return out;
}

py::object pool_stats() {
  auto [cached, limit, hits, misses] = OutputPool::get().stats();
  py::dict d;
  d["cached_bytes"] = cached;
  d["limit_bytes"] = limit;
  d["hits"] = hits;
  d["misses"] = misses;
  return d;
}

py::object empty_cache() {
  size_t freed;
  {
    py::gil_scoped_release no_gil;
    freed = OutputPool::get().empty_cache();
  }
  return py::int_(freed);
}

}  // namespace direct

}  // namespace
