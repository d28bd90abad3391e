// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// The headers every glue file uses, and the few names they share.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../cpu/kernels.h"

#ifdef AMPFUNC_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../cuda/ampfunc_cuda.h"
#endif

namespace {

using ampfunc::Tensors;
using at::Tensor;
using at::TensorList;

bool kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace
