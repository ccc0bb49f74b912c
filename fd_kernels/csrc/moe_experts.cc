// A mixture-of-experts layer's routed experts over a step's tokens, in one op:
//
//   fd_moe_route(h [T, hidden] float32, router [E, hidden] float32, correction [E] float32, top_k,
//                renormalize, norm_min, num_threads) -> chosen [T, top_k] int64, weights [T, top_k] float32
//   fd_moe_experts(h, router, correction, experts (three tensors a linear: expert 0's gate_up, its
//                  down, expert 1's gate_up, ...), top_k, renormalize, norm_min, kinds, widths,
//                  round_inputs, num_threads, mkl_path)
//       -> out [T, hidden] = sum over a token's chosen experts e, ascending e, of
//                            weight_e * down_e(swiglu(gate_up_e(h)))
//
// Routing, a token at a time (fd_moe_route; fd_moe_experts routes the same way): its logits are one
// dot product with each expert's router row, summed over hidden in the same order whatever the
// step holds; the probabilities their softmax; the top_k experts those with the highest
// probability + correction (ERNIE's score correction, zeros for other models: it ranks, it does
// not weigh; ties to the lower index), highest first; their weights the probabilities, divided by
// max(their sum, norm_min) with renormalize. That is fd_kernels.moe.route's definition, whose
// Paddle matmul sums in an order that depends on the step's row count: here a token's routing,
// and so its output, does not depend on the tokens beside it.
//
// The (token, choice) pairs are then grouped by expert, tokens ascending within an expert, and
// each expert that got tokens runs gate_up, SwiGLU and down once over its rows, through the same
// kernel functions with the same arguments as fd_kernels.native.PackedLinear's op-by-op calls
// (mkl_path included: from kGemmRows rows an expert's products go to MKL there and here alike).
// `kinds[i]` says how linear i's three tensors hold its weight (fd_kernels.native's prepared
// kinds): 0 float32 packed for MKL (packed_linear.cc; its one tensor thrice), 1 bfloat16 panels
// (bf16_linear.cc; thrice; `round_inputs[i]`: its inputs rounded to bfloat16, and an expert whose
// two linears both round runs as fd_bf16_mlp, the same bits), 2 int8 codes per output channel,
// their scales and code sums (int8_linear.cc), 4 or 8 blocks of that many bits: codes, scales and
// mins (quant_linear.cc; `round_inputs[i]`: int8 input blocks). `widths[i]` is linear i's output
// width. Each result row is scaled by its weight, rounded, and added to its token's output row,
// experts in ascending order: bit for bit the reduction of fd_kernels.moe.grouped_experts' scale
// and scatter, so with the same routing the two give the same bits.
//
// What it saves is Python and Paddle's dispatch: the portable path's ~4 ops an expert and layer
// (~20-80 us each on a small CPU), plus the routing's ~8 ops a layer. A ~1B model of 16 experts
// (benchmarks/moe_model.py) decoded one row in 40.8 ms a step instead of 50.4 on an AMD EPYC.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "ops.h"
#include "paddle/extension.h"

namespace {

// How a linear's three tensors hold its weight (see the header).
enum Kind : int { kFloat32 = 0, kBf16 = 1, kInt8 = 2 };
constexpr size_t kTensorsPerLinear = 3, kLinearsPerExpert = 2;
constexpr int64_t kMinMacsPerThread = 1 << 18;   // routing: below this a step's rows run on one thread

// How tokens pick their experts.
struct Router {
  const float* rows;        // [experts, hidden]
  const float* correction;  // [experts]
  int64_t experts, hidden;
  int top_k;
  bool renormalize;
  float norm_min;
};

// logits[e] = router row e . h, four experts a pass over h (four independent sums); expert e's sum
// runs over hidden in the same order for every token.
void logits_of(const float* h, const Router& r, float* logits) {
  const int64_t n = r.hidden;
  int64_t e = 0;
  for (; e + 4 <= r.experts; e += 4) {
    const float *w0 = r.rows + e * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < n; ++i) {
      s0 += h[i] * w0[i];
      s1 += h[i] * w1[i];
      s2 += h[i] * w2[i];
      s3 += h[i] * w3[i];
    }
    logits[e] = s0, logits[e + 1] = s1, logits[e + 2] = s2, logits[e + 3] = s3;
  }
  for (; e < r.experts; ++e) {
    const float* w = r.rows + e * n;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += h[i] * w[i];
    logits[e] = s;
  }
}

// Softmax of `values` in place.
void softmax(float* values, int64_t n) {
  const float top = *std::max_element(values, values + n);
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += values[i] = std::exp(values[i] - top);
  for (int64_t i = 0; i < n; ++i) values[i] /= total;
}

// One thread's buffers for routing a token.
struct Scratch {
  std::vector<float> probs, scores;
  std::vector<int64_t> order;
  explicit Scratch(int64_t experts) : probs(experts), scores(experts), order(experts) {}
};

// Token h's top_k experts (chosen, highest score first) and their weights (see the header).
void route_token(const float* h, const Router& r, Scratch& s, int64_t* chosen, float* weights) {
  float* probs = s.probs.data();
  logits_of(h, r, probs);
  softmax(probs, r.experts);
  for (int64_t e = 0; e < r.experts; ++e) s.scores[e] = probs[e] + r.correction[e];
  std::iota(s.order.begin(), s.order.end(), int64_t{0});
  const float* scores = s.scores.data();
  std::partial_sort(s.order.begin(), s.order.begin() + r.top_k, s.order.end(), [scores](int64_t a, int64_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  float total = 0.0f;
  for (int c = 0; c < r.top_k; ++c) {
    chosen[c] = s.order[c];
    total += weights[c] = probs[s.order[c]];
  }
  if (!r.renormalize) return;
  const float divisor = std::max(total, r.norm_min);
  for (int c = 0; c < r.top_k; ++c) weights[c] /= divisor;
}

// Every token's routing: rows over threads when the step is large enough to pay for them.
void route(const float* h, int64_t tokens, const Router& r, int64_t* chosen, float* weights, int threads) {
  const int team = static_cast<int>(std::clamp<int64_t>(tokens * r.experts * r.hidden / kMinMacsPerThread, 1,
                                                        threads));
#pragma omp parallel num_threads(team)
  {
    Scratch scratch(r.experts);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t)
      route_token(h + t * r.hidden, r, scratch, chosen + t * r.top_k, weights + t * r.top_k);
  }
}

// The (token, choice) pairs grouped by expert, tokens ascending within one (a stable counting sort).
struct Groups {
  std::vector<int64_t> starts;   // [experts + 1]: expert e's pairs are [starts[e], starts[e + 1])
  std::vector<int64_t> tokens;   // each pair's token
  std::vector<float> weights;    // each pair's routing weight
};

Groups group_by_expert(const int64_t* chosen, const float* weights, int64_t pairs, int top_k, int64_t experts) {
  Groups g{std::vector<int64_t>(experts + 1, 0), std::vector<int64_t>(pairs), std::vector<float>(pairs)};
  for (int64_t p = 0; p < pairs; ++p) ++g.starts[chosen[p] + 1];
  std::partial_sum(g.starts.begin(), g.starts.end(), g.starts.begin());
  std::vector<int64_t> next(g.starts.begin(), g.starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t at = next[chosen[p]]++;
    g.tokens[at] = p / top_k;
    g.weights[at] = weights[p];
  }
  return g;
}

// The experts' weights and how to apply them (see the header).
struct Experts {
  const std::vector<paddle::Tensor>& tensors;
  const std::vector<int>& kinds;
  const std::vector<int>& widths;
  const std::vector<int>& round_inputs;
  int threads;
  const std::string& mkl_path;

  // x @ W of linear i, by the kernel its kind names.
  paddle::Tensor linear(size_t i, const paddle::Tensor& x) const {
    const paddle::Tensor* t = &tensors[i * kTensorsPerLinear];
    const bool rounded = round_inputs[i] != 0;
    switch (kinds[i]) {
      case kFloat32:
        return PackedLinear(x, t[0], widths[i])[0];
      case kBf16:
        return Bf16Linear(x, t[0], widths[i], threads, mkl_path, rounded)[0];
      case kInt8:
        return Int8Linear(x, t[0], t[1], t[2], widths[i], threads)[0];
      default:   // blocks of kinds[i] bits
        return QuantLinear(x, t[0], t[1], t[2], kinds[i], threads, mkl_path, rounded)[0];
    }
  }

  // down(swiglu(gate_up(x))) of expert e.
  paddle::Tensor mlp(int64_t e, const paddle::Tensor& x) const {
    const size_t gate_up = e * kLinearsPerExpert, down = gate_up + 1;
    if (kinds[gate_up] == kBf16 && kinds[down] == kBf16 && round_inputs[gate_up] && round_inputs[down])
      return Bf16Mlp(x, tensors[gate_up * kTensorsPerLinear], tensors[down * kTensorsPerLinear], widths[gate_up] / 2,
                     widths[down], threads, mkl_path)[0];
    return linear(down, Swiglu(linear(gate_up, x), threads)[0]);
  }
};

// Rows tokens[0 .. count) of h, as a [count, hidden] tensor.
paddle::Tensor gather_rows(const paddle::Tensor& h, const int64_t* tokens, int64_t count) {
  const int64_t hidden = h.shape()[1];
  auto rows = paddle::empty({count, hidden}, h.dtype(), h.place());
  for (int64_t r = 0; r < count; ++r)
    std::memcpy(rows.data<float>() + r * hidden, h.data<float>() + tokens[r] * hidden, hidden * sizeof(float));
  return rows;
}

// out[tokens[r]] += weights[r] * y[r] for each of y's rows, the product rounded before the sum (in
// a pass of its own: a fused multiply-add would round once).
void add_scaled(float* out, paddle::Tensor& y, const int64_t* tokens, const float* weights) {
  const int64_t count = y.shape()[0], hidden = y.shape()[1];
  float* values = y.data<float>();
  for (int64_t r = 0; r < count; ++r) {
    float* row = values + r * hidden;
    const float w = weights[r];
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) row[i] *= w;
    float* o = out + tokens[r] * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) o[i] += row[i];
  }
}

Router router_of(const paddle::Tensor& h, const paddle::Tensor& router, const paddle::Tensor& correction, int top_k,
                 bool renormalize, float norm_min) {
  PD_CHECK(h.dtype() == paddle::DataType::FLOAT32 && h.shape().size() == 2 &&
               router.dtype() == paddle::DataType::FLOAT32 && router.shape().size() == 2 &&
               router.shape()[1] == h.shape()[1] && correction.dtype() == paddle::DataType::FLOAT32 &&
               correction.numel() == router.shape()[0],
           "fd_moe: float32 h [T, hidden], router [experts, hidden] and correction [experts]");
  const int64_t experts = router.shape()[0];
  PD_CHECK(top_k > 0 && top_k <= experts, "fd_moe: top_k=", top_k, " must be in 1..", experts);
  return {router.data<float>(), correction.data<float>(), experts, h.shape()[1], top_k, renormalize, norm_min};
}

}  // namespace

std::vector<paddle::Tensor> MoeRoute(const paddle::Tensor& h, const paddle::Tensor& router,
                                     const paddle::Tensor& correction, int top_k, bool renormalize, float norm_min,
                                     int num_threads) {
  const Router r = router_of(h, router, correction, top_k, renormalize, norm_min);
  const int64_t tokens = h.shape()[0];
  auto chosen = paddle::empty({tokens, top_k}, paddle::DataType::INT64, h.place());
  auto weights = paddle::empty({tokens, top_k}, paddle::DataType::FLOAT32, h.place());
  route(h.data<float>(), tokens, r, chosen.data<int64_t>(), weights.data<float>(), std::max(1, num_threads));
  return {chosen, weights};
}

std::vector<paddle::Tensor> MoeExperts(const paddle::Tensor& h, const paddle::Tensor& router,
                                       const paddle::Tensor& correction, const std::vector<paddle::Tensor>& experts,
                                       int top_k, bool renormalize, float norm_min, const std::vector<int>& kinds,
                                       const std::vector<int>& widths, const std::vector<int>& round_inputs,
                                       int num_threads, const std::string& mkl_path) {
  const size_t linears = static_cast<size_t>(router.shape()[0]) * kLinearsPerExpert;
  PD_CHECK(experts.size() == linears * kTensorsPerLinear && kinds.size() == linears && widths.size() == linears &&
               round_inputs.size() == linears,
           "fd_moe_experts: per expert two linears (gate_up, down) of three tensors each; got ", experts.size(),
           " tensors and ", kinds.size(), " kinds for ", router.shape()[0], " experts");
  const auto routed = MoeRoute(h, router, correction, top_k, renormalize, norm_min, num_threads);
  const int64_t tokens = h.shape()[0], hidden = h.shape()[1], count = router.shape()[0];
  const Groups groups = group_by_expert(routed[0].data<int64_t>(), routed[1].data<float>(), tokens * top_k, top_k,
                                        count);
  const Experts layer{experts, kinds, widths, round_inputs, std::max(1, num_threads), mkl_path};
  auto out = paddle::empty({tokens, hidden}, h.dtype(), h.place());
  std::fill(out.data<float>(), out.data<float>() + tokens * hidden, 0.0f);
  for (int64_t e = 0; e < count; ++e) {
    const int64_t begin = groups.starts[e], rows = groups.starts[e + 1] - begin;
    if (rows == 0) continue;
    auto y = layer.mlp(e, gather_rows(h, &groups.tokens[begin], rows));
    add_scaled(out.data<float>(), y, &groups.tokens[begin], &groups.weights[begin]);
  }
  return {out};
}

std::vector<std::vector<int64_t>> MoeRouteShape(const std::vector<int64_t>& h, const std::vector<int64_t>&,
                                                const std::vector<int64_t>&, int top_k) {
  return {{h[0], top_k}, {h[0], top_k}};
}
std::vector<paddle::DataType> MoeRouteDtype(const paddle::DataType&, const paddle::DataType&,
                                            const paddle::DataType&) {
  return {paddle::DataType::INT64, paddle::DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> MoeExpertsShape(const std::vector<int64_t>& h, const std::vector<int64_t>&,
                                                  const std::vector<int64_t>&,
                                                  const std::vector<std::vector<int64_t>>&) {
  return {h};
}
std::vector<paddle::DataType> MoeExpertsDtype(const paddle::DataType& h, const paddle::DataType&,
                                              const paddle::DataType&, const std::vector<paddle::DataType>&) {
  return {h};
}

PD_BUILD_OP(fd_moe_route)
    .Inputs({"H", "Router", "Correction"})
    .Outputs({"Chosen", "Weights"})
    .Attrs({"top_k: int", "renormalize: bool", "norm_min: float", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(MoeRoute))
    .SetInferShapeFn(PD_INFER_SHAPE(MoeRouteShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MoeRouteDtype));

PD_BUILD_OP(fd_moe_experts)
    .Inputs({"H", "Router", "Correction", paddle::Vec("Experts")})
    .Outputs({"Out"})
    .Attrs({"top_k: int", "renormalize: bool", "norm_min: float", "kinds: std::vector<int>",
            "widths: std::vector<int>", "round_inputs: std::vector<int>", "num_threads: int",
            "mkl_path: std::string"})
    .SetKernelFn(PD_KERNEL(MoeExperts))
    .SetInferShapeFn(PD_INFER_SHAPE(MoeExpertsShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MoeExpertsDtype));
