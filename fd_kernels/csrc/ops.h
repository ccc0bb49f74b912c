// The kernels' entry points (each also registered as its own Paddle op), for ops that chain them
// in C++ without a trip through Python and Paddle's dispatch per call.

#pragma once

#include <string>
#include <vector>

#include "paddle/extension.h"

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                    const paddle::Tensor& weight, float eps, bool has_residual, int num_threads);
std::vector<paddle::Tensor> RopeWriteKv(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                        const paddle::Tensor& cos, const paddle::Tensor& sin,
                                        paddle::Tensor& k_cache, paddle::Tensor& v_cache,
                                        const paddle::Tensor& slots, int num_heads, int num_threads);
std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& starts, const paddle::Tensor& query_lens, float scale,
                                           bool round_queries, int num_threads, int window);
std::vector<paddle::Tensor> Swiglu(const paddle::Tensor& x, int num_threads);
std::vector<paddle::Tensor> PackedLinear(const paddle::Tensor& x, const paddle::Tensor& packed, int n);
std::vector<paddle::Tensor> Int8Linear(const paddle::Tensor& x, const paddle::Tensor& packed,
                                       const paddle::Tensor& scales, const paddle::Tensor& code_sums, int n,
                                       int num_threads);
std::vector<paddle::Tensor> QuantLinear(const paddle::Tensor& x, const paddle::Tensor& codes,
                                        const paddle::Tensor& scales, const paddle::Tensor& mins, int bits,
                                        int num_threads, const std::string& mkl_path, bool int8_inputs);
std::vector<paddle::Tensor> Bf16Linear(const paddle::Tensor& x, const paddle::Tensor& packed, int n, int num_threads,
                                       const std::string& mkl_path, bool round_inputs);
std::vector<paddle::Tensor> Bf16Mlp(const paddle::Tensor& h, const paddle::Tensor& gate_up, const paddle::Tensor& down,
                                    int m, int n, int num_threads, const std::string& mkl_path);
std::vector<paddle::Tensor> MoeExperts(const paddle::Tensor& h, const paddle::Tensor& router,
                                       const paddle::Tensor& correction, const std::vector<paddle::Tensor>& experts,
                                       int top_k, bool renormalize, float norm_min, const std::vector<int>& kinds,
                                       const std::vector<int>& widths, const std::vector<int>& round_inputs,
                                       int num_threads, const std::string& mkl_path);
