// unispec.cpu::PagedAttentionPool, ONNX Runtime CPU kernel: PagedAttention (the math of
// plugins/paged_attention/reference.py) reading each row's past straight from the paged KV pool.
//
// The exported graph gathers every row's blocks, transposes them layer-major, splits layers and K/V, and
// the reference attention then copies the result once more per query: ~6 copies of the history a step.
// This kernel reads key p of row b where it lives, pool[block_table[b, p / bs], layer, p % bs, column],
// so a step reads each row's history once and copies none of it.
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

// One step's geometry and pointers, shared by every row's attention.
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

// Four queries against one key at once: the key is loaded once and the four sums reduce side by side.
void dot4(const float* const* q, const float* key, int64_t n, float* out) {
  const float *q0 = q[0], *q1 = q[1], *q2 = q[2], *q3 = q[3];
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < n; ++d) {
    s0 += q0[d] * key[d];
    s1 += q1[d] * key[d];
    s2 += q2[d] * key[d];
    s3 += q3[d] * key[d];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// y_i += w[i] * x for four rows y_i = y + i * n that share x (one value row, four queries).
void axpy4(const float* w, const float* x, float* y, int64_t n) {
  const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  float *y0 = y, *y1 = y + n, *y2 = y + 2 * n, *y3 = y + 3 * n;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    const float v = x[d];
    y0[d] += w0 * v;
    y1[d] += w1 * v;
    y2[d] += w2 * v;
    y3[d] += w3 * v;
  }
}

// Attention of row `row`'s new tokens, every head. `rows[j]` is the pool row of the row's past position j
// (this layer's K|V live in it at the attribute columns). Loops run key-outer: each pool row is read once,
// contiguously for all heads (the rows of one layer lie a block's stride apart, too far apart for the
// hardware prefetcher, so the rows a few keys ahead are prefetched by hand), and each key and value serves
// its whole GQA group in one pass.
void attend(const Step& st, int64_t row, const std::vector<const float*>& rows) {
  const Attributes& a = st.attr;
  const int64_t t0 = st.offsets[row], t1 = st.offsets[row + 1], past = st.lengths[row];
  const int64_t group = st.q_heads / st.kv_heads, fresh = t1 - t0, keys = past + fresh;
  if (fresh == 0) return;
  const int64_t queries = fresh * st.q_heads;   // query i = (token t0 + i / q_heads, head i % q_heads)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<const float*> q(queries);
  std::vector<int64_t> at(queries);             // each query's position
  for (int64_t i = 0; i < queries; ++i) {
    q[i] = st.q + (t0 * st.q_heads + i) * st.head_dim;
    at[i] = st.positions[t0 + i / st.q_heads];
  }
  auto in_window = [&](int64_t i, int64_t key_position) {
    return a.sliding_window <= 0 || at[i] - key_position < a.sliding_window;
  };
  // The queries of kv head h are, per token, `group` consecutive heads: score them 4 at a time.
  auto score = [&](const float* key_row, int64_t key_stride, float* s) {
    for (int64_t h = 0; h < st.kv_heads; ++h) {
      const float* key = key_row + h * key_stride;
      for (int64_t tok = 0; tok < fresh; ++tok) {
        const int64_t first = tok * st.q_heads + h * group;
        int64_t g = 0;
        for (; g + 4 <= group; g += 4) dot4(&q[first + g], key, st.head_dim, s + first + g);
        for (; g < group; ++g) s[first + g] = dot(q[first + g], key, st.head_dim);
      }
    }
  };
  constexpr int64_t kAhead = 6;                 // keys prefetched ahead
  const int64_t k_bytes = st.kv_heads * st.head_dim * 4, v_bytes = st.kv_heads * st.v_dim * 4;
  auto prefetch = [](const float* from, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(from) + b);
  };
  std::vector<float> scores(keys * queries);    // [key][query]

  for (int64_t p = 0; p < past; ++p) {
    if (p + kAhead < past) prefetch(rows[p + kAhead] + a.k_column, k_bytes);
    float* s = &scores[p * queries];
    score(rows[p] + a.k_column, st.head_dim, s);
    for (int64_t i = 0; i < queries; ++i) s[i] = in_window(i, p) ? s[i] * a.scale : neg_inf;
  }
  for (int64_t u = 0; u < fresh; ++u) {
    float* s = &scores[(past + u) * queries];
    score(st.k + (t0 + u) * st.kv_heads * st.head_dim, st.head_dim, s);
    const int64_t key_position = st.positions[t0 + u];
    for (int64_t i = 0; i < queries; ++i) {
      const bool ok = (!a.causal || key_position <= at[i]) && in_window(i, key_position);
      s[i] = ok ? s[i] * a.scale : neg_inf;
    }
  }

  for (int64_t i = 0; i < queries; ++i) {       // softcap, then softmax over every key of query i
    if (a.softcap > 0)
      for (int64_t j = 0; j < keys; ++j) {
        float& x = scores[j * queries + i];
        if (x != neg_inf) x = std::tanh(x / a.softcap) * a.softcap;    // masked keys stay masked
      }
    float top = neg_inf, total = 0.0f;
    for (int64_t j = 0; j < keys; ++j) top = std::max(top, scores[j * queries + i]);
    for (int64_t j = 0; j < keys; ++j) total += (scores[j * queries + i] = std::exp(scores[j * queries + i] - top));
    for (int64_t j = 0; j < keys; ++j) scores[j * queries + i] /= total;
  }

  float* out = st.out + t0 * st.q_heads * st.v_dim;   // [fresh, q_heads, v_dim], accumulated in place
  std::fill(out, out + queries * st.v_dim, 0.0f);
  for (int64_t j = 0; j < keys; ++j) {
    if (j + kAhead < past) prefetch(rows[j + kAhead] + a.v_column, v_bytes);
    const float* value_row = j < past ? rows[j] + a.v_column : st.v + (t0 + j - past) * st.kv_heads * st.v_dim;
    const float* w = &scores[j * queries];
    for (int64_t h = 0; h < st.kv_heads; ++h) {
      const float* value = value_row + h * st.v_dim;
      for (int64_t tok = 0; tok < fresh; ++tok) {
        const int64_t first = tok * st.q_heads + h * group;
        int64_t g = 0;
        for (; g + 4 <= group; g += 4) axpy4(w + first + g, value, out + (first + g) * st.v_dim, st.v_dim);
        for (; g < group; ++g) axpy(w[first + g], value, out + (first + g) * st.v_dim, st.v_dim);
      }
    }
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
  std::vector<const float*> rows;
  for (int64_t b = 0; b < batch; ++b) {
    rows.resize(st.lengths[b]);
    for (int64_t p = 0; p < st.lengths[b]; ++p) rows[p] = st.pool_row(b, p);
    attend(st, b, rows);
  }
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
