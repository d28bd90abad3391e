#pragma GCC optimize("fp-contract=off")
#pragma GCC optimize("no-math-errno")
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#endif
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>
#include <cstring>
#include <immintrin.h>

namespace {
constexpr int kBlock = 256;
enum Kind { F32 = 0, F16 = 1, BF16 = 2, U8 = 3 };

inline int kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kHalf: return F16;
    case at::kBFloat16: return BF16;
    case at::kByte: return U8;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

inline uint32_t fbits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float bitsf(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float bf16f(uint16_t h) { return bitsf(uint32_t(h) << 16); }
inline uint16_t f_bf16_rne(float x) {  // torch's round to nearest even
  uint32_t u = fbits(x);
  if (x != x) return 0x7FC0;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Maps {
  const float* qmap;    // 256 values
  const float* mid;     // 256: 255 midpoints and +inf
  const uint8_t* base;  // 65536: code of the smallest value of each top-16-bit bucket
};

inline uint8_t encode(float y, const Maps& mp) {
  if (y != y) return 255;
  const uint32_t b = mp.base[fbits(y) >> 16];
  return uint8_t(b + (y >= mp.mid[b] ? 1u : 0u));  // mid[255] is NaN: never
}

// map[code] * absmax for n codes (n a multiple of 8 on the vector path).
inline void decode_block(const uint8_t* codes, float* out, int64_t n, const float* qmap, float absmax) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  const __m256 a = _mm256_set1_ps(absmax);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_i32gather_ps(qmap, idx, 4), a));
  }
#else
  for (int64_t j = 0; j < n; ++j) out[j] = qmap[codes[j]] * absmax;
#endif
}

// Codes of n normalized values (n a multiple of 8 on the vector path).
inline void encode_block(const float* y, uint8_t* out, int64_t n, const Maps& mp) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  alignas(64) int32_t codes[kBlock];
  const __m256i low_byte = _mm256_set1_epi32(0xFF);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 v = _mm256_loadu_ps(y + j);
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    // 4 bytes read at each byte index (the table is padded), the low one kept
    const __m256i b = _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(mp.base), top, 1), low_byte);
    const __m256 mid = _mm256_i32gather_ps(mp.mid, b, 4);
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(v, mid, _CMP_GE_OQ));  // all ones: +1
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i code = _mm256_blendv_epi8(_mm256_sub_epi32(b, up), low_byte, nan);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + j), code);
  }
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<uint8_t>(codes[j]);
#else
  for (int64_t j = 0; j < n; ++j) out[j] = encode(y[j], mp);
#endif
}

struct Hyper {
  float gs, wd, decay, w1, lw, b2, c2, bc2, eps, nss;
  bool l2, decoupled, maximize, lerp_small;
};

struct Leaf {
  int64_t n;
  const void* g; int gk;
  void* p; int pk; int16_t* lo;
  void* m; int mk; float* ma;
  void* v; int vk; float* va;
};

template <typename T> inline float ld(const void* p, int64_t i) { return static_cast<float>(static_cast<const T*>(p)[i]); }

inline float load_any(const void* p, int k, int64_t i) {
  switch (k) {
    case F32: return static_cast<const float*>(p)[i];
    case F16: return static_cast<float>(static_cast<const at::Half*>(p)[i]);
    default: return bf16f(static_cast<const uint16_t*>(p)[i]);
  }
}

template <int GK, int PK, int MK>
void run_block(const Leaf& L, int64_t s, int64_t cnt, const Hyper& c, const Maps& ms, const Maps& mu) {
  alignas(64) float g[kBlock], p[kBlock], m[kBlock], v[kBlock];
  // load
  for (int64_t j = 0; j < cnt; ++j) {
    if constexpr (GK == F32) g[j] = static_cast<const float*>(L.g)[s + j];
    else if constexpr (GK == BF16) g[j] = bf16f(static_cast<const uint16_t*>(L.g)[s + j]);
    else g[j] = static_cast<float>(static_cast<const at::Half*>(L.g)[s + j]);
  }
  if constexpr (PK == BF16) {
    const uint16_t* hi = static_cast<const uint16_t*>(L.p) + s;
    const int16_t* lo = L.lo + s;
    for (int64_t j = 0; j < cnt; ++j) p[j] = bitsf((uint32_t(hi[j]) << 16) + uint32_t(int32_t(lo[j])));
  } else {
    std::memcpy(p, static_cast<const float*>(L.p) + s, cnt * 4);
  }
  if constexpr (MK == U8) {
    const uint8_t* mc = static_cast<const uint8_t*>(L.m) + s;
    const uint8_t* vc = static_cast<const uint8_t*>(L.v) + s;
    const float am = L.ma[s / kBlock], av = L.va[s / kBlock];
    decode_block(mc, m, cnt, ms.qmap, am);
    decode_block(vc, v, cnt, mu.qmap, av);
  } else if constexpr (MK == BF16) {
    for (int64_t j = 0; j < cnt; ++j) {
      m[j] = bf16f(static_cast<const uint16_t*>(L.m)[s + j]);
      v[j] = bf16f(static_cast<const uint16_t*>(L.v)[s + j]);
    }
  } else {
    std::memcpy(m, static_cast<const float*>(L.m) + s, cnt * 4);
    std::memcpy(v, static_cast<const float*>(L.v) + s, cnt * 4);
  }
  // Adam, the operations of the fp32 kernel in its order, kVF lanes at a time (the tail lanes
  // compute on stale values and are never stored).
  using fVec = at::vec::Vectorized<float>;
  constexpr int64_t kVF = fVec::size();
  const fVec gs(c.gs), wd(c.wd), decay(c.decay), lw(c.lw), b2(c.b2), c2(c.c2), bc2(c.bc2), eps(c.eps), nss(c.nss);
  for (int64_t j = 0; j < cnt; j += kVF) {
    fVec gj = fVec::loadu(g + j) * gs, pj = fVec::loadu(p + j), m0 = fVec::loadu(m + j), v0 = fVec::loadu(v + j);
    if (c.maximize) gj = gj.neg();
    if (c.decoupled) pj = pj * decay;
    else if (c.l2) gj = at::vec::fmadd(pj, wd, gj);
    const fVec mj = at::vec::fmadd(lw, gj - m0, c.lerp_small ? m0 : gj);
    const fVec vj = at::vec::fmadd(c2 * gj, gj, v0 * b2);
    const fVec d = vj.sqrt() / bc2 + eps;
    (pj + (nss * mj) / d).store(p + j);
    mj.store(m + j);
    vj.store(v + j);
  }
  // store moments
  if constexpr (MK == U8) {
    // absmax per block; at::vec::maximum propagates NaN as torch's amax does. A q8 leaf's
    // blocks are whole (its size is a multiple of the block).
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
    const fVec dm(amax > 0.f ? amax : 1.f), dv(vmax > 0.f ? vmax : 1.f);
    for (int64_t j = 0; j < cnt; j += kVF) {
      (fVec::loadu(m + j) / dm).store(m + j);
      (fVec::loadu(v + j) / dv).store(v + j);
    }
    uint8_t* mc = static_cast<uint8_t*>(L.m) + s;
    uint8_t* vc = static_cast<uint8_t*>(L.v) + s;
    encode_block(m, mc, cnt, ms);
    encode_block(v, vc, cnt, mu);
    L.ma[s / kBlock] = amax;
    L.va[s / kBlock] = vmax;
  } else if constexpr (MK == BF16) {
    for (int64_t j = 0; j < cnt; ++j) {
      static_cast<uint16_t*>(L.m)[s + j] = f_bf16_rne(m[j]);
      static_cast<uint16_t*>(L.v)[s + j] = f_bf16_rne(v[j]);
    }
  } else {
    std::memcpy(static_cast<float*>(L.m) + s, m, cnt * 4);
    std::memcpy(static_cast<float*>(L.v) + s, v, cnt * 4);
  }
  // store the master
  if constexpr (PK == BF16) {
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
}  // namespace

void adam_lowmem_step_(std::vector<at::Tensor> params, std::vector<at::Tensor> rem, std::vector<at::Tensor> grads,
                       std::vector<at::Tensor> m, std::vector<at::Tensor> ma, std::vector<at::Tensor> v,
                       std::vector<at::Tensor> va, at::Tensor maps, at::Tensor bases, double lr, double beta1,
                       double beta2, double eps, double weight_decay, bool decoupled, bool maximize, double step,
                       double grad_scale) {
  Hyper c;
  c.gs = float(grad_scale);
  c.wd = float(weight_decay);
  c.decay = float(1.0 - lr * weight_decay);
  c.w1 = float(1.0 - beta1);
  c.lerp_small = std::abs(c.w1) < 0.5f;
  c.lw = c.lerp_small ? c.w1 : c.w1 - 1.f;
  c.b2 = float(beta2);
  c.c2 = float(1.0 - beta2);
  const double bc1 = 1.0 - std::pow(beta1, step), bc2 = 1.0 - std::pow(beta2, step);
  c.bc2 = float(std::pow(bc2, 0.5));
  c.nss = float(-(lr / bc1));
  c.eps = float(eps);
  c.l2 = weight_decay != 0.0 && !decoupled;
  c.decoupled = weight_decay != 0.0 && decoupled;
  c.maximize = maximize;
  const float* mp = maps.data_ptr<float>();
  const uint8_t* bp = bases.data_ptr<uint8_t>();
  const int64_t row = bases.size(1);
  const Maps ms{mp, mp + 256, bp}, mu{mp + 512, mp + 768, bp + row};
  std::vector<Leaf> leaves;
  std::vector<BlockFn> fns;
  std::vector<std::pair<int32_t, int64_t>> tasks;
  for (size_t i = 0; i < params.size(); ++i) {
    Leaf L;
    L.n = params[i].numel();
    L.g = grads[i].data_ptr(); L.gk = kind_of(grads[i]);
    L.p = params[i].data_ptr(); L.pk = kind_of(params[i]);
    L.lo = L.pk == BF16 ? rem[i].data_ptr<int16_t>() : nullptr;
    L.m = m[i].data_ptr(); L.mk = kind_of(m[i]);
    L.v = v[i].data_ptr(); L.vk = kind_of(v[i]);
    L.ma = L.mk == U8 ? ma[i].data_ptr<float>() : nullptr;
    L.va = L.vk == U8 ? va[i].data_ptr<float>() : nullptr;
    leaves.push_back(L);
    fns.push_back(pick(L.gk, L.pk, L.mk));
    for (int64_t s = 0; s < L.n; s += kBlock) tasks.emplace_back(int32_t(i), s);
  }
  at::parallel_for(0, int64_t(tasks.size()), 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const auto& L = leaves[tasks[t].first];
      const int64_t s = tasks[t].second;
      fns[tasks[t].first](L, s, std::min<int64_t>(kBlock, L.n - s), c, ms, mu);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) { mod.def("adam_lowmem_step_", &adam_lowmem_step_); }
