// What ort_cpu.cc shares with the ops built on its attention (ort_cpu_rope.cc): the
// attributes every paged-attention op reads, and the attention over the pool itself, so that the loops of
// ort_cpu_attend.h are compiled once, in ort_cpu.cc.

#pragma once
#include <cstdint>

#include "kernel.h"

namespace unispec_cpu {

// The attention's attributes (ints unless said): layer, k_column, v_column (where this layer's K and V start
// in a pool row), scale (float), causal, sliding_window (0 = full), softcap (float, 0 = none).
struct Attributes {
  int64_t layer = 0, k_column = 0, v_column = 0, causal = 1, sliding_window = 0;
  float scale = 1.0f, softcap = 0.0f;
};

OrtStatus* read_attention_attributes(const OrtKernelInfo* info, Attributes* a);

// PagedAttentionPool's math over inputs[0:8] = q [S, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv] (float32, RoPE
// applied), kv_pool, block_table, row_offsets, positions, cache_lengths, and, when `rows` is not null,
// PagedAttentionPoolRows' rows[0:2] = rows [L or 1, N, W], index [N]. Checks them against each other (an
// error status, never a wild read), then writes out [S, Hq, Dv], which the caller allocated.
OrtStatus* attend_pool(const Attributes& attr, const Tensor* inputs, const Tensor* rows, float* out);

}  // namespace unispec_cpu
