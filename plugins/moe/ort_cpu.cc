// unispec.cpu::MoE: DeepSeek-V3's routed experts (plugins/moe/reference.py), running only the experts each
// token chose.
//
// The reference computes every expert on every token and weights the unchosen ones by zero (a dense [S, E]
// routing matrix exports without data-dependent control flow); at the bundled model's 2 of 8 experts that is 4x
// the work, at DeepSeek-V3's 8 of 256 it is 32x, every expert's weights read for every token. Here a token
// costs its router row and its k experts.
//
// Inputs   x [S, H] f32, gate_weight [E, H] f32, e_score_correction_bias [E] f32, w_gate [E, I, H] f32,
//          w_up [E, I, H] f32, w_down [E, H, I] f32
// Output   out [S, H] f32
// Attributes num_experts_per_tok (k), n_group, topk_group, norm_topk_prob (0 / 1), routed_scaling_factor
//
// Routing as the reference: scores = sigmoid(x · gate_weight^T); biased = scores + bias picks the experts: a
// group's score is the sum of its two largest biased scores, the topk_group best groups are kept, and the k
// largest biased scores among their experts are chosen (a lower index first among equals); each chosen expert
// is weighted by its unbiased score (over their sum + 1e-20 when norm_topk_prob) times routed_scaling_factor.
// The experts' outputs are summed in float32 in increasing expert order, as the reference's sum over its
// expert axis (where the unchosen add zeros).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernel.h"
#include "reduce.h"   // dot
#include "silu.h"     // swiglu

namespace unispec_cpu {
namespace {

constexpr size_t kInputs = 6;

struct Routing {
  int64_t k = 0, n_group = 0, topk_group = 0, norm = 0;
  float scale = 1.0f;
};

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The `count` largest of value[0:n] by index, a lower index first among equals, in descending value order.
std::vector<int64_t> top(const std::vector<float>& value, int64_t count) {
  std::vector<int64_t> order(value.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return value[a] > value[b]; });
  order.resize(count);
  return order;
}

// One token's chosen experts (ascending) and their weights.
void route(const Routing& r, const float* x, const float* gate_weight, const float* bias, int64_t experts,
           int64_t hidden, std::vector<int64_t>* chosen, std::vector<float>* weights) {
  std::vector<float> scores(experts), biased(experts);
  for (int64_t e = 0; e < experts; ++e) {
    scores[e] = sigmoid(dot(x, gate_weight + e * hidden, hidden));
    biased[e] = scores[e] + bias[e];
  }
  const int64_t per_group = experts / r.n_group;
  std::vector<float> group_score(r.n_group);
  for (int64_t g = 0; g < r.n_group; ++g) {
    std::vector<float> members(biased.begin() + g * per_group, biased.begin() + (g + 1) * per_group);
    const auto best = top(members, 2);
    group_score[g] = members[best[0]] + members[best[1]];
  }
  std::vector<float> candidates(experts, -std::numeric_limits<float>::infinity());
  for (int64_t g : top(group_score, r.topk_group))
    std::copy(biased.begin() + g * per_group, biased.begin() + (g + 1) * per_group,
              candidates.begin() + g * per_group);
  *chosen = top(candidates, r.k);
  std::sort(chosen->begin(), chosen->end());
  weights->resize(r.k);
  float total = 0.0f;
  for (int64_t i = 0; i < r.k; ++i) total += (*weights)[i] = scores[(*chosen)[i]];
  for (float& w : *weights) w = (r.norm ? w / (total + 1e-20f) : w) * r.scale;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  const Routing& r = *static_cast<const Routing*>(kernel);
  Tensor t[kInputs];
  for (size_t i = 0; i < kInputs; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  if (t[0].dims.size() != 2 || t[1].dims.size() != 2 || t[3].dims.size() != 3)
    return fail("MoE: x must be [S, H], gate_weight [E, H] and w_gate [E, I, H]");
  const int64_t tokens = t[0].dims[0], hidden = t[0].dims[1], experts = t[1].dims[0], inter = t[3].dims[1];
  const std::vector<int64_t> expert_in{experts, inter, hidden}, expert_out{experts, hidden, inter};
  if (t[1].dims[1] != hidden || t[2].dims != std::vector<int64_t>{experts} || t[3].dims != expert_in ||
      t[4].dims != expert_in || t[5].dims != expert_out)
    return fail("MoE: expects gate_weight [E, H], e_score_correction_bias [E], w_gate and w_up [E, I, H], "
                "w_down [E, H, I], H that of x [S, H]");
  if (experts % r.n_group != 0 || experts / r.n_group < 2 || r.topk_group > r.n_group ||
      r.k > r.topk_group * (experts / r.n_group))
    return fail("MoE: " + std::to_string(experts) + " experts cannot make " + std::to_string(r.n_group) +
                " groups of 2 or more with " + std::to_string(r.k) + " chosen from " + std::to_string(r.topk_group) +
                " of them");
  const auto* x = static_cast<const float*>(t[0].data);
  const auto* gate_weight = static_cast<const float*>(t[1].data);
  const auto* bias = static_cast<const float*>(t[2].data);
  const auto* w_gate = static_cast<const float*>(t[3].data);
  const auto* w_up = static_cast<const float*>(t[4].data);
  const auto* w_down = static_cast<const float*>(t[5].data);
  void* data = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, {tokens, hidden}, &data));
  auto* out = static_cast<float*>(data);
  std::vector<int64_t> chosen;
  std::vector<float> weights, gate(inter), up(inter), act(inter), sum(hidden);
  for (int64_t s = 0; s < tokens; ++s) {
    const float* xs = x + s * hidden;
    route(r, xs, gate_weight, bias, experts, hidden, &chosen, &weights);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t i = 0; i < r.k; ++i) {
      const int64_t e = chosen[i];
      for (int64_t j = 0; j < inter; ++j) {
        gate[j] = dot(w_gate + (e * inter + j) * hidden, xs, hidden);
        up[j] = dot(w_up + (e * inter + j) * hidden, xs, hidden);
      }
      swiglu(gate.data(), up.data(), act.data(), inter);    // the SwiGLU every native kernel computes
      for (int64_t h = 0; h < hidden; ++h)
        sum[h] += dot(w_down + (e * hidden + h) * inter, act.data(), inter) * weights[i];
    }
    std::copy(sum.begin(), sum.end(), out + s * hidden);
  }
  return nullptr;
}

OrtStatus* create(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* r = new Routing();
  OrtStatus* status = int_attribute(info, "num_experts_per_tok", &r->k);
  if (status == nullptr) status = int_attribute(info, "n_group", &r->n_group);
  if (status == nullptr) status = int_attribute(info, "topk_group", &r->topk_group);
  if (status == nullptr) status = int_attribute(info, "norm_topk_prob", &r->norm);
  if (status == nullptr) status = float_attribute(info, "routed_scaling_factor", &r->scale);
  if (status == nullptr && (r->k < 1 || r->n_group < 1 || r->topk_group < 1))
    status = fail("MoE: num_experts_per_tok, n_group and topk_group must be >= 1");
  if (status != nullptr) {
    delete r;
    return status;
  }
  *kernel = r;
  return nullptr;
}

OrtCustomOp make_op() {
  OrtCustomOp op = cpu_op();
  op.GetName = [](const OrtCustomOp*) { return "MoE"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return kInputs; };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{1}; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Routing*>(kernel); };
  return op;
}

OrtCustomOp g_moe = make_op();

}  // namespace

const OrtCustomOp* moe_op() { return &g_moe; }

}  // namespace unispec_cpu
