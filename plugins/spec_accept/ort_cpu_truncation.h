// The truncation math unispec.cpu::SpecAccept and SampleDraft share (ort_cpu.cc), after
// plugins/spec_accept's truncation.py: tempered softmax, the k-th largest / top-p nucleus floor, the
// truncated and renormalized distribution, inverse-CDF sampling, and the grammar bitmask. Included by
// ort_cpu.cc alone.
//
// Exactness: probabilities in float64 as in truncation.py, the same operations (tempered softmax, threshold,
// renormalize, cumulative mass, count of cdf <= u * total). Sums are vectorized or taken in groups, so they
// may round differently from torch's in the last bits: a uniform (or a nucleus budget) would have to land
// within ~1e-16 of a boundary for a token to differ, as between torch and ONNX Runtime's decomposition
// (truncation.py says the same).
// Ranking: the k-th largest and the top-p nucleus are exact, read off the probabilities that can reach them
// (ranked_floor, nucleus_floor), as the reference's full sort or its 256 candidates read them.

#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "reduce.h"   // max_of
#include "unispec_constants.h"   // generated at build time: kGreedyTemperature (plugins/ort_cpu/header.py)

#if defined(UNISPEC_MVEC) && defined(__AVX2__)
#include <immintrin.h>
extern "C" __m256d _ZGVdN4v_exp(__m256d);   // libmvec (glibc >= 2.22): exp of four doubles
#endif

namespace unispec_cpu {
namespace {

bool is_greedy(float temperature) { return temperature < kGreedyTemperature; }

// The first of equal maxima, as torch and ONNX ArgMax: the index a scan keeping the first strictly greater
// value ends on (NaN never wins, and a NaN at 0 is never left). The maximum first, vectorised (the scan's
// compare-and-select chain ran at ~2 cycles a token: 0.74 ms for a K = 7 greedy verdict over 128k tokens),
// then its first index.
int64_t argmax(const float* x, int64_t n) {
  if (n <= 0 || std::isnan(x[0])) return 0;
  const float top = max_of(x, n);
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == top) return i;
  return 0;
}

// exp of x[0, n) in place. With glibc's vector math (UNISPEC_MVEC, AVX2) four lanes at a time, each within an
// ulp like the scalar exp (and like torch's own vectorized float64 exp, Sleef's, neither is correctly rounded
// everywhere: such last-bit differences are the ones the "Exactness" paragraph above allows).
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

}  // namespace
}  // namespace unispec_cpu
