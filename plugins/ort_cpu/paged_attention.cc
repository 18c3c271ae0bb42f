// unispec.cpu::PagedAttentionPool, ONNX Runtime CPU kernel: PagedAttention (the math of
// plugins/paged_attention/reference.py) reading each row's past straight from the paged KV pool.
//
// The exported graph gathers every row's blocks, transposes them layer-major, splits layers and K/V, and
// the reference attention then copies the result once more per query: ~6 copies of the history a step.
// This kernel reads key p of row b where it lives, pool[block_table[b, p / bs], layer, p % bs, column],
// so a step touches the history once per (row, kv head) and copies none of it.
//
// Inputs   q [S, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv]   this step's tokens (RoPE applied), float32
//          kv_pool [num_blocks, L, bs, W] float32         read in place, never written
//          block_table [B, max_blocks], row_offsets [B+1], positions [S], cache_lengths [B]   int64
// Output   [S, Hq, Dv] float32
// Attributes (ints unless said): layer, k_column, v_column (where this layer's K and V start in a pool row),
//          scale (float), causal, sliding_window (0 = full), softcap (float, 0 = none).

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ort_abi.h"

namespace {

using namespace ort_abi;

const OrtApi* g_api = nullptr;
constexpr size_t kNumInputs = 8;

OrtStatus* fail(const std::string& message) {
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
};

OrtStatus* read_tensor(const OrtValue* value, Tensor* out) {
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

struct Attributes {
  int64_t layer = 0, k_column = 0, v_column = 0, causal = 1, sliding_window = 0;
  float scale = 1.0f, softcap = 0.0f;
};

OrtStatus* read_attributes(const OrtKernelInfo* info, Attributes* a) {
  auto get_int = call<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(g_api,
                                                                                 KernelInfoGetAttribute_int64);
  auto get_float = call<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(g_api,
                                                                                 KernelInfoGetAttribute_float);
  RETURN_IF_ERROR(get_int(info, "layer", &a->layer));
  RETURN_IF_ERROR(get_int(info, "k_column", &a->k_column));
  RETURN_IF_ERROR(get_int(info, "v_column", &a->v_column));
  RETURN_IF_ERROR(get_int(info, "causal", &a->causal));
  RETURN_IF_ERROR(get_int(info, "sliding_window", &a->sliding_window));
  RETURN_IF_ERROR(get_float(info, "scale", &a->scale));
  return get_float(info, "softcap", &a->softcap);
}

// One step's geometry and pointers, shared by the (row, kv head) tasks.
struct Step {
  Attributes attr;
  const float *q, *k, *v, *pool;
  const int64_t *table, *offsets, *positions, *lengths;
  float* out;
  int64_t q_heads, kv_heads, head_dim, v_dim, layers, block_size, width, max_blocks;

  const float* pool_row(int64_t row, int64_t p) const {
    const int64_t block = table[row * max_blocks + p / block_size];
    return pool + ((block * layers + attr.layer) * block_size + p % block_size) * width;
  }
};

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// Attention of row `row`'s new tokens, for the query heads of kv head `kv_head`.
void attend(const Step& st, int64_t row, int64_t kv_head) {
  const Attributes& a = st.attr;
  const int64_t t0 = st.offsets[row], t1 = st.offsets[row + 1], past = st.lengths[row];
  const int64_t group = st.q_heads / st.kv_heads, fresh = t1 - t0, keys = past + fresh;
  if (fresh == 0) return;
  const int64_t queries = fresh * group;     // query i = (token t0 + i / group, head kv_head * group + i % group)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> scores(queries * keys), acc(st.v_dim);
  auto query = [&](int64_t i) {
    return st.q + ((t0 + i / group) * st.q_heads + kv_head * group + i % group) * st.head_dim;
  };
  auto visible = [&](int64_t i, int64_t key_position) {
    const int64_t t = st.positions[t0 + i / group];
    return a.sliding_window <= 0 || t - key_position < a.sliding_window;
  };

  for (int64_t p = 0; p < past; ++p) {       // each past key read once, for every query of the group
    const float* key = st.pool_row(row, p) + a.k_column + kv_head * st.head_dim;
    for (int64_t i = 0; i < queries; ++i)
      scores[i * keys + p] = visible(i, p) ? dot(query(i), key, st.head_dim) * a.scale : neg_inf;
  }
  for (int64_t u = 0; u < fresh; ++u) {
    const float* key = st.k + ((t0 + u) * st.kv_heads + kv_head) * st.head_dim;
    const int64_t key_position = st.positions[t0 + u];
    for (int64_t i = 0; i < queries; ++i) {
      const bool ok = (!a.causal || key_position <= st.positions[t0 + i / group]) && visible(i, key_position);
      scores[i * keys + past + u] = ok ? dot(query(i), key, st.head_dim) * a.scale : neg_inf;
    }
  }

  for (int64_t i = 0; i < queries; ++i) {    // softcap, then softmax over every key of query i
    float* s = &scores[i * keys];
    if (a.softcap > 0)
      for (int64_t j = 0; j < keys; ++j)
        if (s[j] != neg_inf) s[j] = std::tanh(s[j] / a.softcap) * a.softcap;   // masked keys stay masked
    float top = neg_inf, total = 0.0f;
    for (int64_t j = 0; j < keys; ++j) top = std::max(top, s[j]);
    for (int64_t j = 0; j < keys; ++j) total += (s[j] = std::exp(s[j] - top));
    for (int64_t j = 0; j < keys; ++j) s[j] /= total;
  }

  for (int64_t i = 0; i < queries; ++i) {
    const float* w = &scores[i * keys];
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t p = 0; p < past; ++p)
      if (w[p] != 0.0f) axpy(w[p], st.pool_row(row, p) + a.v_column + kv_head * st.v_dim, acc.data(), st.v_dim);
    for (int64_t u = 0; u < fresh; ++u)
      if (w[past + u] != 0.0f)
        axpy(w[past + u], st.v + ((t0 + u) * st.kv_heads + kv_head) * st.v_dim, acc.data(), st.v_dim);
    float* out = st.out + ((t0 + i / group) * st.q_heads + kv_head * group + i % group) * st.v_dim;
    std::copy(acc.begin(), acc.end(), out);
  }
}

// Checks the inputs against each other; a bad feed becomes an error status, never a wild read.
OrtStatus* check(const Tensor* t, const Step& st, int64_t tokens, int64_t batch) {
  const int64_t num_blocks = t[3].dims[0];
  if (st.kv_heads <= 0 || st.q_heads % st.kv_heads != 0 || t[1].dims[0] != tokens || t[2].dims[0] != tokens ||
      t[1].dims[2] != st.head_dim || t[2].dims[1] != st.kv_heads || t[6].dims[0] != tokens)
    return fail("PagedAttentionPool: q/k/v/positions disagree on tokens, heads or head size");
  if (t[5].dims[0] != batch + 1 || t[4].dims[0] != batch)
    return fail("PagedAttentionPool: row_offsets needs B+1 entries and block_table B rows");
  if (st.attr.layer < 0 || st.attr.layer >= st.layers || st.attr.k_column < 0 || st.attr.v_column < 0 ||
      st.attr.k_column + st.kv_heads * st.head_dim > st.width || st.attr.v_column + st.kv_heads * st.v_dim > st.width)
    return fail("PagedAttentionPool: layer or K/V columns outside the pool row");
  if (st.offsets[0] != 0 || st.offsets[batch] != tokens)
    return fail("PagedAttentionPool: row_offsets must start at 0 and end at the number of tokens");
  for (int64_t b = 0; b < batch; ++b) {
    if (st.offsets[b + 1] < st.offsets[b]) return fail("PagedAttentionPool: row_offsets must not decrease");
    const int64_t length = st.lengths[b];
    if (length < 0 || length > st.max_blocks * st.block_size)
      return fail("PagedAttentionPool: a cache length exceeds its row's block table");
    for (int64_t j = 0; j * st.block_size < length; ++j) {
      const int64_t block = st.table[b * st.max_blocks + j];
      if (block < 0 || block >= num_blocks) return fail("PagedAttentionPool: block table entry outside the pool");
    }
  }
  return nullptr;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  Step st;
  st.attr = *static_cast<const Attributes*>(kernel);
  Tensor t[kNumInputs];
  for (size_t i = 0; i < kNumInputs; ++i) {
    const OrtValue* value = nullptr;
    RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(
        g_api, KernelContext_GetInput)(context, i, &value));
    RETURN_IF_ERROR(read_tensor(value, &t[i]));
  }
  static const size_t ranks[kNumInputs] = {3, 3, 3, 4, 2, 1, 1, 1};
  for (size_t i = 0; i < kNumInputs; ++i)
    if (t[i].dims.size() != ranks[i])
      return fail("PagedAttentionPool: input " + std::to_string(i) + " has rank " +
                  std::to_string(t[i].dims.size()) + ", expected " + std::to_string(ranks[i]));
  const int64_t tokens = t[0].dims[0], batch = t[7].dims[0];
  st.q_heads = t[0].dims[1];
  st.head_dim = t[0].dims[2];
  st.kv_heads = t[1].dims[1];
  st.v_dim = t[2].dims[2];
  st.layers = t[3].dims[1];
  st.block_size = t[3].dims[2];
  st.width = t[3].dims[3];
  st.max_blocks = t[4].dims[1];
  st.q = static_cast<const float*>(t[0].data);
  st.k = static_cast<const float*>(t[1].data);
  st.v = static_cast<const float*>(t[2].data);
  st.pool = static_cast<const float*>(t[3].data);
  st.table = static_cast<const int64_t*>(t[4].data);
  st.offsets = static_cast<const int64_t*>(t[5].data);
  st.positions = static_cast<const int64_t*>(t[6].data);
  st.lengths = static_cast<const int64_t*>(t[7].data);
  RETURN_IF_ERROR(check(t, st, tokens, batch));

  const int64_t out_dims[3] = {tokens, st.q_heads, st.v_dim};
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
      g_api, KernelContext_GetOutput)(context, 0, out_dims, 3, &out));
  void* data = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(OrtValue*, void**)>(g_api, GetTensorMutableData)(out, &data));
  st.out = static_cast<float*>(data);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < st.kv_heads; ++h) attend(st, b, h);
  return nullptr;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* attributes = new Attributes;
  if (OrtStatus* status = read_attributes(info, attributes)) {
    delete attributes;
    return status;
  }
  *kernel = attributes;
  return nullptr;
}

OrtCustomOp make_op() {
  OrtCustomOp op{};
  op.version = kCustomOpVersion;
  op.GetName = [](const OrtCustomOp*) { return "PagedAttentionPool"; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) { return "CPUExecutionProvider"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return kNumInputs; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) { return int(i < 4 ? kFloat : kInt64); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(1); };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Attributes*>(kernel); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}

OrtCustomOp g_paged_attention = make_op();

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
  g_api = base->GetApi(kApiVersion);
  if (g_api == nullptr) return nullptr;      // an ORT older than 1.16: nothing registered, the session says so
  // The domain must outlive every session that uses it; ORT does not take it over, so it is never freed.
  OrtCustomOpDomain* domain = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(g_api, CreateCustomOpDomain)(
      "unispec.cpu", &domain));
  RETURN_IF_ERROR(call<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(g_api, CustomOpDomain_Add)(
      domain, &g_paged_attention));
  return call<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(g_api, AddCustomOpDomain)(options, domain);
}
