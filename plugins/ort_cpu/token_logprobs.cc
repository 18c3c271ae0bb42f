// unispec.cpu::TokenLogprobs: a step's log-probability outputs (export/step/spec_glue.py's token_logprobs) in
// one node, one pass over each verified position's logits.
//
// In model.onnx they are LogSoftmax, GatherElements, Greater, Cast, ReduceSum, Cast, Add and TopK over
// [B, K+1, V], with the emitted ids chosen by Clip, Concat, Equal, Where and Unsqueezes: ~16 nodes that every
// step runs (no input says whether a row asked for log-probabilities), each a dispatch and most a full sweep
// over the vocabulary. Here a position costs one sweep for the maximum, one for the sum of exponentials, one
// that writes log p and counts the tokens above the emitted one, and a partial selection of the top N.
//
// Inputs   logits [B, P, V] f32 (P = K + 1 verified positions), draft_tokens [B, P-1] i64 (-1: none),
//          next_tokens [B] i64, num_accepted [B] i64
// Outputs  emitted [B, P] f32, ranks [B, P] i64, top [B, P, N] f32, top_ids [B, P, N] i64
// Attribute num_top (N)
//
// The emitted token at position j is next_tokens[b] when j == num_accepted[b] or j == P-1, else
// max(draft_tokens[b, j], 0). log p = (x - max) - log(sum exp(x - max)), each exp silu.h's exp_fma (2 ulp), the sum
// in float64 (ONNX Runtime's LogSoftmax sums in float32: the two agree within float32 rounding). rank = 1 + the tokens whose log p is
// strictly greater than the emitted one's. top: the N largest log p, descending, a lower id first among
// equals (ONNX TopK's tie rule).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernel.h"
#include "reduce.h"   // max_of
#include "silu.h"     // exp_fma

namespace unispec_cpu {
namespace {

constexpr size_t kInputs = 4, kOutputs = 4;
constexpr int64_t kChunk = 32;       // values the top-N scan rules out at once

struct Position {
  float* logp;                 // [V] scratch: the position's log p
  float* emitted;
  int64_t* rank;
  float* top;                  // [N]
  int64_t* top_ids;            // [N]
};

// One position's outputs from its logits row x [V] and the id it emitted.
void one_position(const float* x, int64_t vocab, int64_t id, int64_t num_top, const Position& out) {
  const float top = max_of(x, vocab);
  float* logp = out.logp;       // e^(x - max) first (one SIMD loop), then log p over it
#pragma omp simd
  for (int64_t v = 0; v < vocab; ++v) logp[v] = exp_fma(x[v] - top);
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < vocab; ++v) sum += static_cast<double>(logp[v]);
  const float shift = static_cast<float>(std::log(sum));
#pragma omp simd
  for (int64_t v = 0; v < vocab; ++v) logp[v] = (x[v] - top) - shift;
  const float chosen = logp[id];
  int64_t above = 0;
#pragma omp simd reduction(+ : above)
  for (int64_t v = 0; v < vocab; ++v) above += logp[v] > chosen ? 1 : 0;
  *out.emitted = chosen;
  *out.rank = above + 1;
  // the N largest by insertion, ids in increasing order (an equal value never passes one already held),
  // a chunk at a time: once N are held, a chunk whose maximum does not beat the N-th is skipped
  int64_t held = 0;
  for (int64_t v0 = 0; v0 < vocab; v0 += kChunk) {
    const int64_t v1 = std::min(vocab, v0 + kChunk);
    if (held == num_top && !(max_of(logp + v0, v1 - v0) > out.top[num_top - 1])) continue;
    for (int64_t v = v0; v < v1; ++v) {
      const float y = logp[v];
      if (held == num_top && !(y > out.top[num_top - 1])) continue;
      int64_t i = held < num_top ? held++ : num_top - 1;
      for (; i > 0 && y > out.top[i - 1]; --i) {
        out.top[i] = out.top[i - 1];
        out.top_ids[i] = out.top_ids[i - 1];
      }
      out.top[i] = y;
      out.top_ids[i] = v;
    }
  }
}

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  const int64_t num_top = *static_cast<const int64_t*>(kernel);
  Tensor t[kInputs];
  for (size_t i = 0; i < kInputs; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  if (t[0].dims.size() != 3 || t[0].dims[1] < 1 || t[0].dims[2] < num_top)
    return fail("TokenLogprobs: logits must be [B, P, V] with P >= 1 and V >= num_top (" +
                std::to_string(num_top) + ")");
  const int64_t batch = t[0].dims[0], positions = t[0].dims[1], vocab = t[0].dims[2];
  if (t[1].dims != std::vector<int64_t>{batch, positions - 1} || t[2].dims != std::vector<int64_t>{batch} ||
      t[3].dims != std::vector<int64_t>{batch})
    return fail("TokenLogprobs: draft_tokens must be [B, P-1] and next_tokens, num_accepted [B], B and P those of "
                "logits [B, P, V]");
  const auto* logits = static_cast<const float*>(t[0].data);
  const auto* drafts = static_cast<const int64_t*>(t[1].data);
  const auto* next = static_cast<const int64_t*>(t[2].data);
  const auto* accepted = static_cast<const int64_t*>(t[3].data);
  void* data[kOutputs] = {};
  RETURN_IF_ERROR(make_output(context, 0, {batch, positions}, &data[0]));
  RETURN_IF_ERROR(make_output(context, 1, {batch, positions}, &data[1]));
  RETURN_IF_ERROR(make_output(context, 2, {batch, positions, num_top}, &data[2]));
  RETURN_IF_ERROR(make_output(context, 3, {batch, positions, num_top}, &data[3]));
  std::vector<float> logp(vocab);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < positions; ++j) {
      const int64_t at = b * positions + j;
      const bool at_next = j == accepted[b] || j == positions - 1;
      const int64_t id = at_next ? next[b] : std::max<int64_t>(drafts[b * (positions - 1) + j], 0);
      if (id < 0 || id >= vocab)
        return fail("TokenLogprobs: emitted token id " + std::to_string(id) + " is outside the vocabulary of " +
                    std::to_string(vocab));
      one_position(logits + at * vocab, vocab, id, num_top,
                   Position{logp.data(), static_cast<float*>(data[0]) + at, static_cast<int64_t*>(data[1]) + at,
                            static_cast<float*>(data[2]) + at * num_top,
                            static_cast<int64_t*>(data[3]) + at * num_top});
    }
  return nullptr;
}

OrtStatus* create(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* num_top = new int64_t(0);
  OrtStatus* status = int_attribute(info, "num_top", num_top);
  if (status == nullptr && *num_top < 1) status = fail("TokenLogprobs: attribute num_top must be >= 1");
  if (status != nullptr) {
    delete num_top;
    return status;
  }
  *kernel = num_top;
  return nullptr;
}

OrtCustomOp make_op() {
  OrtCustomOp op = cpu_op();
  op.GetName = [](const OrtCustomOp*) { return "TokenLogprobs"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return kInputs; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) { return int(i == 0 ? kFloat : kInt64); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return kOutputs; };
  op.GetOutputType = [](const OrtCustomOp*, size_t i) { return int(i % 2 == 0 ? kFloat : kInt64); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<int64_t*>(kernel); };
  return op;
}

OrtCustomOp g_token_logprobs = make_op();

}  // namespace

const OrtCustomOp* token_logprobs_op() { return &g_token_logprobs; }

}  // namespace unispec_cpu
