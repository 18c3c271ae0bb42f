// unispec.cpu::SiluMul: Y[..., N] = silu(X[..., :N]) · X[..., N:] for X [..., 2N] float32, the gate's columns
// first, then the up projection's. A quantized MLP's gate and up run as one com.microsoft::MatMulNBits over the
// two weights concatenated along N (engines/ort/quant.py), and this is its SwiGLU: one node in place of
// Sigmoid, Mul, Mul (or ORT's QuickGelu + Mul), which at a small model's decode step cost a dispatch each.
//
// The SiLU is PackedLinear's swiglu epilogue (silu.h's swiglu, exp_fma's polynomial), so a SwiGLU is
// the same value whichever of the two kernels computes it and wherever its lanes fall.

#include <string>
#include <vector>

#include "kernel.h"
#include "silu.h"

namespace unispec_cpu {
namespace {

OrtStatus* compute_silu_mul(void*, OrtKernelContext* context) {
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  if (x.dims.empty() || x.dims.back() % 2 != 0)
    return fail("SiluMul: input 0's last axis must be even (gate columns, then as many up columns); it is " +
                std::to_string(x.dims.empty() ? 0 : x.dims.back()));
  const int64_t width = x.dims.back(), n = width / 2, rows = width == 0 ? 0 : x.numel() / width;
  std::vector<int64_t> dims = x.dims;
  dims.back() = n;
  void* out = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, dims, &out));
  const float* in = static_cast<const float*>(x.data);
  for (int64_t r = 0; r < rows; ++r)
    swiglu(in + r * width, in + r * width + n, static_cast<float*>(out) + r * n, n);
  return nullptr;
}

OrtCustomOp make_op() {
  OrtCustomOp op = cpu_op();
  op.GetName = [](const OrtCustomOp*) { return "SiluMul"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return size_t(1); };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(1); };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.CreateKernelV2 = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel) -> OrtStatus* {
    *kernel = nullptr;      // stateless
    return nullptr;
  };
  op.KernelComputeV2 = compute_silu_mul;
  op.KernelDestroy = [](void*) {};
  return op;
}

OrtCustomOp g_silu_mul = make_op();

}  // namespace

const OrtCustomOp* silu_mul_op() { return &g_silu_mul; }

}  // namespace unispec_cpu
