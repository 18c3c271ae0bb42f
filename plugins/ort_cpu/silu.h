// The SiLU that ends a SwiGLU, silu(gate) · up, shared by PackedLinear's swiglu epilogue (matmul_group.h) and
// SiluMul (silu_mul.cc), so a SwiGLU is the same value whichever kernel computes it and wherever its lanes fall.

#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace unispec_cpu {
namespace {

// e^x in float32 from fused multiply-adds alone (Cephes' expf polynomial, within 2 ulp): the same value
// whether a loop runs it in SIMD lanes or one at a time, so a SwiGLU value does not depend on its position.
inline float exp_fma(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);                 // 2^n stays a normal float
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, x);                  // x - n·ln2, ln2 in two parts
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float e = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

// y = silu(gate) · up = gate / (1 + e^-gate) · up, elementwise over `count` values.
void swiglu(const float* gate, const float* up, float* y, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) y[i] = gate[i] / (1.0f + exp_fma(-gate[i])) * up[i];
}

}  // namespace
}  // namespace unispec_cpu
