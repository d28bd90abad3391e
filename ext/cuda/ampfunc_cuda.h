/*
 * ampfunc CUDA kernels: a torch-free C ABI.
 *
 * Every launcher takes host arrays of raw device pointers (one array per tensor list, all the
 * same length n, entry i of each list belonging to the same leaf), the leaves' element counts,
 * a dtype code, device pointers to the scalars that must stay on the device (flags, scales,
 * step counters: reading them on the host would sync), hyper-parameters by value, and the
 * stream to enqueue on. Nothing is read back to the host and nothing is allocated, so every
 * launcher is safe inside CUDA-graph capture.
 *
 * Layout: the lists are packed into kernel arguments in chunks of AMPFUNC_CUDA_CHUNK elements
 * (multi-tensor apply); one launch covers as many leaves and chunks as fit in one kernel
 * argument block, so a flat buffer is one launch and a tree of many leaves is a few.
 *
 * Requirements the caller checks (the torch glue does, with errors naming the leaf):
 *   - every pointer is to contiguous, non-overlapping memory on the device current on the
 *     calling thread, and stays alive until the stream reaches the kernels;
 *   - numels[i] >= 0 (0-element leaves are skipped); n >= 0;
 *   - "fp32 list" means float*, the dtype code applies to the lists documented as such.
 * Unaligned pointers are fine (a scalar path is taken); 16-byte-aligned ones get vector loads.
 *
 * Return value: 0 on success, else a cudaError_t code (cudaErrorInvalidValue for bad arguments);
 * ampfunc_cuda_error_string() turns it into text.
 *
 * Flags: `finite` is a one-byte bool on the device (torch.bool storage): nonzero = every
 * element seen was finite. Outputs taking `accumulate`: 0 overwrites the output (the flag is
 * first set to true, the sum to 0), nonzero combines with what is already there (flag AND-ed,
 * sum added) so that a caller can cover several (dtype) groups with several calls.
 *
 * Arithmetic: everything in fp32 ("opmath"), in the order of torch.optim's single-tensor
 * implementations (see each launcher); bias corrections in double from the fp32 step count;
 * the check's sums of squares combined in double (see ampfunc_cuda_check).
 */
#ifndef AMPFUNC_CUDA_H
#define AMPFUNC_CUDA_H

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtype codes */
#define AMPFUNC_FP32 0
#define AMPFUNC_FP16 1
#define AMPFUNC_BF16 2
/* a moment layout of the low-memory step, not an element dtype: uint8 codes + fp32 absmax per 256 */
#define AMPFUNC_Q8 3

/* Elements per multi-tensor-apply chunk (one thread block per chunk). */
#define AMPFUNC_CUDA_CHUNK 65536

/* Version of this ABI (the glue static_asserts the one it was written for).
 * 2: the out-of-place steps and the pure updates (ampfunc_cuda_*_step_out, ampfunc_cuda_*_update).
 * 3: ampfunc_cuda_check sums without overflow: double `sumsq` accumulator, fp32 `sumsq_f32` and
 *    `norm` outputs, double partials in the workspace (an incompatible change of that launcher).
 * 4: the generic optimizers' launchers (ampfunc_cuda_optim_<name>, AmpfuncOptimLaunch).
 * 5: the low-memory Adam/AdamW step (ampfunc_cuda_adam_lowmem_step, the AMPFUNC_Q8 layout code). */
#define AMPFUNC_CUDA_ABI_VERSION 5
int ampfunc_cuda_abi_version(void);

const char* ampfunc_cuda_error_string(int status);

/* ------------------------------------------------------------------------------------------
 * Read-only check: non-finite flag and sum of squares in one read of the tensors.
 *
 * For each element x (of dtype `dtype`), in fp32: y = scale ? x * (*scale) : x; sums y*y and
 * notes whether x is finite. The sum cannot overflow while every x is finite (it may exceed
 * fp32's range: e.g. 20 values of 1e20): each block sums its 64K-element chunk in fp32, and a
 * block whose fp32 sum overflows while its elements are all finite sums the chunk again in
 * double (a second read of that chunk only). The block partials (double) land in `workspace`;
 * one final kernel adds them in a fixed order in double, so the result is deterministic run to
 * run (no atomics), and rounds the fp32 results once from the double total.
 *   finite          out, 1 byte (may be NULL)   all elements finite        (accumulate rule)
 *   sumsq           out, double (may be NULL)   sum of squares             (accumulate rule)
 *   sumsq_f32       out, fp32 (may be NULL)     fp32(total)                (always overwritten)
 *   norm            out, fp32 (may be NULL)     fp32(sqrt(total))          (always overwritten)
 *                   total = the double sum of this call, plus *sumsq when `accumulate`; so a
 *                   caller covering several groups gets the fp32 sum or the norm of all of
 *                   them from its last call. With `accumulate`, sumsq_f32 or norm need sumsq.
 *   leaf_nonfinite  out, n bytes (may be NULL)  1 where leaf i holds a non-finite value, else 0
 *                                               (always overwritten, whatever `accumulate`)
 *   workspace       scratch on the device, 8-byte aligned, at least
 *                   ampfunc_cuda_check_workspace_bytes() bytes (needs no initialisation; may be
 *                   NULL when that size is 0). After the call it holds each block's partial
 *                   (double, in block order) and then each block's non-finite flag (float).
 * Cost: one read of every element (two for a block whose fp32 sum overflows), 12 bytes per
 * 64K-element chunk, two launches + one per argument block.
 * ------------------------------------------------------------------------------------------ */
int64_t ampfunc_cuda_check_workspace_bytes(int n, const int64_t* numels);

int ampfunc_cuda_check(int n, const void* const* tensors, const int64_t* numels, int dtype,
                       const float* scale, uint8_t* finite, double* sumsq, float* sumsq_f32, float* norm,
                       uint8_t* leaf_nonfinite, void* workspace, int64_t workspace_bytes, int accumulate,
                       cudaStream_t stream);

/* ------------------------------------------------------------------------------------------
 * Unscale, as torch._amp_foreach_non_finite_check_and_unscale_ (bf16 included):
 * per element, in fp32, out = x * (*inv_scale); finiteness is judged on the input x.
 *   ampfunc_cuda_unscale_: in place, the product rounded to `dtype`.
 *   ampfunc_cuda_unscale:  out of place into the fp32 list `outs` (may alias `tensors` only
 *                          when dtype is fp32).
 *   finite: out, 1 byte, accumulate rule (may be NULL).
 * Cost: one read and one write of every element; one launch per argument block (+ a 1-byte
 * memset when !accumulate).
 * ------------------------------------------------------------------------------------------ */
int ampfunc_cuda_unscale_(int n, void* const* tensors, const int64_t* numels, int dtype,
                          const float* inv_scale, uint8_t* finite, int accumulate, cudaStream_t stream);

int ampfunc_cuda_unscale(int n, const void* const* tensors, void* const* outs, const int64_t* numels,
                         int dtype, const float* inv_scale, uint8_t* finite, int accumulate,
                         cudaStream_t stream);

/* ------------------------------------------------------------------------------------------
 * Fused optimizer steps over fp32 master parameters.
 *
 * Shared arguments:
 *   grads / grad_dtype   the gradients (fp32, fp16 or bf16), read only.
 *   params               fp32 master parameters, updated in place.
 *   model_copies         optional (NULL) list written with the new parameter rounded to
 *                        model_dtype (fp16 or bf16; fp32 allowed) in the same pass.
 *   grad_scale           optional device fp32: every gradient is first multiplied by it
 *                        (pass inv_scale * clip_coef, folded on the device).
 *   finite               optional device bool: when it is 0 the kernels exit before writing
 *                        anything (params, state, model copies and the step untouched).
 *   lr_tensor            optional device fp32 overriding hyper->lr (schedules under graphs).
 *   step                 device fp32: the number of steps taken before this one; the update
 *                        uses t = *step + 1. When increment_step is nonzero the launcher then
 *                        enqueues *step += 1 (only if finite). A caller covering several dtype
 *                        groups that share one step passes increment_step = 1 on the last call.
 * ------------------------------------------------------------------------------------------ */

typedef struct AmpfuncAdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int adamw;    /* 1: decoupled weight decay p *= 1 - lr*wd (AdamW); 0: g += wd*p (Adam) */
  int amsgrad;  /* 1: max_exp_avg_sqs must be given */
  int maximize; /* 1: g = -g */
} AmpfuncAdamHyper;

/* Adam / AdamW, the order of torch.optim.adam._single_tensor_adam in fp32:
 *   g = grad * grad_scale; if maximize: g = -g
 *   if adamw: p = p * (1 - lr*wd)  else if wd: g = g + wd*p
 *   m = m + (1-beta1) * (g - m)                        (lerp)
 *   v = v * beta2 + (1-beta2) * g * g
 *   bc1 = 1 - beta1^t, bc2 = 1 - beta2^t               (double, t from the fp32 step)
 *   vmax = max(vmax, v) if amsgrad
 *   denom = sqrt(v or vmax) / sqrt(bc2) + eps
 *   p = p - (lr / bc1) * m / denom;  copy = round(p)
 * exp_avgs, exp_avg_sqs, max_exp_avg_sqs: fp32 lists.
 * Cost: reads g, p, m, v (+vmax); writes p, m, v (+vmax, +copy): one pass. */
int ampfunc_cuda_adam_step(int n, const void* const* grads, int grad_dtype, void* const* params,
                           void* const* exp_avgs, void* const* exp_avg_sqs, void* const* max_exp_avg_sqs,
                           void* const* model_copies, int model_dtype, const int64_t* numels,
                           const float* grad_scale, const uint8_t* finite, const float* lr_tensor,
                           float* step, int increment_step, const AmpfuncAdamHyper* hyper,
                           cudaStream_t stream);

typedef struct AmpfuncSgdHyper {
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  int nesterov;
  int maximize;
} AmpfuncSgdHyper;

/* SGD, the order of torch.optim.sgd._single_tensor_sgd in fp32:
 *   g = grad * grad_scale; if maximize: g = -g; if wd: g = g + wd*p
 *   if momentum: buf = (t == 1) ? g : buf*momentum + (1-dampening)*g
 *                g = nesterov ? g + momentum*buf : buf
 *   p = p - lr*g;  copy = round(p)
 * momentum_bufs: fp32 list, required when momentum != 0 (ignored otherwise); `step` may be
 * NULL only when momentum == 0 (then the buffers are never "first"). */
int ampfunc_cuda_sgd_step(int n, const void* const* grads, int grad_dtype, void* const* params,
                          void* const* momentum_bufs, void* const* model_copies, int model_dtype,
                          const int64_t* numels, const float* grad_scale, const uint8_t* finite,
                          const float* lr_tensor, float* step, int increment_step,
                          const AmpfuncSgdHyper* hyper, cudaStream_t stream);

/* ------------------------------------------------------------------------------------------
 * Out-of-place steps and pure updates: the kernels above with separate destinations, one pass.
 *
 * The *_step_out launchers (the pure step) read params, the state lists and model_copies and
 * write params_out, the *_out state lists and model_copies_out: new p, m, v (+ vmax, + copy),
 * the in-place launcher's numbers bit for bit (the same per-element code runs). model_copies and
 * model_copies_out are given together or not at all (model_copies supplies the values of a
 * skipped step). When *finite is 0 every output is a bit-for-bit copy of its input.
 *
 * The *_update launchers (the pure optax-style update) write `updates` (fp32 list):
 * updates = new_p - p, with new_p the in-place launcher's result (one fp32 subtraction, as
 * torch's sub), and the new state lists; there is no model copy. `params` may be NULL: the
 * params are then taken as zeros, so the update is the step term alone (weight decay then has
 * no effect). When *finite is 0 (finite may be NULL) the updates are +0 and the new state
 * lists copy the old ones.
 *
 * Inputs are only read; the outputs must not overlap the inputs or each other. `step` (device
 * fp32, t = *step + 1) is only read; step_out (may be NULL, then untouched) receives
 * *step + 1, or *step on a skipped step, after every kernel of the call has read *step. A
 * caller covering several dtype groups passes step_out on the last call only.
 * Cost: one read of every input element, one write of every output element; one launch per
 * argument block + one for step_out.
 * ------------------------------------------------------------------------------------------ */
int ampfunc_cuda_adam_step_out(int n, const void* const* grads, int grad_dtype, const void* const* params,
                               const void* const* exp_avgs, const void* const* exp_avg_sqs,
                               const void* const* max_exp_avg_sqs, const void* const* model_copies,
                               void* const* params_out, void* const* exp_avgs_out, void* const* exp_avg_sqs_out,
                               void* const* max_exp_avg_sqs_out, void* const* model_copies_out, int model_dtype,
                               const int64_t* numels, const float* grad_scale, const uint8_t* finite,
                               const float* lr_tensor, const float* step, float* step_out,
                               const AmpfuncAdamHyper* hyper, cudaStream_t stream);

int ampfunc_cuda_adam_update(int n, const void* const* grads, int grad_dtype, const void* const* params,
                             const void* const* exp_avgs, const void* const* exp_avg_sqs,
                             const void* const* max_exp_avg_sqs, void* const* updates, void* const* exp_avgs_out,
                             void* const* exp_avg_sqs_out, void* const* max_exp_avg_sqs_out, const int64_t* numels,
                             const float* grad_scale, const uint8_t* finite, const float* lr_tensor,
                             const float* step, float* step_out, const AmpfuncAdamHyper* hyper,
                             cudaStream_t stream);

/* momentum_bufs / momentum_bufs_out: required when momentum != 0 (then `step` too), ignored
 * otherwise. */
int ampfunc_cuda_sgd_step_out(int n, const void* const* grads, int grad_dtype, const void* const* params,
                              const void* const* momentum_bufs, const void* const* model_copies,
                              void* const* params_out, void* const* momentum_bufs_out, void* const* model_copies_out,
                              int model_dtype, const int64_t* numels, const float* grad_scale,
                              const uint8_t* finite, const float* lr_tensor, const float* step, float* step_out,
                              const AmpfuncSgdHyper* hyper, cudaStream_t stream);

int ampfunc_cuda_sgd_update(int n, const void* const* grads, int grad_dtype, const void* const* params,
                            const void* const* momentum_bufs, void* const* updates, void* const* momentum_bufs_out,
                            const int64_t* numels, const float* grad_scale, const uint8_t* finite,
                            const float* lr_tensor, const float* step, float* step_out,
                            const AmpfuncSgdHyper* hyper, cudaStream_t stream);

/* ------------------------------------------------------------------------------------------
 * Dynamic loss-scale update, one thread, same rule as ampfunc.ops._ref_update_scale:
 *   finite:  tracker+1 >= growth_interval ? (scale = grown if finite(grown) else scale,
 *            tracker = 0) : tracker += 1;  hysteresis_tracker = hysteresis
 *            where grown = min(fp32(scale * growth_factor), max_scale)  (product in double)
 *   else:    tracker = 0; if hysteresis_tracker <= 1: scale = max(fp32(scale*backoff_factor),
 *            min_scale); hysteresis_tracker = max(hysteresis_tracker - 1, 1)
 * scale: fp32, trackers: int32, finite: bool; all 0-d device tensors, updated in place.
 * ------------------------------------------------------------------------------------------ */
int ampfunc_cuda_update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                              const uint8_t* finite, double growth_factor, double backoff_factor,
                              int64_t growth_interval, double min_scale, double max_scale,
                              int64_t hysteresis, cudaStream_t stream);

/* ------------------------------------------------------------------------------------------
 * The generic optimizers (ext/optimizers.h): one launcher per optimizer, named
 * ampfunc_cuda_optim_<name>, all taking one AmpfuncOptimLaunch.
 *
 * lists: the pointer arrays of the launch (n leaves each), in the layout
 *   [0] grads (grad_dtype), [1] params in (fp32; NULL for an update without params),
 *   [2 .. 2+S) the state lists in (fp32; NULL for one the hyper-parameters leave unused),
 *   [2+S] model copies in (out of place only: the values of a skipped step; else NULL),
 *   [3+S] params out (fp32; the updates in delta mode), [4+S .. 4+2S) the state lists out,
 *   [4+2S] model copies out (model_dtype; NULL for none; never in delta mode)
 * with S the optimizer's number of state lists; in place, the out lists are the in lists.
 * dest: 0 in place (a skipped step writes nothing), 1 out of place (a skipped step copies
 * every input to its output), 2 delta (updates = new_p - p; a skipped step writes +0 updates
 * and copies the state). hyper: the hyper-parameters in schema order. step: device fp32, the
 * steps taken before this one (t = *step + 1); step_out (may be NULL) receives *step + 1, or
 * *step on a skipped step, after every kernel of the launch has read *step (in place, pass
 * step_out = step on the last call of a step).
 * Cost: one pass reading each input list once and writing each output list once.
 * ------------------------------------------------------------------------------------------ */
#define AMPFUNC_OPTIM_MAX_LISTS 16
#define AMPFUNC_OPTIM_MAX_HYPERS 8

typedef struct AmpfuncOptimLaunch {
  int dest;
  int n;
  const int64_t* numels;
  void* const* lists[AMPFUNC_OPTIM_MAX_LISTS];
  int grad_dtype;
  int model_dtype;
  const float* grad_scale; /* may be NULL: 1 */
  const uint8_t* finite;   /* may be NULL: taken */
  const float* lr_tensor;  /* may be NULL: lr */
  double lr;
  double hyper[AMPFUNC_OPTIM_MAX_HYPERS];
  const float* step;
  float* step_out;
} AmpfuncOptimLaunch;

/* ------------------------------------------------------------------------------------------
 * The low-memory Adam / AdamW step (ampfunc::adam_lowmem_step_), in place, over the layouts of
 * ampfunc.lowmem. Per leaf i (host arrays of n entries):
 *   grads[i]            grad_dtypes[i]: AMPFUNC_FP32, _FP16 or _BF16; read only.
 *   params[i]           param_dtypes[i]: AMPFUNC_BF16 (the high half of a split fp32 master,
 *                       remainders[i] its int16 low half: bits = (bits(hi) << 16) + lo) or
 *                       AMPFUNC_FP32 (its own master; remainders[i] ignored, may be NULL).
 *   exp_avgs[i], exp_avg_sqs[i]   moment_dtypes[i]: AMPFUNC_FP32, AMPFUNC_BF16 (rounded to
 *                       nearest even after the update) or AMPFUNC_Q8 (uint8 codes of the signed /
 *                       unsigned dynamic map, numels[i] a multiple of 256, exp_avg_absmax[i] and
 *                       exp_avg_sq_absmax[i] fp32 numels[i] / 256 each; NULL otherwise).
 *   qmaps, qbases       ampfunc.lowbits.q8_lookup()'s tables on the device: fp32 (1024,) maps
 *                       and midpoints, uint8 (2, 65552) bases; needed when a leaf is q8.
 * The fp32 numbers are ampfunc_cuda_adam_step's per-element code (amsgrad must be 0) on the
 * joined master and the decoded moments (q8: map[code] * absmax, 0 for a code of 0 where absmax
 * is inf); the moments are then re-encoded as ampfunc.lowbits.quantize_q8 does (absmax: the
 * block's largest magnitude, NaN if it holds one) and the master split again. grad_scale is
 * required; finite may be NULL (taken); when *finite is 0 nothing is written. step (device fp32,
 * t = *step + 1) is incremented once, on the device, when finite.
 * Cost: one pass reading g, p (+ remainder), m, v (+ absmax) and writing p, m, v; one launch per
 * (grad, param, moment) kind present and argument block, plus one for the step.
 * ------------------------------------------------------------------------------------------ */
int ampfunc_cuda_adam_lowmem_step(int n, const void* const* grads, const int* grad_dtypes, void* const* params,
                                  const int* param_dtypes, void* const* remainders, void* const* exp_avgs,
                                  void* const* exp_avg_absmax, void* const* exp_avg_sqs,
                                  void* const* exp_avg_sq_absmax, const int* moment_dtypes, const int64_t* numels,
                                  const float* qmaps, const uint8_t* qbases, const float* grad_scale,
                                  const uint8_t* finite, const float* lr_tensor, float* step,
                                  const AmpfuncAdamHyper* hyper, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* AMPFUNC_CUDA_H */
