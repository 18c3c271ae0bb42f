// PackedLinear's AVX-512 tiles (matmul_tiles.h includes this file when the build targets x86-64-v4): 8 rows a
// tile over 2 zmm accumulators a row, and wide tiles of up to 8 panels for the few-row products.

#pragma once
#include <immintrin.h>

#include <cstdint>

namespace unispec_cpu {
namespace {

constexpr int kMr = 8;              // rows per tile: 8 x 2 zmm accumulators
constexpr int64_t kKc = 256;        // k values per block when many rows share a panel (32 KiB of panel)
constexpr int64_t kManyRows = 16;   // above this many rows, k is blocked (up to 16 read a panel from L2)

inline __m512 load16(const float* b) { return _mm512_load_ps(b); }
inline __m512 load16(const uint16_t* b) {
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(b)));
}

// out[MR][32] (+)= x[MR rows, kc values] · panel[kc][32]; `first`: out starts from zero (else it holds y's).
template <int MR, typename W>
inline void accumulate(const float* x, int64_t ldx, const W* panel, int64_t kc, float (*out)[kPanel], bool first,
                       int64_t /*ahead*/) {
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
}

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

// How many panels a tile of `rows` rows takes at once.
inline int64_t panels_at_once(int64_t rows) { return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1; }

// `rows` rows of x ([rows, k_len]) against panels_at_once(rows) full panels (panels[p] -> ys[p], stride ldy[p]).
template <typename W>
void wide_tile(const float* x, int64_t rows, int64_t k_len, const W* const* panels, float* const* ys,
               const int64_t* ldy) {
  switch (rows) {
    case 1: tile_wide<1, 8>(x, k_len, panels, ys, ldy); break;
    case 2: tile_wide<2, 4>(x, k_len, panels, ys, ldy); break;
    case 3: tile_wide<3, 2>(x, k_len, panels, ys, ldy); break;
    default: tile_wide<4, 2>(x, k_len, panels, ys, ldy); break;
  }
}

}  // namespace
}  // namespace unispec_cpu
