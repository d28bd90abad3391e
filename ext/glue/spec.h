// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// The C++ side of the spec table (ampfunc/ops/_spec.py): each fused optimizer's state lists, the
// hyper-parameter that turns each one on, and its hyper-parameters in schema order. The
// validation of the optimizer ops reads it (validation.h: step_lists, update_lists); the direct
// door's module hands it to Python (`spec()`), where tests/test_ops_spec.py compares it with the
// Python table; and the dispatcher checks every kernel's signature against the schema that
// ampfunc/ops derives from the same table when the library loads.
#pragma once

#include "common.h"
#include "../cpu/lowmem_spec.h"  // adam_lowmem_step_'s lists (per-list dtypes, shape roles)

namespace {

struct StateSpec {
  const char* name;
  const char* when;  // nullptr: always used; else the hyper-parameter that turns it on (nonzero)
};

struct HyperSpec {
  const char* name;
  const char* kind;  // "float" or "bool", the schema's type
};

struct OptimizerSpec {
  const char* name;
  std::vector<StateSpec> state;
  std::vector<HyperSpec> hypers;

  // Whether state list k is used, given the hyper-parameter values in schema order.
  bool uses(size_t k, const std::vector<double>& hyper) const {
    const char* when = state[k].when;
    if (when == nullptr) return true;
    for (size_t i = 0; i < hypers.size(); ++i) {
      if (std::string(hypers[i].name) == when) return hyper[i] != 0.0;
    }
    TORCH_CHECK(false, "ampfunc: the spec of ", name, " names no hyper-parameter ", when);
  }
};

const OptimizerSpec kSgd{"sgd",
                         {{"momentum_buffers", "momentum"}},
                         {{"weight_decay", "float"},
                          {"momentum", "float"},
                          {"dampening", "float"},
                          {"nesterov", "bool"},
                          {"maximize", "bool"}}};

const OptimizerSpec kAdam{"adam",
                          {{"exp_avgs", nullptr}, {"exp_avg_sqs", nullptr}, {"max_exp_avg_sqs", "amsgrad"}},
                          {{"beta1", "float"},
                           {"beta2", "float"},
                           {"eps", "float"},
                           {"weight_decay", "float"},
                           {"amsgrad", "bool"},
                           {"decoupled_weight_decay", "bool"},
                           {"maximize", "bool"}}};

// Every optimizer's spec: SGD's and Adam's above, the generic ones' (ext/optimizers.h) from
// their headers. Defined in optimizers.h.
const std::vector<const OptimizerSpec*>& optimizer_specs();

}  // namespace
