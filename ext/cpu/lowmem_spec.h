// The tensor lists of ampfunc::adam_lowmem_step_ in schema order: name, accepted dtypes, shape
// role, and for an absmax list the list of codes it belongs to. The same table as
// ampfunc/ops/_spec.py's LOWMEM_ADAM_STEP_ (tests/test_ops_spec.py compares them); the kernel
// (lowmem.cpp) validates its arguments in this order. Shape roles: "" the params' shape;
// "remainder" the param's shape where it is bf16, else (0,); "blocks" (numel / 256,) where the
// `of` tensor is uint8 (q8 codes), else (0,).
#pragma once

namespace ampfunc {
namespace lowmem {

struct ListSpec {
  const char* name;
  const char* dtypes;
  const char* shape;
  const char* of;
};

inline constexpr ListSpec kAdamLowmemLists[] = {
    {"params", "float32,bfloat16", "", ""},
    {"remainders", "int16", "remainder", ""},
    {"grads", "float32,float16,bfloat16", "", ""},
    {"exp_avgs", "float32,bfloat16,uint8", "", ""},
    {"exp_avg_absmax", "float32", "blocks", "exp_avgs"},
    {"exp_avg_sqs", "float32,bfloat16,uint8", "", ""},
    {"exp_avg_sq_absmax", "float32", "blocks", "exp_avg_sqs"},
};
inline constexpr int kAdamLowmemNumLists = sizeof(kAdamLowmemLists) / sizeof(kAdamLowmemLists[0]);

}  // namespace lowmem
}  // namespace ampfunc
