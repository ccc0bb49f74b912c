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
// Weights (qkv, o, gate_up, down, in that order) come as one list: per linear, `kinds[i]` 0 takes
// one tensor (an MKL-packed float32 weight, `widths[i]` output features), 4 or 8 takes three
// (codes, scales, mins of a block-quantized weight, see quant_linear.cc). The Python side binds
// block-quantized layers only and runs steps of fewer than 128 tokens here (see
// fd_kernels.native.FusedDecoderLayer for why): MKL is never called inside this op.

#include <vector>

#include "ops.h"
#include "paddle/extension.h"

namespace {

struct Linears {
  const std::vector<paddle::Tensor>& weights;
  const std::vector<int>& kinds;
  const std::vector<int>& widths;
  int threads;
  std::vector<size_t> first;   // index of each linear's first tensor in `weights`

  paddle::Tensor apply(int i, const paddle::Tensor& x) const {
    const auto& w = weights;
    const size_t at = first[i];
    if (kinds[i] == 0) return PackedLinear(x, w[at], widths[i])[0];
    return QuantLinear(x, w[at], w[at + 1], w[at + 2], kinds[i], threads, /*mkl_path=*/"")[0];
  }
};

}  // namespace

std::vector<paddle::Tensor> DecoderLayer(const paddle::Tensor& x, const paddle::Tensor& residual,
                                         const paddle::Tensor& input_norm, const paddle::Tensor& post_norm,
                                         const paddle::Tensor& positions, const paddle::Tensor& cos,
                                         const paddle::Tensor& sin, paddle::Tensor& k_cache, paddle::Tensor& v_cache,
                                         const paddle::Tensor& slots, const paddle::Tensor& row_tables,
                                         const paddle::Tensor& row_starts, const paddle::Tensor& row_lens,
                                         const std::vector<paddle::Tensor>& weights, const std::vector<int>& kinds,
                                         const std::vector<int>& widths, int num_heads, int head_dim, float eps,
                                         bool has_residual, int num_threads) {
  PD_CHECK(kinds.size() == 4 && widths.size() == 4, "fd_decoder_layer: four linears (qkv, o, gate_up, down)");
  Linears linears{weights, kinds, widths, num_threads, {}};
  size_t at = 0;
  for (int kind : kinds) {
    PD_CHECK(kind == 0 || kind == 4 || kind == 8, "fd_decoder_layer: weight kind ", kind, " is not 0, 4 or 8");
    linears.first.push_back(at);
    at += kind == 0 ? 1 : 3;
  }
  PD_CHECK(at == weights.size(), "fd_decoder_layer: ", weights.size(), " weight tensors, the kinds need ", at);
  const int64_t tokens = x.shape()[0];

  auto normed = RmsNorm(x, residual, input_norm, eps, has_residual, num_threads);
  auto qkv = linears.apply(0, normed[0]);
  paddle::experimental::reshape_(qkv, {tokens, widths[0] / head_dim, head_dim});
  auto q = RopeWriteKv(qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads)[0];
  auto attended = PagedAttention(q, k_cache, v_cache, row_tables, row_starts, row_lens, 1.0f, num_threads)[0];
  paddle::experimental::reshape_(attended, {tokens, static_cast<int64_t>(num_heads) * head_dim});
  auto post = RmsNorm(linears.apply(1, attended), normed[1], post_norm, eps, true, num_threads);
  auto out = linears.apply(3, Swiglu(linears.apply(2, post[0]), num_threads)[0]);
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
    .Attrs({"kinds: std::vector<int>", "widths: std::vector<int>", "num_heads: int", "head_dim: int", "eps: float",
            "has_residual: bool", "num_threads: int"})
    .SetInplaceMap({{"KCache", "KCacheOut"}, {"VCache", "VCacheOut"}})
    .SetKernelFn(PD_KERNEL(DecoderLayer))
    .SetInferShapeFn(PD_INFER_SHAPE(DecoderLayerShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecoderLayerDtype));
