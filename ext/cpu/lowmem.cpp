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
// The vector width follows the compiler's target, as in kernels.cpp.
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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
#include <tuple>
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
// `step`, derived from those (build_steps): per top-16-bit bucket, b | T << 8. `near` is `step`
// for the values a scaled block holds (|y| <= 1 + a few ulps, NaN aside), small enough to stay
// in the L1 cache: per sign, the rows of exponent fields near_row0..127, where row near_row0
// stands for every smaller exponent (build_near checks that their entries are all the same).
struct Maps {
  const float* qmap;
  const float* mid;
  const uint8_t* base;
  const int32_t* step;
  const int32_t* near = nullptr;
  int32_t near_row0 = 0;
};

constexpr int32_t kNearRows(int32_t row0) { return 128 - row0; }

// `near` from a map's step table: returns near_row0, the largest exponent field whose rows (and
// every row below, per sign) hold the same 128 entries as exponent 0's; fills out[] with the
// rows near_row0..127 of each sign (2 * kNearRows(row0) * 128 entries, at most 2 * 128 * 128).
int32_t build_near(const int32_t* step, int32_t* out) {
  auto same_as_zero = [&](int32_t e) {
    for (uint32_t sign = 0; sign < 2; ++sign)
      for (uint32_t m7 = 0; m7 < 128; ++m7)
        if (step[(sign << 15) | (uint32_t(e) << 7) | m7] != step[(sign << 15) | m7]) return false;
    return true;
  };
  int32_t row0 = 0;
  while (row0 < 127 && same_as_zero(row0 + 1)) ++row0;
  const int32_t rows = kNearRows(row0);
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (int32_t r = 0; r < rows; ++r)
      for (uint32_t m7 = 0; m7 < 128; ++m7)
        out[(int64_t(sign) * rows + r) * 128 + m7] = step[(sign << 15) | (uint32_t(row0 + r) << 7) | m7];
  return row0;
}

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

// x / absmax as quantize_q8 computes it, in place: x * (1 / d), d = (a > 0 ? a : 1), the
// reciprocal rounded once; x / d where the reciprocal overflows (d under 2**-128); with an
// infinite absmax an infinity keeps its sign's extreme (1 or -1; inf * 0 is NaN).
inline void normalize_block(float* x, float a, int64_t cnt) {
  using fVec = at::vec::Vectorized<float>;
  constexpr int64_t kVF = fVec::size();
  const float d = a > 0.f ? a : 1.f;
  const float r = 1.f / d;
  if (std::isinf(a)) {
    for (int64_t j = 0; j < cnt; ++j) x[j] = std::isinf(x[j]) ? std::copysign(1.f, x[j]) : x[j] * r;
  } else if (std::isinf(r)) {
    const fVec dx(d);
    for (int64_t j = 0; j < cnt; j += kVF) (fVec::loadu(x + j) / dx).store(x + j);
  } else {
    const fVec rx(r);
    for (int64_t j = 0; j < cnt; j += kVF) (fVec::loadu(x + j) * rx).store(x + j);
  }
}

// Adam's numbers in the fp32 CPU kernel's form (ext/cpu/kernels.cpp, adam_segment).
struct Hyper {
  float gs, wd, decay, lw, b2, c2, bc2, eps, nss;
  bool l2, decoupled, maximize, lerp_small;
};

// Adam/AdamW on one vector of lanes, the fp32 kernel's operations in its order: the new master
// from the gradient g (still unscaled), the master p and the moments m0, v0; mj, vj the new
// moments. The hyper-parameters are broadcast once per block.
struct AdamLanes {
  using Vec = at::vec::Vectorized<float>;
  const Hyper& c;
  Vec gs, wd, decay, lw, b2, c2, bc2, eps, nss;
  explicit AdamLanes(const Hyper& h)
      : c(h), gs(h.gs), wd(h.wd), decay(h.decay), lw(h.lw), b2(h.b2), c2(h.c2), bc2(h.bc2), eps(h.eps), nss(h.nss) {}
  Vec operator()(Vec g, Vec p, Vec m0, Vec v0, Vec& mj, Vec& vj) const {
    g = g * gs;
    if (c.maximize) g = g.neg();
    if (c.decoupled) p = p * decay;
    else if (c.l2) g = at::vec::fmadd(p, wd, g);
    mj = at::vec::fmadd(lw, g - m0, c.lerp_small ? m0 : g);
    vj = at::vec::fmadd(c2 * g, g, v0 * b2);
    const Vec d = vj.sqrt() / bc2 + eps;
    return p + (nss * mj) / d;
  }
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

#if defined(CPU_CAPABILITY_AVX512)
// ---- one register pass per block (AVX-512) ----
//
// The same numbers as run_block's passes (the same IEEE operations per element, in the same
// order), but each 16 elements are loaded, widened or decoded, updated, split and stored (or,
// for q8, folded into the new absmax) in registers, and a q8 block's second pass scales, encodes
// and packs 16 codes at a time: the separate passes through the block's buffers cost more than
// the arithmetic.

// 16 bf16 values widened to fp32 (exact).
inline __m512 from_bf16_16(const void* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <int GK>
inline __m512 load_grad16(const void* g, int64_t j) {
  if constexpr (GK == F32) {
    return _mm512_loadu_ps(static_cast<const float*>(g) + j);
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(g) + j;
    if constexpr (GK == BF16) return from_bf16_16(h);
    // fp16: exact, as at::Half -> float
    else return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  }
}

// map[code] * absmax for 16 codes (a finite or NaN absmax: decode_block's general case).
inline __m512 decode16(const uint8_t* codes, const float* qmap, __m512 absmax) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  return _mm512_mul_ps(_mm512_i32gather_ps(idx, qmap, 4), absmax);
}

// encode_block's codes of x[j] * r for a whole block (r the block's finite reciprocal), 16 at a
// time, packed to bytes with one down-conversion.
template <bool kPositiveFloor>
inline void encode_scaled_block(const float* x, float r, uint8_t* out, const Maps& mp) {
  const __m512 rv = _mm512_set1_ps(r);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF), low_byte = _mm512_set1_epi32(0xFF), one = _mm512_set1_epi32(1);
  const __m512i row0 = _mm512_set1_epi32(mp.near_row0), e127 = _mm512_set1_epi32(127),
                rows = _mm512_set1_epi32(kNearRows(mp.near_row0)), m7mask = _mm512_set1_epi32(0x7F);
  for (int64_t j = 0; j < kBlock; j += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + j), rv);
    const __m512i bits = _mm512_castps_si512(y);
    // The row of the near table: the exponent field clamped to [row0, 127] (NaN aside, |y| is at
    // most 1 + a few ulps; a NaN's entry is read and then overridden below), per sign.
    const __m512i expo = _mm512_and_si512(_mm512_srli_epi32(bits, 23), low_byte);
    const __m512i row = _mm512_sub_epi32(_mm512_min_epi32(_mm512_max_epi32(expo, row0), e127), row0);
    const __m512i idx = _mm512_add_epi32(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(bits, 31), rows), row), 7),
        _mm512_and_si512(_mm512_srli_epi32(bits, 16), m7mask));
    const __m512i e = _mm512_i32gather_epi32(idx, mp.near, 4);
    const __m512i flip = _mm512_and_si512(_mm512_srai_epi32(bits, 31), low16);
    const __m512i k = _mm512_xor_si512(_mm512_and_si512(bits, low16), flip);
    const __mmask16 below = _mm512_cmpgt_epi32_mask(_mm512_srli_epi32(e, 8), k);  // code b, else b + 1
    const __m512i b1 = _mm512_add_epi32(_mm512_and_si512(e, low_byte), one);
    __m512i code = _mm512_mask_sub_epi32(b1, below, b1, one);
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), low_byte);  // NaN: 255
    if constexpr (kPositiveFloor) {  // code 0 for a positive value: 1
      code = _mm512_mask_max_epu32(code, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ), code, one);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(code));
  }
}

// torch's float -> bfloat16 for 16 lanes (f_bf16_rne): round to nearest even, NaN quiet.
inline __m256i to_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// run_block<GK, PK, MK> on cnt elements, cnt a multiple of 16 (a q8 block: a whole block whose
// stored absmaxes are not infinite), 16 lanes at a time in registers: fp32 moments read and
// written in place, bf16 ones widened and rounded back, q8 ones decoded here and encoded after
// the block's new absmax is known.
template <int GK, int PK, int MK>
void run_fused_block(const Leaf& L, int64_t s, int64_t cnt, const Hyper& c, const Maps& ms, const Maps& mu) {
  using fVec = at::vec::Vectorized<float>;
  static_assert(fVec::size() == 16, "AVX-512 float vectors hold 16 lanes");
  alignas(64) float m[MK == U8 ? kBlock : 1], v[MK == U8 ? kBlock : 1];
  __m512 ma = _mm512_setzero_ps(), va = _mm512_setzero_ps();
  if constexpr (MK == U8) {
    ma = _mm512_set1_ps(L.ma[s / kBlock]);
    va = _mm512_set1_ps(L.va[s / kBlock]);
  }
  const AdamLanes adam(c);
  const __m512i nan_bits = _mm512_set1_epi32(0x7FC00000);
  fVec am(0.f), av(0.f);
  for (int64_t j = 0; j < cnt; j += 16) {
    const int64_t e = s + j;
    const fVec gj(load_grad16<GK>(L.g, e));
    fVec pj;
    if constexpr (PK == BF16) {
      const __m512i hi = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(L.p) + e)));
      const __m512i lo = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.lo + e)));
      pj = fVec(_mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 16), lo)));
    } else {
      pj = fVec::loadu(static_cast<const float*>(L.p) + e);
    }
    fVec m0, v0;
    if constexpr (MK == U8) {
      m0 = fVec(decode16(static_cast<const uint8_t*>(L.m) + e, ms.qmap, ma));
      v0 = fVec(decode16(static_cast<const uint8_t*>(L.v) + e, mu.qmap, va));
    } else if constexpr (MK == BF16) {
      m0 = fVec(from_bf16_16(static_cast<const uint16_t*>(L.m) + e));
      v0 = fVec(from_bf16_16(static_cast<const uint16_t*>(L.v) + e));
    } else {
      m0 = fVec::loadu(static_cast<const float*>(L.m) + e);
      v0 = fVec::loadu(static_cast<const float*>(L.v) + e);
    }
    fVec mj, vj;
    pj = adam(gj, pj, m0, v0, mj, vj);
    if constexpr (MK == U8) {
      mj.store(m + j);
      vj.store(v + j);
      am = at::vec::maximum(am, mj.abs());
      av = at::vec::maximum(av, vj.abs());
    } else if constexpr (MK == BF16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(L.m) + e), to_bf16_16(mj));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(L.v) + e), to_bf16_16(vj));
    } else {
      mj.store(static_cast<float*>(L.m) + e);
      vj.store(static_cast<float*>(L.v) + e);
    }
    if constexpr (PK == BF16) {  // split_bf16: hi + lo == the master, hi its round to nearest; NaN quiet
      const __m512 pv = pj;
      const __m512i u = _mm512_mask_mov_epi32(_mm512_castps_si512(pv), _mm512_cmp_ps_mask(pv, pv, _CMP_UNORD_Q),
                                              nan_bits);
      const __m512i l = _mm512_srai_epi32(_mm512_slli_epi32(u, 16), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(L.lo + e), _mm512_cvtepi32_epi16(l));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(L.p) + e),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_sub_epi32(u, l), 16)));
    } else {
      pj.store(static_cast<float*>(L.p) + e);
    }
  }
  if constexpr (MK == U8) {
    alignas(64) float ra[16], rb[16];
    am.store(ra);
    av.store(rb);
    float amax = ra[0], vmax = rb[0];
    for (int k = 1; k < 16; ++k) {  // NaN propagates, as torch's amax
      amax = (ra[k] > amax || ra[k] != ra[k]) ? ra[k] : amax;
      vmax = (rb[k] > vmax || rb[k] != rb[k]) ? rb[k] : vmax;
    }
    for (const auto& [x, a, out, unsigned_map] :
         {std::tuple<float*, float, uint8_t*, bool>{m, amax, static_cast<uint8_t*>(L.m) + s, false},
          std::tuple<float*, float, uint8_t*, bool>{v, vmax, static_cast<uint8_t*>(L.v) + s, true}}) {
      const float r = 1.f / (a > 0.f ? a : 1.f);
      const Maps& mp = unsigned_map ? mu : ms;
      if (std::isinf(a) || std::isinf(r)) {  // the rare blocks: normalize_block's special cases
        normalize_block(x, a, kBlock);
        if (unsigned_map) encode_block<true>(x, out, kBlock, mp); else encode_block<false>(x, out, kBlock, mp);
      } else if (unsigned_map) {
        encode_scaled_block<true>(x, r, out, mp);
      } else {
        encode_scaled_block<false>(x, r, out, mp);
      }
    }
    L.ma[s / kBlock] = amax;
    L.va[s / kBlock] = vmax;
  }
}
#endif

template <int GK, int PK, int MK>
void run_block(const Leaf& L, int64_t s, int64_t cnt, const Hyper& c, const Maps& ms, const Maps& mu) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (MK == U8) {
    if (!std::isinf(L.ma[s / kBlock]) && !std::isinf(L.va[s / kBlock]))
      return run_fused_block<GK, PK, MK>(L, s, cnt, c, ms, mu);
  } else {
    if (cnt % 16 == 0) return run_fused_block<GK, PK, MK>(L, s, cnt, c, ms, mu);
  }
#endif
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
  const AdamLanes adam(c);
  for (int64_t j = 0; j < cnt; j += kVF) {
    const int64_t lanes = std::min<int64_t>(kVF, cnt - j);
    const fVec m0 = MK == F32 ? fVec::loadu(mio + j, lanes) : fVec::loadu(mio + j);
    const fVec v0 = MK == F32 ? fVec::loadu(vio + j, lanes) : fVec::loadu(vio + j);
    fVec mj, vj;
    adam(fVec::loadu(g + j), fVec::loadu(p + j), m0, v0, mj, vj).store(p + j);
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
    normalize_block(m, amax, cnt);
    normalize_block(v, vmax, cnt);
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
  static std::vector<int32_t> near(2 * 2 * 128 * 128);
  static int32_t row0[2] = {0, 0};
  static std::vector<uint8_t> seen;
  const std::lock_guard<std::mutex> guard(lock);
  std::vector<uint8_t> now(reinterpret_cast<const uint8_t*>(ms.qmap),
                           reinterpret_cast<const uint8_t*>(ms.qmap) + kMapsNumel * 4);
  now.insert(now.end(), ms.base, ms.base + 2 * kBasesRow);
  if (now != seen) {
    build_steps(ms, steps.data());
    build_steps(mu, steps.data() + 65536);
    row0[0] = build_near(steps.data(), near.data());
    row0[1] = build_near(steps.data() + 65536, near.data() + 2 * 128 * 128);
    seen = std::move(now);
  }
  ms.step = steps.data();
  mu.step = steps.data() + 65536;
  ms.near = near.data();
  mu.near = near.data() + 2 * 128 * 128;
  ms.near_row0 = row0[0];
  mu.near_row0 = row0[1];
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
  // Tasks per parallel chunk: about kGrainElements elements' worth (kernels.cpp's grain), so a
  // call on small leaves stays on this thread instead of waking the pool for microseconds of work.
  constexpr int64_t kGrainElements = 1 << 15;
  int64_t total = 0;
  for (const Leaf& L : leaves) total += L.n;
  const int64_t n_tasks = int64_t(tasks.size());
  const int64_t grain = std::max<int64_t>(1, (n_tasks * kGrainElements + std::max<int64_t>(total, 1) - 1) /
                                                 std::max<int64_t>(total, 1));
  at::parallel_for(0, n_tasks, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const Leaf& L = leaves[tasks[t].first];
      const int64_t s = tasks[t].second;
      fns[tasks[t].first](L, s, std::min<int64_t>(kBlock, L.n - s), c, ms, mu);
    }
  });
  *step_ptr = next_step;
}

TORCH_LIBRARY_IMPL(ampfunc, CPU, m) { m.impl("adam_lowmem_step_", &adam_lowmem_step__cpu); }
