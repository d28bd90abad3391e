// CPU kernels of ampfunc: multi-tensor loops over lists of contiguous CPU tensors.
//
// Every kernel walks the concatenation of its tensors as one index range split across threads
// by at::parallel_for, so a list of 10,000 small tensors costs one parallel region, the same as
// one flat buffer of the same total size. Arithmetic is in fp32 whatever the storage dtype
// (float32, float16, bfloat16); reduced-precision values are converted on load and rounded once
// on store. The binding layer (ext/bindings.cpp) validates devices, dtypes and lengths and makes
// non-contiguous tensors contiguous before calling these.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace ampfunc {
namespace cpu {

struct CheckResult {
  bool finite;   // every element of every tensor is finite
  double sumsq;  // sum of squares, accumulated in fp32 blocks and combined in double
};

// One read of every tensor, no writes. per_leaf_nonfinite (nullable) gets 1 at index i when
// tensor i holds a NaN or an infinity.
// With `scaled`, the squares are of fp32(x * scale) (the unscaled value, the product taken as
// unscale() takes it) while finiteness is still judged on x. Blocks whose fp32 sum overflows are
// recomputed in double, so the double result is finite whenever every squared value is.
CheckResult check(const std::vector<at::Tensor>& tensors, uint8_t* per_leaf_nonfinite, bool scaled = false,
                  float scale = 1.f);

// outs[i] = ins[i] * inv_scale, product in fp32, stored in outs[i]'s dtype. outs may be ins
// (in place). Returns whether every input element was finite.
bool unscale(const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs, float inv_scale);

struct SgdHyper {
  float grad_scale;
  float lr;
  float weight_decay;
  float momentum;
  float dampening;
  bool nesterov;
  bool maximize;
  bool first_step;  // momentum buffer is initialised to the gradient (torch's `buf is None`)
  bool lr_fma = true;  // p + g * -lr as one fused multiply-add (add(alpha=)); false: mul, then add
};

// One pass: g = grad * grad_scale; torch.optim.SGD's update of params (fp32) and momentum
// buffers (fp32, empty list when momentum == 0), read from `params` / `momentum_buffers` and
// written to `params_out` / `momentum_buffers_out`; model_params (empty, or one per param, any
// float dtype) receive the rounded new params. The step runs in place when the out lists are
// the in lists (each element is loaded before it is stored) and out of place when they are
// other tensors; the arithmetic is the same code either way, so the results are bit-identical.
void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& params_out,
              const std::vector<at::Tensor>& momentum_buffers_out, const std::vector<at::Tensor>& model_params,
              const SgdHyper& h);

// The pure optimizer's update (optax form): one pass writing `updates` (fp32, new tensors)
// instead of the params: updates = new_p - p with new_p computed as sgd_step computes it, or
// -lr * g when `params` is empty (then weight_decay must be 0). Momentum buffers are read from
// `momentum_buffers` and written to `momentum_buffers_out`.
void sgd_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& momentum_buffers_out,
                const std::vector<at::Tensor>& updates, const SgdHyper& h);

struct AdamHyper {
  float grad_scale;
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double step;  // the step being taken (already incremented), as torch's _get_value(step_t)
  bool amsgrad;
  bool decoupled_weight_decay;
  bool maximize;
  bool fp32_decay = false;  // decay = 1 - lr * wd in fp32 (a schedule's lr tensor), not in double
};

// The fp32 lists an Adam step reads (or writes): max_exp_avg_sqs is empty without amsgrad.
struct AdamLists {
  const std::vector<at::Tensor>& params;
  const std::vector<at::Tensor>& exp_avgs;
  const std::vector<at::Tensor>& exp_avg_sqs;
  const std::vector<at::Tensor>& max_exp_avg_sqs;
};

// One pass of torch.optim.Adam / AdamW (single-tensor order of operations, fp32): reads `in`
// and the grads, writes `out` and model_params (empty, or the new params rounded to each
// one's dtype). In place when `out` names the same tensors as `in`, out of place otherwise,
// with the same code and so the same bits.
void adam_step(const AdamLists& in, const std::vector<at::Tensor>& grads, const AdamLists& out,
               const std::vector<at::Tensor>& model_params, const AdamHyper& h);

// The pure Adam update: reads `in` (params may be empty: then weight_decay must be 0) and the
// grads, writes the new moments to `out` (its params list is ignored) and `updates` (fp32, new
// tensors): new_p - p with new_p computed as adam_step computes it, or the step term
// (-step_size * m / denom) alone when there are no params.
void adam_update(const AdamLists& in, const std::vector<at::Tensor>& grads, const AdamLists& out,
                 const std::vector<at::Tensor>& updates, const AdamHyper& h);

// outs[i] = fp32(params[i]) + fp32(updates[i]), rounded once to outs[i]'s dtype (params' dtype).
void apply_updates(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& updates,
                   const std::vector<at::Tensor>& outs);

// outs[i] = ins[i], bit for bit (same dtype and numel): the skipped out-of-place step.
void copy(const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs);

struct ScaleConfig {
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  double min_scale;
  double max_scale;
  int64_t hysteresis;
};

// The dynamic loss-scale update, the rule of ampfunc.ops._ref_update_scale.
void update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, bool finite,
                  const ScaleConfig& c);

}  // namespace cpu
}  // namespace ampfunc
