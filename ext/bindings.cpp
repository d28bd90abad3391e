// The torch glue of ampfunc: implementations of the ops that ampfunc/ops/ defines (schemas,
// fake kernels and the plain-torch reference live there, so the ops exist even when this
// extension is not built). The glue validates arguments (errors name the argument and
// the index of the tensor at fault), makes non-contiguous tensors contiguous (and writes the
// results back), and dispatches CPU tensors to ext/cpu/kernels.cpp and, when built with
// AMPFUNC_WITH_CUDA, CUDA tensors to the raw-pointer launchers of ext/cuda/ampfunc_cuda.h.
//
// Nothing here reads a CUDA tensor back to the host: flags, scales and step counters are
// passed to the CUDA launchers as device pointers. On the CPU they are plain memory.
//
// One translation unit, its parts in ext/glue/ along its concerns (each included once):
//   glue/common.h      the headers and the few names every part uses
//   glue/validation.h  argument validation: messages, dtypes, shapes, devices, memory overlap
//   glue/spec.h        the optimizers' spec table (ampfunc/ops/_spec.py's C++ side)
//   glue/cpu_pool.h    the CPU output pool of the out-of-place kernels
//   glue/cpu_ops.h     the CPU implementations of the ops (ext/cpu/ does the arithmetic)
//   glue/cuda_ops.h    the CUDA implementations (ext/cuda/'s launchers), with AMPFUNC_WITH_CUDA
//   glue/lowmem_cuda.h the CUDA implementation of adam_lowmem_step_ (its CPU kernel, with the
//                      checks both share, is ext/cpu/lowmem.cpp), with AMPFUNC_WITH_CUDA
//   glue/held.h        what the direct door may borrow: plain CPU tensors, held lists
//   glue/direct.h      the direct door: eager CPU calls without the dispatcher
//   glue/optimizers.h  the generic optimizers' ops (ext/optimizers.h), CPU and CUDA, and their
//                      direct door
// and this file, the registration: the dispatcher's kernels and the direct door's module.

#include "glue/common.h"
#include "glue/validation.h"
#include "glue/spec.h"
#include "glue/cpu_pool.h"
#include "glue/cpu_ops.h"
#include "glue/cuda_ops.h"
#include "glue/lowmem_cuda.h"
#include "glue/held.h"
#include "glue/direct.h"
#include "glue/optimizers.h"

// The CPU implementations take borrowed lists (ampfunc::Tensors); the dispatcher hands them
// TensorList arguments. Registered<F>::call is F with each `const Tensors&` parameter spelled
// TensorList, the schema type the dispatcher knows.
template <typename T>
struct SchemaArg {
  using type = T;
};
template <>
struct SchemaArg<const Tensors&> {
  using type = TensorList;
};
template <auto F>
struct Registered;
template <typename R, typename... A, R (*F)(A...)>
struct Registered<F> {
  static R call(typename SchemaArg<A>::type... a) { return F(a...); }
};

// A generic optimizer's three ops: one boxed kernel each, for the CPU and CUDA keys alike (it
// picks the device's implementation itself: glue/optimizers.h).
#define AMPFUNC_REGISTER_OPTIMIZER(name, Op)                                                                    \
  m.impl(#name "_step_", torch::CppFunction::makeFromBoxedFunction<&optim_kernel<Op, OptimForm::kInPlace>>());   \
  m.impl(#name "_step", torch::CppFunction::makeFromBoxedFunction<&optim_kernel<Op, OptimForm::kOutOfPlace>>()); \
  m.impl(#name "_update", torch::CppFunction::makeFromBoxedFunction<&optim_kernel<Op, OptimForm::kUpdate>>());

TORCH_LIBRARY_IMPL(ampfunc, CPU, m) {
  m.impl("check", &Registered<&check_cpu>::call);
  m.impl("unscale_", &Registered<&unscale__cpu>::call);
  m.impl("unscale", &Registered<&unscale_cpu>::call);
  m.impl("sgd_step_", &Registered<&sgd_step__cpu>::call);
  m.impl("adam_step_", &Registered<&adam_step__cpu>::call);
  m.impl("sgd_step", &Registered<&sgd_step_cpu>::call);
  m.impl("adam_step", &Registered<&adam_step_cpu>::call);
  m.impl("update_scale_", &update_scale__cpu);
  m.impl("check_norm", &Registered<&check_norm_cpu>::call);
  m.impl("sgd_update", &Registered<&sgd_update_cpu>::call);
  m.impl("adam_update", &Registered<&adam_update_cpu>::call);
  m.impl("apply_updates", &Registered<&apply_updates_cpu>::call);
  AMPFUNC_OPTIMIZERS(AMPFUNC_REGISTER_OPTIMIZER)
}

#ifdef AMPFUNC_WITH_CUDA
TORCH_LIBRARY_IMPL(ampfunc, CUDA, m) {
  m.impl("check", &check_cuda);
  m.impl("unscale_", &unscale__cuda);
  m.impl("unscale", &unscale_cuda);
  m.impl("sgd_step_", &sgd_step__cuda);
  m.impl("adam_step_", &adam_step__cuda);
  m.impl("sgd_step", &sgd_step_cuda);
  m.impl("adam_step", &adam_step_cuda);
  m.impl("update_scale_", &update_scale__cuda);
  m.impl("check_norm", &check_norm_cuda);
  m.impl("sgd_update", &sgd_update_cuda);
  m.impl("adam_update", &adam_update_cuda);
  m.impl("apply_updates", &apply_updates_cuda);
  m.impl("adam_lowmem_step_", &adam_lowmem_step__cuda);
  AMPFUNC_OPTIMIZERS(AMPFUNC_REGISTER_OPTIMIZER)
}
#endif

// A symbol the loader can look for to tell which backends this build carries.
extern "C" int ampfunc_ext_has_cuda() {
#ifdef AMPFUNC_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

// The direct door's module (see namespace direct above), made on request: the library is loaded
// with torch.ops.load_library, not imported, so ampfunc/_build.py asks for the module through
// ctypes (ctypes.PyDLL, which holds the GIL) and keeps it.
extern "C" __attribute__((visibility("default"))) PyObject* ampfunc_direct_module() {
  namespace py = pybind11;
  try {
    py::module_ m = py::reinterpret_steal<py::module_>(PyModule_New("ampfunc._direct"));
    if (!m) return nullptr;
    m.def("check", &direct::check);
    m.def("check_norm", &direct::check_norm);
    m.def("unscale_", &direct::unscale_);
    m.def("unscale", &direct::unscale);
    m.def("sgd_step_", &direct::sgd_step<direct::Form::kInPlace>);
    m.def("sgd_step", &direct::sgd_step<direct::Form::kOutOfPlace>);
    m.def("sgd_step_checked", &direct::sgd_step<direct::Form::kChecked>);
    m.def("sgd_step_checked_", &direct::sgd_step<direct::Form::kCheckedInPlace>);
    m.def("adam_step_", &direct::adam_step<direct::Form::kInPlace>);
    m.def("adam_step", &direct::adam_step<direct::Form::kOutOfPlace>);
    m.def("adam_step_checked", &direct::adam_step<direct::Form::kChecked>);
    m.def("adam_step_checked_", &direct::adam_step<direct::Form::kCheckedInPlace>);
    m.def("sgd_update", &direct::sgd_update);
    m.def("adam_update", &direct::adam_update);
    m.def("apply_updates", &direct::apply_updates);
#define AMPFUNC_DIRECT_OPTIMIZER(name, Op)                                           \
  m.def(#name "_step_", &direct::optim<Op, OptimForm::kInPlace>);                    \
  m.def(#name "_step", &direct::optim<Op, OptimForm::kOutOfPlace>);                  \
  m.def(#name "_step_checked", &direct::optim<Op, OptimForm::kOutOfPlace, true>);    \
  m.def(#name "_step_checked_", &direct::optim<Op, OptimForm::kInPlace, true>);      \
  m.def(#name "_update", &direct::optim<Op, OptimForm::kUpdate>);
    AMPFUNC_OPTIMIZERS(AMPFUNC_DIRECT_OPTIMIZER)
#undef AMPFUNC_DIRECT_OPTIMIZER
    m.def("kernel_ready", &direct::kernel_ready);
    m.def("dict_values_aligned", &direct::dict_values_aligned, py::arg("trees"), py::arg("known") = py::none());
    m.def("same_objects", &direct::same_objects);
    m.def("exact_types", &direct::exact_types);
    m.def("grads_of", &direct::grads_of);
    m.def("clear_grads", &direct::clear_grads);
    m.def("bound_signature", &direct::bound_signature);
    // ops._call around an eager torch.ops call (CUDA): returns the previous setting.
    m.def("pack_outputs", [](bool on) {
      const bool prev = t_pack_outputs;
      t_pack_outputs = on;
      return prev;
    });
    m.def("check_bound", &direct::check_bound);
    m.def("set_grads", &direct::set_grads);
    m.def("fresh_copies", &direct::fresh_copies);
    m.def("bump_versions", &direct::bump_versions);
    py::class_<direct::HeldLists>(m, "HeldLists")
        .def(py::init<const py::list&>())
        .def("__len__", &direct::HeldLists::size);
    m.def("requires_grad_changed", &direct::requires_grad_changed);
    m.def("overlapping_pair", &direct::overlapping_pair);
    m.def("spec", &direct::spec);
    m.def("pool_stats", &direct::pool_stats);
    m.def("empty_cache", &direct::empty_cache);
    return m.release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}
