// One Llama decoder layer in one op, chaining the other kernels in C++:
//
//   h, res = rms_norm(x + residual); qkv = h @ Wqkv; q = rope + KV write(qkv);
//   a = paged_attention(q); x = a @ Wo; h, res = rms_norm(x + res);
//   out = swiglu(h @ Wgate_up) @ Wdown                       -> (out, res)
//
// The same kernels, called in the same order with the same arguments as the model's per-op
// path, so the results are identical; what it saves is Python and Paddle's dispatch, ~20-50 us
// per op on a small CPU, which at a decode step of one row is a third of the step.
//
// Weights (qkv, o, gate_up, down, in that order) are block-quantized (see quant_linear.cc) or
// bfloat16 panels (bf16_linear.cc) and come as one list of twelve tensors: codes, scales and mins
// of each linear, `bits[i]` its code width (16: the panels, then two unused tensors), and
// `round_inputs[i]` whether its input is rounded to the weights' kind: to bfloat16 for panels (on
// AMX tiles where built in; with rounded gate/up and down panels the MLP is one fd_bf16_mlp
// pass, see bf16_mlp.cc), to int8 blocks for block-quantized weights (quant_linear.cc's integer
// dot products). `round_queries`: attention's queries, with a bfloat16 cache, see
// paged_attention.cc. The Python side runs steps of
// fewer than the binding's max_tokens here (see fd_kernels.native.FusedDecoderLayer for why): MKL
// is never called inside this op.

#include <vector>

#include "ops.h"
#include "paddle/extension.h"

namespace {

constexpr size_t kLinears = 4, kTensorsPerLinear = 3;

}  // namespace

std::vector<paddle::Tensor> DecoderLayer(const paddle::Tensor& x, const paddle::Tensor& residual,
                                         const paddle::Tensor& input_norm, const paddle::Tensor& post_norm,
                                         const paddle::Tensor& positions, const paddle::Tensor& cos,
                                         const paddle::Tensor& sin, paddle::Tensor& k_cache, paddle::Tensor& v_cache,
                                         const paddle::Tensor& slots, const paddle::Tensor& row_tables,
                                         const paddle::Tensor& row_starts, const paddle::Tensor& row_lens,
                                         const std::vector<paddle::Tensor>& weights, const std::vector<int>& bits,
                                         const std::vector<int>& widths, int num_heads, int head_dim, float eps,
                                         bool has_residual, const std::vector<int>& round_inputs,
                                         bool round_queries, int num_threads) {
  PD_CHECK(bits.size() == kLinears && widths.size() == kLinears && round_inputs.size() == kLinears &&
               weights.size() == kLinears * kTensorsPerLinear,
           "fd_decoder_layer: four linears (qkv, o, gate_up, down), three tensors each");
  const auto linear = [&](size_t i, const paddle::Tensor& in) {   // in @ W^T of linear i
    const size_t at = i * kTensorsPerLinear;
    const bool rounded = round_inputs[i] != 0;
    if (bits[i] == 16) return Bf16Linear(in, weights[at], widths[i], num_threads, /*mkl_path=*/"", rounded)[0];
    return QuantLinear(in, weights[at], weights[at + 1], weights[at + 2], bits[i], num_threads, /*mkl_path=*/"",
                       rounded)[0];
  };
  const int64_t tokens = x.shape()[0];

  auto normed = RmsNorm(x, residual, input_norm, eps, has_residual, num_threads);
  auto qkv = linear(0, normed[0]);
  paddle::experimental::reshape_(qkv, {tokens, widths[0] / head_dim, head_dim});
  auto q = RopeWriteKv(qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads, num_threads)[0];
  auto attended = PagedAttention(q, k_cache, v_cache, row_tables, row_starts, row_lens, 1.0f, round_queries,
                                 num_threads)[0];
  paddle::experimental::reshape_(attended, {tokens, static_cast<int64_t>(num_heads) * head_dim});
  auto post = RmsNorm(linear(1, attended), normed[1], post_norm, eps, true, num_threads);
  const bool rounded_mlp = bits[2] == 16 && bits[3] == 16 && round_inputs[2] && round_inputs[3];   // fd_bf16_mlp
  auto out = rounded_mlp ? Bf16Mlp(post[0], weights[2 * kTensorsPerLinear], weights[3 * kTensorsPerLinear],
                                   widths[2] / 2, widths[3], num_threads, /*mkl_path=*/"")[0]
                         : linear(3, Swiglu(linear(2, post[0]), num_threads)[0]);
  return {out, post[1]};   // the caches are written in place
}

std::vector<std::vector<int64_t>> DecoderLayerShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>& k_cache, const std::vector<int64_t>& v_cache,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<std::vector<int64_t>>&) {
  return {x, x, k_cache, v_cache};
}

std::vector<paddle::DataType> DecoderLayerDtype(
    const paddle::DataType& x, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType& k_cache,
    const paddle::DataType& v_cache, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const std::vector<paddle::DataType>&) {
  return {x, x, k_cache, v_cache};
}

PD_BUILD_OP(fd_decoder_layer)
    .Inputs({"X", "Residual", "InputNorm", "PostNorm", "Positions", "Cos", "Sin", "KCache", "VCache", "Slots",
             "RowTables", "RowStarts", "RowLens", paddle::Vec("Weights")})
    .Outputs({"Out", "ResidualOut", "KCacheOut", "VCacheOut"})
    .Attrs({"bits: std::vector<int>", "widths: std::vector<int>", "num_heads: int", "head_dim: int", "eps: float",
            "has_residual: bool", "round_inputs: std::vector<int>", "round_queries: bool", "num_threads: int"})
    .SetInplaceMap({{"KCache", "KCacheOut"}, {"VCache", "VCacheOut"}})
    .SetKernelFn(PD_KERNEL(DecoderLayer))
    .SetInferShapeFn(PD_INFER_SHAPE(DecoderLayerShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecoderLayerDtype));
