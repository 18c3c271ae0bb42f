// PackedLinear's AVX2 + FMA tiles (matmul_tiles.h includes this file when the build targets x86-64-v3).
//
// 3 x 4 ymm accumulators. A verify's 8 rows are 3 tiles, so each walks the panel: unblocked, the first streamed
// it from memory and the FMAs of the others waited on it (8 rows ran at ~1.5x AVX-512's time on a weight
// out of cache). Past one tile's rows, k is blocked in blocks of 16 KiB, and the tiles of one block
// prefetch the next one into L2 while they work, so the stream overlaps the FMAs as in AVX-512's one pass.

#pragma once
#include <immintrin.h>

#include <cstdint>

namespace unispec_cpu {
namespace {

constexpr int kMr = 3;
constexpr int64_t kKc = 128;
constexpr int64_t kManyRows = kMr;

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

// out[MR][32] (+)= x[MR rows, kc values] · panel[kc][32]; `first`: out starts from zero (else it holds y's);
// `ahead` > 0: the next k block's row lies that far past each row of this one, prefetched into L2.
template <int MR, typename W>
inline void accumulate(const float* x, int64_t ldx, const W* panel, int64_t kc, float (*out)[kPanel], bool first,
                       int64_t ahead) {
  __m256 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = first ? _mm256_setzero_ps() : _mm256_load_ps(out[i] + 8 * v);
  for (int64_t k = 0; k < kc; ++k) {
    const W* b = panel + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel + 16), _MM_HINT_T0);
    if (ahead > 0) {
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
}

// One row against NP panels at once: a one-panel tile of one row has 4 accumulators, a dependency chain per
// FMA pipe that the FMA latency stalls (a decode step's projections ran at about half the core's rate); 3
// panels give 12, within AVX2's 16 registers beside the broadcast row value. Panel p is panels[p], its
// columns go to ys[p] (the panels may be of different weights of one PackedLinear).
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

// How many panels a tile of `rows` rows takes at once.
inline int64_t panels_at_once(int64_t rows) { return rows == 1 ? 3 : 1; }

// One row of x ([1, k_len]) against 3 full panels (panels[p] -> ys[p]).
template <typename W>
void wide_tile(const float* x, int64_t /*rows*/, int64_t k_len, const W* const* panels, float* const* ys,
               const int64_t* /*ldy*/) {
  tile_wide<3>(x, k_len, panels, ys);
}

}  // namespace
}  // namespace unispec_cpu
