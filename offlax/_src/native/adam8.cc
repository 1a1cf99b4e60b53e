// Adam/AdamW with 8-bit blockwise-quantized moments (offlax/_src/quantized.py), for XLA:CPU.
//
// OfflaxAdam8Step: per block of 256 elements, in one pass over memory: the
// moments dequantized (map[code] * scale), updated as optax updates them, the
// update (or the new param, or the new master and low-precision param) written
// as optax's expression as written, and the new moments quantized again
// (absmax scale; the code is the number of midpoints <= m / scale).
//
// Lookups: with AVX-512 every table lives in registers: the code by a binary
// search over the midpoints (Search), the dequantized value by byte-plane
// permutes (BytePlanes, with VBMI) or float permutes (RegTable); no gathers,
// which were most of the step's time (on AMD Zen 4 a 16-lane gather costs about
// what 16 loads do). Without AVX-512, for the last partial vectors of a leaf,
// and for |m / scale| > 1 (a non-finite or subnormal scale), the code comes
// from quantized.py's bucket table (keyed by the top 17 bits of m / scale,
// then one comparison with the next midpoint), which gives the same count for
// every |y| <= 1 (checked on every float there, in the bench harness of issue
// 45's kernel8 work). Every table comes from Python (`quantized.py`), so the
// codes are the JAX path's; every float
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

#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

// The map index of y (quantized.quantize): the bucket's count, plus one at the next midpoint.
inline int32_t IndexOf(float y, const int32_t* keys, const float* above) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  const int32_t low = keys[bits >> kKeyShift];
  return low + (above[low] <= y ? 1 : 0);
}

#ifdef __AVX512F__
// Lookups in registers, not gathers. The step reads map[code] twice and finds
// two codes an element; as 16-lane gathers (six per 16 elements, from tables of
// 1 KiB and 512 KiB) they were most of its time: a gather costs about what 16
// loads do. A 256-entry float table fits in 16 zmm registers, and `vpermi2ps`
// picks, per lane, one of 32 entries in one instruction.

// kN floats (1, a power of two up to 16, or 32, 64, 128, 256), in registers.
template <int kN>
struct RegTable {
  static constexpr int kRegs = (kN + 15) / 16;
  __m512 r[kRegs];

  void Load(const float* values) {
    if constexpr (kN == 1) {
      r[0] = _mm512_set1_ps(values[0]);
    } else if constexpr (kN < 16) {
      float padded[16] = {};
      std::copy_n(values, kN, padded);
      r[0] = _mm512_loadu_ps(padded);
    } else {
      for (int k = 0; k < kRegs; ++k) r[k] = _mm512_loadu_ps(values + 16 * k);
    }
  }

  // values[index] in each lane, for 0 <= index < kN.
  __m512 At(__m512i index) const {
    if constexpr (kN == 1) {
      return r[0];  // Load broadcast it
    } else if constexpr (kN <= 16) {
      return _mm512_permutexvar_ps(index, r[0]);
    } else {
      // 32 entries a pair of registers (index bits 0-4), then a blend per higher bit.
      __m512 q[kRegs / 2];
      for (int k = 0; k < kRegs / 2; ++k) q[k] = _mm512_permutex2var_ps(r[2 * k], index, r[2 * k + 1]);
      for (int bit = 32, n = kRegs / 2; n > 1; bit *= 2, n /= 2) {
        const __mmask16 high = _mm512_test_epi32_mask(index, _mm512_set1_epi32(bit));
        for (int k = 0; k < n / 2; ++k) q[k] = _mm512_mask_blend_ps(high, q[2 * k], q[2 * k + 1]);
      }
      return q[0];
    }
  }
};

// The index of y (the number of midpoints <= y): a binary search over the 255
// midpoints for its first five levels (step 128 compares with one of 1
// candidate, step 64 with one of 2, ..., step 8 with one of 16: each level's
// candidates fit in a register), which leaves y between midpoints 8c - 1 and
// 8c + 7; then the 7 midpoints 8c .. 8c + 6 at once, each from a table of 32
// (one `vpermi2ps` each, and no chain between them: three more levels would
// take 11 permutes and blends, this takes 7). Exact for |y| <= 1, where the
// bucket table gives the same count (quantized.bucket_counts).
struct Search {
  RegTable<1> s128;
  RegTable<2> s64;
  RegTable<4> s32;
  RegTable<8> s16;
  RegTable<16> s8;
  RegTable<32> last[7];  // last[t][c] = midpoint 8c + t

  void Load(const float* above) {
    float level[128];
    auto load = [&](auto& table, int step) {
      for (int c = 0; c < 128 / step; ++c) level[c] = above[c * 2 * step + step - 1];
      table.Load(level);
    };
    load(s128, 128), load(s64, 64), load(s32, 32), load(s16, 16), load(s8, 8);
    for (int t = 0; t < 7; ++t) {
      for (int c = 0; c < 32; ++c) level[c] = above[8 * c + t];
      last[t].Load(level);
    }
  }

  // One level for kK vectors at once: a level's permute and compare wait on the
  // last level's add, so a single vector's search is a chain of latencies; kK
  // independent chains keep the vector units busy.
  template <int kStep, int kK, typename Table>
  static void Level(const Table& table, const __m512 (&y)[kK], __m512i (&index)[kK]) {
    const __m512i step = _mm512_set1_epi32(kStep);
    for (int k = 0; k < kK; ++k) {
      // index is a multiple of 2 * kStep here: its candidate is number index / (2 * kStep).
      const __m512i c = _mm512_srli_epi32(index[k], __builtin_ctz(2 * kStep));
      const __mmask16 reached = _mm512_cmp_ps_mask(table.At(c), y[k], _CMP_LE_OQ);
      index[k] = _mm512_mask_add_epi32(index[k], reached, index[k], step);
    }
  }

  template <int kK>
  void IndexOf(const __m512 (&y)[kK], __m512i (&index)[kK]) const {
    for (int k = 0; k < kK; ++k) index[k] = _mm512_setzero_si512();
    Level<128>(s128, y, index);
    Level<64>(s64, y, index);
    Level<32>(s32, y, index);
    Level<16>(s16, y, index);
    Level<8>(s8, y, index);
    const __m512i one = _mm512_set1_epi32(1);
    for (int k = 0; k < kK; ++k) {
      const __m512i c = _mm512_srli_epi32(index[k], 3);
      __m512i count = index[k];
      for (int t = 0; t < 7; ++t) {
        const __mmask16 reached = _mm512_cmp_ps_mask(last[t].At(c), y[k], _CMP_LE_OQ);
        count = _mm512_mask_add_epi32(count, reached, count, one);
      }
      index[k] = count;
    }
  }
};

#ifdef __AVX512VBMI__
// A 256-entry float table as four byte planes (byte b of every entry), 4 registers
// each, for 64 lookups at a time: `vpermi2b` picks one of 128 bytes per lane,
// so a plane takes two and a blend on the index's top bit, and four unpacks put
// the bytes back together as floats: about a quarter of RegTable's work a lookup.
struct BytePlanes {
  __m512i plane[4][4];  // [byte of the float][64 entries]
  // Moves byte (4 L + r) of a 64-byte index vector's 4-byte groups to (4 r + L),
  // so that the unpacks (which interleave within 128-bit lanes) return the
  // entries in order.
  __m512i order;

  void Load(const float* values) {
    alignas(64) uint8_t bytes[4][256];
    for (int e = 0; e < 256; ++e) {
      uint32_t bits;
      std::memcpy(&bits, &values[e], sizeof bits);
      for (int b = 0; b < 4; ++b) bytes[b][e] = static_cast<uint8_t>(bits >> (8 * b));
    }
    for (int b = 0; b < 4; ++b) {
      for (int q = 0; q < 4; ++q) plane[b][q] = _mm512_load_si512(bytes[b] + 64 * q);
    }
    alignas(64) uint8_t from[64];
    for (int lane = 0; lane < 4; ++lane) {
      for (int r = 0; r < 4; ++r) {
        for (int q = 0; q < 4; ++q) from[16 * lane + 4 * r + q] = 16 * r + 4 * lane + q;
      }
    }
    order = _mm512_load_si512(from);
  }

  // values[index[i]] * s for the 64 byte indices, to out[0..63].
  void Lookup(__m512i index, __m512 s, float* out) const {
    index = _mm512_permutexvar_epi8(order, index);
    const __mmask64 high = _mm512_movepi8_mask(index);  // index >= 128
    __m512i b[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i low = _mm512_permutex2var_epi8(plane[k][0], index, plane[k][1]);
      const __m512i up = _mm512_permutex2var_epi8(plane[k][2], index, plane[k][3]);
      b[k] = _mm512_mask_blend_epi8(high, low, up);
    }
    const __m512i b01_low = _mm512_unpacklo_epi8(b[0], b[1]), b01_high = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i b23_low = _mm512_unpacklo_epi8(b[2], b[3]), b23_high = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i f[4] = {
        _mm512_unpacklo_epi16(b01_low, b23_low), _mm512_unpackhi_epi16(b01_low, b23_low),
        _mm512_unpacklo_epi16(b01_high, b23_high), _mm512_unpackhi_epi16(b01_high, b23_high)};
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + 16 * k, _mm512_mul_ps(_mm512_castsi512_ps(f[k]), s));
  }
};
#endif

// One moment's tables in registers: its map, its midpoints by level.
struct MapRegs {
#ifdef __AVX512VBMI__
  BytePlanes map;
#else
  RegTable<256> map;
#endif
  Search search;
  void Load(const float* values, const float* above) {
    map.Load(values);
    search.Load(above);
  }
};
#else
struct MapRegs {
  void Load(const float*, const float*) {}
};
#endif

// The dequantized moment of a block: map[code + offset] * s (offset 128 for int8 codes).
template <typename Code>
inline void Dequantize(const Code* codes, int64_t n, float s, const float* map, const MapRegs& regs,
                       float* out) {
  constexpr int32_t offset = std::is_signed_v<Code> ? 128 : 0;
  int64_t i = 0;
#if defined(__AVX512VBMI__)
  const __m512 scale = _mm512_set1_ps(s);
  for (; i + 64 <= n; i += 64) {
    __m512i index = _mm512_loadu_si512(codes + i);
    if constexpr (std::is_signed_v<Code>) index = _mm512_xor_si512(index, _mm512_set1_epi8(-128));
    regs.map.Lookup(index, scale, out + i);
  }
#elif defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(s);
  for (; i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    const __m512i index = std::is_signed_v<Code>
                              ? _mm512_add_epi32(_mm512_cvtepi8_epi32(bytes), _mm512_set1_epi32(offset))
                              : _mm512_cvtepu8_epi32(bytes);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(regs.map.At(index), scale));
  }
#else
  (void)regs;
#endif
  for (; i < n; ++i) out[i] = map[codes[i] + offset] * s;
}

// The codes of x[i] * (1 / s) (quantized.quantize): the map index, minus 128 for int8 codes.
template <typename Code>
inline void Quantize(const float* x, int64_t n, float s, const int32_t* keys, const float* above,
                     const MapRegs& regs, Code* codes) {
  constexpr int32_t offset = std::is_signed_v<Code> ? 128 : 0;
  const float r = 1.0f / (s > 0 ? s : 1.0f);
  int64_t i = 0;
#ifdef __AVX512F__
  constexpr int kK = 4;  // vectors searched side by side (Search::Level)
  const __m512 rv = _mm512_set1_ps(r);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (; i + 16 * kK <= n; i += 16 * kK) {
    __m512 y[kK];
    __mmask16 inside = 0xffff;
    for (int k = 0; k < kK; ++k) {
      y[k] = _mm512_mul_ps(_mm512_loadu_ps(x + i + 16 * k), rv);
      const __m512 abs_y = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(y[k]), abs_mask));
      inside &= _mm512_cmp_ps_mask(abs_y, _mm512_set1_ps(1.0f), _CMP_LE_OQ);
    }
    // |y| > 1, infinities and NaNs (a subnormal or non-finite scale) take the table,
    // whose clipped buckets define their codes.
    if (inside != 0xffff) {
      for (int64_t k = i; k < i + 16 * kK; ++k) {
        codes[k] = static_cast<Code>(IndexOf(x[k] * r, keys, above) - offset);
      }
      continue;
    }
    __m512i index[kK];
    regs.search.IndexOf(y, index);
    for (int k = 0; k < kK; ++k) {
      const __m512i code = _mm512_sub_epi32(index[k], _mm512_set1_epi32(offset));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i + 16 * k), _mm512_cvtepi32_epi8(code));
    }
  }
#else
  (void)regs;
#endif
  for (; i < n; ++i) codes[i] = static_cast<Code>(IndexOf(x[i] * r, keys, above) - offset);
}

template <typename G, typename P, Out kOut, bool kDecay>
void Step8(const Job8& j, int64_t first_block, int64_t last_block) {
  const float c1 = j.h[kC1], b1 = j.h[kB1], c2 = j.h[kC2], b2 = j.h[kB2];
  const float bc1 = j.h[kBc1], bc2 = j.h[kBc2], eps_root = j.h[kEpsRoot];
  const float eps = j.h[kEps], step = j.h[kStep], wd = j.h[kWd];
  const Tables t = j.t;
  MapRegs regs_m, regs_v;  // loaded once a chunk (256 blocks)
  regs_m.Load(t.map_m, t.above_m);
  regs_v.Load(t.map_v, t.above_v);
  float m[kBlockSize], v[kBlockSize];
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t lo = b * kBlockSize, n = std::min(kBlockSize, j.size - lo);
    const G* g_in = static_cast<const G*>(j.g) + lo;
    Dequantize(j.mc + lo, n, j.ms[b], t.map_m, regs_m, m);
    Dequantize(j.vc + lo, n, j.vs[b], t.map_v, regs_v, v);
    for (int64_t i = 0; i < n; ++i) {
      const float g = Widen(g_in[i]);
      m[i] = MulAdd(c1, g, b1 * m[i]);      // (1 - b1) * g + b1 * m
      v[i] = MulAdd(c2, g * g, b2 * v[i]);  // (1 - b2) * g**2 + b2 * v
    }
    uint32_t am_bits = 0, av_bits = 0;
    for (int64_t i = 0; i < n; ++i) {
      am_bits = std::max(am_bits, AbsBits(m[i]));
      av_bits = std::max(av_bits, AbsBits(v[i]));
    }
    const float am = FromBits(am_bits), av = FromBits(av_bits);
    // The update from the new float32 moments, before they are rounded to 8 bits,
    // and the new codes, 64 elements at a time: the update is bound by the
    // divider, the codes by the shuffle unit, and in one loop they overlap.
    for (int64_t first = 0; first < n; first += 64) {
      const int64_t last = std::min(n, first + 64);
      for (int64_t i = first; i < last; ++i) {
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
      Quantize(m + first, last - first, am, t.key_m, t.above_m, regs_m, j.mc_out + lo + first);
      Quantize(v + first, last - first, av, t.key_v, t.above_v, regs_v, j.vc_out + lo + first);
    }
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
