// The one torch glue file of ampfunc: implementations of the ops that ampfunc/ops.py defines
// (schemas, fake kernels and the plain-torch reference live there, so the ops exist even when
// this extension is not built). This file validates arguments (errors name the argument and
// the index of the tensor at fault), makes non-contiguous tensors contiguous (and writes the
// results back), and dispatches CPU tensors to ext/cpu/kernels.cpp and, when built with
// AMPFUNC_WITH_CUDA, CUDA tensors to the raw-pointer launchers of ext/cuda/ampfunc_cuda.h.
//
// Nothing here reads a CUDA tensor back to the host: flags, scales and step counters are
// passed to the CUDA launchers as device pointers. On the CPU they are plain memory.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/kernels.h"

#ifdef AMPFUNC_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/ampfunc_cuda.h"
#endif

namespace {

using ampfunc::Tensors;
using at::Tensor;
using at::TensorList;

bool kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// ---------------------------------------------------------------------------------------------
// validation: every check runs before the first write, so a refused call changes nothing.
//
// Messages have one stable, parseable form, mirrored word for word by ampfunc/ops.py's
// reference path (so both backends raise the same error type and text):
//   "ampfunc: <list>[<index>] <what is wrong> (<op>)"
// ValueError for counts, shapes, devices and overlapping memory; TypeError for dtypes and
// layouts. The engine maps <list>[<index>] back to a leaf path on the error path only.
// ---------------------------------------------------------------------------------------------

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string device_str(const at::Device& d) { return d.str(); }

std::string layout_str(at::Layout l) {
  switch (l) {
    case at::kStrided: return "torch.strided";
    case at::kSparse: return "torch.sparse_coo";
    case at::kSparseCsr: return "torch.sparse_csr";
    case at::kSparseCsc: return "torch.sparse_csc";
    case at::kSparseBsr: return "torch.sparse_bsr";
    case at::kSparseBsc: return "torch.sparse_bsc";
    case at::kMkldnn: return "torch._mkldnn";
    default: return "torch.jagged";
  }
}

std::string item_name(const char* list, int64_t i) {
  return i < 0 ? std::string(list) : std::string(list) + "[" + std::to_string(i) + "]";
}

enum class Dt { kAny, kFp32, kAnyOr64 };  // f32/f16/bf16; f32 only; f32/f16/bf16/f64

const char* dt_words(Dt d) {
  switch (d) {
    case Dt::kFp32: return "float32";
    case Dt::kAnyOr64: return "float32, float16, bfloat16 or float64";
    default: return "float32, float16 or bfloat16";
  }
}

bool dt_ok(Dt d, at::ScalarType t) {
  switch (d) {
    case Dt::kFp32: return t == at::kFloat;
    case Dt::kAnyOr64: return kernel_dtype(t) || t == at::kDouble;
    default: return kernel_dtype(t);
  }
}

// One list of a call: its name in the schema, the dtypes it takes, whether the op writes it.
struct ListSpec {
  // Refers to the caller's list (no copy of its 10,000 pointers and descriptors)...
  ListSpec(const char* n, const Tensors& t, Dt d, bool w) : name(n), ts(t), dt(d), written(w) {}
  // ...or, given a TensorList (the CUDA glue), owns its Tensors view.
  ListSpec(const char* n, at::TensorList t, Dt d, bool w)
      : name(n), owned(std::make_shared<const Tensors>(t)), ts(*owned), dt(d), written(w) {}
  const char* name;
  std::shared_ptr<const Tensors> owned;
  const Tensors& ts;
  Dt dt;
  bool written;
};

// Whether a strided tensor maps two of its elements to one memory location (an expand()ed or
// otherwise stride-0 view, or strides that interleave). Sufficient test: with the dims sorted by
// stride, each stride must step past the furthest offset the dims below it reach.
bool self_overlaps(const Tensor& t) {
  if (t.numel() <= 1 || t.is_contiguous()) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the furthest offset the dims below reach
  for (auto [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += stride * (size - 1);
  }
  return false;
}

struct Span {
  uintptr_t lo, hi;  // bytes [lo, hi)
  int order;         // position of the list in the call (ties broken by it, then by index)
  const char* name;
  int64_t idx;       // -1 for a 0-d argument (named without an index)
  const Tensor* t;   // the tensor: a strided one is compared element by element (see shared_in)
  bool contiguous;
};

void add_span(std::vector<Span>& spans, const Tensor& t, int order, const char* name, int64_t idx) {
  const int64_t numel = t.numel();
  if (numel == 0) return;
  int64_t last = numel - 1;  // offset of the last element, in elements (torch strides are >= 0)
  const bool contiguous = t.is_contiguous();
  if (!contiguous) {
    last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  }
  const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  spans.push_back({lo, lo + static_cast<uintptr_t>((last + 1) * t.element_size()), order, name, idx, &t, contiguous});
}

// The same from a list's descriptor when the tensor is contiguous (no read of the tensor itself).
void add_span(std::vector<Span>& spans, const Tensors& ts, size_t i, int order, const char* name) {
  const Tensors::Desc& d = ts.desc(i);
  if (!d.contiguous || d.data == nullptr) return add_span(spans, ts[i], order, name, static_cast<int64_t>(i));
  if (d.numel == 0) return;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(d.data);
  spans.push_back({lo, lo + static_cast<uintptr_t>(d.numel * static_cast<int64_t>(c10::elementSize(d.dtype))), order,
                   name, static_cast<int64_t>(i), &ts[i], true});
}

// The addresses of a strided tensor's elements (from byte `lo`) in units of `unit` bytes, or of
// every byte of each element when `unit` is 1 and the elements are wider: 1-d int64, host memory.
Tensor element_addresses(const Tensor& t, uintptr_t lo, int64_t unit) {
  const auto opts = at::TensorOptions().dtype(at::kLong);
  Tensor off = at::zeros({}, opts);
  for (int64_t d = 0; d < t.dim(); ++d) off = off.unsqueeze(-1) + at::arange(t.size(d), opts) * t.stride(d);
  const int64_t size = t.element_size();
  Tensor addr = off.flatten() * size + static_cast<int64_t>(lo);
  if (unit == size) return addr.div(unit, "floor");
  return (addr.unsqueeze(-1) + at::arange(size, opts)).flatten();
}

// Element addresses are sorted only for runs of up to this many elements (about 100 bytes of
// host memory per element); larger runs are decided from their layouts (by_layout).
constexpr int64_t kExactElements = int64_t{1} << 22;

// Whether a and b, of one element size, shape and strides (neither overlapping itself), share an
// element: whether their offset is a difference of two of a's element offsets, found dim by dim
// from the largest stride (each stride passes what the dims below reach: at most two candidates
// a dim). -1 when the offset is not whole elements. As ops._lattice_shares.
int lattice_shares(const Tensor& a, const Tensor& b) {
  const int64_t size = a.element_size();
  const int64_t gap = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data_ptr())) -
                      static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.data_ptr()));
  if (gap % size != 0) return -1;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size), ascending
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1) dims.emplace_back(a.stride(d), a.size(d));
  }
  std::sort(dims.begin(), dims.end());
  std::function<bool(int64_t, size_t)> reachable = [&](int64_t delta, size_t k) -> bool {
    if (k == 0) return delta == 0;
    const auto [stride, n] = dims[k - 1];
    int64_t below = 0;
    for (size_t e = 0; e + 1 < k; ++e) below += dims[e].first * (dims[e].second - 1);
    // floor division for negative numerators
    auto floordiv = [](int64_t x, int64_t y) { return x / y - ((x % y != 0) && ((x < 0) != (y < 0))); };
    const int64_t first = -floordiv(below - delta, stride), last = floordiv(delta + below, stride);
    for (int64_t c = std::max(first, 1 - n); c <= std::min(last, n - 1); ++c) {
      if (reachable(delta - c * stride, k - 1)) return true;
    }
    return false;
  };
  return reachable(gap / size, dims.size()) ? 1 : 0;
}

std::pair<const Span*, const Span*> by_layout(const Span* begin, const Span* end) {
  const Tensor& first = *begin->t;
  bool one_layout = true;
  for (const Span* s = begin; s != end && one_layout; ++s) {
    one_layout = s->t->element_size() == first.element_size() && s->t->sizes() == first.sizes() &&
                 s->t->strides() == first.strides() && !self_overlaps(*s->t);
  }
  if (!one_layout) return {begin, begin + 1};  // taken as overlapping, as the byte-range check took it
  for (const Span* a = begin; a != end; ++a) {
    for (const Span* b = a + 1; b != end; ++b) {
      if (lattice_shares(*a->t, *b->t) != 0) return {a, b};
    }
  }
  return {nullptr, nullptr};
}

// Of spans [begin, end) that chain into one run of memory, with a strided tensor among them:
// the first two that share a byte, element by element (the columns of one matrix share none,
// as torch allows), or nullptr/nullptr. As ops._shared_in.
std::pair<const Span*, const Span*> shared_in(const Span* begin, const Span* end) {
  int64_t total = 0;
  for (const Span* s = begin; s != end; ++s) total += s->t->numel();
  if (total > kExactElements) return by_layout(begin, end);
  const int64_t size = begin->t->element_size();
  int64_t unit = size;
  for (const Span* s = begin; s != end; ++s) {
    if (s->t->element_size() != size || s->lo % size != begin->lo % size) unit = 1;
  }
  std::vector<Tensor> addrs, owners;
  for (const Span* s = begin; s != end; ++s) {
    addrs.push_back(element_addresses(*s->t, s->lo, unit));
    owners.push_back(at::full({addrs.back().numel()}, static_cast<int64_t>(s - begin), at::kLong));
  }
  auto [sorted, order] = at::cat(addrs).sort(/*stable=*/true, 0, false);
  const Tensor owner = at::cat(owners).index_select(0, order);
  const int64_t n = sorted.numel();
  const int64_t* a = sorted.data_ptr<int64_t>();
  const int64_t* o = owner.data_ptr<int64_t>();
  for (int64_t j = 0; j + 1 < n; ++j) {
    if (a[j] == a[j + 1]) return {begin + o[j], begin + o[j + 1]};
  }
  return {nullptr, nullptr};
}

inline uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The set of spans the last call of this thread found disjoint, as two order-independent 64-bit
// fingerprints: an in-place step writes the same tensors every call, and a set already found
// disjoint is disjoint again, so the O(n log n) sort is paid once, not once per step.
struct DisjointCache {
  size_t n = 0;
  uint64_t sum = 0, xr = 0;
};
thread_local DisjointCache last_disjoint;

// Raises when two written tensors share memory: the spans sorted by start. Spans that do not
// intersect are disjoint; intersecting contiguous spans share bytes; where a strided tensor is
// among intersecting spans, their element addresses decide (shared_in).
void check_disjoint(const char* op, std::vector<Span>& spans) {
  if (spans.size() < 2) return;
  uint64_t sum = 0, xr = 0;
  for (const Span& s : spans) {
    uint64_t h = mix64(s.hi);
    if (!s.contiguous) {  // a strided tensor is judged by its elements: its layout is part of the set
      for (int64_t d = 0; d < s.t->dim(); ++d) h = mix64(h ^ mix64(s.t->size(d)) ^ (mix64(s.t->stride(d)) << 1));
      h = mix64(h ^ static_cast<uint64_t>(s.t->element_size()));
    }
    const uint64_t a = mix64(s.lo ^ h), b = mix64(a ^ 0x5851f42d4c957f2dULL);
    sum += a;
    xr ^= b;
  }
  if (spans.size() == last_disjoint.n && sum == last_disjoint.sum && xr == last_disjoint.xr) return;
  auto less = [](const Span& a, const Span& b) {
    return a.lo != b.lo ? a.lo < b.lo : (a.order != b.order ? a.order < b.order : a.idx < b.idx);
  };
  if (!std::is_sorted(spans.begin(), spans.end(), less)) std::sort(spans.begin(), spans.end(), less);
  auto refuse = [op](const Span* a, const Span* b) {
    if (b->order < a->order || (b->order == a->order && b->idx < a->idx)) std::swap(a, b);
    TORCH_CHECK_VALUE(false, "ampfunc: ", item_name(a->name, a->idx), " and ", item_name(b->name, b->idx),
                      " overlap in memory; the tensors an in-place op writes must be distinct (", op, ")");
  };
  // Runs of spans that chain (each starts before the furthest end so far): within a run of
  // contiguous tensors the first two share bytes; with a strided one among them, elements decide.
  size_t start = 0;
  uintptr_t hi = spans[0].hi;
  bool strided = !spans[0].contiguous;
  for (size_t k = 1; k <= spans.size(); ++k) {
    if (k < spans.size() && spans[k].lo < hi) {
      hi = std::max(hi, spans[k].hi);
      strided = strided || !spans[k].contiguous;
      continue;
    }
    if (k - start > 1) {
      if (!strided) refuse(&spans[start], &spans[start + 1]);
      auto [a, b] = shared_in(spans.data() + start, spans.data() + k);
      if (a != nullptr) refuse(a, b);
    }
    if (k < spans.size()) {
      start = k;
      hi = spans[k].hi;
      strided = !spans[k].contiguous;
    }
  }
  last_disjoint = {spans.size(), sum, xr};
}

void check_tensor(const char* op, const char* name, int64_t i, const Tensor& t, Dt dt, const at::Device& dev) {
  TORCH_CHECK_VALUE(t.defined(), "ampfunc: ", item_name(name, i), " is undefined (None) (", op, ")");
  // (is_sparse & co. read the dispatch key set inline; layout() costs a call per tensor)
  TORCH_CHECK_TYPE(!(t.is_sparse() || t.is_sparse_csr() || t.is_mkldnn()) || t.layout() == at::kStrided, "ampfunc: ",
                   item_name(name, i), " has layout ", layout_str(t.layout()), "; ampfunc takes dense (strided) tensors (",
                   op, ")");
  TORCH_CHECK_VALUE(!t.is_meta() || dev.is_meta(), "ampfunc: ", item_name(name, i),
                    " is on the meta device (it holds no data) (", op, ")");
  TORCH_CHECK_VALUE(t.device() == dev, "ampfunc: ", item_name(name, i), " is on ", device_str(t.device()),
                    " but the call's tensors are on ", device_str(dev), "; one device per call (", op, ")");
  TORCH_CHECK_TYPE(dt_ok(dt, t.scalar_type()), "ampfunc: ", item_name(name, i), " has dtype ",
                   dtype_str(t.scalar_type()), "; ", name, " take ", dt_words(dt), " (", op, ")");
}

// Loops over long lists of tensors are bound by memory latency, not work: each TensorImpl (and
// its storage) is a separate heap object, cold in cache on a 10,000-leaf tree. Asking for the
// one kPrefetch ahead while working on this one overlaps those misses.
constexpr size_t kPrefetch = 6;

inline void prefetch(const Tensors& ts, size_t i) {
  if (i + kPrefetch < ts.size()) {
    const char* impl = reinterpret_cast<const char*>(ts[i + kPrefetch].unsafeGetTensorImpl());
    __builtin_prefetch(impl);
    __builtin_prefetch(impl + 64);
    __builtin_prefetch(impl + 128);
  }
}

// Whether two descriptors have the same shape for sure (false: compare the tensors' sizes).
inline bool same_shape(const Tensors::Desc& a, const Tensors::Desc& b) {
  if (a.ndim < 0 || a.ndim != b.ndim) return false;
  for (int k = 0; k < a.ndim; ++k) {
    if (a.dims[k] != b.dims[k]) return false;
  }
  return true;
}

// The one validation of a list op: lists[0] is the reference list (its shapes are the ones the
// others must have); every tensor is defined, dense, on `dev`, of an accepted dtype; written
// tensors neither overlap themselves nor each other (nor the written 0-d `scalars`).
void validate(const char* op, const at::Device& dev, const std::vector<ListSpec>& lists,
              const std::vector<std::pair<const char*, const Tensor*>>& written_scalars = {}) {
  const ListSpec& ref = lists[0];
  // reused across calls: a 10,000-leaf step writes 40,000 spans, a fresh 1.6 MB vector (and its
  // page faults) each time otherwise
  thread_local std::vector<Span> spans;
  spans.clear();
  for (size_t l = 0; l < lists.size(); ++l) {
    const ListSpec& L = lists[l];
    TORCH_CHECK_VALUE(L.ts.size() == ref.ts.size(), "ampfunc: ", L.name, " has ", L.ts.size(), " tensors but ",
                      ref.name, " has ", ref.ts.size(), " (", op, ")");
  }
  bool any_written = !written_scalars.empty();
  // The descriptors decide; a tensor is looked at itself only when its descriptor does not
  // settle the question (then check_tensor raises the error naming it, or lets it pass).
  for (size_t i = 0; i < ref.ts.size(); ++i) {
    const Tensors::Desc& r = ref.ts.desc(i);
    for (size_t l = 0; l < lists.size(); ++l) {
      const ListSpec& L = lists[l];
      const Tensors::Desc& d = L.ts.desc(i);
      if (!(d.dense && d.device == dev && dt_ok(L.dt, d.dtype) && (d.data != nullptr || d.numel == 0))) {
        check_tensor(op, L.name, static_cast<int64_t>(i), L.ts[i], L.dt, dev);
        TORCH_CHECK_VALUE(d.data != nullptr || d.numel == 0 || dev.is_meta(), "ampfunc: ", item_name(L.name, i),
                          " has no data (a tensor without storage) (", op, ")");
      }
      if (l > 0 && !same_shape(d, r)) {
        const Tensor& t = L.ts[i];
        TORCH_CHECK_VALUE(t.sizes() == ref.ts[i].sizes(), "ampfunc: ", L.name, "[", i, "] has shape ",
                          shape_str(t.sizes()), " but ", ref.name, "[", i, "] has shape ",
                          shape_str(ref.ts[i].sizes()), " (", op, ")");
      }
      if (L.written) {
        // torch refuses it too, but only after the tensors before it were written
        TORCH_CHECK_VALUE(!d.inference || c10::InferenceMode::is_enabled(), "ampfunc: ", item_name(L.name, i),
                          " is an inference tensor (made under torch.inference_mode()); an in-place op cannot ",
                          "update it outside inference mode: pass a copy made outside it (", op, ")");
        TORCH_CHECK_VALUE(d.contiguous || !self_overlaps(L.ts[i]), "ampfunc: ", L.name, "[", i,
                          "] has elements that share memory (an expand()ed or stride-0 view); an in-place op ",
                          "needs distinct elements: clone it (", op, ")");
        add_span(spans, L.ts, i, static_cast<int>(l), L.name);
        any_written = true;
      }
    }
  }
  if (!any_written) return;
  for (size_t k = 0; k < written_scalars.size(); ++k) {
    add_span(spans, *written_scalars[k].second, static_cast<int>(lists.size() + k), written_scalars[k].first, -1);
  }
  check_disjoint(op, spans);
}

void check_scalar(const char* op, const char* what, const Tensor& t, at::ScalarType dtype, const at::Device& dev) {
  TORCH_CHECK_VALUE(t.defined() && t.numel() == 1, "ampfunc: ", what, " must be a one-element tensor (", op, ")");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, "ampfunc: ", what, " has layout ", layout_str(t.layout()),
                   "; ampfunc takes dense (strided) tensors (", op, ")");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "ampfunc: ", what, " has dtype ", dtype_str(t.scalar_type()),
                   "; expected ", dtype_str(dtype), " (", op, ")");
  TORCH_CHECK_VALUE(t.device() == dev, "ampfunc: ", what, " is on ", device_str(t.device()),
                    " but the call's tensors are on ", device_str(dev), "; one device per call (", op, ")");
}

// Contiguous working copies of a list, borrowed where the tensor is contiguous already; the
// ones that had to be copied are written back by write_back() (for the lists a kernel updates in
// place). The copies live in a deque, which never moves its elements, so `tensors` may point at them.
struct Work {
  Tensors tensors;
  std::deque<Tensor> owned;
  std::vector<std::pair<const Tensor*, const Tensor*>> copies;  // (original, contiguous copy)
  explicit Work(const Tensors& ts) {
    tensors.reserve(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      const Tensor& t = ts[i];
      if (ts.contiguous(i)) {  // the descriptor: no read of the (cold) tensor itself
        tensors.push_back(&t, ts.desc(i));
      } else {
        owned.push_back(t.contiguous());
        tensors.push_back(&owned.back());
        copies.emplace_back(&t, &owned.back());
      }
    }
  }
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  void write_back() {
    for (auto& oc : copies) oc.first->copy_(*oc.second);
  }
};

at::Device device_of(TensorList ts, const Tensor& fallback) {
  return ts.empty() ? fallback.device() : ts[0].device();
}

// ---------------------------------------------------------------------------------------------
// The CPU output pool
// ---------------------------------------------------------------------------------------------
//
// The out-of-place kernels (the pure step and update, apply_updates, unscale) write every
// output into a new tensor, and the caller drops the previous step's tensors of the same sizes
// right after. Through the system allocator that memory often goes back to the kernel (glibc
// trims its heap top and unmaps large blocks), so each step faults in and zero-fills fresh
// pages: for 10,000 leaves of 6 KB about 2 us per output tensor, more than the kernel's own
// work on it. The pool keeps the blocks of dead outputs, by exact size, and hands them to the
// next step's outputs. It only ever holds memory that our outputs held before; it gives blocks
// back to the system beyond AMPFUNC_CPU_POOL_MB (default 2048; 0 turns the pool off) and on
// ampfunc.ops.empty_cache(). Tensors from it are ordinary CPU tensors (resizable; a resize
// takes a new block from the pool).
class OutputPool final : public c10::Allocator {
 public:
  static constexpr size_t kHeader = 64;  // block size stored in front of the data, alignment kept

  OutputPool() : limit_(limit_from_env()) {}

  // AMPFUNC_CPU_POOL_MB: a whole number of MB, as ampfunc._build.cpu_pool_mb accepts (it refuses
  // a bad value by name before the library loads; this covers one set after loading). strtoull
  // read "2G" as 2, "abc" as 0 (pool off), "-1" as 2^64-1 and wrapped large values: anything
  // but digits, or more MB than pool_stats' int64 holds in bytes, keeps the default, with a warning.
  static size_t limit_from_env() {
    constexpr size_t kDefaultMb = 2048;
    const char* env = std::getenv("AMPFUNC_CPU_POOL_MB");
    if (!env) return kDefaultMb << 20;
    const std::string raw(env);
    const char* space = " \t\n\r\f\v";
    const size_t first = raw.find_first_not_of(space);
    if (first == std::string::npos) return kDefaultMb << 20;  // empty: the default
    const std::string digits = raw.substr(first, raw.find_last_not_of(space) - first + 1);
    constexpr size_t kMaxMb = static_cast<size_t>(std::numeric_limits<int64_t>::max()) >> 20;
    size_t mb = 0;
    bool ok = true;
    for (char c : digits) {
      const size_t d = static_cast<size_t>(c - '0');
      if (c < '0' || c > '9' || mb > (kMaxMb - d) / 10) {
        ok = false;
        break;
      }
      mb = mb * 10 + d;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "ampfunc: AMPFUNC_CPU_POOL_MB='%s' is not a whole number of megabytes (at most %zu); using "
                   "the default %zu MB (0 turns the CPU output pool off)\n",
                   env, kMaxMb, kDefaultMb);
      return kDefaultMb << 20;
    }
    return mb << 20;
  }

  bool enabled() const { return limit_ > 0; }

  c10::DataPtr allocate(size_t n) override {
    const size_t bytes = (std::max<size_t>(n, 1) + 63) & ~size_t{63};
    void* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        block = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (!block) {
      block = c10::alloc_cpu(bytes + kHeader);
      *static_cast<size_t*>(block) = bytes;
    }
    void* data = static_cast<char*>(block) + kHeader;
    return {data, data, &OutputPool::release, at::Device(at::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &OutputPool::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Frees every cached block; returns the bytes given back.
  size_t empty_cache() {
    std::unordered_map<size_t, std::vector<void*>> drop;
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(free_);
      bytes = cached_;
      cached_ = 0;
    }
    for (auto& [size, blocks] : drop) {
      for (void* b : blocks) c10::free_cpu(b);
    }
    return bytes;
  }

  std::tuple<int64_t, int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {static_cast<int64_t>(cached_), static_cast<int64_t>(limit_), hits_, misses_};
  }

  static OutputPool& get() {
    static OutputPool* pool = new OutputPool();  // never destroyed: tensors may die at exit
    return *pool;
  }

 private:
  static void release(void* data) {
    void* block = static_cast<char*>(data) - kHeader;
    const size_t bytes = *static_cast<size_t*>(block);
    OutputPool& pool = get();
    {
      std::lock_guard<std::mutex> lock(pool.mu_);
      if (pool.cached_ + bytes <= pool.limit_) {
        pool.free_[bytes].push_back(block);
        pool.cached_ += bytes;
        return;
      }
    }
    c10::free_cpu(block);
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_ = 0, limit_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

// A new contiguous CPU tensor for a kernel's output, from the pool.
Tensor pooled_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  OutputPool& pool = OutputPool::get();
  if (!pool.enabled()) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  return at::detail::empty_generic(sizes, &pool, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt);
}

// ---------------------------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------------------------

// The read-only pass of check / check_norm: (finite, sum of squares in double, per-leaf flags).
// With inv_scale the squares are of fp32(x * inv_scale), x judged for finiteness.
std::tuple<bool, double, Tensor> check_pass(const char* op, const Tensors& tensors, bool per_leaf,
                                            const Tensor* inv_scale) {
  const at::Device dev(at::kCPU);
  if (inv_scale) check_scalar(op, "inv_scale", *inv_scale, at::kFloat, dev);
  validate(op, dev, {{"tensors", tensors, Dt::kAnyOr64, false}});
  const float s = inv_scale ? inv_scale->item<float>() : 1.f;
  const int64_t n = static_cast<int64_t>(tensors.size());
  Tensor leaf = at::zeros({per_leaf ? n : 0}, at::TensorOptions().dtype(at::kBool));
  Tensors fast;
  std::deque<Tensor> copies;
  std::vector<int64_t> fast_idx;
  fast.reserve(n);
  if (per_leaf) fast_idx.reserve(n);
  bool finite = true;
  double sumsq = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& t = tensors[i];
    if (kernel_dtype(t.scalar_type())) {
      if (t.is_contiguous()) {
        fast.push_back(&t);
      } else {
        copies.push_back(t.contiguous());
        fast.push_back(&copies.back());
      }
      if (per_leaf) fast_idx.push_back(i);
    } else {  // float64: rare; plain ATen in double
      const bool ok = at::isfinite(t).all().item<bool>();
      finite = finite && ok;
      if (per_leaf && !ok) leaf[i].fill_(true);
      sumsq += (inv_scale ? t * static_cast<double>(s) : t).square().sum().item<double>();
    }
  }
  std::vector<uint8_t> flags(per_leaf ? fast.size() : 0, 0);
  const auto r = ampfunc::cpu::check(fast, per_leaf ? flags.data() : nullptr, inv_scale != nullptr, s);
  finite = finite && r.finite;
  sumsq += r.sumsq;
  if (per_leaf) {
    bool* lp = leaf.data_ptr<bool>();
    for (size_t k = 0; k < fast.size(); ++k) lp[fast_idx[k]] = flags[k] != 0;
  }
  return {finite, sumsq, leaf};
}

std::tuple<Tensor, Tensor, Tensor> check_cpu(const Tensors& tensors, bool per_leaf) {
  auto [finite, sumsq, leaf] = check_pass("check", tensors, per_leaf, nullptr);
  return {at::scalar_tensor(finite, at::kBool), at::scalar_tensor(static_cast<float>(sumsq), at::kFloat), leaf};
}

// The norm from the double sum: finite whenever every (unscaled) element is finite and the
// norm itself fits in fp32 -- the sum of squares may exceed fp32's range without harm.
std::tuple<Tensor, Tensor, Tensor> check_norm_cpu(const Tensors& tensors, const std::optional<Tensor>& inv_scale,
                                                  bool per_leaf) {
  const Tensor* inv = inv_scale.has_value() && inv_scale->defined() ? &*inv_scale : nullptr;
  auto [finite, sumsq, leaf] = check_pass("check_norm", tensors, per_leaf, inv);
  return {at::scalar_tensor(finite, at::kBool), at::scalar_tensor(static_cast<float>(std::sqrt(sumsq)), at::kFloat),
          leaf};
}

// float64 tensors (rare) take plain ATen here, with the reference's arithmetic: in place the
// product is taken in double; out of place the value is cast to fp32 first, then multiplied.
Tensor unscale__cpu(const Tensors& tensors, const Tensor& inv_scale) {
  const at::Device dev(at::kCPU);
  check_scalar("unscale_", "inv_scale", inv_scale, at::kFloat, dev);
  validate("unscale_", dev, {{"tensors", tensors, Dt::kAnyOr64, true}});
  Tensors fast;
  bool finite = true;
  for (const Tensor& t : tensors) {
    if (kernel_dtype(t.scalar_type())) {
      fast.push_back(&t);
    } else {
      finite = at::isfinite(t).all().item<bool>() && finite;
      t.mul_(static_cast<double>(inv_scale.item<float>()));
    }
  }
  Work w(fast);
  finite = ampfunc::cpu::unscale(w.tensors, w.tensors, inv_scale.item<float>()) && finite;
  w.write_back();
  return at::scalar_tensor(finite, at::kBool);
}

std::tuple<std::vector<Tensor>, Tensor> unscale_cpu(const Tensors& tensors, const Tensor& inv_scale) {
  const at::Device dev(at::kCPU);
  check_scalar("unscale", "inv_scale", inv_scale, at::kFloat, dev);
  validate("unscale", dev, {{"tensors", tensors, Dt::kAnyOr64, false}});
  std::vector<Tensor> outs;
  outs.reserve(tensors.size());  // never reallocates: fast_out points into it
  Tensors fast_in, fast_out;
  std::deque<Tensor> copies;
  bool finite = true;
  for (const Tensor& t : tensors) {
    if (kernel_dtype(t.scalar_type())) {
      outs.push_back(pooled_empty(t.sizes(), at::kFloat));
      if (t.is_contiguous()) {
        fast_in.push_back(&t);
      } else {
        copies.push_back(t.contiguous());
        fast_in.push_back(&copies.back());
      }
      fast_out.push_back(&outs.back());
    } else {
      Tensor o = t.to(at::kFloat);
      finite = at::isfinite(o).all().item<bool>() && finite;
      outs.push_back(o.mul_(inv_scale));
    }
  }
  finite = ampfunc::cpu::unscale(fast_in, fast_out, inv_scale.item<float>()) && finite;
  return {outs, at::scalar_tensor(finite, at::kBool)};
}

// The learning rate: the float, or the value of the 0-d fp32 tensor a schedule produced
// (read in place on the CPU; on CUDA the launchers read it on the device).
double lr_value(const char* op, double lr, const std::optional<Tensor>& lr_tensor, const at::Device& dev) {
  if (!lr_tensor.has_value() || !lr_tensor->defined()) return lr;
  check_scalar(op, "lr_tensor", *lr_tensor, at::kFloat, dev);
  return dev.is_cpu() ? static_cast<double>(lr_tensor->item<float>()) : lr;
}

// `inplace`: the op writes params, the state lists, model_params and step (else it only reads).
void check_sgd_args(const char* op, const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                    const Tensors& model_params, const Tensor& step, const Tensor& grad_scale, const Tensor& finite,
                    double momentum, const at::Device& dev, bool inplace) {
  check_scalar(op, "step", step, at::kFloat, dev);
  check_scalar(op, "grad_scale", grad_scale, at::kFloat, dev);
  check_scalar(op, "finite", finite, at::kBool, dev);
  std::vector<ListSpec> lists{{"params", params, Dt::kFp32, inplace}, {"grads", grads, Dt::kAny, false}};
  if (momentum != 0.0) lists.push_back({"momentum_buffers", momentum_buffers, Dt::kFp32, inplace});
  if (!model_params.empty()) lists.push_back({"model_params", model_params, Dt::kAny, inplace});
  if (inplace) {
    validate(op, dev, lists, {{"step", &step}});
  } else {
    validate(op, dev, lists);
  }
}

void check_adam_args(const char* op, const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                     const Tensors& exp_avg_sqs, const Tensors& max_exp_avg_sqs, const Tensors& model_params, const Tensor& step,
                     const Tensor& grad_scale, const Tensor& finite, bool amsgrad, const at::Device& dev,
                     bool inplace) {
  check_scalar(op, "step", step, at::kFloat, dev);
  check_scalar(op, "grad_scale", grad_scale, at::kFloat, dev);
  check_scalar(op, "finite", finite, at::kBool, dev);
  std::vector<ListSpec> lists{{"params", params, Dt::kFp32, inplace},
                              {"grads", grads, Dt::kAny, false},
                              {"exp_avgs", exp_avgs, Dt::kFp32, inplace},
                              {"exp_avg_sqs", exp_avg_sqs, Dt::kFp32, inplace}};
  if (amsgrad) lists.push_back({"max_exp_avg_sqs", max_exp_avg_sqs, Dt::kFp32, inplace});
  if (!model_params.empty()) lists.push_back({"model_params", model_params, Dt::kAny, inplace});
  if (inplace) {
    validate(op, dev, lists, {{"step", &step}});
  } else {
    validate(op, dev, lists);
  }
}

// New contiguous tensors shaped like `ts`, in `dtype` (else each one's), one pooled allocation each
// (the outputs of the out-of-place steps).
std::vector<Tensor> empty_like_list(const Tensors& ts, std::optional<at::ScalarType> dtype = std::nullopt) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(pooled_empty(t.sizes(), dtype.value_or(t.scalar_type())));
  return out;
}

// Whether the running call may hand back new state lists whose tensors share one block (the
// packed outputs below). Only eager calls set it (the direct door; ops._call around an eager
// torch.ops call on CUDA): a custom op that a compiled graph calls must return outputs that
// alias nothing, each other included (torch checks this at run time and will refuse it), so
// there every output is its own allocation.
thread_local bool t_pack_outputs = false;

struct PackOutputs {
  explicit PackOutputs(bool on) : prev(t_pack_outputs) { t_pack_outputs = on; }
  ~PackOutputs() { t_pack_outputs = prev; }
  PackOutputs(const PackOutputs&) = delete;
  PackOutputs& operator=(const PackOutputs&) = delete;
  bool prev;
};

// Contiguous tensors shaped like `ts`, of `meta`'s dtype and with `keys`, as views of `storage`,
// laid out in list order, each view starting at a multiple of `align` bytes (1: tiling exactly).
// Returns the bytes the layout needs when `storage` is null (the first of the two calls).
int64_t views_of(const c10::Storage* storage, const Tensors& ts, caffe2::TypeMeta meta, c10::DispatchKeySet keys,
                 int64_t align, std::vector<Tensor>* out) {
  const int64_t item = static_cast<int64_t>(meta.itemsize());
  int64_t at = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    at = (at + align - 1) / align * align;
    if (storage) {
      Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(*storage), keys, meta);
      c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      impl->set_sizes_contiguous(ts[i].sizes());
      impl->set_storage_offset(at / item);
      out->push_back(std::move(t));
    }
    at += ts.numel(i) * item;
  }
  return at;
}

// New contiguous tensors shaped like `ts`, in `dtype`, as views of ONE new storage (each view
// starting on a 64-byte line): the new optimizer state and the updates of the out-of-place
// steps. One allocation instead of one per leaf, and the next step reads each list as one run
// of memory rather than 10,000 runs scattered over the heap (what ampfunc.flat.zeros_packed
// does for the initial state). Each view is an ordinary tensor with its own version counter.
std::vector<Tensor> packed_empty_like(const Tensors& ts, at::ScalarType dtype) {
  std::vector<Tensor> out;
  if (ts.empty()) return out;
  if (!t_pack_outputs) return empty_like_list(ts, dtype);  // a compiled graph's call: one allocation each
  OutputPool& pool = OutputPool::get();
  const auto meta = caffe2::TypeMeta::fromScalarType(dtype);
  const c10::DispatchKeySet keys(c10::DispatchKey::CPU);
  const int64_t bytes = views_of(nullptr, ts, meta, keys, 64, nullptr);
  c10::Allocator* alloc = pool.enabled() ? static_cast<c10::Allocator*>(&pool) : c10::GetCPUAllocator();
  const c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, alloc, /*resizable=*/true);
  out.reserve(ts.size());
  views_of(&storage, ts, meta, keys, 64, &out);
  return out;
}

// The SGD kernel's scalars, in fp32: torch's fp32 kernels take SGD's scalar arguments so.
ampfunc::cpu::SgdHyper sgd_hyper(float grad_scale, double lr, double weight_decay, double momentum, double dampening,
                                 bool nesterov, bool maximize, bool first_step) {
  return {grad_scale, static_cast<float>(lr), static_cast<float>(weight_decay), static_cast<float>(momentum),
          static_cast<float>(1.0 - dampening), nesterov, maximize, first_step};
}

void sgd_step__cpu(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers, const Tensors& model_params,
                   const Tensor& step, const Tensor& grad_scale, const Tensor& finite, double lr,
                   const std::optional<Tensor>& lr_tensor, double weight_decay, double momentum, double dampening,
                   bool nesterov, bool maximize) {
  const at::Device dev(at::kCPU);
  check_sgd_args("sgd_step_", params, grads, momentum_buffers, model_params, step, grad_scale, finite, momentum, dev,
                 true);
  lr = lr_value("sgd_step_", lr, lr_tensor, dev);
  if (!finite.item<bool>()) return;  // the skipped step: nothing is written
  Work p(params), g(grads), b(momentum != 0.0 ? momentum_buffers : Tensors()), m(model_params);
  float* step_ptr = step.data_ptr<float>();
  const ampfunc::cpu::SgdHyper h =
      sgd_hyper(grad_scale.item<float>(), lr, weight_decay, momentum, dampening, nesterov, maximize, *step_ptr == 0.f);
  ampfunc::cpu::sgd_step(p.tensors, g.tensors, b.tensors, p.tensors, b.tensors, m.tensors, h);
  p.write_back();
  b.write_back();
  m.write_back();
  *step_ptr += 1.f;
}

void adam_step__cpu(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                    const Tensors& max_exp_avg_sqs, const Tensors& model_params, const Tensor& step,
                    const Tensor& grad_scale, const Tensor& finite, double lr,
                    const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                    double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev(at::kCPU);
  check_adam_args("adam_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                  grad_scale, finite, amsgrad, dev, true);
  lr = lr_value("adam_step_", lr, lr_tensor, dev);
  if (!finite.item<bool>()) return;  // the skipped step: nothing is written
  Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : Tensors()),
      m(model_params);
  float* step_ptr = step.data_ptr<float>();
  const float next_step = *step_ptr + 1.f;  // torch: step_t += 1 (fp32), then _get_value(step_t)
  ampfunc::cpu::AdamHyper h{grad_scale.item<float>(), lr, beta1, beta2, eps, weight_decay,
                            static_cast<double>(next_step), amsgrad, decoupled_weight_decay, maximize};
  const ampfunc::cpu::AdamLists state{p.tensors, m1.tensors, m2.tensors, vmax.tensors};
  ampfunc::cpu::adam_step(state, g.tensors, state, m.tensors, h);
  p.write_back();
  m1.write_back();
  m2.write_back();
  vmax.write_back();
  m.write_back();
  *step_ptr = next_step;
}

// The out-of-place steps: the same kernels with other destinations. Inputs are only read
// (non-contiguous ones through a contiguous copy); every output is a new contiguous tensor.
// A skipped step (finite false) copies the inputs to the outputs and returns the old step.

using SgdOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, Tensor>;

// The out-of-place SGD step, given `finite` (sgd_step) or checking the gradients in its pass
// (sgd_step_checked), as adam_step_out below.
std::pair<SgdOut, bool> sgd_step_out(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                                     const Tensors& model_params, const Tensor& step, const Tensor& grad_scale,
                                     const Tensor* finite, double lr, const std::optional<Tensor>& lr_tensor,
                                     double weight_decay, double momentum, double dampening, bool nesterov,
                                     bool maximize) {
  const at::Device dev(at::kCPU);
  const Tensor go = finite != nullptr ? Tensor() : at::scalar_tensor(true, at::kBool);
  check_sgd_args("sgd_step", params, grads, momentum_buffers, model_params, step, grad_scale,
                 finite != nullptr ? *finite : go, momentum, dev, false);
  lr = lr_value("sgd_step", lr, lr_tensor, dev);
  const Work p(params), g(grads), b(momentum != 0.0 ? momentum_buffers : Tensors()), m(model_params);
  std::vector<Tensor> p_out = empty_like_list(p.tensors), b_out = packed_empty_like(b.tensors, at::kFloat),
                      m_out = empty_like_list(m.tensors);
  const float old_step = step.item<float>(), gs = grad_scale.item<float>();
  bool applied = finite == nullptr || finite->item<bool>();
  if (applied) {
    const ampfunc::cpu::SgdHyper h =
        sgd_hyper(gs, lr, weight_decay, momentum, dampening, nesterov, maximize, old_step == 0.f);
    bool nonfinite = false;
    ampfunc::cpu::sgd_step(p.tensors, g.tensors, b.tensors, p_out, b_out, m_out, h,
                           finite == nullptr ? &nonfinite : nullptr);
    applied = finite != nullptr || (!nonfinite && !std::isnan(gs));
  }
  if (!applied) {  // the skipped step
    ampfunc::cpu::copy(p.tensors, p_out);
    ampfunc::cpu::copy(b.tensors, b_out);
    ampfunc::cpu::copy(m.tensors, m_out);
  }
  return {{p_out, b_out, m_out, at::scalar_tensor(applied ? old_step + 1.f : old_step, at::kFloat)}, applied};
}

SgdOut sgd_step_cpu(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers, const Tensors& model_params,
                    const Tensor& step, const Tensor& grad_scale, const Tensor& finite, double lr,
                    const std::optional<Tensor>& lr_tensor, double weight_decay, double momentum, double dampening,
                    bool nesterov, bool maximize) {
  return sgd_step_out(params, grads, momentum_buffers, model_params, step, grad_scale, &finite, lr, lr_tensor,
                      weight_decay, momentum, dampening, nesterov, maximize)
      .first;
}

using SgdCheckedOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, Tensor, Tensor>;

SgdCheckedOut sgd_step_checked_cpu(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers,
                                   const Tensors& model_params, const Tensor& step, const Tensor& grad_scale,
                                   double lr, const std::optional<Tensor>& lr_tensor, double weight_decay,
                                   double momentum, double dampening, bool nesterov, bool maximize) {
  auto [out, applied] = sgd_step_out(params, grads, momentum_buffers, model_params, step, grad_scale, nullptr, lr,
                                     lr_tensor, weight_decay, momentum, dampening, nesterov, maximize);
  return std::tuple_cat(std::move(out), std::make_tuple(at::scalar_tensor(applied, at::kBool)));
}

using AdamOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                           std::vector<Tensor>, Tensor>;

// The out-of-place Adam step. Given `finite` (adam_step): the kernel runs when it is true; on a
// skipped step the outputs are copies of the inputs and the step count stays. Without it
// (adam_step_checked): the finiteness check of the gradients (check()'s flag) runs in the
// optimizer's pass instead of a pass of its own, since the inputs survive an out-of-place step
// (the pure steps without clipping need no norm first); the step is applied when every
// gradient element is finite and grad_scale is not NaN, else the outputs are overwritten with
// copies of the inputs -- the outputs and flag of check() followed by adam_step(), bit for bit.
// Only the direct door serves the checked form; elsewhere ops.adam_step_checked composes the ops.
std::pair<AdamOut, bool> adam_step_out(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                                       const Tensors& exp_avg_sqs, const Tensors& max_exp_avg_sqs,
                                       const Tensors& model_params, const Tensor& step, const Tensor& grad_scale,
                                       const Tensor* finite, double lr, const std::optional<Tensor>& lr_tensor,
                                       double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
                                       bool decoupled_weight_decay, bool maximize) {
  const at::Device dev(at::kCPU);
  const Tensor go = finite != nullptr ? Tensor() : at::scalar_tensor(true, at::kBool);
  check_adam_args("adam_step", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                  grad_scale, finite != nullptr ? *finite : go, amsgrad, dev, false);
  lr = lr_value("adam_step", lr, lr_tensor, dev);
  const Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : Tensors()),
      m(model_params);
  std::vector<Tensor> p_out = empty_like_list(p.tensors), m1_out = packed_empty_like(m1.tensors, at::kFloat),
                      m2_out = packed_empty_like(m2.tensors, at::kFloat),
                      vmax_out = packed_empty_like(vmax.tensors, at::kFloat), m_out = empty_like_list(m.tensors);
  const float old_step = step.item<float>(), gs = grad_scale.item<float>();
  const float next_step = old_step + 1.f;  // torch: step_t += 1 (fp32), then _get_value(step_t)
  bool applied = finite == nullptr || finite->item<bool>();
  if (applied) {
    ampfunc::cpu::AdamHyper h{gs, lr, beta1, beta2, eps, weight_decay, static_cast<double>(next_step), amsgrad,
                              decoupled_weight_decay, maximize};
    bool nonfinite = false;
    ampfunc::cpu::adam_step({p.tensors, m1.tensors, m2.tensors, vmax.tensors}, g.tensors,
                            {p_out, m1_out, m2_out, vmax_out}, m_out, h, finite == nullptr ? &nonfinite : nullptr);
    applied = finite != nullptr || (!nonfinite && !std::isnan(gs));
  }
  if (!applied) {  // the skipped step
    for (auto [src, dst] : {std::pair{&p.tensors, &p_out}, {&m1.tensors, &m1_out}, {&m2.tensors, &m2_out},
                            {&vmax.tensors, &vmax_out}, {&m.tensors, &m_out}}) {
      ampfunc::cpu::copy(*src, *dst);
    }
  }
  return {{p_out, m1_out, m2_out, vmax_out, m_out, at::scalar_tensor(applied ? next_step : old_step, at::kFloat)},
          applied};
}

AdamOut adam_step_cpu(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                      const Tensors& max_exp_avg_sqs, const Tensors& model_params, const Tensor& step,
                      const Tensor& grad_scale, const Tensor& finite, double lr,
                      const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                      double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  return adam_step_out(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, &finite,
                       lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize)
      .first;
}

using AdamCheckedOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                                  std::vector<Tensor>, Tensor, Tensor>;

AdamCheckedOut adam_step_checked_cpu(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
                                     const Tensors& exp_avg_sqs, const Tensors& max_exp_avg_sqs,
                                     const Tensors& model_params, const Tensor& step, const Tensor& grad_scale,
                                     double lr, const std::optional<Tensor>& lr_tensor, double beta1, double beta2,
                                     double eps, double weight_decay, bool amsgrad, bool decoupled_weight_decay,
                                     bool maximize) {
  auto [out, applied] = adam_step_out(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                                      grad_scale, nullptr, lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad,
                                      decoupled_weight_decay, maximize);
  return std::tuple_cat(std::move(out), std::make_tuple(at::scalar_tensor(applied, at::kBool)));
}

// The pure optimizers' updates (optax form): new tensors `updates` (fp32) and new state; the
// inputs are only read. `params` may be empty when weight_decay == 0 (the update does not need
// them); then grads give the shapes.

void check_update_args(const char* op, const Tensors& params, const Tensors& grads, std::vector<ListSpec> state,
                       const Tensor& step, const Tensor& grad_scale, double weight_decay, const at::Device& dev) {
  check_scalar(op, "step", step, at::kFloat, dev);
  check_scalar(op, "grad_scale", grad_scale, at::kFloat, dev);
  TORCH_CHECK_VALUE(!params.empty() || grads.empty() || weight_decay == 0.0, "ampfunc: weight_decay != 0 needs ",
                    "params (", op, ")");
  std::vector<ListSpec> lists;
  if (!params.empty()) lists.push_back({"params", params, Dt::kFp32, false});
  lists.push_back({"grads", grads, Dt::kAny, false});
  for (auto& l : state) lists.push_back(l);
  validate(op, dev, lists);
}

using SgdUpdateOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, Tensor>;

SgdUpdateOut sgd_update_cpu(const Tensors& params, const Tensors& grads, const Tensors& momentum_buffers, const Tensor& step,
                            const Tensor& grad_scale, double lr, const std::optional<Tensor>& lr_tensor,
                            double weight_decay, double momentum, double dampening, bool nesterov, bool maximize) {
  const at::Device dev(at::kCPU);
  const bool has_buf = momentum != 0.0;
  std::vector<ListSpec> state;
  if (has_buf) state.push_back({"momentum_buffers", momentum_buffers, Dt::kFp32, false});
  check_update_args("sgd_update", params, grads, state, step, grad_scale, weight_decay, dev);
  lr = lr_value("sgd_update", lr, lr_tensor, dev);
  const Work p(params), g(grads), b(has_buf ? momentum_buffers : Tensors());
  std::vector<Tensor> d_out = packed_empty_like(g.tensors, at::kFloat);
  std::vector<Tensor> b_out = packed_empty_like(b.tensors, at::kFloat);
  const float old_step = step.item<float>();
  ampfunc::cpu::SgdHyper h{grad_scale.item<float>(),
                           static_cast<float>(lr),
                           static_cast<float>(weight_decay),
                           static_cast<float>(momentum),
                           static_cast<float>(1.0 - dampening),
                           nesterov,
                           maximize,
                           // as the generic update: the formula from the zero buffer unless dampening
                           dampening != 0.0 && old_step == 0.f};
  ampfunc::cpu::sgd_update(p.tensors, g.tensors, b.tensors, b_out, d_out, h);
  return {d_out, b_out, at::scalar_tensor(old_step + 1.f, at::kFloat)};
}

using AdamUpdateOut = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                                 Tensor>;

AdamUpdateOut adam_update_cpu(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs, const Tensors& exp_avg_sqs,
                              const Tensors& max_exp_avg_sqs, const Tensor& step, const Tensor& grad_scale, double lr,
                              const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                              double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev(at::kCPU);
  std::vector<ListSpec> state{{"exp_avgs", exp_avgs, Dt::kFp32, false}, {"exp_avg_sqs", exp_avg_sqs, Dt::kFp32, false}};
  if (amsgrad) state.push_back({"max_exp_avg_sqs", max_exp_avg_sqs, Dt::kFp32, false});
  check_update_args("adam_update", params, grads, state, step, grad_scale, weight_decay, dev);
  const bool lr_is_tensor = lr_tensor.has_value() && lr_tensor->defined();
  lr = lr_value("adam_update", lr, lr_tensor, dev);
  const Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : Tensors());
  std::vector<Tensor> d_out = packed_empty_like(g.tensors, at::kFloat);
  std::vector<Tensor> m1_out = packed_empty_like(m1.tensors, at::kFloat),
                      m2_out = packed_empty_like(m2.tensors, at::kFloat),
                      vmax_out = packed_empty_like(vmax.tensors, at::kFloat);
  const float next_step = step.item<float>() + 1.f;
  ampfunc::cpu::AdamHyper h{grad_scale.item<float>(), lr, beta1, beta2, eps, weight_decay,
                            static_cast<double>(next_step), amsgrad, decoupled_weight_decay, maximize, lr_is_tensor};
  const std::vector<Tensor> none;
  ampfunc::cpu::adam_update({p.tensors, m1.tensors, m2.tensors, vmax.tensors}, g.tensors,
                            {none, m1_out, m2_out, vmax_out}, d_out, h);
  return {d_out, m1_out, m2_out, vmax_out, at::scalar_tensor(next_step, at::kFloat)};
}

// params + updates, one pass, each result in its param's dtype (the sum in fp32, rounded once).
std::vector<Tensor> apply_updates_cpu(const Tensors& params, const Tensors& updates) {
  const at::Device dev(at::kCPU);
  validate("apply_updates", dev, {{"params", params, Dt::kAny, false}, {"updates", updates, Dt::kAny, false}});
  const Work p(params), u(updates);
  std::vector<Tensor> outs = empty_like_list(p.tensors);
  ampfunc::cpu::apply_updates(p.tensors, u.tensors, outs);
  return outs;
}

void check_scale_args(const Tensor& scale, const Tensor& growth_tracker, const Tensor& hysteresis_tracker,
                      const Tensor& finite, int64_t growth_interval, int64_t hysteresis) {
  const at::Device dev = scale.device();
  check_scalar("update_scale_", "scale", scale, at::kFloat, dev);
  check_scalar("update_scale_", "growth_tracker", growth_tracker, at::kInt, dev);
  check_scalar("update_scale_", "hysteresis_tracker", hysteresis_tracker, at::kInt, dev);
  check_scalar("update_scale_", "finite", finite, at::kBool, dev);
  TORCH_CHECK(growth_interval >= 1, "ampfunc.update_scale_: growth_interval must be >= 1, got ", growth_interval);
  TORCH_CHECK(hysteresis >= 1, "ampfunc.update_scale_: hysteresis must be >= 1, got ", hysteresis);
}

void update_scale__cpu(const Tensor& scale, const Tensor& growth_tracker, const Tensor& hysteresis_tracker,
                       const Tensor& finite, double growth_factor, double backoff_factor, int64_t growth_interval,
                       double min_scale, double max_scale, int64_t hysteresis) {
  check_scale_args(scale, growth_tracker, hysteresis_tracker, finite, growth_interval, hysteresis);
  ampfunc::cpu::update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                             hysteresis_tracker.data_ptr<int32_t>(), finite.item<bool>(),
                             {growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis});
}

// ---------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------

#ifdef AMPFUNC_WITH_CUDA

// The launchers' signatures and meanings this glue was written for (ext/cuda/ampfunc_cuda.h).
static_assert(AMPFUNC_CUDA_ABI_VERSION == 3, "ext/cuda/ampfunc_cuda.h changed its ABI: update the CUDA glue");

int cuda_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return AMPFUNC_FP32;
    case at::kHalf: return AMPFUNC_FP16;
    case at::kBFloat16: return AMPFUNC_BF16;
    default: TORCH_CHECK(false, "ampfunc: unsupported dtype ", t);
  }
}

void cuda_ok(const char* op, int status) {
  TORCH_CHECK(status == 0, "ampfunc.", op, " (CUDA): ", ampfunc_cuda_error_string(status));
}

// Leaves grouped by (dtype of list A, dtype of list B); indices in call order.
template <typename Key>
std::vector<std::pair<Key, std::vector<int64_t>>> group_by(int64_t n, const std::function<Key(int64_t)>& key) {
  std::vector<std::pair<Key, std::vector<int64_t>>> groups;
  for (int64_t i = 0; i < n; ++i) {
    const Key k = key(i);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
    if (it == groups.end()) groups.push_back({k, {i}}); else it->second.push_back(i);
  }
  return groups;
}

// Pointer arrays of a group of leaves across several lists, with runs of leaves that are
// adjacent in memory in every list (views tiling one flat buffer) merged into one entry, so a
// flat buffer is one leaf for the launcher whatever the number of views.
struct Packed {
  std::vector<std::vector<void*>> ptrs;  // per list
  std::vector<int64_t> numels;
};

Packed pack(const std::vector<const Tensors*>& lists, const std::vector<int64_t>& idx, bool merge) {
  Packed pk;
  pk.ptrs.resize(lists.size());
  for (int64_t i : idx) {
    const int64_t numel = (*lists[0])[i].numel();
    if (numel == 0) continue;
    bool adjacent = merge && !pk.numels.empty();
    for (size_t l = 0; adjacent && l < lists.size(); ++l) {
      const Tensor& t = (*lists[l])[i];
      char* end = static_cast<char*>(pk.ptrs[l].back()) + pk.numels.back() * t.element_size();
      adjacent = static_cast<char*>(t.data_ptr()) == end;
    }
    if (adjacent) {
      pk.numels.back() += numel;
    } else {
      for (size_t l = 0; l < lists.size(); ++l) pk.ptrs[l].push_back((*lists[l])[i].data_ptr());
      pk.numels.push_back(numel);
    }
  }
  return pk;
}

// The groups packed over `lists`, leaving out the groups whose leaves are all empty (they
// launch nothing, and their pointer arrays would be null).
template <typename Key>
std::vector<std::pair<Key, Packed>> packed_groups(const std::vector<const Tensors*>& lists,
                                                  const std::vector<std::pair<Key, std::vector<int64_t>>>& groups) {
  std::vector<std::pair<Key, Packed>> packs;
  for (const auto& [key, idx] : groups) {
    Packed pk = pack(lists, idx, true);
    if (!pk.numels.empty()) packs.emplace_back(key, std::move(pk));
  }
  return packs;
}

// The read-only pass of check / check_norm on CUDA: (finite, fp32 sum of squares or, with
// `norm`, the fp32 norm, per-leaf flags). The launcher sums without overflow while every value
// is finite and combines the dtype groups in double (a running sum at the front of the one
// workspace, shared by the groups' calls in stream order); its last call rounds the result.
std::tuple<Tensor, Tensor, Tensor> check_pass_cuda(const char* op, TensorList tensors, bool per_leaf,
                                                   const Tensor* inv_scale, bool norm) {
  TORCH_CHECK(!tensors.empty(), "ampfunc.check: empty list on CUDA");  // empty lists never reach here
  const at::Device dev = tensors[0].device();
  if (inv_scale) check_scalar(op, "inv_scale", *inv_scale, at::kFloat, dev);
  validate(op, dev, {{"tensors", tensors, Dt::kAnyOr64, false}});
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = static_cast<int64_t>(tensors.size());
  Work w(tensors);
  auto opts = at::TensorOptions().device(dev);
  Tensor finite = at::empty({}, opts.dtype(at::kBool));
  Tensor result = at::empty({}, opts.dtype(at::kFloat));
  Tensor leaf = at::zeros({per_leaf ? n : 0}, opts.dtype(at::kBool));
  auto groups = group_by<at::ScalarType>(n, [&](int64_t i) { return w.tensors[i].scalar_type(); });
  // float64 tensors (rare) take plain ATen on the device, in double, as on the CPU: their flag and
  // sum of squares start the accumulators the launchers then add to.
  std::optional<Tensor> ok64, sumsq64;
  for (const auto& [dtype, idx] : groups) {
    if (dtype != at::kDouble) continue;
    for (int64_t i : idx) {
      const Tensor& t = tensors[i];
      const Tensor ok = at::isfinite(t).all();
      if (per_leaf) leaf.narrow(0, i, 1).copy_(ok.logical_not().reshape({1}));
      const Tensor sq = (inv_scale ? t * inv_scale->to(at::kDouble) : t).square().sum();
      ok64 = ok64 ? ok64->logical_and(ok) : ok;
      sumsq64 = sumsq64 ? *sumsq64 + sq : sq;
    }
  }
  std::vector<std::pair<size_t, Packed>> packs;  // (index in groups, its pointers)
  int64_t ws_bytes = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (groups[gi].first == at::kDouble) continue;
    Packed pk = pack({&w.tensors}, groups[gi].second, /*merge=*/!per_leaf);
    if (pk.numels.empty()) continue;
    ws_bytes = std::max(ws_bytes, ampfunc_cuda_check_workspace_bytes(static_cast<int>(pk.numels.size()),
                                                                      pk.numels.data()));
    packs.emplace_back(gi, std::move(pk));
  }
  if (packs.empty()) {  // every tensor was empty or float64
    if (ok64) {
      finite.copy_(*ok64);
      result.copy_(norm ? sumsq64->sqrt() : *sumsq64);
    } else {
      finite.fill_(true);
      result.zero_();
    }
    return {finite, result, leaf};
  }
  // [double running sum][the partials of one group's call]: at::empty's blocks are 8-byte aligned.
  Tensor ws = at::empty({static_cast<int64_t>(sizeof(double)) + ws_bytes}, opts.dtype(at::kByte));
  double* sumsq = reinterpret_cast<double*>(ws.data_ptr());
  if (ok64) {  // the launchers accumulate onto the float64 part (device copies: no host sync)
    finite.copy_(*ok64);
    ws.narrow(0, 0, sizeof(double)).view(at::kDouble).copy_(sumsq64->reshape({1}));
  }
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [gi, pk] = packs[k];
    const auto& [dtype, idx] = groups[gi];
    const bool last = k + 1 == packs.size();
    const int m = static_cast<int>(pk.numels.size());
    Tensor group_leaf = per_leaf ? at::empty({m}, opts.dtype(at::kBool)) : Tensor();
    cuda_ok(op, ampfunc_cuda_check(m, pk.ptrs[0].data(), pk.numels.data(), cuda_dtype(dtype),
                                   inv_scale ? inv_scale->data_ptr<float>() : nullptr,
                                   reinterpret_cast<uint8_t*>(finite.data_ptr<bool>()), sumsq,
                                   last && !norm ? result.data_ptr<float>() : nullptr,
                                   last && norm ? result.data_ptr<float>() : nullptr,
                                   per_leaf ? reinterpret_cast<uint8_t*>(group_leaf.data_ptr<bool>()) : nullptr,
                                   sumsq + 1, ws_bytes, k == 0 && !ok64 ? 0 : 1, stream.stream()));
    if (per_leaf) {
      // group_leaf holds the group's non-empty tensors in order: copied into `leaf` one run of
      // consecutive indices at a time (device-to-device slices: nothing from host memory, so the
      // op stays capturable in a CUDA graph; one run when the list has one dtype)
      int64_t j = 0;
      const int64_t count = static_cast<int64_t>(idx.size());
      for (int64_t a = 0; a < count;) {
        if (w.tensors[idx[a]].numel() == 0) {
          ++a;
          continue;
        }
        int64_t b = a + 1;
        while (b < count && idx[b] == idx[b - 1] + 1 && w.tensors[idx[b]].numel() > 0) ++b;
        leaf.narrow(0, idx[a], b - a).copy_(group_leaf.narrow(0, j, b - a));
        j += b - a;
        a = b;
      }
    }
  }
  return {finite, result, leaf};
}

std::tuple<Tensor, Tensor, Tensor> check_cuda(TensorList tensors, bool per_leaf) {
  return check_pass_cuda("check", tensors, per_leaf, nullptr, /*norm=*/false);
}

// The norm from the launcher's double sum: finite whenever every (unscaled) element is finite
// and the norm itself fits in fp32, as on the CPU.
std::tuple<Tensor, Tensor, Tensor> check_norm_cuda(TensorList tensors, const std::optional<Tensor>& inv_scale,
                                                   bool per_leaf) {
  const Tensor* inv = inv_scale.has_value() && inv_scale->defined() ? &*inv_scale : nullptr;
  return check_pass_cuda("check_norm", tensors, per_leaf, inv, /*norm=*/true);
}

Tensor unscale__cuda(TensorList tensors, const Tensor& inv_scale) {
  const at::Device dev = device_of(tensors, inv_scale);
  check_scalar("unscale_", "inv_scale", inv_scale, at::kFloat, dev);
  validate("unscale_", dev, {{"tensors", tensors, Dt::kAnyOr64, true}});
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Work w(tensors);
  Tensor finite = at::ones({}, at::TensorOptions().device(dev).dtype(at::kBool));
  auto groups = group_by<at::ScalarType>(w.tensors.size(), [&](int64_t i) { return w.tensors[i].scalar_type(); });
  for (auto& [dtype, idx] : groups) {
    if (dtype == at::kDouble) {  // rare: plain ATen on the device, the product in double (as on the CPU)
      for (int64_t i : idx) {
        const Tensor& t = w.tensors[i];  // the working copy of a strided one: write_back() below copies it back
        finite.logical_and_(at::isfinite(t).all());
        t.mul_(inv_scale.to(at::kDouble));
      }
      continue;
    }
    Packed pk = pack({&w.tensors}, idx, true);
    if (pk.numels.empty()) continue;
    cuda_ok("unscale_", ampfunc_cuda_unscale_(static_cast<int>(pk.numels.size()), pk.ptrs[0].data(),
                                              pk.numels.data(), cuda_dtype(dtype), inv_scale.data_ptr<float>(),
                                              reinterpret_cast<uint8_t*>(finite.data_ptr<bool>()), 1,
                                              stream.stream()));
  }
  w.write_back();
  return finite;
}

std::tuple<std::vector<Tensor>, Tensor> unscale_cuda(TensorList tensors, const Tensor& inv_scale) {
  const at::Device dev = device_of(tensors, inv_scale);
  check_scalar("unscale", "inv_scale", inv_scale, at::kFloat, dev);
  validate("unscale", dev, {{"tensors", tensors, Dt::kAnyOr64, false}});
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Work w(tensors);
  std::vector<Tensor> outs;
  for (const Tensor& t : tensors) outs.push_back(at::empty(t.sizes(), t.options().dtype(at::kFloat)));
  Tensor finite = at::ones({}, at::TensorOptions().device(dev).dtype(at::kBool));
  auto groups = group_by<at::ScalarType>(w.tensors.size(), [&](int64_t i) { return w.tensors[i].scalar_type(); });
  for (auto& [dtype, idx] : groups) {
    if (dtype == at::kDouble) {  // rare: plain ATen, cast to fp32 first, then multiplied (as on the CPU)
      for (int64_t i : idx) {
        outs[i].copy_(tensors[i]);
        finite.logical_and_(at::isfinite(outs[i]).all());
        outs[i].mul_(inv_scale);
      }
      continue;
    }
    const Tensors outs_v(outs);
    Packed pk = pack({&w.tensors, &outs_v}, idx, false);
    if (pk.numels.empty()) continue;
    cuda_ok("unscale", ampfunc_cuda_unscale(static_cast<int>(pk.numels.size()), pk.ptrs[0].data(), pk.ptrs[1].data(),
                                            pk.numels.data(), cuda_dtype(dtype), inv_scale.data_ptr<float>(),
                                            reinterpret_cast<uint8_t*>(finite.data_ptr<bool>()), 1, stream.stream()));
  }
  return {outs, finite};
}

void sgd_step__cuda(TensorList params, TensorList grads, TensorList momentum_buffers, TensorList model_params,
                    const Tensor& step, const Tensor& grad_scale, const Tensor& finite, double lr,
                    const std::optional<Tensor>& lr_tensor, double weight_decay, double momentum,
                    double dampening, bool nesterov, bool maximize) {
  const at::Device dev = device_of(params, step);
  lr_value("sgd_step_", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  check_sgd_args("sgd_step_", params, grads, momentum_buffers, model_params, step, grad_scale, finite, momentum,
                 dev, true);
  const bool has_buf = momentum != 0.0;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Work p(params), g(grads), b(has_buf ? momentum_buffers : TensorList()), m(model_params);
  const bool has_model = !m.tensors.empty();
  AmpfuncSgdHyper h{lr, momentum, dampening, weight_decay, nesterov ? 1 : 0, maximize ? 1 : 0};
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(p.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  std::vector<const Tensors*> lists{&p.tensors, &g.tensors};
  if (has_buf) lists.push_back(&b.tensors);
  if (has_model) lists.push_back(&m.tensors);
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    const int nn = static_cast<int>(pk.numels.size());
    cuda_ok("sgd_step_", ampfunc_cuda_sgd_step(
                             nn, pk.ptrs[1].data(), key.first, pk.ptrs[0].data(),
                             has_buf ? pk.ptrs[2].data() : nullptr, has_model ? pk.ptrs.back().data() : nullptr,
                             key.second, pk.numels.data(), grad_scale.data_ptr<float>(),
                             reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()), lr_ptr,
                             step.data_ptr<float>(), k + 1 == packs.size() ? 1 : 0, &h, stream.stream()));
  }
  if (packs.empty()) {  // no elements: only the step counter moves (when finite)
    step.add_(finite.to(at::kFloat).reshape(step.sizes()));
  }
  p.write_back();
  b.write_back();
  m.write_back();
}

void adam_step__cuda(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                     TensorList max_exp_avg_sqs, TensorList model_params, const Tensor& step,
                     const Tensor& grad_scale, const Tensor& finite, double lr,
                     const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                     double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev = device_of(params, step);
  lr_value("adam_step_", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  check_adam_args("adam_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                  grad_scale, finite, amsgrad, dev, true);
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : TensorList()),
      m(model_params);
  const bool has_model = !m.tensors.empty();
  AmpfuncAdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay ? 1 : 0, amsgrad ? 1 : 0,
                     maximize ? 1 : 0};
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(p.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  std::vector<const Tensors*> lists{&p.tensors, &g.tensors, &m1.tensors, &m2.tensors};
  if (amsgrad) lists.push_back(&vmax.tensors);
  if (has_model) lists.push_back(&m.tensors);
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    const int nn = static_cast<int>(pk.numels.size());
    cuda_ok("adam_step_", ampfunc_cuda_adam_step(
                              nn, pk.ptrs[1].data(), key.first, pk.ptrs[0].data(), pk.ptrs[2].data(),
                              pk.ptrs[3].data(), amsgrad ? pk.ptrs[4].data() : nullptr,
                              has_model ? pk.ptrs.back().data() : nullptr, key.second,
                              pk.numels.data(), grad_scale.data_ptr<float>(),
                              reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()), lr_ptr,
                              step.data_ptr<float>(), k + 1 == packs.size() ? 1 : 0, &h, stream.stream()));
  }
  if (packs.empty()) step.add_(finite.to(at::kFloat).reshape(step.sizes()));
  p.write_back();
  m1.write_back();
  m2.write_back();
  vmax.write_back();
  m.write_back();
}

// The pure steps and updates on CUDA: one pass each, the launchers' out-of-place and delta
// modes (ext/cuda/optim.cu), which run the in-place kernels' per-element code with other
// destinations. Inputs are only read (non-contiguous ones through a contiguous copy); every
// output is new and contiguous, never a copy of an input: new params one at::empty each, each
// new state list and the updates views of one block per list (packed_empty_like_cuda). A
// skipped step (finite false, decided on the device) writes the inputs to the outputs and the
// old step.

// New contiguous tensors on the tensors' device, shaped like `ts`, in `dtype` (else each one's).
std::vector<Tensor> empty_outputs(const Tensors& ts, std::optional<at::ScalarType> dtype = std::nullopt) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(at::empty(t.sizes(), t.options().dtype(dtype.value_or(t.scalar_type()))));
  return out;
}

// New contiguous tensors shaped like `ts`, in `dtype`, on their device, as views that tile ONE
// new block of the CUDA caching allocator exactly, in list order (no padding): the new optimizer
// state and the updates of the pure steps (new params stay separate tensors). One allocation per
// list instead of one per leaf, and since the views tile their block like ampfunc.flat's CUDA
// views, pack() merges a list of them back into one range wherever the other lists of the call
// are adjacent too (the next step reading this state, a flat buffer of gradients): 10,000
// leaves become a few launch entries, each starting at the block's (256-byte aligned) base,
// so the kernels' 16-byte vector loads hold for every chunk. A view not merged (gradients
// allocated one by one) that starts off a 16-byte boundary takes the kernels' scalar path for
// that leaf; padding each view to 16 bytes instead would split the ranges at every leaf whose
// size is not a multiple of 4 and break the merge with state laid out by ampfunc.flat. Each
// view is its own TensorImpl (its own version counter) sharing the block's storage.
std::vector<Tensor> packed_empty_like_cuda(const Tensors& ts, at::ScalarType dtype) {
  std::vector<Tensor> out;
  if (ts.empty()) return out;
  if (!t_pack_outputs) return empty_outputs(ts, dtype);  // not an eager call (see t_pack_outputs)
  const auto meta = caffe2::TypeMeta::fromScalarType(dtype);
  const c10::DispatchKeySet keys(c10::DispatchKey::CUDA);
  const int64_t bytes = views_of(nullptr, ts, meta, keys, 1, nullptr);
  const Tensor block = at::empty({bytes / static_cast<int64_t>(meta.itemsize())},
                                 at::TensorOptions().device(ts[0].device()).dtype(dtype));
  out.reserve(ts.size());
  views_of(&block.storage(), ts, meta, keys, 1, &out);
  return out;
}

SgdOut sgd_step_cuda(TensorList params, TensorList grads, TensorList momentum_buffers, TensorList model_params,
                     const Tensor& step, const Tensor& grad_scale, const Tensor& finite, double lr,
                     const std::optional<Tensor>& lr_tensor, double weight_decay, double momentum,
                     double dampening, bool nesterov, bool maximize) {
  const at::Device dev = device_of(params, step);
  check_sgd_args("sgd_step", params, grads, momentum_buffers, model_params, step, grad_scale, finite, momentum, dev,
                 false);
  lr_value("sgd_step", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  const bool has_buf = momentum != 0.0;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Work p(params), g(grads), b(has_buf ? momentum_buffers : TensorList()), m(model_params);
  std::vector<Tensor> p_out = empty_outputs(p.tensors), b_out = packed_empty_like_cuda(b.tensors, at::kFloat),
                      m_out = empty_outputs(m.tensors);
  Tensor step_out = at::empty(step.sizes(), step.options());
  const Tensors p_o(p_out), b_o(b_out), m_o(m_out);
  const bool has_model = !m.tensors.empty();
  AmpfuncSgdHyper h{lr, momentum, dampening, weight_decay, nesterov ? 1 : 0, maximize ? 1 : 0};
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(p.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  std::vector<const Tensors*> lists{&p.tensors, &g.tensors, &p_o};
  const size_t ib = lists.size();
  if (has_buf) lists.insert(lists.end(), {&b.tensors, &b_o});
  const size_t im = lists.size();
  if (has_model) lists.insert(lists.end(), {&m.tensors, &m_o});
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    cuda_ok("sgd_step", ampfunc_cuda_sgd_step_out(
                            static_cast<int>(pk.numels.size()), pk.ptrs[1].data(), key.first, pk.ptrs[0].data(),
                            has_buf ? pk.ptrs[ib].data() : nullptr, has_model ? pk.ptrs[im].data() : nullptr,
                            pk.ptrs[2].data(), has_buf ? pk.ptrs[ib + 1].data() : nullptr,
                            has_model ? pk.ptrs[im + 1].data() : nullptr, key.second, pk.numels.data(),
                            grad_scale.data_ptr<float>(), reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()),
                            lr_ptr, step.data_ptr<float>(), k + 1 == packs.size() ? step_out.data_ptr<float>() : nullptr,
                            &h, stream.stream()));
  }
  if (packs.empty()) {  // no elements: only the step counter moves (when finite)
    step_out.copy_(step).add_(finite.to(at::kFloat).reshape(step.sizes()));
  }
  return {p_out, b_out, m_out, step_out};
}

AdamOut adam_step_cuda(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                       TensorList max_exp_avg_sqs, TensorList model_params, const Tensor& step,
                       const Tensor& grad_scale, const Tensor& finite, double lr,
                       const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                       double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev = device_of(params, step);
  check_adam_args("adam_step", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                  grad_scale, finite, amsgrad, dev, false);
  lr_value("adam_step", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : TensorList()),
      m(model_params);
  std::vector<Tensor> p_out = empty_outputs(p.tensors), m1_out = packed_empty_like_cuda(m1.tensors, at::kFloat),
                      m2_out = packed_empty_like_cuda(m2.tensors, at::kFloat),
                      vmax_out = packed_empty_like_cuda(vmax.tensors, at::kFloat), m_out = empty_outputs(m.tensors);
  Tensor step_out = at::empty(step.sizes(), step.options());
  const Tensors p_o(p_out), m1_o(m1_out), m2_o(m2_out), vmax_o(vmax_out), m_o(m_out);
  const bool has_model = !m.tensors.empty();
  AmpfuncAdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay ? 1 : 0, amsgrad ? 1 : 0,
                     maximize ? 1 : 0};
  using Key = std::pair<int, int>;
  auto groups = group_by<Key>(p.tensors.size(), [&](int64_t i) {
    return Key{cuda_dtype(g.tensors[i].scalar_type()), has_model ? cuda_dtype(m.tensors[i].scalar_type()) : 0};
  });
  // 0 p, 1 g, 2 m1, 3 m2, 4 p_out, 5 m1_out, 6 m2_out, then (vmax, vmax_out), (model, model_out)
  std::vector<const Tensors*> lists{&p.tensors, &g.tensors, &m1.tensors, &m2.tensors, &p_o, &m1_o, &m2_o};
  const size_t iv = lists.size();
  if (amsgrad) lists.insert(lists.end(), {&vmax.tensors, &vmax_o});
  const size_t im = lists.size();
  if (has_model) lists.insert(lists.end(), {&m.tensors, &m_o});
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [key, pk] = packs[k];
    cuda_ok("adam_step", ampfunc_cuda_adam_step_out(
                             static_cast<int>(pk.numels.size()), pk.ptrs[1].data(), key.first, pk.ptrs[0].data(),
                             pk.ptrs[2].data(), pk.ptrs[3].data(), amsgrad ? pk.ptrs[iv].data() : nullptr,
                             has_model ? pk.ptrs[im].data() : nullptr, pk.ptrs[4].data(), pk.ptrs[5].data(),
                             pk.ptrs[6].data(), amsgrad ? pk.ptrs[iv + 1].data() : nullptr,
                             has_model ? pk.ptrs[im + 1].data() : nullptr, key.second, pk.numels.data(),
                             grad_scale.data_ptr<float>(), reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()),
                             lr_ptr, step.data_ptr<float>(),
                             k + 1 == packs.size() ? step_out.data_ptr<float>() : nullptr, &h, stream.stream()));
  }
  if (packs.empty()) step_out.copy_(step).add_(finite.to(at::kFloat).reshape(step.sizes()));
  return {p_out, m1_out, m2_out, vmax_out, m_out, step_out};
}

// The pure updates on CUDA: one pass writing updates = new_p - p (new_p as the in-place kernel
// computes it, then one fp32 subtraction) and the new state; without params, p is taken as 0,
// so the update is the step term (a -0.0 term comes out as +0.0). The numbers agree with the
// CPU kernels within fp32 rounding (the CUDA kernels' own order of operations), not bit for bit.

SgdUpdateOut sgd_update_cuda(TensorList params, TensorList grads, TensorList momentum_buffers, const Tensor& step,
                             const Tensor& grad_scale, double lr, const std::optional<Tensor>& lr_tensor,
                             double weight_decay, double momentum, double dampening, bool nesterov, bool maximize) {
  const at::Device dev = device_of(grads, step);
  const bool has_buf = momentum != 0.0;
  std::vector<ListSpec> state;
  if (has_buf) state.push_back({"momentum_buffers", momentum_buffers, Dt::kFp32, false});
  check_update_args("sgd_update", params, grads, state, step, grad_scale, weight_decay, dev);
  lr_value("sgd_update", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Work p(params), g(grads), b(has_buf ? momentum_buffers : TensorList());
  const bool has_p = !p.tensors.empty();
  std::vector<Tensor> d_out = packed_empty_like_cuda(g.tensors, at::kFloat),
                      b_out = packed_empty_like_cuda(b.tensors, at::kFloat);
  Tensor step_out = at::empty(step.sizes(), step.options());
  const Tensors d_o(d_out), b_o(b_out);
  AmpfuncSgdHyper h{lr, momentum, dampening, weight_decay, nesterov ? 1 : 0, maximize ? 1 : 0};
  auto groups = group_by<int>(g.tensors.size(), [&](int64_t i) { return cuda_dtype(g.tensors[i].scalar_type()); });
  std::vector<const Tensors*> lists{&g.tensors, &d_o};
  const size_t ip = lists.size();
  if (has_p) lists.push_back(&p.tensors);
  const size_t ib = lists.size();
  if (has_buf) lists.insert(lists.end(), {&b.tensors, &b_o});
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [grad_dtype, pk] = packs[k];
    cuda_ok("sgd_update", ampfunc_cuda_sgd_update(
                              static_cast<int>(pk.numels.size()), pk.ptrs[0].data(), grad_dtype,
                              has_p ? pk.ptrs[ip].data() : nullptr, has_buf ? pk.ptrs[ib].data() : nullptr,
                              pk.ptrs[1].data(), has_buf ? pk.ptrs[ib + 1].data() : nullptr, pk.numels.data(),
                              grad_scale.data_ptr<float>(), nullptr, lr_ptr, step.data_ptr<float>(),
                              k + 1 == packs.size() ? step_out.data_ptr<float>() : nullptr, &h, stream.stream()));
  }
  if (packs.empty()) step_out.copy_(step).add_(1.0);
  return {d_out, b_out, step_out};
}

AdamUpdateOut adam_update_cuda(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                               TensorList max_exp_avg_sqs, const Tensor& step, const Tensor& grad_scale, double lr,
                               const std::optional<Tensor>& lr_tensor, double beta1, double beta2, double eps,
                               double weight_decay, bool amsgrad, bool decoupled_weight_decay, bool maximize) {
  const at::Device dev = device_of(grads, step);
  std::vector<ListSpec> state{{"exp_avgs", exp_avgs, Dt::kFp32, false}, {"exp_avg_sqs", exp_avg_sqs, Dt::kFp32, false}};
  if (amsgrad) state.push_back({"max_exp_avg_sqs", max_exp_avg_sqs, Dt::kFp32, false});
  check_update_args("adam_update", params, grads, state, step, grad_scale, weight_decay, dev);
  lr_value("adam_update", lr, lr_tensor, dev);  // validates lr_tensor
  const float* lr_ptr = lr_tensor.has_value() && lr_tensor->defined() ? lr_tensor->data_ptr<float>() : nullptr;
  c10::cuda::CUDAGuard guard(dev);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const Work p(params), g(grads), m1(exp_avgs), m2(exp_avg_sqs), vmax(amsgrad ? max_exp_avg_sqs : TensorList());
  const bool has_p = !p.tensors.empty();
  std::vector<Tensor> d_out = packed_empty_like_cuda(g.tensors, at::kFloat),
                      m1_out = packed_empty_like_cuda(m1.tensors, at::kFloat),
                      m2_out = packed_empty_like_cuda(m2.tensors, at::kFloat),
                      vmax_out = packed_empty_like_cuda(vmax.tensors, at::kFloat);
  Tensor step_out = at::empty(step.sizes(), step.options());
  const Tensors d_o(d_out), m1_o(m1_out), m2_o(m2_out), vmax_o(vmax_out);
  AmpfuncAdamHyper h{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay ? 1 : 0, amsgrad ? 1 : 0,
                     maximize ? 1 : 0};
  auto groups = group_by<int>(g.tensors.size(), [&](int64_t i) { return cuda_dtype(g.tensors[i].scalar_type()); });
  // 0 g, 1 updates, 2 m1, 3 m2, 4 m1_out, 5 m2_out, then params, (vmax, vmax_out)
  std::vector<const Tensors*> lists{&g.tensors, &d_o, &m1.tensors, &m2.tensors, &m1_o, &m2_o};
  const size_t ip = lists.size();
  if (has_p) lists.push_back(&p.tensors);
  const size_t iv = lists.size();
  if (amsgrad) lists.insert(lists.end(), {&vmax.tensors, &vmax_o});
  auto packs = packed_groups(lists, groups);
  for (size_t k = 0; k < packs.size(); ++k) {
    const auto& [grad_dtype, pk] = packs[k];
    cuda_ok("adam_update", ampfunc_cuda_adam_update(
                               static_cast<int>(pk.numels.size()), pk.ptrs[0].data(), grad_dtype,
                               has_p ? pk.ptrs[ip].data() : nullptr, pk.ptrs[2].data(), pk.ptrs[3].data(),
                               amsgrad ? pk.ptrs[iv].data() : nullptr, pk.ptrs[1].data(), pk.ptrs[4].data(),
                               pk.ptrs[5].data(), amsgrad ? pk.ptrs[iv + 1].data() : nullptr, pk.numels.data(),
                               grad_scale.data_ptr<float>(), nullptr, lr_ptr, step.data_ptr<float>(),
                               k + 1 == packs.size() ? step_out.data_ptr<float>() : nullptr, &h, stream.stream()));
  }
  if (packs.empty()) step_out.copy_(step).add_(1.0);
  return {d_out, m1_out, m2_out, vmax_out, step_out};
}

// params + updates on CUDA with ATen: one multi-tensor launch (_foreach_add) for the fp32
// pairs, one fp32 add and rounding per leaf for the others.
std::vector<Tensor> apply_updates_cuda(TensorList params, TensorList updates) {
  if (params.empty()) return {};
  const at::Device dev = params[0].device();
  validate("apply_updates", dev, {{"params", params, Dt::kAny, false}, {"updates", updates, Dt::kAny, false}});
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Tensor> outs(params.size());
  std::vector<Tensor> p32, u32;
  std::vector<size_t> idx32;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].scalar_type() == at::kFloat && updates[i].scalar_type() == at::kFloat) {
      p32.push_back(params[i]);
      u32.push_back(updates[i]);
      idx32.push_back(i);
    } else {
      outs[i] = (params[i].to(at::kFloat) + updates[i].to(at::kFloat)).to(params[i].scalar_type());
    }
  }
  if (!p32.empty()) {
    auto sums = at::_foreach_add(p32, u32);
    for (size_t k = 0; k < idx32.size(); ++k) outs[idx32[k]] = sums[k];
  }
  return outs;
}

void update_scale__cuda(const Tensor& scale, const Tensor& growth_tracker, const Tensor& hysteresis_tracker,
                        const Tensor& finite, double growth_factor, double backoff_factor, int64_t growth_interval,
                        double min_scale, double max_scale, int64_t hysteresis) {
  check_scale_args(scale, growth_tracker, hysteresis_tracker, finite, growth_interval, hysteresis);
  c10::cuda::CUDAGuard guard(scale.device());
  cuda_ok("update_scale_", ampfunc_cuda_update_scale(
                               scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                               hysteresis_tracker.data_ptr<int32_t>(),
                               reinterpret_cast<const uint8_t*>(finite.data_ptr<bool>()), growth_factor,
                               backoff_factor, growth_interval, min_scale, max_scale, hysteresis,
                               c10::cuda::getCurrentCUDAStream().stream()));
}

#endif  // AMPFUNC_WITH_CUDA

// ---------------------------------------------------------------------------------------------
// The direct door: eager CPU calls without the dispatcher
// ---------------------------------------------------------------------------------------------
//
// torch.ops.ampfunc.X(...) boxes every tensor of every list into an IValue, unboxes it into a
// std::vector<Tensor> and runs the autograd and ADInplaceOrView fallbacks over each: about
// 0.35 us per tensor per list, 1.7 ms per list of 10,000 leaves, several times the kernel's own
// time on small leaves. The functions of the module below take the same arguments as the ops
// (lists as Python lists) and run the same CPU implementations, with the same validation and the
// same errors, borrowing the tensors from the Python objects (no reference counts touched).
//
// A call takes this door only when the dispatcher would have sent every tensor straight to the
// CPU kernel: every tensor a plain dense CPU tensor (no subclass with __torch_dispatch__, no
// functionalization, functorch or conjugate/negative views), no dispatch or function mode
// active, no thread-local dispatch keys included, and no tensor requiring grad under grad mode.
// Otherwise the function returns NotImplemented and ampfunc.ops calls the op. Written tensors
// get their version counters bumped as the ADInplaceOrView fallback would, and the call is
// recorded under the op's name for the profiler. The GIL is released during the kernel: each list
// is first copied into a tuple, which keeps its tensors alive whatever other threads do.
namespace direct {

namespace py = pybind11;

bool plain_cpu(const Tensor& t, bool grad_on = at::GradMode::is_enabled()) {
  static const c10::DispatchKeySet blocked({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                            c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Conjugate,
                                            c10::DispatchKey::Negative, c10::DispatchKey::ZeroTensor});
  // Grad mode first: under no_grad (every step) a view's autograd meta, a separate cold object,
  // is never read.
  return t.defined() && t.is_cpu() && t.layout() == at::kStrided && !t.key_set().has_any(blocked) &&
         !(grad_on && t.requires_grad());
}

// The positional arguments of one call, read in order; `ok` turns false at the first argument
// the direct door cannot take.
class Args {
 public:
  explicit Args(const py::args& a) : a_(a), items_(ampfunc::Recycled<PyObject*>::take()) {}
  Args(const Args&) = delete;
  Args& operator=(const Args&) = delete;
  ~Args() {
    std::vector<PyObject*> items = std::move(items_);  // a DECREF may run Python code that calls in again
    for (PyObject* o : items) Py_DECREF(o);
    ampfunc::Recycled<PyObject*>::give(items);
  }

  Tensors list() {
    Tensors out;
    PyObject* seq = next();
    if (!ok) return out;
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
      ok = false;
      return out;
    }
    // The items are held (one reference each, dropped in ~Args with the GIL) so that they stay
    // valid while the GIL is released, whatever another thread does to the list. A C array of
    // references rather than a tuple copy: no Python allocation, nothing for the cyclic GC.
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    items_.reserve(items_.size() + static_cast<size_t>(n));
    // The Python objects, on this thread (they are the interpreter's): type, reference, tensor.
    thread_local std::vector<const Tensor*> tensors;
    tensors.clear();
    tensors.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i + 8 < n) __builtin_prefetch(items[i + 8]);  // cold on a large tree: ask ahead
      PyObject* o = items[i];
      if (!THPVariable_Check(o)) {
        ok = false;
        return out;
      }
      Py_INCREF(o);
      items_.push_back(o);
      tensors.push_back(&THPVariable_Unpack(o));
    }
    // The tensors themselves (TensorImpls, storages): checked and described on every core
    // when the list is long. Grad mode is this thread's, read here once.
    const bool grad_on = at::GradMode::is_enabled();
    if (!out.take_all(tensors.data(), tensors.size(), [grad_on](const Tensor& t) { return plain_cpu(t, grad_on); })) {
      ok = false;
      return out;
    }
    any_tensor_ = any_tensor_ || n > 0;
    return out;
  }

  const Tensor* tensor() {
    PyObject* o = next();
    if (!ok) return nullptr;
    if (!THPVariable_Check(o) || !plain_cpu(THPVariable_Unpack(o))) {
      ok = false;
      return nullptr;
    }
    Py_INCREF(o);
    items_.push_back(o);
    any_tensor_ = true;
    return &THPVariable_Unpack(o);
  }

  std::optional<Tensor> optional_tensor() {
    PyObject* o = next();
    if (!ok || o == Py_None) return std::nullopt;
    if (!THPVariable_Check(o) || !plain_cpu(THPVariable_Unpack(o))) {
      ok = false;
      return std::nullopt;
    }
    return THPVariable_Unpack(o);
  }

  double real() {
    PyObject* o = next();
    if (!ok) return 0.0;
    const double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      ok = false;
    }
    return v;
  }

  int64_t integer() {
    PyObject* o = next();
    if (!ok) return 0;
    if (!PyLong_Check(o)) {
      ok = false;
      return 0;
    }
    const long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      ok = false;
    }
    return static_cast<int64_t>(v);
  }

  bool flag() {
    PyObject* o = next();
    if (!ok) return false;
    if (!PyBool_Check(o)) {
      ok = false;
      return false;
    }
    return o == Py_True;
  }

  // Whether the call can take the direct door: every argument read, at least one tensor, and no
  // mode or thread-local key that would have sent the op anywhere but the CPU kernel.
  bool usable() const {
    return ok && i_ == a_.size() && any_tensor_ && !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
           !at::impl::torch_function_mode_enabled() &&
           (c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty();
  }

  bool ok = true;

 private:
  PyObject* next() {
    if (!ok || i_ >= a_.size()) {
      ok = false;
      return nullptr;
    }
    return a_[i_++].ptr();
  }

  const py::args& a_;
  size_t i_ = 0;
  bool any_tensor_ = false;
  std::vector<PyObject*> items_;  // the tensors held for the call (one reference each)
};

void bump(const Tensors& ts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    prefetch(ts, i);
    const Tensor& t = ts[i];
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

void bump(const Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

py::object not_handled() { return py::reinterpret_borrow<py::object>(Py_NotImplemented); }

// Runs fn() with the GIL released, the call recorded for the profiler under `op`, and returns
// its result converted to Python (None for void).
template <typename Fn>
py::object run(const char* op, Fn&& fn) {
  using R = decltype(fn());
  if constexpr (std::is_void_v<R>) {
    {
      py::gil_scoped_release no_gil;
      RECORD_FUNCTION(op, std::vector<c10::IValue>());
      PackOutputs pack(true);  // an eager call
      fn();
    }
    return py::none();
  } else {
    std::optional<R> out;
    {
      py::gil_scoped_release no_gil;
      RECORD_FUNCTION(op, std::vector<c10::IValue>());
      PackOutputs pack(true);  // an eager call
      out.emplace(fn());
    }
    return py::cast(std::move(*out));
  }
}

py::object check(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors ts = x.list();
  const bool per_leaf = x.flag();
  if (!x.usable()) return not_handled();
  return run("ampfunc::check", [&] { return check_cpu(ts, per_leaf); });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object check_norm(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors ts = x.list();
  std::optional<Tensor> inv = x.optional_tensor();
  const bool per_leaf = x.flag();
  if (!x.usable()) return not_handled();
  return run("ampfunc::check_norm", [&] { return check_norm_cpu(ts, inv, per_leaf); });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object unscale_(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors ts = x.list();
  const Tensor* inv = x.tensor();
  if (!x.usable()) return not_handled();
  return run("ampfunc::unscale_", [&] {
    Tensor finite = unscale__cpu(ts, *inv);
    bump(ts);
    return finite;
  });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object unscale(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors ts = x.list();
  const Tensor* inv = x.tensor();
  if (!x.usable()) return not_handled();
  return run("ampfunc::unscale", [&] { return unscale_cpu(ts, *inv); });
  END_HANDLE_TH_ERRORS_PYBIND
}

// The three forms of an optimizer step through the door: in place (`*_step_`), out of place
// (`*_step`) and out of place checking its own gradients (`*_step_checked`, no `finite` argument).
enum class Form { kInPlace, kOutOfPlace, kChecked };

// sgd_step_ / sgd_step: (params, grads, momentum_buffers, model_params, step, grad_scale, finite, lr,
// lr_tensor, weight_decay, momentum, dampening, nesterov, maximize); sgd_step_checked: without finite.
template <Form kForm>
py::object sgd_step(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), g = x.list(), b = x.list(), mp = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const Tensor* fin = kForm == Form::kChecked ? nullptr : x.tensor();
  const double lr = x.real();
  std::optional<Tensor> lr_t = x.optional_tensor();
  const double wd = x.real(), mom = x.real(), damp = x.real();
  const bool nesterov = x.flag(), maximize = x.flag();
  if (!x.usable()) return not_handled();
  if constexpr (kForm == Form::kInPlace) {
    return run("ampfunc::sgd_step_", [&] {
      sgd_step__cpu(p, g, b, mp, *step, *gs, *fin, lr, lr_t, wd, mom, damp, nesterov, maximize);
      bump(p);
      bump(b);
      bump(mp);
      bump(*step);
    });
  } else if constexpr (kForm == Form::kOutOfPlace) {
    return run("ampfunc::sgd_step",
               [&] { return sgd_step_cpu(p, g, b, mp, *step, *gs, *fin, lr, lr_t, wd, mom, damp, nesterov, maximize); });
  } else {
    return run("ampfunc::sgd_step_checked", [&] {
      return sgd_step_checked_cpu(p, g, b, mp, *step, *gs, lr, lr_t, wd, mom, damp, nesterov, maximize);
    });
  }
  END_HANDLE_TH_ERRORS_PYBIND
}

// adam_step_ / adam_step: (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
// grad_scale, finite, lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize);
// adam_step_checked: without finite.
template <Form kForm>
py::object adam_step(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), g = x.list(), m1 = x.list(), m2 = x.list(), vmax = x.list(), mp = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const Tensor* fin = kForm == Form::kChecked ? nullptr : x.tensor();
  const double lr = x.real();
  std::optional<Tensor> lr_t = x.optional_tensor();
  const double b1 = x.real(), b2 = x.real(), eps = x.real(), wd = x.real();
  const bool amsgrad = x.flag(), decoupled = x.flag(), maximize = x.flag();
  if (!x.usable()) return not_handled();
  if constexpr (kForm == Form::kInPlace) {
    return run("ampfunc::adam_step_", [&] {
      adam_step__cpu(p, g, m1, m2, vmax, mp, *step, *gs, *fin, lr, lr_t, b1, b2, eps, wd, amsgrad, decoupled,
                     maximize);
      bump(p);
      bump(m1);
      bump(m2);
      bump(vmax);
      bump(mp);
      bump(*step);
    });
  } else if constexpr (kForm == Form::kOutOfPlace) {
    return run("ampfunc::adam_step", [&] {
      return adam_step_cpu(p, g, m1, m2, vmax, mp, *step, *gs, *fin, lr, lr_t, b1, b2, eps, wd, amsgrad, decoupled,
                           maximize);
    });
  } else {
    return run("ampfunc::adam_step_checked", [&] {
      return adam_step_checked_cpu(p, g, m1, m2, vmax, mp, *step, *gs, lr, lr_t, b1, b2, eps, wd, amsgrad, decoupled,
                                   maximize);
    });
  }
  END_HANDLE_TH_ERRORS_PYBIND
}

// (params, grads, momentum_buffers, step, grad_scale, lr, lr_tensor, weight_decay, momentum, dampening,
// nesterov, maximize)
py::object sgd_update(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), g = x.list(), b = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const double lr = x.real();
  std::optional<Tensor> lr_t = x.optional_tensor();
  const double wd = x.real(), mom = x.real(), damp = x.real();
  const bool nesterov = x.flag(), maximize = x.flag();
  if (!x.usable()) return not_handled();
  return run("ampfunc::sgd_update",
             [&] { return sgd_update_cpu(p, g, b, *step, *gs, lr, lr_t, wd, mom, damp, nesterov, maximize); });
  END_HANDLE_TH_ERRORS_PYBIND
}

// (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, grad_scale, lr, lr_tensor, beta1, beta2,
// eps, weight_decay, amsgrad, decoupled_weight_decay, maximize)
py::object adam_update(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), g = x.list(), m1 = x.list(), m2 = x.list(), vmax = x.list();
  const Tensor *step = x.tensor(), *gs = x.tensor();
  const double lr = x.real();
  std::optional<Tensor> lr_t = x.optional_tensor();
  const double b1 = x.real(), b2 = x.real(), eps = x.real(), wd = x.real();
  const bool amsgrad = x.flag(), decoupled = x.flag(), maximize = x.flag();
  if (!x.usable()) return not_handled();
  return run("ampfunc::adam_update", [&] {
    return adam_update_cpu(p, g, m1, m2, vmax, *step, *gs, lr, lr_t, b1, b2, eps, wd, amsgrad, decoupled, maximize);
  });
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object apply_updates(const py::args& a) {
  HANDLE_TH_ERRORS
  Args x(a);
  Tensors p = x.list(), u = x.list();
  if (!x.usable()) return not_handled();
  return run("ampfunc::apply_updates", [&] { return apply_updates_cpu(p, u); });
  END_HANDLE_TH_ERRORS_PYBIND
}

// ampfunc.ops.kernel_ready's per-tensor loop: every element of every list of `fp32_lists` (and
// of `float_lists`) an instance of exactly one of `plain_types`, on device `where` (-1: CPU,
// else the CUDA index), float32 (float32/float16/bfloat16), and not requiring grad when
// `grad_on`. Reads a few fields per tensor, in C rather than Python.
bool kernel_ready(const py::tuple& plain_types, int64_t where, bool grad_on, const py::list& fp32_lists,
                  const py::list& float_lists) {
  auto type_ok = [&](PyObject* o) {
    for (const auto& ty : plain_types) {
      if (reinterpret_cast<PyObject*>(Py_TYPE(o)) == ty.ptr()) return true;
    }
    return false;
  };
  auto all_ok = [&](const py::list& lists, bool fp32_only) {
    for (const auto& lst : lists) {
      py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(lst.ptr(), "ampfunc: a list of tensors"));
      if (!seq) throw py::error_already_set();
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
      PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (!type_ok(items[i])) return false;
        const Tensor& t = THPVariable_Unpack(items[i]);
        const at::ScalarType dt = t.scalar_type();
        if (fp32_only ? dt != at::kFloat : !kernel_dtype(dt)) return false;
        const at::Device dev = t.device();
        if (where < 0 ? !dev.is_cpu() : (!dev.is_cuda() || dev.index() != where)) return false;
        if (grad_on && t.requires_grad()) return false;
      }
    }
    return true;
  };
  return all_ok(fp32_lists, true) && all_ok(float_lists, false);
}

// [p.grad for p in params] and `for p in params: p.grad = None`, for ModuleTrainer: at C speed
// (a Python attribute access on a Parameter costs ~0.2 us; 10,000 of them twice a step add up).
py::list grads_of(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  py::list out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(params.ptr(), i);
    if (!THPVariable_Check(o)) throw py::type_error("ampfunc: grads_of takes a list of tensors");
    const Tensor& g = THPVariable_Unpack(o).grad();
    PyObject* w = g.defined() ? THPVariable_Wrap(g) : (Py_INCREF(Py_None), Py_None);
    if (!w) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), i, w);
  }
  return out;
}

void clear_grads(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(PyList_GET_ITEM(params.ptr(), i))) {
      throw py::type_error("ampfunc: clear_grads takes a list of tensors");
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) THPVariable_Unpack(PyList_GET_ITEM(params.ptr(), i)).mutable_grad().reset();
}

// For ModuleTrainer(flat=True). `bound_signature` records, per param, what its binding to the
// flat buffers looks like (data pointer, element count, dtype, the TensorImpl of its .grad);
// `check_bound`, every step, compares the params with it in one C loop that touches only the
// params (their TensorImpls and autograd meta), not the views: `moved` lists the params whose
// data is elsewhere (moved or converted behind the trainer's back), `unbound` those whose .grad
// is no longer the view (set to None by zero_grad(), then made anew by backward, or assigned).
namespace {
constexpr int64_t kSigCols = 4;

void signature_row(const Tensor& p, int64_t* row) {
  row[0] = p.has_storage() ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.const_data_ptr())) : 0;
  row[1] = p.numel();
  row[2] = static_cast<int64_t>(p.scalar_type());
  const Tensor& g = p.grad();
  row[3] = g.defined() ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(g.unsafeGetTensorImpl())) : 0;
}

const Tensor& param_at(const py::list& params, Py_ssize_t i, const char* fn) {
  PyObject* o = PyList_GET_ITEM(params.ptr(), i);
  if (!THPVariable_Check(o)) throw py::type_error(std::string("ampfunc: ") + fn + " takes a list of tensors");
  return THPVariable_Unpack(o);
}
}  // namespace

Tensor bound_signature(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  Tensor sig = at::empty({static_cast<int64_t>(n), kSigCols}, at::TensorOptions().dtype(at::kLong));
  int64_t* rows = sig.data_ptr<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) signature_row(param_at(params, i, "bound_signature"), rows + i * kSigCols);
  return sig;
}

py::tuple check_bound(const py::list& params, const Tensor& signature) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  if (signature.dim() != 2 || signature.size(0) != n || signature.size(1) != kSigCols ||
      signature.scalar_type() != at::kLong || !signature.is_cpu() || !signature.is_contiguous()) {
    throw py::value_error("ampfunc: check_bound takes the params and their bound_signature");
  }
  const int64_t* rows = signature.const_data_ptr<int64_t>();
  py::list moved, unbound;
  int64_t now[kSigCols];
  for (Py_ssize_t i = 0; i < n; ++i) {
    signature_row(param_at(params, i, "check_bound"), now);
    const int64_t* want = rows + i * kSigCols;
    if (now[0] != want[0] || now[1] != want[1] || now[2] != want[2]) moved.append(i);
    if (now[3] != want[3]) unbound.append(i);
  }
  return py::make_tuple(moved, unbound);
}

// A version-counter bump for every tensor of the list, as an in-place torch op makes
// (torch.autograd.graph.increment_version at C speed): ModuleTrainer(flat=True) writes its
// params through the flat buffer, whose views do not share the params' counters.
void bump_versions(const py::list& tensors) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(PyList_GET_ITEM(tensors.ptr(), i))) throw py::type_error("ampfunc: bump_versions takes a list of tensors");
  }
  for (Py_ssize_t i = 0; i < n; ++i) bump(THPVariable_Unpack(PyList_GET_ITEM(tensors.ptr(), i)));
}

// The first index whose requires_grad differs from expected[i] (a bytes object of 0/1), or -1.
int64_t requires_grad_changed(const py::list& tensors, const py::bytes& expected) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  char* want = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_AsStringAndSize(expected.ptr(), &want, &len) != 0 || len != n) {
    PyErr_Clear();
    throw py::value_error("ampfunc: requires_grad_changed takes a list and a bytes object of its length");
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(tensors.ptr(), i);
    if (!THPVariable_Check(o)) throw py::type_error("ampfunc: requires_grad_changed takes a list of tensors");
    if (THPVariable_Unpack(o).requires_grad() != (want[i] != 0)) return i;
  }
  return -1;
}

// `params[i].grad = grads[i]` for every i, at C speed (ModuleTrainer(flat=True) putting its
// gradient views back). Shapes, dtypes and devices must match, as Python's .grad setter demands.
void set_grads(const py::list& params, const py::list& grads) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  if (PyList_GET_SIZE(grads.ptr()) != n) throw py::value_error("ampfunc: set_grads takes two lists of one length");
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *o = PyList_GET_ITEM(params.ptr(), i), *g = PyList_GET_ITEM(grads.ptr(), i);
    if (!THPVariable_Check(o) || !THPVariable_Check(g)) throw py::type_error("ampfunc: set_grads takes lists of tensors");
    const Tensor& p = THPVariable_Unpack(o);
    const Tensor& gt = THPVariable_Unpack(g);
    if (gt.sizes() != p.sizes() || gt.scalar_type() != p.scalar_type() || gt.device() != p.device()) {
      throw py::value_error("ampfunc: set_grads: grads[" + std::to_string(i) + "] does not match its param's shape, " +
                            "dtype and device");
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    THPVariable_Unpack(PyList_GET_ITEM(params.ptr(), i)).mutable_grad() =
        THPVariable_Unpack(PyList_GET_ITEM(grads.ptr(), i));
  }
}

py::object pool_stats() {
  auto [cached, limit, hits, misses] = OutputPool::get().stats();
  py::dict d;
  d["cached_bytes"] = cached;
  d["limit_bytes"] = limit;
  d["hits"] = hits;
  d["misses"] = misses;
  return d;
}

py::object empty_cache() {
  size_t freed;
  {
    py::gil_scoped_release no_gil;
    freed = OutputPool::get().empty_cache();
  }
  return py::int_(freed);
}

}  // namespace direct

}  // namespace

// The CPU implementations take borrowed lists (ampfunc::Tensors); the dispatcher hands them
// TensorList arguments. Registered<F>::call is F with each `const Tensors&` parameter spelled
// TensorList, the schema type the dispatcher knows.
template <typename T>
struct SchemaArg {
  using type = T;
};
template <>
struct SchemaArg<const Tensors&> {
  using type = TensorList;
};
template <auto F>
struct Registered;
template <typename R, typename... A, R (*F)(A...)>
struct Registered<F> {
  static R call(typename SchemaArg<A>::type... a) { return F(a...); }
};

TORCH_LIBRARY_IMPL(ampfunc, CPU, m) {
  m.impl("check", &Registered<&check_cpu>::call);
  m.impl("unscale_", &Registered<&unscale__cpu>::call);
  m.impl("unscale", &Registered<&unscale_cpu>::call);
  m.impl("sgd_step_", &Registered<&sgd_step__cpu>::call);
  m.impl("adam_step_", &Registered<&adam_step__cpu>::call);
  m.impl("sgd_step", &Registered<&sgd_step_cpu>::call);
  m.impl("adam_step", &Registered<&adam_step_cpu>::call);
  m.impl("update_scale_", &update_scale__cpu);
  m.impl("check_norm", &Registered<&check_norm_cpu>::call);
  m.impl("sgd_update", &Registered<&sgd_update_cpu>::call);
  m.impl("adam_update", &Registered<&adam_update_cpu>::call);
  m.impl("apply_updates", &Registered<&apply_updates_cpu>::call);
}

#ifdef AMPFUNC_WITH_CUDA
TORCH_LIBRARY_IMPL(ampfunc, CUDA, m) {
  m.impl("check", &check_cuda);
  m.impl("unscale_", &unscale__cuda);
  m.impl("unscale", &unscale_cuda);
  m.impl("sgd_step_", &sgd_step__cuda);
  m.impl("adam_step_", &adam_step__cuda);
  m.impl("sgd_step", &sgd_step_cuda);
  m.impl("adam_step", &adam_step_cuda);
  m.impl("update_scale_", &update_scale__cuda);
  m.impl("check_norm", &check_norm_cuda);
  m.impl("sgd_update", &sgd_update_cuda);
  m.impl("adam_update", &adam_update_cuda);
  m.impl("apply_updates", &apply_updates_cuda);
}
#endif

// A symbol the loader can look for to tell which backends this build carries.
extern "C" int ampfunc_ext_has_cuda() {
#ifdef AMPFUNC_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

// The direct door's module (see namespace direct above), made on request: the library is loaded
// with torch.ops.load_library, not imported, so ampfunc/_build.py asks for the module through
// ctypes (ctypes.PyDLL, which holds the GIL) and keeps it.
extern "C" __attribute__((visibility("default"))) PyObject* ampfunc_direct_module() {
  namespace py = pybind11;
  try {
    py::module_ m = py::reinterpret_steal<py::module_>(PyModule_New("ampfunc._direct"));
    if (!m) return nullptr;
    m.def("check", &direct::check);
    m.def("check_norm", &direct::check_norm);
    m.def("unscale_", &direct::unscale_);
    m.def("unscale", &direct::unscale);
    m.def("sgd_step_", &direct::sgd_step<direct::Form::kInPlace>);
    m.def("sgd_step", &direct::sgd_step<direct::Form::kOutOfPlace>);
    m.def("sgd_step_checked", &direct::sgd_step<direct::Form::kChecked>);
    m.def("adam_step_", &direct::adam_step<direct::Form::kInPlace>);
    m.def("adam_step", &direct::adam_step<direct::Form::kOutOfPlace>);
    m.def("adam_step_checked", &direct::adam_step<direct::Form::kChecked>);
    m.def("sgd_update", &direct::sgd_update);
    m.def("adam_update", &direct::adam_update);
    m.def("apply_updates", &direct::apply_updates);
    m.def("kernel_ready", &direct::kernel_ready);
    m.def("grads_of", &direct::grads_of);
    m.def("clear_grads", &direct::clear_grads);
    m.def("bound_signature", &direct::bound_signature);
    // ops._call around an eager torch.ops call (CUDA): returns the previous setting.
    m.def("pack_outputs", [](bool on) {
      const bool prev = t_pack_outputs;
      t_pack_outputs = on;
      return prev;
    });
    m.def("check_bound", &direct::check_bound);
    m.def("set_grads", &direct::set_grads);
    m.def("bump_versions", &direct::bump_versions);
    m.def("requires_grad_changed", &direct::requires_grad_changed);
    m.def("pool_stats", &direct::pool_stats);
    m.def("empty_cache", &direct::empty_cache);
    return m.release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}
