// The attention loops of unispec.cpu::PagedAttentionPool (see ort_cpu.cc): one row's new tokens
// against its past read in place from the pool, flash-style in key tiles (attend_tiled) or key-outer over
// whole pool rows (attend_rows). Included by ort_cpu.cc alone, after its `#pragma GCC optimize`.

#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ort_cpu_blocks.h"
#include "ort_cpu_pool.h"   // Attributes
#include "unispec_constants.h"   // generated at build time: the pool's axis order (plugins/pool_axes.py)

namespace unispec_cpu {
namespace {

// One step's geometry and pointers, shared by every row's attention.
struct Step {
  Attributes attr;
  const float *q, *k, *v, *pool;
  const int64_t *table, *offsets, *positions, *lengths;
  float* out;
  int64_t q_heads, kv_heads, head_dim, v_dim, layers, block_size, width, max_blocks;
  int64_t pool_strides[kPoolRank];    // in elements, row-major over the pool's dims (set_pool_geometry)

  const float* pool_row(int64_t row, int64_t p) const {
    const int64_t block = table[row * max_blocks + p / block_size];
    return pool + block * pool_strides[kPoolAxisBlock] + attr.layer * pool_strides[kPoolAxisLayer] +
           (p % block_size) * pool_strides[kPoolAxisOffset];
  }
};

// The kernels read a pool row as one run of `width` floats.
static_assert(kPoolAxisWidth == kPoolRank - 1, "the pool's width axis must be its last (plugins/pool_axes.py)");

// layers, block_size, width and the strides of a contiguous pool of `dims`, by the axes Python names.
inline void set_pool_geometry(const std::vector<int64_t>& dims, Step* st) {
  st->layers = dims[kPoolAxisLayer];
  st->block_size = dims[kPoolAxisOffset];
  st->width = dims[kPoolAxisWidth];
  int64_t stride = 1;
  for (int64_t axis = kPoolRank - 1; axis >= 0; --axis) {
    st->pool_strides[axis] = stride;
    stride *= dims[axis];
  }
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

// Attention of row `row`'s new tokens, every head, for a step with 2 or more queries per kv head (decode
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

// Attention of row `row`'s new tokens, every head, for a step with one query per kv head (multi-head decode):
// loops run key-outer over whole pool rows (each row read once, contiguously for all heads, rows a few keys ahead
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

}  // namespace
}  // namespace unispec_cpu
