// The slice of ONNX Runtime's C ABI that unispec's CPU kernels use, declared here by unispec.
//
// Why not ORT's own header: no package on the registries this project installs from ships
// onnxruntime_c_api.h (the onnxruntime wheel carries only the shared library). The C ABI is stable by
// design: `OrtApi` is a table of function pointers that only ever grows at its end, so a function's slot
// never moves, and GetApi(v) serves the table to a caller built for any version v up to the runtime's own.
// We read the table as an array, and name the slots we call in ONE table below: slot, name, and the API
// version that added the function (API version v is ORT 1.v). The library asks for the newest of those
// versions at registration, so an older ORT gets one error naming both versions instead of a call through
// a slot it does not have (kernel.h, bind_api). tests/plugins/test_ort_cpu_abi.py checks every row against
// the installed library: each slot is called (through ctypes, or by a probe op built from kernel.h) with
// arguments whose answer only the named function gives, and each version against ORT's own version sizes.
//
// `OrtCustomOp` is the struct a library hands to ORT to describe an op: fields in ABI order, up to the
// ones version 16 reads (ORT reads no field newer than the version it is given).

#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

extern "C" {
struct OrtApi;                      // opaque: indexed through ort_abi::call below
struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtCustomOpDomain;
struct OrtSessionOptions;
struct OrtShapeInferContext;

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  int (*GetInputType)(const OrtCustomOp* op, size_t index);       // ONNXTensorElementDataType
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);   // 0 = required
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);       // 0 = default (CPU here)
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                               void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
};
}

// Every OrtApi function the library calls: X(slot, name, the API version that added it).
#define UNISPEC_ORT_API_SLOTS(X)                \
  X(0, CreateStatus, 1)                         \
  X(26, CreateCustomOpDomain, 1)                \
  X(27, CustomOpDomain_Add, 1)                  \
  X(28, AddCustomOpDomain, 1)                   \
  X(51, GetTensorMutableData, 1)                \
  X(61, GetDimensionsCount, 1)                  \
  X(62, GetDimensions, 1)                       \
  X(65, GetTensorTypeAndShape, 1)               \
  X(85, KernelInfoGetAttribute_float, 1)        \
  X(86, KernelInfoGetAttribute_int64, 1)        \
  X(90, KernelContext_GetInput, 1)              \
  X(91, KernelContext_GetOutput, 1)             \
  X(93, ReleaseStatus, 1)                       \
  X(99, ReleaseTensorTypeAndShapeInfo, 1)       \
  X(249, KernelInfoGetConstantInput_tensor, 15) \
  X(274, KernelContext_ParallelFor, 17)

namespace ort_abi {

enum Slot : size_t {
#define UNISPEC_ORT_SLOT(slot, name, since) name = slot,
  UNISPEC_ORT_API_SLOTS(UNISPEC_ORT_SLOT)
#undef UNISPEC_ORT_SLOT
};

// The API version to ask GetApi for: the newest function in the table decides.
constexpr uint32_t kApiVersion = std::max({
#define UNISPEC_ORT_SINCE(slot, name, since) uint32_t{since},
    UNISPEC_ORT_API_SLOTS(UNISPEC_ORT_SINCE)
#undef UNISPEC_ORT_SINCE
});
constexpr uint32_t kCustomOpVersion = 16;   // CreateKernelV2 / KernelComputeV2 report errors as statuses

enum ElementType : int { kFloat = 1, kInt32 = 6, kInt64 = 7, kBool = 9 };
enum ErrorCode : int { kFail = 1, kInvalidArgument = 2 };

// The function in `slot` of the table, typed as F.
template <typename F>
F call(const OrtApi* api, Slot slot) {
  return reinterpret_cast<F>(reinterpret_cast<void* const*>(api)[slot]);
}

}  // namespace ort_abi
