// unispec.cpu::PackedLinear: Y[..., N] = X[..., K] · Wᵀ for a constant W [N, K] (nn.Linear's layout, which the
// exported Gemm(transB=1) reads; attribute trans_b = 1), or X · W for W [K, N] (MatMul's; trans_b = 0), with
// W packed once when the session creates the kernel.
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

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernel.h"

namespace unispec_cpu {
namespace {

constexpr int64_t kPanel = 32;      // output columns per panel
constexpr int64_t kKc = 256;        // k values per block when many rows share a panel (32 KiB of panel)
constexpr int64_t kManyRows = 16;   // above this many rows, k is blocked (up to 16 read a panel from L2)

#if defined(__AVX512F__)
constexpr int kMr = 8;              // rows per tile: 8 x 2 zmm accumulators
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMr = 3;              // 3 x 4 ymm accumulators
#else
constexpr int kMr = 4;
#endif

struct Packed {
  int64_t n = 0, k = 0, panels = 0;
  float* data = nullptr;            // [panels][k][kPanel], 64-byte aligned, columns past n are zero

  ~Packed() { std::free(data); }
};

// acc[MR][32] (+)= x[MR rows, k0 .. k0 + kc) · panel[k0 .. k0 + kc), written to y (stride ldy) for the
// first `cols` columns; `first` starts from zero, else from y.
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy, int64_t cols,
                 bool first) {
  alignas(64) float out[MR][kPanel];
  if (!first)
    for (int i = 0; i < MR; ++i) {
      std::memcpy(out[i], y + i * ldy, sizeof(float) * cols);
      std::fill(out[i] + cols, out[i] + kPanel, 0.0f);
    }
#if defined(__AVX512F__)
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? _mm512_setzero_ps() : _mm512_load_ps(out[i]);
    acc[i][1] = first ? _mm512_setzero_ps() : _mm512_load_ps(out[i] + 16);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const float* b = panel + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel + 16), _MM_HINT_T0);
    const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm512_store_ps(out[i], acc[i][0]);
    _mm512_store_ps(out[i] + 16, acc[i][1]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = first ? _mm256_setzero_ps() : _mm256_load_ps(out[i] + 8 * v);
  for (int64_t k = 0; k < kc; ++k) {
    const float* b = panel + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + 16 * kPanel + 16), _MM_HINT_T0);
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8), b2 = _mm256_load_ps(b + 16),
                 b3 = _mm256_load_ps(b + 24);
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(a, b2, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(a, b3, acc[i][3]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) _mm256_store_ps(out[i] + 8 * v, acc[i][v]);
#else
  if (first)
    for (int i = 0; i < MR; ++i) std::fill(out[i], out[i] + kPanel, 0.0f);
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < MR; ++i)
      for (int64_t j = 0; j < kPanel; ++j) out[i][j] = std::fma(x[i * ldx + k], panel[k * kPanel + j], out[i][j]);
#endif
  for (int i = 0; i < MR; ++i) std::memcpy(y + i * ldy, out[i], sizeof(float) * cols);
}

// rows of x (stride ldx) times panel block [k0, k0 + kc) into y, in tiles of up to kMr rows.
void rows_by_block(const float* x, int64_t rows, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy,
                   int64_t cols, bool first) {
  int64_t m = 0;
  for (; m + kMr <= rows; m += kMr) tile<kMr>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first);
  switch (rows - m) {   // the last few rows, one tile of their own size
#if defined(__AVX512F__)
    case 7: tile<7>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first); break;
    case 6: tile<6>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first); break;
    case 5: tile<5>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first); break;
    case 4: tile<4>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first); break;
#endif
#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
    case 3: tile<3>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first); break;
#endif
    case 2: tile<2>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first); break;
    case 1: tile<1>(x + m * ldx, ldx, panel, kc, y + m * ldy, ldy, cols, first); break;
    default: break;
  }
}

#if defined(__AVX512F__)
// A few rows against NP panels at once, all NP of them full, over all of k (few rows are never k-blocked):
// with 1 to 4 rows a one-panel tile has 2 to 8 accumulators, too few to hide the FMA latency, so it runs at
// a fraction of the core's rate on a weight that sits in cache (the bundled models' ~0.1 MB projections);
// NP panels give it 12 to 16.
template <int MR, int NP>
void tile_wide(const float* x, int64_t k_len, const float* panel, float* y, int64_t ldy) {
  const int64_t stride = k_len * kPanel;       // one panel to the next
  __m512 acc[MR][NP][2];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) acc[i][p][h] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 b[NP][2];
    for (int p = 0; p < NP; ++p) {
      const float* row = panel + p * stride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * kPanel + 16), _MM_HINT_T0);
      b[p][0] = _mm512_load_ps(row);
      b[p][1] = _mm512_load_ps(row + 16);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * k_len + k]);
      for (int p = 0; p < NP; ++p) {
        acc[i][p][0] = _mm512_fmadd_ps(a, b[p][0], acc[i][p][0]);
        acc[i][p][1] = _mm512_fmadd_ps(a, b[p][1], acc[i][p][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(y + i * ldy + p * kPanel + 16 * h, acc[i][p][h]);
}
#endif

// How many panels a tile of `rows` rows takes at once.
int64_t panels_at_once(int64_t rows) {
#if defined(__AVX512F__)
  return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1;
#else
  (void)rows;
  return 1;
#endif
}

struct Job {
  const Packed* w;
  const float* x;
  float* y;
  int64_t rows, panels_per_task;
};

// Panels [task · per, (task + 1) · per) for every row.
void run_task(void* data, size_t task) {
  const Job& job = *static_cast<const Job*>(data);
  const Packed& w = *job.w;
  const int64_t first_panel = static_cast<int64_t>(task) * job.panels_per_task;
  const int64_t last_panel = std::min(w.panels, first_panel + job.panels_per_task);
  const int64_t kc = job.rows > kManyRows ? kKc : w.k, wide = panels_at_once(job.rows);
  for (int64_t p = first_panel; p < last_panel;) {
    const float* panel = w.data + p * w.k * kPanel;
#if defined(__AVX512F__)
    if (wide > 1 && p + wide <= last_panel && (p + wide) * kPanel <= w.n) {
      float* y = job.y + p * kPanel;
      switch (job.rows) {
        case 1: tile_wide<1, 8>(job.x, w.k, panel, y, w.n); break;
        case 2: tile_wide<2, 4>(job.x, w.k, panel, y, w.n); break;
        case 3: tile_wide<3, 2>(job.x, w.k, panel, y, w.n); break;
        default: tile_wide<4, 2>(job.x, w.k, panel, y, w.n); break;
      }
      p += wide;
      continue;
    }
#endif
    const int64_t cols = std::min(kPanel, w.n - p * kPanel);
    for (int64_t k0 = 0; k0 < w.k; k0 += kc)
      rows_by_block(job.x + k0, job.rows, w.k, panel + k0 * kPanel, std::min(kc, w.k - k0), job.y + p * kPanel, w.n,
                    cols, k0 == 0);
    ++p;
  }
}

// The packed weights of this process, by the weight they were packed from: nodes that share a weight (a
// drafter's layers run once per draft step) share one packed copy. An entry lives while a kernel holds it;
// the sample of values guards against a weight freed and another one placed at the same address.
struct Key {
  const float* data;
  int64_t n, k, trans_b;
  bool operator==(const Key& o) const { return data == o.data && n == o.n && k == o.k && trans_b == o.trans_b; }
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

std::shared_ptr<const Packed> pack(const float* w, int64_t n, int64_t k, bool trans_b, OrtStatus** status) {
  auto packed = std::make_shared<Packed>();
  packed->n = n;
  packed->k = k;
  packed->panels = (n + kPanel - 1) / kPanel;
  const size_t bytes = sizeof(float) * packed->panels * k * kPanel;
  packed->data = static_cast<float*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
  if (packed->data == nullptr) {
    *status = fail("PackedLinear: out of memory packing a [" + std::to_string(n) + ", " + std::to_string(k) +
                   "] weight");
    return nullptr;
  }
  for (int64_t p = 0; p < packed->panels; ++p) {
    float* panel = packed->data + p * k * kPanel;
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t col = p * kPanel + j;
        panel[kk * kPanel + j] = trans_b ? w[col * k + kk] : w[kk * n + col];
      }
      for (int64_t j = cols; j < kPanel; ++j) panel[kk * kPanel + j] = 0.0f;
    }
  }
  return packed;
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
  std::shared_ptr<const Packed> packed = pack(w, n, k, trans_b, status);
  if (packed) g_cache.push_back({key, std::move(sample), packed});
  return packed;
}

struct Kernel {
  std::shared_ptr<const Packed> w;
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

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  int64_t trans_b = 1;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(
      g_api, KernelInfoGetAttribute_int64)(info, "trans_b", &trans_b));
  int is_constant = 0;
  const OrtValue* value = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(
      g_api, KernelInfoGetConstantInput_tensor)(info, 1, &is_constant, &value));
  if (!is_constant || value == nullptr)
    return fail("PackedLinear: the weight (input 1) must be a constant initializer; use Gemm for a computed one");
  Tensor weight;
  RETURN_IF_ERROR(read_tensor(value, &weight));
  if (weight.dims.size() != 2 || weight.dims[0] <= 0 || weight.dims[1] <= 0)
    return fail("PackedLinear: the weight must be a matrix with no empty axis");
  const int64_t n = trans_b ? weight.dims[0] : weight.dims[1], k = trans_b ? weight.dims[1] : weight.dims[0];
  OrtStatus* status = nullptr;
  auto packed = shared_pack(static_cast<const float*>(weight.data), n, k, trans_b != 0, &status);
  if (!packed) return status;
  release_pages(weight.data, sizeof(float) * n * k);
  *kernel = new Kernel{std::move(packed)};
  return nullptr;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  const Packed& w = *static_cast<const Kernel*>(kernel)->w;
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  if (x.dims.empty() || x.dims.back() != w.k)
    return fail("PackedLinear: input 0's last axis is " + std::to_string(x.dims.empty() ? 0 : x.dims.back()) +
                ", the weight's K is " + std::to_string(w.k));
  std::vector<int64_t> out_dims = x.dims;
  out_dims.back() = w.n;
  void* out = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, out_dims, &out));
  const int64_t rows = x.numel() / w.k;
  if (rows == 0) return nullptr;
  // tasks of at least ~256K multiply-adds each, so a thread pool's dispatch stays small beside the work
  const int64_t per_panel = rows * w.k * kPanel;
  const int64_t wide = panels_at_once(rows);    // whole groups of panels per task
  const int64_t per_task = (std::max<int64_t>(1, (int64_t(1) << 18) / per_panel) + wide - 1) / wide * wide;
  Job job{&w, static_cast<const float*>(x.data), static_cast<float*>(out), rows, per_task};
  const int64_t tasks = (w.panels + per_task - 1) / per_task;
  if (tasks == 1) {
    run_task(&job, 0);
    return nullptr;
  }
  return call<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      g_api, KernelContext_ParallelFor)(context, run_task, static_cast<size_t>(tasks), 0, &job);
}

OrtCustomOp make_op() {
  OrtCustomOp op = cpu_op();
  op.GetName = [](const OrtCustomOp*) { return "PackedLinear"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return size_t(2); };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(1); };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  return op;
}

OrtCustomOp g_packed_linear = make_op();

}  // namespace

const OrtCustomOp* packed_linear_op() { return &g_packed_linear; }

}  // namespace unispec_cpu
