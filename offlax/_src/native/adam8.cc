// Adam/AdamW with 8-bit blockwise-quantized moments (offlax/_src/quantized.py), for XLA:CPU.
//
// OfflaxAdam8Step: per block of 256 elements, in one pass over memory: the
// moments dequantized (map[code] * scale), updated as optax updates them, the
// update (or the new param, or the new master and low-precision param) written
// as optax's expression as written, and the new moments quantized again
// (absmax scale; the code is the number of midpoints <= m / scale).
//
// Codes: with AVX-512, from the float's bits by arithmetic and lookups in
// registers (Segments: the octave and the run of evenly spaced midpoints that
// y falls in give the count as a floor, to within one where y is near a
// midpoint); a group of 64 with such a y, a block with a subnormal or
// non-finite scale, the last partial vectors of a leaf and CPUs without
// AVX-512 take quantized.py's bucket table (keyed by the top 17 bits of
// m / scale, then one comparison with the next midpoint). Both give the JAX
// path's count for every float in [-1, 1] (`OfflaxAdam8CheckCodes` checks
// every one; tests/test_state_bits.py). Dequantized values: byte-plane permutes
// (BytePlanes, with VBMI) or float permutes (RegTable); no gathers (a 16-lane
// gather costs about what 16 loads do).
//
// Divisions: the update's two divisions by the bias corrections are exact
// emulations by FMA (DivideBy: Markstein's correction of a multiply by the
// reciprocal), where the divider took ten cycles a vector each; the division
// by the denominator and the square root stay.
//
// Every table comes from Python (`quantized.py`), so the codes are the JAX
// path's; every float operation is the JAX path's in its order (or rounds as
// it does), so with XLA told to evaluate as written (no algebraic rewrites, no
// FMA: the tests' flags) the results are bit-identical, and under XLA's
// defaults they agree to rounding (FMA contraction of the moments, as adam.cc
// says).
//
// Threads: the blocks are split in chunks over the calling thread and XLA's
// intra-op pool, or offlax's own where XLA gives fewer than two threads (a GPU
// program's host computation), capped by OFFLAX_NATIVE_THREADS: adam.cc's
// (common.h).
#include "common.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using namespace offlax_native;  // NOLINT: the kernels share its names

constexpr int64_t kBlockSize = 256;
constexpr int kKeyShift = 15;

struct Tables {
  const float* map_m;    // the signed map (256)
  const float* map_v;    // the unsigned map (256)
  const float* above_m;  // the signed midpoints, then +inf (256)
  const float* above_v;
  const int32_t* key_m;  // the bucket counts (2**17)
  const int32_t* key_v;
};

// The index of y (the number of midpoints <= y) from y's bits by arithmetic,
// a few lookups in registers and no search. The dynamic map's positive
// midpoints fall in a few runs on arithmetic grids (one run a decade), each
// after one isolated midpoint (the one between two decades): a run's
// "segment" starts at that midpoint T, and for T <= a < the next T,
//   count(a) = C + clamp(floor(a * A + B), 0, K),
// C the midpoints <= T, K the run's length, A and B its grid (the run's
// j-th midpoint at t = j). An octave of floats holds at most one T, so a's
// segment is its octave's first segment, plus one at or above the octave's T
// (two lookups by the exponent, an integer compare), and A, B, C, K four more
// lookups by segment. The float32 midpoints sit within 2**-15 of their grid,
// so a t that is not within kNear of an integer gives the exact count; a
// vector with a t that is (a few in a thousand vectors), or with |y| > 1, takes
// the bucket table (IndexOf), which is exact everywhere. The signed map is
// symmetric (less its top midpoint): for y < 0 the count is 127 minus the
// positive midpoints below |y| (those <= the float just below it). Checked
// against IndexOf on every float in [-1, 1] (`offlax_adam8_check_codes`,
// tests/test_state_bits.py).
struct Segments {
  static constexpr int kMax = 16;       // segments, with the one below the first T
  static constexpr int kOctaves = 32;   // octaves 2**-31 .. 2**0 (lower ones fold into the first)
  static constexpr int kFirstExponent = 127 - 31;  // biased exponent of octave 0
  static constexpr int kFraction = 12;  // t in fixed point: 12 fraction bits
  static constexpr float kNear = 1.0f / (1 << (kFraction + 2));  // the grid's error bound, checked by Build
  bool ok = false;
  int32_t octave_segment[kOctaves];  // 1 + the segment of the octave's lowest float, + 1
  int32_t octave_start[kOctaves];    // the bits of the T in the octave, else of +inf
  float a[kMax], b[kMax];
  int32_t c[kMax], k[kMax];

  // From the midpoints (255, ascending, then +inf). False (no fast path) if the
  // map has not this shape.
  bool Build(const float* above, bool is_signed) {
    const float* p = is_signed ? above + 127 : above;  // the positive midpoints
    const int n = is_signed ? 128 : 255;
    if (is_signed) {
      for (int i = 0; i < 127; ++i) {
        if (above[i] != -above[253 - i]) return ok = false;
      }
    }
    if (!(p[0] > 0)) return ok = false;
    int segments = 1;  // segment 0: below the first T (count 0)
    a[0] = 0, b[0] = 0.5f, c[0] = 0, k[0] = 0;
    int32_t starts[kMax];
    for (int i = 0; i < n;) {
      if (segments == kMax) return ok = false;
      // Midpoint i starts a segment; its run: the longest after it whose grid
      // (from its first and last) puts every one within kNear / 4 of its slot.
      int run = 0;
      float sa = 0, sb = 0.5f;
      for (int len = 1; i + len < n; ++len) {
        const double first = p[i + 1], last = p[i + len];
        const double step = len == 1 ? first : (last - first) / (len - 1);
        const float ta = static_cast<float>(1 / step), tb = static_cast<float>(1 - first / step);
        bool fits = true;
        for (int j = 1; j <= len && fits; ++j) {
          const float t = std::fma(p[i + j], ta, tb);
          fits = std::fabs(t - j) <= kNear;
        }
        if (!fits) break;
        run = len, sa = ta, sb = tb;
      }
      std::memcpy(&starts[segments], &p[i], sizeof(float));
      a[segments] = sa, b[segments] = sb, c[segments] = i + 1, k[segments] = run;
      ++segments;
      i += 1 + run;
    }
    for (int s = segments; s < kMax; ++s) a[s] = 0, b[s] = 0.5f, c[s] = 0, k[s] = 0;
    for (int s = 0; s < kMax; ++s) {
      // t in fixed point (exact: powers of two); signed codes are the count - 1 (SegmentRegs::Codes).
      a[s] *= 1 << kFraction, b[s] *= 1 << kFraction, c[s] -= is_signed ? 1 : 0;
    }
    for (int o = 0; o < kOctaves; ++o) {
      const uint32_t low = o == 0 ? 0u : static_cast<uint32_t>(kFirstExponent + o) << 23;
      const uint32_t high = static_cast<uint32_t>(kFirstExponent + o + 1) << 23;
      int below = 0, inside = 0;
      octave_start[o] = 0x7f800000;
      for (int s = 1; s < segments; ++s) {
        const uint32_t t = static_cast<uint32_t>(starts[s]);
        if (t < low) ++below;
        if (t >= low && t < high) ++inside, octave_start[o] = starts[s];
      }
      if (inside > 1 || (o == 0 && below + inside > 0)) return ok = false;
      octave_segment[o] = below + 1;
    }
    return ok = true;
  }
};

struct Job8;
using Kernel8 = void (*)(const Job8&, int64_t, int64_t);

struct Job8 : Chunks {
  Kernel8 kernel;
  Tables t;
  Segments segments_m, segments_v;
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
  void RunChunk(int64_t c) const { kernel(*this, c * chunk, std::min(blocks, (c + 1) * chunk)); }
};

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

// Segments in registers.
struct SegmentRegs {
  __m512i octave_segment[2], octave_start[2], c, k;
  __m512 a, b;
  void Load(const Segments& s) {
    for (int h = 0; h < 2; ++h) {
      octave_segment[h] = _mm512_loadu_si512(s.octave_segment + 16 * h);
      octave_start[h] = _mm512_loadu_si512(s.octave_start + 16 * h);
    }
    a = _mm512_loadu_ps(s.a), b = _mm512_loadu_ps(s.b);
    c = _mm512_loadu_si512(s.c), k = _mm512_loadu_si512(s.k);
  }

  // The codes of y (index - 128 if signed) for |y| <= 1; `near` gets a lane's
  // sign bit set where t is within 2**-12 of an integer, where the grid's error
  // could change the count.
  template <bool kSigned>
  __m512i Codes(__m512 y, __m512i& near) const {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i sign = _mm512_srai_epi32(bits, 31);  // -1 where y < 0
    // Signed: y < 0 counts the midpoints < |y|: those <= the float below it (bits - 1).
    // Unsigned: y < 0 (never met: v >= 0) has negative bits, so counts as 0, as it should.
    // Floats below octave 0 (2**-31) count as its lowest: no T lies there.
    const __m512i x = _mm512_max_epi32(
        kSigned ? _mm512_add_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), sign) : bits,
        _mm512_set1_epi32(Segments::kFirstExponent << 23));
    // The octave: the exponent - 96, which the permutes take modulo 32.
    const __m512i octave = _mm512_srli_epi32(x, 23);
    const __m512i first = _mm512_permutex2var_epi32(octave_segment[0], octave, octave_segment[1]);
    const __m512i start = _mm512_permutex2var_epi32(octave_start[0], octave, octave_start[1]);
    // Both >= 0 and <= +inf, so their bits order as their values: x - start < 0 below T.
    const __m512i segment = _mm512_add_epi32(first, _mm512_srai_epi32(_mm512_sub_epi32(x, start), 31));
    const __m512 t = _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_permutexvar_ps(segment, a),
                                     _mm512_permutexvar_ps(segment, b));
    // t in fixed point, rounded: its integer part is the floor of t unless t is within
    // half a step of an integer, where the fraction is 0.
    const __m512i fixed = _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    near = _mm512_or_si512(
        near, _mm512_sub_epi32(_mm512_and_si512(fixed, _mm512_set1_epi32((1 << Segments::kFraction) - 1)),
                               _mm512_set1_epi32(1)));
    const __m512i floor = _mm512_srai_epi32(fixed, Segments::kFraction);
    const __m512i count = _mm512_add_epi32(
        _mm512_permutexvar_epi32(segment, c),
        _mm512_min_epi32(_mm512_max_epi32(floor, _mm512_setzero_si512()), _mm512_permutexvar_epi32(segment, k)));
    if constexpr (kSigned) {
      // count: the positive midpoints <= x, less one. y >= 0: the code is index - 128 =
      // 127 + (count + 1) - 128; y < 0: 127 - min(count + 1, 127) - 128 = ~min(count + 1, 127)
      // (no top midpoint among the negative ones).
      const __m512i q = _mm512_min_epi32(_mm512_sub_epi32(count, sign), _mm512_set1_epi32(127));
      return _mm512_xor_si512(q, sign);
    } else {
      return count;
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

// One moment's tables in registers: its map, its segments.
struct MapRegs {
#ifdef __AVX512VBMI__
  BytePlanes map;
#else
  RegTable<256> map;
#endif
  SegmentRegs segments;
  void Load(const float* values, const Segments& s) {
    map.Load(values);
    segments.Load(s);
  }
};
#else
struct MapRegs {
  void Load(const float*, const Segments&) {}
};
#endif

#ifdef __AVX512F__
// a / b rounded as the division rounds it, for a divisor b fixed for a block and
// its reciprocal rb = 1 / b (rounded): a Newton step puts q within an ulp of
// a / b, and then, rb being the correctly rounded reciprocal, q + (a - b q) rb
// rounded is the correctly rounded quotient (Markstein's theorem; Muller et al.,
// Handbook of Floating-Point Arithmetic, 2nd ed., th. 4.10), with a - b q exact
// (an FMA). Four FMAs and a multiply where the divider takes about ten cycles a
// vector: the bias corrections' two divisions were half of the step's time.
// Valid without underflow and overflow: b in [2**-20, 2], |a| in [2**-76, 2**100]
// or 0 (DivisorOk, Divides); the sign comes from a, so -0 stays -0.
inline __m512 DivideBy(__m512 a, __m512 b, __m512 rb) {
  __m512 q = _mm512_mul_ps(a, rb);
  q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, b, a), rb, q);
  q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, b, a), rb, q);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(q), _mm512_castps_si512(a),
                                                       _mm512_set1_epi32(0x7fffffff), 0xe4));
}
#endif

// Whether DivideBy may divide by b.
inline bool DivisorOk(float b) { return b >= 0x1p-20f && b <= 2.0f; }

// Whether DivideBy may divide every element of a block by such a b: from the
// block's largest |x| bits and its smallest (|x| bits - 1) (unsigned: 0 wraps to the top).
constexpr uint32_t kLowestDividend = 51u << 23, kHighestDividend = 227u << 23;  // 2**-76, 2**100
inline bool Divides(uint32_t most_bits, uint32_t least_bits_minus_one) {
  return most_bits < kHighestDividend && least_bits_minus_one >= kLowestDividend - 1;
}

// The update before weight decay, optax's (m / bc1) / (sqrt(v / bc2 + eps_root) + eps),
// each operation rounded as written; with `fast` the two divisions by the bias
// corrections by DivideBy.
inline void Updates(const float* m, const float* v, int64_t n, float bc1, float bc2, float eps_root,
                    float eps, bool fast, float* u) {
  int64_t i = 0;
#ifdef __AVX512F__
  if (fast) {
    const __m512 b1v = _mm512_set1_ps(bc1), r1 = _mm512_set1_ps(1.0f / bc1);
    const __m512 b2v = _mm512_set1_ps(bc2), r2 = _mm512_set1_ps(1.0f / bc2);
    const __m512 er = _mm512_set1_ps(eps_root), ev = _mm512_set1_ps(eps);
    for (; i + 16 <= n; i += 16) {
      const __m512 mh = DivideBy(_mm512_loadu_ps(m + i), b1v, r1);
      const __m512 vh = DivideBy(_mm512_loadu_ps(v + i), b2v, r2);
      const __m512 d = _mm512_add_ps(_mm512_sqrt_ps(_mm512_add_ps(vh, er)), ev);
      _mm512_storeu_ps(u + i, _mm512_div_ps(mh, d));
    }
  }
#else
  (void)fast;
#endif
  for (; i < n; ++i) u[i] = (m[i] / bc1) / (std::sqrt(v[i] / bc2 + eps_root) + eps);
}

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
__attribute__((always_inline)) inline void Quantize(const float* x, int64_t n, float s, const int32_t* keys, const float* above,
                     bool fast, const MapRegs& regs, Code* codes) {
  constexpr int32_t offset = std::is_signed_v<Code> ? 128 : 0;
  const float r = 1.0f / (s > 0 ? s : 1.0f);
  int64_t i = 0;
#ifdef __AVX512F__
  constexpr int kK = 4;  // vectors a group: one check of the group's lanes for the slow path
  const __m512 rv = _mm512_set1_ps(r);
  // |y| <= 1 where s is 0 or a normal float: |x| <= s, and r = 1 / s rounded is within
  // 2**-24 of 1 / s, so x * r rounds to 1 at most. A subnormal or non-finite s
  // (and its |y| > 1, infinities and NaNs) takes the table, whose clipped buckets
  // define every code.
  fast = fast && (s == 0 || (s >= 0x1p-126f && s <= 0x1p126f));
  for (; fast && i + 16 * kK <= n; i += 16 * kK) {
    __m512i code[kK], near = _mm512_setzero_si512();
    for (int k = 0; k < kK; ++k) {
      code[k] = regs.segments.Codes<std::is_signed_v<Code>>(_mm512_mul_ps(_mm512_loadu_ps(x + i + 16 * k), rv), near);
    }
    // A t near an integer: the table for the group.
    if (_mm512_movepi32_mask(near) != 0) {
      for (int64_t k = i; k < i + 16 * kK; ++k) {
        codes[k] = static_cast<Code>(IndexOf(x[k] * r, keys, above) - offset);
      }
      continue;
    }
    for (int k = 0; k < kK; ++k) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i + 16 * k), _mm512_cvtepi32_epi8(code[k]));
    }
  }
#else
  (void)regs, (void)fast;
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
  regs_m.Load(t.map_m, j.segments_m);
  regs_v.Load(t.map_v, j.segments_v);
  const bool divisors_ok = DivisorOk(bc1) && DivisorOk(bc2);
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
    uint32_t am_low = ~0u, av_low = ~0u;  // the least |x| bits - 1 (0 wraps to the top)
    for (int64_t i = 0; i < n; ++i) {
      am_bits = std::max(am_bits, AbsBits(m[i]));
      av_bits = std::max(av_bits, AbsBits(v[i]));
      am_low = std::min(am_low, AbsBits(m[i]) - 1u);
      av_low = std::min(av_low, AbsBits(v[i]) - 1u);
    }
    const float am = FromBits(am_bits), av = FromBits(av_bits);
    const bool fast = divisors_ok && Divides(am_bits, am_low) && Divides(av_bits, av_low);
    // The update from the new float32 moments, before they are rounded to 8 bits,
    // and the new codes, 64 elements at a time: the update is bound by the
    // divider, the codes by the shuffle unit, and in one loop they overlap.
    for (int64_t first = 0; first < n; first += 64) {
      const int64_t last = std::min(n, first + 64);
      float us[64];
      Updates(m + first, v + first, last - first, bc1, bc2, eps_root, eps, fast, us);
      for (int64_t i = first; i < last; ++i) {
        float u = us[i - first];
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
      Quantize(m + first, last - first, am, t.key_m, t.above_m, j.segments_m.ok, regs_m, j.mc_out + lo + first);
      Quantize(v + first, last - first, av, t.key_v, t.above_v, j.segments_v.ok, regs_v, j.vc_out + lo + first);
    }
    j.ms_out[b] = am;
    j.vs_out[b] = av;
  }
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
  job->segments_m.Build(job->t.above_m, true);
  job->segments_v.Build(job->t.above_v, false);
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
  RunChunks(pool, job, n);
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

// The codes the kernel's fast path gives (Segments) against the bucket table's
// (IndexOf, quantized.py's) for every `stride`-th float bit pattern in [0, 1]
// and, for the signed map, [-1, -0]: the number that differ (0), or -1 where
// the map has no fast path or the CPU no AVX-512 (nothing to check). `slow`
// gets how many fell to the table (t near an integer). For the tests.
extern "C" int64_t OfflaxAdam8CheckCodes(const float* above, const int32_t* keys, int32_t is_signed,
                                         int64_t stride, int64_t* slow) {
  Segments segments;
  *slow = 0;
  if (!segments.Build(above, is_signed != 0)) return -1;
#ifdef __AVX512F__
  SegmentRegs regs;
  regs.Load(segments);
  int64_t wrong = 0;
  alignas(64) uint32_t bits[16];
  alignas(64) int32_t got[16], near[16];
  for (uint32_t sign = 0; sign <= (is_signed ? 1u : 0u); ++sign) {
    for (int64_t first = 0; first <= 0x3f800000; first += 16 * stride) {
      for (int l = 0; l < 16; ++l) {
        bits[l] = static_cast<uint32_t>(std::min<int64_t>(first + l * stride, 0x3f800000)) | (sign << 31);
      }
      const __m512 y = _mm512_castsi512_ps(_mm512_load_si512(bits));
      __m512i near_v = _mm512_setzero_si512();
      _mm512_store_si512(got, is_signed ? regs.Codes<true>(y, near_v) : regs.Codes<false>(y, near_v));
      _mm512_store_si512(near, near_v);
      for (int l = 0; l < 16; ++l) {
        if (near[l] < 0) {
          ++*slow;
          continue;
        }
        const int32_t want = IndexOf(FromBits(bits[l]), keys, above) - (is_signed ? 128 : 0);
        wrong += want != got[l];
      }
    }
  }
  return wrong;
#else
  (void)keys, (void)stride;
  return -1;
#endif
}
