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
// (Qwen 3-style layers, DFlash's draft and Gemma 4, put a per-head RMSNormalization before each RoPE, and
// Gemma 4 a weightless one on v: [S, H, D] ─RMSNormalization─Unsqueeze(2)─RotaryEmbedding─Squeeze(2).)
//
// Inputs   q2d [S, Hq*D], k2d [S, Hkv*D], v2d [S, Hkv*Dv]  the projections' outputs, float32 (no RoPE yet)
//          cos, sin [S, D/2] (or [S, 1, D/2]: S*D/2 values)  one token's half tables, as RotaryEmbedding's
//          kv_pool, block_table, row_offsets, positions, cache_lengths   as PagedAttentionPool's
//          q_norm, k_norm [D] float32, optional: when given, q (k) is RMS-normed per head by that weight
// Outputs  attention [S, Hq*Dv] float32, PagedAttentionPool's [S, Hq, Dv] viewed 2-D
//          kv_delta [S, 1, W] float32, W = Hkv*D + Hkv*Dv: the rotated K then V of each token (a pool row's layout)
// Attributes PagedAttentionPool's (layer, k_column, v_column, scale, causal, sliding_window, softcap) and
//          q_heads, kv_heads, head_dim (D; the rotation is full: all of D, rotate-half, non-interleaved);
//          optional: v_norm (int, 1: v RMS-normed per head without a weight; default 0) and norm_epsilon (float,
//          the norms' epsilon; needed once a norm is asked for).
//
// unispec.cpu::PagedAttentionRopeRows is the same over PagedAttentionPoolRows' past (the pool with this
// step's in-graph rows written over some slots): two more inputs, rows [L or 1, N, W] and index [N], before
// q_norm and k_norm.
//
// The norm is ONNX RMSNormalization's over the last axis of [S, H, D] (stash_type 1) as ONNX Runtime computes
// it: y = x / sqrt(sum(x·x) / D + epsilon) · w, the sum in float32 in order. RoPE is RotaryEmbedding's
// (interleaved=0) exactly: for i < D/2, x'[i] = x[i]·cos[i] - x[i+D/2]·sin[i] and
// x'[i+D/2] = x[i+D/2]·cos[i] + x[i]·sin[i]. The attention is ort_cpu.cc's (attend_pool), over q and
// k rotated into scratch (a step's few tokens: a copy costs less than a node).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernel.h"
#include "ort_cpu_pool.h"

namespace unispec_cpu {
namespace {

constexpr size_t kNumInputs = 10;       // PagedAttentionRope; PagedAttentionRopeRows adds two
constexpr size_t kCos = 3, kSin = 4, kPool = 5;

struct RopeAttributes {
  Attributes attention;
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0, v_norm = 0;
  float norm_epsilon = 0.0f;
  bool has_epsilon = false;
};

// One of q, k, v on its way to the attention: the projection's output [S, heads * dim], its norm weight [dim]
// (null: none), whether it is normed at all (v's norm has no weight) and whether it is rotated.
struct Side {
  const float* x = nullptr;
  const float* norm = nullptr;
  bool normed = false, rotated = false;
  int64_t heads = 0, dim = 0;
};

// RMS-normalizes each `dim` row of x in place, as ONNX Runtime's RMSNormalization (float sum, in order).
void rms_norm(float* x, int64_t rows, int64_t dim, const float* weight, float epsilon) {
  for (int64_t r = 0; r < rows; ++r, x += dim) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
    const float rms = std::sqrt(sum / static_cast<float>(dim) + epsilon);
    for (int64_t i = 0; i < dim; ++i) x[i] = weight != nullptr ? x[i] / rms * weight[i] : x[i] / rms;
  }
}

// Rotates in place `heads` heads of `dim` for each of `tokens` tokens, x [tokens, heads, dim]; cos and sin
// [tokens, dim / 2].
void rotate(float* x, const float* cos, const float* sin, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t s = 0; s < tokens; ++s) {
    const float *c = cos + s * half, *n = sin + s * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* y = x + (s * heads + h) * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float first = y[i], second = y[i + half];     // each i reads and writes its own pair only
        y[i] = first * c[i] - second * n[i];
        y[i + half] = second * c[i] + first * n[i];
      }
    }
  }
}

// The side as the attention reads it: `x` itself when untouched, else normed and/or rotated into `scratch`.
const float* prepare(const Side& side, int64_t tokens, const float* cos, const float* sin, float epsilon,
                     std::vector<float>* scratch) {
  if (!side.normed && !side.rotated) return side.x;
  scratch->assign(side.x, side.x + tokens * side.heads * side.dim);
  if (side.normed) rms_norm(scratch->data(), tokens * side.heads, side.dim, side.norm, epsilon);
  if (side.rotated) rotate(scratch->data(), cos, sin, tokens, side.heads, side.dim);
  return scratch->data();
}

OrtStatus* check(const Tensor* t, const Tensor* norms, const RopeAttributes& a) {
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
  for (size_t i = 0; i < 2; ++i)
    if (norms[i].data != nullptr && (norms[i].dims.size() != 1 || norms[i].dims[0] != a.head_dim))
      return fail("PagedAttentionRope: q_norm and k_norm must be [head_dim]");
  if ((norms[0].data != nullptr || norms[1].data != nullptr || a.v_norm != 0) && !a.has_epsilon)
    return fail("PagedAttentionRope: a q, k or v norm needs the norm_epsilon attribute");
  return nullptr;
}

// The optional inputs from `first` on (q_norm, k_norm): data stays null for an absent one.
OrtStatus* read_norms(OrtKernelContext* context, size_t first, Tensor* norms) {
  for (size_t i = 0; i < 2; ++i) {
    const OrtValue* value = nullptr;
    RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(
        g_api, KernelContext_GetInput)(context, first + i, &value));
    if (value != nullptr) RETURN_IF_ERROR(read_tensor(value, &norms[i]));
  }
  return nullptr;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context, bool with_rows) {
  const RopeAttributes& a = *static_cast<const RopeAttributes*>(kernel);
  const size_t num_inputs = kNumInputs + (with_rows ? 2 : 0);
  Tensor t[kNumInputs + 2], norms[2];
  for (size_t i = 0; i < num_inputs; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  RETURN_IF_ERROR(read_norms(context, num_inputs, norms));
  RETURN_IF_ERROR(check(t, norms, a));
  const int64_t tokens = t[0].dims[0], dim = a.head_dim, v_dim = t[2].dims[1] / a.kv_heads;
  const int64_t k_width = a.kv_heads * dim, v_width = a.kv_heads * v_dim, width = k_width + v_width;
  const auto* cos = static_cast<const float*>(t[kCos].data);
  const auto* sin = static_cast<const float*>(t[kSin].data);
  const auto* q_norm = static_cast<const float*>(norms[0].data);
  const auto* k_norm = static_cast<const float*>(norms[1].data);
  const Side sides[3] = {{static_cast<const float*>(t[0].data), q_norm, q_norm != nullptr, true, a.q_heads, dim},
                         {static_cast<const float*>(t[1].data), k_norm, k_norm != nullptr, true, a.kv_heads, dim},
                         {static_cast<const float*>(t[2].data), nullptr, a.v_norm != 0, false, a.kv_heads, v_dim}};
  std::vector<float> scratch[3];                                  // [S, H, D] normed and rotated q, k (v)
  const float* qkv[3];
  for (size_t i = 0; i < 3; ++i) qkv[i] = prepare(sides[i], tokens, cos, sin, a.norm_epsilon, &scratch[i]);

  void* delta_data = nullptr;
  RETURN_IF_ERROR(make_output(context, 1, {tokens, 1, width}, &delta_data));
  auto* delta = static_cast<float*>(delta_data);                 // [S, 1, W]: K then V of each token
  for (int64_t s = 0; s < tokens; ++s) {
    std::memcpy(delta + s * width, qkv[1] + s * k_width, k_width * sizeof(float));
    std::memcpy(delta + s * width + k_width, qkv[2] + s * v_width, v_width * sizeof(float));
  }
  // PagedAttentionPool's inputs: q, k, v as [S, H, D] views, then the pool and its tables as given
  Tensor pool_inputs[8];
  pool_inputs[0] = {{tokens, a.q_heads, dim}, const_cast<float*>(qkv[0])};
  pool_inputs[1] = {{tokens, a.kv_heads, dim}, const_cast<float*>(qkv[1])};
  pool_inputs[2] = {{tokens, a.kv_heads, v_dim}, const_cast<float*>(qkv[2])};
  for (size_t i = 0; i < 5; ++i) pool_inputs[3 + i] = t[kPool + i];
  void* out = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {tokens, a.q_heads * v_dim}, &out));
  return attend_pool(a.attention, pool_inputs, with_rows ? t + kNumInputs : nullptr, static_cast<float*>(out));
}

OrtStatus* read_norm_attributes(const OrtKernelInfo* info, RopeAttributes* a) {
  if (!optional_attribute(int_attribute, info, "v_norm", &a->v_norm)) a->v_norm = 0;      // absent: v not normed
  // absent: fine while no norm is asked for
  a->has_epsilon = optional_attribute(float_attribute, info, "norm_epsilon", &a->norm_epsilon);
  return nullptr;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* a = new RopeAttributes;
  OrtStatus* status = read_attention_attributes(info, &a->attention);
  if (status == nullptr) status = int_attribute(info, "q_heads", &a->q_heads);
  if (status == nullptr) status = int_attribute(info, "kv_heads", &a->kv_heads);
  if (status == nullptr) status = int_attribute(info, "head_dim", &a->head_dim);
  if (status == nullptr) status = read_norm_attributes(info, a);
  if (status != nullptr) {
    delete a;
    return status;
  }
  *kernel = a;
  return nullptr;
}

OrtCustomOp make_op(bool with_rows) {
  OrtCustomOp op = cpu_op();
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(2); };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.KernelDestroy = [](void* kernel) { delete static_cast<RopeAttributes*>(kernel); };
  op.CreateKernelV2 = create_kernel;
  if (with_rows) {    // ... rows (float), index (int64), then the optional q_norm, k_norm (float)
    op.GetName = [](const OrtCustomOp*) { return "PagedAttentionRopeRows"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kNumInputs + 4; };
    op.GetInputType = [](const OrtCustomOp*, size_t i) {
      return int(i <= kPool || i == kNumInputs || i >= kNumInputs + 2 ? kFloat : kInt64);
    };
    op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) { return int(i >= kNumInputs + 2); };  // 1: optional
    op.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) { return compute(kernel, context, true); };
  } else {
    op.GetName = [](const OrtCustomOp*) { return "PagedAttentionRope"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kNumInputs + 2; };
    op.GetInputType = [](const OrtCustomOp*, size_t i) { return int(i <= kPool || i >= kNumInputs ? kFloat : kInt64); };
    op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) { return int(i >= kNumInputs); };
    op.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) { return compute(kernel, context, false); };
  }
  return op;
}

OrtCustomOp g_rope = make_op(false);
OrtCustomOp g_rope_rows = make_op(true);

}  // namespace

const OrtCustomOp* paged_attention_rope_op(bool with_rows) { return with_rows ? &g_rope_rows : &g_rope; }

}  // namespace unispec_cpu
