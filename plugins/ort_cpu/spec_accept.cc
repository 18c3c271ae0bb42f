// unispec.cpu::SpecAccept and unispec.cpu::SampleDraft, ONNX Runtime CPU kernels for the speculative math of
// plugins/spec_accept (the torch reference is the definition; these follow it step for step):
//
// SpecAccept: the verdict of acceptance.verify. Same inputs, outputs and attributes as the unispec::SpecAccept
//   node (plugins/spec_accept/onnx.py), all ten inputs present (the step graphs always feed the bitmask and
//   the draft distributions):
//     logits [B, K+1, V] f32, draft_tokens [B, K] i64, temperature / top_p / min_p [B] f32, top_k [B] i64,
//     noise [B, K+1, C] f32, in_thinking_phase [B] bool, token_bitmask [B, K+1, W] i32, draft_probs [B, K, V]
//     f32 ([B, 0, V] when K = 0)  ->  num_accepted [B] i64, next_tokens [B] i64
//   attributes num_drafts, relaxed_top_n (ints), relaxed_delta (float).
// SampleDraft: spec_glue.propose's draft choice (acceptance.choose_drafts: sample_draft behind "does any row
//   sample"):
//     logits [B, P, V] f32 (the drafter's, in the target vocabulary), argmax [B, P] i64 (the drafter's own
//     argmax, mapped to target ids), temperature [B] f32, top_k [B] i64, top_p / min_p [B] f32,
//     uniform [B, P] f32  ->  tokens [B, P] i64, q [B, P, V] f32 (q truncated like the target's)
//
// What the decomposition in the graph costs and this does not: the sampled verdict is ~150 ONNX nodes in
// Ifs (softmax, TopK of 256 candidates, cumsums, gathers, in float64 over [B, K+1, V]) and each sampled draft
// step ~30 more; at the bundled models' sizes every node costs about a microsecond whatever its work.
// Here a row is done in one pass per verified position, and positions after the first rejection (whose
// verdict cannot change the outputs) are skipped.
//
// Exactness: probabilities in float64 as in truncation.py, the same operations (tempered softmax, threshold,
// renormalize, cumulative mass, count of cdf <= u * total). Sums are vectorized or taken in groups, so they
// may round differently from torch's in the last bits: a uniform (or a nucleus budget) would have to land
// within ~1e-16 of a boundary for a token to differ, as between torch and ONNX Runtime's decomposition
// (truncation.py says the same).
// Ranking: the k-th largest and the top-p nucleus are exact, read off the probabilities that can reach them
// (ranked_floor, nucleus_floor), as the reference's full sort or its 256 candidates read them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernel.h"

#if defined(UNISPEC_MVEC) && defined(__AVX2__)
#include <immintrin.h>
extern "C" __m256d _ZGVdN4v_exp(__m256d);   // libmvec (glibc >= 2.22): exp of four doubles
#endif

namespace unispec_cpu {
namespace {

constexpr float kGreedyTemperature = 1e-5f;     // truncation.GREEDY_TEMPERATURE
constexpr int64_t kNoiseTarget = 0, kNoiseResidual = 1;   // acceptance.NOISE_TARGET / NOISE_RESIDUAL
constexpr size_t kSpecInputs = 10, kDraftInputs = 7;

bool is_greedy(float temperature) { return temperature < kGreedyTemperature; }

int64_t argmax(const float* x, int64_t n) {     // the first of equal maxima, as torch and ONNX ArgMax
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

// exp of x[0, n) in place. With glibc's vector math (UNISPEC_MVEC, AVX2) four lanes at a time, each within an
// ulp like the scalar exp (and like torch's own vectorized float64 exp, Sleef's, neither is correctly rounded
// everywhere: such last-bit differences are the ones the header's "Exactness" paragraph allows).
void exp_in_place(double* x, int64_t n) {
  int64_t i = 0;
#if defined(UNISPEC_MVEC) && defined(__AVX2__)
  for (; i + 4 <= n; i += 4) _mm256_storeu_pd(x + i, _ZGVdN4v_exp(_mm256_loadu_pd(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// softmax(logits / t) in float64 into out[n]; returns the largest probability. The largest logit gives the
// largest scaled value (division by t > 0 rounds monotonically), so the peak is known before scaling. The
// reductions are vectorized (their order differs from torch's in the last bits, as the header allows).
double softmax(const float* logits, int64_t n, double t, double* out) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = std::max(top, logits[i]);
  const double peak = static_cast<double>(top) / t;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(logits[i]) / t - peak;
  exp_in_place(out, n);
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += out[i];
  double p_max = 0.0;
#pragma omp simd reduction(max : p_max)
  for (int64_t i = 0; i < n; ++i) {
    out[i] /= total;
    p_max = std::max(p_max, out[i]);
  }
  return p_max;
}

// truncation.sample_inverse_cdf: the first token whose cdf exceeds u * total, never a zero-weight one.
// The cdf is non-decreasing, so #{i : cdf[i] <= target} is the index of the first cdf above the target: a
// second pass that stops there gives the reference's count with the same sequential sums (in float64, for
// float32 weights too).
template <typename T>
int64_t sample_inverse_cdf(const T* weights, int64_t n, float u) {
  double running = 0.0;
  int64_t last_positive = 0;
#pragma omp simd reduction(+ : running) reduction(max : last_positive)
  for (int64_t i = 0; i < n; ++i) {
    running += static_cast<double>(weights[i]);
    last_positive = weights[i] > 0 ? std::max(last_positive, i) : last_positive;
  }
  const double target = static_cast<double>(u) * running;
  double cdf = 0.0;
  int64_t index = 0;
  for (; index < n; ++index) {
    cdf += static_cast<double>(weights[index]);
    if (cdf > target) break;
  }
  return std::min(index, last_positive);
}

struct RowParams {
  float temperature, top_p, min_p;
  int64_t top_k;
};

// Scratch buffers reused across a step's rows and positions.
struct Scratch {
  std::vector<double> probs, ranked, residual, partitioned;
  std::vector<float> masked;
};

// The values of probs[n] that are >= tau, into s.ranked (vocabulary order).
void collect(const double* probs, int64_t n, double tau, Scratch& s) {
  s.ranked.resize(n);
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {          // branchless: a flat row keeps nearly all, a peaked one few
    s.ranked[m] = probs[i];
    m += probs[i] >= tau;
  }
  s.ranked.resize(m);
}

// The nucleus of values v[0, m) (any order; v and s.partitioned are overwritten): the values whose exclusive
// mass in rank order (the mass of the values ranked above them) is below `budget`. Returns its smallest
// value, or -1 when it is empty (budget <= 0); *all_in says every value is in it, and then *mass is theirs.
//
// A quickselect on mass with a three-way, branchless partition around a pivot value: the pivot's first rank
// has exclusive mass (mass above the range) + (mass of the larger values), so one pass says which side the
// boundary is on. It reads O(m) values; popping a heap rank by rank read O(nucleus * log m), and std::
// nth_element mispredicts a branch per value: DFlash's flat later positions have nuclei of ~960 of 1024
// tokens. A range of at most kSmallRange values is sorted and walked rank by rank.
double nucleus_floor(double* v, int64_t m, double budget, Scratch& s, bool* all_in, double* mass) {
  constexpr int64_t kSmallRange = 32;
  s.partitioned.resize(m);
  double* buffers[2] = {v, s.partitioned.data()};
  int current = 0;                          // the range lies in buffers[current]
  double* range = v;
  int64_t r = m;
  double above = 0.0, floor = -1.0;         // above: the mass of the values known to be in the nucleus
  bool ended = false;                       // the first rank out is known
  *all_in = true;
  while (r > kSmallRange) {
    const double a = range[0], b = range[r / 2], c = range[r - 1];
    const double pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));   // median of three
    double* out = buffers[1 - current];
    int64_t num_high = 0, num_low = 0;
    double high = 0.0, tied = 0.0;
    for (int64_t i = 0; i < r; ++i) {       // larger values to out's front, smaller ones to its back
      const double x = range[i];
      out[num_high] = x;
      out[m - 1 - num_low] = x;
      num_high += x > pivot;
      num_low += x < pivot;
      high += x > pivot ? x : 0.0;
      tied += x == pivot ? x : 0.0;
    }
    current = 1 - current;
    if (above + high >= budget) {           // the pivot's first rank is out, and so is every smaller value
      *all_in = false;
      range = out;
      r = num_high;
      continue;
    }
    floor = pivot;                          // the pivot is in, and everything larger
    above += high + tied;
    if (num_low > 0 && above >= budget) {   // the largest smaller value is out
      *all_in = false;
      ended = true;
      break;
    }
    range = out + (m - num_low);
    r = num_low;
  }
  if (!ended) {
    std::sort(range, range + r, std::greater<double>());
    for (int64_t j = 0; j < r; ++j) {
      if (above >= budget) {
        *all_in = false;
        break;
      }
      floor = range[j];
      above += range[j];
    }
  }
  *mass = above;
  return floor;
}

// truncation._ranked_floor: max(k-th largest probability, top-p nucleus floor), exact; k in 1..n (n = off).
//
// Only the largest probabilities matter, so it first ranks those >= tau, a bound under which the rest
// cannot reach the nucleus (their mass is below n * tau = (1 - top_p) / 2), and ranks the whole vocabulary
// only when that prefix turns out short (fewer than k values, or its nucleus mass below the budget).
double ranked_floor(const double* probs, int64_t n, int64_t k, float top_p, double p_max, Scratch& s) {
  const double tau = top_p < 1.0f ? (1.0 - static_cast<double>(top_p)) / (2.0 * static_cast<double>(n)) : 0.0;
  for (double bound = tau;; bound = 0.0) {
    collect(probs, n, bound, s);
    const int64_t m = static_cast<int64_t>(s.ranked.size());
    if (k < n && m < k) continue;                                     // the k-th largest is below the bound
    auto begin = s.ranked.begin();
    double kth = 0.0;                                                 // no top-k: every probability is >= 0
    if (k < n) {
      std::nth_element(begin, begin + (k - 1), s.ranked.end(), std::greater<double>());
      kth = s.ranked[k - 1];
    }
    if (top_p >= 1.0f) return kth;                                    // no nucleus: its floor is 0
    double mass = 0.0;                                                // of the top-k set, in vocabulary order
#pragma omp simd reduction(+ : mass)
    for (int64_t i = 0; i < n; ++i) mass += probs[i] >= kth ? probs[i] : 0.0;
    const double budget = static_cast<double>(top_p) * mass;
    auto end = std::remove_if(begin, s.ranked.end(), [kth](double p) { return p < kth; });
    const int64_t kept = end - begin;
    bool all_in = true;
    double nucleus_mass = 0.0;
    const double floor = nucleus_floor(&*begin, kept, budget, s, &all_in, &nucleus_mass);
    // complete when the first rank left out is known: a collected value is out, or the nucleus's mass
    // reaches the budget (so the next rank, uncollected, cannot join), or every value was collected
    if (floor < 0.0 || !all_in || nucleus_mass >= budget || bound == 0.0)
      return std::max(kth, floor >= 0.0 ? floor : p_max);             // an empty nucleus keeps the top token
  }
}

// truncation.truncate: the truncated, renormalized distribution of one position into out[n].
void truncate(const float* logits, int64_t n, const RowParams& r, Scratch& s, double* out) {
  const double p_max = softmax(logits, n, is_greedy(r.temperature) ? 1.0 : static_cast<double>(r.temperature), out);
  const int64_t k = (r.top_k <= 0 || r.top_k >= n) ? n : r.top_k;
  const double floor = (k < n || r.top_p < 1.0f) ? ranked_floor(out, n, k, r.top_p, p_max, s) : 0.0;
  const double threshold = std::min(std::max(floor, static_cast<double>(r.min_p) * p_max), p_max);
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    out[i] = out[i] >= threshold ? out[i] : 0.0;
    total += out[i];
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] /= total;
}

// bitmask.apply_bitmask: the row's logits with forbidden tokens -inf, unless the mask allows nothing in
// [0, V). A mask that allows every token (all words -1, the step graphs' feed without a grammar) is the
// row itself, returned without a copy.
const float* apply_bitmask(const float* logits, const int32_t* words, int64_t n, float* out) {
  const int64_t num_words = (n + 31) / 32;
  bool all_allowed = true;
  for (int64_t w = 0; w < num_words && all_allowed; ++w) {
    const int64_t bits = std::min<int64_t>(32, n - 32 * w);
    const uint32_t wanted = bits == 32 ? ~0u : (1u << bits) - 1u;
    all_allowed = (static_cast<uint32_t>(words[w]) & wanted) == wanted;
  }
  if (all_allowed) return logits;
  bool satisfiable = false;
  for (int64_t i = 0; i < n && !satisfiable; ++i) satisfiable = (static_cast<uint32_t>(words[i / 32]) >> (i % 32)) & 1u;
  if (!satisfiable) return logits;
  for (int64_t i = 0; i < n; ++i) {
    const bool allowed = (static_cast<uint32_t>(words[i / 32]) >> (i % 32)) & 1u;
    out[i] = allowed ? logits[i] : -std::numeric_limits<float>::infinity();
  }
  return out;
}

struct SpecAttributes {
  int64_t num_drafts = 0, relaxed_top_n = 0;
  float relaxed_delta = 0.0f;
};

// acceptance.relaxed_verdict at one position.
bool relaxed(const float* logits, int64_t n, int64_t draft, const SpecAttributes& a, Scratch& s) {
  s.probs.resize(n);
  const double p_top = softmax(logits, n, 1.0, s.probs.data());
  int64_t num_above = 0;
  for (int64_t i = 0; i < n; ++i) num_above += logits[i] > logits[draft];
  return num_above < a.relaxed_top_n && s.probs[draft] >= p_top - static_cast<double>(a.relaxed_delta) &&
         logits[draft] > -std::numeric_limits<float>::infinity();
}

// acceptance.rejection_verdict at one position: accepted, and the recovered token when not. q is the draft's
// distribution renormalized in float64, or onehot(draft) for a draft q cannot have produced (q(d) = 0): a
// deterministic draft. The residual is only formed on a rejection.
bool rejection(const double* target, const float* draft_q, int64_t n, int64_t draft, float coin, float residual_u,
               Scratch& s, int64_t* recovered) {
  const bool from_q = draft_q[draft] > 0;
  double total = 0.0;
  if (from_q) {
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) total += static_cast<double>(draft_q[i]);
  }
  const auto q = [&](int64_t i) {
    return from_q ? static_cast<double>(draft_q[i]) / total : i == draft ? 1.0 : 0.0;
  };
  if (static_cast<double>(coin) * q(draft) < target[draft]) return true;
  s.residual.resize(n);
  double mass = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    s.residual[i] = std::max(target[i] - q(i), 0.0);
    mass += s.residual[i];
  }
  *recovered = sample_inverse_cdf(mass > 0 ? s.residual.data() : target, n, residual_u);
  return false;
}

OrtStatus* spec_accept(void* kernel, OrtKernelContext* context) {
  const SpecAttributes& a = *static_cast<const SpecAttributes*>(kernel);
  Tensor t[kSpecInputs];
  for (size_t i = 0; i < kSpecInputs; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  static const size_t ranks[kSpecInputs] = {3, 2, 1, 1, 1, 1, 3, 1, 3, 3};
  for (size_t i = 0; i < kSpecInputs; ++i)
    if (t[i].dims.size() != ranks[i])
      return fail("SpecAccept: input " + std::to_string(i) + " has rank " + std::to_string(t[i].dims.size()) +
                  ", expected " + std::to_string(ranks[i]));
  const int64_t batch = t[0].dims[0], positions = t[0].dims[1], vocab = t[0].dims[2], k = positions - 1;
  const int64_t channels = t[6].dims[2], words = t[8].dims[2];
  if (k != a.num_drafts || t[1].dims[0] != batch || t[1].dims[1] != k)
    return fail("SpecAccept: logits must be [B, num_drafts + 1, V] and draft_tokens [B, num_drafts]");
  for (size_t i : {2, 3, 4, 5, 7})
    if (t[i].dims[0] != batch) return fail("SpecAccept: every per-row parameter needs B entries");
  if (t[6].dims[0] != batch || t[6].dims[1] != positions || channels < 2)
    return fail("SpecAccept: noise must be [B, num_drafts + 1, C] with C >= 2");
  if (t[8].dims[0] != batch || t[8].dims[1] != positions || words * 32 < vocab)
    return fail("SpecAccept: token_bitmask must be [B, num_drafts + 1, >= ceil(V / 32)]");
  if (t[9].dims[0] != batch || t[9].dims[1] != k || (k > 0 && t[9].dims[2] != vocab))
    return fail("SpecAccept: draft_probs must be [B, num_drafts, V]");
  const auto* logits = static_cast<const float*>(t[0].data);
  const auto* drafts = static_cast<const int64_t*>(t[1].data);
  const auto* noise = static_cast<const float*>(t[6].data);
  const auto* thinking = static_cast<const bool*>(t[7].data);
  const auto* bitmask = static_cast<const int32_t*>(t[8].data);
  const auto* draft_probs = static_cast<const float*>(t[9].data);
  for (int64_t i = 0; i < batch * k; ++i)
    if (drafts[i] >= vocab) return fail("SpecAccept: a draft token outside the vocabulary");
  void *accepted_data = nullptr, *next_data = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {batch}, &accepted_data));
  RETURN_IF_ERROR(make_output(context, 1, {batch}, &next_data));
  auto* num_accepted = static_cast<int64_t*>(accepted_data);
  auto* next_tokens = static_cast<int64_t*>(next_data);

  Scratch s;
  std::vector<double> target(vocab);
  s.masked.resize(vocab);
  for (int64_t b = 0; b < batch; ++b) {
    const RowParams r{static_cast<const float*>(t[2].data)[b], static_cast<const float*>(t[4].data)[b],
                      static_cast<const float*>(t[5].data)[b], static_cast<const int64_t*>(t[3].data)[b]};
    const bool greedy = is_greedy(r.temperature), relaxes = thinking[b] && !greedy && k > 0;
    int64_t i = 0, next = 0;
    for (;; ++i) {                  // position i: verify draft i (i < K), or the bonus (i = K); stop at a rejection
      const int64_t at = b * positions + i;
      const float* masked = apply_bitmask(logits + at * vocab, bitmask + at * words, vocab, s.masked.data());
      const float* u = noise + at * channels;
      const int64_t draft = i < k ? drafts[b * k + i] : -1;     // -1: the bonus, or a slot without a draft
      int64_t token = 0;
      bool accepted = false;
      if (greedy) {
        token = argmax(masked, vocab);
        accepted = draft == token;
      } else {
        truncate(masked, vocab, r, s, target.data());
        if (draft < 0)              // plain decoding: the token is y_i, sampled from the truncated target
          token = sample_inverse_cdf(target.data(), vocab, u[kNoiseTarget]);
        else                        // y_i is not needed: accepted, the draft stands; rejected, the residual's
          accepted = rejection(target.data(), draft_probs + (b * k + i) * vocab, vocab, draft, u[kNoiseTarget],
                               u[kNoiseResidual], s, &token);
        if (relaxes && draft >= 0 && !accepted) accepted = relaxed(masked, vocab, draft, a, s);
      }
      accepted = accepted && draft >= 0 && masked[draft] > -std::numeric_limits<float>::infinity();
      if (!accepted) {
        next = token;
        break;
      }
    }
    num_accepted[b] = i;
    next_tokens[b] = next;
  }
  return nullptr;
}

OrtStatus* sample_draft(void*, OrtKernelContext* context) {
  Tensor t[kDraftInputs];
  for (size_t i = 0; i < kDraftInputs; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  static const size_t ranks[kDraftInputs] = {3, 2, 1, 1, 1, 1, 2};
  for (size_t i = 0; i < kDraftInputs; ++i)
    if (t[i].dims.size() != ranks[i])
      return fail("SampleDraft: expects logits [B, P, V], argmax [B, P], temperature / top_k / top_p / min_p [B] "
                  "and uniform [B, P]");
  const int64_t batch = t[0].dims[0], positions = t[0].dims[1], vocab = t[0].dims[2];
  bool shaped = t[1].dims == std::vector<int64_t>{batch, positions} && t[6].dims == t[1].dims;
  for (size_t i = 2; i < 6; ++i) shaped = shaped && t[i].dims[0] == batch;
  if (!shaped)
    return fail("SampleDraft: argmax and uniform must be [B, P] and the sampling parameters [B], B and P those "
                "of logits");
  const auto* logits = static_cast<const float*>(t[0].data);
  const auto* argmax_in = static_cast<const int64_t*>(t[1].data);
  const auto* temperature = static_cast<const float*>(t[2].data);
  const auto* top_k = static_cast<const int64_t*>(t[3].data);
  const auto* top_p = static_cast<const float*>(t[4].data);
  const auto* min_p = static_cast<const float*>(t[5].data);
  const auto* uniform = static_cast<const float*>(t[6].data);
  void *token_data = nullptr, *q_data = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {batch, positions}, &token_data));
  RETURN_IF_ERROR(make_output(context, 1, {batch, positions, vocab}, &q_data));
  auto* tokens = static_cast<int64_t*>(token_data);
  auto* q = static_cast<float*>(q_data);
  std::fill(q, q + batch * positions * vocab, 0.0f);
  const bool some_sampled = std::any_of(temperature, temperature + batch, [](float x) { return !is_greedy(x); });
  Scratch s;
  s.probs.resize(vocab);
  for (int64_t at = 0; at < batch * positions; ++at) {
    const int64_t b = at / positions;
    const float* row = logits + at * vocab;
    float* row_q = q + at * vocab;
    if (!some_sampled) {            // every row greedy: the argmax, and q of zeros (propose's all_greedy)
      tokens[at] = argmax_in[at];
      continue;
    }
    if (is_greedy(temperature[b])) {  // q = onehot of the row's own argmax: a deterministic draft
      tokens[at] = argmax_in[at];
      row_q[argmax(row, vocab)] = 1.0f;
      continue;
    }
    truncate(row, vocab, RowParams{temperature[b], top_p[b], min_p[b], top_k[b]}, s, s.probs.data());
    for (int64_t i = 0; i < vocab; ++i) row_q[i] = static_cast<float>(s.probs[i]);
    tokens[at] = sample_inverse_cdf(row_q, vocab, uniform[at]);   // from q as carried (rounded to float32)
  }
  return nullptr;
}

OrtStatus* create_spec_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto get_int = call<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(g_api,
                                                                                 KernelInfoGetAttribute_int64);
  auto get_float = call<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(g_api,
                                                                                 KernelInfoGetAttribute_float);
  auto* a = new SpecAttributes;
  OrtStatus* status = get_int(info, "num_drafts", &a->num_drafts);
  if (status == nullptr) status = get_int(info, "relaxed_top_n", &a->relaxed_top_n);
  if (status == nullptr) status = get_float(info, "relaxed_delta", &a->relaxed_delta);
  if (status != nullptr) {
    delete a;
    return status;
  }
  *kernel = a;
  return nullptr;
}

OrtCustomOp make_op(bool spec) {
  OrtCustomOp op = cpu_op();
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(2); };
  if (spec) {
    op.GetName = [](const OrtCustomOp*) { return "SpecAccept"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kSpecInputs; };
    op.GetInputType = [](const OrtCustomOp*, size_t i) {
      static const int types[kSpecInputs] = {kFloat, kInt64, kFloat, kInt64, kFloat, kFloat, kFloat, kBool, kInt32,
                                             kFloat};
      return types[i];
    };
    op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kInt64); };
    op.CreateKernelV2 = create_spec_kernel;
    op.KernelComputeV2 = spec_accept;
    op.KernelDestroy = [](void* kernel) { delete static_cast<SpecAttributes*>(kernel); };
  } else {
    op.GetName = [](const OrtCustomOp*) { return "SampleDraft"; };
    op.GetInputTypeCount = [](const OrtCustomOp*) { return kDraftInputs; };
    op.GetInputType = [](const OrtCustomOp*, size_t i) { return int(i == 1 || i == 3 ? kInt64 : kFloat); };
    op.GetOutputType = [](const OrtCustomOp*, size_t i) { return int(i == 0 ? kInt64 : kFloat); };
    op.CreateKernelV2 = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel) -> OrtStatus* {
      *kernel = nullptr;
      return nullptr;
    };
    op.KernelComputeV2 = sample_draft;
    op.KernelDestroy = [](void*) {};
  }
  return op;
}

OrtCustomOp g_spec_accept = make_op(true);
OrtCustomOp g_sample_draft = make_op(false);

}  // namespace

const OrtCustomOp* spec_accept_op() { return &g_spec_accept; }
const OrtCustomOp* sample_draft_op() { return &g_sample_draft; }

}  // namespace unispec_cpu
