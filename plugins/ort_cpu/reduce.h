// Reductions over a float row that several kernels share: a dot product (the paged attention's key-outer loop,
// MoE's expert rows) and the maximum (TokenLogprobs' log-softmax and top-N scan, SpecAccept's greedy argmax).

#pragma once
#include <algorithm>
#include <cstdint>

namespace unispec_cpu {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// The largest of x[0:n] (n >= 1), sixteen running maxima side by side: a max reduction over one accumulator is
// a chain of dependent scalar maxss that the compiler does not vectorise (NaN ordering). A NaN after x[0] never
// wins; a NaN at x[0] is returned.
inline float max_of(const float* x, int64_t n) {
  float lanes[16];
  std::fill(lanes, lanes + 16, x[0]);
  int64_t v = 0;
  for (; v + 16 <= n; v += 16)
#pragma omp simd
    for (int64_t i = 0; i < 16; ++i) {
      const float a = lanes[i], b = x[v + i];
      lanes[i] = a < b ? b : a;           // a select, not std::max's reference: vmaxps
    }
  float most = lanes[0];
  for (int64_t i = 1; i < 16; ++i) most = most < lanes[i] ? lanes[i] : most;
  for (; v < n; ++v) most = most < x[v] ? x[v] : most;
  return most;
}

}  // namespace
}  // namespace unispec_cpu
