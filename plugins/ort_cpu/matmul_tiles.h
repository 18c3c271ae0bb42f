// The panels unispec.cpu::PackedLinear packs a weight into ([N/32][K][32], float32 or exact float16) and the
// register tiles that multiply rows of X by them, one set per ISA (AVX-512, AVX2 + FMA, portable), with the
// block sizes each ISA's registers and caches suit. Included by matmul.cc alone, so the tiles inline into
// its loops.

#pragma once
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace unispec_cpu {
namespace {

constexpr int64_t kPanel = 32;      // output columns per panel
#if defined(__AVX512F__)
constexpr int kMr = 8;              // rows per tile: 8 x 2 zmm accumulators
constexpr int64_t kKc = 256;        // k values per block when many rows share a panel (32 KiB of panel)
constexpr int64_t kManyRows = 16;   // above this many rows, k is blocked (up to 16 read a panel from L2)
#elif defined(__AVX2__) && defined(__FMA__)
// 3 x 4 ymm accumulators. A verify's 8 rows are 3 tiles, so each walks the panel: unblocked, the first streamed
// it from memory and the FMAs of the others waited on it (8 rows ran at ~1.5x AVX-512's time on a weight
// out of cache). Past one tile's rows, k is blocked in blocks of 16 KiB, and the tiles of one block
// prefetch the next one into L2 while they work, so the stream overlaps the FMAs as in AVX-512's one pass.
constexpr int kMr = 3;
constexpr int64_t kKc = 128;
constexpr int64_t kManyRows = kMr;
#else
constexpr int kMr = 4;
constexpr int64_t kKc = 256;
constexpr int64_t kManyRows = 16;
#endif

struct Packed {
  int64_t n = 0, k = 0, panels = 0;
  bool half = false;                // data holds float16 values (uint16_t), else float
  void* data = nullptr;             // [panels][k][kPanel], 64-byte aligned, columns past n are zero

  ~Packed() { std::free(data); }
  template <typename W>
  const W* panel(int64_t p) const { return static_cast<const W*>(data) + p * k * kPanel; }
  size_t bytes() const { return (half ? sizeof(uint16_t) : sizeof(float)) * panels * k * kPanel; }
};

// The weight's value that goes to output column `col` at reduction index `kk` (w is [n, k] with trans_b,
// else [k, n]).
inline float weight_at(const float* w, int64_t n, int64_t k, bool trans_b, int64_t col, int64_t kk) {
  return trans_b ? w[col * k + kk] : w[kk * n + col];
}

// float16 <-> float32 for packing and for the portable loop; the SIMD paths widen with F16C's vcvtph2ps,
// which gives the same float for every half.
inline float half_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)   // zero, subnormals
                          : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                           : std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  return (h & 0x8000) ? -magnitude : magnitude;
}

// The float16 equal to v, when there is one (finite, within range, no bits below float16's precision).
bool float_to_half_exactly(float v, uint16_t* h) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const float a = std::fabs(v);
  if (a == 0.0f) {
    *h = sign;
    return true;
  }
  if (!(a <= 65504.0f)) return false;                      // NaN, infinities, past float16's largest
  int e = 0;
  std::frexp(a, &e);                                       // a = m · 2^e, m in [0.5, 1)
  const int exponent = std::max(e - 1, -14);               // float16's exponent (subnormals share -14)
  const float scaled = std::ldexp(a, 10 - exponent);       // the significand as an integer, if a fits
  if (scaled != std::floor(scaled)) return false;
  const uint32_t m = static_cast<uint32_t>(scaled);        // < 2^11; 2^10 set for normals
  *h = sign | static_cast<uint16_t>(m < 0x400 ? m : ((exponent + 15) << 10) | (m & 0x3ff));
  return true;
}

bool all_half(const float* w, int64_t count) {
  uint16_t h = 0;
  for (int64_t i = 0; i < count; ++i)
    if (!float_to_half_exactly(w[i], &h)) return false;
  return true;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* b) { return _mm512_load_ps(b); }
inline __m512 load16(const uint16_t* b) {
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(b)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* b) { return _mm256_load_ps(b); }
#if defined(__F16C__)
inline __m256 load8(const uint16_t* b) { return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(b))); }
#else
inline __m256 load8(const uint16_t* b) {
  alignas(32) float f[8];
  for (int j = 0; j < 8; ++j) f[j] = half_to_float(b[j]);
  return _mm256_load_ps(f);
}
#endif
#endif
inline float widen(float w) { return w; }
inline float widen(uint16_t w) { return half_to_float(w); }

// acc[MR][32] (+)= x[MR rows, k0 .. k0 + kc) · panel[k0 .. k0 + kc), written to y (stride ldy) for the
// first `cols` columns; `first` starts from zero, else from y; `ahead`: see rows_by_block.
template <int MR, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t kc, float* y, int64_t ldy, int64_t cols,
                 bool first, int64_t ahead) {
  alignas(64) float out[MR][kPanel];
  if (!first)
    for (int i = 0; i < MR; ++i) {
      std::memcpy(out[i], y + i * ldy, sizeof(float) * cols);
      std::fill(out[i] + cols, out[i] + kPanel, 0.0f);
    }
#if defined(__AVX512F__)
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? _mm512_setzero_ps() : _mm512_load_ps(out[i]);
    acc[i][1] = first ? _mm512_setzero_ps() : _mm512_load_ps(out[i] + 16);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const W* b = panel + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel + 16), _MM_HINT_T0);
    const __m512 b0 = load16(b), b1 = load16(b + 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm512_store_ps(out[i], acc[i][0]);
    _mm512_store_ps(out[i] + 16, acc[i][1]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = first ? _mm256_setzero_ps() : _mm256_load_ps(out[i] + 8 * v);
  for (int64_t k = 0; k < kc; ++k) {
    const W* b = panel + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel + 16), _MM_HINT_T0);
    if (ahead > 0) {                 // the next k block's row, into L2
      _mm_prefetch(reinterpret_cast<const char*>(b + ahead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(b + ahead + 16), _MM_HINT_T1);
    }
    const __m256 b0 = load8(b), b1 = load8(b + 8), b2 = load8(b + 16), b3 = load8(b + 24);
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(a, b2, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(a, b3, acc[i][3]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) _mm256_store_ps(out[i] + 8 * v, acc[i][v]);
#else
  if (first)
    for (int i = 0; i < MR; ++i) std::fill(out[i], out[i] + kPanel, 0.0f);
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < MR; ++i)
      for (int64_t j = 0; j < kPanel; ++j) out[i][j] = std::fma(x[i * ldx + k], widen(panel[k * kPanel + j]), out[i][j]);
#endif
  for (int i = 0; i < MR; ++i) std::memcpy(y + i * ldy, out[i], sizeof(float) * cols);
}

// rows of x (stride ldx) times panel block [k0, k0 + kc) into y, in tiles of up to kMr rows; `ahead`: how far
// past a row of the block the next block's row lies, prefetched into L2 by AVX2's tiles (0: none).
template <typename W>
void rows_by_block(const float* x, int64_t rows, int64_t ldx, const W* panel, int64_t kc, float* y, int64_t ldy,
                   int64_t cols, bool first, int64_t ahead) {
  int64_t m = 0;
  for (; m + kMr <= rows; m += kMr) tile<kMr>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead);
  switch (rows - m) {   // the last few rows, one tile of their own size
#if defined(__AVX512F__)
    case 7: tile<7>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead); break;
    case 6: tile<6>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead); break;
    case 5: tile<5>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead); break;
    case 4: tile<4>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead); break;
#endif
#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
    case 3: tile<3>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead); break;
#endif
    case 2: tile<2>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead); break;
    case 1: tile<1>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead); break;
    default: break;
  }
}

#if defined(__AVX512F__)
// A few rows against NP panels at once, all NP of them full, over all of k (few rows are never k-blocked):
// with 1 to 4 rows a one-panel tile has 2 to 8 accumulators, too few to hide the FMA latency, so it runs at
// a fraction of the core's rate on a weight that sits in cache (the bundled models' ~0.1 MB projections);
// NP panels give it 12 to 16. The NP panels may be of different weights of one PackedLinear (q, k, v): panel
// p is panels[p], its columns go to ys[p] (rows ldy[p] apart), so a group's small weights fill a wide tile.
template <int MR, int NP, typename W>
void tile_wide(const float* x, int64_t k_len, const W* const* panels, float* const* ys, const int64_t* ldy) {
  __m512 acc[MR][NP][2];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) acc[i][p][h] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 b[NP][2];
    for (int p = 0; p < NP; ++p) {
      const W* row = panels[p] + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * kPanel + 16), _MM_HINT_T0);
      b[p][0] = load16(row);
      b[p][1] = load16(row + 16);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * k_len + k]);
      for (int p = 0; p < NP; ++p) {
        acc[i][p][0] = _mm512_fmadd_ps(a, b[p][0], acc[i][p][0]);
        acc[i][p][1] = _mm512_fmadd_ps(a, b[p][1], acc[i][p][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(ys[p] + i * ldy[p] + 16 * h, acc[i][p][h]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// One row against NP panels at once (AVX2): a one-panel tile of one row has 4 accumulators, a dependency chain
// per FMA pipe that the FMA latency stalls (a decode step's projections ran at about half the core's rate);
// 3 panels give 12, within AVX2's 16 registers beside the broadcast row value. Panels and outputs as in
// AVX-512's tile_wide.
template <int NP, typename W>
void tile_wide(const float* x, int64_t k_len, const W* const* panels, float* const* ys) {
  __m256 acc[NP][4];
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < 4; ++v) acc[p][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    const __m256 a = _mm256_set1_ps(x[k]);
    for (int p = 0; p < NP; ++p) {
      const W* row = panels[p] + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * kPanel), _MM_HINT_T0);
      for (int v = 0; v < 4; ++v) acc[p][v] = _mm256_fmadd_ps(a, load8(row + 8 * v), acc[p][v]);
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(ys[p] + 8 * v, acc[p][v]);
}
#endif

// How many panels a tile of `rows` rows takes at once.
int64_t panels_at_once(int64_t rows) {
#if defined(__AVX512F__)
  return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1;
#elif defined(__AVX2__) && defined(__FMA__)
  return rows == 1 ? 3 : 1;
#else
  (void)rows;
  return 1;
#endif
}

}  // namespace
}  // namespace unispec_cpu
