// A run of consecutive Llama decoder layers in one op, chaining the other kernels in C++; per layer:
//
//   h, res = rms_norm(x + residual); qkv = h @ Wqkv; q = rope + KV write(qkv);
//   a = paged_attention(q); x = a @ Wo; h, res = rms_norm(x + res);
//   x = swiglu(h @ Wgate_up) @ Wdown                         -> the run's last (x, res)
//
// The same kernels, called in the same order with the same arguments as the model's per-op
// path, so the results are identical; what it saves is Python and Paddle's dispatch: ~20-50 us
// per op on a small CPU, and ~50-80 us per call of an op with two dozen operands (a decode step of
// one row on an AMD EPYC spent 14% of its time in Paddle's custom-op call path with one call per
// layer). One call runs every layer of a model whose layers all qualify.
//
// Weights of each layer (qkv, o, gate_up, down, in that order) are block-quantized (see
// quant_linear.cc) or bfloat16 panels (bf16_linear.cc) and come as twelve tensors a layer: codes,
// scales and mins of each linear; `bits[4 l + i]` is linear i's code width in layer l (16: the
// panels, then two unused tensors), and `round_inputs[4 l + i]` whether its input is rounded to
// the weights' kind: to bfloat16 for panels (on AMX tiles where built in; with rounded gate/up and
// down panels the MLP is one fd_bf16_mlp pass, see bf16_mlp.cc), to int8 blocks for
// block-quantized weights (quant_linear.cc's integer dot products). `norms` holds each layer's
// input and post-attention RMSNorm weights. `round_queries`: attention's queries, with a bfloat16
// cache, see paged_attention.cc. The Python side runs steps of fewer than the binding's max_tokens
// here (see fd_kernels.native.FusedDecoderLayer for why): MKL is never called inside this op.

#include <algorithm>
#include <vector>

#include "ops.h"
#include "paddle/extension.h"

namespace {

constexpr size_t kLinears = 4, kTensorsPerLinear = 3, kTensorsPerLayer = kLinears * kTensorsPerLinear;

// What every layer of a run shares: the step's positions and attention metadata, the shapes.
struct Step {
  const paddle::Tensor &positions, &cos, &sin, &slots, &row_tables, &row_starts, &row_lens;
  int num_heads, head_dim;
  float eps;
  bool round_queries;
  int num_threads;
};

// Layer `l` of the run on (x, residual): its (out, residual stream).
std::vector<paddle::Tensor> Layer(const Step& step, size_t l, const paddle::Tensor& x, const paddle::Tensor& residual,
                                  bool has_residual, paddle::Tensor& k_cache, paddle::Tensor& v_cache,
                                  const std::vector<paddle::Tensor>& norms, const std::vector<paddle::Tensor>& weights,
                                  const std::vector<int>& bits, const std::vector<int>& widths,
                                  const std::vector<int>& round_inputs) {
  const int threads = step.num_threads;
  const auto linear = [&](size_t i, const paddle::Tensor& in) {   // in @ W^T of the layer's linear i
    const size_t at = l * kTensorsPerLayer + i * kTensorsPerLinear, which = l * kLinears + i;
    const bool rounded = round_inputs[which] != 0;
    if (bits[which] == 16) return Bf16Linear(in, weights[at], widths[which], threads, /*mkl_path=*/"", rounded)[0];
    return QuantLinear(in, weights[at], weights[at + 1], weights[at + 2], bits[which], threads, /*mkl_path=*/"",
                       rounded)[0];
  };
  const size_t first = l * kLinears;
  const int64_t tokens = x.shape()[0];

  auto normed = RmsNorm(x, residual, norms[2 * l], step.eps, has_residual, threads);
  auto qkv = linear(0, normed[0]);
  paddle::experimental::reshape_(qkv, {tokens, widths[first] / step.head_dim, step.head_dim});
  auto q = RopeWriteKv(qkv, step.positions, step.cos, step.sin, k_cache, v_cache, step.slots, step.num_heads,
                       threads)[0];
  auto attended = PagedAttention(q, k_cache, v_cache, step.row_tables, step.row_starts, step.row_lens, 1.0f,
                                 step.round_queries, threads, /*window=*/0)[0];
  paddle::experimental::reshape_(attended, {tokens, static_cast<int64_t>(step.num_heads) * step.head_dim});
  auto post = RmsNorm(linear(1, attended), normed[1], norms[2 * l + 1], step.eps, true, threads);
  const bool rounded_mlp =
      bits[first + 2] == 16 && bits[first + 3] == 16 && round_inputs[first + 2] && round_inputs[first + 3];
  const size_t gate_up = l * kTensorsPerLayer + 2 * kTensorsPerLinear, down = gate_up + kTensorsPerLinear;
  auto out = rounded_mlp ? Bf16Mlp(post[0], weights[gate_up], weights[down], widths[first + 2] / 2,
                                   widths[first + 3], threads, /*mkl_path=*/"")[0]
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
                                          bool round_queries, int num_threads) {
  const size_t layers = k_caches.size();
  PD_CHECK(layers > 0 && v_caches.size() == layers && norms.size() == 2 * layers &&
               weights.size() == layers * kTensorsPerLayer && bits.size() == layers * kLinears &&
               widths.size() == layers * kLinears && round_inputs.size() == layers * kLinears,
           "fd_decoder_layers: per layer a K and a V cache, two norms and four linears (qkv, o, gate_up, "
           "down) of three tensors each; got ", k_caches.size(), " K caches, ", v_caches.size(), " V caches, ",
           norms.size(), " norms, ", weights.size(), " weight tensors");
  const Step step{positions, cos, sin, slots, row_tables, row_starts, row_lens, num_heads, head_dim, eps,
                  round_queries, std::max(1, num_threads)};
  auto carried = Layer(step, 0, x, residual, has_residual, k_caches[0], v_caches[0], norms, weights, bits, widths,
                       round_inputs);
  for (size_t l = 1; l < layers; ++l)
    carried = Layer(step, l, carried[0], carried[1], true, k_caches[l], v_caches[l], norms, weights, bits, widths,
                    round_inputs);
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
            "has_residual: bool", "round_inputs: std::vector<int>", "round_queries: bool", "num_threads: int"})
    .SetInplaceMap({{paddle::Vec("KCaches"), paddle::Vec("KCachesOut")},
                    {paddle::Vec("VCaches"), paddle::Vec("VCachesOut")}})
    .SetKernelFn(PD_KERNEL(DecoderLayers))
    .SetInferShapeFn(PD_INFER_SHAPE(DecoderLayersShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecoderLayersDtype));
