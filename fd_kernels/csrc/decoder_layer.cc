// A run of consecutive Llama decoder layers in one op, chaining the other kernels in C++; per layer:
//
//   h, res = rms_norm(x + residual); qkv = h @ Wqkv; [q, k heads: rms_norm each]; q = rope + KV write(qkv);
//   a = paged_attention(q); x = a @ Wo; h, res = rms_norm(x + res);
//   x = swiglu(h @ Wgate_up) @ Wdown, or x = moe_experts(h)       -> the run's last (x, res)
//
// The same kernels, called in the same order with the same arguments as the model's per-op
// path, so the results are identical; what it saves is Python and Paddle's dispatch: ~20-50 us
// per op on a small CPU, and ~50-80 us per call of an op with two dozen operands (a decode step of
// one row on an AMD EPYC spent 14% of its time in Paddle's custom-op call path with one call per
// layer). One call runs every layer of a model whose layers all qualify.
//
// Linear weights are block-quantized (see quant_linear.cc) or bfloat16 panels (bf16_linear.cc), three
// tensors a linear: codes, scales and mins (panels: the panels thrice). `weights` holds, per layer in
// order: qkv, o, then either gate_up and down (a dense MLP) or, where `top_k[l] > 0` (a MoE MLP),
// the router [E, hidden], the score correction [E] and the E experts' linears (expert 0's gate_up,
// its down, expert 1's gate_up, ...: fd_moe_experts' operands, see moe_experts.cc, whose
// `renormalize[l]`, `norm_min[l]` and per expert linear `expert_kinds`, `expert_widths` and
// `expert_round_inputs`, the MoE layers' entries one after the other, it is called with).
// `bits[4 l + i]` is linear i's code width in layer l (16: the panels; unused for a MoE layer's
// gate_up and down), `widths[4 l + i]` its output width, and `round_inputs[4 l + i]` whether its
// input is rounded to the weights' kind: to bfloat16 for panels (on AMX tiles where built in; with
// rounded gate/up and down panels the MLP is one fd_bf16_mlp pass, see bf16_mlp.cc), to int8 blocks
// for block-quantized weights (quant_linear.cc's integer dot products). `norms` holds each layer's
// input and post-attention RMSNorm weights, then, where `qk_norms[l]` (Qwen3), its query and key
// heads' RMSNorm weights [head_dim] (the query's pre-scaled), applied after the qkv projection as
// LlamaForCausalLM._qk_norm applies them: the fd_rms_norm kernel on one row per head.
// `round_queries`: attention's queries, with a bfloat16 cache, see paged_attention.cc. The Python
// side runs steps of fewer than the binding's max_tokens here (see
// fd_kernels.native.FusedDecoderLayer for why): MKL is never called inside this op (an expert's
// products would reach it from 128 rows only, more than such a step has).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "paddle/extension.h"

namespace {

constexpr size_t kLinears = 4, kTensorsPerLinear = 3;

// What every layer of a run shares: the step's positions and attention metadata, the shapes.
struct Step {
  const paddle::Tensor &positions, &cos, &sin, &slots, &row_tables, &row_starts, &row_lens;
  int num_heads, head_dim;
  float eps;
  bool round_queries;
  int num_threads;
};

// The op's per-layer attributes, and where layer l's tensors start in `norms` and `weights` and its
// experts' entries in the expert_* attributes (see the header for the order).
struct Layers {
  const std::vector<paddle::Tensor>& norms;
  const std::vector<paddle::Tensor>& weights;
  const std::vector<int>& bits;
  const std::vector<int>& widths;
  const std::vector<int>& round_inputs;
  const std::vector<int>& qk_norms;
  const std::vector<int>& top_k;
  const std::vector<int>& renormalize;
  const std::vector<float>& norm_min;
  const std::vector<int>& expert_kinds;
  const std::vector<int>& expert_widths;
  const std::vector<int>& expert_round_inputs;
  std::vector<size_t> norm_at, weight_at, expert_at;   // per layer, and one past the last layer
};

// RMSNorm of each of `heads` heads from head `first` of qkv [T, heads in all, head_dim], in place:
// the heads are copied out into [T * heads, head_dim] rows, normed by the same RmsNorm call as the
// op-by-op path's (LlamaForCausalLM._qk_norm: one row per head, the same rows), and copied back.
void HeadNorm(paddle::Tensor& qkv, int64_t first, int64_t heads, const paddle::Tensor& weight, float eps,
              int threads) {
  const int64_t tokens = qkv.shape()[0], all = qkv.shape()[1], dim = qkv.shape()[2], width = heads * dim;
  auto rows = paddle::empty({tokens * heads, dim}, qkv.dtype(), qkv.place());
  float* q = qkv.data<float>();
  float* r = rows.data<float>();
  for (int64_t t = 0; t < tokens; ++t) std::copy_n(q + (t * all + first) * dim, width, r + t * width);
  const auto normed = RmsNorm(rows, rows, weight, eps, /*has_residual=*/false, threads)[0];
  const float* n = normed.data<float>();
  for (int64_t t = 0; t < tokens; ++t) std::copy_n(n + t * width, width, q + (t * all + first) * dim);
}

// Layer `l` of the run on (x, residual): its (out, residual stream).
std::vector<paddle::Tensor> Layer(const Step& step, const Layers& run, size_t l, const paddle::Tensor& x,
                                  const paddle::Tensor& residual, bool has_residual, paddle::Tensor& k_cache,
                                  paddle::Tensor& v_cache) {
  const int threads = step.num_threads;
  const size_t first = l * kLinears, weights = run.weight_at[l], norms = run.norm_at[l];
  const auto linear = [&](size_t i, const paddle::Tensor& in) {   // in @ W^T of the layer's linear i
    const size_t at = weights + i * kTensorsPerLinear, which = first + i;
    const bool rounded = run.round_inputs[which] != 0;
    if (run.bits[which] == 16)
      return Bf16Linear(in, run.weights[at], run.widths[which], threads, /*mkl_path=*/"", rounded)[0];
    return QuantLinear(in, run.weights[at], run.weights[at + 1], run.weights[at + 2], run.bits[which], threads,
                       /*mkl_path=*/"", rounded)[0];
  };
  const int64_t tokens = x.shape()[0];

  auto normed = RmsNorm(x, residual, run.norms[norms], step.eps, has_residual, threads);
  auto qkv = linear(0, normed[0]);
  const int64_t all_heads = run.widths[first] / step.head_dim, kv_heads = (all_heads - step.num_heads) / 2;
  paddle::experimental::reshape_(qkv, {tokens, all_heads, step.head_dim});
  if (run.qk_norms[l]) {
    HeadNorm(qkv, 0, step.num_heads, run.norms[norms + 2], step.eps, threads);
    HeadNorm(qkv, step.num_heads, kv_heads, run.norms[norms + 3], step.eps, threads);
  }
  auto q = RopeWriteKv(qkv, step.positions, step.cos, step.sin, k_cache, v_cache, step.slots, step.num_heads,
                       threads)[0];
  auto attended = PagedAttention(q, k_cache, v_cache, step.row_tables, step.row_starts, step.row_lens, 1.0f,
                                 step.round_queries, threads, /*window=*/0)[0];
  paddle::experimental::reshape_(attended, {tokens, static_cast<int64_t>(step.num_heads) * step.head_dim});
  auto post = RmsNorm(linear(1, attended), normed[1], run.norms[norms + 1], step.eps, true, threads);
  if (run.top_k[l] > 0) {   // the experts: router, correction, then expert 0's gate_up, its down, ...
    const size_t at = weights + 2 * kTensorsPerLinear, begin = run.expert_at[l], end = run.expert_at[l + 1];
    const std::vector<paddle::Tensor> experts(run.weights.begin() + at + 2, run.weights.begin() + run.weight_at[l + 1]);
    const std::vector<int> kinds(run.expert_kinds.begin() + begin, run.expert_kinds.begin() + end),
        widths(run.expert_widths.begin() + begin, run.expert_widths.begin() + end),
        rounds(run.expert_round_inputs.begin() + begin, run.expert_round_inputs.begin() + end);
    auto out = MoeExperts(post[0], run.weights[at], run.weights[at + 1], experts, run.top_k[l],
                          run.renormalize[l] != 0, run.norm_min[l], kinds, widths, rounds, threads,
                          /*mkl_path=*/"")[0];
    return {out, post[1]};
  }
  const bool rounded_mlp = run.bits[first + 2] == 16 && run.bits[first + 3] == 16 && run.round_inputs[first + 2] &&
                           run.round_inputs[first + 3];
  const size_t gate_up = weights + 2 * kTensorsPerLinear, down = gate_up + kTensorsPerLinear;
  auto out = rounded_mlp ? Bf16Mlp(post[0], run.weights[gate_up], run.weights[down], run.widths[first + 2] / 2,
                                   run.widths[first + 3], threads, /*mkl_path=*/"")[0]
                         : linear(3, Swiglu(linear(2, post[0]), threads)[0]);
  return {out, post[1]};
}

}  // namespace

std::vector<paddle::Tensor> DecoderLayers(const paddle::Tensor& x, const paddle::Tensor& residual,
                                          const paddle::Tensor& positions, const paddle::Tensor& cos,
                                          const paddle::Tensor& sin, const paddle::Tensor& slots,
                                          const paddle::Tensor& row_tables, const paddle::Tensor& row_starts,
                                          const paddle::Tensor& row_lens, std::vector<paddle::Tensor>& k_caches,
                                          std::vector<paddle::Tensor>& v_caches,
                                          const std::vector<paddle::Tensor>& norms,
                                          const std::vector<paddle::Tensor>& weights, const std::vector<int>& bits,
                                          const std::vector<int>& widths, int num_heads, int head_dim, float eps,
                                          bool has_residual, const std::vector<int>& round_inputs,
                                          bool round_queries, int num_threads, const std::vector<int>& qk_norms,
                                          const std::vector<int>& top_k, const std::vector<int>& renormalize,
                                          const std::vector<float>& norm_min, const std::vector<int>& expert_kinds,
                                          const std::vector<int>& expert_widths,
                                          const std::vector<int>& expert_round_inputs) {
  const size_t layers = k_caches.size();
  PD_CHECK(layers > 0 && v_caches.size() == layers && bits.size() == layers * kLinears &&
               widths.size() == layers * kLinears && round_inputs.size() == layers * kLinears &&
               qk_norms.size() == layers && top_k.size() == layers && renormalize.size() == layers &&
               norm_min.size() == layers && expert_widths.size() == expert_kinds.size() &&
               expert_round_inputs.size() == expert_kinds.size(),
           "fd_decoder_layers: per layer a K and a V cache, four linears' codes (qkv, o, gate_up, down) and its "
           "qk_norms, top_k, renormalize and norm_min; got ", k_caches.size(), " K caches, ", v_caches.size(),
           " V caches, ", bits.size(), " codes, ", top_k.size(), " top_k");
  Layers run{norms, weights, bits, widths, round_inputs, qk_norms, top_k, renormalize, norm_min, expert_kinds,
             expert_widths, expert_round_inputs, {0}, {0}, {0}};
  for (size_t l = 0; l < layers; ++l) {   // where each layer's tensors start (see the header's order)
    const size_t at = run.weight_at.back();
    size_t experts = 0;
    if (top_k[l] > 0) {
      PD_CHECK(at + 2 * kTensorsPerLinear < weights.size(), "fd_decoder_layers: layer ", l, " has no router");
      experts = static_cast<size_t>(weights[at + 2 * kTensorsPerLinear].shape()[0]);
    }
    run.norm_at.push_back(run.norm_at.back() + (qk_norms[l] ? 4 : 2));
    run.weight_at.push_back(at + (top_k[l] > 0 ? 2 * kTensorsPerLinear + 2 + 2 * experts * kTensorsPerLinear
                                               : kLinears * kTensorsPerLinear));
    run.expert_at.push_back(run.expert_at.back() + 2 * experts);
  }
  PD_CHECK(norms.size() == run.norm_at.back() && weights.size() == run.weight_at.back() &&
               expert_kinds.size() == run.expert_at.back(),
           "fd_decoder_layers: the layers' flags call for ", run.norm_at.back(), " norms, ", run.weight_at.back(),
           " weight tensors and ", run.expert_at.back(), " expert linears; got ", norms.size(), ", ",
           weights.size(), " and ", expert_kinds.size());
  const Step step{positions, cos, sin, slots, row_tables, row_starts, row_lens, num_heads, head_dim, eps,
                  round_queries, std::max(1, num_threads)};
  auto carried = Layer(step, run, 0, x, residual, has_residual, k_caches[0], v_caches[0]);
  for (size_t l = 1; l < layers; ++l)
    carried = Layer(step, run, l, carried[0], carried[1], true, k_caches[l], v_caches[l]);
  return carried;   // (out, residual stream); the caches are written in place
}

std::vector<std::vector<int64_t>> DecoderLayersShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<std::vector<int64_t>>& k_caches, const std::vector<std::vector<int64_t>>& v_caches,
    const std::vector<std::vector<int64_t>>&, const std::vector<std::vector<int64_t>>&) {
  std::vector<std::vector<int64_t>> shapes{x, x};
  shapes.insert(shapes.end(), k_caches.begin(), k_caches.end());
  shapes.insert(shapes.end(), v_caches.begin(), v_caches.end());
  return shapes;
}

std::vector<paddle::DataType> DecoderLayersDtype(
    const paddle::DataType& x, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const std::vector<paddle::DataType>& k_caches,
    const std::vector<paddle::DataType>& v_caches, const std::vector<paddle::DataType>&,
    const std::vector<paddle::DataType>&) {
  std::vector<paddle::DataType> dtypes{x, x};
  dtypes.insert(dtypes.end(), k_caches.begin(), k_caches.end());
  dtypes.insert(dtypes.end(), v_caches.begin(), v_caches.end());
  return dtypes;
}

PD_BUILD_OP(fd_decoder_layers)
    .Inputs({"X", "Residual", "Positions", "Cos", "Sin", "Slots", "RowTables", "RowStarts", "RowLens",
             paddle::Vec("KCaches"), paddle::Vec("VCaches"), paddle::Vec("Norms"), paddle::Vec("Weights")})
    .Outputs({"Out", "ResidualOut", paddle::Vec("KCachesOut"), paddle::Vec("VCachesOut")})
    .Attrs({"bits: std::vector<int>", "widths: std::vector<int>", "num_heads: int", "head_dim: int", "eps: float",
            "has_residual: bool", "round_inputs: std::vector<int>", "round_queries: bool", "num_threads: int",
            "qk_norms: std::vector<int>", "top_k: std::vector<int>", "renormalize: std::vector<int>",
            "norm_min: std::vector<float>", "expert_kinds: std::vector<int>", "expert_widths: std::vector<int>",
            "expert_round_inputs: std::vector<int>"})
    .SetInplaceMap({{paddle::Vec("KCaches"), paddle::Vec("KCachesOut")},
                    {paddle::Vec("VCaches"), paddle::Vec("VCachesOut")}})
    .SetKernelFn(PD_KERNEL(DecoderLayers))
    .SetInferShapeFn(PD_INFER_SHAPE(DecoderLayersShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecoderLayersDtype));
