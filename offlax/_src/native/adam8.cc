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
// Divisions: m / bc1 is an exact emulation by FMA (DivideBy: Markstein's
// correction of a multiply by the reciprocal); v / bc2, the division by the
// denominator and the square root take the divider (v / bc2 by DivideBy as
// well was slower: the divider has room, the two vector ports have not).
//
// Full blocks take a fast path (with AVX-512 VBMI; FastBlock): two passes over
// the block in registers and 2 KiB of L1, no call or scalar loop per 64
// elements, codes packed 64 at a time; a block it cannot take exactly (a
// subnormal or non-finite scale, an |m| DivideBy cannot divide, a negative v)
// goes to the general path (Step8), which gives the same bits. One thread,
// 16M params in place (random codes and gradients), CPU time: 1.80 -> 1.20 ns
// a param; the fp32 kernel (adam.cc) 1.07 (docs/state_bits.md).
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
//   count(a) = min(floor(a * A + B), H),
// with B holding C, the midpoints <= T (t = C at T, t = C + j at the run's
// j-th midpoint), and H = C + K, K the run's length (past the run's last
// midpoint the grid goes on to slots that are not midpoints). An octave of
// floats holds at most one T, so a's segment is its octave's first segment,
// plus one at or above the octave's T (two lookups by the exponent, an
// integer compare), and A, B, H three more lookups by segment. t is computed
// in fixed point (kFraction bits) and rounded to nearest: Build checks that
// every midpoint of a run rounds to exactly (C + j) << kFraction, and T to at
// least C << kFraction, so (t being monotonic in a) a t whose fraction is not
// 0 gives the exact count; a vector with a t whose fraction is 0 (a few in a
// thousand vectors) takes the bucket table (IndexOf), which is exact
// everywhere. The signed map is symmetric (less its top midpoint): for y < 0
// the code is ~min(1 + the positive midpoints < |y|, 127), the midpoints <=
// the float below |y|: the negative lanes count from that float, take B and H
// from a second half of the tables (segment + kMax) with the 1 folded in, and
// flip the bits. Checked against
// IndexOf on every float in [-1, 1] (`offlax_adam8_check_codes`,
// tests/test_state_bits.py).
struct Segments {
  static constexpr int kMax = 16;       // segments, with the one below the first T
  static constexpr int kOctaves = 32;   // octaves 2**-31 .. 2**0 (lower ones fold into the first)
  static constexpr int kFirstExponent = 127 - 31;  // biased exponent of octave 0
  static constexpr int kFraction = 12;  // t in fixed point: 12 fraction bits
  static constexpr float kNear = 1.0f / (1 << (kFraction + 2));  // the grid's fit, checked by Build
  bool ok = false;
  int32_t octave_segment[kOctaves];  // 1 + the segment of the octave's lowest float, + 1
  int32_t octave_start[kOctaves];    // the bits of the T in the octave, else of +inf
  float a[kMax];                     // A << kFraction, by segment
  float b[2 * kMax];                 // B << kFraction, by segment (+ kMax for y < 0)
  int32_t h[2 * kMax];               // H, likewise

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
    float fa[kMax], fb[kMax];
    int32_t c[kMax], k[kMax], first_midpoint[kMax];
    fa[0] = 0, fb[0] = 0.5f, c[0] = 0, k[0] = 0, first_midpoint[0] = -1;
    int32_t starts[kMax];
    for (int i = 0; i < n;) {
      if (segments == kMax) return ok = false;
      // Midpoint i starts a segment; its run: the longest after it whose grid
      // (from its first and last) puts every one within kNear of its slot.
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
      fa[segments] = sa, fb[segments] = sb, c[segments] = i + 1, k[segments] = run;
      first_midpoint[segments] = i;
      ++segments;
      i += 1 + run;
    }
    for (int s = segments; s < kMax; ++s) fa[s] = 0, fb[s] = 0.5f, c[s] = 0, k[s] = 0;
    constexpr float kOne = 1 << kFraction;
    for (int s = 0; s < kMax; ++s) {
      a[s] = fa[s] * kOne;  // exact: a power of two
      for (int negative = 0; negative < 2; ++negative) {
        // Signed codes: the count less one (y >= 0), ~(the count plus one) (y < 0).
        const int32_t cs = c[s] - (is_signed ? 1 - negative : 0);
        b[s + kMax * negative] = static_cast<float>((static_cast<double>(fb[s]) + cs) * kOne);
        h[s + kMax * negative] = is_signed ? std::min(cs + k[s], 127) : cs + k[s];
        // Exactly as SegmentRegs::Codes rounds: T to at least C, each midpoint to its count.
        const auto fixed = [&](float y) {
          return static_cast<int64_t>(std::nearbyint(std::fma(y, a[s], b[s + kMax * negative])));
        };
        if (s == 0 || s >= segments || (negative && !is_signed)) continue;
        if (fixed(p[first_midpoint[s]]) < int64_t{cs} * (1 << kFraction)) return ok = false;
        for (int j = 1; j <= k[s]; ++j) {
          if (fixed(p[first_midpoint[s] + j]) != int64_t{cs + j} * (1 << kFraction)) return ok = false;
        }
      }
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
  __m512i octave_segment[2], octave_start[2], h[2];
  __m512 a, b[2];
  void Load(const Segments& s) {
    for (int half = 0; half < 2; ++half) {
      octave_segment[half] = _mm512_loadu_si512(s.octave_segment + 16 * half);
      octave_start[half] = _mm512_loadu_si512(s.octave_start + 16 * half);
      b[half] = _mm512_loadu_ps(s.b + 16 * half);
      h[half] = _mm512_loadu_si512(s.h + 16 * half);
    }
    a = _mm512_loadu_ps(s.a);
  }

  // The codes of y (index - 128 if signed) for |y| <= 1; `far` keeps a lane's
  // bit set only where t's fraction is not 0 (else the count may be off by one
  // there, and the caller takes the table).
  template <bool kSigned>
  __m512i Codes(__m512 y, __mmask16& far) const {
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
    // Both >= 0 and <= +inf, so their bits order as their values.
    const __m512i segment =
        _mm512_mask_sub_epi32(first, _mm512_cmplt_epi32_mask(x, start), first, _mm512_set1_epi32(1));
    const __m512i row =  // segment + kMax where y < 0
        kSigned ? _mm512_ternarylogic_epi32(sign, _mm512_set1_epi32(Segments::kMax), segment, 0xea) : segment;
    // The permutes take the segment modulo 16 (a) or 32 (b, h).
    const __m512 t = _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_permutexvar_ps(segment, a),
                                     _mm512_permutex2var_ps(b[0], row, b[1]));
    const __m512i fixed = _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    far = _mm512_mask_test_epi32_mask(far, fixed, _mm512_set1_epi32((1 << Segments::kFraction) - 1));
    const __m512i count = _mm512_min_epi32(_mm512_srai_epi32(fixed, Segments::kFraction),
                                           _mm512_permutex2var_epi32(h[0], row, h[1]));
    if constexpr (kSigned) {
      return _mm512_xor_si512(count, sign);
    } else {
      return count;
    }
  }
};

// Four vectors of codes (int32 in [-128, 127] if kSigned, else [0, 255]) as 64 bytes, in order.
template <bool kSigned>
inline __m512i PackCodes(const __m512i c[4]) {
  // The packs interleave the four by 128-bit lanes: dword 4 L + k of the result
  // holds lanes 4 L .. 4 L + 3 of c[k]; the permute puts it at 4 k + L.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m512i low = _mm512_packs_epi32(c[0], c[1]), high = _mm512_packs_epi32(c[2], c[3]);
  const __m512i bytes = kSigned ? _mm512_packs_epi16(low, high) : _mm512_packus_epi16(low, high);
  return _mm512_permutexvar_epi32(order, bytes);
}

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
    __m512 f[4];
    Lookup(index, s, f);
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + 16 * k, f[k]);
  }

  // The same, to four registers.
  void Lookup(__m512i index, __m512 s, __m512 out[4]) const {
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
    for (int k = 0; k < 4; ++k) out[k] = _mm512_mul_ps(_mm512_castsi512_ps(f[k]), s);
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
    __m512i code[kK];
    __mmask16 far = 0xffff;
    for (int k = 0; k < kK; ++k) {
      code[k] = regs.segments.Codes<std::is_signed_v<Code>>(_mm512_mul_ps(_mm512_loadu_ps(x + i + 16 * k), rv), far);
    }
    // A t near an integer: the table for the group.
    if (far != 0xffff) {
      for (int64_t k = i; k < i + 16 * kK; ++k) {
        codes[k] = static_cast<Code>(IndexOf(x[k] * r, keys, above) - offset);
      }
      continue;
    }
    _mm512_storeu_si512(codes + i, PackCodes<std::is_signed_v<Code>>(code));
  }
#else
  (void)regs, (void)fast;
#endif
  for (; i < n; ++i) codes[i] = static_cast<Code>(IndexOf(x[i] * r, keys, above) - offset);
}

#if defined(__AVX512VBMI__) && defined(__FMA__)
// The fast path of a full block: the general one's arithmetic in registers,
// with no call per 64 elements and no scalar loops. Pass 1 dequantizes 64
// codes of each moment at a time into registers, updates the moments from the
// gradient, keeps the block's absmax (and its least |m|, for DivideBy), and
// leaves the block's new moments in 2 KiB of L1; pass 2 computes the update,
// writes the outputs and packs 64 codes of each moment at a time (PackCodes,
// four instructions where vpmovdb took eight). v / bc2 takes the divider (a
// vector issues 3 operations where DivideBy issues 5, and the divider has room:
// the step's one division and square root leave it idle half of the time); m
// / bc1 stays DivideBy.
struct FastConsts {
  __m512 c1, b1, c2, b2, bc1, rb1, bc2, eps_root, eps, step, wd;
  bool root;  // eps_root != 0 (else v / bc2 + eps_root is v / bc2: never -0)
  explicit FastConsts(const float* h)
      : c1(_mm512_set1_ps(h[kC1])), b1(_mm512_set1_ps(h[kB1])), c2(_mm512_set1_ps(h[kC2])),
        b2(_mm512_set1_ps(h[kB2])), bc1(_mm512_set1_ps(h[kBc1])), rb1(_mm512_set1_ps(1.0f / h[kBc1])),
        bc2(_mm512_set1_ps(h[kBc2])), eps_root(_mm512_set1_ps(h[kEpsRoot])), eps(_mm512_set1_ps(h[kEps])),
        step(_mm512_set1_ps(h[kStep])), wd(_mm512_set1_ps(h[kWd])), root(h[kEpsRoot] != 0) {}
};

// 16 G (float or bfloat16) as floats.
template <typename G>
inline __m512 LoadWide(const G* p) {
  if constexpr (std::is_same_v<G, uint16_t>) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  } else {
    return _mm512_loadu_ps(p);
  }
}

// 16 floats to bfloat16 as ToBf16 rounds them.
inline __m256i ToBf16x16(__m512 f) {
  const __m512i x = _mm512_castps_si512(f), high = _mm512_srli_epi32(x, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40)));
}

// Whether Quantize's arithmetic codes apply to a block of scale s (see there).
inline bool ScaleOk(float s) { return s == 0 || (s >= 0x1p-126f && s <= 0x1p126f); }

// Block b (full) by the fast path; false, with nothing written, where it needs
// the general one: a scale Quantize sends to the table, an |m| DivideBy cannot
// divide, a v with its sign bit set (a NaN, or a negative scale given).
template <typename G, typename P, Out kOut, bool kDecay>
__attribute__((always_inline)) inline bool FastBlock(const Job8& j, int64_t b, const MapRegs& regs_m,
                                                     const MapRegs& regs_v, const FastConsts& k) {
  const int64_t lo = b * kBlockSize;
  const G* g = static_cast<const G*>(j.g) + lo;
  alignas(64) float m[kBlockSize], v[kBlockSize];
  // The inputs two blocks ahead: the hardware prefetchers keep too few lines in flight.
  const int64_t ahead = lo + 2 * kBlockSize;
  if (ahead + kBlockSize <= j.size) {
    for (int l = 0; l < kBlockSize; l += 64) {
      __builtin_prefetch(j.mc + ahead + l);
      __builtin_prefetch(j.vc + ahead + l);
    }
    for (int l = 0; l < kBlockSize; l += 64 / sizeof(G)) __builtin_prefetch(static_cast<const G*>(j.g) + ahead + l);
    if constexpr (kDecay || kOut != Out::kUpdate) {
      for (int l = 0; l < kBlockSize; l += 16) __builtin_prefetch(j.w + ahead + l);
    }
    if constexpr (kOut == Out::kDelta) {
      for (int l = 0; l < kBlockSize; l += 64 / sizeof(P)) __builtin_prefetch(static_cast<const P*>(j.low) + ahead + l);
    }
  }
  const __m512 ms = _mm512_set1_ps(j.ms[b]), vs = _mm512_set1_ps(j.vs[b]);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), one = _mm512_set1_epi32(1);
  __m512i m_most = _mm512_setzero_si512(), m_least = _mm512_set1_epi32(-1), v_most = _mm512_setzero_si512();
  for (int q = 0; q < kBlockSize; q += 64) {
    __m512 mf[4], vf[4];
    regs_m.map.Lookup(_mm512_xor_si512(_mm512_loadu_si512(j.mc + lo + q), _mm512_set1_epi8(-128)), ms, mf);
    regs_v.map.Lookup(_mm512_loadu_si512(j.vc + lo + q), vs, vf);
    for (int l = 0; l < 4; ++l) {
      const __m512 gv = LoadWide(g + q + 16 * l);
      const __m512 mm = _mm512_fmadd_ps(k.c1, gv, _mm512_mul_ps(k.b1, mf[l]));
      const __m512 vv = _mm512_fmadd_ps(k.c2, _mm512_mul_ps(gv, gv), _mm512_mul_ps(k.b2, vf[l]));
      _mm512_store_ps(m + q + 16 * l, mm);
      _mm512_store_ps(v + q + 16 * l, vv);
      const __m512i abs = _mm512_and_si512(_mm512_castps_si512(mm), magnitude);
      m_most = _mm512_max_epu32(m_most, abs);
      m_least = _mm512_min_epu32(m_least, _mm512_sub_epi32(abs, one));  // 0 wraps to the top
      v_most = _mm512_max_epu32(v_most, _mm512_castps_si512(vv));
    }
  }
  const uint32_t am_bits = _mm512_reduce_max_epu32(m_most), av_bits = _mm512_reduce_max_epu32(v_most);
  const float am = FromBits(am_bits), av = FromBits(av_bits);
  if ((av_bits >> 31) != 0 || !Divides(am_bits, _mm512_reduce_min_epu32(m_least)) || !ScaleOk(am) ||
      !ScaleOk(av)) {
    return false;
  }
  const __m512 rm = _mm512_set1_ps(1.0f / (am > 0 ? am : 1.0f)), rv = _mm512_set1_ps(1.0f / (av > 0 ? av : 1.0f));
  for (int q = 0; q < kBlockSize; q += 64) {
    __m512i cm[4], cv[4];
    __mmask16 far_m = 0xffff, far_v = 0xffff;
    for (int l = 0; l < 4; ++l) {
      const int64_t i = q + 16 * l;
      const __m512 mm = _mm512_load_ps(m + i), vv = _mm512_load_ps(v + i);
      __m512 vh = _mm512_div_ps(vv, k.bc2);
      if (k.root) vh = _mm512_add_ps(vh, k.eps_root);
      __m512 u = _mm512_div_ps(DivideBy(mm, k.bc1, k.rb1), _mm512_add_ps(_mm512_sqrt_ps(vh), k.eps));
      if constexpr (kOut == Out::kUpdate) {
        if constexpr (kDecay) u = _mm512_fmadd_ps(k.wd, _mm512_loadu_ps(j.w + lo + i), u);
        _mm512_storeu_ps(static_cast<float*>(j.out) + lo + i, _mm512_mul_ps(k.step, u));
      } else {
        const __m512 w_in = _mm512_loadu_ps(j.w + lo + i);
        if constexpr (kDecay) u = _mm512_fmadd_ps(k.wd, w_in, u);
        const __m512 w = _mm512_fmadd_ps(k.step, u, w_in);
        _mm512_storeu_ps(j.w_out + lo + i, w);
        if constexpr (kOut == Out::kDelta) {
          const __m512 low = LoadWide(static_cast<const P*>(j.low) + lo + i);
          if constexpr (std::is_same_v<P, uint16_t>) {
            const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ToBf16x16(w)), 16));
            _mm512_storeu_ps(static_cast<float*>(j.out) + lo + i, _mm512_sub_ps(rounded, low));
          } else {
            _mm512_storeu_ps(static_cast<float*>(j.out) + lo + i, _mm512_sub_ps(w, low));
          }
        } else if constexpr (kOut == Out::kParam) {
          if constexpr (std::is_same_v<P, uint16_t>) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<P*>(j.out) + lo + i), ToBf16x16(w));
          } else {
            _mm512_storeu_ps(static_cast<float*>(j.out) + lo + i, w);
          }
        }
      }
      cm[l] = regs_m.segments.Codes<true>(_mm512_mul_ps(mm, rm), far_m);
      cv[l] = regs_v.segments.Codes<false>(_mm512_mul_ps(vv, rv), far_v);
    }
    // A t near an integer: the table for the group (Quantize).
    if (far_m == 0xffff) {
      _mm512_storeu_si512(j.mc_out + lo + q, PackCodes<true>(cm));
    } else {
      const float r = 1.0f / (am > 0 ? am : 1.0f);
      for (int i = q; i < q + 64; ++i) j.mc_out[lo + i] = static_cast<int8_t>(IndexOf(m[i] * r, j.t.key_m, j.t.above_m) - 128);
    }
    if (far_v == 0xffff) {
      _mm512_storeu_si512(j.vc_out + lo + q, PackCodes<false>(cv));
    } else {
      const float r = 1.0f / (av > 0 ? av : 1.0f);
      for (int i = q; i < q + 64; ++i) j.vc_out[lo + i] = static_cast<uint8_t>(IndexOf(v[i] * r, j.t.key_v, j.t.above_v));
    }
  }
  j.ms_out[b] = am;
  j.vs_out[b] = av;
  return true;
}
#endif

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
#if defined(__AVX512VBMI__) && defined(__FMA__)
  const FastConsts consts(j.h);
  const bool fast_ready = j.segments_m.ok && j.segments_v.ok && DivisorOk(bc1);
#endif
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t lo = b * kBlockSize, n = std::min(kBlockSize, j.size - lo);
#if defined(__AVX512VBMI__) && defined(__FMA__)
    if (fast_ready && n == kBlockSize && FastBlock<G, P, kOut, kDecay>(j, b, regs_m, regs_v, consts)) continue;
#endif
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
  alignas(64) int32_t got[16];
  for (uint32_t sign = 0; sign <= (is_signed ? 1u : 0u); ++sign) {
    for (int64_t first = 0; first <= 0x3f800000; first += 16 * stride) {
      for (int l = 0; l < 16; ++l) {
        bits[l] = static_cast<uint32_t>(std::min<int64_t>(first + l * stride, 0x3f800000)) | (sign << 31);
      }
      const __m512 y = _mm512_castsi512_ps(_mm512_load_si512(bits));
      __mmask16 far = 0xffff;
      _mm512_store_si512(got, is_signed ? regs.Codes<true>(y, far) : regs.Codes<false>(y, far));
      for (int l = 0; l < 16; ++l) {
        if (((far >> l) & 1) == 0) {
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
