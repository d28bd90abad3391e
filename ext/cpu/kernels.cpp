// CPU kernels; see kernels.h for what each computes.
//
// Why the vector code looks like this: each kernel processes kW = 2 * Vectorized<float>::size()
// elements per iteration (one Vectorized<Half/BFloat16> converts to two float vectors), and
// the tail of a segment uses partial loads/stores (zero-filled lanes that are never stored), so
// there is one code path per kernel and the scalar tail cannot drift from the vector math.
// The order of floating-point operations follows torch.optim's single-tensor CPU path
// (including its fmadd in add(alpha=) and lerp) so results agree with torch to the last bits
// in most elements.

// Only the explicit at::vec::fmadd calls are fused multiply-adds: GCC would otherwise contract
// a * b + c written with vector operators into one FMA (-ffp-contract=fast, its default), and
// the kernels would no longer round as torch's ops (separate mul and add) round.
#pragma GCC optimize("fp-contract=off")

// The vector width follows the compiler's target, as torch's own CPU kernels follow the CPU:
// 512-bit at::vec when it may use AVX-512 (F, BW, DQ, VL: what ATen's AVX512 code needs), else
// 256-bit with AVX2+FMA+F16C. Each lane computes the same IEEE operations at either width, so
// the values do not depend on it; only the order of a reduction's partial sums does.
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#endif
#endif

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <atomic>
#include <mutex>
#include <type_traits>

namespace ampfunc {
namespace cpu {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVF = fVec::size();
constexpr int64_t kW = 2 * kVF;
// Elements per parallel task: large enough to amortise scheduling, small enough that two
// cores split a 1M-element tree evenly.
constexpr int64_t kGrain = 1 << 15;

static_assert(at::vec::Vectorized<at::Half>::size() == kW, "Half vector must convert to two float vectors");
static_assert(at::vec::Vectorized<at::BFloat16>::size() == kW, "BFloat16 vector must convert to two float vectors");

enum class Kind : int { F32 = 0, F16 = 1, BF16 = 2 };

Kind kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return Kind::F32;
    case at::kHalf: return Kind::F16;
    case at::kBFloat16: return Kind::BF16;
    default: TORCH_CHECK(false, "ampfunc cpu kernel: unsupported dtype ", t);
  }
}

// ---- loads and stores of kW elements (n of them valid, n <= kW) as two float vectors ----

inline void load2(const float* p, int64_t n, fVec& a, fVec& b) {
  if (n >= kW) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + kVF);
  } else {
    a = fVec::loadu(p, std::min<int64_t>(n, kVF));
    b = n > kVF ? fVec::loadu(p + kVF, n - kVF) : fVec(0.f);
  }
}

template <typename T>
inline void load2(const T* p, int64_t n, fVec& a, fVec& b) {
  auto v = n >= kW ? at::vec::Vectorized<T>::loadu(p) : at::vec::Vectorized<T>::loadu(p, n);
  std::tie(a, b) = at::vec::convert_to_float<T>(v);
}

inline void store2(float* p, int64_t n, const fVec& a, const fVec& b) {
  if (n >= kW) {
    a.store(p);
    b.store(p + kVF);
  } else {
    a.store(p, std::min<int64_t>(n, kVF));
    if (n > kVF) b.store(p + kVF, n - kVF);
  }
}

template <typename T>
inline void store2(T* p, int64_t n, const fVec& a, const fVec& b) {
  auto v = at::vec::convert_from_float<T>(a, b);
  if (n >= kW) v.store(p); else v.store(p, n);
}

// ---- streaming (non-temporal) stores, for destinations a kernel only writes ----
//
// A plain store first reads the cache line it writes into (read-for-ownership), so a new
// output tensor costs two memory transfers per byte: an out-of-place Adam step would move 40
// bytes per element against the in-place step's 28. A streaming store skips the read. It is
// used for the new tensors of the out-of-place steps when the outputs are too large to stay in
// cache anyway (kStreamMin elements), for full vectors at vector-aligned addresses; partial
// tails and unaligned segments store normally. Only where the data goes changes, never a value.
constexpr int64_t kStreamMin = 1 << 20;

#if defined(CPU_CAPABILITY_AVX512)
static_assert(kVF == 16, "AVX-512 float vectors hold 16 lanes");
inline void stream_store(float* p, const fVec& v) { _mm512_stream_ps(p, v); }
template <typename T>
inline void stream_store(T* p, const at::vec::Vectorized<T>& v) {
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
}
#elif defined(CPU_CAPABILITY_AVX2)
static_assert(kVF == 8, "AVX2 float vectors hold 8 lanes");
inline void stream_store(float* p, const fVec& v) { _mm256_stream_ps(p, v); }
template <typename T>
inline void stream_store(T* p, const at::vec::Vectorized<T>& v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kCanStream = true;

inline void store2(float* p, int64_t n, const fVec& a, const fVec& b, bool stream) {
  if (stream && n >= kW) {
    stream_store(p, a);
    stream_store(p + kVF, b);
  } else {
    store2(p, n, a, b);
  }
}

template <typename T>
inline void store2(T* p, int64_t n, const fVec& a, const fVec& b, bool stream) {
  if (stream && n >= kW) {
    stream_store(p, at::vec::convert_from_float<T>(a, b));
  } else {
    store2(p, n, a, b);
  }
}

inline void stream_fence() { _mm_sfence(); }
#else
constexpr bool kCanStream = false;

template <typename T>
inline void store2(T* p, int64_t n, const fVec& a, const fVec& b, bool /*stream*/) {
  store2(p, n, a, b);
}

inline void stream_fence() {}
#endif

// Whether stores to `out` stream: enabled for this call, `out` is not the source (in place,
// the line was just read and is in cache) and it is aligned for the vector stores.
inline bool streams(bool enabled, const void* out, const void* in) {
  return kCanStream && enabled && out != in && reinterpret_cast<uintptr_t>(out) % (kVF * sizeof(float)) == 0;
}

// Calls fn(typed data pointer) for tensor i of a list (float, half or bfloat16).
template <typename Fn>
inline void with_typed(const Tensors& ts, size_t i, Fn&& fn) {
  switch (kind_of(ts.dtype(i))) {
    case Kind::F32: fn(ts.data<float>(i)); break;
    case Kind::F16: fn(ts.data<at::Half>(i)); break;
    case Kind::BF16: fn(ts.data<at::BFloat16>(i)); break;
  }
}

// The concatenated index range of a tensor list: offsets[i] is where tensor i starts.
struct Ranges {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  explicit Ranges(const Tensors& ts) {
    offsets.reserve(ts.size() + 1);
    for (size_t i = 0; i < ts.size(); ++i) {
      offsets.push_back(total);
      total += ts.numel(i);
    }
    offsets.push_back(total);
  }
  // fn(i, start_in_tensor, count) for each piece of [begin, end) that falls in tensor i.
  template <typename Fn>
  void for_each(int64_t begin, int64_t end, Fn&& fn) const {
    int64_t i = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    while (begin < end) {
      const int64_t stop = std::min(end, offsets[i + 1]);
      if (stop > begin) fn(i, begin - offsets[i], stop - begin);
      begin = stop;
      ++i;
    }
  }
};

inline double hsum(const fVec& v) {
  alignas(64) float buf[kVF];
  v.store(buf);
  double s = 0;
  for (int64_t k = 0; k < kVF; ++k) s += buf[k];
  return s;
}

// ---- check ----

struct CheckAcc {
  double sumsq = 0;
  bool nonfinite = false;
};

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <bool kScaled, typename T>
CheckAcc check_segment(const T* p, int64_t n, float scale) {
  // Fast path: only the sum of squares, two independent fp32 FMA chains, flushed to double
  // every block. A NaN or an infinity makes the block's sum non-finite, so finiteness costs
  // nothing extra in the common case. A non-finite block sum is then decided exactly (rare):
  // it is either a non-finite element or finite squares that overflowed fp32, and in the
  // latter case the block's sum is recomputed in double (squares of finite fp32 values cannot
  // overflow a double), so the sum is finite whenever every element is.
  CheckAcc acc;
  constexpr int64_t kBlock = 4096;
  const fVec s(scale);
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t stop = std::min(n, base + kBlock);
    fVec s0(0.f), s1(0.f);
    for (int64_t j = base; j < stop; j += kW) {
      fVec a, b;
      load2(p + j, stop - j, a, b);
      if (kScaled) {
        a = a * s;
        b = b * s;
      }
      s0 = at::vec::fmadd(a, a, s0);
      s1 = at::vec::fmadd(b, b, s1);
    }
    double block = hsum(s0 + s1);
    if (!std::isfinite(block)) {
      block = 0.0;
      for (int64_t j = base; j < stop; ++j) {
        const float x = to_float(p[j]);
        if (!std::isfinite(x)) acc.nonfinite = true;
        const float u = kScaled ? x * scale : x;
        block += static_cast<double>(u) * static_cast<double>(u);
      }
    }
    acc.sumsq += block;
  }
  return acc;
}

}  // namespace

CheckResult check(const Tensors& tensors, uint8_t* per_leaf_nonfinite, bool scaled, float scale) {
  const Ranges r(tensors);
  std::mutex mu;
  double sumsq = 0;
  bool nonfinite = false;
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    CheckAcc local;
    r.for_each(begin, end, [&](int64_t i, int64_t start, int64_t count) {
      CheckAcc seg;
      with_typed(tensors, i, [&](auto* p) {
        seg = scaled ? check_segment<true>(p + start, count, scale) : check_segment<false>(p + start, count, 1.f);
      });
      local.sumsq += seg.sumsq;
      if (seg.nonfinite) {
        local.nonfinite = true;
        if (per_leaf_nonfinite) __atomic_store_n(per_leaf_nonfinite + i, uint8_t(1), __ATOMIC_RELAXED);
      }
    });
    std::lock_guard<std::mutex> lock(mu);
    sumsq += local.sumsq;
    nonfinite = nonfinite || local.nonfinite;
  });
  return {!nonfinite, sumsq};
}

// ---- unscale ----

namespace {
template <typename Tin, typename Tout>
bool unscale_segment(const Tin* in, Tout* out, int64_t n, float inv_scale) {
  const fVec zero(0.f), s(inv_scale);
  fVec nf(0.f);
  for (int64_t j = 0; j < n; j += kW) {
    fVec a, b;
    load2(in + j, n - j, a, b);
    // Each lane on its own: x * 0 is NaN exactly for a non-finite x, while a + b of two
    // finite lanes can overflow to inf and flag a finite gradient.
    nf = at::vec::fmadd(a, zero, nf);
    nf = at::vec::fmadd(b, zero, nf);
    store2(out + j, n - j, a * s, b * s);
  }
  const double h = hsum(nf);
  return h == 0.0;
}
}  // namespace

bool unscale(const Tensors& ins, const Tensors& outs, float inv_scale) {
  const Ranges r(ins);
  std::atomic<bool> nonfinite{false};
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    bool local = false;
    r.for_each(begin, end, [&](int64_t i, int64_t start, int64_t count) {
      with_typed(ins, i, [&](auto* pin) {
        with_typed(outs, i, [&](auto* pout) {
          if (!unscale_segment(pin + start, pout + start, count, inv_scale)) local = true;
        });
      });
    });
    if (local) nonfinite.store(true, std::memory_order_relaxed);
  });
  return !nonfinite.load();
}

// ---- SGD ----

namespace {
// Reads p_in / buf_in, writes p_out / buf_out (the same pointers in place: every element is
// loaded before it is stored, and the math does not depend on where it goes).
struct Streams {
  bool p, m1, m2, vmax, model;  // which destinations take streaming stores (SGD's buffer: m1)
};

// Update mode (delta non-null): nothing is written to p_out; delta receives new_p - p, or
// g * -lr when p_in is null.
// kCheck: as adam_segment's, the gradients' finiteness read in the same pass.
template <bool kCheck = false, typename G, typename M>
bool sgd_segment(const float* p_in, const G* g, const float* buf_in, float* p_out, float* buf_out, M* model,
                 float* delta, int64_t n, const SgdHyper& h, const Streams& st) {
  const fVec gs(h.grad_scale), wd(h.weight_decay), mom(h.momentum), one_minus_damp(h.one_minus_dampening),
      neg_lr(-h.lr);
  const fVec zero(0.f);
  fVec nf(0.f);
  for (int64_t j = 0; j < n; j += kW) {
    const int64_t m = n - j;
    fVec ga, gb, pa(0.f), pb(0.f);
    load2(g + j, m, ga, gb);
    if constexpr (kCheck) {
      nf = at::vec::fmadd(ga, zero, nf);
      nf = at::vec::fmadd(gb, zero, nf);
    }
    if (p_in) load2(p_in + j, m, pa, pb);
    ga = ga * gs;
    gb = gb * gs;
    if (h.maximize) {
      ga = ga.neg();
      gb = gb.neg();
    }
    if (h.weight_decay != 0.f) {
      ga = at::vec::fmadd(pa, wd, ga);
      gb = at::vec::fmadd(pb, wd, gb);
    }
    if (buf_out) {
      fVec ba, bb;
      if (h.first_step) {
        ba = ga;
        bb = gb;
      } else {
        load2(buf_in + j, m, ba, bb);
        ba = at::vec::fmadd(ga, one_minus_damp, ba * mom);
        bb = at::vec::fmadd(gb, one_minus_damp, bb * mom);
      }
      store2(buf_out + j, m, ba, bb, st.m1);
      if (h.nesterov) {
        ga = at::vec::fmadd(ba, mom, ga);
        gb = at::vec::fmadd(bb, mom, gb);
      } else {
        ga = ba;
        gb = bb;
      }
    }
    if (delta) {
      if (!p_in) {  // -lr * g
        store2(delta + j, m, ga * neg_lr, gb * neg_lr, st.p);
      } else {  // the new param as the in-place step makes it (one fused multiply-add), minus p
        store2(delta + j, m, at::vec::fmadd(ga, neg_lr, pa) - pa, at::vec::fmadd(gb, neg_lr, pb) - pb, st.p);
      }
      continue;
    }
    pa = at::vec::fmadd(ga, neg_lr, pa);
    pb = at::vec::fmadd(gb, neg_lr, pb);
    store2(p_out + j, m, pa, pb, st.p);
    if (model) store2(model + j, m, pa, pb, st.model);
  }
  if constexpr (kCheck) return hsum(nf) != 0.0;  // NaN != 0 too
  return false;
}
}  // namespace

template <bool kCheck>
static void sgd_step_impl(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                          const Tensors& params_out, const Tensors& momentum_buffers_out,
                          const Tensors& model_params, const SgdHyper& h, bool* nonfinite) {
  const Ranges r(params);
  const bool has_buf = !momentum_buffers.empty(), has_model = !model_params.empty();
  const bool big = r.total >= kStreamMin;
  std::atomic<bool> any_nonfinite{false};
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    bool local = false;
    r.for_each(begin, end, [&](int64_t i, int64_t s, int64_t count) {
      const float* p = params.data<float>(i) + s;
      float* p_out = params_out.data<float>(i) + s;
      const float* buf = has_buf ? momentum_buffers.data<float>(i) + s : nullptr;
      float* buf_out = has_buf ? momentum_buffers_out.data<float>(i) + s : nullptr;
      with_typed(grads, i, [&](auto* g) {
        if (has_model) {
          with_typed(model_params, i, [&](auto* mp) {
            const Streams st{streams(big, p_out, p), streams(big, buf_out, buf), false, false,
                             streams(big, mp + s, nullptr)};
            local = sgd_segment<kCheck>(p, g + s, buf, p_out, buf_out, mp + s, static_cast<float*>(nullptr), count,
                                        h, st) || local;
          });
        } else {
          const Streams st{streams(big, p_out, p), streams(big, buf_out, buf), false, false, false};
          local = sgd_segment<kCheck>(p, g + s, buf, p_out, buf_out, static_cast<float*>(nullptr),
                                      static_cast<float*>(nullptr), count, h, st) || local;
        }
      });
    });
    stream_fence();
    if (local) any_nonfinite.store(true, std::memory_order_relaxed);
  });
  if constexpr (kCheck) *nonfinite = any_nonfinite.load();
}

void sgd_step(const Tensors& params, const Tensors& grads,
              const Tensors& momentum_buffers, const Tensors& params_out,
              const Tensors& momentum_buffers_out, const Tensors& model_params,
              const SgdHyper& h, bool* nonfinite) {
  if (nonfinite != nullptr) {
    sgd_step_impl<true>(params, grads, momentum_buffers, params_out, momentum_buffers_out, model_params, h, nonfinite);
  } else {
    sgd_step_impl<false>(params, grads, momentum_buffers, params_out, momentum_buffers_out, model_params, h, nullptr);
  }
}

void sgd_update(const Tensors& params, const Tensors& grads,
                const Tensors& momentum_buffers, const Tensors& momentum_buffers_out,
                const Tensors& updates, const SgdHyper& h) {
  const Ranges r(grads);
  const bool has_p = !params.empty(), has_buf = !momentum_buffers.empty();
  const bool big = r.total >= kStreamMin;
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    r.for_each(begin, end, [&](int64_t i, int64_t s, int64_t count) {
      const float* p = has_p ? params.data<float>(i) + s : nullptr;
      const float* buf = has_buf ? momentum_buffers.data<float>(i) + s : nullptr;
      float* buf_out = has_buf ? momentum_buffers_out.data<float>(i) + s : nullptr;
      float* d = updates.data<float>(i) + s;
      const Streams st{streams(big, d, nullptr), streams(big, buf_out, buf), false, false, false};
      with_typed(grads, i, [&](auto* g) {
        sgd_segment(p, g + s, buf, static_cast<float*>(nullptr), buf_out, static_cast<float*>(nullptr), d, count, h,
                    st);
      });
    });
    stream_fence();
  });
}

// ---- Adam / AdamW ----

namespace {
// The source and destination pointers of one segment (equal in place).
struct AdamPtrs {
  const float *p, *m1, *m2, *vmax;  // vmax null without amsgrad; p null for an update without params
  float *p_out, *m1_out, *m2_out, *vmax_out;
  float* delta;  // update mode: receives new_p - p (or the step term without params); p_out unused
};

// kCheck: also whether every gradient element read is finite (check()'s flag, of the raw
// values), folded into the same pass; returns true when one is not. Without it, returns false.
template <bool kCheck = false, typename G, typename M>
bool adam_segment(const AdamPtrs& x, const G* g, M* model, int64_t n, const ampfunc::AdamScalars& c, const Streams& st) {
  const fVec gs(c.grad_scale), wd(c.weight_decay), decay(c.decay), b2(c.beta2), c2(c.one_minus_beta2),
      bc2(c.bc2_sqrt), eps(c.eps),
      nss(c.neg_step_size);
  // torch's lerp: weight < 0.5 ? start + w * (end - start) : end + (w - 1) * (end - start), fused.
  const fVec lw(c.lerp_small ? c.lerp_weight : c.lerp_weight - 1.f);
  const fVec zero(0.f);
  fVec nf(0.f);  // x * 0 is 0 for a finite x and NaN for an infinity or a NaN
  for (int64_t j = 0; j < n; j += kW) {
    const int64_t k = n - j;
    fVec ga, gb, pa(0.f), pb(0.f), ma, mb, va, vb;
    load2(g + j, k, ga, gb);
    if constexpr (kCheck) {
      nf = at::vec::fmadd(ga, zero, nf);
      nf = at::vec::fmadd(gb, zero, nf);
    }
    if (x.p) load2(x.p + j, k, pa, pb);
    const fVec pa0 = pa, pb0 = pb;
    load2(x.m1 + j, k, ma, mb);
    load2(x.m2 + j, k, va, vb);
    ga = ga * gs;
    gb = gb * gs;
    if (c.maximize) {
      ga = ga.neg();
      gb = gb.neg();
    }
    if (c.decoupled) {
      pa = pa * decay;
      pb = pb * decay;
    } else if (c.l2) {
      ga = at::vec::fmadd(pa, wd, ga);
      gb = at::vec::fmadd(pb, wd, gb);
    }
    ma = at::vec::fmadd(lw, ga - ma, c.lerp_small ? ma : ga);
    mb = at::vec::fmadd(lw, gb - mb, c.lerp_small ? mb : gb);
    // exp_avg_sq.mul_(beta2) (rounded), then addcmul_(g, g, value=1 - beta2), which torch's
    // CPU kernel computes as one fused multiply-add of (value * g) and g.
    va = at::vec::fmadd(c2 * ga, ga, va * b2);
    vb = at::vec::fmadd(c2 * gb, gb, vb * b2);
    store2(x.m1_out + j, k, ma, mb, st.m1);
    store2(x.m2_out + j, k, va, vb, st.m2);
    fVec da = va, db = vb;
    if (x.vmax) {
      fVec xa, xb;
      load2(x.vmax + j, k, xa, xb);
      da = at::vec::maximum(xa, va);
      db = at::vec::maximum(xb, vb);
      store2(x.vmax_out + j, k, da, db, st.vmax);
    }
    da = da.sqrt() / bc2 + eps;
    db = db.sqrt() / bc2 + eps;
    // addcdiv_(m, denom, value=-step_size) is self + (value * t1) / t2 in ATen.
    if (x.delta) {
      if (x.p) {
        store2(x.delta + j, k, (pa + (nss * ma) / da) - pa0, (pb + (nss * mb) / db) - pb0, st.p);
      } else {
        store2(x.delta + j, k, (nss * ma) / da, (nss * mb) / db, st.p);
      }
      continue;
    }
    pa = pa + (nss * ma) / da;
    pb = pb + (nss * mb) / db;
    store2(x.p_out + j, k, pa, pb, st.p);
    if (model) store2(model + j, k, pa, pb, st.model);
  }
  if constexpr (kCheck) return hsum(nf) != 0.0;  // NaN != 0 too
  return false;
}
}  // namespace

static ampfunc::AdamScalars adam_scalars(const AdamHyper& h) {
  return ampfunc::adam_scalars(h.grad_scale, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.amsgrad,
                               h.decoupled_weight_decay, h.maximize, h.fp32_decay);
}

template <bool kCheck>
static void adam_step_impl(const AdamLists& in, const Tensors& grads, const AdamLists& out,
                           const Tensors& model_params, const AdamHyper& h, bool* nonfinite) {
  const ampfunc::AdamScalars c = adam_scalars(h);
  const Ranges r(in.params);
  const bool has_model = !model_params.empty();
  const bool big = r.total >= kStreamMin;
  std::atomic<bool> any_nonfinite{false};
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    bool local = false;
    r.for_each(begin, end, [&](int64_t i, int64_t s, int64_t count) {
      const AdamPtrs x{in.params.data<float>(i) + s,
                       in.exp_avgs.data<float>(i) + s,
                       in.exp_avg_sqs.data<float>(i) + s,
                       c.amsgrad ? in.max_exp_avg_sqs.data<float>(i) + s : nullptr,
                       out.params.data<float>(i) + s,
                       out.exp_avgs.data<float>(i) + s,
                       out.exp_avg_sqs.data<float>(i) + s,
                       c.amsgrad ? out.max_exp_avg_sqs.data<float>(i) + s : nullptr,
                       nullptr};
      Streams st{streams(big, x.p_out, x.p), streams(big, x.m1_out, x.m1), streams(big, x.m2_out, x.m2),
                 streams(big, x.vmax_out, x.vmax), false};
      with_typed(grads, i, [&](auto* g) {
        if (has_model) {
          with_typed(model_params, i, [&](auto* mp) {
            st.model = streams(big, mp + s, nullptr);
            local = adam_segment<kCheck>(x, g + s, mp + s, count, c, st) || local;
          });
        } else {
          local = adam_segment<kCheck>(x, g + s, static_cast<float*>(nullptr), count, c, st) || local;
        }
      });
    });
    stream_fence();
    if (local) any_nonfinite.store(true, std::memory_order_relaxed);
  });
  if constexpr (kCheck) *nonfinite = any_nonfinite.load();
}

void adam_step(const AdamLists& in, const Tensors& grads, const AdamLists& out,
               const Tensors& model_params, const AdamHyper& h, bool* nonfinite) {
  if (nonfinite != nullptr) {
    adam_step_impl<true>(in, grads, out, model_params, h, nonfinite);
  } else {
    adam_step_impl<false>(in, grads, out, model_params, h, nullptr);
  }
}

void adam_update(const AdamLists& in, const Tensors& grads, const AdamLists& out,
                 const Tensors& updates, const AdamHyper& h) {
  const ampfunc::AdamScalars c = adam_scalars(h);
  const Ranges r(grads);
  const bool has_p = !in.params.empty();
  const bool big = r.total >= kStreamMin;
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    r.for_each(begin, end, [&](int64_t i, int64_t s, int64_t count) {
      const AdamPtrs x{has_p ? in.params.data<float>(i) + s : nullptr,
                       in.exp_avgs.data<float>(i) + s,
                       in.exp_avg_sqs.data<float>(i) + s,
                       c.amsgrad ? in.max_exp_avg_sqs.data<float>(i) + s : nullptr,
                       nullptr,
                       out.exp_avgs.data<float>(i) + s,
                       out.exp_avg_sqs.data<float>(i) + s,
                       c.amsgrad ? out.max_exp_avg_sqs.data<float>(i) + s : nullptr,
                       updates.data<float>(i) + s};
      const Streams st{streams(big, x.delta, nullptr), streams(big, x.m1_out, x.m1), streams(big, x.m2_out, x.m2),
                       streams(big, x.vmax_out, x.vmax), false};
      with_typed(grads, i, [&](auto* g) { adam_segment(x, g + s, static_cast<float*>(nullptr), count, c, st); });
    });
    stream_fence();
  });
}

// ---- the generic optimizers ----

namespace {
// The value type the CPU pass runs an optimizer's element function on (ext/optimizers.h):
// at::vec's float vector, wrapped so that the element helpers of ext/optim_scalars.h (mul_rn,
// add_rn, sub_rn, fma_rn, sign_of; lerp is written over them) find their vector overloads here
// by argument-dependent lookup. The same IEEE operation per lane as the scalar helpers, so the
// CPU and CUDA kernels share one element function and the CPU pass is vectorized by
// construction, without branches on values.
struct VF {
  fVec v;
};
inline fVec vec_of(float x) { return fVec(x); }
inline fVec vec_of(const VF& x) { return x.v; }
template <class A, class B>
concept AnyVF = std::is_same_v<A, VF> || std::is_same_v<B, VF>;

template <class A, class B>
  requires AnyVF<A, B>
inline VF mul_rn(const A& a, const B& b) {
  return {vec_of(a) * vec_of(b)};
}
template <class A, class B>
  requires AnyVF<A, B>
inline VF add_rn(const A& a, const B& b) {
  return {vec_of(a) + vec_of(b)};
}
template <class A, class B>
  requires AnyVF<A, B>
inline VF sub_rn(const A& a, const B& b) {
  return {vec_of(a) - vec_of(b)};
}
template <class A, class B, class C>
  requires(AnyVF<A, B> || std::is_same_v<C, VF>)
inline VF fma_rn(const A& a, const B& b, const C& c) {
  return {at::vec::fmadd(vec_of(a), vec_of(b), vec_of(c))};
}
// torch.sign per lane, (x > 0) - (x < 0): compares (all-ones masks) and'ed with 1.0.
inline VF sign_of(const VF& x) {
  const fVec zero(0.f), one(1.f);
  return {((x.v > zero) & one) - ((x.v < zero) & one)};
}

// The source and destination pointers of one segment (equal in place); a null state source
// reads zeros, a null state destination is not written.
template <int kS>
struct OptimPtrs {
  const float* p;  // null for an update without params
  const float* s[kS > 0 ? kS : 1];
  float* p_out;  // unused in update mode
  float* s_out[kS > 0 ? kS : 1];
  float* delta;  // update mode: receives new_p - p
};

// One segment, kW elements per iteration as two vectors (the tail by partial loads and stores,
// as the hand-written kernels above): Op::element runs on each vector.
template <class Op, typename G, typename M>
void optim_segment(const OptimPtrs<Op::kState>& ptrs, const G* g, M* model, int64_t n,
                   const typename Op::Scalars& scalars, const Streams& streamed, const bool* s_streamed) {
  constexpr int kS = Op::kState;
  // Local copies: the stores below could alias the caller's structs as far as the compiler
  // knows, which would reload every pointer and scalar each iteration; copies stay in registers.
  const OptimPtrs<kS> x = ptrs;
  const typename Op::Scalars c = scalars;
  const Streams st = streamed;
  bool s_stream[kS > 0 ? kS : 1];
  for (int q = 0; q < kS; ++q) s_stream[q] = s_streamed[q];
  for (int64_t j = 0; j < n; j += kW) {
    const int64_t k = n - j;
    fVec ga, gb, pa(0.f), pb(0.f);
    load2(g + j, k, ga, gb);
    if (x.p) load2(x.p + j, k, pa, pb);
    VF sa[kS > 0 ? kS : 1], sb[kS > 0 ? kS : 1];
    for (int q = 0; q < kS; ++q) {
      if (x.s[q]) {
        load2(x.s[q] + j, k, sa[q].v, sb[q].v);
      } else {
        sa[q].v = fVec(0.f);
        sb[q].v = fVec(0.f);
      }
    }
    VF qa{pa}, qb{pb};
    Op::element(VF{ga}, qa, sa, c);
    Op::element(VF{gb}, qb, sb, c);
    for (int q = 0; q < kS; ++q) {
      if (x.s_out[q]) store2(x.s_out[q] + j, k, sa[q].v, sb[q].v, s_stream[q]);
    }
    if (x.delta) {
      store2(x.delta + j, k, qa.v - pa, qb.v - pb, st.p);
      continue;
    }
    store2(x.p_out + j, k, qa.v, qb.v, st.p);
    if (model) store2(model + j, k, qa.v, qb.v, st.model);
  }
}
}  // namespace

template <class Op>
void optim_pass(const OptimLists& in, const Tensors& grads, const OptimLists& out, const Tensors& model_params,
                const Tensors* updates, const typename Op::Scalars& c) {
  constexpr int kS = Op::kState;
  const Ranges r(grads);
  const bool has_p = !in.params->empty(), has_model = !model_params.empty();
  const bool big = r.total >= kStreamMin;
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    r.for_each(begin, end, [&](int64_t i, int64_t s, int64_t count) {
      OptimPtrs<kS> x{};
      bool s_stream[kS > 0 ? kS : 1] = {};
      for (int q = 0; q < kS; ++q) {
        x.s[q] = in.state[q]->empty() ? nullptr : in.state[q]->data<float>(i) + s;
        x.s_out[q] = out.state[q]->empty() ? nullptr : out.state[q]->data<float>(i) + s;
        s_stream[q] = x.s_out[q] && streams(big, x.s_out[q], x.s[q]);
      }
      x.p = has_p ? in.params->data<float>(i) + s : nullptr;
      x.p_out = updates ? nullptr : out.params->data<float>(i) + s;
      x.delta = updates ? updates->data<float>(i) + s : nullptr;
      Streams st{updates ? streams(big, x.delta, nullptr) : streams(big, x.p_out, x.p), false, false, false, false};
      with_typed(grads, i, [&](auto* g) {
        if (has_model && !updates) {
          with_typed(model_params, i, [&](auto* mp) {
            st.model = streams(big, mp + s, nullptr);
            optim_segment<Op>(x, g + s, mp + s, count, c, st, s_stream);
          });
        } else {
          optim_segment<Op>(x, g + s, static_cast<float*>(nullptr), count, c, st, s_stream);
        }
      });
    });
    stream_fence();
  });
}

#define AMPFUNC_INSTANTIATE_PASS(name, Op)                                                                     \
  template void optim_pass<Op>(const OptimLists&, const Tensors&, const OptimLists&, const Tensors&,           \
                               const Tensors*, const typename Op::Scalars&);
AMPFUNC_OPTIMIZERS(AMPFUNC_INSTANTIATE_PASS)
#undef AMPFUNC_INSTANTIATE_PASS

// ---- apply_updates ----

namespace {
template <typename P, typename U>
void apply_segment(const P* p, const U* u, P* out, int64_t n, bool stream) {
  for (int64_t j = 0; j < n; j += kW) {
    fVec pa, pb, ua, ub;
    load2(p + j, n - j, pa, pb);
    load2(u + j, n - j, ua, ub);
    store2(out + j, n - j, pa + ua, pb + ub, stream);
  }
}
}  // namespace

void apply_updates(const Tensors& params, const Tensors& updates,
                   const Tensors& outs) {
  const Ranges r(params);
  const bool big = r.total >= kStreamMin;
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    r.for_each(begin, end, [&](int64_t i, int64_t s, int64_t count) {
      with_typed(params, i, [&](auto* p) {
        using P = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
        P* o = outs.data<P>(i) + s;
        const bool st = streams(big, o, nullptr);
        with_typed(updates, i, [&](auto* u) { apply_segment(p + s, u + s, o, count, st); });
      });
    });
    stream_fence();
  });
}

// ---- copy ----

void copy(const Tensors& ins, const Tensors& outs) {
  const Ranges r(ins);
  at::parallel_for(0, r.total, kGrain, [&](int64_t begin, int64_t end) {
    r.for_each(begin, end, [&](int64_t i, int64_t s, int64_t count) {
      const int64_t bytes = static_cast<int64_t>(c10::elementSize(ins.dtype(i)));
      std::memcpy(outs.data<char>(i) + s * bytes, ins.data<char>(i) + s * bytes, count * bytes);
    });
  });
}

// ---- loss scale ----

void update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, bool finite,
                  const ScaleConfig& c) {
  const float s = *scale;
  // torch.amp rounding: products in double, stored in fp32; a growth that overflows fp32 is
  // not applied (the tracker still resets).
  float grown = static_cast<float>(static_cast<double>(s) * c.growth_factor);
  grown = std::isfinite(grown) ? std::min(grown, static_cast<float>(c.max_scale)) : s;
  const float backed = std::max(static_cast<float>(static_cast<double>(s) * c.backoff_factor),
                                static_cast<float>(c.min_scale));
  const int32_t next_tracker = *growth_tracker + 1;
  const bool grow = finite && next_tracker >= c.growth_interval;
  const bool backoff = !finite && *hysteresis_tracker <= 1;
  *scale = grow ? grown : (backoff ? backed : s);
  *growth_tracker = (finite && !grow) ? next_tracker : 0;
  *hysteresis_tracker = finite ? static_cast<int32_t>(c.hysteresis) : std::max(*hysteresis_tracker - 1, 1);
}

}  // namespace cpu
}  // namespace ampfunc
