// The slice of ONNX Runtime's C ABI that unispec's CPU kernels use, declared here by unispec.
//
// Why not ORT's own header: no package on the registries this project installs from ships
// onnxruntime_c_api.h (the onnxruntime wheel carries only the shared library). The C ABI is stable by
// design: `OrtApi` is a table of function pointers that only ever grows at its end, so a function's slot
// never moves. We read the table as an array and name the slots we use. The slot numbers were counted
// from ORT's header (API version 29) and are checked against the installed library by
// tests/plugins/test_ort_cpu.py (it calls slots 0, 1, 2 and 254 through ctypes and compares the answers).
//
// `OrtCustomOp` is the struct a library hands to ORT to describe an op: fields in ABI order, up to the
// ones version 16 reads (ORT reads no field newer than the version it is given).

#pragma once
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

namespace ort_abi {

constexpr uint32_t kApiVersion = 17;        // the oldest table with everything below (ORT >= 1.17)
constexpr uint32_t kCustomOpVersion = 16;   // CreateKernelV2 / KernelComputeV2 report errors as statuses

enum ElementType : int { kFloat = 1, kInt32 = 6, kInt64 = 7, kBool = 9 };
enum ErrorCode : int { kInvalidArgument = 2 };

enum Slot : size_t {
  CreateStatus = 0,
  CreateCustomOpDomain = 26,
  CustomOpDomain_Add = 27,
  AddCustomOpDomain = 28,
  GetTensorMutableData = 51,
  GetDimensionsCount = 61,
  GetDimensions = 62,
  GetTensorTypeAndShape = 65,
  KernelInfoGetAttribute_float = 85,
  KernelInfoGetAttribute_int64 = 86,
  KernelContext_GetInput = 90,
  KernelContext_GetOutput = 91,
  ReleaseStatus = 93,                       // unused by the kernel; tests/plugins/test_ort_cpu.py calls it
  ReleaseTensorTypeAndShapeInfo = 99,
  KernelInfoGetConstantInput_tensor = 249,
  GetBuildInfoString = 254,                 // unused by the kernels; tests/plugins/test_ort_cpu.py calls it
  KernelContext_ParallelFor = 274,
};

// The function in `slot` of the table, typed as F.
template <typename F>
F call(const OrtApi* api, Slot slot) {
  return reinterpret_cast<F>(reinterpret_cast<void* const*>(api)[slot]);
}

}  // namespace ort_abi
