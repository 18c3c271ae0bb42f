// The library's entry point: ONNX Runtime calls RegisterCustomOps when a session registers the library,
// and every op of domain unispec.cpu is added there.

#include "kernel.h"

using namespace unispec_cpu;

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
  RETURN_IF_ERROR(bind_api(base));           // an ORT older than ort_abi.h's table: one error, nothing called
  if (g_api == nullptr) return nullptr;      // not even API version 1: nothing to report an error with
  // The domain must outlive every session that uses it; ORT does not take it over, so it is never freed.
  OrtCustomOpDomain* domain = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(g_api, CreateCustomOpDomain)(
      "unispec.cpu", &domain));
  for (const OrtCustomOp* op : {paged_attention_op(false), paged_attention_op(true), paged_attention_rope_op(false),
                                paged_attention_rope_op(true), spec_accept_op(), sample_draft_op(),
                                packed_linear_op(), silu_mul_op(), token_logprobs_op(), merge_drafts_op(), moe_op()})
    RETURN_IF_ERROR(call<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(g_api, CustomOpDomain_Add)(domain, op));
  return call<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(g_api, AddCustomOpDomain)(options, domain);
}
