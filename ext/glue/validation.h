// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// Validation: every check runs before the first write, so a refused call changes nothing.
#pragma once

#include "common.h"

namespace {

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

// The first two spans that share memory, or nullptr/nullptr: the spans sorted by start. Spans
// that do not intersect are disjoint; intersecting contiguous spans share bytes; where a strided
// tensor is among intersecting spans, their element addresses decide (shared_in). The one
// implementation of the rule: the ops' validation runs it, and ampfunc.ops.overlapping_pair
// (through the direct door's module) for flat buffers and the engine's checks.
std::pair<const Span*, const Span*> find_overlap(std::vector<Span>& spans) {
  if (spans.size() < 2) return {nullptr, nullptr};
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
  if (spans.size() == last_disjoint.n && sum == last_disjoint.sum && xr == last_disjoint.xr) return {nullptr, nullptr};
  auto less = [](const Span& a, const Span& b) {
    return a.lo != b.lo ? a.lo < b.lo : (a.order != b.order ? a.order < b.order : a.idx < b.idx);
  };
  if (!std::is_sorted(spans.begin(), spans.end(), less)) std::sort(spans.begin(), spans.end(), less);
  auto ordered = [](const Span* a, const Span* b) {
    if (b->order < a->order || (b->order == a->order && b->idx < a->idx)) std::swap(a, b);
    return std::make_pair(a, b);
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
      if (!strided) return ordered(&spans[start], &spans[start + 1]);
      auto [a, b] = shared_in(spans.data() + start, spans.data() + k);
      if (a != nullptr) return ordered(a, b);
    }
    if (k < spans.size()) {
      start = k;
      hi = spans[k].hi;
      strided = !spans[k].contiguous;
    }
  }
  last_disjoint = {spans.size(), sum, xr};
  return {nullptr, nullptr};
}

// Raises when two written tensors share memory (find_overlap), naming them.
void check_disjoint(const char* op, std::vector<Span>& spans) {
  auto [a, b] = find_overlap(spans);
  TORCH_CHECK_VALUE(a == nullptr, "ampfunc: ", item_name(a->name, a->idx), " and ", item_name(b->name, b->idx),
                    " overlap in memory; the tensors an in-place op writes must be distinct (", op, ")");
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

// Whether two descriptors have the same shape for sure (false: compare the tensors' sizes).
inline bool same_shape(const Tensors::Desc& a, const Tensors::Desc& b) {
  if (a.ndim < 0 || a.ndim != b.ndim) return false;
  for (int k = 0; k < a.ndim; ++k) {
    if (a.dims[k] != b.dims[k]) return false;
  }
  return true;
}

// What validate() found of held lists (Tensors::held_tag): the keys of this thread's last
// kPassedKeys calls that passed with their reference list and every written list held, built by
// held_key(), the most recent first. A key found again means the same op on the same device and
// mode, the same held lists unchanged in the same places and the same written scalars: every
// check of a held list (its shapes against the reference list's among them), and the
// disjointness of everything written, hold as they did; only the lists not held (the
// gradients) are checked again. Several keys, so that a loop alternating between steps (two
// models, a GAN's two optimizers) keeps what was found of each: a 10,000-leaf step checked
// in full costs 1.5-2 ms more.
constexpr size_t kPassedKeys = 8;
thread_local std::vector<std::vector<uint64_t>> passed_held_keys;

// The key of a call whose reference list and written lists are all held (empty otherwise).
std::vector<uint64_t> held_key(const char* op, const at::Device& dev, const std::vector<ListSpec>& lists,
                               const std::vector<std::pair<const char*, const Tensor*>>& written_scalars) {
  std::vector<uint64_t> key;
  // The reference list held too: the held lists' shapes were compared with these very shapes.
  if (lists.empty() || lists[0].ts.held_tag == 0) return key;
  for (const ListSpec& L : lists) {
    if (L.written && L.ts.held_tag == 0) return key;
  }
  key.reserve(4 + 4 * lists.size() + 3 * written_scalars.size());
  key.push_back(reinterpret_cast<uintptr_t>(op));
  key.push_back((static_cast<uint64_t>(static_cast<uint8_t>(dev.type())) << 8) | static_cast<uint8_t>(dev.index()));
  key.push_back(c10::InferenceMode::is_enabled());
  for (const ListSpec& L : lists) {
    key.push_back(L.ts.held_tag);
    key.push_back(L.ts.size());
    key.push_back((static_cast<uint64_t>(L.dt) << 1) | L.written);
    key.push_back(reinterpret_cast<uintptr_t>(L.name));
  }
  for (const auto& [name, t] : written_scalars) {
    key.push_back(t->has_storage() ? reinterpret_cast<uintptr_t>(t->const_data_ptr()) : 0);
    key.push_back(static_cast<uint64_t>(t->numel()));
    key.push_back(static_cast<uint64_t>(t->element_size()));
  }
  return key;
}

// The one validation of a list op: lists[0] is the reference list (its shapes are the ones the
// others must have); every tensor is defined, dense, on `dev`, of an accepted dtype; written
// tensors neither overlap themselves nor each other (nor the written 0-d `scalars`).
void validate(const char* op, const at::Device& dev, const std::vector<ListSpec>& lists,
              const std::vector<std::pair<const char*, const Tensor*>>& written_scalars = {}) {
  std::vector<uint64_t> key = held_key(op, dev, lists, written_scalars);
  bool again = false;
  if (!key.empty()) {  // taken out while checking: a failed check below leaves it out, all is checked next time
    auto found = std::find(passed_held_keys.begin(), passed_held_keys.end(), key);
    again = found != passed_held_keys.end();
    if (again) passed_held_keys.erase(found);
  }
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
  // The lists checked below: all of them, or on a repeated call (`again`) the ones not held.
  std::vector<size_t> checked;
  for (size_t l = 0; l < lists.size(); ++l) {
    if (!again || lists[l].ts.held_tag == 0) checked.push_back(l);
  }
  for (size_t i = 0; i < ref.ts.size() && !checked.empty(); ++i) {
    const Tensors::Desc& r = ref.ts.desc(i);
    for (size_t l : checked) {
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
  if (!again && any_written) {  // (again: everything written is held and unchanged, disjoint as before)
    for (size_t k = 0; k < written_scalars.size(); ++k) {
      add_span(spans, *written_scalars[k].second, static_cast<int>(lists.size() + k), written_scalars[k].first, -1);
    }
    check_disjoint(op, spans);
  }
  if (!key.empty()) {
    passed_held_keys.insert(passed_held_keys.begin(), std::move(key));
    if (passed_held_keys.size() > kPassedKeys) passed_held_keys.pop_back();
  }
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
// place). The copies live in a deque, which never moves its elements, so `tensors` may point at
// them. A list that is contiguous throughout (the usual case) is `tensors` itself, not copied;
// a temporary list (an empty Tensors(), a TensorList converted) is kept by the Work.
class Work {
 public:
  std::deque<Tensor> owned;
  std::vector<std::pair<const Tensor*, const Tensor*>> copies;  // (original, contiguous copy)

 private:
  Tensors kept_, own_;

 public:
  const Tensors& tensors;
  explicit Work(const Tensors& ts) : tensors(working(ts)) {}
  explicit Work(Tensors&& ts) : kept_(std::move(ts)), tensors(working(kept_)) {}
  // (`c ? list : Tensors()` is a const temporary: copied)
  explicit Work(const Tensors&& ts) : kept_(ts), tensors(working(kept_)) {}
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  void write_back() {
    for (auto& oc : copies) oc.first->copy_(*oc.second);
  }

 private:
  const Tensors& working(const Tensors& ts) {
    bool contiguous = true;  // the descriptors: no read of the (cold) tensors themselves
    for (size_t i = 0; i < ts.size() && contiguous; ++i) contiguous = ts.contiguous(i);
    if (contiguous) return ts;
    own_.reserve(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      const Tensor& t = ts[i];
      if (ts.contiguous(i)) {
        own_.push_back(&t, ts.desc(i));
      } else {
        owned.push_back(t.contiguous());
        own_.push_back(&owned.back());
        copies.emplace_back(&t, &owned.back());
      }
    }
    return own_;
  }
};

at::Device device_of(TensorList ts, const Tensor& fallback) {
  return ts.empty() ? fallback.device() : ts[0].device();
}

}  // namespace
