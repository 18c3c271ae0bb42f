// The panels unispec.cpu::PackedLinear packs a weight into ([N/32][K][32], float32 or exact float16) and the
// register tiles that multiply rows of X by them. What every ISA shares is here; each ISA's tiles and block
// sizes are in a file of their own, the one this build's -march allows included below: matmul_avx512.h,
// matmul_avx2.h (AVX2 + FMA), matmul_portable.h. The library of each variant is built from the same sources
// and chosen at run time by the CPU's flags (variants.py). Included by matmul.cc alone, so the tiles inline
// into its loops.

#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace unispec_cpu {
namespace {

constexpr int64_t kPanel = 32;      // output columns per panel

// float16 -> float32 for the portable loop and the SIMD paths without F16C (vcvtph2ps gives the same float)
inline float half_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)   // zero, subnormals
                          : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                           : std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  return (h & 0x8000) ? -magnitude : magnitude;
}
inline float widen(float w) { return w; }
inline float widen(uint16_t w) { return half_to_float(w); }

}  // namespace
}  // namespace unispec_cpu

// Each defines kMr (rows per tile), kKc (k values per block when many rows share a panel), kManyRows (above
// it, k is blocked), accumulate<MR>() (one tile's products into out), panels_at_once() and wide_tile() (a few
// rows against several panels at once; never called where panels_at_once is 1).
#if defined(__AVX512F__)
#include "matmul_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "matmul_avx2.h"
#else
#include "matmul_portable.h"
#endif

namespace unispec_cpu {
namespace {

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
  accumulate<MR>(x, ldx, panel, kc, out, first, ahead);
  for (int i = 0; i < MR; ++i) std::memcpy(y + i * ldy, out[i], sizeof(float) * cols);
}

// The last `rows` (< kMr) rows of a block, as one tile of their own size.
template <int R, typename W>
inline void tail_tile(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t kc, float* y, int64_t ldy,
                      int64_t cols, bool first, int64_t ahead) {
  if constexpr (R > 0) {
    if (rows == R)
      tile<R>(x, ldx, panel, kc, y, ldy, cols, first, ahead);
    else
      tail_tile<R - 1>(rows, x, ldx, panel, kc, y, ldy, cols, first, ahead);
  }
}

// rows of x (stride ldx) times panel block [k0, k0 + kc) into y, in tiles of up to kMr rows; `ahead`: how far
// past a row of the block the next block's row lies, prefetched into L2 by AVX2's tiles (0: none).
template <typename W>
void rows_by_block(const float* x, int64_t rows, int64_t ldx, const W* panel, int64_t kc, float* y, int64_t ldy,
                   int64_t cols, bool first, int64_t ahead) {
  int64_t m = 0;
  for (; m + kMr <= rows; m += kMr) tile<kMr>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead);
  tail_tile<kMr - 1>(rows - m, x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first, ahead);
}

}  // namespace
}  // namespace unispec_cpu
