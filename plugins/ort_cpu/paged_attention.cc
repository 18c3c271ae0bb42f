// unispec.cpu::PagedAttentionPool, ONNX Runtime CPU kernel: PagedAttention (the math of
// plugins/paged_attention/reference.py) reading each row's past straight from the paged KV pool.
//
// The exported graph gathers every row's blocks, transposes them layer-major, splits layers and K/V, and
// the reference attention then copies the result once more per query: ~6 copies of the history a step.
// This kernel reads key p of row b where it lives, pool[block_table[b, p / bs], layer, p % bs, column],
// so a step reads each row's history once and copies none of it.
//
// Inputs   q [S, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv]   this step's tokens (RoPE applied), float32
//          kv_pool [num_blocks, L, bs, W] float32         read in place, never written
//          block_table [B, max_blocks], row_offsets [B+1], positions [S], cache_lengths [B]   int64
// Output   [S, Hq, Dv] float32
// Attributes (ints unless said): layer, k_column, v_column (where this layer's K and V start in a pool row),
//          scale (float), causal, sliding_window (0 = full), softcap (float, 0 = none).
//
// unispec.cpu::PagedAttentionPoolRows is the same with two more inputs, for a past that is the pool with this
// step's in-graph rows written over some of its slots (a later draft step's, export/archs/common.scatter_rows):
//          rows [L, N, W] float32 (pool-row layout), index [N] int64 = b * P + p with P = max_blocks * bs;
// key p of row b is then rows[layer, n] where index[n] says so, else the pool's row. Rows [1, N, W] are this
// layer's alone (a past that is one layer's slice of the pool, as Gemma 4's assistant reads).

// Floating-point exceptions are never read here, so GCC may evaluate both sides of a select: without this,
// the softmax's loops (exp_nonpositive's clamps and selects) stay scalar on AVX2, which has no masked
// instructions to guard them with (AVX-512 does), and an 8-token verify ran at ~2x AVX-512's time. The
// results are the same bits: only where the compiler may compute, not what, changes. Before every include,
// so that the inline functions of the headers share the setting and still inline into the loops.
#pragma GCC optimize("no-trapping-math")

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernel.h"

namespace unispec_cpu {
namespace {

constexpr size_t kNumInputs = 8;       // PagedAttentionPool; PagedAttentionPoolRows adds two

struct Attributes {
  int64_t layer = 0, k_column = 0, v_column = 0, causal = 1, sliding_window = 0;
  float scale = 1.0f, softcap = 0.0f;
};

OrtStatus* read_attributes(const OrtKernelInfo* info, Attributes* a) {
  auto get_int = call<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(g_api,
                                                                                 KernelInfoGetAttribute_int64);
  auto get_float = call<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(g_api,
                                                                                 KernelInfoGetAttribute_float);
  RETURN_IF_ERROR(get_int(info, "layer", &a->layer));
  RETURN_IF_ERROR(get_int(info, "k_column", &a->k_column));
  RETURN_IF_ERROR(get_int(info, "v_column", &a->v_column));
  RETURN_IF_ERROR(get_int(info, "causal", &a->causal));
  RETURN_IF_ERROR(get_int(info, "sliding_window", &a->sliding_window));
  RETURN_IF_ERROR(get_float(info, "scale", &a->scale));
  return get_float(info, "softcap", &a->softcap);
}

// One step's geometry and pointers, shared by every row's attention.
struct Step {
  Attributes attr;
  const float *q, *k, *v, *pool;
  const int64_t *table, *offsets, *positions, *lengths;
  float* out;
  int64_t q_heads, kv_heads, head_dim, v_dim, layers, block_size, width, max_blocks;

  const float* pool_row(int64_t row, int64_t p) const {
    const int64_t block = table[row * max_blocks + p / block_size];
    return pool + ((block * layers + attr.layer) * block_size + p % block_size) * width;
  }
};

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

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

// One score of a query at position `at` against a key at `position`: scaled, softcapped, and -inf when the
// key is hidden. A cached key is visible unless outside the sliding window, whatever `causal` says (a row's
// whole past precedes its new tokens); a new one must also respect causality.
inline float masked_score(const Attributes& a, float score, bool cached, int64_t position, int64_t at) {
  const bool visible = (cached || !a.causal || position <= at) &&
                       (a.sliding_window <= 0 || at - position < a.sliding_window);
  float x = score * a.scale;
  if (a.softcap > 0) x = std::tanh(x / a.softcap) * a.softcap;
  return visible ? x : -std::numeric_limits<float>::infinity();
}

// masked_score over one query's scores s[0:count] against keys at positions key_at[0:count], the first
// `cached` of them cached keys; returns their maximum (-inf when none is visible).
float prepare_scores(const Attributes& a, float* s, const int64_t* key_at, int64_t count, int64_t cached,
                     int64_t at) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  if (a.softcap <= 0 && a.sliding_window <= 0) {   // the common case: the past is plain scaled scores
#pragma omp simd
    for (int64_t u = 0; u < cached; ++u) s[u] *= a.scale;
    t = cached;
  }
  for (; t < count; ++t) s[t] = masked_score(a, s[t], t < cached, key_at[t], at);
  float top = neg_inf;
#pragma omp simd reduction(max : top)
  for (int64_t u = 0; u < count; ++u) top = std::max(top, s[u]);
  return top;
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

// Attention of row `row`'s new tokens, every head, for a step with 4 or more queries per kv head (decode
// with GQA, a multi-token verify, a prefill chunk), flash-style: keys in tiles of kTile, each query keeping
// a running maximum, denominator and weighted sum of values (online softmax), so a key's pool row is read
// once, tile by tile, for every head and query. `rows[j]` is the pool row of the row's past position j (this
// layer's K|V at the attribute columns); the new tokens' keys and values come from k and v.
//
// Per kv head, its queries (every new token x its GQA group) are scored together in 16x8 / 8x8 register
// blocks over the queries' transpose, written key-major so the softmax runs along contiguous rows, and the
// values accumulated for two queries at a time in registers. The rows of one layer lie a block's stride
// apart, past the hardware prefetcher's reach, so the next tile's rows are prefetched into L2.
void attend_tiled(const Step& st, int64_t row, const std::vector<const float*>& rows) {
  const Attributes& a = st.attr;
  const int64_t t0 = st.offsets[row], t1 = st.offsets[row + 1], past = st.lengths[row];
  const int64_t group = st.q_heads / st.kv_heads, fresh = t1 - t0, keys = past + fresh;
  if (fresh == 0) return;
  const int64_t dim = st.head_dim, v_dim = st.v_dim;
  const int64_t per_head = fresh * group;                       // queries of one kv head
  const int64_t padded = (per_head + 7) / 8 * 8;                // and with zero queries up to a multiple of 8
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // query i of kv head h (i = token * group + g): its position, its column of the transpose, its running state
  // (maximum, denominator: [h][padded]; weighted sum of values: [h][per_head][v_dim])
  std::vector<int64_t> at(padded);
  for (int64_t i = 0; i < padded; ++i) at[i] = st.positions[t0 + std::min(i, per_head - 1) / group];
  std::vector<float> qt(st.kv_heads * dim * padded, 0.0f);   // [h][d][padded], padding queries zero
  for (int64_t h = 0; h < st.kv_heads; ++h)
    for (int64_t i = 0; i < per_head; ++i) {
      const float* q = st.q + ((t0 + i / group) * st.q_heads + h * group + i % group) * dim;
      for (int64_t d = 0; d < dim; ++d) qt[(h * dim + d) * padded + i] = q[d];
    }
  std::vector<float> top(st.kv_heads * padded, neg_inf), total(st.kv_heads * padded, 0.0f);
  std::vector<float> acc(st.kv_heads * per_head * v_dim, 0.0f);
  std::vector<float> scratch(v_dim);                           // the sums of an odd last query's padding partner
  // one head's tile: scores, then weights, key-major ([key][padded]: a key's scores for every query side by
  // side, so masking, maxima and exp run along contiguous rows), and per query its tile maximum etc.
  std::vector<float> s(kTile * padded), tile_top(padded), shift(padded), rescale(padded), sum(padded);
  const float* key_rows[kTile];
  const float* value_rows[kTile];
  int64_t key_at[kTile];

  const int64_t k_bytes = st.kv_heads * dim * 4, v_bytes = st.kv_heads * v_dim * 4;

  for (int64_t j0 = 0; j0 < keys; j0 += kTile) {
    const int64_t count = std::min(kTile, keys - j0);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t j = j0 + t;
      if (j + kTile < past) {                  // the next tile's row, while this tile is worked on
        prefetch<2>(rows[j + kTile] + a.k_column, k_bytes);
        prefetch<2>(rows[j + kTile] + a.v_column, v_bytes);
      }
      const bool cached = j < past;
      key_rows[t] = cached ? rows[j] + a.k_column : st.k + (t0 + j - past) * st.kv_heads * dim;
      value_rows[t] = cached ? rows[j] + a.v_column : st.v + (t0 + j - past) * st.kv_heads * v_dim;
      key_at[t] = cached ? j : st.positions[t0 + j - past];
    }
    const int64_t cached = std::clamp<int64_t>(past - j0, 0, count);   // the tile's keys from the pool
    const bool plain = cached == count && a.softcap <= 0 && a.sliding_window <= 0;   // nothing to mask
    for (int64_t h = 0; h < st.kv_heads; ++h) {
      const float* head_keys[kTile + 7];
      for (int64_t t = 0; t < count; ++t) head_keys[t] = key_rows[t] + h * dim;
      for (int64_t t = count; t < count + 7; ++t) head_keys[t] = head_keys[0];   // padding for the last block
      for (int64_t i0 = 0; i0 < per_head;) {
        const int64_t width = kQueriesAtOnce == 16 && i0 + 16 <= padded ? 16 : 8;   // queries scored at once
        for (int64_t t = 0; t < count; t += 8)
          (width == 16 ? scores16x8 : scores8x8)(&qt[h * dim * padded + i0], padded, head_keys + t, dim,
                                                 &s[t * padded + i0], padded);
        i0 += width;
      }
      // scale, mask, softcap; each query's maximum over the tile
      std::fill(tile_top.begin(), tile_top.end(), neg_inf);
      for (int64_t t = 0; t < count; ++t) {
        float* st_ = &s[t * padded];
        if (plain) {
#pragma omp simd
          for (int64_t i = 0; i < padded; ++i) st_[i] *= a.scale;
        } else {
          for (int64_t i = 0; i < padded; ++i) st_[i] = masked_score(a, st_[i], t < cached, key_at[t], at[i]);
        }
#pragma omp simd
        for (int64_t i = 0; i < padded; ++i) tile_top[i] = std::max(tile_top[i], st_[i]);
      }
      // the online softmax update: weights e^(s - m) against the new running maximum m (0 while a query has
      // seen no visible key, so masked scores still give 0 and not NaN), earlier sums rescaled
      float* head_top = &top[h * padded];
      float* head_total = &total[h * padded];
#pragma omp simd
      for (int64_t i = 0; i < padded; ++i) {
        const float m = std::max(head_top[i], tile_top[i]);
        shift[i] = m == neg_inf ? 0.0f : m;
        rescale[i] = exp_nonpositive(head_top[i] - shift[i]);
        head_top[i] = m;
        sum[i] = 0.0f;
      }
      for (int64_t t = 0; t < count; ++t) {
        float* st_ = &s[t * padded];
#pragma omp simd
        for (int64_t i = 0; i < padded; ++i) {
          const float w = exp_nonpositive(st_[i] - shift[i]);
          st_[i] = w;
          sum[i] += w;
        }
      }
#pragma omp simd
      for (int64_t i = 0; i < padded; ++i) head_total[i] = head_total[i] * rescale[i] + sum[i];
      for (int64_t i = 0; i < per_head; ++i)
        if (rescale[i] != 1.0f) {
          float* out = &acc[(h * per_head + i) * v_dim];
#pragma omp simd
          for (int64_t c = 0; c < v_dim; ++c) out[c] *= rescale[i];
        }
      // the values, two queries at a time (each value load serves both), 64 (AVX-512), 32, then 8 columns at a time;
      // an odd last query pairs with its padding neighbour, whose sums go to scratch
      for (int64_t i = 0; i < per_head; i += 2) {
        const float *p0 = &s[i], *p1 = &s[i + 1];
        float* out0 = &acc[(h * per_head + i) * v_dim];
        float* out1 = i + 1 < per_head ? out0 + v_dim : scratch.data();
        const int64_t column = h * v_dim;
        int64_t c = 0;
        for (; kColumnsAtOnce == 64 && c + 64 <= v_dim; c += 64)
          weighted_pair<8>(p0, p1, padded, value_rows, count, column + c, out0 + c, out1 + c);
        for (; c + 32 <= v_dim; c += 32)
          weighted_pair<4>(p0, p1, padded, value_rows, count, column + c, out0 + c, out1 + c);
        for (; c + 8 <= v_dim; c += 8)
          weighted_pair<1>(p0, p1, padded, value_rows, count, column + c, out0 + c, out1 + c);
        for (; c < v_dim; ++c)
          for (int64_t t = 0; t < count; ++t) {
            out0[c] += p0[t * padded] * value_rows[t][column + c];
            out1[c] += p1[t * padded] * value_rows[t][column + c];
          }
      }
    }
  }
  for (int64_t h = 0; h < st.kv_heads; ++h)
    for (int64_t i = 0; i < per_head; ++i) {
      float* out = st.out + ((t0 + i / group) * st.q_heads + h * group + i % group) * v_dim;
      const float inverse = 1.0f / total[h * padded + i];
      const float* sums = &acc[(h * per_head + i) * v_dim];
      for (int64_t c = 0; c < v_dim; ++c) out[c] = sums[c] * inverse;
    }
}

// Attention of row `row`'s new tokens, every head, for a step with few queries per kv head (decode): loops
// run key-outer over whole pool rows (each row read once, contiguously for all heads, rows a few keys ahead
// prefetched), four queries per key load; every query's scores then lie contiguous for a vectorised softmax.
void attend_rows(const Step& st, int64_t row, const std::vector<const float*>& rows) {
  const Attributes& a = st.attr;
  const int64_t t0 = st.offsets[row], t1 = st.offsets[row + 1], past = st.lengths[row];
  const int64_t group = st.q_heads / st.kv_heads, fresh = t1 - t0, keys = past + fresh;
  if (fresh == 0) return;
  const int64_t queries = fresh * st.q_heads;   // query i = (token t0 + i / q_heads, head i % q_heads)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<const float*> q(queries);
  std::vector<int64_t> at(queries);             // each query's position
  for (int64_t i = 0; i < queries; ++i) {
    q[i] = st.q + (t0 * st.q_heads + i) * st.head_dim;
    at[i] = st.positions[t0 + i / st.q_heads];
  }
  std::vector<float> scores(queries * keys);    // [query][key]
  std::vector<int64_t> key_at(keys);             // each key's position
  for (int64_t j = 0; j < keys; ++j) key_at[j] = j < past ? j : st.positions[t0 + j - past];
  float four[4];
  auto score = [&](const float* key_row, int64_t j) {   // every query against key j
    for (int64_t h = 0; h < st.kv_heads; ++h) {
      const float* key = key_row + h * st.head_dim;
      for (int64_t tok = 0; tok < fresh; ++tok) {
        const int64_t first = tok * st.q_heads + h * group;
        int64_t g = 0;
        for (; g + 4 <= group; g += 4) {
          dot4(&q[first + g], key, st.head_dim, four);
          for (int64_t u = 0; u < 4; ++u) scores[(first + g + u) * keys + j] = four[u];
        }
        for (; g < group; ++g) scores[(first + g) * keys + j] = dot(q[first + g], key, st.head_dim);
      }
    }
  };
  const int64_t k_bytes = st.kv_heads * st.head_dim * 4, v_bytes = st.kv_heads * st.v_dim * 4;
  for (int64_t p = 0; p < past; ++p) {
    if (p + kAhead < past) prefetch<3>(rows[p + kAhead] + a.k_column, k_bytes);
    score(rows[p] + a.k_column, p);
  }
  for (int64_t u = 0; u < fresh; ++u) score(st.k + (t0 + u) * st.kv_heads * st.head_dim, past + u);

  for (int64_t i = 0; i < queries; ++i) {       // scale, mask, softcap, softmax over every key of query i
    float* si = &scores[i * keys];
    const float top = prepare_scores(a, si, key_at.data(), keys, past, at[i]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < keys; ++j) total += (si[j] = exp_nonpositive(si[j] - top));
    const float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t j = 0; j < keys; ++j) si[j] *= inverse;
  }

  float* out = st.out + t0 * st.q_heads * st.v_dim;   // [fresh, q_heads, v_dim], accumulated in place
  std::fill(out, out + queries * st.v_dim, 0.0f);
  for (int64_t j = 0; j < keys; ++j) {
    if (j + kAhead < past) prefetch<3>(rows[j + kAhead] + a.v_column, v_bytes);
    const float* value_row = j < past ? rows[j] + a.v_column : st.v + (t0 + j - past) * st.kv_heads * st.v_dim;
    for (int64_t h = 0; h < st.kv_heads; ++h) {
      const float* value = value_row + h * st.v_dim;
      for (int64_t tok = 0; tok < fresh; ++tok) {
        const int64_t first = tok * st.q_heads + h * group;
        int64_t g = 0;
        for (; g + 4 <= group; g += 4) {
          const float w[4] = {scores[(first + g) * keys + j], scores[(first + g + 1) * keys + j],
                              scores[(first + g + 2) * keys + j], scores[(first + g + 3) * keys + j]};
          axpy4(w, value, out + (first + g) * st.v_dim, st.v_dim);
        }
        for (; g < group; ++g) axpy(scores[(first + g) * keys + j], value, out + (first + g) * st.v_dim, st.v_dim);
      }
    }
  }
}

// Checks the inputs against each other; a bad feed becomes an error status, never a wild read.
OrtStatus* check(const Tensor* t, const Step& st, int64_t tokens, int64_t batch) {
  const int64_t num_blocks = t[3].dims[0];
  if (st.kv_heads <= 0 || st.q_heads % st.kv_heads != 0 || t[1].dims[0] != tokens || t[2].dims[0] != tokens ||
      t[1].dims[2] != st.head_dim || t[2].dims[1] != st.kv_heads || t[6].dims[0] != tokens)
    return fail("PagedAttentionPool: q/k/v/positions disagree on tokens, heads or head size");
  if (t[5].dims[0] != batch + 1 || t[4].dims[0] != batch)
    return fail("PagedAttentionPool: row_offsets needs B+1 entries and block_table B rows");
  if (st.attr.layer < 0 || st.attr.layer >= st.layers || st.attr.k_column < 0 || st.attr.v_column < 0 ||
      st.attr.k_column + st.kv_heads * st.head_dim > st.width || st.attr.v_column + st.kv_heads * st.v_dim > st.width)
    return fail("PagedAttentionPool: layer or K/V columns outside the pool row");
  if (st.offsets[0] != 0 || st.offsets[batch] != tokens)
    return fail("PagedAttentionPool: row_offsets must start at 0 and end at the number of tokens");
  for (int64_t b = 0; b < batch; ++b) {
    if (st.offsets[b + 1] < st.offsets[b]) return fail("PagedAttentionPool: row_offsets must not decrease");
    const int64_t length = st.lengths[b];
    if (length < 0 || length > st.max_blocks * st.block_size)
      return fail("PagedAttentionPool: a cache length exceeds its row's block table");
    for (int64_t j = 0; j * st.block_size < length; ++j) {
      const int64_t block = st.table[b * st.max_blocks + j];
      if (block < 0 || block >= num_blocks) return fail("PagedAttentionPool: block table entry outside the pool");
    }
  }
  return nullptr;
}

// The in-graph rows of PagedAttentionPoolRows: a later draft step's past is the pool with this step's rows
// written over some slots (export/archs/common.scatter_rows), rows [L, N, W] (pool-row layout) going to flat
// slots index [N] = b * P + p, P = max_blocks * block_size.
struct Overrides {
  const float* rows = nullptr;   // this layer's rows [N, W]
  const int64_t* index = nullptr;
  int64_t count = 0;
};

OrtStatus* read_overrides(OrtKernelContext* context, const Step& st, int64_t batch, Overrides* o) {
  Tensor t[2];
  for (size_t i = 0; i < 2; ++i) {
    RETURN_IF_ERROR(read_input(context, kNumInputs + i, &t[i]));
  }
  if (t[0].dims.size() != 3 || t[1].dims.size() != 1 || (t[0].dims[0] != st.layers && t[0].dims[0] != 1) ||
      t[0].dims[2] != st.width || t[0].dims[1] != t[1].dims[0])
    return fail("PagedAttentionPoolRows: rows must be [layers or 1, N, pool row width] and index [N]");
  o->count = t[1].dims[0];
  const int64_t layer = t[0].dims[0] == 1 ? 0 : st.attr.layer;       // [1, N, W]: this layer's rows alone
  o->rows = static_cast<const float*>(t[0].data) + layer * o->count * st.width;
  o->index = static_cast<const int64_t*>(t[1].data);
  const int64_t slots = batch * st.max_blocks * st.block_size;
  for (int64_t n = 0; n < o->count; ++n)
    if (o->index[n] < 0 || o->index[n] >= slots)
      return fail("PagedAttentionPoolRows: a row index outside batch x max_blocks x block_size");
  return nullptr;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context, bool with_rows) {
  Step st;
  st.attr = *static_cast<const Attributes*>(kernel);
  Tensor t[kNumInputs];
  for (size_t i = 0; i < kNumInputs; ++i) {
    RETURN_IF_ERROR(read_input(context, i, &t[i]));
  }
  static const size_t ranks[kNumInputs] = {3, 3, 3, 4, 2, 1, 1, 1};
  for (size_t i = 0; i < kNumInputs; ++i)
    if (t[i].dims.size() != ranks[i])
      return fail("PagedAttentionPool: input " + std::to_string(i) + " has rank " +
                  std::to_string(t[i].dims.size()) + ", expected " + std::to_string(ranks[i]));
  const int64_t tokens = t[0].dims[0], batch = t[7].dims[0];
  st.q_heads = t[0].dims[1];
  st.head_dim = t[0].dims[2];
  st.kv_heads = t[1].dims[1];
  st.v_dim = t[2].dims[2];
  st.layers = t[3].dims[1];
  st.block_size = t[3].dims[2];
  st.width = t[3].dims[3];
  st.max_blocks = t[4].dims[1];
  st.q = static_cast<const float*>(t[0].data);
  st.k = static_cast<const float*>(t[1].data);
  st.v = static_cast<const float*>(t[2].data);
  st.pool = static_cast<const float*>(t[3].data);
  st.table = static_cast<const int64_t*>(t[4].data);
  st.offsets = static_cast<const int64_t*>(t[5].data);
  st.positions = static_cast<const int64_t*>(t[6].data);
  st.lengths = static_cast<const int64_t*>(t[7].data);
  RETURN_IF_ERROR(check(t, st, tokens, batch));
  Overrides overrides;
  if (with_rows) RETURN_IF_ERROR(read_overrides(context, st, batch, &overrides));

  void* data = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {tokens, st.q_heads, st.v_dim}, &data));
  st.out = static_cast<float*>(data);
  const int64_t slots_per_row = st.max_blocks * st.block_size;
  std::vector<const float*> rows;
  for (int64_t b = 0; b < batch; ++b) {
    rows.resize(st.lengths[b]);
    for (int64_t p = 0; p < st.lengths[b]; ++p) rows[p] = st.pool_row(b, p);
    for (int64_t n = 0; n < overrides.count; ++n) {    // in-graph rows over their slots (the last one wins)
      const int64_t row_of = overrides.index[n] / slots_per_row, p = overrides.index[n] % slots_per_row;
      if (row_of == b && p < st.lengths[b])
        rows[p] = overrides.rows + n * st.width;
    }
    const int64_t per_head = (st.offsets[b + 1] - st.offsets[b]) * (st.q_heads / st.kv_heads);
    (per_head >= 4 ? attend_tiled : attend_rows)(st, b, rows);
  }
  return nullptr;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* attributes = new Attributes;
  if (OrtStatus* status = read_attributes(info, attributes)) {
    delete attributes;
    return status;
  }
  *kernel = attributes;
  return nullptr;
}

OrtCustomOp make_op(bool with_rows) {
  OrtCustomOp op = cpu_op();
  op.GetInputType = [](const OrtCustomOp*, size_t i) { return int(i < 4 || i == kNumInputs ? kFloat : kInt64); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(1); };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Attributes*>(kernel); };
  op.CreateKernelV2 = create_kernel;
  if (with_rows) {
    op.GetName = [](const OrtCustomOp*) { return "PagedAttentionPoolRows"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kNumInputs + 2; };
    op.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) { return compute(kernel, context, true); };
  } else {
    op.GetName = [](const OrtCustomOp*) { return "PagedAttentionPool"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kNumInputs; };
    op.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) { return compute(kernel, context, false); };
  }
  return op;
}

OrtCustomOp g_paged_attention = make_op(false);
OrtCustomOp g_paged_attention_rows = make_op(true);

}  // namespace

const OrtCustomOp* paged_attention_op(bool with_rows) {
  return with_rows ? &g_paged_attention_rows : &g_paged_attention;
}

}  // namespace unispec_cpu
