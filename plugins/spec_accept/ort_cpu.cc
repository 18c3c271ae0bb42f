// unispec.cpu::SpecAccept and unispec.cpu::SampleDraft, ONNX Runtime CPU kernels for the speculative math of
// plugins/spec_accept (the torch reference is the definition; these follow it step for step):
//
// SpecAccept: the verdict of acceptance.verify. Same inputs, outputs and attributes as the unispec::SpecAccept
//   node (plugins/spec_accept/onnx.py), all ten inputs present (the step graphs always feed the bitmask and
//   the draft distributions):
//     logits [B, K+1, V] f32, draft_tokens [B, K] i64, temperature / top_p / min_p [B] f32, top_k [B] i64,
//     noise [B, K+1, C] f32, in_thinking_phase [B] bool, token_bitmask [B, K+1, W] i32, draft_probs [B, K, V]
//     f32 ([B, 0, V] when K = 0)  ->  num_accepted [B] i64, next_tokens [B] i64
//   attributes num_drafts, relaxed_top_n (ints), relaxed_delta (float).
// SampleDraft: spec_glue.propose's draft choice (acceptance.choose_drafts: sample_draft behind "does any row
//   sample"):
//     logits [B, P, V] f32 (the drafter's, in the target vocabulary), argmax [B, P] i64 (the drafter's own
//     argmax, mapped to target ids), temperature [B] f32, top_k [B] i64, top_p / min_p [B] f32,
//     uniform [B, P] f32  ->  tokens [B, P] i64, q [B, P, V] f32 (q truncated like the target's)
//
// What the decomposition in the graph costs and this does not: the sampled verdict is ~150 ONNX nodes in
// Ifs (softmax, TopK of 256 candidates, cumsums, gathers, in float64 over [B, K+1, V]) and each sampled draft
// step ~30 more; at the bundled models' sizes every node costs about a microsecond whatever its work.
// Here a row is done in one pass per verified position, and positions after the first rejection (whose
// verdict cannot change the outputs) are skipped.
//
// The truncation math both ops share, and what is exact in it, is in ort_cpu_truncation.h (included
// here alone: one translation unit).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernel.h"
#include "ort_cpu_truncation.h"

namespace unispec_cpu {
namespace {

// kNoiseTarget / kNoiseResidual, the channels read here, come from the generated unispec_constants.h
constexpr int64_t kNoiseChannelsRead = std::max(kNoiseTarget, kNoiseResidual) + 1;
constexpr size_t kSpecInputs = 10, kDraftInputs = 7;

struct SpecAttributes {
  int64_t num_drafts = 0, relaxed_top_n = 0;
  float relaxed_delta = 0.0f;
};

// acceptance.relaxed_verdict at one position.
bool relaxed(const float* logits, int64_t n, int64_t draft, const SpecAttributes& a, Scratch& s) {
  s.probs.resize(n);
  const double p_top = softmax(logits, n, 1.0, s.probs.data());
  int64_t num_above = 0;
  for (int64_t i = 0; i < n; ++i) num_above += logits[i] > logits[draft];
  return num_above < a.relaxed_top_n && s.probs[draft] >= p_top - static_cast<double>(a.relaxed_delta) &&
         logits[draft] > -std::numeric_limits<float>::infinity();
}

// acceptance.rejection_verdict at one position: accepted, and the recovered token when not. q is the draft's
// distribution renormalized in float64, or onehot(draft) for a draft q cannot have produced (q(d) = 0): a
// deterministic draft. The residual is only formed on a rejection.
bool rejection(const double* target, const float* draft_q, int64_t n, int64_t draft, float coin, float residual_u,
               Scratch& s, int64_t* recovered) {
  const bool from_q = draft_q[draft] > 0;
  double total = 0.0;
  if (from_q) {
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) total += static_cast<double>(draft_q[i]);
  }
  const auto q = [&](int64_t i) {
    return from_q ? static_cast<double>(draft_q[i]) / total : i == draft ? 1.0 : 0.0;
  };
  if (static_cast<double>(coin) * q(draft) < target[draft]) return true;
  s.residual.resize(n);
  double mass = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    s.residual[i] = std::max(target[i] - q(i), 0.0);
    mass += s.residual[i];
  }
  *recovered = sample_inverse_cdf(mass > 0 ? s.residual.data() : target, n, residual_u);
  return false;
}

OrtStatus* spec_accept(void* kernel, OrtKernelContext* context) {
  const SpecAttributes& a = *static_cast<const SpecAttributes*>(kernel);
  Tensor t[kSpecInputs];
  for (size_t i = 0; i < kSpecInputs; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  static const size_t ranks[kSpecInputs] = {3, 2, 1, 1, 1, 1, 3, 1, 3, 3};
  for (size_t i = 0; i < kSpecInputs; ++i)
    if (t[i].dims.size() != ranks[i])
      return fail("SpecAccept: input " + std::to_string(i) + " has rank " + std::to_string(t[i].dims.size()) +
                  ", expected " + std::to_string(ranks[i]));
  const int64_t batch = t[0].dims[0], positions = t[0].dims[1], vocab = t[0].dims[2], k = positions - 1;
  const int64_t channels = t[6].dims[2], words = t[8].dims[2];
  if (k != a.num_drafts || t[1].dims[0] != batch || t[1].dims[1] != k)
    return fail("SpecAccept: logits must be [B, num_drafts + 1, V] and draft_tokens [B, num_drafts]");
  for (size_t i : {2, 3, 4, 5, 7})
    if (t[i].dims[0] != batch) return fail("SpecAccept: every per-row parameter needs B entries");
  if (t[6].dims[0] != batch || t[6].dims[1] != positions || channels < kNoiseChannelsRead)
    return fail("SpecAccept: noise must be [B, num_drafts + 1, C] with C >= " + std::to_string(kNoiseChannelsRead));
  if (t[8].dims[0] != batch || t[8].dims[1] != positions || words * 32 < vocab)
    return fail("SpecAccept: token_bitmask must be [B, num_drafts + 1, >= ceil(V / 32)]");
  if (t[9].dims[0] != batch || t[9].dims[1] != k || (k > 0 && t[9].dims[2] != vocab))
    return fail("SpecAccept: draft_probs must be [B, num_drafts, V]");
  const auto* logits = static_cast<const float*>(t[0].data);
  const auto* drafts = static_cast<const int64_t*>(t[1].data);
  const auto* noise = static_cast<const float*>(t[6].data);
  const auto* thinking = static_cast<const bool*>(t[7].data);
  const auto* bitmask = static_cast<const int32_t*>(t[8].data);
  const auto* draft_probs = static_cast<const float*>(t[9].data);
  for (int64_t i = 0; i < batch * k; ++i)
    if (drafts[i] >= vocab) return fail("SpecAccept: a draft token outside the vocabulary");
  void *accepted_data = nullptr, *next_data = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {batch}, &accepted_data));
  RETURN_IF_ERROR(make_output(context, 1, {batch}, &next_data));
  auto* num_accepted = static_cast<int64_t*>(accepted_data);
  auto* next_tokens = static_cast<int64_t*>(next_data);

  Scratch s;
  std::vector<double> target;          // the truncated target distribution: sampled rows only
  s.masked.resize(vocab);
  for (int64_t b = 0; b < batch; ++b) {
    const RowParams r{static_cast<const float*>(t[2].data)[b], static_cast<const float*>(t[4].data)[b],
                      static_cast<const float*>(t[5].data)[b], static_cast<const int64_t*>(t[3].data)[b]};
    const bool greedy = is_greedy(r.temperature), relaxes = thinking[b] && !greedy && k > 0;
    int64_t i = 0, next = 0;
    for (;; ++i) {                  // position i: verify draft i (i < K), or the bonus (i = K); stop at a rejection
      const int64_t at = b * positions + i;
      const float* masked = apply_bitmask(logits + at * vocab, bitmask + at * words, vocab, s.masked.data());
      const float* u = noise + at * channels;
      const int64_t draft = i < k ? drafts[b * k + i] : -1;     // -1: the bonus, or a slot without a draft
      int64_t token = 0;
      bool accepted = false;
      if (greedy) {
        token = argmax(masked, vocab);
        accepted = draft == token;
      } else {
        target.resize(vocab);
        truncate(masked, vocab, r, s, target.data());
        if (draft < 0)              // plain decoding: the token is y_i, sampled from the truncated target
          token = sample_inverse_cdf(target.data(), vocab, u[kNoiseTarget]);
        else                        // y_i is not needed: accepted, the draft stands; rejected, the residual's
          accepted = rejection(target.data(), draft_probs + (b * k + i) * vocab, vocab, draft, u[kNoiseTarget],
                               u[kNoiseResidual], s, &token);
        if (relaxes && draft >= 0 && !accepted) accepted = relaxed(masked, vocab, draft, a, s);
      }
      accepted = accepted && draft >= 0 && masked[draft] > -std::numeric_limits<float>::infinity();
      if (!accepted) {
        next = token;
        break;
      }
    }
    num_accepted[b] = i;
    next_tokens[b] = next;
  }
  return nullptr;
}

OrtStatus* sample_draft(void*, OrtKernelContext* context) {
  Tensor t[kDraftInputs];
  for (size_t i = 0; i < kDraftInputs; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  static const size_t ranks[kDraftInputs] = {3, 2, 1, 1, 1, 1, 2};
  for (size_t i = 0; i < kDraftInputs; ++i)
    if (t[i].dims.size() != ranks[i])
      return fail("SampleDraft: expects logits [B, P, V], argmax [B, P], temperature / top_k / top_p / min_p [B] "
                  "and uniform [B, P]");
  const int64_t batch = t[0].dims[0], positions = t[0].dims[1], vocab = t[0].dims[2];
  bool shaped = t[1].dims == std::vector<int64_t>{batch, positions} && t[6].dims == t[1].dims;
  for (size_t i = 2; i < 6; ++i) shaped = shaped && t[i].dims[0] == batch;
  if (!shaped)
    return fail("SampleDraft: argmax and uniform must be [B, P] and the sampling parameters [B], B and P those "
                "of logits");
  const auto* logits = static_cast<const float*>(t[0].data);
  const auto* argmax_in = static_cast<const int64_t*>(t[1].data);
  const auto* temperature = static_cast<const float*>(t[2].data);
  const auto* top_k = static_cast<const int64_t*>(t[3].data);
  const auto* top_p = static_cast<const float*>(t[4].data);
  const auto* min_p = static_cast<const float*>(t[5].data);
  const auto* uniform = static_cast<const float*>(t[6].data);
  void *token_data = nullptr, *q_data = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {batch, positions}, &token_data));
  RETURN_IF_ERROR(make_output(context, 1, {batch, positions, vocab}, &q_data));
  auto* tokens = static_cast<int64_t*>(token_data);
  auto* q = static_cast<float*>(q_data);
  std::fill(q, q + batch * positions * vocab, 0.0f);
  const bool some_sampled = std::any_of(temperature, temperature + batch, [](float x) { return !is_greedy(x); });
  Scratch s;
  s.probs.resize(vocab);
  for (int64_t at = 0; at < batch * positions; ++at) {
    const int64_t b = at / positions;
    const float* row = logits + at * vocab;
    float* row_q = q + at * vocab;
    if (!some_sampled) {            // every row greedy: the argmax, and q of zeros (propose's all_greedy)
      tokens[at] = argmax_in[at];
      continue;
    }
    if (is_greedy(temperature[b])) {  // q = onehot of the row's own argmax: a deterministic draft
      tokens[at] = argmax_in[at];
      row_q[argmax(row, vocab)] = 1.0f;
      continue;
    }
    truncate(row, vocab, RowParams{temperature[b], top_p[b], min_p[b], top_k[b]}, s, s.probs.data());
    for (int64_t i = 0; i < vocab; ++i) row_q[i] = static_cast<float>(s.probs[i]);
    tokens[at] = sample_inverse_cdf(row_q, vocab, uniform[at]);   // from q as carried (rounded to float32)
  }
  return nullptr;
}

OrtStatus* create_spec_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* a = new SpecAttributes;
  OrtStatus* status = int_attribute(info, "num_drafts", &a->num_drafts);
  if (status == nullptr) status = int_attribute(info, "relaxed_top_n", &a->relaxed_top_n);
  if (status == nullptr) status = float_attribute(info, "relaxed_delta", &a->relaxed_delta);
  if (status != nullptr) {
    delete a;
    return status;
  }
  *kernel = a;
  return nullptr;
}

OrtCustomOp make_op(bool spec) {
  OrtCustomOp op = cpu_op();
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(2); };
  if (spec) {
    op.GetName = [](const OrtCustomOp*) { return "SpecAccept"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kSpecInputs; };
    op.GetInputType = [](const OrtCustomOp*, size_t i) {
      static const int types[kSpecInputs] = {kFloat, kInt64, kFloat, kInt64, kFloat, kFloat, kFloat, kBool, kInt32,
                                             kFloat};
      return types[i];
    };
    op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kInt64); };
    op.CreateKernelV2 = create_spec_kernel;
    op.KernelComputeV2 = spec_accept;
    op.KernelDestroy = [](void* kernel) { delete static_cast<SpecAttributes*>(kernel); };
  } else {
    op.GetName = [](const OrtCustomOp*) { return "SampleDraft"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kDraftInputs; };
    op.GetInputType = [](const OrtCustomOp*, size_t i) { return int(i == 1 || i == 3 ? kInt64 : kFloat); };
    op.GetOutputType = [](const OrtCustomOp*, size_t i) { return int(i == 0 ? kInt64 : kFloat); };
    op.CreateKernelV2 = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel) -> OrtStatus* {
      *kernel = nullptr;
      return nullptr;
    };
    op.KernelComputeV2 = sample_draft;
    op.KernelDestroy = [](void*) {};
  }
  return op;
}

OrtCustomOp g_spec_accept = make_op(true);
OrtCustomOp g_sample_draft = make_op(false);

}  // namespace

const OrtCustomOp* spec_accept_op() { return &g_spec_accept; }
const OrtCustomOp* sample_draft_op() { return &g_sample_draft; }

}  // namespace unispec_cpu
