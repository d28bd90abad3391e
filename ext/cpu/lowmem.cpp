// The fused step of the low-memory settings on the CPU: ampfunc::adam_lowmem_step_ (schema in
// ampfunc/ops/_spec.py, LOWMEM_ADAM_STEP_; its list table in lowmem_spec.h, included by ext/glue/spec.h).
//
// One pass per block of 256 elements: rebuild the fp32 master (a bf16 param and its int16
// remainder, or an fp32 param), widen or dequantize the moments (fp32, bf16, or q8 codes with
// an fp32 absmax per block), run Adam/AdamW in fp32 with the operations of the fp32 kernel in
// its order, then re-quantize the moments and split the master again. The master and the
// moments are then bit for bit those of ampfunc.lowmem's plain-torch path: join, the fp32
// fused step, encode, split.
#pragma GCC optimize("fp-contract=off")
#pragma GCC optimize("no-math-errno")
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#endif
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "../optim_scalars.h"
#include "lowmem_checks.h"
#include "lowmem_spec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define AMPFUNC_LOWMEM_GATHER 1
#endif

namespace {

using at::Tensor;
using Tensors = std::vector<Tensor>;

constexpr int64_t kBlock = 256;
constexpr int64_t kMapsNumel = 1024;   // ampfunc.lowbits.q8_lookup: maps
constexpr int64_t kBasesRow = 65552;   // ... and bases, (2, kBasesRow)

enum Kind { F32 = 0, F16 = 1, BF16 = 2, U8 = 3 };

inline uint32_t fbits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float bitsf(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float bf16f(uint16_t h) { return bitsf(uint32_t(h) << 16); }
inline uint16_t f_bf16_rne(float x) {  // torch's float -> bfloat16: round to nearest even, NaN quiet
  const uint32_t u = fbits(x);
  if (x != x) return 0x7FC0;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// One dynamic map's tables (ampfunc.lowbits.q8_lookup): its 256 values, its 255 midpoints and a
// NaN, and for each top 16 bits of an fp32 pattern the code of the smallest value with them;
// `step`, derived from those (build_steps): per top-16-bit bucket, b | T << 8.
struct Maps {
  const float* qmap;
  const float* mid;
  const uint8_t* base;
  const int32_t* step;
};

inline uint8_t encode_one(float y, const Maps& mp) {
  if (y != y) return 255;
  const uint32_t b = mp.base[fbits(y) >> 16];
  return uint8_t(b + (y >= mp.mid[b] ? 1u : 0u));  // mid[255] is NaN: never
}

// The unsigned map's rule (ampfunc.lowbits.quantize_q8): a positive value never takes code 0.
inline uint8_t encode_positive(float y, const Maps& mp) {
  const uint8_t c = encode_one(y, mp);
  return c == 0 && y > 0.f ? uint8_t(1) : c;
}

// The step table of one map from its base and midpoints: for bucket t, the first k' at which
// the code is b + 1 (65536: never), k' the low 16 bits, reversed for a negative bucket so the
// value grows with k'. Buckets of infinities/NaN: only k = 0 (the infinity) is a number.
void build_steps(const Maps& mp, int32_t* out) {
  for (uint32_t t = 0; t < 65536; ++t) {
    const uint32_t b = mp.base[t];
    const bool neg = t & 0x8000u;
    auto up = [&](uint32_t kp) {
      const uint32_t k = neg ? 65535u - kp : kp;
      return encode_one(bitsf((t << 16) | k), mp) != b;
    };
    uint32_t T;
    if ((t & 0x7F80u) == 0x7F80u) {
      T = neg ? (up(65535) ? 65535u : 65536u) : (up(0) ? 0u : 1u);
    } else {
      uint32_t lo = 0, hi = 65536;  // first kp in [lo, hi) with up(kp)
      while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (up(mid)) hi = mid; else lo = mid + 1;
      }
      T = lo;
    }
    out[t] = int32_t(b | (T << 8));
  }
}

// qmap[code] * absmax for the n codes of one block. In a block whose absmax is inf (a second
// moment that overflowed) the code of 0 stays 0, not 0 * inf (ampfunc.lowbits.dequantize_q8).
inline void decode_block(const uint8_t* codes, float* out, int64_t n, const float* qmap, float absmax) {
  if (std::isinf(absmax)) {
    for (int64_t j = 0; j < n; ++j) out[j] = qmap[codes[j]] == 0.f ? 0.f : qmap[codes[j]] * absmax;
    return;
  }
#ifdef AMPFUNC_LOWMEM_GATHER
  const __m256 a = _mm256_set1_ps(absmax);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_i32gather_ps(qmap, idx, 4), a));
  }
  for (; j < n; ++j) out[j] = qmap[codes[j]] * absmax;
#else
  for (int64_t j = 0; j < n; ++j) out[j] = qmap[codes[j]] * absmax;
#endif
}

// The codes of n normalized values. Every top-16-bit bucket holds at most one midpoint, so a
// value's code is b or b + 1 and, within its bucket, b + 1 exactly from a threshold T on its low
// 16 bits (reversed for a negative value, whose magnitude grows with them): one table load (the
// step table) and one integer comparison, the same codes as encode_one.
template <bool kPositiveFloor>
inline void encode_block(const float* y, uint8_t* out, int64_t n, const Maps& mp) {
#ifdef AMPFUNC_LOWMEM_GATHER
  alignas(64) int32_t codes[kBlock];
  const __m256i low_byte = _mm256_set1_epi32(0xFF);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(y + j);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i e = _mm256_i32gather_epi32(mp.step, _mm256_srli_epi32(bits, 16), 4);
    const __m256i flip = _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(0xFFFF));
    const __m256i k = _mm256_xor_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF)), flip);
    const __m256i below = _mm256_cmpgt_epi32(_mm256_srli_epi32(e, 8), k);  // all ones: code b
    const __m256i b1 = _mm256_add_epi32(_mm256_and_si256(e, low_byte), _mm256_set1_epi32(1));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i code = _mm256_blendv_epi8(_mm256_add_epi32(b1, below), low_byte, nan);
    if constexpr (kPositiveFloor) {  // code 0 for a positive value: 1
      const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ));
      code = _mm256_max_epu32(code, _mm256_and_si256(positive, _mm256_set1_epi32(1)));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + j), code);
  }
  for (int64_t k = 0; k < j; ++k) out[k] = static_cast<uint8_t>(codes[k]);
  for (; j < n; ++j) out[j] = kPositiveFloor ? encode_positive(y[j], mp) : encode_one(y[j], mp);
#else
  for (int64_t j = 0; j < n; ++j) out[j] = kPositiveFloor ? encode_positive(y[j], mp) : encode_one(y[j], mp);
#endif
}

// Adam's numbers in the fp32 CPU kernel's form (ext/cpu/kernels.cpp, adam_segment).
struct Hyper {
  float gs, wd, decay, lw, b2, c2, bc2, eps, nss;
  bool l2, decoupled, maximize, lerp_small;
};

struct Leaf {
  int64_t n;
  const void* g;
  void* p;
  int16_t* lo;  // the remainder of a bf16 param; nullptr for an fp32 param
  void* m;
  float* ma;    // absmax per block of a q8 first moment
  void* v;
  float* va;
};

template <int GK, int PK, int MK>
void run_block(const Leaf& L, int64_t s, int64_t cnt, const Hyper& c, const Maps& ms, const Maps& mu) {
  alignas(64) float g[kBlock], p[kBlock], m[kBlock], v[kBlock];
  if constexpr (GK == F32) {
    std::memcpy(g, static_cast<const float*>(L.g) + s, cnt * 4);
  } else if constexpr (GK == BF16) {
    const uint16_t* src = static_cast<const uint16_t*>(L.g) + s;
    for (int64_t j = 0; j < cnt; ++j) g[j] = bf16f(src[j]);
  } else {
    const at::Half* src = static_cast<const at::Half*>(L.g) + s;
    for (int64_t j = 0; j < cnt; ++j) g[j] = static_cast<float>(src[j]);
  }
  if constexpr (PK == BF16) {
    const uint16_t* hi = static_cast<const uint16_t*>(L.p) + s;
    const int16_t* lo = L.lo + s;
    for (int64_t j = 0; j < cnt; ++j) p[j] = bitsf((uint32_t(hi[j]) << 16) + uint32_t(int32_t(lo[j])));
  } else {
    std::memcpy(p, static_cast<const float*>(L.p) + s, cnt * 4);
  }
  if constexpr (MK == U8) {
    decode_block(static_cast<const uint8_t*>(L.m) + s, m, cnt, ms.qmap, L.ma[s / kBlock]);
    decode_block(static_cast<const uint8_t*>(L.v) + s, v, cnt, mu.qmap, L.va[s / kBlock]);
  } else if constexpr (MK == BF16) {
    const uint16_t* sm = static_cast<const uint16_t*>(L.m) + s;
    const uint16_t* sv = static_cast<const uint16_t*>(L.v) + s;
    for (int64_t j = 0; j < cnt; ++j) m[j] = bf16f(sm[j]);
    for (int64_t j = 0; j < cnt; ++j) v[j] = bf16f(sv[j]);
  }
  // Adam, kVF lanes at a time; lanes past cnt compute on stale values and are never stored. fp32
  // moments are read and written in place (a copy through the block's buffers only adds passes).
  using fVec = at::vec::Vectorized<float>;
  constexpr int64_t kVF = fVec::size();
  float* const mio = MK == F32 ? static_cast<float*>(L.m) + s : m;
  float* const vio = MK == F32 ? static_cast<float*>(L.v) + s : v;
  const fVec gs(c.gs), wd(c.wd), decay(c.decay), lw(c.lw), b2(c.b2), c2(c.c2), bc2(c.bc2), eps(c.eps), nss(c.nss);
  for (int64_t j = 0; j < cnt; j += kVF) {
    const int64_t lanes = std::min<int64_t>(kVF, cnt - j);
    fVec gj = fVec::loadu(g + j) * gs, pj = fVec::loadu(p + j);
    const fVec m0 = MK == F32 ? fVec::loadu(mio + j, lanes) : fVec::loadu(mio + j);
    const fVec v0 = MK == F32 ? fVec::loadu(vio + j, lanes) : fVec::loadu(vio + j);
    if (c.maximize) gj = gj.neg();
    if (c.decoupled) pj = pj * decay;
    else if (c.l2) gj = at::vec::fmadd(pj, wd, gj);
    const fVec mj = at::vec::fmadd(lw, gj - m0, c.lerp_small ? m0 : gj);
    const fVec vj = at::vec::fmadd(c2 * gj, gj, v0 * b2);
    const fVec d = vj.sqrt() / bc2 + eps;
    (pj + (nss * mj) / d).store(p + j);
    if constexpr (MK == F32) {
      mj.store(mio + j, lanes);
      vj.store(vio + j, lanes);
    } else {
      mj.store(mio + j);
      vj.store(vio + j);
    }
  }
  if constexpr (MK == U8) {
    // The absmax of each block (a q8 leaf's blocks are whole); NaN propagates as torch's amax.
    fVec am(0.f), av(0.f);
    for (int64_t j = 0; j < cnt; j += kVF) {
      am = at::vec::maximum(am, fVec::loadu(m + j).abs());
      av = at::vec::maximum(av, fVec::loadu(v + j).abs());
    }
    alignas(64) float ra[kVF], rb[kVF];
    am.store(ra);
    av.store(rb);
    float amax = ra[0], vmax = rb[0];
    for (int64_t k = 1; k < kVF; ++k) {
      amax = (ra[k] > amax || ra[k] != ra[k]) ? ra[k] : amax;
      vmax = (rb[k] > vmax || rb[k] != rb[k]) ? rb[k] : vmax;
    }
    for (const auto& [x, a] : {std::pair<float*, float>{m, amax}, std::pair<float*, float>{v, vmax}}) {
      const float d = a > 0.f ? a : 1.f;
      if (std::isinf(a)) {
        // An infinity keeps its sign's extreme code (inf / inf is NaN), as quantize_q8.
        for (int64_t j = 0; j < cnt; ++j) x[j] = std::isinf(x[j]) ? std::copysign(1.f, x[j]) : x[j] / d;
      } else {
        const fVec dx(d);
        for (int64_t j = 0; j < cnt; j += kVF) (fVec::loadu(x + j) / dx).store(x + j);
      }
    }
    encode_block<false>(m, static_cast<uint8_t*>(L.m) + s, cnt, ms);
    encode_block<true>(v, static_cast<uint8_t*>(L.v) + s, cnt, mu);
    L.ma[s / kBlock] = amax;
    L.va[s / kBlock] = vmax;
  } else if constexpr (MK == BF16) {
    uint16_t* dm = static_cast<uint16_t*>(L.m) + s;
    uint16_t* dv = static_cast<uint16_t*>(L.v) + s;
    for (int64_t j = 0; j < cnt; ++j) dm[j] = f_bf16_rne(m[j]);
    for (int64_t j = 0; j < cnt; ++j) dv[j] = f_bf16_rne(v[j]);
  }
  if constexpr (PK == BF16) {
    // hi + lo == the master with hi its round to nearest (ampfunc.lowbits.split_bf16); NaN quiet
    uint16_t* hi = static_cast<uint16_t*>(L.p) + s;
    int16_t* lo = L.lo + s;
    for (int64_t j = 0; j < cnt; ++j) {
      uint32_t u = fbits(p[j]);
      u = p[j] != p[j] ? 0x7FC00000u : u;
      const int16_t l = int16_t(u & 0xFFFFu);
      lo[j] = l;
      hi[j] = uint16_t((u - uint32_t(int32_t(l))) >> 16);
    }
  } else {
    std::memcpy(static_cast<float*>(L.p) + s, p, cnt * 4);
  }
}

using BlockFn = void (*)(const Leaf&, int64_t, int64_t, const Hyper&, const Maps&, const Maps&);

template <int GK, int PK>
BlockFn pick_m(int mk) {
  switch (mk) {
    case F32: return run_block<GK, PK, F32>;
    case BF16: return run_block<GK, PK, BF16>;
    default: return run_block<GK, PK, U8>;
  }
}
template <int GK>
BlockFn pick_p(int pk, int mk) { return pk == BF16 ? pick_m<GK, BF16>(mk) : pick_m<GK, F32>(mk); }
BlockFn pick(int gk, int pk, int mk) {
  switch (gk) {
    case F32: return pick_p<F32>(pk, mk);
    case F16: return pick_p<F16>(pk, mk);
    default: return pick_p<BF16>(pk, mk);
  }
}

int kind_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kHalf: return F16;
    case at::kBFloat16: return BF16;
    default: return U8;
  }
}

// The step tables of the two maps, built on the first call and again only when the tables
// passed differ (they are q8_lookup()'s: one build per process). ~2M table probes per build.
void step_tables(Maps& ms, Maps& mu) {
  static std::mutex lock;
  static std::vector<int32_t> steps(2 * 65536);
  static std::vector<uint8_t> seen;
  const std::lock_guard<std::mutex> guard(lock);
  std::vector<uint8_t> now(reinterpret_cast<const uint8_t*>(ms.qmap),
                           reinterpret_cast<const uint8_t*>(ms.qmap) + kMapsNumel * 4);
  now.insert(now.end(), ms.base, ms.base + 2 * kBasesRow);
  if (now != seen) {
    build_steps(ms, steps.data());
    build_steps(mu, steps.data() + 65536);
    seen = std::move(now);
  }
  ms.step = steps.data();
  mu.step = steps.data() + 65536;
}

}  // namespace

// Adam / AdamW (decoupled_weight_decay) over split masters and bf16 / q8 / fp32 moments, in place.
// When `finite` is false nothing is written. Cost: one pass over params, remainders, grads and
// the moments; reads `finite`, `step`, `grad_scale` (and `lr_tensor`) on the host (CPU tensors).
void adam_lowmem_step__cpu(const Tensors& params, const Tensors& remainders, const Tensors& grads,
                           const Tensors& exp_avgs, const Tensors& exp_avg_absmax, const Tensors& exp_avg_sqs,
                           const Tensors& exp_avg_sq_absmax, const Tensor& step, const Tensor& grad_scale,
                           const Tensor& finite, const Tensor& qmaps, const Tensor& qbases, double lr,
                           const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                           double weight_decay, bool decoupled_weight_decay, bool maximize) {
  ampfunc::lowmem::check_args(params, remainders, grads, exp_avgs, exp_avg_absmax, exp_avg_sqs, exp_avg_sq_absmax,
                              step, grad_scale, finite, qmaps, qbases, lr_tensor, at::Device(at::kCPU));
  ampfunc::lowmem::check_hypers(lr, beta1, beta2, eps, weight_decay);
  if (lr_tensor.has_value() && lr_tensor->defined()) lr = static_cast<double>(lr_tensor->item<float>());
  if (!finite.item<bool>()) return;  // the skipped step: nothing is written
  float* step_ptr = step.data_ptr<float>();
  const float next_step = *step_ptr + 1.f;  // torch: step_t += 1 (fp32), then _get_value(step_t)
  // The fp32 kernel's numbers (ext/optim_scalars.h), so the update is its update bit for bit.
  const ampfunc::AdamScalars a = ampfunc::adam_scalars(grad_scale.item<float>(), lr, beta1, beta2, eps, weight_decay,
                                                       static_cast<double>(next_step), false, decoupled_weight_decay,
                                                       maximize);
  Hyper c;
  c.gs = a.grad_scale;
  c.wd = a.weight_decay;
  c.decay = a.decay;
  c.lerp_small = a.lerp_small;
  c.lw = a.lerp_small ? a.lerp_weight : a.lerp_weight - 1.f;
  c.b2 = a.beta2;
  c.c2 = a.one_minus_beta2;
  c.bc2 = a.bc2_sqrt;
  c.nss = a.neg_step_size;
  c.eps = a.eps;
  c.l2 = a.l2;
  c.decoupled = a.decoupled;
  c.maximize = a.maximize;
  const Tensor maps = qmaps.contiguous(), bases = qbases.contiguous();
  const float* mp = maps.data_ptr<float>();
  const uint8_t* bp = bases.data_ptr<uint8_t>();
  Maps ms{mp, mp + 256, bp, nullptr}, mu{mp + 512, mp + 768, bp + kBasesRow, nullptr};
  step_tables(ms, mu);
  std::vector<Leaf> leaves;
  std::vector<BlockFn> fns;
  std::vector<std::pair<int32_t, int64_t>> tasks;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool q8 = exp_avgs[i].scalar_type() == at::kByte;
    const bool split = params[i].scalar_type() == at::kBFloat16;
    Leaf L{params[i].numel(), grads[i].data_ptr(), params[i].data_ptr(),
           split ? remainders[i].data_ptr<int16_t>() : nullptr, exp_avgs[i].data_ptr(),
           q8 ? exp_avg_absmax[i].data_ptr<float>() : nullptr, exp_avg_sqs[i].data_ptr(),
           q8 ? exp_avg_sq_absmax[i].data_ptr<float>() : nullptr};
    leaves.push_back(L);
    fns.push_back(pick(kind_of(grads[i]), kind_of(params[i]), kind_of(exp_avgs[i])));
    for (int64_t s = 0; s < L.n; s += kBlock) tasks.emplace_back(int32_t(i), s);
  }
  at::parallel_for(0, int64_t(tasks.size()), 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const Leaf& L = leaves[tasks[t].first];
      const int64_t s = tasks[t].second;
      fns[tasks[t].first](L, s, std::min<int64_t>(kBlock, L.n - s), c, ms, mu);
    }
  });
  *step_ptr = next_step;
}

TORCH_LIBRARY_IMPL(ampfunc, CPU, m) { m.impl("adam_lowmem_step_", &adam_lowmem_step__cpu); }
