// What unispec's ONNX Runtime CPU kernels share: the ORT table they call through, error statuses, reading
// inputs and allocating outputs, and the ops each source file defines (registered by register.cc).

#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ort_abi.h"

namespace unispec_cpu {

using namespace ort_abi;

inline const OrtApi* g_api = nullptr;       // set once by RegisterCustomOps (bind_api)

// Binds g_api to the runtime's table when it has every slot of ort_abi.h; when the runtime is older, returns
// the one-line error status to hand back instead, made through version 1's CreateStatus (slot 0 of every
// ORT's table), so no slot the runtime lacks is ever called. g_api stays null when even version 1 is refused.
inline OrtStatus* bind_api(const OrtApiBase* base) {
  g_api = base->GetApi(kApiVersion);
  const OrtApi* oldest = g_api != nullptr ? nullptr : base->GetApi(1);
  if (oldest == nullptr) return nullptr;
  const std::string message = "unispec.cpu needs ONNX Runtime's C API version " + std::to_string(kApiVersion) +
                              " (onnxruntime >= 1." + std::to_string(kApiVersion) + "); this onnxruntime is " +
                              base->GetVersionString() + ": upgrade onnxruntime";
  return call<OrtStatus* (*)(int, const char*)>(oldest, CreateStatus)(kFail, message.c_str());
}

inline OrtStatus* fail(const std::string& message) {
  return call<OrtStatus* (*)(int, const char*)>(g_api, CreateStatus)(kInvalidArgument, message.c_str());
}

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    if (OrtStatus* status_ = (expr)) { \
      return status_;                  \
    }                                  \
  } while (0)

struct Tensor {
  std::vector<int64_t> dims;
  void* data = nullptr;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
};

inline OrtStatus* read_tensor(const OrtValue* value, Tensor* out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(
      g_api, GetTensorTypeAndShape)(value, &info));
  size_t rank = 0;
  OrtStatus* status = call<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(
      g_api, GetDimensionsCount)(info, &rank);
  if (status == nullptr) {
    out->dims.resize(rank);
    status = call<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(g_api, GetDimensions)(
        info, out->dims.data(), rank);
  }
  call<void (*)(OrtTensorTypeAndShapeInfo*)>(g_api, ReleaseTensorTypeAndShapeInfo)(info);
  RETURN_IF_ERROR(status);
  return call<OrtStatus* (*)(OrtValue*, void**)>(g_api, GetTensorMutableData)(const_cast<OrtValue*>(value),
                                                                               &out->data);
}

// Input `index` of the node as a Tensor (its dims and data).
inline OrtStatus* read_input(OrtKernelContext* context, size_t index, Tensor* out) {
  const OrtValue* value = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(
      g_api, KernelContext_GetInput)(context, index, &value));
  return read_tensor(value, out);
}

// Output `index` allocated with `dims`; its data pointer in *data.
inline OrtStatus* make_output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& dims,
                              void** data) {
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
      g_api, KernelContext_GetOutput)(context, index, dims.data(), dims.size(), &out));
  return call<OrtStatus* (*)(OrtValue*, void**)>(g_api, GetTensorMutableData)(out, data);
}

// A node's attribute (KernelInfoGetAttribute_int64 / _float); an error status when the node lacks it.
inline OrtStatus* int_attribute(const OrtKernelInfo* info, const char* name, int64_t* out) {
  return call<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(g_api, KernelInfoGetAttribute_int64)(
      info, name, out);
}

inline OrtStatus* float_attribute(const OrtKernelInfo* info, const char* name, float* out) {
  return call<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(g_api, KernelInfoGetAttribute_float)(
      info, name, out);
}

// An optional attribute: whether the node has it (`*out` left alone when not); ORT's error status for an
// absent one is ours to free, and is.
template <typename T>
bool optional_attribute(OrtStatus* (*read)(const OrtKernelInfo*, const char*, T*), const OrtKernelInfo* info,
                        const char* name, T* out) {
  OrtStatus* absent = read(info, name, out);
  if (absent != nullptr) call<void (*)(OrtStatus*)>(g_api, ReleaseStatus)(absent);
  return absent == nullptr;
}

// An op of the CPU provider with the fields every unispec op sets alike; the caller adds its name, types,
// counts and kernel functions.
inline OrtCustomOp cpu_op() {
  OrtCustomOp op{};
  op.version = kCustomOpVersion;
  op.GetExecutionProviderType = [](const OrtCustomOp*) { return "CPUExecutionProvider"; };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  return op;
}

// The ops, one or more per source file.
const OrtCustomOp* paged_attention_op(bool with_rows);   // plugins/paged_attention/ort_cpu.cc
const OrtCustomOp* spec_accept_op();                      // plugins/spec_accept/ort_cpu.cc
const OrtCustomOp* sample_draft_op();                     // plugins/spec_accept/ort_cpu.cc
const OrtCustomOp* packed_linear_op();                    // matmul.cc
const OrtCustomOp* paged_attention_rope_op(bool with_rows);  // plugins/paged_attention/ort_cpu_rope.cc
const OrtCustomOp* silu_mul_op();                         // silu_mul.cc
const OrtCustomOp* token_logprobs_op();                   // token_logprobs.cc
const OrtCustomOp* merge_drafts_op();                     // merge_drafts.cc
const OrtCustomOp* moe_op();                              // plugins/moe/ort_cpu.cc

}  // namespace unispec_cpu
