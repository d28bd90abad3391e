// Part of the torch glue of ampfunc, the one translation unit ext/bindings.cpp (which includes
// each file of ext/glue/ once; one heavy torch translation unit keeps the build short).
// The CPU output pool: the memory of the out-of-place CPU kernels' outputs.
#pragma once

#include "common.h"
#include "validation.h"

namespace {

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

}  // namespace
