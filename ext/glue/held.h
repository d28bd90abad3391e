// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// What the direct door may borrow: plain CPU tensors, and the held lists of in-place steps.
#pragma once

#include "common.h"

namespace {

namespace direct {

namespace py = pybind11;

// Whether the dispatcher would send `t` straight to the CPU kernel (see direct.h).
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

// ---------------------------------------------------------------------------------------------
// Held lists
// ---------------------------------------------------------------------------------------------
//
// An in-place step passes the same lists every call (the params, the master, the moments: the
// engine keeps them while their tensors stay the same), and describing them is most of what
// a 10,000-leaf call costs beyond its kernel: a reference taken and dropped on each Python
// object, each TensorImpl and storage read into a descriptor, every call. A HeldLists object
// holds such lists (strong references to each list and to each of its tensors, so no address
// below is reused while it lives) with their descriptors and, per tensor, a Mark: what the
// tensor looked like when described. While it lives, a call that passes one of those very list
// objects, still holding the very same tensor objects, gets the held descriptors once every
// tensor is found unchanged against its Mark: the same TensorImpl behind the Python object
// (torch.utils.swap_tensors changes it), the same key set (subclass, inference, conjugate and
// functionalization keys), storage, allocation, deleter (a lazy clone makes a storage
// copy-on-write under the same pointer), size in bytes, offset, element count, dtype, sizes,
// contiguity and version counter. A `.data` assignment, set_(), resize_(), or a storage resized
// under the tensor changes one of these; the list is then described anew, as any other list,
// and its Marks taken again. Verifying reads the objects a description reads but takes no
// reference and builds nothing. Validation still runs on the descriptors, every call.

// What a tensor's descriptor (which has its TensorImpl, element count, dtype, sizes and version
// counter) does not say of it: its storage, allocation, deleter, size in bytes, offset and keys.
struct Mark {
  const c10::StorageImpl* storage;
  const void* allocation;
  c10::DeleterFnPtr deleter;
  size_t nbytes;
  int64_t offset;
  c10::DispatchKeySet keys;
};

inline Mark mark_of(const Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const c10::StorageImpl* s = impl->unsafe_storage().unsafeGetStorageImpl();
  const c10::DataPtr& dp = s->data_ptr();  // the const accessor: never materializes
  return {s, dp.get(), dp.get_deleter(), s->nbytes(), impl->storage_offset(), impl->key_set()};
}

// Whether `t` is as described by `m` and `d` (contiguous, at most Tensors::kInlineDims dims).
inline bool unchanged(const Tensor& t, const Mark& m, const Tensors::Desc& d, bool grad_on) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl != d.impl || impl->key_set() != m.keys || impl->unsafe_storage().unsafeGetStorageImpl() != m.storage ||
      impl->storage_offset() != m.offset || impl->numel() != d.numel || t.scalar_type() != d.dtype ||
      ampfunc::counter_of(t) != d.counter || !impl->is_contiguous()) {
    return false;
  }
  const auto sizes = impl->sizes();
  if (static_cast<int64_t>(sizes.size()) != d.ndim) return false;
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (sizes[k] != d.dims[k]) return false;
  }
  const c10::DataPtr& dp = m.storage->data_ptr();
  return dp.get() == m.allocation && dp.get_deleter() == m.deleter && m.storage->nbytes() == m.nbytes &&
         !(grad_on && t.requires_grad());
}

// One held list: the list object, its items (one reference each, taken by the constructor of
// HeldLists and dropped here, with the interpreter's lock: both run in Python calls), their
// descriptors and Marks.
struct HeldList {
  HeldList() = default;
  HeldList(const HeldList&) = delete;
  HeldList& operator=(const HeldList&) = delete;
  ~HeldList() {
    for (PyObject* o : raw) Py_DECREF(o);
  }

  py::object list;
  std::vector<PyObject*> raw;  // the items, compared with the list's at each call
  Tensors tensors;
  std::vector<Mark> marks;
  // The tensors' counters (one reference each). Made anew with the marks, never changed in
  // place: a call bumping through them after the kernel keeps the vector it took.
  std::shared_ptr<std::vector<c10::VariableVersion>> versions;
  bool usable = false;  // every tensor contiguous, of at most kInlineDims dims, with data (markable)
  uint64_t tag = 0;

  bool same_items(PyObject* seq) const {
    return PySequence_Fast_GET_SIZE(seq) == static_cast<Py_ssize_t>(raw.size()) &&
           (raw.empty() || std::memcmp(PySequence_Fast_ITEMS(seq), raw.data(), raw.size() * sizeof(PyObject*)) == 0);
  }

  // Whether tensors [begin, end) are unchanged. Memory-latency bound (a Python object, three
  // TensorImpl lines and a storage per tensor, all cold): every address is in the Marks, so the
  // loop asks for all of them kAhead tensors on, with no chain of loads to wait for.
  bool unchanged_in(size_t begin, size_t end, bool grad_on) const {
    constexpr size_t kAhead = 24;
    for (size_t i = begin; i < end; ++i) {
      if (i + kAhead < end) {
        const Mark& a = marks[i + kAhead];
        __builtin_prefetch(raw[i + kAhead]);
        ampfunc::prefetch_lines(tensors.desc(i + kAhead).impl, sizeof(c10::TensorImpl));
        __builtin_prefetch(reinterpret_cast<const char*>(a.storage) + 16);  // the DataPtr
        __builtin_prefetch(reinterpret_cast<const char*>(a.storage) + 63);  // its size and flags
      }
      if (!unchanged(tensors[i], marks[i], tensors.desc(i), grad_on)) return false;
    }
    return true;
  }

  // Takes the Marks of `ts`, the list's tensors just described (the list holds the same items,
  // every one plain: the door's own test), under a new tag (Tensors::held_tag: what validation
  // found of the old descriptors is void). A list that cannot be held as it is now (a
  // non-contiguous tensor, say) takes the door's usual road, and is looked at again, from its
  // descriptors, each time that road describes it.
  void remark(const Tensors& ts) {
    static std::atomic<uint64_t> tags{0};
    tag = ++tags;
    usable = markable(ts);
    if (!usable) return;
    tensors = ts;
    marks.resize(ts.size());
    auto counters = std::make_shared<std::vector<c10::VariableVersion>>();
    counters->reserve(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      marks[i] = mark_of(ts[i]);
      counters->push_back(ts[i].unsafeGetTensorImpl()->version_counter());
    }
    versions = std::move(counters);
  }

  // Contiguous, at most Tensors::kInlineDims dims, with data (read from the descriptors; a
  // copy-on-write storage was materialized when the list was described).
  static bool markable(const Tensors& ts) {
    for (size_t i = 0; i < ts.size(); ++i) {
      const Tensors::Desc& d = ts.desc(i);
      if (!d.contiguous || d.ndim < 0 || !d.dense || d.data == nullptr) return false;
    }
    return true;
  }
};

// The lists held now, by list object (the interpreter's lock guards it).
// A call shares ownership of the held lists it uses (another thread may drop their HeldLists
// while the kernel runs without the interpreter's lock).
std::unordered_map<PyObject*, std::shared_ptr<HeldList>>& held_registry() {
  static auto* r = new std::unordered_map<PyObject*, std::shared_ptr<HeldList>>();
  return *r;
}

std::shared_ptr<HeldList> held_list(PyObject* seq) {
  auto& r = held_registry();
  if (r.empty()) return nullptr;
  auto it = r.find(seq);
  return it == r.end() ? nullptr : it->second;
}

// The held lists among a call's arguments, checked together before the arguments are read: a
// verdict per held list (usable: the very list, the same items, every tensor unchanged). The
// loop waits on memory, not on work, and a core has a bounded number of misses in flight, so
// from kSpreadMin tensors on it runs as one parallel region over all the call's held tensors
// (the cores' misses then overlap too): one hand-off a call, where the kernels make two.
//
// When that region runs, the call's other lists of tensors (not held: the gradients, new every
// step) are described in it too, for reading only (Tensors::describe_for_reading); a list the
// call only reads takes that description (Args::read_list), one that it may write is described
// as usual. Their Python objects are looked at here, on this thread (the interpreter's lock is
// held throughout the region, so no list changes meanwhile).
class HeldCheck {
 public:
  // A list of tensors described for reading in the region: argument `arg`, the list `seq`.
  struct ForReading {
    size_t arg;
    PyObject* seq;
    size_t start;  // its first index in the region's range
    Tensors tensors;
    bool ok = true;  // every tensor a plain CPU tensor (plain_cpu)
  };

  HeldCheck(const py::args& a, bool grad_on) {
    auto& r = held_registry();
    if (r.empty()) return;
    size_t total = 0;
    for (const py::handle& h : a) {
      auto it = r.find(h.ptr());
      if (it == r.end() || !it->second->usable || !it->second->same_items(h.ptr())) continue;
      lists_.push_back(it->second);
      starts_.push_back(total);
      total += it->second->raw.size();
    }
    if (lists_.empty()) return;
    starts_.push_back(total);
    const bool spread = total >= kSpreadMin && at::get_num_threads() > 1;
    const size_t all = spread ? add_for_reading(a, r, total) : total;
    std::vector<uint8_t> bad(lists_.size() + reads_.size(), 0);  // written by the region's threads, a byte each
    auto check = [&](size_t begin, size_t end) {
      size_t l = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
      for (; begin < end && begin < total; ++l) {
        const size_t stop = std::min(end, starts_[l + 1]);
        if (stop > begin && !__atomic_load_n(&bad[l], __ATOMIC_RELAXED) &&
            !lists_[l]->unchanged_in(begin - starts_[l], stop - starts_[l], grad_on)) {
          __atomic_store_n(&bad[l], uint8_t(1), __ATOMIC_RELAXED);
        }
        begin = stop;
      }
      for (size_t f = 0; f < reads_.size() && begin < end; ++f) {
        ForReading& rd = reads_[f];
        const size_t lo = std::max(begin, rd.start), hi = std::min(end, rd.start + rd.tensors.size());
        if (lo >= hi) continue;
        if (!rd.tensors.describe_for_reading(lo - rd.start, hi - rd.start,
                                             [grad_on](const Tensor& t) { return plain_cpu(t, grad_on); })) {
          __atomic_store_n(&bad[lists_.size() + f], uint8_t(1), __ATOMIC_RELAXED);
        }
      }
    };
    if (spread) {
      at::parallel_for(0, static_cast<int64_t>(all), kSpreadGrain,
                       [&](int64_t b, int64_t e) { check(static_cast<size_t>(b), static_cast<size_t>(e)); });
    } else {
      check(0, total);
    }
    ok_.resize(lists_.size());
    for (size_t l = 0; l < lists_.size(); ++l) ok_[l] = !bad[l];
    for (size_t f = 0; f < reads_.size(); ++f) reads_[f].ok = !bad[lists_.size() + f];
  }

  // The held list `seq` when it was found unchanged, else nullptr.
  std::shared_ptr<HeldList> unchanged(PyObject* seq) const {
    for (size_t l = 0; l < lists_.size(); ++l) {
      if (ok_[l] && lists_[l]->list.ptr() == seq) return lists_[l];
    }
    return nullptr;
  }

  // Argument `arg`, the list `seq`, when it was described for reading in the region.
  ForReading* for_reading(size_t arg, PyObject* seq) {
    for (ForReading& rd : reads_) {
      if (rd.arg == arg && rd.seq == seq) return &rd;
    }
    return nullptr;
  }

 private:
  static constexpr size_t kSpreadMin = 4096;
  static constexpr int64_t kSpreadGrain = 2048;

  // Queues the arguments that are lists (or tuples) of tensors and not held, from index `at` of
  // the region on; returns the end of the region's range.
  size_t add_for_reading(const py::args& a, const std::unordered_map<PyObject*, std::shared_ptr<HeldList>>& r,
                         size_t at) {
    thread_local std::vector<const Tensor*> tensors;
    for (size_t k = 0; k < a.size(); ++k) {
      PyObject* seq = a[k].ptr();
      if (!(PyList_CheckExact(seq) || PyTuple_CheckExact(seq)) || r.count(seq) != 0) continue;
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
      PyObject** items = PySequence_Fast_ITEMS(seq);
      tensors.clear();
      bool all_tensors = n > 0;
      for (Py_ssize_t i = 0; i < n && all_tensors; ++i) {
        if (i + 8 < n) __builtin_prefetch(items[i + 8]);  // cold on a large tree: ask ahead
        all_tensors = THPVariable_Check(items[i]);
        if (all_tensors) tensors.push_back(&THPVariable_Unpack(items[i]));
      }
      if (!all_tensors) continue;
      reads_.push_back(ForReading{k, seq, at, Tensors(), true});
      reads_.back().tensors.point_at(tensors.data(), tensors.size());
      at += tensors.size();
    }
    return at;
  }

  std::vector<std::shared_ptr<HeldList>> lists_;
  std::vector<size_t> starts_;
  std::vector<bool> ok_;
  std::vector<ForReading> reads_;
};

// ampfunc.ops.held_lists: holds `lists` (Python lists of tensors) for the direct door.
class HeldLists {
 public:
  explicit HeldLists(const py::list& lists) {
    const Py_ssize_t n = PyList_GET_SIZE(lists.ptr());
    lists_.reserve(static_cast<size_t>(n));
    for (Py_ssize_t k = 0; k < n; ++k) {
      PyObject* seq = PyList_GET_ITEM(lists.ptr(), k);
      if (!PyList_CheckExact(seq) || held_list(seq) != nullptr) continue;  // held already: by another
      auto h = std::make_shared<HeldList>();
      h->list = py::reinterpret_borrow<py::object>(seq);
      const Py_ssize_t len = PyList_GET_SIZE(seq);
      std::vector<const Tensor*> ts;
      bool all_tensors = true;
      for (Py_ssize_t i = 0; i < len; ++i) {
        PyObject* o = PyList_GET_ITEM(seq, i);
        all_tensors = THPVariable_Check(o);
        if (!all_tensors) break;  // (the references taken go with h)
        Py_INCREF(o);
        h->raw.push_back(o);
        ts.push_back(&THPVariable_Unpack(o));
      }
      if (!all_tensors) continue;
      bool cow = false;
      for (const Tensor* t : ts) {
        cow = cow || (t->defined() && t->has_storage() && c10::impl::cow::is_cow_data_ptr(t->storage().data_ptr()));
      }
      if (cow) continue;  // describing would materialize it: a write this object must not make
      Tensors described;
      if (!described.take_all(ts.data(), ts.size(), [](const Tensor& t) { return plain_cpu(t, false); })) continue;
      h->remark(described);
      held_registry()[seq] = h;
      lists_.push_back(std::move(h));
    }
  }
  HeldLists(const HeldLists&) = delete;
  HeldLists& operator=(const HeldLists&) = delete;
  ~HeldLists() {
    auto& r = held_registry();
    for (const auto& h : lists_) {
      auto it = r.find(h->list.ptr());
      if (it != r.end() && it->second == h) r.erase(it);
    }
  }

  // How many of the lists given are held (a list held by another object, or holding anything
  // but tensors, is not).
  size_t size() const { return lists_.size(); }

 private:
  std::vector<std::shared_ptr<HeldList>> lists_;
};

}  // namespace direct

}  // namespace
