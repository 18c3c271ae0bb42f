// The register blocks unispec.cpu::PagedAttentionPool is built of: dot products (one from reduce.h), scaled
// adds, the 8- and 16-query score tiles, the two-query weighted sums of values, a vectorisable e^x, and
// prefetches.
// Included by ort_cpu.cc alone (after its `#pragma GCC optimize`): one translation unit, so these
// inline into its loops.

#pragma once
#include <cstdint>
#include <cstring>

#include "reduce.h"   // dot

namespace unispec_cpu {
namespace {

// Four queries against one key at once: the key is loaded once and the four sums reduce side by side.
void dot4(const float* const* q, const float* key, int64_t n, float* out) {
  const float *q0 = q[0], *q1 = q[1], *q2 = q[2], *q3 = q[3];
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < n; ++d) {
    s0 += q0[d] * key[d];
    s1 += q1[d] * key[d];
    s2 += q2[d] * key[d];
    s3 += q3[d] * key[d];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// y_i += w[i] * x for four rows y_i = y + i * n that share x (one value row, four queries).
void axpy4(const float* w, const float* x, float* y, int64_t n) {
  const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  float *y0 = y, *y1 = y + n, *y2 = y + 2 * n, *y3 = y + 3 * n;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    const float v = x[d];
    y0[d] += w0 * v;
    y1[d] += w1 * v;
    y2[d] += w2 * v;
    y3[d] += w3 * v;
  }
}

// Eight lanes of float in a register (AVX; two SSE registers where there is no AVX): the micro-kernels below
// keep their accumulators in these, which plain loops over small arrays do not guarantee.
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));   // the same, loaded from any float address

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

// Scores of 8 queries against 8 keys. `qt` holds the queries transposed, [dim][stride] (these 8 are 8
// consecutive columns), so each step of d is one 8-wide load and eight broadcast FMAs into eight
// independent accumulators (enough to hide the FMA latency); key u's 8 scores go to out + u * out_stride.
void scores8x8(const float* qt, int64_t stride, const float* const* keys, int64_t dim, float* out,
               int64_t out_stride) {
  v8 a[8] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const v8 q = load8(qt + d * stride);
    for (int u = 0; u < 8; ++u) a[u] += keys[u][d] * q;
  }
  for (int u = 0; u < 8; ++u) store8(out + u * out_stride, a[u]);
}

// The same for 16 queries (columns) at once: two loads and eight broadcasts feed sixteen FMAs per step of d.
void scores16x8(const float* qt, int64_t stride, const float* const* keys, int64_t dim, float* out,
                int64_t out_stride) {
  v8 a[8] = {}, b[8] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const v8 q0 = load8(qt + d * stride), q1 = load8(qt + d * stride + 8);
    for (int u = 0; u < 8; ++u) {
      const float k = keys[u][d];
      a[u] += k * q0;
      b[u] += k * q1;
    }
  }
  for (int u = 0; u < 8; ++u) store8(out + u * out_stride, a[u]), store8(out + u * out_stride + 8, b[u]);
}

// acc0[0:8N] += sum over t of p0[t * stride] * values[t][column:column + 8N], and acc1 likewise with p1: each value
// load serves two queries, the 2N sums held in registers (N = 8: sixteen of them).
template <int N>
void weighted_pair(const float* p0, const float* p1, int64_t stride, const float* const* values, int64_t count,
                   int64_t column, float* acc0, float* acc1) {
  v8 a[N], b[N];
  for (int u = 0; u < N; ++u) a[u] = load8(acc0 + 8 * u), b[u] = load8(acc1 + 8 * u);
  for (int64_t t = 0; t < count; ++t) {
    const float w0 = p0[t * stride], w1 = p1[t * stride];
    const float* x = values[t] + column;
    for (int u = 0; u < N; ++u) {
      const v8 value = load8(x + 8 * u);
      a[u] += w0 * value;
      b[u] += w1 * value;
    }
  }
  for (int u = 0; u < N; ++u) store8(acc0 + 8 * u, a[u]), store8(acc1 + 8 * u, b[u]);
}

// e^x for x <= 0 (a score minus its running maximum) in a form loops vectorise: Cody-Waite reduction to
// r in [-ln2/2, ln2/2], Cephes' degree-6 polynomial for e^r (within 2 ulp of expf), the power of two built
// in the exponent bits. x below -87 (masked keys are -inf) gives exactly 0.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float shift = 12582912.0f;                    // 1.5 * 2^23: adding it rounds to an integer
  const float n = (clamped * 1.44269504088896341f + shift) - shift;
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return x < -87.0f ? 0.0f : y * power;
}

constexpr int64_t kTile = 32;                   // keys per tile
// The widest register blocks the vector registers hold: 16 queries x 8 keys and 64 value columns for two
// queries are 16 accumulators of 8 floats plus the operands, which AVX-512's 32 registers keep but AVX2's 16
// do not (spilled, they ran the 8-token verify at 1.7x AVX-512's time): there, 8 queries and 32 columns.
#if defined(__AVX512F__)
constexpr int64_t kQueriesAtOnce = 16, kColumnsAtOnce = 64;
#else
constexpr int64_t kQueriesAtOnce = 8, kColumnsAtOnce = 32;
#endif
constexpr int64_t kAhead = 8;                   // keys prefetched ahead, one at a time (attend_rows)

// Asks for `bytes` from `from` on, into every cache level (a row a few keys ahead) or into L2 and below (a
// whole tile ahead, which in L1 would evict the tile being worked on).
template <int kLocality>
void prefetch(const float* from, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(from) + b, 0, kLocality);
}

}  // namespace
}  // namespace unispec_cpu
