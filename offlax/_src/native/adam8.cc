// Adam/AdamW with 8-bit blockwise-quantized moments (offlax/_src/quantized.py), for XLA:CPU.
//
// OfflaxAdam8Step: per block of 256 elements, in one pass over memory: the
// moments dequantized (map[code] * scale), updated as optax updates them, the
// update (or the new param, or the new master and low-precision param) written
// as optax's expression as written, and the new moments quantized again
// (absmax scale; the code from the bucket table keyed by the top 17 bits of
// m / scale, then one comparison with the next midpoint). Every table comes
// from Python (`quantized.py`), so the codes are the JAX path's; every float
// operation is the JAX path's in its order, so with XLA told to evaluate as
// written (no algebraic rewrites, no FMA: the tests' flags) the results are
// bit-identical, and under XLA's defaults they agree to rounding (FMA
// contraction of the moments, as adam.cc says).
//
// Threads: the blocks are split in chunks over the calling thread and XLA's
// intra-op pool (capped by OFFLAX_NATIVE_THREADS, as adam.cc).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum { kC1, kB1, kC2, kB2, kBc1, kBc2, kEpsRoot, kEps, kStep, kWd, kNumHyper };
constexpr int64_t kBlockSize = 256;
constexpr int kKeyShift = 15;

// What the step writes besides the state (host_adam.OUT_*).
enum class Out { kNone = 0, kDelta = 1, kParam = 2, kUpdate = 3 };

struct Tables {
  const float* map_m;    // the signed map (256)
  const float* map_v;    // the unsigned map (256)
  const float* above_m;  // the signed midpoints, then +inf (256)
  const float* above_v;
  const int32_t* key_m;  // the bucket counts (2**17)
  const int32_t* key_v;
};

struct Job8;
using Kernel8 = void (*)(const Job8&, int64_t, int64_t);

struct Job8 {
  Kernel8 kernel;
  Tables t;
  const void* g;
  const int8_t* mc;
  const float* ms;
  const uint8_t* vc;
  const float* vs;
  const float* w;
  const void* low;
  int8_t* mc_out;
  float* ms_out;
  uint8_t* vc_out;
  float* vs_out;
  float* w_out;
  void* out;
  float h[kNumHyper];
  int64_t size;
  int64_t blocks;
  int64_t chunk;  // blocks per chunk
  int64_t num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

inline float MulAdd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

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

// The bits of |x|: for floats >= 0 (and NaN) they order as the values do, so the
// absmax is an integer max, which vectorises; a NaN (above every number) wins,
// as in XLA's max (its payload may differ).
inline uint32_t AbsBits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits & 0x7fffffffu;
}

inline float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The map indices of x[i] * (1 / s) (quantized.quantize): bucket count, plus one at the next
// midpoint.
inline void Codes(const float* x, int64_t n, float s, const int32_t* keys, const float* above,
                  int32_t* index) {
  const float r = 1.0f / (s > 0 ? s : 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float y = x[i] * r;
    uint32_t bits;
    std::memcpy(&bits, &y, sizeof bits);
    const int32_t low = keys[bits >> kKeyShift];
    index[i] = low + (above[low] <= y ? 1 : 0);
  }
}

template <typename G, typename P, Out kOut, bool kDecay>
void Step8(const Job8& j, int64_t first_block, int64_t last_block) {
  const float c1 = j.h[kC1], b1 = j.h[kB1], c2 = j.h[kC2], b2 = j.h[kB2];
  const float bc1 = j.h[kBc1], bc2 = j.h[kBc2], eps_root = j.h[kEpsRoot];
  const float eps = j.h[kEps], step = j.h[kStep], wd = j.h[kWd];
  const Tables t = j.t;
  float m[kBlockSize], v[kBlockSize];
  int32_t index[kBlockSize];
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t lo = b * kBlockSize, n = std::min(kBlockSize, j.size - lo);
    const float sm = j.ms[b], sv = j.vs[b];
    const G* g_in = static_cast<const G*>(j.g) + lo;
    const int8_t* mc = j.mc + lo;
    const uint8_t* vc = j.vc + lo;
    for (int64_t i = 0; i < n; ++i) {
      const float g = Widen(g_in[i]);
      const float mq = t.map_m[mc[i] + 128] * sm;
      const float vq = t.map_v[vc[i]] * sv;
      m[i] = MulAdd(c1, g, b1 * mq);      // (1 - b1) * g + b1 * m
      v[i] = MulAdd(c2, g * g, b2 * vq);  // (1 - b2) * g**2 + b2 * v
    }
    uint32_t am_bits = 0, av_bits = 0;
    for (int64_t i = 0; i < n; ++i) {
      am_bits = std::max(am_bits, AbsBits(m[i]));
      av_bits = std::max(av_bits, AbsBits(v[i]));
    }
    const float am = FromBits(am_bits), av = FromBits(av_bits);
    // The update from the new float32 moments, before they are rounded to 8 bits.
    for (int64_t i = 0; i < n; ++i) {
      float u = (m[i] / bc1) / (std::sqrt(v[i] / bc2 + eps_root) + eps);
      if constexpr (kOut == Out::kUpdate) {
        if constexpr (kDecay) u = MulAdd(wd, j.w[lo + i], u);  // add_decayed_weights
        static_cast<float*>(j.out)[lo + i] = step * u;          // scale_by_learning_rate
      } else {
        const float w_in = j.w[lo + i];
        if constexpr (kDecay) u = MulAdd(wd, w_in, u);
        const float w = MulAdd(step, u, w_in);  // apply_updates(w, step * u)
        j.w_out[lo + i] = w;
        if constexpr (kOut == Out::kDelta) {
          static_cast<float*>(j.out)[lo + i] =
              Widen(Narrow<P>(w)) - Widen(static_cast<const P*>(j.low)[lo + i]);
        } else if constexpr (kOut == Out::kParam) {
          static_cast<P*>(j.out)[lo + i] = Narrow<P>(w);
        }
      }
    }
    Codes(m, n, am, t.key_m, t.above_m, index);
    for (int64_t i = 0; i < n; ++i) j.mc_out[lo + i] = static_cast<int8_t>(index[i] - 128);
    Codes(v, n, av, t.key_v, t.above_v, index);
    for (int64_t i = 0; i < n; ++i) j.vc_out[lo + i] = static_cast<uint8_t>(index[i]);
    j.ms_out[b] = am;
    j.vs_out[b] = av;
  }
}

void Work(Job8& j) {
  for (int64_t c; (c = j.next.fetch_add(1)) < j.num_chunks;) {
    const int64_t lo = c * j.chunk, hi = std::min(j.blocks, lo + j.chunk);
    j.kernel(j, lo, hi);
    if (j.done.fetch_add(1) + 1 == j.num_chunks) {
      std::lock_guard<std::mutex> lock(j.mu);
      j.all_done.notify_all();
    }
  }
}

int64_t MaxThreads(int64_t pool_threads) {
  static const int64_t cap = [] {
    const char* env = std::getenv("OFFLAX_NATIVE_THREADS");
    const long value = env == nullptr ? 0 : std::strtol(env, nullptr, 10);
    return value > 0 ? static_cast<int64_t>(value) : int64_t{0};
  }();
  const int64_t threads = std::max<int64_t>(1, pool_threads);
  return cap > 0 ? std::min(cap, threads) : threads;
}

template <typename G, typename P, Out kOut>
Kernel8 PickDecay(bool decay) {
  return decay ? Step8<G, P, kOut, true> : Step8<G, P, kOut, false>;
}

template <typename G>
Kernel8 PickOut(int32_t out, bool low_bf16, bool decay) {
  switch (static_cast<Out>(out)) {
    case Out::kNone: return PickDecay<G, float, Out::kNone>(decay);
    case Out::kUpdate: return PickDecay<G, float, Out::kUpdate>(decay);
    case Out::kDelta:
      return low_bf16 ? PickDecay<G, uint16_t, Out::kDelta>(decay)
                      : PickDecay<G, float, Out::kDelta>(decay);
    case Out::kParam:
      return low_bf16 ? PickDecay<G, uint16_t, Out::kParam>(decay)
                      : PickDecay<G, float, Out::kParam>(decay);
  }
  return nullptr;
}

bool F32OrBf16(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error Step8Impl(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::Buffer<ffi::S8> mc,
                     ffi::Buffer<ffi::F32> ms, ffi::Buffer<ffi::U8> vc, ffi::Buffer<ffi::F32> vs,
                     ffi::Buffer<ffi::F32> w, ffi::AnyBuffer low, ffi::Buffer<ffi::F32> maps,
                     ffi::Buffer<ffi::F32> above, ffi::Buffer<ffi::S32> keys,
                     ffi::Buffer<ffi::F32> hyper, ffi::Result<ffi::AnyBuffer> result,
                     ffi::ResultBuffer<ffi::S8> mc_out, ffi::ResultBuffer<ffi::F32> ms_out,
                     ffi::ResultBuffer<ffi::U8> vc_out, ffi::ResultBuffer<ffi::F32> vs_out,
                     ffi::ResultBuffer<ffi::F32> w_out, bool decay, int32_t out) {
  const int64_t n = static_cast<int64_t>(g.element_count());
  const int64_t blocks = (n + kBlockSize - 1) / kBlockSize;
  const bool reads_w = decay || out != static_cast<int32_t>(Out::kUpdate);
  const bool low_out = out == static_cast<int32_t>(Out::kDelta) ||
                       out == static_cast<int32_t>(Out::kParam);
  if (static_cast<int64_t>(mc.element_count()) != n ||
      static_cast<int64_t>(vc.element_count()) != n ||
      static_cast<int64_t>(ms.element_count()) != blocks ||
      static_cast<int64_t>(vs.element_count()) != blocks ||
      (reads_w && static_cast<int64_t>(w.element_count()) != n) ||
      (low_out && static_cast<int64_t>(low.element_count()) != n) ||
      maps.element_count() != 512 || above.element_count() != 512 ||
      keys.element_count() != (size_t{2} << 17) || hyper.element_count() != kNumHyper) {
    return ffi::Error::InvalidArgument("offlax adam8 step: operands of the wrong size");
  }
  if (!F32OrBf16(g.element_type()) || (low_out && !F32OrBf16(low.element_type())) || out < 0 ||
      out > 3) {
    return ffi::Error::InvalidArgument("offlax adam8 step: unsupported dtype or output");
  }
  const bool low_bf16 = low.element_type() == ffi::DataType::BF16;
  auto job = std::make_shared<Job8>();
  job->kernel = g.element_type() == ffi::DataType::BF16 ? PickOut<uint16_t>(out, low_bf16, decay)
                                                        : PickOut<float>(out, low_bf16, decay);
  job->t = Tables{maps.typed_data(),         maps.typed_data() + 256, above.typed_data(),
                  above.typed_data() + 256,  keys.typed_data(),       keys.typed_data() + (1 << 17)};
  job->g = g.untyped_data();
  job->mc = mc.typed_data();
  job->ms = ms.typed_data();
  job->vc = vc.typed_data();
  job->vs = vs.typed_data();
  job->w = w.typed_data();
  job->low = low.untyped_data();
  job->mc_out = mc_out->typed_data();
  job->ms_out = ms_out->typed_data();
  job->vc_out = vc_out->typed_data();
  job->vs_out = vs_out->typed_data();
  job->w_out = w_out->typed_data();
  job->out = result->untyped_data();
  std::copy_n(hyper.typed_data(), kNumHyper, job->h);
  job->size = n;
  job->blocks = blocks;
  job->chunk = 256;  // 64 Ki elements a chunk
  job->num_chunks = (blocks + job->chunk - 1) / job->chunk;
  if (job->num_chunks == 0) return ffi::Error::Success();
  const int64_t helpers = std::min(MaxThreads(pool.num_threads()), job->num_chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  std::unique_lock<std::mutex> lock(job->mu);
  job->all_done.wait(lock, [&] { return job->done.load() == job->num_chunks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OfflaxAdam8Step, Step8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // g (f32 or bf16)
                                  .Arg<ffi::Buffer<ffi::S8>>()   // mu codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mu scales
                                  .Arg<ffi::Buffer<ffi::U8>>()   // nu codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // nu scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w: param or master
                                  .Arg<ffi::AnyBuffer>()         // the low-precision param
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the two maps
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the two midpoint tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the two bucket tables
                                  .Arg<ffi::Buffer<ffi::F32>>()  // hyperparameters
                                  .Ret<ffi::AnyBuffer>()         // update, new param or delta
                                  .Ret<ffi::Buffer<ffi::S8>>()   // mu codes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // mu scales
                                  .Ret<ffi::Buffer<ffi::U8>>()   // nu codes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // nu scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // w
                                  .Attr<bool>("decay")
                                  .Attr<int32_t>("out"));
