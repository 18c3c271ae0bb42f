// PackedLinear's portable tiles (matmul_tiles.h includes this file when the build has neither AVX-512 nor
// AVX2 + FMA): plain loops the compiler vectorises as it can, 4 rows a tile, no wide tiles. Not tuned.

#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace unispec_cpu {
namespace {

constexpr int kMr = 4;
constexpr int64_t kKc = 256;
constexpr int64_t kManyRows = 16;

// out[MR][32] (+)= x[MR rows, kc values] · panel[kc][32]; `first`: out starts from zero (else it holds y's).
template <int MR, typename W>
inline void accumulate(const float* x, int64_t ldx, const W* panel, int64_t kc, float (*out)[kPanel], bool first,
                       int64_t /*ahead*/) {
  if (first)
    for (int i = 0; i < MR; ++i) std::fill(out[i], out[i] + kPanel, 0.0f);
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < MR; ++i)
      for (int64_t j = 0; j < kPanel; ++j)
        out[i][j] = std::fma(x[i * ldx + k], widen(panel[k * kPanel + j]), out[i][j]);
}

inline int64_t panels_at_once(int64_t /*rows*/) { return 1; }

template <typename W>
void wide_tile(const float*, int64_t, int64_t, const W* const*, float* const*, const int64_t*) {}   // never called

}  // namespace
}  // namespace unispec_cpu
