// A matrix transpose for checkpoint loads and saves (`hf/mapping.transpose`),
// called through ctypes (which releases the GIL: threads run bands of rows).
//
// Hugging Face stores a Linear's weight as [out, in], an NNX kernel is [in, out],
// so nearly every byte of a checkpoint is transposed on its way in and out.
// numpy's strided copy of `x.T` moves 0.27 GB/s a core for bf16, its copies
// of 16 x 1024 tiles 1.2; this moves 4-5 GB/s a core (a 2-core AMD EPYC, Zen 4;
// memcpy there: 11.7 GB/s), so a load or a save is no longer bound by the CPU
// but by the disk. Tiles of 128 source rows x 64 bytes of columns, walked a
// column block at a time: each step writes 8 destination rows of 256 contiguous
// bytes, and the tile's source lines stay in L1 for the 4 (bf16) column blocks
// that read them. 2- and 4-byte elements go through SSE2 8x8 / 4x4 register
// transposes; other sizes, the tiles' ragged edges and other CPUs, element by
// element (the same result: a transpose is a copy, bit for bit).
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

constexpr int64_t kTileRows = 128;
constexpr int64_t kTileBytes = 64;  // of a source row: one cache line

// dst[j, i] = src[i, j] for i in [r0, r1), j in [c0, c1); src is (rows, cols).
template <typename T>
void Elements(const T* src, T* dst, int64_t rows, int64_t cols, int64_t r0, int64_t r1,
              int64_t c0, int64_t c1) {
  for (int64_t j = c0; j < c1; ++j) {
    for (int64_t i = r0; i < r1; ++i) dst[j * rows + i] = src[i * cols + j];
  }
}

#if defined(__SSE2__)
// An 8x8 block of 2-byte elements: rows of `s` (stride ss) into rows of `d` (stride ds).
inline void Block(const uint16_t* s, int64_t ss, uint16_t* d, int64_t ds) {
  __m128i a[8], b[8], c[8];
  for (int k = 0; k < 8; ++k) a[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k * ss));
  for (int k = 0; k < 4; ++k) {
    b[2 * k] = _mm_unpacklo_epi16(a[2 * k], a[2 * k + 1]);
    b[2 * k + 1] = _mm_unpackhi_epi16(a[2 * k], a[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    c[4 * k + 0] = _mm_unpacklo_epi32(b[4 * k + 0], b[4 * k + 2]);
    c[4 * k + 1] = _mm_unpackhi_epi32(b[4 * k + 0], b[4 * k + 2]);
    c[4 * k + 2] = _mm_unpacklo_epi32(b[4 * k + 1], b[4 * k + 3]);
    c[4 * k + 3] = _mm_unpackhi_epi32(b[4 * k + 1], b[4 * k + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * k) * ds), _mm_unpacklo_epi64(c[k], c[k + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * k + 1) * ds),
                     _mm_unpackhi_epi64(c[k], c[k + 4]));
  }
}

// A 4x4 block of 4-byte elements.
inline void Block(const uint32_t* s, int64_t ss, uint32_t* d, int64_t ds) {
  __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + ss));
  __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * ss));
  __m128i a3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 3 * ss));
  __m128i b0 = _mm_unpacklo_epi32(a0, a1), b1 = _mm_unpackhi_epi32(a0, a1);
  __m128i b2 = _mm_unpacklo_epi32(a2, a3), b3 = _mm_unpackhi_epi32(a2, a3);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_unpacklo_epi64(b0, b2));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + ds), _mm_unpackhi_epi64(b0, b2));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * ds), _mm_unpacklo_epi64(b1, b3));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 3 * ds), _mm_unpackhi_epi64(b1, b3));
}
constexpr bool kBlocks = true;
#else
template <typename T>
inline void Block(const T*, int64_t, T*, int64_t) {}
constexpr bool kBlocks = false;
#endif

template <typename T>
void Rows(const T* src, T* dst, int64_t rows, int64_t cols, int64_t begin, int64_t end) {
  constexpr int64_t kB = (sizeof(T) == 2 ? 8 : sizeof(T) == 4 ? 4 : 1);  // a register block
  constexpr bool kSimd = kBlocks && kB > 1;
  constexpr int64_t kCols = kTileBytes / sizeof(T);
  for (int64_t ib = begin; ib < end; ib += kTileRows) {
    const int64_t ie = ib + kTileRows < end ? ib + kTileRows : end;
    const int64_t iv = kSimd ? ib + (ie - ib) / kB * kB : ib;  // rows in whole blocks
    for (int64_t jb = 0; jb < cols; jb += kCols) {
      const int64_t je = jb + kCols < cols ? jb + kCols : cols;
      const int64_t jv = kSimd ? jb + (je - jb) / kB * kB : jb;
      if constexpr (kSimd) {
        for (int64_t j = jb; j < jv; j += kB) {
          for (int64_t i = ib; i < iv; i += kB) Block(src + i * cols + j, cols, dst + j * rows + i, rows);
        }
      }
      Elements(src, dst, rows, cols, iv, ie, jb, je);  // the rows left below the blocks
      Elements(src, dst, rows, cols, ib, iv, jv, je);  // the columns left right of them
    }
  }
}

}  // namespace

// Rows [begin, end) of the C-contiguous (rows, cols) matrix `src` of `itemsize`-byte
// elements, into the C-contiguous (cols, rows) matrix `dst`: dst[j, i] = src[i, j].
// Returns 0, or 1 for an item size other than 1, 2, 4 or 8 (nothing written).
extern "C" int OfflaxTranspose(const void* src, void* dst, int64_t rows, int64_t cols,
                               int64_t itemsize, int64_t begin, int64_t end) {
  switch (itemsize) {
    case 1:
      Rows(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), rows, cols, begin, end);
      return 0;
    case 2:
      Rows(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols, begin, end);
      return 0;
    case 4:
      Rows(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), rows, cols, begin, end);
      return 0;
    case 8:
      Rows(static_cast<const uint64_t*>(src), static_cast<uint64_t*>(dst), rows, cols, begin, end);
      return 0;
    default:
      return 1;
  }
}
