// unispec.cpu::PagedAttentionRope, ONNX Runtime CPU kernel: one layer's attention from its projections'
// outputs, RoPE and the layer's KV delta row included, so that a layer's attention is one node.
//
// At the bundled sizes a decode step is dispatch-bound (~1-5 us a node on one core), and the exported layer
// spends eleven nodes around PagedAttentionPool doing no arithmetic worth a dispatch:
//
//   q2d ─Reshape─RotaryEmbedding─Squeeze─────────────────────┐
//   k2d ─Reshape─RotaryEmbedding─Reshape─┬─Reshape───────────┤ PagedAttentionPool ─Reshape─▶ attention [S, Hq*Dv]
//   v2d ─────────────────────────────────│─┬─Reshape─────────┘
//                                        └─┴─Concat─Unsqueeze──▶ kv_delta [S, 1, W]
//
// Inputs   q2d [S, Hq*D], k2d [S, Hkv*D], v2d [S, Hkv*Dv]  the projections' outputs, float32 (no RoPE yet)
//          cos, sin [S, D/2] (or [S, 1, D/2]: S*D/2 values)  one token's half tables, as RotaryEmbedding's
//          kv_pool, block_table, row_offsets, positions, cache_lengths   as PagedAttentionPool's
// Outputs  attention [S, Hq*Dv] float32, PagedAttentionPool's [S, Hq, Dv] viewed 2-D
//          kv_delta [S, 1, W] float32, W = Hkv*D + Hkv*Dv: the rotated K then V of each token (a pool row's layout)
// Attributes PagedAttentionPool's (layer, k_column, v_column, scale, causal, sliding_window, softcap) and
//          q_heads, kv_heads, head_dim (D; the rotation is full: all of D, rotate-half, non-interleaved).
//
// unispec.cpu::PagedAttentionRopeRows is the same over PagedAttentionPoolRows' past (the pool with this
// step's in-graph rows written over some slots): two more inputs, rows [L or 1, N, W] and index [N].
//
// RoPE is RotaryEmbedding's (interleaved=0) exactly: for i < D/2, x'[i] = x[i]·cos[i] - x[i+D/2]·sin[i] and
// x'[i+D/2] = x[i+D/2]·cos[i] + x[i]·sin[i]. The attention is paged_attention.cc's (attend_pool), over q and
// k rotated into scratch (a step's few tokens: a copy costs less than a node).

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernel.h"
#include "paged_attention_pool.h"

namespace unispec_cpu {
namespace {

constexpr size_t kNumInputs = 10;       // PagedAttentionRope; PagedAttentionRopeRows adds two
constexpr size_t kCos = 3, kSin = 4, kPool = 5;

struct RopeAttributes {
  Attributes attention;
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
};

// Rotates `heads` heads of `dim` for each of `tokens` tokens: from[s] [heads, dim] -> to[s], rows `from_stride`
// and `to_stride` floats apart; cos and sin [tokens, dim / 2].
void rotate(const float* from, int64_t from_stride, float* to, int64_t to_stride, const float* cos,
            const float* sin, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t s = 0; s < tokens; ++s) {
    const float *c = cos + s * half, *n = sin + s * half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = from + s * from_stride + h * dim;
      float* y = to + s * to_stride + h * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        y[i] = x[i] * c[i] - x[i + half] * n[i];
        y[i + half] = x[i + half] * c[i] + x[i] * n[i];
      }
    }
  }
}

OrtStatus* check(const Tensor* t, const RopeAttributes& a) {
  const int64_t tokens = t[0].dims.empty() ? -1 : t[0].dims[0];
  const int64_t q_width = a.q_heads * a.head_dim, k_width = a.kv_heads * a.head_dim;
  if (a.q_heads <= 0 || a.kv_heads <= 0 || a.head_dim <= 0 || a.head_dim % 2 != 0)
    return fail("PagedAttentionRope: q_heads, kv_heads and head_dim must be positive, head_dim even");
  for (size_t i = 0; i < 3; ++i)
    if (t[i].dims.size() != 2 || t[i].dims[0] != tokens)
      return fail("PagedAttentionRope: q, k and v must be [S, heads * head size] of the same S");
  if (t[0].dims[1] != q_width || t[1].dims[1] != k_width || t[2].dims[1] % a.kv_heads != 0)
    return fail("PagedAttentionRope: q is not [S, q_heads * head_dim], k [S, kv_heads * head_dim] or v "
                "[S, kv_heads * Dv]");
  if (t[kCos].numel() != tokens * a.head_dim / 2 || t[kSin].numel() != tokens * a.head_dim / 2 ||
      t[kCos].dims.empty() || t[kCos].dims[0] != tokens || t[kSin].dims.empty() || t[kSin].dims[0] != tokens)
    return fail("PagedAttentionRope: cos and sin must be [S, head_dim / 2] (or [S, 1, head_dim / 2])");
  return nullptr;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context, bool with_rows) {
  const RopeAttributes& a = *static_cast<const RopeAttributes*>(kernel);
  Tensor t[kNumInputs + 2];
  for (size_t i = 0; i < kNumInputs + (with_rows ? 2 : 0); ++i) {
    RETURN_IF_ERROR(read_input(context, i, &t[i]));
  }
  RETURN_IF_ERROR(check(t, a));
  const int64_t tokens = t[0].dims[0], dim = a.head_dim, v_dim = t[2].dims[1] / a.kv_heads;
  const int64_t k_width = a.kv_heads * dim, v_width = a.kv_heads * v_dim, width = k_width + v_width;
  const auto* cos = static_cast<const float*>(t[kCos].data);
  const auto* sin = static_cast<const float*>(t[kSin].data);
  const auto* v = static_cast<const float*>(t[2].data);

  void* delta_data = nullptr;
  RETURN_IF_ERROR(make_output(context, 1, {tokens, 1, width}, &delta_data));
  auto* delta = static_cast<float*>(delta_data);                 // [S, 1, W]: K then V of each token
  std::vector<float> q(tokens * a.q_heads * dim), k(tokens * k_width);   // [S, H, D] rotated
  rotate(static_cast<const float*>(t[0].data), a.q_heads * dim, q.data(), a.q_heads * dim, cos, sin, tokens,
         a.q_heads, dim);
  rotate(static_cast<const float*>(t[1].data), k_width, k.data(), k_width, cos, sin, tokens, a.kv_heads, dim);
  for (int64_t s = 0; s < tokens; ++s) {
    std::memcpy(delta + s * width, k.data() + s * k_width, k_width * sizeof(float));
    std::memcpy(delta + s * width + k_width, v + s * v_width, v_width * sizeof(float));
  }

  // PagedAttentionPool's inputs: q, k, v as [S, H, D] views, then the pool and its tables as given
  Tensor pool_inputs[8];
  pool_inputs[0] = {{tokens, a.q_heads, dim}, q.data()};
  pool_inputs[1] = {{tokens, a.kv_heads, dim}, k.data()};
  pool_inputs[2] = {{tokens, a.kv_heads, v_dim}, t[2].data};
  for (size_t i = 0; i < 5; ++i) pool_inputs[3 + i] = t[kPool + i];
  void* out = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {tokens, a.q_heads * v_dim}, &out));
  return attend_pool(a.attention, pool_inputs, with_rows ? t + kNumInputs : nullptr, static_cast<float*>(out));
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* a = new RopeAttributes;
  auto get_int = call<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(g_api,
                                                                                 KernelInfoGetAttribute_int64);
  OrtStatus* status = read_attention_attributes(info, &a->attention);
  if (status == nullptr) status = get_int(info, "q_heads", &a->q_heads);
  if (status == nullptr) status = get_int(info, "kv_heads", &a->kv_heads);
  if (status == nullptr) status = get_int(info, "head_dim", &a->head_dim);
  if (status != nullptr) {
    delete a;
    return status;
  }
  *kernel = a;
  return nullptr;
}

OrtCustomOp make_op(bool with_rows) {
  OrtCustomOp op = cpu_op();
  op.GetInputType = [](const OrtCustomOp*, size_t i) {
    return int(i <= kPool || i == kNumInputs ? kFloat : kInt64);
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(2); };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.KernelDestroy = [](void* kernel) { delete static_cast<RopeAttributes*>(kernel); };
  op.CreateKernelV2 = create_kernel;
  if (with_rows) {
    op.GetName = [](const OrtCustomOp*) { return "PagedAttentionRopeRows"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kNumInputs + 2; };
    op.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) { return compute(kernel, context, true); };
  } else {
    op.GetName = [](const OrtCustomOp*) { return "PagedAttentionRope"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kNumInputs; };
    op.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) { return compute(kernel, context, false); };
  }
  return op;
}

OrtCustomOp g_rope = make_op(false);
OrtCustomOp g_rope_rows = make_op(true);

}  // namespace

const OrtCustomOp* paged_attention_rope_op(bool with_rows) { return with_rows ? &g_rope_rows : &g_rope; }

}  // namespace unispec_cpu
