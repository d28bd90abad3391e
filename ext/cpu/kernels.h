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
#include <ATen/Parallel.h>
#include <c10/core/impl/COW.h>

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "../optim_scalars.h"
#include "../optimizers.h"

namespace ampfunc {

// Vectors recycled per thread. A 10,000-leaf step builds a dozen lists of 10,000-40,000 entries
// per call; fresh vectors of that size come from mmap (glibc's threshold is 128 KB) and fault
// in their pages on every call, about a tenth of such a call's time. Taken vectors keep their
// capacity; a handful per thread and element type is kept.
template <typename T>
class Recycled {
 public:
  static std::vector<T> take() {
    auto& s = spare();
    if (s.empty()) return {};
    std::vector<T> v = std::move(s.back());
    s.pop_back();
    return v;
  }
  static void give(std::vector<T>& v) {
    if (v.capacity() == 0) return;
    auto& s = spare();
    if (s.size() >= kKeep) return;
    v.clear();
    s.push_back(std::move(v));
  }

 private:
  static constexpr size_t kKeep = 16;
  static std::vector<std::vector<T>>& spare() {
    thread_local std::vector<std::vector<T>> s;
    return s;
  }
};

// Prefetches for loops over long lists of tensors, which are bound by memory latency rather
// than work: each TensorImpl, its storage and its version counter are separate heap objects,
// cold in cache on a 10,000-leaf tree (a step's data streams through the cache between calls).
// A prefetch never faults, so a stale or null address costs nothing but the request.
inline void prefetch_lines(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}
// The TensorImpl's fields (sizes, dtype, device, flags, key set, storage and counter handles).
inline void prefetch_impl(const at::Tensor& t) { prefetch_lines(t.unsafeGetTensorImpl(), sizeof(c10::TensorImpl)); }
// Its storage (the data pointer): reads the TensorImpl's storage handle, so ask for the
// TensorImpl first.
inline void prefetch_storage(const at::Tensor& t) {
  prefetch_lines(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl(), 128);
}
// The address of a tensor's version counter (VariableVersion holds one intrusive pointer to
// it, not exposed): for prefetching only, never dereferenced here.
inline const void* counter_of(const at::Tensor& t) {
  static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion is one pointer");
  return *reinterpret_cast<const void* const*>(&t.unsafeGetTensorImpl()->version_counter());
}

// A list of tensors as the kernels and the binding layer pass it around: borrowed pointers plus,
// per tensor, what the kernels need of it (data pointer, element count, dtype, contiguity), read
// once when the tensor joins the list.
//
// Copying an at::Tensor handle costs an atomic reference-count update (and, for a tensor that a
// Python object owns, a trip through the interpreter); reading a TensorImpl and its storage
// costs cache misses, since each is a separate heap object and a 10,000-leaf tree's are cold.
// A Tensors copies pointers only, and the kernels read the compact descriptors, not the tensors.
// The tensors must outlive it and must not change (data pointer, size, dtype) while it is in
// use: they belong to the caller's lists (the dispatcher's argument vector, or the tuples the
// direct door holds) or to a Work copy.
class Tensors {
 public:
  static constexpr int kInlineDims = 4;
  // What the kernels and the validation of a call read of each tensor: taken in the one pass
  // that builds the list, so validation walks these (sequential memory) instead of the cold
  // tensors again.
  struct Desc {
    char* data;  // nullptr for a tensor without storage (validation refuses those)
    int64_t numel;
    at::ScalarType dtype;
    bool contiguous;
    bool dense;  // defined and not sparse / mkldnn (validation looks closer at the others)
    at::Device device = at::Device(at::kCPU);
    int8_t ndim;  // -1: more than kInlineDims dims (validation compares the tensors' sizes)
    int64_t dims[kInlineDims];
    bool inference = false;  // made under torch.inference_mode(): not writable outside it
    // Where the version counter lives, read with the rest: the bumps after an in-place kernel
    // ask for it ahead (a prefetch only; the bump itself goes through the TensorImpl).
    const void* counter = nullptr;
    c10::TensorImpl* impl = nullptr;  // the tensor's TensorImpl (read through p_ otherwise)
  };

  class iterator {
   public:
    explicit iterator(const at::Tensor* const* p) : p_(p) {}
    const at::Tensor& operator*() const { return **p_; }
    iterator& operator++() {
      ++p_;
      return *this;
    }
    bool operator!=(const iterator& o) const { return p_ != o.p_; }

   private:
    const at::Tensor* const* p_;
  };

  Tensors() = default;
  Tensors(c10::ArrayRef<at::Tensor> ts) { borrow(ts.data(), ts.size()); }        // NOLINT: implicit, views
  Tensors(const std::vector<at::Tensor>& ts) { borrow(ts.data(), ts.size()); }  // NOLINT: of the same tensors
  Tensors(const Tensors& o) : p_(Recycled<const at::Tensor*>::take()), d_(Recycled<Desc>::take()) {
    p_.assign(o.p_.begin(), o.p_.end());
    d_.assign(o.d_.begin(), o.d_.end());
  }
  Tensors(Tensors&&) noexcept = default;
  Tensors& operator=(const Tensors& o) {
    p_.assign(o.p_.begin(), o.p_.end());
    d_.assign(o.d_.begin(), o.d_.end());
    return *this;
  }
  Tensors& operator=(Tensors&&) noexcept = default;
  ~Tensors() {
    Recycled<const at::Tensor*>::give(p_);
    Recycled<Desc>::give(d_);
  }

  void reserve(size_t n) {
    if (p_.capacity() == 0) p_ = Recycled<const at::Tensor*>::take();
    if (d_.capacity() == 0) d_ = Recycled<Desc>::take();
    p_.reserve(n);
    d_.reserve(n);
  }
  void push_back(const at::Tensor* t) {
    p_.push_back(t);
    d_.push_back(describe(*t));
  }
  // Appends a tensor whose descriptor is known already (taken from another Tensors).
  void push_back(const at::Tensor* t, const Desc& d) {
    p_.push_back(t);
    d_.push_back(d);
  }
  // Takes `n` tensors at once; `ok(t)` is asked of each tensor on the way, and the result is
  // whether it held for all. One loop on this thread, its cache misses overlapped by prefetching
  // two stages ahead: the TensorImpl kImplAhead tensors on, its storage (whose address is in that
  // TensorImpl, asked for earlier) kStorageAhead on. Not spread over the cores: a parallel region
  // per list would hand work to the other threads and wait for them several times a call, and
  // when those threads are not running (a loaded machine) each wait costs a scheduler slice.
  // A copy-on-write storage is materialized after the loop (describe() writes then), unless the
  // list is only read (`for_reading`: see describe_for_reading).
  template <typename Ok>
  bool take_all(const at::Tensor* const* ts, size_t n, Ok ok, bool for_reading = false) {
    point_at(ts, n);
    bool any_cow = false;
    const bool all_ok = describe_range(0, n, ok, for_reading ? Access::kRead : Access::kWriteLater, &any_cow);
    if (any_cow) {
      for (size_t i = 0; i < n; ++i) {
        if (d_[i].data == kCow) d_[i] = describe(*p_[i]);
      }
    }
    return all_ok;
  }
  // A list only read (the gradients), described in parts, possibly on several threads: point_at()
  // takes the `n` tensors, then describe_for_reading() fills the descriptors of [begin, end)
  // (each index by one thread). Reading needs no write access: the data pointer is the const
  // one (a copy-on-write storage is read where it is, not copied), so nothing but the tensors
  // is read and nothing is written but this list's own descriptors.
  void point_at(const at::Tensor* const* ts, size_t n) {
    reserve(n);
    p_.assign(ts, ts + n);
    d_.resize(n);
  }
  template <typename Ok>
  bool describe_for_reading(size_t begin, size_t end, Ok ok) {
    return describe_range(begin, end, ok, Access::kRead, nullptr);
  }
  size_t size() const { return p_.size(); }
  bool empty() const { return p_.empty(); }
  const at::Tensor& operator[](size_t i) const { return *p_[i]; }
  const Desc& desc(size_t i) const { return d_[i]; }
  int64_t numel(size_t i) const { return d_[i].numel; }
  at::ScalarType dtype(size_t i) const { return d_[i].dtype; }
  bool contiguous(size_t i) const { return d_[i].contiguous; }
  template <typename T>
  T* data(size_t i) const {
    return reinterpret_cast<T*>(d_[i].data);
  }
  iterator begin() const { return iterator(p_.data()); }
  iterator end() const { return iterator(p_.data() + p_.size()); }

  // Set when these are the descriptors of a list the direct door holds between calls, found
  // unchanged by this call (ext/glue/held.h): the held list's tag, new whenever its descriptors
  // are (validation may then reuse what it found of the same lists before), and its tensors'
  // version counters (bumped without reading the TensorImpls again). Not copied.
  uint64_t held_tag = 0;
  c10::VariableVersion* held_versions = nullptr;

 private:
  static constexpr size_t kImplAhead = 16, kStorageAhead = 8;
  // A marker, never dereferenced: the tensor's storage is copy-on-write (see take_all).
  static inline char* const kCow = reinterpret_cast<char*>(uintptr_t{1});

  // kWrite: the data pointer for writing (a copy-on-write storage materialized); kWriteLater:
  // the kCow marker instead of materializing; kRead: the data pointer for reading.
  enum class Access { kWrite, kWriteLater, kRead };

  // Descriptors [begin, end) of the tensors point_at() took, prefetched two stages ahead (see
  // take_all); `ok(t)` is asked of each, `any_cow` (nullable) set when one got the kCow marker.
  template <typename Ok>
  bool describe_range(size_t begin, size_t end, Ok ok, Access access, bool* any_cow) {
    bool all_ok = true, cow = false;
    for (size_t i = begin; i < end; ++i) {
      if (i + kImplAhead < end) prefetch_impl(*p_[i + kImplAhead]);
      if (i + kStorageAhead < end) prefetch_storage(*p_[i + kStorageAhead]);
      const at::Tensor& t = *p_[i];
      all_ok = ok(t) && all_ok;
      d_[i] = describe(t, access);
      cow = cow || d_[i].data == kCow;
    }
    if (any_cow != nullptr) *any_cow = cow;
    return all_ok;
  }

  static Desc describe(const at::Tensor& t, Access access = Access::kWrite) {
    Desc d{nullptr, 0, at::kFloat, true, false, at::Device(at::kCPU), -1, {0, 0, 0, 0}};
    if (!t.defined()) return d;
    // data_ptr() (not const_data_ptr()) unless only read: the kernels may write, which must
    // materialize a copy-on-write storage first. Layouts without storage (sparse) get none;
    // validation refuses them.
    const bool has_data = t.layout() == at::kStrided && t.has_storage();
    if (has_data && access == Access::kWriteLater && c10::impl::cow::is_cow_data_ptr(t.storage().data_ptr())) {
      d.data = kCow;
      return d;
    }
    if (has_data) {
      d.data = access == Access::kRead ? static_cast<char*>(const_cast<void*>(t.const_data_ptr()))
                                       : static_cast<char*>(t.data_ptr());
    }
    d.numel = t.numel();
    d.dtype = t.scalar_type();
    d.contiguous = t.is_contiguous();
    d.dense = !(t.is_sparse() || t.is_sparse_csr() || t.is_mkldnn());
    d.device = t.device();
    d.inference = t.is_inference();
    d.counter = counter_of(t);
    d.impl = t.unsafeGetTensorImpl();
    const auto sizes = t.sizes();
    if (sizes.size() <= static_cast<size_t>(kInlineDims)) {
      d.ndim = static_cast<int8_t>(sizes.size());
      for (size_t k = 0; k < sizes.size(); ++k) d.dims[k] = sizes[k];
    }
    return d;
  }
  void borrow(const at::Tensor* ts, size_t n) {
    reserve(n);
    for (size_t i = 0; i < n; ++i) push_back(ts + i);
  }

  std::vector<const at::Tensor*> p_;
  std::vector<Desc> d_;
};

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
CheckResult check(const Tensors& tensors, uint8_t* per_leaf_nonfinite, bool scaled = false,
                  float scale = 1.f);

// outs[i] = ins[i] * inv_scale, product in fp32, stored in outs[i]'s dtype. outs may be ins
// (in place). Returns whether every input element was finite.
bool unscale(const Tensors& ins, const Tensors& outs, float inv_scale);

// SGD's scalars (ext/optim_scalars.h: shared with the CUDA kernels).
using SgdHyper = ampfunc::SgdScalars;

// One pass: g = grad * grad_scale; torch.optim.SGD's update of params (fp32) and momentum
// buffers (fp32, empty list when momentum == 0), read from `params` / `momentum_buffers` and
// written to `params_out` / `momentum_buffers_out`; model_params (empty, or one per param, any
// float dtype) receive the rounded new params. The step runs in place when the out lists are
// the in lists (each element is loaded before it is stored) and out of place when they are
// other tensors; the arithmetic is the same code either way, so the results are bit-identical.
// With `nonfinite`, the same pass also sets it to whether any gradient element is an infinity
// or a NaN, as adam_step does.
void sgd_step(const Tensors& params, const Tensors& grads,
              const Tensors& momentum_buffers, const Tensors& params_out,
              const Tensors& momentum_buffers_out, const Tensors& model_params,
              const SgdHyper& h, bool* nonfinite = nullptr);

// The pure optimizer's update (optax form): one pass writing `updates` (fp32, new tensors)
// instead of the params: updates = new_p - p with new_p computed as sgd_step computes it, or
// -lr * g when `params` is empty (then weight_decay must be 0). Momentum buffers are read from
// `momentum_buffers` and written to `momentum_buffers_out`.
void sgd_update(const Tensors& params, const Tensors& grads,
                const Tensors& momentum_buffers, const Tensors& momentum_buffers_out,
                const Tensors& updates, const SgdHyper& h);

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
  const Tensors& params;
  const Tensors& exp_avgs;
  const Tensors& exp_avg_sqs;
  const Tensors& max_exp_avg_sqs;
};

// One pass of torch.optim.Adam / AdamW (single-tensor order of operations, fp32): reads `in`
// and the grads, writes `out` and model_params (empty, or the new params rounded to each
// one's dtype). In place when `out` names the same tensors as `in`, out of place otherwise,
// with the same code and so the same bits. With `nonfinite`, the same pass also sets it to
// whether any gradient element is an infinity or a NaN (check()'s flag): an out-of-place step
// can then take its skip decision after the pass, its inputs being intact.
void adam_step(const AdamLists& in, const Tensors& grads, const AdamLists& out,
               const Tensors& model_params, const AdamHyper& h, bool* nonfinite = nullptr);

// The pure Adam update: reads `in` (params may be empty: then weight_decay must be 0) and the
// grads, writes the new moments to `out` (its params list is ignored) and `updates` (fp32, new
// tensors): new_p - p with new_p computed as adam_step computes it, or the step term
// (-step_size * m / denom) alone when there are no params.
void adam_update(const AdamLists& in, const Tensors& grads, const AdamLists& out,
                 const Tensors& updates, const AdamHyper& h);

// ---- the generic optimizers (ext/optimizers.h) ----

// A generic optimizer's fp32 lists: params (empty for an update without params) and its state
// lists in the spec's order (an empty list for one the hyper-parameters leave unused).
struct OptimLists {
  const Tensors* params;
  std::vector<const Tensors*> state;
};

// One pass of optimizer Op over the concatenation of the lists: reads `in` and the grads (any
// float dtype), writes `out` (the same tensors in place, others out of place) and model_params
// (empty, or the new params rounded to each one's dtype); or, with `updates` (fp32), writes
// new_p - p there instead of the params (the step term alone without params). Op::element's
// arithmetic, element by element, so in place and out of place give the same bits.
template <class Op>
void optim_pass(const OptimLists& in, const Tensors& grads, const OptimLists& out, const Tensors& model_params,
                const Tensors* updates, const typename Op::Scalars& c);

// outs[i] = fp32(params[i]) + fp32(updates[i]), rounded once to outs[i]'s dtype (params' dtype).
void apply_updates(const Tensors& params, const Tensors& updates,
                   const Tensors& outs);

// outs[i] = ins[i], bit for bit (same dtype and numel): the skipped out-of-place step.
void copy(const Tensors& ins, const Tensors& outs);

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
