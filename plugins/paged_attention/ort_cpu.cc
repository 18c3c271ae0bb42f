// unispec.cpu::PagedAttentionPool, ONNX Runtime CPU kernel: PagedAttention (the math of
// plugins/paged_attention/reference.py) reading each row's past straight from the paged KV pool.
//
// The exported graph gathers every row's blocks, transposes them layer-major, splits layers and K/V, and
// the reference attention then copies the result once more per query: ~6 copies of the history a step.
// This kernel reads key p of row b where it lives, pool[block_table[b, p / bs], layer, p % bs, column],
// so a step reads each row's history once and copies none of it.
//
// Inputs   q [S, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv]   this step's tokens (RoPE applied), float32
//          kv_pool [num_blocks, L, bs, W] float32         read in place, never written (axis order and
//                                                          strides from the generated unispec_constants.h)
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
//
// Here: the op (attributes, input checks, the in-graph rows, registration) and attend_pool, the attention that
// ort_cpu_rope.cc's fused op calls too (ort_cpu_pool.h). The attention loops are in
// ort_cpu_attend.h, the register blocks they are built of in ort_cpu_blocks.h; both are
// included here alone, so the whole kernel is one translation unit and the blocks inline into the loops.

// Floating-point exceptions are never read here, so GCC may evaluate both sides of a select: without this,
// the softmax's loops (exp_nonpositive's clamps and selects) stay scalar on AVX2, which has no masked
// instructions to guard them with (AVX-512 does), and an 8-token verify ran at ~2x AVX-512's time. The
// results are the same bits: only where the compiler may compute, not what, changes. Before every include,
// so that the inline functions of the headers share the setting and still inline into the loops.
#pragma GCC optimize("no-trapping-math")

#include <cstdint>
#include <string>
#include <vector>

#include "kernel.h"
#include "ort_cpu_attend.h"

namespace unispec_cpu {
namespace {

constexpr size_t kNumInputs = 8;       // PagedAttentionPool; PagedAttentionPoolRows adds two

// Checks the inputs against each other; a bad feed becomes an error status, never a wild read.
OrtStatus* check(const Tensor* t, const Step& st, int64_t tokens, int64_t batch) {
  const int64_t num_blocks = t[3].dims[kPoolAxisBlock];
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

OrtStatus* read_overrides(const Tensor* t, const Step& st, int64_t batch, Overrides* o) {
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
  Tensor t[kNumInputs + 2];
  for (size_t i = 0; i < kNumInputs + (with_rows ? 2 : 0); ++i) {
    RETURN_IF_ERROR(read_input(context, i, &t[i]));
  }
  if (t[0].dims.size() != 3 || t[2].dims.size() != 3)
    return fail("PagedAttentionPool: q must be [S, Hq, D] and v [S, Hkv, Dv]");
  void* data = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {t[0].dims[0], t[0].dims[1], t[2].dims[2]}, &data));
  return attend_pool(*static_cast<const Attributes*>(kernel), t, with_rows ? t + kNumInputs : nullptr,
                     static_cast<float*>(data));
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* attributes = new Attributes;
  if (OrtStatus* status = read_attention_attributes(info, attributes)) {
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

OrtStatus* read_attention_attributes(const OrtKernelInfo* info, Attributes* a) {
  RETURN_IF_ERROR(int_attribute(info, "layer", &a->layer));
  RETURN_IF_ERROR(int_attribute(info, "k_column", &a->k_column));
  RETURN_IF_ERROR(int_attribute(info, "v_column", &a->v_column));
  RETURN_IF_ERROR(int_attribute(info, "causal", &a->causal));
  RETURN_IF_ERROR(int_attribute(info, "sliding_window", &a->sliding_window));
  RETURN_IF_ERROR(float_attribute(info, "scale", &a->scale));
  return float_attribute(info, "softcap", &a->softcap);
}

OrtStatus* attend_pool(const Attributes& attr, const Tensor* t, const Tensor* with_rows, float* out) {
  Step st;
  st.attr = attr;
  static const size_t ranks[kNumInputs] = {3, 3, 3, kPoolRank, 2, 1, 1, 1};
  for (size_t i = 0; i < kNumInputs; ++i)
    if (t[i].dims.size() != ranks[i])
      return fail("PagedAttentionPool: input " + std::to_string(i) + " has rank " +
                  std::to_string(t[i].dims.size()) + ", expected " + std::to_string(ranks[i]));
  const int64_t tokens = t[0].dims[0], batch = t[7].dims[0];
  st.q_heads = t[0].dims[1];
  st.head_dim = t[0].dims[2];
  st.kv_heads = t[1].dims[1];
  st.v_dim = t[2].dims[2];
  set_pool_geometry(t[3].dims, &st);
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
  if (with_rows != nullptr) RETURN_IF_ERROR(read_overrides(with_rows, st, batch, &overrides));
  st.out = out;
  const int64_t slots_per_row = st.max_blocks * st.block_size;
  std::vector<const float*> rows;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = st.lengths[b], step = st.pool_strides[kPoolAxisOffset];
    rows.resize(length);
    for (int64_t p0 = 0; p0 < length; p0 += st.block_size) {    // one table lookup per block, not per key
      const float* first = st.pool_row(b, p0);
      for (int64_t p = p0, end = std::min(length, p0 + st.block_size); p < end; ++p) rows[p] = first + (p - p0) * step;
    }
    for (int64_t n = 0; n < overrides.count; ++n) {    // in-graph rows over their slots (the last one wins)
      const int64_t row_of = overrides.index[n] / slots_per_row, p = overrides.index[n] % slots_per_row;
      if (row_of == b && p < st.lengths[b])
        rows[p] = overrides.rows + n * st.width;
    }
    // Tiles from 2 queries per kv head: a GQA pair's decode ran key-outer with a horizontal sum per key and
    // query, 0.49 ms a bundled Llama 3 step at 384 past tokens against 0.34 tiled (padded to 8 queries).
    const int64_t per_head = (st.offsets[b + 1] - st.offsets[b]) * (st.q_heads / st.kv_heads);
    (per_head >= 2 ? attend_tiled : attend_rows)(st, b, rows);
  }
  return nullptr;
}

const OrtCustomOp* paged_attention_op(bool with_rows) {
  return with_rows ? &g_paged_attention_rows : &g_paged_attention;
}

}  // namespace unispec_cpu