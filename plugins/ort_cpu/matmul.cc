// unispec.cpu::PackedLinear: Y[..., N] = X[..., K] · Wᵀ for a constant W [N, K] (nn.Linear's layout, which the
// exported Gemm(transB=1) reads; attribute trans_b = 1), or X · W for W [K, N] (MatMul's; trans_b = 0), with
// W packed once when the session creates the kernel.
//
// With weights W_1 .. W_n (n <= 4; one layout, one K) as inputs 1 .. n it has n outputs, Y_i = X · W_iᵀ: one
// node and one stream of panels for the linears that read the same X (q, k, v), matmul_group.h. Attribute
// swiglu = 1 with two weights of one N (gate, up) gives the one output silu(X · W_1ᵀ) · (X · W_2ᵀ) instead.
// A small model's decode step is dispatch-bound (~1-5 us a node on one core), so the node count is its time.
//
// Why not ONNX Runtime's own Gemm (MLAS): a decode or verify step multiplies a few rows (1 to ~16) by every
// weight of the model, so a step is a stream over the weights. MLAS reads the weight panels in an order
// tuned for many rows; at 8 rows it runs at ~1.9x its 1-row time at the 1.1B shape (2.42 against 1.27 ms
// for [8, 2048] x [2048, 5632], measured here), where the weights' bytes alone would allow ~1.2x. This
// kernel lays W out as panels of 32 output columns, [N/32][K][32], so one panel is one contiguous stream;
// it multiplies up to 8 rows of X with each panel while the panel goes by (16 AVX-512 accumulators), so 8
// rows read the weights once, and the loads of the next lines are issued well ahead.
//
// For more rows (a prefill chunk) the same panels are walked in blocks of kKc values of k that stay in L1
// while every group of 8 rows goes over them.
//
// A weight whose every value is a float16 exactly (a drafter shipped in float16 and exported as float32) is
// packed as float16 and widened as it is loaded: the same products and sums, bit for bit, from half the
// bytes. A step reads a drafter's weights after the target's have pushed them out of L2 (Llama 3 + Eagle3's
// head: 1.3 MB of float32 per draft step), so it is their stream that halves.
//
// The packed copy is made from the initializer ORT hands the kernel at creation
// (KernelInfoGetConstantInput_tensor); ORT maps external weights from the file and this op never asks it
// to copy them; once packed, the original's pages are handed back (release_pages), so a session holds one
// copy of each weight in memory, as with MLAS's own prepacking, and nodes that read the same weight share
// its packed copy.
// Work is split over panels through ORT's intra-op thread pool (KernelContext_ParallelFor); with one
// thread it runs inline.
//
// Without AVX-512 (or AVX2 + FMA) a portable loop gives the same results more slowly; the sums run over k
// in order, one fused multiply-add per term where the CPU has FMA.
//
// The panel layout and the per-ISA register tiles are in matmul_tiles.h, the run of a node's panels in
// matmul_group.h (both included here alone, so the tiles inline into its loops); here: the shared packed
// copies and the op.

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel.h"
#include "matmul_tiles.h"
#include "matmul_group.h"

namespace unispec_cpu {
namespace {

// The packed weights of this process, by the weight they were packed from: nodes that share a weight (a
// drafter's layers run once per draft step) share one packed copy, and so do sessions over the same
// weights file (a speculative artifact's step and target-only graphs: each session maps the file anew, so
// their target weights are equal values at other addresses, found by comparing every value). An entry lives
// while a kernel holds it; the sample of values guards against a weight freed and another one placed at the
// same address.
struct Key {
  const float* data;
  int64_t n, k, trans_b;
  bool same_shape(const Key& o) const { return n == o.n && k == o.k && trans_b == o.trans_b; }
  bool operator==(const Key& o) const { return data == o.data && same_shape(o); }
};
struct Entry {
  Key key;
  std::vector<float> sample;
  std::weak_ptr<const Packed> packed;
};
std::mutex g_cache_mutex;
std::vector<Entry> g_cache;

std::vector<float> sample_of(const float* w, int64_t count) {
  std::vector<float> sample;
  for (int64_t i = 0; i < 16; ++i) sample.push_back(w[i * (count - 1) / 15]);
  return sample;
}

template <typename W>
void fill_panels(const float* w, int64_t n, int64_t k, bool trans_b, Packed* packed) {
  uint16_t h = 0;
  for (int64_t p = 0; p < packed->panels; ++p) {
    W* panel = static_cast<W*>(packed->data) + p * k * kPanel;
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t col = p * kPanel + j;
        const float v = weight_at(w, n, k, trans_b, col, kk);
        if constexpr (std::is_same_v<W, float>) {
          panel[kk * kPanel + j] = v;
        } else {
          float_to_half_exactly(v, &h);                  // exact: all_half checked every value
          panel[kk * kPanel + j] = h;
        }
      }
      for (int64_t j = cols; j < kPanel; ++j) panel[kk * kPanel + j] = W(0);
    }
  }
}

std::shared_ptr<const Packed> pack(const float* w, int64_t n, int64_t k, bool trans_b, OrtStatus** status) {
  auto packed = std::make_shared<Packed>();
  packed->n = n;
  packed->k = k;
  packed->panels = (n + kPanel - 1) / kPanel;
  packed->half = all_half(w, n * k);
  packed->data = std::aligned_alloc(64, (packed->bytes() + 63) / 64 * 64);
  if (packed->data == nullptr) {
    *status = fail("PackedLinear: out of memory packing a [" + std::to_string(n) + ", " + std::to_string(k) +
                   "] weight");
    return nullptr;
  }
  if (packed->half)
    fill_panels<uint16_t>(w, n, k, trans_b, packed.get());
  else
    fill_panels<float>(w, n, k, trans_b, packed.get());
  return packed;
}

// Whether `packed` holds exactly the values of w (bit for bit; both packings are exact).
template <typename W>
bool holds(const Packed& packed, const float* w, bool trans_b) {
  const int64_t n = packed.n, k = packed.k;
  for (int64_t col = 0; col < n; ++col) {
    const W* panel = packed.panel<W>(col / kPanel) + col % kPanel;
    for (int64_t kk = 0; kk < k; ++kk) {
      const float held = widen(panel[kk * kPanel]), given = weight_at(w, n, k, trans_b, col, kk);
      if (std::memcmp(&held, &given, sizeof(float)) != 0) return false;
    }
  }
  return true;
}

std::shared_ptr<const Packed> shared_pack(const float* w, int64_t n, int64_t k, bool trans_b, OrtStatus** status) {
  const Key key{w, n, k, trans_b};
  std::vector<float> sample = sample_of(w, n * k);
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  g_cache.erase(std::remove_if(g_cache.begin(), g_cache.end(), [](const Entry& e) { return e.packed.expired(); }),
                g_cache.end());
  for (const Entry& e : g_cache)
    if (e.key == key && e.sample == sample)
      if (auto packed = e.packed.lock()) return packed;
  for (const Entry& e : g_cache)
    if (e.key.same_shape(key) && e.sample == sample)
      if (auto packed = e.packed.lock())
        if (packed->half ? holds<uint16_t>(*packed, w, trans_b) : holds<float>(*packed, w, trans_b)) return packed;
  std::shared_ptr<const Packed> packed = pack(w, n, k, trans_b, status);
  if (packed) g_cache.push_back({key, std::move(sample), packed});
  return packed;
}

constexpr size_t kMaxWeights = 4;

struct Kernel {
  std::vector<std::shared_ptr<const Packed>> w;     // inputs 1 .. n, one K
  bool swiglu = false;
};

// The kernel never reads the original weight again (ORT hands it in at every run, unread), so once it is
// packed its pages are given back: MADV_PAGEOUT reclaims them without changing what the memory holds (a
// page of ORT's mapping of the weights file is read back from the file if anything else reads it, say a
// tied embedding's Gather). Without this, packing reads the whole mapped file into the process and the
// session holds each weight twice in resident memory. Where the kernel has no MADV_PAGEOUT (Linux < 5.4)
// the hint is refused and nothing changes.
void release_pages(const void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_PAGEOUT)
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_PAGEOUT);
#else
  (void)data;
  (void)bytes;
#endif
}

// Packs input `index`'s weight into *packed; *present false when the node has no input there (or not a
// constant one: compute tells those apart).
OrtStatus* pack_input(const OrtKernelInfo* info, size_t index, int64_t trans_b, std::shared_ptr<const Packed>* packed,
                      bool* present) {
  int is_constant = 0;
  const OrtValue* value = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(
      g_api, KernelInfoGetConstantInput_tensor)(info, index, &is_constant, &value));
  *present = is_constant && value != nullptr;
  if (!*present) return nullptr;
  Tensor weight;
  RETURN_IF_ERROR(read_tensor(value, &weight));
  if (weight.dims.size() != 2 || weight.dims[0] <= 0 || weight.dims[1] <= 0)
    return fail("PackedLinear: each weight must be a matrix with no empty axis");
  const int64_t n = trans_b ? weight.dims[0] : weight.dims[1], k = trans_b ? weight.dims[1] : weight.dims[0];
  OrtStatus* status = nullptr;
  *packed = shared_pack(static_cast<const float*>(weight.data), n, k, trans_b != 0, &status);
  if (!*packed) return status;
  release_pages(weight.data, sizeof(float) * n * k);
  return nullptr;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  int64_t trans_b = 1, swiglu = 0;
  RETURN_IF_ERROR(int_attribute(info, "trans_b", &trans_b));
  if (!optional_attribute(int_attribute, info, "swiglu", &swiglu)) swiglu = 0;    // absent: plain outputs
  auto made = std::make_unique<Kernel>();
  made->swiglu = swiglu != 0;
  for (size_t index = 1; index <= kMaxWeights; ++index) {
    std::shared_ptr<const Packed> packed;
    bool present = false;
    RETURN_IF_ERROR(pack_input(info, index, trans_b, &packed, &present));
    if (!present) break;
    if (!made->w.empty() && packed->k != made->w[0]->k)
      return fail("PackedLinear: weight " + std::to_string(index) + "'s K is " + std::to_string(packed->k) +
                  ", weight 1's is " + std::to_string(made->w[0]->k) + "; group only weights of one K");
    made->w.push_back(std::move(packed));
  }
  if (made->w.empty())
    return fail("PackedLinear: the weight (input 1) must be a constant initializer; use Gemm for a computed one");
  if (made->swiglu && (made->w.size() != 2 || made->w[0]->n != made->w[1]->n))
    return fail("PackedLinear: swiglu = 1 takes two weights of one N (gate, up)");
  *kernel = made.release();
  return nullptr;
}

// Output `index` allocated with `dims`, or an error naming it when the node does not have it.
OrtStatus* output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& dims, float** data) {
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
      g_api, KernelContext_GetOutput)(context, index, dims.data(), dims.size(), &out));
  if (out == nullptr)
    return fail("PackedLinear: give the node one output per weight (output " + std::to_string(index) + " missing)");
  return call<OrtStatus* (*)(OrtValue*, void**)>(g_api, GetTensorMutableData)(out, reinterpret_cast<void**>(data));
}

// Where each weight's columns go: the node's outputs, or for swiglu the two halves of `scratch`.
OrtStatus* outputs(const Kernel& kernel, OrtKernelContext* context, std::vector<int64_t> dims, int64_t rows,
                   std::vector<float>* scratch, float** ys) {
  for (size_t i = 0; i < kernel.w.size(); ++i) {
    dims.back() = kernel.w[i]->n;
    if (kernel.swiglu) {
      ys[i] = scratch->data() + i * rows * kernel.w[0]->n;
      if (i == 0) RETURN_IF_ERROR(output(context, 0, dims, &ys[2]));
    } else {
      RETURN_IF_ERROR(output(context, i, dims, &ys[i]));
    }
  }
  return nullptr;
}

OrtStatus* compute(void* kernel_data, OrtKernelContext* context) {
  const Kernel& kernel = *static_cast<const Kernel*>(kernel_data);
  const int64_t k = kernel.w[0]->k;
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  if (x.dims.empty() || x.dims.back() != k)
    return fail("PackedLinear: input 0's last axis is " + std::to_string(x.dims.empty() ? 0 : x.dims.back()) +
                ", the weight's K is " + std::to_string(k));
  if (kernel.w.size() < kMaxWeights) {         // a weight past the packed ones was not a constant
    const OrtValue* extra = nullptr;
    RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(
        g_api, KernelContext_GetInput)(context, kernel.w.size() + 1, &extra));
    if (extra != nullptr) return fail("PackedLinear: every weight (inputs 1..4) must be a constant initializer");
  }
  const int64_t rows = x.numel() / k;
  thread_local std::vector<float> scratch;     // swiglu's gate and up, [2][rows, N]
  thread_local std::vector<Slot> slots;
  if (kernel.swiglu) scratch.resize(2 * rows * kernel.w[0]->n);
  float* ys[kMaxWeights] = {};
  RETURN_IF_ERROR(outputs(kernel, context, x.dims, rows, &scratch, ys));
  if (rows == 0) return nullptr;
  slots.clear();
  for (size_t i = 0; i < kernel.w.size(); ++i) {
    const Packed& w = *kernel.w[i];
    for (int64_t p = 0; p < w.panels; ++p)
      slots.push_back({w.half ? static_cast<const void*>(w.panel<uint16_t>(p)) : w.panel<float>(p), ys[i] + p * kPanel,
                       w.n, std::min(kPanel, w.n - p * kPanel), w.half});
  }
  // tasks of at least ~256K multiply-adds each, so a thread pool's dispatch stays small beside the work
  const int64_t wide = panels_at_once(rows);    // whole groups of panels per task
  const int64_t per_task = (std::max<int64_t>(1, (int64_t(1) << 18) / (rows * k * kPanel)) + wide - 1) / wide * wide;
  const int64_t num_slots = static_cast<int64_t>(slots.size()), tasks = (num_slots + per_task - 1) / per_task;
  Job job{slots.data(), static_cast<const float*>(x.data), num_slots, rows, k, per_task};
  if (tasks == 1)
    run_task(&job, 0);
  else
    RETURN_IF_ERROR((call<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
        g_api, KernelContext_ParallelFor)(context, run_task, static_cast<size_t>(tasks), 0, &job)));
  if (kernel.swiglu) swiglu(ys[0], ys[1], ys[2], rows * kernel.w[0]->n);
  return nullptr;
}

OrtCustomOp make_op() {
  OrtCustomOp op = cpu_op();
  op.GetName = [](const OrtCustomOp*) { return "PackedLinear"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return size_t(1 + kMaxWeights); };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t index) { return index <= 1 ? 0 : 1; };  // 1: optional
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return kMaxWeights; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t index) { return index == 0 ? 0 : 1; };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  return op;
}

OrtCustomOp g_packed_linear = make_op();

}  // namespace

const OrtCustomOp* packed_linear_op() { return &g_packed_linear; }

}  // namespace unispec_cpu

// Bytes held by this process's packed weights (each shared copy once): what a session's PackedLinear nodes
// keep resident beside the weights file, for tests and memory reports (plugins/ort_cpu/__init__.py).
extern "C" __attribute__((visibility("default"))) int64_t unispec_packed_linear_bytes() {
  using namespace unispec_cpu;
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  int64_t bytes = 0;
  for (const Entry& e : g_cache)
    if (auto packed = e.packed.lock()) bytes += static_cast<int64_t>(packed->bytes());
  return bytes;
}
