// The fused step of the low-memory settings on CUDA: ampfunc::adam_lowmem_step_ (schema in
// ampfunc/ops/_spec.py, LOWMEM_ADAM_STEP_; the CPU kernel is ext/cpu/lowmem.cpp).
//
// Per element, in registers: rebuild the fp32 master (a bf16 param and its int16 remainder, or
// an fp32 param), widen or dequantize the moments (fp32, bf16, or q8 codes with an fp32 absmax
// per block of 256), take the fp32 CUDA kernel's Adam/AdamW step (adam_element.cuh, the code of
// optim.cu: so the master and the moments are those of ampfunc.lowmem's plain road on CUDA --
// join, the fp32 fused step, encode, split -- bit for bit), then re-quantize the moments (a q8
// block's absmax is a block reduction) and split the master again.
//
// Layout: the leaves are grouped by (grad dtype, param dtype, moment layout), one kernel
// instantiation each, and packed multi-tensor-apply style (mta.cuh, chunks of 64K elements);
// each chunk is cut into kSplits spans of kSpan elements, one thread block of 256 threads per
// span, one thread per element of a q8 block of 256 at a time. A q8 leaf is a whole number of
// blocks and chunks start at multiples of 64K, so every q8 block lies in one thread block.
//
// Nothing is read back to the host: the skip (`finite`), the step count, the gradient scale and
// the lr tensor are read by the kernels, and the step counter is incremented on the device, once,
// by a last one-thread kernel (only when finite).
#include <math.h>

#include <vector>

#include "mta.cuh"
#include "adam_element.cuh"
#include "../optim_scalars.h"

namespace ampfunc {
namespace cuda {
namespace {

constexpr int kQBlock = 256;              // elements per q8 block, and threads per thread block
constexpr int kSpan = 16 * kQBlock;       // elements per thread block
constexpr int kSplits = kChunk / kSpan;   // thread blocks per multi-tensor-apply chunk
static_assert(kChunk % kSpan == 0, "a chunk must be a whole number of spans");
constexpr int kMapsNumel = 1024;          // ampfunc.lowbits.q8_lookup: maps
constexpr int kBasesRow = 65552;          // ... and bases, (2, kBasesRow)

// The launch's lists (each leaf: one pointer per list; null where a leaf's layout lacks it).
constexpr int kDepth = 7;
constexpr int kG = 0, kP = 1, kLo = 2, kM = 3, kMa = 4, kV = 5, kVa = 6;

struct LowmemArgs {
  const float* grad_scale;
  const uint8_t* finite;   // may be null: taken
  const float* lr_tensor;  // may be null: lr
  const float* step;       // the steps taken before this one
  const float* qmaps;      // (1024,): signed map, its midpoints + NaN, unsigned map, its midpoints + NaN
  const uint8_t* qbases;   // (2, 65552): per top 16 bits of an fp32 pattern, the code of its lowest value
  double lr, beta1, beta2, eps, weight_decay;
  int adamw, maximize;
};

static_assert(fits_kernel_params<kDepth, LowmemArgs>(), "low-memory step arguments too large");

__device__ __forceinline__ float bits_f(uint32_t u) { return __int_as_float(static_cast<int>(u)); }
__device__ __forceinline__ bool is_nan(float x) { return x != x; }
__device__ __forceinline__ bool is_inf(float x) { return (__float_as_uint(x) & 0x7fffffffu) == 0x7f800000u; }

// torch's float -> bfloat16: round to nearest even, a NaN the quiet 0x7FC0 (lowmem.cpp's f_bf16_rne).
__device__ __forceinline__ uint16_t f_bf16_rne(float x) {
  if (is_nan(x)) return 0x7FC0;
  const uint32_t u = __float_as_uint(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_f(uint16_t h) { return bits_f(static_cast<uint32_t>(h) << 16); }

template <int GK>
__device__ __forceinline__ float load_grad(const void* g, int64_t j) {
  if constexpr (GK == AMPFUNC_FP32) return static_cast<const float*>(g)[j];
  else if constexpr (GK == AMPFUNC_BF16) return bf16_f(static_cast<const uint16_t*>(g)[j]);
  else return to_float(static_cast<const __half*>(g)[j]);
}

// map[code] * absmax; in a block whose absmax is inf the code of 0 stays 0, not 0 * inf
// (ampfunc.lowbits.dequantize_q8); a NaN absmax makes every element NaN.
__device__ __forceinline__ float decode_q8(uint8_t code, const float* map, float absmax) {
  const float q = map[code];
  return (is_inf(absmax) && q == 0.f) ? 0.f : __fmul_rn(q, absmax);
}

// quantize_q8's code of x in a block of absmax a: an infinity its sign's extreme (sign(x)), else
// x * (1 / d) with d = (a > 0 ? a : 1), the reciprocal rounded once (x / d where it overflows,
// d under 2**-128); then the nearest code, a value on a midpoint taking the larger one, NaN 255:
// the bucket's code b (one table load) and one comparison with the next midpoint (mid[255] is NaN).
// With the unsigned map (kPositiveFloor: second moments) a positive y never takes code 0 but 1.
template <bool kPositiveFloor>
__device__ __forceinline__ uint8_t encode_q8(float x, float a, const float* mid, const uint8_t* bases) {
  const float d = a > 0.f ? a : 1.f;
  const float r = __frcp_rn(d);
  const float y = is_inf(x) ? bits_f((__float_as_uint(x) & 0x80000000u) | 0x3f800000u)
                            : (is_inf(r) ? __fdiv_rn(x, d) : __fmul_rn(x, r));
  if (is_nan(y)) return 255;
  const uint32_t b = bases[__float_as_uint(y) >> 16];
  const uint32_t code = b + (y >= mid[b] ? 1u : 0u);
  return static_cast<uint8_t>(kPositiveFloor && code == 0u && y > 0.f ? 1u : code);
}

// torch.amax's max: NaN wins.
__device__ __forceinline__ float max_nan(float a, float b) { return (a > b || is_nan(a)) ? a : b; }

// The absmax of two values over the thread block (every thread gets both), in a fixed order.
__device__ __forceinline__ void block_absmax(float& a, float& b, float (*red)[kQBlock / 32]) {
  for (int off = 16; off > 0; off >>= 1) {
    a = max_nan(a, __shfl_down_sync(0xffffffffu, a, off));
    b = max_nan(b, __shfl_down_sync(0xffffffffu, b, off));
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    red[0][warp] = a;
    red[1][warp] = b;
  }
  __syncthreads();
  a = red[0][0];
  b = red[1][0];
  for (int w = 1; w < kQBlock / 32; ++w) {
    a = max_nan(a, red[0][w]);
    b = max_nan(b, red[1][w]);
  }
  __syncthreads();  // `red` is written again for the next block
}

// GK: the grads' dtype code; PK: the params' (AMPFUNC_BF16: split with a remainder, or FP32);
// MK: the moments' layout (AMPFUNC_FP32, AMPFUNC_BF16 or AMPFUNC_Q8).
template <int GK, int PK, int MK>
__global__ void __launch_bounds__(kQBlock)
lowmem_kernel(const __grid_constant__ TensorListMeta<kDepth> meta, const LowmemArgs args) {
  if (args.finite != nullptr && *args.finite == 0) return;  // the skipped step: nothing is written
  const int mb = blockIdx.x / kSplits;
  const int slot = meta.block_tensor[mb];
  const int64_t chunk0 = static_cast<int64_t>(meta.block_chunk[mb]) * kChunk;
  const int64_t left = meta.numel[slot] - chunk0;
  const int len = static_cast<int>(left < kChunk ? left : kChunk);
  const int lo = static_cast<int>(blockIdx.x % kSplits) * kSpan;
  if (lo >= len) return;  // the chunk ends before this span (a short leaf)
  const int hi = len < lo + kSpan ? len : lo + kSpan;

  __shared__ AdamScalars shared_scalars;
  __shared__ float tables[MK == AMPFUNC_Q8 ? kMapsNumel : 1];
  __shared__ float red[2][kQBlock / 32];
  if (threadIdx.x == 0) {
    const double lr = args.lr_tensor ? static_cast<double>(*args.lr_tensor) : args.lr;
    // t = step + 1 in fp32 (torch's `step_t += 1`), the bias corrections in double from it
    shared_scalars = ampfunc::adam_scalars(*args.grad_scale, lr, args.beta1, args.beta2, args.eps, args.weight_decay,
                                           static_cast<double>(*args.step + 1.0f), false, args.adamw != 0,
                                           args.maximize != 0);
  }
  if constexpr (MK == AMPFUNC_Q8) {
    for (int k = threadIdx.x; k < kMapsNumel; k += kQBlock) tables[k] = args.qmaps[k];
  }
  __syncthreads();
  const AdamScalars s = shared_scalars;
  const bool has_wd = args.weight_decay != 0.0;
  const bool adamw = args.adamw != 0;
  const int maximize = args.maximize;

  const void* gp = meta.ptr[kG][slot];
  void* pp = meta.ptr[kP][slot];
  int16_t* lop = static_cast<int16_t*>(meta.ptr[kLo][slot]);
  void* mp = meta.ptr[kM][slot];
  void* vp = meta.ptr[kV][slot];
  float* map_ = static_cast<float*>(meta.ptr[kMa][slot]);
  float* vap = static_cast<float*>(meta.ptr[kVa][slot]);

  for (int base = lo; base < hi; base += kQBlock) {  // the same trip count for every thread
    const int64_t j = chunk0 + base + threadIdx.x;
    const bool on = base + static_cast<int>(threadIdx.x) < hi;
    float g = 0.f, p = 0.f, m = 0.f, v = 0.f, unused = 0.f;
    float am = 0.f, av = 0.f;  // the q8 block's absmax (decode), then the new one
    if constexpr (MK == AMPFUNC_Q8) {
      am = map_[(chunk0 + base) / kQBlock];
      av = vap[(chunk0 + base) / kQBlock];
    }
    if (on) {
      g = load_grad<GK>(gp, j);
      if constexpr (PK == AMPFUNC_BF16) {
        p = bits_f((static_cast<uint32_t>(static_cast<const uint16_t*>(pp)[j]) << 16) +
                   static_cast<uint32_t>(static_cast<int32_t>(lop[j])));
      } else {
        p = static_cast<const float*>(pp)[j];
      }
      if constexpr (MK == AMPFUNC_Q8) {
        m = decode_q8(static_cast<const uint8_t*>(mp)[j], tables, am);
        v = decode_q8(static_cast<const uint8_t*>(vp)[j], tables + 512, av);
      } else if constexpr (MK == AMPFUNC_BF16) {
        m = bf16_f(static_cast<const uint16_t*>(mp)[j]);
        v = bf16_f(static_cast<const uint16_t*>(vp)[j]);
      } else {
        m = static_cast<const float*>(mp)[j];
        v = static_cast<const float*>(vp)[j];
      }
    }
    if (adamw) adam_element<true, false>(g, p, m, v, unused, maximize, has_wd, s);
    else adam_element<false, false>(g, p, m, v, unused, maximize, has_wd, s);
    if constexpr (MK == AMPFUNC_Q8) {
      // the new absmax of the block (q8 leaves are whole blocks: every thread is `on`)
      am = fabsf(m);
      av = fabsf(v);
      block_absmax(am, av, red);
      if (on) {
        static_cast<uint8_t*>(mp)[j] = encode_q8<false>(m, am, tables + 256, args.qbases);
        static_cast<uint8_t*>(vp)[j] = encode_q8<true>(v, av, tables + 768, args.qbases + kBasesRow);
      }
      if (threadIdx.x == 0) {
        map_[(chunk0 + base) / kQBlock] = am;
        vap[(chunk0 + base) / kQBlock] = av;
      }
    } else if (on) {
      if constexpr (MK == AMPFUNC_BF16) {
        static_cast<uint16_t*>(mp)[j] = f_bf16_rne(m);
        static_cast<uint16_t*>(vp)[j] = f_bf16_rne(v);
      } else {
        static_cast<float*>(mp)[j] = m;
        static_cast<float*>(vp)[j] = v;
      }
    }
    if (on) {
      if constexpr (PK == AMPFUNC_BF16) {
        // hi + lo == the master, hi its round to nearest (ampfunc.lowbits.split_bf16); NaN quiet
        const uint32_t u = is_nan(p) ? 0x7FC00000u : __float_as_uint(p);
        const int16_t l = static_cast<int16_t>(u & 0xFFFFu);
        lop[j] = l;
        static_cast<uint16_t*>(pp)[j] = static_cast<uint16_t>((u - static_cast<uint32_t>(static_cast<int32_t>(l))) >> 16);
      } else {
        static_cast<float*>(pp)[j] = p;
      }
    }
  }
}

// After every update kernel has read *step (stream order): one increment, when finite.
__global__ void lowmem_finish_step(float* step, const uint8_t* finite) {
  if (finite == nullptr || *finite != 0) *step += 1.0f;
}

template <int GK, int PK, int MK>
cudaError_t run_group(int n, const int64_t* numels, void* const* const* lists, const LowmemArgs& args,
                      cudaStream_t stream) {
  return multi_tensor_apply<kDepth>(n, numels, lists, [&](const TensorListMeta<kDepth>& meta, int nb) {
    lowmem_kernel<GK, PK, MK><<<nb * kSplits, kQBlock, 0, stream>>>(meta, args);
    return cudaGetLastError();
  });
}

template <int GK, int PK>
cudaError_t run_moments(int mk, int n, const int64_t* numels, void* const* const* lists, const LowmemArgs& args,
                        cudaStream_t stream) {
  switch (mk) {
    case AMPFUNC_FP32: return run_group<GK, PK, AMPFUNC_FP32>(n, numels, lists, args, stream);
    case AMPFUNC_BF16: return run_group<GK, PK, AMPFUNC_BF16>(n, numels, lists, args, stream);
    default: return run_group<GK, PK, AMPFUNC_Q8>(n, numels, lists, args, stream);
  }
}

template <int GK>
cudaError_t run_params(int pk, int mk, int n, const int64_t* numels, void* const* const* lists,
                       const LowmemArgs& args, cudaStream_t stream) {
  return pk == AMPFUNC_BF16 ? run_moments<GK, AMPFUNC_BF16>(mk, n, numels, lists, args, stream)
                            : run_moments<GK, AMPFUNC_FP32>(mk, n, numels, lists, args, stream);
}

cudaError_t run_kinds(int gk, int pk, int mk, int n, const int64_t* numels, void* const* const* lists,
                      const LowmemArgs& args, cudaStream_t stream) {
  switch (gk) {
    case AMPFUNC_FP32: return run_params<AMPFUNC_FP32>(pk, mk, n, numels, lists, args, stream);
    case AMPFUNC_FP16: return run_params<AMPFUNC_FP16>(pk, mk, n, numels, lists, args, stream);
    default: return run_params<AMPFUNC_BF16>(pk, mk, n, numels, lists, args, stream);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace ampfunc

using namespace ampfunc::cuda;

extern "C" int ampfunc_cuda_adam_lowmem_step(int n, const void* const* grads, const int* grad_dtypes,
                                             void* const* params, const int* param_dtypes, void* const* remainders,
                                             void* const* exp_avgs, void* const* exp_avg_absmax,
                                             void* const* exp_avg_sqs, void* const* exp_avg_sq_absmax,
                                             const int* moment_dtypes, const int64_t* numels, const float* qmaps,
                                             const uint8_t* qbases, const float* grad_scale, const uint8_t* finite,
                                             const float* lr_tensor, float* step, const AmpfuncAdamHyper* hyper,
                                             cudaStream_t stream) {
  if (hyper == nullptr || hyper->amsgrad || step == nullptr || grad_scale == nullptr || n < 0)
    return cudaErrorInvalidValue;
  if (n > 0 && (grads == nullptr || grad_dtypes == nullptr || params == nullptr || param_dtypes == nullptr ||
                remainders == nullptr || exp_avgs == nullptr || exp_avg_absmax == nullptr || exp_avg_sqs == nullptr ||
                exp_avg_sq_absmax == nullptr || moment_dtypes == nullptr || numels == nullptr))
    return cudaErrorInvalidValue;
  // The leaves of each (grad, param, moments) kind, in call order: 3 x 2 x 3 kinds.
  constexpr int kKinds = 18;
  std::vector<int> kind_of(n > 0 ? n : 1, -1);
  int count[kKinds] = {0};
  for (int i = 0; i < n; ++i) {
    const int gk = grad_dtypes[i], pk = param_dtypes[i], mk = moment_dtypes[i];
    if (!valid_dtype(gk) || (pk != AMPFUNC_FP32 && pk != AMPFUNC_BF16) ||
        (mk != AMPFUNC_FP32 && mk != AMPFUNC_BF16 && mk != AMPFUNC_Q8) || numels[i] < 0)
      return cudaErrorInvalidValue;
    if (numels[i] == 0) continue;
    if (grads[i] == nullptr || params[i] == nullptr || exp_avgs[i] == nullptr || exp_avg_sqs[i] == nullptr ||
        (pk == AMPFUNC_BF16 && remainders[i] == nullptr))
      return cudaErrorInvalidValue;
    if (mk == AMPFUNC_Q8 && (numels[i] % kQBlock != 0 || exp_avg_absmax[i] == nullptr ||
                             exp_avg_sq_absmax[i] == nullptr || qmaps == nullptr || qbases == nullptr))
      return cudaErrorInvalidValue;
    kind_of[i] = (gk * 2 + (pk == AMPFUNC_BF16 ? 1 : 0)) * 3 + (mk == AMPFUNC_FP32 ? 0 : mk == AMPFUNC_BF16 ? 1 : 2);
    ++count[kind_of[i]];
  }
  LowmemArgs args;
  args.grad_scale = grad_scale;
  args.finite = finite;
  args.lr_tensor = lr_tensor;
  args.step = step;
  args.qmaps = qmaps;
  args.qbases = qbases;
  args.lr = hyper->lr;
  args.beta1 = hyper->beta1;
  args.beta2 = hyper->beta2;
  args.eps = hyper->eps;
  args.weight_decay = hyper->weight_decay;
  args.adamw = hyper->adamw != 0;
  args.maximize = hyper->maximize != 0;
  static const int kMk[3] = {AMPFUNC_FP32, AMPFUNC_BF16, AMPFUNC_Q8};
  for (int k = 0; k < kKinds; ++k) {
    if (count[k] == 0) continue;
    std::vector<void*> ptrs[kDepth];
    std::vector<int64_t> ns;
    for (int i = 0; i < n; ++i) {
      if (kind_of[i] != k) continue;
      const bool q8 = k % 3 == 2, split = (k / 3) % 2 == 1;
      ptrs[kG].push_back(const_cast<void*>(grads[i]));
      ptrs[kP].push_back(params[i]);
      ptrs[kLo].push_back(split ? remainders[i] : nullptr);
      ptrs[kM].push_back(exp_avgs[i]);
      ptrs[kMa].push_back(q8 ? exp_avg_absmax[i] : nullptr);
      ptrs[kV].push_back(exp_avg_sqs[i]);
      ptrs[kVa].push_back(q8 ? exp_avg_sq_absmax[i] : nullptr);
      ns.push_back(numels[i]);
    }
    void* const* lists[kDepth];
    for (int d = 0; d < kDepth; ++d) lists[d] = ptrs[d].data();
    const cudaError_t err = run_kinds(k / 6, (k / 3) % 2 ? AMPFUNC_BF16 : AMPFUNC_FP32, kMk[k % 3],
                                      static_cast<int>(ns.size()), ns.data(), lists, args, stream);
    if (err != cudaSuccess) return err;
  }
  lowmem_finish_step<<<1, 1, 0, stream>>>(step, finite);
  return cudaGetLastError();
}
