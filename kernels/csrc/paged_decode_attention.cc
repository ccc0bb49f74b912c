// Decode attention reading K/V blocks in place (no gather copy): one query token per row.
//
// q            float32 [B, H, D]            (contiguous)
// k/v cache    float32 [N, Hkv, bs, D]      (the layout of fd_kernels/paged_attention.py)
// block_tables int64   [B, W]               row b's blocks, in order
// context_lens int64   [B]                  keys row b attends to (its new token included)
// out          float32 [B, H, D]
//
// Per (row, kv head): the scores of the GQA group's query heads against every key, an exact
// two-pass softmax (max, then exp and sum), then the weighted sum of the values. Loops over
// head_dim are written for the compiler's vectoriser (-fopenmp-simd; the ISA flags come from
// the capabilities the platform declared). Rows x kv heads are split over threads when the
// batch is large enough to pay for them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "paddle/extension.h"

namespace {

// exp(x) for x <= 0 (softmax after subtracting the max), vectorisable: x = n ln2 + r with
// |r| <= ln2/2, exp(r) by a degree-6 polynomial (relative error < 2e-7), 2^n by building the
// float's exponent bits. Below -87 the result flushes to 0 like expf's.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Shapes {
  int64_t rows, heads, kv_heads, head_dim, block_size, width;
};

void attend_one(const float* q, const float* k_cache, const float* v_cache, const int64_t* table, int64_t context,
                int64_t kv_head, const Shapes& s, float scale, float* out, std::vector<float>& scores) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t d = s.head_dim;
  scores.resize(static_cast<size_t>(group * context));
  for (int64_t j = 0; j < context; ++j) {
    const int64_t block = table[j / s.block_size];
    const float* key = k_cache + ((block * s.kv_heads + kv_head) * s.block_size + j % s.block_size) * d;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += qg[i] * key[i];
      scores[g * context + j] = acc * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * context;
    const float top = *std::max_element(sg, sg + context);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < context; ++j) {
      sg[j] = exp_nonpositive(sg[j] - top);
      total += sg[j];
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < context; ++j) sg[j] *= inv;
    float* og = out + g * d;
    std::fill(og, og + d, 0.f);
  }
  for (int64_t j = 0; j < context; ++j) {
    const int64_t block = table[j / s.block_size];
    const float* value = v_cache + ((block * s.kv_heads + kv_head) * s.block_size + j % s.block_size) * d;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * context + j];
      float* og = out + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) og[i] += p * value[i];
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> PagedDecodeAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                                 const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                                 const paddle::Tensor& context_lens, float scale, int num_threads) {
  PD_CHECK(q.dtype() == paddle::DataType::FLOAT32 && k_cache.dtype() == paddle::DataType::FLOAT32,
           "fd_paged_decode_attention: float32 only");
  PD_CHECK(block_tables.dtype() == paddle::DataType::INT64 && context_lens.dtype() == paddle::DataType::INT64,
           "fd_paged_decode_attention: int64 block tables and context lengths");
  const auto qs = q.shape();
  const auto cs = k_cache.shape();
  const Shapes s{qs[0], qs[1], cs[1], qs[2], cs[2], block_tables.shape()[1]};
  PD_CHECK(cs[3] == s.head_dim && s.heads % s.kv_heads == 0, "fd_paged_decode_attention: shape mismatch");
  auto out = paddle::empty(qs, q.dtype(), q.place());
  const float* qp = q.data<float>();
  const float* kp = k_cache.data<float>();
  const float* vp = v_cache.data<float>();
  const int64_t* tables = block_tables.data<int64_t>();
  const int64_t* lens = context_lens.data<int64_t>();
  float* op = out.data<float>();
  const int64_t group = s.heads / s.kv_heads;
  const int64_t tasks = s.rows * s.kv_heads;

  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = t / s.kv_heads, kv_head = t % s.kv_heads;
      const int64_t offset = (row * s.heads + kv_head * group) * s.head_dim;
      attend_one(qp + offset, kp, vp, tables + row * s.width, lens[row], kv_head, s, scale, op + offset, scores);
    }
  };
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, tasks / 8));
  if (threads == 1) {
    run(0, tasks);
  } else {
    std::vector<std::thread> pool;
    const int64_t per = (tasks + threads - 1) / threads;
    for (int64_t i = 1; i < threads; ++i) pool.emplace_back(run, i * per, std::min(tasks, (i + 1) * per));
    run(0, std::min(tasks, per));
    for (auto& thread : pool) thread.join();
  }
  return {out};
}

std::vector<std::vector<int64_t>> PagedDecodeAttentionShape(const std::vector<int64_t>& q,
                                                            const std::vector<int64_t>&,
                                                            const std::vector<int64_t>&,
                                                            const std::vector<int64_t>&,
                                                            const std::vector<int64_t>&) {
  return {q};
}

std::vector<paddle::DataType> PagedDecodeAttentionDtype(const paddle::DataType& q, const paddle::DataType&,
                                                        const paddle::DataType&, const paddle::DataType&,
                                                        const paddle::DataType&) {
  return {q};
}

PD_BUILD_OP(fd_paged_decode_attention)
    .Inputs({"Q", "KCache", "VCache", "BlockTables", "ContextLens"})
    .Outputs({"Out"})
    .Attrs({"scale: float", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(PagedDecodeAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedDecodeAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedDecodeAttentionDtype));
