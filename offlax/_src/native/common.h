// What the Adam kernels (adam.cc, adam8.cc) share: the hyperparameters' order,
// the outputs a step may write, bfloat16 conversions as XLA converts, and the
// threads a call runs on (XLA's intra-op pool, or offlax's own).
//
// In a named namespace, not an anonymous one: one OwnPool for the whole library,
// whichever kernel starts it.
#ifndef OFFLAX_NATIVE_COMMON_H_
#define OFFLAX_NATIVE_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace offlax_native {

namespace ffi = xla::ffi;

// Hyperparameters, computed by the caller exactly as optax computes them (host_adam.step_hyper).
enum { kC1, kB1, kC2, kB2, kBc1, kBc2, kEpsRoot, kEps, kStep, kWd, kNumHyper };

// What a whole step writes besides the state (host_adam.OUT_*, host_adam8.OUT_UPDATE).
enum class Out {
  kNone = 0,    // `w` is the param: the step is done
  kDelta = 1,   // `w` is the master: float32 update of the low-precision param
  kParam = 2,   // `w` is the master: the new low-precision param (`w` rounded)
  kUpdate = 3,  // the update only (adam8.cc)
};

// a * b + c as XLA:CPU's loop computes it.
inline float MulAdd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// bfloat16 <-> float as XLA converts: exact widening; narrowing rounds to
// nearest even, NaN stays a (quiet) NaN.
inline float FromBf16(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

inline uint16_t ToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? (x >> 16) | 0x40u : rounded);
}

// float from T (uint16_t: bfloat16), and back.
template <typename T>
inline float Widen(T x) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return FromBf16(x);
  } else {
    return x;
  }
}

template <typename T>
inline T Narrow(float x) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return ToBf16(x);
  } else {
    return x;
  }
}

inline bool F32OrBf16(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16;
}

// Threads a call may use: OFFLAX_NATIVE_THREADS if set (read once), else all of its pool.
inline int64_t MaxThreads(int64_t pool_threads) {
  static const int64_t cap = [] {
    const char* env = std::getenv("OFFLAX_NATIVE_THREADS");
    const long value = env == nullptr ? 0 : std::strtol(env, nullptr, 10);
    return value > 0 ? static_cast<int64_t>(value) : int64_t{0};
  }();
  const int64_t threads = std::max<int64_t>(1, pool_threads);
  return cap > 0 ? std::min(cap, threads) : threads;
}

// The cores this process may run on.
inline int64_t Cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

// offlax's own workers, one per core but the caller's, for calls that XLA gives no pool.
// Started on first use and never stopped: a pool destroyed at exit would wait for workers
// blocked on its queue.
class OwnPool {
 public:
  static OwnPool& Get() {
    static OwnPool* pool = new OwnPool(Cores() - 1);
    return *pool;
  }
  int64_t num_threads() const { return workers_; }
  void Schedule(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(fn));
    }
    ready_.notify_one();
  }

 private:
  explicit OwnPool(int64_t workers) : workers_(workers) {
    for (int64_t t = 0; t < workers_; ++t) std::thread([this] { Loop(); }).detach();
  }
  void Loop() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [this] { return !queue_.empty(); });
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }
  const int64_t workers_;
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
};

// Whether a call whose XLA pool has `pool_threads` threads uses offlax's own pool:
// OFFLAX_NATIVE_POOL=own or =xla (read once) decides, else whether XLA gave fewer than two.
inline bool UseOwnPool(int64_t pool_threads) {
  static const int forced = [] {
    const char* env = std::getenv("OFFLAX_NATIVE_POOL");
    if (env == nullptr) return 0;
    return std::strcmp(env, "own") == 0 ? 1 : std::strcmp(env, "xla") == 0 ? -1 : 0;
  }();
  return forced == 0 ? pool_threads < 2 : forced > 0;
}

// With OFFLAX_NATIVE_DEBUG set (not "0"), says once what the first call of more than one
// chunk was given: where the host step runs slower than on the CPU backend, the pool is the
// first suspect.
inline void SayPool(int64_t pool_threads, bool own, int64_t threads, int64_t size) {
  static std::once_flag once;
  std::call_once(once, [&] {
    const char* env = std::getenv("OFFLAX_NATIVE_DEBUG");
    if (env == nullptr || env[0] == '\0' || std::strcmp(env, "0") == 0) return;
    std::fprintf(stderr,
                 "offlax native: XLA's intra-op pool has %lld threads; the first call (%lld "
                 "elements) ran on %lld threads (%s)\n",
                 static_cast<long long>(pool_threads), static_cast<long long>(size),
                 static_cast<long long>(threads), own ? "offlax's own pool" : "XLA's pool");
  });
}

// A call's work in chunks, taken by whichever thread is free. A job derives from it and
// has `void RunChunk(int64_t c) const`.
struct Chunks {
  int64_t num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

// Runs chunks until none is left. A helper that starts late finds none, so the
// caller waits only for chunks that some running thread has taken.
template <typename Job>
void Work(Job& j) {
  for (int64_t c; (c = j.next.fetch_add(1)) < j.num_chunks;) {
    j.RunChunk(c);
    if (j.done.fetch_add(1) + 1 == j.num_chunks) {
      std::lock_guard<std::mutex> lock(j.mu);
      j.all_done.notify_all();
    }
  }
}

// Runs a job's chunks over the caller and XLA's intra-op threads (or offlax's own,
// where XLA gives fewer than two), and returns when all are done. `size`: the
// elements, for SayPool.
template <typename Job>
void RunChunks(ffi::ThreadPool& pool, std::shared_ptr<Job> job, int64_t size) {
  if (job->num_chunks == 0) return;
  const bool own = UseOwnPool(pool.num_threads());
  const int64_t available = own ? OwnPool::Get().num_threads() + 1 : pool.num_threads();
  const int64_t helpers = std::min(MaxThreads(available), job->num_chunks) - 1;
  if (job->num_chunks > 1) SayPool(pool.num_threads(), own, helpers + 1, size);
  for (int64_t t = 0; t < helpers; ++t) {
    if (own) {
      OwnPool::Get().Schedule([job] { Work(*job); });
    } else {
      pool.Schedule([job] { Work(*job); });
    }
  }
  Work(*job);
  std::unique_lock<std::mutex> lock(job->mu);
  job->all_done.wait(lock, [&] { return job->done.load() == job->num_chunks; });
}

}  // namespace offlax_native

#endif  // OFFLAX_NATIVE_COMMON_H_
