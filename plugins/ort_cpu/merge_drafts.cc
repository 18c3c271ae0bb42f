// unispec.cpu::MergeDrafts: a speculative step's merge of each row's new tokens with its drafts
// (plugins/spec_accept/ragged.py merge_drafts and merge_positions) in one node.
//
// Exported, the merge is ~35 small index nodes (Range, Slice, GreaterOrEqual, Cast, ReduceSum, GatherND, Where,
// Concat, ...) over a few hundred integers: each costs ONNX Runtime's dispatch, about a microsecond, far more
// than its arithmetic. Here it is one loop per merged slot, computing what the nodes compute:
//
// Inputs   tokens [S] i64, row_offsets [B+1] i64, positions [S] i64, draft_tokens [B, K] i64 (-1: none)
// Outputs  merged_tokens [M] i64, merged_positions [M] i64, merged_offsets [B+1] i64, row_ids [M] i64,
//          M = S + B*K
// Attributes num_drafts (K, the exported constant), placeholder (the token a missing draft -1 becomes)
//
// merged_offsets[b] = row_offsets[b] + b*K. Slot m belongs to row r = #{b : m >= merged_offsets[b+1]} (row_ids_of),
// at local = m - merged_offsets[r]; with n = row_offsets[r+1] - row_offsets[r] it reads token row_offsets[r] + local
// when local < n, else draft j = local - n of row r, at position positions[row_offsets[r+1] - 1] + 1 + j.
// An index outside its tensor (offsets that are not a ragged layout of S tokens) fails, as GatherND does.

#include <cstdint>
#include <string>
#include <vector>

#include "kernel.h"

namespace unispec_cpu {
namespace {

constexpr size_t kInputs = 4, kOutputs = 4;

struct Attributes {
  int64_t num_drafts = 0;
  int64_t placeholder = 0;
};

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  const Attributes& a = *static_cast<const Attributes*>(kernel);
  Tensor t[kInputs];
  for (size_t i = 0; i < kInputs; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  const int64_t num_tokens = t[0].numel(), num_rows = t[1].numel() - 1, k = a.num_drafts;
  if (t[0].dims.size() != 1 || t[1].dims.size() != 1 || num_rows < 0 || t[2].dims != t[0].dims ||
      t[3].dims != std::vector<int64_t>{num_rows, k})
    return fail("MergeDrafts: tokens and positions must be [S], row_offsets [B+1] and draft_tokens [B, " +
                std::to_string(k) + "]");
  const auto* tokens = static_cast<const int64_t*>(t[0].data);
  const auto* offsets = static_cast<const int64_t*>(t[1].data);
  const auto* positions = static_cast<const int64_t*>(t[2].data);
  const auto* drafts = static_cast<const int64_t*>(t[3].data);
  const int64_t merged = num_tokens + num_rows * k;
  int64_t* out[kOutputs] = {};
  const std::vector<int64_t> dims[kOutputs] = {{merged}, {merged}, {num_rows + 1}, {merged}};
  for (size_t i = 0; i < kOutputs; ++i)
    RETURN_IF_ERROR(make_output(context, i, dims[i], reinterpret_cast<void**>(&out[i])));
  for (int64_t b = 0; b <= num_rows; ++b) out[2][b] = offsets[b] + b * k;
  for (int64_t m = 0; m < merged; ++m) {
    int64_t row = 0;
    for (int64_t b = 1; b <= num_rows; ++b) row += m >= out[2][b] ? 1 : 0;
    if (row >= num_rows) return fail("MergeDrafts: row_offsets do not lay out the " + std::to_string(num_tokens) +
                                     " tokens in rows (slot " + std::to_string(m) + " is past the last row)");
    const int64_t local = m - out[2][row], length = offsets[row + 1] - offsets[row];
    const int64_t source = local < length ? offsets[row] + local : num_tokens + row * k + local - length;
    int64_t last = offsets[row + 1] - 1;
    if (last < 0) last += num_tokens;      // GatherND's negative index: a first row without tokens
    if (source < 0 || source >= merged || last < 0 || last >= num_tokens)
      return fail("MergeDrafts: row_offsets do not lay out the " + std::to_string(num_tokens) + " tokens in rows");
    out[3][m] = row;
    if (source < num_tokens) {
      out[0][m] = tokens[source];
      out[1][m] = positions[source];
    } else {
      const int64_t draft = source - num_tokens, j = draft % k;      // k >= 1 here: draft slots exist
      out[0][m] = drafts[draft] >= 0 ? drafts[draft] : a.placeholder;
      out[1][m] = positions[last] + 1 + j;
    }
  }
  return nullptr;
}

OrtStatus* create(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* a = new Attributes;
  OrtStatus* status = int_attribute(info, "num_drafts", &a->num_drafts);
  if (status == nullptr) status = int_attribute(info, "placeholder", &a->placeholder);
  if (status == nullptr && a->num_drafts < 1) status = fail("MergeDrafts: attribute num_drafts must be >= 1");
  if (status != nullptr) {
    delete a;
    return status;
  }
  *kernel = a;
  return nullptr;
}

OrtCustomOp make_op() {
  OrtCustomOp op = cpu_op();
  op.GetName = [](const OrtCustomOp*) { return "MergeDrafts"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return kInputs; };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return int(kInt64); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return kOutputs; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kInt64); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Attributes*>(kernel); };
  return op;
}

OrtCustomOp g_merge_drafts = make_op();

}  // namespace

const OrtCustomOp* merge_drafts_op() { return &g_merge_drafts; }

}  // namespace unispec_cpu
